"""Rank 0 reads ``N / group`` files at the commit, not ``N``: report groups.

Every rank writes its report before the vote, as before. After a passing vote the leader of
each group of ``group`` ranks (ranks ``g * group``, ``g >= 1``) reads its members' reports
(they are durable: every rank voted after writing its own) and writes them as one group file
(:mod:`tessera.format.report_group`), while rank 0 reads the reports of its own group and waits
for the group files. Nothing new is exchanged between ranks: the save keeps its two fixed-size
collectives. A group file that is late (past :data:`WAIT_S`), missing (its leader died), torn or
of another save costs only time: rank 0 reads those members' own files instead. The leader
removes its group file once the commit's outcome is known; the reports go with the commit.

At 16,384 ranks and 20 ms per request this is 256 group reads instead of 16,383 report reads
(``bench/plan_scale.py``, the commit step).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from ... import _knobs
from ...format.rank_report import report_path
from ...format.report_group import decode_group, encode_group, group_path, members
from .handoff import PreparedSave

logger = logging.getLogger(__name__)

WAIT_S = 10.0
"""How long rank 0 waits for a group file before reading its members' own files."""

_T = TypeVar("_T")


def group_size(world_size: int) -> int:
    """Ranks per report group in a job of ``world_size`` ranks (0: no groups)."""
    group = _knobs.report_group()
    return group if group > 1 and world_size > group else 0


def in_threads(items: Sequence[_T], fn: Callable[[_T], None], threads: int) -> None:
    """``fn`` of every item, ``threads`` at once (each thread takes every ``threads``-th item:
    no per-item task objects, which cost more than a read at 16k ranks); raises the first
    error (by item order) after every thread stopped."""
    threads = max(1, min(threads, len(items)))
    errors: list[tuple[int, BaseException]] = []

    def worker(first: int) -> None:
        for i in range(first, len(items), threads):
            if errors:
                return
            try:
                fn(items[i])
            except BaseException as e:
                errors.append((i, e))
                return

    pool = [threading.Thread(target=worker, args=(i,), name=f"tessera-reports-{i}") for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    if errors:
        raise min(errors, key=lambda x: x[0])[1]


def combine(save: PreparedSave, leader: int, own: bytes, world_size: int, group: int) -> str | None:
    """A group's leader, after a passing vote: write its group's reports as one file; its path,
    or None if that failed (logged: rank 0 then reads the reports one by one). Never raises."""
    reports = {leader: own}
    try:
        others = list(members(leader, group, world_size))[1:]

        def read(rank: int) -> None:
            reports[rank] = save.store.read_file(report_path(save.save_id, rank))

        in_threads(others, read, 32)
        path = group_path(save.save_id, leader)
        save.store.write_atomic(path, encode_group(save.save_id, leader, reports))
        return path
    except Exception as e:
        logger.debug("rank %d: could not write the report group of %s: %s", leader, save.path, e)
        return None


def read_all(save: PreparedSave, world_size: int, read_one: Callable[[int], bytes], threads: int) -> dict[int, bytes]:
    """Rank 0: every other rank's report (by rank), from group files where they come in time,
    else from the rank's own file (``read_one``)."""
    group = group_size(world_size)
    raw: dict[int, bytes] = {}

    def one(rank: int) -> None:
        raw[rank] = read_one(rank)

    if not group:
        in_threads(range(1, world_size), one, threads)
        return raw
    deadline = time.monotonic() + WAIT_S

    def task(item: tuple[str, int]) -> None:
        kind, n = item
        if kind == "rank":
            one(n)
            return
        expected = members(n, group, world_size)
        got = _await_group(save, n, expected, deadline)
        raw.update(got)
        for rank in expected:
            if rank not in got:
                one(rank)

    items = [("rank", r) for r in range(1, min(group, world_size))]
    items += [("group", leader) for leader in range(group, world_size, group)]
    in_threads(items, task, threads)
    return raw


def _await_group(save: PreparedSave, leader: int, expected: range, deadline: float) -> dict[int, bytes]:
    """The member reports in the group file of ``leader`` once it exists (polling until
    ``deadline``); empty if it never came or is not usable."""
    path = group_path(save.save_id, leader)
    pause = 0.005
    while True:
        try:
            data = save.store.read_file(path)
            return decode_group(
                data, source=f"{save.path}/{path}", save_id=save.save_id, leader=leader, expected=expected
            )
        except FileNotFoundError:
            if time.monotonic() + pause > deadline:
                logger.debug("rank 0: the report group of rank %d of %s did not come in time", leader, save.path)
                return {}
            time.sleep(pause)
            pause = min(0.1, 2 * pause)
        except Exception as e:  # torn, another save's, a storage error: the members' own files
            logger.debug("rank 0: not using the report group of rank %d of %s: %s", leader, save.path, e)
            return {}
