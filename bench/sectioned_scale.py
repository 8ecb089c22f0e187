"""Steps of ``plan_scale.py`` for the manifest in sections (format version 2) and the commit.

- ``sections``: the manifest of ``plan_scale.build_manifest`` committed as an index and its
  sections on a local directory; one loading rank (``--load-rank`` of ``--target-ranks``)
  reads the index and the sections its targets meet through :class:`SlowStorage` (20 ms per
  request and 1 GB/s, slept; bytes and requests counted), then plans its reads. Reported:
  its bytes, requests and wall time to a load plan; the same for the version 1 manifest (read
  whole) as the before (times: medians of 5 plans); and, from a sample of loading ranks, the bytes
  all ranks read together.
- ``commit``: rank 0 of a save by ``--ranks`` ranks: every rank's report, with the section it
  encodes itself, written to a local directory (not timed on rank 0: each rank's own work at
  write time; its median is reported), combined by each group's leader (``TESSERA_REPORT_GROUP``,
  default 64: their files appear when a leader would have finished, its CPU plus two requests),
  then read through :class:`SlowStorage` with the commit's bounded parallelism
  (``tessera.engine.saving.finish._reports``, geometry only; a group file not there yet is a
  request too, then a pause), the
  index built and the sections joined (``tessera.engine.saving.sectioned.build_sectioned``),
  written (sections, then index): requests, CPU and wall time.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from types import SimpleNamespace

import numpy as np

LATENCY_S = 0.020
BANDWIDTH = 1e9
SAMPLED_RANKS = 8
REPEATS = 5


class SlowStorage:
    """A store that sleeps ``LATENCY_S`` per request plus its bytes at ``BANDWIDTH``, and counts them."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.url = inner.url
        self.requests = 0
        self.bytes = 0
        self.thread_s: dict[int, float] = {}
        """Storage time (latency and bytes) each thread waited for."""
        self._lock = threading.Lock()

    def _cost(self, nbytes: int) -> None:
        cost = LATENCY_S + nbytes / BANDWIDTH
        key = threading.get_ident()
        with self._lock:
            self.requests += 1
            self.bytes += nbytes
            self.thread_s[key] = self.thread_s.get(key, 0.0) + cost
        time.sleep(cost)

    def read_file(self, path: str) -> bytes:
        try:
            data = self.inner.read_file(path)
        except FileNotFoundError:
            self._cost(0)  # a miss is a request too
            raise
        self._cost(len(data))
        return data

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        self.inner.read_into(path, offset, out)
        self._cost(len(out))

    def read_bounded(self, path: str, limit: int) -> bytes | int:
        try:
            got = self.inner.read_bounded(path, limit)
        except FileNotFoundError:
            self._cost(0)
            raise
        self._cost(0 if isinstance(got, int) else len(got))
        return got

    def size(self, path: str) -> int:
        self._cost(0)
        return self.inner.size(path)

    def write_file(self, path: str, chunks) -> None:
        chunks = [bytes(c) for c in chunks]
        self.inner.write_file(path, chunks)
        self._cost(sum(map(len, chunks)))

    def write_atomic(self, path: str, data: bytes) -> None:
        self.inner.write_atomic(path, data)
        self._cost(len(data))

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def _store(root: str):
    from tessera.storage.local import FileStorage

    os.makedirs(root, exist_ok=True)
    return FileStorage(root)


