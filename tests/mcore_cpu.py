"""Real megatron-core on CPU (gloo) for the interop tests: the CUDA-only spots, worked around.

megatron-core 0.16 runs its models on CPU except for a few spots that hard-code CUDA. Each
workaround below replaces exactly that spot and nothing else (see docs/frameworks.md):

1. ``parallel_state._GLOBAL_MEMORY_BUFFER`` allocates on ``torch.cuda.current_device()``
   (used by ``DotProductAttention``): replaced by a buffer that allocates on the CPU.
2. The CUDA RNG tracker (``tensor_parallel.random``) forks CUDA generator states around
   attention dropout: replaced by a tracker forking the CPU generator (dropout is 0 here).
   ``model_parallel_cuda_manual_seed`` is not called (it seeds CUDA generators).
3. ``get_default_causal_mask`` builds its mask with ``device="cuda"``: the tests pass an
   explicit causal ``attention_mask``.
4. MoE: ``TopKRouter.gating`` moves its weight to ``torch.cuda.current_device()`` (run
   under :func:`cuda_calls_on_cpu`), ``moe_utils.te_general_gemm`` is undefined without
   Transformer Engine (set to None, the value it has when TE is missing), and the
   ``alltoall`` token dispatcher creates a ``torch.cuda.Stream`` (the tests use ``allgather``).
5. ``FP32Optimizer.__init__`` puts its loss scale ``torch.tensor([1.0], device="cuda")``:
   :class:`CPUFP32Optimizer` builds the same optimizer with the scale on the CPU.
   (``DistributedOptimizer`` and Megatron's DDP grad buffers are CUDA-only throughout and
   are not run here. By its source, the distributed optimizer's ``fully_reshardable``
   sharded state dict has the same per-parameter keys and boxes as ``FP32Optimizer``'s,
   which is what runs; its ``dp_reshardable`` buckets are not exercised.)
6. Megatron's ``torch_dist`` writer calls ``torch.cuda.synchronize()`` and puts two small
   coordination tensors on ``torch.cuda.current_device()``: see :func:`cuda_calls_on_cpu`.
   It also needs ``psutil``.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterator
from typing import Any

import torch

SEQ = 8
VOCAB = 48  # divisible by TP (Megatron-LM pads the vocabulary before building the model)


def init_parallel(tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None) -> None:
    """``initialize_model_parallel`` on the current gloo world, with the CPU workarounds."""
    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state as ps
    from megatron.core import utils as mu
    from megatron.core.tensor_parallel import random as mr

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )  # fmt: skip

    class CPUMemoryBuffer(mu.GlobalMemoryBuffer):
        def get_tensor(
            self, tensor_shape: Any, dtype: torch.dtype, name: str, mem_alloc_context: Any = None
        ) -> torch.Tensor:
            n = math.prod(tensor_shape)
            buf = self.buffer.get((name, dtype))
            if buf is None or buf.numel() < n:
                buf = self.buffer[(name, dtype)] = torch.empty(n, dtype=dtype)
            return buf[:n].view(*tensor_shape)

    ps._GLOBAL_MEMORY_BUFFER = CPUMemoryBuffer()

    class CPURNGTracker(mr.CudaRNGStatesTracker):
        @contextlib.contextmanager
        def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
            with torch.random.fork_rng(devices=[]):
                yield

    mr.get_cuda_rng_tracker()
    mr._CUDA_RNG_STATE_TRACKER = CPURNGTracker()

    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):  # 0.16 without Transformer Engine leaves it undefined
        moe_utils.te_general_gemm = None


def build_gpt(seed: int, *, num_layers: int = 2, moe_experts: int | None = None, swiglu: bool = True) -> Any:
    """A tiny GPTModel for the current parallel state (local layer spec, fp32, CPU init)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    # Each TP x PP x EP rank draws its own init from the seed; the checkpoint is the judge.
    torch.manual_seed(seed + 1000 * torch.distributed.get_rank())
    moe = dict(num_moe_experts=moe_experts, moe_router_topk=2, moe_token_dispatcher_type="allgather",
               moe_grouped_gemm=False, moe_ffn_hidden_size=24, moe_aux_loss_coeff=0.0) if moe_experts else {}  # fmt: skip
    cfg = TransformerConfig(
        num_layers=num_layers, hidden_size=16, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=32,
        use_cpu_initialization=True, gated_linear_unit=swiglu, add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, pipeline_dtype=torch.float32, params_dtype=torch.float32,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
        expert_tensor_parallel_size=ps.get_expert_tensor_parallel_world_size(), **moe,
    )  # fmt: skip
    spec = get_gpt_layer_local_spec(num_experts=moe_experts, moe_grouped_gemm=False)
    return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                    pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())  # fmt: skip


