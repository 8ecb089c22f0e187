"""The coordination group: which ranks take part in a save or load, over which gloo group.

Checkpointing uses its own gloo group, created once per training group (:func:`world_for`):
it works when the training group is NCCL, and a background commit never shares a group with
the training loop's collectives. Without ``torch.distributed`` initialised everything
degrades to a single process (``World(0, 1)``). The collectives themselves are
:mod:`tessera.engine.dist`'s.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import threading
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from .. import _knobs
from ..errors import CollectiveTimeoutError

logger = logging.getLogger(__name__)

_GROUPS: dict[object, Any] = {}
_OWNED: list[Any] = []  # the gloo groups tessera created (not a caller's group used as is)
_GROUPS_LOCK = threading.Lock()


@atexit.register
def _release_groups() -> None:
    """At exit, destroy tessera's own gloo groups and drop every reference to a group.

    ``dist.destroy_process_group()`` unregisters every group, but tessera's cache kept the
    coordination group's object alive until interpreter finalization, and a
    ``ProcessGroupGloo`` destroyed then (its worker threads still holding work, the
    interpreter half torn down) can abort the process with "terminate called without an
    active exception". atexit runs after non-daemon threads (a background commit) are
    joined, while the interpreter is still whole, so the groups are torn down cleanly here.
    """
    with _GROUPS_LOCK:
        owned = list(_OWNED)
        _OWNED.clear()
        _GROUPS.clear()
    for group in owned:
        try:
            if dist.is_initialized():
                dist.destroy_process_group(group)
        except Exception as e:
            logger.debug("destroying tessera's coordination group at exit: %s", e)


@dataclass(frozen=True)
class World:
    """This process's place among the ranks taking part in a save or load."""

    rank: int
    size: int
    group: Any = None
    """The gloo group used for coordination; None when running as a single process."""

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.group is not None and self.size > 1


def is_default_group(process_group: Any) -> bool:
    """Whether ``process_group`` means the whole job (None, or ``dist.group.WORLD``)."""
    return process_group is None or (dist.is_initialized() and process_group == dist.group.WORLD)


def world_for(process_group: Any = None) -> World:
    """The world of ``process_group`` (default: the whole job), with its coordination group.

    For the default group and for non-gloo groups (NCCL), the first call creates a
    dedicated gloo group (for a subgroup, only its members take part); later calls are
    local. A gloo ``process_group`` is used directly.
    """
    if not (dist.is_available() and dist.is_initialized()):
        if process_group is not None:
            raise ValueError("process_group was given but torch.distributed is not initialised")
        return World(0, 1, None)
    if is_default_group(process_group):
        process_group = None
    key = process_group if process_group is not None else "default"
    with _GROUPS_LOCK:
        group = _GROUPS.get(key)
        if group is None:
            if process_group is not None and dist.get_backend(process_group) == "gloo":
                # A gloo subgroup is used as is: creating a new group would be collective
                # over the whole job, and only the subgroup's ranks are calling us.
                group = process_group
            else:
                ranks = dist.get_process_group_ranks(process_group) if process_group is not None else None
                timeout = datetime.timedelta(seconds=_knobs.collective_timeout_s())
                # For a subgroup, only its members synchronise: the other ranks are not calling us.
                try:
                    group = dist.new_group(
                        ranks=ranks, backend="gloo", timeout=timeout, use_local_synchronization=ranks is not None
                    )
                except RuntimeError as e:  # a peer died while the group was being connected
                    raise CollectiveTimeoutError(
                        f"rank {dist.get_rank()}: creating tessera's coordination group failed; another rank died "
                        f"or hangs (timeout {_knobs.collective_timeout_s():.0f}s, TESSERA_TIMEOUT_S): {e}"
                    ) from e
                _OWNED.append(group)
            _GROUPS[key] = group
    return World(dist.get_rank(group), dist.get_world_size(group), group)
