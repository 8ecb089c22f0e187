"""Step directories under a manager root: naming, listing, and the ``latest`` pointer.

Local operations only (no communication); any rank may call them.
"""

from __future__ import annotations

import logging

from ..format.manifest import MANIFEST_NAME
from ..format.names import parse_step_dirname, step_dirname
from ..storage import Storage
from ..storage.capabilities import Closable

__all__ = [
    "LATEST_NAME",
    "check_step",
    "close_store",
    "join_root",
    "parse_step_dirname",
    "read_pointer",
    "scan_steps",
    "step_dirname",
    "write_pointer",
]

logger = logging.getLogger(__name__)

LATEST_NAME = "latest"


def join_root(root: str, name: str) -> str:
    """``name`` under ``root`` (a path or URL, with or without a trailing ``/``)."""
    return root + name if root.endswith("/") else f"{root}/{name}"


def check_step(step: int) -> int:
    """``step`` itself, if it is a valid step number.

    Raises:
        ValueError: if ``step`` is not an integer >= 0.
    """
    if type(step) is not int or step < 0:
        raise ValueError(f"a checkpoint step must be an integer >= 0, got {step!r}")
    return step


def scan_steps(store: Storage) -> dict[int, bool]:
    """Every step directory under ``store``'s root: ``{step: committed}``.

    A step is committed when its ``manifest.json`` exists; other names are ignored.
    """
    found: dict[int, bool] = {}
    for rel in store.list(""):
        head, _, rest = rel.partition("/")
        step = parse_step_dirname(head)
        if step is None or not rest:
            continue
        found[step] = found.get(step, False) or rest == MANIFEST_NAME
    return found


def read_pointer(store: Storage, root: str) -> int | None:
    """The step the ``latest`` pointer under ``store`` names (None if absent or unreadable)."""
    try:
        text = store.read_file(LATEST_NAME)
    except FileNotFoundError:
        return None
    step = parse_step_dirname(text.decode("utf-8", "replace").strip())
    if step is None:
        logger.warning("%s/%s does not name a step directory (%r); ignoring it", root, LATEST_NAME, text[:80])
    return step


def write_pointer(store: Storage, step: int) -> None:
    """Point ``latest`` at ``step`` (atomically)."""
    store.write_atomic(LATEST_NAME, (step_dirname(step) + "\n").encode())


def close_store(store: object) -> None:
    """Release ``store``'s resources if it holds any (:class:`~tessera.storage.capabilities.Closable`)."""
    if isinstance(store, Closable):
        store.close()
