"""What is at a path that holds no committed checkpoint, and what to do: one diagnosis for every caller.

``tessera.load``, :meth:`CheckpointManager.load <tessera.CheckpointManager.load>` and the
``tessera`` command all say the same thing when a path is not a committed checkpoint, because
they all ask :func:`examine_path`: a missing path (and, beside it, the steps of a manager root:
a step deleted by retention or never saved), a manager root (with its steps), a checkpoint of
another framework (DCP, DeepSpeed, Megatron, Hugging Face, ``torch.save``: with the import
command), an unfinished save, or a folder of step directories the manager does not recognise
(DCP's ``step-6``: with the name the manager expects).

Everything here runs in one process, only lists directories and reads small files, and never
communicates. It runs where a load found no manifest, so it never slows a load that succeeds.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from enum import Enum
from typing import Any

from ...format.manifest import MANIFEST_NAME
from ...format.names import DATA_DIR, OWNER_MARKER_DIR, parse_step_dirname, step_dirname
from ...storage import Storage, storage_for

__all__ = ["PathKind", "PathReport", "examine_path", "stray_step", "stray_steps_note"]

_LATEST = "latest"  # the manager's pointer file (tessera.manager.steps.LATEST_NAME)
_STRAY_STEP = re.compile(r"^(?:step|checkpoint|ckpt)[-_]?(\d+)$")
_FORMAT_NAMES = {
    "dcp": "torch.distributed.checkpoint (DCP)",
    "megatron": "Megatron",
    "deepspeed": "DeepSpeed",
    "torch": "torch.save",
    "hf": "Hugging Face safetensors",
}


class PathKind(str, Enum):
    """What :func:`examine_path` found."""

    CHECKPOINT = "checkpoint"
    """A committed tessera checkpoint (``manifest.json``)."""
    INCOMPLETE = "incomplete"
    """A tessera checkpoint directory whose save never committed (``data/`` but no manifest)."""
    MANAGER_ROOT = "manager_root"
    """A :class:`~tessera.CheckpointManager` root: ``step-NNNNNNNN/`` directories."""
    STRAY_STEPS = "stray_steps"
    """A folder of step directories named otherwise (``step-6``): the manager ignores them."""
    HF = "hf"
    """A Hugging Face safetensors directory (or a single ``.safetensors`` file)."""
    OTHER_FORMAT = "other_format"
    """A checkpoint of another framework (DCP, DeepSpeed, Megatron, ``torch.save``)."""
    MISSING = "missing"
    """Nothing there."""
    UNKNOWN = "unknown"
    """Something else."""


def stray_step(name: str) -> int | None:
    """The step a directory name like ``step-6`` or ``step_00012`` stands for, when the manager
    does not read it as one (its own names are ``step-00000006``); None otherwise.

    Example:
        >>> stray_step("step-6"), stray_step("step-00000006")
        (6, None)
    """
    m = _STRAY_STEP.match(name)
    if m is None or parse_step_dirname(name) is not None:
        return None
    return int(m.group(1))


def stray_steps_note(names: list[str]) -> str:
    """One sentence naming the step directories the manager ignores and the names it expects."""
    shown = sorted(names, key=lambda n: stray_step(n) or 0)
    first = shown[0]
    listing = ", ".join(shown[:5]) + (f" ... ({len(shown)} in all)" if len(shown) > 5 else "")
    return (
        f"step directories the checkpoint manager does not recognise: {listing} "
        f"(it names step {stray_step(first)} '{step_dirname(stray_step(first) or 0)}')"
    )


@dataclass(frozen=True)
class PathReport:
    """What :func:`examine_path` found at ``path``."""

    path: str
    kind: PathKind
    format: str | None = None
    """For :attr:`PathKind.OTHER_FORMAT` / :attr:`PathKind.HF`: ``dcp``, ``megatron``, ``deepspeed``, ``torch``, ``hf``."""
    steps: tuple[int, ...] = ()
    """Committed steps of the manager root (``path`` itself, or its parent for a step path)."""
    incomplete: tuple[int, ...] = ()
    """Step directories of that root whose save never committed."""
    pointer: int | None = None
    """The step the root's ``latest`` names."""
    stray: tuple[str, ...] = ()
    """Step directories the manager does not recognise (``step-6``)."""
    stray_format: str | None = None
    """The format of the newest stray step directory (``dcp``...), if recognised."""
    root: str | None = None
    """The manager root beside a missing or unfinished step directory."""
    step: int | None = None
    """The step number ``path`` names under :attr:`root`."""

    @property
    def summary(self) -> str:
        """One sentence: what is at ``path``."""
        p = self.path
        if self.kind == PathKind.CHECKPOINT:
            return f"{p}: a committed tessera checkpoint"
        if self.kind == PathKind.MANAGER_ROOT:
            return f"{p}: a checkpoint manager root with {_steps_text(self.steps, self.incomplete)}" + self._stale()
        if self.kind == PathKind.STRAY_STEPS:
            return f"{p} holds {stray_steps_note(list(self.stray))}"
        if self.kind in (PathKind.OTHER_FORMAT, PathKind.HF):
            return f"{p}: a {_FORMAT_NAMES.get(self.format or '', self.format)} checkpoint, not a tessera one"
        if self.kind == PathKind.INCOMPLETE:
            where = f"step {self.step} under {self.root} never committed: " if self.root is not None else ""
            return (
                f"{p}: {where}a tessera checkpoint whose save never committed ({DATA_DIR}/ but no {MANIFEST_NAME}: "
                "the save did not finish); it is never loaded, and the next save to this path replaces it"
            )
        if self.kind == PathKind.MISSING:
            return f"no committed checkpoint at {p}: nothing is there"
        return f"no committed checkpoint at {p}: {MANIFEST_NAME} is missing (never saved, or the save did not finish)"

    def _stale(self) -> str:
        if self.pointer is None or self.pointer in self.steps:
            return ""
        return (
            f"; its '{_LATEST}' names step {self.pointer}, which is not committed there (stale: deleted by hand or "
            "never finished; CheckpointManager repairs it when it starts, and loads the newest committed step)"
        )

    def message(self) -> str:
        """What is at ``path`` and what to do: the text of every "not found" tessera reports."""
        p = self.path
        if self.kind == PathKind.MANAGER_ROOT:
            if not self.steps:
                return f"{self.summary}; nothing to load"
            newest = _join(p, step_dirname(self.steps[-1]))
            return (
                f"{self.summary}, not one checkpoint: load a step ({newest}), or the newest committed one with "
                f"CheckpointManager({p!r}).load(state); on the command line {p} means its newest step, {p}@STEP another"
            )
        if self.kind == PathKind.STRAY_STEPS:
            how = (
                f"; they are {_FORMAT_NAMES.get(self.stray_format, self.stray_format)} checkpoints: convert the "
                f"folder into a manager root, step numbers kept, with: tessera convert {p} OUT"
                if self.stray_format is not None
                else "; rename them, or save with CheckpointManager"
            )
            return self.summary + how
        if self.kind in (PathKind.OTHER_FORMAT, PathKind.HF):
            return f"{self.summary}; import it once with: tessera convert {p} OUT (then load OUT)"
        text = self.summary
        if self.root is not None and self.step is not None:
            if self.kind == PathKind.MISSING:
                text = f"no committed checkpoint at {p}: {self._why_step_missing()}"
            text += f"; its committed steps: {_listing(self.steps)}"
        return text

    def _why_step_missing(self) -> str:
        step, steps = self.step, self.steps
        assert step is not None  # only called with a step
        if steps and step < steps[0]:
            why = "older than every step the root keeps: deleted by retention (keep_last, keep_every) or by hand"
        elif steps and step > steps[-1]:
            why = "newer than every committed step: never saved, or deleted by hand"
        else:
            why = "never saved, or deleted (by retention or by hand)"
        name = step_dirname(step)
        if os.path.basename(self.path.rstrip("/")) != name:
            if step in steps:
                return f"the checkpoint manager names step {step} '{name}': {_join(self.root or '.', name)}"
            why += f"; the manager names step {step} '{name}'"
        return f"no step {step} under {self.root}, a checkpoint manager root ({why})"


