"""The job's epoch behind torch's `DistributedSampler`: one global order, and resume at another world size.

NOTE [ raydl global epoch ]
torch's `DistributedSampler` makes one permutation P of the dataset per epoch from
`seed + epoch` alone, pads it (or cuts it, `drop_last`) to a multiple of the world size W, and
gives rank r the positions r, r + W, r + 2W, ... . The permutation does not depend on W, and ranks
step in lockstep (DDP), so after each rank handed out c samples the job has consumed exactly the
first W * c positions of the dealt list: a prefix of P. A rank's global batch j (the union of
every rank's batch j) is the slice [j * W * B, (j + 1) * W * B) of that list.

The loader state records, beside torchdata's per-rank layout, the job's position in that order
(`_raydl["global_epoch"]`): the sampler's seed, epoch, shuffle flag and dataset length, the world
size, and `start + W * c`, where `start` is where this rank's deal began in P (0, unless the epoch
itself was resumed at another world size). Loading a state whose world size, batch size or
num_workers differ from the loader's (or whose epoch was already re-dealt) re-deals the rest:
R = P[position:N] (padding positions of the old deal are duplicates, not owed), padded from its
own head or cut for the new world size as the new sampler's `drop_last` says, rank r' taking
R[r'::W']. Each sample the old job had not consumed comes once (and padding as torch pads);
with the global batch kept (W' * B' == W * B) the global batches are the uninterrupted run's as
sets. The next epochs are the sampler's own again (`set_epoch`). Worker snapshots of the old job
are not used then: a re-dealt epoch's samples go to other ranks and workers, which is why only
`ray_seed="sample"` (each sample's draws keyed by its index) gives the uninterrupted run's content.
A state of another dataset length, sampler seed or shuffle, or of a sampler raydl does not know
(anything but torch's own `DistributedSampler`, or a subclass whose `global_order(epoch, seed, shuffle)` gives its P,
such as `raydl.ParquetDistributedSampler`), is refused with a ValueError, never re-dealt.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Iterator, Optional

from torch.utils.data import BatchSampler
from torch.utils.data.distributed import DistributedSampler

__all__ = [
    "GLOBAL_EPOCH",
    "check_record",
    "distributed_sampler",
    "epoch_record",
    "load_order",
    "needs_redeal",
    "redealt_iter",
]

GLOBAL_EPOCH = "global_epoch"  # the key in the state's `_raydl` section


def distributed_sampler(index_sampler: Any) -> Optional[DistributedSampler]:
    """torch's own DistributedSampler behind an index sampler (itself, or under torch's BatchSampler), or None."""
    s = index_sampler.sampler if type(index_sampler) is BatchSampler else index_sampler
    if type(s) is DistributedSampler or (
        isinstance(s, DistributedSampler) and callable(getattr(s, "global_order", None))
    ):
        return s  # torch's own, or a subclass that says its epoch's order P (raydl.ParquetDistributedSampler)
    return None


def rank_length(sampler: DistributedSampler, start: int) -> int:
    """Samples rank `sampler.rank` gets in an epoch dealt from position `start` of the permutation."""
    return _deal_size(len(sampler.dataset) - start, sampler.num_replicas, sampler.drop_last)  # type: ignore[arg-type]


def _deal_size(remaining: int, world: int, drop_last: bool) -> int:
    return remaining // world if drop_last else math.ceil(remaining / world)


def epoch_record(sampler: DistributedSampler, start: int, consumed: int, epoch: Optional[int] = None) -> dict:
    """The job's position after this rank handed out `consumed` samples of an epoch dealt from `start`
    (`epoch`: the re-dealt epoch's, else the sampler's)."""
    n = len(sampler.dataset)  # type: ignore[arg-type]
    return {
        "dataset_len": n,
        "seed": int(sampler.seed),
        "epoch": int(sampler.epoch if epoch is None else epoch),
        "shuffle": bool(sampler.shuffle),
        "num_replicas": int(sampler.num_replicas),
        "position": min(n, start + sampler.num_replicas * consumed),
        "start": start,
        **({"order": sampler.raydl_order_state()} if callable(getattr(sampler, "raydl_order_state", None)) else {}),
    }


def load_order(record: Optional[Mapping], sampler: Optional[DistributedSampler]) -> None:
    """A sampler whose order depends on more than torch's arguments (ParquetDistributedSampler's node slots and batch)
    takes the saved job's, before the epoch is fast-forwarded or re-dealt."""
    load = getattr(sampler, "raydl_load_order", None)
    if isinstance(record, Mapping) and callable(load):  # a record with none: saved before the order was recorded
        load(record["order"] if isinstance(record.get("order"), Mapping) else {})


