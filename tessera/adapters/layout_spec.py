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

This module holds the naming vocabulary (:class:`Rule`, :class:`PipelineStage`,
:class:`LayerStack`, :class:`ExpertStack`) and re-exports the per-tensor layouts of
:mod:`.param_layouts`; :mod:`.megatron` holds :class:`~tessera.adapters.megatron.MegatronSpec`,
which applies both to whole state dicts.
"""

from __future__ import annotations

import fnmatch
import logging
import re
from dataclasses import dataclass, field
from enum import Enum

from ..errors import StateMismatchError
from .param_layouts import Fused, PaddedVocab, ParamLayout, Replicated, Skip, Split, TilePiece

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
