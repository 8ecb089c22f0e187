"""The one harness for tests on real process groups: N processes joined by a gloo group.

Processes come from a ``forkserver`` that has already imported torch and tessera, so a rank
starts in milliseconds instead of the seconds a fresh interpreter needs. Each rank
initialises ``torch.distributed`` (gloo, a FileStore rendezvous in a temporary directory)
and calls ``fn(rank, world_size, *args)``; ``fn`` must be a module-level function so that the
ranks can import it.

* :func:`run_distributed` returns every rank's return value and fails the test with each
  failed rank's traceback (a hang is killed after ``timeout`` seconds);
* :func:`run_ranks` returns what happened to each rank (result, error, died, hung), for
  tests where ranks fail or die on purpose; :func:`start_ranks` starts them without waiting
  (to kill one mid-save), :func:`start` one process without a group.

Tests that use it carry the ``distributed`` marker (set in ``tests/conftest.py``).
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


def _forkserver() -> multiprocessing.context.BaseContext:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "tessera", "tests.dist_utils"])
    return ctx


def start(fn: Callable[..., Any], *args: Any) -> multiprocessing.process.BaseProcess:
    """Start ``fn(*args)`` in a fresh process forked from the preloaded server."""
    p = _forkserver().Process(target=fn, args=args, daemon=True)
    p.start()
    return p


@dataclass(frozen=True)
class RankOutcome:
    """What became of one rank.

    Attributes:
        rank: the rank.
        status: ``"ok"``, ``"error"`` (raised), ``"died"`` (exited without a result) or
            ``"hung"`` (killed by the runner at the deadline).
        value: the return value (``"ok"``) or ``{"type", "mro", "message", "traceback"}``.
        seconds: wall time from just after the process group formed to the end (None if unknown).
        exitcode: the process exit code.
    """

    rank: int
    status: str
    value: Any
    seconds: float | None
    exitcode: int | None

    def error_is(self, name: str) -> bool:
        """Whether this rank raised an exception that is (a subclass of) class ``name``."""
        return self.status == "error" and name in self.value["mro"]


def _rank_main(
    rank: int,
    world: int,
    store_path: str,
    result_path: str,
    env: dict[str, str],
    fn: Callable[..., Any],
    args: tuple,
    pg_timeout: float | None,
) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.update(env)
    torch.set_num_threads(1)
    t0 = None
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store_path}",
            rank=rank,
            world_size=world,
            **({} if pg_timeout is None else {"timeout": datetime.timedelta(seconds=pg_timeout)}),
        )
        t0 = time.monotonic()
        out: tuple[str, Any] = ("ok", fn(rank, world, *args))
    except BaseException as e:
        out = (
            "error",
            {
                "type": type(e).__name__,
                "mro": [c.__name__ for c in type(e).__mro__],
                "message": str(e),
                "traceback": traceback.format_exc(),
            },
        )
    seconds = None if t0 is None else time.monotonic() - t0
    tmp = result_path + ".tmp"
    with open(tmp, "wb") as f:
        pickle.dump((out, seconds), f)
    os.replace(tmp, result_path)
    # Skip gloo teardown: with a dead peer it can block; the parent only needs the file.
    os._exit(0)


class RankGroup:
    """Ranks started by :func:`start_ranks`; :meth:`collect` waits for them and reports."""

    def __init__(
        self,
        fn: Callable[..., Any],
        world: int,
        args: tuple,
        env: dict[str, str] | None,
        *,
        daemon: bool = True,
        pg_timeout: float | None = 120.0,
    ) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="tessera-ranks-")
        ctx = _forkserver()
        store = os.path.join(self._tmp.name, "store")
        self.procs = [
            ctx.Process(
                target=_rank_main,
                args=(r, world, store, os.path.join(self._tmp.name, f"{r}.pkl"), dict(env or {}), fn, args, pg_timeout),
                daemon=daemon,
            )
            for r in range(world)
        ]
        for p in self.procs:
            p.start()

    def kill(self, rank: int) -> None:
        """SIGKILL one rank."""
        self.procs[rank].kill()

    def collect(self, timeout: float, wait_for: Iterable[int] | None = None) -> list[RankOutcome]:
        """Wait up to ``timeout`` seconds (for the ranks in ``wait_for``, default all), then
        kill whatever still runs and report every rank."""
        try:
            deadline = time.monotonic() + timeout
            for r in sorted(range(len(self.procs)) if wait_for is None else wait_for):
                self.procs[r].join(max(0.0, deadline - time.monotonic()))
            hung = set()
            for r, p in enumerate(self.procs):
                if p.is_alive():
                    hung.add(r)
                    p.kill()
                    p.join()
            out = []
            for r, p in enumerate(self.procs):
                path = os.path.join(self._tmp.name, f"{r}.pkl")
                if os.path.exists(path):
                    with open(path, "rb") as f:
                        (status, value), seconds = pickle.load(f)
                    out.append(RankOutcome(r, status, value, seconds, p.exitcode))
                else:
                    out.append(RankOutcome(r, "hung" if r in hung else "died", None, None, p.exitcode))
            return out
        finally:
            self._tmp.cleanup()


def start_ranks(fn: Callable[..., Any], world: int, *args: Any, env: dict[str, str] | None = None) -> RankGroup:
    """Start ``fn(rank, world, *args)`` on ``world`` gloo ranks without waiting for them."""
    return RankGroup(fn, world, args, env)


def run_ranks(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    timeout: float = 60.0,
    env: dict[str, str] | None = None,
    wait_for: Iterable[int] | None = None,
) -> list[RankOutcome]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; every rank's outcome.

    ``fn`` must be a module-level function. Ranks still running after ``timeout`` seconds
    are killed and reported as ``"hung"``; so are the others once every rank in
    ``wait_for`` has finished (for tests where a rank hangs on purpose). ``env`` is set in
    each rank before it starts.
    """
    return start_ranks(fn, world, *args, env=env).collect(timeout, wait_for)


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 240.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; their results.

    Raises:
        AssertionError: naming every rank that raised (with its traceback), died or hung.
    """
    group = RankGroup(fn, world_size, args, None, daemon=False, pg_timeout=None)
    outcomes = group.collect(timeout)
    errors = []
    for o in outcomes:
        if o.status == "error":
            errors.append(f"rank {o.rank}:\n{o.value['traceback']}")
        elif o.status != "ok":
            errors.append(f"rank {o.rank}: {o.status if o.status == 'hung' else f'died (exit code {o.exitcode})'}")
    if errors:
        raise AssertionError("distributed test failed:\n" + "\n".join(errors))
    return [o.value for o in outcomes]
