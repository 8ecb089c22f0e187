"""Environment knobs, all prefixed ``TESSERA_`` and read here only.

Knobs are for operators tuning a deployment without code changes; code should prefer the
option dataclasses in :mod:`tessera.options`.
"""

from __future__ import annotations

import os


def _int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} must be an integer") from None


def _float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} must be a number") from None
    if not value >= 0:  # also refuses nan
        raise ValueError(f"environment variable {name}={raw!r} must be a number >= 0")
    return value


def collective_timeout_s() -> float:
    """Seconds a collective phase may wait for other ranks (``TESSERA_TIMEOUT_S``, default 600)."""
    return float(_int("TESSERA_TIMEOUT_S", 600))


def io_threads() -> int:
    """Threads per rank for reading and writing data files (``TESSERA_IO_THREADS``, default 4)."""
    return max(1, _int("TESSERA_IO_THREADS", 4))


def chunk_bytes(compressed: bool = False) -> int:
    """The largest checksum chunk in bytes (``TESSERA_CHUNK_BYTES``; default 4 MiB, 256 KiB for a
    save that may compress: a compressed chunk is also the unit a resharded read decodes, and
    such a save cuts small tiles finer still, :mod:`tessera.format.chunking`)."""
    return max(4096, _int("TESSERA_CHUNK_BYTES", (256 << 10) if compressed else (4 << 20)))


def compress() -> bool | str:
    """Whether saves store tiles compressed (``TESSERA_COMPRESS=1``, or ``auto``: where the codec
    is measured faster than the storage; default off)."""
    raw = os.environ.get("TESSERA_COMPRESS", "0").strip().lower()
    if raw == "auto":
        return "auto"
    return raw not in ("0", "false", "no", "off", "")


def direct_io() -> str:
    """How durable local writes of data files treat the page cache (``TESSERA_DIRECT_IO``):
    ``auto`` (default) ``O_DIRECT`` or buffered per device, whichever its writes measured faster
    (:mod:`tessera.storage.direct_choice`); ``1`` always ``O_DIRECT`` (where the filesystem
    supports it); ``0`` always buffered."""
    raw = os.environ.get("TESSERA_DIRECT_IO", "auto").strip().lower()
    if raw in ("", "auto"):
        return "auto"
    return "off" if raw in ("0", "false", "no", "off") else "on"


def recache() -> str:
    """Whether committed local files written around the page cache are read back into it
    (``TESSERA_RECACHE``: ``auto`` (default) on local filesystems within half of
    ``MemAvailable``, ``0`` off (a job that never reads its checkpoints back on the same nodes
    saves the steps' slowdown beside it), ``1`` always)."""
    raw = os.environ.get("TESSERA_RECACHE", "auto").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return "off"
    if raw in ("1", "true", "yes", "on", "always"):
        return "always"
    if raw == "auto":
        return "auto"
    raise ValueError(f"environment variable TESSERA_RECACHE={raw!r} must be 0, auto or 1")


def verify_checksums() -> bool:
    """Whether loads verify checksums (``TESSERA_VERIFY=0`` turns it off; default on)."""
    return os.environ.get("TESSERA_VERIFY", "1") not in ("0", "false", "no")


def staging_mode() -> str:
    """How ``async_save`` stages (``TESSERA_STAGING``: ``auto`` (default), ``background`` or ``blocking``)."""
    return os.environ.get("TESSERA_STAGING", "") or "auto"


def max_staging_bytes() -> str | None:
    """Host-memory budget of async saves (``TESSERA_MAX_STAGING_BYTES``, e.g. ``2GiB``; unset: none)."""
    return os.environ.get("TESSERA_MAX_STAGING_BYTES") or None


def check_staging() -> str:
    """How background copies are checked (``TESSERA_CHECK_STAGING``: ``full`` (default), ``sampled``, ``off``).

    ``1``/``true`` mean ``full`` and ``0``/``false`` mean ``off``, as before the levels existed.
    """
    raw = os.environ.get("TESSERA_CHECK_STAGING", "").strip().lower()
    aliases = {"": "full", "1": "full", "true": "full", "yes": "full", "0": "off", "false": "off", "no": "off"}
    return aliases.get(raw, raw)


def writer_mode() -> str:
    """Who writes a save's data files (``TESSERA_WRITER``: ``thread`` (default) or ``process``)."""
    return os.environ.get("TESSERA_WRITER", "") or "thread"


def preemption_grace_s() -> float:
    """Seconds after a first preemption signal during which more signals are the same preemption
    (``TESSERA_PREEMPTION_GRACE_S``, default 5); a signal after that stops the job."""
    return _float("TESSERA_PREEMPTION_GRACE_S", 5.0)


def writer_timeout_s() -> float:
    """Seconds a writer process (``WriterMode.PROCESS``) may go without progress before its save
    fails (``TESSERA_WRITER_TIMEOUT_S``; default half of ``TESSERA_TIMEOUT_S``, so that the
    stuck rank's error reaches the other ranks before their own exchange times out)."""
    return _float("TESSERA_WRITER_TIMEOUT_S", collective_timeout_s() / 2)


def sectioned_manifest_tiles() -> int:
    """Tiles from which a save's manifest is written in sections, format version 2, so that each
    loading rank reads only its part (``TESSERA_SECTIONED_MANIFEST_TILES``, default 262144; 0:
    always). Smaller manifests stay version 1, read whole."""
    return max(0, _int("TESSERA_SECTIONED_MANIFEST_TILES", 1 << 18))


def report_group() -> int:
    """Ranks whose reports one leader combines for the commit (``TESSERA_REPORT_GROUP``, default
    64; 0 or 1: none, rank 0 reads every report). Groups form only in jobs of more ranks than this."""
    return _int("TESSERA_REPORT_GROUP", 64)
