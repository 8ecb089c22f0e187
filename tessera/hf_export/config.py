"""``config.json`` of a Hugging Face export: where it comes from and how it is written.

A tessera checkpoint holds tensors, not a model class, so ``export_hf`` writes a
``config.json`` only when one is given: a ``config=`` argument (a dict, a ``config.json``
file, or a model directory holding one: ``tessera convert --config``), else the checkpoint's
metadata entry :data:`HF_CONFIG_KEY`, which ``import_hf`` records from the directory it reads
and a training job can record itself::

    tessera.save(path, state, options=tessera.SaveOptions(
        metadata={"hf_config": json.loads(model.config.to_json_string())}))

As :func:`tessera.save_hf` does, the config's dtype is set to the floating-point dtype
written, when there is exactly one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import torch

from ..storage import Storage

__all__ = ["CONFIG_NAME", "HF_CONFIG_KEY", "config_of_directory", "read_config", "write_config"]

HF_CONFIG_KEY = "hf_config"
"""The manifest metadata entry holding a Hugging Face config (a JSON object)."""
CONFIG_NAME = "config.json"


def read_config(config: Mapping[str, Any] | str) -> dict[str, Any]:
    """The config ``config`` names: a dict, a ``config.json`` file, or a directory holding one.

    Raises:
        FileNotFoundError: if the file (or the directory's ``config.json``) does not exist.
        ValueError: if it is not a JSON object.

    Example:
        >>> read_config("/models/llama")["model_type"]  # doctest: +SKIP
        'llama'
    """
    if isinstance(config, Mapping):
        return dict(config)
    path = os.path.join(config, CONFIG_NAME) if os.path.isdir(config) else config
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"no Hugging Face config at {path} (give a config.json file or a directory holding one)"
        )
    with open(path, encoding="utf-8") as f:
        try:
            doc = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(doc, dict):
        raise ValueError(f"{path} holds a JSON {type(doc).__name__}, not a Hugging Face config (a JSON object)")
    return doc


def config_of_directory(src: str) -> dict[str, Any] | None:
    """The ``config.json`` beside the safetensors files of ``src``, if there is a valid one."""
    directory = src if os.path.isdir(src) else os.path.dirname(src)
    try:
        return read_config(os.path.join(directory, CONFIG_NAME))
    except (FileNotFoundError, ValueError):
        return None


def write_config(out: Storage, config: Mapping[str, Any], dtypes: set[torch.dtype]) -> None:
    """Write ``config.json`` (atomically), its dtype set to the one floating-point dtype written."""
    doc = dict(config)
    floats = {d for d in dtypes if d.is_floating_point}
    if len(floats) == 1:
        name = str(next(iter(floats))).removeprefix("torch.")
        for key in [k for k in ("dtype", "torch_dtype") if k in doc] or ["torch_dtype"]:
            doc[key] = name
    out.write_atomic(CONFIG_NAME, (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode("utf-8"))
