"""Hostile input: fuzzed manifests, escaping file references, pickle without opt-in, bad targets.

The manifest decoder must raise ManifestError or succeed (never another exception, never a
hang, never an allocation sized by numbers in the file); whatever it accepts, ``verify``
must report on and ``load`` must either load or raise a CheckpointError. Validation of
keys, shapes and dtypes happens before a single byte reaches the caller's tensors.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import shutil
import signal
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tessera
from tessera.format.manifest import MANIFEST_NAME, Manifest, decode
from tessera.storage import FileStorage
from tessera.tools.verification import ProblemKind, verify

NO_TIMINGS = tessera.LoadOptions(record_timings=False)
FUZZ = settings(
    max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)


@contextlib.contextmanager
def _time_limit(seconds: int) -> Iterator[None]:
    """Fail instead of hanging: SIGALRM raises in the main thread after ``seconds``."""

    def fire(signum, frame):
        raise TimeoutError(f"did not finish within {seconds}s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _state() -> dict:
    return {
        "w": torch.arange(32, dtype=torch.float32).reshape(8, 4),
        "h": torch.arange(6, dtype=torch.bfloat16),
        "z": torch.tensor(7, dtype=torch.int64),
        "step": 3,
        "cfg": {"lr": 0.5, "betas": (0.9, 0.99), "name": "adam", "raw": b"\x00\x01"},
        "pos": tessera.per_rank(11),
    }


def _blank() -> dict:
    return {
        "w": torch.zeros(8, 4),
        "h": torch.zeros(6, dtype=torch.bfloat16),
        "z": torch.tensor(0, dtype=torch.int64),
        "step": 0,
        "cfg": None,
        "pos": tessera.per_rank(0),
    }


@pytest.fixture(scope="module")
def valid(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    """A real checkpoint and its manifest document."""
    path = str(tmp_path_factory.mktemp("valid") / "ckpt")
    tessera.save(path, _state(), options=tessera.SaveOptions(chunk_bytes=4096))
    return path, json.loads(Path(path, MANIFEST_NAME).read_bytes())


@pytest.fixture
def ckpt(valid: tuple[str, dict], tmp_path) -> str:
    path = str(tmp_path / "ckpt")
    shutil.copytree(valid[0], path)
    return path


def _write_manifest(path: str, data: bytes) -> None:
    with open(os.path.join(path, MANIFEST_NAME), "wb") as f:
        f.write(data)


def _decode_or_manifest_error(data: bytes) -> Manifest | None:
    try:
        return decode(data)
    except tessera.errors.ManifestError:
        return None


# --------------------------------------------------------------------------------------
# Fuzzing the decoder, and what the rest of tessera does with what it accepts

_STRINGS = [
    "../../etc/passwd",
    "/etc/passwd",
    "data/../../x",
    "data/../manifest.json",
    "manifest.json",
    "s3://b/k",
    "float32",
    "bfloat16",
    "int64",
    "complex32",
    "bits16",
    "float4_e2m1fn_x2",
    "nonsense",
    "0" * 16,
    "f" * 16,
    "ffffffffffffffffff",
    "xxh3_64",
    "tessera",
    "error",
    "keep",
    "modulo",
    "__pickle__",
    "__tuple__",
    "__dict__",
    "__bytes__",
    "__float__",
    "__dtype__",
    "",
    "\x00",
    "é",
]
_INTS = [0, 1, -1, 2, 3, 7, 8, 64, 4095, 4096, 2**31, 2**53 + 1, 2**62, 2**63 - 1, 2**63, 2**64, 10**30, -(2**63)]
_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from(_INTS),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from(_STRINGS),
    st.text(max_size=12),
)
_json = st.recursive(
    _leaf,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5), st.dictionaries(st.sampled_from(_STRINGS) | st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=12,
)


def _paths(doc: object, prefix: tuple = ()) -> Iterator[tuple]:
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _paths(v, prefix + (i,))


def _mutate(doc: dict, data: st.DataObject) -> dict:
    doc = copy.deepcopy(doc)
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        paths = [p for p in _paths(doc) if p]
        path = data.draw(st.sampled_from(paths), label="path")
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        key = path[-1]
        op = data.draw(st.sampled_from(["replace", "delete", "duplicate", "nudge"]), label="op")
        if op == "replace":
            parent[key] = data.draw(_json, label="value")
        elif op == "delete":
            del parent[key]
        elif op == "duplicate" and isinstance(parent, list):
            parent.insert(key, copy.deepcopy(parent[key]))
        elif op == "nudge" and type(parent[key]) is int:
            parent[key] += data.draw(
                st.sampled_from([-(2**63), -65, -8, -4, -1, 1, 4, 8, 64, 2**62, 2**63]), label="delta"
            )
    return doc


def _exercise(path: str) -> None:
    """verify must report and load must load or raise a CheckpointError, for any accepted manifest."""
    report = verify(path, threads=1)
    assert isinstance(report.ok, bool) and all(p.message for p in report.problems)
    try:
        tessera.load(path, _blank(), strict=False, options=NO_TIMINGS)
    except tessera.CheckpointError:
        pass


@FUZZ
@given(doc=_json)
def test_decoder_on_random_json(doc: object) -> None:
    with _time_limit(20):
        _decode_or_manifest_error(json.dumps(doc).encode())


@FUZZ
@given(raw=st.binary(max_size=300))
def test_decoder_on_random_bytes(raw: bytes) -> None:
    with _time_limit(20):
        _decode_or_manifest_error(raw)


@FUZZ
@given(data=st.data())
def test_decoder_on_mutated_manifests(valid: tuple[str, dict], tmp_path_factory, data: st.DataObject) -> None:
    path, doc = valid
    work = str(tmp_path_factory.getbasetemp() / "mutated")
    if not os.path.exists(work):
        shutil.copytree(path, work)
    raw = json.dumps(_mutate(doc, data)).encode()
    with _time_limit(20):
        if _decode_or_manifest_error(raw) is None:
            return
        _write_manifest(work, raw)
        _exercise(work)


@FUZZ
@given(data=st.data())
def test_decoder_on_damaged_manifest_bytes(valid: tuple[str, dict], data: st.DataObject) -> None:
    raw = bytearray(Path(valid[0], MANIFEST_NAME).read_bytes())
    for _ in range(data.draw(st.integers(1, 4))):
        kind = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        i = data.draw(st.integers(0, len(raw) - 1))
        if kind == "flip":
            raw[i] ^= 1 << data.draw(st.integers(0, 7))
        elif kind == "cut":
            del raw[i:]
            if not raw:
                break
        else:
            raw[i:i] = data.draw(st.binary(min_size=1, max_size=8))
    with _time_limit(20):
        _decode_or_manifest_error(bytes(raw))


def test_zero_dim_tile_with_a_list_as_file_index_is_a_manifest_error(valid: tuple[str, dict]) -> None:
    doc = copy.deepcopy(valid[1])
    doc["tensors"]["z"]["tiles"][0][0] = []  # found by test_decoder_on_mutated_manifests
    with pytest.raises(tessera.errors.ManifestError):
        decode(json.dumps(doc).encode())


@pytest.mark.parametrize("where", ["chunk_bytes", "file_bytes"])
def test_integers_beyond_int64_are_manifest_errors(valid: tuple[str, dict], where: str) -> None:
    doc = copy.deepcopy(valid[1])
    if where == "chunk_bytes":
        doc["checksum"]["chunk_bytes"] = 2**63 + 4096  # found by test_decoder_on_mutated_manifests
    else:
        doc["files"][0]["bytes"] = 2**64
    with pytest.raises(tessera.errors.ManifestError):
        decode(json.dumps(doc).encode())


def test_deeply_nested_manifest_is_refused_quickly() -> None:
    with _time_limit(20):
        for depth in (10_000, 200_000):
            with pytest.raises(tessera.errors.ManifestError):
                decode(b"[" * depth + b"]" * depth)
            with pytest.raises(tessera.errors.ManifestError):
                decode(b'{"format": "tessera", "version": 1, "x": ' + b"[" * depth + b"]" * depth + b"}")


def _huge_shape_doc(doc: dict) -> dict:
    doc = copy.deepcopy(doc)
    doc["tensors"]["w"]["shape"] = [2**40, 2**40]
    return doc


def test_huge_shapes_are_refused_without_allocating(valid: tuple[str, dict], ckpt: str) -> None:
    _, doc = valid
    variants = [
        _huge_shape_doc(doc),
        {**doc, "tensors": {"big": {"dtype": "float64", "shape": [2**31] * 4, "tiles": []}}},
        {**doc, "tensors": {"big": {"dtype": "float32", "shape": [2**61], "tiles": []}}},
    ]
    tracemalloc.start()
    try:
        for variant in variants:
            with pytest.raises(tessera.errors.ManifestError, match="implausibly large"):
                decode(json.dumps(variant).encode())
        _write_manifest(ckpt, json.dumps(variants[0]).encode())
        with pytest.raises(tessera.errors.ManifestError):
            tessera.load(ckpt, _blank(), options=NO_TIMINGS)
        assert verify(ckpt).problems[0].kind == ProblemKind.MANIFEST
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"refusing a huge shape allocated {peak / 2**20:.1f} MiB"


def test_large_but_plausible_shape_loads_nothing_before_the_mismatch(valid: tuple[str, dict], ckpt: str) -> None:
    """A shape the decoder accepts but the caller's tensor does not match: refused up front."""
    _, doc = valid
    doc = copy.deepcopy(doc)
    doc["tensors"]["w"]["shape"] = [2**30, 4]  # tiles now cover a sliver: decodes, does not match
    _write_manifest(ckpt, json.dumps(doc).encode())
    tracemalloc.start()
    try:
        target = _blank()
        with pytest.raises(tessera.StateMismatchError, match=r"'w'.*\[1073741824, 4\]"):
            tessera.load(ckpt, target, options=NO_TIMINGS)
        report = verify(ckpt)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert torch.equal(target["w"], torch.zeros(8, 4))
    (p,) = report.problems
    assert p.kind == ProblemKind.COVERAGE and p.tensor == "w"
    assert peak < 8 << 20, f"{peak / 2**20:.1f} MiB"


