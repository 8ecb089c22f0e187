"""The one harness for tests on real process groups: N processes joined by a gloo group.

Processes come from a ``forkserver`` that has already imported torch, tessera and what
ranks import from them (``_forkserver``), so a rank starts in milliseconds instead of the
seconds a fresh interpreter needs. Each rank initialises ``torch.distributed`` (gloo, a
FileStore rendezvous in a temporary directory) and calls ``fn(rank, world_size, *args)``;
``fn`` must be a module-level function so that the ranks can import it.

* :func:`run_distributed` returns every rank's return value and fails the test with each
  failed rank's traceback (a hang is killed after ``timeout`` seconds);
* :func:`run_ranks` returns what happened to each rank (result, error, died, hung), for
  tests where ranks fail or die on purpose; :func:`start_ranks` starts them without waiting
  (to kill one mid-save), :func:`start` one process without a group.

Tests that use it carry the ``distributed`` marker (set in ``tests/conftest.py``).

:func:`run_script` runs a Python file as ``python FILE`` would, in a process from the same
server (the documentation's code blocks, tests/test_docs.py): no group, no marker.
"""

from __future__ import annotations

import atexit
import builtins
import datetime
import gc
import multiprocessing
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


def _forkserver() -> multiprocessing.context.ForkServerContext:
    ctx = multiprocessing.get_context("forkserver")
    # What nearly every rank imports anyway, once here instead of in each: DTensor (tessera's
    # adapters and saves), torch._dynamo (the first optimizer built), tessera's manager, pytest
    # (the test module that defines fn): about 1.3 s of CPU per rank on a 2-core machine. And
    # the Llama model of the Hugging Face tests (1.3 s in each of their ranks). A module that
    # is not installed is skipped.
    ctx.set_forkserver_preload([
        "torch", "torch.distributed", "torch.distributed.tensor", "torch._dynamo",
        "tessera", "tessera.adapters", "tessera.manager", "pytest", "tests.dist_utils",
        "transformers", "transformers.models.llama.modeling_llama",
    ])  # fmt: skip
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
            timeout=None if pg_timeout is None else datetime.timedelta(seconds=pg_timeout),
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
    # Processes the rank started through multiprocessing (a framework's manager server, such as
    # megatron-core's async checkpoint writer's) would outlive an exit that skips their shutdown.
    for child in multiprocessing.active_children():
        child.kill()
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


# ------------------------------------------------------------------------------------------
# One script, as ``python FILE`` runs it


def _script_main(script: str, argv: list[str], cwd: str, env: dict[str, str], stdout: str, stderr: str) -> None:
    """Run ``script`` as ``__main__`` and end the way an interpreter ends: non-daemon threads,
    then atexit handlers (tessera's among them), then the exit code."""
    for fd, path in ((1, stdout), (2, stderr)):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(out, fd)  # fd level: C code and child processes write there too
        os.close(out)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    # What an interpreter reads from the environment at its start; the server started earlier.
    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    options = [o for o in env.get("PYTHONWARNINGS", "").split(",") if o]
    if options:
        sys.warnoptions[:] = options
        warnings._processoptions(options)  # type: ignore[attr-defined]
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(script))
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=script, __cached__=None, __builtins__=builtins)
    sys.modules["__main__"] = main  # what the script defines pickles by reference, as under python FILE
    code = 0
    try:
        with open(script, "rb") as f:
            exec(compile(f.read(), script, "exec"), main.__dict__)
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException as e:
        traceback.print_exception(type(e), e, e.__traceback__.tb_next if e.__traceback__ else None)
        code = 1
    # What the interpreter does at exit, in its order: join non-daemon threads, run atexit
    # handlers, then drop __main__'s names (objects' finalizers run).
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    main.__dict__.clear()
    gc.collect()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class ScriptProcess:
    """A script started by :func:`start_script`: the part of ``subprocess.Popen`` tests use
    (``pid``, ``poll``, ``kill``, ``communicate``, ``returncode``), output read from files."""

    def __init__(self, script: str, argv: list[str], cwd: str, env: dict[str, str], logs: str) -> None:
        self.args = [sys.executable, script, *argv]
        stem = os.path.basename(script)
        self._out, self._err = (os.path.join(logs, f"{stem}.{n}") for n in ("stdout", "stderr"))
        self._proc = _forkserver().Process(target=_script_main, args=(script, argv, cwd, env, self._out, self._err))
        self._proc.start()
        self.pid: int = self._proc.pid  # type: ignore[assignment]
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and not self._proc.is_alive():
            self._proc.join()
            self.returncode = self._proc.exitcode
        return self.returncode

    def kill(self) -> None:
        self._proc.kill()

    def output(self) -> tuple[str, str]:
        """What the process wrote so far: (stdout, stderr)."""

        def read(path: str) -> str:
            try:
                with open(path, encoding="utf-8", errors="replace") as f:
                    return f.read()
            except FileNotFoundError:
                return ""

        return read(self._out), read(self._err)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Wait for the process to end; its (stdout, stderr).

        Raises:
            subprocess.TimeoutExpired: the process still runs after ``timeout`` seconds.
        """
        self._proc.join(timeout)
        if self.poll() is None:
            out, err = self.output()
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0, output=out, stderr=err)
        return self.output()


def start_script(
    script: str | os.PathLike[str],
    *argv: str,
    cwd: str | os.PathLike[str],
    env: dict[str, str],
    logs: str | os.PathLike[str],
) -> ScriptProcess:
    """Start ``script`` like ``python script *argv`` in ``cwd`` with environment ``env``, in a
    process forked from the preloaded server (torch and tessera are imported already); its
    stdout and stderr go to files in ``logs``, named after the script.

    Unlike a fresh interpreter, the process starts with those modules imported; a script that
    starts processes from functions it defines (``multiprocessing``) needs a real interpreter.
    """
    return ScriptProcess(os.path.abspath(script), list(argv), os.path.abspath(cwd), env, os.path.abspath(logs))


def run_script(
    script: str | os.PathLike[str],
    *argv: str,
    cwd: str | os.PathLike[str],
    env: dict[str, str],
    timeout: float,
) -> subprocess.CompletedProcess[str]:
    """Run ``script`` as :func:`start_script` does and wait for it; its exit code and output.

    Raises:
        subprocess.TimeoutExpired: after ``timeout`` seconds (the process is killed), with the
            output so far.
    """
    with tempfile.TemporaryDirectory(prefix="tessera-script-") as logs:
        proc = start_script(script, *argv, cwd=cwd, env=env, logs=logs)
        try:
            out, err = proc.communicate(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise
        assert proc.returncode is not None
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
