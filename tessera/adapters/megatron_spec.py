"""``MegatronSpec``: a Megatron-style TP x PP (x EP) state dict to global tiles and back.

A tensor- and pipeline-parallel rank holds slices of parameters under local names
(``decoder.layers.0..k`` on every stage, fused QKV, padded vocabulary). A
:class:`MegatronSpec` (rules from :mod:`.layout_spec` plus layer and expert stacks) turns
that local state dict into :class:`~tessera.ShardedTensor`\\ s keyed by global FQN
(``to_global``), builds the empty local state of any TP x PP rank from global shapes
(``empty_local``) and describes it for ``tessera.load`` (``global_targets``). Pure and local.
The spec of Megatron-core's ``GPTModel`` is :func:`tessera.adapters.megatron.gpt_spec`.
"""

from __future__ import annotations

import logging
import re
import string
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import StateMismatchError
from ..shards import ShardedTensor
from .layout_spec import (
    ExpertStack,
    Fused,
    LayerStack,
    Rule,
    Skip,
    TilePiece,
)
from .param_layouts import Shape

logger = logging.getLogger(__name__)

__all__ = ["GlobalShapes", "LocalValue", "MegatronSpec"]

GlobalShapes = Mapping[str, tuple[Sequence[int], torch.dtype]]
"""Global FQN -> (shape, dtype), e.g. from :func:`global_shapes_from_manifest`."""
LocalValue = torch.Tensor | Mapping[str, object] | None
"""A local state dict value: a tensor, a dict of per-parameter optimizer state, or (for
:class:`~.layout_spec.Skip` entries such as TE's ``_extra_state``) anything."""


def _template_regex(layout: Fused) -> re.Pattern[str]:
    groups = {
        "module": r"(?P<module>.+?)",
        "leaf": r"(?P<leaf>[^.]+)",
        "name": r"(?P<name>.+)",
        "part": "(?P<part>" + "|".join(re.escape(p) for p, _ in layout.parts) + ")",
    }
    out = ""
    for literal, field_name, _, _ in string.Formatter().parse(layout.name):
        out += re.escape(literal)
        if field_name is not None:
            out += groups[field_name]
    return re.compile(out)


