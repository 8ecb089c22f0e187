"""``save``, ``async_save`` and ``load``: the public entry points.

The phases are orchestrated in :mod:`tessera.engine.saving` and :mod:`tessera.engine.loading`.

save:  flatten -> local plan -> global plan [cached] -> stage -> write -> commit
load:  manifest -> flatten target -> validate -> plan reads -> read + verify + copy -> values

Distributed contract: every rank of the process group calls ``save``/``async_save``/
``load`` with the same path, in the same order. Each call is collective. A failure on any
rank is raised on every rank. At most one save is in flight per process: a new save or a
load first waits for the previous save to finish (and raises its error, if any).
"""

from __future__ import annotations

from typing import Any

from ._args import check_path_state
from .engine import loading as _loading
from .engine.inflight import wait_pending
from .engine.loading import read_manifest
from .engine.saving import SaveRequest, start_save
from .options import LoadOptions, SaveOptions
from .results import LoadResult, PendingSave, SaveResult
from .storage import Storage

__all__ = ["LoadResult", "PendingSave", "SaveResult", "async_save", "load", "read_manifest", "save", "wait_pending"]


def save(
    path: str,
    state: object,
    *,
    process_group: Any = None,
    storage: Storage | None = None,
    allow_pickle: bool = False,
    options: SaveOptions | None = None,
    storage_options: dict[str, Any] | None = None,
) -> SaveResult:
    """Save ``state`` to ``path`` and commit it; collective over ``process_group``.

    Each rank writes only the tiles the global plan gives it (replicas once, balanced).
    Saving over an existing checkpoint replaces it atomically: readers see the old or the
    new checkpoint, never a mix, also after a crash.

    Args:
        path: directory or URL of the checkpoint (``str`` or ``os.PathLike``).
        state: dict of tensors, DTensors, ShardedTensor/FlatShard, nested containers,
            plain values, per_rank values and Stateful objects.
        process_group: the ranks taking part (default: all). Coordination runs over a
            dedicated gloo group, so NCCL training groups work too.
        storage: a backend instance to use instead of choosing one from ``path``.
        allow_pickle: store values that are not plain (needs the same opt-in to load).
        options: see :class:`SaveOptions`.
        storage_options: backend options when ``storage`` is not given (e.g. S3
            credentials or ``{"client_kwargs": {"endpoint_url": ...}}``; see docs/storage.md).

    Returns:
        this rank's :class:`SaveResult`.

    Raises:
        TypeError: if ``path`` is not a path or ``state`` not a dict/Stateful (e.g. swapped),
            before any work.
        CheckpointError: on any rank's failure (the previous checkpoint stays intact).

    Example:
        >>> tessera.save("/ckpt/step100", {"model": model.state_dict(), "step": 100})
    """
    path = check_path_state("tessera.save", path, state)
    request = SaveRequest(path, state, process_group, storage, allow_pickle, options, storage_options, background=False)
    return start_save(request).wait()


def async_save(
    path: str,
    state: object,
    *,
    process_group: Any = None,
    storage: Storage | None = None,
    allow_pickle: bool = False,
    options: SaveOptions | None = None,
    storage_options: dict[str, Any] | None = None,
) -> PendingSave:
    """Like :func:`save`, but return early; copy, write and commit in the background.

    Commits exactly the state at the call, bit for bit, whatever the caller does next.
    Under the default ``StagingMode.AUTO``, tensors held by a gated Stateful
    (:class:`~tessera.ModelState`, :class:`~tessera.OptimizerState`, or an object of yours
    implementing :class:`~tessera.stateful.GatedStateful`) are copied to host memory in the
    background (CPU: a copy thread; CUDA: a side stream into reused pinned memory, after
    the work queued on the current stream) while the calls that change them
    (``optimizer.step()``, ``load_state_dict``, the forward pass where it may change a saved
    buffer, a parameter no saved optimizer steps, or writes parameters itself) wait for the copy; every
    other tensor (a raw ``model.state_dict()``) is copied before this returns, as
    ``torch.distributed.checkpoint.async_save`` does. A tensor copied in the background
    and changed before its copy some other way (``pending.wait_staged()`` says when it may
    change) fails the save on every rank with
    :class:`~tessera.errors.StagingMutationError` instead of committing a mix (the check of
    ``SaveOptions.check_staging``, on by default; what it cannot see is listed there). ``pending.stall_s`` is the whole time
    this call blocked, including the wait for the previous save (at most one is in flight
    per process); ``pending.stall_parts`` splits it. Call ``.wait()`` before relying on the
    checkpoint; an error in the background is raised there, and by the next save if nobody
    waited.

    Args:
        path, state, process_group, storage, allow_pickle, options, storage_options: as
            :func:`save`.

    Returns:
        a :class:`PendingSave`: ``wait_staged()``, ``wait()``, ``done()``, ``stall_s``.

    Raises:
        TypeError: if ``path`` is not a path or ``state`` not a dict/Stateful, before any work.
        CheckpointError: a failure before the save was handed to the background (the
            previous save's, planning, a blocking copy), on every rank; later failures are
            raised by ``wait()``.

    Example:
        >>> pending = tessera.async_save("/ckpt/step100", {"model": ModelState(m), "optim": OptimizerState(m, opt)})
        >>> ...  # keep training: opt.step() waits for the copy if it still runs
        >>> pending.wait()
    """
    path = check_path_state("tessera.async_save", path, state)
    request = SaveRequest(path, state, process_group, storage, allow_pickle, options, storage_options, background=True)
    return start_save(request)


def load(
    path: str,
    state: object,
    *,
    strict: bool = True,
    process_group: Any = None,
    storage: Storage | None = None,
    allow_pickle: bool = False,
    cast_dtypes: bool = False,
    options: LoadOptions | None = None,
    storage_options: dict[str, Any] | None = None,
) -> LoadResult:
    # The docstring is loading.load's (set below): one text for the one function.
    path = check_path_state("tessera.load", path, state)
    return _loading.load(
        path, state, strict=strict, process_group=process_group, storage=storage, allow_pickle=allow_pickle,
        cast_dtypes=cast_dtypes, options=options, storage_options=storage_options,
    )  # fmt: skip


load.__doc__ = _loading.load.__doc__
