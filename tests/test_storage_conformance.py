"""One conformance suite for every storage backend (see tessera/storage/base.py for the contract)."""

from __future__ import annotations

import itertools
import os
import random
import threading
import tracemalloc
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from s3_server import moto_endpoint, s3_bucket, s3_client, s3_options  # noqa: F401 (fixtures)

from tessera.errors import ManifestError, StorageError, UnsupportedPathError
from tessera.storage import FileStorage, FsspecStorage, Storage, storage_for

MiB = 1 << 20
S3_PART = 5 * MiB  # the smallest part S3 (and moto) accept
SMALL_PART = 64 << 10

BACKENDS = [
    "file",
    "file-nondurable",
    "fsspec-memory",
    "fsspec-file",
    pytest.param("s3", marks=pytest.mark.s3),
]


def _part_size(kind: str) -> int:
    return S3_PART if kind == "s3" else SMALL_PART


def make_backend(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> Storage:
    if kind == "file":
        return FileStorage(str(tmp_path / "ckpt"))
    if kind == "file-nondurable":
        return FileStorage(str(tmp_path / "ckpt"), durable=False)
    if kind == "fsspec-memory":
        store = FsspecStorage(f"memory://tessera-test-{uuid.uuid4().hex}/ckpt", part_size=SMALL_PART, max_concurrency=2)
        request.addfinalizer(
            lambda: (
                store.fs.rm(store.fs._strip_protocol(store.url), recursive=True)
                if store.fs.exists(store.fs._strip_protocol(store.url))
                else None
            )
        )
        return store
    if kind == "fsspec-file":
        return FsspecStorage(f"file://{tmp_path}/ckpt", part_size=SMALL_PART, max_concurrency=2)
    if kind == "s3":
        bucket = request.getfixturevalue("s3_bucket")
        endpoint = request.getfixturevalue("moto_endpoint")
        return FsspecStorage(
            f"s3://{bucket}/{uuid.uuid4().hex}/ckpt", s3_options(endpoint), part_size=S3_PART, max_concurrency=2
        )
    raise AssertionError(kind)


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Storage]:
    yield make_backend(request.param, tmp_path, request)


@pytest.fixture
def kind(request: pytest.FixtureRequest) -> str:
    return request.node.callspec.params["backend"]


