"""Encode and decode speed of the erasure codes the local tier could use (issue #35).

Measures tessera's codec (:class:`tessera.manager.local_tier.codec.Codec`: numpy XOR for
m = 1, ISA-L Reed-Solomon through pyeclib for m >= 2) as the tier calls it, on 4+2, 5+1 and
2+1 stripes of ``--block-mib`` MiB blocks, and the alternatives where installed: ISA-L for
m = 1 and zfec (Reed-Solomon over GF(2^8)) for every shape.
Run: ``python bench/bench_parity_codec.py --block-mib 4 --repeat 3``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np

from tessera.manager.local_tier.codec import ISAL, Codec, codec_for


def _best(fn: Callable[[], object], repeat: int) -> float:
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return min(out)


def _row(name: str, codec: Codec, blocks: list[np.ndarray], repeat: int) -> None:
    k, m = codec.k, codec.m
    enc_s = _best(lambda: codec.encode(blocks), repeat)
    parity = codec.encode(blocks)
    have = dict(enumerate(blocks + parity))
    for slot in range(m):  # the first m data blocks lost
        del have[slot]
    dec_s = _best(lambda: codec.decode(have, list(range(m))), repeat)
    got = codec.decode(have, list(range(m)))
    assert all(np.array_equal(got[s], blocks[s]) for s in range(m)), name
    mb = k * len(blocks[0]) / 1e6
    print(f"{name:>16} {k}+{m}: encode {mb / enc_s:8.0f} MB/s of data, decode ({m} lost) {mb / dec_s:8.0f} MB/s")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--block-mib", type=int, default=4)
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args()
    size = a.block_mib << 20
    rng = np.random.default_rng(0)
    for k, m in ((4, 2), (5, 1), (2, 1)):
        blocks = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(k)]
        _row(f"tessera ({codec_for(m)})", Codec(k, m, codec_for(m)), blocks, a.repeat)
        if m == 1:
            _row(f"alt ({ISAL})", Codec(k, m, ISAL), blocks, a.repeat)
        _zfec(k, m, blocks, a.repeat)


def _zfec(k: int, m: int, blocks: list[np.ndarray], repeat: int) -> None:
    try:
        import zfec
    except ImportError:
        print(f"{'alt (zfec)':>16} {k}+{m}: not installed (not measured)")
        return
    enc, dec = zfec.Encoder(k, k + m), zfec.Decoder(k, k + m)
    want = tuple(range(k, k + m))
    data = tuple(blocks)
    enc_s = _best(lambda: enc.encode(data, want), repeat)
    parity = enc.encode(data, want)
    ins = data[m:] + tuple(parity)
    nums = tuple(range(m, k)) + want
    dec_s = _best(lambda: dec.decode(ins, nums), repeat)
    mb = k * len(blocks[0]) / 1e6
    print(
        f"{'alt (zfec)':>16} {k}+{m}: encode {mb / enc_s:8.0f} MB/s of data, decode ({m} lost) {mb / dec_s:8.0f} MB/s"
    )


if __name__ == "__main__":
    main()