def step_sections(args: argparse.Namespace) -> dict:
    import plan_scale as ps

    from tessera.engine.loading.manifest import open_manifest
    from tessera.engine.loading.plan import plan_reads
    from tessera.format.manifest import encode, encode_sectioned, sections_path

    params = ps.llama_params(args.tensors)
    m = ps.build_manifest(params, args.ranks, args.layout)
    t0 = time.perf_counter()
    index, sections = encode_sectioned(m)
    encode_s = time.perf_counter() - t0
    root = os.path.join(args.workdir, "v2")
    store = _store(root)
    store.write_file(sections_path(m.save_id), [sections])
    store.write_atomic("manifest.json", index)
    v1_root = os.path.join(args.workdir, "v1")
    _store(v1_root).write_atomic("manifest.json", encode(m))
    del m

    def load_plan(at: str, rank: int, ranks: int) -> tuple[float, int, int, int, float]:
        slow = SlowStorage(_store(at))
        targets = ps.load_targets(params, ranks, args.layout, rank)
        t0, c0 = time.perf_counter(), time.process_time()
        manifest, part = open_manifest(slow, at, rank)
        if part is not None:
            manifest = part.narrow(targets)
        plan_reads(manifest, targets, rank=rank)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        return wall, slow.bytes, slow.requests, (part.sections_read if part else 0), cpu

    # Modelled: the CPU seconds (this machine is shared: wall time includes waiting for a core)
    # plus the storage's time on the critical path: the index's read (one request: a backend
    # that reads bounded needs no stat first), then one round of parallel section reads, each
    # 20 ms, and every byte at 1 GB/s.
    # The loading rank's plan, REPEATS times from storage (a fresh store and manifest each time):
    # the medians (the first call also pays lazy imports and cold caches).
    def median_of(at: str) -> tuple[float, int, int, int, float]:
        runs = [load_plan(at, args.load_rank, args.target_ranks) for _ in range(REPEATS)]
        return (
            float(np.median([r[0] for r in runs])),
            runs[0][1],
            runs[0][2],
            runs[0][3],
            float(np.median([r[4] for r in runs])),
        )

    v2_s, v2_bytes, v2_requests, v2_sections, v2_cpu = median_of(root)
    v1_s, v1_bytes, v1_requests, _, v1_cpu = median_of(v1_root)
    # All ranks together: a sample of loading ranks, spread over the job, scaled up.
    sample = np.linspace(0, args.target_ranks - 1, SAMPLED_RANKS).astype(int).tolist()
    sampled = [load_plan(root, r, args.target_ranks) for r in sample]
    mean_bytes = float(np.mean([s[1] for s in sampled]))
    return {
        "v2_index_mb": len(index) / 1e6,
        "v2_sections_mb": len(sections) / 1e6,
        "v2_encode_s": encode_s,
        "v2_rank_bytes": v2_bytes,
        "v2_rank_requests": v2_requests,
        "v2_rank_sections_read": v2_sections,
        "v2_rank_plan_s": v2_s,
        "v2_rank_plan_cpu_s": v2_cpu,
        "v2_rank_plan_modelled_s": v2_cpu + 2 * LATENCY_S + v2_bytes / BANDWIDTH,
        "v2_sampled_rank_plan_s_max": max(s[0] for s in sampled),
        "v2_sampled_rank_bytes_max": max(s[1] for s in sampled),
        "v2_all_ranks_bytes_est": mean_bytes * args.target_ranks,
        "v1_rank_bytes": v1_bytes,
        "v1_rank_requests": v1_requests,
        "v1_rank_plan_s": v1_s,
        "v1_rank_plan_cpu_s": v1_cpu,
        "v1_rank_plan_modelled_s": v1_cpu + LATENCY_S + v1_bytes / BANDWIDTH,
    }


def _reports(params, ranks: int, layout: str):
    """Every rank's report of the save ``plan_scale.build_manifest`` describes, rank by rank."""
    import plan_scale as ps

    from tessera.format.rank_report import RankReportDoc, ReportTiles

    m = ps.build_manifest(params, ranks, layout)
    names = tuple(m.tensors)
    nd = max(len(p.shape) for p in params)
    cols: dict[str, list[np.ndarray]] = {k: [] for k in ("name", "file", "offs", "lens", "bo", "chunks", "sums")}
    for ti, e in enumerate(m.tensors.values()):
        t = e.table
        n = len(t)
        k = t.offsets.shape[1]
        offs = np.zeros((n, nd), dtype=np.int64)
        lens = np.ones((n, nd), dtype=np.int64)
        offs[:, :k], lens[:, :k] = t.offsets, t.lengths
        cols["name"].append(np.full(n, ti, dtype=np.int64))
        cols["file"].append(t.file)
        cols["offs"].append(offs)
        cols["lens"].append(lens)
        cols["bo"].append(t.byte_offset)
        cols["chunks"].append(t.chunks)
        cols["sums"].append(t.checksums)  # one checksum per tile at this scale
    c = {k: np.concatenate(v) for k, v in cols.items()}
    order = np.argsort(c["file"], kind="stable")
    bounds = np.searchsorted(c["file"][order], np.arange(ranks + 1))
    for r in range(ranks):
        rows = order[bounds[r] : bounds[r + 1]]
        tiles = ReportTiles(
            ((m.files[r].path, m.files[r].nbytes),),
            names,
            np.zeros(len(rows), dtype=np.int64),
            c["name"][rows],
            c["offs"][rows],
            c["lens"][rows],
            c["bo"][rows],
            c["chunks"][rows],
            c["sums"][rows],
        )
        yield RankReportDoc(r, m.save_id, tiles, {}, {}, {"write": 1.0, "bytes": int(m.files[r].nbytes)})