def _payload(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


def test_implements_protocol(backend: Storage) -> None:
    assert isinstance(backend, Storage)
    assert isinstance(backend.url, str) and backend.url


def test_write_many_chunks_of_every_buffer_kind(backend: Storage) -> None:
    t = torch.arange(1000, dtype=torch.int64).to(torch.uint8)  # wraps around: not all equal bytes
    f = np.linspace(-1, 1, 333, dtype=np.float32)
    chunks = [
        b"header",
        bytearray(b"\x00\x01\x02"),
        memoryview(t.numpy()),
        memoryview(t.numpy())[10:20],  # a view in the middle of a tensor
        b"",
        memoryview(f),  # format "f": must be taken as its raw bytes
        memoryview(_payload(70_000, 1)),
    ] + [memoryview(bytes([i])) for i in range(200)]
    expected = b"".join(bytes(memoryview(c).cast("B")) for c in chunks)
    backend.write_file("data/0-0.safetensors", chunks)
    assert backend.read_file("data/0-0.safetensors") == expected
    assert backend.size("data/0-0.safetensors") == len(expected)


def test_write_from_a_generator(backend: Storage) -> None:
    def gen() -> Iterator[memoryview]:
        for i in range(50):
            yield memoryview(_payload(1000 + i, i))

    backend.write_file("data/gen.bin", gen())
    assert backend.read_file("data/gen.bin") == b"".join(_payload(1000 + i, i) for i in range(50))


def test_large_file_spanning_several_parts(backend: Storage, kind: str, request: pytest.FixtureRequest) -> None:
    part = _part_size(kind)
    n = 2 * part + part // 2 + 7  # three parts, the last one short
    data = torch.from_numpy(np.frombuffer(_payload(n, 2), dtype=np.uint8).copy())
    view = memoryview(data.numpy())
    # Chunk boundaries that do not line up with the part boundaries.
    cuts = [0, 1, part - 3, part + 5, 2 * part + 11, n]
    backend.write_file("data/big.bin", [view[a:b] for a, b in itertools.pairwise(cuts)])
    assert backend.size("data/big.bin") == n
    out = torch.empty(n, dtype=torch.uint8)
    backend.read_into("data/big.bin", 0, memoryview(out.numpy()))
    assert torch.equal(out, data)
    if kind == "s3":
        # A multipart object's ETag ends in "-<number of parts>".
        bucket, _, prefix = backend.url[len("s3://") :].partition("/")
        head = s3_client(request.getfixturevalue("moto_endpoint")).head_object(
            Bucket=bucket, Key=f"{prefix}/data/big.bin"
        )
        assert head["ETag"].strip('"').endswith("-3"), head["ETag"]


@pytest.mark.s3
def test_s3_upload_memory_is_bounded_by_parts(s3_bucket: str, moto_endpoint: str) -> None:
    store = FsspecStorage(
        f"s3://{s3_bucket}/{uuid.uuid4().hex}", s3_options(moto_endpoint), part_size=S3_PART, max_concurrency=2
    )
    total = 8 * S3_PART
    src = np.frombuffer(_payload(total, 3), dtype=np.uint8)
    module = "*tessera/storage/*"  # allocations made by any storage module
    peaks = []

    def chunks() -> Iterator[memoryview]:
        for i, start in enumerate(range(0, total, MiB)):
            if i % 4 == 0:
                snap = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, module)])
                peaks.append(sum(s.size for s in snap.statistics("filename")))
            yield memoryview(src)[start : start + MiB]

    tracemalloc.start()
    try:
        store.write_file("big.bin", chunks())
    finally:
        tracemalloc.stop()
    # Part buffers only: max_concurrency in flight + one filling, never the whole 40 MiB file.
    assert max(peaks) <= 3 * S3_PART + MiB, peaks
    assert max(peaks) >= S3_PART  # the measurement does see the part buffers
    assert store.read_file("big.bin") == src.tobytes()


def test_read_into_at_various_offsets(backend: Storage, kind: str) -> None:
    part = _part_size(kind)
    n = part + part // 3
    data = _payload(n, 4)
    backend.write_file("data/r.bin", [data])
    cases = [(0, 1), (0, n), (1, 17), (n - 1, 1), (part - 5, 10), (part, n - part), (12345, 4096), (7, 0)]
    for offset, length in cases:
        out = bytearray(length)
        backend.read_into("data/r.bin", offset, memoryview(out))
        assert bytes(out) == data[offset : offset + length], (offset, length)
    # Into a torch tensor's memory, and into a non-byte (float32) view.
    t = torch.zeros(256, dtype=torch.uint8)
    backend.read_into("data/r.bin", 100, memoryview(t.numpy()))
    assert bytes(t.numpy()) == data[100:356]
    f = np.zeros(16, dtype=np.float32)
    backend.read_into("data/r.bin", 8, memoryview(f))
    assert f.tobytes() == data[8:72]


@pytest.mark.parametrize("start_back, length", [(10, 20), (0, 1), (-100, 5)])
def test_read_past_the_end_raises_storage_error(backend: Storage, start_back: int, length: int) -> None:
    backend.write_file("data/short.bin", [b"x" * 1000])
    # start_back: how far before the end the read starts (negative: after the end).
    with pytest.raises(StorageError, match="short.bin"):
        backend.read_into("data/short.bin", 1000 - start_back, memoryview(bytearray(length)))


