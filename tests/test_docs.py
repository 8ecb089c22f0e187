"""Every ```python block of README.md and docs/*.md runs as written.

Each block runs as a script in its own Python process whose working directory is an empty
temporary directory, with the repository importable (``PYTHONPATH``). The process is forked
from a server that has imported torch and tessera already (``run_script`` in
tests/dist_utils.py), which saves the seconds a fresh interpreter needs; a block that starts
processes from functions it defines (``multiprocessing``) or names ``torchrun`` runs in a
fresh interpreter instead. Two markers, on the line
before a block (blank lines in between are allowed), change that:

* ``<!-- snippet: skip (reason) -->``: the block is not run. The reason is required, so a
  reader knows why (needs torchrun, S3, a GPU, ...).
* ``<!-- snippet: continue -->``: the block continues the previous block of the same file
  (it shares its names); they run together, as one program, in one process.

A block that continues a skipped block is skipped with it. Any other ``snippet:`` marker
is an error, as is a ``skip`` without a reason or a ``continue`` with no block before it.
Tests are named ``file:line`` (the line of the first block's opening fence).

A block must clean up after itself: host-memory checkpoint steps it leaves fail its test,
and anything it leaves in the temporary directory fails the session (tests/conftest.py).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tessera.storage.host_memory import default_memory_root
from tests.dist_utils import run_script

REPO = Path(__file__).resolve().parent.parent
TIMEOUT_S = float(os.environ.get("TESSERA_DOCS_TIMEOUT_S", "300"))  # generous: the machine may be shared

_MARKER = re.compile(r"^\s*<!--\s*snippet:\s*(.*?)\s*-->\s*$")
_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")


class SnippetMarkerError(ValueError):
    """A ``<!-- snippet: ... -->`` marker that is malformed or misplaced."""


@dataclass
class Snippet:
    """One program: a block and the blocks that continue it."""

    file: str
    line: int
    code: str
    skip: str | None = None
    lines: list[int] = field(default_factory=list)

    @property
    def id(self) -> str:
        return f"{self.file}:{self.line}"


def extract(text: str, file: str) -> list[Snippet]:
    """The runnable programs of one Markdown file, in order.

    Raises:
        SnippetMarkerError: for an unknown marker, a ``skip`` without a reason, or a
            ``continue`` with no earlier block in the file.
    """
    lines = text.splitlines()
    out: list[Snippet] = []
    marker: tuple[str, int] | None = None  # (marker text, its line) waiting for a block
    i = 0
    while i < len(lines):
        line = lines[i]
        m = _MARKER.match(line)
        if m:
            marker = (m.group(1), i + 1)
            i += 1
            continue
        fence = _FENCE.match(line)
        if fence is None:
            if line.strip():
                marker = None  # a marker applies only to the block right after it
            i += 1
            continue
        indent, ticks, lang = fence.groups()
        start = i + 1
        body: list[str] = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(ticks[0] * len(ticks)):
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i])
            i += 1
        i += 1  # the closing fence
        if lang != "python":
            if marker is not None:
                raise SnippetMarkerError(
                    f"{file}:{marker[1]}: a snippet marker before a ```{lang} block (only ```python blocks run)"
                )
            continue
        code = "\n".join(body) + "\n"
        kind, at = marker if marker else ("", 0)
        if kind == "continue":
            if not out:
                raise SnippetMarkerError(f"{file}:{at}: 'snippet: continue' with no earlier python block")
            prev = out[-1]
            prev.code += f"\n# --- {file}:{start} ---\n" + code
            prev.lines.append(start)
        elif kind.startswith("skip"):
            reason = re.fullmatch(r"skip\s*\((.+)\)", kind)
            if reason is None or not reason.group(1).strip():
                raise SnippetMarkerError(f"{file}:{at}: 'snippet: skip' needs a reason: <!-- snippet: skip (why) -->")
            out.append(Snippet(file, start, code, skip=reason.group(1).strip(), lines=[start]))
        elif kind:
            raise SnippetMarkerError(
                f"{file}:{at}: unknown snippet marker {kind!r} (use 'skip (reason)' or 'continue')"
            )
        else:
            out.append(Snippet(file, start, code, lines=[start]))
        marker = None
    return out


def documented_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def all_snippets() -> list[Snippet]:
    out: list[Snippet] = []
    for path in documented_files():
        out += extract(path.read_text(encoding="utf-8"), str(path.relative_to(REPO)))
    return out


_NEEDS_INTERPRETER = re.compile(r"^\s*(import|from)\s+(torch\.)?multiprocessing\b|torchrun", re.MULTILINE)


def needs_interpreter(code: str) -> bool:
    """Whether a block must run in a fresh interpreter: it starts processes from functions it
    defines (a spawned child re-runs the script), or it is a torchrun script."""
    return _NEEDS_INTERPRETER.search(code) is not None


def run_snippet(snippet: Snippet, tmp: Path) -> subprocess.CompletedProcess[str]:
    """Run ``snippet`` as a script, in the empty directory ``tmp/cwd``."""
    tmp.mkdir(parents=True, exist_ok=True)
    script = tmp / "snippet.py"
    script.write_text(snippet.code, encoding="utf-8")
    cwd = tmp / "cwd"
    cwd.mkdir()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("OMP_NUM_THREADS", "1")
    if not needs_interpreter(snippet.code):
        return run_script(script, cwd=cwd, env=env, timeout=TIMEOUT_S)
    return subprocess.run(
        [sys.executable, str(script)], cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )


_SNIPPETS = all_snippets()


@pytest.mark.parametrize("snippet", _SNIPPETS, ids=[s.id for s in _SNIPPETS])
def test_snippet_runs(snippet: Snippet, tmp_path: Path) -> None:
    if snippet.skip is not None:
        pytest.skip(f"marked skip: {snippet.skip}")
    try:
        proc = run_snippet(snippet, tmp_path)
    except subprocess.TimeoutExpired as e:
        out, err = (x.decode(errors="replace") if isinstance(x, bytes) else (x or "") for x in (e.stdout, e.stderr))
        pytest.fail(
            f"the python block(s) at {snippet.id} ran past {TIMEOUT_S:.0f}s (TESSERA_DOCS_TIMEOUT_S):\n"
            f"--- stdout ---\n{out[-4000:]}\n--- stderr ---\n{err[-4000:]}",
            pytrace=False,
        )
    where = ", ".join(f"{snippet.file}:{n}" for n in snippet.lines)
    if proc.returncode != 0:
        pytest.fail(
            f"the python block(s) at {where} failed (exit {proc.returncode}):\n"
            f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-4000:]}",
            pytrace=False,
        )
    # A reader copies the block as it is: it must not leave host-memory steps behind (they
    # outlive the process and count against RAM). Checkpoints in the working directory are
    # mirrored under this path; tests/conftest.py checks everything else at the session's end.
    shm = default_memory_root(str(tmp_path))
    left = [os.path.join(d, f) for d, _, files in os.walk(shm) for f in files]
    if left:
        pytest.fail(
            f"the python block(s) at {where} left host-memory checkpoint files in {shm} (remove them at the "
            f"end of the block, as docs/resilience.md shows): {left[:3]}",
            pytrace=False,
        )


# ------------------------------------------------------------------------------------------
# The extractor itself


def test_every_doc_page_is_collected() -> None:
    names = {p.name for p in documented_files()}
    assert "README.md" in names and "manager.md" in names and "format.md" in names


def test_extract_honours_skip_and_continue() -> None:
    text = "\n".join([
        "# t", "```python", "a = 1", "```",
        "<!-- snippet: continue -->", "```python", "assert a == 1", "```",
        "text", "<!-- snippet: skip (needs torchrun) -->", "", "```python", "boom()", "```",
        "<!-- snippet: continue -->", "```python", "boom_again()", "```",
        "```bash", "echo hi", "```",
        "```python", "b = 2", "```",
    ])  # fmt: skip
    got = extract(text, "x.md")
    assert [(s.line, s.skip, s.lines) for s in got] == [
        (2, None, [2, 6]),
        (12, "needs torchrun", [12, 16]),
        (22, None, [22]),
    ]
    assert got[0].code.startswith("a = 1\n") and "assert a == 1" in got[0].code
    assert "boom_again()" in got[1].code
    assert got[2].code == "b = 2\n"


def test_marker_applies_only_to_the_next_block() -> None:
    got = extract("<!-- snippet: skip (why) -->\nsome text\n```python\nx = 1\n```\n", "x.md")
    assert got[0].skip is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("<!-- snippet: skip -->\n```python\nx\n```\n", "needs a reason"),
        ("<!-- snippet: skip () -->\n```python\nx\n```\n", "needs a reason"),
        ("<!-- snippet: continue -->\n```python\nx\n```\n", "no earlier python block"),
        ("<!-- snippet: run-later -->\n```python\nx\n```\n", "unknown snippet marker"),
        ("<!-- snippet: skip (why) -->\n```bash\nls\n```\n", "before a ```bash block"),
    ],
)
def test_malformed_markers_are_errors(text: str, message: str) -> None:
    with pytest.raises(SnippetMarkerError, match=re.escape(message)):
        extract(text, "x.md")


@pytest.mark.parametrize("fresh", [False, True], ids=["forked", "interpreter"])
def test_a_failing_snippet_fails(tmp_path: Path, fresh: bool) -> None:
    head = "import multiprocessing  # a fresh interpreter\n" if fresh else ""
    snippet = Snippet("x.md", 1, head + "import tessera\nraise SystemExit(3)\n")
    assert needs_interpreter(snippet.code) is fresh
    assert run_snippet(snippet, tmp_path / "a").returncode == 3
    proc = run_snippet(Snippet("x.md", 1, head + "import os, tessera\nprint(os.listdir('.'))\n"), tmp_path / "b")
    assert proc.returncode == 0 and proc.stdout.strip() == "[]"


_LIKE_AN_INTERPRETER = """
import atexit, os, sys, threading, time
import torch
import warnings
warnings.warn("hidden by PYTHONWARNINGS")
atexit.register(lambda: print("atexit", flush=True))
threading.Thread(target=lambda: (time.sleep(0.2), print("thread", flush=True))).start()
class Gone:
    def __del__(self):
        print("finalized", flush=True)
