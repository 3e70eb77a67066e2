"""The node cache: one actor per node and cache folder, holding units (byte ranges of files) fetched ahead in the known order.

NOTE [ raydl node cache ]
What a streamed dataset (data/parquet.py) reads is split into units (a few byte ranges of one
file). Every node has one `NodeCache` actor per cache folder (detached, named after the node and
the folder), shared by every worker of the node and every rank of a `ray_job` there.
  * the order ahead: the driver (`CacheFeed`, cluster/cache/driver_feed.py) tells the cache, per
    stream, which units each batch position uses (the whole epoch when the sampler knows it,
    else each batch as it is sent), and its cursor;
  * fetching: up to FETCH_PARALLEL fetches, always of the missing unit used first (one a worker
    waits for, then the plans' order). A fetch reserves its bytes first and renames a temporary
    file when whole: a unit is visible only whole, and the bytes held never exceed the limit;
  * eviction (Belady): the unit whose next use is farthest goes first, and only if that use is
    later than the unit to fetch. A pinned unit (between `acquire` and `release`) is never
    evicted; no worker holds a pin while it waits, so two units' room always makes progress,
    and the driver sends a batch only while the batches in flight fit (`CacheFeed.has_room`);
  * storage faults: transient errors are retried with backoff (STORAGE_ATTEMPTS), others fail
    the unit at once and the worker raises naming the file;
  * the folder: units are files named by a key of path, size, mtime and ranges, so loaders and
    clusters on one node share a folder safely (only whole files are seen; a vanished file is
    asked for again); a restarted cache adopts the files it is told about. The limit is the
    folder's: the datasets' metadata in its subfolders (the tar index, the file listing) counts
    against it, measured when a dataset registers, and unit files no registered dataset names
    (an earlier run's) count until evicted, before any other unit;
  * checksums: a unit's file ends with a CRC-32 of its bytes taken as they arrive; a worker checks
    it before decoding a byte, and a mismatch is deleted, counted and fetched again (for
    accidents, not attackers).
Across nodes each cache is told the batches its own workers make (torch's round robin), so a node
fetches only what its workers read; a batch whose worker is not known goes to every node's plan,
and one sent elsewhere than foreseen re-plans the rest of the epoch. A plan whose driver is silent
for STREAM_IDLE_S is dropped. Detail, figures and known limits: docs/design-notes.md.
Across nodes the caches cooperate: NOTE [ raydl cooperative caches ] in peer_units.py.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

__all__ = ["NodeCache"]

from ...data.storage import OpenFiles, read_objects, with_retries
from .peer_calls import ident, is_gone, this_node
from .peer_units import PeerUnits
from .stream_plan import INF, StreamPlan
from .unit_file import UNIT_TRAILER_BYTES, clean_tmp, folder_bytes, intact, seal, sound, unlink, write_whole

logger = logging.getLogger(__name__)

FETCH_PARALLEL = 8  # concurrent storage requests per node cache
FETCH_SPANS_KEPT = 4096  # the last fetches kept for the loader's timeline
ACQUIRE_SLICE_S = 5.0  # one acquire call waits at most this long
READ_TIMEOUT_S = float(os.environ.get("RAYDL_CACHE_READ_TIMEOUT_S", "300"))  # a worker's wait for one batch's units
READ_AHEAD_STEPS = 64  # NOTE [ raydl read ahead ]: how far past the cursor a worker's read-ahead looks
IDLE_EXIT_S = float(os.environ.get("RAYDL_CACHE_IDLE_S", "900"))  # a cache nobody called for this long exits
STREAM_IDLE_S = 1800.0  # a plan whose driver said nothing for this long is dropped (a driver gone without closing it)


class NodeCache(PeerUnits):
    """The node's cache actor (NOTE [ raydl node cache ]); made by `node_cache`, never directly."""

    def __init__(
        self, cache_dir: str, limit_bytes: int, idle_exit_s: Optional[float] = None, node_id: Optional[str] = None
    ) -> None:
        """`idle_exit_s`: as an actor, exit after this long with no stream and no call (None: never); `node_id`: the
        name its peers and the driver's plan know it by (default: its Ray node's id)."""
        self._node = node_id or this_node()
        if "{node_id}" in cache_dir:  # a folder of each node's own on a file system the nodes share
            cache_dir = cache_dir.replace("{node_id}", self._node or "local")
        os.makedirs(cache_dir, exist_ok=True)
        self._idle_exit_s = idle_exit_s
        self._stopped = False
        self._dir = cache_dir
        self._limit = int(limit_bytes)
        self._cv = threading.Condition()
        self._specs: dict[str, tuple] = {}  # key -> (fs token, path, file size, segments, nbytes)
        self._fs: dict[str, Any] = {}
        self._keys: dict[str, list] = {}  # dataset token -> unit keys by unit id
        self._unit_ids: dict[str, dict] = {}  # dataset token -> {unit key: unit id}, made at a first read-ahead
        self._ready: dict[str, int] = {}  # key -> nbytes, whole on disk
        self._fetching: dict[str, int] = {}  # key -> nbytes reserved
        self._pins: dict[str, int] = {}
        self._failed: dict[str, str] = {}
        self._urgent: dict[str, int] = {}  # key -> order of the request
        self._streams: dict[str, StreamPlan] = {}
        self._closed: dict[str, None] = {}  # streams closed (calls run concurrently: a late `plan` must not reopen one)
        # NOTE [ raydl cooperative caches ]
        self._peers: dict[str, Any] = {}  # node id -> its cache actor
        self._dead_peers: set = set()  # peer caches (`_ident`) that are gone: their units are read from storage
        # key -> [when to ask again, ask urgently, asks]: a unit its owner will offer, its bytes kept reserved (it
        # stays in _fetching, with no thread on it)
        self._asked: dict[str, list] = {}
        self._offered: set = set()  # keys offered while their ask was under way: asked again at once
        self._wanted: dict[str, set] = {}  # key -> peers waiting for this cache to have it
        self._used = 0
        self._n = 0
        self._stats = dict(
            hits=0,
            misses=0,
            bytes_fetched=0,
            fetches=0,
            adopted=0,
            evictions=0,
            retries=0,
            failures=0,
            corrupt=0,
            peak_bytes=0,
            bytes_from_peers=0,
            peer_fetches=0,
            peer_fallbacks=0,
            bytes_served=0,
        )
        self._wait_s = 0.0
        # (start, end, key, nbytes, error or None) of the last fetches from storage, wall clock: the timeline's track
        self._fetch_spans: deque = deque(maxlen=FETCH_SPANS_KEPT)
        self._last_call = time.monotonic()
        self._pool = ThreadPoolExecutor(FETCH_PARALLEL)
        self._open_files = OpenFiles()
        clean_tmp(self._dir)
        # the folder's other bytes (NOTE [ raydl node cache ], "the folder"): metadata, and unit files of no dataset yet
        self._meta, self._orphans = folder_bytes(cache_dir)
        self._used = sum(self._orphans.values())
        self._shrink()
        threading.Thread(target=self._loop, name="raydl-cache", daemon=True).start()

    def __repr__(self) -> str:
        return f"raydl.NodeCache({self._dir})"

    # ------------------------------------------------------------------ driver and worker calls

    def register(self, token: str, fs: Any, units: list) -> None:
        """A dataset's units: (path, file size, segments, key) per unit id; intact files already there are adopted."""
        with self._cv:
            self._touch()
            if token in self._keys:
                return
            self._fs[token] = fs
            self._meta = folder_bytes(self._dir)[0]  # its tar index or file listing was just written there
            keys = []
            for path, size, segs, key in units:
                nbytes = sum(n for _, n in segs) + UNIT_TRAILER_BYTES  # its file's size: what the limit counts
                self._specs.setdefault(key, (token, path, size, segs, nbytes))
                keys.append(key)
                if key in self._orphans:  # now a unit of a dataset: adopted below, or removed
                    self._used -= self._orphans.pop(key)
                if key not in self._ready and key not in self._fetching and intact(self._dir, key, nbytes):
                    if self._used + nbytes <= self._room():
                        self._ready[key] = nbytes
                        self._used += nbytes
                        self._stats["adopted"] += 1
                    else:  # left by an earlier cache beyond this one's limit: the folder stays within it
                        unlink(os.path.join(self._dir, key))
            self._keys[token] = keys
            self._unit_ids.pop(token, None)
            self._shrink()
            self._peak()

    def plan(
        self,
        sid: str,
        token: str,
        first: int,
        steps: list,
        owners: Optional[dict] = None,
        peers: Optional[dict] = None,
    ) -> None:
        """Stream `sid`'s batches from position `first` on: `steps[j]` = unit ids of batch first + j (replacing
        what an earlier plan said of those positions: the driver re-plans when batches go to other nodes).

        `owners`: {unit id: node id} of the units planned here that another node's cache fetches from storage,
        `peers`: {node id: its cache actor} (NOTE [ raydl cooperative caches ]); they replace the earlier ones."""
        with self._cv:
            self._touch()
            keys = self._keys[token]
            if sid in self._closed:
                return
            s = self._streams.setdefault(sid, StreamPlan())  # an `extend` may have come first
            s.owners = {keys[u]: node for u, node in (owners or {}).items() if node != self._node}
            self._peers.update({node: h for node, h in (peers or {}).items() if node != self._node})
            s.cursor = max(s.cursor, first)
            s.sent = max(s.sent, s.cursor)
            s.drop(first, first + len(steps))
            for j, units in enumerate(steps):
                if units:
                    s.add(first + j, [keys[u] for u in units])
            s.scan = min(s.scan, first)
            self._cv.notify_all()

    def extend(self, sid: str, token: str, step: int, units: list) -> None:
        with self._cv:
            if sid in self._closed:
                return
            s = self._streams.setdefault(sid, StreamPlan())
            s.add(step, [self._keys[token][u] for u in units])
            self._cv.notify_all()

    def advance(self, sid: str, cursor: int, sent: int) -> None:
        with self._cv:
            self._touch()
            s = self._streams.get(sid)
            if s is not None:
                s.touched = time.monotonic()
            if s is not None and cursor >= s.cursor:  # calls may run out of order: cursors only move on
                for step in [k for k in s.steps if k < cursor]:
                    del s.steps[step]
                s.cursor, s.sent = cursor, sent
                self._cv.notify_all()

    def close(self, sid: str) -> None:
        with self._cv:
            self._streams.pop(sid, None)
            self._closed[sid] = None
            while len(self._closed) > 10_000:
                del self._closed[next(iter(self._closed))]
            self._cv.notify_all()

    def acquire(
        self, token: str, units: list, timeout_s: float, count: bool = True, ahead: int = 0, have: tuple = ()
    ) -> dict:
        """Pin and return {unit id: local path} of the units present, waiting (bounded) until one is.

        Units absent are asked for at once (before any unit of a plan). `count`: this is the
        batch's first call, whose units count as hits (present) or misses (absent). `ahead`: with
        the units asked, up to this many more that are here and that the plans use next, the
        worker's `have` excepted (NOTE [ raydl read ahead ]).

        Returns {"ready": {...}, "ahead": {unit id: path} (pinned too), "errors": {unit id: message}, "unknown":
        dataset not registered}.
        """
        t0 = time.monotonic()
        deadline = t0 + min(timeout_s, ACQUIRE_SLICE_S)
        with self._cv:
            self._touch()
            keys = self._keys.get(token)
            if keys is None:
                return {"ready": {}, "errors": {}, "unknown": True}
            waited = False
            if count:
                for u in units:
                    self._stats["hits" if keys[u] in self._ready else "misses"] += 1
            while True:
                ready, errors = {}, {}
                for u in units:
                    k = keys[u]
                    if k in self._ready:
                        ready[u] = os.path.join(self._dir, k)
                    elif k in self._failed:
                        errors[u] = self._failed.pop(k)
                        self._hole()
                for u in units:
                    k = keys[u]
                    if k not in self._ready and k not in self._fetching and k not in self._urgent:
                        self._n += 1
                        self._urgent[k] = self._n
                    elif k in self._asked and not self._asked[k][1]:  # asked ahead: now a worker waits for it
                        self._asked[k][:2] = [0.0, True]
                if ready or errors:
                    extra = self._next_ready(token, ahead, set(units) | set(have)) if ahead > 0 else {}
                    for u in [*ready, *extra]:
                        k = keys[u]
                        self._pins[k] = self._pins.get(k, 0) + 1
                    if waited:
                        self._wait_s += time.monotonic() - t0
                    return {"ready": ready, "ahead": extra, "errors": errors, "unknown": False}
                waited = True
                self._cv.notify_all()
                left = deadline - time.monotonic()
                if left <= 0:
                    self._wait_s += time.monotonic() - t0
                    return {"ready": {}, "errors": {}, "unknown": False}
                self._cv.wait(left)

    def _next_ready(self, token: str, n: int, skip: set) -> dict:
        """{unit id: path} of up to `n` units here that `token`'s plans use next from their cursors, `skip` excepted
        (NOTE [ raydl read ahead ]); called with `_cv` held."""
        keys = self._keys[token]
        unit_of = self._unit_ids.get(token)
        if unit_of is None:
            unit_of = self._unit_ids[token] = {k: u for u, k in enumerate(keys)}
        out: dict = {}
        for s in self._streams.values():
            for step in range(s.cursor, s.last + 1):
                for k in s.steps.get(step, ()):
                    u = unit_of.get(k)
                    if u is not None and u not in skip and u not in out and k in self._ready:
                        out[u] = os.path.join(self._dir, k)
                        if len(out) >= n:
                            return out
                if step - s.cursor > READ_AHEAD_STEPS:
                    break
        return out

    def release(self, token: str, units: list, lost: tuple = (), corrupt: tuple = ()) -> None:
        """Unpin units read; `lost`: units whose file had vanished (another cache evicted it): forget them;
        `corrupt`: units whose file failed its checksum: delete it (it is fetched again when asked for)."""
        with self._cv:
            keys = self._keys.get(token, [])
            for u in units:
                k = keys[u]
                if self._pins.get(k, 0) > 1:
                    self._pins[k] -= 1
                else:
                    self._pins.pop(k, None)
            for u in lost:
                k = keys[u]
                if k in self._ready and not self._pins.get(k):
                    self._used -= self._ready.pop(k)
                    self._hole()
            for u in corrupt:  # a unit read by two workers is reported twice: the file on disk decides
                k = keys[u]
                if k in self._ready and not sound(os.path.join(self._dir, k)):
                    unlink(os.path.join(self._dir, k))  # never handed out again, and fetched when next asked for
                    self._used -= self._ready.pop(k)
                    self._stats["corrupt"] += 1
                    self._hole()
            self._cv.notify_all()

    def stats(self) -> dict:
        """Counters, bytes held now and at peak, the limit, and the prefetch depth (units held ahead of the cursors)."""
        with self._cv:
            ahead = sum(1 for k in self._ready if self._next_use(k)[0] < INF)
            return dict(
                self._stats,
                bytes_held=self._used,
                metadata_bytes=self._meta,
                limit_bytes=self._limit,
                units_held=len(self._ready),
                prefetch_depth=ahead,
                fetching=len(self._fetching),
                wait_s=self._wait_s,
            )

    def in_use(self) -> bool:
        """Whether a loader's plan is open here (an epoch streaming through this cache)."""
        with self._cv:
            return bool(self._streams)

    def fetch_spans(self, since_wall_s: float) -> list:
        """The fetches from storage that ended at or after `since_wall_s` (wall clock): (start, end, key, nbytes,
        error), oldest first, at most FETCH_SPANS_KEPT (`LoaderStats.timeline()` draws them)."""
        with self._cv:
            return [span for span in self._fetch_spans if span[1] >= since_wall_s]

    def stop(self) -> None:
        """End the scheduler thread and the fetch threads (a cache used as a plain object, in tests)."""
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        self._pool.shutdown(wait=True)

    def reset_stats(self) -> None:
        with self._cv:
            for k in self._stats:
                self._stats[k] = 0
            self._stats["peak_bytes"] = self._used + self._meta
            self._wait_s = 0.0

    # ------------------------------------------------------------------ scheduling

    def _touch(self) -> None:
        self._last_call = time.monotonic()

    def _room(self) -> int:
        """The bytes units may take: the limit less the folder's metadata."""
        return self._limit - self._meta

    def _peak(self) -> None:
        """`peak_bytes`: the folder's most, units and metadata (what `cache_limit` bounds)."""
        held = self._used + self._meta
        if held > self._stats["peak_bytes"]:
            self._stats["peak_bytes"] = held
        assert self._used <= max(self._room(), 0), (self._used, self._meta, self._limit)

    def _shrink(self) -> None:
        """Back within the limit after the metadata grew (or at start): orphan unit files go, then the unpinned
        units used farthest ahead."""
        while self._used > max(self._room(), 0):
            if self._evict_orphan():
                continue
            victims = [k for k in self._ready if not self._pins.get(k)]
            if not victims:
                return  # pinned units only: they are released, then evicted as room is made
            self._evict(max(victims, key=lambda k: self._next_use(k)[0]))

    def _evict_orphan(self) -> bool:
        """Remove one unit file of an earlier run that no dataset here uses; False when none is left."""
        if not self._orphans:
            return False
        name, n = self._orphans.popitem()
        unlink(os.path.join(self._dir, name))
        self._used -= n
        self._stats["evictions"] += 1
        return True

    def _next_use(self, key: str) -> tuple[float, bool]:
        best, in_flight = INF, False
        for s in self._streams.values():
            d, f = s.next_use(key)
            best, in_flight = min(best, d), in_flight or f
        return best, in_flight

    def _candidate(self) -> Optional[tuple[float, str]]:
        """The missing unit used first: a unit a worker waits for, else the plans' next in order of first use."""
        if self._urgent:
            key = min(self._urgent, key=self._urgent.__getitem__)
            return -1.0, key
        best: Optional[tuple[float, str]] = None
        for s in self._streams.values():
            for step in range(max(s.cursor, s.scan), s.last + 1):
                if best is not None and step - s.cursor >= best[0]:
                    break
                keys = s.steps.get(step, ())
                hit = next(
                    (k for k in keys if k not in self._ready and k not in self._fetching and k not in self._failed),
                    None,
                )
                if hit is not None:
                    best = (float(step - s.cursor), hit)
                    break
                s.scan = step + 1
        return best

    def _hole(self) -> None:
        """A unit left the cache: the plans' scans for missing units start again at their cursors."""
        for s in self._streams.values():
            s.scan = 0

    def _make_room(self, nbytes: int, dist: float) -> bool:
        """Evict (Belady) until `nbytes` fit, only units used later than `dist`; False if they cannot fit now."""
        while self._used + nbytes > self._room():
            if self._evict_orphan():  # a file no dataset here uses: first to go
                continue
            victim, far, victim_in_flight = None, -2.0, True
            for k in self._ready:
                if self._pins.get(k):
                    continue
                d, in_flight = self._next_use(k)
                # units of batches in flight go last, and only for a worker waiting now (dist < 0)
                if (in_flight, -d) < (victim_in_flight, -far):
                    victim, far, victim_in_flight = k, d, in_flight
            if victim is None or far <= dist or (victim_in_flight and dist >= 0):
                return False
            self._evict(victim)
        return True

    def _evict(self, key: str) -> None:
        self._used -= self._ready.pop(key)
        self._stats["evictions"] += 1
        self._hole()
        try:
            os.unlink(os.path.join(self._dir, key))
        except FileNotFoundError:
            pass

    def _loop(self) -> None:
        with self._cv:
            while True:
                self._ask_again()
                while len(self._fetching) - len(self._asked) < FETCH_PARALLEL:
                    cand = self._candidate()
                    if cand is None:
                        break
                    dist, key = cand
                    nbytes = self._specs[key][4]
                    if nbytes > self._room():
                        self._urgent.pop(key, None)
                        self._failed[key] = (
                            f"a unit of {nbytes} bytes does not fit: cache_limit={self._limit} bytes less the "
                            f"{self._meta} bytes of metadata in {self._dir} (the tar-index/ and file-listing/ "
                            "folders) leaves no room for it. Raise cache_limit, or remove those folders (they are "
                            "made again)."
                        )
                        self._cv.notify_all()
                        continue
                    if not self._make_room(nbytes, dist):
                        break
                    urgent = self._urgent.pop(key, None) is not None
                    self._fetching[key] = nbytes
                    self._used += nbytes
                    self._peak()
                    self._pool.submit(self._fetch, key, self._source(key), urgent)
                self._cv.wait(0.2)
                if self._stopped:
                    return
                now = time.monotonic()
                for sid in [k for k, st in self._streams.items() if now - st.touched > STREAM_IDLE_S]:
                    logger.warning(
                        "raydl cache %s: dropping the plan of a loader silent for %.0f s",
                        self._dir,
                        now - self._streams[sid].touched,
                    )
                    self._streams.pop(sid)
                    self._hole()
                idle = self._idle_exit_s
                if idle is not None and not self._streams and time.monotonic() - self._last_call > idle:
                    logger.info("raydl cache %s: idle for %.0f s, exiting", self._dir, idle)
                    os._exit(0)  # a detached actor nobody uses: its process goes

    def _ask_again(self) -> None:
        """Ask again the owners of the units offered since, or not offered in peer_units.PEER_ASK_S (an owner gone then
        answers with an error); one asked in vain 3 times gives up its reserved bytes until it is asked again
        (two caches each holding room for the other's units cannot wait on each other for long)."""
        now = time.monotonic()
        for key, (when, urgent, asks) in list(self._asked.items()):
            if when > now or len(self._fetching) - len(self._asked) >= FETCH_PARALLEL:
                continue
            del self._asked[key]
            if when > 0 and asks >= 3 and not urgent:
                self._used -= self._fetching.pop(key)
                self._hole()
                continue
            self._pool.submit(self._fetch, key, self._source(key), urgent, asks)

    def _fetch(self, key: str, source: Optional[tuple] = None, urgent: bool = False, asks: int = 0) -> None:
        token, path, size, segs, nbytes = self._specs[key]
        fs = self._fs[token]
        error = None
        started_wall_s, fetched = time.time(), False
        raw = None
        if source is not None and not intact(self._dir, key, nbytes):
            try:
                raw = self._from_peer(key, source, urgent, asks)
                if raw is None:  # offered later (its room stays reserved, no thread waits)
                    return
            except Exception as e:
                logger.info("raydl cache %s: %s from storage: %s", self._dir, key, e)
                with self._cv:
                    self._stats["peer_fallbacks"] += 1
                    if is_gone(e):
                        self._dead_peers.add(ident(source[1]))
        try:
            if raw is not None:
                write_whole(self._dir, key, [raw])
                with self._cv:
                    self._stats["bytes_from_peers"] += nbytes - UNIT_TRAILER_BYTES
                    self._stats["peer_fetches"] += 1
            elif not intact(self._dir, key, nbytes):  # another loader sharing the folder may have written it

                def on_retry(e: BaseException) -> None:
                    with self._cv:
                        self._stats["retries"] += 1

                def read() -> list:
                    if isinstance(path, tuple):  # several whole objects (FileDataset): one GET each, in parallel
                        return read_objects(fs, path)
                    return self._open_files.read_segments(fs, path, segs, size)  # NOTE [ raydl open storage files ]

                parts = with_retries(read, f"reading {path}", on_retry)
                got, want = sum(len(p) for p in parts), nbytes - UNIT_TRAILER_BYTES
                if got != want:
                    raise OSError(f"{path} is truncated: read {got} of {want} bytes of its column chunks")
                write_whole(self._dir, key, [*parts, seal(parts)])
                fetched = True
                with self._cv:
                    self._stats["bytes_fetched"] += nbytes - UNIT_TRAILER_BYTES
                    self._stats["fetches"] += 1
            else:
                with self._cv:
                    self._stats["adopted"] += 1
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        with self._cv:
            if fetched or error is not None:
                self._fetch_spans.append((started_wall_s, time.time(), key, nbytes - UNIT_TRAILER_BYTES, error))
            self._fetching.pop(key, None)
            self._offered.discard(key)
            waiting = self._wanted.pop(key, ())
            if error is None:
                self._ready[key] = nbytes
            else:
                self._used -= nbytes
                self._failed[key] = error
                self._stats["failures"] += 1
                self._hole()
            self._cv.notify_all()
            peers = [self._peers[n] for n in waiting if n in self._peers]
        for peer in peers:  # they ask again now (and hear of a failure then)
            try:
                peer.offer.remote(key=key)
            except Exception:  # a peer gone: it asks nobody any more
                pass


# ---------------------------------------------------------------------- handles
