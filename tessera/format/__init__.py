"""The on-disk format layer: geometry, dtypes, values, the manifest, safetensors headers, tile files
and on-disk names.

Imports only the vocabulary modules (``errors``, ``options``, ``results``, ...) below it; storage,
the engine and everything above build on it (see docs/architecture.md).
"""
