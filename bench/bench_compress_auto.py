"""``compress="auto"`` against plain and compressed saves, on a local disk and on loopback S3.

The state is bench_compress.py's trained transformer (fp32 weights, both AdamW moments, a bf16
copy). Each arm saves it ``--repeat`` times to new paths of one place, after one save that is
not timed (``auto``'s first save to a place is plain: it measures the storage), and reports the
median save time, the stored bytes and, for ``auto``, what it chose. The places:

* ``local disk``: ``--dir`` (default: a temporary directory under /tmp), durable writes (O_DIRECT).
* ``loopback S3 (moto)``: ``s3://`` to a moto server on 127.0.0.1 started here. moto is a Python
  server holding objects in RAM: a storage slower than the codec, as object stores and network
  filesystems are for one rank, not a model of S3's own speed.

Run::

    .venv/bin/python bench/bench_compress_auto.py --repeat 5
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import tempfile
import time
import uuid

import torch
from bench_compress import _state as as_tensors
from bench_compress import train

import tessera
from tessera.engine.saving import compress_choice

AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_CONFIG_FILE": "/dev/null",
    "AWS_SHARED_CREDENTIALS_FILE": "/dev/null",
    "AWS_EC2_METADATA_DISABLED": "true",
    "NO_PROXY": "127.0.0.1,localhost",
}


def _stored(url: str, storage_options: dict | None) -> tuple[int, int]:
    """Stored bytes of the data files, and how many of those files are compressed."""
    m = tessera.read_manifest(url, storage_options=storage_options)
    return sum(f.nbytes for f in m.files), sum(f.frames is not None for f in m.files)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--no-s3", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(2)
    _, now = train(4, 256, args.steps, 10, 0)
    state = as_tensors(now)
    logical = sum(v.numel() * v.element_size() for v in state.values())
    disk = os.path.abspath(args.dir or tempfile.mkdtemp(prefix="tessera-bench-auto-"))
    places: dict[str, tuple[str, dict | None]] = {"local disk": (disk, None)}
    server = None
    if not args.no_s3:
        import boto3
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        os.environ.update(AWS_ENV)
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        endpoint, bucket = f"http://{host}:{port}", f"tessera-bench-{uuid.uuid4().hex[:8]}"
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
        opts = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": endpoint}}
        places["loopback S3 (moto)"] = (f"s3://{bucket}", opts)
    print(f"{logical / 1e6:.1f} MB of trained state ({args.steps} steps), one process, median of {args.repeat} saves")
    print(f"{'place':20s}{'arm':10s}{'save s':>9s}{'x plain':>9s}{'stored MB':>11s}{'ratio':>7s}  chose")
    try:
        for name, (root, opts) in places.items():
            plain = None
            for arm, compress in (("plain", False), ("compress", True), ("auto", "auto")):
                times = []
                for i in range(args.repeat + 1):
                    url = f"{root}/{arm}-{i}"
                    t0 = time.perf_counter()
                    tessera.save(url, state, options=tessera.SaveOptions(compress=compress), storage_options=opts)
                    if i:  # the first save of each arm is not timed
                        times.append(time.perf_counter() - t0)
                t = statistics.median(times)
                plain = t if plain is None else plain
                stored, coded = _stored(url, opts)
                w, c = compress_choice.CHOICE.rates(url)
                chose = ""
                if compress == "auto":
                    chose = (
                        f"{'coded' if coded else 'plain'} (storage {w / 1e6:.0f} MB/s, codec {c / 1e6:.0f} MB/s x 2)"
                    )
                print(
                    f"{name:20s}{arm:10s}{t:9.3f}{t / plain:9.2f}{stored / 1e6:11.1f}{logical / stored:7.3f}  {chose}"
                )
    finally:
        if server is not None:
            server.stop()
        if args.dir is None:
            shutil.rmtree(disk, ignore_errors=True)


if __name__ == "__main__":
    main()
