"""multiprocessing synchronisation objects in a dataset: found before shipping, named, and explained.

NOTE [ raydl multiprocessing objects ]
A `multiprocessing` Value, Array, Lock, RLock, Semaphore, Event, Condition, Barrier or queue (and
torch.multiprocessing's, the same classes) lives in memory or OS handles that only processes
forked or spawned from its creator inherit. torch's worker processes are such children, so a
dataset may hold one; raydl's workers are processes started by Ray, possibly on other machines,
so it cannot work there. Pickling most of them fails deep inside multiprocessing
("Lock objects should only be shared between processes through inheritance"); worse, a Manager
proxy or a Pipe connection pickles without error and only fails in the worker (authentication
refused, or a file descriptor that means nothing there). raydl therefore pickles the payload
with `dumps_checked`, a cloudpickle pickler that stops at the first such object, and
`_payload.find_unpicklable` names the attribute that holds it; the error gives the fix: a Ray
actor as the shared state (a counter actor whose handle the dataset keeps), or per-worker state
made in `worker_init_fn`. `mp_kind` only inspects types (never calls into the object), so a
proxy is never contacted.
"""

from __future__ import annotations

import ctypes
import io
from typing import Any, Optional

__all__ = ["mp_kind", "dumps_checked", "MultiprocessingObjectError", "mp_object_message"]


class MultiprocessingObjectError(TypeError):
    """Raised while pickling when a multiprocessing synchronisation object is met."""

    def __init__(self, obj: Any, kind: str) -> None:
        super().__init__(f"{kind} cannot be sent to processes started by Ray")
        self.obj = obj
        self.kind = kind


def _classes() -> list[tuple[tuple[type, ...], str]]:
    import multiprocessing.connection as connection
    import multiprocessing.managers as managers
    import multiprocessing.pool as pool
    import multiprocessing.queues as queues
    import multiprocessing.sharedctypes as sharedctypes
    import multiprocessing.synchronize as synchronize

    return [
        ((sharedctypes.SynchronizedArray,), "multiprocessing Array"),
        ((sharedctypes.SynchronizedBase,), "multiprocessing Value"),
        ((synchronize.BoundedSemaphore,), "multiprocessing BoundedSemaphore"),
        ((synchronize.Semaphore,), "multiprocessing Semaphore"),
        ((synchronize.RLock,), "multiprocessing RLock"),
        ((synchronize.Lock,), "multiprocessing Lock"),
        ((synchronize.SemLock,), "multiprocessing semaphore"),
        ((synchronize.Event,), "multiprocessing Event"),
        ((synchronize.Barrier,), "multiprocessing Barrier"),
        ((synchronize.Condition,), "multiprocessing Condition"),
        ((queues.JoinableQueue,), "multiprocessing JoinableQueue"),
        ((queues.Queue,), "multiprocessing Queue"),
        ((queues.SimpleQueue,), "multiprocessing SimpleQueue"),
        ((connection.Connection,), "multiprocessing Pipe connection"),
        ((managers.BaseProxy,), "multiprocessing Manager proxy"),
        ((managers.BaseManager,), "multiprocessing Manager"),
        ((pool.Pool,), "multiprocessing Pool"),
    ]


_CLASSES: Optional[list[tuple[tuple[type, ...], str]]] = None
_CTYPES = (ctypes._SimpleCData, ctypes.Array, ctypes.Structure)


# kind by exact type, filled as types are met: pickling calls mp_kind on every object
_KIND_BY_TYPE: dict[type, Optional[str]] = {}


def _kind_of_type(cls: type) -> Optional[str]:
    global _CLASSES
    if _CLASSES is None:
        _CLASSES = _classes()
    for classes, kind in _CLASSES:
        if issubclass(cls, classes):
            return f"{kind} ({cls.__name__})" if kind == "multiprocessing Manager proxy" else kind
    return None


def mp_kind(obj: Any) -> Optional[str]:
    """What kind of multiprocessing object `obj` is ("multiprocessing Lock", ...), or None for anything else."""
    cls = type(obj)
    try:
        kind = _KIND_BY_TYPE[cls]
    except KeyError:
        kind = _KIND_BY_TYPE[cls] = _kind_of_type(cls)
    except TypeError:  # an unhashable metaclass instance
        kind = _kind_of_type(cls)
    if kind is not None:
        return kind
    if isinstance(obj, _CTYPES):
        import multiprocessing.heap as heap

        # RawValue / RawArray: ctypes objects placed in multiprocessing's shared heap
        if isinstance(obj.__dict__.get("_wrapper") if hasattr(obj, "__dict__") else None, heap.BufferWrapper):
            return "multiprocessing RawArray" if isinstance(obj, ctypes.Array) else "multiprocessing RawValue"
    return None


def dumps_checked(obj: Any, buffer_callback: Any = None) -> bytes:
    """`cloudpickle.dumps(obj)` that raises MultiprocessingObjectError at the first multiprocessing object inside."""
    from ray import cloudpickle

    global _PICKLER
    if _PICKLER is None:

        class _CheckingPickler(cloudpickle.Pickler):
            def reducer_override(self, o: Any) -> Any:
                kind = mp_kind(o)
                if kind is not None:
                    raise MultiprocessingObjectError(o, kind)
                return super().reducer_override(o)

        _PICKLER = _CheckingPickler
    with io.BytesIO() as file:
        _PICKLER(file, protocol=cloudpickle.DEFAULT_PROTOCOL, buffer_callback=buffer_callback).dump(obj)
        return file.getvalue()


_PICKLER: Any = None


def mp_object_message(field: str, path: str, kind: str, inside: bool = False) -> str:
    """The error for a multiprocessing object at `path` of `field` (or somewhere `inside` it): what is wrong, the fix."""
    where = f"{path} holds a {kind} (in a closure or global it uses)" if inside else f"{path} is a {kind}"
    return (
        f"raydl cannot send {field} to its Ray workers: {where}. Such objects can only be "
        "shared with processes forked or spawned from this one (torch's worker processes); raydl's "
        "workers are processes started by Ray, possibly on other machines. Fix: keep shared state in "
        "a Ray actor (e.g. a counter actor whose handle the dataset holds), or make per-worker state "
        "in worker_init_fn (or lazily on first use in the worker)."
    )
