"""Replicated tensors whose copies differ between ranks: refused at the save, on every rank.

A plain tensor held by several ranks is one replicated global tensor; its holders each write a
slab of their own copy, so different copies would commit a tensor no rank held
(``tessera.engine.saving.replicas``).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import tessera
from tessera.engine.saving.handoff import EncodedValues, rank_report
from tessera.engine.saving.replicas import check_replicas, device_digest, host_digest
from tessera.errors import ReplicaMismatchError
from tessera.format.rank_report import decode_report, encode_report
from tests.dist_utils import run_distributed

NAN_A = torch.tensor([0x7FC00000], dtype=torch.int32).view(torch.float32)
NAN_B = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)  # another NaN payload


def _state(rank: int, w_differs: bool) -> dict:
    w = torch.arange(1000, dtype=torch.float32)
    if w_differs and rank == 1:
        w[517] = torch.nextafter(w[517], torch.tensor(1e9))  # one element, by one ulp
    nan = torch.tensor([1.0, float("nan"), -0.0, 3.0])
    return {
        "model": {"w": w, "same": torch.ones(3, 5), "nan": nan},
        "step": torch.tensor(7),
        "rng": tessera.per_rank(torch.full((4,), float(rank))),  # rank-local: never compared
    }


def _saves(rank: int, world: int, path: str) -> list[str]:
    out = []
    for i, (differs, background) in enumerate([(False, False), (True, False), (False, True), (True, True)]):
        try:
            state = _state(rank, differs)
            if background:
                tessera.async_save(path, state).wait()
            else:
                tessera.save(path, state)
            out.append(f"{i}: committed")
        except tessera.CheckpointError as e:
            out.append(f"{i}: {type(e).__name__}: {e}")
        committed = {"model": {"w": torch.zeros(1000), "same": torch.zeros(3, 5), "nan": torch.zeros(4)}}
        committed["step"] = torch.tensor(0)
        committed["rng"] = tessera.per_rank(torch.zeros(4))
        tessera.load(path, committed)
        expected = _state(rank, False)
        assert torch.equal(committed["model"]["w"], expected["model"]["w"]), (i, rank)  # never a mix
        assert torch.equal(committed["model"]["nan"].view(torch.int32), expected["model"]["nan"].view(torch.int32))
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_a_replicated_tensor_that_differs_on_one_rank_fails_the_save_on_every_rank(tmp_path, world: int) -> None:
    out = run_distributed(_saves, world, str(tmp_path / "c"))
    for rank, results in enumerate(out):
        ok0, bad1, ok2, bad3 = results
        assert ok0 == "0: committed" and ok2 == "2: committed", (rank, results)  # NaN and -0.0 copies agree
        for bad in (bad1, bad3):  # sync and async, a cached plan each time
            assert "ReplicaMismatchError" in bad and "'model.w'" in bad, (rank, bad)
            assert "ranks 1 hold one copy" in bad and ("ranks 0 hold" in bad or "ranks 0, 2 hold" in bad), bad
            assert "model.same" not in bad and "model.nan" not in bad and "rng" not in bad, bad


def _stages(rank: int, world: int, path: str, kind: str) -> str:
    """Pipeline-like: each rank holds a tensor of its own, and one shared tensor."""
    shared = torch.zeros(4)
    if kind == "zero" and rank == 1:
        shared[2] = -0.0  # other bits, equal as numbers
    if kind == "nan" and rank == 1:
        shared = torch.cat([NAN_B, torch.zeros(3)])
    elif kind == "nan":
        shared = torch.cat([NAN_A, torch.zeros(3)])
    try:
        tessera.save(path, {f"own{rank}": torch.full((3,), float(rank)), "shared": shared})
    except tessera.CheckpointError as e:
        return f"{type(e).__name__}: {e}"
    return "committed"


@pytest.mark.parametrize("kind", ["zero", "nan"])
def test_copies_that_differ_only_in_bits_are_refused_with_stage_local_tensors_beside(tmp_path, kind: str) -> None:
    out = run_distributed(_stages, 2, str(tmp_path / "c"), kind)
    for msg in out:
        assert msg.startswith("ReplicaMismatchError") and "'shared'" in msg and "'own" not in msg, msg
    assert not (tmp_path / "c" / "manifest.json").exists()


def _stage_digests(rank: int, world: int, path: str) -> list:
    """Three saves of pipeline-like state: which tensors each digests, and the third's outcome."""
    from tessera.engine.saving import prepare

    digested: list[tuple[str, ...]] = []
    real = prepare.digest_replicas

    def recording(*args, **kwargs):
        out = real(*args, **kwargs)
        digested.append(() if out is None else tuple(sorted(out.names)))
        return out

    prepare.digest_replicas = recording
    try:
        for i in range(3):
            shared = torch.zeros(4)
            if i == 2 and rank == 1:
                shared[1] = 1.0  # the copies differ on the save whose plan is cached
            try:
                tessera.save(path, {f"own{rank}": torch.full((3,), float(rank + i)), "shared": shared})
                outcome = "committed"
            except tessera.CheckpointError as e:
                outcome = f"{type(e).__name__}: {e}"
    finally:
        prepare.digest_replicas = real
    return [digested, outcome]


