"""The save path's building blocks on their own: the collective step helper (real gloo
ranks), the single-process commit entry point that converters use, and the declared
optional capabilities of the shipped backends."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tessera
from tessera.engine import commit, dist
from tessera.engine.saving.write import FileWrite, WriteRequest, write_tiles
from tessera.errors import CommitCheckError, DistributedError, StateMismatchError, StorageError
from tessera.format.chunking import Chunking
from tessera.format.dtypes import as_bytes, dtype_name
from tessera.format.geometry import Box
from tessera.format.manifest import FileEntry, Manifest, TensorEntry, Tile
from tessera.format.tilefile import layout_file
from tessera.manager.local_tier.tier import NodeStorage
from tessera.storage import FileStorage, FsspecStorage
from tessera.storage import capabilities as cap
from tests.dist_utils import run_distributed

_REPO = Path(__file__).resolve().parent.parent

# --------------------------------------------------------------------------------------
# dist.collective_step


def _step_worker(rank: int, world_size: int) -> dict[str, object]:
    world = dist.world_for()
    out: dict[str, object] = {}
    out["exchanged"] = dist.collective_step(world, "exchanging", lambda: rank * 10)
    out["summed"] = dist.collective_step(world, "summing", lambda: rank + 1, lambda g: sum(g.all()))
    out["scattered"] = dist.collective_step(
        world, "scattering", lambda: rank, lambda g: [f"to {r}" for r in g.all()], per_rank=True
    )

    def fails_on_1() -> int:
        if rank == 1:
            raise StateMismatchError("rank 1: tensor 'w' does not match")
        return rank

    seen: list[object] = []

    def coordinate(g: dist.Gathered[int]) -> int | None:
        seen.append((g.ok, sorted(g.failures), g.payloads))
        return None

    try:
        dist.collective_step(world, "validating", fails_on_1, coordinate)
    except StateMismatchError as e:
        out["local_failure"] = (type(e).__name__, sorted(e.failures), "tensor 'w' does not match" in str(e))
    out["coordinator_saw"] = seen

    def coordinator_fails(g: dist.Gathered[int]) -> int:
        raise StorageError("rank 0: the manifest could not be published")

    try:
        dist.collective_step(world, "committing", lambda: rank, coordinator_fails)
    except StorageError as e:
        out["coordinator_failure"] = (type(e).__name__, sorted(e.failures), "could not be published" in str(e))

    def mixed() -> int:
        if rank == 0:
            raise StorageError("rank 0: disk full")
        raise StateMismatchError("rank 1: wrong shape")

    try:
        dist.collective_step(world, "mixing", mixed)
    except DistributedError as e:
        out["mixed"] = (type(e).__name__, sorted(e.failures))
    except Exception as e:  # the rank's own error when it is the only one: not the case here
        out["mixed"] = (type(e).__name__, None)
    # The group is still usable: every rank left each failed step together.
    out["after"] = dist.collective_step(world, "after", lambda: rank)
    return out


def test_collective_step_raises_every_failure_on_every_rank() -> None:
    results = run_distributed(_step_worker, 2)
    for rank, out in enumerate(results):
        assert out["exchanged"] == [0, 10]
        assert out["summed"] == 3
        assert out["scattered"] == f"to {rank}"
        assert out["local_failure"] == ("StateMismatchError", [1], True)
        assert out["coordinator_failure"] == ("StorageError", [0], True)
        assert out["mixed"] == ("DistributedError", [0, 1])
        assert out["after"] == [0, 1]
    # The coordinator ran on rank 0 only, also when a rank failed (so that it can clean up).
    assert results[0]["coordinator_saw"] == [(False, [1], [0, None])]
    assert results[1]["coordinator_saw"] == []


def test_collective_step_single_process_raises_the_own_error_unchanged() -> None:
    world = dist.World(0, 1)
    err = StateMismatchError("rank 0: nope")
    with pytest.raises(StateMismatchError) as info:
        dist.collective_step(world, "validating", lambda: (_ for _ in ()).throw(err))
    assert info.value is err and set(info.value.failures) == {0}
    assert dist.collective_step(world, "adding", lambda: 2, lambda g: sum(g.all())) == 2


# --------------------------------------------------------------------------------------
# commit.commit_single


def _write_tensor(store: FileStorage, claim: commit.Claim, t: torch.Tensor) -> Manifest:
    """Write ``t`` as tensor 'w' in one data file under the claim's prefix; its manifest."""
    box = Box((0,) * t.dim(), tuple(t.shape))
    layout = layout_file("0-0.safetensors", [("w", box, t.dtype)])
    path = f"{claim.data_prefix}/0-0.safetensors"
    (written,) = write_tiles(
        store, WriteRequest((FileWrite(path, layout, [as_bytes(t)]),), chunking=Chunking(64), threads=1)
    )
    tiles = tuple(Tile(path, w.box.offsets, w.box.lengths, w.byte_offset, w.nbytes, w.checksums) for w in written.tiles)
    return Manifest(
        save_id=claim.save_id,
        world_size=1,
        chunk_bytes=64,
        tensors={"w": TensorEntry(dtype_name(t.dtype), tuple(t.shape), tiles)},
        files=(FileEntry(path, 0, written.nbytes),),
    )


