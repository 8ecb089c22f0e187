"""``tessera remove-local ROOT``: delete a run's steps from this node's local tier (host memory)."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from .render import EXIT_OK, to_json

if TYPE_CHECKING:
    from rich.console import Console


def cmd_remove_local(args: argparse.Namespace, out: Console) -> int:
    """Delete ``ROOT``'s steps from this node's local-tier directory (``--local-dir``, else the
    default of a ``tier::ROOT`` manager); run it on each node once the job is over."""
    from ..manager.local_tier import node_dir, node_index, remove_root_steps
    from ..storage.host_memory import TIER_PREFIX, default_memory_root

    root = args.root[len(TIER_PREFIX) :] if args.root.startswith(TIER_PREFIX) else args.root
    local_dir = args.local_dir or default_memory_root(root)
    node = args.node if args.node is not None else node_index()
    directory = node_dir(local_dir, node)
    removed = remove_root_steps(directory, root) if os.path.isdir(directory) else []
    if args.json:
        out.print(to_json({"root": root, "directory": directory, "removed": removed}))
    elif removed:
        out.print(f"removed {len(removed)} local step(s) of {root} from {directory}: {', '.join(map(str, removed))}")
    else:
        out.print(f"no local step of {root} in {directory}")
    return EXIT_OK
