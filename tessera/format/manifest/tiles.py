"""A tensor's tiles as a manifest holds them (a ``tiles`` list or a ``tile_table`` of columns),
decoded and validated column by column.

Columns are checked with whole-array numpy operations (no per-tile Python work); a tensor's
table may be decoded lazily, on first use (:class:`EncodedTiles`). What one manifest's tables
may inflate to is bounded by a :class:`Budget` charged before a byte is inflated.
"""

from __future__ import annotations

import base64
import binascii
import sys
import threading
import zlib
from collections.abc import Sequence
from itertools import chain
from typing import Any

import numpy as np

from ...errors import ManifestError
from ..chunking import Chunking
from .schema import MAX_MANIFEST_BYTES, FileEntry, TileTable


def fail(what: str) -> ManifestError:
    """The error of an invalid manifest: ``what`` is the problem, naming the tensor and field."""
    return ManifestError(f"invalid manifest: {what}")


def as_int(x: Any, what: str, lo: int = 0) -> int:
    """``x`` if it is an integer in ``[lo, 2**62)`` (booleans are not), else :func:`fail`."""
    # The upper bound keeps the int64 arithmetic of _decode_tiles free of overflow.
    if type(x) is not int or not lo <= x < 1 << 62:
        raise fail(f"{what} must be an integer in [{lo}, 2**62), got {x!r:.80}")
    return x


def as_dict(x: Any, what: str) -> dict:
    """``x`` if it is a JSON object, else :func:`fail`."""
    if not isinstance(x, dict):
        raise fail(f"{what} must be an object")
    return x


def _int_array(values: Any, what: str, ndim: int) -> np.ndarray:
    """A strict int64 array from JSON lists (no floats, strings, bools or ragged rows)."""
    try:
        arr = np.array(values)
    except (ValueError, TypeError, OverflowError):
        raise fail(f"{what} must be integers of equal length") from None
    if arr.ndim != ndim:  # before the empty shortcut: [[]] is not a list of integers
        raise fail(f"{what} must be non-negative integers")
    if arr.size == 0:
        return np.zeros(arr.shape, dtype=np.int64)
    if arr.dtype.kind not in "iu":
        raise fail(f"{what} must be non-negative integers")
    # Below 2**62, sums like offsets + lengths and byte_offset + nbytes cannot wrap in int64.
    if (arr < 0).any() or arr.max() >= 1 << 62:
        raise fail(f"{what} must be non-negative integers below 2**62")
    return arr.astype(np.int64)


class Budget:
    """Bytes that tile-table columns may still inflate to (see :data:`DECODE_RATIO`)."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.left = total

    def take(self, nbytes: int, what: str) -> None:
        if nbytes < 0 or nbytes > self.left:
            raise fail(
                f"{what} declares {nbytes} bytes of tile data, more than a manifest of this size can hold "
                f"(at most {self.total} bytes in all); the count is inconsistent with the file"
            )
        self.left -= nbytes


class Context:
    """What every tensor of one manifest shares while its tiles are decoded."""

    __slots__ = ("budget", "chunking", "file_sizes", "files", "lock", "paths", "source")

    def __init__(self, source: str, files: tuple[FileEntry, ...], chunking: Chunking, budget: Budget) -> None:
        self.source = source
        self.files = files
        self.paths = tuple(f.path for f in files)
        # Tiles lie inside a file's logical bytes (a compressed file's: what its frames decode to).
        self.file_sizes = np.array([f.logical_bytes for f in files], dtype=np.int64)
        self.chunking = chunking
        self.budget = budget
        self.lock = threading.Lock()  # one decode at a time: the budget is charged once per table


class EncodedTiles:
    """A tensor's tiles as the manifest holds them, checked for size up front and decoded once.

    Construction checks the form and charges the tile count to the manifest's budget, so that
    a manifest cannot promise more than :data:`DECODE_RATIO` times its size even if its tables
    are decoded later (:func:`decode` with ``lazy=True``). :meth:`decode` validates the columns
    on first call and returns the same table (or raises the same error) on every later call;
    it is safe to call from several threads.
    """

    __slots__ = ("_ctx", "_error", "_form", "_name", "_raw", "_shape", "_size", "_table", "count")

    def __init__(self, ctx: Context, name: str, entry: dict, shape: tuple[int, ...], size: int) -> None:
        what = f"tensor '{name}'"
        if ("tiles" in entry) == ("tile_table" in entry):
            raise fail(f"{what}: needs exactly one of 'tiles' and 'tile_table'")
        self._form = "tiles" if "tiles" in entry else "tile_table"
        raw = entry[self._form]
        if self._form == "tiles":
            if not isinstance(raw, list):
                raise fail(f"{what}: tiles must be a list")
            self.count = len(raw)
        else:
            raw = as_dict(raw, f"{what} tile_table")
            self.count = as_int(raw.get("count"), f"{what} tile_table count")
            # Every tile has at least file, byte_offset and chunks entries, plus its boxes: checked
            # against the budget before a byte is inflated.
            ctx.budget.take(8 * self.count * (3 + 2 * len(shape)), f"{what}: tile_table.count {self.count}")
        self._ctx, self._name, self._raw, self._shape, self._size = ctx, name, raw, shape, size
        self._table: TileTable | None = None
        self._error: str | None = None

    def decode(self) -> TileTable:
        """The validated table (decoded on the first call).

        Raises:
            ManifestError: naming the tensor (and, for a lazily decoded manifest, the source).
        """
        with self._ctx.lock:
            if self._table is None:
                if self._error is not None:
                    raise ManifestError(self._error)
                try:
                    table = _decode_tiles(self._ctx, self._name, self._form, self._raw, self._shape, self._size)
                except ManifestError as e:
                    self._error, self._raw = str(e), None
                    raise
                self._table, self._raw = table, None  # the encoded text is not needed any more
            return self._table

    def __call__(self) -> TileTable:
        """:meth:`decode` for a lazily decoded manifest: errors name the manifest too, as :func:`decode`'s do."""
        try:
            return self.decode()
        except ManifestError as e:
            raise ManifestError(f"{self._ctx.source}: {e}") from None


