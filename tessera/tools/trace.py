"""Where save and load time went: per-rank, per-phase timings from a checkpoint.

Every save records, per rank, the seconds each phase took and the bytes written
(``manifest.timings["save"]["ranks"][rank] = {"wait_previous": s, "plan": s, "stage": s, "write": s,
"bytes": n}``, and for ``async_save`` ``"stall"``: the seconds the call blocked);
conversions record ``"convert"`` the same way. Every load writes its per-rank timings
(``{"metadata": s, "plan": s, "read": s, "values": s, "total": s, "bytes": n}``) to
``timings/load-<UTC time>-<id>.json`` inside the checkpoint it read (see
:class:`tessera.LoadOptions`); :func:`load_records` reads them back. This module turns
them into a table with stragglers flagged, a Chrome/Perfetto trace (``chrome://tracing``,
https://ui.perfetto.dev) and a PNG timeline. Phases of a rank ran one after another, so
each rank's timeline starts at 0 and lays its phases end to end.

What blocked training: a load blocks the training loop for all of its phases; a save
blocks it for ``wait_previous`` (the save before it), ``plan``, and ``stage`` (the copy to
host memory when it blocks) or ``schedule`` (when the copy runs in the background, as
``copy``, which does not block): together the stall of ``async_save``; a synchronous save
(``tessera.save``) blocks for everything. :data:`BLOCKING_PHASES` names them.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass, field
from typing import Any

from ..format.manifest import Manifest

logger = logging.getLogger(__name__)

PHASE_ORDER = (
    "metadata",
    "wait_previous",
    "plan",
    "stage",
    "schedule",
    "copy",
    "read",
    "broadcast",
    "write",
    "values",
    "commit",
)
"""Known phases, in the order they run; other phases follow in the order recorded."""

BLOCKING_PHASES: dict[str, tuple[str, ...] | None] = {
    "save": ("wait_previous", "plan", "stage", "schedule"),
    "load": None,
    "convert": None,
}
"""Per operation, the phases during which the training loop waits (None: all of them).
For ``save`` these are the stall of ``async_save``; a synchronous save blocks throughout."""

MIN_GAP_S = 0.25
"""Default absolute gap to the median (seconds) below which no rank is called a straggler."""


@dataclass(frozen=True)
class RankTiming:
    """One rank's phases of one operation.

    Attributes:
        rank: the rank.
        phases: ``{phase: seconds}`` in the order they ran.
        nbytes: bytes the rank moved (written or read), if recorded.
    """

    rank: int
    phases: dict[str, float]
    nbytes: int = 0

    @property
    def total(self) -> float:
        return sum(self.phases.values())


@dataclass(frozen=True)
class Straggler:
    """A rank slower than the median rank by more than the chosen factor.

    Attributes:
        rank: the slow rank.
        phase: the phase (``"total"`` for the whole operation).
        seconds: the rank's time.
        median: the median over ranks.
    """

    rank: int
    phase: str
    seconds: float
    median: float

    @property
    def factor(self) -> float:
        return self.seconds / self.median if self.median > 0 else float("inf")


def operations(manifest: Manifest) -> list[str]:
    """The operations with per-rank timings in ``manifest`` (``"save"``, ``"load"``, ...)."""
    return [op for op, v in manifest.timings.items() if isinstance(v, dict) and isinstance(v.get("ranks"), dict)]


def rank_timings(manifest: Manifest, op: str = "save") -> list[RankTiming]:
    """Every rank's timings of operation ``op``, by rank.

    Raises:
        KeyError: if the manifest has no timings for ``op``.

    Example:
        >>> [t.total for t in rank_timings(tessera.read_manifest(path))]
    """
    ranks = manifest.timings.get(op, {}).get("ranks") if isinstance(manifest.timings.get(op), dict) else None
    if not isinstance(ranks, dict):
        raise KeyError(
            f"the manifest has no per-rank timings for '{op}' (it has: {', '.join(operations(manifest)) or 'none'})"
        )
    return _rank_list(ranks)


def find_stragglers(timings: list[RankTiming], factor: float = 1.5, min_gap_s: float = MIN_GAP_S) -> list[Straggler]:
    """Ranks slower than the median rank by both ``factor`` times and ``min_gap_s`` seconds.

    Checked overall and per phase. Both gaps are needed: a relative one alone flags noise
    on short operations (a rank taking 60 ms where the others took 20 ms), an absolute one
    alone flags every rank of a long save that is a few percent slow.

    Example:
        >>> find_stragglers(rank_timings(manifest), factor=2.0, min_gap_s=1.0)
    """
    if len(timings) < 2:
        return []
    out = []
    phases = ["total"] + list(dict.fromkeys(p for t in timings for p in t.phases))
    for phase in phases:
        values = {t.rank: (t.total if phase == "total" else t.phases.get(phase, 0.0)) for t in timings}
        med = statistics.median(values.values())
        for rank, v in values.items():
            if v > factor * med and v - med >= min_gap_s:
                out.append(Straggler(rank, phase, v, med))
    return out


def blocked_seconds(op: str, timing: RankTiming) -> float:
    """Seconds of ``timing`` during which the training loop waited (see :data:`BLOCKING_PHASES`).

    Example:
        >>> blocked_seconds("save", RankTiming(0, {"plan": 0.1, "stage": 0.2, "write": 3.0}))
        0.30000000000000004
    """
    phases = BLOCKING_PHASES.get(op)
    if phases is None:
        return timing.total
    return sum(v for p, v in timing.phases.items() if p in phases)


@dataclass(frozen=True)
class LoadRecord:
    """The per-rank timings of one load of a checkpoint (``timings/load-*.json``).

    Attributes:
        name: the record's path inside the checkpoint.
        created: when the load finished (UTC, ISO 8601).
        world_size: how many ranks loaded.
        timings: each rank's phases (a load records rank 0's).
    """

    name: str
    created: str
    world_size: int
    timings: list[RankTiming]
    slowest: dict[str, tuple[int, float]] = field(default_factory=dict)
    """Per phase, the slowest rank and its seconds (a load records rank 0's phases in full and,
    for the others, only this: its votes carry a few bytes per rank)."""


def _rank_list(ranks: object) -> list[RankTiming]:
    if not isinstance(ranks, dict):
        return []
    out = []
    for r, t in ranks.items():
        if not isinstance(t, dict):
            continue
        phases = {
            k: float(v) for k, v in t.items() if k not in ("bytes", "total", "stall") and isinstance(v, (int, float))
        }
        known = [p for p in PHASE_ORDER if p in phases]
        ordered = {p: phases[p] for p in known + [p for p in phases if p not in PHASE_ORDER]}
        out.append(RankTiming(int(r), ordered, int(t.get("bytes", 0) or 0)))
    return sorted(out, key=lambda t: t.rank)


def _slowest(doc: object) -> dict[str, tuple[int, float]]:
    if not isinstance(doc, dict):
        return {}
    out = {}
    for phase, v in doc.items():
        if isinstance(v, dict) and isinstance(v.get("rank"), int) and isinstance(v.get("seconds"), (int, float)):
            out[str(phase)] = (v["rank"], float(v["seconds"]))
    return out


def load_records(path: str, storage: Any = None) -> list[LoadRecord]:
    """Every recorded load of the checkpoint at ``path``, oldest first.

    Records of loads of an earlier checkpoint saved at the same path are removed by the
    save that replaced it; unreadable records are skipped (logged at DEBUG).

    Example:
        >>> [r.created for r in load_records("/ckpt/step100")]
    """
    import json

    from ..format.names import LOAD_TIMINGS_DIR
    from ..storage import storage_for

    store = storage_for(path, storage)
    out = []
    for name in sorted(n for n in store.list(LOAD_TIMINGS_DIR) if n.endswith(".json")):
        try:
            doc = json.loads(store.read_file(name))
        except (OSError, ValueError) as e:
            logger.debug("skipping load record %s: %s", name, e)
            continue
        if isinstance(doc, dict):
            timings = _rank_list(doc.get("ranks"))
            if timings:
                out.append(
                    LoadRecord(
                        name,
                        str(doc.get("created", "")),
                        int(doc.get("world_size", len(timings))),
                        timings,
                        _slowest(doc.get("slowest")),
                    )
                )
    return out


@dataclass(frozen=True)
class TimingSource:
    """Where the per-rank timings of one operation come from.

    Attributes:
        timings: each rank's phases.
        note: empty for timings in the manifest; for a load, which recorded load they are.
    """

    timings: list[RankTiming]
    note: str = ""


def timing_sources(path: str, manifest: Manifest) -> dict[str, TimingSource]:
    """The timings recorded for each operation on the checkpoint at ``path``: its save (and
    conversion) from ``manifest``, and the newest recorded load when the manifest has none.

    Example:
        >>> list(timing_sources("/ckpt/step100", tessera.read_manifest("/ckpt/step100")))  # doctest: +SKIP
        ['save', 'load']
    """
    sources = {op: TimingSource(rank_timings(manifest, op)) for op in operations(manifest)}
    records = load_records(path)
    if records and "load" not in sources:
        last = records[-1]
        earlier = f"; {len(records) - 1} earlier load(s) recorded" if len(records) > 1 else ""
        slowest = "".join(
            f"; slowest {p}: rank {r} ({t:.3f}s)" for p, (r, t) in last.slowest.items() if last.world_size > 1
        )
        sources["load"] = TimingSource(last.timings, f"the newest load, {last.created}, {last.name}{earlier}{slowest}")
    return sources


def chrome_trace(manifest: Manifest, ops: list[str] | None = None) -> dict[str, Any]:
    """A Chrome/Perfetto trace: one process per operation, one thread per rank.

    Returns:
        The JSON object (``{"traceEvents": [...], ...}``); times are in microseconds.

    Example:
        >>> json.dump(chrome_trace(tessera.read_manifest(path)), open("trace.json", "w"))
    """
    events: list[dict[str, Any]] = []
    for pid, op in enumerate(ops if ops is not None else operations(manifest)):
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": f"tessera {op}"}})
        for t in rank_timings(manifest, op):
            events.append(
                {"name": "thread_name", "ph": "M", "pid": pid, "tid": t.rank, "args": {"name": f"rank {t.rank}"}}
            )
            ts = 0.0
            for phase, seconds in t.phases.items():
                events.append({
                    "name": phase, "cat": op, "ph": "X", "pid": pid, "tid": t.rank,
                    "ts": round(ts * 1e6, 3), "dur": round(seconds * 1e6, 3),
                    "args": {"seconds": seconds, **({"bytes": t.nbytes} if phase in ("write", "read") else {})},
                })  # fmt: skip
                ts += seconds
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"save_id": manifest.save_id, "world_size": manifest.world_size},
    }


def plot_timeline(
    timings: list[RankTiming],
    out_png: str,
    *,
    title: str = "",
    stragglers: list[Straggler] | None = None,
) -> None:
    """Draw one horizontal bar per rank, split into its phases, to a PNG file.

    Straggler ranks' labels are drawn in red. Needs matplotlib (``pip install tessera[plot]``).

    Raises:
        ImportError: if matplotlib is not installed.

    Example:
        >>> t = rank_timings(manifest)
        >>> plot_timeline(t, "timeline.png", stragglers=find_stragglers(t))
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    phases = list(dict.fromkeys(p for t in timings for p in t.phases))
    colors = {p: plt.get_cmap("tab10")(i % 10) for i, p in enumerate(phases)}
    slow = {s.rank for s in stragglers or []}
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.4 * len(timings)))
    try:
        for row, t in enumerate(timings):
            start = 0.0
            for phase, seconds in t.phases.items():
                ax.barh(
                    row, seconds, left=start, color=colors[phase], label=phase if row == 0 else None, edgecolor="white"
                )
                start += seconds
        ax.set_yticks(range(len(timings)))
        ax.set_yticklabels([f"rank {t.rank}" for t in timings])
        for label, t in zip(ax.get_yticklabels(), timings):
            if t.rank in slow:
                label.set_color("red")
        ax.invert_yaxis()
        ax.set_xlabel("seconds")
        ax.set_title(title or "tessera timeline")
        handles = [plt.Rectangle((0, 0), 1, 1, color=colors[p]) for p in phases]
        ax.legend(handles, phases, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False)
        fig.tight_layout()
        fig.savefig(out_png, dpi=100)
    finally:
        plt.close(fig)
