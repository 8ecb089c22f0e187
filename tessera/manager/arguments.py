"""The manager's constructor arguments: checking them, and keeping them on the parts that use them.

:func:`check_arguments` validates at the boundary (before anything is built or installed)
and resolves a ``tier::<url>`` root. :class:`Kept` makes an argument an attribute of the
manager that one of its parts owns, so that ``mgr.keep_last = 5`` still changes what
retention does.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Generic, NamedTuple, TypeVar, cast, overload

from ..options import SaveOptions
from ..storage.host_memory import TIER_PREFIX, default_memory_root
from .local_tier import LocalTier
from .local_tier.codec import check_available

__all__ = ["Kept", "LocalTierArguments", "check_arguments", "local_tier_of"]

T = TypeVar("T")


class LocalTierArguments(NamedTuple):
    """The arguments :func:`check_arguments` resolves."""

    root: str
    """The durable root (without a ``tier::`` prefix)."""
    local_dir: str | None
    """The local tier's directory (None: no local tier)."""
    local_replicas: int
    """Copies of each rank's files on other nodes."""
    warn_single_node: bool
    """Whether ``local_replicas`` was given (then a single-node job warns that no copy is placed)."""
    local_parity: tuple[int, int] | None = None
    """``(k, m)`` of the parity that replaces replicas (None: replicas)."""


def check_arguments(
    root: str,
    *,
    keep_last: int | None,
    keep_every: int | None,
    durable_every: int | None,
    local_keep_last: int,
    local_replicas: int | None,
    local_dir: str | None,
    dedup: bool = False,
    local_parity: tuple[int, int] | None = None,
) -> LocalTierArguments:
    """Check :class:`~tessera.CheckpointManager`'s arguments and resolve a ``tier::`` root.

    ``tier::<url>`` is ``<url>`` with the local tier in host memory (``local_dir`` defaults to
    :func:`~tessera.storage.host_memory.default_memory_root` of it).

    Raises:
        ValueError: for ``keep_last``, ``keep_every``, ``durable_every`` or ``local_keep_last``
            below 1, ``local_replicas`` below 0, or a ``local_dir`` that is not a local path;
            ``local_parity`` that is not ``(k, m)`` with ``k, m >= 1``, or given with ``local_replicas``.
    """
    for name, value in (
        ("keep_last", keep_last),
        ("keep_every", keep_every),
        ("durable_every", durable_every),
        ("local_keep_last", local_keep_last),
    ):
        if value is not None and (type(value) is not int or value < 1):
            raise ValueError(f"CheckpointManager({root!r}): {name} must be None or an integer >= 1, got {value!r}")
    warn_single_node = local_replicas is not None
    if local_parity is not None:
        ok = isinstance(local_parity, tuple | list) and len(local_parity) == 2
        if not ok or any(type(v) is not int or v < 1 for v in local_parity):
            raise ValueError(
                f"CheckpointManager({root!r}): local_parity must be (k, m) with integers >= 1, got {local_parity!r}"
            )
        if local_replicas is not None:
            raise ValueError(
                f"CheckpointManager({root!r}): local_parity={tuple(local_parity)} replaces replicas; "
                f"do not also give local_replicas={local_replicas!r}"
            )
        local_parity, local_replicas = (int(local_parity[0]), int(local_parity[1])), 0
        try:
            check_available(*local_parity)
        except ValueError as e:
            raise ValueError(f"CheckpointManager({root!r}): {e}") from None
    if local_replicas is None:
        local_replicas = 1
    if type(local_replicas) is not int or local_replicas < 0:
        raise ValueError(f"CheckpointManager({root!r}): local_replicas must be an integer >= 0, got {local_replicas!r}")
    if isinstance(root, str) and root.startswith(TIER_PREFIX):
        # "tier::<url>": the local tier in host memory, every step also durable under <url>.
        root = root[len(TIER_PREFIX) :]
        if local_dir is None:
            local_dir = default_memory_root(root)
    if local_dir is not None and (not isinstance(local_dir, str) or "://" in local_dir or not local_dir):
        raise ValueError(f"CheckpointManager({root!r}): local_dir must be a local directory path, got {local_dir!r}")
    if dedup and local_dir is not None:
        raise ValueError(
            f"CheckpointManager({root!r}): dedup=True applies to saves under root and cannot be combined "
            "with a local tier (local_dir or a 'tier::' root) yet; choose one"
        )
    return LocalTierArguments(root, local_dir, local_replicas, warn_single_node, local_parity)


def local_tier_of(args: LocalTierArguments, *, keep_last: int, process_group: Any) -> LocalTier | None:
    """The manager's local tier for its checked arguments (None without ``local_dir``)."""
    if args.local_dir is None:
        return None
    return LocalTier(
        args.local_dir,
        args.root,
        replicas=args.local_replicas,
        keep_last=keep_last,
        process_group=process_group,
        warn_single_node=args.warn_single_node,
        parity=args.local_parity,
    )


class Kept(Generic[T]):
    """A public attribute of the manager that one of its parts owns.

    Reading or assigning it on the manager reads or assigns the attribute of the same name
    on the part, e.g. ``keep_last = Kept[int | None]("_retention")``.

    Args:
        part: the name of the manager's attribute holding the part.
    """

    def __init__(self, part: str) -> None:
        self.part = part
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, objtype: type) -> Kept[T]: ...
    @overload
    def __get__(self, obj: object, objtype: type | None = None) -> T: ...
    def __get__(self, obj: object, objtype: type | None = None) -> T | Kept[T]:
        if obj is None:
            return self
        return cast(T, getattr(getattr(obj, self.part), self.name))

    def __set__(self, obj: object, value: T) -> None:
        setattr(getattr(obj, self.part), self.name, value)


def with_budget(
    options: SaveOptions | None, max_staging_bytes: int | str | None, compress: bool | str | None = None
) -> SaveOptions | None:
    """``options`` with ``CheckpointManager(max_staging_bytes=..., compress=...)`` set in them (where given)."""
    if max_staging_bytes is not None:
        options = dataclasses.replace(options or SaveOptions(), max_staging_bytes=max_staging_bytes)
    if compress is not None:
        base = options or SaveOptions()
        # a chunk size left at its default follows ``compress`` (SaveOptions.chunk_bytes)
        follows = base.chunk_bytes == SaveOptions(compress=base.compress).chunk_bytes
        options = dataclasses.replace(base, compress=compress, chunk_bytes=0 if follows else base.chunk_bytes)
    return options
