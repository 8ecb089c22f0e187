"""Framework adapters: whole training states as tessera Stateful objects.

``ModelState`` and ``OptimizerState`` take a model and optimizer as any framework wraps
them (plain, DDP, FSDP1, FSDP2, tensor parallel, 2-D meshes) and key everything by clean
parameter FQN, so a checkpoint saved under one layout loads under any other.

Modules, one concept each: ``views`` (how a rank's memory maps onto a global tensor),
``model`` and ``fsdp1`` (parameters and buffers), ``optimizer``, ``zero`` (DeepSpeed flat
partitions), ``rng`` and ``position`` (generators, data position), ``data`` and
``stream_state`` (reshardable data streams), ``param_layouts`` and ``layout_spec`` (TP layout
vocabulary), ``megatron_spec`` and ``megatron`` (Megatron state dicts), ``megatron_core``
and ``megatron_core_mapping`` (Megatron-Core sharded state dicts); ``_torch_compat`` holds
the private torch APIs they need.
"""

from ._gate import StagingGate
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
    "StagingGate",
    "reshard_stream_states",
]
