"""Integrations of tessera with training frameworks.

Each submodule imports its framework, so import the one you use:

- :mod:`tessera.integrations.lightning`: ``TesseraCheckpointIO`` (a Lightning ``CheckpointIO``
  plugin) and strategies whose saves are collective and sharded (DDP, FSDP, ModelParallel).
- :mod:`tessera.integrations.accelerate`: ``save_state`` / ``load_state`` for an
  ``accelerate.Accelerator`` (model, optimizer, scheduler, RNG), any process count.
- :mod:`tessera.integrations.torchtitan`: a checkpointer for torchtitan's training loop.

Nothing is imported here, so ``import tessera.integrations`` needs none of the frameworks.
"""

__all__: list[str] = []
