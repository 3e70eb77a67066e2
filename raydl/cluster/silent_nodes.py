"""Nodes that went silent: kept out of placement until Ray shows them alive again (NOTE [ raydl silent node ]).

NOTE [ raydl silent node ]
A node can vanish without a word (a frozen VM, a dead switch port, a partition): no RST, no FIN, and Ray declares
it dead only after its health checks give up (a minute with the defaults). The driver hears of it first:
  * over a lane: a worker on another node sends at least every LANE_HEARTBEAT_S, so a lane on which the kernel has
    received nothing for `ray_silence_timeout_s` (TCP_INFO's time since the last data, TLS lanes too) is silent;
  * over Ray's calls (`ray_lane=False`, a `ray_job`'s ranks, a call sent before its worker's lane opened): once
    the driver has heard nothing from a worker it waits on for `ray_silence_timeout_s`, it opens one TCP
    connection to the node's raylet port (`reach_raylet`); no answer within RAYLET_PROBE_S is silence. The kernel
    answers for a listening raylet however busy it is, so a slow batch on a live node is never taken for it.
The lane is closed (a late reply can never be read from it), or the Ray call dropped, its worker is recovered as a
dead one (NOTE [ raydl recovery ]) with the iterator's other workers on that node (their replacements start
together), and the node is marked here, process-wide:
  * raydl's placement leaves the node out of its candidates (NOTE [ raydl placement ]), so no replacement lands on
    a node that cannot answer; placement by the user's own hints is Ray's business and is not changed;
  * a probe (a zero-CPU task pinned to the node) is sent when it is marked; the node is a candidate again once the
    probe has run there (Ray reached it: its link is back), never earlier. A node Ray declares dead fails the probe
    and stays marked (a dead node's id never returns).
A node whose raylet is gone (every process killed: connections reset, but Ray lists the node alive until its
health checks give up) is marked the same way when one of its workers dies and a TCP connection to its raylet's
port is refused (`raylet_refuses`, asked once per death): else the replacement went to the dead node and died.
A false alarm (a worker holding the GIL in native code past the timeout, a link stalled longer) costs one worker
replaced: the timeout is the knob between that and the stall of a real silence. A Ray Client driver (no lanes)
need not reach a raylet's port itself: its probe is one connection opened by a zero-CPU task on another node, the
head's first (`reach_raylet_from_cluster`); no answer from that task in time is no verdict, asked again later.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Optional

from .._constants import CLUSTER_PROBE_SLACK_S

__all__ = [
    "mark_silent",
    "is_silent",
    "silent_nodes",
    "raylet_refuses",
    "reach_raylet",
    "reach_raylet_from_cluster",
    "verdict_from_cluster",
]

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_probes: dict[str, Any] = {}  # node id -> the ObjectRef of its probe (None where none could be sent)


def _probe_fn() -> Any:
    import ray

    @ray.remote(num_cpus=0, max_retries=0)
    def raydl_node_probe() -> bool:
        return True

    return raydl_node_probe


_HEAD_RESOURCE = "node:__internal_head__"  # the resource only the head node has (Ray 2.x)


def _verdict_fn() -> Any:
    import ray

    @ray.remote(num_cpus=0, max_retries=0)
    def raydl_raylet_probe(address: tuple, timeout_s: float) -> str:
        return connect_verdict(address, timeout_s)

    return raydl_raylet_probe


def mark_silent(node_id: str, why: str = "nothing on a lane for ray_silence_timeout_s") -> None:
    """A lane to `node_id` went silent (or its raylet refuses): keep it out of placement until a probe runs there."""
    with _lock:
        if node_id in _probes:
            return
        probe = None
        try:
            bytes.fromhex(node_id)  # (a node id Ray could not parse is not probed: it stays marked)
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # hard, as Placement.strategy

            strategy = NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
            probe = _probe_fn().options(scheduling_strategy=strategy).remote()
        except Exception as e:  # noqa: BLE001 - no probe: the node stays out until this process ends
            logger.debug("raydl: no probe for silent node %s (%s)", node_id, e)
        _probes[node_id] = probe
    logger.warning(
        "raydl: node %s went silent (%s): no worker is placed there until Ray reaches it again", node_id[:8], why
    )


def raylet_refuses(node_id: str, timeout_s: float = 1.0) -> bool:
    """Whether a TCP connection to `node_id`'s raylet (its address and port as Ray lists them) is refused: its
    raylet process is gone. False when it answers, when the connection times out, or when Ray does not say."""
    return reach_raylet(node_id, timeout_s) == "refused"


def reach_raylet(node_id: str, timeout_s: float) -> str:
    """One TCP connection to `node_id`'s raylet port: "answers", "refused" (its raylet is gone), "timeout" (nothing
    came back: the node or its link is silent) or "unknown" (Ray does not list the node as alive, or another error).
    The kernel answers a connection for a listening process however busy the process is, so a busy raylet still
    answers; a SIGSTOPped worker process on a live node does too."""
    address = raylet_address(node_id)
    return "unknown" if address is None else connect_verdict(address, timeout_s)


def raylet_address(node_id: str) -> Optional[tuple]:
    """(host, port) of `node_id`'s raylet as Ray lists it; None if Ray does not list the node as alive."""
    import ray

    try:
        row = next(n for n in ray.nodes() if n.get("NodeID") == node_id and n.get("Alive"))
        return (row["NodeManagerAddress"], int(row["NodeManagerPort"]))
    except (StopIteration, KeyError, TypeError, ValueError, Exception):  # noqa: BLE001 - unknown: no verdict
        return None


