"""Errors raised by tessera.

Every error derives from :class:`CheckpointError` and, where one fits, from the matching
builtin too, so ``except ValueError`` keeps working for callers that do not know tessera.
Messages name the tensor, the file and the rank where they are known.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType


class CheckpointError(Exception):
    """Base class of every error tessera raises on purpose.

    Attributes:
        failures: ``{rank: "TypeName: message"}`` when the error reports failures of
            several ranks of a collective save or load (every rank raises the same type,
            each with every failed rank's cause); empty for a purely local error.
    """

    failures: Mapping[int, str] = MappingProxyType({})


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No committed checkpoint exists at the path (none, or only an unfinished save)."""


class CorruptCheckpointError(CheckpointError, ValueError):
    """Stored bytes or the manifest do not match what was committed (checksum, size, schema)."""


class MissingTilesError(CorruptCheckpointError, FileNotFoundError):
    """A step references tiles it shares with other steps of its root, and they are not there."""


class ManifestError(CorruptCheckpointError):
    """The manifest is malformed, truncated, oversized, or refers outside the checkpoint."""


class CoverageError(CheckpointError, ValueError):
    """The ranks' tiles of a tensor leave a gap, overlap with different owners, or exceed it."""


class StateMismatchError(CheckpointError, ValueError):
    """The state passed to ``load`` does not match the checkpoint (keys, shapes, dtypes)."""


class MissingKeysError(StateMismatchError, KeyError):
    """Keys the caller asked for are not in the checkpoint (``strict=True``)."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class InvalidStateError(CheckpointError, ValueError, TypeError):
    """The state passed to ``save`` or ``load`` cannot be named or encoded.

    Two of its entries flatten to the same name (``{"a.b": x, "a": {"b": y}}``), it is
    nested deeper than tessera follows, or an entry cannot be stored (a key that is not a
    str or int, a meta, sparse or quantized tensor, a nested ``per_rank()``...). Both a
    ``ValueError`` and a ``TypeError``, as the builtin these cases raised before.
    """


class PickleNotAllowedError(CheckpointError, TypeError):
    """A value needs pickle but the caller did not opt in (at save or at load).

    Also raised by imports (``tessera convert``, ``tessera diff``) for a file of another tool
    that names a class outside its format's allow-list (DCP's ``.metadata``, DeepSpeed and
    Megatron ``*.pt`` files): nothing from it was run.
    """


class StorageError(CheckpointError, OSError):
    """A storage backend failed persistently (after retries)."""


class DistributedError(CheckpointError, RuntimeError):
    """One or more ranks failed during a collective phase of a save or load.

    Attributes:
        failures: ``{rank: message}`` for every rank that reported a failure.
    """

    def __init__(self, message: str, failures: Mapping[int, str] | None = None) -> None:
        self.failures = dict(failures or {})
        if self.failures:
            detail = "\n".join(f"  rank {r}: {m}" for r, m in sorted(self.failures.items()))
            message = f"{message}\n{detail}"
        super().__init__(message)


class CollectiveTimeoutError(DistributedError, TimeoutError):
    """A collective phase did not complete in time: a rank died or hangs."""


class PlanMismatchError(DistributedError):
    """The ranks of a save disagree on its plan: the state's structure changed on some ranks
    since the last save and not on the others. The save wrote nothing that stays; a
    synchronous save starts over by itself (``retry``), and every rank's next save plans again."""

    retry: bool = False


class ConcurrentSaveError(CheckpointError, RuntimeError):
    """Another save committed to the same checkpoint path while this one ran.

    The two saves were fenced: at most one of them commits, and this one did not. The
    checkpoint at the path is the other save's, complete.
    """


class StagingMutationError(CheckpointError, RuntimeError):
    """A tensor copied in the background was modified before its copy (``PendingSave.wait_staged``).

    Raised on every rank by the mutation check of an async save (``SaveOptions.check_staging``,
    on by default) instead of committing a checkpoint that mixes two moments; nothing was
    committed. Change saved tensors after ``wait_staged()``, through calls a gated Stateful
    holds, or save them with ``StagingMode.AUTO`` (raw tensors copied before the call returns).
    """


