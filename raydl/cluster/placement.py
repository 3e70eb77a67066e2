"""Where each worker runs when the user gives no placement hint: raydl's own plan, per worker.

NOTE [ raydl placement ]
Workers reserve no CPU by default (num_cpus=0, like torch's processes), and Ray places such actors
erratically (its SPREAD and default strategies: docs/design-notes.md). So, when `ray_remote_args`
carries no placement hint, raydl decides each worker's node itself:
  * candidates: the alive nodes less silent ones (NOTE [ raydl silent node ]) and the trainers'
    nodes (the driver's, or every rank's of a job pool), whose CPUs train; the trainers' only when
    no other node is alive. Weights: free CPUs where Ray reports them
    (`available_resources_per_node`, a DeveloperAPI), else total CPUs;
  * shares: `num_workers` apportioned by weight (largest remainders; ties to the bigger node, then
    a stable order of address, port, id), worker ids dealt round robin in that order;
  * each worker gets hard `NodeAffinitySchedulingStrategy(node_id, soft=False)`: a soft affinity
    is not held for actors that reserve nothing. Hard affinity cannot strand a worker: the plan
    names only alive nodes, and a node that dies first fails the creation at once, re-planned
    without counting a restart (at most PLACEMENT_RETRIES times);
  * a replacement, or a worker added to a running pool, goes to the alive node furthest below its
    share (`node_for_new_worker`).
Invariant: same cluster, same free CPUs: same plan, whatever loaders came and went before.
A hint wins: resources beyond `num_cpus=0`, a `label_selector` or a `scheduling_strategy` make Ray
place the workers; raydl adds `scheduling_strategy="SPREAD"` when resources or labels come without
a strategy. Warm actors (NOTE [ raydl warm pool ]) are kept under their options plus their node,
so a warm actor is always where the plan wants it. `loader.worker_records` shows where each runs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from .connect import has_placement_hints
from .silent_nodes import is_silent, silent_nodes

__all__ = ["has_placement_hints", "NodeWeight", "apportion", "Placement", "worker_placement"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeWeight:
    """One candidate node: its id, a stable sort key, and its weight (free CPUs, or total CPUs)."""

    node_id: str
    key: tuple
    weight: float


def _ordered(nodes: Sequence[NodeWeight]) -> list[NodeWeight]:
    return sorted(nodes, key=lambda n: n.key)


def apportion(nodes: Sequence[NodeWeight], n: int) -> list[str]:
    """Node id of each of `n` workers: shares proportional to the weights, dealt round robin (NOTE [ raydl placement ])."""
    if n <= 0 or not nodes:
        return []
    order = _ordered(nodes)
    total = sum(max(node.weight, 0.0) for node in order)
    weights = [max(node.weight, 0.0) for node in order] if total > 0 else [1.0] * len(order)
    total = sum(weights)
    quotas = [n * w / total for w in weights]
    counts = [int(q) for q in quotas]
    # Largest remainders first; ties to the bigger node, then to the first in the stable order.
    by_remainder = sorted(range(len(order)), key=lambda i: (-(quotas[i] - counts[i]), -weights[i], i))
    for i in by_remainder[: n - sum(counts)]:
        counts[i] += 1
    plan: list[str] = []
    left = list(counts)
    while len(plan) < n:
        for i, node in enumerate(order):
            if left[i] > 0:
                plan.append(node.node_id)
                left[i] -= 1
    return plan


def _node_key(row: Mapping[str, Any]) -> tuple:
    return (str(row.get("NodeManagerAddress", "")), int(row.get("NodeManagerPort") or 0), str(row.get("NodeID", "")))


def _free_cpus_by_node() -> Optional[dict[str, float]]:
    """Free CPUs of each alive node as Ray reports them, or None where this Ray does not say."""
    try:
        from ray._private.state import available_resources_per_node  # DeveloperAPI, checked against Ray 2.60

        return {node_id: float(res.get("CPU", 0.0)) for node_id, res in available_resources_per_node().items()}
    except Exception:  # another Ray version, Ray Client: fall back to total CPUs
        return None


class Placement:
    """raydl's placement plan for one loader's workers (NOTE [ raydl placement ])."""

    def __init__(self, driver_node_id: str) -> None:
        self.driver_node_id = driver_node_id
        self.trainer_nodes = {
            driver_node_id
        }  # a job's pool: every rank's node it has heard of (NOTE [ raydl job pool ])

    def add_trainer_node(self, node_id: Optional[str]) -> None:
        """Another process that trains runs on `node_id`: its CPUs are busy too, new workers go elsewhere if they can."""
        if node_id:
            self.trainer_nodes.add(node_id)

    def candidates(self, by_total: bool = False) -> list[NodeWeight]:
        """The alive nodes workers may go to now, with their weights (free CPUs, or with `by_total` their CPUs); the
        trainers' nodes only if no other is alive."""
        import ray

        rows = [row for row in ray.nodes() if row.get("Alive")]
        if silent_nodes():  # NOTE [ raydl silent node ]: none placed where a lane went silent
            rows = [row for row in rows if not is_silent(row["NodeID"])]
        others = [row for row in rows if row["NodeID"] not in self.trainer_nodes]
        rows = others or rows
        free = None if by_total else _free_cpus_by_node()
        total = {row["NodeID"]: float((row.get("Resources") or {}).get("CPU", 0.0)) for row in rows}
        weight = dict(total)
        if free is not None and any(free.get(node_id, 0.0) > 0 for node_id in total):
            weight = {node_id: free.get(node_id, cpus) for node_id, cpus in total.items()}
        return [NodeWeight(row["NodeID"], _node_key(row), weight[row["NodeID"]]) for row in rows]

    def plan(self, num_workers: int) -> list[Optional[str]]:
        """The node of each worker id; None for every worker when Ray lists no alive node."""
        nodes = self.candidates()
        plan: list[Optional[str]] = list(apportion(nodes, num_workers)) or [None] * num_workers
        logger.debug("raydl: placement plan %s over %s", plan, nodes)
        return plan

    def node_for_new_worker(self, others: Sequence[Optional[str]]) -> Optional[str]:
        """The node for one more worker, given the nodes of the pool's other workers: the one most below its share."""
        nodes = self.candidates()
        if not nodes:
            return None
        wanted = apportion(nodes, len(others) + 1)
        deficit = {
            node_id: wanted.count(node_id) - sum(o == node_id for o in others) for node_id in dict.fromkeys(wanted)
        }
        best = max(deficit.values())
        # Ties: the first node in the plan's own order.
        return next(node_id for node_id in wanted if deficit[node_id] == best)

    @staticmethod
    def strategy(node_id: str) -> Any:
        """Node affinity to `node_id` (hard: see NOTE [ raydl placement ] for why not soft)."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        return NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)


def worker_placement(options: Mapping[str, Any], driver_node_id: str) -> Optional[Placement]:
    """raydl's plan for workers with these actor options, or None when the user's hints decide (NOTE [ raydl placement ])."""
    if has_placement_hints(options):
        return None
    return Placement(driver_node_id)
