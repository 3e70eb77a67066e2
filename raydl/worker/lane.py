"""A worker's end of a lane: the driver's calls over a local socket instead of one Ray actor call each.

NOTE [ raydl lane ]
Ray's per-call cost on the driver's core (submitting the actor call, then the `get` of its
returns: ~450 us a call on a 2-core machine, ~250 us a batch at 2 batches a call) is most of what
a batch costs the trainer at the overhead floor. So by default (`ray_lane=True`) a worker on the
driver's node whose batches are small (LANE_MAX_BATCH_BYTES: its first batch tells) is sent its
calls over a Unix socket the driver opened for it (abstract namespace, never a file; the worker
proves itself with a random token the driver gave it through Ray):
  * the driver writes each call's tasks (`[(idx, work), ...]`, pickled) to the socket and reads
    the call's `(batches, metas)` back in the order it wrote the calls: one socket per worker, so
    replies come in call order;
  * in the worker, a daemon thread reads the calls and makes them with the same `fetch_many` a Ray
    call runs, under the actor's lock (one fetch at a time, as with Ray's one-call-at-a-time
    actor); it stops at the socket's end, or when the actor is given another loader (`reset` /
    `configure` bump the actor's generation: calls still queued from the old loader are not made);
  * calls are made in the order the driver sent them, whichever way they went: the lane opens
    while Ray calls sent before it may still wait in the actor's queue, so each lane call carries
    how many Ray calls of this loader the driver had sent to the worker, and waits until the
    worker has made that many (the actor counts them; `reset` starts the count anew);
  * batches travel pickled in the reply (protocol 5, their arrays in band): one copy through the
    kernel, which for the small batches the lane is for costs far less than Ray's call. Only
    workers on the driver's node get a lane; the others keep Ray's calls (and Ray's zero-copy
    object store, NOTE [ raydl zero-copy ]).
The driver's side (driver/lane.py) says when a worker's calls move to its lane and what happens
when the lane breaks (a dead worker: the socket's end, as Ray's actor death).
"""

from __future__ import annotations

import logging
import pickle
import socket
import threading
from multiprocessing.connection import Connection
from typing import Any, Callable

__all__ = ["serve_lane", "dumps_reply", "Turns"]

logger = logging.getLogger(__name__)


def dumps_reply(value: Any) -> bytes:
    """A call's reply for the lane: pickle's protocol 5 (NumPy arrays in band), cloudpickle for what pickle refuses."""
    try:
        return pickle.dumps(value, protocol=5)
    except Exception:  # a batch holding a lambda, a local class...: as Ray would, with cloudpickle
        from ray import cloudpickle  # here, not at import: the driver imports Ray late (NOTE [ raydl node Ray ])

        return cloudpickle.dumps(value, protocol=5)


class Turns:
    """The actor's order of calls: one at a time (the lock), Ray's calls counted, a generation per loader."""

    def __init__(self) -> None:
        self.cond = threading.Condition(threading.Lock())
        self.generation = 0
        self.ray_calls = 0  # Ray calls of this loader made so far

    def new_loader(self) -> None:
        """The actor is given another loader (or none): lanes of the old one stop, the count starts anew."""
        with self.cond:
            self.generation += 1
            self.ray_calls = 0
            self.cond.notify_all()

    def ray_call(self, make: Callable[[], Any]) -> Any:
        """A Ray call's fetch: made under the lock, then counted."""
        with self.cond:
            try:
                return make()
            finally:
                self.ray_calls += 1
                self.cond.notify_all()

    def lane_call(self, born: int, after: int, make: Callable[[], Any]) -> tuple[bool, Any]:
        """A lane call of generation `born`, once `after` Ray calls were made: (False, None) when the actor serves
        another loader now (the lane stops), else (True, its reply)."""
        with self.cond:
            self.cond.wait_for(lambda: self.generation != born or self.ray_calls >= after)
            if self.generation != born:
                return False, None
            return True, make()


def serve_lane(address: str, token: bytes, turns: Turns, make_call: Callable[[int, list], Any]) -> None:
    """Connect to the driver's lane at `address` and, in a daemon thread, make each call it sends with `make_call`
    in its turn (`turns`) while the actor serves this loader. Raises OSError when the driver's lane is not there."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10.0)
    sock.connect(address)
    sock.settimeout(None)
    conn = Connection(sock.detach())
    conn.send_bytes(token)
    born = turns.generation

    def loop() -> None:
        try:
            while True:
                after, epoch, tasks = pickle.loads(conn.recv_bytes())
                go_on, reply = turns.lane_call(born, after, lambda: make_call(epoch, tasks))
                if not go_on:  # the actor serves another loader now: nothing more from this lane
                    return
                conn.send_bytes(dumps_reply(reply))
        except (EOFError, OSError):  # the driver closed the lane (epoch over, loader shut down) or went away
            return
        finally:
            conn.close()

    threading.Thread(target=loop, name="raydl-lane", daemon=True).start()
