"""Encode and decode speed of the erasure codes the local tier could use (issue #35).

Measures zfec (Reed-Solomon over GF(2^8), systematic) for k+m = 4+2, 5+1, 2+1 and numpy XOR
(m = 1 only) on blocks of ``--block-mib`` MiB; pyeclib is measured if it is installed.
Run: ``python bench/bench_parity_codec.py --block-mib 4 --repeat 3``.
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def _best(fn, repeat: int) -> float:  # type: ignore[no-untyped-def]
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return min(out)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--block-mib", type=int, default=4)
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args()
    size = a.block_mib << 20
    rng = np.random.default_rng(0)
    import zfec

    for k, m in ((4, 2), (5, 1), (2, 1)):
        blocks = tuple(rng.integers(0, 256, size, dtype=np.uint8) for _ in range(k))
        enc = zfec.Encoder(k, k + m)
        want = tuple(range(k, k + m))
        enc_s = _best(lambda: enc.encode(blocks, want), a.repeat)  # noqa: B023
        parity = enc.encode(blocks, want)
        dec = zfec.Decoder(k, k + m)
        ins = tuple(blocks[m:]) + tuple(parity)  # the first m data blocks lost
        nums = tuple(range(m, k)) + want
        dec_s = _best(lambda: dec.decode(ins, nums), a.repeat)  # noqa: B023
        mb = k * size / 1e6
        print(f"zfec {k}+{m}: encode {mb / enc_s:8.0f} MB/s of data, decode ({m} lost) {mb / dec_s:8.0f} MB/s")
        if m == 1:
            xor_s = _best(lambda: np.bitwise_xor.reduce(np.stack(blocks)), a.repeat)  # noqa: B023
            print(f"numpy XOR {k}+1: encode {mb / xor_s:8.0f} MB/s (decode is the same XOR)")
    try:
        import pyeclib  # noqa: F401
    except ImportError:
        print("pyeclib: not installed (not measured)")


if __name__ == "__main__":
    main()
