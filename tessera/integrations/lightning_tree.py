"""The nesting of a Lightning checkpoint dict, kept beside its tensors and values.

:func:`encode_tree` splits the dict into a JSON skeleton (stored in the manifest's metadata under
:data:`METADATA_KEY`) and named leaves (saved as tensors and plain values); :func:`decode_tree`
rebuilds it. Pure: no Lightning import, so it is usable and testable without Lightning.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..errors import CheckpointError

METADATA_KEY = "lightning"
"""Key of the manifest metadata that records the checkpoint dict's nesting."""


def encode_tree(tree: Mapping[str, Any]) -> tuple[list[Any], dict[str, object]]:
    """Split a nested checkpoint dict into a JSON skeleton and ``{fqn: leaf}``.

    Containers holding tensors are walked (dicts by key, lists and tuples by index); a
    tensor is a leaf named by its dotted path, and so is a subtree without tensors (stored
    as one plain value; dict subclasses such as ``OrderedDict`` become dicts). Names that
    two paths share (keys with dots) get a ``#n`` suffix.

    Returns:
        ``(skeleton, leaves)``: nodes are ``["d", [[key, node], ...]]``, ``["l", [node, ...]]``,
        ``["t", [node, ...]]`` and ``["v", fqn]``.
    """
    leaves: dict[str, object] = {}

    def name_for(path: str) -> str:
        name, n = path, 1
        while name in leaves:
            name, n = f"{path}#{n}", n + 1
        return name

    def walk(value: object, path: str) -> list[Any]:
        if isinstance(value, Mapping) and _has_tensor(value):
            items = []
            for k, v in value.items():
                if not isinstance(k, (str, int)) or isinstance(k, bool):
                    raise TypeError(f"checkpoint key {k!r} under '{path}' must be a str or int")
                items.append([k, walk(v, f"{path}.{k}" if path else str(k))])
            return ["d", items]
        if isinstance(value, (list, tuple)) and _has_tensor(value):
            kind = "t" if isinstance(value, tuple) else "l"
            return [kind, [walk(v, f"{path}.{i}") for i, v in enumerate(value)]]
        name = name_for(path)
        leaves[name] = value if isinstance(value, torch.Tensor) else _plain(value)
        return ["v", name]

    return walk(dict(tree), ""), leaves


def decode_tree(node: list[Any], leaves: Mapping[str, object]) -> Any:
    """Rebuild the nested checkpoint dict from :func:`encode_tree`'s skeleton and loaded leaves."""
    kind, body = node
    if kind == "d":
        return {k: decode_tree(child, leaves) for k, child in body}
    if kind == "l":
        return [decode_tree(child, leaves) for child in body]
    if kind == "t":
        return tuple(decode_tree(child, leaves) for child in body)
    if kind == "v":
        return leaves[body]
    raise CheckpointError(f"unknown node {kind!r} in the checkpoint's '{METADATA_KEY}' metadata")


def _has_tensor(value: object) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, Mapping):
        return any(_has_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_tensor(v) for v in value)
    return False


def _plain(value: object) -> object:
    """Dict subclasses (``OrderedDict``, Lightning's ``AttributeDict``) as dicts, recursively."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if type(value) is list:
        return [_plain(v) for v in value]
    if type(value) is tuple:
        return tuple(_plain(v) for v in value)
    return value