def _join(root: str, name: str) -> str:
    return root + name if root.endswith("/") else f"{root}/{name}"


def _listing(steps: tuple[int, ...]) -> str:
    return ", ".join(map(str, steps)) if steps else "none"


def _steps_text(steps: tuple[int, ...], incomplete: tuple[int, ...]) -> str:
    text = (
        f"{len(steps)} committed step(s)" + (f" ({_listing(steps)})" if steps else "") if steps else "no committed step"
    )
    if incomplete:
        text += f" and {len(incomplete)} incomplete ({_listing(incomplete)}: their saves never finished)"
    return text


class _Listing:
    """The entries of a directory (or URL prefix): top-level names, which are directories, which hold what."""

    def __init__(self, path: str, store: Storage | None, storage_options: dict[str, Any] | None) -> None:
        self.local = "://" not in path and store is None
        self.path = path
        self.files: dict[str, set[str]] = {}  # top-level dir -> names directly inside it
        self.top: set[str] = set()
        if self.local:
            if os.path.isdir(path):
                self.top = set(os.listdir(path))
            return
        backend = storage_for(path, store, storage_options=dict(storage_options or {}))
        for rel in backend.list(""):
            head, _, rest = rel.partition("/")
            self.top.add(head)
            if rest:
                self.files.setdefault(head, set()).add(rest.partition("/")[0])

    def is_dir(self, name: str) -> bool:
        return os.path.isdir(os.path.join(self.path, name)) if self.local else name in self.files

    def inside(self, name: str) -> set[str]:
        if self.local:
            try:
                return set(os.listdir(os.path.join(self.path, name)))
            except OSError:
                return set()
        return self.files.get(name, set())

    def read(self, name: str) -> str | None:
        if not self.local:
            return None
        try:
            with open(os.path.join(self.path, name), encoding="utf-8", errors="replace") as f:
                return f.read(4096)
        except OSError:
            return None


