"""Check a checkpoint end to end without loading it: files, headers, checksums, coverage.

:func:`verify` reads every byte of every tile once, streaming through small per-thread
buffers (memory stays bounded whatever the checkpoint or chunk size), and reports every
problem it finds instead of stopping at the first. Each problem names the tensor, the data
file and the rank that wrote the file (``FileEntry.rank``). The ``tessera verify`` command
is built on it.
"""

from __future__ import annotations

import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .. import _knobs
from ..engine.file_checks import check_file, tiles_by_file, unreferenced_files
from ..engine.loading.manifest import decode_read, read_bytes
from ..errors import CheckpointError, CoverageError, ManifestError, PickleNotAllowedError
from ..format.geometry import Box, check_box_coverage
from ..format.manifest import MANIFEST_NAME, Manifest
from ..format.values import decode_value
from ..results import Problem, ProblemKind, VerifyReport
from ..storage import Storage, storage_for
from ..storage.shared_tiles import with_shared_tiles

__all__ = ["Problem", "ProblemKind", "VerifyReport", "verify"]

logger = logging.getLogger(__name__)

_MAX_COORD = 1 << 62
"""Shapes beyond this cannot be checked with int64 arithmetic; no real tensor is that big."""


def verify(path: str, *, storage: Storage | None = None, threads: int | None = None) -> VerifyReport:
    """Verify the committed checkpoint at ``path`` without loading it.

    Checks that the manifest is valid; that every data file it refers to exists with the
    recorded size and is a safetensors file whose header agrees with the manifest; that
    every chunk of every tile matches its checksum; that the tiles of every tensor cover
    it exactly once; and that every plain value decodes. Reads each tile byte once, with at
    most ``threads`` buffers of 8 MiB. Needs no process group; run it on one process.

    Args:
        path: directory or URL of the checkpoint.
        storage: a backend instance to use instead of choosing one from ``path``.
        threads: files checked at once (default ``TESSERA_IO_THREADS``).

    Returns:
        A :class:`VerifyReport`; ``report.ok`` is True when nothing is wrong. Problems are
        reported, not raised (use ``report.raise_if_failed()`` to raise).

    Example:
        >>> report = tessera.verify("/ckpt/run1/step-00000100")
        >>> if not report.ok:
        ...     print(report.summary())
    """
    t0 = time.monotonic()
    store = storage_for(path, storage)
    try:
        data = read_bytes(store, f"{path}/{MANIFEST_NAME}")
    except ManifestError as e:  # oversized: refused before reading it
        return VerifyReport(
            path, None, (Problem(ProblemKind.MANIFEST, str(e), file=MANIFEST_NAME),), seconds=time.monotonic() - t0
        )
    except FileNotFoundError:
        from ..engine.loading.manifest import not_found

        msg = str(not_found(path, store))  # what tessera.load says for the same path
        return VerifyReport(
            path, None, (Problem(ProblemKind.MANIFEST, msg, file=MANIFEST_NAME),), seconds=time.monotonic() - t0
        )
    except Exception as e:
        msg = f"{path}: reading {MANIFEST_NAME} failed: {type(e).__name__}: {e}"
        return VerifyReport(
            path, None, (Problem(ProblemKind.READ, msg, file=MANIFEST_NAME),), seconds=time.monotonic() - t0
        )
    try:
        manifest = decode_read(store, path, data)  # a sectioned manifest: its index and every section
    except ManifestError as e:
        return VerifyReport(
            path, None, (Problem(ProblemKind.MANIFEST, str(e), file=MANIFEST_NAME),), seconds=time.monotonic() - t0
        )
    except Exception as e:
        msg = f"{path}/{MANIFEST_NAME}: invalid manifest ({type(e).__name__} in the decoder: {e})"
        return VerifyReport(
            path, None, (Problem(ProblemKind.MANIFEST, msg, file=MANIFEST_NAME),), seconds=time.monotonic() - t0
        )

    try:
        store = with_shared_tiles(store, manifest, path)
    except CheckpointError as e:
        return VerifyReport(
            path, None, (Problem(ProblemKind.READ, str(e), file=MANIFEST_NAME),), seconds=time.monotonic() - t0
        )
    problems: list[Problem] = []
    problems += _check_coverage(manifest)
    pickled = _check_values(manifest, problems)
    by_file = tiles_by_file(manifest)
    n = max(1, threads if threads is not None else _knobs.io_threads())
    checked = 0
    with ThreadPoolExecutor(
        max_workers=min(n, max(1, len(manifest.files))), thread_name_prefix="tessera-verify"
    ) as pool:
        futures = [
            pool.submit(check_file, store, manifest, f, by_file.get(i, [])) for i, f in enumerate(manifest.files)
        ]
        for fut in futures:
            res = fut.result()
            problems += res.problems
            checked += res.bytes_checked
    unreferenced = unreferenced_files(store, manifest)
    report = VerifyReport(
        path=path,
        save_id=manifest.save_id,
        problems=tuple(problems),
        tensors=len(manifest.tensors),
        tiles=sum(e.num_tiles for e in manifest.tensors.values()),
        files=len(manifest.files),
        bytes_checked=checked,
        seconds=time.monotonic() - t0,
        unreferenced_files=tuple(unreferenced),
        pickled_values=tuple(pickled),
    )
    logger.info("verified %s: %d problem(s), %d bytes in %.2fs", path, len(problems), checked, report.seconds)
    return report


