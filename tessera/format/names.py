"""Names in a checkpoint: its directories (data, owner markers, load timings), step directories, file
references in a manifest, tensor-name prefixes.

Step directories are ``step-`` and the step number zero-padded to 8 digits, shared by the durable
layout (:mod:`tessera.manager`) and the node-local tier (:mod:`tessera.manager.local_tier`); names
not in exactly this form are not steps. A file reference in a manifest must stay inside the
checkpoint and be spelled canonically (:func:`check_reference`).
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Iterable

from ..errors import ManifestError

DATA_DIR = "data"
"""Directory (inside a checkpoint) of the data files, one subdirectory per save id."""
OWNER_MARKER_DIR = ".tessera-saves"
"""Directory (inside a checkpoint) of the owner markers of saves in progress (see tessera.engine.commit)."""
LOAD_TIMINGS_DIR = "timings"
"""Directory (inside a checkpoint) where each load's per-rank timings are kept."""
SHARED_TILES_DIR = ".tessera-tiles"
"""Directory beside the step directories of a manager root that holds the data files steps
share (``CheckpointManager(dedup=True)``): one subdirectory per save id, plus :data:`PINS_DIR`."""
SHARED_REF = "@tiles/"
"""Prefix of a manifest's reference to a file in the :data:`SHARED_TILES_DIR` beside the
checkpoint (``@tiles/<save id>/<rank>-<k>.safetensors``); every other reference is inside
the checkpoint."""
PINS_DIR = ".pins"
"""Directory (inside :data:`SHARED_TILES_DIR`) of the pins of saves in flight: what they may reference."""

STEP_PREFIX = "step-"
STEP_DIGITS = 8
_STEP_RE = re.compile(r"^step-(\d{8,})$")


def step_dirname(step: int) -> str:
    """The directory name of ``step``: ``step-`` and the number padded to 8 digits.

    Example:
        >>> step_dirname(100)
        'step-00000100'
    """
    return f"{STEP_PREFIX}{step:0{STEP_DIGITS}d}"


def parse_step_dirname(name: str) -> int | None:
    """The step a directory name stands for, or None if it is not a step directory.

    Only the canonical form :func:`step_dirname` produces is accepted, so no two names map
    to one step.

    Example:
        >>> parse_step_dirname("step-00000100"), parse_step_dirname("step-100")
        (100, None)
    """
    m = _STEP_RE.match(name)
    if m is None:
        return None
    step = int(m.group(1))
    return step if step_dirname(step) == name else None


def check_relpath(path: str) -> str:
    """Return ``path`` normalised, refusing anything that escapes the checkpoint root.

    Raises:
        ManifestError: for absolute paths, ``..`` components, backslashes or NUL bytes.
    """
    if not isinstance(path, str) or not path or "\x00" in path or "\\" in path:
        raise ManifestError(f"invalid file reference {path!r} in checkpoint")
    norm = posixpath.normpath(path)
    if norm.startswith("/") or norm == ".." or norm.startswith("../") or norm == "." or ":" in norm.split("/")[0]:
        raise ManifestError(f"file reference {path!r} points outside the checkpoint directory; refusing it")
    return norm


def check_reference(path: object) -> str:
    """``path`` if it is a canonical file reference of a manifest, else :class:`ManifestError`.

    A manifest names each data file once, in one spelling: relative, ``/``-separated, with no
    empty, ``.`` or ``..`` component (so nothing is normalised: ``a/../b`` is refused, not read
    as ``b``), no backslash, NUL or URL scheme. A shared reference is ``@tiles/<save id>/<file>``
    (:data:`SHARED_REF`), the same rules applying to the rest of it.

    Raises:
        ManifestError: naming the reference and why it is refused.

    Example:
        >>> check_reference("@tiles/0a1b/0-0.safetensors")
        '@tiles/0a1b/0-0.safetensors'
    """
    if not isinstance(path, str) or not path or "\x00" in path or "\\" in path:
        raise ManifestError(f"invalid file reference {path!r:.200} in checkpoint")
    parts = path.split("/")
    norm = posixpath.normpath(path)
    if path.startswith("/") or ":" in parts[0] or norm == ".." or norm.startswith("../"):
        raise ManifestError(f"file reference {path!r:.200} points outside the checkpoint directory; refusing it")
    if any(p in ("", ".", "..") for p in parts):
        raise ManifestError(
            f"file reference {path!r:.200} is not canonical (an empty, '.' or '..' component); "
            "a manifest names each file in one plain relative spelling; refusing it"
        )
    if parts[0] == SHARED_REF.rstrip("/") and len(parts) < 3:
        raise ManifestError(f"shared file reference {path!r:.200} must be {SHARED_REF}<save id>/<file>; refusing it")
    return path


def is_shared_ref(path: str) -> bool:
    """Whether a manifest file reference points into the shared tile directory (:data:`SHARED_REF`)."""
    return path.startswith(SHARED_REF)


def shared_tiles_url(checkpoint_url: str) -> str:
    """The shared tile directory of the checkpoint at ``checkpoint_url``: beside it, in its parent.

    Example:
        >>> shared_tiles_url("s3://bucket/run/step-00000100/")
        's3://bucket/run/.tessera-tiles'
        >>> shared_tiles_url("step-00000100")
        '.tessera-tiles'
    """
    url = checkpoint_url.rstrip("/")
    head, sep, name = url.rpartition("/")
    if not sep:
        if ":" in url:
            raise ValueError(f"{checkpoint_url!r} has no parent directory to hold shared tiles")
        return SHARED_TILES_DIR
    if not name or head.endswith(":/") or head.endswith(":"):
        raise ValueError(f"{checkpoint_url!r} has no parent directory to hold shared tiles")
    return f"{head}/{SHARED_TILES_DIR}"


def strip_prefix(names: Iterable[str], prefix: str | None) -> dict[str, str]:
    """``{new name: old name}`` of the names under ``prefix``, with the prefix removed.

    Without a prefix every name maps to itself.
    """
    if not prefix:
        return {n: n for n in names}
    return {n[len(prefix) :]: n for n in names if n.startswith(prefix) and len(n) > len(prefix)}