def _foreign_format(names: set[str], read: Any) -> str | None:
    """The framework whose checkpoint directory holds ``names`` (a directory's entries), if any."""
    if ".metadata" in names:
        meta = read("metadata.json") if "metadata.json" in names else None
        try:
            if meta is not None and json.loads(meta).get("sharded_backend") == "torch_dist":
                return "megatron"
        except (ValueError, AttributeError):
            pass
        return "dcp"
    if "model.safetensors.index.json" in names or any(n.endswith(".safetensors") for n in names):
        return "hf"
    if "latest_checkpointed_iteration.txt" in names or any(n.startswith("mp_rank_") for n in names):
        return "megatron"
    if any(n.endswith("_optim_states.pt") for n in names) or _LATEST in names:
        return "deepspeed"
    return None


def _file_kind(path: str) -> PathReport:
    if path.endswith(".safetensors"):
        return PathReport(path, PathKind.HF, "hf")
    if path.endswith((".pt", ".pth", ".bin")):
        return PathReport(path, PathKind.OTHER_FORMAT, "torch")
    return PathReport(path, PathKind.UNKNOWN)


def _root_of(listing: _Listing) -> tuple[tuple[int, ...], tuple[int, ...], int | None]:
    committed: list[int] = []
    incomplete: list[int] = []
    for name in listing.top:
        step = parse_step_dirname(name)
        if step is None or not listing.is_dir(name):
            continue
        (committed if MANIFEST_NAME in listing.inside(name) else incomplete).append(step)
    pointer = None
    text = listing.read(_LATEST) if _LATEST in listing.top else None
    if text is not None:
        pointer = parse_step_dirname(text.strip())
    return tuple(sorted(committed)), tuple(sorted(incomplete)), pointer


def examine_path(
    path: str, *, storage: Storage | None = None, storage_options: dict[str, Any] | None = None
) -> PathReport:
    """What is at ``path``: a checkpoint, a manager root, another framework's checkpoint, ...

    Args:
        path: a directory, file or URL.
        storage: the backend bound to ``path`` (a URL's); None: chosen from ``path``.
        storage_options: backend options when ``storage`` is not given.

    Returns:
        The :class:`PathReport`; its :meth:`~PathReport.message` is what tessera says when
        ``path`` holds no committed checkpoint.

    Example:
        >>> examine_path("/ckpt/dcp-run").message()  # doctest: +SKIP
        "/ckpt/dcp-run holds step directories the checkpoint manager does not recognise: step-6, step-12 ..."
    """
    if path.startswith("tier::"):
        path = path.removeprefix("tier::")
    local = "://" not in path and storage is None
    if local and os.path.isfile(path):
        return _file_kind(path)
    if local and not os.path.isdir(path):
        return _beside(path, PathReport(path, PathKind.MISSING))
    listing = _Listing(path, storage, storage_options)
    names = listing.top
    if MANIFEST_NAME in names and not listing.is_dir(MANIFEST_NAME):
        return PathReport(path, PathKind.CHECKPOINT)
    steps, incomplete, pointer = _root_of(listing)
    if steps or incomplete:
        return PathReport(path, PathKind.MANAGER_ROOT, steps=steps, incomplete=incomplete, pointer=pointer)
    stray = sorted(
        (n for n in names if stray_step(n) is not None and listing.is_dir(n)), key=lambda n: stray_step(n) or 0
    )
    if stray:
        inside = listing.inside(stray[-1])
        fmt = _foreign_format(inside, lambda n: listing.read(f"{stray[-1]}/{n}"))
        return PathReport(path, PathKind.STRAY_STEPS, stray=tuple(stray), stray_format=fmt)
    if not names:
        return _beside(path, PathReport(path, PathKind.MISSING if not local else PathKind.UNKNOWN))
    if DATA_DIR in names or OWNER_MARKER_DIR in names:
        return _beside(path, PathReport(path, PathKind.INCOMPLETE))
    fmt = _foreign_format(names, listing.read)
    if fmt is not None:
        return PathReport(path, PathKind.HF if fmt == "hf" else PathKind.OTHER_FORMAT, fmt)
    return PathReport(path, PathKind.UNKNOWN)


def _beside(path: str, report: PathReport) -> PathReport:
    """``report``, with the manager root ``path`` is a step of (local paths only: its parent is listed)."""
    if "://" in path:
        return report
    parent, name = os.path.split(path.rstrip("/"))
    step = parse_step_dirname(name)
    if step is None:
        step = stray_step(name)
    if step is None or not os.path.isdir(parent or "."):
        return report
    steps, incomplete, pointer = _root_of(_Listing(parent or ".", None, None))
    return PathReport(
        report.path, report.kind, report.format, steps, incomplete, pointer, root=parent or ".", step=step
    )