def _check_coverage(manifest: Manifest) -> list[Problem]:
    problems = []
    for fqn, entry in manifest.tensors.items():
        shape = entry.shape
        if any(s >= _MAX_COORD for s in shape) or math.prod(shape) >= _MAX_COORD:
            problems.append(
                Problem(ProblemKind.COVERAGE, f"tensor '{fqn}': shape {list(shape)} is implausibly large", tensor=fqn)
            )
            continue
        table = entry.table
        nd = len(shape)
        # The decoder keeps coordinates below 2**62, so these sums cannot wrap in int64.
        outside = (
            np.flatnonzero((table.offsets + table.lengths > np.asarray(shape, dtype=np.int64)).any(axis=1))
            if nd
            else np.zeros(0, dtype=np.int64)
        )
        if len(outside):
            t = entry.tile(int(outside[0]))
            problems.append(
                Problem(
                    ProblemKind.COVERAGE,
                    f"tensor '{fqn}': tile {Box(t.offsets, t.lengths)} in '{t.file}' lies outside its shape {list(shape)}",
                    tensor=fqn,
                    file=t.file,
                )
            )
            continue
        boxes = np.concatenate([table.offsets, table.lengths], axis=1).reshape(len(table), 2 * nd)
        if len(boxes):  # identical boxes are replicas
            boxes = np.unique(boxes, axis=0) if nd else boxes[:1]
        try:
            check_box_coverage(fqn, shape, boxes[:, :nd], boxes[:, nd:])
        except CoverageError as e:
            files = [table.paths[i] for i in np.unique(table.file)[:5].tolist()]
            where = (
                f" (tiles in {', '.join(repr(f) for f in files[:4])}{' ...' if len(files) > 4 else ''})"
                if files
                else ""
            )
            problems.append(Problem(ProblemKind.COVERAGE, f"{e}{where}", tensor=fqn))
    return problems


def _check_values(manifest: Manifest, problems: list[Problem]) -> list[str]:
    pickled = []
    items = [(k, v) for k, v in manifest.values.items()]
    items += [(k, v) for k, e in manifest.per_rank.items() for v in e.by_rank]
    for name, encoded in items:
        try:
            decode_value(encoded, name, allow_pickle=False)
        except PickleNotAllowedError:
            if name not in pickled:
                pickled.append(name)
        except (ManifestError, RecursionError) as e:
            problems.append(Problem(ProblemKind.VALUE, f"value '{name}': {e}", tensor=name))
    return pickled
