"""Python's global `random`, which every thread shares, kept to the threads that should draw from it.

NOTE [ raydl random and threads ]
The `random` module's functions are methods of one generator shared by every thread of the
process. Two of raydl's paths need draws kept apart:
  * Ray's start, run by `raydl.start()`'s thread (NOTE [ raydl early start ]), draws from it
    (a free port, ids): at moments no one controls it would take draws from the script's stream;
  * a cold start (NOTE [ raydl cold start ]) makes a worker's streams live in the driver while it
    makes that worker's batch: a draw from any other thread then (a Ray thread, the start thread)
    would be taken from the worker's stream, and the batches would differ from torch's (measured:
    they did, before this module).
So once either is used, the `random` module's functions are replaced by routers (for the rest of
the process: swapping them back while other threads call them would race): a call from a
`diverted` thread draws from that thread's own generator; while `only_this_thread_draws` holds,
a call from any other thread (but the fetch threads of `ray_threads_per_worker`, which make the
same batch) draws from a generator of their own; every other call goes to the global generator as
before. A router costs about 0.3 us a call. Code that bound a function before (`from random
import random`) keeps the shared generator. NumPy's and torch's global generators are not
affected: Ray does not draw from them.
"""

from __future__ import annotations

import contextlib
import random
import threading
from typing import Any, Callable, Iterator, Optional

__all__ = ["diverted", "only_this_thread_draws"]

_lock = threading.Lock()
_installed = False
_own: dict[int, random.Random] = {}  # diverted thread ident -> its generator
_exclusive: Optional[int] = None  # while set: the one thread (with its fetch threads) drawing from the global generator
_others = random.Random()  # what the other threads draw from meanwhile
_FETCH_THREADS = "raydl_fetch"  # worker/fetch.py's thread name prefix


def _router(name: str, shared: Callable) -> Callable:
    def call(*args: Any, **kwargs: Any) -> Any:
        me = threading.get_ident()
        own = _own.get(me)
        if own is None and _exclusive is not None and me != _exclusive:
            if not threading.current_thread().name.startswith(_FETCH_THREADS):
                own = _others
        return (shared if own is None else getattr(own, name))(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    call.__doc__ = shared.__doc__
    return call


def _install() -> None:
    global _installed
    with _lock:
        if _installed:
            return
        for name in random.__all__:
            fn = getattr(random, name)
            if getattr(fn, "__self__", None) is random._inst:  # the shared generator's methods
                setattr(random, name, _router(name, fn))
        _installed = True


@contextlib.contextmanager
def diverted() -> Iterator[None]:
    """The calling thread's draws from `random` go to a generator of its own meanwhile."""
    _install()
    me = threading.get_ident()
    _own[me] = random.Random()
    try:
        yield
    finally:
        _own.pop(me, None)


@contextlib.contextmanager
def only_this_thread_draws() -> Iterator[None]:
    """Only the calling thread (and its fetch threads) draws from the global `random` meanwhile."""
    global _exclusive
    _install()
    _exclusive = threading.get_ident()
    try:
        yield
    finally:
        _exclusive = None
