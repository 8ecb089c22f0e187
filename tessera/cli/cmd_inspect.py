"""``tessera inspect`` and ``tessera verify``: what a path is, what a checkpoint holds, whether it is intact."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from typing import TYPE_CHECKING, Any

from ..tools import UsageError
from .render import EXIT_OK, EXIT_PROBLEMS, fmt_size, shorten, to_json, value_text

if TYPE_CHECKING:
    from rich.console import Console

    from ..tools.verification import VerifyReport


def _not_a_checkpoint(args: argparse.Namespace, out: Console, verb: str) -> int | None:
    """For a path that is not one tessera checkpoint, say what it is; None for a checkpoint.

    A manager root lists its steps (``verify`` verifies them); a Hugging Face directory is
    described; anything else gets the diagnosis ``tessera.load`` raises for it
    (:func:`~tessera.tools.describe.examine_path`). A missing path returns None: reading it
    raises the same diagnosis.
    """
    from ..tools.describe import PathKind, examine_path

    report = examine_path(args.path)
    if report.kind in (PathKind.CHECKPOINT, PathKind.MISSING, PathKind.UNKNOWN):
        return None
    if report.kind == PathKind.MANAGER_ROOT:
        return _manager_root(args, out, verify=verb == "verify")
    if report.kind == PathKind.HF:
        return _hf_directory(args, out, verb)
    out.print(report.message())
    return EXIT_PROBLEMS


def _manager_root(args: argparse.Namespace, out: Console, *, verify: bool) -> int:
    """A manager root: list its steps (``inspect``) or verify every committed one (``verify``)."""
    from rich.table import Table

    from ..tools.describe import examine_path, list_steps
    from ..tools.steps import verify_steps

    if not verify:
        steps = list_steps(args.path)
        root = examine_path(args.path)
        stale = root.pointer is not None and root.pointer not in root.steps
        if args.json:
            print(to_json({"path": args.path, "kind": "manager_root", "latest": root.pointer, "stale_latest": stale,
                           "steps": [dataclasses.asdict(s) for s in steps]}))  # fmt: skip
            return EXIT_OK
        committed = [s for s in steps if s.committed]
        out.print(root.summary)
        table = Table(title="steps", title_justify="left")
        for col in ("step", "state", "path"):
            table.add_column(col, overflow="fold", justify="right" if col == "step" else "left")
        for s in steps:
            state = ("committed" if s.committed else "incomplete (never loaded)") + (", latest" if s.latest else "")
            table.add_row(str(s.step), state, s.path)
        out.print(table)
        if committed:
            out.print(f"  details of a step: tessera inspect {committed[-1].path}")
        return EXIT_OK
    result = verify_steps(args.path, getattr(args, "step", None))
    incomplete = result.incomplete
    if args.json:
        print(to_json({"path": args.path, "kind": "manager_root", "ok": all(r.ok for _, r in result.reports),
                       "incomplete_steps": incomplete,
                       "steps": {str(s.step): verify_doc(r) for s, r in result.reports}}))  # fmt: skip
        return EXIT_OK if result.ok else EXIT_PROBLEMS
    for s, report in result.reports:
        print_verify(out, s.path, report, args.limit)
    if incomplete:
        out.print(
            f"note: incomplete step(s) {', '.join(map(str, incomplete))} (their save never committed; never loaded)"
        )
    if not result.reports:
        out.print(f"{args.path}: a checkpoint manager root with no committed step")
    else:
        verdict = "all OK" if result.ok else "PROBLEMS found"
        out.print(f"{len(result.reports)} step(s) verified under {args.path}: {verdict}")
    return EXIT_OK if result.ok else EXIT_PROBLEMS


def _hf_directory(args: argparse.Namespace, out: Console, verb: str) -> int:
    from ..tools.describe import describe_hf

    hf = describe_hf(args.path)
    if args.json:
        print(to_json({"kind": "hf", **dataclasses.asdict(hf)}))
    else:
        arch = (
            f", {'/'.join(hf.architectures)}" if hf.architectures else (f", {hf.model_type}" if hf.model_type else "")
        )
        dtypes = ", ".join(f"{n} {d}" for d, n in sorted(hf.dtypes.items()))
        out.print(
            f"{args.path}: a Hugging Face safetensors directory{arch}: {hf.tensors} tensors ({dtypes}), "
            f"{fmt_size(hf.total_bytes)} in {len(hf.files)} file(s); not a tessera checkpoint"
        )
        out.print(f"  to compare or load it with tessera: tessera convert {args.path} OUT (--prefix model. to nest it)")
    return EXIT_OK if verb == "inspect" else EXIT_PROBLEMS


def cmd_inspect(args: argparse.Namespace, out: Console) -> int:
    """``tessera inspect PATH``: a checkpoint's tensors, values and layout (or what the path is instead)."""
    from rich.table import Table
    from rich.text import Text

    other = _not_a_checkpoint(args, out, "inspect")
    if other is not None:
        return other
    from ..tools.describe import inspect_data

    data = inspect_data(args.path)
    count = len(data["tensors"])
    if args.filter:
        data["tensors"] = [t for t in data["tensors"] if re.search(args.filter, t["name"])]
    if args.json:
        print(to_json(data))
        return EXIT_OK
    out.print(Text.assemble((args.path, "bold"), f"  (tessera format v{data['format_version']})"))
    step = "" if data["step"] is None else f"   step {data['step']}"
    out.print(f"  save_id {data['save_id']}   created {data['created']}{step}   saved by {data['world_size']} rank(s)")
    out.print(
        f"  {count} tensors, {fmt_size(data['total_bytes'])} in {data['files']} file(s); "
        f"{len(data['values'])} values, {len(data['per_rank'])} per-rank values"
    )
    if data["stored_bytes"] != data["total_bytes"]:
        ratio = data["total_bytes"] / max(data["stored_bytes"], 1)
        out.print(f"  compressed: {fmt_size(data['stored_bytes'])} stored ({ratio:.2f}x)")
    out.print(f"  layout {json.dumps(data['layout'])}")
    shared = data["sharing"]
    if shared is not None:
        uses = ", ".join(
            f"{fmt_size(s['bytes'])} of {'step ' + str(s['step']) if s['step'] is not None else 'save ' + s['save_id']}"
            for s in shared["from"]
        )
        out.print(
            f"  shares tiles (dedup): {fmt_size(shared['own_bytes'])} written by this save, "
            f"{fmt_size(shared['shared_bytes'])} stored by earlier saves ({uses})"
        )
    shown = f"tensors matching '{args.filter}': {len(data['tensors'])} of {count}" if args.filter else "tensors"
    table = Table(title=shown, title_justify="left")
    for col, justify in (
        ("name", "left"),
        ("dtype", "left"),
        ("shape", "left"),
        ("tiles", "right"),
        ("bytes", "right"),
        ("stored", "right"),
    ):
        table.add_column(col, justify=justify, overflow="fold")  # type: ignore[arg-type]
    for t in sorted(data["tensors"], key=lambda t: t["name"]):
        name = t["name"] + (f" (per-rank, {t['per_rank']})" if "per_rank" in t else "")
        ratio = (
            f" ({t['bytes'] / t['stored_bytes']:.2f}x)" if t["stored_bytes"] and t["stored_bytes"] != t["bytes"] else ""
        )
        table.add_row(
            name,
            t["dtype"],
            str(t["shape"]),
            str(t["tiles"]),
            fmt_size(t["bytes"]),
            fmt_size(t["stored_bytes"]) + ratio,
        )
    out.print(table)
    if data["values"] or data["per_rank"]:
        vt = Table(title="values", title_justify="left")
        vt.add_column("name", overflow="fold")
        vt.add_column("value", overflow="fold")
        for k in sorted(data["values"]):
            vt.add_row(k, shorten(value_text(data["values"][k], k)))
        for k, v in sorted(data["per_rank"].items()):
            vt.add_row(f"{k} (per-rank, {v['on_resize']})", shorten(value_text(v["values"], k)))
        out.print(vt)
    return EXIT_OK