def build_optimizer(model: torch.nn.Module, lr: float = 1e-2) -> Any:
    """Megatron's ``FP32Optimizer`` over ``torch.optim.Adam``, loss scale on the CPU."""
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.optimizer import FP32Optimizer, MegatronOptimizer

    class CPUFP32Optimizer(FP32Optimizer):
        def __init__(self, optimizer: torch.optim.Optimizer, config: OptimizerConfig, init_state_fn: Any) -> None:
            MegatronOptimizer.__init__(self, optimizer, config, init_state_fn)
            self._scale = torch.tensor([1.0], dtype=torch.float)
            self.is_stub_optimizer = optimizer is None

    def init_state_fn(opt: torch.optim.Optimizer, config: Any = None) -> None:  # as get_megatron_optimizer's
        for group in opt.param_groups:
            for p in group["params"]:
                if len(opt.state[p]) == 0:
                    opt.state[p]["exp_avg"] = torch.zeros_like(p.data)
                    opt.state[p]["exp_avg_sq"] = torch.zeros_like(p.data)

    # Param groups keyed like get_megatron_optimizer's (experts apart). Experts are found by
    # name, not by Megatron's ``allreduce`` flag, which is set only when EP > 1: the group
    # structure (a common value in the checkpoint) must not change with the EP size.
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = []
    for expert in (False, True):
        ps_ = [p for n, p in params if (".experts." in n) == expert]
        if ps_:
            groups.append({"params": ps_, "wd_mult": 1.0, "lr_mult": 1.0, "is_expert_parallel": expert,
                           "is_decoupled_lr": False})  # fmt: skip
    adam = torch.optim.Adam(groups, lr=lr)
    return CPUFP32Optimizer(adam, OptimizerConfig(optimizer="adam", lr=lr, clip_grad=0.0), init_state_fn)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(tokens, position_ids, causal mask, labels)``, the same on every rank."""
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    pos = torch.arange(SEQ).unsqueeze(0).expand(2, SEQ)
    mask = torch.triu(torch.ones(SEQ, SEQ), diagonal=1).bool()[None, None]
    return tokens, pos, mask, torch.roll(tokens, -1, dims=1)


def train(model: torch.nn.Module, optimizer: Any, steps: int) -> None:
    """A few real training steps (PP=1: forward, backward through Megatron's TP autograd, step)."""
    with cuda_calls_on_cpu():
        for step in range(steps):
            tokens, pos, mask, labels = batch(step)
            optimizer.zero_grad()
            loss = model(tokens, pos, mask, labels=labels).float().mean()
            loss.backward()
            optimizer.step()


def local_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's plain local state dict (no ``_extra_state``), cloned."""
    return {
        k: v.detach().clone()
        for k, v in model.state_dict().items()
        if isinstance(v, torch.Tensor) and "_extra_state" not in k
    }


@contextlib.contextmanager
def cuda_calls_on_cpu() -> Iterator[None]:
    """Megatron's ``torch_dist`` save/load on CPU (workaround 6).

    ``dist_checkpointing``'s writer calls ``torch.cuda.synchronize()`` after its
    device-to-host copies and allocates two small coordination tensors on
    ``torch.cuda.current_device()``; inside this context those are a no-op and ``"cpu"``.
    """
    saved = torch.cuda.synchronize, torch.cuda.current_device
    torch.cuda.synchronize = lambda *args, **kwargs: None  # type: ignore[assignment]
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cuda.synchronize, torch.cuda.current_device = saved
