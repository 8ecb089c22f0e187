"""tessera: parallelism-agnostic distributed checkpointing for PyTorch.

Save training state from any parallel layout, load it into any other::

    import tessera
    tessera.save("/ckpt/step100", {"model": model.state_dict(), "step": 100})
    tessera.load("/ckpt/step100", {"model": model.state_dict(), "step": 0})
"""

from .adapters import (
    DataPosition,
    LoaderState,
    ModelState,
    OptimizerState,
    ReshardableStream,
    RNGState,
    reshard_stream_states,
)
from .api import LoadResult, PendingSave, SaveResult, async_save, load, read_manifest, save
from .errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CollectiveTimeoutError,
    CorruptCheckpointError,
    CoverageError,
    DistributedError,
    ManifestError,
    MissingKeysError,
    PickleNotAllowedError,
    StateMismatchError,
    StorageError,
)
from .hf_export import HFSaveResult, save_hf
from .manager import CheckpointManager, StepLoadResult
from .options import LoadOptions, SaveOptions
from .shards import FlatShard, OnResize, ShardedTensor, per_rank
from .verify import Problem, ProblemKind, VerifyReport, verify
from .version import __version__

__all__ = [
    "__version__",
    "CheckpointError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CollectiveTimeoutError",
    "CorruptCheckpointError",
    "CoverageError",
    "DataPosition",
    "DistributedError",
    "FlatShard",
    "HFSaveResult",
    "LoadOptions",
    "LoaderState",
    "LoadResult",
    "ManifestError",
    "MissingKeysError",
    "ModelState",
    "OnResize",
    "OptimizerState",
    "PendingSave",
    "PickleNotAllowedError",
    "Problem",
    "ProblemKind",
    "RNGState",
    "ReshardableStream",
    "SaveOptions",
    "SaveResult",
    "ShardedTensor",
    "StateMismatchError",
    "StepLoadResult",
    "StorageError",
    "VerifyReport",
    "async_save",
    "load",
    "per_rank",
    "read_manifest",
    "reshard_stream_states",
    "save",
    "save_hf",
    "verify",
]
