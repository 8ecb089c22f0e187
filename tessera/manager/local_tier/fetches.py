"""Which files move between nodes when a step is recovered: pure functions of the gathered
inventories, so every rank computes the same transfers without communicating."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from ...format.manifest import MANIFEST_NAME
from .inventory import NodeInventory, StepHolding
from .placement import Placement
from .transfer import Transfer


def choose_manifest_fetches(
    inventories: Sequence[NodeInventory | None], placement: Placement, step: int, save_id: str
) -> list[Transfer]:
    """The manifest of ``(step, save_id)`` for each node of ``placement`` that lacks it, from
    the first node holding it (its leader to the node's leader). Pure and deterministic."""
    holdings = holdings_of(inventories, step, save_id)
    if not holdings:
        return []
    src = min(holdings)
    return [
        Transfer(placement.leader(src), placement.leader(node), MANIFEST_NAME, holdings[src].manifest_bytes)
        for node in sorted(placement.nodes)
        if node not in holdings
    ]


def choose_fetches(
    inventories: Sequence[NodeInventory | None],
    placement: Placement,
    step: int,
    save_id: str,
    files: Sequence[tuple[str, int]],
    needs: Mapping[int, Iterable[int]] | None = None,
) -> list[Transfer]:
    """The data files (``files``: the manifest's, in order) each node needs but lacks, and
    who sends them.

    Args:
        needs: per node, the indices of the files its ranks will read (None: every file).

    Pure and deterministic (every rank computes the same list). Each missing file comes
    from one of the nodes holding it, rotating over holders and over their ranks to spread
    the load, to one of the needing node's ranks (rotating too).
    """
    holdings = holdings_of(inventories, step, save_id)
    holders_of: dict[int, list[int]] = {}
    for n in sorted(holdings):
        for i in holdings[n].held:
            holders_of.setdefault(i, []).append(n)
    out = []
    for node in sorted(placement.nodes):
        members = placement.nodes[node]
        have = holdings[node].held if node in holdings else frozenset()
        wanted = range(len(files)) if needs is None else sorted(set(needs.get(node, ())))
        for i in wanted:
            if i in have:
                continue
            path, nbytes = files[i]
            holders = holders_of[i]
            src_members = placement.nodes[holders[(i + node) % len(holders)]]
            out.append(Transfer(src_members[i % len(src_members)], members[i % len(members)], path, nbytes))
    return out


def holdings_of(inventories: Sequence[NodeInventory | None], step: int, save_id: str) -> dict[int, StepHolding]:
    """What each node holds of ``(step, save_id)``, by node index (nodes holding nothing left out)."""
    out = {}
    for inv in inventories:
        if inv is not None:
            h = inv.holding(step, save_id)
            if h is not None:
                out[inv.node] = h
    return out
