"""Framework adapters: whole training states as tessera Stateful objects.

``ModelState`` and ``OptimizerState`` take a model and optimizer as any framework wraps
them (plain, DDP, FSDP1, FSDP2, tensor parallel, 2-D meshes) and key everything by clean
parameter FQN, so a checkpoint saved under one layout loads under any other.
"""

from .data import LoaderState, ReshardableStream, reshard_stream_states
from .model import ModelState
from .optimizer import OptimizerState
from .position import DataPosition
from .rng import RNGState

__all__ = [
    "DataPosition",
    "LoaderState",
    "ModelState",
    "OptimizerState",
    "RNGState",
    "ReshardableStream",
    "reshard_stream_states",
]
