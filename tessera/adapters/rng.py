"""``RNGState``: the random generators of a training process (Python, NumPy, torch CPU and CUDA), per rank.

LR schedulers and ``torch.amp.GradScaler`` already have ``state_dict()``/``load_state_dict()``
and go into the state as they are; the data position is :mod:`.position`.
"""

from __future__ import annotations

import random
from typing import Any, cast

import numpy as np
import torch

from ..shards import OnResize, PerRank, per_rank


def _unwrap(value: Any) -> Any:
    return value.value if isinstance(value, PerRank) else value


class RNGState:
    """The random generators of this process, saved and restored per rank.

    Under the same world size every rank gets back exactly its own generator states.
    Under another world size there is no rank to take them from; ``on_resize`` decides:
    ``"keep"`` (default) leaves the generators as they are (seed them per rank as at the
    start of a job), ``"modulo"`` gives rank ``r`` what rank ``r % old_world`` saved (ranks
    then share streams), ``"error"`` refuses.

    Args:
        on_resize: the policy above.
        cuda: include the current CUDA device's generator (default: if CUDA is available, so
            that saving and loading processes agree on the keys).

    Example:
        >>> state = {"model": tessera.ModelState(m), "rng": tessera.RNGState()}
    """

    def __init__(self, *, on_resize: OnResize | str = OnResize.KEEP, cuda: bool | None = None) -> None:
        self.on_resize = OnResize(on_resize)
        self.cuda = torch.cuda.is_available() if cuda is None else cuda

    def hold_mutations(self, pending: Any) -> None:
        """Nothing to hold: :meth:`state_dict` builds fresh tensors that nothing else changes,
        so an async save may copy them in the background (see ``tessera.stateful.GatedStateful``)."""

    def state_dict(self) -> dict[str, Any]:
        """The current generator states, each marked per rank."""
        version, internal, gauss = random.getstate()
        name, keys, pos, has_gauss, cached = cast("tuple[str, np.ndarray, int, int, float]", np.random.get_state())
        sd: dict[str, Any] = {
            "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss_next": gauss},
            "numpy": {
                "algorithm": name,
                "keys": torch.from_numpy(keys.astype(np.int64)),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached),
            },
            "torch": torch.get_rng_state(),
        }
        if self.cuda:
            sd["cuda"] = torch.cuda.get_rng_state()
        return {k: per_rank(v, on_resize=self.on_resize) for k, v in sd.items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Set the generators from ``state_dict`` (as filled by ``tessera.load``)."""
        py = _unwrap(state_dict["python"])
        random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss_next"]))
        n = _unwrap(state_dict["numpy"])
        np.random.set_state(
            (n["algorithm"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
        )
        torch.set_rng_state(_unwrap(state_dict["torch"]))
        if "cuda" in state_dict:
            torch.cuda.set_rng_state(_unwrap(state_dict["cuda"]))
