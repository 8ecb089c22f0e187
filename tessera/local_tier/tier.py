"""The replicated node-local tier of :class:`~tessera.CheckpointManager`.

Layout: each node has its own directory (``local_dir`` with ``{node}`` replaced)::

    <node dir>/step-00000005/
      manifest.json            the step's manifest (the same bytes on every node)
      data/<save id>/<r>-*.safetensors   the node's own ranks' files and its replicas
      local-commit.json        the node's commit marker (see inventory.MARKER_NAME)

A local step is saved by :func:`tessera.save` into each rank's own node directory (the
commit protocol's location check compares the template, not the node's path), then
:meth:`LocalTier.commit` hands the manifest to every node, sends each rank's files to its
replica ranks (:func:`~tessera.local_tier.placement.place`), and only then lets each node
write its commit marker. Recovery (:meth:`LocalTier.recover`) gathers every node's
inventory, picks the newest complete step, fetches the missing files from peers and loads.

Distributed contract: every method is collective over the manager's process group unless
said otherwise; a LocalTier is used by one thread at a time.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import api, commit, dist, manifest
from ..errors import CheckpointError, CorruptCheckpointError, StorageError
from ..manifest import MANIFEST_NAME
from ..results import LoadResult
from ..step_names import parse_step_dirname, step_dirname
from ..storage import FileStorage, Storage
from .fetch_plan import holdings_of, plan_fetches, plan_manifest_fetches
from .inventory import MARKER_NAME, NodeInventory, choose_step, marker_bytes, read_marker, scan_node
from .needs import needed_files
from .placement import Placement, node_dir, node_index, place
from .transfer import Transfer, run_transfers

logger = logging.getLogger(__name__)

LOCAL_PREFIX = "local-tier:"


class NodeStorage(FileStorage):
    """A node's directory for one step: a :class:`FileStorage` (no fsync: host memory) whose
    location is the same string on every node, since each node has its own directory by design."""

    def __init__(self, path: str, label: str) -> None:
        super().__init__(path, durable=False)
        self._label = label

    def location(self) -> str:
        """The node-independent name of this step of the local tier."""
        return self._label

    @property
    def all_files_visible(self) -> bool:
        """False: rank 0 sees only its own node's files; the tier checks the rest itself."""
        return False


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


