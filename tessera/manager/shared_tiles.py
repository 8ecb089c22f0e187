"""The shared tile directory of a manager root with ``dedup=True``: what saves reference, and collection.

Every save under such a root writes its data files into ``<root>/.tessera-tiles/<save id>/``
and references the tiles that did not change since the step it builds on (see
:mod:`tessera.engine.saving.dedup`). :class:`SharedTiles` owns that directory for one manager:

- :meth:`for_save`: the :class:`~tessera.engine.saving.tile_index.Dedup` a save needs; its
  index is the rank's own tiles of the manager's last committed save, or, after a restart,
  those of the step ``latest`` names (every rank reads that manifest; no communication);
- :meth:`collect` (rank 0, after retention): remove the directories that no committed step
  references and no save in flight has pinned, and the pins whose saves are over.

Safety against saves of other processes (another job, a zombie) rests on the order of
operations described in :mod:`tessera.engine.tile_pins`: collection lists committed
manifests before pins, a save pins before it checks that its base is still committed.
"""

from __future__ import annotations

import logging
import threading
import time

from ..engine.loading.manifest import read_manifest, read_manifest_files
from ..engine.saving.tile_index import Dedup, TileIndex, shared_dir
from ..engine.tile_pins import Pin, read_pins, remove_pin
from ..errors import CheckpointNotFoundError
from ..format.manifest import MANIFEST_NAME
from ..format.names import OWNER_MARKER_DIR, PINS_DIR, SHARED_TILES_DIR, is_shared_ref
from ..storage import Storage
from ..storage.capabilities import RemovesEmptyDirs, Versioned
from .steps import StepDirectory, close_store, join_root

__all__ = ["PIN_GRACE_S", "PIN_LEASE_S", "SharedTiles"]

logger = logging.getLogger(__name__)

PIN_LEASE_S = 6 * 3600.0
"""A pin older than this protects nothing: no save runs for six hours (a killed save's pin
would otherwise keep its directories forever)."""
PIN_GRACE_S = 120.0
"""A pin younger than this always protects (its save may not have claimed its path yet)."""


