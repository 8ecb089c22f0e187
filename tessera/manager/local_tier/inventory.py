"""What each node's local directory holds, and the choice of the step to recover.

A node's local step is *committed* when its marker (:data:`MARKER_NAME`, written after the
step's replicas are in place) exists. The marker lists the step's files in manifest order,
so a node's holdings are summarised as indices into that list: a few bytes per file, with
no manifest to decode. :func:`choose_step` is pure and runs on every rank identically.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from ...format.names import parse_step_dirname
from .stripes import ParityLayout, parity_path
from .timeline import Timeline

logger = logging.getLogger(__name__)

MARKER_NAME = "local-commit.json"


@dataclass(frozen=True)
class StepHolding:
    """One committed local step as one node holds it.

    Attributes:
        step: the training step.
        save_id: the checkpoint's save id (two saves of one step differ here).
        n_files: how many data files the step has (the manifest's ``files``).
        held: indices into the manifest's ``files`` of those present on the node with the
            right size. The names themselves are not sent: every node learns them from the
            manifest, so a summary stays one node's size, whatever the job's.
        manifest_bytes: the size of the step's ``manifest.json`` on the node.
        epoch: the timeline epoch the step was saved in (its marker's; see :mod:`.timeline`).
        layout: the step's parity layout (``local_parity``; None: replicas or nothing).
        parity: the parity blocks ``(stripe, block)`` present on the node with the right size.
    """

    step: int
    save_id: str
    n_files: int
    held: frozenset[int]
    manifest_bytes: int = 0
    epoch: int = 0
    layout: ParityLayout | None = None
    parity: frozenset[tuple[int, int]] = frozenset()


@dataclass(frozen=True)
class NodeInventory:
    """A node's committed local steps.

    Attributes:
        node: the node index.
        steps: one entry per committed local step, newest first.
    """

    node: int
    steps: tuple[StepHolding, ...]

    def holding(self, step: int, save_id: str) -> StepHolding | None:
        """This node's holding of one step's save, or None."""
        for h in self.steps:
            if h.step == step and h.save_id == save_id:
                return h
        return None


def read_marker(step_dir: str) -> dict | None:
    """A step directory's commit marker, or None if absent or unreadable."""
    try:
        with open(os.path.join(step_dir, MARKER_NAME), "rb") as f:
            doc = json.loads(f.read())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        logger.warning("ignoring the local step at %s: unreadable %s: %s", step_dir, MARKER_NAME, e)
        return None
    return doc if isinstance(doc, dict) else None


def marker_bytes(
    root: str,
    root_id: str,
    step: int,
    save_id: str,
    files: Sequence[tuple[str, int]],
    *,
    epoch: int,
    layout: ParityLayout | None = None,
) -> bytes:
    """The content of a step's commit marker: the run's identity (``root`` and its ``root_id``),
    the timeline epoch the step was saved in, the step, its save, its files and, with
    ``local_parity``, its parity layout (with the blocks' checksums)."""
    doc: dict = {
        "root": root,
        "root_id": root_id,
        "epoch": epoch,
        "step": step,
        "save_id": save_id,
        "files": [[p, n] for p, n in files],
    }
    if layout is not None:
        doc["parity"] = layout.to_doc()
    return json.dumps(doc, separators=(",", ":")).encode()


def marker_epoch(doc: dict) -> int:
    """The timeline epoch a commit marker records (0 for markers written before epochs existed;
    -1, never admitted, for a malformed one)."""
    value = doc.get("epoch", 0)
    return value if type(value) is int and value >= 0 else -1


def owner_of(doc: dict | None, root: str, root_id: str | None, timeline: Timeline | None = None) -> str:
    """Whose step a commit marker says it is: ``"ours"`` (this root and this root id, and, if
    ``timeline`` is given, on it), ``"abandoned"`` (ours, but of a timeline the job left:
    :meth:`Timeline.admits` refuses it), ``"stale"`` (this root string but another root id, or
    none: a deleted root's or another run's), ``"foreign"`` (another root: a run sharing the
    directory) or ``"none"`` (no marker)."""
    if doc is None:
        return "none"
    if doc.get("root") != root:
        return "foreign"
    if root_id is None or doc.get("root_id") != root_id:
        return "stale"
    if timeline is not None:
        step = doc.get("step")
        if type(step) is not int or not timeline.admits(step, epoch=marker_epoch(doc)):
            return "abandoned"
    return "ours"


def local_steps(directory: str) -> list[tuple[int, str]]:
    """The step directories under a node's directory: ``(step, path)``, oldest first."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    out = [(step, os.path.join(directory, name)) for name in names if (step := parse_step_dirname(name)) is not None]
    return sorted(out)


def scan_node(
    directory: str, node: int, root: str, root_id: str | None, timeline: Timeline | None = None
) -> NodeInventory:
    """The committed local steps under a node's directory that belong to the run: those whose
    marker names ``root`` and ``root_id`` (the identity written into the durable root) and
    an epoch ``timeline`` admits (if given).

    Steps of another root, or of this root string under another root id (a deleted and
    recreated root, a previous run's leftovers in ``/dev/shm``), or of an abandoned timeline
    (a node that missed a rollback or a resume) are ignored; with ``root_id=None`` (the
    durable root has no identity: it was deleted or never saved to) no step is the run's.
    A file counts as held when it exists with the listed size.
    """
    out = []
    for step, step_dir in local_steps(directory):
        doc = read_marker(step_dir)
        if owner_of(doc, root, root_id, timeline) != "ours" or doc is None or doc.get("step") != step:
            continue
        try:
            files = tuple((str(p), int(n)) for p, n in doc["files"])
            save_id = str(doc["save_id"])
            layout = ParityLayout.from_doc(doc["parity"]) if "parity" in doc else None
            if layout is not None and len(layout.owner) != len(files):
                raise ValueError("the parity layout does not match the files")
        except (KeyError, TypeError, ValueError) as e:
            logger.warning("ignoring the local step at %s: malformed %s (%s)", step_dir, MARKER_NAME, e)
            continue
        try:
            manifest_bytes = os.stat(os.path.join(step_dir, "manifest.json")).st_size
        except OSError:
            continue
        held = set()
        for i, (path, nbytes) in enumerate(files):
            try:
                if os.stat(os.path.join(step_dir, path)).st_size == nbytes:
                    held.add(i)
            except OSError:
                pass
        parity = set()
        if layout is not None:
            for i in range(layout.n):
                for p in range(layout.m):
                    try:
                        if os.stat(os.path.join(step_dir, parity_path(save_id, i, p))).st_size == layout.block(i):
                            parity.add((i, p))
                    except OSError:
                        pass
        out.append(
            StepHolding(
                step, save_id, len(files), frozenset(held), manifest_bytes, marker_epoch(doc), layout, frozenset(parity)
            )
        )
    out.sort(key=lambda h: (h.step, h.save_id), reverse=True)
    return NodeInventory(node, tuple(out))


def choose_step(
    inventories: Sequence[NodeInventory | None],
    *,
    only_step: int | None = None,
    at_least: int | None = None,
    exclude: Collection[tuple[int, str]] = (),
) -> tuple[int, str] | None:
    """The newest ``(step, save_id)`` whose files are all held by some node, or can be rebuilt
    from parity (:meth:`ParityLayout.shortfall` is empty), or None.

    A step counts only if at least one node committed it with a manifest; its files may be
    spread over any nodes. Cost: one pass over the holdings (O(nodes x steps x files held)).

    Args:
        inventories: one per rank or per node (None entries are ignored).
        only_step: consider this step only.
        at_least: consider only steps at least this new (e.g. the newest durable step).
        exclude: ``(step, save_id)`` pairs not to consider (found unusable).

    Example:
        >>> a = NodeInventory(0, (StepHolding(5, "x", 2, frozenset({0})),))
        >>> b = NodeInventory(1, (StepHolding(5, "x", 2, frozenset({1})),))
        >>> choose_step([a, b])
        (5, 'x')
    """
    union: dict[tuple[int, str], set[int]] = {}
    count: dict[tuple[int, str], int] = {}
    parts: dict[tuple[int, str], list[StepHolding]] = {}
    for inv in inventories:
        if inv is None:
            continue
        for h in inv.steps:
            if only_step is not None and h.step != only_step:
                continue
            if at_least is not None and h.step < at_least:
                continue
            key = (h.step, h.save_id)
            if key in exclude:
                continue
            union.setdefault(key, set()).update(h.held)
            count[key] = h.n_files
            parts.setdefault(key, []).append(h)
    complete = [key for key, held in union.items() if len(held) == count[key] or rebuildable(parts[key])]
    return max(complete) if complete else None


def rebuildable(holdings: Sequence[StepHolding]) -> bool:
    """Whether the nodes' holdings of one step (with a parity layout) can rebuild what no node holds."""
    layout = next((h.layout for h in holdings if h.layout is not None), None)
    if layout is None:
        return False
    return not layout.shortfall([h.held for h in holdings], [h.parity for h in holdings])


def without(
    inventories: Sequence[NodeInventory | None], bad: Collection[tuple[int, int, str, int]]
) -> list[NodeInventory | None]:
    """``inventories`` with the files in ``bad`` (``(node, step, save_id, file index)``: copies
    that failed their checksums) no longer counted as held."""
    if not bad:
        return list(inventories)
    out: list[NodeInventory | None] = []
    for inv in inventories:
        if inv is None:
            out.append(None)
            continue
        steps = tuple(
            StepHolding(
                h.step,
                h.save_id,
                h.n_files,
                frozenset(i for i in h.held if (inv.node, h.step, h.save_id, i) not in bad),
                h.manifest_bytes,
                h.epoch,
                h.layout,
                h.parity,
            )
            for h in inv.steps
        )
        out.append(NodeInventory(inv.node, steps))
    return out
