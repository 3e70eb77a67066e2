"""A node cache's side of the cooperation between caches: serving the units it owns to its peers, and getting the
units others own from them.

NOTE [ raydl cooperative caches ]
With the window shuffle every node's workers read nearly every unit, so each node fetching its own
would read the data N times at N nodes. The driver's plan gives each unit one owner per epoch (a
node that uses it, the owned bytes balanced: `CacheFeed`), and only the owner fetches it from
storage; its plan holds the unit until the last batch of any node that uses it is handed out. A
node that needs a unit owned elsewhere asks the owner's cache (`serve`): the bytes come back as
they lie in the owner's file (checksum included, checked before they are written here), in chunks
of PEER_CHUNK inside Ray's replies; or "not yet": the owner notes who asked and tells it (`offer`)
when the unit arrives. Meanwhile the unit's room stays reserved here (so the prefetch does not
fill it with later units, to evict them again) but no fetch thread waits: this cache fetches
other units. A unit a worker here waits for is asked for urgently, and the owner fetches it
before its plan's order; one not offered in PEER_ASK_S is asked again (after 3 asks its room is
given back until the next). An owner that is gone, fails, or hands out bytes that fail the
checksum: the unit is read from storage here (counted: `peer_fallbacks`).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable, Optional

from .peer_calls import call, call_all, ident, this_actor
from .unit_file import UNIT_TRAILER_BYTES, unsealed

__all__ = ["PeerUnits"]

PEER_ASK_S = 10.0  # a unit asked of its owner and not offered within this long is asked again
PEER_CALL_S = float(os.environ.get("RAYDL_CACHE_PEER_CALL_S", "60"))  # one transfer from a peer, at most
# A unit comes from a peer in chunks this small: each inside Ray's reply (max_direct_call_object_size, 100 KiB), not
# through the object store, whose transfers of many small objects at once took 1-2 s each on the test machine
PEER_CHUNK = 96 * 1024


class PeerUnits:
    """The peer half of `NodeCache` (node_actor.py), whose state it shares: `_cv` guards it; `_peers`, `_asked`,
    `_offered` and `_wanted` are this half's own (NOTE [ raydl cooperative caches ])."""

    _cv: threading.Condition
    _node: Optional[str]
    _dir: str
    _specs: dict
    _failed: dict
    _ready: dict
    _fetching: dict
    _pins: dict
    _urgent: dict
    _streams: dict
    _stats: dict
    _peers: dict
    _dead_peers: set
    _asked: dict
    _offered: set
    _wanted: dict
    _used: int
    _n: int
    _touch: Callable[[], None]
    _hole: Callable[[], None]

    def serve(self, key: str, node: Optional[str], urgent: bool, reply_to: Any = None, offset: int = 0) -> Any:
        """A peer's ask for a unit this cache owns (NOTE [ raydl cooperative caches ]): (its file's size, trailer
        included, and its bytes from `offset`, at most PEER_CHUNK); None when it is not here yet (`node`, whose
        cache is `reply_to`, is offered it when it arrives, and, `urgent`, it is fetched before the plan's order);
        a message when this cache cannot give it (unknown, its fetch failed, gone since a first chunk)."""
        with self._cv:
            self._touch()
            if node is not None and reply_to is not None:  # it may ask before this cache's plan names it
                self._peers.setdefault(node, reply_to)
            if key not in self._specs:
                return "not registered here"
            if key in self._failed:
                return self._failed[key]
            if key not in self._ready:
                if offset:
                    return "evicted while it was being read"
                if node is not None:
                    self._wanted.setdefault(key, set()).add(node)
                if urgent and key not in self._fetching and key not in self._urgent:
                    self._n += 1
                    self._urgent[key] = self._n
                    self._cv.notify_all()
                return None
            self._pins[key] = self._pins.get(key, 0) + 1
        try:
            with open(os.path.join(self._dir, key), "rb") as f:
                size = os.fstat(f.fileno()).st_size
                f.seek(offset)
                raw = f.read(PEER_CHUNK)
        except OSError:
            raw = None
        with self._cv:
            if self._pins.get(key, 0) > 1:
                self._pins[key] -= 1
            else:
                self._pins.pop(key, None)
            if raw is None:  # gone from the folder (another cache sharing it): forget it, fetch it again
                if key in self._ready and not self._pins.get(key):
                    self._used -= self._ready.pop(key)
                    self._hole()
                return "its file vanished"
            if not offset:
                self._stats["bytes_served"] += size - UNIT_TRAILER_BYTES
        return size, raw

    def offer(self, key: str) -> None:
        """The owner of a unit asked for now has it: ask again (NOTE [ raydl cooperative caches ])."""
        with self._cv:
            if key in self._asked:
                self._asked[key][0] = 0.0  # due now
                self._cv.notify_all()
            elif key in self._fetching:
                self._offered.add(key)

    def _source(self, key: str) -> Optional[tuple[str, Any]]:
        """(node id, cache actor) of the peer to ask for `key`, None: storage (NOTE [ raydl cooperative caches ])."""
        for s in self._streams.values():
            node = s.owners.get(key)
            peer = self._peers.get(node) if node is not None else None
            if peer is not None and ident(peer) not in self._dead_peers:
                return node, peer
        return None

    def _from_peer(self, key: str, source: tuple, urgent: bool, asks: int) -> Optional[bytes]:
        """The unit's sealed bytes from its owner's cache; None when it will offer them later (the key is then
        parked in _asked, its bytes still reserved); raises when the owner cannot give them (gone, failed, bytes
        that fail their checksum)."""
        node, peer = source
        got = call(peer.serve, PEER_CALL_S, key=key, node=self._node, urgent=urgent, reply_to=this_actor())
        if got is None:
            with self._cv:
                when = 0.0 if key in self._offered else time.monotonic() + PEER_ASK_S
                self._offered.discard(key)
                self._asked[key] = [when, urgent, asks + 1]
                self._cv.notify_all()
            return None
        if isinstance(got, str):  # the owner's own fetch failed, or it does not know the unit
            raise OSError(f"the cache of node {node} cannot give it: {got}")
        size, first = got
        # the other chunks at once, each small enough to come back inside Ray's reply (not through the object store)
        rest = call_all(
            peer.serve,
            PEER_CALL_S,
            [dict(key=key, node=None, urgent=False, offset=o) for o in range(len(first), size, PEER_CHUNK)],
        )
        bad = next((r for r in rest if not isinstance(r, tuple)), None)
        if bad is not None:
            raise OSError(f"the cache of node {node} cannot give it: {bad}")
        raw = b"".join([first, *(chunk for _, chunk in rest)])
        if len(raw) != size or unsealed(raw) is None:
            raise OSError(f"the bytes from the cache of node {node} fail their checksum")
        return raw
