"""The replicated node-local tier of :class:`~tessera.CheckpointManager`.

Layout: each node has its own directory (``local_dir`` with ``{node}`` replaced)::

    <node dir>/step-00000005/
      manifest.json            the step's manifest (the same bytes on every node)
      data/<save id>/<r>-*.safetensors   the node's own ranks' files and its replicas
      parity/<save id>/<stripe>-<block>.bin   with ``local_parity``: the parity blocks it keeps
      local-commit.json        the node's commit marker (see inventory.MARKER_NAME)

A local step is saved by :func:`tessera.save` into each rank's own node directory (the
commit protocol's location check compares the template, not the node's path), then
:meth:`LocalTier.commit` hands the manifest to every node, sends each rank's files to its
replica ranks (:func:`~tessera.manager.local_tier.placement.place`) or computes the step's
parity blocks (``parity``: :mod:`~tessera.manager.local_tier.parity`), and only then lets each
node write its commit marker (which records the parity layout and checksums). Recovery (:meth:`LocalTier.recover`) gathers every node's
inventory, picks the newest complete step, fetches the missing files from peers and loads.

Distributed contract: every method is collective over the manager's process group unless
said otherwise; a LocalTier is used by one thread at a time.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ...engine import commit, dist
from ...errors import CheckpointError, StorageError
from ...format import manifest
from ...format.manifest import MANIFEST_NAME
from ...format.names import step_dirname
from ...storage import FileStorage, Storage
from .files import as_storage_error, remove_quietly
from .inventory import MARKER_NAME, NodeInventory, StepHolding, marker_bytes, scan_node
from .parity import encode as encode_parity
from .placement import Placement, node_dir, node_index, place
from .recovery import Recovery, RecoveryAttempt
from .retention import LocalRetention, remove_root_steps
from .stripes import ParityLayout, effective
from .timeline import Timeline
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


class LocalTier:
    """Node-local steps with replicas on other nodes.

    Args:
        local_dir: the node-local directory; ``{node}`` is replaced by the node index.
        root: the durable root of the run (recorded in markers, with its root id: see :attr:`root_id`).
        replicas: copies of each rank's files on other nodes.
        keep_last: committed local steps each node keeps.
        process_group: the ranks taking part.
        warn_single_node: warn when ``replicas`` cannot be honoured because the job has one node.
        parity: ``(k, m)``: parity blocks instead of replicas (``replicas`` must then be 0); see
            :mod:`~tessera.manager.local_tier.stripes` for the layout.
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
        parity: tuple[int, int] | None = None,
    ) -> None:
        self.local_dir = local_dir
        self.root = root
        self.replicas = replicas
        self.keep_last = keep_last
        self.process_group = process_group
        self.warn_single_node = warn_single_node
        self.parity = parity
        self._placement: Placement | None = None
        self._placement_key: tuple[int, int] | None = None
        self.retention = LocalRetention(root, keep_last)
        self._own_node: int | None = None
        self.root_id: str | None = None
        """The identity of the durable root (written into it when it is created, see
        :mod:`tessera.manager.identity`); each commit marker records it, and only steps whose
        marker carries it are the run's. None until the manager has read it."""
        self.timeline: Timeline | None = None
        """The run's timeline (:mod:`.timeline`), read with :attr:`root_id`: each commit marker
        records its current epoch, and only steps it admits are loaded or kept."""
        self.last_report = ""
        """What the last :meth:`recover` found, for an error when it loaded nothing."""

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
            self._own_node = self._placement.node_of[world.rank]
            if self.warn_single_node and self.replicas > 0 and len(self._placement.nodes) < 2 and world.is_coordinator:
                logger.warning("local tier at %s: one node only, so no replicas are kept", self.local_dir)
            if self.parity is not None and world.is_coordinator:
                got = effective(*self.parity, len(self._placement.nodes))
                if got != self.parity:
                    logger.warning(
                        "local tier at %s: local_parity=%s needs %d nodes; this job has %d, so it keeps %s",
                        self.local_dir, self.parity, sum(self.parity), len(self._placement.nodes),
                        f"{got[0]}+{got[1]} parity" if got[1] else "no parity (one node)",
                    )  # fmt: skip
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

    def steps_here(self, root_id: str | None, timeline: Timeline) -> list[int]:
        """The run's local steps (their marker names ``root_id``, ``timeline`` admits them) this
        node holds completely, oldest first. Not collective; the node is the placement's if
        known, else torchrun's environment's (:func:`~tessera.manager.local_tier.placement.node_index`)."""
        if root_id is None:
            return []
        node = self._own_node if self._own_node is not None else node_index(_global_rank_now())
        inv = scan_node(node_dir(self.local_dir, node), node, self.root, root_id, timeline)
        return sorted(h.step for h in inv.steps if len(h.held) == h.n_files or _own_part(h, node))

    def _is_leader(self, world: dist.World) -> bool:
        p = self.placement(world)
        return p.leader(p.node_of[world.rank]) == world.rank

    # --------------------------------------------------------------------------------
    # Save

    def before_save(self, step: int, world: dist.World) -> None:
        """Node leaders (local): un-commit ``step`` on this node before it is saved again, and
        if the node's directory has no room for one more step, delete older local steps first
        (:meth:`LocalRetention.make_room`: never the newest committed one)."""
        self.wait_deletions()
        if self._is_leader(world):
            directory = self.node_directory(world)
            remove_quietly(os.path.join(directory, step_dirname(step), MARKER_NAME))
            self.retention.make_room(directory, self.root_id, self.timeline, step)

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

        def read_manifest() -> bytes | None:
            if not world.is_coordinator:
                return None
            try:
                return store.read_file(MANIFEST_NAME)
            except Exception as e:
                raise StorageError(
                    f"step {step}: rank 0 cannot read its local manifest in {store.root}: {type(e).__name__}: {e}"
                ) from e

        def from_rank_0(gathered: dist.Gathered[bytes | None]) -> bytes | None:
            return gathered.payloads[0]

        shared = dist.collective_step(world, f"step {step}: sharing the local manifest", read_manifest, from_rank_0)
        assert shared is not None  # rank 0 read it, or the step raised on every rank
        data = shared
        m = manifest.decode(data, source=f"{store.root}/{MANIFEST_NAME}")
        node = placement.node_of[world.rank]
        leader = placement.leader(node) == world.rank

        def write_manifest() -> None:
            if leader and node != placement.node_of[0]:
                store.write_atomic(MANIFEST_NAME, data)

        dist.collective_step(world, f"step {step}: writing the local manifest", write_manifest)
        layout = None
        if self.parity is not None:
            layout = ParityLayout.build(*self.parity, placement.node_of, [(f.rank, f.nbytes) for f in m.files])
        if layout is not None:
            what = f"step {step}: computing parity"
            layout, error = encode_parity(
                world, placement, layout, store.root, m.save_id, [(f.path, f.nbytes) for f in m.files]
            )
            dist.exchange(
                world, None if error is None else as_storage_error(error, f"rank {world.rank}: {what}"), None, what
            )
        else:
            transfers = [Transfer(f.rank, t, f.path, f.nbytes) for f in m.files for t in placement.targets[f.rank]]
            run_transfers(world, transfers, store.root, f"step {step}: replicating")

        def commit_locally() -> None:
            # Steps newer than this one, or of an older save of it, belong to a timeline the job
            # left: the fork that opened this epoch refused them everywhere (see identity.begin_epoch).
            if leader:
                files = [(f.path, f.nbytes) for f in m.files]
                marker = marker_bytes(self.root, self._id(), step, m.save_id, files, epoch=self._epoch(), layout=layout)
                store.write_atomic(MARKER_NAME, marker)

        dist.collective_step(world, f"step {step}: committing the local step", commit_locally)
        if leader:
            try:
                self.apply_retention(world, step)
            except Exception as e:
                logger.warning("local retention in %s after step %d failed: %s", store.root, step, e)
        return data

    def copy_to_durable(self, step: int, data: bytes, durable: Storage, world: dist.World) -> None:
        """Collective: make the committed local ``step`` durable through the commit protocol.

        The same protocol as a save (:mod:`tessera.engine.commit`): rank 0 claims the durable path
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
                raise as_storage_error(e, f"rank {world.rank}: {what}") from e
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

    def _id(self) -> str:
        if self.root_id is None:
            raise CheckpointError(f"internal error: the local tier at {self.local_dir} has no root id")
        return self.root_id

    def _epoch(self) -> int:
        if self.timeline is None:
            raise CheckpointError(f"internal error: the local tier at {self.local_dir} has no timeline")
        return self.timeline.epoch

    def apply_retention(self, world: dist.World, newest: int) -> list[int]:
        """Node leaders: :meth:`LocalRetention.apply` on this node. Not collective."""
        return self.retention.apply(self.node_directory(world), self.root_id, self.timeline, newest)

    def remove_stale(self, world: dist.World) -> list[tuple[int, str, int]]:
        """Node leaders: delete this node's steps that are never to be loaded (another root id,
        or an abandoned timeline: :meth:`LocalRetention.stale`) and wait until they are gone;
        returns them as ``(step, kind, epoch)``. Not collective."""
        directory = self.node_directory(world)
        stale = self.retention.stale(directory, self.root_id, self.timeline)
        self.retention.delete(directory, [s for s, _, _ in stale])
        self.retention.wait()
        return stale

    def remove_all(self, world: dist.World) -> list[int]:
        """Node leaders: :func:`remove_root_steps` on this node's directory. Not collective."""
        self.retention.wait()
        return remove_root_steps(self.node_directory(world), self.root)

    def wait_deletions(self) -> None:
        """Wait for the background deletion of old local steps, if one runs. Not collective."""
        self.retention.wait()

    # --------------------------------------------------------------------------------
    # Recovery

    def inventory(self, world: dist.World) -> list[NodeInventory | None]:
        """Collective: every rank's node inventory (node leaders report, others send None)."""
        placement = self.placement(world)
        node = placement.node_of[world.rank]
        mine = (
            scan_node(self.node_directory(world), node, self.root, self.root_id, self.timeline)
            if self._is_leader(world)
            else None
        )
        return dist.all_gather(world, mine, "gathering the local tier's inventory")

    def recover(
        self,
        state: object,
        world: dist.World,
        kwargs: dict[str, Any],
        only_step: int | None,
        at_least: int | None = None,
    ) -> Recovery | None:
        """Collective: load the newest step that can be assembled intact from what the nodes
        hold (and not older than ``at_least``), fetching missing or corrupt files from peers;
        None if there is no such step (:attr:`last_report` then says what was found).

        Raises:
            CheckpointError: what fetching or loading failed with (the same type on every rank).
        """
        self.wait_deletions()
        attempt = RecoveryAttempt(self, world)
        try:
            return attempt.run(state, kwargs, only_step, at_least)
        finally:
            self.last_report = attempt.report()


def _own_part(h: StepHolding, node: int) -> bool:
    """Whether a node holds its own files of a step with parity (the rest is on other nodes)."""
    if h.layout is None or node not in h.layout.order:
        return False
    return set(h.layout.files_of(h.layout.order.index(node))) <= h.held


def _global_rank(world: dist.World) -> int | None:
    if not world.distributed:
        return None
    import torch.distributed as tdist

    return tdist.get_global_rank(world.group, world.rank)


def _global_rank_now() -> int | None:
    """This process's global rank, or None without ``torch.distributed``."""
    import torch.distributed as tdist

    return tdist.get_rank() if tdist.is_available() and tdist.is_initialized() else None
