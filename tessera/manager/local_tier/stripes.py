"""The parity layout of a step of the local tier (``local_parity=(k, m)``): pure functions of
the job's shape and the step's manifest, so every rank computes the same layout alone.

Each node's *stream* is the concatenation, in manifest order, of the files written by its
ranks (its own files of the step); its length is the sum of their sizes. A stream is cut into
``k`` equal *segments* of ``ceil(length / k)`` bytes (the last one zero-padded).

Stripes rotate over the ``N`` nodes of the save, in increasing node index (their *positions*
0..N-1): stripe ``i`` (there are ``N``) has as data the segment ``t`` of the node at position
``(i + t) % N`` for ``t < k``, each zero-padded to the stripe's block size (its largest
segment), and its ``m`` parity blocks are kept by the nodes at positions ``(i + k + p) % N``
for ``p < m``. So every node gives one segment to each of ``k`` stripes and keeps one parity
block of each of ``m`` stripes: ``m/k`` of its bytes in extra memory whatever ``N % k`` is,
and the ``k + m`` blocks of a stripe are on ``k + m`` distinct nodes, so any ``m`` lost nodes
cost every stripe at most ``m`` blocks. The parity block ``p`` of stripe ``i`` is the file
:func:`parity_path` in the step directory of its holder.

A job of ``N < k + m`` nodes uses ``m' = min(m, N - 1)`` and ``k' = min(k, N - m')`` (a warning
says so): a two-node job gets ``1 + 1`` (each node's stream copied to the other, as one
replica), a one-node job no parity at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .codec import CODECS, codec_for

__all__ = ["CHUNK", "ParityLayout", "effective", "parity_path"]

CHUNK = 4 << 20
"""Bytes of each block moved and encoded at once: a node's parity window holds at most
``(k + m)`` chunks of each stripe it encodes or rebuilds, never a copy of its stream."""


def effective(k: int, m: int, nodes: int) -> tuple[int, int]:
    """The ``(k, m)`` a job of ``nodes`` nodes uses for ``local_parity=(k, m)`` ((0, 0): none).

    Example:
        >>> effective(4, 2, 6), effective(4, 2, 3), effective(2, 1, 2), effective(2, 1, 1)
        ((4, 2), (1, 2), (1, 1), (0, 0))
    """
    m_e = min(m, nodes - 1)
    if m_e < 1:
        return 0, 0
    return min(k, nodes - m_e), m_e


def parity_path(save_id: str, stripe: int, block: int) -> str:
    """The file of parity block ``block`` of ``stripe``, relative to the step directory."""
    return f"parity/{save_id}/{stripe}-{block}.bin"


@dataclass(frozen=True)
class ParityLayout:
    """Which bytes form which stripe, and where parity blocks live.

    Attributes:
        k: data blocks per stripe.
        m: parity blocks per stripe.
        order: the node index at each position (the save's nodes, increasing).
        lengths: the stream length of each position.
        owner: the position whose stream each of the manifest's files is part of.
        crc: per stripe, the xxh3-64 checksum of each parity block (empty before encoding).
        codec: the erasure code of the parity (:mod:`.codec`).
    """

    k: int
    m: int
    order: tuple[int, ...]
    lengths: tuple[int, ...]
    owner: tuple[int, ...]
    crc: tuple[tuple[int, ...], ...] = ()
    codec: str = ""

    def __post_init__(self) -> None:
        if not self.codec:
            object.__setattr__(self, "codec", codec_for(self.m))

    @staticmethod
    def build(k: int, m: int, node_of_rank: Sequence[int], files: Sequence[tuple[int, int]]) -> ParityLayout | None:
        """The layout of a step whose ``files`` are ``(writing rank, nbytes)`` in manifest order,
        saved by ranks on nodes ``node_of_rank``; None when the job has one node."""
        order = tuple(sorted(set(int(n) for n in node_of_rank)))
        k_e, m_e = effective(k, m, len(order))
        if m_e == 0:
            return None
        position = {n: i for i, n in enumerate(order)}
        owner = tuple(position[int(node_of_rank[r])] for r, _ in files)
        lengths = [0] * len(order)
        for (_, nbytes), pos in zip(files, owner):
            lengths[pos] += int(nbytes)
        return ParityLayout(k_e, m_e, order, tuple(lengths), owner)

    @property
    def n(self) -> int:
        """Nodes (positions) and stripes."""
        return len(self.order)

    def segment(self, pos: int) -> int:
        """The segment size of a position's stream."""
        return -(-self.lengths[pos] // self.k)

    def data_pos(self, stripe: int, slot: int) -> int:
        """The position whose segment ``slot`` is data block ``slot`` of ``stripe``."""
        return (stripe + slot) % self.n

    def parity_pos(self, stripe: int, block: int) -> int:
        """The position keeping parity block ``block`` of ``stripe``."""
        return (stripe + self.k + block) % self.n

    def block(self, stripe: int) -> int:
        """The block size of ``stripe``: its largest segment."""
        return max(self.segment(self.data_pos(stripe, t)) for t in range(self.k))

    def stripes_of(self, pos: int) -> list[tuple[int, int]]:
        """``(stripe, slot)`` of each segment of a position's stream, segment order."""
        return [((pos - t) % self.n, t) for t in range(self.k)]

    def parity_of(self, pos: int) -> list[tuple[int, int]]:
        """``(stripe, block)`` of the parity blocks a position keeps."""
        return [((pos - self.k - p) % self.n, p) for p in range(self.m)]

    def files_of(self, pos: int) -> list[int]:
        """Indices into the manifest's files of a position's stream, in stream order."""
        return [i for i, o in enumerate(self.owner) if o == pos]

    def rounds(self) -> int:
        """Chunks of :data:`CHUNK` bytes in the largest block."""
        return max((-(-self.block(i) // CHUNK) for i in range(self.n)), default=0)

    def with_crc(self, crc: dict[tuple[int, int], int]) -> ParityLayout:
        """This layout with the parity blocks' checksums."""
        table = tuple(tuple(int(crc[(i, p)]) for p in range(self.m)) for i in range(self.n))
        return ParityLayout(self.k, self.m, self.order, self.lengths, self.owner, table, self.codec)

    def to_doc(self) -> dict:
        """The layout as a commit marker records it (JSON)."""
        return {
            "k": self.k,
            "m": self.m,
            "order": list(self.order),
            "lengths": list(self.lengths),
            "owner": list(self.owner),
            "crc": [list(c) for c in self.crc],
            "codec": self.codec,
        }

    @staticmethod
    def from_doc(doc: dict) -> ParityLayout:
        """Parse :meth:`to_doc`'s output.

        Raises:
            KeyError, TypeError, ValueError: it is malformed.
        """
        out = ParityLayout(
            int(doc["k"]),
            int(doc["m"]),
            tuple(int(n) for n in doc["order"]),
            tuple(int(n) for n in doc["lengths"]),
            tuple(int(n) for n in doc["owner"]),
            tuple(tuple(int(c) for c in row) for row in doc["crc"]),
            str(doc["codec"]),
        )
        if out.codec not in CODECS:
            raise ValueError(f"its parity was encoded with {out.codec!r}, which this tessera does not decode")
        if not (out.k >= 1 and out.m >= 1 and out.k + out.m <= out.n == len(out.lengths) == len(out.crc)):
            raise ValueError(f"inconsistent parity layout {doc!r:.200}")
        if any(not 0 <= o < out.n for o in out.owner) or any(len(c) != out.m for c in out.crc):
            raise ValueError(f"inconsistent parity layout {doc!r:.200}")
        return out

    # ----------------------------------------------------------------------------------
    # What can be rebuilt from what the nodes hold (pure)

    def missing(self, union: frozenset[int] | set[int]) -> list[int]:
        """Positions with a file held by no node (``union``: the indices held anywhere)."""
        return sorted({o for i, o in enumerate(self.owner) if i not in union})

    def whole(self, held: Sequence[frozenset[int]]) -> dict[int, int]:
        """For each position, the first entry of ``held`` (per node) holding its whole stream."""
        out: dict[int, int] = {}
        for pos in range(self.n):
            files = set(self.files_of(pos))
            for j, h in enumerate(held):
                if files <= h:
                    out[pos] = j
                    break
        return out

    def shortfall(
        self, held: Sequence[frozenset[int]], parity: Sequence[frozenset[tuple[int, int]]]
    ) -> list[tuple[int, list[str]]]:
        """The stripes that cannot rebuild a lost stream: ``(stripe, what it lost)``; empty when
        every missing stream can be decoded. ``held`` and ``parity`` are per node."""
        union = frozenset().union(*held) if held else frozenset()
        lost = self.missing(union)
        if not lost:
            return []
        whole = self.whole(held)
        blocks = frozenset().union(*parity) if parity else frozenset()
        out = []
        for i in sorted({s for pos in lost for s, _ in self.stripes_of(pos)}):
            gone = [f"data of node {self.order[self.data_pos(i, t)]}" for t in range(self.k)]
            gone = [g for t, g in enumerate(gone) if self.data_pos(i, t) not in whole]
            gone += [
                f"parity {p} on node {self.order[self.parity_pos(i, p)]}" for p in range(self.m) if (i, p) not in blocks
            ]
            if len(gone) > self.m:
                out.append((i, gone))
        return out
