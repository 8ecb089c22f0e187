"""The shared tile directory of a manager root with ``dedup=True``: what saves reference, and collection.

Every save under such a root writes its data files into ``<root>/.tessera-tiles/<save id>/``
and references the tiles that did not change since the step it builds on (see
:mod:`tessera.engine.saving.dedup`). :class:`SharedTiles` owns that directory for one manager:

- :meth:`for_save`: the :class:`~tessera.engine.saving.tile_index.Dedup` a save needs; its
  index is the rank's own tiles of the manager's last committed save, or, after a restart,
  those of the step the manager loaded or else the newest committed step (every rank lists the
  root and reads that manifest; no communication);
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
from ..engine.tile_pins import PIN_LEASE_S, Pin, read_pins, remove_pin
from ..errors import CheckpointNotFoundError
from ..format.manifest import MANIFEST_NAME
from ..format.names import OWNER_MARKER_DIR, PINS_DIR, SHARED_TILES_DIR, is_shared_ref
from ..storage import Storage
from ..storage.capabilities import RemovesEmptyDirs, Versioned
from .steps import StepDirectory, close_store, join_root

__all__ = ["PIN_LEASE_S", "SharedTiles"]

logger = logging.getLogger(__name__)


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
        self._started = False  # whether the index was looked for (after a restart: the newest committed step)
        self._base: int | None = None  # the step the manager loaded, if it did
        self._lock = threading.Lock()
        self._seen: dict[str, tuple[str, tuple[str, frozenset[str]]]] = {}  # url -> (version, refs)
        self._first_seen: dict[tuple[str, int], float] = {}  # (save id, rank) of a pin -> time.monotonic()

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

    def build_on(self, step: int) -> None:
        """The manager loaded ``step``: the next save references its tiles (every rank loaded it)."""
        with self._lock:
            self._base = step
            self._started = False

    def _index_of_latest(self) -> TileIndex | None:
        """The tiles of the step the manager loaded, else of the newest committed step (not of
        ``latest``, which may name a step deleted since, or lag behind after a crash)."""
        step = self._base
        if step is None:
            step = max((s for s, c in self.steps.scan().items() if c), default=None)
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
        pins = read_pins(self.store)
        claimed = {p.save_id for p in pins if p.rank == 0}  # rank 0 pins only after its claim
        now = time.monotonic()
        self._first_seen = {(p.save_id, p.rank): self._first_seen.get((p.save_id, p.rank), now) for p in pins}
        for pin in pins:
            if committed.get(pin.checkpoint) == pin.save_id or not self._protects(pin, pin.save_id in claimed):
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

    def _protects(self, pin: Pin, claimed: bool) -> bool:
        """Whether a pin still protects its directories: its save may still commit, or did.

        Decided on what storage shows, not on clocks: a save whose rank 0 has not pinned has not
        claimed its path yet (rank 0 pins after its claim), and may still do so however long that
        takes (rank 0 busy with retention, say): its pins protect for :data:`PIN_LEASE_S`. A save
        that claimed may commit while its owner marker exists, and did if its manifest says so.
        """
        if not pin.checkpoint:
            return True  # an unreadable pin ("*") always protects
        if not claimed:
            seen = time.monotonic() - self._first_seen.get((pin.save_id, pin.rank), time.monotonic())
            return min(seen, time.time() - pin.created) < PIN_LEASE_S
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
