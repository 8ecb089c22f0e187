"""Path mapping of the memory tier: where the memory copy of a durable URL lives, and manifests."""

from __future__ import annotations

from ..base import OWNER_MARKER_DIR
from ..host_memory import TIER_PREFIX, default_memory_root

MANIFEST = "manifest.json"

__all__ = ["MANIFEST", "TIER_PREFIX", "default_memory_root", "is_manifest", "manifest_files"]


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
