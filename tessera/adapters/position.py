"""``DataPosition``: where a deterministic data stream stands, in global samples.

Counting global samples (not per-rank ones) lets a job resumed under another world size
continue with exactly the next samples. Streams that keep their own per-rank state are
:mod:`.data`.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import StateMismatchError


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
        >>> pos = tessera.adapters.DataPosition()
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
        """The epoch and the samples seen in it (global counts: the same on every rank)."""
        return {"epoch": self.epoch, "samples_seen": self.samples_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume at the saved epoch and sample count (under any world size).

        Raises:
            ValueError: if ``state_dict`` lacks an integer ``epoch`` or ``samples_seen``.
        """
        try:
            self.epoch, self.samples_seen = int(state_dict["epoch"]), int(state_dict["samples_seen"])
        except (KeyError, TypeError, ValueError) as e:
            raise StateMismatchError(
                f"data position: expected {{'epoch', 'samples_seen'}} integers, got {state_dict!r}"
            ) from e
