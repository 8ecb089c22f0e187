"""Argument checks at the public boundary: wrong types and swapped arguments, before any work.

The public API puts *where* before *what*: ``tessera.save(path, state)``,
``tessera.load(path, state)``, ``CheckpointManager.save(step, state)``; the one exception
is ``CheckpointManager.load(state, step=None)``, whose step is optional (newest by
default). A call with the arguments the other way round, or of the wrong type, raises a
:class:`TypeError` naming each argument, what it got and what it wants, before any rank
reads or writes anything, instead of failing deep inside with an unrelated message.

Pure and local: no communication, so every rank raises the same error for the same call.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["check_manager_load", "check_manager_save", "check_path_state"]


def _kind(x: object) -> str:
    return "None" if x is None else type(x).__name__


def _is_path(x: object) -> bool:
    return isinstance(x, (str, os.PathLike))


def _is_state(x: object) -> bool:
    return isinstance(x, Mapping) or (
        callable(getattr(x, "state_dict", None)) and callable(getattr(x, "load_state_dict", None))
    )


def _is_step(x: object) -> bool:
    return type(x) is int


def check_path_state(func: str, path: object, state: object) -> str:
    """Check ``func(path, state)`` and return ``path`` as a string.

    Args:
        func: the function's public name, for the message (e.g. ``"tessera.load"``).
        path: a checkpoint path or URL: ``str`` or ``os.PathLike``.
        state: a dict, or an object with ``state_dict()``/``load_state_dict()``.

    Returns:
        ``path`` as ``str`` (``os.fspath`` of a path object).

    Raises:
        TypeError: naming ``path`` and/or ``state`` when either has the wrong type; when the
            two look swapped the message says so.

    Example:
        >>> check_path_state("tessera.load", "/ckpt/step100", {"step": 0})
        '/ckpt/step100'
    """
    if _is_path(path) and _is_state(state):
        return os.fspath(path)  # type: ignore[call-overload]
    if _is_state(path) and _is_path(state):
        raise TypeError(
            f"{func}(path, state): the arguments are swapped: got a {_kind(path)} as `path` and a {_kind(state)} "
            f"as `state`; call {func}({os.fspath(state)!r}, state)"  # type: ignore[call-overload]
        )
    problems = []
    if not _is_path(path):
        problems.append(f"`path` must be a str or os.PathLike (the checkpoint directory or URL), got {_kind(path)}")
    if not _is_state(state):
        problems.append(
            f"`state` must be a dict (or an object with state_dict()/load_state_dict()), got {_kind(state)}"
        )
    raise TypeError(f"{func}(path, state): " + "; ".join(problems))


def check_manager_save(step: object, state: object) -> None:
    """Check ``CheckpointManager.save(step, state)``.

    Raises:
        TypeError: naming ``step`` and/or ``state`` (and saying so when they are swapped).

    Example:
        >>> check_manager_save(100, {"step": 100})
    """
    if _is_step(step) and _is_state(state):
        return
    if _is_state(step) and _is_step(state):
        raise TypeError(
            f"CheckpointManager.save(step, state): the arguments are swapped: got a {_kind(step)} as `step` and "
            f"{state!r} as `state`; call manager.save({state!r}, state)"
        )
    problems = []
    if not _is_step(step):
        problems.append(f"`step` must be an int (the training step), got {_kind(step)}")
    if not _is_state(state):
        problems.append(
            f"`state` must be a dict (or an object with state_dict()/load_state_dict()), got {_kind(state)}"
        )
    raise TypeError("CheckpointManager.save(step, state): " + "; ".join(problems))


def check_manager_load(state: object, step: object) -> None:
    """Check ``CheckpointManager.load(state, step=None)``.

    Raises:
        TypeError: naming ``state`` and/or ``step`` (and saying so when they are swapped).

    Example:
        >>> check_manager_load({"step": 0}, None)
    """
    step_ok = step is None or _is_step(step)
    if _is_state(state) and step_ok:
        return
    if _is_step(state) and _is_state(step):
        raise TypeError(
            f"CheckpointManager.load(state, step=None): the arguments are swapped: got {state!r} as `state` and a "
            f"{_kind(step)} as `step`; call manager.load(state, step={state!r})"
        )
    problems = []
    if not _is_state(state):
        hint = " (the manager's root is given to its constructor)" if _is_path(state) else ""
        problems.append(
            f"`state` must be a dict (or an object with state_dict()/load_state_dict()), got {_kind(state)}{hint}"
        )
    if not step_ok:
        problems.append(f"`step` must be an int or None (None: the newest loadable step), got {_kind(step)}")
    raise TypeError("CheckpointManager.load(state, step=None): " + "; ".join(problems))
