"""Data streams whose checkpoint survives a change of data-parallel size.

:class:`DataPosition` covers loaders that consume whole global batches in lockstep. Real
pipelines hold data *in flight*: samples prefetched but not yet consumed, and the tail of
a document a token packer has not yet emitted; ranks also read at different speeds (a
packer consumes more short documents than long ones). A per-DP-rank loader state cannot be
loaded under another DP size. This module can:

- :class:`ReshardableStream` deals a global, deterministic stream of a map-style source to
  the DP ranks (*lanes*) and records, per rank, how far it read, which samples it has
  prefetched and which tokens its packer still holds. It is an ``IterableDataset`` with
  ``state_dict()``/``load_state_dict()``, so torchdata's ``StatefulDataLoader`` saves it as
  the dataset state.
- :func:`reshard_stream_states` turns the states of all ``W`` saved ranks into states for
  ``W'`` ranks: everything read before is never read again, and every sample or token in
  flight is handed to exactly one new rank. Pure; no communication.
- :class:`LoaderState` puts a stream (or a ``StatefulDataLoader`` over one) into a tessera
  state. Each rank's state is a :func:`per_rank` value; when the job is loaded under
  another DP size, it reads every saved rank's state from the checkpoint and takes its
  share of the resharded states.

The global stream: position ``p`` is sample ``perm(epoch)[p % N]`` of epoch ``p // N``, with
the same per-epoch permutation as :class:`DataPosition`. Under ``W`` ranks with *frontier*
``F`` (every position before it was read) and *skip* set ``S`` (positions after ``F`` already
read), the unread positions in order are ``u_0 < u_1 < ...``; rank ``r`` reads ``u_r,
u_{r+W}, u_{r+2W}, ...``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import torch
from torch.utils.data import IterableDataset, get_worker_info

from ..errors import StateMismatchError
from ..format.values import decode_value
from ..shards import OnResize, PerRank, per_rank
from .stream_state import CONFIG_KEYS, FORMAT, check_state, reshard_stream_states, unread_position

logger = logging.getLogger(__name__)

__all__ = ["FORMAT", "LoaderState", "ReshardableStream", "reshard_stream_states"]


class ReshardableStream(IterableDataset):
    """This DP rank's share of a global stream over a map-style source, resumable at any DP size.

    Iterating yields ``source[i]`` for this rank's positions of the global stream (after
    keeping ``prefetch`` samples read ahead), or with ``pack_len`` the source's samples
    (sequences of token ids) concatenated and cut into lists of ``pack_len`` tokens; the
    last one of the stream may be shorter. One pass covers all ``epochs``. Iterating again
    continues where the last pass stopped.

    The checkpoint holds positions, not samples: prefetched samples are read again from
    ``source`` on resume (it must be deterministic: ``source[i]`` always the same), while
    tokens held by the packer are stored as they are (plain ints).

    Thread-safety: one consumer. With a ``DataLoader``, use ``num_workers=0`` (a worker
    process would hold a copy whose position the main process never sees).

    Args:
        source: a map-style dataset (``len()`` and ``[i]``).
        rank: this rank's index among the data-parallel ranks (default: the
            ``torch.distributed`` rank, else 0).
        world_size: the number of data-parallel ranks (default: the
            ``torch.distributed`` world size, else 1).
        seed: the seed of the per-epoch permutations.
        shuffle: permute each epoch (else read in order).
        epochs: epochs in the stream (None: endless).
        prefetch: samples kept read ahead of the one being consumed.
        pack_len: pack tokens into sequences of this length (None: yield samples as they are).

    Example:
        >>> stream = tessera.adapters.ReshardableStream(docs, rank=dp_rank, world_size=dp_size, pack_len=2048)
        >>> state = {"model": tessera.ModelState(model), "data": tessera.adapters.LoaderState(stream)}
    """

    def __init__(
        self,
        source: Sequence[Any],
        *,
        rank: int | None = None,
        world_size: int | None = None,
        seed: int = 0,
        shuffle: bool = True,
        epochs: int | None = 1,
        prefetch: int = 0,
        pack_len: int | None = None,
    ) -> None:
        if rank is None or world_size is None:
            initialized = torch.distributed.is_available() and torch.distributed.is_initialized()
            rank = (torch.distributed.get_rank() if initialized else 0) if rank is None else rank
            world_size = (
                (torch.distributed.get_world_size() if initialized else 1) if world_size is None else world_size
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} must be in [0, {world_size})")
        if prefetch < 0 or (pack_len is not None and pack_len < 1) or (epochs is not None and epochs < 0):
            raise ValueError(f"prefetch ({prefetch}) and epochs ({epochs}) must be >= 0, pack_len ({pack_len}) >= 1")
        self.source = source
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.epochs = epochs
        self.prefetch = prefetch
        self.pack_len = pack_len
        self._frontier = 0
        self._skip: list[int] = []
        self._cursor = 0
        self._prefetched: list[int] = []  # positions read but not yet consumed
        self._packed: list[list[Any]] = []  # [position, tokens not yet emitted] per document
        self._perm: tuple[int, torch.Tensor] | None = None

    # -- the global stream --------------------------------------------------------------

    @property
    def total(self) -> int | None:
        """Positions in the whole stream (None: endless)."""
        return None if self.epochs is None else self.epochs * len(self.source)

    def index(self, position: int) -> int:
        """The source index at global ``position``."""
        n = len(self.source)
        epoch, i = divmod(position, n)
        if not self.shuffle:
            return i
        if self._perm is None or self._perm[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = (epoch, torch.randperm(n, generator=g))
        return int(self._perm[1][i])

    def _read(self) -> int | None:
        """Read this rank's next position, or None at the end of the stream."""
        p = unread_position(self._frontier, self._skip, self.rank + self._cursor * self.world_size)
        if self.total is not None and p >= self.total:
            return None
        self._cursor += 1
        return p

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        if info is not None and info.num_workers > 1:
            raise RuntimeError(
                "ReshardableStream in a DataLoader with num_workers > 1: every worker would read the same "
                "positions and the main process could not checkpoint them; use num_workers=0"
            )
        if len(self.source) == 0:
            return
        while True:
            item = self._next_sample() if self.pack_len is None else self._next_pack()
            if item is None:
                return
            yield item

    def _fill(self) -> bool:
        """Keep ``prefetch`` + 1 samples read ahead; whether any is there."""
        while len(self._prefetched) <= self.prefetch:
            p = self._read()
            if p is None:
                break
            self._prefetched.append(p)
        return bool(self._prefetched)

    def _next_sample(self) -> Any:
        if not self._fill():
            return None
        # State is updated before the sample is handed out: a checkpoint taken after it was
        # consumed must not hold it.
        return self.source[self.index(self._prefetched.pop(0))]

    def _next_pack(self) -> list[int] | None:
        assert self.pack_len is not None
        while sum(len(t) for _, t in self._packed) < self.pack_len and self._fill():
            p = self._prefetched.pop(0)
            tokens = self.source[self.index(p)]
            tokens = tokens.tolist() if isinstance(tokens, torch.Tensor) else [int(t) for t in tokens]
            if tokens:
                self._packed.append([p, tokens])
        out: list[int] = []
        while self._packed and len(out) < self.pack_len:
            p, tokens = self._packed[0]
            take = self.pack_len - len(out)
            out += tokens[:take]
            if take >= len(tokens):
                self._packed.pop(0)
            else:
                self._packed[0] = [p, tokens[take:]]
        return out or None

    # -- state ---------------------------------------------------------------------------

    def in_flight(self) -> tuple[list[int], list[int]]:
        """Positions prefetched but not consumed, and tokens held by the packer."""
        return list(self._prefetched), [t for _, toks in self._packed for t in toks]

    def state_dict(self) -> dict[str, Any]:
        """This rank's state: config, its schedule and cursor, what it holds in flight (plain values)."""
        return {
            "format": FORMAT,
            "source_len": len(self.source),
            "seed": self.seed,
            "shuffle": self.shuffle,
            "epochs": self.epochs,
            "pack_len": self.pack_len,
            "world_size": self.world_size,
            "rank": self.rank,
            "frontier": self._frontier,
            "skip": list(self._skip),
            "cursor": self._cursor,
            "prefetched": list(self._prefetched),
            "packed": [[p, list(t)] for p, t in self._packed],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from a state saved by this rank (same DP size and rank).

        Raises:
            StateMismatchError: for a state of another stream, rank or DP size (reshard it
                with :func:`reshard_stream_states`, which :class:`LoaderState` does for you).
        """
        check_state(state_dict, 0)
        mine = self.state_dict()
        for k in (*CONFIG_KEYS, "world_size", "rank"):
            if state_dict[k] != mine[k]:
                raise StateMismatchError(
                    f"data stream of rank {self.rank}/{self.world_size}: saved {k}={state_dict[k]!r}, this stream has "
                    f"{mine[k]!r}"
                    + (
                        "; a state of another DP size must be resharded (tessera.adapters.LoaderState does it)"
                        if k in ("world_size", "rank")
                        else ""
                    )
                )
        self._frontier = int(state_dict["frontier"])
        self._skip = sorted(int(s) for s in state_dict["skip"])
        self._cursor = int(state_dict["cursor"])
        self._prefetched = [int(p) for p in state_dict["prefetched"]]
        self._packed = [[int(p), [int(t) for t in toks]] for p, toks in state_dict["packed"]]


class StatefulLoader(Protocol):
    """What :class:`LoaderState` needs of a loader: a :class:`ReshardableStream`, or torchdata's
    ``StatefulDataLoader`` over one."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class LoaderState:
    """A data stream in a tessera state, loadable under another data-parallel size.

    Wraps a :class:`ReshardableStream`, or a torchdata ``StatefulDataLoader`` (with
    ``num_workers=0``) over one. Each rank saves its own state as a :func:`per_rank` value.
    Loaded under the same DP size, each rank continues exactly where it stopped; under
    another, every rank reads all saved ranks' states from the checkpoint (they are small:
    positions and packer tokens) and takes its share of :func:`reshard_stream_states`.

    Not collective by itself: it goes into the state passed to ``tessera.save`` and
    ``tessera.load`` on every rank. Processes that share a DP rank (the tensor-parallel
    ranks of one replica) save identical states, which count once; such a job may also be
    resumed under another number of processes with the same DP size.

    Args:
        loader: a :class:`ReshardableStream` or a ``StatefulDataLoader`` whose dataset is one.

    Example:
        >>> loader = StatefulDataLoader(tessera.adapters.ReshardableStream(docs, pack_len=2048), batch_size=8)
        >>> tessera.save(path, {"model": tessera.ModelState(model), "data": tessera.adapters.LoaderState(loader)})
    """

    def __init__(self, loader: StatefulLoader) -> None:
        stream = loader if isinstance(loader, ReshardableStream) else getattr(loader, "dataset", None)
        if not isinstance(stream, ReshardableStream):
            raise TypeError(
                f"LoaderState takes a ReshardableStream or a StatefulDataLoader over one, not {type(loader).__name__}"
            )
        workers = getattr(loader, "num_workers", 0)
        if stream is not loader and workers:
            raise ValueError("LoaderState: the StatefulDataLoader must use num_workers=0 (see ReshardableStream)")
        self.loader = loader
        self.stream = stream
        self._pending: tuple[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        """This rank's loader state, marked per rank."""
        return {"state": per_rank(self.loader.state_dict(), on_resize=OnResize.MODULO)}

    def prepare_load(self, manifest: Any, fqn: str) -> None:
        """Before a load (called by ``tessera.load``): pick this rank's state, resharding if needed.

        Every saving process's state is in the manifest. Processes that share a DP rank (e.g.
        the tensor-parallel ranks of one DP replica) hold identical states and count once.
        """
        self._pending = None
        entry = manifest.per_rank.get(f"{fqn}.state")
        if entry is None:
            return  # tessera.load reports the missing key
        saved = [decode_value(v, f"{fqn}.state") for v in entry.values]
        by_rank: dict[int, tuple[Any, dict[str, Any]]] = {}
        for i, value in enumerate(saved):
            stream = _stream_state(value)
            check_state(stream, i)
            seen = by_rank.setdefault(int(stream["rank"]), (value, stream))
            if seen[1] != stream:
                raise StateMismatchError(
                    f"'{fqn}': two saving processes hold different states for data-parallel rank {stream['rank']}"
                )
        ranks = sorted(by_rank)
        saved_world = int(by_rank[ranks[0]][1]["world_size"])
        if saved_world == self.stream.world_size and ranks == list(range(saved_world)):
            self._pending = ("same", by_rank[self.stream.rank][0])  # the rank's own state, whoever saved it
            return
        states = [by_rank[r][1] for r in ranks]
        self._pending = ("resharded", reshard_stream_states(states, self.stream.world_size)[self.stream.rank])
        logger.info(
            "data stream saved by %d DP ranks resharded for DP rank %d of %d",
            saved_world,
            self.stream.rank,
            self.stream.world_size,
        )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take the loaded state (this rank's own, or its share of the resharded states).

        Raises:
            StateMismatchError: for a state saved under another DP size when the load did not
                go through ``tessera.load`` (which reshards it).
        """
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] == "resharded":
            self.stream.load_state_dict(pending[1])
            if self.loader is not self.stream:
                self.loader.load_state_dict({})  # a fresh iterator, continuing from the stream's state
            return
        if pending is not None:
            value = pending[1]
        else:
            value = state_dict["state"]
            value = value.value if isinstance(value, PerRank) else value
        stream_state = _stream_state(value)
        if isinstance(stream_state, dict) and stream_state.get("world_size") != self.stream.world_size:
            raise StateMismatchError(
                f"data stream of rank {self.stream.rank}: the state was saved by {stream_state.get('world_size')} ranks, "
                f"this job has {self.stream.world_size}; load it with tessera.load, which reshards it"
            )
        self.loader.load_state_dict(value)


def _stream_state(value: Any) -> Any:
    """The stream's state inside a saved value: the value itself, or a loader's ``dataset_state``."""
    if isinstance(value, dict) and "format" not in value and "dataset_state" in value:
        return value["dataset_state"]
    return value