def test_tile_outside_its_tensor_via_int64_overflow_is_refused(valid: tuple[str, dict]) -> None:
    doc = copy.deepcopy(valid[1])
    doc["tensors"]["w"]["tiles"][0][1] = [2**63 - 2, 0]  # shape [8, 4]; the tile's lengths stay [8, 4]
    with pytest.raises(tessera.errors.ManifestError):
        m = decode(json.dumps(doc).encode())
        raise AssertionError(f"accepted tile {m.tensors['w'].tiles[0]}")


def test_tile_outside_its_tensor_is_caught_by_load_and_verify(valid: tuple[str, dict], ckpt: str) -> None:
    doc = copy.deepcopy(valid[1])
    doc["tensors"]["w"]["tiles"][0][1] = [2**63 - 2, 0]
    _write_manifest(ckpt, json.dumps(doc).encode())
    target = _blank()
    with pytest.raises(tessera.CorruptCheckpointError, match="'w'"):
        tessera.load(ckpt, target, options=NO_TIMINGS)
    assert torch.equal(target["w"], torch.zeros(8, 4))
    kinds = {p.kind for p in verify(ckpt).problems}
    assert ProblemKind.COVERAGE in kinds or kinds == {ProblemKind.MANIFEST}, kinds


def test_malformed_tensor_policies_are_refused_or_ignored(tmp_path) -> None:
    path = str(tmp_path / "ckpt")
    tessera.save(path, {"rng": tessera.per_rank(torch.arange(4))})
    doc = json.loads(Path(path, MANIFEST_NAME).read_bytes())
    doc["metadata"]["tensor_policies"] = ["not", "a", "dict"]
    _write_manifest(path, json.dumps(doc).encode())
    target = {"rng": tessera.per_rank(torch.zeros(4, dtype=torch.int64))}
    try:
        tessera.load(path, target, options=NO_TIMINGS)
    except tessera.CheckpointError:
        return  # refusing the manifest is fine
    assert torch.equal(target["rng"].value, torch.arange(4))  # so is ignoring the informational metadata


