"""torchdata's state layout (its keys, raydl's own section) and the check that a state fits a loader.

A state is refused at `load_state_dict`, before any iterator exists, with a ValueError that names
the mismatch and the fix (NOTE [ raydl checkpoint ] in driver/state/checkpoint.py): not a loader state,
another num_workers (unless the job's epoch is re-dealt at another world size: NOTE [ raydl global
epoch ] in job/global_epoch.py), another dataset kind or length, batch size, drop_last or sampler
type, or a random sampler's epoch that the state does not record.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import torch
from torch.utils.data import BatchSampler, IterableDataset

from ...job.global_epoch import GLOBAL_EPOCH, check_record, distributed_sampler, needs_redeal
from .samplers import RngSamplerIter, rng_sampler

__all__ = ["validate", "loader_facts", "redeals", "worker_key"]

# torchdata's keys (torchdata/stateful_dataloader/stateful_dataloader.py)
SNAPSHOT = "_snapshot"
MAIN_SNAPSHOT = "_main_snapshot"
WORKER_SNAPSHOTS = "_worker_snapshots"
SNAPSHOT_STEP = "_snapshot_step"
STEPS_SINCE_SNAPSHOT = "_steps_since_snapshot"
LAST_YIELDED_WORKER_ID = "_last_yielded_worker_id"
BASE_SEED = "_base_seed"
NUM_WORKERS = "_num_workers"
INDEX_SAMPLER_STATE = "_index_sampler_state"
SAMPLER_ITER_STATE = "_sampler_iter_state"
SAMPLER_ITER_YIELDED = "_sampler_iter_yielded"
LEN_CALLED = "_IterableDataset_len_called"
SHARED_SEED = "_shared_seed"
FINISHED = "_iterator_finished"
NUM_YIELDED = "_num_yielded"
# raydl's own section (ignored by torchdata)
RAYDL = "_raydl"
SAMPLER_EPOCH = "sampler_epoch"  # a random sampler's epoch record, when not under torchdata's keys
NEXT_EPOCH_RNG = "next_epoch_rng"  # torch's global RNG as a state taken after its epoch ended left it
STATE_VERSION = 2


def worker_key(worker_id: int) -> str:
    return f"worker_{worker_id}"


def _type_name(obj: Any) -> Optional[str]:
    return None if obj is None else f"{type(obj).__module__}.{type(obj).__qualname__}"


def loader_facts(loader: Any) -> dict:
    """What a state records about its loader, to refuse one that does not fit (`_raydl` section)."""
    try:
        length = len(loader.dataset)  # type: ignore[arg-type]
    except TypeError:
        length = None
    return {
        "version": STATE_VERSION,
        "dataset": "iterable" if isinstance(loader.dataset, IterableDataset) else "map",
        "dataset_len": length,
        "batch_size": loader.batch_size,
        "drop_last": loader.drop_last,
        "sampler": _type_name(loader.sampler),
        "batch_sampler": _type_name(loader.batch_sampler),
        "num_workers": loader.num_workers,
    }


def _not_a_state(state: Any, why: str) -> ValueError:
    what = (
        f"a dict with keys {sorted(map(str, state))[:8]}" if isinstance(state, Mapping) else f"a {type(state).__name__}"
    )
    return ValueError(
        f"DataLoader.load_state_dict: got {what}, which is not a loader state ({why}). Pass what "
        "DataLoader.state_dict() (raydl's or torchdata's StatefulDataLoader's) returned."
    )


def validate(state: Any, loader: Any) -> None:
    """Raise a ValueError naming the mismatch if `state` cannot resume this loader exactly."""
    if not isinstance(state, Mapping):
        raise _not_a_state(state, "not a dict")
    nw = loader.num_workers
    if SNAPSHOT in state:
        snap = state[SNAPSHOT]
        if (
            not isinstance(snap, Mapping)
            or not isinstance(snap.get(MAIN_SNAPSHOT), Mapping)
            or SNAPSHOT_STEP not in snap
        ):
            raise _not_a_state(state, f"its {SNAPSHOT!r} lacks {MAIN_SNAPSHOT!r} or {SNAPSHOT_STEP!r}")
        state_nw = snap[MAIN_SNAPSHOT].get(NUM_WORKERS)
        workers = snap.get(WORKER_SNAPSHOTS) or {}
        if not isinstance(workers, Mapping) or set(workers) - {worker_key(i) for i in range(len(workers))}:
            raise _not_a_state(state, f"its worker snapshots are not keyed worker_0..worker_<n-1>: {list(workers)[:8]}")
    elif NUM_YIELDED in state and SAMPLER_ITER_YIELDED in state:
        state_nw = 0
    else:
        raise _not_a_state(state, f"it has neither {SNAPSHOT!r} (num_workers > 0) nor {NUM_YIELDED!r} (num_workers=0)")
    facts = state.get(RAYDL)
    record = facts.get(GLOBAL_EPOCH) if isinstance(facts, Mapping) else None
    if record is not None:  # NOTE [ raydl global epoch ]
        index_sampler = loader.batch_sampler if loader.batch_sampler is not None else loader.sampler
        dist = distributed_sampler(index_sampler)
        check_record(record, dist)
        if redeals(state, loader, dist):
            return  # re-dealt: another world size, batch size or num_workers is the point
    if state_nw != nw:
        raise ValueError(
            f"DataLoader.load_state_dict: num_workers mismatch: the state was saved with num_workers={state_nw}, "
            f"this loader has num_workers={nw}. Build the loader with num_workers={state_nw} to resume exactly."
        )
    if isinstance(facts, Mapping):
        mine = loader_facts(loader)
        names = {
            "dataset": "dataset kind",
            "dataset_len": "dataset length",
            "batch_size": "batch size",
            "drop_last": "drop_last",
            "sampler": "sampler type",
            "batch_sampler": "batch sampler type",
        }
        for key, name in names.items():
            if key in facts and facts[key] != mine[key]:
                raise ValueError(
                    f"DataLoader.load_state_dict: {name} mismatch: the state was saved with {facts[key]!r}, this "
                    f"loader has {mine[key]!r}. Resume with the same dataset, batch size and sampler."
                )
    if not state.get(FINISHED):
        _check_permutation(state[SNAPSHOT][MAIN_SNAPSHOT] if SNAPSHOT in state else state, loader)


def _check_permutation(main: Mapping, loader: Any) -> None:
    """Refuse a state that does not record the epoch's order of a random sampler drawing from the global RNG.

    StatefulDataLoader records it for its own RandomSampler (what shuffle=True makes there) and
    raydl for torch's random samplers; a fast-forward through a fresh permutation would silently
    hand out other samples.
    """
    if isinstance(loader.dataset, IterableDataset):
        return
    index_sampler = loader.batch_sampler if loader.batch_sampler is not None else loader.sampler
    s = rng_sampler(index_sampler)
    if s is None or s.generator is not None:
        return
    it_state = main.get(SAMPLER_ITER_STATE)
    if isinstance(it_state, Mapping) and type(index_sampler) is BatchSampler:
        it_state = it_state.get("sampler_iter_state")
    if isinstance(it_state, Mapping) and isinstance(it_state.get(RngSamplerIter.GENERATOR), torch.Tensor):
        return
    if int(main.get(SAMPLER_ITER_YIELDED) or 0) == 0 and it_state is None:
        return  # nothing of the epoch was drawn: it starts afresh, as the saver's would have
    raise ValueError(
        f"DataLoader.load_state_dict: the state does not record the order of its epoch, and this loader's "
        f"{type(s).__name__} (no generator) would draw another one from torch's global RNG. The state comes from a "
        f"loader whose sampler has no state_dict() (for example StatefulDataLoader given torch's {type(s).__name__}). "
        "Resume from a state of this loader, or give the sampler a generator in both loaders."
    )


def redeals(state: Mapping, loader: Any, dist: Any) -> bool:
    """Whether `state` re-deals the job's epoch for this loader (NOTE [ raydl global epoch ]) rather than resuming
    this rank where it stopped: another world size, batch size or num_workers, or an epoch re-dealt already."""
    facts = state.get(RAYDL)
    record = facts.get(GLOBAL_EPOCH) if isinstance(facts, Mapping) else None
    if record is None or dist is None:
        return False
    saved_nw = state[SNAPSHOT][MAIN_SNAPSHOT].get(NUM_WORKERS) if SNAPSHOT in state else 0
    same = saved_nw == loader.num_workers and facts.get("batch_size") == loader.batch_size  # type: ignore[union-attr]
    return needs_redeal(record, dist, same)