def test_commit_single_publishes_and_removes_the_replaced_checkpoint(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    tessera.save(root, {"w": torch.zeros(3, 4)})
    old_files = FileStorage(root).list("data")
    store = FileStorage(root)
    claim = commit.claim(store, "c0ffee0123456789")
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    manifest = _write_tensor(store, claim, t)
    commit.commit_single(store, claim, manifest, root)
    target = {"w": torch.empty(3, 4)}
    tessera.load(root, target)
    assert torch.equal(target["w"], t)
    assert tessera.read_manifest(root).save_id == "c0ffee0123456789"
    assert store.list("data") == ["data/c0ffee0123456789/0-0.safetensors"]
    assert not set(old_files) & set(store.list("data"))
    assert store.list(commit.MARKER_DIR) == []  # its own marker is gone too


def test_commit_single_refuses_another_saves_manifest_and_abandons_on_a_missing_file(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    tessera.save(root, {"w": torch.ones(2)})
    before = FileStorage(root).read_file("manifest.json")
    store = FileStorage(root)
    claim = commit.claim(store, "aaaa000000000000")
    manifest = _write_tensor(store, claim, torch.arange(2, dtype=torch.float32))
    other = commit.Claim("bbbb000000000000", claim.expected, claim.fenced)
    with pytest.raises(ValueError, match="bbbb000000000000"):
        commit.commit_single(store, other, manifest, root)
    store.delete([manifest.files[0].path])  # say, another job deleted it
    with pytest.raises(CommitCheckError, match="missing"):
        commit.commit_single(store, claim, manifest, root)
    assert store.read_file("manifest.json") == before  # the previous checkpoint stands
    assert store.list(commit.MARKER_DIR) == [] and store.list(claim.data_prefix) == []
    target = {"w": torch.zeros(2)}
    tessera.load(root, target)
    assert torch.equal(target["w"], torch.ones(2))


# --------------------------------------------------------------------------------------
# storage capabilities


def test_shipped_backends_declare_their_capabilities(tmp_path: Path) -> None:
    file = FileStorage(str(tmp_path / "f"))
    memory = FsspecStorage("memory://tessera-caps/ckpt")
    node = NodeStorage(str(tmp_path / "node"), "local-tier:step-1")
    for c in (cap.Locatable, cap.ConditionalPublish, cap.ListsSizes, cap.SyncsDirs, cap.RemovesEmptyDirs):
        assert isinstance(file, c), c
    for c in (cap.MapsRanges, cap.Uncommits, cap.Closable):
        assert isinstance(file, c), c
    assert not isinstance(file, cap.PartialVisibility)
    assert isinstance(memory, cap.ConditionalPublish) and isinstance(memory, cap.ListsSizes)
    assert not isinstance(memory, cap.MapsRanges)
    assert isinstance(node, cap.PartialVisibility) and not node.all_files_visible  # the local tier's node directory
    file.close()
    node.close()


# --------------------------------------------------------------------------------------
# module boundaries


def test_loading_does_not_import_saving() -> None:
    code = "import sys, tessera.engine.loading.core; print('tessera.engine.saving' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=_REPO)
    assert out.stdout.strip() == "False"


_STORAGE_INDEPENDENT = ["engine", "api.py"]


def test_storage_independent_code_never_looks_up_backend_methods_by_name() -> None:
    pattern = re.compile(r"getattr\(\s*(self\.)?(store|storage|_?root_store|durable|backend)\b")
    files = sorted((_REPO / "tessera" / "engine").rglob("*.py")) + [_REPO / "tessera" / "api.py"]
    assert len(files) > len(_STORAGE_INDEPENDENT)
    offenders = [
        f"{p.name}:{i}" for p in files for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)
    ]
    assert offenders == []