# --------------------------------------------------------------------------------------
# File references outside the checkpoint

ESCAPES = [
    "../../etc/passwd",
    "/etc/passwd",
    "data/../../outside.safetensors",
    "..",
    "s3://bucket/key",
    "c:/x",
    "data\\x",
    "data/\x00x",
    "",
]


@pytest.mark.parametrize("ref", ESCAPES)
def test_file_references_outside_the_checkpoint_are_refused(valid: tuple[str, dict], ckpt: str, ref: str) -> None:
    doc = copy.deepcopy(valid[1])
    doc["files"][0]["path"] = ref
    raw = json.dumps(doc).encode()
    with pytest.raises(tessera.errors.ManifestError, match="file reference|outside"):
        decode(raw)
    _write_manifest(ckpt, raw)
    target = _blank()
    with pytest.raises(tessera.errors.ManifestError):
        tessera.load(ckpt, target, options=NO_TIMINGS)
    assert torch.equal(target["w"], torch.zeros(8, 4))
    (p,) = verify(ckpt).problems
    assert p.kind == ProblemKind.MANIFEST


def _aliases(path: str) -> list[str]:
    """Spellings of ``path`` (a data file reference) that normalise back to it, or to a shared reference."""
    head, save_id, name = path.split("/")
    return [
        f"{head}/./{save_id}/{name}",
        f"{head}//{save_id}/{name}",
        f"{head}/{save_id}/../{save_id}/{name}",
        f"{head}/{save_id}/{name}/",
        f"./{path}",
        f"@tiles/../{path}",
        f"@tiles/{save_id}/../../{path}",
        f"@tiles/./{save_id}/{name}",
        f"@tiles//{save_id}/{name}",
        "@tiles/0-0.safetensors",
        "@tiles/",
    ]


