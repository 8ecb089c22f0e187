"""A declarative spec of a tensor- and pipeline-parallel (Megatron-style) model layout.

A :class:`LayoutSpec` says, per parameter-name pattern, how a TP rank holds a parameter
(:class:`Replicated`, :class:`Split` along a dimension, :class:`PaddedVocab`, :class:`Fused`
sub-parameters such as QKV or SwiGLU gate/up, or :class:`Skip`), and which names are
numbered per pipeline stage (:class:`LayerStack`). From it, a TP x PP rank's local state
dict becomes global tiles keyed by global FQN (``to_global``), and an empty local state for
any other TP x PP rank can be built from the global shapes (``empty_local``) and filled by
``tessera.load`` through the tiles (``global_targets``). See ``docs/layouts.md``.

Rules are strict on purpose: a parameter that matches no rule or several rules, or whose
shape does not fit its rule under the TP size, is a :class:`~tessera.StateMismatchError`
naming the parameter. Nothing here communicates; every function is pure and local.

This module holds the vocabulary and the per-tensor geometry; :mod:`.megatron` holds
:class:`~tessera.adapters.megatron.MegatronSpec`, which applies it to whole state dicts.
"""

from __future__ import annotations

import fnmatch
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum

import torch

from ..errors import StateMismatchError

logger = logging.getLogger(__name__)

__all__ = [
    "ExpertStack",
    "Fused",
    "LayerStack",
    "PaddedVocab",
    "ParamLayout",
    "PipelineStage",
    "Replicated",
    "Rule",
    "Skip",
    "Split",
    "TilePiece",
]

Shape = tuple[int, ...]


@dataclass(frozen=True, eq=False)
class TilePiece:
    """One box of a global tensor held by a local tensor (a view of it)."""

    name: str
    global_shape: Shape
    global_offset: Shape
    view: torch.Tensor


class ParamLayout:
    """How a TP rank holds one parameter; subclasses are the spec's vocabulary.

    ``tiles`` maps a local tensor to boxes of global tensors, ``local_shape`` maps global
    shapes back to the local shape, ``padding`` lists the local elements no global tensor
    owns (zeroed before a load).
    """

    def global_names(self, name: str) -> list[str]:
        """The global tensors this parameter holds tiles of."""
        return [name]

    def tiles(self, name: str, local: torch.Tensor, tp_rank: int, tp_size: int) -> list[TilePiece]:
        raise NotImplementedError

    def local_shape(self, name: str, shapes: Mapping[str, Shape], tp_size: int) -> Shape:
        raise NotImplementedError

    def padding(self, name: str, local: torch.Tensor, tp_rank: int, tp_size: int) -> list[torch.Tensor]:
        return []


def _check_dim(name: str, dim: int, ndim: int, what: str) -> None:
    if not 0 <= dim < ndim:
        raise StateMismatchError(f"parameter '{name}': {what} splits dimension {dim}, but it has {ndim} dimension(s)")


def _with(shape: Sequence[int], dim: int, size: int | Sequence[int]) -> Shape:
    sizes = (size,) if isinstance(size, int) else tuple(size)
    return tuple(shape[:dim]) + sizes + tuple(shape[dim + 1 :])


@dataclass(frozen=True)
class Replicated(ParamLayout):
    """Every TP rank holds the whole tensor (layer norms, row-parallel biases)."""

    def tiles(self, name: str, local: torch.Tensor, tp_rank: int, tp_size: int) -> list[TilePiece]:
        return [TilePiece(name, tuple(local.shape), (0,) * local.dim(), local)]

    def local_shape(self, name: str, shapes: Mapping[str, Shape], tp_size: int) -> Shape:
        return shapes[name]


