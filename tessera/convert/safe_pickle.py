"""Reading other tools' pickles without running their code: one allow-list mechanism for every import.

DCP's ``.metadata`` is a raw pickle; DeepSpeed's and Megatron's ``*.pt`` files are
``torch.save`` pickles. Unpickling a file runs whatever callable it names (``os.system``,
``builtins.eval``), so, unless the caller opts in with ``allow_pickle=True``
(``--allow-pickle``), every import reads them with an allow-list of the few classes the
format really holds, written as ``torch.serialization.safe_globals`` takes them
(``obj`` or ``(obj, "module.Name")``):

* :func:`unpickle_restricted` reads a raw pickle with :class:`RestrictedUnpickler`, whose
  ``find_class`` returns only allowed objects;
* :func:`torch_load_restricted` reads a ``torch.save`` file with torch's own ``weights_only``
  unpickler (tensors, containers, numbers) plus the same kind of allow-list.

Either refuses anything else with :class:`~tessera.errors.PickleNotAllowedError` naming the
file and the opt-in, before any code from the file runs.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from ..errors import CorruptCheckpointError, PickleNotAllowedError

SafeGlobal = Callable[..., Any] | tuple[Any, str]
"""One allowed global: an object named by its ``__module__.__qualname__``, or ``(object, "module.Name")``."""


def _qualified(entry: SafeGlobal) -> tuple[str, Any]:
    if isinstance(entry, tuple):
        obj, name = entry
        return name, obj
    return f"{entry.__module__}.{entry.__qualname__}", entry


def _refusal(path: str, what: str, why: object) -> PickleNotAllowedError:
    return PickleNotAllowedError(
        f"refusing to unpickle {path} ({what}): {why}; unpickling would run code the file names. "
        "Pass allow_pickle=True (tessera convert --allow-pickle) only if you trust the file and its source"
    )


class _Refused(pickle.UnpicklingError):
    """The file asks for something the allow-list does not hold (not a malformed pickle)."""


class RestrictedUnpickler(pickle.Unpickler):
    """A ``pickle.Unpickler`` that resolves only allowed globals and no persistent ids.

    Every callable a pickle can invoke (``REDUCE``, ``NEWOBJ``, ``INST``, ``OBJ``,
    extension codes) is first looked up through :meth:`find_class`, so a file can build
    only the allowed classes, from plain values.

    Example:
        >>> data = pickle.dumps(torch.Size([2, 3]))
        >>> RestrictedUnpickler(io.BytesIO(data), [(torch.Size, "torch.Size")]).load()
        torch.Size([2, 3])
    """

    def __init__(self, file: io.BufferedIOBase | io.BytesIO, allowed: Iterable[SafeGlobal]) -> None:
        super().__init__(file)
        self._allowed: Mapping[str, Any] = dict(_qualified(e) for e in allowed)

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._allowed[f"{module}.{name}"]
        except KeyError:
            raise _Refused(f"it names '{module}.{name}', which is not allowed here") from None

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused("it holds a persistent id, which a plain pickle here never holds")


def unpickle_restricted(path: str, allowed: Iterable[SafeGlobal], *, allow_pickle: bool, what: str) -> Any:
    """The object pickled in the local file ``path``, built from ``allowed`` globals only.

    Args:
        path: the file (read whole: these are small metadata files).
        allowed: the globals the format holds.
        allow_pickle: unpickle anything (only for trusted files).
        what: what the file is, for messages ("DCP metadata").

    Returns:
        The unpickled object (its type is for the caller to check).

    Raises:
        PickleNotAllowedError: the file names a global outside ``allowed``.
        CorruptCheckpointError: the file is not a pickle (truncated, garbage).
        OSError: it cannot be read.

    Example:
        >>> md = unpickle_restricted("/dcp/.metadata", dcp_metadata_globals(), allow_pickle=False, what="DCP metadata")
    """
    with open(path, "rb") as f:
        data = f.read()
    try:
        if allow_pickle:
            return pickle.loads(data)
        return RestrictedUnpickler(io.BytesIO(data), allowed).load()
    except _Refused as e:
        raise _refusal(path, what, e) from e
    except (
        pickle.UnpicklingError,
        EOFError,
        ValueError,
        TypeError,
        IndexError,
        KeyError,
        AttributeError,
        RecursionError,
        MemoryError,
    ) as e:
        # What a truncated or malformed pickle raises from the opcodes it has (KeyError: a
        # memo miss; TypeError: an allowed class called with the wrong arguments).
        raise CorruptCheckpointError(f"{path}: {what} is not a valid pickle ({type(e).__name__}: {e})") from e


def torch_load_restricted(path: str, allowed: Iterable[SafeGlobal], *, allow_pickle: bool, what: str) -> Any:
    """``torch.load`` of ``path`` (memory-mapped where the format allows) with ``weights_only`` and ``allowed``.

    Args:
        path: a ``torch.save`` file.
        allowed: globals allowed besides torch's ``weights_only`` defaults.
        allow_pickle: unpickle anything (only for trusted files).
        what: what the file is, for messages ("DeepSpeed checkpoint file").

    Raises:
        PickleNotAllowedError: the file holds objects ``weights_only`` and ``allowed`` refuse.

    Example:
        >>> sd = torch_load_restricted("mp_rank_00_model_states.pt", [], allow_pickle=False, what="file")
    """
    if allow_pickle:
        return _torch_load(path, weights_only=False)
    with torch.serialization.safe_globals(list(allowed)):
        try:
            return _torch_load(path, weights_only=True)
        except pickle.UnpicklingError as e:  # weights_only refused an object: anything else propagates as is
            raise _refusal(path, what, f"it holds objects outside the format's usual contents ({e})") from e


def _torch_load(path: str, *, weights_only: bool) -> Any:
    """``torch.load`` memory-mapped, falling back to a plain read for the legacy (non-zip) format."""
    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only)
    except RuntimeError as e:
        if "mmap" not in str(e):
            raise
        return torch.load(path, map_location="cpu", weights_only=weights_only)
