"""Step directories under a manager root: naming, listing, the ``latest`` pointer, deletion.

:class:`StepDirectory` owns the root: its path or URL, the backend bound to it, and the
factory that builds a backend for one step. Its operations are local (no communication);
any rank may list, while only rank 0 moves ``latest`` or deletes steps.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable

from ..engine.loading.path_report import stray_step, stray_steps_note
from ..format.manifest import MANIFEST_NAME
from ..format.names import OWNER_MARKER_DIR, parse_step_dirname, step_dirname
from ..storage import Storage
from ..storage.capabilities import Closable, Uncommits, Versioned

__all__ = [
    "LATEST_NAME",
    "StepDirectory",
    "check_step",
    "close_store",
    "is_first_rank",
    "join_root",
    "parse_step_dirname",
    "step_dirname",
]

logger = logging.getLogger(__name__)

LATEST_NAME = "latest"


def join_root(root: str, name: str) -> str:
    """``name`` under ``root`` (a path or URL, with or without a trailing ``/``)."""
    return root + name if root.endswith("/") else f"{root}/{name}"


def check_step(step: int) -> int:
    """``step`` itself, if it is a valid step number.

    Raises:
        ValueError: if ``step`` is not an integer >= 0.
    """
    if type(step) is not int or step < 0:
        raise ValueError(f"a checkpoint step must be an integer >= 0, got {step!r}")
    return step


def is_first_rank(process_group: object = None) -> bool:
    """Whether this process is rank 0 of ``process_group`` (the whole job by default; True
    without ``torch.distributed``). Local: creates no group, unlike ``dist.world_for``."""
    import torch.distributed as torch_dist

    if not (torch_dist.is_available() and torch_dist.is_initialized()):
        return True
    return torch_dist.get_rank(process_group) == 0  # type: ignore[arg-type]


def close_store(store: object) -> None:
    """Release ``store``'s resources if it holds any (:class:`~tessera.storage.capabilities.Closable`)."""
    if isinstance(store, Closable):
        store.close()


class StepDirectory:
    """The manager's root: one subdirectory per step and the ``latest`` pointer.

    Listing, the pointer and deletions go through one backend bound to the root
    (:attr:`store`); a step's save or load gets its own backend from :meth:`open_step`.

    Args:
        root: the directory or URL holding the steps.
        factory: builds the backend of a URL (the root, or a step directory).
    """

    def __init__(self, root: str, factory: Callable[[str], Storage]) -> None:
        self.root = root
        self.factory = factory
        self.store = factory(root)

    def url(self, step: int) -> str:
        """The path or URL of ``step``'s directory (it need not exist)."""
        return join_root(self.root, step_dirname(check_step(step)))

    def open_step(self, step: int) -> Storage:
        """A new backend bound to ``step``'s directory; release it with :func:`close_store`."""
        return self.factory(self.url(step))

    def scan(self) -> dict[int, bool]:
        """Every step directory under the root: ``{step: committed}``.

        A step is committed when its ``manifest.json`` exists; other names are ignored.
        """
        found: dict[int, bool] = {}
        for rel in self.store.list(""):
            head, _, rest = rel.partition("/")
            step = parse_step_dirname(head)
            if step is None or not rest:
                continue
            found[step] = found.get(step, False) or rest == MANIFEST_NAME
        return found

    def check_at_start(self) -> None:
        """Rank 0, when the manager starts: repair a stale ``latest``, and warn once about step
        directories the manager ignores. Not collective; failures are logged, never raised.

        ``latest`` naming a step that is not committed (its directory deleted by hand: ``rm -rf``
        of the newest steps is allowed) is pointed at the newest committed step, or removed when
        there is none, with a warning. Directories named like steps in another form (``step-6``,
        as DCP scripts name them) are never loaded: the warning names the form the manager reads.
        """
        try:
            found: dict[int, bool] = {}
            stray: set[str] = set()
            for rel in self.store.list(""):
                head, _, rest = rel.partition("/")
                step = parse_step_dirname(head)
                if step is not None and rest:
                    found[step] = found.get(step, False) or rest == MANIFEST_NAME
                elif rest and stray_step(head) is not None:
                    stray.add(head)
            if stray:
                warnings.warn(
                    f"{self.root} holds {stray_steps_note(sorted(stray))}; the manager ignores them "
                    f"(a folder of DCP steps converts into a manager root with: tessera convert FOLDER {self.root})",
                    RuntimeWarning,
                    stacklevel=3,
                )
            pointer = self.pointer()
            committed = sorted(s for s, c in found.items() if c)
            if pointer is None or pointer in committed:
                return
            if committed:
                self.point_at(committed[-1])
            else:
                self.remove_pointer()
            now = f"now names step {committed[-1]}, the newest committed one" if committed else "was removed"
            warnings.warn(
                f"{self.root}/{LATEST_NAME} named step {pointer}, which is not committed there (deleted?); it {now}",
                RuntimeWarning,
                stacklevel=3,
            )
        except Exception as e:
            logger.warning("checking the steps under %s at start failed: %s", self.root, e)

    def pointer(self) -> int | None:
        """The step the ``latest`` pointer names (None if absent or unreadable)."""
        try:
            text = self.store.read_file(LATEST_NAME)
        except FileNotFoundError:
            return None
        step = parse_step_dirname(text.decode("utf-8", "replace").strip())
        if step is None:
            logger.warning("%s/%s does not name a step directory (%r); ignoring it", self.root, LATEST_NAME, text[:80])
        return step

    def point_at(self, step: int) -> None:
        """Point ``latest`` at ``step`` (atomically)."""
        self.store.write_atomic(LATEST_NAME, (step_dirname(step) + "\n").encode())

    def remove_pointer(self) -> None:
        """Delete ``latest`` (no step is left for it to name)."""
        self.store.delete([LATEST_NAME])

    def delete(self, step: int) -> None:
        """Delete ``step``'s directory: its manifest first, then its data.

        On a fenced backend (:class:`~tessera.storage.capabilities.Uncommits` and
        :class:`~tessera.storage.capabilities.Versioned`) the manifest is withdrawn under the
        step's commit lock, and only if no save committed the step meanwhile (then nothing is
        deleted); the owner markers go with it, so that a save still writing into this step
        (another job's) can no longer publish over the files deleted next.
        """
        store = self.store
        name = step_dirname(step)
        manifest = f"{name}/{MANIFEST_NAME}"
        fenced = isinstance(store, Uncommits) and isinstance(store, Versioned)
        expected = store.version(manifest) if fenced and isinstance(store, Versioned) else None
        files = store.list(name)  # relative to root: "step-.../data/..."
        # Un-commit first: a deletion cut short must not leave a "committed" step without data.
        if fenced and isinstance(store, Uncommits):
            markers = [f for f in files if f.startswith(f"{name}/{OWNER_MARKER_DIR}/")]
            if not store.uncommit(manifest, expected, markers):
                logger.info("not deleting step %d under %s: a save committed it meanwhile", step, self.root)
                return
        else:
            store.delete([manifest])
        store.delete([f for f in files if f != manifest])
        logger.info("deleted step %d under %s (%d files)", step, self.root, len(files))