def step_commit(args: argparse.Namespace) -> dict:
    import plan_scale as ps

    from tessera.engine import commit
    from tessera.engine.commit import Claim, _encoded, publish
    from tessera.engine.gc_pause import gc_paused
    from tessera.engine.saving import finish, report_groups
    from tessera.engine.saving.plan import TensorMeta
    from tessera.engine.saving.sectioned import build_sectioned, tile_count
    from tessera.format.rank_report import encode_report, report_path
    from tessera.format.report_group import encode_group, group_path, members
    from tessera.options import SaveOptions

    params = ps.llama_params(args.tensors)
    root = os.path.join(args.workdir, "commit")
    store = _store(root)
    docs = []
    report_bytes = 0
    rank_encode_s = []  # each rank's own work at write time: its section and report
    reports: dict[int, bytes] = {}
    for doc in _reports(params, args.ranks, args.layout):
        if doc.rank == 0:
            docs.append(doc)
        else:
            t0 = time.process_time()
            data = encode_report(doc)
            rank_encode_s.append(time.process_time() - t0)
            report_bytes += len(data)
            store.write_atomic(report_path(doc.save_id, doc.rank), data)
            reports[doc.rank] = data
    save_id = docs[0].save_id
    metas = tuple(TensorMeta(p.fqn, ps.DTYPE, p.shape) for p in params)
    finish._READ_THREADS = int(os.environ.get("TESSERA_BENCH_REPORT_THREADS", finish._READ_THREADS))
    # The leaders' work after the vote (on their own ranks, not rank 0's): each reads its members'
    # reports in one round of parallel requests and writes its group file. Their files are encoded
    # here, untimed, and appear under their names when a leader would have finished: its CPU (one
    # leader's, measured) plus two requests and its bytes.
    group = report_groups.group_size(args.ranks)
    staged: list[tuple[str, str]] = []
    leader_s = 0.0
    for leader in range(group, args.ranks, group) if group else ():
        t0 = time.process_time()
        data = encode_group(save_id, leader, {r: reports[r] for r in members(leader, group, args.ranks)})
        cpu = time.process_time() - t0
        leader_s = max(leader_s, cpu + 2 * LATENCY_S + 2 * len(data) / BANDWIDTH)
        store.write_atomic(group_path(save_id, leader) + ".staged", data)
        staged.append((group_path(save_id, leader) + ".staged", group_path(save_id, leader)))
    del reports
    out = {
        "commit_report_mb": report_bytes / 1e6,
        "commit_read_threads": finish._READ_THREADS,
        "commit_rank_report_encode_ms": 1e3 * float(np.median(rank_encode_s)),
        "commit_group": group,
        "commit_leader_s": leader_s,
    }
    slow = SlowStorage(store)
    save = SimpleNamespace(store=slow, save_id=save_id, path=root, dedup=None)
    world = SimpleNamespace(size=args.ranks)
    paused = _PauseClock()
    report_groups.time = paused  # type: ignore[attr-defined]  # rank 0's polling pauses, counted per thread

    def leaders_finish() -> None:
        time.sleep(leader_s)
        for a, b in staged:
            os.replace(os.path.join(root, a), os.path.join(root, b))

    publisher = threading.Thread(target=leaders_finish)
    # What ``finish._commit`` does on rank 0 for a save in sections (its ranks' sections joined),
    # with the cyclic collector paused as there (``finish._assemble``).
    t0, c0 = time.perf_counter(), time.process_time()
    publisher.start()
    with gc_paused():
        got = finish._reports(world, save, docs, [], detailed=False)
        t1, c1 = time.perf_counter(), time.process_time()
        publisher.join()
        assert commit.sectioned_for(slow, tile_count(got))
        encoded = build_sectioned(args.ranks, metas, got, save_id, SaveOptions(chunk_bytes=ps.CHUNK_BYTES))
    t2 = time.perf_counter()
    claim = Claim(save_id, None, False)
    data, _ = _encoded(slow, claim, encoded)
    publish(slow, claim, data, root)
    t3, c3 = time.perf_counter(), time.process_time()
    # Modelled: CPU seconds plus the storage's time on the critical path: the reading thread
    # with the most storage time (its requests at 20 ms each and its bytes at 1 GB/s, plus the
    # pauses it slept waiting for group files), then the two writes.
    path_s = max(slow.thread_s[k] + paused.slept.get(k, 0.0) for k in slow.thread_s)
    out["commit_cpu_s"] = c3 - c0
    out["commit_reports_cpu_s"] = c1 - c0
    out["commit_modelled_s"] = (c3 - c0) + path_s + 2 * LATENCY_S
    out.update(
        {
            "commit_reports_s": t1 - t0,
            "commit_assemble_s": t2 - t1,
            "commit_encode_write_s": t3 - t2,
            "commit_s": t3 - t0,
            "commit_requests": slow.requests,
            "commit_bytes_read_mb": slow.bytes / 1e6,
            "commit_index_mb": len(encoded.index) / 1e6,
            "commit_sections_mb": len(encoded.sections) / 1e6,
        }
    )
    return out


class _PauseClock:
    """``time`` for :mod:`tessera.engine.saving.report_groups`: its sleeps counted per thread."""

    def __init__(self) -> None:
        self.slept: dict[int, float] = {}
        self.monotonic = time.monotonic

    def sleep(self, seconds: float) -> None:
        key = threading.get_ident()
        self.slept[key] = self.slept.get(key, 0.0) + seconds
        time.sleep(seconds)
