"""Lossless codecs on real trained state: ratio and single-core MB/s, per tensor role.

Trains a small transformer (``--layers`` x ``--dim``, a bf16 copy of the weights beside the
fp32 master) with AdamW for ``--steps`` steps, keeps the state ``--delta-gap`` steps before the
end, then compresses every role (fp32 weights, ``exp_avg``, ``exp_avg_sq``, bf16 weights) in
``--chunk`` byte chunks, each alone (what a resharded read decodes), with each candidate:

- ``zstd-N``: plain zstandard at level N (what DCP's ``ZStandard`` extension does, per item);
- ``planes+zstd-N``: the chunk's bytes split into byte planes (numpy: view as ``(n, itemsize)``,
  transpose), then zstd; the codec tessera uses (``tessera/format/codec.py``) when it is importable;
- ``blosc2-shuffle-zstd-N``, ``blosc2-bytedelta-zstd-N``, ``blosc2-shuffle-lz4``: blosc2's own
  filters (``nthreads=1``);
- ``delta+planes+zstd-1``: the integer difference of the bit patterns against the same tensor
  ``--delta-gap`` steps earlier, then planes + zstd-1 (what delta tiles would store).

Ratio is logical bytes / stored bytes (a chunk that does not shrink is counted raw). MB/s are
logical bytes per second of one thread (best of ``--repeat``). Prints a table and one JSON line.

With ``--save DIR``, also whole checkpoints of the trained state (fp32 weights, ``exp_avg``,
``exp_avg_sq``, bf16 weights; one process) in ``DIR``: bytes on disk, save seconds (to
``os.sync()``), load seconds from the page cache (after tessera's re-cache has read its files
back) and cold (every file evicted with ``posix_fadvise(DONTNEED)``), medians of ``--repeat``,
for tessera uncompressed, tessera ``compress=True`` (its default chunk size: ``--chunk`` sizes
only the codec table) and DCP with ``_extensions=[ZStandard()]``; then a resharded read of the compressed checkpoint:
each of 3 row ranges of every 2-D tensor loaded alone (what each rank of 3 reads), and the bytes
it decoded (``LoadResult.decoded_bytes``) against the bytes it needed.

    python bench/bench_compress.py                     # 4 layers x 256, 200 steps (~1 min on 1 core)
    python bench/bench_compress.py --steps 300 --dim 384 --layers 6
    python bench/bench_compress.py --save /tmp/bench-compress
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
import zstandard
from bench_dcp import evict

try:
    import blosc2
except ImportError:  # pragma: no cover - optional candidate
    blosc2 = None


def train(layers: int, dim: int, steps: int, gap: int, seed: int) -> tuple[dict, dict]:
    """The roles' tensors after ``steps`` steps and ``gap`` steps before (name -> tensor)."""
    torch.manual_seed(seed)
    vocab, seq, batch = 2048, 64, 8
    layer = torch.nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.0, batch_first=True)
    model = torch.nn.Sequential(
        torch.nn.Embedding(vocab, dim), torch.nn.TransformerEncoder(layer, layers), torch.nn.Linear(dim, vocab)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    # A learnable signal: a fixed random bigram table, so the loss falls and the state is trained.
    table = torch.randint(0, vocab, (vocab,))
    snaps = {}
    for step in range(1, steps + 1):
        x = torch.randint(0, vocab, (batch, seq))
        loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, vocab), table[x].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step in (steps - gap, steps):
            snaps[step] = roles(model, opt)
    print(
        f"trained {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M params, {steps} steps, loss {loss.item():.3f}"
    )
    return snaps[steps - gap], snaps[steps]


def roles(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, np.ndarray]:
    def cat(ts: list[torch.Tensor]) -> np.ndarray:
        return torch.cat([t.detach().reshape(-1) for t in ts]).clone().numpy()

    params = [p for p in model.parameters()]
    bf16 = torch.cat([p.detach().reshape(-1) for p in params]).to(torch.bfloat16).view(torch.int16).numpy().copy()
    return {
        "fp32 weights": cat(params),
        "exp_avg": cat([opt.state[p]["exp_avg"] for p in params]),
        "exp_avg_sq": cat([opt.state[p]["exp_avg_sq"] for p in params]),
        "bf16 weights": bf16,
    }


