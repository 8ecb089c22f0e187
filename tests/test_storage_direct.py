"""Durable local writes through ``O_DIRECT`` (``tessera.storage.local._write_direct``).

Every size around the block and buffer edges, chunked oddly, reads back byte for byte; the
flag is really used where the filesystem takes it, and not for non-durable writes; a
filesystem that refuses direct writes (tmpfs, or ``EINVAL`` at the first write) gets the
same bytes buffered; the knob turns it off.
"""

from __future__ import annotations

import errno
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tessera.storage import FileStorage, local

SIZES = [0, 1, 4095, 4096, 4097, (1 << 20) - 1, 1 << 20, (1 << 20) + 1, (3 << 20) + 12345]


def _chunks(data: bytes, sizes: list[int]) -> list[bytes]:
    out, i, k = [], 0, 0
    while i < len(data):
        n = sizes[k % len(sizes)]
        out.append(data[i : i + n])
        i, k = i + n, k + 1
    return out


def _direct_calls(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Record whether each data-file write got O_DIRECT."""
    seen: list[bool] = []
    real = local._set_direct

    def spy(fd: int, on: bool) -> bool:
        ok = real(fd, on)
        if on:
            seen.append(ok)
        return ok

    monkeypatch.setattr(local, "_set_direct", spy)
    return seen


@pytest.mark.parametrize("size", SIZES)
def test_durable_writes_go_direct_and_read_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, size: int) -> None:
    probe = os.open(tmp_path / "probe", os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        takes_direct = local._set_direct(probe, True)
    finally:
        os.close(probe)
    monkeypatch.setenv("TESSERA_DIRECT_IO", "1")  # always (auto follows what this process measured)
    seen = _direct_calls(monkeypatch)
    data = os.urandom(size)
    store = FileStorage(str(tmp_path), durable=True)
    store.write_file("data/f.bin", _chunks(data, [7, 4096, 300_000, 1 << 20, 1]))
    assert (tmp_path / "data" / "f.bin").read_bytes() == data
    assert seen == [takes_direct]  # used exactly where this filesystem takes it


def test_non_durable_writes_stay_buffered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _direct_calls(monkeypatch)
    FileStorage(str(tmp_path), durable=False).write_file("f.bin", [b"x" * 10_000])
    assert seen == [] and (tmp_path / "f.bin").read_bytes() == b"x" * 10_000


def test_the_knob_turns_direct_writes_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _direct_calls(monkeypatch)
    monkeypatch.setenv("TESSERA_DIRECT_IO", "0")
    FileStorage(str(tmp_path), durable=True).write_file("f.bin", [b"y" * 10_000])
    assert seen == [] and (tmp_path / "f.bin").read_bytes() == b"y" * 10_000


def test_a_refused_direct_write_falls_back_to_buffered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A filesystem that accepts the flag but fails the first direct write with EINVAL."""
    real_write = os.write
    refused: list[int] = []

    def write(fd: int, data) -> int:  # type: ignore[no-untyped-def]
        if fcntl.fcntl(fd, fcntl.F_GETFL) & getattr(os, "O_DIRECT", 0):
            refused.append(len(data))
            raise OSError(errno.EINVAL, "Invalid argument (injected)")
        return real_write(fd, data)

    from tessera.storage import direct_choice, recache

    monkeypatch.setattr(os, "write", write)
    monkeypatch.setenv("TESSERA_DIRECT_IO", "auto")
    monkeypatch.setenv("TESSERA_RECACHE", "1")
    choice = direct_choice.DirectChoice()
    monkeypatch.setattr(local, "DIRECT_CHOICE", choice)
    monkeypatch.setattr(choice, "use_direct", lambda device: True)
    recorded: list[bool] = []
    monkeypatch.setattr(choice, "record", lambda device, direct, nbytes, seconds: recorded.append(direct))
    offered: list[list[str]] = []
    monkeypatch.setattr(recache, "offer", lambda root, paths, supersedes=True: offered.append(list(paths)))
    data = os.urandom((2 << 20) + 777)
    store = FileStorage(str(tmp_path), durable=True)
    store.write_file("f.bin", _chunks(data, [100_000]))
    assert (tmp_path / "f.bin").read_bytes() == data
    probe = os.open(tmp_path / "f.bin", os.O_RDONLY)
    try:
        takes_direct = local._set_direct(probe, True)
    finally:
        os.close(probe)
    assert len(refused) == (1 if takes_direct else 0)  # one refusal, then buffered
    # the file went through the page cache: timed as a buffered write, never re-cached
    assert recorded == [False]
    store.recache(["f.bin"])
    assert offered == []


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm (tmpfs)")
def test_tmpfs_writes_are_correct_whether_or_not_it_takes_direct_io(monkeypatch: pytest.MonkeyPatch) -> None:
    import tempfile

    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        data = os.urandom((1 << 20) + 4097)
        FileStorage(d, durable=True).write_file("f.bin", _chunks(data, [4096, 99]))
        assert Path(d, "f.bin").read_bytes() == data


def test_auto_measures_both_modes_then_keeps_the_faster_and_looks_again() -> None:
    from tessera.storage.direct_choice import EXPLORE_EVERY, MARGIN, MIN_SAMPLE_BYTES, DirectChoice

    c, dev, mb = DirectChoice(), 7, 64 << 20
    assert c.use_direct(dev)  # nothing measured: direct
    c.record(dev, True, MIN_SAMPLE_BYTES - 1, 1.0)  # too small to say anything
    assert c.use_direct(dev)
    c.record(dev, True, mb, 0.16)  # 400 MiB/s direct
    assert not c.use_direct(dev)  # buffered is measured next
    c.record(dev, False, mb, 0.16 / (MARGIN * 0.9))  # faster, but not by the margin
    assert c.use_direct(dev)
    for _ in range(10):
        c.record(dev, False, mb, 0.16 / 1.7)  # buffered 1.7x direct: a device that caps O_DIRECT
    assert not c.use_direct(dev) and c.rates(dev)["buffered"] > MARGIN * c.rates(dev)["direct"]
    for _ in range(EXPLORE_EVERY - 13):
        c.record(dev, False, mb, 0.16 / 1.7)
    assert not c.use_direct(dev)
    c.record(dev, False, mb, 0.16 / 1.7)
    assert c.use_direct(dev)  # after EXPLORE_EVERY measured writes, one file tries the other mode ...
    assert not c.use_direct(dev)  # ... one only
    assert c.use_direct(dev + 1)  # devices are measured apart


def test_auto_writes_buffered_where_buffered_measured_faster_and_reads_none_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tessera.storage import direct_choice, recache

    monkeypatch.setenv("TESSERA_DIRECT_IO", "auto")
    monkeypatch.setenv("TESSERA_RECACHE", "1")
    choice = direct_choice.DirectChoice()
    monkeypatch.setattr(local, "DIRECT_CHOICE", choice)
    dev = os.stat(tmp_path).st_dev
    choice.record(dev, True, 64 << 20, 0.16)
    choice.record(dev, False, 64 << 20, 0.05)

    seen = _direct_calls(monkeypatch)
    offered: list[list[str]] = []
    monkeypatch.setattr(recache, "offer", lambda root, paths, supersedes=True: offered.append(list(paths)))
    store = FileStorage(str(tmp_path), durable=True)
    data = os.urandom(MIB := 1 << 20)
    store.write_file("data/a.bin", [data])
    assert seen == [] and (tmp_path / "data" / "a.bin").read_bytes() == data  # buffered
    monkeypatch.setenv("TESSERA_DIRECT_IO", "1")
    store.write_file("data/b.bin", [data[:MIB]])
    store.recache(["data/a.bin", "data/b.bin"])
    assert offered == [[str(tmp_path / "data" / "b.bin")]]  # a buffered file is in the page cache already
    store.write_file("data/c.bin", [data])
    store.recache(["data/c.bin"])
    assert offered[-1] == [str(tmp_path / "data" / "c.bin")]


def test_auto_times_the_device_not_the_waits_for_the_next_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file whose producer is slow (a staging copy, a coder) is timed without those waits:
    otherwise whichever mode it used would look slower than the device is."""
    import time

    from tessera.storage import direct_choice

    monkeypatch.setenv("TESSERA_DIRECT_IO", "auto")
    choice = direct_choice.DirectChoice()
    monkeypatch.setattr(local, "DIRECT_CHOICE", choice)
    recorded: list[float] = []
    monkeypatch.setattr(choice, "record", lambda device, direct, nbytes, seconds: recorded.append(seconds))
    data = os.urandom(direct_choice.MIN_SAMPLE_BYTES)

    def slow() -> Iterator[bytes]:
        for i in range(0, len(data), 1 << 20):
            time.sleep(0.05)
            yield data[i : i + (1 << 20)]

    t0 = time.monotonic()
    FileStorage(str(tmp_path), durable=True).write_file("f.bin", slow())
    elapsed = time.monotonic() - t0
    assert (tmp_path / "f.bin").read_bytes() == data
    (seconds,) = recorded
    assert 0 < seconds <= elapsed - 0.35  # eight waits of 0.05 s are not the device's
