"""Errors raised by tessera.

Every error derives from :class:`CheckpointError` and, where one fits, from the matching
builtin too, so ``except ValueError`` keeps working for callers that do not know tessera.
Messages name the tensor, the file and the rank where they are known.
"""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class of every error tessera raises on purpose."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No committed checkpoint exists at the path (none, or only an unfinished save)."""


class CorruptCheckpointError(CheckpointError, ValueError):
    """Stored bytes or the manifest do not match what was committed (checksum, size, schema)."""


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


class PickleNotAllowedError(CheckpointError, TypeError):
    """A value needs pickle but the caller did not opt in (at save or at load)."""


class StorageError(CheckpointError, OSError):
    """A storage backend failed persistently (after retries)."""


class DistributedError(CheckpointError, RuntimeError):
    """One or more ranks failed during a collective phase of a save or load.

    Attributes:
        failures: ``{rank: message}`` for every rank that reported a failure.
    """

    def __init__(self, message: str, failures: dict[int, str] | None = None) -> None:
        self.failures: dict[int, str] = dict(failures or {})
        if self.failures:
            detail = "\n".join(f"  rank {r}: {m}" for r, m in sorted(self.failures.items()))
            message = f"{message}\n{detail}"
        super().__init__(message)


class CollectiveTimeoutError(DistributedError, TimeoutError):
    """A collective phase did not complete in time: a rank died or hangs."""


class ConcurrentSaveError(CheckpointError, RuntimeError):
    """Another save committed to the same checkpoint path while this one ran.

    The two saves were fenced: at most one of them commits, and this one did not. The
    checkpoint at the path is the other save's, complete.
    """


class LocationMismatchError(CheckpointError, ValueError):
    """The ranks of one save named different checkpoint locations (paths or storage)."""


class CommitCheckError(StorageError):
    """At commit, a data file was missing or had the wrong size where the manifest would point.

    Nothing was committed; the checkpoint at the path is the previous one.
    """
