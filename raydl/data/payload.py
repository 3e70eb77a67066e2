"""Ship the dataset, collate_fn and worker_init_fn to the object store once, or say what cannot be pickled."""

from __future__ import annotations

import sys
from typing import Any

from ..worker.actor import WorkerPayload
from .mp_objects import MultiprocessingObjectError, dumps_checked, mp_kind, mp_object_message

__all__ = ["put_payload", "find_unpicklable"]

_MAX_DEPTH = 3


def _pickle_error(obj: Any) -> Exception | None:
    try:
        dumps_checked(obj)  # a multiprocessing object fails here even where pickle would accept it
    except Exception as e:  # pickling raises many types: TypeError, PicklingError, AttributeError...
        return e
    return None


def _children(obj: Any) -> list[tuple[str, Any]]:
    if isinstance(obj, dict):
        return [(f"[{k!r}]", v) for k, v in obj.items()]
    if isinstance(obj, (list, tuple)):
        return [(f"[{i}]", v) for i, v in enumerate(obj)]
    state = getattr(obj, "__dict__", None)
    if isinstance(state, dict):
        return [(f".{k}", v) for k, v in state.items()]
    return []


def find_unpicklable(obj: Any, name: str, depth: int = 0) -> tuple[str, Any, Exception] | None:
    """The deepest attribute path under `obj` that fails to pickle, with the object and its error."""
    err = _pickle_error(obj)
    if err is None:
        return None
    if depth < _MAX_DEPTH and mp_kind(obj) is None:  # a multiprocessing object is the culprit itself
        for suffix, child in _children(obj):
            found = find_unpicklable(child, name + suffix, depth + 1)
            if found is not None:
                return found
    return name, obj, err


def put_payload(payload: WorkerPayload, share_memory: bool = False) -> Any:
    """Put the payload into the object store once; an unpicklable part raises a TypeError naming it.

    By default the payload travels as pickled bytes, so each worker unpickles a private,
    writable copy, exactly as torch's worker processes get one. With `share_memory`, its buffers
    travel out of band: NumPy arrays and pyarrow data inside are then mapped read-only from the
    object store, shared by every worker of a node instead of copied (less memory; writes to
    them fail). `raydl.ArrowDataset` and Hugging Face `datasets` tables are shared either way
    (NOTE [ raydl shared memory ] in data/share.py).
    """
    import ray
    from ray import cloudpickle

    from .share import pack

    # A script relaunched by multiprocessing's spawn (Lightning's ddp_spawn) runs as
    # `__mp_main__`, a module no Ray worker can import: ship its classes by value, as cloudpickle
    # already does for `__main__`.
    main = sys.modules.get("__mp_main__")
    if main is not None and sys.modules.get("__main__") is main:
        cloudpickle.register_pickle_by_value(main)
    try:
        return ray.put(pack(payload, share_memory))  # NOTE [ raydl multiprocessing objects ] checked there
    except Exception as put_error:
        # Only now pay for a second pickling pass, to name the culprit.
        for field in ("dataset", "collate_fn", "worker_init_fn"):
            found = find_unpicklable(getattr(payload, field), field)
            if found is not None:
                path, obj, err = found
                kind = mp_kind(obj)
                if kind is not None or isinstance(err, MultiprocessingObjectError):
                    inside = kind is None
                    raise TypeError(mp_object_message(field, path, kind or err.kind, inside)) from None
                raise TypeError(
                    f"raydl cannot send {field} to its Ray workers: {path} (a {type(obj).__name__}) "
                    f"cannot be pickled: {err}. Fix: create it inside the worker instead (lazily on "
                    "first use, or in worker_init_fn), or drop it from the object before iterating."
                ) from None
        raise TypeError(f"raydl cannot send the dataset to its Ray workers: {put_error}") from put_error