def check_record(record: Any, sampler: Optional[DistributedSampler]) -> None:
    """Raise a ValueError naming why `record` cannot be resumed by a loader whose sampler is `sampler`."""
    if not isinstance(record, Mapping):
        raise ValueError(f"DataLoader.load_state_dict: the state's {GLOBAL_EPOCH!r} record is not a dict")
    if sampler is None:
        raise ValueError(
            "DataLoader.load_state_dict: the state was saved by a loader with torch's DistributedSampler; this loader "
            "has none, so the job's position cannot be re-dealt. Build the loader with a DistributedSampler."
        )
    mine = {
        "dataset_len": len(sampler.dataset),
        "seed": int(sampler.seed),  # type: ignore[arg-type]
        "shuffle": bool(sampler.shuffle),
    }
    for key, value in mine.items():
        if record.get(key) != value:
            raise ValueError(
                f"DataLoader.load_state_dict: the DistributedSampler's {key} was {record.get(key)!r} when the state "
                f"was saved and is {value!r} now: the epoch's order differs, so the samples the job had not consumed "
                "cannot be found. Resume with the same dataset and the sampler's same seed and shuffle."
            )


def needs_redeal(record: Mapping, sampler: DistributedSampler, same_batches: bool) -> bool:
    """Whether the loaded epoch must be re-dealt rather than fast-forwarded (NOTE [ raydl global epoch ])."""
    return int(record["num_replicas"]) != sampler.num_replicas or int(record.get("start", 0)) > 0 or not same_batches


def redealt_indices(record: Mapping, sampler: DistributedSampler) -> list:
    """This rank's share of the samples the saved job had not consumed in the record's epoch."""
    n = int(record["dataset_len"])
    whole = DistributedSampler(
        sampler.dataset,
        num_replicas=1,
        rank=0,
        shuffle=bool(record["shuffle"]),
        seed=int(record["seed"]),
        drop_last=False,
    )
    whole.set_epoch(int(record["epoch"]))
    if callable(getattr(sampler, "global_order", None)):  # a subclass with its own P (NOTE [ raydl unit order ])
        order = sampler.global_order(int(record["epoch"]), int(record["seed"]), bool(record["shuffle"]))
    else:
        order = list(iter(whole))  # torch's permutation P of the epoch
    rest = order[min(int(record["position"]), n) :]
    w = sampler.num_replicas
    size = _deal_size(len(rest), w, sampler.drop_last) * w
    if size > len(rest) and rest:  # pad from the head, as torch pads
        rest = (rest * math.ceil(size / len(rest)))[:size]
    else:
        rest = rest[:size]
    return rest[sampler.rank :: w]


def redealt_iter(record: Mapping, index_sampler: Any) -> tuple[Iterator, int, int]:
    """(the index iterator of the re-dealt epoch, its start position in P, samples this rank gets)."""
    sampler = distributed_sampler(index_sampler)
    assert sampler is not None
    mine = redealt_indices(record, sampler)
    start = min(int(record["position"]), int(record["dataset_len"]))
    if type(index_sampler) is BatchSampler:
        return _batches(mine, index_sampler.batch_size, index_sampler.drop_last), start, len(mine)
    return iter(mine), start, len(mine)


def _batches(indices: list, batch_size: int, drop_last: bool) -> Iterator[list]:
    for i in range(0, len(indices), batch_size):
        batch = indices[i : i + batch_size]
        if drop_last and len(batch) < batch_size:
            return
        yield batch
