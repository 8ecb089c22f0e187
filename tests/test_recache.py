"""A committed save's files come back into the page cache (tessera.storage.recache), off the save's path."""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from pathlib import Path

import pytest
import torch

import tessera
from tessera.storage import recache

_libc = ctypes.CDLL(None, use_errno=True)


def resident_fraction(path: Path) -> float:
    """The share of ``path``'s pages in the page cache (``mincore`` of a mapping of it)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    try:
        pages = -(-size // mmap.PAGESIZE)
        vec = (ctypes.c_ubyte * pages)()
        addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
        if _libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore")
        return sum(v & 1 for v in vec) / pages
    finally:
        del addr
        m.close()


def evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # dirty pages are not dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def data_files(root: Path) -> list[Path]:
    return [p for p in (root / "data").rglob("*") if p.is_file()]


@pytest.fixture(autouse=True)
def _direct_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Re-caching is for files written with O_DIRECT; auto may write a test's files buffered."""
    monkeypatch.setenv("TESSERA_DIRECT_IO", "1")


def settle() -> None:
    assert recache.drain(timeout=30)


def state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"w{i}": torch.randn(512, 1024, generator=g) for i in range(4)}  # 8 MiB


def test_a_committed_save_is_read_back_into_the_page_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TESSERA_RECACHE", "0")
    tessera.save(str(tmp_path / "off"), state())
    settle()
    files = data_files(tmp_path / "off")
    assert files
    if min(resident_fraction(f) for f in files) > 0.5:
        pytest.skip("this filesystem keeps direct writes in the page cache (no O_DIRECT): nothing to re-cache")

    monkeypatch.setenv("TESSERA_RECACHE", "1")
    before = recache.stats()["bytes"]
    tessera.save(str(tmp_path / "on"), state())
    settle()
    files = data_files(tmp_path / "on")
    assert all(resident_fraction(f) == 1.0 for f in files)
    assert recache.stats()["bytes"] - before >= sum(f.stat().st_size for f in files)
    out = {k: torch.empty_like(v) for k, v in state().items()}
    tessera.load(str(tmp_path / "on"), out)
    assert all(torch.equal(out[k], v) for k, v in state().items())

    monkeypatch.delenv("TESSERA_RECACHE")  # the default: on, where the filesystem is local
    tessera.save(str(tmp_path / "default"), state())
    settle()
    files = data_files(tmp_path / "default")
    if recache.filesystem_type(str(tmp_path)) in recache.LOCAL_FILESYSTEMS:  # not read over a network
        assert all(resident_fraction(f) == 1.0 for f in files)


def test_a_file_gone_before_it_is_read_back_stops_nothing_else(tmp_path: Path) -> None:
    real = tmp_path / "real.bin"
    real.write_bytes(os.urandom(3 << 20))
    evict(real)
    recache.schedule([str(tmp_path / "gone.bin")])  # deleted by retention meanwhile, say
    settle()
    recache.schedule([str(real)])
    settle()
    assert resident_fraction(real) == 1.0


def uncached(*files: Path) -> None:
    """Write 2 MiB of noise to each of ``files``, none of it left in the page cache, the thread idle."""
    for f in files:
        f.write_bytes(os.urandom(2 << 20))
        evict(f)
    settle()


