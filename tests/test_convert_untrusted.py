"""Importing a crafted DCP or Megatron ``torch_dist`` checkpoint never runs code from its ``.metadata``.

DCP's ``.metadata`` is a pickle. Each crafted file below would create a marker file if it were
unpickled; it goes through the real command line (``tessera convert`` with the format detected,
``--from dcp``, ``--from megatron``, ``tessera diff``, and one run of the installed ``tessera``
entry point in a subprocess) and must be refused with ``PickleNotAllowedError`` naming the
file, the marker never created. Real checkpoints written by ``torch.distributed.checkpoint``
(a Megatron-style one with byte entries and every rank's save plan included) still import,
and ``--allow-pickle`` still reads a trusted file that names a class DCP never writes.
"""

from __future__ import annotations

import builtins
import dataclasses
import io
import json
import os
import pickle
import subprocess
import sys
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata

import tessera
from tessera.cli import main
from tessera.convert import import_dcp, import_torch_dist
from tessera.errors import CorruptCheckpointError, PickleNotAllowedError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class _Call:
    """Unpickles as ``func(*args)``: stands for arbitrary code in a crafted file."""

    def __init__(self, func: Callable[..., object], *args: object) -> None:
        self.func, self.args = func, args

    def __reduce__(self):
        return (self.func, self.args)


class Trusted:
    """A harmless class of the user's own that DCP's metadata never holds."""

    def __init__(self, x: int) -> None:
        self.x = x


def _touch_code(marker: str) -> str:
    return f"open({marker!r}, 'w').close()"


def _payloads(marker: str) -> dict[str, Callable[[Metadata], object]]:
    """Ways to hide code in ``.metadata``: each maps the real metadata to what gets pickled."""
    return {
        "os.system": lambda md: _Call(os.system, f"touch '{marker}'"),
        "eval in planner_data": lambda md: dataclasses.replace(
            md,
            planner_data={"x": _Call(builtins.eval, f"__import__('os').close(__import__('os').open({marker!r}, 65))")},
        ),
        "exec in storage_meta": lambda md: dataclasses.replace(
            md, storage_meta=_Call(builtins.exec, _touch_code(marker))
        ),
        "subprocess.call": lambda md: _Call(subprocess.call, ["touch", marker]),
    }


PAYLOADS = list(_payloads("-"))


def _dcp_checkpoint(path: str) -> dict[str, torch.Tensor]:
    state = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(5, dtype=torch.bfloat16), "n": 7}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=path, no_dist=True)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


class _MegatronStylePlanner(dcp.DefaultSavePlanner):
    """Records every rank's plan in the metadata, as Megatron-Core's ``torch_dist`` save does."""

    def create_global_plan(self, all_plans):  # type: ignore[no-untyped-def]
        plans, metadata = super().create_global_plan(all_plans)
        metadata.all_local_plans = all_plans
        return plans, metadata


def _megatron_checkpoint(path: str) -> dict[str, torch.Tensor]:
    """A ``torch_dist`` directory: DCP files with tensors and ``BytesIO`` objects, ``common.pt``, ``metadata.json``."""
    obj = io.BytesIO()
    torch.save([{"rng": torch.arange(3)}], obj)
    obj.seek(0)
    tensors = {
        "decoder.weight": torch.arange(20.0).reshape(4, 5),
        "optimizer.state.exp_avg.decoder.weight": torch.ones(4, 5),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(
            {**tensors, "rng_state/shard_0.0_1.1": obj},
            checkpoint_id=path,
            no_dist=True,
            planner=_MegatronStylePlanner(),
        )
    torch.save({"iteration": 3, "checkpoint_version": 3.0}, os.path.join(path, "common.pt"))
    with open(os.path.join(path, "metadata.json"), "w") as f:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1}, f)
    return tensors


def _craft(path: str, make: Callable[[Metadata], object]) -> None:
    """Replace ``path``'s ``.metadata`` with what ``make`` builds from the real one."""
    meta = os.path.join(path, ".metadata")
    with open(meta, "rb") as f:
        real = pickle.load(f)  # written by dcp.save above: trusted
    with open(meta, "wb") as f:
        pickle.dump(make(real), f)


@pytest.fixture
def other(tmp_path) -> str:
    """A tessera checkpoint for ``tessera diff`` to compare against."""
    path = str(tmp_path / "other")
    tessera.save(path, {"w": torch.zeros(3, 4)})
    return path


def _commands(kind: str, src: str, out: str, other: str) -> list[list[str]]:
    return [
        ["convert", src, f"{out}-detected"],
        ["convert", "--from", kind, src, f"{out}-{kind}"],
        ["diff", src, other],
        ["diff", other, src],
    ]


