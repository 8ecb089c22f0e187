"""``tessera convert``, ``tessera diff`` and ``tessera rename``: printing around :mod:`tessera.tools`."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..tools import UsageError
from .render import EXIT_OK, EXIT_PROBLEMS, fmt_size, phase_progress, to_json

if TYPE_CHECKING:
    from rich.console import Console


def cmd_diff(args: argparse.Namespace, out: Console) -> int:
    """``tessera diff A B``: tables of the tensors and values that differ."""
    from rich.table import Table
    from rich.text import Text

    from ..tools.diff import diff_any

    report = diff_any(
        args.a, args.b, atol=args.atol, rtol=args.rtol, strip_a=args.strip, strip_b=args.strip_b,
        prefix=args.prefix, progress=phase_progress(args),
    )  # fmt: skip
    if args.json:
        doc = dataclasses.asdict(report)
        doc["identical"] = report.identical
        for d in doc["tensors"] + doc["values"]:
            d["kind"] = d["kind"].value
        print(to_json(doc))
        return EXIT_OK if report.identical else EXIT_PROBLEMS
    if report.tensors:
        table = Table(title="tensors that differ", title_justify="left")
        for col in ("name", "difference", "detail", "max abs", "max rel"):
            table.add_column(col, overflow="fold")
        for d in report.tensors:
            table.add_row(
                d.name, d.kind.value, d.detail,
                "" if d.max_abs is None else f"{d.max_abs:.4g}", "" if d.max_rel is None else f"{d.max_rel:.4g}",
            )  # fmt: skip
        out.print(table)
    if report.values:
        table = Table(title="values that differ", title_justify="left")
        for col in ("name", "difference", "A vs B"):
            table.add_column(col, overflow="fold")
        for d in report.values:
            table.add_row(d.name, d.kind.value, d.detail)
        out.print(table)
    verdict = (
        ("identical", "green")
        if report.identical
        else (f"{len(report.tensors)} tensor(s) and {len(report.values)} value(s) differ", "red")
    )
    out.print(Text.assemble(
        verdict, f": {report.same_tensors} tensors and {report.same_values} values equal; "
        f"{fmt_size(report.bytes_compared)} compared in {report.seconds:.2f}s"
    ))  # fmt: skip
    return EXIT_OK if report.identical else EXIT_PROBLEMS


def print_skipped(out: Console, skipped: Sequence[str], verbose: int) -> None:
    """One line per reason ("plain value", "per-rank tensor", ...), at most 3 names each; all with -v."""
    if not skipped:
        return
    if verbose:
        for s in skipped:
            out.print(f"  skipped: {s}")
        return
    reasons: dict[str, list[str]] = {}
    for s in skipped:
        m = re.match(r"^(.*) \(([^()]*)\)$", s)
        name, why = (m.group(1), m.group(2)) if m else (s, "other")
        reasons.setdefault(why, []).append(name)
    for why, names in reasons.items():
        more = f", ... and {len(names) - 3} more (-v lists them)" if len(names) > 3 else ""
        out.print(f"  skipped {len(names)} ({why}): {', '.join(names[:3])}{more}")


def cmd_convert(args: argparse.Namespace, out: Console) -> int:
    """``tessera convert SRC DST``: one line per step, then what was written."""
    from ..tools.convert import ConvertOptions, convert_checkpoint

    options = ConvertOptions(
        prefix=args.prefix, include_values=not args.no_values, allow_pickle=args.allow_pickle, tag=args.tag,
        spec=args.spec, hf_config=args.config, progress=phase_progress(args),
    )  # fmt: skip
    dst_fmt, result = convert_checkpoint(
        args.src, args.dst, src_format=args.src_format, dst_format=args.dst_format, dtype=args.dtype,
        max_shard_size=args.max_shard_size, force=args.force, options=options, notify=out.print,
    )  # fmt: skip
    out.print(
        f"wrote {result.tensors} tensors and {result.values} values ({fmt_size(result.bytes)}, {result.files} file(s)) "
        f"to {args.dst} ({dst_fmt.value}) in {result.seconds:.2f}s"
    )
    print_skipped(out, result.skipped, args.verbose)
    if dst_fmt.value == "hf" and "://" not in args.dst:
        _say_config(out, args)
    return EXIT_OK


def _say_config(out: Console, args: argparse.Namespace) -> None:
    """Whether a ``config.json`` went beside the model, and how to get one when it did not."""
    if os.path.isfile(os.path.join(args.dst, "config.json")):
        source = f"from {args.config}" if args.config else "recorded in the checkpoint"
        out.print(f"  wrote config.json ({source})")
        return
    out.print(
        "  no config.json: the checkpoint records no Hugging Face config. from_pretrained needs one: pass "
        "--config CONFIG.json (or a model directory), save with SaveOptions(metadata={'hf_config': ...}), "
        "or export from the model with tessera.save_hf"
    )


class RuleAction(argparse.Action):
    """Collects --map and --regex rules in the order given."""

    def __call__(
        self, parser: argparse.ArgumentParser, ns: argparse.Namespace, value: Any, option: str | None = None
    ) -> None:
        from ..convert.rename import RenameRule

        try:
            rule = RenameRule.parse(str(value), regex=option == "--regex")
        except ValueError as e:
            parser.error(str(e))
        rules = list(getattr(ns, "rules", None) or [])
        rules.append(rule)
        ns.rules = rules


def cmd_rename(args: argparse.Namespace, out: Console) -> int:
    """``tessera rename PATH --map/--regex``: rewrite names in the manifest only."""
    from rich.table import Table

    from ..convert.rename import rename_tensors

    if not args.rules:
        raise UsageError("give at least one --map OLD=NEW or --regex PATTERN=REPLACEMENT")
    renames = rename_tensors(args.path, args.rules, dry_run=args.dry_run)
    if not renames:
        out.print("no name matched the rules; nothing renamed")
        return EXIT_PROBLEMS
    table = Table(title=f"{'would rename' if args.dry_run else 'renamed'} {len(renames)} entries", title_justify="left")
    table.add_column("old", overflow="fold")
    table.add_column("new", overflow="fold")
    for old, new in sorted(renames.items())[: args.limit]:
        table.add_row(old, new)
    out.print(table)
    if len(renames) > args.limit:
        out.print(f"... and {len(renames) - args.limit} more")
    return EXIT_OK
