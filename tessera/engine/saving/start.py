"""Starting a save: wait for the previous one, prepare and plan, stage, hand off the rest."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial

import torch

from ...errors import PlanMismatchError
from ...options import SaveOptions, StagingCheck, StagingMode
from ...results import PendingSave, SaveResult
from .. import dist, inflight
from ..timing import PhaseTimer
from .cache import SaveCache, cache_for
from .fingerprint import CallFingerprint
from .finish import finish_save
from .handoff import FileReport, PreparedSave, SaveRequest
from .prepare import prepare
from .sources import MutationCheck, OverlappedCopy, Sources, Staged, hold_mutations, private_copies, sources, stage
from .staging import is_copied, ready_event
from .window import Window

logger = logging.getLogger(__name__)
_STALL_PARTS = ("wait_previous", "plan", "stage", "schedule")


@dataclass
class _StageStep:
    """How this rank's stage step runs, decided in the caller's thread.

    ``staged`` gives the staged bytes (or raises what failed); ``failed`` is a blocking
    copy's error, known before returning; ``event`` is set once the state may change again
    (None: it may change at once); ``overlapped`` is a background copy to wait for; with
    ``blocks`` the call itself waits for ``event`` (tensors nothing holds back from changing,
    streamed through a memory budget's window by the background writes); ``fingerprint`` is
    what the CPU tiles copied after the call held at the call.
    """

    staged: Callable[[], Staged]
    failed: BaseException | None = None
    event: threading.Event | None = None
    overlapped: OverlappedCopy | Window | None = None
    blocks: bool = False
    fingerprint: CallFingerprint | None = None

    def verdict(self, reports: list[FileReport], rank: int, path: str) -> None:
        """After the writes, before the vote: raise what the background copy found (a failed
        copy, a source changed under it), or a CPU tile whose written bytes are not the call's."""
        if self.overlapped is not None:
            self.overlapped.verdict()
        if self.fingerprint is not None:
            self.fingerprint.verify(reports, rank, path)


def start_save(request: SaveRequest) -> PendingSave:
    """Start a save; collective over ``request.process_group`` (see :func:`_start_save`).

    A synchronous save whose ranks' plans turned out to disagree (the structure changed on some
    ranks only) starts over once, every rank together: they all learned it from one vote.
    """
    try:
        return _start_save(request)
    except PlanMismatchError as e:
        if not e.retry:
            raise
        logger.info("%s: the ranks' plans disagreed; planning the save again", request.path)
        return _start_save(request)


def _start_save(request: SaveRequest) -> PendingSave:
    """Start a save; collective over ``request.process_group``.

    Waits for this process's previous save of the group, then (every rank together) flattens
    the state, agrees on a save id, location and plan, and stages the bytes: before returning,
    or in the background for what :class:`~tessera.options.StagingMode` allows. Writing and the
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
    ctx = cache_for(request.process_group)
    with ctx.lock:
        previous = inflight.wait_pending(request.process_group)
        timer.mark("wait_previous")
        world = dist.world_for(request.process_group)
        save = prepare(world, ctx, request, opts, previous)
        timer.mark("plan")
        step = _stage_step(request, save, ctx, world.rank, timer)
        # The background report waits for the caller's stall, known once this returns.
        returned = threading.Event() if request.background else None
        verdict = partial(step.verdict, rank=world.rank, path=request.path) if step.event is not None else None

        def finish() -> SaveResult:
            try:
                return finish_save(world, save, step.staged, timer, returned, verdict)
            finally:
                if step.overlapped is not None:
                    step.overlapped.join()  # the staging buffer is reused by the next save

        future: Future[SaveResult] = Future()
        if step.failed is not None:
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
            mismatch = future.exception()
            if isinstance(mismatch, PlanMismatchError) and mismatch.retry:
                raise mismatch
        if step.blocks and step.event is not None:
            step.event.wait()  # the writes run in the background; the state is free once copied out
        stall_parts = _STALL_PARTS + (("copy",) if step.blocks else ())
        parts = {k: timer.phases[k] for k in stall_parts if k in timer.phases}
        pending = PendingSave(future, 0.0, path=request.path, staged_event=step.event, stall_parts=parts)
        if step.event is not None:
            hold_mutations([obj for obj, _ in save.flat.statefuls], pending)
        pending.stall_s = time.monotonic() - timer.t0
        if returned is not None and not returned.is_set():
            timer.stall = pending.stall_s
            returned.set()
        if request.background:
            inflight.track(request.process_group, pending)
        else:
            pending._observed = True
        return pending


def _stage_step(request: SaveRequest, save: PreparedSave, ctx: SaveCache, rank: int, timer: PhaseTimer) -> _StageStep:
    """Copy now what must be copied now; schedule the rest in the background.

    A synchronous save writes straight from contiguous CPU tensors. An async save copies
    in the caller's thread every tensor that nothing holds back from changing (all of them
    with ``BLOCKING``, the ungated ones with ``AUTO``, none with ``BACKGROUND``) and the rest
    in a copy thread that the writes follow tile by tile. Under a memory budget smaller than
    what would be copied, nothing is copied whole: see :func:`_windowed`.
    """
    opts = save.options
    srcs = sources(save.plan, save.flat)
    mode = opts.staging
    budget = opts.max_staging_bytes
    if isinstance(budget, int):
        to_copy = sum(t.numel() * t.element_size() for t in srcs.tensors if is_copied(t, request.background))
        if to_copy > budget:
            return _windowed(request, save, srcs, ctx, rank, timer, budget)
    if not request.background or mode is StagingMode.BLOCKING or (mode is StagingMode.AUTO and not any(srcs.gated)):
        return _blocking(save, srcs.tensors, ctx, rank, timer, copy=request.background)
    # Ungated tensors of an AUTO save are copied now, into private copies the copy thread reads.
    now = [i for i, g in enumerate(srcs.gated) if not g] if mode is StagingMode.AUTO else []
    private_copies(srcs.tensors, now)
    after = ready_event(srcs.tensors)
    check, fingerprint = _checks(save, srcs, skip=set(now))
    event, copied = _copied_event(timer)
    verify = None if check is None else partial(check.verify, rank=rank, path=request.path)
    overlapped = OverlappedCopy(save.plan, srcs.tensors, ctx.staging, rank, after, copied, verify)
    timer.mark("schedule")
    return _StageStep(overlapped.start, event=event, overlapped=overlapped, fingerprint=fingerprint)


def _checks(
    save: PreparedSave, srcs: Sources, skip: set[int], fingerprint: bool = True
) -> tuple[MutationCheck | None, CallFingerprint | None]:
    """The mutation check of the sources copied after the call returns (all but ``skip``).

    ``FULL`` (the default): a fingerprint of every CPU tile, taken now, compared with what the
    writers checksum from the copies; version counters for device tensors. ``SAMPLED``: version
    counters and sampled elements only. ``OFF``: nothing.
    """
    opts = save.options
    if opts.check_staging is StagingCheck.OFF:
        return None, None
    taken = None
    if fingerprint and opts.check_staging is StagingCheck.FULL:
        cpu = [i for i, t in enumerate(srcs.tensors) if i not in skip and t.device.type == "cpu"]
        if cpu:
            taken = CallFingerprint(srcs.tensors, srcs.names, srcs.keys, cpu, save.chunking, opts.io_threads)
            skip = skip | set(cpu)
    return MutationCheck(srcs.tensors, srcs.names, skip), taken


def _windowed(
    request: SaveRequest,
    save: PreparedSave,
    srcs: Sources,
    ctx: SaveCache,
    rank: int,
    timer: PhaseTimer,
    budget: int,
) -> _StageStep:
    """Stream every tensor through the budget's reused buffers (:class:`.window.Window`): the
    writers copy each tile piece by piece; no host copy of the state is made.

    Gated tensors are held by their gates until their last piece is copied. Tensors nothing
    holds back (a raw ``state_dict()`` under ``AUTO``; every tensor with ``BLOCKING``) make
    the call itself wait until then, so the state may change once it returns: the budget is
    kept whatever the caller passes. A synchronous save writes through the window before
    returning anyway.
    """
    opts = save.options
    background = request.background
    mode = opts.staging
    blocks = background and (mode is StagingMode.BLOCKING or (mode is StagingMode.AUTO and not all(srcs.gated)))
    check, fingerprint = None, None
    if background:
        # A call that waits for the copies needs no fingerprint: its own thread cannot write meanwhile.
        check, fingerprint = _checks(save, srcs, skip=set(), fingerprint=not blocks)
    verify = None if check is None else partial(check.verify_sources, rank=rank, path=request.path)
    event, copied = _copied_event(timer)
    after = ready_event(srcs.tensors)  # the copies run on a side stream, after the caller's queued work
    window = Window(save.plan, srcs.tensors, budget, opts.io_threads, ctx.window, rank, after, copied, verify)
    timer.mark("schedule")
    return _StageStep(window.start, event=event, overlapped=window, blocks=blocks, fingerprint=fingerprint)


def _copied_event(timer: PhaseTimer) -> tuple[threading.Event, Callable[[], None]]:
    """The event a background copy sets once the state may change, and the callback that
    marks the ``copy`` phase and sets it (marked first: a call waiting for the event reads it)."""
    event = threading.Event()

    def copied() -> None:
        timer.mark("copy")
        event.set()

    return event, copied


def _blocking(
    save: PreparedSave, srcs: list[torch.Tensor], ctx: SaveCache, rank: int, timer: PhaseTimer, *, copy: bool
) -> _StageStep:
    """The copy in the caller's thread (``copy=False``: CPU tensors are written in place)."""
    done: Future[Staged] = Future()  # the copy's bytes, or what failed
    try:
        done.set_result(stage(save.plan, srcs, ctx.staging, rank, copy=copy))
    except Exception as e:  # raised in the claim step, so that every rank hears of it
        done.set_exception(e)
    timer.mark("stage")
    return _StageStep(done.result, failed=done.exception())


def _run_into(future: Future[SaveResult], fn: Callable[[], SaveResult]) -> None:
    try:
        future.set_result(fn())
    except BaseException as e:
        future.set_exception(e)
