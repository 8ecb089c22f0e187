"""DCP's ``.metadata``, read without running code from it (plain DCP and Megatron-Core ``torch_dist``).

``torch.distributed.checkpoint`` writes ``.metadata`` with ``pickle.dump``, and its
``FileSystemReader.read_metadata`` reads it back with ``pickle.load``: a crafted file runs
its payload as soon as it is read. :func:`read_dcp_metadata` reads it with
:func:`~tessera.convert.safe_pickle.unpickle_restricted` and :data:`DCP_METADATA_GLOBALS`,
the classes that files written by ``dcp.save`` (one process or many, DTensors, byte entries)
and by Megatron-Core's ``torch_dist`` writer (which adds every rank's save plan) hold, then
checks the structure the importers rely on, so a malformed file is a typed error naming it
rather than an ``AttributeError`` deep in DCP's reader.
"""

from __future__ import annotations

import collections
import os
import pathlib
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    BytesIOWriteData,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from .._torch_private import dcp_metadata_private_classes
from ..errors import CorruptCheckpointError
from .safe_pickle import SafeGlobal, unpickle_restricted

METADATA_FILE = ".metadata"
"""DCP's metadata file in a checkpoint directory."""


def _layout(name: str) -> torch.layout:
    """Stand-in for ``torch.serialization._get_layout``, which ``torch.layout`` pickles through."""
    for v in vars(torch).values():
        if isinstance(v, torch.layout) and str(v) == name:
            return v
    raise ValueError(f"unknown torch layout {name!r}")


def _torch_constants() -> list[SafeGlobal]:
    """Every ``torch.<dtype>``, ``torch.<layout>`` and ``torch.<memory_format>``, by the name pickle uses."""
    kinds = (torch.dtype, torch.layout, torch.memory_format)
    return [(v, f"torch.{k}") for k, v in vars(torch).items() if isinstance(v, kinds)]


def _paths() -> list[SafeGlobal]:
    """``StorageMeta.checkpoint_id`` may be a path: read back as a pure path (no filesystem access)."""
    out: list[SafeGlobal] = []
    for module in ("pathlib", "pathlib._local"):  # Python 3.13 moved the classes to pathlib._local
        out += [
            (pathlib.PurePosixPath, f"{module}.PosixPath"),
            (pathlib.PurePosixPath, f"{module}.PurePosixPath"),
            (pathlib.PureWindowsPath, f"{module}.WindowsPath"),
            (pathlib.PureWindowsPath, f"{module}.PureWindowsPath"),
        ]
    return out


def dcp_metadata_globals() -> list[SafeGlobal]:
    """The globals a DCP ``.metadata`` file may name (found by unpickling real ones, torch 2.13).

    ``dcp.save`` writes the metadata dataclasses, ``torch.Size``, dtypes, layouts and the
    private ``_StorageInfo`` / ``_MEM_FORMAT_ENCODING``; Megatron-Core adds the ranks' save
    plans (``SavePlan``, ``WriteItem``, ...). All of them are plain records or enums.
    """
    public: list[SafeGlobal] = [
        Metadata, TensorStorageMetadata, BytesStorageMetadata, ChunkStorageMetadata, TensorProperties,
        MetadataIndex, StorageMeta, SavePlan, WriteItem, WriteItemType, TensorWriteData, BytesIOWriteData,
    ]  # fmt: skip
    return [
        *public,
        *dcp_metadata_private_classes(),
        (torch.Size, "torch.Size"),
        (_layout, "torch.serialization._get_layout"),
        (collections.OrderedDict, "collections.OrderedDict"),
        *_torch_constants(),
        *_paths(),
    ]


