"""Lightning + tessera: train on N CPU processes, resume on M.

    python examples/lightning_resume.py --devices 2 --epochs 2 --ckpt /tmp/tessera-lightning
    python examples/lightning_resume.py --devices 3 --epochs 4 --ckpt /tmp/tessera-lightning

The second run resumes from ``<ckpt>/last.ckpt`` (a tessera checkpoint directory) on 3
processes. Lightning launches the processes itself (or run it under ``torchrun``).
``--strategy`` picks the Tessera strategy (``ddp``, ``fsdp2``: every rank saves its shards)
or ``plugin`` (Lightning's own DDPStrategy + TesseraCheckpointIO: rank 0 saves).
"""

from __future__ import annotations

import argparse
import os

import lightning.pytorch as pl
import torch
from torch import nn

from tessera.integrations.lightning import TesseraCheckpointIO, TesseraDDPStrategy, TesseraModelParallelStrategy


class Regression(pl.LightningModule):
    def __init__(self, fsdp2: bool = False) -> None:
        super().__init__()
        self.fsdp2 = fsdp2
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))

    def configure_model(self) -> None:
        if self.fsdp2:  # FSDP2 inside Lightning's ModelParallelStrategy
            from torch.distributed.fsdp import fully_shard

            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--ckpt", default="/tmp/tessera-lightning")
    p.add_argument("--strategy", choices=["ddp", "fsdp2", "plugin"], default="ddp")
    p.add_argument("--async-save", action="store_true", help="write checkpoints in the background")
    args = p.parse_args()

    strategy = {"ddp": TesseraDDPStrategy, "fsdp2": TesseraModelParallelStrategy, "plugin": pl.strategies.DDPStrategy}
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 16, generator=g)
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy[args.strategy](),
        plugins=[TesseraCheckpointIO(async_save=args.async_save)],
        max_epochs=args.epochs,
        callbacks=[pl.callbacks.ModelCheckpoint(dirpath=args.ckpt, save_last=True)],
        logger=False,
        enable_progress_bar=False,
    )
    last = os.path.join(args.ckpt, "last.ckpt")
    resume = last if os.path.exists(os.path.join(last, "manifest.json")) else None
    trainer.fit(
        Regression(fsdp2=args.strategy == "fsdp2"), torch.utils.data.DataLoader(data, batch_size=8), ckpt_path=resume
    )
    if trainer.is_global_zero:
        print(
            f"{'resumed from ' + resume if resume else 'started fresh'}; now at epoch {trainer.current_epoch}, "
            f"step {trainer.global_step}, on {args.devices} processes; last checkpoint: {last}"
        )


if __name__ == "__main__":
    main()
