"""Every "not found" says why, and the same thing from ``tessera.load``, ``CheckpointManager.load`` and the CLI.

One diagnosis (``tessera.engine.loading.path_report``) for: a missing path, a manager root
(with its steps), a DCP checkpoint (with the import command), a step retention deleted, an
unfinished save, and a folder of step directories the manager does not recognise (with the
name it expects). Also: the manager's start (a stale ``latest`` repaired, unrecognised step
directories warned about once), ``inspect`` flagging a stale ``latest``, dedup building on the
newest committed step after ``rm -rf`` of the newest ones, and strict missing-key errors that
show where the checkpoint keeps those keys.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import tessera
from tessera.cli import EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE, main
from tessera.errors import MissingKeysError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _state() -> dict[str, object]:
    return {"w": torch.zeros(4), "step": 0}


def _python(path: Path | str) -> str:
    with pytest.raises(tessera.CheckpointNotFoundError) as info:
        tessera.load(str(path), _state())
    return str(info.value)


def _manager(root: Path | str, step: int | None = None) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        manager = tessera.CheckpointManager(str(root))
    with pytest.raises(tessera.CheckpointNotFoundError) as info, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        manager.load(_state(), step)
    manager.close()
    return str(info.value)


def _cli(capsys: pytest.CaptureFixture[str], *argv: str, code: int = EXIT_PROBLEMS) -> str:
    assert main(list(argv)) == code
    captured = capsys.readouterr()
    return " ".join((captured.out + captured.err).split())  # rich may wrap long lines


def _same(message: str, text: str) -> bool:
    return " ".join(message.split()) in text


def _run(root: Path, steps: list[int], keep_last: int | None = None) -> None:
    with tessera.CheckpointManager(str(root), keep_last=keep_last) as manager:
        for s in steps:
            manager.save(s, {"w": torch.full((4,), float(s)), "step": s})


def _dcp(path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(4), "step": 3}, checkpoint_id=str(path), no_dist=True)


def test_a_missing_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "typo"
    message = _python(path)
    assert message == f"no committed checkpoint at {path}: nothing is there"
    assert _same(message, _cli(capsys, "inspect", str(path)))
    assert _same(message, _manager(path))  # a manager root that does not exist (yet)
    for argv in (["verify", str(path)], ["diff", str(path), str(path)]):
        assert _same(message, _cli(capsys, *argv)), argv
    assert _same(message, _cli(capsys, "convert", str(path), str(tmp_path / "out"), code=EXIT_USAGE))
    assert _same(message, _cli(capsys, "rename", str(path), "--map", "a=b"))
    assert not path.exists() and not (tmp_path / "out").exists()  # nothing created on the way


def test_a_manager_root_lists_its_steps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "run"
    _run(root, [10, 20])
    message = _python(root)
    assert f"{root}: a checkpoint manager root with 2 committed step(s) (10, 20)" in message
    assert f"load a step ({root}/step-00000020)" in message and f"CheckpointManager('{root}').load(state)" in message
    assert _same(message.split(", not one checkpoint")[0], _cli(capsys, "inspect", str(root), code=EXIT_OK))


def test_a_dcp_checkpoint_names_the_import_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "dcp"
    _dcp(path)
    message = _python(path)
    assert "a torch.distributed.checkpoint (DCP) checkpoint, not a tessera one" in message
    assert f"tessera convert {path} OUT" in message
    assert _same(message, _cli(capsys, "inspect", str(path)))
    assert _same(message, _cli(capsys, "verify", str(path)))
    assert _same(message, _manager(path))


def test_a_step_retention_deleted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "run"
    _run(root, [1, 2, 3], keep_last=2)
    step = root / "step-00000001"
    message = _python(step)
    assert "no step 1 under" in message and "deleted by retention" in message
    assert message.endswith("its committed steps: 2, 3")
    assert _same(message, _manager(root, 1))
    assert _same(message, _cli(capsys, "inspect", str(step)))
    assert _same(message, _cli(capsys, "inspect", f"{root}@1", code=EXIT_USAGE))


def test_an_unfinished_save(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "run"
    _run(root, [1])
    step = root / "step-00000002"
    (step / "data").mkdir(parents=True)
    (step / "data" / "0-0.safetensors").write_bytes(b"\0" * 64)
    message = _python(step)
    assert "step 2 under" in message and "never committed" in message and "its committed steps: 1" in message
    assert _same(message, _manager(root, 2))
    assert _same(message, _cli(capsys, "inspect", str(step)))
    alone = tmp_path / "alone"
    (alone / "data").mkdir(parents=True)
    assert "a tessera checkpoint whose save never committed" in _python(alone)


def test_unrecognised_step_directories(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "dcp-run"
    for s in (6, 12):
        _dcp(folder / f"step-{s}")
    message = _python(folder)
    assert "step directories the checkpoint manager does not recognise: step-6, step-12" in message
    assert "(it names step 6 'step-00000006')" in message and f"tessera convert {folder} OUT" in message
    assert _same(message, _manager(folder))
    assert _same(message, _cli(capsys, "inspect", str(folder)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tessera.CheckpointManager(str(folder)).close()
    said = [str(w.message) for w in caught if "does not recognise" in str(w.message)]
    assert len(said) == 1 and "the manager ignores them" in said[0]
    # A typo'd step name under a manager root: the name the manager expects.
    root = tmp_path / "run"
    _run(root, [6])
    assert f"the checkpoint manager names step 6 'step-00000006': {root}/step-00000006" in _python(root / "step-6")


def test_a_stale_latest_is_flagged_then_repaired(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "run"
    _run(root, [1, 2, 3])
    shutil.rmtree(root / "step-00000003")  # rm -rf of the newest step: allowed
    text = _cli(capsys, "inspect", str(root), code=EXIT_OK)
    assert "its 'latest' names step 3, which is not committed there (stale" in text
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        manager = tessera.CheckpointManager(str(root))
    assert any("named step 3, which is not committed" in str(w.message) for w in caught)
    assert manager.pointer_step() == 2 and (root / "latest").read_text().strip() == "step-00000002"
    manager.close()
    assert "which is not committed there" not in _cli(capsys, "inspect", str(root), code=EXIT_OK)


def test_dedup_builds_on_the_newest_committed_step_after_rm_rf(tmp_path: Path) -> None:
    root = tmp_path / "run"
    state = {f"w{i}": torch.randn(128, 128) for i in range(16)}
    with tessera.CheckpointManager(str(root), dedup=True) as manager:
        for s in (1, 2, 3):
            state["w0"][0, 0] += 1
            changed = manager.save(s, state).bytes_written
    shutil.rmtree(root / "step-00000003")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        manager = tessera.CheckpointManager(str(root), dedup=True)
    state["w0"][0, 0] += 1
    written = manager.save(4, state).bytes_written
    manager.close()
    assert written <= 2 * changed < sum(t.numel() * 4 for t in state.values()) / 4
    target = {k: torch.zeros(128, 128) for k in state}
    tessera.load(str(root / "step-00000004"), target)
    assert all(torch.equal(target[k], state[k]) for k in state)


def test_dedup_builds_on_the_step_the_manager_loaded(tmp_path: Path) -> None:
    root = tmp_path / "run"
    state = {f"w{i}": torch.randn(128, 128) for i in range(16)}
    with tessera.CheckpointManager(str(root), dedup=True) as manager:
        changed = 0
        for s in (1, 2):
            state["w0"][0, 0] += 1
            changed = manager.save(s, state).bytes_written
    shutil.rmtree(root / "step-00000002")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        manager = tessera.CheckpointManager(str(root), dedup=True)
    loaded = {k: torch.zeros(128, 128) for k in state}
    assert manager.load(loaded).step == 1
    loaded["w1"][0, 0] += 1
    assert manager.save(5, loaded).bytes_written <= 2 * changed
    manager.close()


@contextlib.contextmanager
def caplog_warnings() -> Iterator[list[str]]:
    """The messages tessera logs at WARNING inside the block."""
    records: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    log = logging.getLogger("tessera")
    log.addHandler(handler)
    try:
        yield records
    finally:
        log.removeHandler(handler)


def test_missing_keys_show_the_prefix_that_explains_them(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 2)
    path = str(tmp_path / "ck")
    tessera.save(path, {"app": {"model": model.state_dict()}, "step": 1})  # the DCP tutorial's layout
    with pytest.raises(MissingKeysError) as info:
        tessera.load(path, {"model": torch.nn.Linear(3, 2).state_dict()})
    message = str(info.value)
    assert "under 'app.' ('app.model.bias')" in message and "tessera rename CKPT --map app.=" in message
    with caplog_warnings() as records:
        tessera.load(path, {"model": torch.nn.Linear(3, 2).state_dict()}, strict=False)
    assert any("under 'app.'" in r for r in records)  # the strict=False warning says the same
    target = {"app": {"model": torch.nn.Linear(3, 2).state_dict()}}
    tessera.load(path, target)  # nested under it, as suggested
    assert torch.equal(target["app"]["model"]["weight"], model.weight.detach())


def test_missing_keys_show_the_nearest_unexpected_keys(tmp_path: Path) -> None:
    path = str(tmp_path / "ck")
    tessera.save(path, {"model": {"layer.weight": torch.ones(2, 2), "layer.bias": torch.ones(2)}})
    with pytest.raises(MissingKeysError) as info:
        tessera.load(path, {"model": {"layers.weight": torch.zeros(2, 2), "layers.bias": torch.zeros(2)}})
    assert "'model.layer.weight' (for 'model.layers.weight')" in str(info.value)


def test_convert_to_dcp_counts_the_files_it_wrote(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = str(tmp_path / "ck")
    tessera.save(src, {"model": {"w": torch.ones(3)}, "cfg": {"a": 1, "b": {"c": [1, 2]}}, "step": 4})
    out = tmp_path / "dcp"
    text = _cli(capsys, "convert", src, str(out), "--to", "dcp", code=EXIT_OK)
    written = len([n for n in os.listdir(out) if n.endswith(".distcp") or n == ".metadata"])
    assert f"{written} file(s)" in text and written == len(os.listdir(out))
