"""Hugging Face export from a sharded job (:func:`tessera.save_hf`), and the files of an HF directory."""

from .export import HFSaveResult, save_hf

__all__ = ["HFSaveResult", "save_hf"]
