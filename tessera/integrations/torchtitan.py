"""torchtitan: a ``CheckpointManager`` whose saves and loads go through tessera instead of DCP.

torchtitan's ``CheckpointManager`` (``torchtitan/components/checkpoint.py``) decides *when*
to save, which steps exist, what to purge and what to load; the two methods ``dcp_save`` and
``dcp_load`` do the I/O. :class:`TesseraCheckpointManager` overrides exactly those (and the
probe that finds committed steps), so every policy of torchtitan's checkpointer (interval,
``keep_latest_k``, ``load_step``, ``initial_load_model_only``, ``exclude_from_loading``,
async) keeps working. What changes:

- the model is saved as :class:`tessera.ModelState` of the model parts and the optimizers as
  :class:`tessera.OptimizerState` (keyed by parameter FQN, each rank's DTensor shards, no
  ``lr=0`` step to create a fresh optimizer's state), so a run resumes under any other
  parallelism (FSDP/TP/PP degrees) or world size;
- the data loader's state is per rank (``tessera.per_rank``): under the same DP degree each
  rank gets its own back, under another one the loaders start from their current state
  (torchtitan's own loader cannot reshard either);
- ``async_mode="async"`` and ``"async_with_pinned_mem"`` both use :func:`tessera.async_save`
  (it stages to host memory itself); a step is committed when its ``manifest.json`` exists.

Hugging Face export and import (``last_save_in_hf``, ``initial_load_in_hf``) still use DCP's
Hugging Face reader and writer.

To use it in torchtitan's trainer, call :func:`install` before the ``Trainer`` is built;
in a custom loop, construct :class:`TesseraCheckpointManager` where you would construct
``CheckpointManager``.
"""

from __future__ import annotations

import logging
import os
import re
from concurrent.futures import Future
from typing import Any

import torch
from torchtitan.components import checkpoint as tt_checkpoint
from torchtitan.components.checkpoint import AsyncMode, CheckpointManager

from .. import api
from ..adapters import ModelState, OptimizerState
from ..format.manifest import MANIFEST_NAME
from ..results import PendingSave
from ..shards import OnResize, per_rank

__all__ = ["TesseraCheckpointManager", "install"]

logger = logging.getLogger(__name__)

MODEL, OPTIMIZER, DATALOADER = tt_checkpoint.MODEL, tt_checkpoint.OPTIMIZER, tt_checkpoint.DATALOADER


class _PerRank:
    """A Stateful whose whole state belongs to this rank (torchtitan's data loader)."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def state_dict(self) -> dict[str, Any]:
        # Under another DP degree there is no rank to take a state from: keep the loader's own.
        return {"state": per_rank(self.obj.state_dict(), on_resize=OnResize.KEEP)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        value = state_dict["state"]
        self.obj.load_state_dict(getattr(value, "value", value))


class _PendingFuture(Future):
    """torchtitan waits on ``save_future.result()``; this forwards to a tessera save."""

    def __init__(self, pending: PendingSave) -> None:
        super().__init__()
        self._pending = pending

    def result(self, timeout: float | None = None) -> Any:
        return self._pending.wait(timeout)

    def done(self) -> bool:
        return self._pending.done()


class TesseraCheckpointManager(CheckpointManager):
    """torchtitan's ``CheckpointManager`` writing tessera checkpoints (same arguments).

    Distributed contract: as torchtitan's, every rank calls ``save``/``load`` at the same
    steps; each save and load is collective over the default process group.

    Example:
        >>> from tessera.integrations import torchtitan as tt
        >>> tt.install()  # torchtitan.train.Trainer now builds a TesseraCheckpointManager
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if getattr(self, "async_mode", None) == AsyncMode.ASYNC_WITH_PINNED_MEM:
            # tessera stages into host memory itself: no DCP stager, no staging future.
            self.async_mode = AsyncMode.ASYNC
            self.enable_staging = False

    def _model_parts(self) -> list[torch.nn.Module]:
        return list(self.states[MODEL].model)

    def _tessera_state(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """torchtitan's flattened state dict as a tessera state (model and optimizer by FQN)."""
        model_keys = set(self.states[MODEL].state_dict())
        parts = self._model_parts()
        state: dict[str, Any] = {}
        has_model = False
        for key, value in state_dict.items():
            if key in model_keys:
                has_model = True
            elif key == OPTIMIZER:
                state[OPTIMIZER] = OptimizerState(parts, list(value.optimizers))
            elif key == DATALOADER:
                if value is not None:
                    state[DATALOADER] = _PerRank(value)
            else:
                state[key] = value
        if has_model:
            state[MODEL] = ModelState(parts)
        return state

    @torch.no_grad()
    def dcp_save(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        async_mode: AsyncMode,
        enable_garbage_collection: bool = False,
        to_hf: bool = False,
    ) -> Future | None:
        """Save ``state_dict`` at ``checkpoint_id`` with tessera (DCP for ``to_hf``)."""
        if to_hf:
            return super().dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf)
        if self._is_model_only(state_dict):
            # torchtitan's model-only last save (maybe cast to export_dtype): its tensors as they are.
            state: dict[str, Any] = dict(state_dict)
        else:
            state = self._tessera_state(state_dict)
        if async_mode in (AsyncMode.ASYNC, AsyncMode.ASYNC_WITH_PINNED_MEM):
            pending = api.async_save(checkpoint_id, state)
            pending.wait_staged()  # torchtitan steps the optimizer next: stage first
            return _PendingFuture(pending)
        api.save(checkpoint_id, state)
        return None

    @torch.no_grad()
    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
        """Load ``checkpoint_id`` into the live model, optimizers and the other states."""
        if from_hf:
            super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
            return
        wrapper = self.states[MODEL]
        manifest = api.read_manifest(checkpoint_id)
        if not any(k.startswith(MODEL + ".") for k in manifest.tensors):
            # A model-only checkpoint (torchtitan's last step): the model's keys are at the top.
            api.load(checkpoint_id, state_dict)
            wrapper.load_state_dict(state_dict)
            return
        api.load(checkpoint_id, self._tessera_state(state_dict))
        # ModelState filled the parameters in place; refresh torchtitan's cached state dict.
        wrapper.cache_state_dict = wrapper._get_state_dict()

    def _is_model_only(self, state_dict: dict[str, Any]) -> bool:
        return set(state_dict) <= set(self.states[MODEL].state_dict())

    def _find_load_step(self, folder: str = "") -> int:
        """The newest ``step-N`` directory holding a committed tessera checkpoint (-1 if none)."""
        folder = folder or self.folder
        if not os.path.isdir(folder):
            return -1
        steps = []
        for name in os.listdir(folder):
            match = re.search(r"step-(\d+)", name)
            if match and os.path.isfile(os.path.join(folder, name, MANIFEST_NAME)):
                steps.append(int(match.group(1)))
        return max(steps, default=-1)


def install() -> None:
    """Make torchtitan's trainer (``torchtitan.train.Trainer``) build a :class:`TesseraCheckpointManager`.

    ``torchtitan/train.py`` constructs ``CheckpointManager`` by the name it imported; this
    rebinds that name. Call it before the ``Trainer`` is created (e.g. in the script that
    calls ``torchtitan.train.main``).
    """
    import torchtitan.train

    torchtitan.train.CheckpointManager = TesseraCheckpointManager
    logger.info("torchtitan.train.Trainer will checkpoint with tessera")
