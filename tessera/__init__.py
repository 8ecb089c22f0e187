"""tessera: parallelism-agnostic distributed checkpointing for PyTorch.

Save training state from any parallel layout, load it into any other::

    import tessera
    tessera.save("/ckpt/step100", {"model": model.state_dict(), "step": 100})
    tessera.load("/ckpt/step100", {"model": model.state_dict(), "step": 0})

Importing the package does no work: the public names below are loaded from their modules
on first use (PEP 562), so that ``tessera --help`` and ``tessera --version`` answer without
importing torch. ``import tessera`` followed by any attribute behaves as an eager import.

Glossary (in full in ``docs/format.md``):

* **box**: a rectangular region of a global tensor (offsets, lengths); geometry only.
* **flat range**: ``[start, stop)`` of a tensor's row-major flattening; becomes boxes.
* **shard**: what a user passes to say which box or flat range a rank holds
  (:class:`ShardedTensor`, :class:`FlatShard`).
* **piece**: a box a rank holds, with its data (``engine.flat_state.TensorPiece``).
* **tile**: a box as stored in a data file: laid out (``TileSlot``), written
  (``WrittenTile``), committed in the manifest (``format.manifest.Tile``).
* **block** / **slab**: a box cut to bound memory while streaming / one of n near-equal
  slices of a box shared among ranks (``format.geometry.split_box`` / ``format.geometry.split_even``).
* **value**: a plain (non-tensor) Python object, stored inline in the manifest; a
  **per-rank value** has one encoded value per saving rank.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    MissingKeysError,
    StagingMutationError,
    StateMismatchError,
    StorageError,
)
from .version import __version__

if TYPE_CHECKING:  # what the lazy names below resolve to, for type checkers and IDEs
    from .adapters import ModelState, OptimizerState, RNGState, StagingGate
    from .api import LoadResult, PendingSave, SaveResult, async_save, load, read_manifest, save
    from .hf_export import save_hf
    from .manager import CheckpointManager
    from .options import LoadOptions, SaveOptions, StagingMode
    from .shards import FlatShard, OnResize, ShardedTensor, per_rank
    from .tools.verification import verify

_LAZY: dict[str, str] = {
    **dict.fromkeys(("ModelState", "OptimizerState", "RNGState", "StagingGate"), ".adapters"),
    "save_hf": ".hf_export",
    **dict.fromkeys(("LoadResult", "PendingSave", "SaveResult", "async_save", "load", "read_manifest", "save"), ".api"),
    "CheckpointManager": ".manager",
    **dict.fromkeys(("LoadOptions", "SaveOptions", "StagingMode"), ".options"),
    **dict.fromkeys(("FlatShard", "OnResize", "ShardedTensor", "per_rank"), ".shards"),
    "verify": ".tools.verification",
}

_MOVED: dict[str, str] = {
    **dict.fromkeys(
        (
            "AllOf", "AnyOf", "AtSteps", "EveryNSeconds", "EveryNSteps", "OnPreemption", "SaveContext",
            "SavePolicy", "PreemptionHandler", "StepLoadResult",
        ),
        "manager",
    ),
    **dict.fromkeys(("DataPosition", "LoaderState", "ReshardableStream", "reshard_stream_states"), "adapters"),
    "HFSaveResult": "hf_export",
    "WriterMode": "options",
    **dict.fromkeys(("Problem", "ProblemKind", "VerifyReport"), "results"),
    **dict.fromkeys(
        (
            "CollectiveTimeoutError", "CommitCheckError", "ConcurrentSaveError", "CoverageError", "DistributedError",
            "InvalidStateError", "LocationMismatchError", "ManifestError", "PickleNotAllowedError",
            "UnsupportedPathError",
        ),
        "errors",
    ),
}  # fmt: skip
"""Names that live in a namespace only (the common path is ``__all__``): where each is."""


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        if name in _MOVED:
            raise AttributeError(
                f"module 'tessera' has no attribute {name!r}: it lives in its namespace, tessera.{_MOVED[name]}.{name}"
            )
        # `import tessera; tessera.storage.X` keeps working for subpackages and modules.
        try:
            return importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "FlatShard",
    "LoadOptions",
    "LoadResult",
    "MissingKeysError",
    "ModelState",
    "OnResize",
    "OptimizerState",
    "PendingSave",
    "RNGState",
    "SaveOptions",
    "SaveResult",
    "ShardedTensor",
    "StagingGate",
    "StagingMode",
    "StagingMutationError",
    "StateMismatchError",
    "StorageError",
    "__version__",
    "async_save",
    "load",
    "per_rank",
    "read_manifest",
    "save",
    "save_hf",
    "verify",
]
