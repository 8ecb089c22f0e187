"""Recovery from the local tier: the newest step that can be assembled intact from what the
nodes hold, with copies that fail their checksums replaced by intact ones from peers.

One :class:`RecoveryAttempt` per :meth:`~tessera.manager.local_tier.LocalTier.recover` call. It
gathers the inventories, picks a step, fetches what each node lacks and loads. When the load
finds bytes that do not match their checksums, every node checks its copies of that step's
files, removes those that fail, and the choice is made again from what is left: a replica
held intact elsewhere is fetched in place of the bad copy; failing that, an older step is
taken. Verification costs nothing until a load fails.

Distributed contract: collective over the tier's process group; every rank takes the same
decisions (they depend only on gathered data and on errors every rank sees).
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ... import api
from ...engine import dist
from ...engine.file_checks import check_file, tiles_by_file
from ...errors import CheckpointError, CollectiveTimeoutError, CorruptCheckpointError, DistributedError
from ...format import manifest
from ...format.manifest import MANIFEST_NAME, Manifest
from ...results import LoadResult
from ...storage import FileStorage
from .fetches import choose_fetches, choose_manifest_fetches, holdings_of
from .files import as_storage_error, remove_quietly
from .inventory import MARKER_NAME, NodeInventory, choose_step, marker_bytes
from .needs import needed_files
from .parity import check_parity, rebuild
from .placement import Placement
from .stripes import ParityLayout
from .timeline import Timeline
from .transfer import run_transfers


class TierView(Protocol):
    """What recovery uses of :class:`~tessera.manager.local_tier.LocalTier` (which owns recovery,
    so recovery names the part it needs instead of importing its owner)."""

    local_dir: str
    root: str
    root_id: str | None
    timeline: Timeline | None

    def placement(self, world: dist.World) -> Placement: ...
    def inventory(self, world: dist.World) -> list[NodeInventory | None]: ...
    def step_label(self, step: int) -> str: ...
    def step_store(self, step: int, world: dist.World) -> FileStorage: ...


logger = logging.getLogger(__name__)

_UNUSABLE = frozenset({"CorruptCheckpointError", "ManifestError", "CheckpointNotFoundError"})
"""Error types that say a checkpoint's bytes are unusable (compared by name: a peer's failure
reaches the other ranks as text inside a DistributedError)."""


def is_unusable(e: BaseException) -> bool:
    """Whether a load failed because the checkpoint is unusable, identically on every rank."""
    if isinstance(e, CollectiveTimeoutError):
        return False
    if isinstance(e, DistributedError):
        return bool(e.failures) and all(str(t).split(":", 1)[0] in _UNUSABLE for t in e.failures.values())
    return type(e).__name__ in _UNUSABLE


_REBUILDS = 3
"""Parity rebuilds of one step in one recovery before a failing load excludes it."""


class _BadParity(Exception):
    """Parity blocks failed their checksums and were removed: choose the step again."""


@dataclass(frozen=True)
class Recovery:
    """What :meth:`LocalTier.recover` loaded.

    Attributes:
        step: the step loaded.
        result: its LoadResult on this rank.
        source: ``"local"`` if every node already held all its files, ``"peers"`` if files were fetched.
        peer_bytes: bytes this rank received from peers.
    """

    step: int
    result: LoadResult
    source: str
    peer_bytes: int


class RecoveryAttempt:
    """One recovery: the choice of step, fetches, the load, and repairs after a failed load.

    Args:
        tier: the local tier.
        world: the process group's view of this rank.
    """

    def __init__(self, tier: TierView, world: dist.World) -> None:
        self.tier = tier
        self.world = world
        self.placement = tier.placement(world)
        self.node = self.placement.node_of[world.rank]
        self.leader = self.placement.leader(self.node) == world.rank
        self.inventories: list[NodeInventory | None] = []
        self.excluded: set[tuple[int, str]] = set()
        self.bad: list[str] = []  # "step 5: <file> on node 0: <why>", job-wide, the same on every rank
        self.moved = 0
        self.lost: list[str] = []  # steps parity could not rebuild: what their stripes lost
        self.rebuilds: dict[tuple[int, str], int] = {}  # parity rebuilds of each step so far

    def run(
        self, state: object, kwargs: dict[str, Any], only_step: int | None, at_least: int | None
    ) -> Recovery | None:
        """Load the newest usable step; None if none can be assembled intact."""
        self.inventories = self.tier.inventory(self.world)
        # Each round either loads, or removes at least one bad copy, or excludes a step: it ends.
        while True:
            choice = choose_step(self.inventories, only_step=only_step, at_least=at_least, exclude=self.excluded)
            self._note_lost(choice, only_step, at_least)
            if choice is None:
                return None
            step, save_id = choice
            store = self.tier.step_store(step, self.world)
            try:
                m, received = self._assemble(state, step, save_id)
            except _BadParity:
                self.inventories = self.tier.inventory(self.world)
                continue
            try:
                result = api.load(self.tier.step_label(step), state, storage=store, **kwargs)
            except CheckpointError as e:
                if not is_unusable(e):
                    raise
                # A rebuild from an input that is bad is followed by one without it (the repair
                # removes it); a step rebuilt more often than that keeps failing for another reason.
                if not self._repair(step, save_id, m, e) or self.rebuilds.get((step, save_id), 0) > _REBUILDS:
                    self.excluded.add((step, save_id))
                self.inventories = self.tier.inventory(self.world)
                continue
            if self.bad and self.world.is_coordinator:
                warnings.warn(
                    f"recovered step {step} from the local tier at {self.tier.local_dir} after finding bad copies "
                    f"(removed; intact copies or an older step used instead): {'; '.join(self.bad)}",
                    RuntimeWarning,
                    stacklevel=5,
                )
            return Recovery(step, result, "peers" if self.moved else "local", received)

    def _assemble(self, state: object, step: int, save_id: str) -> tuple[Manifest | None, int]:
        """Give every node the step's manifest and the files its ranks will read; the manifest
        and the bytes this rank received."""
        world, placement, inventories = self.world, self.placement, self.inventories
        store = self.tier.step_store(step, world)
        holdings = holdings_of(inventories, step, save_id)
        if self.leader and self.node not in holdings:
            remove_quietly(os.path.join(store.root, MARKER_NAME))  # another save of this step, if any
        what = f"step {step}: fetching from peers"
        first = choose_manifest_fetches(inventories, placement, step, save_id)
        received = run_transfers(world, first, store.root, what)
        # Every node has the manifest now: the file names and sizes come from it.
        error: BaseException | None = None
        m: Manifest | None = None
        files: list[tuple[str, int]] = []
        wanted = b""
        try:
            m = manifest.decode(store.read_file(MANIFEST_NAME), source=f"{store.root}/{MANIFEST_NAME}")
            if m.save_id != save_id:
                # Another writer replaced the manifest after this step's commit (a zombie job on
                # the same local_dir): its files are not the ones the commit markers vouch for.
                raise CorruptCheckpointError(
                    f"rank {world.rank}: local step {step} in {store.root}: {MANIFEST_NAME} is of save "
                    f"{m.save_id}, but the step was committed as save {save_id}; is another job writing "
                    f"into {self.tier.local_dir}?"
                )
            files = [(f.path, f.nbytes) for f in m.files]
            # Each rank says which files its load reads (one bit per file): a node fetches only those.
            wanted = np.packbits(needed_files(state, m, rank=world.rank, world_size=world.size)).tobytes()
        except Exception as e:
            error = as_storage_error(e, f"rank {world.rank}: step {step}: reading the local manifest")
        masks = dist.exchange(world, error, wanted, what)
        needs: dict[int, set[int]] = {}
        for rank, bits in enumerate(masks):
            mask = np.unpackbits(np.frombuffer(bits, dtype=np.uint8), count=len(files)).astype(bool)
            needs.setdefault(placement.node_of[rank], set()).update(np.flatnonzero(mask).tolist())
        layout = next((h.layout for h in holdings.values() if h.layout is not None), None)
        if layout is not None and len(set().union(*(h.held for h in holdings.values()))) < len(files):
            received += self._rebuild(step, save_id, layout, files, needs)
            inventories = self.inventories = self.tier.inventory(world)
            holdings = holdings_of(inventories, step, save_id)
        transfers = choose_fetches(inventories, placement, step, save_id, files, needs)
        received += run_transfers(world, transfers, store.root, what)
        if self.leader and (self.node not in holdings or len(holdings[self.node].held) < len(files)):
            # The step keeps the epoch it was saved in (every holder's marker records the same one).
            epoch = min(h.epoch for h in holdings.values())
            marker = marker_bytes(
                self.tier.root, self.tier.root_id or "", step, save_id, files, epoch=epoch, layout=layout
            )
            store.write_atomic(MARKER_NAME, marker)
        self.moved += len(first) + len(transfers)
        logger.info(
            "rank %d: recovering step %d from the local tier (%d files fetched job-wide, %d bytes by this rank)",
            world.rank, step, len(first) + len(transfers), received,
        )  # fmt: skip
        return m, received

    def _rebuild(
        self, step: int, save_id: str, layout: ParityLayout, files: list[tuple[str, int]], needs: dict[int, set[int]]
    ) -> int:
        """Collective: check the parity blocks of the stripes that lost a stream (a bad one is
        removed and :class:`_BadParity` raised: the step is chosen again), then rebuild the lost
        streams on their nodes (or survivors) and commit the step there; the bytes received."""
        world, placement = self.world, self.placement
        store = self.tier.step_store(step, world)
        holdings = holdings_of(self.inventories, step, save_id)
        union = frozenset().union(*(h.held for h in holdings.values()))
        lost = layout.missing(union)
        stripes = {i for j in lost for i, _ in layout.stripes_of(j)}
        mine: list[tuple[str, str]] = []
        if self.leader and self.node in holdings:
            mine = check_parity(
                store.root, save_id, layout, sorted(b for b in holdings[self.node].parity if b[0] in stripes)
            )
        found = dist.all_gather(world, mine, f"step {step}: checking the parity blocks")
        new = [
            f"step {step}: {path} on node {placement.node_of[rank]}: {why}"
            for rank, items in enumerate(found)
            for path, why in items
        ]
        if new:
            if world.is_coordinator:
                logger.warning("local tier at %s: bad parity removed: %s", self.tier.local_dir, "; ".join(new))
            self.bad += new
            raise _BadParity()
        held = {n: h.held for n, h in holdings.items()}
        blocks = {n: h.parity for n, h in holdings.items()}
        host, received, error = rebuild(world, placement, layout, held, blocks, store.root, save_id, files, needs)
        what = f"step {step}: rebuilding from parity"
        dist.exchange(
            world, None if error is None else as_storage_error(error, f"rank {world.rank}: {what}"), None, what
        )
        if self.leader and self.node in host.values() and self.node not in holdings:
            epoch = min(h.epoch for h in holdings.values())
            root, root_id = self.tier.root, self.tier.root_id or ""
            store.write_atomic(
                MARKER_NAME, marker_bytes(root, root_id, step, save_id, files, epoch=epoch, layout=layout)
            )
        if world.is_coordinator:
            logger.warning(
                "local tier at %s: step %d: rebuilt the files of node(s) %s from parity (on node(s) %s)",
                self.tier.local_dir, step, [layout.order[j] for j in lost], sorted(set(host.values())),
            )  # fmt: skip
        self.moved += len(lost)
        self.rebuilds[(step, save_id)] = self.rebuilds.get((step, save_id), 0) + 1
        return received

    def _note_lost(self, choice: tuple[int, str] | None, only_step: int | None, at_least: int | None) -> None:
        """Say which newer steps with parity could not be rebuilt, and what their stripes lost."""
        newest: dict[tuple[int, str], list] = {}
        for inv in self.inventories:
            for h in inv.steps if inv is not None else ():
                if (
                    h.layout is None
                    or (only_step is not None and h.step != only_step)
                    or (choice and (h.step, h.save_id) <= choice)
                ):
                    continue
                if at_least is not None and h.step < at_least:
                    continue
                newest.setdefault((h.step, h.save_id), []).append(h)
        for (step, save_id), hs in sorted(newest.items(), reverse=True):
            layout = hs[0].layout
            assert layout is not None
            short = layout.shortfall([h.held for h in hs], [h.parity for h in hs])
            if (step, save_id) in self.excluded or not short:
                continue
            lines = [f"stripe {i} lost {', '.join(gone)}" for i, gone in short]
            line = f"step {step} cannot be rebuilt from parity ({layout.k}+{layout.m}): {'; '.join(lines)}"
            if line not in self.lost:
                self.lost.append(line)
                if self.world.is_coordinator:
                    warnings.warn(
                        f"local tier at {self.tier.local_dir}: {line}; "
                        f"{'loading step ' + str(choice[0]) if choice else 'falling back to the durable root'}",
                        RuntimeWarning,
                        stacklevel=6,
                    )

    def _repair(self, step: int, save_id: str, m: Manifest | None, error: BaseException) -> bool:
        """Collective, after loading ``step`` failed with ``error``: node leaders check every
        copy of the step's files their node holds and remove those that fail; True if any did."""
        store = self.tier.step_store(step, self.world)
        mine: list[tuple[str, str]] = []
        if self.leader and m is not None:
            tiles = tiles_by_file(m)
            for i, entry in enumerate(m.files):
                if not os.path.exists(os.path.join(store.root, entry.path)):
                    continue
                problems = check_file(store, m, entry, tiles.get(i, [])).problems
                if problems:
                    mine.append((entry.path, problems[0].message))
                    remove_quietly(os.path.join(store.root, entry.path))
        found = dist.all_gather(self.world, mine, f"step {step}: checking the local copies")
        new = [
            f"step {step}: {path} on node {self.placement.node_of[rank]}: {why}"
            for rank, items in enumerate(found)
            for path, why in items
        ]
        for line in new:  # job-wide news: logged by rank 0 only
            (logger.warning if self.world.is_coordinator else logger.debug)(
                "local tier at %s: bad copy removed: %s", self.tier.local_dir, line
            )
        self.bad += new
        if not new and self.world.is_coordinator:
            logger.warning("local step %d failed to load and no copy of its files is bad: %s", step, error)
        if not new:
            self.bad.append(f"step {step}: failed to load ({error})")
        return bool(new)

    def report(self) -> str:
        """What this attempt found, for an error when nothing loaded (empty if nothing to say)."""
        held = []
        for inv in self.inventories:
            if inv is not None and inv.steps:
                steps = ", ".join(f"{h.step} ({len(h.held)}/{h.n_files} files)" for h in inv.steps)
                held.append(f"node {inv.node}: step {steps}")
        lines = [f"the local tier at {self.tier.local_dir}:"]
        lines += ["  " + (("; ".join(held)) if held else "no committed step of this run on any node")]
        lines += [f"  bad copy: {b}" for b in self.bad]
        lines += [f"  lost: {b}" for b in self.lost]
        return "\n".join(lines)
