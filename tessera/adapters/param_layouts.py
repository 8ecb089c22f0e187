"""How a tensor-parallel rank holds one parameter: the per-tensor layouts of a layout spec.

Each :class:`ParamLayout` (:class:`Replicated`, :class:`Split`, :class:`PaddedVocab`,
:class:`Fused`, :class:`Skip`) names the global tensors a local parameter belongs to and
cuts a TP rank's local tensor into :class:`TilePiece` s, boxes of those global tensors.
Pure and local; the naming rules that pick a layout per parameter are :mod:`.layout_spec`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ..errors import StateMismatchError

__all__ = ["Fused", "PaddedVocab", "ParamLayout", "Replicated", "Skip", "Split", "TilePiece"]

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
