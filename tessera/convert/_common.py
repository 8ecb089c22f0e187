"""Small pieces every converter shares: results, progress, sizes, dtypes, names, blocks.

Conversions stream: a tensor is cut into blocks of at most ``block_bytes`` (see
:func:`split_box`) and only a few blocks are in memory at once, so converting never needs
the whole model in memory.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ..format.dtypes import itemsize as itemsize  # re-exported for the converters
from ..format.geometry import split_box as split_box  # re-exported for the converters

ProgressFn = Callable[[int, int], None]
"""``progress(done_bytes, total_bytes)``, called as a conversion moves bytes."""

DEFAULT_BLOCK_BYTES = 64 << 20
"""Largest block of a tensor a converter reads or writes at once."""


@dataclass(frozen=True)
class ConvertResult:
    """What a conversion did.

    Attributes:
        source: where the data came from.
        destination: where it went.
        tensors: number of tensors written.
        values: number of plain values written.
        bytes: tensor bytes written (after any dtype cast).
        files: number of files written.
        seconds: wall time of the conversion.
        skipped: names the target format cannot hold (with the reason), not written.
    """

    source: str
    destination: str
    tensors: int
    values: int
    bytes: int
    files: int
    seconds: float
    skipped: tuple[str, ...] = field(default_factory=tuple)


class Progress:
    """Counts bytes against a total and forwards them to an optional callback."""

    def __init__(self, total: int, callback: ProgressFn | None) -> None:
        self.total = total
        self.done = 0
        self._callback = callback

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        if self._callback is not None:
            self._callback(self.done, self.total)


def numel(shape: Iterable[int]) -> int:
    return math.prod(shape)
