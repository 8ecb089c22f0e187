"""Shared pytest configuration: markers' behaviour and common fixtures.

Tests against real third-party frameworks carry ``@pytest.mark.interop("pkg", ...)``, naming
the import names they need. Without those packages the test is skipped, locally; with
``TESSERA_REQUIRE_INTEROP=1`` (what ``scripts/test.sh`` sets in CI) a missing package, or any
skip raised from inside an interop test (``pytest.importorskip``), is a failure instead, so a
broken install of the ``interop`` extra can never turn into a silently green run. So is a
test module that skips itself whole while being collected.

A session that leaves anything in the temporary directory or tessera-named entries in
``/dev/shm`` fails, naming each leftover and the test that left it (``tests/leftovers.py``;
``TESSERA_LEFTOVER_CHECK=0`` turns the check off). Host-memory steps that a test writes for
checkpoints under its ``tmp_path`` are removed after the test, as pytest keeps ``tmp_path``
but nothing may stay in ``/dev/shm``.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

try:
    from tests.leftovers import LeftoverCheck, remove_memory_mirror
except ImportError:  # a conftest copied into a pytester directory (test_interop_hook.py) has no tests package
    LeftoverCheck = remove_memory_mirror = None  # type: ignore[assignment,misc]

_MISSING = pytest.StashKey[str]()
_LEFTOVERS = pytest.StashKey[LeftoverCheck]()
_LEFTOVER_LINES = pytest.StashKey[list[str]]()


def _require_interop() -> bool:
    return os.environ.get("TESSERA_REQUIRE_INTEROP", "") not in ("", "0")


def _missing(packages: tuple[str, ...]) -> list[str]:
    out = []
    for name in packages:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            out.append(name)
    return out


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_cuda = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if isinstance(item, pytest.Function) and _uses_harness(item.function, item.module):
            item.add_marker(pytest.mark.distributed)
        if "cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_cuda)
            continue
        marker = item.get_closest_marker("interop")
        if marker is None:
            continue
        missing = _missing(tuple(marker.args))
        if not missing:
            continue
        reason = f"needs {', '.join(missing)} (pip install -e '.[interop]', or bash scripts/setup.sh)"
        if _require_interop():
            item.stash[_MISSING] = reason
        else:
            item.add_marker(pytest.mark.skip(reason=reason))


_HARNESS_NAMES = ("run_distributed", "run_ranks", "start_ranks", "start", "RankGroup")


def _code_names(code: types.CodeType) -> set[str]:
    """Global names a function's code refers to, nested functions and lambdas included."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def _uses_harness(fn: object, module: types.ModuleType | None, depth: int = 0) -> bool:
    """Whether a test starts processes through tests/dist_utils.py, directly or through a
    helper function of its module (the ``distributed`` marker)."""
    code = getattr(fn, "__code__", None)
    if module is None or code is None or depth > 2:
        return False
    dist_utils = sys.modules.get("tests.dist_utils")
    if dist_utils is None:  # nothing collected imports the harness (or a conftest copied elsewhere)
        return False
    harness = [getattr(dist_utils, n) for n in _HARNESS_NAMES]
    for name in _code_names(code):
        obj = getattr(module, name, None)
        if obj is None:
            continue
        if any(obj is h for h in harness):
            return True
        if inspect.isfunction(obj) and obj.__module__ == module.__name__ and _uses_harness(obj, module, depth + 1):
            return True
    return False


def pytest_runtest_setup(item: pytest.Item) -> None:
    reason = item.stash.get(_MISSING, None)
    if reason is not None:
        pytest.fail(f"TESSERA_REQUIRE_INTEROP=1 but this interop test {reason}", pytrace=False)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if (
        report.skipped
        and _require_interop()
        and item.get_closest_marker("interop") is not None
        and not (item.get_closest_marker("cuda") and not torch.cuda.is_available())
        and not hasattr(report, "wasxfail")
    ):
        report.outcome = "failed"
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.longrepr = f"TESSERA_REQUIRE_INTEROP=1 but this interop test skipped: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    name = os.path.basename(str(getattr(collector, "path", "")))
    # With every extra installed (CI), no test module may skip itself whole: the integration and
    # Megatron modules import their framework at the top with importorskip.
    if report.skipped and _require_interop() and name.startswith("test_") and name.endswith(".py"):
        report.outcome = "failed"
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.longrepr = f"TESSERA_REQUIRE_INTEROP=1 but interop module {name} skipped: {reason}"


# ------------------------------------------------------------------------------------------
# Leftovers in the temporary directory and /dev/shm


def pytest_configure(config: pytest.Config) -> None:
    # The CLI sizes its tables to the terminal (COLUMNS first): as in a pipe, whatever terminal
    # or pytest-xdist worker runs the tests.
    os.environ["COLUMNS"] = "140"
    if LeftoverCheck is None:
        return
    if os.environ.get("TESSERA_LEFTOVER_CHECK", "1") != "0":
        worker = getattr(config, "workerinput", {}).get("workerid")  # a pytest-xdist worker
        config.stash[_LEFTOVERS] = LeftoverCheck(worker=worker)  # before any test creates a temporary file


@pytest.fixture(autouse=True)
def _no_leftovers(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    check = request.config.stash.get(_LEFTOVERS, None)
    if check is not None:
        check.basetemp = tmp_path_factory.getbasetemp()
        check.before_test()
    tmp: Path | None = request.getfixturevalue("tmp_path") if "tmp_path" in request.fixturenames else None
    yield
    if tmp is not None and remove_memory_mirror is not None:
        remove_memory_mirror(tmp)  # a tier:: root or local tier under tmp_path keeps its steps in /dev/shm
    if check is not None:
        check.after_test(request.node.nodeid)


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    check = session.config.stash.get(_LEFTOVERS, None)
    if check is None:
        return
    from tessera.engine.saving import writer_process

    writer_process.shutdown()  # a live writer process of this process is not a leftover yet
    lines = check.finish()
    if lines:
        session.config.stash[_LEFTOVER_LINES] = lines
        if session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    lines = terminalreporter.config.stash.get(_LEFTOVER_LINES, None)
    if lines:
        terminalreporter.write_sep("=", "leftovers: this session left these behind (the run fails)", red=True)
        for line in lines:
            terminalreporter.write_line(line)