@pytest.mark.parametrize("kind", ["dcp", "megatron"])
@pytest.mark.parametrize("payload", PAYLOADS)
def test_crafted_metadata_is_refused_by_every_command(tmp_path, capsys, other, kind: str, payload: str) -> None:
    src = str(tmp_path / kind)
    (_dcp_checkpoint if kind == "dcp" else _megatron_checkpoint)(src)
    marker = str(tmp_path / "pwned")
    _craft(src, _payloads(marker)[payload])
    for argv in _commands(kind, src, str(tmp_path / "out"), other):
        capsys.readouterr()
        assert main(argv) == 1, argv
        err = capsys.readouterr().err
        assert not os.path.exists(marker), f"{argv}: code from the crafted .metadata ran"
        assert f"refusing to unpickle {os.path.join(src, '.metadata')}" in err, (argv, err)
        assert "--allow-pickle" in err and "Traceback" not in err, err
        assert not list(tmp_path.glob("out*/manifest.json")), argv


@pytest.mark.parametrize("kind", ["dcp", "megatron"])
def test_the_api_raises_a_typed_error_naming_the_file(tmp_path, kind: str) -> None:
    src = str(tmp_path / kind)
    (_dcp_checkpoint if kind == "dcp" else _megatron_checkpoint)(src)
    marker = str(tmp_path / "pwned")
    _craft(src, _payloads(marker)["os.system"])
    do = import_dcp if kind == "dcp" else import_torch_dist
    with pytest.raises(PickleNotAllowedError, match=r"refusing to unpickle .*\.metadata .*'posix\.system'"):
        do(src, str(tmp_path / "out"))
    assert not os.path.exists(marker)


def test_the_installed_command_refuses_it_too(tmp_path) -> None:
    src = str(tmp_path / "dcp")
    _dcp_checkpoint(src)
    marker = str(tmp_path / "pwned")
    _craft(src, _payloads(marker)["exec in storage_meta"])
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")])}
    cmd = [
        sys.executable,
        "-c",
        "import sys; from tessera.cli import main; sys.exit(main())",
        "convert",
        src,
        str(tmp_path / "out"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert not os.path.exists(marker)
    assert "PickleNotAllowed" in proc.stderr or "refusing to unpickle" in proc.stderr, proc.stderr


def test_malformed_metadata_is_a_typed_error_not_an_attribute_error(tmp_path) -> None:
    src = str(tmp_path / "dcp")
    _dcp_checkpoint(src)
    for make, match in [
        (lambda md: {"state_dict_metadata": {}}, "holds a dict, not DCP Metadata"),
        (lambda md: dataclasses.replace(md, storage_data=None), "storage_data"),
        (
            lambda md: dataclasses.replace(
                md,
                storage_data={
                    k: dataclasses.replace(v, relative_path="../../secret") for k, v in md.storage_data.items()
                },
            ),
            "not a file of the checkpoint directory",
        ),
    ]:
        _craft(src, make)
        with pytest.raises(CorruptCheckpointError, match=match):
            import_dcp(src, str(tmp_path / "out"))
        os.remove(os.path.join(src, ".metadata"))
        _dcp_checkpoint(src)
    with open(os.path.join(src, ".metadata"), "r+b") as f:
        f.truncate(40)
    with pytest.raises(CorruptCheckpointError, match=r"\.metadata: DCP metadata is not a valid pickle"):
        import_dcp(src, str(tmp_path / "out"))


def test_real_checkpoints_still_import(tmp_path, capsys) -> None:
    src = str(tmp_path / "dcp")
    want = _dcp_checkpoint(src)
    assert main(["convert", src, str(tmp_path / "a")]) == 0
    target = {"w": torch.zeros(3, 4), "b": torch.zeros(5, dtype=torch.bfloat16), "n": 0}
    tessera.load(str(tmp_path / "a"), target)
    assert torch.equal(target["w"], want["w"]) and torch.equal(target["b"], want["b"]) and target["n"] == 7

    mg = str(tmp_path / "megatron")
    want = _megatron_checkpoint(mg)
    assert main(["convert", mg, str(tmp_path / "m")]) == 0, capsys.readouterr().err
    manifest = tessera.read_manifest(str(tmp_path / "m"))
    assert set(want) <= set(manifest.tensors) and "rng_state/shard_0.0_1.1" in manifest.values
    got = {k: torch.zeros_like(v) for k, v in want.items()}
    tessera.load(str(tmp_path / "m"), got, strict=False)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_allow_pickle_reads_a_trusted_file_that_names_another_class(tmp_path, capsys) -> None:
    src = str(tmp_path / "dcp")
    _dcp_checkpoint(src)
    _craft(src, lambda md: dataclasses.replace(md, planner_data={**md.planner_data, "extra": Trusted(1)}))
    assert main(["convert", src, str(tmp_path / "a")]) == 1
    assert f"'{__name__}.Trusted', which is not allowed" in capsys.readouterr().err
    assert main(["convert", "--allow-pickle", src, str(tmp_path / "b")]) == 0
    assert "w" in tessera.read_manifest(str(tmp_path / "b")).tensors
