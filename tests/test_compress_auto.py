"""``SaveOptions(compress="auto")``: a rank codes its files only where its writes measured the
codec faster than the storage (tessera/engine/saving/compress_choice.py)."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pytest
import torch

import tessera
from tessera.engine.saving import compress_choice
from tessera.engine.saving.compress_choice import CompressChoice, place
from tessera.manager import CheckpointManager
from tessera.options import SaveOptions, WriterMode
from tests.dist_utils import run_distributed
from tests.s3_server import moto_endpoint, s3_bucket, s3_options  # noqa: F401 - fixtures

MB = 1 << 20


@pytest.fixture
def choice(monkeypatch: pytest.MonkeyPatch) -> CompressChoice:
    """A fresh measurement registry for the test (the process's one is shared by every test)."""
    fresh = CompressChoice()
    monkeypatch.setattr(compress_choice, "CHOICE", fresh)
    return fresh


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"w{i}": torch.randn(512, 1024, generator=g) * 0.02 for i in range(4)}  # 8 MiB, trained-like


def _slow(choice: CompressChoice, url: str) -> None:
    """Make ``url``'s place measure 16 MiB/s, slower than any codec on any load (the moving
    average forgets the real measurements before)."""
    for _ in range(60):
        choice.record_storage(url, 1 << 30, 64.0)


def _coded(path: Path) -> list[bool]:
    return ["frames" in f for f in json.loads((path / "manifest.json").read_text())["files"]]


def _loads_bit_exact(path: Path, state: dict[str, torch.Tensor]) -> None:
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    tessera.load(str(path), target)
    assert all(torch.equal(target[k], v) for k, v in state.items())


def test_place_is_the_device_or_the_bucket(tmp_path: Path) -> None:
    assert place("s3://bucket/run1/step-5") == place("s3://bucket/other") == "s3://bucket"
    assert place("gs://b2/x") != place("s3://bucket/x")
    # A path that does not exist yet belongs to the device of its nearest existing directory.
    assert place(str(tmp_path / "not" / "yet")) == place(str(tmp_path)) == f"dev:{os.stat(tmp_path).st_dev}"
    assert place(f"file://{tmp_path}") == place(str(tmp_path))


def test_the_decision_is_codec_against_storage_and_plain_until_the_storage_is_known() -> None:
    c = CompressChoice()
    sample = memoryview((torch.randn(MB) * 0.02).numpy().tobytes())
    assert c.should_code("s3://b/x", 2, sample, 4) is False  # nothing known of the storage: measure it first
    assert c.rates("s3://b/y") == (None, None)
    c.record_storage("s3://b/x", 64 * MB, 1.0)  # 64 MiB/s: slower than any codec
    assert c.should_code("s3://b/other-step", 2, sample, 4) is True  # the codec was timed on the sample
    storage, codec = c.rates("s3://b/z")
    assert storage == 64 * MB and codec is not None and codec > 64 * MB / 2
    for _ in range(20):
        c.record_storage("s3://b/x", 1 << 40, 1.0)  # a terabyte a second: faster than any codec
    assert c.should_code("s3://b/x", 2, sample, 4) is False
    c.record_storage("s3://b/x", 1000, 1e-9)  # writes under 1 MiB are latency: not measured
    assert c.rates("s3://b/x")[0] == pytest.approx(1 << 40, rel=1e-3)


