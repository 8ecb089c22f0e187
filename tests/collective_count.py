"""Count the ``torch.distributed`` collectives a process makes and the bytes it contributes.

The coordination targets (DESIGN.md, "Distribution and scale": a steady-state save and a
load each need at most 2 collectives of at most 1 KiB per rank) are about calls, not time,
so they are checked by counting. :class:`CollectiveCounter` replaces every public collective
of ``torch.distributed`` with a counting wrapper, in ``torch.distributed``,
``torch.distributed.distributed_c10d`` and every other loaded module that imported the
function by name (``from torch.distributed.distributed_c10d import broadcast``), and puts
the originals back when it exits. Calls are recorded only inside :meth:`CollectiveCounter.phase`,
two ways:

* **API calls**: the outermost ``torch.distributed`` call; ``all_gather_object`` counts once
  although it runs ``all_gather`` twice inside;
* **wire ops**: the calls that run no other counted call (the tensor collectives that move
  the bytes): ``all_gather_object`` is 2 of them, an ``all_reduce`` is 1.

The payload of a call is what this rank contributes: the ``nbytes`` of the tensors it sends
(all of them for ``all_reduce`` or ``all_gather``, only on the root for ``broadcast`` and
``scatter``, none for ``recv`` or ``barrier``), or for an ``*_object`` call the pickled size
of its object(s) (on the root only for ``broadcast_object_list`` and ``scatter_object_list``).
A wire op's payload is the tensors it sends (an ``*_object`` call sends a size tensor, then
its pickle padded to the largest rank's).

Not counted: the functional collectives (``torch.distributed._functional_collectives``,
which DTensor's ``redistribute`` and ``full_tensor`` use) run in C++ without a Python call,
and store traffic (rendezvous, ``new_group``'s store barrier). Creating a process group
counts apart, as ``groups_created``.

Every rank counts its own calls; a job reports the maximum over ranks. The counter is
thread-safe: a background thread's calls (an async save) count in the phase that is open
when they run.

Example:
    >>> counter = CollectiveCounter()
    >>> with counter:
    ...     with counter.phase("steady save"):
    ...         tessera.save(path, state)
    >>> counter.phases["steady save"].api_calls
"""

from __future__ import annotations

import functools
import inspect
import pickle
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from types import ModuleType, TracebackType
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

# What each collective sends from this rank: the argument holding its tensors or objects.
_SENDS: dict[str, str] = {
    "all_reduce": "tensor",
    "all_reduce_coalesced": "tensors",
    "reduce": "tensor",
    "all_gather": "tensor",
    "all_gather_into_tensor": "input_tensor",
    "all_gather_single": "input_tensor",
    "all_gather_coalesced": "input_tensor_list",
    "_all_gather_base": "input_tensor",
    "gather": "tensor",
    "reduce_scatter": "input_list",
    "reduce_scatter_tensor": "input",
    "reduce_scatter_single": "input",
    "_reduce_scatter_base": "input",
    "all_to_all": "input_tensor_list",
    "all_to_all_single": "input",
    "send": "tensor",
    "isend": "tensor",
    "all_gather_object": "obj",
    "gather_object": "obj",
    "send_object_list": "object_list",
}
# Rooted collectives: only the root sends.
_ROOT_SENDS: dict[str, str] = {
    "broadcast": "tensor",
    "scatter": "scatter_list",
    "broadcast_object_list": "object_list",
    "scatter_object_list": "scatter_object_input_list",
}
# Collectives that send nothing of this rank's (or, batch_isend_irecv, are sized apart).
_SENDS_NOTHING = ("barrier", "monitored_barrier", "recv", "irecv", "recv_object_list", "batch_isend_irecv")
_OBJECT_LISTS = ("object_list", "scatter_object_input_list")

COLLECTIVES: tuple[str, ...] = tuple(n for n in (*_SENDS, *_ROOT_SENDS, *_SENDS_NOTHING) if hasattr(c10d, n))
"""The collectives this torch has, by name in ``torch.distributed.distributed_c10d``."""
GROUP_SETUP: tuple[str, ...] = tuple(
    n for n in ("new_group", "new_subgroups", "new_subgroups_by_enumeration", "split_group") if hasattr(c10d, n)
)
"""Calls that create process groups: counted as ``groups_created``, not as collectives."""


@dataclass
class PhaseCounts:
    """What one rank did during one phase.

    Attributes:
        api_calls: outermost ``torch.distributed`` collective calls.
        wire_ops: calls that ran no other counted call (the tensor collectives underneath).
        max_call_bytes: the largest payload of one API call.
        largest_call: the name of that call ("" if none sent anything).
        total_bytes: the payloads of all API calls, summed.
        wire_bytes: the payloads of all wire ops, summed (pickles padded, size tensors).
        groups_created: process groups created (``new_group`` and kin).
        calls: API calls by name.
        wire: wire ops by name.
    """

    api_calls: int = 0
    wire_ops: int = 0
    max_call_bytes: int = 0
    largest_call: str = ""
    total_bytes: int = 0
    wire_bytes: int = 0
    groups_created: int = 0
    calls: dict[str, int] = field(default_factory=dict)
    wire: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def worst(ranks: list[PhaseCounts]) -> PhaseCounts:
        """The maximum over ranks of every count (each taken on its own rank)."""
        out = PhaseCounts()
        for name in ("api_calls", "wire_ops", "max_call_bytes", "total_bytes", "wire_bytes", "groups_created"):
            setattr(out, name, max((getattr(r, name) for r in ranks), default=0))
        if ranks:
            out.largest_call = max(ranks, key=lambda r: r.max_call_bytes).largest_call
        for attr in ("calls", "wire"):
            merged: Counter[str] = Counter()
            for r in ranks:
                merged |= Counter(getattr(r, attr))
            setattr(out, attr, dict(sorted(merged.items())))
        return out