def test_missing_files(backend: Storage) -> None:
    with pytest.raises(FileNotFoundError):
        backend.read_file("nope/missing.bin")
    with pytest.raises(FileNotFoundError):
        backend.read_into("nope/missing.bin", 0, memoryview(bytearray(4)))
    with pytest.raises(FileNotFoundError):
        backend.size("nope/missing.bin")
    assert not backend.exists("nope/missing.bin")
    assert backend.list("nope") == []


def test_write_atomic_replaces(backend: Storage) -> None:
    backend.write_atomic("manifest.json", b'{"v": 1}')
    assert backend.read_file("manifest.json") == b'{"v": 1}'
    backend.write_atomic("manifest.json", b'{"v": 2, "longer": true}')
    assert backend.read_file("manifest.json") == b'{"v": 2, "longer": true}'
    backend.write_atomic("manifest.json", b"{}")
    assert backend.read_file("manifest.json") == b"{}"
    assert backend.list() == ["manifest.json"]  # no temporary files left behind


def test_write_atomic_readers_never_see_a_mix(backend: Storage) -> None:
    versions = [bytes([65 + i]) * (50_000 + 7_919 * i) for i in range(3)]
    backend.write_atomic("manifest.json", versions[0])
    stop = threading.Event()
    bad: list[int] = []

    def read_loop() -> None:
        while not stop.is_set():
            got = backend.read_file("manifest.json")
            if got not in versions:
                bad.append(len(got))

    readers = [threading.Thread(target=read_loop) for _ in range(3)]
    for r in readers:
        r.start()
    try:
        for i in range(12):
            backend.write_atomic("manifest.json", versions[i % 3])
    finally:
        stop.set()
        for r in readers:
            r.join()
    assert not bad, f"torn reads of lengths {bad[:5]}"


def test_write_file_replaces_an_existing_file(backend: Storage) -> None:
    backend.write_file("data/a.bin", [b"a" * 5000])
    backend.write_file("data/a.bin", [b"b" * 10])
    assert backend.read_file("data/a.bin") == b"b" * 10
    assert backend.size("data/a.bin") == 10


def test_empty_file(backend: Storage) -> None:
    backend.write_file("data/empty.bin", [])
    assert backend.exists("data/empty.bin")
    assert backend.size("data/empty.bin") == 0
    assert backend.read_file("data/empty.bin") == b""


def test_list_exists_size_delete(backend: Storage) -> None:
    files = {
        "manifest.json": b"{}",
        "data/0-0.safetensors": b"0" * 10,
        "data/1-0.safetensors": b"1" * 20,
        "data/sub/deep.bin": b"d" * 30,
        "data2/x.bin": b"x" * 40,
    }
    for path, content in files.items():
        if path == "manifest.json":
            backend.write_atomic(path, content)
        else:
            backend.write_file(path, [content])
    assert backend.list() == sorted(files)
    assert backend.list("data") == ["data/0-0.safetensors", "data/1-0.safetensors", "data/sub/deep.bin"]
    assert backend.list("data/sub") == ["data/sub/deep.bin"]
    assert backend.list("data/1-0.safetensors") == ["data/1-0.safetensors"]
    assert backend.list("dat") == []
    for path, content in files.items():
        assert backend.exists(path)
        assert backend.size(path) == len(content)
    assert backend.exists("data")  # a directory / prefix with files under it
    backend.delete(["data/0-0.safetensors", "data/sub/deep.bin", "data/never-existed.bin"])
    backend.delete([])
    assert not backend.exists("data/0-0.safetensors")
    assert backend.list("data") == ["data/1-0.safetensors"]
    assert backend.list() == ["data/1-0.safetensors", "data2/x.bin", "manifest.json"]
    backend.delete(["data/1-0.safetensors"])
    backend.delete(["data/1-0.safetensors"])  # deleting twice is fine
    assert backend.list("data") == []