@pytest.mark.parametrize("k", range(11))
def test_non_canonical_file_references_are_refused_at_decode(valid: tuple[str, dict], ckpt: str, k: int) -> None:
    doc = copy.deepcopy(valid[1])
    ref = _aliases(doc["files"][0]["path"])[k]
    doc["files"][0]["path"] = ref
    raw = json.dumps(doc).encode()
    with pytest.raises(tessera.errors.CorruptCheckpointError, match=r"files\[0\].*" + re.escape(repr(ref))):
        decode(raw, lazy=True)
    _write_manifest(ckpt, raw)
    target = _blank()
    with pytest.raises(tessera.errors.ManifestError, match=re.escape(repr(ref))):
        tessera.load(ckpt, target, options=NO_TIMINGS)
    assert torch.equal(target["w"], torch.zeros(8, 4))
    (p,) = verify(ckpt).problems
    assert p.kind == ProblemKind.MANIFEST


@pytest.mark.parametrize("ref", ["../outside", "/etc/passwd", "a/../../b"])
def test_storage_refuses_paths_outside_its_root(tmp_path, ref: str) -> None:
    store = FileStorage(str(tmp_path / "root"))
    (tmp_path / "outside").write_text("secret")
    with pytest.raises(tessera.errors.ManifestError):
        store.read_file(ref)
    with pytest.raises(tessera.errors.ManifestError):
        store.write_file(ref, [b"x"])


# --------------------------------------------------------------------------------------
# Pickle only with opt-in


def _touch(marker: str) -> str:
    open(marker, "w").close()
    return "code from the checkpoint ran"


