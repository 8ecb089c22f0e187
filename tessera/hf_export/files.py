"""The files of a Hugging Face model directory: names, shards, the index (export and import share them)."""

from __future__ import annotations

import json
import logging
import os
import re

from ..storage import Storage

logger = logging.getLogger(__name__)


INDEX_NAME = "model.safetensors.index.json"


SINGLE_NAME = "model.safetensors"


_MODEL_FILE = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$|^model\.safetensors\.index\.json$")


def group_shards(sizes: list[int], limit: int) -> list[list[int]]:
    """Group tensors of ``sizes`` bytes, in order, into shards of at most ``limit`` bytes.

    Shards fill in order, as ``transformers``' ``save_pretrained`` does; a tensor larger than
    the limit gets a shard of its own. Returns the indices of ``sizes`` in each shard.

    Example:
        >>> group_shards([4, 4, 8, 2], 8)
        [[0, 1], [2], [3]]
    """
    shards: list[list[int]] = [[]]
    size = 0
    for i, nbytes in enumerate(sizes):
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += nbytes
    return shards


def shard_file_names(count: int) -> list[str]:
    """Names of ``count`` shard files: ``model.safetensors`` alone, else ``model-0000i-of-0000N``.

    Example:
        >>> shard_file_names(2)
        ['model-00001-of-00002.safetensors', 'model-00002-of-00002.safetensors']
    """
    if count == 1:
        return [SINGLE_NAME]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def index_bytes(total_size: int, weight_map: dict[str, str]) -> bytes:
    """The content of ``model.safetensors.index.json`` for a sharded directory."""
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    return json.dumps(index, indent=2, sort_keys=True).encode()


def remove_model_files(out: Storage, out_dir: str) -> None:
    """Delete earlier ``model*.safetensors`` files and the index (config and tokenizer stay)."""
    stale = [p for p in out.list("") if _MODEL_FILE.match(p)]
    if stale:
        logger.info("replacing %d model file(s) in %s", len(stale), out_dir)
        out.delete(stale)


def hf_files(src: str) -> list[str]:
    """The safetensors files of a Hugging Face directory (index, single file or all), or ``src`` itself.

    Raises:
        FileNotFoundError: if there is none.

    Example:
        >>> hf_files("/models/llama")  # [".../model-00001-of-00002.safetensors", ...]
    """
    if os.path.isfile(src):
        return [src]
    index = os.path.join(src, INDEX_NAME)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map", {})
        return [os.path.join(src, n) for n in sorted(set(weight_map.values()))]
    single = os.path.join(src, SINGLE_NAME)
    if os.path.isfile(single):
        return [single]
    found = (
        sorted(os.path.join(src, n) for n in os.listdir(src) if n.endswith(".safetensors"))
        if os.path.isdir(src)
        else []
    )
    if not found:
        raise FileNotFoundError(
            f"no safetensors files in {src} (expected {INDEX_NAME}, {SINGLE_NAME} or *.safetensors)"
        )
    return found