gone = Gone()
print(__name__, os.path.basename(__file__), os.path.basename(sys.argv[0]), os.listdir("."), flush=True)
print(os.environ["TESSERA_SNIPPET_PROBE"], torch.get_num_threads(), flush=True)
os.write(2, b"fd 2\\n")
raise KeyError("boom")
"""


def test_a_forked_snippet_runs_like_a_fresh_interpreter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the forked runner must keep from ``python FILE``: ``__main__``, argv, the working
    directory and environment (warning filters and torch's threads included), output at the fd
    level, exit code and traceback, and the exit sequence (non-daemon threads, atexit handlers,
    finalizers) that tessera's cleanup relies on."""
    monkeypatch.setenv("TESSERA_SNIPPET_PROBE", "seen")  # set after the fork server started
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("PYTHONWARNINGS", "ignore")
    forked = run_snippet(Snippet("x.md", 1, _LIKE_AN_INTERPRETER), tmp_path / "forked")
    fresh = run_snippet(Snippet("x.md", 1, "import multiprocessing\n" + _LIKE_AN_INTERPRETER), tmp_path / "fresh")
    assert forked.stdout == fresh.stdout == "__main__ snippet.py snippet.py []\nseen 1\nthread\natexit\nfinalized\n"
    assert forked.returncode == fresh.returncode == 1
    for proc in (forked, fresh):
        assert proc.stderr.startswith("fd 2\nTraceback (most recent call last):\n"), proc.stderr
        assert proc.stderr.endswith("KeyError: 'boom'\n"), proc.stderr
        assert proc.stderr.count('File "') == 1, proc.stderr  # only the snippet's own frame


