"""Fault injection against a real S3 API (moto), through a proxy that fails chosen requests."""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Iterator

import pytest
from s3_server import (  # noqa: F401 (fixtures)
    FaultProxy,
    fault_proxy,
    make_bucket,
    moto_endpoint,
    s3_bucket,
    s3_client,
    s3_options,
)

from tessera.errors import StorageError
from tessera.storage import FsspecStorage, RetryOptions

pytestmark = pytest.mark.s3

MiB = 1 << 20
PART = 5 * MiB
FAST_RETRY = RetryOptions(max_attempts=5, initial_backoff_s=0.01, max_backoff_s=0.05)


def _store(bucket: str, endpoint: str, retry: RetryOptions = FAST_RETRY) -> FsspecStorage:
    return FsspecStorage(
        f"s3://{bucket}/{uuid.uuid4().hex}/ckpt", s3_options(endpoint), part_size=PART, max_concurrency=2, retry=retry
    )


def _data(n: int) -> bytes:
    return bytes(range(251)) * (n // 251) + bytes(n % 251)


def test_throttled_uploads_are_retried(fault_proxy: tuple[FaultProxy, str], s3_bucket: str) -> None:
    proxy, endpoint = fault_proxy
    store = _store(s3_bucket, endpoint)
    slow_parts = proxy.inject("upload_part", "slowdown", 3)
    slow_start = proxy.inject("create_multipart", "slowdown", 1)
    broken_complete = proxy.inject("complete_multipart", "internal", 1)
    data = _data(2 * PART + 1234)
    store.write_file("data/0-0.safetensors", [memoryview(data)[: PART + 1], memoryview(data)[PART + 1 :]])
    assert (slow_parts.hits, slow_start.hits, broken_complete.hits) == (3, 1, 1)
    assert store.read_file("data/0-0.safetensors") == data


def test_lost_answer_to_complete_is_recognised_as_success(
    fault_proxy: tuple[FaultProxy, str],
    s3_bucket: str,
) -> None:
    proxy, endpoint = fault_proxy
    store = _store(s3_bucket, endpoint)
    lost = proxy.inject("complete_multipart", "lose_answer", 1)  # done, but the client never hears
    # AWS may answer the retried Complete with NoSuchUpload: the upload is gone because it
    # completed. The object is there with the right size, so the write succeeded.
    gone = proxy.inject("complete_multipart", "nosuchupload", 1)
    data = _data(PART + 1)
    store.write_file("data/0-0.safetensors", [data])
    assert (lost.hits, gone.hits) == (1, 1)
    assert store.read_file("data/0-0.safetensors") == data


def test_throttled_commit_is_retried(fault_proxy: tuple[FaultProxy, str], s3_bucket: str) -> None:
    proxy, endpoint = fault_proxy
    store = _store(s3_bucket, endpoint)
    fault = proxy.inject("put_object", "slowdown", 2)
    store.write_atomic("manifest.json", b'{"step": 1}')
    assert fault.hits == 2
    assert store.read_file("manifest.json") == b'{"step": 1}'


def test_connection_resets_on_reads_are_retried(
    fault_proxy: tuple[FaultProxy, str],
    s3_bucket: str,
) -> None:
    proxy, endpoint = fault_proxy
    store = _store(s3_bucket, endpoint)
    data = _data(PART + 100)
    store.write_file("data/a.bin", [data])
    resets = proxy.inject("get_range", "reset", 2)
    head_reset = proxy.inject("head", "reset", 1)
    get_reset = proxy.inject("get", "reset", 1)
    out = bytearray(PART)  # two ranged GETs: the second one is short, both may be hit
    store.read_into("data/a.bin", 50, memoryview(out))
    assert bytes(out) == data[50 : 50 + PART]
    assert store.size("data/a.bin") == len(data)
    assert store.read_file("data/a.bin") == data
    assert (resets.hits, head_reset.hits, get_reset.hits) == (2, 1, 1)


def test_listing_and_deleting_are_retried(fault_proxy: tuple[FaultProxy, str], s3_bucket: str) -> None:
    proxy, endpoint = fault_proxy
    store = _store(s3_bucket, endpoint)
    for i in range(3):
        store.write_file(f"data/{i}.bin", [b"x" * i])
    listing = proxy.inject("list", "internal", 2)
    deleting = proxy.inject("delete_objects", "slowdown", 1)
    assert store.list() == ["data/0.bin", "data/1.bin", "data/2.bin"]
    store.delete(["data/0.bin", "data/2.bin"])
    assert store.list() == ["data/1.bin"]
    assert (listing.hits, deleting.hits) == (2, 1)


def test_persistent_throttling_gives_up_after_max_attempts(
    fault_proxy: tuple[FaultProxy, str],
    s3_bucket: str,
) -> None:
    proxy, endpoint = fault_proxy
    retry = RetryOptions(max_attempts=4, initial_backoff_s=0.01, max_backoff_s=0.02)
    store = _store(s3_bucket, endpoint, retry)
    fault = proxy.inject("put_object", "slowdown", 1000)
    t0 = time.monotonic()
    with pytest.raises(StorageError) as info:
        store.write_atomic("manifest.json", b"{}")
    assert fault.hits == 4  # bounded: exactly max_attempts requests, no hidden client retries
    assert time.monotonic() - t0 < 10
    message = str(info.value)
    assert store.url in message and "after 4 attempts" in message and "SlowDown" in message


def test_failed_upload_is_aborted_not_completed(
    fault_proxy: tuple[FaultProxy, str],
    s3_bucket: str,
    moto_endpoint: str,
) -> None:
    proxy, endpoint = fault_proxy
    retry = RetryOptions(max_attempts=2, initial_backoff_s=0.01, max_backoff_s=0.02)
    store = _store(s3_bucket, endpoint, retry)
    proxy.inject("upload_part", "internal", 1000)
    with pytest.raises(StorageError, match="uploading part"):
        store.write_file("data/big.bin", [_data(2 * PART + 1)])
    assert not store.exists("data/big.bin")
    prefix = store.url[len(f"s3://{s3_bucket}/") :]
    uploads = s3_client(moto_endpoint).list_multipart_uploads(Bucket=s3_bucket, Prefix=prefix)
    assert uploads.get("Uploads", []) == []


def test_error_in_the_chunk_iterator_aborts_the_upload(s3_bucket: str, moto_endpoint: str) -> None:
    store = _store(s3_bucket, moto_endpoint)

    def chunks() -> Iterator[bytes]:
        yield _data(PART + 10)
        raise RuntimeError("staging failed")

    with pytest.raises(RuntimeError, match="staging failed"):  # the caller's error, unchanged
        store.write_file("data/x.bin", chunks())
    assert not store.exists("data/x.bin")
    prefix = store.url[len(f"s3://{s3_bucket}/") :]
    assert s3_client(moto_endpoint).list_multipart_uploads(Bucket=s3_bucket, Prefix=prefix).get("Uploads", []) == []


def test_bucket_deleted_mid_write(moto_endpoint: str) -> None:
    bucket = make_bucket(moto_endpoint)
    store = _store(bucket, moto_endpoint)
    store.write_file("data/old.bin", [b"old"])

    def chunks() -> Iterator[bytes]:
        yield _data(PART)  # the first part is on its way
        client = s3_client(moto_endpoint)
        client.delete_object(Bucket=bucket, Key=f"{store.url[len(f's3://{bucket}/') :]}/data/old.bin")
        client.delete_bucket(Bucket=bucket)
        yield _data(PART)
        yield b"tail"

    t0 = time.monotonic()
    with pytest.raises(StorageError) as info:
        store.write_file("data/0-0.safetensors", chunks())
    message = str(info.value)
    assert "data/0-0.safetensors" in message and bucket in message
    assert "NoSuchBucket" in message or "NoSuchUpload" in message
    assert "does not exist" in message or "vanished" in message
    assert time.monotonic() - t0 < 10  # not retried: a missing bucket is not transient
    with pytest.raises(StorageError, match=f"bucket '{bucket}' does not exist"):
        store.write_atomic("manifest.json", b"{}")


def test_unreachable_endpoint_names_it(s3_bucket: str) -> None:
    with socket.socket() as s:  # a port on 127.0.0.1 that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}"
    retry = RetryOptions(max_attempts=3, initial_backoff_s=0.01, max_backoff_s=0.02)
    store = _store(s3_bucket, endpoint, retry)
    with pytest.raises(StorageError) as info:
        store.read_file("manifest.json")
    message = str(info.value)
    assert endpoint in message and "after 3 attempts" in message and store.url in message
