"""Whether every worker of a loader must run on the driver's own node, and torch's worker-count warning.

NOTE [ raydl worker-count warning ]
torch warns ("This DataLoader will create N worker processes in total. Our suggested max number
of worker in current system is M ...") when `num_workers` exceeds the CPUs this process may use,
once when the loader is built and once when an iterator is created. raydl gives the same
warning, with torch's own text and numbers (it calls torch's public
`DataLoader.check_worker_number_rationality`), exactly when its workers share this host's CPUs:
every alive node that could host a worker is the driver's node. That is the case with
  * the local Ray raydl starts itself, or any single-node Ray;
  * `ray_remote_args` pinning workers here: a `NodeAffinitySchedulingStrategy` naming the
    driver's node, or resources, `memory` or a `label_selector` only the driver's node has.
It stays silent when workers can go to other nodes (two or more candidate nodes), with Ray
Client (the "driver" then runs on the cluster, not on this host), and with a placement group
strategy (where its bundles go is Ray's decision). When it is given:
  * at construction, only when the answer needs no Ray call that could start anything: Ray is
    already connected (its node table is read), or nothing is connected and no address is set,
    so the first iteration will start a local Ray on this host;
  * at iterator creation (once per persistent loader, as torch), after Ray is connected.
The check runs only when `num_workers` exceeds this host's usable CPUs, so the common case costs
nothing.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Mapping, Optional

from .connect import resource_request

__all__ = ["workers_confined_to_driver_node", "confined_nodes", "warn_if_workers_oversubscribe", "local_start_expected"]


def _usable_cpus() -> Optional[int]:
    """CPUs this process may run on (affinity where the OS has it), as torch counts them."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count()


def _label_matches(value: Optional[str], condition: str) -> bool:
    """One `label_selector` condition ("v", "!v", "in(a,b)", "!in(a,b)") against a node's label value."""
    cond = condition.strip()
    negate = cond.startswith("!")
    if negate:
        cond = cond[1:].strip()
    if cond.startswith("in(") and cond.endswith(")"):
        allowed = {v.strip() for v in cond[3:-1].split(",")}
    else:
        allowed = {cond}
    hit = value is not None and value in allowed
    return not hit if negate else hit


def _pinned_node_id(strategy: Any) -> Optional[str]:
    """The node a NodeAffinitySchedulingStrategy names (soft or not: Ray uses it whenever it is alive and fits)."""
    node_id = getattr(strategy, "node_id", None)
    if type(strategy).__name__ == "NodeAffinitySchedulingStrategy" and isinstance(node_id, str):
        return node_id
    return None


def confined_nodes(nodes: list[Mapping[str, Any]], options: Mapping[str, Any]) -> Optional[set[str]]:
    """Ids of the alive nodes of `nodes` (ray.nodes() rows) that could host one worker with `options`.

    None when raydl cannot tell (a placement group strategy decides).
    """
    strategy = options.get("scheduling_strategy")
    if type(strategy).__name__ == "PlacementGroupSchedulingStrategy":
        return None
    request = resource_request(options)
    selector = options.get("label_selector") or {}
    pinned = _pinned_node_id(strategy)
    ids = set()
    for node in nodes:
        if not node.get("Alive"):
            continue
        resources = node.get("Resources") or {}
        if not all(resources.get(name, 0.0) >= amount for name, amount in request.items()):
            continue
        labels = node.get("Labels") or {}
        if not all(_label_matches(labels.get(k), str(c)) for k, c in selector.items()):
            continue
        if pinned is not None and node.get("NodeID") != pinned:
            continue
        ids.add(node.get("NodeID"))
    return ids


def workers_confined_to_driver_node(options: Mapping[str, Any]) -> bool:
    """Whether Ray (connected) can place the workers only on the driver's node; see NOTE [ raydl worker-count warning ]."""
    import ray

    if ray.util.client.ray.is_connected():
        return False
    driver = ray.get_runtime_context().get_node_id()
    ids = confined_nodes(ray.nodes(), options)
    # no candidate at all: placement will fail with its own error; nothing to say about CPUs here
    return bool(ids) and ids <= {driver}


def _ray_connected() -> bool:
    ray = sys.modules.get("ray")  # construction must not import (let alone start) Ray just to decide
    return ray is not None and ray.is_initialized()


def local_start_expected(address: Optional[str]) -> bool:
    """Whether a first iteration now would start a local Ray on this host (nothing connected, no address set)."""
    return not _ray_connected() and address is None and not os.environ.get("RAY_ADDRESS")


def warn_if_workers_oversubscribe(loader: Any, options: Mapping[str, Any], at_construction: bool = False) -> None:
    """torch's worker-count warning, with torch's text, when every worker runs on this host and there are too many.

    `loader` is a torch DataLoader (raydl's or a patched torch one); `options` are the worker
    actor options. At construction nothing is started (see NOTE [ raydl worker-count warning ]).
    """
    from torch.utils.data import DataLoader as TorchDataLoader

    num_workers = loader.num_workers
    usable = _usable_cpus()
    if not num_workers or (usable is not None and num_workers <= usable):
        return
    if at_construction and local_start_expected(getattr(loader, "ray_address", None)):
        confined = True
    elif at_construction and not _ray_connected():
        confined = False  # an address is set: where it leads is known only once connected
    else:
        confined = workers_confined_to_driver_node(options)
    if confined:
        TorchDataLoader.check_worker_number_rationality(loader)
