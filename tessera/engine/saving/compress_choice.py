"""``SaveOptions(compress="auto")``: code a rank's files only where that makes its write faster.

A write that codes its chunks takes about ``max(B / C, (B / ratio) / W)`` for ``B`` logical
bytes, ``C`` the rate the rank's coder threads code at and ``W`` the rate its storage takes bytes
at; a plain write takes ``B / W``. So coding pays exactly where ``C > W``: object stores, network
filesystems, a disk shared by many ranks; not on a local disk faster than the codec (the 2-core
development machine's NVMe takes ~1 GB/s, its two cores code ~0.6 GB/s: docs/compression.md).

Both rates are measured by the writes themselves, per process (the writer process keeps its own)
and per place: a local filesystem (its device), or an object store's bucket (scheme and host),
whatever the checkpoint's path under it, as moving averages:

* ``W``: from plain writes, bytes over the write stage's wall time; from coded writes, stored
  bytes over the time the backend was not waiting for frames.
* ``C``: from coded writes, logical bytes over the seconds spent coding, per thread; before any,
  from coding the first chunk of the write being decided (a few milliseconds).

The first write to a place is plain (nothing is known of ``W``). The decision is each rank's own:
a checkpoint may hold coded and plain files side by side (each file says which it is).
Thread-safe.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import urllib.parse
from dataclasses import dataclass

logger = logging.getLogger(__name__)

_WEIGHT = 0.5
"""Weight of the newest measurement in each moving average."""
_MIN_BYTES = 1 << 20
"""Writes smaller than this are not measured (their time is latency, not bandwidth)."""


@dataclass
class _Rates:
    storage_bps: float | None = None
    """Bytes per second the rank's writes to this root took, all threads together."""
    codec_bps: float | None = None
    """Logical bytes per second one coder thread codes."""


def _mix(old: float | None, new: float) -> float:
    return new if old is None else (1 - _WEIGHT) * old + _WEIGHT * new


def place(url: str) -> str:
    """Where a storage root's bytes go, for its rates: ``scheme://host`` of a URL, or the device
    of the nearest existing directory of a local path.

    Example:
        >>> place("s3://bucket/run1/step-5")
        's3://bucket'
    """
    if "://" in url and not url.startswith("file://"):
        parts = urllib.parse.urlsplit(url)
        return f"{parts.scheme}://{parts.netloc}"
    path = os.path.abspath(url.removeprefix("file://"))
    while True:
        try:
            return f"dev:{os.stat(path).st_dev}"
        except OSError:
            parent = os.path.dirname(path)
            if parent == path:
                return "dev:?"
            path = parent


class CompressChoice:
    """The measured rates of one process, by :func:`place`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rates: dict[str, _Rates] = {}

    def rates(self, url: str) -> tuple[float | None, float | None]:
        """``(storage bytes/s, codec bytes/s per thread)`` measured for ``url``'s place so far."""
        key = place(url)
        with self._lock:
            r = self._rates.get(key, _Rates())
            return r.storage_bps, r.codec_bps

    def should_code(self, url: str, coders: int, sample: memoryview | None, itemsize: int) -> bool:
        """Whether the next write to ``url`` with ``coders`` coder threads codes its chunks.

        ``sample`` (a chunk of that write) is coded once to measure the codec where no coded
        write has measured it yet.
        """
        storage, codec = self.rates(url)
        if storage is None:
            return False
        if codec is None and sample is not None and len(sample) >= _MIN_BYTES:
            from ...format.codec import encode_chunk

            encode_chunk(sample[: 64 << 10], itemsize)  # loads the codec: not part of its rate
            t0 = time.perf_counter()
            encode_chunk(sample, itemsize)
            codec = self.record_codec(url, len(sample), time.perf_counter() - t0)
        if codec is None:
            return False
        code = codec * coders > storage
        logger.debug(
            "%s: compress=auto %s (codec %.0f MB/s x %d threads, storage %.0f MB/s)",
            url, "codes" if code else "writes plain", codec / 1e6, coders, storage / 1e6,
        )  # fmt: skip
        return code

    def record_storage(self, url: str, nbytes: int, seconds: float) -> None:
        """A write stage moved ``nbytes`` to ``url`` in ``seconds`` of the backend's time."""
        if nbytes >= _MIN_BYTES and seconds > 0:
            key = place(url)
            with self._lock:
                r = self._rates.setdefault(key, _Rates())
                r.storage_bps = _mix(r.storage_bps, nbytes / seconds)

    def record_codec(self, url: str, nbytes: int, seconds: float) -> float | None:
        """One thread coded ``nbytes`` in ``seconds``; the codec's rate for ``url`` now."""
        key = place(url)
        with self._lock:
            r = self._rates.setdefault(key, _Rates())
            if nbytes >= _MIN_BYTES and seconds > 0:
                r.codec_bps = _mix(r.codec_bps, nbytes / seconds)
            return r.codec_bps


CHOICE = CompressChoice()
"""This process's measurements (the write stage's, and the writer process's in that process)."""