def planes(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a.view(np.uint8).reshape(-1, a.itemsize).T).tobytes()


def unplanes(b: bytes, itemsize: int) -> np.ndarray:
    return np.frombuffer(b, np.uint8).reshape(itemsize, -1).T.copy()


def candidates() -> dict[str, tuple[Callable, Callable]]:
    """name -> (compress(chunk array) -> bytes, decompress(bytes, chunk array) -> None)."""
    out: dict[str, tuple[Callable, Callable]] = {}
    for lvl in (1, 3):
        c, d = zstandard.ZstdCompressor(level=lvl), zstandard.ZstdDecompressor()
        out[f"zstd-{lvl}"] = (lambda a, c=c: c.compress(a.tobytes()), lambda b, a, d=d: d.decompress(b))
        out[f"planes+zstd-{lvl}"] = (
            lambda a, c=c: c.compress(planes(a)),
            lambda b, a, d=d: unplanes(d.decompress(b), a.itemsize),
        )
    try:
        from tessera.format import codec

        def enc(a: np.ndarray) -> bytes:
            frame = codec.encode_chunk(memoryview(a.view(np.uint8)), a.itemsize)
            return a.tobytes() if frame is None else frame  # stored raw

        def dec(b: bytes, a: np.ndarray) -> None:
            out = bytearray(a.nbytes)
            if len(b) == a.nbytes:
                out[:] = b
            else:
                codec.decode_chunk(b, memoryview(out))

        out["tessera codec"] = (enc, dec)
    except ImportError:
        pass
    if blosc2 is not None:
        for name, flt, cod, lvl in (
            ("blosc2-shuffle-zstd-1", blosc2.Filter.SHUFFLE, blosc2.Codec.ZSTD, 1),
            ("blosc2-shuffle-zstd-3", blosc2.Filter.SHUFFLE, blosc2.Codec.ZSTD, 3),
            ("blosc2-bytedelta-zstd-1", blosc2.Filter.BYTEDELTA, blosc2.Codec.ZSTD, 1),
            ("blosc2-shuffle-lz4", blosc2.Filter.SHUFFLE, blosc2.Codec.LZ4, 5),
        ):
            filters = [blosc2.Filter.SHUFFLE, flt] if flt == blosc2.Filter.BYTEDELTA else [flt]
            cp = {"codec": cod, "clevel": lvl, "filters": filters, "nthreads": 1}
            out[name] = (
                lambda a, cp=cp: blosc2.compress2(a, typesize=a.itemsize, **cp),
                lambda b, a: blosc2.decompress2(b, nthreads=1),
            )
    return out


