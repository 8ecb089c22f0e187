"""Starting a save: wait for the previous one, prepare and plan, stage, hand off the rest."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from .. import dist, inflight
from ..options import SaveOptions, StagingMode
from ..results import PendingSave, SaveResult
from ..stage import ready_event
from ..timing import PhaseTimer
from .context import context_for
from .finish import finish_save
from .handoff import SaveRequest
from .prepare import prepare
from .sources import OverlappedCopy, Staged, check_unchanged, fingerprints, install_gates, sources, stage

_STALL_PARTS = ("wait_previous", "plan", "stage", "schedule")


def start_save(request: SaveRequest) -> PendingSave:
    """Start a save; collective over ``request.process_group``.

    Waits for this process's previous save of the group, then (every rank together) flattens
    the state, agrees on a save id, location and plan, and stages the bytes (blocking, or
    scheduled on the background thread with ``StagingMode.BACKGROUND``). Writing and the
    commit run in a background thread when ``request.background``, else before returning.

    Args:
        request: the call of ``save`` / ``async_save`` (see :class:`SaveRequest`).

    Returns:
        the save's :class:`PendingSave`; for a synchronous save it is already done
        (``wait()`` returns the result or raises its error).

    Raises:
        CheckpointError: a failure before the save was handed to the background (the
            previous save's, preparing, planning or a blocking copy), raised on every rank.
    """
    opts = request.options or SaveOptions()
    timer = PhaseTimer()  # before the wait for the previous save: the stall counts it
    ctx = context_for(request.process_group)
    with ctx.lock:
        previous = inflight.wait_pending(request.process_group)
        timer.mark("wait_previous")
        world = dist.world_for(request.process_group)
        save = prepare(world, ctx, request, opts, previous)
        timer.mark("plan")
        overlap = request.background and opts.staging is StagingMode.BACKGROUND
        staged_event: threading.Event | None = None
        # The background report waits for the caller's stall, known once this returns.
        returned = threading.Event() if request.background else None
        staged: Callable[[], Staged]
        overlapped: OverlappedCopy | None = None
        if not overlap:
            blocking: Future[Staged] = Future()  # the copy's bytes, or what failed
            try:
                srcs = sources(save.plan, save.flat)[0]
                blocking.set_result(stage(save.plan, srcs, ctx.staging, world.rank, copy=request.background))
            except Exception as e:  # raised in the claim step, so that every rank hears of it
                blocking.set_exception(e)
            timer.mark("stage")
            staged = blocking.result
        else:
            srcs, names = sources(save.plan, save.flat)
            after = ready_event(srcs)
            reference = fingerprints(srcs) if opts.check_staging else None
            staged_event = threading.Event()
            event = staged_event

            if reference is None:  # the copy and the writes overlap (issue #13)

                def copied() -> None:
                    event.set()
                    timer.mark("copy")

                overlapped = OverlappedCopy(save.plan, srcs, ctx.staging, world.rank, after, copied)
                staged = overlapped.start
            else:  # the debug check compares every byte once the copy is over, before writing

                def staged() -> Staged:
                    try:
                        out = stage(save.plan, srcs, ctx.staging, world.rank, copy=True, after=after)
                        check_unchanged(srcs, names, out, reference, world.rank, request.path)
                        return out
                    finally:
                        srcs.clear()  # let the caller's tensors go
                        event.set()
                        timer.mark("copy")

            timer.mark("schedule")

        def finish() -> SaveResult:
            try:
                return finish_save(world, save, staged, timer, returned)
            finally:
                if overlapped is not None:
                    overlapped.join()  # the staging buffer is reused by the next save

        future: Future[SaveResult] = Future()
        if not overlap and blocking.exception() is not None:
            timer.stall = time.monotonic() - timer.t0
            if returned is not None:
                returned.set()
            _run_into(future, finish)  # join the peers' steps now, then raise here
            future.result()
        if request.background:
            # Not a daemon: at interpreter exit Python waits for the commit to finish (bounded
            # by TESSERA_TIMEOUT_S if a peer is gone) instead of killing it half-way.
            thread = threading.Thread(target=_run_into, args=(future, finish), name="tessera-save", daemon=False)
            thread.start()
        else:
            _run_into(future, finish)
        parts = {k: timer.phases[k] for k in _STALL_PARTS if k in timer.phases}
        pending = PendingSave(future, 0.0, path=request.path, staged_event=staged_event, stall_parts=parts)
        if overlap:
            install_gates([obj for obj, _ in save.flat.statefuls], pending)
        pending.stall_s = time.monotonic() - timer.t0
        if returned is not None and not returned.is_set():
            timer.stall = pending.stall_s
            returned.set()
        if request.background:
            inflight.track(request.process_group, pending)
        else:
            pending._observed = True
        return pending


def _run_into(future: Future[SaveResult], fn: Callable[[], SaveResult]) -> None:
    try:
        future.set_result(fn())
    except BaseException as e:
        future.set_exception(e)
