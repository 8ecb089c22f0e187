"""Lightning: save and resume ``Trainer`` checkpoints with tessera.

Two pieces, because Lightning routes checkpoints differently per strategy:

- :class:`TesseraCheckpointIO`, a ``CheckpointIO`` plugin. With Lightning's own strategies
  (``DDPStrategy``, ``SingleDeviceStrategy``) ``Strategy.save_checkpoint`` calls the plugin on
  global rank 0 only, with the whole (replicated) checkpoint dict; the plugin writes it as a
  tessera checkpoint from that rank, and every rank reads it back on resume. That covers
  DDP at any device count (its state is replicated), but the save is not collective.
- :class:`TesseraDDPStrategy`, :class:`TesseraFSDPStrategy` and
  :class:`TesseraModelParallelStrategy`: Lightning's strategies with their checkpoint
  methods replaced, so every rank saves its own shards of the model and optimizer
  (:class:`tessera.ModelState` / :class:`tessera.OptimizerState`, keyed by parameter FQN)
  in one collective save, and a resume under another device count or strategy loads each
  rank's new shards in place. Lightning's ``FSDPStrategy`` and ``ModelParallelStrategy``
  never call a ``CheckpointIO`` for sharded checkpoints (they call torch DCP themselves),
  which is why a strategy is needed there.

Everything else in Lightning's checkpoint dict (loops, callbacks, LR schedulers,
hyperparameters, ``epoch``/``global_step``) is stored as tensors and plain values in the
same checkpoint; its nesting is recorded in the manifest's metadata (``"lightning"``), so
``load_checkpoint`` returns the dict Lightning saved.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.io.checkpoint_plugin import CheckpointIO
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy, Strategy
from lightning.pytorch.trainer.states import TrainerFn

from .. import api
from ..adapters import ModelState, OptimizerState
from ..errors import StateMismatchError
from ..format.dtypes import dtype_from_name
from ..options import LoadOptions, SaveOptions
from ..results import PendingSave
from ..storage import storage_for
from .lightning_tree import METADATA_KEY, decode_tree, encode_tree

__all__ = [
    "TesseraCheckpointIO",
    "TesseraDDPStrategy",
    "TesseraFSDPStrategy",
    "TesseraModelParallelStrategy",
]

logger = logging.getLogger(__name__)

_FORMAT = 1
MANIFEST = "manifest.json"
_RANK_GROUPS: dict[tuple[int, int], Any] = {}


class TesseraCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that writes tessera checkpoints (a directory per path).

    Pass it as a plugin: ``Trainer(plugins=[TesseraCheckpointIO()])``. With Lightning's own
    strategies rank 0 writes the checkpoint and every rank reads it; with the ``Tessera*``
    strategies of this module all ranks save their shards together (see the module docs).

    Distributed contract: ``save_checkpoint`` is called by rank 0 alone under Lightning's own
    strategies (it then uses a process group of that rank only) and by every rank under the
    ``Tessera*`` strategies. ``load_checkpoint`` is called by every rank; each reads what it
    needs. Not thread-safe: one save or load at a time per process.

    Args:
        async_save: return from ``save_checkpoint`` once the state is staged in host memory
            and write in the background (:func:`tessera.async_save`). A later save or load
            first waits for it; ``teardown()`` (end of ``fit``) waits for the last one.
        allow_pickle: store values that are not plain Python values (e.g. objects in
            ``hyper_parameters``) with pickle; loading then needs the same opt-in.
        save_options: see :class:`tessera.SaveOptions`.
        load_options: see :class:`tessera.LoadOptions`.

    Example:
        >>> trainer = Trainer(plugins=[TesseraCheckpointIO(async_save=True)])
        >>> trainer.fit(model, ckpt_path="checkpoints/last.ckpt")  # a tessera directory
    """

    def __init__(
        self,
        *,
        async_save: bool = False,
        allow_pickle: bool = False,
        save_options: SaveOptions | None = None,
        load_options: LoadOptions | None = None,
    ) -> None:
        self.async_save = async_save
        self.allow_pickle = allow_pickle
        self.save_options = save_options or SaveOptions()
        self.load_options = load_options
        self._pending: PendingSave | None = None
        self._doomed: list[str] = []

    # ----------------------------------------------------------------------------------
    # CheckpointIO

    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        """Write ``checkpoint`` to the directory ``path`` from this rank alone.

        Args:
            checkpoint: Lightning's checkpoint dict.
            path: directory (or URL) of the tessera checkpoint; replaced atomically if it exists.
            storage_options: tessera storage options (e.g. S3 credentials), see docs/storage.md.
        """
        self._save(checkpoint, str(path), storage_options, sharded={}, process_group=self._rank_group())

    def load_checkpoint(
        self, path: _PATH, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Read the whole checkpoint dict saved at ``path`` (tensors on the CPU).

        ``map_location`` and ``weights_only`` are accepted for Lightning's interface; tensors
        are always read to the CPU (Lightning moves them where they belong), and nothing is
        unpickled unless the plugin was created with ``allow_pickle=True``.

        Raises:
            CheckpointNotFoundError: if ``path`` holds no committed checkpoint.
            StateMismatchError: if the checkpoint was not written by this plugin.
        """
        return self._load(str(path), sharded={}, strict=True, process_group=self._rank_group())

    def remove_checkpoint(self, path: _PATH) -> None:
        """Delete the checkpoint at ``path``: its manifest first (un-committing it), then the rest.

        Called by rank 0 (e.g. by ``ModelCheckpoint`` when ``save_top_k`` drops a checkpoint,
        right after a save). While an asynchronous save is in flight the deletion is deferred
        until that save has committed, so a crash never leaves no checkpoint at all, and the
        training loop does not wait for the write.
        """
        self._doomed.append(str(path))
        if self._pending is None or self._pending.done():
            self._wait()

    def _delete(self, url: str) -> None:
        store = storage_for(url)
        files = store.list("")
        if MANIFEST in files:
            store.delete([MANIFEST])
        store.delete([f for f in files if f != MANIFEST])
        local = url[len("file://") :] if url.startswith("file://") else url
        if "://" not in local and os.path.isdir(local):
            shutil.rmtree(local)  # the now empty directories
        logger.info("removed checkpoint %s (%d files)", url, len(files))

    def teardown(self) -> None:
        """Wait for an asynchronous save still in flight (raises its error, if any)."""
        self._wait()

    # ----------------------------------------------------------------------------------
    # Used by the strategies

    def _save(
        self,
        checkpoint: Mapping[str, Any],
        path: str,
        storage_options: Any | None,
        *,
        sharded: Mapping[str, object],
        process_group: Any,
    ) -> None:
        t0 = time.monotonic()
        self._wait()  # tessera would wait for the previous save anyway; then deferred deletions
        rest = {k: v for k, v in checkpoint.items() if k not in sharded}
        tree, leaves = encode_tree(rest)
        state: dict[str, object] = dict(leaves)
        for key, obj in sharded.items():
            if isinstance(obj, list):
                for i, item in enumerate(obj):
                    state[f"{key}.{i}"] = item
            else:
                state[key] = obj
        meta = {
            "format": _FORMAT,
            "tree": tree,
            "leaves": sorted(leaves),
            "sharded": {k: (len(v) if isinstance(v, list) else None) for k, v in sharded.items()},
        }
        options = replace(self.save_options, metadata={**self.save_options.metadata, METADATA_KEY: meta})
        kwargs: dict[str, Any] = dict(
            process_group=process_group,
            allow_pickle=self.allow_pickle,
            options=options,
            storage_options=storage_options,
        )
        if self.async_save:
            self._pending = api.async_save(path, state, **kwargs)
            self._pending.wait_staged()  # Lightning steps the raw optimizer next: stage first
            logger.info("staged checkpoint %s in %.3fs (writing in the background)", path, self._pending.stall_s)
        else:
            self._pending = None
            api.save(path, state, **kwargs)
            logger.info("saved checkpoint %s in %.3fs", path, time.monotonic() - t0)

    def _load(self, path: str, *, sharded: Mapping[str, object], strict: bool, process_group: Any) -> dict[str, Any]:
        self._wait()
        manifest = api.read_manifest(path)
        meta = manifest.metadata.get(METADATA_KEY)
        if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
            raise StateMismatchError(
                f"checkpoint {path} was not written by TesseraCheckpointIO (no '{METADATA_KEY}' metadata of "
                f"format {_FORMAT}); load it with tessera.load, or save it through the plugin"
            )
        state: dict[str, object] = {}
        for fqn in meta["leaves"]:
            entry = manifest.tensors.get(fqn)
            state[fqn] = torch.empty(entry.shape, dtype=dtype_from_name(entry.dtype)) if entry is not None else None
        saved_sharded: dict[str, int | None] = meta.get("sharded", {})
        if "state_dict" in sharded and "state_dict" not in saved_sharded:
            raise StateMismatchError(
                f"checkpoint {path} was saved by TesseraCheckpointIO under one of Lightning's own strategies "
                "(rank 0 wrote the whole state, optimizer state keyed by index); a Tessera* strategy loads only "
                "checkpoints saved by a Tessera* strategy. Resume it with Lightning's own strategy and the plugin"
            )
        for key, obj in sharded.items():
            if key not in saved_sharded:
                continue  # e.g. a weights-only checkpoint has no optimizer states
            if isinstance(obj, list):
                n = saved_sharded[key]
                if n != len(obj):
                    raise StateMismatchError(
                        f"checkpoint {path} holds {n} entries of '{key}', the job has {len(obj)}; "
                        "resume with the same number of optimizers"
                    )
                for i, item in enumerate(obj):
                    state[f"{key}.{i}"] = item
            else:
                state[key] = obj
        unsharded = [k for k in saved_sharded if k not in sharded]
        if unsharded and "state_dict" in unsharded:
            raise StateMismatchError(
                f"checkpoint {path} was saved by a Tessera* strategy (model and optimizer sharded by FQN); "
                "resume it with TesseraDDPStrategy, TesseraFSDPStrategy or TesseraModelParallelStrategy"
            )
        api.load(
            path,
            state,
            strict=strict,
            process_group=process_group,
            allow_pickle=self.allow_pickle,
            options=self.load_options,
        )
        return decode_tree(meta["tree"], state)

    def _wait(self) -> None:
        """Wait for the save in flight, then carry out the deletions deferred behind it."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.wait()
        doomed, self._doomed = self._doomed, []
        for url in doomed:
            self._delete(url)

    def _rank_group(self) -> Any:
        """A process group of this rank only (None without torch.distributed).

        Lightning calls ``save_checkpoint`` on rank 0 alone, so the save cannot be collective
        over the job. The group is created with local synchronization: only this rank takes
        part, and the job's group numbering is left alone.
        """
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return None
        key = (id(dist.group.WORLD), dist.get_rank())
        group = _RANK_GROUPS.get(key)
        if group is None:
            # One per process and job: a second group of the same ranks would get the same name.
            group = dist.new_group([dist.get_rank()], backend="gloo", use_local_synchronization=True)
            _RANK_GROUPS[key] = group
        return group


# --------------------------------------------------------------------------------------
# Strategies whose saves are collective and sharded


if TYPE_CHECKING:  # the mixin is only ever combined with a Strategy; tell the type checker so
    _StrategyBase = Strategy
else:
    _StrategyBase = object


class _TesseraStrategyMixin(_StrategyBase):
    """Checkpoint methods for a Lightning ``ParallelStrategy``: one collective tessera save.

    The model (``ModelState`` of the wrapped model) and each optimizer (``OptimizerState``)
    are saved by every rank as its own shards, keyed by parameter FQN; the rest of
    Lightning's checkpoint dict is saved alongside. Loading happens after the strategy has
    set up the model and optimizers, in place, under any device count.
    """

    _checkpoint_io: CheckpointIO | None

    @property
    def checkpoint_io(self) -> TesseraCheckpointIO:
        if self._checkpoint_io is None:
            self._checkpoint_io = TesseraCheckpointIO()
        if not isinstance(self._checkpoint_io, TesseraCheckpointIO):
            raise TypeError(
                f"{type(self).__name__} saves with tessera and needs a TesseraCheckpointIO plugin, "
                f"got {type(self._checkpoint_io).__name__}"
            )
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO) -> None:
        self._checkpoint_io = io

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        # The model and optimizers must exist (wrapped and sharded) to be filled in place.
        return True

    def _live_model(self) -> torch.nn.Module:
        if self.model is None:
            raise RuntimeError(f"{type(self).__name__}: no model is connected yet; checkpoints need the set-up model")
        return self.model

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model's parameters and buffers by FQN, as views of this rank's shards (no communication)."""
        return ModelState(self._live_model()).state_dict()

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's state by parameter FQN, as views of this rank's shards (no communication)."""
        return OptimizerState(self._live_model(), _unwrap(optimizer)).state_dict()

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        """Save collectively: every rank writes its shards (called by all ranks)."""
        path = str(self.broadcast(str(filepath)))
        sharded: dict[str, object] = {"state_dict": ModelState(self._live_model())}
        if "optimizer_states" in checkpoint:
            sharded["optimizer_states"] = [OptimizerState(self._live_model(), _unwrap(o)) for o in self.optimizers]
        self.checkpoint_io._save(checkpoint, path, storage_options, sharded=sharded, process_group=None)

    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """Load collectively into the live model and optimizers; return the rest of the dict."""
        path = str(self.broadcast(str(checkpoint_path)))
        module = self.lightning_module
        model_state = ModelState(self._live_model())
        sharded: dict[str, object] = {"state_dict": model_state}
        optim_states: list[OptimizerState] = []
        if module is not None and module.trainer.state.fn == TrainerFn.FITTING and self.optimizers:
            optim_states = [OptimizerState(self._live_model(), _unwrap(o)) for o in self.optimizers]
            sharded["optimizer_states"] = optim_states
        strict = module.strict_loading if module is not None else True
        checkpoint = self.checkpoint_io._load(path, sharded=sharded, strict=strict, process_group=None)
        # For on_load_checkpoint hooks: views of what was just loaded, keyed by FQN.
        checkpoint["state_dict"] = model_state.state_dict()
        if optim_states:
            checkpoint["optimizer_states"] = [o.state_dict() for o in optim_states]
        return checkpoint

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Nothing to do: ``load_checkpoint`` filled the model in place."""

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Nothing to do: ``load_checkpoint`` filled the optimizers in place."""

    def teardown(self) -> None:
        """Wait for an asynchronous save in flight, then tear the strategy down.

        ``ModelParallelStrategy.teardown`` does not tear its ``CheckpointIO`` down, so the
        wait happens here for every strategy.
        """
        self.checkpoint_io.teardown()
        super().teardown()

    def remove_checkpoint(self, filepath: _PATH) -> None:
        """Rank 0 deletes the checkpoint directory."""
        if self.is_global_zero:
            self.checkpoint_io.remove_checkpoint(filepath)


