"""Lightning: ``TesseraCheckpointIO`` and the Tessera* strategies with the real ``lightning``.

Jobs run on real gloo process groups (``tests/dist_utils.py``); Lightning sees a
torchelastic-style environment and uses the initialised group. Each job trains a tiny
model with Adam for two epochs of two steps; ``ModelCheckpoint`` saves at each epoch end.
A resumed job records, at ``on_train_start`` (after Lightning restored everything), the
full model and optimizer state through torch's own ``get_*_state_dict(full_state_dict=True)``
and compares it bit-exactly with what the saving job recorded when it saved; it then
trains to the end (step counters continue), and at the same device count its losses
equal the uninterrupted run's.
"""

from __future__ import annotations

import os
from collections import OrderedDict

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

import tessera  # noqa: E402
from tessera.integrations.lightning import (  # noqa: E402
    TesseraCheckpointIO,
    TesseraDDPStrategy,
    TesseraFSDPStrategy,
    TesseraModelParallelStrategy,
    decode_tree,
    encode_tree,
)
from tests.dist_utils import run_distributed  # noqa: E402

pytestmark = pytest.mark.interop


class TinyModule(pl.LightningModule):
    """Two linear layers (uneven dims, so FSDP shards are uneven) trained with Adam."""

    def __init__(self, wrap: str = "") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.wrap = wrap
        self.net = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if self.wrap == "fsdp" and not isinstance(self.net, torch.distributed.fsdp.FullyShardedDataParallel):
            # Lightning passes FSDP1 device_id=None on the CPU, which torch 2.13 refuses; a
            # module wrapped here is taken as it is.
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
            from torch.distributed.fsdp.wrap import ModuleWrapPolicy

            self.net = FSDP(
                self.net, auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear}), device_id=torch.device("cpu")
            )
        if self.wrap == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            for layer in self.net:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=self.device_mesh["data_parallel"])
            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> dict:
        opt = torch.optim.Adam(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(7)
    return torch.utils.data.TensorDataset(torch.randn(8, 5, generator=g), torch.randn(8, 3, generator=g))


def _full_state(trainer: pl.Trainer) -> dict:
    """Model and optimizer state as torch's own full state dicts (the independent reference)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    model = trainer.strategy.model
    opt = trainer.optimizers[0]
    opts = StateDictOptions(full_state_dict=True)
    optim = get_optimizer_state_dict(model, opt, options=opts)
    # Copies: the live tensors keep changing as training goes on.
    optim["state"] = {p: {k: torch.as_tensor(v).clone() for k, v in st.items()} for p, st in optim["state"].items()}
    return {
        "model": {k: v.detach().clone() for k, v in get_model_state_dict(model, options=opts).items()},
        "optim": optim,
        "lr": [g["lr"] for g in opt.param_groups],
    }


class _Record(pl.Callback):
    def __init__(self) -> None:
        self.saved: dict | None = None
        self.saved_step: int | None = None
        self.start: dict | None = None
        self.start_step: int | None = None

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        if trainer.current_epoch == 0:
            self.saved = _full_state(trainer)
            self.saved_step = trainer.global_step

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start_step = trainer.global_step
        if trainer.global_step > 0:
            self.start = _full_state(trainer)


def _strategy(kind: str) -> object:
    if kind == "ddp_plugin":
        return pl.strategies.DDPStrategy()
    if kind == "single":
        return "auto"
    return {"ddp": TesseraDDPStrategy, "fsdp": TesseraFSDPStrategy, "fsdp2": TesseraModelParallelStrategy}[kind]()


def _fit(rank: int, world: int, kind: str, ckpt_dir: str, resume: str | None, async_save: bool = False) -> dict:
    """Train 2 epochs (or resume from ``resume``) under ``kind`` on ``world`` processes."""
    if world > 1:
        os.environ.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            GROUP_RANK="0",
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT="1",
        )
    pl.seed_everything(0)  # also the seed of Lightning's DistributedSampler shuffling
    torch.manual_seed(1 if resume else 0)  # a resumed job starts from other weights
    record = _Record()
    ckpt = pl.callbacks.ModelCheckpoint(
        dirpath=ckpt_dir, filename="{epoch}", save_top_k=-1, save_on_train_epoch_end=True
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=_strategy(kind),
        plugins=[TesseraCheckpointIO(async_save=async_save)]
        if kind in ("ddp_plugin", "single") or async_save
        else None,
        max_epochs=2,
        logger=False,
        callbacks=[record, ckpt],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module = TinyModule(wrap=kind if kind in ("fsdp", "fsdp2") else "")
    loader = torch.utils.data.DataLoader(_dataset(), batch_size=2)
    trainer.fit(module, loader, ckpt_path=resume)
    return {
        "saved": record.saved,
        "saved_step": record.saved_step,
        "start": record.start,
        "start_step": record.start_step,
        "end_step": trainer.global_step,
        "losses": module.losses,
        "lr_end": trainer.optimizers[0].param_groups[0]["lr"],
    }


def _steps_per_epoch(world: int, kind: str) -> int:
    if kind in ("single", "fsdp2"):  # Lightning adds no DistributedSampler under ModelParallelStrategy
        return len(_dataset()) // 2
    per_rank = -(-len(_dataset()) // world)  # DistributedSampler pads
    return -(-per_rank // 2)


def _assert_same_state(a: dict, b: dict) -> None:
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    sa, sb = a["optim"]["state"], b["optim"]["state"]
    assert sa.keys() == sb.keys() and sa
    for fqn in sa:
        assert sa[fqn].keys() == sb[fqn].keys()
        for key in sa[fqn]:
            assert torch.equal(torch.as_tensor(sa[fqn][key]), torch.as_tensor(sb[fqn][key])), (fqn, key)
    assert a["lr"] == b["lr"]


def _run(kind: str, world: int, ckpt_dir: str, resume: str | None = None, **kw: object) -> list[dict]:
    if kind == "single":
        return [_fit(0, 1, kind, ckpt_dir, resume, **kw)]
    return run_distributed(_fit, world, kind, ckpt_dir, resume, *kw.values(), timeout=300)


# --------------------------------------------------------------------------------------
# The checkpoint dict's nesting, in one process


def test_encode_tree_roundtrip_lightning_like_dict(tmp_path):
    t = torch.arange(6.0).reshape(2, 3)
    checkpoint = {
        "epoch": 3,
        "global_step": 12,
        "state_dict": OrderedDict([("net.0.weight", t), ("net.0.bias", torch.zeros(2))]),
        "optimizer_states": [
            {
                "state": {0: {"step": torch.tensor(4.0), "exp_avg": t + 1}},
                "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0, 1], "foreach": None}],
            }
        ],
        "callbacks": {
            "ModelCheckpoint{'monitor': 'val.loss'}": {
                "best_model_score": torch.tensor(float("inf")),
                "best_k_models": {"/a/b.ckpt": torch.tensor(1.5)},
            }
        },
        "hyper_parameters": OrderedDict(hidden=7),
        "loops": {"fit_loop": {"state_dict": {}, "epoch_progress": {"total": {"ready": 3}}}},
        "a.b": 1,
        "a": {"b": torch.ones(1)},
    }
    io = TesseraCheckpointIO()
    io.save_checkpoint(checkpoint, tmp_path / "c.ckpt")
    loaded = io.load_checkpoint(tmp_path / "c.ckpt")
    assert loaded.keys() == checkpoint.keys()
    assert loaded["epoch"] == 3 and loaded["a.b"] == 1 and torch.equal(loaded["a"]["b"], torch.ones(1))
    assert torch.equal(loaded["state_dict"]["net.0.weight"], t)
    state0 = loaded["optimizer_states"][0]["state"][0]
    assert list(loaded["optimizer_states"][0]["state"]) == [0]  # int keys stay ints
    assert torch.equal(state0["exp_avg"], t + 1) and state0["step"].item() == 4.0
    assert loaded["optimizer_states"][0]["param_groups"][0]["betas"] == (0.9, 0.999)
    cb = loaded["callbacks"]["ModelCheckpoint{'monitor': 'val.loss'}"]
    assert torch.isinf(cb["best_model_score"]) and cb["best_k_models"]["/a/b.ckpt"].item() == 1.5
    assert loaded["hyper_parameters"] == {"hidden": 7}
    assert loaded["loops"] == checkpoint["loops"]
    # The checkpoint is an ordinary tessera checkpoint with readable names.
    names = set(tessera.read_manifest(str(tmp_path / "c.ckpt")).tensors)
    assert {"state_dict.net.0.weight", "optimizer_states.0.state.0.exp_avg"} <= names
    io.remove_checkpoint(tmp_path / "c.ckpt")
    assert not (tmp_path / "c.ckpt").exists()


def test_async_save_defers_removal_until_the_new_checkpoint_commits(tmp_path):
    io = TesseraCheckpointIO(async_save=True)
    io.save_checkpoint({"w": torch.ones(3), "epoch": 0}, tmp_path / "a")
    io.save_checkpoint({"w": torch.full((3,), 2.0), "epoch": 1}, tmp_path / "b")  # waits for "a" first
    io.remove_checkpoint(tmp_path / "a")  # ModelCheckpoint does this right after saving "b"
    io.teardown()
    assert not (tmp_path / "a").exists()
    loaded = io.load_checkpoint(tmp_path / "b")
    assert loaded["epoch"] == 1 and torch.equal(loaded["w"], torch.full((3,), 2.0))


def test_encode_tree_is_pure_json_skeleton():
    tree, leaves = encode_tree({"x": [torch.ones(1), (torch.zeros(1), 2)], "y": {"z": 1}})
    assert tree == ["d", [["x", ["l", [["v", "x.0"], ["t", [["v", "x.1.0"], ["v", "x.1.1"]]]]]], ["y", ["v", "y"]]]]
    rebuilt = decode_tree(tree, leaves)
    assert isinstance(rebuilt["x"][1], tuple) and rebuilt["y"] == {"z": 1}


def test_non_plain_value_needs_pickle(tmp_path):
    class Opaque:
        pass

    with pytest.raises(tessera.errors.PickleNotAllowedError, match="hyper_parameters"):
        TesseraCheckpointIO().save_checkpoint({"hyper_parameters": {"o": Opaque()}, "w": torch.ones(1)}, tmp_path / "c")


def test_plain_tessera_checkpoint_is_refused_with_a_clear_error(tmp_path):
    tessera.save(str(tmp_path / "c"), {"w": torch.ones(1)})
    with pytest.raises(tessera.StateMismatchError, match="not written by TesseraCheckpointIO"):
        TesseraCheckpointIO().load_checkpoint(tmp_path / "c")


def test_checkpoints_of_the_two_modes_are_told_apart(tmp_path):
    """A plugin checkpoint (rank 0, index-keyed) and a strategy one (FQN-keyed) are refused across."""
    model = torch.nn.Linear(2, 2)
    io = TesseraCheckpointIO()
    io.save_checkpoint({"state_dict": model.state_dict(), "epoch": 0}, tmp_path / "plugin")
    with pytest.raises(tessera.StateMismatchError, match="Lightning's own strategies"):
        io._load(
            str(tmp_path / "plugin"), sharded={"state_dict": tessera.ModelState(model)}, strict=True, process_group=None
        )
    io._save(
        {"epoch": 0},
        str(tmp_path / "strategy"),
        None,
        sharded={"state_dict": tessera.ModelState(model)},
        process_group=None,
    )
    with pytest.raises(tessera.StateMismatchError, match="Tessera\\* strategy"):
        io.load_checkpoint(tmp_path / "strategy")


# --------------------------------------------------------------------------------------
# Real Trainer runs


def test_single_process_trainer_resumes(tmp_path):
    first = _run("single", 1, str(tmp_path / "a"), async_save=True)[0]  # saves in the background
    assert first["saved_step"] == 4 and (tmp_path / "a" / "epoch=0.ckpt" / "manifest.json").exists()
    resumed = _run("single", 1, str(tmp_path / "b"), str(tmp_path / "a" / "epoch=0.ckpt"))[0]
    assert resumed["start_step"] == 4 and resumed["end_step"] == 8
    _assert_same_state(first["saved"], resumed["start"])
    assert resumed["losses"] == first["losses"][4:]  # the same loss curve, bit-exact
    assert resumed["lr_end"] == first["lr_end"]


def _fit_many(rank: int, world: int, runs: list[tuple]) -> list[dict]:
    """Several Trainer runs, one after the other, in the same processes (spawning is slow)."""
    return [_fit(rank, world, *run) for run in runs]


KINDS = ("ddp_plugin", "ddp", "fsdp", "fsdp2")


def test_trainers_save_on_2_and_resume_on_2_3_and_1(tmp_path):
    """Every strategy saves on 2 processes; resumes on 2 (same losses), 3 and 1 (same state).

    ``ddp_plugin`` is Lightning's own DDPStrategy with the plugin (rank 0 writes the
    checkpoint alone); ``ddp``/``fsdp``/``fsdp2`` are the Tessera* strategies (all ranks write
    their shards). One process resumes every checkpoint of a Tessera* strategy under
    TesseraDDPStrategy: the keys are the same in every strategy.
    """
    ckpt = {k: str(tmp_path / k / "epoch=0.ckpt") for k in KINDS}
    # The FSDP2 job saves asynchronously (each rank stages its shards, then writes in the background).
    first = run_distributed(_fit_many, 2, [(k, str(tmp_path / k), None, k == "fsdp2") for k in KINDS], timeout=600)
    for i, kind in enumerate(KINDS):
        manifest = tessera.read_manifest(ckpt[kind])
        writers = {tile.file.split("/")[-1].split("-")[0] for e in manifest.tensors.values() for tile in e.tiles}
        if kind == "ddp_plugin":
            assert manifest.world_size == 1 and "optimizer_states.0.state.0.exp_avg" in manifest.tensors
            continue
        assert manifest.world_size == 2 and len(writers) == 2, kind  # both ranks wrote tiles
        assert {"state_dict.net.0.weight", "optimizer_states.0.state.net.0.weight.exp_avg"} <= set(manifest.tensors)
        assert first[0][i]["saved_step"] == _steps_per_epoch(2, kind)

    def resume(world: int, targets: dict[str, str]) -> list[list[dict]]:
        runs = [(targets[k], str(tmp_path / f"{k}-on{world}"), ckpt[k]) for k in KINDS]
        return run_distributed(_fit_many, world, runs, timeout=600)

    # Same device count: the same state and the same loss curve as the uninterrupted run, bit-exact.
    same = resume(2, {k: k for k in KINDS})
    for i, kind in enumerate(KINDS):
        saved_step = first[0][i]["saved_step"]
        for rank in range(2):
            _assert_same_state(first[rank][i]["saved"], same[rank][i]["start"])
            assert same[rank][i]["start_step"] == saved_step, kind
            assert same[rank][i]["losses"] == first[rank][i]["losses"][saved_step:], kind
    # Other device counts: the same state, and training continues to the end of the epoch.
    for world, targets in ((3, {k: k for k in KINDS}), (1, {**{k: "ddp" for k in KINDS}, "ddp_plugin": "ddp_plugin"})):
        resumed = resume(world, targets)
        for i, kind in enumerate(KINDS):
            saved_step = first[0][i]["saved_step"]
            for r in (job[i] for job in resumed):
                _assert_same_state(first[0][i]["saved"], r["start"])
                assert r["start_step"] == saved_step, (kind, world)
                assert r["end_step"] == saved_step + _steps_per_epoch(world, targets[kind]), (kind, world)