def test_where_the_model_says_code_the_realized_writes_decide_and_the_loser_is_retried() -> None:
    c = CompressChoice()
    sample = memoryview((torch.randn(MB) * 0.02).numpy().tobytes())
    url = "s3://b/x"
    c.record_storage(url, 64 * MB, 1.0)  # slower than the codec: the model says code
    assert c.should_code(url, 2, sample, 4) is True  # coded writes not tried here yet
    c.record_write(url, 64 * MB, 1.0, coded=False)
    c.record_write(url, 64 * MB, 2.0, coded=True)  # coding realized half the plain rate
    assert c.realized("s3://b/other") == (64 * MB, 32 * MB)
    picks = [c.should_code(url, 2, sample, 4) for _ in range(2 * compress_choice.PROBE_EVERY)]
    assert picks.count(True) == 2 and picks[compress_choice.PROBE_EVERY - 1] is True  # the loser, retried
    for _ in range(20):
        c.record_write(url, 64 * MB, 0.25, coded=True)  # the storage slowed: coding now realizes more
    picks = [c.should_code(url, 2, sample, 4) for _ in range(compress_choice.PROBE_EVERY)]
    assert picks.count(False) == 1
    for _ in range(20):
        c.record_storage(url, 1 << 40, 1.0)  # storage faster than the codec: plain, whatever was realized
    assert not any(c.should_code(url, 2, sample, 4) for _ in range(2 * compress_choice.PROBE_EVERY))
    c.record_write(url, 1000, 1e-9, coded=True)  # under 1 MiB: latency, not measured
    assert c.realized(url)[1] == pytest.approx(256 * MB, rel=1e-3)


def test_a_coded_save_that_realized_less_than_plain_is_not_repeated(tmp_path: Path, choice: CompressChoice) -> None:
    state = _state()
    opts = SaveOptions(compress="auto")
    tessera.save(str(tmp_path / "first"), state, options=opts)  # plain: measures the disk
    _slow(choice, str(tmp_path))
    tessera.save(str(tmp_path / "tried"), state, options=opts)
    assert _coded(tmp_path / "tried") == [True]
    plain, coded = choice.realized(str(tmp_path))
    assert plain is not None and coded is not None  # both kinds of write were timed by the saves
    for _ in range(20):
        choice.record_write(str(tmp_path), 64 * MB, 1.0, coded=True)  # coding realized far less here
        choice.record_write(str(tmp_path), 64 * MB, 0.01, coded=False)
    tessera.save(str(tmp_path / "after"), state, options=opts)
    assert _coded(tmp_path / "after") == [False]
    _loads_bit_exact(tmp_path / "after", state)


def test_save_options_take_auto_and_refuse_other_values(monkeypatch: pytest.MonkeyPatch) -> None:
    assert SaveOptions(compress="auto").compress == "auto"
    monkeypatch.setenv("TESSERA_COMPRESS", "auto")
    assert SaveOptions().compress == "auto"
    with pytest.raises(ValueError, match="compress must be True, False or 'auto'"):
        SaveOptions(compress="zstd")


@pytest.mark.parametrize("writer", [WriterMode.THREAD, WriterMode.PROCESS])
def test_auto_writes_plain_first_then_codes_where_the_storage_is_slower(
    tmp_path: Path, choice: CompressChoice, writer: WriterMode
) -> None:
    state = _state()
    opts = SaveOptions(compress="auto", writer=writer)
    tessera.save(str(tmp_path / "first"), state, options=opts)
    assert _coded(tmp_path / "first") == [False]
    _loads_bit_exact(tmp_path / "first", state)
    if writer is WriterMode.PROCESS:
        return  # the writer process measures in its own registry; the decisions below are the thread writer's
    assert choice.rates(str(tmp_path))[0] is not None  # the plain write measured the disk
    _slow(choice, str(tmp_path))
    tessera.save(str(tmp_path / "slow"), state, options=opts)
    assert _coded(tmp_path / "slow") == [True]
    assert json.loads((tmp_path / "slow" / "manifest.json").read_text())["version"] == 3
    _loads_bit_exact(tmp_path / "slow", state)
    for _ in range(30):
        choice.record_storage(str(tmp_path), 1 << 40, 1.0)
    tessera.save(str(tmp_path / "fast"), state, options=opts)
    assert _coded(tmp_path / "fast") == [False]


