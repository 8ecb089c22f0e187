"""The manager is composed of parts that own their state: a structural check, by reading the source.

``CheckpointManager`` (``tessera/manager/core.py``) composes small objects (step directory,
retention, background saves, the save routes, the step loader). No other module may reach
into the manager's private attributes, and no part may import the facade back (not even
under ``TYPE_CHECKING``): a part that needs something of the manager is given it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import tessera

PACKAGE = Path(tessera.__file__).parent
CORE = PACKAGE / "manager" / "core.py"


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p != CORE)


def _manager_private_names() -> set[str]:
    """Every private attribute of CheckpointManager: ``self._x`` it assigns, ``_x`` it defines."""
    tree = ast.parse(CORE.read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "CheckpointManager"]
    names: set[str] = set()
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            names.add(node.attr)
    names |= {item.name for item in cls.body if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)}
    return {name for name in names if name.startswith("_") and not name.startswith("__")}


def test_the_private_names_are_found() -> None:
    # The check below is only as good as this list: the parts the facade holds must be in it.
    names = _manager_private_names()
    assert {"_closed", "_decider"} <= names, names


def test_no_module_but_core_touches_a_private_attribute_of_the_manager() -> None:
    private = _manager_private_names()
    found = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Attribute)
                and node.attr in private
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
            ):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: .{node.attr}")
    assert not found, "modules reaching into CheckpointManager's private attributes:\n" + "\n".join(found)


def test_nothing_imports_the_manager_facade_back() -> None:
    """Only the packages' ``__init__`` re-export the manager; no part of it imports ``core``."""
    reexports = {PACKAGE / "__init__.py", PACKAGE / "manager" / "__init__.py"}
    found = []
    for path in _modules():
        in_manager = path.parent == PACKAGE / "manager"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                module = node.module or ""
                names = {a.name for a in node.names}
                imports_core = (
                    module.endswith("manager.core")
                    or (in_manager and node.level == 1 and module == "core")
                    or (in_manager and node.level == 1 and not module and "core" in names)
                )
                if imports_core and path != PACKAGE / "manager" / "__init__.py":
                    found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: from {module} import ...")
                elif in_manager and "CheckpointManager" in names and path not in reexports:
                    found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: imports CheckpointManager")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.endswith("manager.core"):
                        found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: import {alias.name}")
    assert not found, "modules importing the manager facade:\n" + "\n".join(found)