def _decode_tiles(ctx: Context, name: str, form: str, raw: Any, shape: tuple[int, ...], size: int) -> TileTable:
    """Parse a tensor's tiles (list or table form) and validate them column by column."""
    what = f"tensor '{name}'"
    nd = len(shape)
    if form == "tiles":
        columns = _tile_lists(what, raw, nd)
    else:
        columns = _tile_table(what, raw, nd, ctx.budget)
    return check_columns(ctx, name, shape, size, columns)


def check_columns(
    ctx: Context, name: str, shape: tuple[int, ...], size: int, columns: tuple[np.ndarray, ...]
) -> TileTable:
    """A tensor's decoded columns ``(file, offsets, lengths, byte_offset, chunks, checksums)``,
    validated (inside the tensor and their files, aligned, checksum counts) as a table.

    Raises:
        ManifestError: naming the tensor and the first problem.
    """
    what = f"tensor '{name}'"
    nd = len(shape)
    fidx, offs, lens, byte_offsets, counts, sums = columns
    n = len(fidx)
    if not n:  # a tensor without elements: shared empty columns, no per-tensor arrays
        z = _EMPTY.get(nd)
        if z is None:
            z = (np.zeros(0, dtype=np.int64), np.zeros((0, nd), dtype=np.int64), np.zeros(0, dtype=np.uint64))
            for a in z:
                a.flags.writeable = False
            _EMPTY[nd] = z
        return TileTable(ctx.paths, z[0], z[1], z[1], z[0], z[0], z[0], z[2])
    files = ctx.files
    if int(fidx.max()) >= len(files):
        raise fail(f"{what}: a tile refers to file #{int(fidx.max())} but only {len(files)} files are listed")
    if nd:
        shape_arr = np.asarray(shape, dtype=np.int64)
        if (np.add(offs, lens) > shape_arr).any():  # no overflow: both are below 2**62
            i = int(np.flatnonzero((offs + lens > shape_arr).any(axis=1))[0])
            raise fail(f"{what}: tile at {offs[i].tolist()} x {lens[i].tolist()} lies outside shape {list(shape)}")
        if not lens.all():  # savers never store empty boxes; they would cost memory, not data
            i = int(np.flatnonzero((lens == 0).any(axis=1))[0])
            raise fail(f"{what}: tile lengths {lens[i].tolist()} hold no element; a tile must not be empty")
        # Inside the tensor, so the product stays below prod(shape) * size < 2**62.
        nbytes = lens[:, 0] * size
        for d in range(1, nd):
            nbytes *= lens[:, d]
    else:
        nbytes = np.full(n, size, dtype=np.int64)
    over = np.flatnonzero(byte_offsets + nbytes > ctx.file_sizes[fidx])
    if len(over):
        i = int(over[0])
        raise fail(
            f"{what}: tile bytes [{int(byte_offsets[i])}, {int(byte_offsets[i] + nbytes[i])}) exceed file {files[int(fidx[i])].path}"
        )
    # The reader views buffers as the dtype: tiles must be item-aligned (item sizes are powers of two).
    misaligned = np.flatnonzero(byte_offsets & (size - 1) if size & (size - 1) == 0 else byte_offsets % size)
    if len(misaligned):
        i = int(misaligned[0])
        raise fail(f"{what}: tile byte offset {int(byte_offsets[i])} is not a multiple of the item size {size}")
    chunking = ctx.chunking
    if int(nbytes.max()) <= chunking.whole_below:  # the common case at scale: one checksum per tile
        ok = int(counts.min()) == 1 == int(counts.max()) and len(sums) == n
    else:
        expected = chunking.counts(nbytes)
        ok = np.array_equal(counts, expected) and len(sums) == int(expected.sum())
    if not ok:
        expected = chunking.counts(nbytes)
        raise fail(f"{what}: expected {expected.tolist()[:5]} chunk checksums per tile, found {counts.tolist()[:5]}")
    return TileTable(ctx.paths, fidx, offs, lens, byte_offsets, nbytes, counts, sums)


