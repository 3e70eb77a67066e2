"""The driver's side of the node cache: what one loader iterator tells the caches of its nodes about its order.

NOTE [ raydl node cache ] in cluster/cache/node_actor.py says what the cache does with it. `CacheFeed` runs in the
training process (driver/iter.py calls it as batches are sent and handed out); the cache actors it
talks to run on every node a worker of the iterator runs on.
"""

from __future__ import annotations

import itertools
import os
import time
import uuid
from typing import Any, Callable, Optional

import numpy as np

from .handles import _ensure_registered, _name, node_cache
from .unit_file import UNIT_TRAILER_BYTES

__all__ = ["CacheFeed", "plan_owners"]

# NOTE [ raydl cache cursor ]
# The caches learn the loop's cursor (the next batch to hand out) and the end of the batches in
# flight from `advance`, an actor call. It was sent at every batch: 514 calls in two epochs of 256
# batches, where the workers made 36 acquire/release pairs; a Ray call of the training loop's per
# batch, and the cache's CPU in bench_streaming went 0.33 -> 0.24 cores without them. The cursor
# matters to a cache in one way: a unit whose last use it passed is the first evicted. So the driver tells the caches at once
# when the cursor passes a batch that is the last in the plan to use some unit (`_frees`: every
# position beyond the known plan counts as one), and otherwise at most every ADVANCE_INTERVAL_S:
# within a shuffle window no unit is freed, and a cursor late by a few batches only keeps units the
# next batches use anyway. A worker that waits for a unit never waits on this: its ask is urgent,
# and an urgent fetch may evict any unit no worker holds. Over node slots (NOTE [ raydl node slots ])
# a unit is freed every batch or two, and telling each doubled the loop's Ray calls (69 against 19 an
# epoch of 150 batches, one node): the caches are told once a quarter of the units a worker keeps
# (`units_in_use`) were freed since the last telling, which a window shuffle's window end passes at once.
ADVANCE_INTERVAL_S = 0.05


