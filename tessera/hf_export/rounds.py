"""The exchange rounds of :func:`tessera.hf_export.export.save_hf`: writers assemble blocks from the owners' pieces.

Every rank takes part in every round (one ``all_to_all`` over the CPU coordination group);
a writer streams each block it assembles to its shard file as :func:`file_chunks` yields it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.distributed as torch_dist

from ..engine import dist
from ..format.dtypes import itemsize
from ..format.geometry import Box
from ..format.safetensors_header import encode_header
from .schedule import ExportBlock, ExportSchedule, ExportTensor


class ExchangeRounds:
    """Runs the exchange rounds in order; every rank takes part in every round."""

    def __init__(self, world: dist.World, plan: ExportSchedule, local: dict[tuple[str, Box], torch.Tensor]) -> None:
        self.world = world
        self.plan = plan
        self.local = local
        self.done = 0
        self.peak_bytes = 0

    def next_block(self) -> tuple[ExportBlock, torch.Tensor]:
        """Run rounds up to the one delivering this rank's next block; that block, in the output dtype."""
        while self.done < len(self.plan.rounds):
            got = self._run()
            if got is not None:
                return got
        raise RuntimeError(f"rank {self.world.rank}: the export schedule has no block left for this rank")  # a bug

    def drain(self) -> None:
        """Take part in the rounds left (this rank has no more blocks to write)."""
        while self.done < len(self.plan.rounds):
            self._run()

    def _run(self) -> tuple[ExportBlock, torch.Tensor] | None:
        """One round: send this rank's parts of the writers' blocks, assemble its own block if it has one."""
        entries = self.plan.rounds[self.done]
        self.done += 1
        me, size = self.world.rank, self.world.size
        in_sizes = [0] * size
        out_sizes = [0] * size
        outgoing: list[tuple[int, torch.Tensor]] = []  # (destination, the part), in sending order
        mine: ExportBlock | None = None
        for w, i in entries:
            b = self.plan.blocks[w][i]
            if w == me:
                mine = b
            for owner, box, part in b.sources:
                if owner == w:
                    continue
                n = padded(part.numel * itemsize(b.tensor.dtype))
                if owner == me:
                    outgoing.append((w, self.local[(b.tensor.fqn, box)][part.relative_to(box).slices()]))
                    in_sizes[w] += n
                if w == me:
                    out_sizes[owner] += n
        received = torch.empty(0, dtype=torch.uint8)
        exchange_bytes = sum(in_sizes) + sum(out_sizes)
        if any(owner != w for w, i in entries for owner, _, _ in self.plan.blocks[w][i].sources):
            # Parts are copied straight into the send buffer, grouped by destination rank.
            send = torch.empty(sum(in_sizes), dtype=torch.uint8)
            pos = 0
            for dest in range(size):
                for d, data in outgoing:
                    if d == dest:
                        n = data.numel() * data.element_size()
                        send[pos : pos + n].view(data.dtype).view(data.shape).copy_(data)
                        pos += padded(n)
            received = torch.empty(sum(out_sizes), dtype=torch.uint8)
            dist.run_collective(
                self.world,
                f"exchanging round {self.done - 1} of the Hugging Face export",
                lambda: torch_dist.all_to_all_single(received, send, out_sizes, in_sizes, group=self.world.group),
            )
            del send
        self.peak_bytes = max(self.peak_bytes, exchange_bytes)
        if mine is None:
            return None
        t = mine.tensor
        buf = torch.empty(mine.box.lengths, dtype=t.dtype)
        offsets = [sum(out_sizes[:r]) for r in range(size)]  # where each sender's parts start
        for owner, box, part in mine.sources:
            dst = buf[part.relative_to(mine.box).slices()]
            if owner == me:
                dst.copy_(self.local[(t.fqn, box)][part.relative_to(box).slices()])
            else:
                n = part.numel * itemsize(t.dtype)
                dst.copy_(received[offsets[owner] : offsets[owner] + n].view(t.dtype).view(part.lengths))
                offsets[owner] += padded(n)
        out = buf if t.out_dtype == t.dtype else buf.to(t.out_dtype)
        held = (
            sum(out_sizes)
            + buf.numel() * buf.element_size()
            + (out.numel() * out.element_size() if out is not buf else 0)
        )
        self.peak_bytes = max(self.peak_bytes, held)
        return mine, out


def file_chunks(shard: tuple[ExportTensor, ...], rounds: ExchangeRounds) -> Iterator[bytes | memoryview]:
    """A shard file's bytes: its header, then each tensor block by block as the rounds deliver them."""
    from ..format.dtypes import safetensors_dtype_code

    yield encode_header([(t.name, safetensors_dtype_code(t.out_dtype, t.fqn), t.shape, t.nbytes) for t in shard])
    remaining = {t.name: math.prod(t.shape) for t in shard}
    for t in shard:
        while remaining[t.name]:
            block, data = rounds.next_block()
            if block.tensor.name != t.name:
                raise RuntimeError(f"export schedule out of order: got '{block.tensor.name}', expected '{t.name}'")
            remaining[t.name] -= block.box.numel
            yield data.contiguous().reshape(-1).view(torch.uint8).numpy().data
            del block, data  # written: free it before the next round allocates the next block


def padded(nbytes: int) -> int:
    """``nbytes`` rounded up to 8: every part in an exchange buffer starts aligned for any dtype."""
    return -(-nbytes // 8) * 8