def hold_the_thread(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Keep the re-caching thread busy with an earlier save's file (scheduled as ``held``) until the
    returned event is set: what is scheduled meanwhile waits in the queue."""
    busy, release = threading.Event(), threading.Event()
    read_through = recache._read_through

    def held(path: str, generation: int) -> None:
        if path == "held":
            busy.set()
            release.wait(10)
            return
        read_through(path, generation)

    monkeypatch.setattr(recache, "_read_through", held)
    recache.schedule(["held"])
    assert busy.wait(10)
    return release


def test_work_queued_before_a_write_is_dropped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    old, new = tmp_path / "old.bin", tmp_path / "new.bin"
    uncached(old, new)
    read_through = recache._read_through
    dropped = recache.stats()["dropped"]
    release = hold_the_thread(monkeypatch)
    recache.schedule([str(old)])  # queued by a save ...
    recache.yield_to_writes()  # ... before the next save wrote (FileStorage.write_file, every write stage)
    recache.schedule([str(new)])  # queued after it: read
    release.set()
    settle()
    assert recache.stats()["dropped"] == dropped + 1
    assert resident_fraction(old) < 0.5
    assert resident_fraction(new) == 1.0
    read_through(str(old), recache._generation - 1)  # a read under way stops at its next step
    assert resident_fraction(old) < 0.5


def test_a_save_gives_way_to_later_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TESSERA_RECACHE", "0")
    generation = recache._generation
    tessera.save(str(tmp_path / "s"), state())
    assert recache._generation > generation


def test_when_it_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gib = 1 << 30
    monkeypatch.setattr(recache, "filesystem_type", lambda root: "ext4")
    monkeypatch.setattr(recache, "available_bytes", lambda: 16 * gib)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("TESSERA_RECACHE", raising=False)
    assert recache.wanted(str(tmp_path), 8 * gib)  # on by default ("auto"): half of what is available
    assert not recache.wanted(str(tmp_path), 8 * gib + 1)
    monkeypatch.setenv("TESSERA_RECACHE", "auto")
    assert recache.wanted(str(tmp_path), 8 * gib)
    assert not recache.wanted(str(tmp_path), 8 * gib + 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # the node's eight ranks each re-cache theirs
    assert recache.wanted(str(tmp_path), 1 * gib)
    assert not recache.wanted(str(tmp_path), 1 * gib + 1)
    monkeypatch.setattr(recache, "filesystem_type", lambda root: "nfs4")  # the bytes would cross the network
    assert not recache.wanted(str(tmp_path), 1)
    monkeypatch.setenv("TESSERA_RECACHE", "1")
    assert recache.wanted(str(tmp_path), 100 * gib)
    monkeypatch.setenv("TESSERA_RECACHE", "0")
    monkeypatch.setattr(recache, "filesystem_type", lambda root: "ext4")
    assert not recache.wanted(str(tmp_path), 1)
    assert not recache.wanted(str(tmp_path), 0)
    monkeypatch.setenv("TESSERA_RECACHE", "sometimes")
    with pytest.raises(ValueError, match="TESSERA_RECACHE"):
        recache.wanted(str(tmp_path), 1)


def test_filesystem_type_reads_the_mount_table() -> None:
    assert recache.filesystem_type("/proc/self") == "proc"
    assert recache.filesystem_type("/") is not None


def test_a_newer_save_takes_the_older_ones_place_in_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cache holds one save's files per directory: not every save's until the kernel reclaims."""
    monkeypatch.setenv("TESSERA_RECACHE", "1")
    tessera.save(str(tmp_path / "step1"), state())
    settle()
    first = data_files(tmp_path / "step1")
    if min(resident_fraction(f) for f in first) < 1.0:
        pytest.skip("this filesystem's files were not re-cached")
    tessera.save(str(tmp_path / "step2"), state())
    settle()
    assert all(resident_fraction(f) == 1.0 for f in data_files(tmp_path / "step2"))
    assert all(resident_fraction(f) < 0.5 for f in first)


def test_files_a_newer_checkpoint_still_reads_stay_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TESSERA_RECACHE", "1")
    old, new = tmp_path / "old.bin", tmp_path / "new.bin"
    for f in (old, new):
        f.write_bytes(os.urandom(2 << 20))
        evict(f)
    root = str(tmp_path / "step")  # a checkpoint in tmp_path; old.bin and new.bin stand for its files
    recache.offer(root, [str(old)])
    settle()
    recache.offer(root, [str(new)], supersedes=False)  # a dedup step: it reads old.bin's tiles too
    settle()
    assert resident_fraction(old) == 1.0 and resident_fraction(new) == 1.0
    evicted = recache.stats()["evicted"]
    recache.offer(root, [str(old)])  # a plain save: what was offered before makes way
    settle()
    assert recache.stats()["evicted"] == evicted  # new.bin was offered without superseding: kept
    recache.offer(root, [str(new)])
    settle()
    assert resident_fraction(old) < 0.5 and resident_fraction(new) == 1.0


def test_a_load_of_the_checkpoint_being_read_back_takes_its_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "ckpt"
    (root / "data").mkdir(parents=True)
    files = [root / "data" / f"{i}.bin" for i in range(2)]
    uncached(*files)
    read_through = recache._read_through
    yielded = recache.stats()["yielded"]
    release = hold_the_thread(monkeypatch)
    recache.schedule([str(f) for f in files])  # the save's files, queued behind a busy thread ...
    recache.yield_to_reads(str(root))  # ... when a load of that checkpoint starts reading it
    release.set()
    settle()
    assert recache.stats()["yielded"] == yielded + 2
    assert all(resident_fraction(f) < 0.5 for f in files)
    read_through(str(files[0]), recache._generation)  # a read under way stops at its next step
    assert resident_fraction(files[0]) < 0.5
    recache.offer(str(root), [str(f) for f in files], supersedes=False)  # a new save there: wanted again
    settle()
    assert all(resident_fraction(f) == 1.0 for f in files)


def test_loading_a_local_checkpoint_makes_its_reading_back_give_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TESSERA_RECACHE", "0")
    path = tmp_path / "s"
    tessera.save(str(path), state())
    assert not recache._being_loaded(str(data_files(path)[0]))
    tessera.load(str(path), {k: torch.zeros_like(v) for k, v in state().items()})
    assert recache._being_loaded(str(data_files(path)[0]))
    assert not recache._being_loaded(str(tmp_path / "other" / "data" / "x"))


def test_a_save_at_the_edge_of_the_memory_rule_is_recached_in_part(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where a rank's files do not all fit in its part of half of MemAvailable, the first ones
    that fit are re-cached (a first load finds them), not none."""
    mib = 1 << 20
    files = []
    for i, n in enumerate([3, 3, 3]):
        f = tmp_path / f"f{i}.bin"
        f.write_bytes(b"x" * (n * mib))
        files.append(str(f))
    monkeypatch.setattr(recache, "filesystem_type", lambda root: "ext4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.delenv("TESSERA_RECACHE", raising=False)
    scheduled: list[tuple[str, ...]] = []
    monkeypatch.setattr(recache, "schedule", lambda paths, drop=(): scheduled.append(tuple(paths)))
    monkeypatch.setattr(recache, "available_bytes", lambda: 28 * mib)  # half: 14 MiB, 7 per rank
    recache.offer(str(tmp_path), files, supersedes=False)
    assert scheduled[-1] == tuple(files[:2])
    monkeypatch.setattr(recache, "available_bytes", lambda: 40 * mib)  # 10 MiB per rank: all three
    recache.offer(str(tmp_path), files, supersedes=False)
    assert scheduled[-1] == tuple(files)
    monkeypatch.setattr(recache, "available_bytes", lambda: 8 * mib)  # 2 MiB per rank: none fits
    recache.offer(str(tmp_path), files, supersedes=False)
    assert scheduled[-1] == ()
