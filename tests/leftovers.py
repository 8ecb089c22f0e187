"""What a test session leaves behind in the temporary directory and in ``/dev/shm``.

``tests/conftest.py`` starts a :class:`LeftoverCheck` when the session starts and fails the
run if anything is left at the end. Attribution has to survive a shared machine, where other
sessions create and delete temporary files at the same time, so:

* the session gets a temporary directory of its own (``TMPDIR``, which subprocesses and doc
  snippets inherit); pytest's ``basetemp`` stays where it always is
  (``PYTEST_DEBUG_TEMPROOT``) and is pytest's to rotate. Anything in the private directory at
  the end is a leftover; the directory is removed afterwards;
* ``/dev/shm``: tessera-named entries that were not there at the start (a writer process's
  arena ``tessera-writer-*``, host-memory stores), and the host-memory mirrors
  (``/dev/shm/tessera/local/<path>``) of this session's ``basetemp`` and private directory.

Each test's new top-level entries are noted with its node id, so the report names the test.

Under pytest-xdist each worker runs a check of its own (its own private directory and mirrors,
each test attributed) and hands its report lines to the controller through a file in the
controller's private directory (:data:`REPORT_PREFIX`); the controller checks ``/dev/shm``
as a whole, once every worker is done (workers share it, so a worker cannot tell whose a new
entry is).
"""

from __future__ import annotations

import getpass
import multiprocessing.util
import os
import shutil
import tempfile
from pathlib import Path

from tessera.storage.host_memory import default_memory_root

SHM = Path("/dev/shm")
REPORT_PREFIX = ".leftovers-"
"""A worker's report lines, in the controller's private directory (not a leftover)."""
CACHES = ("torchinductor_", REPORT_PREFIX)
"""Names in the temporary directory that are caches meant to outlive a process, not leftovers
(torch puts its compile cache at ``<tmp>/torchinductor_<user>``)."""


def _shm_tessera_entries(skip: Path) -> set[Path]:
    """Top-level ``/dev/shm`` entries named ``tessera*`` (``/dev/shm/tessera`` itself aside),
    the stores under ``/dev/shm/tessera`` and their first level, and the directories of the
    ``local`` store except those under ``skip`` (the mirror of the temporary directory, where
    other sessions' tests write: this session's part of it is checked through its mirrors)."""
    out: set[Path] = set()
    if not SHM.is_dir():
        return out
    out.update(e for e in SHM.iterdir() if e.name.startswith("tessera") and e.name != "tessera")
    root = SHM / "tessera"
    if not root.is_dir():
        return out
    for store in root.iterdir():
        if store.name != "local":
            out.add(store)
            if store.is_dir():
                out.update(store.iterdir())
            continue
        for d, dirs, _ in os.walk(store):
            dirs[:] = [x for x in dirs if Path(d, x) != skip]
            out.update(Path(d, x) for x in dirs)
    return out


def _non_empty(path: Path) -> list[Path]:
    """Files (and symlinks) under ``path``; empty directories do not count."""
    if not path.exists():
        return []
    if not path.is_dir():
        return [path]
    return [Path(d) / f for d, _, files in os.walk(path) for f in files]


def describe(path: Path) -> str:
    """A leftover with a hint at where it comes from."""
    name = path.name
    if name.startswith("tessera-writer-"):
        return f"{path}  (a writer process's shared-memory arena, never unlinked: WriterMode.PROCESS)"
    if str(path).startswith(str(SHM / "tessera")):
        return f"{path}  (host-memory checkpoint steps: a tier:: root or a local tier)"
    return str(path)


