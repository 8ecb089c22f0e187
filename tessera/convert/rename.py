"""Rename the tensors and values of a checkpoint by rewriting its manifest only.

Data files are not touched: the manifest maps names to tiles, so a rename is one atomic
manifest publish through :mod:`tessera.engine.commit` (fenced like a save's: it fails rather than
overwrite a save that committed meanwhile), whatever the checkpoint's size. The tile keys
inside the safetensors data files keep the old names; tessera never reads them (the
manifest is the source of truth). The manifest's ``metadata["tile_names"]`` maps every
renamed tensor to the name its tiles are stored under.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from ..api import read_manifest
from ..engine import commit
from ..errors import ConcurrentSaveError
from ..format.manifest import Manifest, encode
from ..storage import Storage, storage_for

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RenameRule:
    """One renaming rule.

    Attributes:
        old: a name prefix, or a regular expression when ``regex`` is True.
        new: the replacement prefix, or the ``re.sub`` replacement (``\\1`` groups allowed).
        regex: whether ``old`` is a regular expression (searched; the first match replaced).
    """

    old: str
    new: str
    regex: bool = False

    def apply(self, name: str) -> str | None:
        """The new name, or None if the rule does not match ``name``."""
        if self.regex:
            pattern = re.compile(self.old)
            if pattern.search(name) is None:
                return None
            return pattern.sub(self.new, name, count=1)
        if name.startswith(self.old):
            return self.new + name[len(self.old) :]
        return None

    @classmethod
    def parse(cls, text: str, *, regex: bool = False) -> RenameRule:
        """A rule from ``"old=new"`` (split at the first ``=``).

        Raises:
            ValueError: without a ``=``, with an empty ``old``, or an invalid regex.

        Example:
            >>> RenameRule.parse("^layers[.]([0-9]+)[.]=blocks.\\g<1>.", regex=True)
        """
        old, sep, new = text.partition("=")
        if not sep or not old:
            raise ValueError(f"rename rule {text!r} must look like OLD=NEW (OLD not empty)")
        if regex:
            try:
                re.compile(old)
            except re.error as e:
                raise ValueError(f"rename rule {text!r}: invalid regular expression: {e}") from e
        return cls(old, new, regex)


def resolve_renames(names: Sequence[str], rules: Sequence[RenameRule]) -> dict[str, str]:
    """``{old: new}`` for every name some rule changes (the first matching rule applies).

    Raises:
        ValueError: if two names would get the same name, or a name becomes empty.

    Example:
        >>> resolve_renames(["model.w", "step"], [RenameRule("model.", "net.")])
        {'model.w': 'net.w'}
    """
    out: dict[str, str] = {}
    for name in names:
        for rule in rules:
            new = rule.apply(name)
            if new is not None:
                if new != name:
                    out[name] = new
                break
    final: dict[str, str] = {}
    for name in names:
        new = out.get(name, name)
        if not new:
            raise ValueError(f"renaming '{name}' would leave an empty name")
        if new in final:
            raise ValueError(f"renaming would give '{final[new]}' and '{name}' the same name '{new}'")
        final[new] = name
    return out


def rename_tensors(
    path: str,
    rules: Sequence[RenameRule],
    *,
    storage: Storage | None = None,
    dry_run: bool = False,
) -> dict[str, str]:
    """Rename tensors, plain and per-rank values of the checkpoint at ``path`` in place.

    Single process. The new manifest replaces the old one atomically: readers see all old
    names or all new names. A rename racing a save to ``path`` is fenced like a second save:
    if the save commits first, the rename fails and renames nothing; if the rename commits
    first, the save fails and the renamed checkpoint stands, complete.

    Args:
        path: a committed checkpoint.
        rules: applied in order; the first rule that matches a name renames it.
        storage: a backend to use instead of choosing one from ``path``.
        dry_run: compute and return the renames without writing.

    Returns:
        ``{old name: new name}`` of every name changed.

    Raises:
        CheckpointNotFoundError: if nothing is committed at ``path``.
        ValueError: if the renames would make two names collide.
        ConcurrentSaveError: a save committed ``path`` while the rename ran (nothing renamed).

    Example:
        >>> rename_tensors("/ckpt/step100", [RenameRule("model.module.", "model.")])
    """
    store = storage_for(path, storage)
    if dry_run:
        return resolve_renames(sorted(read_manifest(path, storage=store).keys()), rules)
    read_manifest(path, storage=store)  # nothing committed there: say so before claiming (creating) the path
    # Claimed before the manifest is read, so the publish fails if a save commits in between.
    claim = commit.claim(store, uuid.uuid4().hex[:16])
    try:
        m = read_manifest(path, storage=store)
        renames = resolve_renames(sorted(m.keys()), rules)
        if renames:
            try:
                commit.publish(store, claim, encode(_renamed(m, renames, rules)), path)
            except ConcurrentSaveError as e:
                raise ConcurrentSaveError(
                    f"not renaming {path}: a save committed it while the rename ran (publishing the renamed "
                    "manifest would have brought back the checkpoint it replaced); nothing was renamed. Run the "
                    f"rename again once no job is saving to {path}"
                ) from e
            logger.info("renamed %d entries of %s", len(renames), path)
    finally:  # the rename wrote no data files: only its owner marker goes
        commit.abandon(store, claim, [], path, keep_data=True)
    return renames


def _renamed(m: Manifest, renames: dict[str, str], rules: Sequence[RenameRule]) -> Manifest:
    """``m`` with the names changed as ``renames`` says, the renaming recorded in its metadata."""

    def r(name: str) -> str:
        return renames.get(name, name)

    policies = m.metadata.get("tensor_policies") or {}
    # Tile keys inside the data files keep the names the tensors were saved under; record
    # them so that tools reading those headers (tessera verify) can still match them.
    tile_names = dict(m.metadata.get("tile_names") or {})
    tile_names = {r(k): tile_names.get(k, k) for k in m.tensors if tile_names.get(k, k) != r(k)}
    history = list(m.metadata.get("renames") or [])
    history.append({"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "count": len(renames),
                    "rules": [[rule.old, rule.new, rule.regex] for rule in rules]})  # fmt: skip
    new = dataclasses.replace(
        m,
        tensors={r(k): v for k, v in m.tensors.items()},
        values={r(k): v for k, v in m.values.items()},
        per_rank={r(k): v for k, v in m.per_rank.items()},
        metadata={
            **m.metadata,
            "tensor_policies": {r(k): v for k, v in policies.items()},
            "tile_names": tile_names,
            "renames": history,
        },
    )
    return new
