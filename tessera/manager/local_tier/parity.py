"""Parity of the local tier over tessera's gloo group: encoding at a local commit, checking
parity blocks and rebuilding lost streams at recovery (layout: :mod:`.stripes`).

Both go in rounds of :data:`~.stripes.CHUNK` bytes per block: in each round the data chunks
of a stripe go to the node that computes its parity (the holder of its parity block 0), which
encodes them and sends the other parity chunks to their holders; at recovery the ``k``
chunks a stripe still has go to the node rebuilding a lost stream, which decodes them. A
node's stream is read from the files its step directory holds (mapped, not copied), so the
memory parity needs beyond the files themselves is ``(k + m)`` chunks per stripe a node
encodes or decodes in a round.

Only node leaders (the lowest rank of each node) send, receive, read or write; every rank
computes the same plan from shared data and takes part in every collective.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as tdist
import xxhash

from ...engine import dist
from .codec import Codec
from .files import remove_quietly
from .placement import Placement
from .streams import StreamReader, StreamWriter
from .stripes import CHUNK, ParityLayout, parity_path
from .transfer import FileSink, read_tensor

logger = logging.getLogger(__name__)

Move = tuple[int, int, int, Any]
"""``(src rank, dst rank, nbytes, key)`` of one chunk in a round."""


def _exchange(
    world: dist.World,
    moves: Sequence[Move],
    send: Callable[[Any, int], torch.Tensor],
    recv: Callable[[Any, int], torch.Tensor],
    what: str,
) -> None:
    """Post every move naming this rank (a send to itself is a copy) and wait for them."""
    me = world.rank

    def post() -> None:
        works = []
        for tag, (src, dst, n, key) in enumerate(moves):
            if n == 0:
                continue
            if src == me and dst == me:
                recv(key, n).copy_(send(key, n))
            elif dst == me:
                works.append(tdist.irecv(recv(key, n), group=world.group, group_src=src, tag=tag))
        for tag, (src, dst, n, key) in enumerate(moves):
            if n and src == me and dst != me:
                works.append(tdist.isend(send(key, n), group=world.group, group_dst=dst, tag=tag))
        for work in works:
            work.wait()  # type: ignore[union-attr]

    if world.distributed:
        dist.run_collective(world, what, post)
    else:
        post()


def encode(
    world: dist.World,
    placement: Placement,
    layout: ParityLayout,
    root: str,
    save_id: str,
    files: Sequence[tuple[str, int]],
) -> tuple[ParityLayout, BaseException | None]:
    """Collective: compute every stripe's parity and write each block on its holder; the layout
    with the blocks' checksums (xxh3-64), and this rank's error (reading or writing failed) if any. A
    dead or hung peer raises :class:`~tessera.errors.CollectiveTimeoutError`."""
    what = f"{root}: computing parity"
    lead = [placement.leader(node) for node in layout.order]
    me = world.rank
    mine = lead.index(me) if me in lead else None
    error: BaseException | None = None
    reader: StreamReader | None = None
    sinks: dict[tuple[int, int], FileSink] = {}
    crc: dict[tuple[int, int], Any] = {}
    codec = Codec(layout.k, layout.m, layout.codec)
    try:
        if mine is not None:
            reader = StreamReader(root, [files[i] for i in layout.files_of(mine)])
            for i, p in layout.parity_of(mine):
                sinks[(i, p)] = FileSink(root, parity_path(save_id, i, p), layout.block(i))
                crc[(i, p)] = xxhash.xxh3_64()
    except Exception as e:
        error = e
    pool: dict[Any, torch.Tensor] = {}  # receive and send buffers, reused from round to round

    def keep(key: Any, n: int, r: int) -> torch.Tensor:
        sink = sinks.get(key)
        if sink is None:  # this rank failed to create it: receive and drop
            return buffer(("dropped", key), n)
        return sink.buffer[r * CHUNK : r * CHUNK + n]

    def buffer(key: Any, n: int) -> torch.Tensor:
        if key not in pool:
            pool[key] = torch.empty(CHUNK, dtype=torch.uint8)
        return pool[key][:n]

    try:
        for r in range(layout.rounds()):
            live = [
                (i, min(CHUNK, layout.block(i) - r * CHUNK)) for i in range(layout.n) if layout.block(i) > r * CHUNK
            ]

            def read(key: Any, n: int, r: int = r) -> torch.Tensor:
                nonlocal error
                _, t = key
                try:
                    assert reader is not None and mine is not None
                    seg = layout.segment(mine)
                    return reader.read(t * seg + r * CHUNK, n, (t + 1) * seg)
                except Exception as e:
                    error = error or e
                    return torch.zeros(n, dtype=torch.uint8)

            def into(key: Any, n: int) -> torch.Tensor:
                return buffer(("data", key), n)

            moves: list[Move] = [
                (lead[layout.data_pos(i, t)], lead[layout.parity_pos(i, 0)], n, (i, t))
                for i, n in live
                for t in range(layout.k)
            ]
            _exchange(world, moves, read, into, f"{what} (data, round {r})")
            for i, n in live:
                if lead[layout.parity_pos(i, 0)] == me:
                    # Parity block 0 is computed into its file's mapping, the others into send buffers.
                    first = keep((i, 0), n, r) if (i, 0) in sinks else buffer(("parity", (i, 0)), n)
                    out = [first.numpy()] + [buffer(("parity", (i, p)), n).numpy() for p in range(1, layout.m)]
                    codec.encode([buffer(("data", (i, t)), n).numpy() for t in range(layout.k)], out)

            def give(key: Any, n: int) -> torch.Tensor:
                return buffer(("parity", key), n)

            moves = [
                (lead[layout.parity_pos(i, 0)], lead[layout.parity_pos(i, p)], n, (i, p))
                for i, n in live
                for p in range(1, layout.m)
            ]
            _exchange(world, moves, give, functools.partial(keep, r=r), f"{what} (parity, round {r})")
            for i, n in live:
                for p in range(layout.m):
                    if (i, p) in sinks:
                        chunk = sinks[(i, p)].buffer[r * CHUNK : r * CHUNK + n].numpy()
                        crc[(i, p)].update(chunk.data)
    except BaseException:
        for sink in sinks.values():
            sink.abort()
        raise
    finally:
        if reader is not None:
            reader.close()
        pool.clear()
    for sink in sinks.values():
        try:
            if error is None:
                sink.commit()
            else:
                sink.abort()
        except Exception as e:
            error = error or e
    sums = {b: h.intdigest() for b, h in crc.items()}
    gathered = dist.all_gather(world, sums, f"{what}: checksums")
    merged: dict[tuple[int, int], int] = {}
    for part in gathered:
        merged.update(part)
    if len(merged) != layout.n * layout.m:  # a rank failed before it could make its files
        merged = {(i, p): merged.get((i, p), 0) for i in range(layout.n) for p in range(layout.m)}
    return layout.with_crc(merged), error


def check_parity(
    root: str, save_id: str, layout: ParityLayout, blocks: Sequence[tuple[int, int]]
) -> list[tuple[str, str]]:
    """Node leaders, not collective: check ``blocks`` this node holds against their checksums,
    remove those that fail; ``(file, why)`` of each removed."""
    bad = []
    for i, p in blocks:
        path = parity_path(save_id, i, p)
        full = os.path.join(root, path)
        try:
            got = xxhash.xxh3_64_intdigest(read_tensor(root, path).numpy().data)
        except FileNotFoundError:
            continue
        except OSError as e:
            bad.append((path, f"unreadable: {e}"))
            remove_quietly(full)
            continue
        if got != layout.crc[i][p]:
            bad.append((path, f"checksum (xxh3-64) {got:016x}, {layout.crc[i][p]:016x} recorded at the commit"))
            remove_quietly(full)
    return bad


def rebuild(
    world: dist.World,
    placement: Placement,
    layout: ParityLayout,
    held: Mapping[int, frozenset[int]],
    blocks: Mapping[int, frozenset[tuple[int, int]]],
    root: str,
    save_id: str,
    files: Sequence[tuple[str, int]],
    needs: Mapping[int, set[int]] | None = None,
) -> tuple[dict[int, int], int, BaseException | None]:
    """Collective: rebuild the streams no node holds from the rest of their stripes.

    Args:
        held: per node of the job, the indices of the manifest's files it holds.
        blocks: per node, the parity blocks it holds (checked: :func:`check_parity`).
        needs: per node, the indices of the files its ranks' load reads: a stream whose node
            is not in the job is rebuilt on the node that reads most of its bytes (no second move).

    Returns:
        the node that now holds each rebuilt position (its own node if in the job, else a
        survivor), the bytes this rank received, and this rank's error if any.
    """
    what = f"{root}: rebuilding from parity"
    nodes = sorted(placement.nodes)
    order = [n for n in nodes if n in held]
    union = frozenset().union(*held.values()) if held else frozenset()
    lost = layout.missing(union)
    whole = layout.whole([held[n] for n in order])
    source = {pos: order[j] for pos, j in whole.items()}
    holder: dict[tuple[int, int], int] = {}
    for n in order:
        for b in sorted(blocks.get(n, ())):
            holder.setdefault(b, n)

    def host_of(j: int) -> int:
        if layout.order[j] in placement.nodes:
            return layout.order[j]
        reads = {n: sum(files[f][1] for f in layout.files_of(j) if f in (needs or {}).get(n, ())) for n in nodes}
        best = max(reads.values())
        most = [n for n in nodes if reads[n] == best]  # ties (or nobody): rotate
        return most[j % len(most)]

    host = {j: host_of(j) for j in lost}
    # One job per stripe that lost a segment: its decoder receives k blocks, decodes the lost
    # segments and sends each to its host. The decoder is a host holding one of the k blocks if
    # any, else one of the holders, rotating with the stripe: decoding is spread over the nodes
    # and a host receives one segment per stripe, not k blocks.
    jobs = []  # (stripe, decoder node, inputs [(block number, node)], wanted [(slot, host node)])
    for i in sorted({s for j in lost for s, _ in layout.stripes_of(j)}):
        want = [(t, host[layout.data_pos(i, t)]) for t in range(layout.k) if layout.data_pos(i, t) in lost]
        inputs = [(t, source[layout.data_pos(i, t)]) for t in range(layout.k) if layout.data_pos(i, t) in source]
        inputs = (inputs + [(layout.k + p, holder[(i, p)]) for p in range(layout.m) if (i, p) in holder])[: layout.k]
        at = sorted({h for _, h in want} & {n for _, n in inputs})
        jobs.append((i, at[0] if at else inputs[i % len(inputs)][1], inputs, want))
    me = world.rank
    my_node = placement.node_of[me]
    leader = placement.leader(my_node) == me
    error: BaseException | None = None
    writers: dict[int, StreamWriter] = {}
    readers: dict[int, StreamReader] = {}
    received = 0
    try:
        if leader:
            for j in lost:
                if host[j] == my_node:
                    writers[j] = StreamWriter(root, [files[f] for f in layout.files_of(j)])
            for pos, n in source.items():
                if n == my_node:
                    readers[pos] = StreamReader(root, [files[f] for f in layout.files_of(pos)])
    except Exception as e:
        error = e
    codec = Codec(layout.k, layout.m, layout.codec)
    rounds = max((-(-layout.block(i) // CHUNK) for i, _, _, _ in jobs), default=0)
    got: dict[Any, torch.Tensor] = {}  # receive buffers, reused from round to round
    try:
        for r in range(rounds):

            def read(key: Any, n: int, r: int = r) -> torch.Tensor:
                nonlocal error
                job, num = key
                i = jobs[job][0]
                try:
                    if num < layout.k:
                        pos = layout.data_pos(i, num)
                        seg = layout.segment(pos)
                        return readers[pos].read(num * seg + r * CHUNK, n, (num + 1) * seg)
                    return read_tensor(root, parity_path(save_id, i, num - layout.k))[r * CHUNK : r * CHUNK + n]
                except Exception as e:
                    error = error or e
                    return torch.zeros(n, dtype=torch.uint8)

            def into(key: Any, n: int) -> torch.Tensor:
                if key not in got:
                    got[key] = torch.empty(CHUNK, dtype=torch.uint8)
                return got[key][:n]

            moves: list[Move] = []
            for x, (i, d, inputs, _) in enumerate(jobs):
                n = min(CHUNK, layout.block(i) - r * CHUNK)
                if n > 0:
                    moves += [(placement.leader(src), placement.leader(d), n, (x, num)) for num, src in inputs]
            _exchange(world, moves, read, into, f"{what} (round {r})")
            received += sum(n for src, dst, n, _ in moves if dst == me and src != me)
            decoded: dict[Any, torch.Tensor] = {}
            segments: list[Move] = []
            for x, (i, d, inputs, want) in enumerate(jobs):
                n = min(CHUNK, layout.block(i) - r * CHUNK)
                if n > 0 and placement.leader(d) == me and error is None:
                    out = codec.decode({num: got[(x, num)][:n].numpy() for num, _ in inputs}, [t for t, _ in want])
                    decoded.update({(x, t): torch.from_numpy(chunk) for t, chunk in out.items()})
                for t, h in want:  # the bytes of the lost segment in this chunk (the rest is padding)
                    keep = max(0, min(n, layout.segment(layout.data_pos(i, t)) - r * CHUNK))
                    segments.append((placement.leader(d), placement.leader(h), keep, (x, t)))

            def give(key: Any, n: int, decoded: dict = decoded) -> torch.Tensor:
                chunk = decoded.get(key)
                return chunk[:n] if chunk is not None else torch.zeros(n, dtype=torch.uint8)

            landed: set[Any] = set()  # segments received straight into their file's mapping

            def land(key: Any, n: int, r: int = r, landed: set = landed) -> torch.Tensor:
                x, t = key
                pos = layout.data_pos(jobs[x][0], t)
                w = writers.get(pos)
                view = w.view(t * layout.segment(pos) + r * CHUNK, n) if w is not None else None
                if view is None:
                    return into(("segment", key), n)
                landed.add(key)
                return view

            _exchange(world, segments, give, land, f"{what} (segments, round {r})")
            received += sum(n for src, dst, n, _ in segments if dst == me and src != me)
            for _, dst, n, (x, t) in segments:
                if dst == me and n and error is None and (x, t) not in landed:
                    pos = layout.data_pos(jobs[x][0], t)
                    seg = layout.segment(pos)
                    writers[pos].write(t * seg + r * CHUNK, got[("segment", (x, t))][:n].numpy())
        # A decoder that failed sent zeros: no rebuilt file is published unless every rank succeeded.
        everyone = dist.all_true(world, error is None, f"{what}: checking every rank's part")
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    finally:
        for reader in readers.values():
            reader.close()
    for w in writers.values():
        try:
            if error is None and everyone:
                w.commit()
            else:
                w.abort()
        except Exception as e:
            error = error or e
    if error is not None:
        logger.warning("rank %d: %s: %s", me, what, error)
    return host, received, error
