"""Pins: what a save in flight may reference in a root's shared tile directory.

A save with dedup (``CheckpointManager(dedup=True)``) references tiles that earlier steps
committed, and writes its own new tiles under ``<save id>/`` of the shared tile directory.
Neither is protected by a committed manifest until the save commits, so before it writes,
every rank *pins* them: ``.pins/<save id>`` (rank 0) and ``.pins/<save id>.r<rank>`` name the
save's own directory and every directory the rank may reference (ranks do not wait for each
other before writing, so each protects what it writes and references itself). Garbage collection (:mod:`tessera.manager.shared_tiles`)
never removes a pinned directory. A failed save removes its pin; a committed save leaves it
to the next collection that reads its manifest (removing it at the commit would let a
collection that listed manifests just before the commit, and pins just after, miss both).

The order of operations is what makes this safe against a collection running at the same
time in another process (docs/guarantees.md, "Shared tiles"): a save pins *before* it
checks that the step it takes its references from is still committed; a collection lists
the directories present, then committed manifests, then pins.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

from ..format.names import PINS_DIR
from ..storage import Storage

__all__ = ["PIN_LEASE_S", "Pin", "read_pins", "remove_pin", "write_pin"]

logger = logging.getLogger(__name__)

PIN_LEASE_S = 6 * 3600.0
"""How long a pin of a save that never claimed its path protects (its rank 0 died before the
claim; else the claim is still to come): six hours both since the pin was made (the pinning
host's clock) and since the collector first saw it (its own monotonic clock), so that no clock,
however wrong, shortens it. A pin of a save that claimed its path needs no clock: it protects
while the save's owner marker exists, or if the save committed."""


@dataclass(frozen=True)
class Pin:
    """A save in flight and the shared directories it may use.

    Attributes:
        save_id: the save (its own new tiles go under ``<save_id>/``).
        checkpoint: where the save commits (its step directory).
        dirs: directories (save ids) of tiles it may reference.
        created: when it was pinned (seconds since the epoch, the pinning host's clock: for
            information and for the lease of a pin whose save never claimed its path; no rule
            compares it with another host's clock to decide what is protected).
        rank: the rank that wrote it. Rank 0 pins only after it claimed the save's path (its
            owner marker exists): a save with rank 0's pin and no marker is over.
    """

    save_id: str
    checkpoint: str
    dirs: frozenset[str]
    created: float
    rank: int = 0

    @property
    def protects(self) -> frozenset[str]:
        return self.dirs | {self.save_id}


def _pin_path(save_id: str, rank: int) -> str:
    return f"{PINS_DIR}/{save_id}" if rank == 0 else f"{PINS_DIR}/{save_id}.r{rank}"


def write_pin(tiles: Storage, save_id: str, checkpoint: str, dirs: frozenset[str], rank: int = 0) -> Pin:
    """A rank, before it writes or references a tile: pin the save's directories (rank 0 after its claim)."""
    pin = Pin(save_id, checkpoint, dirs, time.time(), rank)
    doc = {"save_id": save_id, "checkpoint": checkpoint, "dirs": sorted(dirs), "created": pin.created}
    tiles.write_atomic(_pin_path(save_id, rank), json.dumps(doc).encode())
    return pin


def remove_pin(tiles: Storage, save_id: str) -> None:
    """Remove a save's pins (every rank's): rank 0 of a failed save, or a collection. Never
    raises (a leftover pin only delays collection)."""
    try:
        names = [p for p in tiles.list(PINS_DIR) if p.rsplit("/", 1)[-1].split(".r", 1)[0] == save_id]
        tiles.delete(sorted(set(names) | {_pin_path(save_id, 0)}))
    except Exception as e:
        logger.warning("could not remove the pin of save %s under %s: %s", save_id, tiles.url, e)


def read_pins(tiles: Storage) -> list[Pin]:
    """Every pin in the shared tile directory. A pin that cannot be parsed pins every directory
    (it is returned with ``dirs`` = {"*"}): collection must not guess what it protected."""
    pins = []
    for path in tiles.list(PINS_DIR):
        save_id, _, rank = path.rsplit("/", 1)[-1].partition(".r")
        try:
            doc = json.loads(tiles.read_file(path))
            dirs = frozenset(map(str, doc["dirs"]))
            pins.append(Pin(str(doc["save_id"]), str(doc["checkpoint"]), dirs, float(doc["created"]), int(rank or 0)))
        except FileNotFoundError:
            continue  # removed since the listing: the save is over
        except Exception as e:
            logger.warning("unreadable pin %s under %s (%s): keeping every shared tile", path, tiles.url, e)
            pins.append(Pin(save_id, "", frozenset({"*"}), time.time()))
    return pins