class LeftoverCheck:
    """Snapshot at the start, per-test attribution, and the comparison at the end."""

    def __init__(self, *, worker: str | None = None) -> None:
        # The controller's private directory, where a worker (``worker``: its id) reports.
        self.report_to = Path(os.environ["TMPDIR"]) / f"{REPORT_PREFIX}{worker}" if worker else None
        self.check_shm = worker is None
        # A session started by a test of another session inherits its TMPDIR: the usual
        # temporary directory is then the one the outer session recorded.
        real_tmp = Path(os.environ.get("PYTEST_DEBUG_TEMPROOT") or tempfile.gettempdir()).resolve()
        os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", str(real_tmp))  # basetemp stays put
        # multiprocessing's own directory of this process is removed at its exit, after the
        # session's end (a worker's after its controller's): created now, in the usual place
        # (a worker inherited its controller's private directory as TMPDIR).
        os.environ["TMPDIR"] = str(real_tmp)
        tempfile.tempdir = None
        multiprocessing.util.get_temp_dir()
        self.private = Path(tempfile.mkdtemp(prefix="tessera-tests-", dir=real_tmp))
        self.skip = Path(default_memory_root(str(real_tmp)))
        # torch's compile cache lives in the temporary directory by default: keep the usual one.
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(real_tmp / f"torchinductor_{getpass.getuser()}"))
        os.environ["TMPDIR"] = str(self.private)
        tempfile.tempdir = None  # tempfile caches the directory it found first
        self.shm_start = _shm_tessera_entries(self.skip)
        self.shm_root_existed = (SHM / "tessera").exists()
        self.basetemp: Path | None = None
        """pytest's ``basetemp`` (set by the first test): its host-memory mirror is this session's."""
        self.by_test: dict[Path, str] = {}
        self._before: tuple[set[Path], set[Path]] = (set(), set())

    def _mirrors(self) -> list[Path]:
        roots = [self.private] + ([self.basetemp] if self.basetemp is not None else [])
        return [Path(default_memory_root(str(r))) for r in roots]

    def _tmp_entries(self) -> set[Path]:
        return {p for p in self.private.iterdir() if not p.name.startswith(CACHES)}

    def _top(self) -> tuple[set[Path], set[Path]]:
        shm = _shm_tessera_entries(self.skip) if self.check_shm else set()
        for mirror in self._mirrors():
            if mirror.is_dir():
                shm.update(mirror.iterdir())
        return self._tmp_entries(), shm

    def before_test(self) -> None:
        self._before = self._top()

    def after_test(self, nodeid: str) -> None:
        tmp, shm = self._top()
        for path in (tmp - self._before[0]) | (shm - self._before[1]):
            self.by_test.setdefault(path, nodeid)

    def finish(self) -> list[str]:
        """The leftovers as report lines (empty: none); removes what is this session's own."""
        found: list[tuple[Path, bool]] = []  # (path, ours to remove)
        found += [(p, True) for p in sorted(self._tmp_entries())]
        new = _shm_tessera_entries(self.skip) - self.shm_start if self.check_shm else set()
        found += [(p, False) for p in sorted(new) if not any(q in new for q in p.parents)]  # topmost only
        mirrors = self._mirrors()
        for mirror in mirrors:
            if mirror.is_dir():
                found += [(p, True) for p in sorted(mirror.iterdir()) if _non_empty(p)]
        lines = []
        for path, _ in found:
            test = self.by_test.get(path) or next(
                (t for p, t in self.by_test.items() if str(path).startswith(str(p))), None
            )
            lines.append(describe(path) + (f"  <- {test}" if test else ""))
        for report in sorted(self.private.glob(f"{REPORT_PREFIX}*")):  # the workers' lines
            lines += report.read_text().splitlines()
        # This session's own directories go, leftovers included (they are reported above);
        # entries another process may still use (a live writer's arena) are only reported.
        shutil.rmtree(self.private, ignore_errors=True)
        for mirror in mirrors:
            shutil.rmtree(mirror, ignore_errors=True)
            _remove_empty_parents(mirror.parent, stop=SHM / "tessera" / "local")
        if not self.shm_root_existed:
            _remove_empty_parents(SHM / "tessera" / "local", stop=SHM / "tessera")
        if self.report_to is not None and lines:
            self.report_to.write_text("".join(f"{line}\n" for line in lines))
        return lines


def _remove_empty_parents(path: Path, stop: Path) -> None:
    """``rmdir`` ``path`` and its parents up to and including ``stop`` while they are empty."""
    while True:
        try:
            path.rmdir()
        except OSError:
            return  # not empty (another session's), or gone
        if path == stop or stop not in path.parents:
            return
        path = path.parent


def remove_memory_mirror(directory: Path) -> None:
    """Remove the host-memory steps a test wrote for checkpoints under ``directory``."""
    shutil.rmtree(default_memory_root(str(directory)), ignore_errors=True)
