"""``tessera rename`` racing a save to the same checkpoint path, in real processes.

The result must be the renamed old checkpoint or the new save, complete: never a mix, a torn
manifest, or a manifest naming files that are gone; a rename that loses says so and renames
nothing.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import tessera
from tessera.convert.rename import RenameRule, rename_tensors
from tessera.errors import ConcurrentSaveError
from tests.crash_worker import GateStorage, check_state, gated_save, make_state, read_progress, save_loop, start

NO_TIMINGS = tessera.LoadOptions(record_timings=False)
TO_NET = [RenameRule("model.", "net.")]
TOGGLE = [RenameRule("model.", "net."), RenameRule("net.", "model.")]


def _wait(path: str, proc: Any, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert proc.is_alive(), f"the child died (exit code {proc.exitcode})"
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.01)


def _load_any_names(path: str) -> tuple[int, str]:
    """Load ``path`` whichever names it has now (``model.*`` or ``net.*``); check every bit
    against ``make_state(k)``. Returns ``(k, prefix)``."""
    report = tessera.verify(path)
    assert report.ok and report.unreferenced_files == (), report.summary()
    keys = set(tessera.read_manifest(path).keys())
    prefix = "net" if "net.a" in keys else "model"
    assert keys == {f"{prefix}.a", f"{prefix}.b", "k", "meta"}, keys  # all old names or all new ones
    blank = make_state(0)
    state = {prefix: {"a": torch.zeros_like(blank["model"]["a"]), "b": torch.zeros_like(blank["model"]["b"])}}
    state.update(k=-1, meta={"tag": ""})
    tessera.load(path, state, options=NO_TIMINGS)
    return check_state({"model": state[prefix], "k": state["k"], "meta": state["meta"]}), prefix


def _leftovers(path: str) -> list[str]:
    markers = os.path.join(path, ".tessera-saves")
    return sorted(os.listdir(markers)) if os.path.isdir(markers) else []


# --------------------------------------------------------------------------------------
# One interleaving at a time: the rename stopped right before it publishes, and the save


def gated_rename(path: str, entered: str, gate: str, result: str, via_cli: bool) -> None:
    """Rename ``model.`` to ``net.`` in ``path``, pausing before the manifest publish until
    ``gate`` exists; write the outcome (``ok``/``Type: message``, or the CLI's exit code and
    stderr) to ``result``."""
    store = GateStorage(path, entered=entered, gate=gate)
    if via_cli:
        import tessera.cli
        import tessera.convert.rename as rename_module

        rename_module.storage_for = lambda url, storage=None: store  # type: ignore[assignment]
        fd = os.open(result + ".err", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 2)
        rc = tessera.cli.main(["rename", path, "--map", "model.=net."])
        os.close(2)
        with open(result + ".err") as f:
            out = f"rc={rc} {f.read()}"
    else:
        try:
            rename_tensors(path, TO_NET, storage=store)
            out = "ok"
        except BaseException as e:
            out = f"{type(e).__name__}: {e}"
    with open(result + ".tmp", "w") as f:
        f.write(out)
    os.replace(result + ".tmp", result)


@pytest.mark.parametrize("via_cli", [False, True])
def test_a_rename_that_loses_to_a_save_renames_nothing_and_says_so(tmp_path: Path, via_cli: bool) -> None:
    # The rename has read the old manifest and is about to publish its renamed copy when a
    # save commits: publishing would bring back the old checkpoint under new names. Before,
    # the error told a rename "this save's files were removed" (they were not: a rename
    # writes none) and did not say that nothing was renamed.
    path = str(tmp_path / "ck")
    tessera.save(path, make_state(1))
    entered, gate, result = (str(tmp_path / n) for n in ("entered", "gate", "result"))
    proc = start(gated_rename, path, entered, gate, result, via_cli)
    try:
        _wait(entered, proc)
        tessera.save(path, make_state(2))
        Path(gate).touch()
        proc.join(120)
        outcome = Path(result).read_text()
    finally:
        if proc.is_alive():
            proc.kill()
    if via_cli:
        assert outcome.startswith("rc=1 tessera rename: error: not renaming"), outcome
    else:
        assert outcome.startswith("ConcurrentSaveError: not renaming"), outcome
    assert "nothing was renamed" in outcome and "files were removed" not in outcome, outcome
    assert _load_any_names(path) == (2, "model")  # the save, whole and under its own names
    assert _leftovers(path) == []


def test_a_save_that_loses_to_a_rename_leaves_the_renamed_checkpoint(tmp_path: Path) -> None:
    # The save has written and checked its files and is about to publish when the rename
    # commits: the save must fail, and the renamed old checkpoint stands, complete.
    path = str(tmp_path / "ck")
    tessera.save(path, make_state(1))
    entered, gate, result = (str(tmp_path / n) for n in ("entered", "gate", "result"))
    proc = start(gated_save, path, 2, entered, gate, result, None)
    try:
        _wait(entered, proc)
        assert rename_tensors(path, TO_NET) == {"model.a": "net.a", "model.b": "net.b"}
        Path(gate).touch()
        proc.join(120)
        outcome = Path(result).read_text()
    finally:
        if proc.is_alive():
            proc.kill()
    assert outcome.startswith("ConcurrentSaveError"), outcome
    assert _load_any_names(path) == (1, "net")
    assert _leftovers(path) == []
    assert os.listdir(os.path.join(path, "data")) == [tessera.read_manifest(path).save_id]


# --------------------------------------------------------------------------------------
# Free-running: a saver and a renamer on one path for a few seconds


def rename_loop(path: str, progress: str, stop: str, seed: int) -> None:
    """Toggle ``model.`` <-> ``net.`` in ``path`` until the file ``stop`` exists (at most 60 s),
    pausing a random 0-100 ms between renames so that saves commit too; log each outcome."""
    torch.set_num_threads(1)
    rng = random.Random(seed)
    deadline = time.monotonic() + 60
    while not os.path.exists(stop) and time.monotonic() < deadline:
        try:
            rename_tensors(path, TOGGLE)
            line = "renamed"
        except ConcurrentSaveError:
            line = "lost"
        except BaseException as e:  # anything else is a failure of the test
            line = f"error {type(e).__name__}: {e}".replace("\n", " ")
        with open(progress, "a") as f:
            f.write(line + "\n")
        time.sleep(rng.uniform(0.0, 0.1))


def test_rename_and_save_racing_on_one_path_leave_one_whole_checkpoint(tmp_path: Path) -> None:
    # Holds: each rename publishes over the manifest it read or fails; each save commits over
    # the manifest it claimed or fails. Whatever the interleaving, the path holds one complete
    # checkpoint, all under one set of names, and both loops keep going. Rounds go on (at
    # most ~15 s; usually 2 rounds, 5 s) until a rename has lost to a save and a save to a rename.
    path = str(tmp_path / "ck")
    tessera.save(path, make_state(1))
    renames_log = str(tmp_path / "renames")
    lost_saves = 0
    deadline = time.monotonic() + 15
    rnd = 0
    while rnd < 2 or (time.monotonic() < deadline and not (lost_saves and "lost" in Path(renames_log).read_text())):
        saves_log, stop = str(tmp_path / f"saves-{rnd}"), str(tmp_path / f"stop-{rnd}")
        renamer = start(rename_loop, path, renames_log, stop, rnd)
        saver = None
        try:
            _wait(renames_log, renamer)  # the renamer is running before the saver starts
            saver = start(save_loop, path, saves_log, "contended", None, 100 * rnd + 2, 20)
            saver.join(120)
            Path(stop).touch()
            renamer.join(120)
            assert saver.exitcode == 0 and renamer.exitcode == 0, (saver.exitcode, renamer.exitcode)
        finally:
            for p in (saver, renamer):
                if p is not None and p.is_alive():
                    p.kill()
        k, _ = _load_any_names(path)
        _, done = read_progress(saves_log)  # the last save that succeeded (lost ones log "lost k")
        if done:  # renamed or not, the path holds that save's state
            assert k == done, (k, done)
        assert _leftovers(path) == []
        lost_saves += Path(saves_log).read_text().count("lost")
        rnd += 1
    outcomes = Path(renames_log).read_text().split("\n")[:-1]
    assert not [o for o in outcomes if o.startswith("error")], outcomes
    assert outcomes.count("renamed") > 0, outcomes
