"""The per-rank marker protocol of the memory tier (multi-node persistence).

Each rank copies its own files to the durable store, then reports with a small marker object
``.tessera-persist/<save id>/<rank>.ok`` (or ``<rank>.failed`` holding the cause). Rank 0
publishes the manifest once every rank's ``.ok`` is there (:func:`await_markers`), then removes
the markers (:func:`remove_markers`).
"""

from __future__ import annotations

import logging
import re
import time

from ...errors import StorageError
from ..base import Storage

logger = logging.getLogger(__name__)

MARKER_DIR = ".tessera-persist"
"""Directory (in the durable checkpoint) of the per-rank persistence markers, while a commit waits for them."""
_SAVE_ID_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")


def check_save_id(save_id: str, url: str) -> None:
    """Refuse a save id that cannot name a marker directory.

    Raises:
        ValueError: for a save id that is not a plain name.
    """
    if not _SAVE_ID_RE.fullmatch(save_id):
        raise ValueError(f"{url}: save id {save_id!r} must be a plain name ([A-Za-z0-9._-])")


def marker_dir(save_id: str) -> str:
    """The directory of ``save_id``'s markers, relative to the durable checkpoint."""
    return f"{MARKER_DIR}/{save_id}"


def write_marker(durable: Storage, path: str, data: bytes, rank: int, url: str) -> None:
    """Publish the marker ``path`` (``data``: empty, or a failure's cause) for ``rank``.

    Raises:
        StorageError: if it cannot be written (rank 0 then does not commit).
    """
    try:
        durable.write_atomic(path, data)
    except Exception as e:
        raise StorageError(
            f"rank {rank} could not report its persistence of {url} at {durable.url}/{path}: {e}; "
            "rank 0 will not commit this save"
        ) from e


def await_markers(durable: Storage, markers: str, world_size: int, timeout_s: float, url: str) -> None:
    """Rank 0: wait until every rank's ``.ok`` marker is under ``markers``.

    Args:
        durable: the durable store.
        markers: the save's marker directory (:func:`marker_dir`).
        world_size: ranks that must report.
        timeout_s: how long to wait for them.
        url: the tier's URL, for messages.

    Raises:
        StorageError: for a ``.failed`` marker (with the rank's cause), or ranks still
            missing after ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    delay = 0.02
    while True:
        ok: set[int] = set()
        failed: list[int] = []
        for p in durable.list(markers):
            head, _, status = p.rpartition("/")[2].partition(".")
            if head.isdigit() and status == "ok":
                ok.add(int(head))
            elif head.isdigit() and status == "failed":
                failed.append(int(head))
        if failed:
            causes = []
            for r in sorted(failed)[:3]:
                try:
                    causes.append(f"rank {r}: {durable.read_file(f'{markers}/{r}.failed').decode(errors='replace')}")
                except Exception as e:
                    causes.append(f"rank {r}: (its report could not be read: {e})")
            raise StorageError(
                f"not committing {url}: {len(failed)} rank(s) failed to persist their files; the durable "
                f"checkpoint keeps its previous commit. " + "; ".join(causes)
            )
        if len(ok) >= world_size:
            return
        if time.monotonic() > deadline:
            missing = sorted(set(range(world_size)) - ok)
            shown = ", ".join(map(str, missing[:10])) + (" ..." if len(missing) > 10 else "")
            raise StorageError(
                f"not committing {url}: {len(missing)} rank(s) ({shown}) did not report their files "
                f"persisted within {timeout_s:g}s (a rank died, or its copy is still running); "
                "the durable checkpoint keeps its previous commit"
            )
        time.sleep(delay)
        delay = min(1.0, delay * 1.5)


def remove_markers(durable: Storage) -> None:
    """Remove every marker (this save's, and any a rank wrote after an earlier commit gave up)."""
    try:
        durable.delete(durable.list(MARKER_DIR))
    except Exception as e:
        logger.warning("could not remove persistence markers under %s: %s", durable.url, e)
