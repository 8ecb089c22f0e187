"""Report groups: the rank reports of a group of ranks, combined into one file by the group's
leader after the vote, so that rank 0 reads ``N / group`` files at the commit instead of ``N``.

A group file is one JSON line, then the members' reports as written, one after the other::

    {"format": "tessera-report-group", "version": 1, "save_id": "...", "leader": 64,
     "ranks": [65, 66, ...], "sizes": [14021, 13998, ...]}
    <report of rank 65><report of rank 66>...

It adds nothing to what the reports say: each member report keeps its own checksum, rank and
save id, and rank 0 checks each as if it had read the report's own file. A group file is an
optimisation only; the reports stay where they are until the commit removes them, and rank 0
reads a member's own file whenever its group file is missing, late, torn or lists another save.
"""

from __future__ import annotations

import json

import xxhash

from ..errors import ManifestError
from .rank_report import MAX_REPORT_BYTES, report_dir

GROUP_FORMAT = "tessera-report-group"
GROUP_VERSION = 1


def group_path(save_id: str, leader: int) -> str:
    """The group file of the group led by rank ``leader``, inside the checkpoint."""
    return f"{report_dir(save_id)}/group-{leader}.bin"


def members(leader: int, group: int, world_size: int) -> range:
    """The ranks whose reports the group of ``leader`` combines (the leader's own first)."""
    return range(leader, min(leader + group, world_size))


def encode_group(save_id: str, leader: int, reports: dict[int, bytes]) -> bytes:
    """The group file of ``reports`` (by rank), as the leader writes it."""
    ranks = sorted(reports)
    head = {
        "format": GROUP_FORMAT,
        "version": GROUP_VERSION,
        "save_id": save_id,
        "leader": leader,
        "ranks": ranks,
        "sizes": [len(reports[r]) for r in ranks],
    }
    return json.dumps(head, separators=(",", ":")).encode() + b"\n" + b"".join(reports[r] for r in ranks)


def decode_group(data: bytes, *, source: str, save_id: str, leader: int, expected: range) -> dict[int, bytes]:
    """The member reports of a group file whose checksums match (a torn one is left out: the
    caller reads those ranks' own files).

    Raises:
        ManifestError: naming ``source``, if the file is not the group of ``leader`` in save
            ``save_id`` listing exactly ``expected``.
    """
    line, sep, rest = data.partition(b"\n")
    try:
        head = json.loads(line) if sep and len(line) < 64 * 1024 * 1024 else None
    except ValueError:
        head = None
    if not isinstance(head, dict) or head.get("format") != GROUP_FORMAT or head.get("version") != GROUP_VERSION:
        raise ManifestError(f"{source}: not a tessera report group of version {GROUP_VERSION}")
    if head.get("save_id") != save_id or head.get("leader") != leader:
        raise ManifestError(
            f"{source}: the group of rank {head.get('leader')!r:.20} in save {head.get('save_id')!r:.40}"
        )
    ranks, sizes = head.get("ranks"), head.get("sizes")
    if ranks != list(expected) or not isinstance(sizes, list) or len(sizes) != len(ranks):
        raise ManifestError(f"{source}: it lists ranks {ranks!r:.80}, expected {list(expected)!r:.80}")
    if not all(type(n) is int and 0 <= n <= MAX_REPORT_BYTES for n in sizes) or sum(sizes) != len(rest):
        raise ManifestError(f"{source}: its sizes do not add up to its {len(rest)} bytes of reports")
    out: dict[int, bytes] = {}
    at = 0
    for rank, n in zip(ranks, sizes):
        report = rest[at : at + n]
        at += n
        body, sep, digest = report.rpartition(b"\n")
        if sep and xxhash.xxh3_64_hexdigest(body).encode() == digest:
            out[rank] = report
    return out