def test_writes_without_auto_measure_nothing(tmp_path: Path, choice: CompressChoice) -> None:
    tessera.save(str(tmp_path / "plain"), _state())
    tessera.save(str(tmp_path / "coded"), _state(), options=SaveOptions(compress=True))
    assert choice.rates(str(tmp_path)) == (None, None)


def test_an_auto_write_measures_the_codec_and_the_storage(tmp_path: Path, choice: CompressChoice) -> None:
    _slow(choice, str(tmp_path))
    tessera.save(str(tmp_path / "a"), _state(), options=SaveOptions(compress="auto"))
    assert _coded(tmp_path / "a") == [True]
    storage, codec = choice.rates(str(tmp_path))
    assert storage is not None and codec is not None and codec > MB  # logical bytes per second of one thread


def test_a_manager_with_auto_keeps_every_step_loadable(tmp_path: Path, choice: CompressChoice) -> None:
    state = _state()
    with CheckpointManager(str(tmp_path / "run"), compress="auto", keep_last=2) as mgr:
        mgr.save(1, state)
        _slow(choice, str(tmp_path))
        mgr.save(2, state)
    coded = {step: _coded(tmp_path / "run" / f"step-{step:08d}") for step in (1, 2)}
    assert coded == {1: [False], 2: [True]}
    for step in (1, 2):
        _loads_bit_exact(tmp_path / "run" / f"step-{step:08d}", state)


def test_auto_on_s3_codes_once_the_endpoint_is_measured_slow(
    moto_endpoint: str, s3_bucket: str, choice: CompressChoice
) -> None:
    opts = s3_options(moto_endpoint)
    state = _state()
    first, second = (f"s3://{s3_bucket}/{uuid.uuid4().hex}/ckpt" for _ in range(2))
    tessera.save(first, state, options=SaveOptions(compress="auto"), storage_options=opts)
    assert not _any_coded(first, storage_options=opts)
    storage, _ = choice.rates(first)
    assert storage is not None  # the loopback endpoint, measured by the first save
    _slow(choice, first)
    tessera.save(second, state, options=SaveOptions(compress="auto"), storage_options=opts)
    assert _any_coded(second, storage_options=opts)
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    tessera.load(second, target, storage_options=opts)
    assert all(torch.equal(target[k], v) for k, v in state.items())


def test_auto_saves_keep_the_sectioned_manifest_coded_or_not(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, choice: CompressChoice
) -> None:
    monkeypatch.setenv("TESSERA_SECTIONED_MANIFEST_TILES", "0")  # every save large enough for sections
    state = _state()
    tessera.save(str(tmp_path / "plain"), state, options=SaveOptions(compress="auto"))
    # a save that may compress records its chunk rule, so its index is version 4 coded or not
    assert json.loads((tmp_path / "plain" / "manifest.json").read_text())["version"] == 4
    assert not _any_coded(str(tmp_path / "plain"))
    _loads_bit_exact(tmp_path / "plain", state)
    _slow(choice, str(tmp_path))
    tessera.save(str(tmp_path / "coded"), state, options=SaveOptions(compress="auto"))
    assert json.loads((tmp_path / "coded" / "manifest.json").read_text())["version"] == 4
    assert _any_coded(str(tmp_path / "coded"))  # frames in the sections
    _loads_bit_exact(tmp_path / "coded", state)


ROWS, COLS = 1024, 1024


def _any_coded(path: str, **kw: object) -> bool:
    """Whether the checkpoint at ``path`` has a compressed data file (a save with compress="auto"
    commits version 3 or 4 either way: its chunk rule is in the manifest)."""
    return any(f.frames is not None for f in tessera.read_manifest(path, **kw).files)


def _global() -> torch.Tensor:
    return torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(5)) * 0.02


