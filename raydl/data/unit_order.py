"""The order `shuffle=True` gives a `ParquetDataset` (data/parquet.py): a sampler a node cache can serve, and torch's
DistributedSampler over the same order.

NOTE [ raydl unit order ]
`shuffle=True` over a ParquetDataset does not make torch's RandomSampler: the dataset supplies
`ParquetShuffleSampler`, an order a cache can serve. Each epoch draws one seed exactly as
RandomSampler draws its own (`torch.empty((), dtype=torch.int64).random_(generator=g)`, from the
loader's `generator`, else from torch's global RNG), then:
  1. the row groups are permuted with that seed;
  2. consecutive runs of `shuffle_window` row groups of that permutation form windows, the short
     one (when the row groups do not fill the last) first: an epoch ends with whole windows, so
     the batches a model is trained on last before an epoch's checkpoint or evaluation mix a whole
     window (with 40 row groups a slot and a window of 19, a short window last put 2 row groups,
     about 2 files, behind each slot's last batches: a model trained through it at 4 nodes
     scored 0.709 against 0.754 with it first, benchmarks/README.md "Mixing");
  3. the rows of each window are permuted, and the windows are concatenated.
Every row comes once per epoch; the row-group permutation leaves no trace of storage order (the
rank correlation with it is about 1/sqrt(number of row groups)); a batch mixes the rows of a
whole window, hence of several files. Each row group is used only inside its window, so with a
window that fits in half the cache every byte is fetched once per epoch. The sampler's iterator
has a state (`{"seed", "yielded", "layout"}`, and `generator`: the state of the sampler's generator
before the epoch's seed was drawn), recorded by raydl's checkpoint as torchdata's sampler iterator
state: a resume rebuilds the epoch from its seed and skips what was handed out, and the generator
goes on from where the epoch's draw left it, so the epochs after it are the saved run's too;
`layout` names the units, the window and the node slots, and a state saved over others (the
files, `cache_limit`, `shuffle_window` or `node_slots` changed) is refused; with slots per node
the state also has `slots`, the count its run settled, which a resume keeps.
With C > 1 slots and the loader's batch size B (NOTE [ raydl node slots ]), step 2 deals the
permuted units to C slots (slot s takes every C-th: perm[s], perm[s + C], ...), each slot cuts its
units into windows of its own and shuffles their rows as above: `shuffle_window` units with the
default, one slot a node (C is the nodes the loader's workers run on when its first epoch starts,
and each node's cache holds a window), `shuffle_window // C` with `node_slots=C` given (the
window shared out: the order then never depends on the nodes). Its rows are cut
into batches of B, and the epoch takes one batch of each slot in turn (slot order, skipping a slot
that has run out); what is left of each slot (under B rows, all of one unit: the one with the most
rows among its last 4B, whose last rows move to the end) ends the epoch, slot after slot. A
batch so comes from one slot's window, except the last few: the order depends on the seed, the
units, the window, C and B, never on the workers that make it. C = 1 is the order above.

NOTE [ raydl distributed slots ]
`ParquetDistributedSampler` is torch's DistributedSampler (seed + epoch, padding or `drop_last`,
`set_epoch`, equal counts) over the same order. Without slots rank r takes positions r, r + W, ...
of it; then every rank's batch draws from every unit of the window, and every node's workers of
every rank need nearly every unit (two ranks over three data nodes read 2.6-3.7x the data). Over
node slots (issue 64; one a node by default, as for one process) the job's order is cut for the
loader's batch size B (raydl's DataLoader sets the sampler's `batch_size` when it has none) and
dealt by batch: the order's whole rounds of W batches go one a rank (rank r takes the job's
batches r, r + W, ...), so each of a rank's batches comes from one slot and is made on that slot's
node, whose cache serves every rank's batches of it; the rest (under W batches, and the slots'
leftovers) is padded or cut as torch does and dealt by position. Counts stay torch's, and after
each rank handed out c samples the job has consumed the first W * c positions of the order, as
with torch's deal, so NOTE [ raydl global epoch ]'s record and re-deal at another world size hold;
the record also keeps the slot count and B (`raydl_order_state`), which a resume takes before it
fast-forwards or re-deals (a re-dealt epoch is dealt by position: exact, but not local, until the
next epoch). Every rank must cut the same order: the slot count is rank 0's node count, sent to the
ranks through torch.distributed at the first epoch (`agreed_slot_count`); with no process group of
W ranks there are no slots unless `node_slots` is given (to the dataset or the sampler).
The node caches are not told a rank's order ahead (they fetch what its workers ask for): told both
ranks' plans, two private-pool ranks over three namespace nodes stopped at the 25th batch of their
second epoch, waiting on a unit (bench_across_nodes --ddp 2; not diagnosed yet).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Iterator, Optional

import numpy as np
import torch
from torch.utils.data import Sampler
from torch.utils.data.distributed import DistributedSampler

if TYPE_CHECKING:
    from .parquet import ParquetDataset

__all__ = ["ParquetDistributedSampler", "ParquetShuffleSampler", "shard_aware_order", "slotted_order"]


def shard_aware_order(
    starts: np.ndarray,
    rows: np.ndarray,
    window: int,
    seed: int,
    perm: Optional[np.ndarray] = None,
    rng: Optional[np.random.Generator] = None,
) -> np.ndarray:
    """The epoch's row order for `seed` (NOTE [ raydl unit order ]): row groups permuted, rows shuffled per window.
    `perm` and `rng` given: the units already permuted (one slot's) and the generator that shuffles their rows."""
    if rng is None:
        rng = np.random.default_rng(int(seed) & 0xFFFFFFFFFFFFFFFF)
    if perm is None:
        perm = rng.permutation(len(rows))
    parts = []
    short = (window - len(perm) % window) % window  # the first window holds window - short units
    for w0 in range(0, len(perm) + short, window):
        units = perm[max(0, w0 - short) : w0 + window - short]
        idx = np.concatenate([np.arange(starts[u], starts[u] + rows[u], dtype=np.int64) for u in units])
        rng.shuffle(idx)
        parts.append(idx)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def slotted_order(
    starts: np.ndarray,
    rows: np.ndarray,
    window: int,
    slots: int,
    batch: int,
    seed: int,
    slot_window: Optional[int] = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The epoch's row order over `slots` node slots for batches of `batch` rows, and the slot of each batch (NOTE [
    raydl unit order ]); a last batch that mixes slots is given the slot most of its rows come from. Each slot shuffles
    windows of `slot_window` units, by default `window // slots` (slots given by the user: the cluster's window shared
    out); slots per node pass the whole window, since each node's cache holds a window of its own."""
    slots, batch = max(1, min(int(slots), len(rows))), max(1, int(batch))
    if slots == 1:
        order = shard_aware_order(starts, rows, window, seed)
        return order, np.zeros(-(-len(order) // batch), dtype=np.int32)
    rng = np.random.default_rng(int(seed) & 0xFFFFFFFFFFFFFFFF)
    perm = rng.permutation(len(rows))
    per_slot = max(1, window // slots if slot_window is None else int(slot_window))
    full, rest = [], []
    for s in range(slots):
        stream = _one_unit_last(starts, shard_aware_order(starts, rows, per_slot, 0, perm[s::slots], rng), batch)
        n = len(stream) // batch
        full.append(stream[: n * batch].reshape(n, batch))
        rest.append(stream[n * batch :])
    counts = np.array([len(f) for f in full], dtype=np.int64)
    slot_of = np.repeat(np.arange(slots, dtype=np.int32), counts)
    round_of = np.concatenate([np.arange(c) for c in counts]) if counts.sum() else np.zeros(0, np.int64)
    turn = np.lexsort((slot_of, round_of))  # round by round, each slot's batch in slot order
    head = np.concatenate(full)[turn].reshape(-1) if counts.sum() else np.zeros(0, np.int64)
    tail = np.concatenate(rest)
    tail_slot = np.repeat(np.arange(slots, dtype=np.int32), [len(r) for r in rest])
    tail_batches = [np.bincount(tail_slot[i : i + batch]).argmax() for i in range(0, len(tail), batch)]
    return np.concatenate([head, tail]), np.concatenate([slot_of[turn], np.asarray(tail_batches, np.int32)])


def _one_unit_last(starts: np.ndarray, stream: np.ndarray, batch: int) -> np.ndarray:
    """A slot's rows with the `len % batch` left over at its end taken from one unit (the last rows of the unit with the
    most rows among the last 4 x `batch`, when it has enough), so the last batches, which mix slots, need one unit of
    each slot they take rows from (NOTE [ raydl unit order ])."""
    r = len(stream) % batch
    if not r:
        return stream
    lo = max(0, len(stream) - 4 * batch)  # within the last window's rows in practice: the rows shuffled together
    units = np.searchsorted(starts, stream[lo:], side="right") - 1
    values, counts = np.unique(units, return_counts=True)
    if counts.max() < r:
        return stream
    at = np.flatnonzero(units == values[counts.argmax()])[-r:] + lo
    keep = np.ones(len(stream), bool)
    keep[at] = False
    return np.concatenate([stream[keep], stream[at]])


_ORDER = "/o2"  # in a state's layout: the order with each short window first (o1, before: last)
_OLD_ORDER = (
    "the state was saved by a raydl whose order put each slot's short window last; this one puts it first, so the "
    "state's seed now gives another order and it cannot be resumed exactly. Start the run's next epoch without the "
    "state, or resume with the raydl that saved it"
)


def _draw_seed(generator: Optional[torch.Generator]) -> int:
    """One int64 drawn as torch's RandomSampler draws its seed (from `generator`, else torch's global RNG)."""
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())


class _ShuffleIter(Iterator[int]):
    """One epoch of `ParquetShuffleSampler`; its state is `{"seed", "yielded", "layout"}` and, over node slots, the
    batch size the order was made for (NOTE [ raydl unit order ])."""

    raydl_fresh_state = True  # `state_dict` gives a new dict of ints, a str and `_gen_state`, replaced, never written

    def __init__(self, sampler: ParquetShuffleSampler) -> None:
        self._sampler = sampler
        self.seed: Optional[int] = None  # drawn at the first step, when torch's RandomSampler draws its own
        self.yielded = 0
        self._order: Optional[np.ndarray] = None
        self._slots: Optional[np.ndarray] = None  # the slot of each batch of the epoch (node slots only)
        self._batch: Optional[int] = None  # what the epoch's order is cut for (node slots only; set at `_begin`)
        self._gen_state: Optional[torch.Tensor] = None  # the sampler's generator before the epoch's seed was drawn

    @property
    def _slotted(self) -> bool:
        return self._sampler.batch_size is not None and self._sampler.slots > 1

    def __iter__(self) -> _ShuffleIter:
        return self

    def _begin(self, seed: Optional[int]) -> None:
        if seed is None:  # the generator as the draw found it: a resume moves it on as this draw did
            g = self._sampler.generator
            self._gen_state = g.get_state() if g is not None else None
            seed = _draw_seed(g)
        self.seed = int(seed)
        ds = self._sampler.dataset
        if self._batch is None and self._slotted:
            self._batch = self._sampler.batch_size
        if self._batch is None:
            self._order, self._slots = ds.shuffled_order(self.seed), None
        else:
            self._order, self._slots = ds.slotted_order(self.seed, self._batch, self._sampler.slots)

    def __next__(self) -> int:
        if self._order is None:
            self._begin(None)
        if self.yielded >= len(self._order):  # type: ignore[arg-type]
            raise StopIteration
        value = int(self._order[self.yielded])  # type: ignore[index]
        self.yielded += 1
        return value

    def remaining_order(self) -> np.ndarray:
        """The indices this epoch will still yield, in order: what the node cache is told ahead."""
        if self._order is None:
            self._begin(None)
        return self._order[self.yielded :]  # type: ignore[index]

    def batch_slots(self, batch_size: Optional[int]) -> Optional[np.ndarray]:
        """The node slot of each batch of the epoch (from its first), for batches of `batch_size`; None when the order
        has no slots or was cut for another batch size (a state saved at another one)."""
        if self._order is None:
            self._begin(None)
        return self._slots if self._slots is not None and batch_size == self._batch else None

    def _layout(self) -> str:
        """What the epoch's order depends on besides the seed, the batch size and (slots per node) the slot count: the
        units, the window and the slots given."""
        ds = self._sampler.dataset
        head = f"{getattr(ds, 'token', '')}:{ds.shuffle_window}{_ORDER}"
        if getattr(ds, "node_slots", 1) is None:
            return head + ":per-node"  # the count is the state's `slots`, dealt to whatever nodes a resume has
        slots = ds.node_slots if self._slotted else 1
        return head + (f":{slots}" if slots > 1 else "")

    def state_dict(self) -> dict:
        if self._order is None:  # the base seed was drawn before: drawing the epoch's now keeps torch's order of draws
            self._begin(None)
        sd = {"seed": self.seed, "yielded": self.yielded, "layout": self._layout()}
        if self._batch is not None:
            sd["batch"] = self._batch
        if getattr(self._sampler.dataset, "node_slots", 1) is None:
            sd["slots"] = self._sampler.slots
        if self._gen_state is not None:
            sd["generator"] = self._gen_state
        return sd

    def load_state_dict(self, sd: dict) -> None:
        if "seed" not in sd:
            raise ValueError(
                f"ParquetShuffleSampler: the state {sd!r} has no epoch seed: it was saved for another sampler"
            )
        saved = sd.get("layout")
        if saved is not None and _ORDER not in saved:
            parts = saved.split(":")
            if len(parts) > 1 and ":".join([parts[0], parts[1] + _ORDER, *parts[2:]]) == self._layout():
                raise ValueError(f"ParquetShuffleSampler: {_OLD_ORDER} (layout {saved!r})")
        if saved is not None and saved != self._layout():
            raise ValueError(
                "the state was saved over other units, another shuffle window or other node slots (layout "
                f"{sd['layout']!r}, now {self._layout()!r}: token:shuffle_window{_ORDER}[:node_slots, or :per-node for the "
                "default, one slot a node]): the files, cache_limit, shuffle_window or node_slots changed, and the "
                "same seed would now give another order. Build the dataset as the saved run did to resume it (a state "
                "saved with the default node_slots before slots per node resumes with node_slots=12, or the count its "
                "layout ends with)."
            )
        if sd.get("slots") is not None and getattr(self._sampler.dataset, "node_slots", 1) is None:
            self._sampler.slots = int(
                sd["slots"]
            )  # the saved run's nodes, kept for this run (NOTE [ raydl node slots ])
        self._batch = int(sd["batch"]) if sd.get("batch") is not None and self._slotted else None
        g = self._sampler.generator
        if sd.get("generator") is not None and g is not None:
            # the epoch's draw made again: the generator goes on to the next epochs as the saved run's did
            g.set_state(sd["generator"])
            self._gen_state = sd["generator"].clone()  # the caller's tensor stays the caller's
            _draw_seed(g)
        self._begin(int(sd["seed"]))
        n = int(sd["yielded"])
        if n > len(self._order):  # type: ignore[arg-type]
            raise ValueError(
                f"ParquetShuffleSampler: the state is {n} rows into its epoch, but this dataset has "
                f"{len(self._order)} rows: the files changed since the state was saved"  # type: ignore[arg-type]
            )
        self.yielded = n


class ParquetShuffleSampler(Sampler[int]):
    """What `shuffle=True` samples over a `ParquetDataset`: row groups permuted, rows shuffled within windows.

    Args:
        dataset (ParquetDataset): the dataset.
        generator (torch.Generator, optional): each epoch draws its seed from it, as torch's
            RandomSampler does. Defaults to ``None`` (torch's global RNG).
        batch_size (int, optional): the batches the order is cut for over the dataset's node
            slots (NOTE [ raydl node slots ]): what `shuffle=True` passes, the loader's
            `batch_size`. Defaults to ``None``: the order of one slot (every batch mixes the
            whole window).
        node_slots (int, optional): for a dataset built with the default ``node_slots=None``
            (one slot a node): the slot count, as a loader over that many nodes settles it (what
            to give torch's DataLoader to reproduce such a loader's order). Defaults to ``None``:
            settled by the loader's first epoch; 1 when iterated without one.
    """

    def __init__(
        self,
        dataset: ParquetDataset,
        generator: Optional[torch.Generator] = None,
        batch_size: Optional[int] = None,
        node_slots: Optional[int] = None,
    ) -> None:
        self.dataset = dataset
        self.generator = generator
        self.batch_size = batch_size
        # the slots of this run: the dataset's, or (its default) one a node, settled when the loader's first epoch
        # starts (`settle`) or by a resumed state, and kept for the run (NOTE [ raydl node slots ])
        self._slots: Optional[int] = _run_slots("ParquetShuffleSampler", dataset, node_slots)

    @property
    def slots(self) -> int:
        """The node slots this run's orders are cut over (1 until settled)."""
        return self._slots or 1

    @slots.setter
    def slots(self, value: int) -> None:
        self._slots = max(1, int(value))

    @property
    def settled(self) -> bool:
        """Whether this run's slot count is known (given, settled by a first epoch, or loaded from a state)."""
        return self._slots is not None

    def settle(self, nodes: int) -> int:
        """Slots per node: the first epoch's node count becomes the run's slot count; later calls change nothing (an
        order that follows the nodes would change under a resumed or elastic run). Returns the run's count."""
        if self._slots is None:
            self.slots = nodes
        return self.slots

    def __iter__(self) -> _ShuffleIter:
        return _ShuffleIter(self)

    def __len__(self) -> int:
        return len(self.dataset)


class ParquetDistributedSampler(DistributedSampler):
    """torch's `DistributedSampler` over a `ParquetDataset`'s shard-aware order (NOTE [ raydl unit order ]).

    Same arguments, `set_epoch`, counts per rank, padding and `drop_last` as torch's: the job's order of epoch `e` is
    the dataset's order for seed `seed + e`. Over node slots (NOTE [ raydl distributed slots ]) it is cut into batches
    of `batch_size`, each from one slot's window, and the ranks take them in turns, batch by batch, so each rank's
    batches are made on the node whose cache holds their units; without slots (one node, `node_slots=1`,
    `shuffle=False`, no batch size) rank `r` takes positions r, r + W, r + 2W, ... . A state saved with it resumes at
    another world size as torch's does (NOTE [ raydl global epoch ] in job/global_epoch.py).

    Args (beyond torch's):
        batch_size (int, optional): the batches the order is dealt in. Defaults to ``None``: raydl's DataLoader
            sets its own `batch_size` (torch's DataLoader deals positions).
        node_slots (int, optional): for a dataset built with the default ``node_slots=None``: the slot count
            (as a job over that many nodes settles it). Defaults to ``None``: settled by the loader's first epoch,
            the same on every rank (NOTE [ raydl distributed slots ]).
    """

    def __init__(
        self,
        dataset: Any,
        num_replicas: Optional[int] = None,
        rank: Optional[int] = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        *,
        batch_size: Optional[int] = None,
        node_slots: Optional[int] = None,
    ) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
        self.batch_size = batch_size
        self._slots = _run_slots("ParquetDistributedSampler", dataset, node_slots)
        self._dealt: Optional[tuple] = None  # (what the epoch's deal depends on, (this rank's indices, batch slots))

    slots = ParquetShuffleSampler.slots
    settled = ParquetShuffleSampler.settled
    settle = ParquetShuffleSampler.settle

    @property
    def slotted(self) -> bool:
        """Whether the job's order is cut over more than one slot, dealt to the ranks batch by batch."""
        return bool(self.shuffle) and self.batch_size is not None and self.slots > 1

    def global_order(self, epoch: int, seed: Optional[int] = None, shuffle: Optional[bool] = None) -> list:
        """The job's order P of `epoch` before padding and dealing (what a resume at another world size re-deals)."""
        seed = self.seed if seed is None else seed
        shuffle = self.shuffle if shuffle is None else shuffle
        if shuffle and self.slotted:
            return self.dataset.slotted_order(seed + epoch, self.batch_size, self.slots)[0].tolist()
        if shuffle:
            return self.dataset.shuffled_order(seed + epoch).tolist()
        return list(range(len(self.dataset)))

    def _deal(self) -> tuple:
        """(this rank's indices of the epoch, the node slot of each of its batches or None)."""
        key = (self.epoch, self.seed, self.shuffle, self.slots, self.batch_size, self.num_replicas, self.rank)
        key += (self.drop_last,)
        if self._dealt is not None and self._dealt[0] == key:
            return self._dealt[1]
        if not self.slotted:
            indices = self.global_order(self.epoch)
            if not self.drop_last:
                padding = self.total_size - len(indices)
                if padding > 0 and indices:
                    indices += (indices * (padding // len(indices) + 1))[:padding]
            else:
                indices = indices[: self.total_size]
            out: tuple = (indices[self.rank : self.total_size : self.num_replicas], None)
        else:
            order, batch_slots = self.dataset.slotted_order(self.seed + self.epoch, self.batch_size, self.slots)
            out = _dealt_by_batch(order, batch_slots, self.batch_size, self.num_replicas, self.rank, self.total_size)
        self._dealt = (key, out)
        return out

    def __iter__(self) -> Iterator[int]:
        return iter(self._deal()[0])

    def rank_batch_slots(self, batch_size: Optional[int]) -> Optional[np.ndarray]:
        """The node slot of each of this rank's batches this epoch, for batches of `batch_size`; None when its order
        has no slots or was dealt for another batch size."""
        if batch_size is None or batch_size != self.batch_size:
            return None
        return self._deal()[1]

    def raydl_order_state(self) -> dict:
        """What the job's order depends on beyond torch's arguments: the slot count it settled and the batch size it
        deals in; the loader's state keeps it beside the job's position (NOTE [ raydl global epoch ])."""
        return {"slots": self.slots, "batch": self.batch_size, "per_node": self._per_node, "order": _ORDER}

    def raydl_load_order(self, sd: Mapping) -> None:
        """A saved job's slot count and batch size, before its epoch is resumed (fast-forwarded or re-dealt): its order
        at any node count and any batch size now (NOTE [ raydl distributed slots ])."""
        if self.shuffle and sd.get("order") != _ORDER:
            raise ValueError(f"ParquetDistributedSampler: {_OLD_ORDER}.")
        if bool(sd.get("per_node")) != self._per_node:
            raise ValueError(
                "ParquetDistributedSampler: the state was saved with "
                + ("the default node_slots (one slot a node)" if sd.get("per_node") else "node_slots given")
                + " and this dataset has "
                + ("the default" if self._per_node else f"node_slots={self.dataset.node_slots}")
                + ": build the dataset as the saved run did to resume it"
            )
        if self._per_node and sd.get("slots") is not None:
            self.slots = int(sd["slots"])
        self.batch_size = int(sd["batch"]) if sd.get("batch") is not None else self.batch_size

    @property
    def _per_node(self) -> bool:
        return getattr(self.dataset, "node_slots", 1) is None


def _run_slots(who: str, dataset: Any, node_slots: Optional[int]) -> Optional[int]:
    """A sampler's slot count: the dataset's `node_slots` when given, else `node_slots` (None: to be settled)."""
    given = getattr(dataset, "node_slots", 1)
    if node_slots is not None and given is not None and int(node_slots) != given:
        raise ValueError(
            f"{who}: node_slots={node_slots}, but the dataset was built with node_slots={given}: give it to one of them"
        )
    return given if given is not None else node_slots


def _dealt_by_batch(
    order: np.ndarray, batch_slots: np.ndarray, batch: int, world: int, rank: int, total: int
) -> tuple[list, np.ndarray]:
    """Rank `rank`'s share of a job's order cut into batches (NOTE [ raydl distributed slots ]): the whole rounds of
    `world` batches dealt one a rank, then the rest (under `world` batches, and the slots' leftovers) by position as
    torch deals it, padded from the order's head or cut to `total` (torch's total size); with the node slot of each
    of the rank's batches (the tail's: the slot of the job's batch it starts in)."""
    rounds = len(order) // batch // world
    head_len = rounds * world * batch
    mine = order[:head_len].reshape(rounds, world, batch)[:, rank, :].reshape(-1).tolist()
    tail = order[head_len:].tolist()
    need = total - head_len
    if len(tail) < need:
        whole = order.tolist()
        tail += (whole * ((need - len(tail)) // max(1, len(whole)) + 1))[: need - len(tail)]
    tail = tail[:need]
    mine_tail = tail[rank::world]
    slots = batch_slots[rank : rounds * world : world].tolist() if rounds else []
    for j in range(-(-len(mine_tail) // batch)):
        at = (head_len + rank + j * batch * world) // batch
        slots.append(int(batch_slots[min(at, len(batch_slots) - 1)]) if len(batch_slots) else 0)
    return mine + mine_tail, np.asarray(slots, dtype=np.int32)