def measure(arr: np.ndarray, comp: Callable, decomp: Callable, chunk: int, repeat: int) -> tuple[float, float, float]:
    per = max(1, chunk // arr.itemsize)
    chunks = [arr[i : i + per] for i in range(0, arr.size, per)]
    stored, best_c, best_d = 0, float("inf"), float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        frames = [comp(c) for c in chunks]
        best_c = min(best_c, time.perf_counter() - t0)
        t0 = time.perf_counter()
        for f, c in zip(frames, chunks):
            decomp(f, c)
        best_d = min(best_d, time.perf_counter() - t0)
        stored = sum(min(len(f), c.nbytes) for f, c in zip(frames, chunks))
    return arr.nbytes / stored, arr.nbytes / best_c / 1e6, arr.nbytes / best_d / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--delta-gap", type=int, default=10)
    ap.add_argument("--chunk", type=int, default=4 << 20, help="bytes per independently decodable chunk")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save", metavar="DIR", help="also save whole checkpoints in DIR (removed after)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    before, after = train(args.layers, args.dim, args.steps, args.delta_gap, args.seed)
    cands = candidates()
    zc = zstandard.ZstdCompressor(level=1)
    zd = zstandard.ZstdDecompressor()
    results: dict[str, dict[str, list[float]]] = {}
    for role, arr in after.items():
        for name, (comp, decomp) in cands.items():
            results.setdefault(name, {})[role] = [
                round(x, 3) for x in measure(arr, comp, decomp, args.chunk, args.repeat)
            ]
        old = before[role]
        u = np.uint32 if arr.itemsize == 4 else np.uint16
        diff = (arr.view(u) - old.view(u)).view(arr.dtype)  # wraps: exact, invertible
        results.setdefault("delta+planes+zstd-1", {})[role] = [
            round(x, 3)
            for x in measure(
                diff,
                lambda a: zc.compress(planes(a)),
                lambda b, a: unplanes(zd.decompress(b), a.itemsize),
                args.chunk,
                args.repeat,
            )
        ]
    full = ("fp32 weights", "exp_avg", "exp_avg_sq")
    nbytes = {r: after[r].nbytes for r in after}
    print(f"\nratio / compress MB/s / decompress MB/s per core; chunks of {args.chunk >> 10} KiB")
    print(f"{'candidate':26s}" + "".join(f"{r:>24s}" for r in after) + f"{'fp32 state':>12s}{'whole state':>24s}")
    roles = list(after)
    for name, by_role in results.items():
        state = sum(nbytes[r] for r in full) / sum(nbytes[r] / by_role[r][0] for r in full)
        # The whole state (every role) coded by one core: logical bytes over the summed seconds.
        total = sum(nbytes[r] for r in roles)
        whole = [total / sum(nbytes[r] / by_role[r][k] for r in roles) for k in (0, 1, 2)]
        cells = "".join(f"{by_role[r][0]:>8.3f}{by_role[r][1]:>8.0f}{by_role[r][2]:>8.0f}" for r in after)
        print(f"{name:26s}{cells}{state:>12.3f}{whole[0]:>8.3f}{whole[1]:>8.0f}{whole[2]:>8.0f}")
        by_role["fp32 state"] = [round(state, 3)]
        by_role["whole state"] = [round(x, 3) for x in whole]
    saves = save_checkpoints(after, args.save, args.repeat, before) if args.save else None
    print(json.dumps({"args": vars(args), "results": results, "saves": saves}))


def _du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _state(state_np: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    state = {k.replace(" ", "_"): torch.from_numpy(v.copy()) for k, v in state_np.items()}
    state["bf16_weights"] = state["bf16_weights"].view(torch.bfloat16)
    return state


def save_checkpoints(state_np: dict[str, np.ndarray], root: str, repeat: int, before_np: dict) -> dict:
    """Bytes on disk and save/load seconds per format, and the resharded read's decoded bytes."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._extension import ZStandard

    import tessera
    from tessera.storage import recache

    state = _state(state_np)
    logical = sum(v.numel() * v.element_size() for v in state.values())
    no_timings = tessera.LoadOptions(record_timings=False)
    arms = {
        "tessera": lambda p: tessera.save(p, state, options=tessera.SaveOptions(compress=False)),
        "tessera compress": lambda p: tessera.save(p, state, options=tessera.SaveOptions(compress=True)),
        "dcp+zstd": lambda p: dcp.save(state, storage_writer=dcp.FileSystemWriter(p, _extensions=[ZStandard()])),
    }
    loads = {
        "tessera": lambda p, t: tessera.load(p, t, options=no_timings),
        "tessera compress": lambda p, t: tessera.load(p, t, options=no_timings),
        "dcp+zstd": lambda p, t: dcp.load(t, storage_reader=dcp.FileSystemReader(p)),
    }
    out: dict = {"logical_bytes": logical}
    print(f"\nwhole checkpoints of {logical / 1e6:.1f} MB (one process, {root}; medians of {repeat})")
    print(f"{'format':18s}{'bytes':>14s}{'ratio':>8s}{'save s':>9s}{'load s':>9s}{'cold s':>9s}")
    for name, save in arms.items():
        path = os.path.join(root, name.replace(" ", "-"))
        saves, warm, cold = [], [], []
        for _ in range(repeat):
            shutil.rmtree(path, ignore_errors=True)
            os.sync()
            t0 = time.perf_counter()
            save(path)
            os.sync()
            saves.append(time.perf_counter() - t0)
            recache.drain(60)  # tessera's files read back into the page cache (its default) before the loads
            for times in (warm, cold):
                if times is cold:
                    evict(path)  # from the disk: posix_fadvise(DONTNEED) on every file
                target = {k: torch.zeros_like(v) for k, v in state.items()}
                t0 = time.perf_counter()
                loads[name](path, target)
                times.append(time.perf_counter() - t0)
                assert all(torch.equal(target[k].view(torch.uint8), state[k].view(torch.uint8)) for k in state), name
        nbytes = _du(path)
        s_, w_, c_ = (statistics.median(x) for x in (saves, warm, cold))
        out[name] = {
            "bytes": nbytes,
            "ratio": round(logical / nbytes, 3),
            "save_s": s_,
            "load_s": w_,
            "cold_load_s": c_,
        }
        print(f"{name:18s}{nbytes:>14,d}{logical / nbytes:>8.3f}{s_:>9.3f}{w_:>9.3f}{c_:>9.3f}")
    path = os.path.join(root, "tessera-compress")
    decoded = needed = plain_read = 0
    for rank in range(3):  # rank r of 3 loads rows [r*n/3, (r+1)*n/3) of the one 1-D-split state
        target = {}
        for k, v in state.items():
            n = v.shape[0]
            a, b = rank * n // 3, (rank + 1) * n // 3
            target[k] = tessera.ShardedTensor(torch.zeros_like(v[a:b]), tuple(v.shape), (a,))
            needed += (b - a) * v.element_size()
        decoded += tessera.load(path, target, options=no_timings).decoded_bytes
        # the same read of the uncompressed checkpoint reads (and verifies) whole chunks too
        plain_read += tessera.load(os.path.join(root, "tessera"), target, options=no_timings).bytes_read
    out["reshard"] = {"decoded": decoded, "needed": needed, "plain_read": plain_read}
    print(
        f"resharded read (3 row ranges per tensor): decoded {decoded:,d} bytes for {needed:,d} needed "
        f"({decoded / needed:.3f}x); uncompressed, the same read reads {plain_read:,d} ({plain_read / needed:.3f}x)"
    )
    # delta tiles: a manager root with dedup and compression saves the state 10 steps earlier, then this one
    delta_root = os.path.join(root, "delta")
    with tessera.CheckpointManager(delta_root, dedup=True, compress=True, load_options=no_timings) as mgr:
        mgr.save(1, _state(before_np))
        t0 = time.perf_counter()
        second = mgr.save(2, state).bytes_written
        delta_s = time.perf_counter() - t0
    per = {}
    m = tessera.read_manifest(os.path.join(delta_root, "step-00000002"))
    frames = {f.path: f.frames for f in m.files}
    for name, e in m.tensors.items():
        stored = sum(frames[t.file].stored_bytes(t.byte_offset, t.byte_offset + t.nbytes) for t in e.tiles)  # type: ignore[union-attr]
        per[name] = round(sum(t.nbytes for t in e.tiles) / stored, 3)
    out["delta"] = {"bytes": second, "ratio": round(logical / second, 3), "save_s": delta_s, "per_tensor": per}
    assert m.version == 3
    print(
        f"{'compress + delta':18s}{second:>14,d}{logical / second:>8.3f}{delta_s:>9.3f}   (10 steps after the last save)"
    )
    print("  per tensor: " + ", ".join(f"{k} {v:.3f}x" for k, v in per.items()))
    shutil.rmtree(root, ignore_errors=True)
    return out


if __name__ == "__main__":
    main()
