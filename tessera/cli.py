"""The ``tessera`` command: inspect, verify, diff, convert, rename and trace checkpoints.

A thin layer over the public API (:func:`tessera.verify`, :mod:`tessera.convert`,
:mod:`tessera.trace`): parse arguments, call one function, render the result with ``rich``
(or as JSON with ``--json``). Exit codes: 0 ok, 1 problems found (or the operation
failed), 2 usage error. Every verb runs in one process and works on checkpoints saved by
any number of ranks in any layout; long work shows a progress bar on a terminal.

Example:
    $ tessera inspect /ckpt/step-00000100
    $ tessera verify /ckpt/step-00000100 && tessera convert /ckpt/step-00000100 /export/hf --to hf --prefix model.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import os
import re
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from .errors import CheckpointError
from .version import __version__

# Nothing here imports torch (nor rich) at module level: `tessera --help` and `--version`
# answer at once; each command imports what it needs.
if TYPE_CHECKING:
    import torch
    from rich.console import Console

    from .convert import ConvertResult, Format
    from .trace import RankTiming, Straggler

EXIT_OK = 0
EXIT_PROBLEMS = 1
EXIT_USAGE = 2

logger = logging.getLogger(__name__)


class UsageError(Exception):
    """Arguments that do not make sense together (exit code 2)."""


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _json(doc: object) -> str:
    """Strict JSON: non-finite floats (an infinite difference, say) become the strings "inf"/"nan"."""

    def clean(x: object) -> object:
        if isinstance(x, float) and not math.isfinite(x):
            return str(x)
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x

    return json.dumps(clean(doc), indent=2, allow_nan=False, default=str)


def _short(text: str, n: int = 70) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."


@contextlib.contextmanager
def _progress(args: argparse.Namespace, what: str) -> Iterator[Callable[[int, int], None] | None]:
    """A ``(done, total)`` callback drawing a progress bar on stderr, when it is a terminal."""
    if args.no_progress or not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(what, total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)


# --------------------------------------------------------------------------------------
# inspect


def _value_text(encoded: Any, name: str) -> str:
    from .errors import ManifestError, PickleNotAllowedError
    from .values import decode_value

    try:
        return repr(decode_value(encoded, name, allow_pickle=False))
    except PickleNotAllowedError:
        return "<pickled; needs allow_pickle=True>"
    except ManifestError as e:
        return f"<invalid: {e}>"


def inspect_data(path: str) -> dict[str, Any]:
    """What ``tessera inspect --json`` prints for a checkpoint (see :func:`tessera.describe.inspect_data`)."""
    from .describe import inspect_data as describe

    return describe(path)


def _not_a_checkpoint(args: argparse.Namespace, out: Console, verb: str) -> int | None:
    """For a path that is not one tessera checkpoint, say what it is; None for a checkpoint.

    A manager root lists its steps (``verify`` verifies them); a Hugging Face directory is
    described. A missing path returns None, so the command reports it as before.
    """
    from .describe import PathKind, classify_path

    kind = classify_path(args.path)
    if kind in (PathKind.CHECKPOINT, PathKind.MISSING):
        return None
    if kind == PathKind.MANAGER_ROOT:
        return _manager_root(args, out, verify=verb == "verify")
    if kind == PathKind.HF:
        return _hf_directory(args, out, verb)
    if kind == PathKind.INCOMPLETE:
        out.print(f"{args.path}: a tessera checkpoint whose save never committed (data/ but no manifest.json); "
                  "it is never loaded and the next save to this path replaces it")  # fmt: skip
        return EXIT_PROBLEMS
    if kind == PathKind.OTHER_FORMAT:
        from .convert import detect_format

        fmt = detect_format(args.path).value
        out.print(
            f"{args.path}: a {fmt} checkpoint, not a tessera one; import it with: tessera convert {args.path} OUT"
        )
        return EXIT_PROBLEMS
    return None


def _manager_root(args: argparse.Namespace, out: Console, *, verify: bool) -> int:
    from rich.table import Table

    from .describe import list_steps

    steps = list_steps(args.path)
    chosen = steps
    if verify and getattr(args, "step", None) is not None:
        chosen = [s for s in steps if s.step == args.step]
        if not chosen:
            raise UsageError(
                f"no step {args.step} under {args.path}; it has: {', '.join(str(s.step) for s in steps) or 'none'}"
            )
    committed = [s for s in chosen if s.committed]
    if not verify:
        if args.json:
            print(_json({"path": args.path, "kind": "manager_root",
                         "steps": [dataclasses.asdict(s) for s in steps]}))  # fmt: skip
            return EXIT_OK
        out.print(
            f"{args.path}: a checkpoint manager root with {len([s for s in steps if s.committed])} committed step(s)"
        )
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
    from .verify import verify as verify_one

    results = []
    ok = True
    for s in committed:
        report = verify_one(s.path)
        ok &= report.ok
        results.append((s, report))
        if not args.json:
            _print_verify(out, s.path, report, args.limit)
    incomplete = [s.step for s in chosen if not s.committed]
    if args.json:
        print(_json({"path": args.path, "kind": "manager_root", "ok": ok, "incomplete_steps": incomplete,
                     "steps": {str(s.step): _verify_doc(r) for s, r in results}}))  # fmt: skip
    else:
        if incomplete:
            out.print(
                f"note: incomplete step(s) {', '.join(map(str, incomplete))} (their save never committed; never loaded)"
            )
        if not committed:
            out.print(f"{args.path}: a checkpoint manager root with no committed step")
        else:
            out.print(f"{len(committed)} step(s) verified under {args.path}: " + ("all OK" if ok else "PROBLEMS found"))
    return EXIT_OK if ok and committed else EXIT_PROBLEMS


def _hf_directory(args: argparse.Namespace, out: Console, verb: str) -> int:
    from .describe import describe_hf

    hf = describe_hf(args.path)
    if args.json:
        print(_json({"kind": "hf", **dataclasses.asdict(hf)}))
    else:
        arch = (
            f", {'/'.join(hf.architectures)}" if hf.architectures else (f", {hf.model_type}" if hf.model_type else "")
        )
        dtypes = ", ".join(f"{n} {d}" for d, n in sorted(hf.dtypes.items()))
        out.print(
            f"{args.path}: a Hugging Face safetensors directory{arch}: {hf.tensors} tensors ({dtypes}), "
            f"{_size(hf.total_bytes)} in {len(hf.files)} file(s); not a tessera checkpoint"
        )
        out.print(f"  to compare or load it with tessera: tessera convert {args.path} OUT (--prefix model. to nest it)")
    return EXIT_OK if verb == "inspect" else EXIT_PROBLEMS


def _cmd_inspect(args: argparse.Namespace, out: Console) -> int:
    from rich.table import Table
    from rich.text import Text

    other = _not_a_checkpoint(args, out, "inspect")
    if other is not None:
        return other
    data = inspect_data(args.path)
    count = len(data["tensors"])
    if args.filter:
        data["tensors"] = [t for t in data["tensors"] if re.search(args.filter, t["name"])]
    if args.json:
        print(_json(data))
        return EXIT_OK
    out.print(Text.assemble((args.path, "bold"), f"  (tessera format v{data['format_version']})"))
    step = "" if data["step"] is None else f"   step {data['step']}"
    out.print(f"  save_id {data['save_id']}   created {data['created']}{step}   saved by {data['world_size']} rank(s)")
    out.print(
        f"  {count} tensors, {_size(data['total_bytes'])} in {data['files']} file(s); "
        f"{len(data['values'])} values, {len(data['per_rank'])} per-rank values"
    )
    out.print(f"  layout {json.dumps(data['layout'])}")
    shown = f"tensors matching '{args.filter}': {len(data['tensors'])} of {count}" if args.filter else "tensors"
    table = Table(title=shown, title_justify="left")
    for col, justify in (
        ("name", "left"),
        ("dtype", "left"),
        ("shape", "left"),
        ("tiles", "right"),
        ("bytes", "right"),
    ):
        table.add_column(col, justify=justify, overflow="fold")  # type: ignore[arg-type]
    for t in sorted(data["tensors"], key=lambda t: t["name"]):
        name = t["name"] + (f" (per-rank, {t['per_rank']})" if "per_rank" in t else "")
        table.add_row(name, t["dtype"], str(t["shape"]), str(t["tiles"]), _size(t["bytes"]))
    out.print(table)
    if data["values"] or data["per_rank"]:
        vt = Table(title="values", title_justify="left")
        vt.add_column("name", overflow="fold")
        vt.add_column("value", overflow="fold")
        for k in sorted(data["values"]):
            vt.add_row(k, _short(_value_text(data["values"][k], k)))
        for k, v in sorted(data["per_rank"].items()):
            vt.add_row(f"{k} (per-rank, {v['on_resize']})", _short(_value_text(v["values"], k)))
        out.print(vt)
    return EXIT_OK


# --------------------------------------------------------------------------------------
# verify


def _verify_doc(report: Any) -> dict[str, Any]:
    doc = dataclasses.asdict(report)
    doc["ok"] = report.ok
    doc["problems"] = [{**dataclasses.asdict(p), "kind": p.kind.value} for p in report.problems]
    return doc


def _print_verify(out: Console, path: str, report: Any, limit: int) -> None:
    from rich.text import Text

    head = (
        f"{report.tensors} tensors, {report.tiles} tiles, {report.files} files, "
        f"{_size(report.bytes_checked)} checked in {report.seconds:.2f}s"
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


def _cmd_verify(args: argparse.Namespace, out: Console) -> int:
    from .verify import verify

    other = _not_a_checkpoint(args, out, "verify")
    if other is not None:
        return other
    if args.step is not None:
        raise UsageError(f"--step applies to a checkpoint manager root; {args.path} is one checkpoint")
    report = verify(args.path)
    if args.json:
        print(_json(_verify_doc(report)))
    else:
        _print_verify(out, args.path, report, args.limit)
    return EXIT_OK if report.ok else EXIT_PROBLEMS


# --------------------------------------------------------------------------------------
# diff


def _cmd_diff(args: argparse.Namespace, out: Console) -> int:
    from rich.table import Table
    from rich.text import Text

    from . import convert as cv
    from .convert.compare import diff_checkpoints

    with contextlib.ExitStack() as stack:
        paths = []
        for side in (args.a, args.b):
            try:
                fmt = cv.detect_format(side)
            except ValueError as e:
                raise UsageError(str(e)) from e
            if fmt != cv.Format.TESSERA:
                # Another format (an HF export, a torch.save file...): read it through a
                # temporary tessera checkpoint, names as they are.
                tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix=".tessera-diff-"))
                _import(args, fmt, side, os.path.join(tmp, "ckpt"), None, None)
                side = os.path.join(tmp, "ckpt")
            paths.append(side)
        with _progress(args, "comparing") as cb:
            report = diff_checkpoints(
                paths[0], paths[1], atol=args.atol, rtol=args.rtol, progress=cb,
                strip_a=args.strip, strip_b=args.strip_b, prefix=args.prefix,
            )  # fmt: skip
        report = dataclasses.replace(report, a=args.a, b=args.b)
    if args.json:
        doc = dataclasses.asdict(report)
        doc["identical"] = report.identical
        for d in doc["tensors"] + doc["values"]:
            d["kind"] = d["kind"].value
        print(_json(doc))
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
        f"{_size(report.bytes_compared)} compared in {report.seconds:.2f}s"
    ))  # fmt: skip
    return EXIT_OK if report.identical else EXIT_PROBLEMS


# --------------------------------------------------------------------------------------
# convert


def _check_output(args: argparse.Namespace, fmt: Format) -> None:
    """Refuse to write into an existing, non-empty output unless ``--force``; with it, make room.

    A tessera destination is replaced atomically by the save itself; any other output
    (a file, an HF or DCP directory) is removed first, so no stale file mixes in.
    """
    from . import convert as cv

    dst = args.dst
    if "://" in dst:
        return  # object stores: the exporters replace their own files
    exists = os.path.isfile(dst) or (os.path.isdir(dst) and bool(os.listdir(dst)))
    if not exists:
        return
    if not args.force:
        raise UsageError(f"{dst} exists and is not empty; pass --force to replace it")
    if fmt == cv.Format.TESSERA:
        return
    if os.path.isdir(dst):
        from .describe import PathKind, classify_path

        if classify_path(dst) in (PathKind.CHECKPOINT, PathKind.MANAGER_ROOT):
            raise UsageError(
                f"{dst} holds tessera checkpoints; refusing to delete them to write {fmt.value} (choose another output)"
            )
        shutil.rmtree(dst)
    else:
        os.remove(dst)


def _hf_prefix(args: argparse.Namespace, src: str, out: Console) -> str | None:
    """The prefix to export to Hugging Face: ``--prefix``, or the detected model prefix."""
    if args.prefix is not None:
        return args.prefix
    from .api import read_manifest
    from .describe import detect_model_prefix

    names = list(read_manifest(src).tensors)
    prefix, why = detect_model_prefix(names)
    if prefix is None:
        raise UsageError(f"--to hf exports a model; {why}")
    out.print(f"exporting the model only: {why} (--prefix chooses another)" if prefix else f"note: {why}")
    return prefix


def _print_skipped(out: Console, skipped: Sequence[str], verbose: int) -> None:
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


def _cmd_convert(args: argparse.Namespace, out: Console) -> int:
    from . import convert as cv
    from .convert._common import parse_dtype, parse_size

    try:
        src_fmt = cv.Format(args.src_format) if args.src_format else cv.detect_format(args.src)
    except ValueError as e:
        raise UsageError(str(e)) from e
    dst_fmt = cv.Format(args.dst_format) if args.dst_format else cv.Format.TESSERA
    if src_fmt == dst_fmt:
        raise UsageError(f"source and destination are both {src_fmt.value}; choose another format with --to")
    try:
        dtype = parse_dtype(args.dtype) if args.dtype else None
        shard = parse_size(args.max_shard_size)
    except ValueError as e:
        raise UsageError(str(e)) from e
    if os.path.abspath(args.src) == os.path.abspath(args.dst):
        raise UsageError("the source and the destination are the same path")
    _check_output(args, dst_fmt)
    if src_fmt != cv.Format.TESSERA and dst_fmt != cv.Format.TESSERA:
        # Two steps through a temporary tessera checkpoint next to the destination (or in the
        # system's temporary directory when the destination is a URL).
        parent = None if "://" in args.dst else os.path.dirname(os.path.abspath(args.dst))
        if parent:
            os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".tessera-convert-", dir=parent)
        try:
            first = _import(args, src_fmt, args.src, tmp, None, None)
            out.print(f"read {first.tensors} tensors from {args.src} ({src_fmt.value})")
            prefix = _hf_prefix(args, tmp, out) if dst_fmt == cv.Format.HF else args.prefix
            result = _export(args, dst_fmt, tmp, args.dst, dtype, shard, prefix)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    elif src_fmt == cv.Format.TESSERA:
        prefix = _hf_prefix(args, args.src, out) if dst_fmt == cv.Format.HF else args.prefix
        result = _export(args, dst_fmt, args.src, args.dst, dtype, shard, prefix)
    else:
        result = _import(args, src_fmt, args.src, args.dst, dtype, args.prefix)
    out.print(
        f"wrote {result.tensors} tensors and {result.values} values ({_size(result.bytes)}, {result.files} file(s)) "
        f"to {args.dst} ({dst_fmt.value}) in {result.seconds:.2f}s"
    )
    _print_skipped(out, result.skipped, args.verbose)
    return EXIT_OK


def _export(
    args: argparse.Namespace, fmt: Format, src: str, dst: str, dtype: torch.dtype | None, shard: int, prefix: str | None
) -> ConvertResult:
    from . import convert as cv

    with _progress(args, f"writing {fmt.value}") as cb:
        if fmt == cv.Format.HF:
            return cv.export_hf(src, dst, max_shard_size=shard, dtype=dtype, prefix=prefix, progress=cb)
        if fmt == cv.Format.TORCH:
            return cv.export_torch_save(
                src, dst, dtype=dtype, prefix=prefix, include_values=not args.no_values, progress=cb
            )
        if fmt == cv.Format.DCP:
            return cv.export_dcp(src, dst, dtype=dtype, prefix=prefix, include_values=not args.no_values, progress=cb)
        if fmt == cv.Format.DEEPSPEED:
            model_prefix = args.prefix if args.prefix is not None else "model."
            return cv.export_deepspeed_universal(src, dst, tag=args.tag, model_prefix=model_prefix, progress=cb)
    raise UsageError(f"cannot write {fmt.value} checkpoints (write tessera, hf, torch, dcp or deepspeed)")


def _import(
    args: argparse.Namespace, fmt: Format, src: str, dst: str, dtype: torch.dtype | None, prefix: str | None
) -> ConvertResult:
    from . import convert as cv

    with _progress(args, f"reading {fmt.value}") as cb:
        if fmt == cv.Format.HF:
            return cv.import_hf(src, dst, prefix=prefix, dtype=dtype, progress=cb)
        if fmt == cv.Format.TORCH:
            return cv.import_torch_save(
                src, dst, prefix=prefix, dtype=dtype, allow_pickle=args.allow_pickle, progress=cb
            )
        if fmt == cv.Format.DCP:
            return cv.import_dcp(src, dst, prefix=prefix, dtype=dtype, allow_pickle=args.allow_pickle, progress=cb)
        if fmt == cv.Format.DEEPSPEED:
            return cv.import_deepspeed(
                src, dst, tag=args.tag, model_prefix=prefix if prefix is not None else "model.", dtype=dtype,
                allow_pickle=args.allow_pickle, progress=cb,
            )  # fmt: skip
        if fmt == cv.Format.MEGATRON:
            if cv.is_torch_dist(src):  # Megatron-Core's own format describes itself: no spec needed
                return cv.import_torch_dist(src, dst, dtype=dtype, progress=cb)
            if not args.spec:
                raise UsageError(
                    "--from megatron needs --spec LAYOUT_SPEC (the JSON layout spec of the per-rank files); "
                    "torch_dist checkpoints need none"
                )
            return cv.import_megatron(
                src, dst, spec=args.spec, prefix=prefix if prefix is not None else "model.", dtype=dtype,
                allow_pickle=args.allow_pickle, progress=cb,
            )  # fmt: skip
    raise UsageError(f"cannot read {fmt.value} checkpoints")


# --------------------------------------------------------------------------------------
# rename


class _RuleAction(argparse.Action):
    """Collects --map and --regex rules in the order given."""

    def __call__(
        self, parser: argparse.ArgumentParser, ns: argparse.Namespace, value: Any, option: str | None = None
    ) -> None:
        from .convert.rename import RenameRule

        try:
            rule = RenameRule.parse(str(value), regex=option == "--regex")
        except ValueError as e:
            parser.error(str(e))
        rules = list(getattr(ns, "rules", None) or [])
        rules.append(rule)
        ns.rules = rules


def _cmd_rename(args: argparse.Namespace, out: Console) -> int:
    from rich.table import Table

    from .convert.rename import rename_tensors

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


# --------------------------------------------------------------------------------------
# trace


def _cmd_trace(args: argparse.Namespace, out: Console) -> int:
    from . import trace
    from .api import read_manifest

    m = read_manifest(args.path)
    sources: dict[str, tuple[list[RankTiming], str]] = {
        op: (trace.rank_timings(m, op), "") for op in trace.operations(m)
    }
    records = trace.load_records(args.path)
    if records and "load" not in sources:
        last = records[-1]
        earlier = f"; {len(records) - 1} earlier load(s) recorded" if len(records) > 1 else ""
        sources["load"] = (last.timings, f"the newest load, {last.created}, {last.name}{earlier}")
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
        timings, note = sources[op]
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
        print(_json(doc))
    any_slow = any(found.values())
    return EXIT_PROBLEMS if args.fail_on_stragglers and any_slow else EXIT_OK


def _trace_table(
    out: Console, op: str, timings: list[RankTiming], slow: list[Straggler], factor: float, min_gap: float, note: str
) -> None:
    from rich.table import Table

    from .trace import BLOCKING_PHASES, blocked_seconds

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
            f"{blocked_seconds(op, t):.3f}", _size(t.nbytes), flags, style=style,
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


# --------------------------------------------------------------------------------------
# Parser and entry point


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``tessera`` command."""
    p = argparse.ArgumentParser(
        prog="tessera", description="Inspect, verify, compare, convert and trace tessera checkpoints."
    )
    p.add_argument("--version", action="version", version=f"tessera {__version__}")
    p.add_argument("-v", "--verbose", action="count", default=0, help="log more (-vv: debug)")
    p.add_argument("--no-progress", action="store_true", help="never draw progress bars")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("inspect", help="list tensors, values, layout and metadata (or a manager root's steps)")
    s.add_argument("path")
    s.add_argument("--json", action="store_true", help="print JSON for machines")
    s.add_argument("--filter", metavar="REGEX", help="only tensors whose name matches")
    s.set_defaults(func=_cmd_inspect)

    s = sub.add_parser("verify", help="check every checksum, file and tensor coverage (exit 1 on any problem)")
    s.add_argument("path", help="a checkpoint, or a manager root (every committed step is verified)")
    s.add_argument("--json", action="store_true")
    s.add_argument("--step", type=int, help="under a manager root: verify only this step")
    s.add_argument("--limit", type=int, default=50, help="problems listed at most (default 50)")
    s.set_defaults(func=_cmd_verify)

    s = sub.add_parser("diff", help="compare two checkpoints tensor by tensor (exit 1 if they differ)")
    s.add_argument("a")
    s.add_argument("b")
    s.add_argument("--atol", type=float, default=0.0, help="absolute tolerance (default 0: exact)")
    s.add_argument("--rtol", type=float, default=0.0, help="relative tolerance (default 0: exact)")
    s.add_argument(
        "--strip",
        metavar="P",
        help="compare A's names under P, without P (e.g. model. for a model export); leave out the rest of A",
    )
    s.add_argument("--strip-b", metavar="P", help="the same for B")
    s.add_argument("--prefix", metavar="P", help="compare only names under P (after --strip), in both")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=_cmd_diff, allow_pickle=False, tag=None, spec=None)

    s = sub.add_parser(
        "convert",
        help="convert between tessera, hf, torch, dcp (and from deepspeed, megatron)",
        description="Convert a checkpoint. Reading tessera, --prefix selects names under it and strips it; "
        "writing tessera, --prefix is prepended to every name.",
    )
    s.add_argument("src")
    s.add_argument("dst")
    formats = ["tessera", "hf", "dcp", "torch", "deepspeed", "megatron"]
    s.add_argument("--from", dest="src_format", choices=formats, help="source format (default: detected)")
    s.add_argument(
        "--to",
        dest="dst_format",
        choices=["tessera", "hf", "dcp", "torch", "deepspeed"],
        help="destination format (default: tessera; deepspeed: a universal checkpoint)",
    )
    s.add_argument(
        "--prefix",
        help="name prefix to select and strip (export) or to prepend (import), e.g. 'model.'; "
        "--to hf detects the model's prefix when not given ('' exports every tensor)",
    )
    s.add_argument("--force", action="store_true", help="replace an existing, non-empty output")
    s.add_argument("--dtype", help="cast floating-point tensors (bf16, fp16, fp32)")
    s.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard for --to hf (default 5GB)")
    s.add_argument("--no-values", action="store_true", help="leave plain values out (torch, dcp)")
    s.add_argument(
        "--allow-pickle", action="store_true", help="unpickle objects in the source (only for files you trust)"
    )
    s.add_argument(
        "--tag",
        help="deepspeed: the global_step directory to read instead of 'latest', or to write (default global_step<N>)",
    )
    s.add_argument("--spec", help="megatron: the layout spec (JSON) describing the files")
    s.set_defaults(func=_cmd_convert)

    s = sub.add_parser("rename", help="rename tensors and values by rewriting only the manifest")
    s.add_argument("path")
    s.add_argument(
        "--map", action=_RuleAction, metavar="OLD=NEW", help="replace the name prefix OLD by NEW (repeatable)"
    )
    s.add_argument(
        "--regex", action=_RuleAction, metavar="PATTERN=REPL", help="re.sub the first match of PATTERN (repeatable)"
    )
    s.add_argument("--dry-run", action="store_true", help="show the renames without writing")
    s.add_argument("--limit", type=int, default=50, help="renames listed at most")
    s.set_defaults(func=_cmd_rename, rules=[])

    s = sub.add_parser("trace", help="per-rank, per-phase timings: stragglers, Chrome trace, PNG timeline")
    s.add_argument("path")
    s.add_argument(
        "--op", default="save", help="operation: save (default), load (the newest recorded load), convert or all"
    )
    s.add_argument(
        "--factor", type=float, default=1.5, help="a straggler is slower than this times the median (default 1.5)"
    )
    s.add_argument("--min-gap", type=float, default=0.25, metavar="SECONDS",
                   help="... and slower than the median by at least this (default 0.25)")  # fmt: skip
    s.add_argument("--chrome", metavar="OUT.json", help="write a Chrome/Perfetto trace")
    s.add_argument("--png", metavar="OUT.png", help="write a timeline plot")
    s.add_argument("--json", action="store_true")
    s.add_argument("--fail-on-stragglers", action="store_true", help="exit 1 when a straggler is found")
    s.set_defaults(func=_cmd_trace)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``tessera`` command with ``argv`` (default: ``sys.argv[1:]``); the exit code.

    Example:
        >>> main(["verify", "/ckpt/step-00000100"])
        0
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse: --help (0) or a usage error (2)
        return int(e.code or 0) if not isinstance(e.code, str) else EXIT_USAGE
    from rich.console import Console

    level = logging.WARNING if args.verbose == 0 else logging.INFO if args.verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("tessera").setLevel(level)
    width = shutil.get_terminal_size((140, 24)).columns if not sys.stdout.isatty() else None
    # No markup: names, values and paths are printed as they are (brackets included).
    out = Console(width=width, highlight=False, markup=False)
    err = Console(stderr=True, highlight=False, markup=False, soft_wrap=True)  # messages stay whole lines
    try:
        return int(args.func(args, out))
    except BrokenPipeError:  # e.g. `tessera inspect --json | head`: the reader has what it wanted
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK
    except UsageError as e:
        err.print(f"tessera {args.command}: usage error: {e}")
        return EXIT_USAGE
    except (CheckpointError, OSError, ValueError, TypeError, KeyError, NotImplementedError, ImportError) as e:
        if args.verbose:
            logger.exception("tessera %s failed", args.command)
        err.print(f"tessera {args.command}: error: {e}")
        return EXIT_PROBLEMS


if __name__ == "__main__":
    sys.exit(main())
