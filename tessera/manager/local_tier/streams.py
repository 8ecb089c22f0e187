"""A node's stream (:mod:`.stripes`): its files of a step read or written as one byte range.

Reads map the files (no copy when a chunk lies in one file); writes go into
:class:`~tessera.manager.local_tier.transfer.FileSink` files mapped onto the page cache,
renamed into place only when the whole stream was written.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np
import torch

from .transfer import FileSink, read_tensor


class StreamReader:
    """Read chunks of a node's stream from its step directory.

    Args:
        root: the step directory.
        files: the stream's ``(path, nbytes)`` in stream order.
    """

    def __init__(self, root: str, files: Sequence[tuple[str, int]]) -> None:
        self.root = root
        self.files = list(files)
        self.starts = [0]
        for _, n in self.files:
            self.starts.append(self.starts[-1] + n)
        self._maps: dict[int, torch.Tensor] = {}

    @property
    def length(self) -> int:
        return self.starts[-1]

    def _file(self, i: int) -> torch.Tensor:
        if i not in self._maps:
            path, nbytes = self.files[i]
            t = read_tensor(self.root, path)
            if t.numel() != nbytes:
                raise OSError(f"{self.root}/{path}: {t.numel()} bytes, {nbytes} expected")
            self._maps[i] = t
        return self._maps[i]

    def read(self, offset: int, n: int, end: int) -> torch.Tensor:
        """``n`` bytes from ``offset``: the stream's bytes below ``min(end, length)``, zeros after."""
        stop = min(offset + n, end, self.length)
        if stop <= offset:
            return torch.zeros(n, dtype=torch.uint8)
        i = bisect.bisect_right(self.starts, offset) - 1
        if stop - offset == n and stop <= self.starts[i + 1]:
            return self._file(i)[offset - self.starts[i] : stop - self.starts[i]]  # a view of the mapping
        out = torch.zeros(n, dtype=torch.uint8)
        pos = offset
        while pos < stop:
            i = bisect.bisect_right(self.starts, pos) - 1
            upto = min(stop, self.starts[i + 1])
            out[pos - offset : upto - offset] = self._file(i)[pos - self.starts[i] : upto - self.starts[i]]
            pos = upto
        return out

    def close(self) -> None:
        """Release the mappings."""
        self._maps.clear()


class StreamWriter:
    """Write a node's stream into new files of a step directory (replacing any present).

    Args:
        root: the step directory.
        files: the stream's ``(path, nbytes)`` in stream order.
    """

    def __init__(self, root: str, files: Sequence[tuple[str, int]]) -> None:
        self.starts = [0]
        for _, n in files:
            self.starts.append(self.starts[-1] + n)
        self.sinks: list[FileSink] = []
        try:
            for path, n in files:
                self.sinks.append(FileSink(root, path, n))
        except BaseException:
            self.abort()
            raise

    def write(self, offset: int, data: np.ndarray) -> None:
        """Put ``data`` at ``offset`` of the stream (bytes past its end are padding: dropped)."""
        stop = min(offset + len(data), self.starts[-1])
        pos = offset
        while pos < stop:
            i = bisect.bisect_right(self.starts, pos) - 1
            upto = min(stop, self.starts[i + 1])
            chunk = torch.from_numpy(np.ascontiguousarray(data[pos - offset : upto - offset]))
            self.sinks[i].buffer[pos - self.starts[i] : upto - self.starts[i]] = chunk
            pos = upto

    def view(self, offset: int, n: int) -> torch.Tensor | None:
        """The ``n`` bytes at ``offset`` as a view of one file's mapping (a receive lands there with
        no copy), or None where they span files or pass the stream's end (:meth:`write` them)."""
        i = bisect.bisect_right(self.starts, offset) - 1
        if n <= 0 or i >= len(self.sinks) or offset + n > self.starts[i + 1]:
            return None
        return self.sinks[i].buffer[offset - self.starts[i] : offset - self.starts[i] + n]

    def commit(self) -> None:
        """Rename every file into place."""
        for sink in self.sinks:
            sink.commit()

    def abort(self) -> None:
        """Remove the temporary files."""
        for sink in self.sinks:
            sink.abort()
