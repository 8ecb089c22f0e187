"""The safetensors header: written for tessera data files and Hugging Face exports, parsed for checks.

A safetensors file is ``[8-byte little-endian header length][JSON header][tensor bytes...]``.
The JSON header maps each tensor's name to ``{"dtype", "shape", "data_offsets"}`` (offsets
relative to the first byte after the header) and may hold a ``"__metadata__"`` object of
strings. This module is the only place that writes or parses that header; reading tensor
bytes is left to the callers (tessera's range reads, or the ``safetensors`` library).

Example:
    >>> header = encode_header([("w", "F32", (2, 3), 24)])
    >>> len(header) % ALIGN
    0
    >>> parse_header(lambda start, n: (header + bytes(24))[start : start + n], len(header) + 24)[1] == len(header)
    True
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Sequence
from typing import Any

from .dtypes import ALIGN

METADATA_KEY = "__metadata__"
"""The header key holding the file's string metadata, not a tensor."""

MAX_HEADER_BYTES = 100 << 20
"""The largest header :func:`parse_header` accepts (the ``safetensors`` library's own limit)."""

HeaderEntry = tuple[str, str, Sequence[int], int]
"""``(name, dtype code, shape, nbytes)`` of one tensor in a header, in file order."""


def encode_header(entries: Sequence[HeaderEntry], metadata: dict[str, str] | None = None) -> bytes:
    """The 8-byte length and JSON header of a safetensors file holding ``entries`` back to back.

    The header is padded with spaces to a multiple of :data:`~tessera.format.dtypes.ALIGN` bytes,
    so the tensor bytes that follow start aligned for every dtype (and a cache line).

    Args:
        entries: ``(name, dtype code, shape, nbytes)`` per tensor, in the order their bytes follow.
        metadata: string metadata, stored after ``"format": "pt"``.

    Returns:
        The header bytes, length prefix included.

    Example:
        >>> len(encode_header([("w", "F32", (2, 3), 24)]))
        128
    """
    header: dict[str, object] = {METADATA_KEY: {"format": "pt", **(metadata or {})}}
    pos = 0
    for name, code, shape, nbytes in entries:
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    body = json.dumps(header, separators=(",", ":")).encode("utf-8")
    body += b" " * (-(len(body) + 8) % ALIGN)
    return struct.pack("<Q", len(body)) + body


def parse_header(read: Callable[[int, int], bytes], size: int) -> tuple[dict[str, Any], int]:
    """Parse a safetensors header without reading any tensor bytes.

    Args:
        read: ``read(start, nbytes)`` returns ``nbytes`` bytes of the file from ``start``.
        size: the file's size in bytes.

    Returns:
        ``(header, data_start)``: the JSON header (``"__metadata__"`` included) and the file
        offset its ``data_offsets`` are relative to.

    Raises:
        ValueError: if the file is too short, the length is over the file or
            :data:`MAX_HEADER_BYTES`, or the header is not JSON.
        TypeError: if the header is not a JSON object.

    Example:
        >>> raw = encode_header([("w", "F32", (2,), 8)]) + bytes(8)
        >>> parse_header(lambda start, n: raw[start : start + n], len(raw))[0]["w"]["data_offsets"]
        [0, 8]
    """
    if size < 8:
        raise ValueError(f"{size} bytes is too short for a safetensors header")
    (n,) = struct.unpack("<Q", read(0, 8))
    if n > min(size - 8, MAX_HEADER_BYTES):
        raise ValueError(f"header length {n} exceeds the file or the {MAX_HEADER_BYTES}-byte limit")
    header = json.loads(read(8, n))
    if not isinstance(header, dict):
        raise TypeError("the header is not a JSON object")
    return header, 8 + n


def read_file_header(path: str) -> tuple[dict[str, Any], int]:
    """:func:`parse_header` of a local file.

    Raises:
        ValueError: naming the file, if it is not a safetensors file.
        TypeError: naming the file, if its header is not a JSON object.
        OSError: if it cannot be read.

    Example:
        >>> header, data_start = read_file_header("model.safetensors")  # doctest: +SKIP
    """
    with open(path, "rb") as fh:

        def read(start: int, n: int) -> bytes:
            fh.seek(start)
            data = fh.read(n)
            if len(data) != n:
                raise ValueError(f"{path} ends at byte {start + len(data)}, inside its header")
            return data

        fh.seek(0, 2)
        size = fh.tell()
        try:
            return parse_header(read, size)
        except TypeError as e:
            raise TypeError(f"{path} is not a safetensors file ({e})") from e
        except ValueError as e:  # JSONDecodeError and UnicodeDecodeError included
            raise ValueError(f"{path} is not a safetensors file ({e})") from e


def tensor_entries(header: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The tensor entries of a parsed header (the ``"__metadata__"`` entry left out).

    Example:
        >>> tensor_entries({"__metadata__": {"format": "pt"}, "w": {"dtype": "F32"}})
        {'w': {'dtype': 'F32'}}
    """
    return {k: v for k, v in header.items() if k != METADATA_KEY}