def check_many(ctx: Context, items: Sequence[tuple[str, tuple[int, ...], int, Any]]) -> list[TileTable] | None:
    """:func:`check_columns` of many tensors' columns (``(name, shape, item size, columns)``) with
    whole-array work per number of dimensions: their tables, or None if any is invalid (then
    :func:`check_columns` of each, which names the tensor and the problem)."""
    out: list[TileTable | None] = [None] * len(items)
    by_nd: dict[int, list[int]] = {}
    for i, (_, shape, _, cols) in enumerate(items):
        if len(cols[0]):
            by_nd.setdefault(len(shape), []).append(i)
        else:
            out[i] = check_columns(ctx, items[i][0], shape, items[i][2], cols)
    chunking = ctx.chunking
    for nd, ks in by_nd.items():
        n = np.array([len(items[k][3][0]) for k in ks], dtype=np.int64)
        fidx, offs, lens, bo, counts, sums = (np.concatenate([items[k][3][c] for k in ks]) for c in range(6))
        size = np.repeat(np.array([items[k][2] for k in ks], dtype=np.int64), n)
        if int(fidx.max()) >= len(ctx.files):
            return None
        nbytes = size.copy()
        if nd:
            bound = np.repeat(np.array([items[k][1] for k in ks], dtype=np.int64).reshape(len(ks), nd), n, axis=0)
            if (offs + lens > bound).any() or not lens.all():
                return None
            for d in range(nd):  # inside the tensor: below prod(shape) * size < 2**62
                nbytes *= lens[:, d]
        if (bo + nbytes > ctx.file_sizes[fidx]).any() or (bo & (size - 1)).any() or (size & (size - 1)).any():
            return None
        if int(nbytes.max()) <= chunking.whole_below:
            if int(counts.min()) != 1 or int(counts.max()) != 1 or len(sums) != len(fidx):
                return None
        elif not np.array_equal(counts, chunking.counts(nbytes)) or len(sums) != int(counts.sum()):
            return None
        at = np.concatenate([[0], np.cumsum(n)]).tolist()
        sum_at = np.concatenate([[0], np.cumsum(counts)])[at].tolist()
        for j, k in enumerate(ks):
            a, b = at[j], at[j + 1]
            out[k] = TileTable(
                ctx.paths,
                fidx[a:b],
                offs[a:b],
                lens[a:b],
                bo[a:b],
                nbytes[a:b],
                counts[a:b],
                sums[sum_at[j] : sum_at[j + 1]],
            )
    return [t for t in out if t is not None]


_EMPTY: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
"""Shared read-only columns of tile tables without tiles, per ndim."""

_Columns = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def _tile_lists(what: str, raw: Any, nd: int) -> _Columns:
    """Columns of the list form: ``[[file, offsets, lengths, byte_offset, [hex, ...]], ...]``."""
    if not isinstance(raw, list):
        raise fail(f"{what}: tiles must be a list")
    n = len(raw)
    if not raw:
        z = np.zeros(0, dtype=np.int64)
        return (
            z,
            np.zeros((0, nd), dtype=np.int64),
            np.zeros((0, nd), dtype=np.int64),
            z,
            z,
            np.zeros(0, dtype=np.uint64),
        )
    try:
        ok = set(map(len, raw)) == {5} and all(isinstance(t, list) for t in raw)
    except TypeError:
        ok = False
    if not ok:
        raise fail(f"{what}: a tile must be [file, offsets, lengths, byte_offset, checksums]")
    fcol, ocol, lcol, bcol, scol = zip(*raw)
    fidx = _int_array(fcol, f"{what} tile file indices", 1)
    if nd:
        offs = _int_array(ocol, f"{what} tile offsets", 2)
        lens = _int_array(lcol, f"{what} tile lengths", 2)
        if offs.shape != (n, nd) or lens.shape != (n, nd):
            raise fail(f"{what}: tile rank does not match its shape")
    else:
        if any(o != [] for o in ocol) or any(x != [] for x in lcol):
            raise fail(f"{what}: tile rank does not match shape []")
        offs = lens = np.zeros((n, 0), dtype=np.int64)
    byte_offsets = _int_array(bcol, f"{what} tile byte offsets", 1)
    try:
        counts = np.fromiter(map(len, scol), dtype=np.int64, count=n)
        joined = "".join(chain.from_iterable(scol))
        digests = bytes.fromhex(joined)
    except (TypeError, ValueError):
        raise fail(f"{what}: checksums must be lists of 16 hex digits") from None
    total = int(counts.sum())
    if len(joined) != 16 * total or len(digests) != 8 * total:
        raise fail(f"{what}: checksums must be lists of 16 hex digits")
    return fidx, offs, lens, byte_offsets, counts, np.frombuffer(digests, dtype=">u8").astype(np.uint64)