def reach_raylet_from_cluster(node_id: str, timeout_s: float) -> str:
    """`reach_raylet`'s verdict for a Ray Client driver: the connection is opened by a zero-CPU task on another node
    of the cluster (the head's first, where Ray Client's server runs), since the client itself may sit outside the
    cluster's network. "unknown" when no other node is alive or the task gives no answer in time."""
    address = raylet_address(node_id)
    return "unknown" if address is None else verdict_from_cluster(address, timeout_s, avoid=node_id)


def verdict_from_cluster(address: tuple, timeout_s: float, avoid: Optional[str] = None) -> str:
    """`connect_verdict(address, timeout_s)` run by a task on an alive node other than `avoid` (the head's first)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    try:
        others = [n for n in ray.nodes() if n.get("Alive") and n.get("NodeID") != avoid]
        if not others:
            return "unknown"
        asker = next((n for n in others if _HEAD_RESOURCE in n.get("Resources", {})), others[0])
        strategy = NodeAffinitySchedulingStrategy(node_id=asker["NodeID"], soft=False)
        ref = _verdict_fn().options(scheduling_strategy=strategy).remote(tuple(address), timeout_s)
    except Exception:  # noqa: BLE001 - Ray could not send it: no verdict
        return "unknown"
    try:
        return ray.get(ref, timeout=timeout_s + CLUSTER_PROBE_SLACK_S)
    except Exception:  # noqa: BLE001 - a slow or lost task: no verdict (asked again one timeout later)
        return "unknown"


def connect_verdict(address: tuple, timeout_s: float) -> str:
    """`reach_raylet`'s verdict for one TCP connection to `address` (host, port)."""
    import socket

    try:
        socket.create_connection(address, timeout=timeout_s).close()
    except ConnectionRefusedError:
        return "refused"
    except TimeoutError:  # socket.timeout: no answer at all
        return "timeout"
    except OSError:
        return "unknown"
    return "answers"


def is_silent(node_id: Any) -> bool:
    """Whether `node_id` is marked silent and has not answered its probe yet."""
    if node_id is None or node_id not in _probes:
        return False
    _look()
    return node_id in _probes


def silent_nodes() -> list[str]:
    """The nodes marked silent now (their probes looked at)."""
    _look()
    with _lock:
        return sorted(_probes)


def _look() -> None:
    """Lift the mark of every node whose probe has run (Ray reached it again)."""
    import ray

    with _lock:
        pending = {ref: node for node, ref in _probes.items() if ref is not None}
        if not pending:
            return
        try:
            done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=0, fetch_local=False)
        except Exception:  # noqa: BLE001 - Ray shut down: nothing is placed anyway
            return
        for ref in done:
            try:
                ray.get(ref, timeout=0)
            except Exception:  # noqa: BLE001 - the node died (or the probe could not run): it stays out
                _probes[pending[ref]] = None
                continue
            node = pending[ref]
            del _probes[node]
            logger.info("raydl: node %s answers again: it may host workers", node[:8])


def _forget_all() -> None:
    """Tests and a new Ray session: no node is marked."""
    with _lock:
        _probes.clear()
