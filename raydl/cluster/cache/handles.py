"""The node cache actors: one per node and folder, found by name, started there, told a dataset, ended when idle.

NOTE [ raydl node cache ] in cluster/cache/node_actor.py says what a cache does; this module holds the handles a
process keeps to them (per Ray session), starts one on a node when none runs, registers a dataset with
it once, and ends those no loader streams through (`raydl.release_node_caches()`).
"""

from __future__ import annotations

import hashlib
import threading
from typing import Any, Optional

from .node_actor import IDLE_EXIT_S, READ_TIMEOUT_S, NodeCache

__all__ = ["node_cache", "release_node_caches"]

_handles: dict[str, Any] = {}
_registered: set = set()
_handles_lock = threading.Lock()


def _name(node_id: str, cache_dir: str) -> str:
    return f"raydl-cache-{node_id[:16]}-{hashlib.sha1(cache_dir.encode()).hexdigest()[:10]}"


_REMOTE: list = []  # NodeCache as a Ray actor class, made once per process


def _remote_class() -> Any:
    """`ray.remote(NodeCache)`, made once per process (under `_handles_lock`).

    Every call to a cache actor passes its arguments by keyword: a handle found by name
    (`get_if_exists`) can come with its methods' signatures reduced to `**kwargs` (Ray issue
    #26283, seen here as "too many positional arguments" in the suite), which keywords satisfy."""
    import ray

    if not _REMOTE:
        _REMOTE.append(ray.remote(NodeCache))
    return _REMOTE[0]


def node_cache(cache_dir: str, limit_bytes: int, node_id: Optional[str] = None, fresh: bool = False) -> Any:
    """The cache actor of this (or `node_id`'s) node for `cache_dir`: found by name, else started there."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from ..connect import ray_session

    node_id = node_id or ray.get_runtime_context().get_node_id()
    name = _name(node_id, cache_dir)
    with _handles_lock:
        session = ray_session()
        if fresh or _handles.get(name, (None, None))[0] != session:  # handles die with their Ray session
            _handles.pop(name, None)
            _registered.difference_update({r for r in _registered if r[0] == name})
        h = _handles.get(name, (None, None))[1]
        if h is None:
            h = (
                _remote_class()
                .options(
                    name=name,
                    namespace="raydl",
                    get_if_exists=True,
                    lifetime="detached",
                    num_cpus=0,
                    max_concurrency=64,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
                )
                .remote(cache_dir=cache_dir, limit_bytes=limit_bytes, idle_exit_s=IDLE_EXIT_S)
            )
            _handles[name] = (session, h)
        return h


def _ensure_registered(actor: Any, dataset: Any, name: str) -> None:
    import ray

    if (name, dataset.token) not in _registered:
        ray.get(
            actor.register.remote(token=dataset.token, fs=dataset.filesystem, units=dataset.raydl_cache_units()),
            timeout=READ_TIMEOUT_S,
        )
        _registered.add((name, dataset.token))


def release_node_caches() -> int:
    """End the node cache actors of `raydl.ParquetDataset`s that no loader is streaming through now, on every
    node of the connected Ray cluster; returns how many ended.

    Their files stay in their folders (a later cache adopts the intact ones). Caches also end by
    themselves after RAYDL_CACHE_IDLE_S seconds unused (default 900). Does nothing when this process
    is not connected to Ray (NOTE [ raydl no Ray behind the user's back ] in cluster/connect.py).
    """
    import ray

    from ..connect import ray_session

    if ray_session() is None:
        return 0
    ended = 0
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["namespace"] != "raydl" or not entry["name"].startswith("raydl-cache-"):
            continue
        try:
            actor = ray.get_actor(entry["name"], namespace="raydl")
            if ray.get(actor.in_use.remote(), timeout=10):
                continue
            ray.kill(actor, no_restart=True)
            ended += 1
        except Exception:  # gone meanwhile, or not answering: left to its idle exit
            continue
    with _handles_lock:
        _handles.clear()
        _registered.clear()
    return ended