@pytest.mark.parametrize("bad", ["../x", "/etc/passwd", "a/../../x", "..", "", "a\\b", "c:/x"])
def test_paths_outside_the_root_are_refused(backend: Storage, bad: str) -> None:
    with pytest.raises(ManifestError):
        backend.write_file(bad, [b"x"])
    with pytest.raises(ManifestError):
        backend.write_atomic(bad, b"x")
    with pytest.raises(ManifestError):
        backend.read_file(bad)
    with pytest.raises(ManifestError):
        backend.read_into(bad, 0, memoryview(bytearray(1)))
    with pytest.raises(ManifestError):
        backend.size(bad)
    with pytest.raises(ManifestError):
        backend.exists(bad)
    with pytest.raises(ManifestError):
        backend.delete([bad])


def test_concurrent_reads_from_threads(backend: Storage, kind: str) -> None:
    n = 3 * _part_size(kind) // 2
    files = {f"data/{i}.bin": _payload(n, 10 + i) for i in range(3)}
    for path, content in files.items():
        backend.write_file(path, [content])
    rng = random.Random(5)
    jobs = []
    for i in range(32):
        path = rng.choice(sorted(files))
        offset = rng.randrange(n)
        # Mostly small reads, some spanning more than one S3 range request.
        length = rng.randrange(1, n - offset + 1) if i % 4 == 0 else rng.randrange(1, 5000)
        jobs.append((path, offset, min(length, n - offset)))

    def read(job: tuple[str, int, int]) -> bool:
        path, offset, length = job
        out = bytearray(length)
        backend.read_into(path, offset, memoryview(out))
        return bytes(out) == files[path][offset : offset + length]

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(read, jobs))


def test_concurrent_writes_from_threads(backend: Storage) -> None:
    def write(i: int) -> None:
        backend.write_file(f"data/{i}-0.safetensors", [_payload(30_000 + i, i), b"end"])

    with ThreadPoolExecutor(6) as pool:
        list(pool.map(write, range(12)))
    assert backend.list("data") == sorted(f"data/{i}-0.safetensors" for i in range(12))
    for i in range(12):
        assert backend.read_file(f"data/{i}-0.safetensors") == _payload(30_000 + i, i) + b"end"


def test_storage_for_picks_the_backend(tmp_path: Path) -> None:
    assert isinstance(storage_for(str(tmp_path)), FileStorage)
    assert isinstance(storage_for(f"file://{tmp_path}"), FileStorage)
    local = storage_for(str(tmp_path), storage_options={"durable": False})
    assert isinstance(local, FileStorage) and not local.durable
    mem = storage_for("memory://tessera-test/x")
    assert isinstance(mem, FsspecStorage) and mem.protocol == "memory"
    given = FileStorage(str(tmp_path))
    assert storage_for("s3://ignored/x", given) is given
    with pytest.raises(TypeError):
        storage_for(str(tmp_path), object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="nosuchproto"):
        storage_for("nosuchproto://x/y")


@pytest.mark.parametrize("given", [False, True])
def test_storage_for_refuses_a_tier_path_and_names_the_manager(tmp_path: Path, given: bool) -> None:
    """``tier::`` is a CheckpointManager root (its local tier), never a storage backend."""
    url = f"tier::{tmp_path}/d"
    with pytest.raises(UnsupportedPathError, match=r"CheckpointManager\('tier::") as e:
        storage_for(url, FileStorage(str(tmp_path / "d")) if given else None)
    assert isinstance(e.value, ValueError) and f"'{tmp_path}/d'" in str(e.value)


@pytest.mark.s3
def test_storage_for_s3_uses_storage_options(s3_bucket: str, moto_endpoint: str) -> None:
    store = storage_for(f"s3://{s3_bucket}/{uuid.uuid4().hex}", storage_options=s3_options(moto_endpoint))
    assert isinstance(store, FsspecStorage)
    store.write_atomic("manifest.json", b"{}")
    assert store.read_file("manifest.json") == b"{}"


def test_fsspec_options_are_validated() -> None:
    with pytest.raises(ValueError, match="minimum part size"):
        FsspecStorage("s3://bucket/x", part_size=MiB)
    with pytest.raises(ValueError, match="max_concurrency"):
        FsspecStorage("memory://x", max_concurrency=0)
    with pytest.raises(ValueError, match="no protocol"):
        FsspecStorage(os.fspath("/plain/path"))


