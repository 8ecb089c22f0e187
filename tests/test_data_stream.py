"""Data streams that reshard: saved at DP=4 mid-epoch with data in flight, resumed at DP=2 and 3.

Every token identifies its document and place (``doc * 1000 + j``), so "each sample exactly
once" is a multiset comparison against the uninterrupted run.
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tessera
from tessera.errors import StateMismatchError
from tests.dist_utils import run_distributed

DOCS = [[d * 1000 + j for j in range(1 + (d * 7) % 11)] for d in range(60)]
ALL_TOKENS = Counter(t for d in DOCS for t in d)
SAMPLES = list(range(37))


def _stream(rank: int, world: int, *, pack: bool = True, source=None) -> tessera.adapters.ReshardableStream:
    if pack:
        return tessera.adapters.ReshardableStream(
            DOCS if source is None else source, rank=rank, world_size=world, seed=5, prefetch=2, pack_len=6
        )
    return tessera.adapters.ReshardableStream(SAMPLES, rank=rank, world_size=world, seed=5, prefetch=3, epochs=2)


def _take(stream: tessera.adapters.ReshardableStream, it, n: int | None, pack: bool) -> list[int]:
    out: list[int] = []
    for _ in range(n) if n is not None else itertools.count():
        try:
            item = next(it)
        except StopIteration:
            break
        out += item if pack else [item]
    return out


def _lanes(states, world: int, steps: list[int] | None, pack: bool) -> tuple[list[int], list[dict]]:
    """Run ``world`` streams in one process, rank r taking ``steps[r]`` items (None: to the end)."""
    streams = [_stream(r, world, pack=pack) for r in range(world)]
    if states is not None:
        for s, state in zip(streams, states):
            s.load_state_dict(state)
    seen: list[int] = []
    for r, s in enumerate(streams):
        seen += _take(s, iter(s), None if steps is None else steps[r], pack)
    return seen, [s.state_dict() for s in streams]


@settings(max_examples=40, deadline=None)
@given(
    pack=st.booleans(),
    old=st.integers(1, 5),
    new=st.integers(1, 5),
    skew=st.lists(st.integers(0, 12), min_size=5, max_size=5),
    again=st.integers(1, 4),
)
def test_resharding_keeps_every_sample_exactly_once(pack, old, new, skew, again):
    """Any DP sizes, ranks at different positions, resharded twice: nothing lost, nothing repeated."""
    everything = ALL_TOKENS if pack else Counter(SAMPLES * 2)
    first, states = _lanes(None, old, skew[:old], pack)
    second, states = _lanes(tessera.adapters.reshard_stream_states(states, new), new, skew[:new], pack)
    third, _ = _lanes(tessera.adapters.reshard_stream_states(states, again), again, None, pack)
    assert Counter(first + second + third) == everything


def test_same_dp_size_resumes_exactly_where_it_stopped(tmp_path):
    s = _stream(0, 1)
    it = iter(s)
    before = _take(s, it, 5, True)
    prefetched, tokens = s.in_flight()
    assert len(prefetched) == 2 and tokens  # data in flight at the save
    tessera.save(str(tmp_path / "c"), {"data": tessera.adapters.LoaderState(s)})
    rest = _take(s, it, None, True)
    resumed = _stream(0, 1)
    tessera.load(str(tmp_path / "c"), {"data": tessera.adapters.LoaderState(resumed)})
    assert _take(resumed, iter(resumed), None, True) == rest
    assert Counter(before + rest) == ALL_TOKENS


def test_errors():
    states = [_stream(r, 2).state_dict() for r in range(2)]
    with pytest.raises(StateMismatchError, match="saved world_size=2, this stream has 3"):
        _stream(0, 3).load_state_dict(states[0])
    with pytest.raises(StateMismatchError, match="saved source_len=60, this stream has 3"):
        _stream(0, 2, source=[[1]] * 3).load_state_dict(states[0])
    with pytest.raises(StateMismatchError, match="not one complete set of 2 ranks"):
        tessera.adapters.reshard_stream_states(states[:1], 3)
    with pytest.raises(TypeError, match="ReshardableStream or a StatefulDataLoader"):
        tessera.adapters.LoaderState([1, 2])
    with pytest.raises(ValueError, match=r"rank 2 must be in \[0, 2\)"):
        tessera.adapters.ReshardableStream(DOCS, rank=2, world_size=2)


# --------------------------------------------------------------------------------------
# Real DP jobs: 4 gloo ranks save mid-epoch, 2 or 3 ranks resume through tessera.load


def _dp_job(rank: int, world: int, path: str, save_after: int | None, resume: bool, loader: bool, pack: bool):
    """Each rank takes batches of 2 (to the end, or ``save_after`` batches then saves)."""
    stream = _stream(rank, world, pack=pack)
    source = stream
    if loader:
        from torchdata.stateful_dataloader import StatefulDataLoader

        source = StatefulDataLoader(stream, batch_size=2, collate_fn=list)
    state = {"data": tessera.adapters.LoaderState(source), "step": 0}
    if resume:
        tessera.load(path, state)
    it = iter(source)
    seen: list[int] = []
    n = 0
    while save_after is None or n < save_after:
        if loader:
            batch = next(it, None)
            if batch is None:
                break
            seen += [t for item in batch for t in (item if pack else [item])]
        else:
            got = _take(stream, it, 2, pack)
            if not got:
                break
            seen += got
        n += 1
    if save_after is not None:
        tessera.save(path, {"data": tessera.adapters.LoaderState(source), "step": n})
    return seen, stream.in_flight()


def _check_resharding(tmp_path, loader: bool, pack: bool) -> None:
    everything = ALL_TOKENS if pack else Counter(SAMPLES * 2)
    # The uninterrupted DP=4 run, its 4 ranks' streams driven in this process (no collective
    # is involved in reading, so this is exactly what the 4 processes would read).
    full, _ = _lanes(None, 4, None, pack)
    uninterrupted = Counter(full)
    assert uninterrupted == everything
    path = str(tmp_path / "ckpt")
    before = run_distributed(_dp_job, 4, path, 3, False, loader, pack)
    in_flight = [f for _, f in before]
    assert all(prefetched for prefetched, _ in in_flight)  # every rank holds prefetched samples
    if pack:
        assert any(tokens for _, tokens in in_flight)  # and packers hold tokens
    seen_before = [t for seen, _ in before for t in seen]
    assert 0 < len(seen_before) < sum(everything.values()) // 2  # saved mid-epoch
    for new_world in (2, 3):
        after = run_distributed(_dp_job, new_world, path, None, True, loader, pack)
        seen_after = [t for seen, _ in after for t in seen]
        assert Counter(seen_before + seen_after) == uninterrupted, f"resumed on {new_world} ranks"


def test_dp4_resumes_on_dp2_and_dp3(tmp_path):
    _check_resharding(tmp_path, loader=False, pack=True)


@pytest.mark.interop
@pytest.mark.parametrize(
    "pack", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["packed-tokens", "prefetched-samples"]
)
def test_stateful_dataloader_dp4_resumes_on_dp2_and_dp3(tmp_path, pack):
    pytest.importorskip("torchdata.stateful_dataloader")
    _check_resharding(tmp_path, loader=True, pack=pack)


@pytest.mark.interop
def test_stateful_dataloader_rejects_workers():
    tdl = pytest.importorskip("torchdata.stateful_dataloader")
    with pytest.raises(ValueError, match="num_workers=0"):
        tessera.adapters.LoaderState(tdl.StatefulDataLoader(_stream(0, 1), num_workers=2))


def _replicated_dp_job(rank: int, world: int, path: str, dp: int, save: bool):
    """``world`` processes as ``dp`` DP ranks, each stream shared by world // dp processes (TP-like)."""
    stream = _stream(rank * dp // world, dp)
    state = {"data": tessera.adapters.LoaderState(stream)}
    if not save:
        tessera.load(path, state)
    got = _take(stream, iter(stream), 3 + rank * dp // world if save else None, True)
    if save:
        tessera.save(path, state)
    return rank * dp // world, got


def test_streams_shared_by_several_processes_count_once(tmp_path):
    """Saved by 4 processes as 2 DP ranks x 2 replicas, resumed by 3 processes as 3 DP ranks."""
    path = str(tmp_path / "ckpt")
    before = run_distributed(_replicated_dp_job, 4, path, 2, True)
    assert before[0] == before[1] and before[2] == before[3]  # replicas read the same
    after = run_distributed(_replicated_dp_job, 3, path, 3, False)
    seen = before[0][1] + before[2][1] + [t for _, got in after for t in got]
    assert Counter(seen) == ALL_TOKENS
