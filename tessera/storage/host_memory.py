"""Host memory on this node: the default directory of a checkpoint's node-local copy.

Used by the local tier of :class:`~tessera.CheckpointManager`: a ``tier::`` root's default
``local_dir``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import posixpath
import re
import tempfile

from .local import local_root

logger = logging.getLogger(__name__)

__all__ = ["TIER_PREFIX", "default_memory_root", "prune_empty_parents"]

TIER_PREFIX = "tier::"
"""Prefix of a :class:`~tessera.CheckpointManager` root with its local tier in host memory (``docs/resilience.md``)."""


def default_memory_root(durable_url: str) -> str:
    """The memory directory used for ``durable_url`` when none is given.

    ``/dev/shm/tessera/<store>/<path of the URL>``, where ``<store>`` is ``local`` for paths
    and ``file://`` URLs, and ``<scheme>-<host or bucket>-<hash>`` otherwise: for example
    ``s3://ckpts/run-7/step-100`` maps to ``/dev/shm/tessera/s3-ckpts-1f0e2a9c/run-7/step-100``.
    The path is kept (not hashed) so that memory copies nest like the checkpoints do: a
    manager on ``tier::s3://ckpts/run-7`` keeps its steps under ``.../run-7/step-*``. Where
    ``/dev/shm`` does not exist, the system temporary directory is used instead (possibly
    disk-backed).
    """
    base = "/dev/shm"
    if not (os.path.isdir(base) and os.access(base, os.W_OK)):
        base = tempfile.gettempdir()
        logger.warning("no writable /dev/shm; host-memory checkpoints go to %s, which may be on disk", base)
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


def prune_empty_parents(directory: str) -> None:
    """Remove ``directory``'s parents that are left empty, up to (not including) the
    ``tessera`` directory of host memory that :func:`default_memory_root` builds paths under;
    nothing outside it is touched."""
    top = None
    for base in ("/dev/shm", tempfile.gettempdir()):
        candidate = os.path.join(base, "tessera")
        if os.path.commonpath([candidate, os.path.abspath(directory)]) == candidate:
            top = candidate
    if top is None:
        return
    parent = os.path.dirname(os.path.abspath(directory))
    while parent != top and parent.startswith(top + os.sep):
        try:
            os.rmdir(parent)
        except OSError:
            return  # not empty (another run's steps), or gone
        parent = os.path.dirname(parent)
