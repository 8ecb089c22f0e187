"""The ``tessera`` command: inspect, verify, diff, convert, rename and trace checkpoints.

A thin layer over the public API (:func:`tessera.verify`, :mod:`tessera.convert`,
:mod:`tessera.tools.trace`): parse arguments, call one function, render the result with ``rich``
(or as JSON with ``--json``). Exit codes: 0 ok, 1 problems found (or the operation
failed), 2 usage error. Every verb runs in one process and works on checkpoints saved by
any number of ranks in any layout; long work shows a progress bar on a terminal.

Example:
    $ tessera inspect /ckpt/step-00000100
    $ tessera verify /ckpt/step-00000100 && tessera convert /ckpt/step-00000100 /export/hf --to hf --prefix model.

Modules: ``render`` (sizes, JSON, progress bars), ``cmd_inspect`` (inspect, verify),
``cmd_convert`` (convert, diff, rename), ``cmd_trace`` (trace), ``cmd_local`` (local, remove-local). The work itself is done by
library functions (:mod:`tessera.tools`, :mod:`tessera.tools.describe`, :mod:`tessera.tools.verification`,
:mod:`tessera.tools.trace`); nothing here imports torch (nor rich) at module level, so
``tessera --help`` and ``--version`` answer at once.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointError
from ..tools import UsageError
from ..version import __version__
from .cmd_convert import RuleAction, cmd_convert, cmd_diff, cmd_rename
from .cmd_inspect import cmd_inspect, cmd_verify
from .cmd_local import cmd_local, cmd_remove_local
from .cmd_trace import cmd_trace
from .render import EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["EXIT_OK", "EXIT_PROBLEMS", "EXIT_USAGE", "UsageError", "build_parser", "main"]

logger = logging.getLogger(__name__)

_ROOT_HELP = "a manager root (its latest committed step) or ROOT@STEP"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``tessera`` command."""
    p = argparse.ArgumentParser(
        prog="tessera", description="Inspect, verify, compare, convert and trace tessera checkpoints."
    )
    p.add_argument("--version", action="version", version=f"tessera {__version__}")
    p.add_argument("-v", "--verbose", action="count", default=0, help="log more (-vv: debug)")
    p.add_argument("--no-progress", action="store_true", help="never draw progress bars")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # The same two options after the verb (`tessera convert A B -v`). Their own dests: argparse
    # copies a subcommand's defaults over the values parsed before the verb.
    after = argparse.ArgumentParser(add_help=False)
    after.add_argument("-v", "--verbose", dest="verbose_after", action="count", default=0, help="log more (-vv: debug)")
    after.add_argument("--no-progress", dest="no_progress_after", action="store_true", help="never draw progress bars")

    def verb(name: str, **kwargs: Any) -> argparse.ArgumentParser:
        return sub.add_parser(name, parents=[after], **kwargs)

    s = verb("inspect", help="list tensors, values, layout and metadata (or a manager root's steps)")
    s.add_argument("path", help=f"a checkpoint, {_ROOT_HELP}, or a root itself (its steps are listed)")
    s.add_argument("--json", action="store_true", help="print JSON for machines")
    s.add_argument("--filter", metavar="REGEX", help="only tensors whose name matches")
    s.set_defaults(func=cmd_inspect, checkpoints=("path",), root_means_latest=False)

    s = verb("verify", help="check every checksum, file and tensor coverage (exit 1 on any problem)")
    s.add_argument("path", help=f"a checkpoint, {_ROOT_HELP}, or a root itself (every committed step is verified)")
    s.add_argument("--json", action="store_true")
    s.add_argument("--step", type=int, help="under a manager root: verify only this step")
    s.add_argument("--limit", type=int, default=50, help="problems listed at most (default 50)")
    s.set_defaults(func=cmd_verify, checkpoints=("path",), root_means_latest=False)

    s = verb("diff", help="compare two checkpoints tensor by tensor (exit 1 if they differ)")
    s.add_argument("a", help=f"a checkpoint of any format, {_ROOT_HELP}")
    s.add_argument("b", help="the same")
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
    s.set_defaults(func=cmd_diff, allow_pickle=False, tag=None, spec=None, checkpoints=("a", "b"))

    s = verb(
        "convert",
        help="convert between tessera, hf, torch, dcp (and from deepspeed, megatron)",
        description="Convert a checkpoint. Reading tessera, --prefix selects names under it and strips it; "
        "writing tessera, --prefix is prepended to every name.",
    )
    s.add_argument("src", help=f"the checkpoint to read, {_ROOT_HELP}")
    s.add_argument("dst", help="the output")
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
    s.add_argument(
        "--config",
        metavar="CONFIG",
        help="--to hf: the config.json to write (the file, or a model directory holding one); "
        "default: the one recorded in the checkpoint (metadata hf_config), if any",
    )
    s.add_argument("--no-values", action="store_true", help="leave plain values out (torch, dcp)")
    s.add_argument(
        "--allow-pickle", action="store_true", help="unpickle objects in the source (only for files you trust)"
    )
    s.add_argument(
        "--tag",
        help="deepspeed: the global_step directory to read instead of 'latest', or to write (default global_step<N>)",
    )
    s.add_argument("--spec", help="megatron: the layout spec (JSON) describing the files")
    s.set_defaults(func=cmd_convert, checkpoints=("src",))

    s = verb("rename", help="rename tensors and values by rewriting only the manifest")
    s.add_argument("path", help=f"a checkpoint, {_ROOT_HELP}")
    s.add_argument(
        "--map", action=RuleAction, metavar="OLD=NEW", help="replace the name prefix OLD by NEW (repeatable)"
    )
    s.add_argument(
        "--regex", action=RuleAction, metavar="PATTERN=REPL", help="re.sub the first match of PATTERN (repeatable)"
    )
    s.add_argument("--dry-run", action="store_true", help="show the renames without writing")
    s.add_argument("--limit", type=int, default=50, help="renames listed at most")
    s.set_defaults(func=cmd_rename, rules=[], checkpoints=("path",))

    s = verb("trace", help="per-rank, per-phase timings: stragglers, Chrome trace, PNG timeline")
    s.add_argument("path", help=f"a checkpoint, {_ROOT_HELP}")
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
    s.set_defaults(func=cmd_trace, checkpoints=("path",))

    s = verb(
        "local",
        help="list a run's steps in this node's local tier (data, replicas, parity)",
        description="List the steps of ROOT held in this node's local-tier directory: committed or not, "
        "replicas or parity (k+m), the bytes of data files (the node's own and replicas) and of parity blocks.",
    )
    _local_tier_arguments(s)
    s.set_defaults(func=cmd_local, checkpoints=())

    s = verb(
        "remove-local",
        help="delete a run's steps from this node's local tier (host memory of a tier:: root)",
        description="Delete every step of ROOT held in this node's local-tier directory (committed or not; "
        "steps of other roots stay). Run it on each node once the job is over; the durable steps under ROOT "
        "are not touched.",
    )
    _local_tier_arguments(s)
    s.set_defaults(func=cmd_remove_local, checkpoints=())
    p.set_defaults(root_means_latest=True)
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

    args.verbose += args.verbose_after
    args.no_progress = args.no_progress or args.no_progress_after
    level = logging.WARNING if args.verbose == 0 else logging.INFO if args.verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("tessera").setLevel(level)
    piped = not sys.stdout.isatty()
    width = shutil.get_terminal_size((140, 24)).columns if piped else None
    # No markup: names, values and paths are printed as they are (brackets included). Into a
    # pipe or a file, lines stay whole (a long path wrapped at the width breaks grep and jq).
    out = Console(width=width, highlight=False, markup=False, soft_wrap=piped)
    err = Console(stderr=True, highlight=False, markup=False, soft_wrap=True)  # messages stay whole lines
    try:
        _resolve_checkpoints(args, err)
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


def _resolve_checkpoints(args: argparse.Namespace, err: Console) -> None:
    """Replace each checkpoint argument of the verb by the checkpoint it names, saying which on stderr.

    One place for every verb: a manager root means its newest committed step (``inspect``
    and ``verify`` keep a bare root: they list or verify its steps), ``ROOT@STEP`` a step.
    """
    from ..tools.steps import resolve_checkpoint

    for name in args.checkpoints:
        resolved = resolve_checkpoint(getattr(args, name), root_means_latest=args.root_means_latest)
        if resolved.note is not None:
            err.print(f"tessera {args.command}: {resolved.note}")
        setattr(args, name, resolved.path)


def _local_tier_arguments(s: argparse.ArgumentParser) -> None:
    """The arguments of the commands that read one node's local tier: ROOT, --local-dir, --node, --json."""
    s.add_argument("root", help="the manager root (tier::URL or URL)")
    s.add_argument("--local-dir", help="the manager's local_dir (default: the one of a tier:: root)")
    s.add_argument("--node", type=int, help="the node index for {node} in --local-dir (default: from torchrun's env)")
    s.add_argument("--json", action="store_true")
