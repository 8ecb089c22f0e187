"""``SaveOptions(compress="auto")``: code a rank's files only where that makes its write faster.

A write that codes its chunks takes about ``max(B / C, (B / ratio) / W)`` for ``B`` logical
bytes, ``C`` the rate the rank's coder threads code at and ``W`` the rate its storage takes bytes
at; a plain write takes ``B / W``. So coding pays exactly where ``C > W``: object stores, network
filesystems, a disk shared by many ranks; not on a local disk faster than the codec (the 2-core
development machine's NVMe takes 1.1-1.7 GB/s, its two cores code 0.65-1.1 GB/s:
docs/compression.md).

Both rates are measured by the writes themselves, per process (the writer process keeps its
own), as moving averages:

* ``W`` per place: a local filesystem (its device) or an object store's bucket (scheme and
  host), whatever the checkpoint's path under it. Bytes stored over the write stage's time less
  the time the backend waited for its next bytes (staging pieces, checksums, frames).
* ``C`` per thread, for the process: logical bytes over the seconds spent coding; before any
  coded write, from coding one chunk of the write being decided (or a MiB of trained-like fp32
  values where it has none of a MiB: a memory budget's pieces, small tiles), a few milliseconds.

The model is a bound, not a promise: ``C <= W`` proves coding cannot win, but ``C > W`` does
not prove it does (on a core shared with other ranks, coding and writing do not overlap as the
model assumes: on the 2-core VM with its disk at 0.4 GB/s the model chose to code and the save
took 1.37x a plain one, docs/benchmarks.md). So where the model says code, the choice goes by
what the writes themselves realized: once both kinds of write ran to a place, the kind that moved
more logical bytes per second of its write stage is taken, and every :data:`PROBE_EVERY`-th
decision the other kind once more, so that a storage whose rate drifts is followed.

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

logger = logging.getLogger(__name__)

_WEIGHT = 0.5
"""Weight of the newest measurement in each moving average."""
_MIN_BYTES = 1 << 20
"""Writes smaller than this are not measured (their time is latency, not bandwidth)."""
PROBE_EVERY = 8
"""Decisions between two tries of the kind of write (coded or plain) that realized less."""


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


_SAMPLE: bytes | None = None


def _sample() -> bytes:
    """A MiB of trained-like fp32 values (normal, scale 0.02), to time the codec where a write
    has no chunk of its own to offer (a memory budget's pieces, tiles under a MiB)."""
    global _SAMPLE
    if _SAMPLE is None:
        import numpy as np

        _SAMPLE = (np.random.default_rng(0).standard_normal(1 << 18, dtype=np.float32) * 0.02).tobytes()
    return _SAMPLE


class CompressChoice:
    """The measured rates of one process: the storage's by :func:`place`, the codec's (a property
    of the machine's cores, whatever the place)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._storage: dict[str, float] = {}
        self._codec: float | None = None
        self._realized: dict[tuple[str, bool], float] = {}  # (place, coded): logical bytes/s of write stages
        self._decisions: dict[str, int] = {}  # per place: decisions taken by the realized rates

    def rates(self, url: str) -> tuple[float | None, float | None]:
        """``(storage bytes/s, codec bytes/s per thread)`` measured for ``url``'s place so far."""
        key = place(url)
        with self._lock:
            return self._storage.get(key), self._codec

    def should_code(self, url: str, coders: int, sample: memoryview | None, itemsize: int) -> bool:
        """Whether the next write to ``url`` with ``coders`` coder threads codes its chunks.

        Where the codec was not measured yet, ``sample`` (a chunk of that write of at least a MiB;
        else a MiB of trained-like fp32 values) is coded once to measure it.
        """
        storage, codec = self.rates(url)
        if storage is None:
            return False
        if codec is None:
            from ...format.codec import encode_chunk

            if sample is None or len(sample) < _MIN_BYTES:
                sample, itemsize = memoryview(_sample()), 4
            encode_chunk(sample[: 64 << 10], itemsize)  # loads the codec: not part of its rate
            t0 = time.perf_counter()
            encode_chunk(sample, itemsize)
            codec = self.record_codec(len(sample), time.perf_counter() - t0)
        if codec is None:
            return False
        code = codec * coders > storage and self._realized_choice(place(url))
        logger.debug(
            "%s: compress=auto %s (codec %.0f MB/s x %d threads, storage %.0f MB/s)",
            url, "codes" if code else "writes plain", codec / 1e6, coders, storage / 1e6,
        )  # fmt: skip
        return code

    def _realized_choice(self, key: str) -> bool:
        """Where the model says code: whether to, by the writes both kinds realized at ``key``."""
        with self._lock:
            plain, coded = self._realized.get((key, False)), self._realized.get((key, True))
            if plain is None or coded is None:
                return True  # not both tried here yet: try what the model expects to be faster
            n = self._decisions[key] = self._decisions.get(key, 0) + 1
            faster = coded > plain
            return faster != (n % PROBE_EVERY == 0)

    def realized(self, url: str) -> tuple[float | None, float | None]:
        """``(plain, coded)``: logical bytes per second the write stages of each kind realized."""
        key = place(url)
        with self._lock:
            return self._realized.get((key, False)), self._realized.get((key, True))

    def record_write(self, url: str, logical: int, seconds: float, coded: bool) -> None:
        """A write stage (coded or plain) moved ``logical`` bytes of tiles to ``url`` in ``seconds``."""
        self._record(self._realized, (place(url), coded), logical, seconds)

    def _record(self, table: dict, key: object, nbytes: int, seconds: float) -> None:
        """Mix a rate into ``table[key]``; writes under :data:`_MIN_BYTES` are latency, not measured."""
        if nbytes >= _MIN_BYTES and seconds > 0:
            with self._lock:
                table[key] = _mix(table.get(key), nbytes / seconds)

    def record_storage(self, url: str, nbytes: int, seconds: float) -> None:
        """A write stage moved ``nbytes`` to ``url`` in ``seconds`` of the backend's time."""
        self._record(self._storage, place(url), nbytes, seconds)

    def record_codec(self, nbytes: int, seconds: float) -> float | None:
        """Threads coded ``nbytes`` in ``seconds`` of their time in all; the codec's rate now."""
        with self._lock:
            if nbytes >= _MIN_BYTES and seconds > 0:
                self._codec = _mix(self._codec, nbytes / seconds)
            return self._codec


CHOICE = CompressChoice()
"""This process's measurements (the write stage's, and the writer process's in that process)."""