class LocalTier:
    """Node-local steps with replicas on other nodes.

    Args:
        local_dir: the node-local directory; ``{node}`` is replaced by the node index.
        root: the durable root of the run (recorded in markers, so leftovers of other runs are ignored).
        replicas: copies of each rank's files on other nodes.
        keep_last: committed local steps each node keeps.
        process_group: the ranks taking part.
        warn_single_node: warn when ``replicas`` cannot be honoured because the job has one node.
    """

    def __init__(
        self,
        local_dir: str,
        root: str,
        *,
        replicas: int,
        keep_last: int,
        process_group: Any,
        warn_single_node: bool = True,
    ) -> None:
        self.local_dir = local_dir
        self.root = root
        self.replicas = replicas
        self.keep_last = keep_last
        self.process_group = process_group
        self.warn_single_node = warn_single_node
        self._placement: Placement | None = None
        self._placement_key: tuple[int, int] | None = None
        self._deleter: threading.Thread | None = None

    # --------------------------------------------------------------------------------
    # Names and layout

    def placement(self, world: dist.World) -> Placement:
        """Which node each rank is on and where its replicas go; collective on first use, then cached."""
        key = (id(world.group), world.size)
        if self._placement is None or self._placement_key != key:
            rank = _global_rank(world)
            nodes = dist.all_gather(world, node_index(rank), "gathering node indices")
            self._placement = place([int(n) for n in nodes], self.replicas)
            self._placement_key = key
            if self.warn_single_node and self.replicas > 0 and len(self._placement.nodes) < 2 and world.is_coordinator:
                logger.warning("local tier at %s: one node only, so no replicas are kept", self.local_dir)
        return self._placement

    def node_directory(self, world: dist.World) -> str:
        """This rank's node directory (not collective once the placement is known)."""
        return node_dir(self.local_dir, self.placement(world).node_of[world.rank])

    def step_label(self, step: int) -> str:
        """The name of ``step`` in the local tier, the same on every node."""
        return f"{LOCAL_PREFIX}{self.local_dir.rstrip('/')}/{step_dirname(step)}"

    def step_store(self, step: int, world: dist.World) -> NodeStorage:
        """This node's directory of ``step``."""
        return NodeStorage(os.path.join(self.node_directory(world), step_dirname(step)), self.step_label(step))

    def _is_leader(self, world: dist.World) -> bool:
        p = self.placement(world)
        return p.leader(p.node_of[world.rank]) == world.rank

    # --------------------------------------------------------------------------------
    # Save

    def before_save(self, step: int, world: dist.World) -> None:
        """Un-commit ``step`` on this node before it is saved again (node leaders; local)."""
        self.wait_deletions()
        if self._is_leader(world):
            _remove(os.path.join(self.node_directory(world), step_dirname(step), MARKER_NAME))

    def commit(self, step: int, world: dist.World) -> bytes:
        """Collective, after :func:`tessera.save` committed ``step`` into rank 0's node directory:
        give every node the manifest, send every rank's files to its replica ranks, then
        commit the step on every node and apply local retention.

        Returns:
            the manifest's bytes.

        Raises:
            StorageError: on every rank, if a file could not be read, sent or written
                (the step is then committed on no node).
        """
        placement = self.placement(world)
        store = self.step_store(step, world)
        payload: tuple[bytes | None, str | None] = (None, None)
        if world.is_coordinator:
            try:
                payload = (store.read_file(MANIFEST_NAME), None)
            except Exception as e:
                payload = (None, f"{type(e).__name__}: {e}")
        data, error = dist.broadcast(world, payload, f"step {step}: sharing the local manifest")
        if data is None:
            raise StorageError(f"step {step}: rank 0 cannot read its local manifest in {store.root}: {error}")
        m = manifest.decode(data, source=f"{store.root}/{MANIFEST_NAME}")
        node = placement.node_of[world.rank]
        leader = placement.leader(node) == world.rank
        own_error: BaseException | None = None
        if leader and node != placement.node_of[0]:
            try:
                store.write_atomic(MANIFEST_NAME, data)
            except Exception as e:
                own_error = e
        dist.exchange(world, own_error, None, f"step {step}: writing the local manifest")
        transfers = [Transfer(f.rank, t, f.path, f.nbytes) for f in m.files for t in placement.targets[f.rank]]
        run_transfers(world, transfers, store.root, f"step {step}: replicating")
        if leader:
            try:
                files = [(f.path, f.nbytes) for f in m.files]
                store.write_atomic(MARKER_NAME, marker_bytes(self.root, step, m.save_id, files))
            except Exception as e:
                own_error = e
        dist.exchange(world, own_error, None, f"step {step}: committing the local step")
        if leader:
            try:
                self.apply_retention(world, step)
            except Exception as e:
                logger.warning("local retention in %s after step %d failed: %s", store.root, step, e)
        return data

    def copy_to_durable(self, step: int, data: bytes, durable: Storage, world: dist.World) -> None:
        """Collective: make the committed local ``step`` durable through the commit protocol.

        The same protocol as a save (:mod:`tessera.commit`): rank 0 claims the durable path
        (owner marker, the manifest version it replaces), each rank uploads the files it wrote
        (created, never rewritten, under ``data/<save id>/``), rank 0 checks every file's size,
        publishes the manifest fenced against any other writer and removes what no save can
        commit any more. A failure reported by any rank removes this copy's files and raises on
        every rank; the durable root keeps its previous commit. (A failed exchange leaves them
        to the next commit at the root: it may have come after rank 0 published.)

        Raises:
            ConcurrentSaveError: another writer committed the durable path since the claim.
            CheckpointError: an upload or the commit failed (on every rank).
        """
        m = manifest.decode(data)
        store = self.step_store(step, world)
        what = f"step {step}: copying to durable storage {durable.url}"
        claim = dist.collective_step(
            world, what, lambda: None, lambda g: commit.claim(durable, m.save_id) if g.ok else None
        )
        if claim is None:
            raise CheckpointError(f"internal error: {what}: no claim")

        def upload() -> list[str]:
            uploaded: list[str] = []
            try:
                for f in m.files:
                    if f.rank == world.rank:
                        durable.write_file(f.path, [store.read_file(f.path)])
                        uploaded.append(f.path)
            except CheckpointError:
                raise
            except Exception as e:
                raise _storage_error(e, f"rank {world.rank}: {what}") from e
            return uploaded

        def publish(g: dist.Gathered[list[str]]) -> None:
            if not g.ok:
                files = [p for paths in g.payloads if paths is not None for p in paths]
                commit.abandon(durable, claim, files, durable.url)
                return
            commit.commit_manifest(durable, claim, m, durable.url)

        # A failed exchange leaves the uploads in place on ranks other than 0: they cannot tell
        # whether rank 0 published before it failed. Uncommitted, they are the files of a save
        # whose owner marker stays, which the next commit at the durable root removes.
        dist.collective_step(world, what, upload, publish)

    def apply_retention(self, world: dist.World, newest: int) -> list[int]:
        """Node leaders: delete committed local steps beyond the newest ``keep_last`` and
        uncommitted leftovers older than ``newest``; returns the steps deleted. Not collective."""
        directory = self.node_directory(world)
        committed: list[int] = []
        other: list[int] = []
        for name in os.listdir(directory):
            step = parse_step_dirname(name)
            if step is None:
                continue
            doc = read_marker(os.path.join(directory, name))
            if doc is None:
                other.append(step)
            elif doc.get("root") == self.root:
                committed.append(step)
            # else: another run's committed step (a shared local_dir): not ours to count or delete
        committed.sort()
        doomed = committed[: max(0, len(committed) - self.keep_last)]
        doomed += [s for s in other if s < newest]
        dirs = [os.path.join(directory, step_dirname(s)) for s in sorted(doomed)]
        for step_dir in dirs:
            _remove(os.path.join(step_dir, MARKER_NAME))  # un-commit first: a cut-short delete is skipped
        # Freeing the data is off the save's path: a background thread, joined before the next save.
        self.wait_deletions()
        if dirs:
            self._deleter = threading.Thread(target=_remove_dirs, args=(dirs,), name="tessera-local-retention")
            self._deleter.daemon = True
            self._deleter.start()
        return sorted(doomed)

    def wait_deletions(self) -> None:
        """Wait for the background deletion of old local steps, if one runs. Not collective."""
        deleter, self._deleter = self._deleter, None
        if deleter is not None:
            deleter.join()

    # --------------------------------------------------------------------------------
    # Recovery

    def inventory(self, world: dist.World) -> list[NodeInventory | None]:
        """Collective: every rank's node inventory (node leaders report, others send None)."""
        placement = self.placement(world)
        node = placement.node_of[world.rank]
        mine = scan_node(self.node_directory(world), node, self.root) if self._is_leader(world) else None
        return dist.all_gather(world, mine, "gathering the local tier's inventory")

    def recover(
        self,
        state: object,
        world: dist.World,
        kwargs: dict[str, Any],
        only_step: int | None,
        at_least: int | None = None,
    ) -> Recovery | None:
        """Collective: load the newest step the surviving nodes hold completely (and not older
        than ``at_least``), fetching missing files from peers; None if there is no such step.

        Raises:
            CheckpointError: what fetching or loading failed with (the same type on every rank).
        """
        self.wait_deletions()
        placement = self.placement(world)
        inventories = self.inventory(world)
        choice = choose_step(inventories, only_step=only_step, at_least=at_least)
        if choice is None:
            return None
        step, save_id = choice
        node = placement.node_of[world.rank]
        leader = placement.leader(node) == world.rank
        store = self.step_store(step, world)
        holdings = holdings_of(inventories, step, save_id)
        if leader and node not in holdings:
            _remove(os.path.join(store.root, MARKER_NAME))  # another save of this step, if any

        what = f"step {step}: fetching from peers"
        first = plan_manifest_fetches(inventories, placement, step, save_id)
        received = run_transfers(world, first, store.root, what)
        # Every node has the manifest now: the file names and sizes come from it.
        error: BaseException | None = None
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
                    f"into {self.local_dir}?"
                )
            files = [(f.path, f.nbytes) for f in m.files]
            # Each rank says which files its load reads (one bit per file): a node fetches only those.
            wanted = np.packbits(needed_files(state, m, rank=world.rank, world_size=world.size)).tobytes()
        except Exception as e:
            error = _storage_error(e, f"rank {world.rank}: step {step}: reading the local manifest")
        masks = dist.exchange(world, error, wanted, what)
        needs: dict[int, set[int]] = {}
        for rank, bits in enumerate(masks):
            mask = np.unpackbits(np.frombuffer(bits, dtype=np.uint8), count=len(files)).astype(bool)
            needs.setdefault(placement.node_of[rank], set()).update(np.flatnonzero(mask).tolist())
        transfers = plan_fetches(inventories, placement, step, save_id, files, needs)
        received += run_transfers(world, transfers, store.root, what)
        if leader and (node not in holdings or len(holdings[node].held) < len(files)):
            store.write_atomic(MARKER_NAME, marker_bytes(self.root, step, save_id, files))
        moved = len(first) + len(transfers)
        logger.info(
            "rank %d: recovering step %d from the local tier (%d files fetched job-wide, %d bytes by this rank)",
            world.rank, step, moved, received,
        )  # fmt: skip
        result = api.load(self.step_label(step), state, storage=store, **kwargs)
        return Recovery(step, result, "peers" if moved else "local", received)


def _global_rank(world: dist.World) -> int | None:
    if not world.distributed:
        return None
    import torch.distributed as tdist

    return tdist.get_global_rank(world.group, world.rank)


def _remove_dirs(dirs: list[str]) -> None:
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def _storage_error(e: BaseException, what: str) -> CheckpointError:
    if isinstance(e, CheckpointError):
        return e
    out = StorageError(f"{what}: {type(e).__name__}: {e}")
    out.__cause__ = e
    return out