@dataclass
class _Frame:
    name: str
    setup: bool
    payload: int = 0
    has_inner: bool = False


def _nbytes(value: object, objects: bool) -> int:
    """Bytes of a tensor or a list of tensors, or (``objects``) of the pickles of a list's
    objects, each pickled alone as c10d's ``_object_to_tensor`` does."""
    if value is None:
        return 0
    if objects:
        return sum(len(pickle.dumps(o)) for o in value) if isinstance(value, list) else 0
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v, False) for v in value)
    return 0


def _is_root(args: dict[str, Any]) -> bool:
    group = args.get("group")
    if args.get("group_src") is not None:
        return bool(dist.get_rank(group) == args["group_src"])
    return args.get("src") is not None and dist.get_rank() == args["src"]


def _payload(name: str, signature: inspect.Signature, args: tuple, kwargs: dict[str, Any]) -> int:
    """The bytes this rank contributes to ``name(*args, **kwargs)``; 0 if the call is malformed
    (the real call raises then) or an object does not pickle (likewise)."""
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return 0
    a = bound.arguments
    try:
        if name == "batch_isend_irecv":
            ops = a.get("p2p_op_list") or []
            return sum(_nbytes(p.tensor, False) for p in ops if getattr(p.op, "__name__", "") in ("isend", "send"))
        if name in _SENDS:
            arg = _SENDS[name]
        elif name in _ROOT_SENDS and _is_root(a):
            arg = _ROOT_SENDS[name]
        else:
            return 0
        if arg == "obj":  # one object (which may be a list)
            return len(pickle.dumps(a["obj"]))
        return _nbytes(a.get(arg), arg in _OBJECT_LISTS)
    except Exception:  # an unpicklable object, a group this rank is not in: the call itself reports it
        return 0


class CollectiveCounter:
    """Counts this process's ``torch.distributed`` collectives per phase (module docstring).

    Use as a context manager: entering patches, leaving restores the originals (also where a
    module imported a wrapper by name while the counter was active). Calls outside a phase
    are not recorded. Not reentrant; phases do not nest.

    Attributes:
        phases: the counts of each finished or open phase, by name.
    """

    def __init__(self) -> None:
        self.phases: dict[str, PhaseCounts] = {}
        self._active: PhaseCounts | None = None
        self._lock = threading.Lock()
        self._local = threading.local()
        self._wrappers: dict[int, Callable[..., Any]] = {}  # id(original) -> wrapper
        self._originals: dict[int, Callable[..., Any]] = {}  # id(wrapper) -> original
        self._installed = False

    # -- patching ---------------------------------------------------------------------------

    def __enter__(self) -> CollectiveCounter:
        if self._installed:
            raise RuntimeError("CollectiveCounter is already installed")
        for name in (*COLLECTIVES, *GROUP_SETUP):
            original = getattr(c10d, name)
            wrapper = self._wrap(name, original, setup=name in GROUP_SETUP)
            self._wrappers[id(original)] = wrapper
            self._originals[id(wrapper)] = original
        self._installed = True
        self._swap(self._wrappers)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._installed = False
        self._swap(self._originals)
        self._wrappers.clear()
        self._originals.clear()

    @staticmethod
    def _swap(replacement: dict[int, Callable[..., Any]]) -> None:
        """In every loaded module, replace each function found in ``replacement`` (by id)."""
        for module in list(sys.modules.values()):
            if not isinstance(module, ModuleType):
                continue
            try:
                names = list(vars(module).items())
            except TypeError:
                continue
            for attr, value in names:
                new = replacement.get(id(value))
                if new is not None:
                    setattr(module, attr, new)

    def _wrap(self, name: str, original: Callable[..., Any], setup: bool) -> Callable[..., Any]:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not self._installed or self._active is None:
                return original(*args, **kwargs)
            stack: list[_Frame] = self._local.__dict__.setdefault("stack", [])
            frame = _Frame(name, setup)
            if stack:
                stack[-1].has_inner = True
            if not setup:
                frame.payload = _payload(name, signature, args, kwargs)
            stack.append(frame)
            try:
                return original(*args, **kwargs)
            finally:
                stack.pop()
                self._record(frame, outermost=not stack)

        return wrapper

    def _record(self, frame: _Frame, outermost: bool) -> None:
        with self._lock:
            counts = self._active
            if counts is None:
                return
            if frame.setup:
                counts.groups_created += outermost
                return
            if outermost:
                counts.api_calls += 1
                counts.total_bytes += frame.payload
                if frame.payload > counts.max_call_bytes:
                    counts.max_call_bytes, counts.largest_call = frame.payload, frame.name
                counts.calls[frame.name] = counts.calls.get(frame.name, 0) + 1
            if not frame.has_inner:
                counts.wire_ops += 1
                counts.wire_bytes += frame.payload
                counts.wire[frame.name] = counts.wire.get(frame.name, 0) + 1

    # -- phases -----------------------------------------------------------------------------

    @contextmanager
    def phase(self, name: str) -> Iterator[PhaseCounts]:
        """Record the calls made (on any thread) until the block ends, as phase ``name``."""
        if not self._installed:
            raise RuntimeError("CollectiveCounter.phase needs the counter installed: use `with counter:` first")
        if name in self.phases:
            raise ValueError(f"phase {name!r} was already counted")
        if self._active is not None:
            raise RuntimeError(f"phase {name!r} opened inside another phase; phases do not nest")
        counts = self.phases[name] = PhaseCounts()
        self._active = counts
        try:
            yield counts
        finally:
            with self._lock:
                self._active = None
