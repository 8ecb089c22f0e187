"""Where a node's tiles live: node indices, node directories and the replica ring.

Pure functions of the job's shape (no I/O, no communication). The placement is decided once
per job shape and cached by :class:`~tessera.manager.local_tier.tier.LocalTier`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

NODE_FIELD = "{node}"


def node_index(rank: int | None = None) -> int:
    """This process's node index, from torchrun's environment.

    ``GROUP_RANK`` if set (torchrun's node rank), else ``RANK // LOCAL_WORLD_SIZE``, else 0.

    Args:
        rank: the global rank to use instead of ``RANK`` (e.g. ``torch.distributed.get_rank()``).

    Example:
        >>> os.environ.update(GROUP_RANK="3"); node_index()
        3
    """
    group_rank = os.environ.get("GROUP_RANK")
    if group_rank not in (None, ""):
        return int(group_rank)
    local_world = os.environ.get("LOCAL_WORLD_SIZE")
    if rank is None:
        env_rank = os.environ.get("RANK")
        rank = int(env_rank) if env_rank not in (None, "") else None
    if rank is None or local_world in (None, ""):
        return 0
    return rank // max(1, int(local_world))


def node_dir(local_dir: str, node: int) -> str:
    """``local_dir`` with ``{node}`` replaced by ``node``.

    Example:
        >>> node_dir("/dev/shm/tessera-{node}", 2)
        '/dev/shm/tessera-2'
    """
    return local_dir.replace(NODE_FIELD, str(node))


@dataclass(frozen=True)
class Placement:
    """Which ranks keep copies of each rank's files.

    Attributes:
        node_of: the node index of each rank (indexed by rank in the process group).
        nodes: each node's ranks, in rank order.
        targets: per rank, the ranks (on other nodes) that keep a copy of its files.
    """

    node_of: tuple[int, ...]
    nodes: dict[int, tuple[int, ...]]
    targets: tuple[tuple[int, ...], ...]

    def leader(self, node: int) -> int:
        """The rank that writes a node's shared files (manifest, commit marker): its lowest."""
        return self.nodes[node][0]


def place(node_of: Sequence[int], replicas: int) -> Placement:
    """A ring over nodes: rank ``j`` of node ``i`` copies its files to rank ``j`` (modulo
    the node's size) of nodes ``i+1 .. i+replicas``.

    Copies go only to other nodes, so no two copies of a tile share a node; with fewer
    nodes than ``replicas + 1`` each node keeps at most one copy of a tile (fewer replicas).

    Args:
        node_of: the node index of each rank.
        replicas: copies wanted per rank's files on other nodes (0: none).

    Example:
        >>> place([0, 0, 1, 1], 1).targets
        ((2,), (3,), (0,), (1,))
    """
    nodes: dict[int, list[int]] = {}
    for rank, node in enumerate(node_of):
        nodes.setdefault(int(node), []).append(rank)
    order = sorted(nodes)
    position = {node: i for i, node in enumerate(order)}
    copies = max(0, min(int(replicas), len(order) - 1))
    targets = []
    for rank, node in enumerate(node_of):
        local = nodes[node].index(rank)
        i = position[node]
        mine = []
        for k in range(1, copies + 1):
            members = nodes[order[(i + k) % len(order)]]
            mine.append(members[local % len(members)])
        targets.append(tuple(mine))
    return Placement(tuple(int(n) for n in node_of), {n: tuple(r) for n, r in nodes.items()}, tuple(targets))
