"""Path mapping of the memory tier: where the memory copy of a durable URL lives, and manifests."""

from __future__ import annotations

import hashlib
import logging
import os
import posixpath
import re
import tempfile

from ..base import OWNER_MARKER_DIR
from ..local import local_root

logger = logging.getLogger(__name__)

TIER_PREFIX = "tier::"
"""URL prefix that selects the memory tier in :func:`tessera.storage.storage_for`."""
MANIFEST = "manifest.json"


def default_memory_root(durable_url: str) -> str:
    """The memory directory used for ``durable_url`` when none is given.

    ``/dev/shm/tessera/<store>/<path of the URL>``, where ``<store>`` is ``local`` for paths
    and ``file://`` URLs, and ``<scheme>-<host or bucket>-<hash>`` otherwise: for example
    ``s3://ckpts/run-7/step-100`` maps to ``/dev/shm/tessera/s3-ckpts-1f0e2a9c/run-7/step-100``.
    The path is kept (not hashed) so that the memory copies of checkpoints nest like the
    checkpoints do: a tier opened on ``.../run-7`` (e.g. by a checkpoint manager applying
    retention) sees and deletes the memory copies of ``.../run-7/step-*``. Where ``/dev/shm``
    does not exist, the system temporary directory is used instead (possibly disk-backed).
    """
    base = "/dev/shm"
    if not (os.path.isdir(base) and os.access(base, os.W_OK)):
        base = tempfile.gettempdir()
        logger.warning("no writable /dev/shm; the memory tier uses %s, which may be on disk", base)
    scheme, sep, rest = durable_url.partition("://")
    if not sep or scheme == "file":
        store, path = "local", os.path.realpath(local_root(durable_url))  # one copy per directory, however reached
    else:
        authority, _, path = rest.partition("/")
        digest = hashlib.sha256(f"{scheme}://{authority}".encode()).hexdigest()[:8]
        store = f"{re.sub(r'[^A-Za-z0-9._-]', '_', scheme)}-{re.sub(r'[^A-Za-z0-9._-]', '_', authority)}-{digest}"
    # normpath of an absolute path cannot climb above "/": no ".." escapes the tier root.
    rel = posixpath.normpath("/" + path).lstrip("/")
    return os.path.join(base, "tessera", store, rel)


def is_manifest(rel: str) -> bool:
    """Whether the relative path ``rel`` is a ``manifest.json`` (at any depth)."""
    return rel == MANIFEST or rel.endswith("/" + MANIFEST)


def manifest_files(manifest: bytes, written: list[str]) -> list[str]:
    """The data files a committed manifest references (``written`` if it is not a tessera manifest)."""
    # The tier is the one backend that reads what it stores: it must persist one save's files
    # and no other's, and only the manifest knows which those are. Imported here, not at the
    # top: tessera.manifest imports tessera.storage.base, whose package imports this one.
    from ...errors import ManifestError
    from ...manifest import decode

    try:
        return [f.path for f in decode(manifest).files]
    except ManifestError:
        return [p for p in written if not p.startswith(OWNER_MARKER_DIR + "/")]