def read_dcp_metadata(directory: str, *, allow_pickle: bool = False) -> Metadata:
    """The ``.metadata`` of the DCP checkpoint in ``directory``, checked; no code from it runs.

    Args:
        directory: the DCP checkpoint directory (a Megatron ``iter_*`` directory included).
        allow_pickle: unpickle whatever the file names (only for checkpoints you trust);
            the structure is checked all the same.

    Returns:
        DCP's ``Metadata``, ready for ``FileSystemReader.set_up_storage_reader``.

    Raises:
        FileNotFoundError: there is no ``.metadata``.
        PickleNotAllowedError: the file names a class DCP's metadata never holds.
        CorruptCheckpointError: it is not a pickle of DCP metadata, or its entries are
            malformed or point at files outside ``directory``.

    Example:
        >>> md = read_dcp_metadata("/dcp/step100")
        >>> sorted(md.state_dict_metadata)[:2]
        ['model.w', 'optim.step']
    """
    path = os.path.join(directory, METADATA_FILE)
    md = unpickle_restricted(path, dcp_metadata_globals(), allow_pickle=allow_pickle, what="DCP metadata")
    _check(md, path)
    return md


def _check(md: Any, path: str) -> None:
    """Raise ``CorruptCheckpointError`` unless ``md`` has the structure the importers read."""

    def bad(what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{path}: {what}; the DCP metadata is malformed (not what dcp.save writes)")

    if not isinstance(md, Metadata):
        raise bad(f"it holds a {type(md).__name__}, not DCP Metadata")
    if not isinstance(md.state_dict_metadata, dict):
        raise bad("state_dict_metadata is not a dict")
    storage = md.storage_data
    if not isinstance(storage, dict):
        raise bad("storage_data is not a dict of entry locations")
    for fqn, entry in md.state_dict_metadata.items():
        if not isinstance(fqn, str):
            raise bad(f"entry name {fqn!r} is not a string")
        if isinstance(entry, BytesStorageMetadata):
            _check_location(storage.get(MetadataIndex(fqn)), f"entry '{fqn}'", bad)
            continue
        if not isinstance(entry, TensorStorageMetadata):
            raise bad(f"entry '{fqn}' is a {type(entry).__name__}, not tensor or bytes metadata")
        props = entry.properties
        if not isinstance(props, TensorProperties) or not isinstance(getattr(props, "dtype", None), torch.dtype):
            raise bad(f"tensor '{fqn}' has no dtype")
        if not _is_shape(entry.size):
            raise bad(f"tensor '{fqn}' has shape {entry.size!r}, not a list of sizes")
        if not isinstance(entry.chunks, list):
            raise bad(f"tensor '{fqn}' has no list of chunks")
        for chunk in entry.chunks:
            if (
                not isinstance(chunk, ChunkStorageMetadata)
                or not _is_shape(chunk.offsets)
                or not _is_shape(chunk.sizes)
            ):
                raise bad(f"tensor '{fqn}' has a malformed chunk {chunk!r:.80}")
            if len(chunk.offsets) != len(entry.size) or len(chunk.sizes) != len(entry.size):
                raise bad(f"tensor '{fqn}' of shape {list(entry.size)} has a chunk of {len(chunk.sizes)} dimensions")
            if any(o + n > s for o, n, s in zip(chunk.offsets, chunk.sizes, entry.size)):
                raise bad(
                    f"tensor '{fqn}' of shape {list(entry.size)} has a chunk at {list(chunk.offsets)} of size "
                    f"{list(chunk.sizes)} outside it"
                )
            if all(chunk.sizes):  # empty chunks are never read
                where = f"tensor '{fqn}' chunk at {list(chunk.offsets)}"
                _check_location(storage.get(MetadataIndex(fqn, chunk.offsets)), where, bad)


def _is_shape(value: Any) -> bool:
    return isinstance(value, (tuple, list)) and all(type(n) is int and n >= 0 for n in value)


def _check_location(info: Any, where: str, bad: Any) -> None:
    """A storage location must name a data file inside the checkpoint directory."""
    if info is None:
        raise bad(f"{where} has no storage location")
    name, offset, length = (getattr(info, a, None) for a in ("relative_path", "offset", "length"))
    parts = name.split("/") if isinstance(name, str) else [""]
    if any(p in ("", ".", "..") or "\\" in p or "\0" in p for p in parts):
        raise bad(f"{where} is stored in {name!r}, not a file of the checkpoint directory")
    if type(offset) is not int or type(length) is not int or offset < 0 or length < 0:
        raise bad(f"{where} has the byte range offset={offset!r}, length={length!r}")
