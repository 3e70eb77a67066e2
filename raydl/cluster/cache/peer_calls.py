"""Calls between node caches (NOTE [ raydl cooperative caches ] in peer_units.py): who this cache is, a peer's
call awaited within a bound, and whether a failed call means the peer is gone. Plain objects stand in for actors in
tests: a call's result that is no ObjectRef is taken as it is."""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["this_node", "this_actor", "call", "call_all", "ident", "is_gone"]


def this_node() -> Optional[str]:
    """This process's Ray node id, None outside Ray."""
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except Exception:
        return None


def this_actor() -> Any:
    """This actor's own handle (what a peer offers units to), None outside an actor."""
    try:
        import ray

        return ray.get_runtime_context().current_actor if ray.is_initialized() else None
    except Exception:
        return None


def call_all(method: Any, timeout_s: float, calls: list) -> list:
    """`method.remote(**kwargs)`'s results for each kwargs of `calls`, all sent before any is awaited."""
    if not calls:
        return []
    import ray

    outs = [method.remote(**kwargs) for kwargs in calls]
    return ray.get(outs, timeout=timeout_s) if isinstance(outs[0], ray.ObjectRef) else outs


def call(method: Any, timeout_s: float, **kwargs: Any) -> Any:
    """`method.remote(**kwargs)`'s result: a peer cache actor's call, or a plain object's (tests)."""
    out = method.remote(**kwargs)
    import ray

    return ray.get(out, timeout=timeout_s) if isinstance(out, ray.ObjectRef) else out


def ident(handle: Any) -> Any:
    """What names a peer cache: its Ray actor id (handles passed in calls are new objects each time)."""
    return getattr(handle, "_actor_id", None) or id(handle)


def is_gone(e: BaseException) -> bool:
    """Whether a peer's call failed because its actor is gone (or does not answer)."""
    try:
        from ray.exceptions import GetTimeoutError, RayActorError

        return isinstance(e, (RayActorError, GetTimeoutError))
    except ImportError:
        return False