_COLUMN_TYPES = {"int8": "<i1", "int16": "<i2", "int32": "<i4", "int64": "<i8", "uint64": "<u8"}
"""Column ``dtype`` names and their little-endian layouts (``uint64`` is for checksums only)."""

if sys.version_info >= (3, 11):

    def _b64decode(text: str) -> bytes:
        return binascii.a2b_base64(text, strict_mode=True)

else:  # pragma: no cover - Python 3.10

    def _b64decode(text: str) -> bytes:
        return base64.b64decode(text, validate=True)


def _tile_table(what: str, raw: dict, nd: int, budget: Budget) -> _Columns:
    """Columns of the table form (see docs/format.md); ``count`` is charged to the budget already."""
    n = raw["count"]
    fidx = column(what, raw, "file", n, n)
    offs = column(what, raw, "offsets", n * nd, n).reshape(n, nd)
    lens = column(what, raw, "lengths", n * nd, n).reshape(n, nd)
    byte_offsets = column(what, raw, "byte_offset", n, n)
    counts = column(what, raw, "chunks", n, n)
    total = int(counts.sum())
    budget.take(8 * total, f"{what}: tile_table.chunks (sum {total})")
    sums = column(what, raw, "checksums", total, total)
    return fidx, offs, lens, byte_offsets, counts, sums


def column(what: str, raw: dict, key: str, count: int, rows: int, label: str = "tile_table") -> np.ndarray:
    """One column: ``count`` values in ``rows`` rows, as int64 in [0, 2**62) (uint64 for checksums).

    A column is either a string (base64 of deflated little-endian 64-bit values, the first form
    of tile tables) or ``{"dtype", "delta", "zlib", "data"}``. Inflating is bounded by what
    ``count`` allows, so a hostile column cannot expand beyond what it declares.
    """
    checksums = key == "checksums"
    value = raw.get(key)
    if isinstance(value, str):
        dtype, delta, deflated, text = ("<u8" if checksums else "<i8"), False, True, value
    elif isinstance(value, dict):
        name, delta, deflated = value.get("dtype"), value.get("delta", False), value.get("zlib", False)
        if name not in _COLUMN_TYPES or (name == "uint64") != checksums:
            allowed = "uint64" if checksums else "int8, int16, int32 or int64"
            raise fail(f"{what}: {label}.{key}.dtype must be {allowed}, got {name!r:.40}")
        if type(delta) is not bool or type(deflated) is not bool or (delta and checksums):
            raise fail(f"{what}: {label}.{key}: delta and zlib must be true or false (checksums take no delta)")
        data = value.get("data")
        if not isinstance(data, str):
            raise fail(f"{what}: {label}.{key}.data must be a base64 string")
        dtype, text = _COLUMN_TYPES[name], data
    else:
        raise fail(f"{what}: {label}.{key} must be a base64 string or a column object")
    if len(text) > 4 * MAX_MANIFEST_BYTES // 3 + 4:
        raise fail(f"{what}: {label}.{key} must be a base64 string")
    expected = count * np.dtype(dtype).itemsize
    try:
        buf = _b64decode(text)
        if deflated:  # bounded: a hostile column cannot inflate past what ``count`` allows
            buf = zlib.decompressobj().decompress(buf, expected + 1)
    except (binascii.Error, ValueError, zlib.error):
        raise fail(f"{what}: {label}.{key} is not valid base64{' of zlib data' if deflated else ''}") from None
    if len(buf) != expected:
        raise fail(f"{what}: {label}.{key} holds {len(buf)} bytes, expected {expected}")
    arr = np.frombuffer(buf, dtype=dtype)
    if checksums:
        return arr.astype(np.uint64, copy=False)
    if not count:
        return np.zeros(0, dtype=np.int64)
    if delta:  # each row is the difference from the row before it (per column of a 2-D array)
        arr = np.cumsum(arr.reshape(rows, -1), axis=0, dtype=np.int64).reshape(-1)
    else:
        arr = arr.astype(np.int64, copy=False)
    # One pass for both bounds: negatives are huge as unsigned. Below 2**62, sums like
    # offsets + lengths and byte_offset + nbytes cannot wrap in int64.
    if int(arr.view(np.uint64).max()) >= 1 << 62:
        raise fail(f"{what}: {label}.{key} must be non-negative integers below 2**62")
    return arr