class _Payload:
    """Unpickling this runs ``_touch``: stands for arbitrary code in a checkpoint."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (_touch, (self.marker,))


def test_pickled_values_never_load_without_opt_in(tmp_path) -> None:
    path = str(tmp_path / "ckpt")
    marker = str(tmp_path / "pwned")
    with pytest.raises(tessera.errors.PickleNotAllowedError):
        tessera.save(path, {"w": torch.ones(2), "obj": _Payload(marker)})  # opt-in needed at save
    tessera.save(path, {"w": torch.ones(2), "obj": _Payload(marker)}, allow_pickle=True)
    assert not os.path.exists(marker)
    target = {"w": torch.zeros(2), "obj": None}
    with pytest.raises(tessera.errors.PickleNotAllowedError, match="'obj'.*allow_pickle=True"):
        tessera.load(path, target, options=NO_TIMINGS)
    assert not os.path.exists(marker) and target["obj"] is None
    report = verify(path)
    assert report.ok and report.pickled_values == ("obj",) and not os.path.exists(marker)
    tessera.load(path, target, allow_pickle=True, options=NO_TIMINGS)
    assert os.path.exists(marker) and target["obj"] == "code from the checkpoint ran"


def test_pickle_refusal_happens_before_any_tensor_is_touched(tmp_path) -> None:
    path = str(tmp_path / "ckpt")
    tessera.save(path, {"w": torch.ones(2), "obj": {1, 2}}, allow_pickle=True)
    target = {"w": torch.zeros(2), "obj": None}
    with pytest.raises(tessera.errors.PickleNotAllowedError):
        tessera.load(path, target, options=NO_TIMINGS)
    assert torch.equal(target["w"], torch.zeros(2)), "tensors were filled by a load that then failed"


# --------------------------------------------------------------------------------------
# Keys, shapes and dtypes are validated before any byte is copied


class _Tracker:
    """A Stateful that records whether load_state_dict was called."""

    def __init__(self) -> None:
        self.t = torch.zeros(3)
        self.loaded = False

    def state_dict(self) -> dict:
        return {"t": self.t}

    def load_state_dict(self, sd: dict) -> None:
        self.loaded = True


def _mismatch_target(kind: str) -> dict:
    t = {
        "a": torch.zeros(16),
        "m": {"b": torch.zeros(4, 4, dtype=torch.int32), "c": torch.zeros(5)},
        "k": -1,
        "s": _Tracker(),
    }
    if kind == "shape":
        t["m"]["c"] = torch.zeros(6)
    elif kind == "dtype":
        t["m"]["c"] = torch.zeros(5, dtype=torch.float64)
    elif kind == "missing":
        t["m"]["extra"] = torch.zeros(2)
    elif kind == "unexpected":
        del t["m"]["c"]
    elif kind == "tensor_vs_value":
        t["m"]["c"] = 0
    elif kind == "value_vs_tensor":
        t["k"] = torch.zeros(1)
    elif kind == "expanded":  # every element of the target is one memory location
        t["m"]["c"] = torch.zeros(1).expand(5)
    elif kind == "shared_storage":  # two targets overlap in memory
        t["m"]["c"] = t["a"][2:7]
    return t


@pytest.mark.parametrize(
    "kind",
    ["shape", "dtype", "missing", "unexpected", "tensor_vs_value", "value_vs_tensor", "expanded", "shared_storage"],
)
def test_a_failed_validation_leaves_every_target_untouched(tmp_path, kind: str) -> None:
    path = str(tmp_path / "ckpt")
    saved = {
        "a": torch.arange(16, dtype=torch.float32),
        "m": {"b": torch.ones(4, 4, dtype=torch.int32), "c": torch.full((5,), 2.0)},
        "k": 9,
        "s": {"t": torch.full((3,), 4.0)},
    }
    tessera.save(path, saved)
    target = _mismatch_target(kind)
    before = {k: v.clone() for k, v in [("a", target["a"]), ("b", target["m"]["b"])]}
    with pytest.raises(tessera.StateMismatchError) as info:
        tessera.load(path, target, options=NO_TIMINGS)
    assert "'m." in str(info.value) or "'k'" in str(info.value)
    assert torch.equal(target["a"], before["a"]) and torch.equal(target["m"]["b"], before["b"])
    assert torch.equal(target["s"].t, torch.zeros(3)) and not target["s"].loaded
    assert target["k"] == -1 or (isinstance(target["k"], torch.Tensor) and torch.equal(target["k"], torch.zeros(1)))


@pytest.mark.parametrize(
    "edit",
    [
        lambda doc: doc["tensors"]["z"]["tiles"][0].__setitem__(0, []),
        lambda doc: doc["checksum"].__setitem__("chunk_bytes", 2**63 + 4096),
    ],
    ids=["list-file-index", "huge-chunk-bytes"],
)
def test_verify_reports_any_manifest_the_decoder_cannot_take(valid: tuple[str, dict], ckpt: str, edit) -> None:
    doc = copy.deepcopy(valid[1])
    edit(doc)
    _write_manifest(ckpt, json.dumps(doc).encode())
    (p,) = verify(ckpt).problems
    assert p.kind == ProblemKind.MANIFEST and p.file == MANIFEST_NAME


def test_tied_targets_that_are_one_view_still_load(tmp_path) -> None:
    path = str(tmp_path / "ckpt")
    w = torch.arange(6, dtype=torch.float32)
    tessera.save(path, {"embed.weight": w, "head.weight": w})
    tied = torch.zeros(6)
    tessera.load(path, {"embed.weight": tied, "head.weight": tied}, options=NO_TIMINGS)
    assert torch.equal(tied, w)


def test_interleaved_but_disjoint_views_load(tmp_path) -> None:
    path = str(tmp_path / "ckpt")
    cols = {f"c{i}": torch.arange(4, dtype=torch.float32) + 10 * i for i in range(3)}
    tessera.save(path, cols)
    fused = torch.zeros(4, 3)
    tessera.load(path, {f"c{i}": fused[:, i] for i in range(3)}, options=NO_TIMINGS)
    assert torch.equal(fused, torch.stack([cols[f"c{i}"] for i in range(3)], dim=1))


def _split_tiles_with_a_gap(path: str) -> None:
    """Rewrite the single tile of 'w' (8 floats) as [0, 4) and [5, 8): element 4 is in no tile."""
    import xxhash

    mpath = os.path.join(path, MANIFEST_NAME)
    doc = json.loads(Path(mpath).read_bytes())
    f, _, _, off, _ = doc["tensors"]["w"]["tiles"][0]
    data = Path(path, doc["files"][f]["path"]).read_bytes()

    def tile(start: int, n: int) -> list:
        b = off + 4 * start
        return [f, [start], [n], b, [f"{xxhash.xxh3_64_intdigest(data[b : b + 4 * n]):016x}"]]

    doc["tensors"]["w"]["tiles"] = [tile(0, 4), tile(5, 3)]
    _write_manifest(path, json.dumps(doc).encode())


def _load_half_with_a_gap(rank: int, world: int, path: str) -> dict:
    target = {"w": tessera.ShardedTensor(torch.full((4,), -1.0), (8,), (4 * rank,))}
    try:
        tessera.load(path, target, options=NO_TIMINGS)
        kind, message = "no error", ""
    except tessera.CheckpointError as e:
        kind, message = type(e).__name__, str(e)
    return {"kind": kind, "message": message, "untouched": torch.equal(target["w"].local, torch.full((4,), -1.0))}


def test_a_coverage_gap_on_one_rank_stops_every_rank_before_it_writes(tmp_path) -> None:
    from tests.dist_utils import run_distributed

    path = str(tmp_path / "ckpt")
    tessera.save(path, {"w": torch.arange(8, dtype=torch.float32)})
    _split_tiles_with_a_gap(path)
    out = run_distributed(_load_half_with_a_gap, 2, path)
    for rank, o in enumerate(out):
        assert o["kind"] == "CorruptCheckpointError" and "'w'" in o["message"], (rank, o)
        assert "rank 1" in o["message"], (rank, o)
        assert o["untouched"], f"rank {rank} wrote into its target before every rank had validated"


def _alias_on_rank1(rank: int, world: int, path: str) -> dict:
    a = torch.full((4,), -1.0)
    b = torch.zeros(1).expand(4) if rank == 1 else torch.full((4,), -1.0)
    try:
        tessera.load(path, {"a": a, "b": b}, options=NO_TIMINGS)
        kind = "no error"
    except tessera.StateMismatchError as e:
        kind = type(e).__name__
    return {"kind": kind, "untouched": torch.equal(a, torch.full((4,), -1.0))}


def test_an_aliased_target_on_one_rank_stops_every_rank_before_it_writes(tmp_path) -> None:
    from tests.dist_utils import run_distributed

    path = str(tmp_path / "ckpt")
    tessera.save(path, {"a": torch.arange(4, dtype=torch.float32), "b": torch.ones(4)})
    out = run_distributed(_alias_on_rank1, 2, path)
    assert [o["kind"] for o in out] == ["StateMismatchError"] * 2, out
    assert all(o["untouched"] for o in out), out


# --------------------------------------------------------------------------------------
# Decoding is bounded by the bytes read (issue #10, item 7)


def _b64z(arr) -> str:
    import base64
    import zlib

    import numpy as np

    return base64.b64encode(zlib.compress(np.ascontiguousarray(arr).tobytes(), 9)).decode()


def _b64z_full(count: int, value: int, dtype: str, chunk: int = 1 << 24) -> str:
    """``_b64z(np.full(count, value, dtype))`` without the array or a deflate pass over all of
    it (2 GiB for 268 M checksums: seconds of level-9 compression).

    Deflate state is reset at a full flush, so every ``chunk``-byte piece of a constant array
    compresses to the same bytes: compress one, repeat it, compress the rest and write the
    Adler-32 of the whole stream at the end.
    """
    import base64
    import struct
    import zlib

    import numpy as np

    item = np.full(1, value, dtype).tobytes()
    chunk -= chunk % len(item)
    total = count * len(item)
    repeats, rest = divmod(total, chunk)
    piece = item * (chunk // len(item))
    z = zlib.compressobj(9)
    out = [z.compress(b"")]  # the 2-byte zlib header
    if repeats:
        body = z.compress(piece) + z.flush(zlib.Z_FULL_FLUSH)
        out.append(body * repeats)
    tail = z.compress(item * (rest // len(item))) + z.flush()
    adler = 1
    for _ in range(repeats):
        adler = zlib.adler32(piece, adler)
    adler = zlib.adler32(item * (rest // len(item)), adler)
    out.append(tail[:-4] + struct.pack(">I", adler))
    return base64.b64encode(b"".join(out)).decode()


def _table_doc(doc: dict, name: str, shape: list[int], count: int, lengths: int, chunks: int) -> dict:
    """A tile table of ``count`` tiles at offset 0 with the given lengths and chunk counts (compresses to almost nothing)."""
    doc = copy.deepcopy(doc)
    zeros = _b64z_full(count, 0, "<i8")
    doc["tensors"][name] = {
        "dtype": "uint8",
        "shape": shape,
        "tile_table": {
            "count": count,
            "file": zeros,
            "offsets": zeros,
            "lengths": _b64z_full(count, lengths, "<i8"),
            "byte_offset": zeros,
            "chunks": _b64z_full(count, chunks, "<i8"),
            "checksums": _b64z_full(count * chunks, 0, "<u8"),
        },
    }
    return doc


@pytest.mark.parametrize(
    ("count", "value", "dtype", "chunk"),
    [(0, 0, "<i8", 64), (5, 7, "<i8", 64), (8, 1, "<i8", 64), (1001, 3, "<u8", 64), (1000, 0, "<i8", 1 << 24)],
)
def test_the_constant_table_helper_is_the_array(count: int, value: int, dtype: str, chunk: int) -> None:
    import base64
    import zlib

    import numpy as np

    got = zlib.decompress(base64.b64decode(_b64z_full(count, value, dtype, chunk=chunk)))
    assert got == np.full(count, value, dtype).tobytes()


def _peak(fn) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize(
    ("shape", "count", "lengths", "chunks", "match"),
    [
        ([0], 1 << 24, 0, 0, "tile_table.count"),  # 16.7 M zero-length tiles (the 0.87 MB manifest)
        ([1], 1 << 22, 1, 1, "tile_table.count"),  # 4 M one-byte tiles, each with a compressible checksum
        ([1], 1 << 12, 1, 1 << 16, r"tile_table.chunks"),  # few tiles declaring 268 M checksums
    ],
    ids=["zero-length-16.7M", "tiny-4M", "many-checksums"],
)
def test_a_compressed_tile_table_cannot_size_allocations(
    valid: tuple[str, dict], ckpt: str, shape, count, lengths, chunks, match
) -> None:
    data = json.dumps(_table_doc(valid[1], "z", shape, count, lengths, chunks)).encode()
    assert len(data) < 4 << 20
    with _time_limit(30):
        peak = _peak(lambda: _expect_manifest_error(data, match))
        assert peak < 8 * len(data) + (4 << 20), (
            f"refusing a {len(data)}-byte manifest allocated {peak / 2**20:.1f} MiB"
        )
        _write_manifest(ckpt, data)
        with pytest.raises(tessera.errors.ManifestError, match=match):
            tessera.load(ckpt, _blank(), options=NO_TIMINGS)
        (p,) = verify(ckpt).problems
        assert p.kind == ProblemKind.MANIFEST and "tile_table" in p.message


def _expect_manifest_error(data: bytes, match: str) -> None:
    with pytest.raises(tessera.errors.ManifestError, match=match):
        decode(data)


def test_zero_length_tiles_are_refused(valid: tuple[str, dict]) -> None:
    data = json.dumps(_table_doc(valid[1], "z", [4, 0], 17, 0, 0)).encode()
    doc = json.loads(data)
    import numpy as np

    doc["tensors"]["z"]["tile_table"]["offsets"] = _b64z(np.zeros(34, dtype="<i8"))  # 17 tiles x 2 dims
    doc["tensors"]["z"]["tile_table"]["lengths"] = _b64z(np.zeros(34, dtype="<i8"))
    with pytest.raises(tessera.errors.ManifestError, match="hold no element"):
        decode(json.dumps(doc).encode())


def test_an_oversized_manifest_is_refused_before_it_is_read(ckpt: str) -> None:
    path = os.path.join(ckpt, MANIFEST_NAME)
    with open(path, "r+b") as f:
        f.truncate(int(1.06 * (1 << 30)))  # sparse: no disk used, but 1.06 GiB if read
    with _time_limit(20):
        peak = _peak(lambda: _expect_read_error(ckpt))
        assert peak < 1 << 20, f"the size check read {peak / 2**20:.1f} MiB of the manifest"
        (p,) = verify(ckpt).problems
        assert p.kind == ProblemKind.MANIFEST and "limit" in p.message
        with pytest.raises(tessera.errors.ManifestError, match="size"):
            tessera.load(ckpt, _blank(), options=NO_TIMINGS)


def _expect_read_error(path: str) -> None:
    with pytest.raises(tessera.errors.ManifestError, match=r"size \d+ bytes is over the 1073741824-byte limit"):
        tessera.read_manifest(path)


def test_a_manifest_that_is_a_directory_is_a_manifest_error(tmp_path) -> None:
    os.makedirs(tmp_path / "ckpt" / MANIFEST_NAME)
    with pytest.raises(tessera.errors.ManifestError, match="not a regular file"):
        tessera.load(str(tmp_path / "ckpt"), {"w": torch.zeros(1)}, options=NO_TIMINGS)
    assert verify(str(tmp_path / "ckpt")).problems[0].kind == ProblemKind.MANIFEST


def test_a_file_entry_naming_a_directory_is_a_typed_error(valid: tuple[str, dict], ckpt: str) -> None:
    doc = copy.deepcopy(valid[1])
    doc["files"][0]["path"] = "data"  # a directory; its recorded size still covers the tiles
    _write_manifest(ckpt, json.dumps(doc).encode())
    with pytest.raises(tessera.CorruptCheckpointError, match="'data'.*not a regular file"):
        tessera.load(ckpt, _blank(), options=NO_TIMINGS)
    problems = verify(ckpt).problems
    assert problems and all(p.file == "data" for p in problems if p.file)


def test_verify_memory_stays_bounded_with_many_tiles(tmp_path) -> None:
    # 20 000 real one-element tiles (a FlatShard-like layout written by hand): verify keeps
    # per-tile arrays, not per-tile objects.
    import numpy as np
    import xxhash

    path = str(tmp_path / "ckpt")
    n = 20_000
    tessera.save(path, {"w": torch.arange(n, dtype=torch.int32)})
    doc = json.loads(Path(path, MANIFEST_NAME).read_bytes())
    f, _, _, off, _ = doc["tensors"]["w"]["tiles"][0]
    raw = Path(path, doc["files"][f]["path"]).read_bytes()
    checks = np.array([xxhash.xxh3_64_intdigest(raw[off + 4 * i : off + 4 * i + 4]) for i in range(n)], dtype="<u8")
    doc["tensors"]["w"] = {
        "dtype": "int32",
        "shape": [n],
        "tile_table": {
            "count": n,
            "file": _b64z(np.full(n, f, "<i8")),
            "offsets": _b64z(np.arange(n, dtype="<i8")),
            "lengths": _b64z(np.ones(n, "<i8")),
            "byte_offset": _b64z(off + 4 * np.arange(n, dtype="<i8")),
            "chunks": _b64z(np.ones(n, "<i8")),
            "checksums": _b64z(checks),
        },
    }
    data = json.dumps(doc).encode()
    _write_manifest(path, data)
    target = {"w": torch.zeros(n, dtype=torch.int32)}
    tessera.load(path, target, options=NO_TIMINGS)
    assert torch.equal(target["w"], torch.arange(n, dtype=torch.int32))
    report = None

    def run() -> None:
        nonlocal report
        report = verify(path, threads=1)

    peak = _peak(run)
    assert report is not None and report.tiles == n and report.bytes_checked == 4 * n
    # Only the data file's header disagrees (it names one tile): every checksum matches.
    assert {p.kind for p in report.problems} == {ProblemKind.HEADER}
    assert peak < 16 * len(data) + (4 << 20), f"verify of {n} tiles peaked at {peak / 2**20:.1f} MiB"


# --------------------------------------------------------------------------------------
# The one safetensors header module: what it writes the safetensors library reads; what it
# parses is bounded and refused with a clear error when hostile.


def test_safetensors_header_is_read_by_the_safetensors_library(tmp_path: Path) -> None:
    from safetensors import safe_open

    from tessera.format.safetensors_header import ALIGN, encode_header, read_file_header, tensor_entries

    w = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    b = torch.tensor([1, 2, 3], dtype=torch.int16)
    entries = [("w", "F32", (2, 3), 24), ("b", "I16", (3,), 6)]
    header = encode_header(entries, {"producer": "test"})
    assert len(header) % ALIGN == 0
    path = tmp_path / "x.safetensors"
    path.write_bytes(header + w.numpy().tobytes() + b.numpy().tobytes())
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"format": "pt", "producer": "test"}
        assert torch.equal(f.get_tensor("w"), w) and torch.equal(f.get_tensor("b"), b)
    parsed, data_start = read_file_header(str(path))
    assert data_start == len(header)
    assert tensor_entries(parsed) == {
        "w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
        "b": {"dtype": "I16", "shape": [3], "data_offsets": [24, 30]},
    }


@pytest.mark.parametrize(
    ("raw", "error", "match"),
    [
        (b"\x01\x00", ValueError, "2 bytes is too short for a safetensors header"),
        ((1 << 40).to_bytes(8, "little") + b"{}", ValueError, "header length 1099511627776 exceeds the file"),
        ((200 << 20).to_bytes(8, "little"), ValueError, "exceeds the file or the 104857600-byte limit"),
        ((4).to_bytes(8, "little") + b"{{{{", ValueError, "Expecting property name"),
        ((2).to_bytes(8, "little") + b"[]", TypeError, "the header is not a JSON object"),
    ],
)
def test_hostile_safetensors_headers_are_refused(tmp_path: Path, raw: bytes, error: type, match: str) -> None:
    from tessera.format.safetensors_header import parse_header, read_file_header

    reads: list[tuple[int, int]] = []

    def read(start: int, n: int) -> bytes:
        reads.append((start, n))
        return raw[start : start + n]

    size = len(raw) if len(raw) > 20 or raw[:2] == b"\x01\x00" else 300 << 20  # a huge file, a short read
    with pytest.raises(error, match=match):
        parse_header(read, size)
    assert all(n <= 8 or n <= len(raw) for _, n in reads)  # never a read of the declared (hostile) length
    path = tmp_path / "bad.safetensors"
    path.write_bytes(raw)
    with pytest.raises((ValueError, TypeError), match="bad.safetensors is not a safetensors file"):
        read_file_header(str(path))
