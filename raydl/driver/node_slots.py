"""Which node makes each batch of an order cut over node slots: the slots dealt to the nodes the workers run on.

NOTE [ raydl node slots ]
With the window shuffle every node's workers read nearly every unit when batches go to the workers
by torch's round robin: the cooperative caches (NOTE [ raydl cooperative caches ]) read each unit
from storage once, then send it to every other node, (N - 1)x the data between nodes an epoch.
A streamed dataset's `shuffle=True` order is instead cut over `node_slots` slots (NOTE [ raydl
unit order ]): each unit belongs to one slot in an epoch, and each batch but the last few
takes its rows from one slot's units. The driver deals the slots to the nodes its workers run on
and sends each batch to a worker of its slot's node (the least busy one there), so a node's cache
is told, and fetches, only its own slots' units: nothing crosses between nodes but the units of
the last batches that mix slots. The trainer still receives the batches in the sampler's order
(the reorder buffer), the prefetch bound is the same, and the deal is made again whenever the
nodes change (a node lost, workers added or retired): the caches' plan follows.
  * How many slots (issue 64): by default one a node, each shuffling a whole window (what one node's
    cache holds): the driver settles the count when the run's first epoch starts, from the nodes its
    workers run on (`_RayLoaderIter._settle_slots`), keeps it for the run and records it in the state
    (Mosaic Streaming's canonical nodes). A batch so mixes as much as the window shuffle on one node,
    and one node is that shuffle. The 12 slots of a twelfth of the window that were the default made
    batches of one file on a class-sorted corpus (0.17 against 0.48 for a batch-norm model in
    tests/test_node_slots.py). `node_slots` given keeps that many slots of a share of the window.
  * The deal: the active workers sorted by (node, worker id); slot s goes to the node of worker
    (s + 1/2) * workers // slots, so nodes get slots in proportion to their workers (one slot a node
    with the default and as many workers on each). When the nodes change, a slot stays on its node
    while that node is there; a lost node's slots go to the nodes with the fewest slots per worker,
    and a node that joins takes slots from the most loaded while that evens them out
    (`_dealt_again`). A node count that does not divide the slots gives some nodes a slot more (5
    nodes over 12 slots given: 3 and 2), and nodes beyond the slots get no batch (a resume of a
    2-node run on 4 nodes): `node_slots` a multiple of the node count balances them
    (sim_node_slots, retired at 3d9a662, docs/benchmark-notes.md#retired-benchmarks: 4 slots a node also spreads
    a lost node's slots over 4 others).
  * The batches do not depend on the deal: the order depends on the seed, units, window, slots and
    batch size only, and a batch's random draws on its position (`ray_seed="batch"`, the default for such
    a loader). With `ray_seed="worker"` a batch's draws depend on the worker torch's round robin
    gives it, so raydl keeps that round robin, and the cooperative caches serve it; so too for a
    sampler of the user's, `node_slots=1` and an order cut for another batch size (a state saved at
    another one). A `ray_job`'s ranks share its workers: each rank's batch goes to the least busy of
    the job's workers on its slot's node (NOTE [ raydl distributed slots ]).
    `loader.stats().cache["placement"]` says which path an epoch took, and why.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any, Callable, Optional

import numpy as np

logger = logging.getLogger(__name__)
_WARNED: set = set()  # (slots, nodes) told once a process: nodes that make no batch

__all__ = [
    "SlotDeal",
    "agreed_slot_count",
    "batch_nodes",
    "epoch_deal",
    "next_worker",
    "placement_reason",
    "settle_slots",
]


def placement_reason(*, seed: str, slots: Optional[np.ndarray], has_slots: bool) -> Optional[str]:
    """None when an epoch's batches may go to their slots' nodes; else why the round robin keeps them."""
    if not has_slots:
        return "the sampler is not the dataset's shuffle over node slots (shuffle=False, a sampler of the user's)"
    if seed == "worker":
        return "ray_seed='worker': a batch's random draws depend on the worker torch's round robin gives it"
    if slots is None:
        return (
            "the order has one node slot (node_slots=1, or the default one slot a node with the workers on one node) "
            "or was cut for another batch size"
        )
    return None


def settle_slots(dataset: Any, sampler_iter: Any, nodes: int) -> None:
    """Slots per node (a streamed dataset's default `node_slots`): the run's first epoch cuts its order over the `nodes`
    its workers run on, one slot a node, kept for the run (1 where torch's round robin places the batches anyway: the
    window shuffle, which the cooperative caches serve); a DDP job's ranks take rank 0's count. A `ray_job`'s ranks
    count the job's workers' nodes, the same for every rank. The ranks agree once, at the run's first epoch, and every
    rank joins whatever its own count (a rank whose workers sit on one node while rank 0's sit on two must still take
    part, or rank 0 waits in the broadcast)."""
    settle = getattr(dataset, "raydl_settle_slots", None)
    if not callable(settle):
        return
    nodes = max(1, nodes)
    distributed = getattr(dataset, "raydl_distributed", None)
    sampler = distributed(sampler_iter) if callable(distributed) else None
    if sampler is not None and not sampler.settled:
        nodes = agreed_slot_count(nodes, sampler.num_replicas)
    settle(sampler_iter, nodes)


def epoch_deal(
    dataset: Any, sampler_iter: Any, batch: Optional[int], seed: str, node_of: Callable[[int], Optional[str]]
) -> tuple[Optional[SlotDeal], Callable[[], dict]]:
    """This epoch's deal of batches to nodes by slot (None where torch's round robin places them), and what
    `loader.stats().cache["placement"]` says of it."""
    has = callable(getattr(dataset, "raydl_batch_slots", None))
    slots = dataset.raydl_batch_slots(sampler_iter, batch) if has and batch else None
    why = placement_reason(seed=seed, slots=slots, has_slots=has)
    if why is not None:
        return None, lambda: {"mode": "round robin", "why": why}
    deal = SlotDeal(slots, node_of)  # type: ignore[arg-type]
    return deal, deal.figures


def next_worker(deal: Optional[SlotDeal], sched: Any, send_idx: int) -> Optional[int]:
    """The worker of task `send_idx`: the least busy on its slot's node when the epoch has a deal and a worker there,
    else the schedule's own (torch's round robin)."""
    if deal is not None:
        node, there = deal.place(send_idx, sched.active)
        if node is not None:
            worker_id = sched.least_busy(there)
            if worker_id is not None:
                deal.sent(node)
                return worker_id
        deal.sent(None)
    return sched.next_worker()


def batch_nodes(
    deal: Optional[SlotDeal], sched: Any, send_idx: int, first: int, end: int, node_of: Callable[[Any], Optional[str]]
) -> list:
    """The node of each batch position in [first, end): its worker's for a batch sent, else its slot's under a deal
    (else the worker the schedule will give it); None where not known."""
    workers = sched.workers_of(first, end, send_idx)
    nodes = {w: node_of(w) for w in set(workers)}
    if deal is not None:  # the batches not sent yet go to their slots' nodes
        by_slot = deal.nodes(first, end, sched.active)
        return [
            nodes[w] if p < send_idx and w is not None else n for p, w, n in zip(range(first, end), workers, by_slot)
        ]
    return [nodes[w] for w in workers]


def agreed_slot_count(nodes: int, world: int) -> int:
    """The slot count of a DDP job's order (NOTE [ raydl distributed slots ]): every rank must cut the same order, so
    rank 0's node count goes to every rank through torch.distributed (each rank settles at its loader's first epoch,
    which DDP ranks reach together). Without a process group of `world` ranks the ranks cannot agree: one slot, the
    position deal, whose order needs no agreement (give `node_slots` to have slots then)."""
    if world <= 1:
        return nodes
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() != world:
            return 1
        box = [nodes]
        dist.broadcast_object_list(box, src=0)
        return int(box[0])
    except (RuntimeError, ValueError) as e:  # a backend that cannot send objects: no slots, said
        logger.warning("raydl: the ranks' node slot counts could not be agreed through torch.distributed (%s)", e)
        return 1


class SlotDeal:
    """The slots of one epoch's batches and the node each slot is dealt to (NOTE [ raydl node slots ])."""

    def __init__(self, batch_slots: np.ndarray, node_of: Callable[[int], Optional[str]]) -> None:
        self._slots = np.asarray(batch_slots, dtype=np.int64)
        self._count = int(self._slots.max()) + 1 if len(self._slots) else 1
        self._node_of = node_of
        self._key: tuple = ()
        self._nodes: list = []  # slot -> node (None: no worker's node known)
        self.batches_by_node: dict = {}  # node -> batches sent there this epoch

    def deal(self, workers: list[int]) -> list:
        """slot -> node for these active workers (made again only when their nodes changed: see the NOTE)."""
        key = tuple((w, self._node_of(w)) for w in workers)
        if key != self._key:
            self._key = key
            known = sorted((n, w) for w, n in key if n is not None)
            if not known:
                self._nodes = [None] * self._count
            elif all(n is None for n in self._nodes):
                n = len(known)  # slot s: the worker at (s + 1/2) * workers / slots, rounded down
                self._nodes = [known[(2 * s + 1) * n // (2 * self._count)][0] for s in range(self._count)]
            else:
                self._nodes = _dealt_again(self._nodes, Counter(n for n, _ in known))
            self._warn_idle({n for n, _ in known})
        return self._nodes

    def _warn_idle(self, nodes: set) -> None:
        """Nodes with workers but no slot make no batch: said once, with the fix."""
        idle = nodes - set(self._nodes)
        if idle and (self._count, len(nodes)) not in _WARNED:
            _WARNED.add((self._count, len(nodes)))
            n = len(nodes)
            logger.warning(
                "raydl: %d of the %d nodes the workers run on make no batch: the dataset's shuffle order has %d node "
                "slots (NOTE [ raydl node slots ]; with the default, one a node, the count the run settled at its first "
                "epoch, kept in its state). Give the dataset node_slots=%d (a multiple of the node count; "
                "shuffle_window at least that) to use them all in a new run.",
                len(idle),
                n,
                self._count,
                n * -(-self._count // n),
            )

    def node_at(self, position: int, workers: list[int]) -> Optional[str]:
        """The node of the slot of the batch at `position` (None: not known: no slot, or no node known yet)."""
        if not 0 <= position < len(self._slots):
            return None
        return self.deal(workers)[int(self._slots[position])]

    def place(self, position: int, workers: list[int]) -> tuple[Optional[str], list[int]]:
        """The node of the batch at `position` and those of `workers` that run there (the nodes looked up once)."""
        node = self.node_at(position, workers)
        return node, [w for w, n in self._key if n == node] if node is not None else []

    def nodes(self, first: int, end: int, workers: list[int]) -> list:
        """The node of each batch position in [first, end)."""
        nodes = self.deal(workers)
        return [nodes[int(self._slots[p])] if 0 <= p < len(self._slots) else None for p in range(first, end)]

    def sent(self, node: Optional[str]) -> None:
        """A batch went to `node` (None: to torch's round robin's worker, no node known yet)."""
        key = "not placed" if node is None else node
        self.batches_by_node[key] = self.batches_by_node.get(key, 0) + 1

    def figures(self) -> dict:
        """What `loader.stats().cache["placement"]` says of this epoch."""
        return {
            "mode": "node slots",
            "node_slots": self._count,
            "batches_by_node": dict(self.batches_by_node),
            "nodes_without_slots": len({n for _, n in self._key if n is not None} - set(self._nodes)),
        }


def _dealt_again(nodes: list, weight: Counter) -> list:
    """The deal `nodes` (slot -> node) after the nodes changed to those of `weight` (node -> its workers): a slot keeps
    its node while that node is there; a slot whose node is gone goes to the node with the fewest slots per worker;
    then, while moving one slot from the node with the most slots per worker to the one with the fewest evens them
    out, it moves (a node that joined takes its share; every slot moved is fetched there again)."""
    out = [n if n in weight else None for n in nodes]
    load = Counter({n: 0 for n in weight})
    load.update(n for n in out if n is not None)
    for s, n in enumerate(out):
        if n is None:
            n = min(weight, key=lambda m: ((load[m] + 1) / weight[m], m))
            out[s] = n
            load[n] += 1
    while True:
        most = max(weight, key=lambda m: (load[m] / weight[m], m))
        least = min(weight, key=lambda m: (load[m] / weight[m], m))
        if (load[most] - 1) / weight[most] < (load[least] + 1) / weight[least] or most == least:
            return out
        s = max(i for i, n in enumerate(out) if n == most)
        out[s] = least
        load[most] -= 1
        load[least] += 1