def verify_doc(report: VerifyReport) -> dict[str, Any]:
    doc = dataclasses.asdict(report)
    doc["ok"] = report.ok
    doc["problems"] = [{**dataclasses.asdict(p), "kind": p.kind.value} for p in report.problems]
    return doc


def print_verify(out: Console, path: str, report: VerifyReport, limit: int) -> None:
    from rich.text import Text

    head = (
        f"{report.tensors} tensors, {report.tiles} tiles, {report.files} files, "
        f"{fmt_size(report.bytes_checked)} checked in {report.seconds:.2f}s"
    )
    if report.ok:
        out.print(Text.assemble(("OK", "green"), f" {path}: {head}"))
    else:
        out.print(Text.assemble(("FAILED", "red"), f" {path}: {len(report.problems)} problem(s); {head}"))
        for p in report.problems[:limit]:  # each message names the tensor, file and rank
            out.print(Text.assemble("  ", (p.kind.value, "bold"), f": {p.message}"))
        if len(report.problems) > limit:
            out.print(f"... and {len(report.problems) - limit} more (--limit)")
    if report.unreferenced_files:
        out.print(
            f"note: {len(report.unreferenced_files)} unreferenced file(s) under data/ (left by an unfinished save; harmless)"
        )
    if report.pickled_values:
        out.print(f"note: values stored with pickle (load needs allow_pickle=True): {', '.join(report.pickled_values)}")


def cmd_verify(args: argparse.Namespace, out: Console) -> int:
    """``tessera verify PATH``: every file, header, checksum and tensor coverage (exit 1 on a problem)."""
    from ..tools.verification import verify

    other = _not_a_checkpoint(args, out, "verify")
    if other is not None:
        return other
    if args.step is not None:
        raise UsageError(f"--step applies to a checkpoint manager root; {args.path} is one checkpoint")
    report = verify(args.path)
    if args.json:
        print(to_json(verify_doc(report)))
    else:
        print_verify(out, args.path, report, args.limit)
    return EXIT_OK if report.ok else EXIT_PROBLEMS