def test_one_temporary_file_name_rule(tmp_path: Path) -> None:
    """Temporary files follow storage.base.temp_name: a commit removes leftovers."""
    from tessera.storage.base import TEMP_RE, is_temp_name, temp_name

    name = temp_name("data/x.safetensors")
    assert name.startswith("data/x.safetensors.tmp-") and TEMP_RE.search(name)
    assert is_temp_name(name) and is_temp_name(name, of="data/x.safetensors")
    assert temp_name("a") != temp_name("a")
    assert not is_temp_name("data/x.safetensors") and not is_temp_name("a.tmp-notes")
    assert not is_temp_name(name, of="data/y.safetensors")

    durable = FileStorage(str(tmp_path / "durable"))
    durable.write_atomic("keep.bin", b"k")
    durable.write_file(temp_name("manifest.json"), [b"{"])  # a publish in progress
    durable.write_file("manifest.json.tmp-0123abcd", [b"{"])  # any <name>.tmp-* is a leftover to remove
    durable.replace_if("manifest.json", b"{}", None)
    assert [p for p in durable.list() if ".tmp" in p] == []
    assert durable.read_file("manifest.json") == b"{}" and durable.read_file("keep.bin") == b"k"


def test_file_storage_raises_storage_errors_not_raw_os_errors(tmp_path) -> None:
    # The Storage protocol promises StorageError (naming the file), or FileNotFoundError /
    # IsADirectoryError for a path that is missing or not a file; an ENAMETOOLONG (or EIO,
    # EACCES) from the OS must not reach the caller as a bare OSError.
    from tessera.errors import StorageError
    from tessera.storage.local import FileStorage

    store = FileStorage(str(tmp_path))
    store.write_atomic("d/x", b"12")
    with pytest.raises(StorageError, match=r"size of .*nnnn.*OSError"):
        store.size("n" * 5000)  # ENAMETOOLONG
    with pytest.raises(StorageError, match="read_file of"):
        store.read_file("m" * 5000)
    with pytest.raises(IsADirectoryError):  # not a file: its own documented kind
        store.read_file("d")
    with pytest.raises(FileNotFoundError):
        store.read_file("missing")
    assert store.read_file("d/x") == b"12" and store.list("d") == ["d/x"]


def test_read_bounded_reads_small_files_in_one_request_and_sizes_long_ones(backend: Storage) -> None:
    from tessera.storage.capabilities import ReadsBounded

    assert isinstance(backend, ReadsBounded)
    data = _payload(1000, 3)
    backend.write_atomic("m.json", data)
    assert backend.read_bounded("m.json", 1000) == data  # exactly at the limit
    assert backend.read_bounded("m.json", 5000) == data
    assert backend.read_bounded("m.json", 999) == 1000  # one byte over: its size, not its bytes
    assert backend.read_bounded("m.json", 10) == 1000
    backend.write_atomic("empty.json", b"")
    assert backend.read_bounded("empty.json", 10) == b""
    with pytest.raises(FileNotFoundError):
        backend.read_bounded("absent.json", 10)


def test_an_oversized_manifest_is_refused_without_being_read(tmp_path: Path) -> None:
    """A sparse 8 GiB ``manifest.json``: refused from its size, none of it read or held."""
    from tessera.engine.loading.manifest import read_bytes

    store = FileStorage(str(tmp_path))
    with open(tmp_path / "manifest.json", "wb") as f:
        f.truncate(8 << 30)
    tracemalloc.start()
    try:
        with pytest.raises(ManifestError, match=r"size 8589934592 bytes is over the \d+-byte limit"):
            read_bytes(store, "ckpt/manifest.json")
        assert tracemalloc.get_traced_memory()[1] < 16 << 20
    finally:
        tracemalloc.stop()
