"""Names of torch dtypes in the manifest, and their safetensors codes in tile files.

The manifest names dtypes by their torch attribute name (``"bfloat16"``). Tile files use the
safetensors code where safetensors has one; other dtypes (complex128, float8_e8m0fnu, ...)
are stored as raw bytes (``U8`` with a trailing dimension of the item size), so every tile
file stays a valid safetensors file and the manifest keeps the true dtype.
"""

from __future__ import annotations

import functools

import torch

# Canonical names only (no aliases such as "float" or "long").
_NAMES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float64",
        "float32",
        "float16",
        "bfloat16",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "bool",
        "complex128",
        "complex64",
        "complex32",
        "float8_e4m3fn",
        "float8_e4m3fnuz",
        "float8_e5m2",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
        "float4_e2m1fn_x2",
        "bits8",
        "bits16",
    )
    if isinstance(getattr(torch, name, None), torch.dtype)
}
_BY_DTYPE: dict[torch.dtype, str] = {v: k for k, v in _NAMES.items()}

_SAFETENSORS: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.complex64: "C64",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fnuz: "F8_E4M3FNUZ",
    torch.float8_e5m2fnuz: "F8_E5M2FNUZ",
}


def dtype_name(dtype: torch.dtype) -> str:
    """The manifest name of ``dtype``.

    Raises:
        TypeError: for dtypes tessera cannot store (quantized tensors).
    """
    try:
        return _BY_DTYPE[dtype]
    except KeyError:
        raise TypeError(f"tessera cannot store tensors of dtype {dtype}; dequantize or convert first") from None


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype for a manifest name; only known names are accepted."""
    try:
        return _NAMES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown dtype {name!r} in checkpoint") from None


ALIGN = 64
"""Byte alignment of tile data in data files and in host buffers: every dtype's alignment, and a cache line."""


@functools.cache
def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype`` (cached: planners ask once per tensor, thousands of times)."""
    return torch.empty((), dtype=dtype).element_size()


def safetensors_code(dtype: torch.dtype) -> tuple[str, bool]:
    """``(code, raw)``: the safetensors dtype code, and whether bytes are stored raw as U8."""
    code = _SAFETENSORS.get(dtype)
    if code is None:
        return "U8", True
    return code, False


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor's bytes as a 1-D uint8 view (no copy)."""
    return t.reshape(-1).view(torch.uint8)


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
