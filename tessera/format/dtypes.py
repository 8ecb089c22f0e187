"""Names of torch dtypes in the manifest, and their safetensors codes in tile files.

The manifest names dtypes by their torch attribute name (``"bfloat16"``). Tile files use the
safetensors code where safetensors has one; other dtypes (complex128, float8_e8m0fnu, ...)
are stored as raw bytes (``U8`` with a trailing dimension of the item size), so every tile
file stays a valid safetensors file and the manifest keeps the true dtype.
"""

from __future__ import annotations

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


def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
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