class ReplicaMismatchError(CheckpointError, ValueError):
    """The copies of a replicated tensor (a plain tensor several ranks hold) differ between ranks at a save.

    Nothing was committed. Make the copies equal, or save rank-local values with ``tessera.per_rank``.
    """


class LocationMismatchError(CheckpointError, ValueError):
    """The ranks of one save named different checkpoint locations (paths or storage)."""


class UnsupportedPathError(CheckpointError, ValueError):
    """A path or URL names no checkpoint location a save or load can use.

    For example ``tier::<root>``: that prefix names the local tier of a
    :class:`~tessera.CheckpointManager` (``CheckpointManager("tier::<root>")``), not a storage backend.
    """


class CommitCheckError(StorageError):
    """At commit, a data file was missing or had the wrong size where the manifest would point.

    Nothing was committed; the checkpoint at the path is the previous one.
    """


@dataclass(frozen=True)
class RankFailure:
    """One rank's failure as it travels to the other ranks (picklable, no traceback).

    Attributes:
        rank: the rank that failed.
        type_name: the exception's class name (``StateMismatchError``, ``TypeError``, ...).
        message: ``str()`` of the exception, which names the tensor and file.
        tessera_type: whether the class is a :class:`CheckpointError` defined by tessera,
            so that the other ranks can raise the same type.
    """

    rank: int
    type_name: str
    message: str
    tessera_type: bool = False

    @classmethod
    def of(cls, rank: int, e: BaseException, context: str = "") -> RankFailure:
        """The record of exception ``e`` raised on ``rank``; ``context`` prefixes the message."""
        t = type(e)
        message = f"{context}: {e}" if context else str(e)
        return cls(rank, t.__name__, message, _known(t.__name__) is t)

    def __str__(self) -> str:
        return f"{self.type_name}: {self.message}"


def _tessera_classes() -> dict[str, type[CheckpointError]]:
    out: dict[str, type[CheckpointError]] = {}
    todo: list[type[CheckpointError]] = [CheckpointError]
    while todo:
        c = todo.pop()
        if c.__module__ == __name__:  # only tessera's own classes, never a name from a peer
            out[c.__name__] = c
        todo.extend(c.__subclasses__())
    return out


def _known(name: str) -> type[CheckpointError] | None:
    return _tessera_classes().get(name)


def _common_class(names: set[str]) -> type[CheckpointError] | None:
    """The most specific tessera class every failure is an instance of, if below the base."""
    known = [_known(n) for n in names]
    classes = [c for c in known if c is not None]
    if not classes or len(classes) < len(known):
        return None
    common = [c for c in classes[0].__mro__ if isinstance(c, type) and issubclass(c, CheckpointError)]
    for c in common:
        if all(issubclass(k, c) for k in classes):
            return None if c is CheckpointError and len(names) > 1 else c
    return None


def collective_error(message: str, failures: Mapping[int, RankFailure | str]) -> CheckpointError:
    """One error for a collective phase that failed on the ranks in ``failures``.

    If every failed rank raised a tessera error of the same class (or of classes sharing a
    tessera base more specific than :class:`CheckpointError`), the error has that class, so
    ``except StateMismatchError`` works on every rank; otherwise (mixed or non-tessera
    causes) it is a :class:`DistributedError`. Either way ``failures`` holds every failed
    rank's cause as ``"TypeName: message"`` and the message lists them.
    """
    texts = {int(r): str(f) for r, f in failures.items()}
    names = {f.type_name for f in failures.values() if isinstance(f, RankFailure) and f.tessera_type}
    typed = all(isinstance(f, RankFailure) and f.tessera_type for f in failures.values())
    cls = _common_class(names) if typed else None
    if cls is None or issubclass(cls, DistributedError):
        return (cls or DistributedError)(message, texts)
    detail = "\n".join(f"  rank {r}: {m}" for r, m in sorted(texts.items()))
    try:
        err = cls(f"{message}\n{detail}")
    except Exception:
        return DistributedError(message, texts)
    err.failures = texts
    return err
