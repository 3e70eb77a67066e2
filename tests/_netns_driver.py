"""What the namespace cluster's scenario drivers share (tests/_netns_main.py, _netns_cache_main.py,
_netns_job_main.py): the cluster they run on, found from RAYDL_NETNS_STATE, and their `main()`.

`python -m tests._netns_<x>_main SCENARIO` (tests/_netns.py's `run_driver`) runs one scenario function on a dict of
facts and prints them as one `FACTS {json}` line, which tests/_session.py's `read_facts` reads. A driver that joins
Ray starts its facts with where it runs and the nodes alive, and leaves Ray (idle workers released first) however
its scenario ends.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Callable, Mapping

from tests._netns import netns


def state_cluster():
    """The running cluster this driver was started on (`RAYDL_NETNS_STATE`: its state folder, /tmp/rdl-<tag>)."""
    root = os.environ["RAYDL_NETNS_STATE"]
    return netns.from_state(os.path.basename(root)[len(netns.PREFIX) :])


def wait_alive(n: int, timeout_s: float = 120) -> int:
    """Nodes Ray counts alive once `n` are, or at `timeout_s`."""
    import ray

    deadline = time.monotonic() + timeout_s
    alive = 0
    while time.monotonic() < deadline:
        alive = sum(node["Alive"] for node in ray.nodes())
        if alive >= n:
            break
        time.sleep(0.5)
    return alive


def print_facts(facts: dict) -> None:
    print("FACTS " + json.dumps(facts))
    sys.stdout.flush()


def main(scenarios: Mapping[str, Callable[[dict], None]], join_ray: bool = True) -> None:
    """Run the scenario named by `sys.argv[1]` and print its facts. `join_ray`: join the cluster first (RAY_ADDRESS,
    the token and, with TLS, the head's certificate come from the environment); the facts then start with the
    driver's address (`driver_ip`), the nodes alive (`alive`, waited for) and their addresses (`node_ips`)."""
    scenario = scenarios[sys.argv[1]]
    if not join_ray:
        facts: dict = {}
        scenario(facts)
        print_facts(facts)
        return
    import ray

    import raydl

    ray.init()
    cluster = state_cluster()
    facts = {"driver_ip": ray.util.get_node_ip_address(), "alive": wait_alive(len(cluster.nodes))}
    facts["node_ips"] = sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"])
    try:
        scenario(facts)
    finally:
        raydl.release_idle_workers()
        ray.shutdown()
    print_facts(facts)