def test_a_cached_plan_digests_only_tensors_that_other_ranks_also_hold(tmp_path) -> None:
    """A stage's own weights have no other copy: once the gathered plan shows it, they are not
    digested (the call stays as short as before the check), while shared copies still are."""
    out = run_distributed(_stage_digests, 2, str(tmp_path / "c"))
    for rank, (digested, outcome) in enumerate(out):
        assert digested[0] == (f"own{rank}", "shared"), digested  # the first save knows no plan
        assert digested[1] == digested[2] == ("shared",), digested
        assert outcome.startswith("ReplicaMismatchError") and "'shared'" in outcome, outcome


def test_the_digests_see_every_bit_and_every_position() -> None:
    x = torch.randn(1001)
    variants = {
        "same": x.clone(),
        "one bit": x.view(torch.int32).clone().__ixor__(1 << 7).view(torch.float32),
        "swapped": x[torch.tensor([1, 0, *range(2, 1001)])],
        "negative zero": torch.where(torch.arange(1001) == 5, torch.tensor(-0.0), x),
        "positive zero": torch.where(torch.arange(1001) == 5, torch.tensor(0.0), x),
    }
    for digest in (host_digest, lambda t: int(device_digest(t))):
        seen = {name: digest(t) for name, t in variants.items()}
        assert seen["same"] == digest(x)
        assert len(set(seen.values())) == len(seen), seen
        assert digest(x[::2]) == digest(x[::2].contiguous())  # strides do not matter, values do
        a, b = torch.cat([NAN_A, x]), torch.cat([NAN_B, x])
        assert digest(a) == digest(a.clone()) and digest(a) != digest(b)
        for t in (torch.zeros(0), torch.ones(3, dtype=torch.uint8), torch.ones(1, dtype=torch.bfloat16)):
            assert digest(t) == digest(t.clone())
        assert digest(torch.tensor([1, 2, 3], dtype=torch.uint8)) != digest(torch.tensor([1, 3, 2], dtype=torch.uint8))


def test_rank_zero_names_each_tensor_and_which_ranks_hold_which_copy() -> None:
    names = ("a", "b", "c")
    same = np.array([1, 2, 3], dtype=np.uint64)
    check_replicas("ckpt", [(names, same), (names, same.copy()), None])
    other = np.array([1, 5, 3], dtype=np.uint64)
    with pytest.raises(ReplicaMismatchError, match=r"'b': ranks 0, 2 hold one copy; ranks 1 hold one copy") as e:
        check_replicas("ckpt", [(names, same), (names, other), (names, same)])
    assert "'a'" not in str(e.value) and "'c'" not in str(e.value)
    # Different tensor sets (pipeline stages) and different kinds of device are not differences.
    on_device = np.array([2 | 1 << 63], dtype=np.uint64)
    check_replicas("ckpt", [(("a", "b"), same[:2]), (("b", "x"), np.array([2, 9], dtype=np.uint64))])
    check_replicas("ckpt", [(("b",), same[1:2]), (("b",), on_device)])


def test_the_digests_travel_in_the_rank_report() -> None:
    digests = np.array([1, (1 << 64) - 1], dtype=np.uint64)
    doc = dataclasses.replace(rank_report(1, "s", [], EncodedValues({}, {}), {}), replicas=(("a", "b"), digests))
    back = decode_report(encode_report(doc), source="r", rank=1, save_id="s")
    assert back.replicas is not None and back.replicas[0] == ("a", "b")
    assert np.array_equal(back.replicas[1], digests)


def test_a_large_host_copy_digests_alike_in_pieces_with_or_without_threads() -> None:
    """Past 16 MiB a host copy is digested in fixed pieces (hashed by threads at the call): the
    digest must not depend on the thread count, and one changed element anywhere must change it."""
    from concurrent.futures import ThreadPoolExecutor

    t = torch.randn(5 << 20)  # 20 MiB: two pieces and a part
    with ThreadPoolExecutor(3) as pool:
        threaded = host_digest(t, pool)
    assert threaded == host_digest(t)
    for at in (0, (4 << 20) + 1, t.numel() - 1):
        u = t.clone()
        u[at] = u[at].item() + 1.0
        assert host_digest(u) != threaded, at
