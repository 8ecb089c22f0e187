"""Resharding the saved states of a :class:`~tessera.adapters.data.ReshardableStream` to another DP size.

Pure functions on state dicts (no stream, no communication): :func:`reshard_stream_states`
turns the states of all ``W`` saved ranks into states for ``W'`` ranks, so everything read
before is never read again and every sample or token in flight goes to exactly one new
rank. The stream itself, and how it walks the global order, is :mod:`.data`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from ..errors import StateMismatchError

logger = logging.getLogger(__name__)

__all__ = ["CONFIG_KEYS", "FORMAT", "check_state", "reshard_stream_states", "unread_position"]

FORMAT = 1
"""Version of the stream state dict."""
CONFIG_KEYS = ("source_len", "seed", "shuffle", "epochs", "pack_len")
"""State keys that describe the stream itself; every saved rank must agree on them."""


def unread_position(frontier: int, skip: list[int], j: int) -> int:
    """The ``j``-th position from ``frontier`` on that is not in ``skip`` (sorted, all >= frontier)."""
    p = frontier + j
    for s in skip:
        if s > p:
            break
        p += 1
    return p


def check_state(state: Any, i: int) -> None:
    """Raise unless ``state`` (the ``i``-th given) is a complete :class:`ReshardableStream` state of this format."""
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise StateMismatchError(
            f"data stream state {i} is not a ReshardableStream state (format {FORMAT}): {state!r:.200}"
        )
    missing = [
        k
        for k in (*CONFIG_KEYS, "world_size", "rank", "frontier", "skip", "cursor", "prefetched", "packed")
        if k not in state
    ]
    if missing:
        raise StateMismatchError(f"data stream state {i} lacks {missing}")


def reshard_stream_states(states: Sequence[dict[str, Any]], world_size: int) -> list[dict[str, Any]]:
    """States for ``world_size`` ranks that continue the stream the saved ranks were reading.

    Every position any saved rank read is never read again; every prefetched sample and
    every token held by a packer goes to exactly one new rank (dealt round-robin in position
    order). Pure and deterministic: every rank computes the same result.

    Args:
        states: the :meth:`ReshardableStream.state_dict` of every saved rank, any order.
        world_size: the new number of data-parallel ranks.

    Returns:
        One state per new rank, index ``r`` for rank ``r``.

    Raises:
        StateMismatchError: if the states are not one complete set from one stream.

    Example:
        >>> new = reshard_stream_states([s.state_dict() for s in old_streams], 3)
        >>> stream.load_state_dict(new[stream.rank])
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    for i, s in enumerate(states):
        check_state(s, i)
    if not states:
        raise StateMismatchError("no data stream states to reshard")
    first = states[0]
    old_world = int(first["world_size"])
    by_rank = {int(s["rank"]): s for s in states}
    if sorted(by_rank) != list(range(old_world)) or len(states) != old_world:
        raise StateMismatchError(
            f"data stream states of ranks {sorted(int(s['rank']) for s in states)} are not one complete set of "
            f"{old_world} ranks"
        )
    for s in states:
        for k in (*CONFIG_KEYS, "world_size", "frontier", "skip"):
            if s[k] != first[k]:
                raise StateMismatchError(
                    f"data stream states of ranks 0 and {s['rank']} differ in {k}: {first[k]!r} vs {s[k]!r}"
                )
    frontier = int(first["frontier"])
    skip = sorted(int(x) for x in first["skip"])
    cursors = [int(by_rank[r]["cursor"]) for r in range(old_world)]
    # The first unread index of the old schedule, over all ranks; everything before it was read.
    first_unread = min(r + c * old_world for r, c in enumerate(cursors))
    new_frontier = unread_position(frontier, skip, first_unread)
    ahead = {s for s in skip if s >= new_frontier}
    for r, c in enumerate(cursors):
        i0 = max(0, -(-(first_unread + 1 - r) // old_world))
        ahead.update(unread_position(frontier, skip, r + i * old_world) for i in range(i0, c))
    prefetched = sorted(int(p) for s in states for p in s["prefetched"])
    held = sorted(((int(p), [int(t) for t in toks]) for s in states for p, toks in s["packed"]), key=lambda e: e[0])
    packed = [[p, toks] for p, toks in held]
    out = []
    for r in range(world_size):
        out.append(
            {
                **{k: first[k] for k in CONFIG_KEYS},
                "format": FORMAT,
                "world_size": world_size,
                "rank": r,
                "frontier": new_frontier,
                "skip": sorted(ahead),
                "cursor": 0,
                "prefetched": prefetched[r::world_size],
                "packed": packed[r::world_size],
            }
        )
    logger.debug(
        "resharded a data stream from %d to %d ranks at frontier %d (%d read ahead)",
        old_world,
        world_size,
        new_frontier,
        len(ahead),
    )
    return out
