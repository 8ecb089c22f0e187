"""The first save in a fresh process: tessera against DCP, each in its own new interpreter.

A job pays its first checkpoint's one-time costs (imports, planning, thread pools, buffers) at
every restart, so this is measured in fresh processes: for each repeat and each library (the
order alternates), a new Python imports torch and the library (not timed: a training script
does that at start-up), builds ``--mb`` MB of fp32 CPU tensors (``--tensors`` of them), then
saves them twice, durably: the first save and a second one. The table shows medians.

    python bench/bench_first_save.py --mb 806 --tensors 64 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile

_CHILD = """
import json, os, sys, time
import torch
lib, path, mb, n = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
if lib == "tessera":
    import tessera
    save = lambda p, s: tessera.save(p, s)
else:
    import torch.distributed.checkpoint as dcp
    save = lambda p, s: dcp.save(s, checkpoint_id=p)
torch.manual_seed(0)
state = {f"t{i}": torch.randn(int(mb * (1 << 20)) // 4 // n) for i in range(n)}
times = []
for k in range(2):
    t0 = time.perf_counter()
    save(f"{path}/{k}", state)
    times.append(time.perf_counter() - t0)
print(json.dumps(times))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=806)
    ap.add_argument("--tensors", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="tessera-first-save-", dir=args.dir)
    rec: dict[str, list[list[float]]] = {"tessera": [], "dcp": []}
    try:
        for trial in range(args.repeat):
            order = ["tessera", "dcp"] if trial % 2 == 0 else ["dcp", "tessera"]
            for lib in order:
                path = f"{root}/{lib}-{trial}"
                env_cmd = [sys.executable, "-c", _CHILD, lib, path, str(args.mb), str(args.tensors)]
                out = subprocess.run(env_cmd, capture_output=True, text=True, check=True)
                rec[lib].append(json.loads(out.stdout.strip().splitlines()[-1]))
                shutil.rmtree(path, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {lib: [statistics.median(t[k] for t in rec[lib]) for k in range(2)] for lib in rec}
    print(f"\n{args.mb:.0f} MB of fp32 CPU tensors ({args.tensors} tensors), one process, medians of {args.repeat}\n")
    print("| save in a fresh process | tessera | DCP | DCP / tessera |")
    print("|---|---|---|---|")
    for k, label in enumerate(("first save", "second save")):
        t, d = med["tessera"][k], med["dcp"][k]
        print(f"| {label} | {t:.3f} s | {d:.3f} s | {d / t:.2f}x |")
    print(json.dumps({"command": " ".join(sys.argv), "seconds": rec, "medians": med}))


if __name__ == "__main__":
    main()
