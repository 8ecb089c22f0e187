"""Call to commit of ``async_save`` against ``save`` of the same state, with per-phase timings.

One process saves ``--mb`` MB of fp32 CPU tensors (``--tensors`` of them) durably, a sync
save and an async save alternating, ``--repeat`` times each (the first of each is a warm-up
and not counted). Prints, per mode, the median wall time from the call until the
checkpoint is committed and the median of each phase of ``SaveResult.timings`` (the
figures ``tessera trace`` shows). ``--writer process`` uses ``WriterMode.PROCESS``.

    python bench/bench_async_commit.py --mb 256 --repeat 6
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time

import torch

import tessera
from tessera import SaveOptions
from tessera.options import WriterMode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=256)
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=6)
    ap.add_argument("--writer", choices=[m.value for m in WriterMode], default=WriterMode.THREAD.value)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    n = int(args.mb * (1 << 20)) // 4 // args.tensors
    state = {f"t{i}": torch.randn(n) for i in range(args.tensors)}
    opts = SaveOptions(writer=WriterMode(args.writer))
    root = tempfile.mkdtemp(prefix="tessera-async-commit-", dir=args.dir)
    rec: dict[str, list[tuple[float, dict[str, float]]]] = {"sync": [], "async": []}
    for trial in range(args.repeat):
        for mode in rec:
            path = f"{root}/{mode}-{trial}"
            t0 = time.perf_counter()
            if mode == "sync":
                result = tessera.save(path, state, options=opts)
            else:
                result = tessera.async_save(path, state, options=opts).wait()
            secs = time.perf_counter() - t0
            shutil.rmtree(path)
            if trial:
                rec[mode].append((secs, result.timings))
    shutil.rmtree(root, ignore_errors=True)
    med = {mode: statistics.median(s for s, _ in v) for mode, v in rec.items()}
    for mode, v in rec.items():
        names = [k for k in v[-1][1] if k not in ("bytes", "stall")]
        phases = ", ".join(f"{k} {statistics.median(t.get(k, 0.0) for _, t in v):.3f}" for k in names)
        print(f"{mode}: {med[mode]:.3f} s call to commit ({phases})")
    print(f"async / sync: {med['async'] / med['sync']:.2f}x")


if __name__ == "__main__":
    main()
