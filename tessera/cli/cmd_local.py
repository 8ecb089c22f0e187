"""``tessera local ROOT``: what this node's local tier holds of a run (files, replicas, parity);
``tessera remove-local ROOT``: delete a run's steps from it (host memory)."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from .render import EXIT_OK, to_json

if TYPE_CHECKING:
    from rich.console import Console


def _directory(args: argparse.Namespace) -> tuple[str, str]:
    """The manager root (no ``tier::``) and this node's local-tier directory."""
    from ..manager.local_tier import node_dir, node_index
    from ..storage.host_memory import TIER_PREFIX, default_memory_root

    root = args.root[len(TIER_PREFIX) :] if args.root.startswith(TIER_PREFIX) else args.root
    local_dir = args.local_dir or default_memory_root(root)
    return root, node_dir(local_dir, args.node if args.node is not None else node_index())


def cmd_local(args: argparse.Namespace, out: Console) -> int:
    """List ``ROOT``'s steps in this node's local-tier directory: committed or not, the bytes of
    the node's data files (its own and replicas) and of its parity blocks, and the code."""
    from ..manager.local_tier.inventory import local_steps, read_marker

    root, directory = _directory(args)
    rows = []
    for step, step_dir in local_steps(directory):
        doc = read_marker(step_dir)
        if doc is not None and doc.get("root") != root:
            continue  # another run's step in a shared directory
        sizes = {}
        for part in ("data", "parity"):
            top = os.path.join(step_dir, part)
            sizes[part] = sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(top) for n in names)
        parity = doc.get("parity") if doc is not None else None
        code = f"parity {parity['k']}+{parity['m']}" if isinstance(parity, dict) else "replicas"
        rows.append({"step": step, "committed": doc is not None, "protection": code, "data_bytes": sizes["data"],
                     "parity_bytes": sizes["parity"]})  # fmt: skip
    if args.json:
        print(to_json({"root": root, "directory": directory, "steps": rows}))  # never wrapped
    elif not rows:
        out.print(f"no local step of {root} in {directory}")
    else:
        out.print(f"local steps of {root} in {directory}:")
        for r in rows:
            state = "committed" if r["committed"] else "not committed"
            out.print(f"  step {r['step']}: {state}, {r['protection']}, {r['data_bytes']} bytes of data files, "
                      f"{r['parity_bytes']} bytes of parity")  # fmt: skip
    return EXIT_OK


def cmd_remove_local(args: argparse.Namespace, out: Console) -> int:
    """Delete ``ROOT``'s steps from this node's local-tier directory (``--local-dir``, else the
    default of a ``tier::ROOT`` manager); run it on each node once the job is over."""
    from ..manager.local_tier import remove_root_steps

    root, directory = _directory(args)
    removed = remove_root_steps(directory, root) if os.path.isdir(directory) else []
    if args.json:
        out.print(to_json({"root": root, "directory": directory, "removed": removed}))
    elif removed:
        out.print(f"removed {len(removed)} local step(s) of {root} from {directory}: {', '.join(map(str, removed))}")
    else:
        out.print(f"no local step of {root} in {directory}")
    return EXIT_OK