# ------------------------------------------------------------------------------------------
# What the user docs say


_ISSUE_NUMBER = re.compile(r"(?<![\w/&(])#\d+(?![\w-])|\bissues?\s+#?\d+|\bthe issue's\b", re.IGNORECASE)


def test_user_docs_mention_no_issue_numbers() -> None:
    """Users do not read our tracker: "(issue #13)" or "#12" in a user doc says nothing to them."""
    found = [
        f"{path.relative_to(REPO)}:{n}: {m.group(0)!r}"
        for path in documented_files()
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        for m in _ISSUE_NUMBER.finditer(line)
    ]
    assert not found, "issue-tracker numbers in user docs:\n  " + "\n  ".join(found)


@pytest.mark.parametrize(
    ("line", "hit"),
    [("predate background staging (issue #13):", True), ("the targets of #12", True), ("issue 7", True),
     ("see [guarantees](guarantees.md#7-the-commit-protocol)", False), ("[x](#7-the-commit-protocol)", False),
     ("print(x)  # 1 1 tensor", False), ("https://github.com/pytorch/pytorch/issues/167288", False)],
)  # fmt: skip
def test_the_issue_number_check_itself(line: str, hit: bool) -> None:
    assert bool(_ISSUE_NUMBER.search(line)) is hit


def test_manager_doc_names_every_argument_and_public_member() -> None:
    """docs/manager.md is the manager's whole API: every constructor argument and public member."""
    import inspect

    from tessera.manager import CheckpointManager

    text = (REPO / "docs" / "manager.md").read_text(encoding="utf-8")
    arguments = [p for p in inspect.signature(CheckpointManager.__init__).parameters if p != "self"]
    members = [n for n in vars(CheckpointManager) if not n.startswith("_")]
    assert "save" in members and "should_save" in members and "reached_preemption" in members
    undocumented = [n for n in arguments + members if not re.search(rf"`{n}[`(]", text)]
    assert not undocumented, f"docs/manager.md does not document: {undocumented}"


def test_extras_named_in_docs_exist() -> None:
    """``pip install ".[name]"`` in a user doc names an extra that pyproject.toml defines."""
    import tomllib

    extras = set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    named = {
        (path.name, extra)
        for path in documented_files()
        for group in re.findall(r"\.\[([\w,-]+)\]", path.read_text(encoding="utf-8"))
        for extra in group.split(",")
    }
    assert named, "no extra named in the docs: the pattern is wrong"
    assert not {(f, e) for f, e in named if e not in extras}, f"extras not in pyproject.toml: {named}"
