"""tessera.adapters.megatron_core on single-process sharded state dicts built from real megatron-core classes.

The multi-process, trained-model checks against Megatron's own loader are in
tests/test_interop_megatron.py. These cover what a real 0.16 job does not produce or what
needs a hand-made case: ``flattened_range`` (megatron-core < 0.14; 0.16 refuses to build
one, so it is made with ``object.__new__``), objects that need pickle, padded vocabularies
whose saved shape differs, and factories.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

mapping = pytest.importorskip(
    "megatron.core.dist_checkpointing.mapping", reason="needs megatron-core (the interop extra)"
)

import tessera  # noqa: E402
from tessera.adapters.megatron_core import load_sharded_state_dict, save_sharded_state_dict  # noqa: E402

pytestmark = pytest.mark.interop


class Opaque:
    def __init__(self, x: int) -> None:
        self.x = x


def _st(key: str, data: torch.Tensor, shape: tuple[int, ...], offset: tuple[int, ...], **kw: object) -> object:
    return mapping.ShardedTensor(key, data, data.dtype, tuple(data.shape), shape, offset, None, **kw)


def test_tensors_objects_common_and_nonpersistent_round_trip(tmp_path) -> None:
    w = torch.arange(24.0).reshape(4, 6)
    sd = {
        "w": _st("layers.w", w, (1, 4, 6), (0, 0, 0), prepend_axis_num=1),  # e.g. layer 0 of 1
        "obj": mapping.ShardedObject("rng", {"seed": 3, "state": torch.arange(5)}, (1,), (0,)),
        "plain": mapping.ShardedObject("cfg", {"lr": 0.5}, (1,), (0,)),
        "local": mapping.LocalNonpersistentObject("not saved"),
        "iteration": 7,
        "groups": [{"lr": 0.1, "params": mapping.LocalNonpersistentObject([0, 1])}],
    }
    save_sharded_state_dict(str(tmp_path), sd)
    m = tessera.read_manifest(str(tmp_path))
    assert m.tensors["layers.w"].shape == (1, 4, 6)
    assert m.values["cfg/shard_0_1"] == {"lr": 0.5}  # plain objects inline, readable
    target = torch.zeros(2, 6)
    req = {
        "w": _st("layers.w", target, (1, 4, 6), (0, 2, 0), prepend_axis_num=1),
        "obj": mapping.ShardedObject("rng", None, (1,), (0,)),
        "plain": mapping.ShardedObject("cfg", None, (1,), (0,)),
        "local": mapping.LocalNonpersistentObject("mine"),
        "groups": [{"params": mapping.LocalNonpersistentObject([5])}],
    }
    out = load_sharded_state_dict(str(tmp_path), req)
    assert out["w"].data_ptr() == target.data_ptr() and torch.equal(target, w[2:])  # filled in place
    assert out["obj"]["seed"] == 3 and torch.equal(out["obj"]["state"], torch.arange(5))  # no pickle needed
    assert out["plain"] == {"lr": 0.5} and out["local"] == "mine"
    assert out["iteration"] == 7  # the checkpoint's common part, as Megatron merges it
    assert out["groups"] == [{"lr": 0.1, "params": [5]}]


def test_objects_needing_pickle_are_opt_in_at_save_and_load(tmp_path) -> None:
    sd = {"o": mapping.ShardedObject("o", Opaque(4), (1,), (0,))}
    with pytest.raises(tessera.errors.PickleNotAllowedError, match="'o/shard_0_1'"):
        save_sharded_state_dict(str(tmp_path), sd)
    save_sharded_state_dict(str(tmp_path), sd, allow_pickle=True)
    req = {"o": mapping.ShardedObject("o", None, (1,), (0,))}
    with pytest.raises(tessera.errors.PickleNotAllowedError, match="allow_pickle"):
        load_sharded_state_dict(str(tmp_path), req)
    assert load_sharded_state_dict(str(tmp_path), req, allow_pickle=True)["o"].x == 4


def test_megatron_lm_args_namespace_needs_no_pickle(tmp_path) -> None:
    import argparse

    sd = {"args": argparse.Namespace(lr=0.1, params_dtype=torch.bfloat16), "iteration": 3}
    save_sharded_state_dict(str(tmp_path), sd)
    out = load_sharded_state_dict(str(tmp_path), {})
    assert out == sd


def _flat_st(key: str, data: torch.Tensor, local_shape: tuple[int, ...], shape: tuple[int, ...],
             offset: tuple[int, ...], rng: slice) -> object:  # fmt: skip
    # megatron-core 0.16 refuses flattened_range in validate_metadata_integrity; older
    # releases (the distributed optimizer's fully_sharded_model_space) wrote exactly this.
    st = object.__new__(mapping.ShardedTensor)
    fields = dict(key=key, data=data, dtype=data.dtype, local_shape=local_shape, global_shape=shape,
                  global_offset=offset, axis_fragmentations=None, replica_id=0, prepend_axis_num=0,
                  allow_shape_mismatch=False, flattened_range=rng)  # fmt: skip
    for f in dataclasses.fields(mapping.ShardedTensor):
        object.__setattr__(st, f.name, fields[f.name])
    return st


def test_flattened_range_is_a_flat_shard_when_contiguous(tmp_path) -> None:
    g = torch.arange(24.0).reshape(4, 6)
    # Rank chunk = rows 2..3 (contiguous in the global order); the optimizer holds flat 3..10 of it.
    save_sharded_state_dict(str(tmp_path), {"a": _flat_st("a", g[2:].reshape(-1)[3:10].clone(), (2, 6), (4, 6), (2, 0), slice(3, 10)),
                                            "b": _st("a", g[:2].clone(), (4, 6), (0, 0)),
                                            "c": _flat_st("a", g[2:].reshape(-1)[:3].clone(), (2, 6), (4, 6), (2, 0), slice(0, 3)),
                                            "d": _flat_st("a", g[2:].reshape(-1)[10:].clone(), (2, 6), (4, 6), (2, 0), slice(10, 12))})  # fmt: skip
    out = torch.zeros(4, 6)
    tessera.load(str(tmp_path), {"a": out})
    assert torch.equal(out, g)
    bad = _flat_st("a", torch.zeros(3), (4, 3), (4, 6), (0, 3), slice(0, 3))  # a column block: not contiguous
    with pytest.raises(tessera.StateMismatchError, match="not one contiguous range"):
        save_sharded_state_dict(str(tmp_path / "x"), {"a": bad})


def test_padded_vocabulary_of_another_size_reads_the_overlap(tmp_path) -> None:
    emb = torch.randn(40, 4)
    save_sharded_state_dict(str(tmp_path), {"e": _st("emb", emb, (40, 4), (0, 0), allow_shape_mismatch=True)})
    # Loaded at TP=2 with the vocabulary padded to 48: rank 1 holds rows 24..47.
    target = torch.full((24, 4), 7.0)
    out = load_sharded_state_dict(str(tmp_path), {"e": _st("emb", target, (48, 4), (24, 0), allow_shape_mismatch=True)})
    assert torch.equal(out["e"][:16], emb[24:]) and torch.equal(out["e"][16:], torch.zeros(8, 4))
    with pytest.raises(tessera.StateMismatchError):  # without allow_shape_mismatch it is an error
        load_sharded_state_dict(str(tmp_path), {"e": _st("emb", torch.zeros(24, 4), (48, 4), (24, 0))})


def test_factory_is_built_on_save_and_merged_on_load(tmp_path) -> None:
    def build(key: str, t: torch.Tensor, replica_id: object, flattened_range: object) -> dict:
        return {"even": _st(f"{key}.even", t[0::2].contiguous(), (2, 3), (0, 0)),
                "odd": _st(f"{key}.odd", t[1::2].contiguous(), (2, 3), (0, 0))}  # fmt: skip

    def merge(sd: dict) -> torch.Tensor:
        return torch.stack([sd["even"], sd["odd"]], 1).reshape(4, 3)

    t = torch.randn(4, 3)
    save_sharded_state_dict(str(tmp_path), {"f": mapping.ShardedTensorFactory("fac", t, build, merge)})
    assert set(tessera.read_manifest(str(tmp_path)).tensors) == {"fac.even", "fac.odd"}
    out = load_sharded_state_dict(
        str(tmp_path), {"f": mapping.ShardedTensorFactory("fac", torch.zeros(4, 3), build, merge)}
    )
    assert torch.equal(out["f"], t)


def test_missing_tensor_is_an_error_when_strict(tmp_path) -> None:
    save_sharded_state_dict(str(tmp_path), {"a": _st("a", torch.ones(2), (2,), (0,))})
    req = {"b": _st("b", torch.zeros(2), (2,), (0,))}
    with pytest.raises(tessera.MissingKeysError, match="'b'|b"):
        load_sharded_state_dict(str(tmp_path), req)
    result: list = []
    load_sharded_state_dict(str(tmp_path), req, strict=False, result=result)
    assert result[0].missing_keys == ["b"]
