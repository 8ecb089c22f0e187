"""``tessera trace``: per-rank, per-phase timings, stragglers, Chrome trace and PNG timeline."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
from typing import TYPE_CHECKING, Any

from ..tools import UsageError
from .render import EXIT_OK, EXIT_PROBLEMS, fmt_size, to_json

if TYPE_CHECKING:
    from rich.console import Console

    from ..tools.trace import RankTiming, Straggler


def cmd_trace(args: argparse.Namespace, out: Console) -> int:
    """``tessera trace PATH``: per-rank phase tables, stragglers, Chrome trace and PNG timeline."""
    from ..api import read_manifest
    from ..tools import trace

    m = read_manifest(args.path)
    sources = trace.timing_sources(args.path, m)
    if not sources:
        out.print(
            f"{args.path}: no per-rank timings recorded (no save timings in the manifest, no timings/load-*.json)"
        )
        return EXIT_PROBLEMS
    chosen = list(sources) if args.op == "all" else [args.op]
    if args.op != "all" and args.op not in sources:
        raise UsageError(f"no timings for '{args.op}' in {args.path}; it has: {', '.join(sources)}")
    found: dict[str, list[Straggler]] = {}
    doc: dict[str, Any] = {}
    for op in chosen:
        timings, note = sources[op].timings, sources[op].note
        slow = trace.find_stragglers(timings, args.factor, args.min_gap)
        found[op] = slow
        doc[op] = {"ranks": [dataclasses.asdict(t) | {"total": t.total, "blocked": trace.blocked_seconds(op, t)} for t in timings],
                   "stragglers": [dataclasses.asdict(s) | {"factor": s.factor} for s in slow]}  # fmt: skip
        if note:
            doc[op]["source"] = note
        if not args.json:
            _trace_table(out, op, timings, slow, args.factor, args.min_gap, note)
        if args.png:
            png = args.png if len(chosen) == 1 else re.sub(r"(\.png)?$", f"-{op}.png", args.png, count=1)
            trace.plot_timeline(timings, png, title=f"tessera {op} of {args.path} ({m.save_id})", stragglers=slow)
            if not args.json:
                out.print(f"wrote timeline {png}")
    if args.chrome:
        with open(args.chrome, "w") as f:
            json.dump(trace.chrome_trace(m, [op for op in chosen if op in trace.operations(m)]), f)
        if not args.json:
            out.print(f"wrote Chrome/Perfetto trace {args.chrome} (open in ui.perfetto.dev or chrome://tracing)")
    if args.json:
        print(to_json(doc))
    any_slow = any(found.values())
    return EXIT_PROBLEMS if args.fail_on_stragglers and any_slow else EXIT_OK


def _trace_table(
    out: Console, op: str, timings: list[RankTiming], slow: list[Straggler], factor: float, min_gap: float, note: str
) -> None:
    from rich.table import Table

    from ..tools.trace import BLOCKING_PHASES, blocked_seconds

    phases = list(dict.fromkeys(p for t in timings for p in t.phases))
    blocking = BLOCKING_PHASES.get(op)
    by_rank: dict[int, list[Straggler]] = {}
    for s in slow:
        by_rank.setdefault(s.rank, []).append(s)
    title = f"{op}: {len(timings)} rank(s), seconds per phase" + (f" ({note})" if note else "")
    table = Table(title=title, title_justify="left")
    table.add_column("rank", justify="right")
    for p in phases:
        table.add_column(p + ("*" if blocking is not None and p in blocking else ""), justify="right")
    for col in ("total", "blocked", "bytes", "straggler"):
        table.add_column(col, justify="right" if col != "straggler" else "left")
    for t in timings:
        flags = ", ".join(
            f"{s.phase} {s.factor:.1f}x median (+{s.seconds - s.median:.2f}s)" for s in by_rank.get(t.rank, [])
        )
        style = "red" if flags else None
        table.add_row(
            str(t.rank), *(f"{t.phases.get(p, 0.0):.3f}" for p in phases), f"{t.total:.3f}",
            f"{blocked_seconds(op, t):.3f}", fmt_size(t.nbytes), flags, style=style,
        )  # fmt: skip
    out.print(table)
    if blocking is None:
        out.print(f"  blocked: the training loop waits for the whole {op}")
    else:
        marked = ", ".join(f"{p}*" for p in blocking)
        out.print(f"  blocked: {marked} (the stall of async_save); a synchronous save blocks for its total")
    if timings:
        worst = max(timings, key=lambda t: t.total)
        median = statistics.median(t.total for t in timings)
        rule = f"over {factor}x the median and {min_gap:g}s above it"
        out.print(
            f"  median total {median:.3f}s, slowest rank {worst.rank} ({worst.total:.3f}s); "
            + (f"{len(by_rank)} straggler rank(s) {rule}" if by_rank else f"no straggler (none {rule})")
        )
