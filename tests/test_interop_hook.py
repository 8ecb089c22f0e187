"""The interop marker's contract (tests/conftest.py): skip locally, fail in CI when a framework is missing."""

from __future__ import annotations

import os
import shutil

import pytest

from tests.dist_utils import run_script

_TESTS = """
import pytest

@pytest.mark.interop("tessera_no_such_framework")
def test_needs_missing():
    pass

@pytest.mark.interop()
def test_importorskip_inside():
    pytest.importorskip("tessera_no_such_framework")

@pytest.mark.interop("pytest")
def test_present():
    pass

def test_plain_skip():
    pytest.skip("not an interop test")
"""


_MODULE = """
import pytest

pytest.importorskip("tessera_no_such_framework")


def test_never_collected():
    pass
"""


def _run(tmp_path, require: str | None, *, module: bool = True) -> str:
    """``python -m pytest`` on the test files above with this conftest, in a process forked
    from the preloaded server (tests/dist_utils.py): the conftest imports torch, and a fresh
    interpreter spends seconds on that."""
    shutil.copy(os.path.join(os.path.dirname(__file__), "conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_x.py").write_text(_TESTS)
    if module:
        (tmp_path / "test_interop_mod.py").write_text(_MODULE)
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\nmarkers =\n    interop(*packages): real frameworks\n    cuda: cuda\n"
    )
    # The server imported anyio (a pytest plugin) with transformers: pytest's warning that it
    # cannot rewrite it would add a word to the summary lines compared below.
    quiet = ["-W", "ignore::pytest.PytestAssertRewriteWarning"]
    args = ["-q", "-rA", "-p", "no:cacheprovider", *quiet, str(tmp_path)]
    (tmp_path / "run_pytest.py").write_text(f"import sys\nimport pytest\n\nsys.exit(pytest.main({args!r}))\n")
    env = {k: v for k, v in os.environ.items() if k != "TESSERA_REQUIRE_INTEROP"}
    if require is not None:
        env["TESSERA_REQUIRE_INTEROP"] = require
    return run_script(tmp_path / "run_pytest.py", cwd=tmp_path, env=env, timeout=300).stdout


@pytest.mark.parametrize("require", [None, "0"])
def test_missing_framework_skips_locally(tmp_path, require: str | None) -> None:
    out = _run(tmp_path, require)
    assert "1 passed, 4 skipped" in out, out
    assert "needs tessera_no_such_framework" in out


def test_missing_framework_fails_when_required(tmp_path) -> None:
    out = _run(tmp_path, "1", module=False)
    assert "FAILED" in out and "test_needs_missing" in out and "test_importorskip_inside" in out, out
    # The missing package fails at setup (an error), the skip from inside the test fails it;
    # a plain skip stays a skip.
    assert "1 failed, 1 passed, 1 skipped, 1 error" in out, out


def test_interop_module_skipping_itself_fails_collection_when_required(tmp_path) -> None:
    out = _run(tmp_path, "1")
    assert "interop module test_interop_mod.py skipped" in out and "1 error" in out, out
