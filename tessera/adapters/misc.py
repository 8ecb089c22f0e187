"""The rest of a training state: random number generators and the data position.

LR schedulers and ``torch.amp.GradScaler`` already have ``state_dict()``/``load_state_dict()``
and go into the state as they are. This module adds:

- :class:`RNGState`: Python, NumPy, torch CPU and CUDA generator states, per rank.
- :class:`DataPosition`: where a deterministic data stream stands, in global samples, so a
  job resumed under another world size continues with exactly the next samples.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from ..errors import StateMismatchError
from ..shards import OnResize, PerRank, per_rank


def _unwrap(value: Any) -> Any:
    return value.value if isinstance(value, PerRank) else value


class RNGState:
    """The random generators of this process, saved and restored per rank.

    Under the same world size every rank gets back exactly its own generator states.
    Under another world size there is no rank to take them from; ``on_resize`` decides:
    ``"keep"`` (default) leaves the generators as they are (seed them per rank as at the
    start of a job), ``"modulo"`` gives rank ``r`` what rank ``r % old_world`` saved (ranks
    then share streams), ``"error"`` refuses.

    Args:
        on_resize: the policy above.
        cuda: include the current CUDA device's generator (default: if CUDA is available, so
            that saving and loading processes agree on the keys).

    Example:
        >>> state = {"model": tessera.ModelState(m), "rng": tessera.RNGState()}
    """

    def __init__(self, *, on_resize: OnResize | str = OnResize.KEEP, cuda: bool | None = None) -> None:
        self.on_resize = OnResize(on_resize)
        self.cuda = torch.cuda.is_available() if cuda is None else cuda

    def state_dict(self) -> dict[str, Any]:
        """The current generator states, each marked per rank."""
        version, internal, gauss = random.getstate()
        name, keys, pos, has_gauss, cached = np.random.get_state()
        sd: dict[str, Any] = {
            "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss_next": gauss},
            "numpy": {
                "algorithm": name,
                "keys": torch.from_numpy(keys.astype(np.int64)),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached),
            },
            "torch": torch.get_rng_state(),
        }
        if self.cuda:
            sd["cuda"] = torch.cuda.get_rng_state()
        return {k: per_rank(v, on_resize=self.on_resize) for k, v in sd.items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Set the generators from ``state_dict`` (as filled by ``tessera.load``)."""
        py = _unwrap(state_dict["python"])
        random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss_next"]))
        n = _unwrap(state_dict["numpy"])
        np.random.set_state(
            (n["algorithm"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
        )
        torch.set_rng_state(_unwrap(state_dict["torch"]))
        if "cuda" in state_dict:
            torch.cuda.set_rng_state(_unwrap(state_dict["cuda"]))


class DataPosition:
    """How far a job has read a dataset, counted in global samples (not per rank).

    Each global batch is a fixed slice of a per-epoch permutation, and each rank takes its
    contiguous share of it, so the samples a job trains on depend only on the position and
    not on the world size: resumed under another world size, the job continues with the
    next global batch. The position is a replicated plain value.

    Args:
        epoch: the current epoch.
        samples_seen: samples of this epoch already consumed by all ranks together.

    Example:
        >>> pos = tessera.DataPosition()
        >>> idx = pos.batch_indices(len(ds), 32, rank, world)  # this rank's share
        >>> ...train on ds[idx]...; pos.advance(32)
    """

    def __init__(self, epoch: int = 0, samples_seen: int = 0) -> None:
        self.epoch = epoch
        self.samples_seen = samples_seen

    def batch_indices(
        self,
        num_samples: int,
        global_batch_size: int,
        rank: int,
        world_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
    ) -> list[int]:
        """The dataset indices of ``rank``'s share of the next global batch.

        Rolls over to the next epoch (dropping the incomplete last batch) when the
        current one has fewer than ``global_batch_size`` samples left.

        Raises:
            ValueError: if the batch does not split evenly over ``world_size`` ranks or
                is larger than the dataset.
        """
        if global_batch_size % world_size or not 0 < global_batch_size <= num_samples:
            raise ValueError(
                f"global batch size {global_batch_size} must be positive, at most the dataset size {num_samples} "
                f"and divisible by the world size {world_size}"
            )
        if self.samples_seen + global_batch_size > num_samples:
            self.epoch += 1
            self.samples_seen = 0
        if shuffle:
            g = torch.Generator().manual_seed(seed * 1_000_003 + self.epoch)
            order = torch.randperm(num_samples, generator=g)
        else:
            order = torch.arange(num_samples)
        share = global_batch_size // world_size
        start = self.samples_seen + rank * share
        return order[start : start + share].tolist()

    def advance(self, global_batch_size: int) -> None:
        """Record that all ranks together consumed one more global batch."""
        self.samples_seen += global_batch_size

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "samples_seen": self.samples_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        try:
            self.epoch, self.samples_seen = int(state_dict["epoch"]), int(state_dict["samples_seen"])
        except (KeyError, TypeError, ValueError) as e:
            raise StateMismatchError(
                f"data position: expected {{'epoch', 'samples_seen'}} integers, got {state_dict!r}"
            ) from e