def _save_rows_deciding_alone(rank: int, world: int, path: str, sections: str) -> list[bool]:
    """Each rank's own measurements decide: rank 1 has seen a slow disk, rank 0 nothing yet."""
    os.environ["TESSERA_SECTIONED_MANIFEST_TILES"] = sections
    if rank == 1:
        compress_choice.CHOICE.record_storage(path, 1 << 30, 64.0)
    per = ROWS // world
    part = _global()[rank * per : (rank + 1) * per].clone()
    tessera.save(
        path, {"w": tessera.ShardedTensor(part, (ROWS, COLS), (rank * per, 0))}, options=SaveOptions(compress="auto")
    )
    m = tessera.read_manifest(path)
    return [f.frames is not None for f in m.files if f.rank == rank]


def _load_rows(rank: int, world: int, path: str) -> None:
    per = -(-ROWS // world)
    a, b = rank * per, min(ROWS, (rank + 1) * per)
    part = torch.zeros(b - a, COLS)
    tessera.load(path, {"w": tessera.ShardedTensor(part, (ROWS, COLS), (a, 0))})
    assert torch.equal(part, _global()[a:b])


@pytest.mark.parametrize("sections", ["0", "1000000"], ids=["sectioned", "inline"])
def test_ranks_decide_alone_and_a_mixed_checkpoint_loads_into_other_layouts(tmp_path: Path, sections: str) -> None:
    path = str(tmp_path / "mixed")
    coded = run_distributed(_save_rows_deciding_alone, 2, path, sections)
    assert coded == [[False], [True]]
    assert tessera.read_manifest(path).version == (4 if sections == "0" else 3)  # one coded file is enough
    for world in (1, 3):
        run_distributed(_load_rows, world, path)
    assert tessera.verify(path).ok


def test_auto_codes_under_a_memory_budget_and_with_small_tiles(tmp_path: Path, choice: CompressChoice) -> None:
    """No chunk of a MiB to time the codec on (a budget streams pieces; these tiles are small):
    the codec is timed on trained-like values instead, and a slow storage still gets coded files."""
    g = torch.Generator().manual_seed(1)
    small = {f"b{i}": torch.randn(64, 1024, generator=g) * 0.02 for i in range(16)}  # 256 KiB each
    _slow(choice, str(tmp_path))
    tessera.save(str(tmp_path / "small"), small, options=SaveOptions(compress="auto"))
    assert _coded(tmp_path / "small") == [True]
    _loads_bit_exact(tmp_path / "small", small)
    state = _state()
    pending = tessera.async_save(
        str(tmp_path / "budget"), state, options=SaveOptions(compress="auto", max_staging_bytes=1 << 20)
    )
    pending.wait()
    assert _coded(tmp_path / "budget") == [True]
    _loads_bit_exact(tmp_path / "budget", state)


def test_auto_under_dedup_builds_delta_tiles_only_where_it_codes(tmp_path: Path, choice: CompressChoice) -> None:
    state = _state()
    with CheckpointManager(str(tmp_path / "run"), dedup=True, compress="auto", keep_last=4) as mgr:
        mgr.save(1, state)  # nothing known of the disk: plain
        assert choice.rates(str(tmp_path))[0] is not None  # and measured, where auto decides
        for step in (2, 3):
            for _ in range(60):
                choice.record_storage(str(tmp_path), 1 << 40, 1.0)  # a fast disk: plain
            for v in state.values():
                v.add_(1e-4)
            mgr.save(step, state)
        for _ in range(60):
            choice.record_storage(str(tmp_path), 1 << 30, 64.0)  # a slow one: coded, as deltas where smaller
        for v in state.values():
            v.add_(1e-4)
        mgr.save(4, state)
    for step in (1, 2, 3, 4):
        m = tessera.read_manifest(str(tmp_path / "run" / f"step-{step:08d}"))
        coded = any(f.frames is not None for f in m.files)
        assert m.version in (3, 4) and coded == (step == 4), (step, m.version)
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        tessera.load(str(tmp_path / "run" / f"step-{step:08d}"), target)
    assert all(torch.equal(target[k], v) for k, v in state.items())
