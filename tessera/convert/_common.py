"""Small pieces every converter shares: results, progress, sizes, dtypes, names, blocks.

Conversions stream: a tensor is cut into blocks of at most ``block_bytes`` (see
:func:`split_box`) and only a few blocks are in memory at once, so converting never needs
the whole model in memory.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from ..format.dtypes import dtype_name, safetensors_code
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


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """Bytes in a size such as ``"5GB"`` (10^9), ``"512MiB"`` (2^20) or ``1000``.

    Decimal and binary units follow the Hugging Face convention (``"5GB"`` is 5·10^9 bytes).

    Raises:
        ValueError: for anything else, or a size below one byte.

    Example:
        >>> parse_size("2MiB")
        2097152
    """
    if isinstance(text, int):
        n = text
    else:
        m = _SIZE.match(text)
        if m is None:
            raise ValueError(f"cannot read size {text!r}; use e.g. 5GB, 512MiB or a number of bytes")
        unit = (m.group(2) or "b").lower()
        power = {"b": 0, "k": 1, "m": 2, "g": 3, "t": 4}[unit[0]]
        base = 1024 if "i" in unit else 1000
        n = int(float(m.group(1)) * base**power)
    if n < 1:
        raise ValueError(f"size {text!r} must be at least one byte")
    return n


_DTYPE_ALIASES = {
    "fp32": torch.float32,
    "float": torch.float32,
    "f32": torch.float32,
    "fp16": torch.float16,
    "half": torch.float16,
    "f16": torch.float16,
    "bf16": torch.bfloat16,
    "fp64": torch.float64,
    "double": torch.float64,
}


def parse_dtype(text: str) -> torch.dtype:
    """The torch dtype for ``"bf16"``, ``"bfloat16"``, ``"torch.float16"`` and so on.

    Raises:
        ValueError: for a name that is not a floating-point dtype.

    Example:
        >>> parse_dtype("bf16")
        torch.bfloat16
    """
    name = text.strip().lower().removeprefix("torch.")
    dt = _DTYPE_ALIASES.get(name) or getattr(torch, name, None)
    if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
        raise ValueError(f"unknown floating-point dtype {text!r}; use e.g. bf16, fp16, fp32")
    return dt


def cast_for(dtype: torch.dtype, target: torch.dtype | None) -> torch.dtype:
    """The dtype a tensor of ``dtype`` is written as: casts apply to floating point only."""
    if target is None or not dtype.is_floating_point:
        return dtype
    return target


def strip_prefix(names: Iterable[str], prefix: str | None) -> dict[str, str]:
    """``{new name: old name}`` of the names under ``prefix``, with the prefix removed.

    Without a prefix every name maps to itself.
    """
    if not prefix:
        return {n: n for n in names}
    return {n[len(prefix) :]: n for n in names if n.startswith(prefix) and len(n) > len(prefix)}


def numel(shape: Iterable[int]) -> int:
    return math.prod(shape)


_KNOWN_DTYPES = (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, torch.complex64, torch.uint16, torch.uint32, torch.uint64,
    torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
)  # fmt: skip
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {safetensors_code(dt)[0]: dt for dt in _KNOWN_DTYPES}
"""safetensors dtype code (``"BF16"``) -> torch dtype, for every code both sides know."""


def safetensors_dtype_code(dtype: torch.dtype, name: str) -> str:
    """The safetensors code of ``dtype``.

    Raises:
        TypeError: naming the tensor, for dtypes the safetensors format cannot hold.
    """
    code, raw = safetensors_code(dtype)
    if raw:
        raise TypeError(f"tensor '{name}' has dtype {dtype_name(dtype)}, which safetensors files cannot hold")
    return code
