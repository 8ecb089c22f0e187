"""``TESSERA_DIRECT_IO=auto`` (the default): write a device's data files with ``O_DIRECT`` or
buffered, whichever its own durable writes measured faster.

``O_DIRECT`` spares the cores beside a save the kernel's copy into the page cache and its
writeback, and on most days of this project's VM it was also the faster durable write (0.4 s per
512 MB against 0.4-1.8 s buffered). On others the same virtual disk capped direct writes at
390-445 MB/s while buffered, fsync'ed writes ran at 680 MB/s: a sync save took 1.5x DCP's
(docs/benchmarks.md, "Speed at size on a slower disk"). Which one wins is the device's, and can
change from hour to hour, so it is measured, per device, from the writes tessera makes anyway:

* every durable data file of at least :data:`MIN_SAMPLE_BYTES` is timed from its creation to
  the end of its fsync, less the time the write waited for its next bytes (an async save's
  staging copy, a coder: a slow producer would make the mode its file used look slow), and its
  bytes per second feed a moving average for its mode;
* the first files a process writes to a device go direct; once one was measured, the next are
  written buffered until one of those was measured; after that, buffered only where it measured
  :data:`MARGIN` times faster than direct (direct's spared CPU is worth that much), and one file
  in :data:`EXPLORE_EVERY` measured writes tries the other mode, so a change is seen.

Per process (each writer process measures its own) and thread-safe.
"""

from __future__ import annotations

import threading

MIN_SAMPLE_BYTES = 8 << 20
"""Smaller files say more about fsync latency than about bandwidth: not measured."""

MARGIN = 1.25
"""Buffered writes are chosen only where they measured this many times direct's rate."""

EXPLORE_EVERY = 32
"""After this many measured writes of a device, one file goes the other way, to follow the device
(one: the files a save writes side by side do not all explore at once)."""

_WEIGHT = 0.3
"""Weight of the newest measurement in a mode's moving average."""


class DirectChoice:
    """Measured durable-write rates per device and mode, and the choice they make."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rates: dict[int, dict[bool, float]] = {}
        self._since: dict[int, int] = {}  # measured writes since the device's last exploration

    def use_direct(self, device: int) -> bool:
        """Whether the next data file on ``device`` (``st_dev``) should be written with ``O_DIRECT``."""
        with self._lock:
            rates = self._rates.get(device, {})
            if True not in rates:
                return True
            if False not in rates:
                return False
            best = rates[False] < MARGIN * rates[True]
            if self._since.get(device, 0) >= EXPLORE_EVERY:
                self._since[device] = 0
                return not best
            return best

    def record(self, device: int, direct: bool, nbytes: int, seconds: float) -> None:
        """A durable write of ``nbytes`` on ``device`` took ``seconds`` (creation to fsync)."""
        if nbytes < MIN_SAMPLE_BYTES or seconds <= 0:
            return
        rate = nbytes / seconds
        with self._lock:
            rates = self._rates.setdefault(device, {})
            old = rates.get(direct)
            rates[direct] = rate if old is None else (1 - _WEIGHT) * old + _WEIGHT * rate
            self._since[device] = self._since.get(device, 0) + 1

    def rates(self, device: int) -> dict[str, float]:
        """The device's moving averages in bytes per second (``direct``, ``buffered``), as measured."""
        with self._lock:
            got = self._rates.get(device, {})
            return {("direct" if k else "buffered"): v for k, v in got.items()}


CHOICE = DirectChoice()
