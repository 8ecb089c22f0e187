"""Durable local writes through ``O_DIRECT`` (``tessera.storage.local._write_direct``), and large
reads of ranges not in the page cache through ``O_DIRECT`` (``_direct_io.DirectReads``).

Every size around the block and buffer edges, chunked oddly, reads back byte for byte; the
flag is really used where the filesystem takes it, and not for non-durable writes; a
filesystem that refuses direct writes (tmpfs, or ``EINVAL`` at the first write) gets the
same bytes buffered; the knob turns it off.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

import pytest
import torch

import tessera
from tessera.errors import StorageError
from tessera.storage import FileStorage, _direct_io, local

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

    monkeypatch.setattr(os, "write", write)
    data = os.urandom((2 << 20) + 777)
    FileStorage(str(tmp_path), durable=True).write_file("f.bin", _chunks(data, [100_000]))
    assert (tmp_path / "f.bin").read_bytes() == data
    probe = os.open(tmp_path / "f.bin", os.O_RDONLY)
    try:
        takes_direct = local._set_direct(probe, True)
    finally:
        os.close(probe)
    assert len(refused) == (1 if takes_direct else 0)  # one refusal, then buffered


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm (tmpfs)")
def test_tmpfs_writes_are_correct_whether_or_not_it_takes_direct_io(monkeypatch: pytest.MonkeyPatch) -> None:
    import tempfile

    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        data = os.urandom((1 << 20) + 4097)
        FileStorage(d, durable=True).write_file("f.bin", _chunks(data, [4096, 99]))
        assert Path(d, "f.bin").read_bytes() == data


# --- Reads: ranges not in the page cache are read with O_DIRECT (map_range) -------------------------


def _evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _direct_reads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, bool]]:
    """Record each direct read: (offset, length, whether it was served)."""
    seen: list[tuple[int, int, bool]] = []
    real = _direct_io.DirectReads.read

    def spy(self: _direct_io.DirectReads, full: str, offset: int, length: int) -> memoryview | None:
        view = real(self, full, offset, length)
        seen.append((offset, length, view is not None))
        return view

    monkeypatch.setattr(_direct_io.DirectReads, "read", spy)
    return seen


def _takes_direct(directory: Path) -> bool:
    probe = os.open(directory / "probe", os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        return local._set_direct(probe, True)
    finally:
        os.close(probe)
        os.unlink(directory / "probe")


RANGES = [(0, 1 << 20), (1, (1 << 20) + 1), (4095, 3 << 20), (12345, (5 << 20) - 12345 - 7), (0, (5 << 20) - 7)]


@pytest.mark.parametrize(("offset", "length"), RANGES)
def test_uncached_ranges_are_read_directly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, offset: int, length: int
) -> None:
    if not _takes_direct(tmp_path):
        pytest.skip("this filesystem refuses O_DIRECT")
    data = os.urandom((5 << 20) - 7)
    store = FileStorage(str(tmp_path), durable=True)
    store.write_file("f.bin", [data])
    _evict(tmp_path / "f.bin")
    seen = _direct_reads(monkeypatch)
    view = store.map_range("f.bin", offset, length)
    assert bytes(view) == data[offset : offset + length]
    assert seen == [(offset, length, True)]
    del view
    store.release_range("f.bin", offset, length)
    # Once the page cache holds the range, the memory map serves it again.
    (tmp_path / "f.bin").read_bytes()
    view = store.map_range("f.bin", offset, length)
    assert bytes(view) == data[offset : offset + length]
    assert len(seen) == 1
    del view
    store.release_range("f.bin", offset, length)
    store.close()


def test_small_ranges_and_the_knob_keep_the_page_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = os.urandom(3 << 20)
    store = FileStorage(str(tmp_path), durable=True)
    store.write_file("f.bin", [data])
    _evict(tmp_path / "f.bin")
    seen = _direct_reads(monkeypatch)
    assert bytes(store.map_range("f.bin", 100, 4096)) == data[100:4196]  # small: not worth a direct read
    monkeypatch.setenv("TESSERA_DIRECT_IO", "0")
    assert bytes(store.map_range("f.bin", 0, 2 << 20)) == data[: 2 << 20]
    assert seen == []
    store.close()


def test_a_direct_read_past_the_end_is_a_truncation_error(tmp_path: Path) -> None:
    if not _takes_direct(tmp_path):
        pytest.skip("this filesystem refuses O_DIRECT")
    store = FileStorage(str(tmp_path), durable=True)
    store.write_file("f.bin", [os.urandom(2 << 20)])
    _evict(tmp_path / "f.bin")
    with pytest.raises(StorageError, match="truncated"):
        store.map_range("f.bin", 1 << 20, (1 << 20) + 1)
    store.close()


def test_a_load_after_a_direct_save_reads_directly_and_is_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first load after a save (nothing of it in the page cache), resharded so that it maps
    ranges: bit-exact, and the ranges came through direct reads."""
    if not _takes_direct(tmp_path):
        pytest.skip("this filesystem refuses O_DIRECT")
    src = {f"t{i}": torch.randn(512, 1024) for i in range(3)}  # 2 MiB each
    tessera.save(str(tmp_path / "ck"), src)
    seen = _direct_reads(monkeypatch)
    halves = [{k: tessera.ShardedTensor(torch.zeros(512, 512), (512, 1024), (0, c)) for k in src} for c in (0, 512)]
    for h in halves:
        tessera.load(str(tmp_path / "ck"), h, strict=False)
    for k, v in src.items():
        assert torch.equal(halves[0][k].local, v[:, :512]) and torch.equal(halves[1][k].local, v[:, 512:])
    assert seen and all(served for _, _, served in seen)
