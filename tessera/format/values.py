"""Plain Python values in the manifest: a tagged JSON encoding, and the pickle opt-in.

JSON alone loses tuples, non-string dict keys, bytes and non-finite floats, so those are
wrapped in single-key tag objects (``{"__tuple__": [...]}``). Anything else is refused
unless the caller opts in to pickle, at save *and* at load: unpickling runs arbitrary code.
"""

from __future__ import annotations

import base64
import math
import pickle
from typing import Any

import torch

from ..errors import InvalidStateError, ManifestError, PickleNotAllowedError
from .dtypes import dtype_from_name, dtype_name

_TAGS = ("__tuple__", "__dict__", "__bytes__", "__float__", "__dtype__", "__pickle__")
MAX_DEPTH = 100
"""How deeply containers may nest, in a state and in a stored value. Far beyond any real
state; it keeps encoding and decoding well inside Python's recursion limit, so a deeper
value is a typed error instead of a ``RecursionError``."""


def is_plain(value: object, _depth: int = 0) -> bool:
    """Whether ``value`` encodes without pickle (recursively; too deep is not plain)."""
    if value is None or isinstance(value, (bool, int, float, str, bytes, torch.dtype)):
        return True
    if _depth >= MAX_DEPTH:
        return False
    if isinstance(value, (list, tuple)):
        return all(is_plain(v, _depth + 1) for v in value)
    if isinstance(value, dict):
        return all(is_plain(k, _depth + 1) and is_plain(v, _depth + 1) for k, v in value.items())
    return False


def check_depth(value: object, name: str) -> None:
    """Refuse a value whose containers nest deeper than :data:`MAX_DEPTH` (iteratively).

    Raises:
        InvalidStateError: naming ``name``.
    """
    stack: list[tuple[object, int]] = [(value, 0)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, (list, tuple, dict)):
            if depth >= MAX_DEPTH:
                raise InvalidStateError(
                    f"value '{name}' nests containers more than {MAX_DEPTH} levels deep; tessera does not store such values"
                )
            items = v.values() if isinstance(v, dict) else v
            stack.extend((x, depth + 1) for x in items)


def encode_value(value: object, name: str, *, allow_pickle: bool = False) -> Any:
    """Encode ``value`` (stored under ``name``) as JSON-compatible data.

    Raises:
        PickleNotAllowedError: if the value needs pickle and ``allow_pickle`` is False.
        InvalidStateError: if containers nest deeper than :data:`MAX_DEPTH`.
    """
    return _encode(value, name, allow_pickle, 0)


def _encode(value: object, name: str, allow_pickle: bool, depth: int) -> Any:
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else {"__float__": repr(value)}
    if isinstance(value, (list, tuple, dict)) and depth >= MAX_DEPTH:
        raise InvalidStateError(
            f"value '{name}' nests containers more than {MAX_DEPTH} levels deep; tessera does not store such values"
        )
    d = depth + 1
    if isinstance(value, list):
        return [_encode(v, name, allow_pickle, d) for v in value]
    if (isinstance(value, tuple) and type(value) is tuple) or isinstance(value, torch.Size):
        return {"__tuple__": [_encode(v, name, allow_pickle, d) for v in value]}
    if type(value) is dict:
        if all(isinstance(k, str) and k not in _TAGS for k in value):
            return {k: _encode(v, name, allow_pickle, d) for k, v in value.items()}
        return {
            "__dict__": [
                [_encode(k, name, allow_pickle, d), _encode(v, name, allow_pickle, d)] for k, v in value.items()
            ]
        }
    if isinstance(value, (bytes, bytearray)):
        return {"__bytes__": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, torch.dtype):
        return {"__dtype__": dtype_name(value)}
    if not allow_pickle:
        raise PickleNotAllowedError(
            f"value '{name}' of type {type(value).__module__}.{type(value).__qualname__} is not a plain value "
            "(None, bool, int, float, str, bytes, list, tuple, dict, torch.dtype) and would need pickle; "
            "convert it, give it state_dict()/load_state_dict(), or pass allow_pickle=True to save and load"
        )
    try:
        return {"__pickle__": base64.b64encode(pickle.dumps(value)).decode("ascii")}
    except RecursionError:
        raise InvalidStateError(f"value '{name}' is nested too deeply to pickle") from None


def decode_value(data: Any, name: str, *, allow_pickle: bool = False) -> Any:
    """Inverse of :func:`encode_value`.

    Raises:
        PickleNotAllowedError: for a pickled value without ``allow_pickle``.
        ManifestError: for data that is not a valid encoding, or nests deeper than
            :data:`MAX_DEPTH`.
    """
    return _decode(data, name, allow_pickle, 0)


def _decode(data: Any, name: str, allow_pickle: bool, depth: int) -> Any:
    if data is None or isinstance(data, (bool, int, float, str)):
        return data
    if depth >= MAX_DEPTH:
        raise ManifestError(f"value '{name}': nested more than {MAX_DEPTH} levels deep")
    d = depth + 1
    if isinstance(data, list):
        return [_decode(v, name, allow_pickle, d) for v in data]
    if not isinstance(data, dict):
        raise ManifestError(f"value '{name}': unexpected JSON type {type(data).__name__}")
    if len(data) == 1:
        ((tag, inner),) = data.items()
        try:
            if tag == "__tuple__":
                return tuple(_decode(v, name, allow_pickle, d) for v in inner)
            if tag == "__dict__":
                return {
                    _hashable(_decode(k, name, allow_pickle, d), name): _decode(v, name, allow_pickle, d)
                    for k, v in inner
                }
            if tag == "__bytes__":
                return base64.b64decode(inner, validate=True)
            if tag == "__float__":
                if inner not in ("nan", "inf", "-inf"):
                    raise ValueError(inner)
                return float(inner)
            if tag == "__dtype__":
                return dtype_from_name(inner)
            if tag == "__pickle__":
                if not allow_pickle:
                    raise PickleNotAllowedError(
                        f"value '{name}' was saved with pickle; loading it runs code from the checkpoint. "
                        "Pass allow_pickle=True to load only if you trust its source"
                    )
                return pickle.loads(base64.b64decode(inner, validate=True))
        except (PickleNotAllowedError, ManifestError):
            raise
        except (TypeError, ValueError) as e:
            raise ManifestError(f"value '{name}': malformed {tag} encoding ({e})") from e
    return {k: _decode(v, name, allow_pickle, d) for k, v in data.items()}


def _hashable(key: Any, name: str) -> Any:
    if isinstance(key, list):
        raise ManifestError(f"value '{name}': a dict key decodes to a list")
    return key
