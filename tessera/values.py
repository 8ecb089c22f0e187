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

from .dtypes import dtype_from_name, dtype_name
from .errors import ManifestError, PickleNotAllowedError

_TAGS = ("__tuple__", "__dict__", "__bytes__", "__float__", "__dtype__", "__pickle__")


def is_plain(value: object) -> bool:
    """Whether ``value`` encodes without pickle (recursively)."""
    if value is None or isinstance(value, (bool, int, float, str, bytes, torch.dtype)):
        return True
    if isinstance(value, (list, tuple)):
        return all(is_plain(v) for v in value)
    if isinstance(value, dict):
        return all(is_plain(k) and is_plain(v) for k, v in value.items())
    return False


def encode_value(value: object, name: str, *, allow_pickle: bool = False) -> Any:
    """Encode ``value`` (stored under ``name``) as JSON-compatible data.

    Raises:
        PickleNotAllowedError: if the value needs pickle and ``allow_pickle`` is False.
    """
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else {"__float__": repr(value)}
    if isinstance(value, list):
        return [encode_value(v, name, allow_pickle=allow_pickle) for v in value]
    if isinstance(value, tuple) and type(value) is tuple or isinstance(value, torch.Size):
        return {"__tuple__": [encode_value(v, name, allow_pickle=allow_pickle) for v in value]}
    if type(value) is dict:
        if all(isinstance(k, str) and k not in _TAGS for k in value):
            return {k: encode_value(v, name, allow_pickle=allow_pickle) for k, v in value.items()}
        return {
            "__dict__": [
                [encode_value(k, name, allow_pickle=allow_pickle), encode_value(v, name, allow_pickle=allow_pickle)]
                for k, v in value.items()
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
    return {"__pickle__": base64.b64encode(pickle.dumps(value)).decode("ascii")}


def decode_value(data: Any, name: str, *, allow_pickle: bool = False) -> Any:
    """Inverse of :func:`encode_value`.

    Raises:
        PickleNotAllowedError: for a pickled value without ``allow_pickle``.
        ManifestError: for data that is not a valid encoding.
    """
    if data is None or isinstance(data, (bool, int, float, str)):
        return data
    if isinstance(data, list):
        return [decode_value(v, name, allow_pickle=allow_pickle) for v in data]
    if not isinstance(data, dict):
        raise ManifestError(f"value '{name}': unexpected JSON type {type(data).__name__}")
    if len(data) == 1:
        (tag, inner), = data.items()
        try:
            if tag == "__tuple__":
                return tuple(decode_value(v, name, allow_pickle=allow_pickle) for v in inner)
            if tag == "__dict__":
                return {
                    _hashable(decode_value(k, name, allow_pickle=allow_pickle), name):
                    decode_value(v, name, allow_pickle=allow_pickle)
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
        except PickleNotAllowedError:
            raise
        except (TypeError, ValueError) as e:
            raise ManifestError(f"value '{name}': malformed {tag} encoding ({e})") from e
    return {k: decode_value(v, name, allow_pickle=allow_pickle) for k, v in data.items()}


def _hashable(key: Any, name: str) -> Any:
    if isinstance(key, list):
        raise ManifestError(f"value '{name}': a dict key decodes to a list")
    return key
