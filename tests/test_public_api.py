"""The public API documents itself: every name in ``tessera.__all__`` has a docstring, every
public method of a public class too, and every public function with parameters lists them
under ``Args:`` (issue #16)."""

from __future__ import annotations

import inspect

import tessera


def _undocumented() -> list[str]:
    missing = []
    for name in tessera.__all__:
        obj = getattr(tessera, name)
        if not inspect.getdoc(obj):
            missing.append(name)
        if inspect.isfunction(obj) and inspect.signature(obj).parameters and "Args:" not in inspect.getdoc(obj):
            missing.append(f"{name} (no Args: section)")
        if inspect.isclass(obj):
            for attr, value in vars(obj).items():
                if not attr.startswith("_") and inspect.isfunction(value) and not inspect.getdoc(value):
                    missing.append(f"{name}.{attr}")
    return missing


def test_every_public_name_is_documented() -> None:
    assert _undocumented() == []


def test_every_public_name_resolves() -> None:
    # The package is lazy (PEP 562): a name in __all__ missing from _LAZY fails only when used.
    for name in tessera.__all__:
        assert getattr(tessera, name) is not None, name
    assert sorted(set(tessera.__all__)) == sorted(tessera.__all__)