@dataclass(frozen=True)
class MegatronSpec:
    """The layout of a TP x PP model: parameter rules and pipeline layer stacks.

    Every parameter must match exactly one rule (by its global name). Names under a layer
    stack are renumbered between local (per stage) and global indices; other names live on
    the stages their rule says.

    MoE experts (:class:`~.layout_spec.ExpertStack`) are numbered per expert-parallel (EP)
    rank and split by the expert-tensor-parallel (ETP) rank; the methods take ``ep_rank``,
    ``ep_size`` and ``etp_rank``, ``etp_size`` (default: the TP rank and size, Megatron's
    default ``expert_tensor_parallel_size``).

    Attributes:
        rules: one :class:`~.layout_spec.Rule` per parameter family.
        layers: the layer stacks numbered per pipeline stage.
        experts: the expert stacks numbered per EP rank.
    """

    rules: tuple[Rule, ...]
    layers: tuple[LayerStack, ...] = ()
    experts: tuple[ExpertStack, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "rules", tuple(self.rules))
        object.__setattr__(self, "layers", tuple(self.layers))
        object.__setattr__(self, "experts", tuple(self.experts))

    # ---- names -----------------------------------------------------------------------

    def rule_for(self, name: str) -> Rule:
        """The one rule matching global ``name``.

        Raises:
            StateMismatchError: if no rule or several rules match, naming the parameter.
        """
        hits = [r for r in self.rules if r.matches(name)]
        if len(hits) == 1:
            return hits[0]
        if not hits:
            raise StateMismatchError(f"parameter '{name}' matches no rule of the layout spec; declare its layout")
        raise StateMismatchError(
            f"parameter '{name}' matches {len(hits)} rules of the layout spec "
            f"({', '.join(repr(r.describe()) for r in hits)}); patterns must not overlap"
        )

    def global_name(self, local_name: str, pp_rank: int, pp_size: int, ep_rank: int = 0, ep_size: int = 1) -> str:
        """The global name of ``local_name`` on pipeline stage ``pp_rank`` (and EP rank ``ep_rank``)."""
        found = [g for g in (s.to_global(local_name, pp_rank, pp_size) for s in self.layers) if g is not None]
        if len(found) > 1:
            raise StateMismatchError(f"parameter '{local_name}' falls under {len(found)} layer stacks")
        name = found[0] if found else local_name
        experts = [g for g in (s.to_global(name, ep_rank, ep_size) for s in self.experts) if g is not None]
        if len(experts) > 1:
            raise StateMismatchError(f"parameter '{local_name}' falls under {len(experts)} expert stacks")
        return experts[0] if experts else name

    def is_expert(self, name: str) -> bool:
        """Whether ``name`` is an expert parameter (split by ETP, numbered per EP rank)."""
        return any(s.match(name) for s in self.experts)

    def _locate(self, name: str, rule: Rule, pp_size: int, ep_size: int = 1) -> tuple[list[int], str, int | None]:
        """Stages holding global ``name``, its local name there, and its EP rank (None: all)."""
        ep_rank = None
        for experts in self.experts:
            hit = experts.to_local(name, ep_size)
            if hit is not None:
                ep_rank, name = hit
                break
        for stack in self.layers:
            found = stack.to_local(name, pp_size)
            if found is not None:
                return [found[0]], found[1], ep_rank
        return [p for p in range(pp_size) if rule.stage.holds(p, pp_size)], name, ep_rank

    # ---- local state -> global tiles -------------------------------------------------

    def _pieces(
        self, local_sd: Mapping[str, LocalValue], tp_rank: int, tp_size: int, pp_rank: int, pp_size: int,
        ep: tuple[int, int] = (0, 1),
    ) -> Iterator[tuple[str, str, Rule, LocalValue]]:  # fmt: skip
        _check_ranks(tp_rank, tp_size, pp_rank, pp_size)
        if not 0 <= ep[0] < ep[1]:
            raise ValueError(f"invalid rank: ep_rank={ep[0]} of ep_size={ep[1]}")
        for local_name, value in local_sd.items():
            name = self.global_name(local_name, pp_rank, pp_size, *ep)
            rule = self.rule_for(name)
            if isinstance(rule.layout, Skip):
                continue
            if not any(s.match(local_name) for s in self.layers) and not rule.stage.holds(pp_rank, pp_size):
                raise StateMismatchError(
                    f"parameter '{local_name}' is on pipeline stage {pp_rank} of {pp_size}, but its rule "
                    f"{rule.describe()!r} places it on the {rule.stage.value} stage"
                )
            yield local_name, name, rule, value

    def _tp(self, name: str, tp_rank: int, tp_size: int, etp: tuple[int | None, int | None]) -> tuple[int, int]:
        """The (rank, size) that splits ``name``: ETP for experts (default: TP), else TP."""
        if not self.is_expert(name):
            return tp_rank, tp_size
        rank, size = (tp_rank if etp[0] is None else etp[0]), (tp_size if etp[1] is None else etp[1])
        if not 0 <= rank < size:
            raise ValueError(f"invalid rank: etp_rank={rank} of etp_size={size}")
        return rank, size

    def to_global(
        self, local_sd: Mapping[str, LocalValue], tp_rank: int, tp_size: int, pp_rank: int, pp_size: int, *,
        ep_rank: int = 0, ep_size: int = 1, etp_rank: int | None = None, etp_size: int | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """A rank's local state dict as global tiles (views, no copies), for ``tessera.save``.

        Args:
            local_sd: local name -> tensor, or -> dict of per-parameter optimizer state
                (``{"exp_avg": t, "exp_avg_sq": t, "step": s}``): tensors with at least one
                dimension follow the parameter's layout, other values (a 0-dim ``step``)
                are copied to every global tensor the parameter holds.
            tp_rank, tp_size: this rank's tensor-parallel position.
            pp_rank, pp_size: this rank's pipeline stage.
            ep_rank, ep_size: this rank's expert-parallel position (MoE).
            etp_rank, etp_size: its expert-tensor-parallel position (default: TP's).

        Returns:
            ``{global_name: ShardedTensor}`` (or ``{global_name: {key: ...}}`` for dict values).

        Raises:
            StateMismatchError: a parameter that matches no rule or several, whose shape does
                not fit its rule under ``tp_size``, that sits on the wrong stage, or an expert
                count that ``ep_size`` does not divide.

        Example:
            >>> spec.to_global(model.state_dict(), tp_rank=1, tp_size=2, pp_rank=0, pp_size=2)
        """
        out: dict[str, Any] = {}
        etp = (etp_rank, etp_size)
        for local_name, name, rule, value in self._pieces(
            local_sd, tp_rank, tp_size, pp_rank, pp_size, (ep_rank, ep_size)
        ):
            for gname, item in _convert(local_name, name, rule, value, *self._tp(name, tp_rank, tp_size, etp)).items():
                if gname in out:
                    raise StateMismatchError(
                        f"two local parameters map to the global name '{gname}' (one is '{local_name}')"
                    )
                out[gname] = item
        return out

    def global_targets(
        self, local_sd: Mapping[str, LocalValue], tp_rank: int, tp_size: int, pp_rank: int, pp_size: int, *,
        ep_rank: int = 0, ep_size: int = 1, etp_rank: int | None = None, etp_size: int | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """What ``tessera.load`` fills to load into ``local_sd`` in place.

        The same tiles as :meth:`to_global`; in addition, vocabulary padding of the local
        tensors is zeroed here (it is not in the checkpoint). Under PP a stage holds only
        its own layers, so load with ``strict=False`` and check ``missing_keys`` is empty.

        Example:
            >>> local = spec.empty_local(shapes, tp_rank, 4, pp_rank, 1)
            >>> tessera.load(path, {"model": spec.global_targets(local, tp_rank, 4, pp_rank, 1)})
        """
        targets = self.to_global(local_sd, tp_rank, tp_size, pp_rank, pp_size, ep_rank=ep_rank, ep_size=ep_size,
                                 etp_rank=etp_rank, etp_size=etp_size)  # validates first  # fmt: skip
        for _, name, rule, value in self._pieces(local_sd, tp_rank, tp_size, pp_rank, pp_size, (ep_rank, ep_size)):
            values = value.values() if isinstance(value, Mapping) else [value]
            for v in values:
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    for pad in rule.layout.padding(name, v, *self._tp(name, tp_rank, tp_size, (etp_rank, etp_size))):
                        pad.zero_()
        return targets

    # ---- global shapes -> empty local state ------------------------------------------

    def _group(self, global_shapes: GlobalShapes) -> dict[str, tuple[Rule, dict[str, Shape], torch.dtype]]:
        """Global tensors grouped by the (fused) parameter they belong to."""
        fused = [(r, r.layout, _template_regex(r.layout)) for r in self.rules if isinstance(r.layout, Fused)]
        groups: dict[str, tuple[Rule, dict[str, Shape], torch.dtype]] = {}
        for gname, (shape, dtype) in global_shapes.items():
            owners = []
            for rule, layout, regex in fused:
                m = regex.fullmatch(gname)
                if m is None:
                    continue
                d = m.groupdict()
                parent = d.get("name") or ".".join(x for x in (d.get("module"), d.get("leaf")) if x)
                if rule.matches(parent) and layout.part_name(parent, d["part"]) == gname:
                    owners.append((parent, rule))
            direct = [r for r in self.rules if r.matches(gname)]
            if (owners and direct) or len(owners) > 1:
                raise StateMismatchError(
                    f"tensor '{gname}' is ambiguous: it is a fused part of {[p for p, _ in owners]} and matches "
                    f"rules {[r.describe() for r in direct]}; make the patterns disjoint"
                )
            if owners:
                parent, rule = owners[0]
            else:
                parent, rule = gname, self.rule_for(gname)
                if isinstance(rule.layout, Fused):
                    raise StateMismatchError(
                        f"tensor '{gname}' matches the fused rule {rule.describe()!r}, but fused parameters are saved "
                        f"as their parts ({', '.join(rule.layout.global_names(gname))})"
                    )
                if isinstance(rule.layout, Skip):
                    continue
            _, shapes, first_dtype = groups.setdefault(parent, (rule, {}, dtype))
            if dtype != first_dtype:
                raise StateMismatchError(f"fused parts of '{parent}' have different dtypes ({first_dtype}, {dtype})")
            shapes[gname] = tuple(int(s) for s in shape)
        return groups

    def empty_local(
        self,
        global_shapes: GlobalShapes,
        tp_rank: int,
        tp_size: int,
        pp_rank: int,
        pp_size: int,
        *,
        ep_rank: int = 0,
        ep_size: int = 1,
        etp_rank: int | None = None,
        etp_size: int | None = None,
        device: torch.device | str | None = None,
    ) -> dict[str, torch.Tensor]:
        """Zero-filled local tensors of TP x PP rank ``(tp_rank, pp_rank)``, by local name.

        Args:
            global_shapes: global name -> (shape, dtype) of every parameter in the checkpoint.
            tp_rank, tp_size, pp_rank, pp_size: the target rank.
            ep_rank, ep_size, etp_rank, etp_size: its expert-parallel position (MoE).
            device: where to allocate.

        Returns:
            The rank's local state dict (fused parameters fused, vocabulary padded).

        Raises:
            StateMismatchError: a global tensor no rule explains, a fused parameter with a
                missing part, shapes that do not split under ``tp_size``, or experts that do
                not split under ``ep_size``.

        Example:
            >>> shapes = global_shapes_from_manifest(tessera.read_manifest(path), prefix="model.")
            >>> local = spec.empty_local(shapes, tp_rank=0, tp_size=4, pp_rank=0, pp_size=1)
        """
        _check_ranks(tp_rank, tp_size, pp_rank, pp_size)
        if not 0 <= ep_rank < ep_size:
            raise ValueError(f"invalid rank: ep_rank={ep_rank} of ep_size={ep_size}")
        out: dict[str, torch.Tensor] = {}
        for parent, (rule, shapes, dtype) in self._group(global_shapes).items():
            missing = [n for n in rule.layout.global_names(parent) if n not in shapes]
            if missing:
                raise StateMismatchError(f"fused parameter '{parent}' lacks its part(s) {missing} in the global shapes")
            stages, local_name, on_ep = self._locate(parent, rule, pp_size, ep_size)
            if pp_rank in stages and on_ep in (None, ep_rank):
                size = self._tp(parent, tp_rank, tp_size, (etp_rank, etp_size))[1]
                out[local_name] = torch.zeros(rule.layout.local_shape(parent, shapes, size), dtype=dtype, device=device)
        return out


def _check_ranks(tp_rank: int, tp_size: int, pp_rank: int, pp_size: int) -> None:
    if not (0 <= tp_rank < tp_size and 0 <= pp_rank < pp_size):
        raise ValueError(
            f"invalid rank: tp_rank={tp_rank} of tp_size={tp_size}, pp_rank={pp_rank} of pp_size={pp_size}"
        )


def _sharded(p: TilePiece) -> ShardedTensor:
    return ShardedTensor(p.view, p.global_shape, p.global_offset)


def _convert(local_name: str, name: str, rule: Rule, value: LocalValue, tp_rank: int, tp_size: int) -> dict[str, Any]:
    if isinstance(value, torch.Tensor):
        return {p.name: _sharded(p) for p in rule.layout.tiles(name, value, tp_rank, tp_size)}
    if not isinstance(value, Mapping):
        raise StateMismatchError(
            f"parameter '{local_name}': expected a tensor or a dict of optimizer state, got {type(value).__name__}"
        )
    names = rule.layout.global_names(name)
    out: dict[str, dict[str, Any]] = {g: {} for g in names}
    for key, v in value.items():
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            pieces = rule.layout.tiles(name, v, tp_rank, tp_size)
            for p in pieces:
                out[p.name][key] = _sharded(p)
        else:
            for g in names:
                out[g][key] = v
    return out