def _unwrap(optimizer: Any) -> torch.optim.Optimizer:
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


class TesseraDDPStrategy(_TesseraStrategyMixin, DDPStrategy):
    """``DDPStrategy`` whose checkpoints are saved by all ranks together with tessera.

    Replicated weights are written once, the writing spread over the ranks. Resumes under
    any device count, and from or into ``TesseraFSDPStrategy`` / ``TesseraModelParallelStrategy``
    checkpoints (the keys are the LightningModule's parameter FQNs in every strategy).

    Example:
        >>> Trainer(accelerator="cpu", devices=2, strategy=TesseraDDPStrategy())
    """

    strategy_name = "tessera_ddp"


class TesseraFSDPStrategy(_TesseraStrategyMixin, FSDPStrategy):
    """``FSDPStrategy`` (FSDP1) whose checkpoints are tessera checkpoints of each rank's shards.

    Each rank saves the parts of the original parameters its flat shard holds (no
    all-gather, unlike torch's sharded state dict), and the optimizer states the same way.
    ``state_dict_type`` is ignored for checkpoints: they are always sharded.
    """

    strategy_name = "tessera_fsdp"


class TesseraModelParallelStrategy(_TesseraStrategyMixin, ModelParallelStrategy):
    """``ModelParallelStrategy`` (FSDP2 / tensor parallel in ``configure_model``) saving with tessera.

    DTensor shards are saved as they are and resharded on load to any mesh.
    ``save_distributed_checkpoint`` is ignored: checkpoints are always sharded.
    """

    strategy_name = "tessera_model_parallel"
