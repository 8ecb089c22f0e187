"""Scale simulation, in one process: a 70B-shaped model saved by N ranks and loaded by M.

Simulates, without any tensor data, what planning and the manifest cost at 10^4+ ranks:

- ``plan``: first-save planning as a rank of this DTensor job does it, alone
  (:func:`first_save_plan`: ``derive_rank_plan`` from its own boxes; the ranks only vote on a
  digest of the tensor table); ``--gathered`` adds ``gathered``, the fallback for layouts that
  cannot be derived (flat shards, pipeline stages): rank 0's ``build_global_plan`` over every
  rank's simulated local plan;
- ``encode``: the manifest such a save commits, built as a real save builds it (one
  ``TileTable`` of numpy columns per tensor, one random checksum per tile, real byte offsets
  and file sizes, one file ``data/<save id>/<rank>-0.safetensors`` per rank), to bytes;
- ``decode``: those bytes back to a manifest, every tensor decoded and validated, then one
  rank's resharded load plan (``plan_reads`` for its boxes under ``--target-ranks``);
- ``partial``: a rank that needs 10 tensors decodes lazily and reads only those, then the
  same load plan from the lazily decoded manifest (which decodes what the rank touches).

The model has Llama-2-70B's shapes (hidden 8192, intermediate 28672, 8 kv heads of 128,
vocab 32000: q/k/v/o/gate/up/down and two RMSNorm vectors per layer, embedding, final norm,
lm_head) with as many layers as ``--tensors`` needs. Layouts (``--layout``):

- ``fsdp``: every tensor Shard(0) over all ranks, torch's chunking (uneven: later ranks get
  fewer rows or none; the 1-D norms too);
- ``fsdp-tp``: a 2-D mesh (ranks/8 data-parallel x 8 tensor-parallel, tp innermost): TP
  Shard(0) for q/k/v/gate/up, embedding and lm_head, Shard(1) for o/down, norms replicated
  over TP; FSDP Shard(0) over the dp dimension on top, of each rank's TP-local block (what
  FSDP2 does over TP). Replicas are stored once (the saver dedups them), so a tensor has as
  many tiles as distinct non-empty boxes.

Each step runs in a fresh subprocess: ``*_peak_rss_mb`` is that process's ``ru_maxrss``
(inputs it had to build included: the simulated local plans for ``gathered``, the manifest
object for ``encode``, the bytes for ``decode``), and ``*_base_rss_mb`` its RSS just before
the timed call. Times are ``time.perf_counter`` on one thread.

    python bench/plan_scale.py --ranks 16384 --tensors 1000

The last line printed is one JSON object with every measurement.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np

TP = 8
"""Tensor-parallel size of the ``fsdp-tp`` layout."""
DTYPE = "bfloat16"
ITEMSIZE = 2
CHUNK_BYTES = 4 << 20
"""Checksum chunk of the simulated save (tessera's default): one checksum per tile at this scale."""
SAVE_ID = "5eed0123456789ab"
PARTIAL_TENSORS = 10
SAMPLED_RANKS = 8
STEPS = ("plan", "gathered", "encode", "decode", "partial", "sections", "commit")


@dataclass(frozen=True)
class Param:
    """A global tensor of the model and how tensor parallelism splits it."""

    fqn: str
    shape: tuple[int, ...]
    tp: str
    """``col`` (TP Shard(0)), ``row`` (TP Shard(1)) or ``rep`` (replicated over TP)."""


def llama_params(tensors: int) -> list[Param]:
    """A Llama-2-70B-shaped model with exactly ``tensors`` tensors (layers added until there are enough)."""
    hidden, inter, kv, vocab = 8192, 28672, 1024, 32000
    layer = [
        ("self_attn.q_proj.weight", (hidden, hidden), "col"),
        ("self_attn.k_proj.weight", (kv, hidden), "col"),
        ("self_attn.v_proj.weight", (kv, hidden), "col"),
        ("self_attn.o_proj.weight", (hidden, hidden), "row"),
        ("mlp.gate_proj.weight", (inter, hidden), "col"),
        ("mlp.up_proj.weight", (inter, hidden), "col"),
        ("mlp.down_proj.weight", (hidden, inter), "row"),
        ("input_layernorm.weight", (hidden,), "rep"),
        ("post_attention_layernorm.weight", (hidden,), "rep"),
    ]
    head = [Param("model.embed_tokens.weight", (vocab, hidden), "col")]
    tail = [Param("model.norm.weight", (hidden,), "rep"), Param("lm_head.weight", (vocab, hidden), "col")]
    body: list[Param] = []
    i = 0
    while len(body) < tensors - len(head) - len(tail):
        body += [Param(f"model.layers.{i}.{name}", shape, tp) for name, shape, tp in layer]
        i += 1
    return (head + body[: max(0, tensors - 3)] + tail)[:tensors]


def _chunk(n: np.ndarray | int, parts: int, i: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Start and length of part ``i`` of ``n`` split in ``parts`` (torch.chunk / DTensor Shard: uneven, maybe empty)."""
    c = -(-np.asarray(n) // parts)
    start = np.minimum(i * c, n)
    return start, np.minimum(start + c, n) - start


def rank_boxes(p: Param, ranks: int, layout: str) -> tuple[np.ndarray, np.ndarray]:
    """Offsets and lengths ``(ranks, ndim)`` of every rank's box of ``p`` (empty boxes included)."""
    r = np.arange(ranks, dtype=np.int64)
    nd = len(p.shape)
    offs = np.zeros((ranks, nd), dtype=np.int64)
    lens = np.tile(np.asarray(p.shape, dtype=np.int64), (ranks, 1))
    if layout == "fsdp":
        offs[:, 0], lens[:, 0] = _chunk(p.shape[0], ranks, r)
        return offs, lens
    dp, di, tj = ranks // TP, r // TP, r % TP
    if p.tp == "col":  # FSDP's Shard(0) of the TP-local row block
        block, block_len = _chunk(p.shape[0], TP, tj)
        start, lens[:, 0] = _chunk(block_len, dp, di)
        offs[:, 0] = block + start
    elif p.tp == "row":  # TP columns x FSDP rows
        offs[:, 1], lens[:, 1] = _chunk(p.shape[1], TP, tj)
        offs[:, 0], lens[:, 0] = _chunk(p.shape[0], dp, di)
    else:  # replicated over TP: every tp rank of a dp group holds the same box
        offs[:, 0], lens[:, 0] = _chunk(p.shape[0], dp, di)
    return offs, lens


def stored_tiles(p: Param, ranks: int, layout: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The distinct non-empty boxes of ``p`` sorted by offsets (as a save stores them) and a writer for each.

    Replicas are written once, by their holders in turn (the saver balances them by bytes).
    """
    offs, lens = rank_boxes(p, ranks, layout)
    keep = lens.prod(axis=1) > 0
    rank = np.flatnonzero(keep)
    offs, lens = offs[keep], lens[keep]
    order = np.lexsort((rank, *lens.T[::-1], *offs.T[::-1]))
    offs, lens, rank = offs[order], lens[order], rank[order]
    first = np.ones(len(rank), dtype=bool)
    first[1:] = (offs[1:] != offs[:-1]).any(axis=1) | (lens[1:] != lens[:-1]).any(axis=1)
    starts = np.flatnonzero(first)
    sizes = np.diff(np.append(starts, len(rank)))
    writer = rank[starts + np.arange(len(starts)) % sizes]
    return offs[starts], lens[starts], writer


# --------------------------------------------------------------------------------------
# First-save planning


def local_plans(params: list[Param], ranks: int, layout: str) -> list:
    """Every rank's :class:`LocalPlan` (what it holds), built arithmetically (not timed)."""
    from tessera.engine.saving.plan import LocalPlan, TensorMeta

    metas = tuple(TensorMeta(p.fqn, DTYPE, p.shape) for p in params)
    nd = max(len(p.shape) for p in params)
    boxes = np.zeros((ranks, len(params), 1 + 2 * nd), dtype=np.int64)
    boxes[:, :, 1 + nd :] = 1  # lower-rank tensors are padded with offset 0, length 1
    for t, p in enumerate(params):
        offs, lens = rank_boxes(p, ranks, layout)
        k = len(p.shape)
        boxes[:, t, 0] = t
        boxes[:, t, 1 : 1 + k] = offs
        boxes[:, t, 1 + nd : 1 + nd + k] = lens
    digest = hashlib.blake2b(repr(metas).encode(), digest_size=16).hexdigest()
    flats = np.zeros((0, 3), dtype=np.int64)
    return [LocalPlan(r, metas, boxes[r], flats, f"fp{r}", digest) for r in range(ranks)]


def rank_local_plan(params: list[Param], ranks: int, layout: str, rank: int):
    """One rank's :class:`LocalPlan`, with its place among the holders of each box (what
    ``build_local_plan`` records from DTensor placements: replicated over TP for ``rep``)."""
    from tessera.engine.saving.plan import LocalPlan, TensorMeta

    metas = tuple(TensorMeta(p.fqn, DTYPE, p.shape) for p in params)
    nd = max(len(p.shape) for p in params)
    boxes = np.zeros((len(params), 1 + 2 * nd), dtype=np.int64)
    boxes[:, 1 + nd :] = 1
    replicas = np.zeros((len(params), 2), dtype=np.int64)
    replicas[:, 1] = 1
    for t, p in enumerate(params):
        offs, lens = rank_boxes(p, ranks, layout)  # (vectorised over ranks; this rank's row is used)
        k = len(p.shape)
        boxes[t, 0] = t
        boxes[t, 1 : 1 + k] = offs[rank]
        boxes[t, 1 + nd : 1 + nd + k] = lens[rank]
        if layout == "fsdp-tp" and p.tp == "rep":
            replicas[t] = (rank % TP, TP)
    digest = hashlib.blake2b(repr(metas).encode(), digest_size=16).hexdigest()
    flats = np.zeros((0, 3), dtype=np.int64)
    return LocalPlan(rank, metas, boxes, flats, f"fp{rank}", digest, replicas)


def first_save_plan(params: list[Param], ranks: int, layout: str) -> dict:
    """First-save planning as each rank of a DTensor job does it: alone (no plan is exchanged).

    Every rank derives its share of the plan from its own boxes and its place among their
    holders (``derive_rank_plan``) and the ranks agree by voting on a digest of the tensor table
    (one all-reduce of a few bytes, not simulated). Timed: deriving the plan, for a few ranks
    (the first, a middle one, the last); ``plan_s`` is the slowest.

    Returns:
        ``plan_s`` (seconds, the slowest sampled rank), ``plan_tiles`` (boxes written in all,
        from the stored geometry) and ``plan_base_rss_mb`` (RSS before the timed part).
    """
    from tessera.engine.saving.plan import derive_rank_plan

    base = _rss_mb()
    slowest = 0.0
    for rank in (0, ranks // 2 + 1, ranks - 1):
        local = rank_local_plan(params, ranks, layout, rank)
        t0 = time.perf_counter()
        derive_rank_plan(local, ranks)
        slowest = max(slowest, time.perf_counter() - t0)
    tiles = sum(len(stored_tiles(p, ranks, layout)[0]) for p in params)
    return {"plan_s": slowest, "plan_tiles": int(tiles), "plan_base_rss_mb": base}


def gathered_plan(params: list[Param], ranks: int, layout: str) -> dict:
    """The fallback for layouts that cannot be derived: every rank's local plan (simulated, not
    timed) merged by the coordinator's ``build_global_plan`` (timed), as a first save of flat
    shards or pipeline stages does."""
    from tessera.engine.saving.plan import build_global_plan

    plans = local_plans(params, ranks, layout)
    base = _rss_mb()
    t0 = time.perf_counter()
    plan = build_global_plan(plans)
    plan_s = time.perf_counter() - t0
    return {
        "gathered_plan_s": plan_s,
        "gathered_plan_tiles": int(sum(len(rp.rows) for rp in plan.rank_plans)),
        "gathered_plan_base_rss_mb": base,
    }


# --------------------------------------------------------------------------------------
# The manifest


def build_manifest(params: list[Param], ranks: int, layout: str, seed: int = 0):
    """The manifest a save of ``params`` by ``ranks`` ranks commits: numpy columns only, no per-tile objects."""
    from tessera.format.manifest import FileEntry, Manifest, TensorEntry, TileTable

    rng = np.random.default_rng(seed)
    geometry = [stored_tiles(p, ranks, layout) for p in params]
    per_rank = np.zeros(ranks, dtype=np.int64)
    for _, _, writer in geometry:
        per_rank += np.bincount(writer, minlength=ranks)
    # A safetensors header: about 120 bytes of JSON per tile, padded to 64 bytes.
    pos = (8 + 64 + 120 * per_rank + 63) // 64 * 64
    paths = tuple(f"data/{SAVE_ID}/{r}-0.safetensors" for r in range(ranks))
    tensors = {}
    for p, (offs, lens, writer) in zip(params, geometry):
        nbytes = lens.prod(axis=1) * ITEMSIZE
        byte_offset = pos[writer]  # files hold their tiles in tensor order
        pos[writer] += nbytes  # writers are distinct within a tensor
        chunks = -(-nbytes // CHUNK_BYTES)
        sums = rng.integers(0, 1 << 64, int(chunks.sum()), dtype=np.uint64, endpoint=False)
        table = TileTable(paths, writer, offs, lens, byte_offset, nbytes, chunks, sums)
        tensors[p.fqn] = TensorEntry(DTYPE, p.shape, table=table)
    files = tuple(FileEntry(path, r, int(pos[r])) for r, path in enumerate(paths))
    return Manifest(SAVE_ID, ranks, CHUNK_BYTES, tensors, files=files, layout={"world_size": ranks, "mesh": layout})


def load_targets(params: list[Param], ranks: int, layout: str, rank: int) -> list:
    """``rank``'s read targets when ``ranks`` ranks load under ``layout`` (torch.empty of its boxes)."""
    import torch

    from tessera.engine.loading.plan import ReadTarget
    from tessera.format.geometry import Box

    targets = []
    for p in params:
        offs, lens = rank_boxes(p, ranks, layout)
        box = Box(tuple(offs[rank].tolist()), tuple(lens[rank].tolist()))
        if not box.is_empty():
            targets.append(ReadTarget(p.fqn, box, torch.empty(box.lengths, dtype=torch.bfloat16)))
    return targets


def _decode(data: bytes, lazy: bool):
    from tessera.format.manifest import decode

    if lazy:
        try:
            return decode(data, lazy=True)
        except TypeError:  # a tessera without lazy decoding: the eager decode is what it does
            return decode(data)
    return decode(data)


# --------------------------------------------------------------------------------------
# Steps (each in its own process)


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def step_plan(args: argparse.Namespace) -> dict:
    params = llama_params(args.tensors)
    times = []
    for _ in range(args.repeat):
        out = first_save_plan(params, args.ranks, args.layout)
        times.append(out["plan_s"])
    out["plan_s"] = sorted(times)[len(times) // 2]
    return {**out, "plan_peak_rss_mb": _peak_mb()}


def step_gathered(args: argparse.Namespace) -> dict:
    out = gathered_plan(llama_params(args.tensors), args.ranks, args.layout)
    return {**out, "gathered_plan_peak_rss_mb": _peak_mb()}


def step_encode(args: argparse.Namespace) -> dict:
    from tessera.format.manifest import encode

    params = llama_params(args.tensors)
    t0 = time.perf_counter()
    m = build_manifest(params, args.ranks, args.layout)
    build_s = time.perf_counter() - t0
    tiles = sum(e.num_tiles for e in m.tensors.values())
    base = _rss_mb()
    t0 = time.perf_counter()
    data = encode(m)
    encode_s = time.perf_counter() - t0
    peak = _peak_mb()
    with open(os.path.join(args.workdir, "manifest.json"), "wb") as f:
        f.write(data)
    return {
        "tiles": tiles,
        "files": len(m.files),
        "manifest_mb": len(data) / 1e6,
        "build_manifest_s": build_s,
        "encode_s": encode_s,
        "encode_base_rss_mb": base,
        "encode_peak_rss_mb": peak,
    }


def _plan_load(m, params: list[Param], args: argparse.Namespace) -> tuple[float, int, int]:
    from tessera.engine.loading.plan import plan_reads

    targets = load_targets(params, args.target_ranks, args.layout, args.load_rank)
    t0 = time.perf_counter()
    reqs = plan_reads(m, targets, rank=args.load_rank)
    return time.perf_counter() - t0, len(targets), len(reqs)


def step_decode(args: argparse.Namespace) -> dict:
    params = llama_params(args.tensors)
    with open(os.path.join(args.workdir, "manifest.json"), "rb") as f:
        data = f.read()
    base = _rss_mb()
    t0 = time.perf_counter()
    m = _decode(data, lazy=False)
    decode_s = time.perf_counter() - t0
    decode_peak = _peak_mb()
    load_plan_s, targets, reads = _plan_load(m, params, args)
    return {
        "decode_s": decode_s,
        "decode_base_rss_mb": base,
        "decode_peak_rss_mb": decode_peak,
        "load_plan_s": load_plan_s,
        "load_plan_targets": targets,
        "load_plan_reads": reads,
        "load_plan_peak_rss_mb": _peak_mb(),
    }


def step_partial(args: argparse.Namespace) -> dict:
    params = llama_params(args.tensors)
    with open(os.path.join(args.workdir, "manifest.json"), "rb") as f:
        data = f.read()
    base = _rss_mb()
    wanted = [p.fqn for p in params[:: max(1, len(params) // PARTIAL_TENSORS)][:PARTIAL_TENSORS]]
    t0 = time.perf_counter()
    m = _decode(data, lazy=True)
    tiles = sum(len(m.tensors[name].table) for name in wanted)
    partial_s = time.perf_counter() - t0
    partial_peak = _peak_mb()
    del m
    t0 = time.perf_counter()  # afresh: the load plan decodes what it touches
    m = _decode(data, lazy=True)
    head_s = time.perf_counter() - t0
    load_plan_s, _, _ = _plan_load(m, params, args)
    return {
        "partial_decode_s": partial_s,
        "partial_decode_tiles": tiles,
        "partial_base_rss_mb": base,
        "partial_peak_rss_mb": partial_peak,
        "load_plan_from_bytes_s": head_s + load_plan_s,
    }


def step_sections(args: argparse.Namespace) -> dict:
    from sectioned_scale import step_sections as step

    return step(args)


def step_commit(args: argparse.Namespace) -> dict:
    from sectioned_scale import step_commit as step

    return step(args)


def _run_step(step: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--step", step, "--workdir", args.workdir]
    for flag in ("ranks", "tensors", "layout", "target_ranks", "load_rank", "repeat"):
        cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=False)
    if proc.returncode:
        raise SystemExit(f"step {step} failed with exit status {proc.returncode}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"  {step}: {time.monotonic() - t0:.1f} s wall", file=sys.stderr)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=4096, help="ranks of the saving job")
    ap.add_argument("--tensors", type=int, default=1000, help="tensors of the model (at least 3)")
    ap.add_argument("--layout", choices=("fsdp", "fsdp-tp"), default="fsdp")
    ap.add_argument("--target-ranks", type=int, default=None, help="ranks of the loading job (default: 3/4 of --ranks)")
    ap.add_argument("--load-rank", type=int, default=None, help="the loading rank whose plan is timed")
    ap.add_argument("--repeat", type=int, default=1, help="planning runs (the median is reported)")
    ap.add_argument("--skip", action="append", default=[], choices=STEPS, help="leave a step out (repeatable)")
    ap.add_argument(
        "--gathered",
        action="store_true",
        help="also time the gathered plan of layouts that cannot be derived (GBs, minutes)",
    )
    ap.add_argument("--step", choices=STEPS, help=argparse.SUPPRESS)
    ap.add_argument("--workdir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.tensors < 3:
        ap.error("--tensors must be at least 3")
    if args.target_ranks is None:
        args.target_ranks = max(1, args.ranks * 3 // 4)
    if args.load_rank is None:
        args.load_rank = min(1001, args.target_ranks // 3)
    for n in (args.ranks, args.target_ranks):
        if args.layout == "fsdp-tp" and n % TP:
            ap.error(f"--layout fsdp-tp needs rank counts divisible by {TP}, got {n}")
    if args.step:
        # Imported here so that no timing includes importing tessera (and torch).
        import tessera.engine.loading.plan
        import tessera.engine.saving.plan  # noqa: F401

        out = globals()[f"step_{args.step}"](args)
        print(json.dumps(out))
        return

    args.workdir = tempfile.mkdtemp(prefix="tessera-plan-scale-")
    results: dict = {
        "ranks": args.ranks,
        "tensors": args.tensors,
        "layout": args.layout,
        "target_ranks": args.target_ranks,
        "load_rank": args.load_rank,
    }
    try:
        for step in STEPS:
            if step in args.skip or (step in ("decode", "partial") and "encode" in args.skip):
                continue
            if step == "gathered" and not args.gathered:
                continue
            results.update(_run_step(step, args))
    finally:
        shutil.rmtree(args.workdir, ignore_errors=True)
    r = results
    r.setdefault("tiles", r.get("plan_tiles"))
    print("| step | time | peak RSS (step process) |")
    print("|---|---|---|")
    if "plan_s" in r:
        print(
            f"| first-save plan, one rank deriving its share ({r['plan_tiles']:,} tiles in all) "
            f"| {r['plan_s']:.3f} s | {r['plan_peak_rss_mb']:.0f} MB |"
        )
    if "gathered_plan_s" in r:
        print(
            f"| first-save plan gathered by rank 0 (layouts that cannot be derived) "
            f"| {r['gathered_plan_s']:.2f} s | {r['gathered_plan_peak_rss_mb']:.0f} MB |"
        )
    if "encode_s" in r:
        print(
            f"| manifest encode ({r['tiles']:,} tiles, {r['files']:,} files, {r['manifest_mb']:.1f} MB) "
            f"| {r['encode_s']:.2f} s | {r['encode_peak_rss_mb']:.0f} MB |"
        )
    if "decode_s" in r:
        print(f"| full decode + validation | {r['decode_s']:.2f} s | {r['decode_peak_rss_mb']:.0f} MB |")
        print(
            f"| partial decode ({PARTIAL_TENSORS} tensors) | {r['partial_decode_s']:.2f} s | {r['partial_peak_rss_mb']:.0f} MB |"
        )
        print(
            f"| rank {r['load_rank']}'s load plan {args.ranks} -> {args.target_ranks} ({r['load_plan_targets']} targets, "
            f"{r['load_plan_reads']} reads) | {r['load_plan_s']:.3f} s | {r['load_plan_peak_rss_mb']:.0f} MB |"
        )
        print(f"| the same plan from the manifest bytes (lazy decode) | {r['load_plan_from_bytes_s']:.2f} s | |")
    if "v2_rank_plan_s" in r:
        mib = 1 << 20
        print()
        print(
            f"| one loading rank ({args.ranks} -> {args.target_ranks}, rank {r['load_rank']}) | bytes read | requests | time to a load plan (20 ms/request, 1 GB/s) |"
        )
        print("|---|---|---|---|")
        print(
            f"| version 1 (manifest.json whole) | {r['v1_rank_bytes'] / mib:.1f} MiB | {r['v1_rank_requests']} | {r['v1_rank_plan_s']:.2f} s |"
        )
        print(
            f"| version 2 (index {r['v2_index_mb']:.2f} MB + {r['v2_rank_sections_read']} sections) | {r['v2_rank_bytes'] / mib:.2f} MiB "
            f"| {r['v2_rank_requests']} | {r['v2_rank_plan_modelled_s']:.2f} s modelled ({r['v2_rank_plan_cpu_s']:.2f} s CPU; wall {r['v2_rank_plan_s']:.2f} s, "
            f"slowest of {SAMPLED_RANKS} sampled {r['v2_sampled_rank_plan_s_max']:.2f} s) |"
        )
        print(
            f"| all ranks together, version 1 / 2 | {r['v1_rank_bytes'] * args.target_ranks / 1e9:.1f} GB / "
            f"{r['v2_all_ranks_bytes_est'] / 1e9:.1f} GB (sections file {r['v2_sections_mb']:.1f} MB) | | |"
        )
    if "commit_s" in r:
        print(
            f"| commit on rank 0: {args.ranks - 1} reports ({r['commit_report_mb']:.0f} MB)"
            + (
                f" in groups of {r['commit_group']} (leaders done after {r['commit_leader_s']:.2f} s)"
                if r["commit_group"]
                else ""
            )
            + f", {r['commit_read_threads']} reads in flight "
            f"| {r['commit_bytes_read_mb']:.0f} MB | {r['commit_requests']} | {r['commit_modelled_s']:.2f} s modelled ({r['commit_cpu_s']:.2f} s CPU; "
            f"wall {r['commit_s']:.2f} s: reports {r['commit_reports_s']:.2f} s, assemble {r['commit_assemble_s']:.2f} s, "
            f"encode + write {r['commit_encode_write_s']:.2f} s) |"
        )
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}))


if __name__ == "__main__":
    main()
