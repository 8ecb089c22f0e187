"""Cyclic garbage collection paused while metadata is decoded and planned.

Decoding a manifest, planning a load and assembling a commit allocate hundreds of thousands
of small objects (tuples, boxes, arrays, dicts) that form no reference cycles. Those bursts
trigger the cyclic collector, and each full (generation 2) collection walks every object the
process holds: 0.18 s with 170,000 objects in a bare benchmark process, one such pause in
one of three 16,384-rank load plans (``bench/plan_scale.py``), more in a training process
whose heap is larger. Reference counting frees everything these steps drop; the collector
resumes when the outermost pause ends, in whichever thread it ends.
"""

from __future__ import annotations

import functools
import gc
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import ParamSpec, TypeVar

_lock = threading.Lock()
_depth = 0
_resume = False

P = ParamSpec("P")
R = TypeVar("R")


@contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic collection inside (nested and concurrent pauses share one; the collector is
    enabled again at the end only if it was enabled when the first began)."""
    global _depth, _resume
    with _lock:
        if not _depth:
            _resume = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if not _depth and _resume:
                gc.enable()


def gc_paused_call(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn`` run under :func:`gc_paused`."""

    @functools.wraps(fn)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        with gc_paused():
            return fn(*args, **kwargs)

    return call