class SharedTiles:
    """The shared tile directory of one manager root.

    Args:
        steps: the root.
    """

    def __init__(self, steps: StepDirectory) -> None:
        self.steps = steps
        self.url = join_root(steps.root, SHARED_TILES_DIR)
        self.store: Storage = steps.factory(self.url)
        self._index: TileIndex | None = None
        self._started = False  # whether the index was looked for (after a restart: in `latest`)
        self._lock = threading.Lock()
        self._seen: dict[str, tuple[str, tuple[str, frozenset[str]]]] = {}  # url -> (version, refs)

    # -- Saves --------------------------------------------------------------------------------

    def for_save(self) -> Dedup:
        """What the next save of this rank may reference, and where it hears of its commit."""
        with self._lock:
            if not self._started:
                self._started = True
                self._index = self._index_of_latest()
            index = self._index
        return Dedup(self.store, index, self._still_committed, self._committed)

    def start_over(self) -> None:
        """A save failed: the next one references nothing and writes every tile."""
        with self._lock:
            self._index = None
            self._started = True

    def _committed(self, index: TileIndex) -> None:
        with self._lock:
            self._index = index

    def _index_of_latest(self) -> TileIndex | None:
        step = self.steps.pointer()
        if step is None:
            return None
        url = self.steps.url(step)
        store = self.steps.factory(url)
        try:
            return TileIndex.of_manifest(read_manifest(url, storage=store), url)
        except CheckpointNotFoundError:
            return None
        except Exception as e:
            logger.warning("dedup: cannot read %s (%s); the next save writes every tile", url, e)
            return None
        finally:
            close_store(store)

    def _still_committed(self, index: TileIndex) -> bool:
        return self._save_id_at(index.base_url) == index.base_save_id

    def _save_id_at(self, url: str) -> str | None:
        """The save id committed at ``url`` (None: nothing committed there)."""
        found = self._refs_at(url)
        return None if found is None else found[0]

    def _refs_at(self, url: str) -> tuple[str, frozenset[str]] | None:
        """``(save id, shared directories referenced)`` of the manifest committed at ``url`` (None: none).

        Cached by the manifest's version where the root's backend has versions (one ``stat`` or
        HEAD instead of decoding the manifest again at every collection).
        """
        root = self.steps.store
        rel = url[len(self.steps.root) :].strip("/") if url.startswith(self.steps.root) else None
        version = root.version(f"{rel}/{MANIFEST_NAME}") if rel and isinstance(root, Versioned) else None
        hit = self._seen.get(url)
        if version is not None and hit is not None and hit[0] == version:
            return hit[1]
        store = self.steps.factory(url)
        try:
            save_id, files = read_manifest_files(store, url)
        except CheckpointNotFoundError:
            return None
        finally:
            close_store(store)
        refs = save_id, frozenset(shared_dir(f.path) for f in files if is_shared_ref(f.path))
        if version is not None:
            self._seen[url] = (version, refs)
        return refs

    # -- Collection ---------------------------------------------------------------------------

    def collect(self) -> list[str]:
        """Rank 0: remove the shared directories nothing committed or in flight references.

        Order (see :mod:`tessera.engine.tile_pins`): the directories present, then the committed
        manifests, then the pins. A pin goes once its save's manifest was among those read (the
        manifest protects what the save uses from then on) or once its save can no longer
        commit. An unreadable manifest or pin stops the collection: nothing is removed on a guess.

        Returns:
            the save ids whose directories were removed.
        """
        present = {p.split("/", 1)[0] for p in self.store.list("")} - {PINS_DIR}  # later ones are not ours to judge
        referenced: set[str] = set()
        committed: dict[str, str] = {}  # checkpoint -> the save id committed there
        for step, is_committed in sorted(self.steps.scan().items()):
            if not is_committed:
                continue
            url = self.steps.url(step)
            try:
                refs = self._refs_at(url)
            except Exception as e:
                logger.warning("not collecting shared tiles under %s: cannot read %s (%s)", self.url, url, e)
                return []
            if refs is None:
                continue  # deleted since the listing
            committed[url] = refs[0]
            referenced |= refs[1]
        protected = set(referenced)
        over: list[str] = []  # pins that protect nothing any more
        for pin in read_pins(self.store):
            if committed.get(pin.checkpoint) == pin.save_id or not self._protects(pin):
                over.append(pin.save_id)
            else:
                protected |= pin.protects
        if "*" in protected:
            return []
        doomed = sorted(present - protected)
        for sid in doomed:
            self.store.delete(self.store.list(sid))
        for sid in over:
            remove_pin(self.store, sid)
        root = self.steps.store
        if isinstance(root, RemovesEmptyDirs):  # those of saves killed before their first file
            root.remove_empty_dirs(SHARED_TILES_DIR)
        if doomed:
            logger.info("removed %d shared tile directories under %s", len(doomed), self.url)
        return doomed

    def _protects(self, pin: Pin) -> bool:
        """Whether a pin still protects its directories: its save may still commit, or did."""
        age = time.time() - pin.created
        if age < PIN_GRACE_S:
            return True
        if age > PIN_LEASE_S or not pin.checkpoint:
            return not pin.checkpoint  # an unreadable pin ("*") always protects
        store = self.steps.factory(pin.checkpoint)
        try:
            if store.exists(f"{OWNER_MARKER_DIR}/{pin.save_id}"):
                return True  # the save has claimed its path and not finished
        finally:
            close_store(store)
        # Finished: committed (its manifest references what it needs, maybe listed after ours) or dead.
        try:
            return self._save_id_at(pin.checkpoint) == pin.save_id
        except Exception as e:
            logger.warning("pin of save %s: cannot read %s (%s); keeping what it pins", pin.save_id, pin.checkpoint, e)
            return True

    def close(self) -> None:
        close_store(self.store)