class CacheFeed:
    """What the driver tells the node caches about one iterator's order (NOTE [ raydl node cache ]).

    Each node's cache is told the batches that workers on that node make (or, by torch's round robin,
    will make: `where`), so a node fetches only the units its own workers read; a batch whose worker
    is not known yet goes to every node's plan. A batch sent to another node than foreseen (a worker
    lost, the pool resized) re-plans the rest of the epoch from the cursor.

    With several nodes, each unit planned from the cursor on gets one owner (NOTE [ raydl cooperative
    caches ]): of the nodes that use it, the one that owns the fewest bytes so far, taken in the order
    of first use. Only the owner fetches it from storage; its plan also has the unit at the other
    nodes' batches that use it, so it holds it for them; they ask the owner's cache for it.
    """

    _COUNTERS = (
        "hits",
        "misses",
        "bytes_fetched",
        "fetches",
        "adopted",
        "evictions",
        "retries",
        "failures",
        "corrupt",
        "wait_s",
        "bytes_from_peers",
        "peer_fetches",
        "peer_fallbacks",
        "bytes_served",
    )
    _PER_NODE = (
        "hits",
        "misses",
        "bytes_fetched",
        "fetches",
        "adopted",
        "bytes_from_peers",
        "peer_fetches",
        "peer_fallbacks",
        "bytes_served",
    )

    def __init__(self, dataset: Any, batch_size: int, where: Optional[Callable[[int, int], list]] = None) -> None:
        """`where(first, end)`: the node of the worker of each batch position in [first, end), None if not known."""
        self._ds = dataset
        self._batch = max(1, batch_size)
        self._where = where
        self._sid = uuid.uuid4().hex
        self._actors: dict[str, Any] = {}  # node id -> its cache actor
        self._bases: dict[str, Any] = {}  # node id -> its counters when it joined this epoch (a ref)
        self._steps: list = []  # unit ids of each batch position from `_first` on
        self._nodes: list = []  # the node each position's plan went to, None: every node
        self._owners: dict = {}  # unit id -> the node whose cache fetches it from storage (several nodes only)
        self._first = 0
        self._last: tuple = (-1, -1)  # (cursor, end of the batches in flight) last reported
        self._frees: list = []  # per position of `_steps`: units last used there (NOTE [ raydl cache cursor ])
        # units freed since the last telling that make the caches be told at once (NOTE [ raydl cache cursor ])
        self._free_units = max(1, int(getattr(dataset, "units_in_use", 1)) // 4)
        self._told: tuple = (-1, -1)  # what the caches were last told, and when
        self._told_at = 0.0
        self._open = False  # whether the stream is open (actors stay known for stats after it closes)
        self._session: Optional[str] = None  # the actors' Ray session (NOTE [ raydl no Ray behind the user's back ])
        self._guess: Optional[str] = None  # the node fed before the workers said where they run
        # what placed this epoch's batches (NOTE [ raydl node slots ] in driver/node_slots.py), for stats
        self.placement: Optional[Callable[[], dict]] = None

    @staticmethod
    def for_dataset(dataset: Any, batch_size: Optional[int], where: Any = None) -> Optional[CacheFeed]:
        """A feed for a dataset that streams through the node cache, else None."""
        if not callable(getattr(dataset, "raydl_cache_units", None)):
            return None
        return CacheFeed(dataset, batch_size or 1, where)

    def begin_epoch(self, sampler_iter: Any, first: int, node_ids: Any = ()) -> None:
        """Send the epoch's plan from batch position `first` on, before any of its batches is sent: what the sampler
        knows ahead (the driver weighs each batch against it before sending it: `has_room`)."""
        import ray

        from ..connect import ray_session

        self.close()
        self._sid = uuid.uuid4().hex  # a stream per epoch: a late call of the last one cannot move this one
        self._session = ray_session()
        self._actors, self._bases = {}, {}
        steps: list = []
        ahead = self._ds.raydl_order_ahead(sampler_iter)
        if ahead is not None and len(ahead):
            units = self._ds.units_of(ahead)
            for i in range(0, len(units), self._batch):
                steps.append(np.unique(units[i : i + self._batch]).tolist())
        self._steps, self._first = steps, first
        self._frees = _last_uses(steps).tolist()
        self._nodes = [None] * len(steps)
        self._last = self._told = (first, first)
        self._told_at = 0.0
        self._open = True
        node_ids = list(node_ids)
        # Workers not placed yet (a first epoch): the driver's node until they say where they run.
        guess = None if node_ids else ray.get_runtime_context().get_node_id()
        self._guess = None
        self.add_nodes(node_ids or [guess])
        self._guess = guess

    def _at(self) -> int:
        """The first position still to plan: the cursor."""
        return max(self._last[0], self._first)

    def _split(self, known: list) -> bool:
        """Which node's plan each position from the cursor on goes to (None: every node's); whether any changed."""
        at = self._at()
        end = self._first + len(self._steps)
        if self._where is None or len(known) < 2 or at >= end:
            new = [None] * (end - at)
        else:
            new = [n if n in known else None for n in self._where(at, end)]
        old = self._nodes[at - self._first :]
        self._nodes[at - self._first :] = new
        owners = self._assign_owners(known)
        changed = new != old or owners != self._owners
        self._owners = owners
        return changed

    def _flat(self, known: list) -> tuple:
        """The plan from the cursor on as arrays, one entry per (batch, unit): unit ids, batch offsets from the
        cursor, and the index in `known` of the node planned for the batch (-1: every node; -2: a node not known)."""
        steps, nodes = self._steps[self._at() - self._first :], self._nodes[self._at() - self._first :]
        lens = np.fromiter(map(len, steps), np.int64, len(steps))
        units = np.fromiter(itertools.chain.from_iterable(steps), np.int64, int(lens.sum()))
        index = {n: i for i, n in enumerate(known)}
        per_step = np.fromiter((-1 if n is None else index.get(n, -2) for n in nodes), np.int64, len(steps))
        return units, np.repeat(np.arange(len(steps)), lens), np.repeat(per_step, lens), lens

    def _assign_owners(self, known: list) -> dict:
        """{unit id: owner node} of the units planned from the cursor on, with two nodes or more (NOTE [ raydl
        cooperative caches ]): in the order of first use, each goes to the node using it that owns the fewest bytes
        so far (the first user on a tie); a unit of a batch planned on every node may go to any of them."""
        if len(known) < 2 or os.environ.get("RAYDL_CACHE_PEERS", "1") == "0":  # "0": each node fetches its own
            return {}
        units, pos, node, _ = self._flat(known)
        owner = plan_owners(units, pos, node, len(known), self._ds.unit_nbytes)
        return {u: known[n] for u, n in owner.items()}

    def _plan_for(self, node: str) -> list:
        """The steps from the cursor on that `node`'s cache is told: all units of its own batches (and of those
        planned on every node), the units it owns of the other nodes' batches."""
        known = list(self._actors)
        if node not in known:
            known.append(node)
        units, pos, planned, lens = self._flat(known)
        me = known.index(node)
        keep = (planned == -1) | (planned == me)
        if self._owners:
            owner = np.full(int(self._ds.unit_nbytes.shape[0]), -3, np.int64)
            owned = [u for u, n in self._owners.items() if n == node]
            owner[owned] = me
            keep |= owner[units] == me
        if not len(lens):
            return []
        kept = np.bincount(pos[keep], minlength=len(lens))  # units kept of each batch
        return [chunk.tolist() for chunk in np.split(units[keep], np.cumsum(kept)[:-1])]

    def _send_plan(self, node: str, actor: Any) -> None:
        at = self._at()
        steps = self._plan_for(node)
        planned = {u for units in steps for u in units}
        owners = {u: n for u, n in self._owners.items() if n != node and u in planned}
        actor.plan.remote(
            sid=self._sid,
            token=self._ds.token,
            first=at,
            steps=steps,
            owners=owners,
            peers={n: a for n, a in self._actors.items() if n != node} if owners else {},
        )
        actor.advance.remote(sid=self._sid, cursor=at, sent=max(self._last[1], at))

    def add_nodes(self, node_ids: Any) -> None:
        """Workers run on these nodes: their caches get their part of the plan from the cursor on, and the nodes
        already fed get theirs again if the split changed."""
        if not self._open:
            return
        node_ids = list(dict.fromkeys(node_ids))
        guess, self._guess = self._guess, None
        if guess is not None and node_ids and guess not in node_ids:  # no worker there: stop its prefetching
            self._actors.pop(guess).close.remote(sid=self._sid)
            self._bases.pop(guess)
        new = [node for node in node_ids if node not in self._actors]
        for node in new:
            actor = node_cache(self._ds.cache_dir, self._ds.cache_limit, node_id=node)
            _ensure_registered(actor, self._ds, _name(node, self._ds.cache_dir))
            self._bases[node] = actor.stats.remote()
            self._actors[node] = actor
        changed = self._split(list(self._actors))
        for node, actor in self._actors.items():
            if node in new or changed:
                self._send_plan(node, actor)

    def on_send(self, position: int, index: Any, node: Optional[str] = None) -> None:
        """A batch sent to a worker on `node` (None: not known): added to that node's plan unless it had it."""
        if not self._open:
            return
        end = self._first + len(self._steps)
        if position < end:
            told = self._nodes[position - self._first] if position >= self._first else None
            if told is not None and node is not None and told != node and node in self._actors:
                # Not the foreseen worker's node (a worker lost, the pool resized): plan the rest again.
                self._split(list(self._actors))
                self._nodes[position - self._first] = node
                self._owners = self._assign_owners(list(self._actors))
                for n, actor in self._actors.items():
                    self._send_plan(n, actor)
            return
        self._steps.extend([] for _ in range(position - end))  # positions skipped at resume use nothing
        self._nodes.extend(None for _ in range(position - end))
        units = np.unique(self._ds.units_of(index if isinstance(index, list) else [index])).tolist()
        self._steps.append(units)
        # a plan told batch by batch says nothing of later uses: each position may be a unit's last
        self._frees.extend([self._free_units] * (len(self._steps) - len(self._frees)))  # (appended once a batch)
        target = node if node in self._actors and len(self._actors) > 1 else None
        self._nodes.append(target)
        for n, actor in self._actors.items():
            if target is None or n == target:
                actor.extend.remote(sid=self._sid, token=self._ds.token, step=position, units=units)

    def has_room(self, cursor: int, position: int) -> bool:
        """Whether the batch at `position` may be sent now: on every node, the units of the batches from `cursor` to
        it (those the node's cache is told) fit in the cache with room for one more unit arriving (NOTE [ raydl node
        cache ]: a cache full of units of batches in flight must evict one of them for a worker that waits, and fetch
        it again). True for a position the plan does not know yet: nothing to weigh."""
        lo, hi = max(cursor, self._first) - self._first, position - self._first
        if not self._open or hi < lo or hi >= len(self._steps):
            return True
        groups: dict = {}
        owners = self._owners
        for units, node in zip(self._steps[lo : hi + 1], self._nodes[lo : hi + 1]):
            groups.setdefault(node, set()).update(units)
            if owners and node is not None:  # the owners hold them for this batch's node too
                for u in units:
                    if owners.get(u, node) != node:
                        groups.setdefault(owners[u], set()).add(u)
        every = groups.pop(None, set())
        sizes = self._ds.unit_nbytes + UNIT_TRAILER_BYTES  # as the cache counts them: each file's checksum too
        room = self._ds.cache_limit - getattr(self._ds, "cache_metadata_bytes", 0) - int(sizes.max())
        return all(int(sizes[list(every | own)].sum()) <= room for own in (groups.values() or [set()]))

    def advance(self, cursor: int, sent: int) -> None:
        """The loop's cursor and the end of the batches in flight moved: told to the caches when a unit's last use
        was passed, else at most every ADVANCE_INTERVAL_S (NOTE [ raydl cache cursor ])."""
        if not self._open or (cursor, sent) == self._last:
            return
        self._last = (cursor, sent)
        now = time.monotonic()
        if now - self._told_at < ADVANCE_INTERVAL_S and not self._frees_in(self._told[0], cursor):
            return
        self._told, self._told_at = self._last, now
        for actor in self._actors.values():
            actor.advance.remote(sid=self._sid, cursor=cursor, sent=sent)

    def _frees_in(self, start: int, end: int) -> bool:
        """Whether the batch positions in [start, end) are the last uses of `_free_units` units or more (outside the
        known plan: yes)."""
        if end <= start:
            return False
        lo, hi = start - self._first, end - self._first
        if lo < 0 or hi > len(self._frees):
            return True
        return sum(self._frees[lo:hi]) >= self._free_units

    def _live(self) -> bool:
        """Whether the actors' Ray session is still this process's: finalizers may run after ray.shutdown()."""
        from ..connect import ray_session

        return bool(self._actors) and self._session is not None and ray_session() == self._session

    def close(self) -> None:
        from ..connect import ray_calls

        if self._open:
            self._open = False
            if not self._actors:
                return
            with ray_calls(self._session) as session:  # may run in a finalizer, in any thread
                if session is None:
                    return
                for actor in self._actors.values():
                    try:
                        actor.close.remote(sid=self._sid)
                    except Exception:  # Ray going down
                        pass

    def fetch_spans(self, since_wall_s: float) -> dict:
        """node id -> the fetches from storage of its cache since `since_wall_s` (NOTE [ raydl node cache ]), for the
        timeline; nodes that do not answer within 10 s are left out."""
        import ray

        if not self._live():
            return {}
        nodes = list(self._actors)
        refs = [self._actors[n].fetch_spans.remote(since_wall_s=since_wall_s) for n in nodes]
        out = {}
        for node, ref in zip(nodes, refs):
            try:
                out[node] = ray.get(ref, timeout=10)
            except Exception:  # a cache gone or slow: the picture goes without its track
                continue
        return out

    def stats(self, busy_s: float) -> Optional[dict]:
        """This epoch's cache figures, summed over the nodes fed whose caches answer (bytes held and peak: now, the
        largest node's).

        `busy_s`: the workers' time making batches, of which `storage_wait_share` is the part spent
        waiting for units to arrive from storage. None when no cache answers within 10 s.
        """
        import ray

        if not self._live():
            return None
        asked = [(n, self._actors[n].stats.remote(), self._bases[n]) for n in list(self._actors)]
        nodes, nows, bases = [], [], []
        for node, now, base in asked:  # a node lost (its cache gone) is left out
            try:
                nows.append(ray.get(now, timeout=10))
                bases.append(ray.get(base, timeout=10))
                nodes.append(node)
            except Exception:
                if len(nows) > len(bases):
                    nows.pop()
        if not nodes:
            return None
        out = dict(max(nows, key=lambda st: st["peak_bytes"]))
        for k in self._COUNTERS:
            out[k] = sum(now.get(k, 0) - base.get(k, 0) for now, base in zip(nows, bases))
        out["prefetch_depth"] = sum(now["prefetch_depth"] for now in nows)
        out["nodes"] = len(nodes)
        # Each node's own figures this epoch: what its workers read (hits, misses) and what its cache brought in.
        out["per_node"] = {
            node: {k: now.get(k, 0) - base.get(k, 0) for k in self._PER_NODE}
            | {"bytes_held": now["bytes_held"], "peak_bytes": now["peak_bytes"]}
            for node, now, base in zip(nodes, nows, bases)
        }
        asked = out["hits"] + out["misses"]
        out["hit_rate"] = out["hits"] / asked if asked else 0.0
        out["storage_wait_share"] = min(1.0, out["wait_s"] / busy_s) if busy_s > 0 else 0.0
        if self.placement is not None:
            out["placement"] = self.placement()
        return out


def plan_owners(units: np.ndarray, pos: np.ndarray, node: np.ndarray, k: int, sizes: np.ndarray) -> dict:
    """{unit: owner node's index} for a plan given as (unit, batch position, node index; -1: every one of the `k`
    nodes) entries (NOTE [ raydl cooperative caches ]): in the order of first use, each unit goes to the node using it
    that owns the fewest bytes so far (the first user on a tie). Also what the retired sim_node_slots planned with
    (commit 3d9a662)."""
    every = node == -1  # each node uses these
    units = np.concatenate([units[node >= 0], np.repeat(units[every], k)])
    pos = np.concatenate([pos[node >= 0], np.repeat(pos[every], k)])
    node = np.concatenate([node[node >= 0], np.tile(np.arange(k), int(every.sum()))])
    order = np.lexsort((pos, node, units))  # each (unit, node) pair's first use first
    units, pos, node = units[order], pos[order], node[order]
    first = np.ones(len(units), bool)
    first[1:] = (units[1:] != units[:-1]) | (node[1:] != node[:-1])
    order = np.lexsort((node[first], pos[first]))
    users: dict = {}  # unit -> the nodes that use it, in order of first use (units in order of first use)
    for u, n in zip(units[first][order].tolist(), node[first][order].tolist()):
        users.setdefault(u, []).append(n)
    owned = [0] * k
    owners = {}
    for u, lst in users.items():
        n = min(lst, key=lambda i: (owned[i], lst.index(i)))
        owners[u] = n
        owned[n] += int(sizes[u])
    return owners


def _last_uses(steps: list) -> np.ndarray:
    """Per position of `steps` (the unit ids of each batch): how many units it is the last position to use."""
    frees = np.zeros(len(steps), np.int64)
    if not steps:
        return frees
    lens = np.fromiter(map(len, steps), np.int64, len(steps))
    units = np.fromiter(itertools.chain.from_iterable(steps), np.int64, int(lens.sum()))
    if not len(units):
        return frees
    pos = np.repeat(np.arange(len(steps)), lens)
    last = np.full(int(units.max()) + 1, -1, np.int64)
    np.maximum.at(last, units, pos)
    np.add.at(frees, last[last >= 0], 1)
    return frees
