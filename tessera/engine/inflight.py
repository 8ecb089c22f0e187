"""The save in flight, per process group, and waiting for it.

At most one save is in flight per process and process group. A new save, a load and the
checkpoint manager first wait for it; a background failure nobody has seen yet is handed to
the caller (as a value, so that it can be raised on every rank in the caller's next
collective step). At interpreter exit, failures nobody saw are written to stderr.

Saving and loading both import this module; neither imports the other.
"""

from __future__ import annotations

import atexit
import sys
import threading
from concurrent.futures import wait as wait_futures

from ..results import PendingSave
from . import dist

__all__ = ["settle", "track", "wait_pending"]

_PENDING: dict[object, PendingSave] = {}
_LOCK = threading.Lock()


def _key(process_group: object) -> object:
    # The default group may be named explicitly (dist.group.WORLD) or left as None.
    return "default" if dist.is_default_group(process_group) else process_group


def track(process_group: object, pending: PendingSave) -> None:
    """Remember ``pending`` as the save in flight of ``process_group`` (replacing the last one)."""
    with _LOCK:
        _PENDING[_key(process_group)] = pending


def settle(pending: PendingSave | None) -> BaseException | None:
    """Block until ``pending`` has finished; its error if nobody has observed it yet.

    The error is returned, not raised: a caller hands it to its next collective step, so
    that every rank fails together (whether a rank already observed it is per process).
    Marks the error as observed.
    """
    if pending is None:
        return None
    wait_futures([pending._future])
    try:
        pending._raise_unobserved()
    except BaseException as e:
        return e
    return None


def wait_pending(process_group: object = None) -> BaseException | None:
    """Block until this process's save in flight for ``process_group`` (if any) has finished.

    Returns:
        the save's error if it failed and nobody has observed it yet, else None.
    """
    with _LOCK:
        pending = _PENDING.pop(_key(process_group), None)
    return settle(pending)


@atexit.register
def _report_unobserved() -> None:
    """At exit: say on stderr which background saves failed with nobody waiting for them.

    Written straight to stderr, not logged: with no logging configured, or logging to a
    file, the failure would otherwise go unnoticed. (Python ignores an exit status set by
    an atexit handler, so the process's exit code cannot be changed from here safely.)
    Non-daemon save threads have been joined by the time atexit handlers run.
    """
    with _LOCK:
        pendings = list(_PENDING.values())
    for pending in pendings:
        e = pending.unobserved_error()
        if e is None:
            continue
        pending._observed = True
        try:
            sys.stderr.write(
                f"tessera: ERROR: the asynchronous save to {pending.path} failed in the background and nothing "
                f"waited for it (call .wait() on the PendingSave); the checkpoint was NOT committed: "
                f"{type(e).__name__}: {e}\n"
            )
            sys.stderr.flush()
        except Exception:
            pass