@dataclass(frozen=True)
class Split(ParamLayout):
    """Evenly split along ``dim`` across TP ranks, rank order = position.

    Column-parallel linear weights (``[out, in]``) and their biases split ``dim=0``;
    row-parallel weights split ``dim=1``.
    """

    dim: int

    def tiles(self, name: str, local: torch.Tensor, tp_rank: int, tp_size: int) -> list[TilePiece]:
        _check_dim(name, self.dim, local.dim(), "Split")
        n = local.shape[self.dim]
        shape = _with(local.shape, self.dim, n * tp_size)
        return [TilePiece(name, shape, _with((0,) * local.dim(), self.dim, n * tp_rank), local)]

    def local_shape(self, name: str, shapes: Mapping[str, Shape], tp_size: int) -> Shape:
        shape = shapes[name]
        _check_dim(name, self.dim, len(shape), "Split")
        if shape[self.dim] % tp_size:
            raise StateMismatchError(
                f"parameter '{name}' of global shape {list(shape)}: dimension {self.dim} ({shape[self.dim]}) "
                f"does not split evenly across {tp_size} TP ranks"
            )
        return _with(shape, self.dim, shape[self.dim] // tp_size)


@dataclass(frozen=True)
class PaddedVocab(ParamLayout):
    """A vocabulary dimension padded for TP, saved at its true size.

    Megatron pads the vocabulary to a multiple of ``make_vocab_size_divisible_by * tp``
    and splits it evenly. The saved global tensor has ``vocab_size`` entries along ``dim``;
    padding rows are dropped on save and zeroed on load.

    Attributes:
        vocab_size: the true vocabulary size.
        pad_to_multiple_of: Megatron's ``make_vocab_size_divisible_by`` (before the TP factor).
        dim: the vocabulary dimension.
    """

    vocab_size: int
    pad_to_multiple_of: int = 1
    dim: int = 0

    def __post_init__(self) -> None:
        if self.vocab_size < 1 or self.pad_to_multiple_of < 1:
            raise ValueError(f"PaddedVocab needs vocab_size >= 1 and pad_to_multiple_of >= 1, got {self}")

    def padded_size(self, tp_size: int) -> int:
        """The padded vocabulary size under ``tp_size`` ranks."""
        m = self.pad_to_multiple_of * tp_size
        return -(-self.vocab_size // m) * m

    def _rows(self, name: str, local: torch.Tensor, tp_rank: int, tp_size: int) -> tuple[int, int]:
        _check_dim(name, self.dim, local.dim(), "PaddedVocab")
        n = local.shape[self.dim]
        if n * tp_size != self.padded_size(tp_size):
            raise StateMismatchError(
                f"parameter '{name}': local vocabulary dimension {self.dim} has {n} entries, so {n * tp_size} over "
                f"{tp_size} TP ranks, but vocab_size={self.vocab_size} padded to a multiple of "
                f"{self.pad_to_multiple_of}*{tp_size} is {self.padded_size(tp_size)}; check pad_to_multiple_of"
            )
        start = n * tp_rank
        return start, max(0, min(n, self.vocab_size - start))

    def tiles(self, name: str, local: torch.Tensor, tp_rank: int, tp_size: int) -> list[TilePiece]:
        start, real = self._rows(name, local, tp_rank, tp_size)
        shape = _with(local.shape, self.dim, self.vocab_size)
        offset = _with((0,) * local.dim(), self.dim, min(start, self.vocab_size))
        return [TilePiece(name, shape, offset, local.narrow(self.dim, 0, real))]

    def local_shape(self, name: str, shapes: Mapping[str, Shape], tp_size: int) -> Shape:
        shape = shapes[name]
        _check_dim(name, self.dim, len(shape), "PaddedVocab")
        if shape[self.dim] != self.vocab_size:
            raise StateMismatchError(
                f"parameter '{name}' of global shape {list(shape)}: dimension {self.dim} should be the true "
                f"vocabulary size {self.vocab_size}"
            )
        return _with(shape, self.dim, self.padded_size(tp_size) // tp_size)

    def padding(self, name: str, local: torch.Tensor, tp_rank: int, tp_size: int) -> list[torch.Tensor]:
        _, real = self._rows(name, local, tp_rank, tp_size)
        n = local.shape[self.dim]
        return [local.narrow(self.dim, real, n - real)] if real < n else []


@dataclass(frozen=True)
class Fused(ParamLayout):
    """Sub-parameters concatenated along ``dim`` (QKV, SwiGLU gate/up), saved unfused.

    The fused tensor is ``groups`` repetitions of the parts in order, each part ``size``
    long along ``dim``: Megatron-core's GQA ``linear_qkv`` is ``groups=num_query_groups``
    with parts ``q: heads_per_group * head_dim, k: head_dim, v: head_dim``; SwiGLU's
    ``linear_fc1`` is ``groups=1`` with parts ``gate: ffn, up: ffn``. TP splits whole groups
    when ``tp`` divides ``groups`` and splits every part of a group evenly when ``groups``
    divides ``tp``; anything else is an error.

    Each part is saved as its own global tensor named by ``name`` (``{module}``: the
    parameter's name up to its last dot, ``{leaf}``: the rest, ``{part}``, ``{name}``: the
    whole name), so any TP size can reload it. With ``groups > 1`` the part keeps a group
    dimension at ``dim`` (``q`` is ``[groups, heads_per_group * head_dim, hidden]``); its
    row-major bytes are exactly the usual unfused tensor, so ``.reshape(-1, hidden)`` gives
    ``q_proj``. That keeps each rank's share one box for every TP size.

    Attributes:
        dim: the fused dimension.
        parts: ``(part_name, size_per_group)`` in fused order.
        groups: how many times the parts repeat along ``dim``.
        name: template of the global names of the parts.
    """

    dim: int
    parts: tuple[tuple[str, int], ...]
    groups: int = 1
    name: str = "{module}.{part}.{leaf}"

    def __post_init__(self) -> None:
        object.__setattr__(self, "parts", tuple((str(p), int(s)) for p, s in self.parts))
        names = [p for p, _ in self.parts]
        if not names or len(set(names)) != len(names) or any(s < 1 for _, s in self.parts) or self.groups < 1:
            raise ValueError(f"Fused needs distinct part names with sizes >= 1 and groups >= 1, got {self}")
        if "{part}" not in self.name:
            raise ValueError(f"Fused name template {self.name!r} must contain '{{part}}'")

    def part_name(self, name: str, part: str) -> str:
        module, _, leaf = name.rpartition(".")
        return self.name.format(module=module, leaf=leaf, part=part, name=name).strip(".")

    def global_names(self, name: str) -> list[str]:
        return [self.part_name(name, p) for p, _ in self.parts]

    def _chunks(self, name: str, tp_size: int) -> tuple[int, list[int]]:
        """``(local groups, local size of each part per local group)`` under ``tp_size``."""
        g = self.groups
        if g % tp_size == 0:
            return g // tp_size, [s for _, s in self.parts]
        if tp_size % g == 0 and all(s % (tp_size // g) == 0 for _, s in self.parts):
            return 1, [s // (tp_size // g) for _, s in self.parts]
        raise StateMismatchError(
            f"parameter '{name}': fused parts {list(self.parts)} in {g} group(s) cannot be split across "
            f"{tp_size} TP ranks (TP must divide the groups, or the groups TP and each part's size)"
        )

    def _part_shape(self, shape: Shape, size: int) -> Shape:
        return _with(shape, self.dim, (self.groups, size) if self.groups > 1 else (size,))

    def tiles(self, name: str, local: torch.Tensor, tp_rank: int, tp_size: int) -> list[TilePiece]:
        _check_dim(name, self.dim, local.dim(), "Fused")
        k, chunks = self._chunks(name, tp_size)
        if local.shape[self.dim] != k * sum(chunks):
            raise StateMismatchError(
                f"parameter '{name}' of local shape {list(local.shape)}: fused dimension {self.dim} should be "
                f"{k * sum(chunks)} under TP={tp_size} ({k} group(s) of parts {chunks}, from {list(self.parts)} "
                f"in {self.groups} group(s))"
            )
        per_rank = tp_size // self.groups if tp_size > self.groups else 1
        group0, within = (tp_rank * k, 0) if self.groups % tp_size == 0 else (tp_rank // per_rank, tp_rank % per_rank)
        grouped = local.unflatten(self.dim, (k, sum(chunks))) if self.groups > 1 else local
        out, pos = [], 0
        for (part, size), c in zip(self.parts, chunks):
            view = grouped.narrow(self.dim + (1 if self.groups > 1 else 0), pos, c)
            pos += c
            if self.groups > 1:
                offset = _with((0,) * local.dim(), self.dim, (group0, within * c))
            else:
                offset = _with((0,) * local.dim(), self.dim, tp_rank * c)
            out.append(TilePiece(self.part_name(name, part), self._part_shape(tuple(local.shape), size), offset, view))
        return out

    def local_shape(self, name: str, shapes: Mapping[str, Shape], tp_size: int) -> Shape:
        k, chunks = self._chunks(name, tp_size)
        expected: Shape | None = None
        for part, size in self.parts:
            pname = self.part_name(name, part)
            shape = shapes[pname]
            extra = 1 if self.groups > 1 else 0
            _check_dim(pname, self.dim + extra, len(shape), "Fused")
            local = _with(shape[: self.dim] + shape[self.dim + extra :], self.dim, k * sum(chunks))
            if self._part_shape(local, size) != tuple(shape) or (expected is not None and local != expected):
                raise StateMismatchError(
                    f"fused part '{pname}' of '{name}' has global shape {list(shape)}, which does not fit parts "
                    f"{list(self.parts)} in {self.groups} group(s) along dimension {self.dim}"
                )
            expected = local
        assert expected is not None
        return expected


@dataclass(frozen=True)
class Skip(ParamLayout):
    """Not saved and not loaded (TE ``_extra_state``, recomputable buffers)."""

    def global_names(self, name: str) -> list[str]:
        return []

    def tiles(self, name: str, local: torch.Tensor, tp_rank: int, tp_size: int) -> list[TilePiece]:
        return []


class PipelineStage(str, Enum):
    """Which pipeline stages hold a parameter that is not in a :class:`LayerStack`."""

    ALL = "all"
    FIRST = "first"
    LAST = "last"

    def holds(self, pp_rank: int, pp_size: int) -> bool:
        return self is PipelineStage.ALL or pp_rank == (0 if self is PipelineStage.FIRST else pp_size - 1)


@dataclass(frozen=True)
class Rule:
    """A name pattern and the layout of the parameters it matches.

    Attributes:
        pattern: a glob (``fnmatch``: ``*`` also matches dots) or a compiled regex (full
            match), tested against the parameter's global name (layer indices global;
            for fused parameters, the fused name).
        layout: how TP ranks hold the matched parameters.
        stage: which pipeline stages hold them, for names outside any layer stack.
    """

    pattern: str | re.Pattern[str]
    layout: ParamLayout
    stage: PipelineStage = PipelineStage.ALL

    def __post_init__(self) -> None:
        if not isinstance(self.layout, ParamLayout):
            raise TypeError(f"rule {self.pattern!r}: layout must be a ParamLayout, got {type(self.layout).__name__}")
        object.__setattr__(self, "stage", PipelineStage(self.stage))

    def matches(self, name: str) -> bool:
        if isinstance(self.pattern, re.Pattern):
            return self.pattern.fullmatch(name) is not None
        return fnmatch.fnmatchcase(name, self.pattern)

    def describe(self) -> str:
        return self.pattern.pattern if isinstance(self.pattern, re.Pattern) else self.pattern


@dataclass(frozen=True)
class LayerStack:
    """Layers numbered locally per pipeline stage, saved with global indices.

    Stage ``p`` holds ``counts[p]`` layers named ``template`` with ``{i}`` = 0, 1, ...;
    they are global layers ``sum(counts[:p]) + i``.

    Attributes:
        template: the name prefix with ``{i}`` for the index, e.g. ``"decoder.layers.{i}"``.
        num_layers: total layers over all stages.
        stage_layers: explicit per-stage counts; its length is the PP size it applies to
            (PP=1 always holds every layer). None splits ``num_layers`` evenly.
    """

    template: str
    num_layers: int
    stage_layers: tuple[int, ...] | None = None
    _regex: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.template.count("{i}") != 1:
            raise ValueError(f"layer stack template {self.template!r} must contain '{{i}}' exactly once")
        pre, post = self.template.split("{i}")
        object.__setattr__(self, "_regex", re.compile(rf"{re.escape(pre)}(\d+){re.escape(post)}(?=\.|$)"))
        if self.stage_layers is not None:
            counts = tuple(int(c) for c in self.stage_layers)
            if any(c < 0 for c in counts) or sum(counts) != self.num_layers:
                raise ValueError(
                    f"layer stack {self.template!r}: stage_layers {counts} must add up to {self.num_layers}"
                )
            object.__setattr__(self, "stage_layers", counts)

    def counts(self, pp_size: int) -> tuple[int, ...]:
        """Layers per stage under ``pp_size`` stages (one stage always holds them all)."""
        if pp_size == 1:
            return (self.num_layers,)
        if self.stage_layers is not None:
            if len(self.stage_layers) != pp_size:
                raise ValueError(
                    f"layer stack {self.template!r}: stage_layers {self.stage_layers} are for PP={len(self.stage_layers)}, "
                    f"not PP={pp_size}; use dataclasses.replace(stack, stage_layers=...) for this layout"
                )
            return self.stage_layers
        if self.num_layers % pp_size:
            raise ValueError(
                f"layer stack {self.template!r}: {self.num_layers} layers do not split evenly over {pp_size} "
                "pipeline stages; give stage_layers"
            )
        return (self.num_layers // pp_size,) * pp_size

    def match(self, name: str) -> re.Match[str] | None:
        return self._regex.match(name)

    def renumber(self, name: str, m: re.Match[str], index: int) -> str:
        return name[: m.start(1)] + str(index) + name[m.end(1) :]

    def to_global(self, name: str, pp_rank: int, pp_size: int) -> str | None:
        """The global name of local ``name`` on stage ``pp_rank`` (None: not in this stack)."""
        m = self.match(name)
        if m is None:
            return None
        counts = self.counts(pp_size)
        i = int(m.group(1))
        if i >= counts[pp_rank]:
            raise StateMismatchError(
                f"parameter '{name}' on pipeline stage {pp_rank}: local layer {i}, but stage {pp_rank} of {pp_size} "
                f"holds {counts[pp_rank]} layer(s) of '{self.template}'"
            )
        return self.renumber(name, m, sum(counts[:pp_rank]) + i)

    def to_local(self, name: str, pp_size: int) -> tuple[int, str] | None:
        """``(stage, local name)`` of global ``name`` (None: not in this stack)."""
        m = self.match(name)
        if m is None:
            return None
        i = int(m.group(1))
        counts = self.counts(pp_size)
        if i >= self.num_layers:
            raise StateMismatchError(
                f"tensor '{name}': layer {i} is past the {self.num_layers} layers of '{self.template}'"
            )
        start = 0
        for stage, c in enumerate(counts):
            if i < start + c:
                return stage, self.renumber(name, m, i - start)
            start += c
        raise AssertionError("unreachable")


@dataclass(frozen=True)
class ExpertStack:
    """MoE experts numbered locally per expert-parallel rank, saved with global indices.

    With ``num_experts`` experts over ``ep`` ranks, EP rank ``e`` holds experts
    ``e * num_experts / ep ...`` as local experts ``0 .. num_experts / ep - 1`` under
    ``template`` (``{i}``: the local index). The pattern is searched anywhere in a name, so
    ``"mlp.experts.local_experts.{i}"`` covers every layer's experts. Expert parameters
    are split by the expert-tensor-parallel rank (ETP) instead of the TP rank.

    Attributes:
        template: the name part with ``{i}`` for the expert index.
        num_experts: experts per MoE layer (over all EP ranks).
    """

    template: str
    num_experts: int
    _regex: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.template.count("{i}") != 1:
            raise ValueError(f"expert stack template {self.template!r} must contain '{{i}}' exactly once")
        if self.num_experts < 1:
            raise ValueError(f"expert stack {self.template!r}: num_experts must be >= 1, got {self.num_experts}")
        pre, post = self.template.split("{i}")
        object.__setattr__(self, "_regex", re.compile(rf"(?:^|(?<=\.)){re.escape(pre)}(\d+){re.escape(post)}(?=\.|$)"))

    def per_rank(self, name: str, ep_size: int) -> int:
        """Experts per EP rank.

        Raises:
            StateMismatchError: if ``num_experts`` is not a multiple of ``ep_size``.
        """
        if ep_size < 1 or self.num_experts % ep_size:
            raise StateMismatchError(
                f"parameter '{name}': {self.num_experts} experts of '{self.template}' do not divide evenly over "
                f"{ep_size} expert-parallel ranks; choose an EP size that divides {self.num_experts}"
            )
        return self.num_experts // ep_size

    def match(self, name: str) -> re.Match[str] | None:
        return self._regex.search(name)

    def to_global(self, name: str, ep_rank: int, ep_size: int) -> str | None:
        """The global name of local ``name`` on EP rank ``ep_rank`` (None: not an expert)."""
        m = self.match(name)
        if m is None:
            return None
        n = self.per_rank(name, ep_size)
        i = int(m.group(1))
        if i >= n:
            raise StateMismatchError(
                f"parameter '{name}' on expert-parallel rank {ep_rank}: local expert {i}, but each of {ep_size} EP "
                f"ranks holds {n} of the {self.num_experts} experts"
            )
        return name[: m.start(1)] + str(ep_rank * n + i) + name[m.end(1) :]

    def to_local(self, name: str, ep_size: int) -> tuple[int, str] | None:
        """``(EP rank, local name)`` of global ``name`` (None: not an expert)."""
        m = self.match(name)
        if m is None:
            return None
        n = self.per_rank(name, ep_size)
        i = int(m.group(1))
        if i >= self.num_experts:
            raise StateMismatchError(
                f"tensor '{name}': expert {i} is past the {self.num_experts} experts of '{self.template}'"
            )
        return i // n, name[: m.start(1)] + str(i % n) + name[m.end(1) :]
