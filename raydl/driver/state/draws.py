"""The draws an iterator makes of torch's RNG: its base seed, and the global RNG a next epoch draws from.

Where they come from at a resume, and why a resumed iterator still draws one and discards it, is
NOTE [ raydl checkpoint ] (driver/state/checkpoint.py), "draws". Kept apart from the tracker: the cold
start's, the in-process and the Ray iterators draw here, whether or not they track a state.
"""

from __future__ import annotations

import base64
import os
from collections.abc import Mapping
from typing import Any, Optional

import torch

from .layout import BASE_SEED, FINISHED, MAIN_SNAPSHOT, NEXT_EPOCH_RNG, RAYDL, SNAPSHOT
from .samplers import rng_sampler

__all__ = [
    "draw_base_seed",
    "iterator_base_seed",
    "saved_base_seed",
    "next_epoch_draws_global",
    "global_rng_record",
    "restore_next_epoch_rng",
    "track_rng_enabled",
]


def draw_base_seed(generator: Optional[torch.Generator]) -> int:
    """torch's per-iterator base seed, drawn from the loader's generator (the global RNG without one)."""
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())


def iterator_base_seed(generator: Optional[torch.Generator], resumed: bool) -> Optional[int]:
    """What a new iterator draws as its base seed: torch's draw; for a resumed one (which takes the
    state's) the same draw from the loader's own generator, None from the global RNG (NOTE [ raydl checkpoint ], draws)."""
    if resumed and generator is None:
        return None
    return draw_base_seed(generator)


def next_epoch_draws_global(loader: Any, index_sampler: Any) -> bool:
    """Whether a new epoch of this loader draws from torch's global RNG: its base seed (no `generator`) or its
    order (a torch random sampler without a generator of its own, what shuffle=True makes)."""
    s = rng_sampler(index_sampler)
    return loader.generator is None or (s is not None and s.generator is None)


def global_rng_record() -> str:
    """torch's global RNG state now, as base64 text (raydl's section stays JSON where torchdata's is)."""
    return base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode("ascii")


def restore_next_epoch_rng(state: Mapping) -> None:
    """Before the epoch after a state taken once its epoch ended: torch's global RNG is set back to where the saver's
    stood when it took the state (`_raydl.next_epoch_rng`), so that epoch draws what the saver's next epoch drew
    (NOTE [ raydl checkpoint ], draws). Nothing for other states, or one without the record (torchdata's)."""
    text = (state.get(RAYDL) or {}).get(NEXT_EPOCH_RNG) if state.get(FINISHED) else None
    if isinstance(text, str):
        torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8))


def track_rng_enabled() -> bool:
    """Workers report their generators' state with each batch unless RAYDL_TRACK_WORKER_RNG=0.

    Off saves a worker 18-26 us per batch (docs/resume.md); randomness drawn in workers then
    restarts from the workers' seeds at a resume, as with torchdata.
    """
    return os.environ.get("RAYDL_TRACK_WORKER_RNG", "1") != "0"


def saved_base_seed(state: Mapping) -> int:
    """The base seed a state was saved with (where each layout keeps it)."""
    if SNAPSHOT in state:
        return int(state[SNAPSHOT][MAIN_SNAPSHOT][BASE_SEED])
    saved = (state.get(RAYDL) or {}).get("base_seed")
    return int(saved) if saved is not None else draw_base_seed(None)
