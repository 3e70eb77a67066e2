"""Run by tests/_netns.py in the head's namespace of a namespace cluster (cluster/netns_testbed.py): a driver that
joins it (RAY_ADDRESS, its token and TLS files in the environment) and prints one `FACTS {json}` line.

Scenarios: `plain` (placement over the nodes' addresses, TCP lanes seen on the wire, a node killed mid-epoch: last,
it takes a node away, then the other worker node goes silent) and `tls` (the lanes of a TLS cluster: TLS connections, the marker never on the wire).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import ray
import torch
from torch.utils.data import Dataset

import raydl
from tests import _datasets as D
from tests._netns import netns
from tests._netns_driver import main, state_cluster


class Marked(Dataset):
    """Sample i: `size` bytes of `marker` repeated, and i. Every sample carries the marker many times over."""

    def __init__(self, n: int, marker: bytes, size: int) -> None:
        self.n, self.marker, self.size = n, marker, size

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        data = np.frombuffer(self.marker * (self.size // len(self.marker)), dtype=np.uint8).copy()
        return {"data": torch.from_numpy(data), "i": i}


def _lane_ports(it) -> dict:
    """The driver's local port of each open TCP lane, and its connection's type."""
    lanes = it._calls._lanes
    out = {}
    for wid, lane in [] if lanes is None else lanes._lanes.items():
        if lane.remote:
            s = socket.socket(fileno=os.dup(lane.conn.fileno()))
            out[wid] = [s.getsockname()[1], type(lane.conn).__name__]
            s.close()
    return out


def _lanes_on_the_wire(cluster) -> dict:
    """2 workers (one per worker node) send 40 batches of 4 x 64 KiB samples, each sample the marker repeated; a
    sniffer in the bridge's namespace counts the frames carrying the marker, by TCP port."""
    marker = b"RAYDL" + secrets.token_bytes(11)
    sniffer = subprocess.Popen(
        [*cluster.exec_prefix(None), sys.executable, netns.__file__, "sniff", "--marker", marker.hex()],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert sniffer.stdout.readline().strip() == "ready"
        loader = raydl.DataLoader(
            Marked(160, marker, 64 * 1024), batch_size=4, num_workers=2, timeout=60, ray_startup_timeout_s=240
        )
        it = iter(loader)
        got = [next(it)["i"].tolist() for _ in range(10)]
        ports = _lane_ports(it)  # open by now (the calls went over them); the epoch's rest goes over them too
        got += [b["i"].tolist() for b in it]
        facts = {
            "complete": got == [list(range(i, i + 4)) for i in range(0, 160, 4)],
            "lane_calls": it._calls.lane_calls,
            "remote_lane_calls": it._calls._lanes.remote_calls_sent if it._calls._lanes is not None else 0,
            "calls": it._sched.calls_sent,
            "lanes": ports,
            "worker_ips": sorted(r.node_ip for r in it.worker_records),
        }
        del it, loader
    finally:
        time.sleep(0.5)
        sniffer.send_signal(signal.SIGTERM)
        out, _ = sniffer.communicate(timeout=30)
    facts["sniffed"] = json.loads(out.strip().splitlines()[-1])
    return facts


def plain(facts: dict) -> None:
    facts["_t"] = time.monotonic()
    cluster = state_cluster()
    ips = [cluster.ip(n) for n in cluster.nodes]

    # (a) raydl's own placement: the workers go to the two nodes other than the driver's, one each; torch's batches
    # (kept warm: the next loaders reuse them on their nodes, no new worker process to start)
    gen = lambda: torch.Generator().manual_seed(5)  # noqa: E731
    kwargs = dict(batch_size=3, shuffle=True)
    expected = [b.tolist() for b in torch.utils.data.DataLoader(D.RangeDataset(36), generator=gen(), **kwargs)]
    loader = raydl.DataLoader(
        D.RangeDataset(36), num_workers=2, generator=gen(), timeout=60, ray_startup_timeout_s=240, **kwargs
    )
    it = iter(loader)
    facts["placement_same_as_torch"] = [b.tolist() for b in it] == expected
    facts["placement_ips"] = sorted(r.node_ip for r in it.worker_records)
    del it, loader
    _phase(facts, "placement")

    # (b) TCP lanes between namespaces carry the batches, in the clear on this cluster (the control of the TLS test)
    facts["wire"] = _lanes_on_the_wire(cluster)
    _phase(facts, "wire")

    # (c) a worker node killed mid-epoch (every process in its namespace): every batch once, in order
    n = 60
    loader = raydl.DataLoader(
        D.SlowDataset(n, {i: 0.05 for i in range(n)}),
        batch_size=2,
        num_workers=2,
        timeout=60,
        ray_startup_timeout_s=240,
    )
    it = iter(loader)
    out = [next(it).flatten().tolist()]
    while it._calls.lane_calls < 2 and it._rcvd_idx < 12:
        out.append(next(it).flatten().tolist())
    facts["kill_lane_calls_before"] = it._calls.lane_calls
    victim = ips.index(it.worker_records[1].node_ip)
    t0 = time.monotonic()
    facts["killed_pids"] = len(cluster.kill_node(victim))
    out.append(next(it).flatten().tolist())
    facts["kill_next_batch_s"] = round(time.monotonic() - t0, 1)
    out += [b.flatten().tolist() for b in it]
    facts["kill_s"] = round(time.monotonic() - t0, 1)
    facts["kill_complete_in_order"] = out == [[i, i + 1] for i in range(0, n, 2)]
    facts["kill_restarts"] = sum(it._pool.restarts)
    facts["kill_victim_ip"] = ips[victim]
    facts["kill_survivor_ips"] = sorted({r.node_ip for r in it.worker_records})
    del it, loader
    _phase(facts, "kill")

    # (d) the surviving worker node goes silent (its link down: no RST, no FIN) mid-epoch, then comes back
    _silent_node(cluster, facts, ips)
    facts.pop("_t")


def _phase(facts: dict, name: str) -> None:
    """How long the part of the scenario since the last phase (or its start, `facts["_t"]`) took, in seconds."""
    now = time.monotonic()
    facts.setdefault("phase_s", {})[name] = round(now - facts["_t"], 1)
    facts["_t"] = now


class _Said(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _silent_node(cluster, facts: dict, ips: list) -> None:
    """The defaults (shuffle=True, no generator), both workers on the one worker node left, whose link goes down
    once both have lanes: the epoch goes on, every batch once; the replacements are not placed on the silent node
    (here: on the head, the only other); the link comes back during the epoch (late replies must be dropped), and
    the node is a candidate again once Ray reaches it."""
    from raydl.cluster import silent_nodes

    deadline = time.monotonic() + 120  # the killed node gone from Ray's view first
    while sum(node["Alive"] for node in ray.nodes()) > 2 and time.monotonic() < deadline:
        time.sleep(0.5)
    _phase(facts, "killed_node_declared_dead")
    said = _Said()
    logging.getLogger("raydl").addHandler(said)
    n = 240
    loader = raydl.DataLoader(
        D.SlowDataset(n, {i: 0.02 for i in range(n)}), batch_size=2, shuffle=True, num_workers=2, timeout=120
    )
    it = iter(loader)
    out = []
    while it._calls._lanes is None or not all(it._calls._lanes.has_lane(w) for w in (0, 1)):
        out.append(next(it).flatten().tolist())
    victim = ips.index(it.worker_records[0].node_ip)
    facts["silent_workers_ips_before"] = sorted({r.node_ip for r in it.worker_records})
    victim_node = it.worker_records[0].node_id
    facts["silent_probe_before"] = silent_nodes.reach_raylet(victim_node, 1.0)  # the Ray calls' verdict, alive
    t0 = time.monotonic()
    cluster.link_down(victim)
    try:
        facts["silent_probe_down"] = silent_nodes.reach_raylet(victim_node, 1.0)  # ... and silent
        last, gaps = t0, []
        while it._pool.restarts == [0, 0]:  # until a replacement delivered
            out.append(next(it).flatten().tolist())
            gaps.append(time.monotonic() - last)
            last = time.monotonic()
    finally:
        cluster.link_up(victim)
    facts["silent_stall_s"] = round(max(gaps), 1)
    facts["silent_marked"] = silent_nodes.silent_nodes()
    _phase(facts, "silent_until_replaced")
    out += [b.flatten().tolist() for b in it]  # the rest of the epoch, the link back: late replies come now
    samples = [i for batch in out for i in batch]
    facts["silent_complete_once"] = sorted(samples) == list(range(n)) and len(out) == n // 2
    facts["silent_restarts"] = list(it._pool.restarts)
    facts["silent_replacement_ips"] = sorted({r.node_ip for r in it.worker_records})
    facts["silent_victim_ip"] = ips[victim]
    facts["silent_said"] = [line for line in said.lines if "silent" in line]
    del it, loader
    alive_ids = {node["NodeID"] for node in ray.nodes() if node["Alive"]}
    deadline = time.monotonic() + 60  # the silent node's mark lifted (the killed node's stays: it never returns)
    while victim_node in silent_nodes.silent_nodes() and time.monotonic() < deadline:
        time.sleep(0.2)
    left = silent_nodes.silent_nodes()
    _phase(facts, "silent_mark_lifted")
    # lifted once Ray reaches the node again; a node Ray declared dead meanwhile stays marked (it never returns)
    facts["silent_mark_right"] = all(node not in alive_ids for node in left) and bool(facts["silent_marked"])
    facts["silent_node_alive_after"] = any(
        node["Alive"] and node["NodeManagerAddress"] == ips[victim] for node in ray.nodes()
    )


def tls(facts: dict) -> None:
    facts["wire"] = _lanes_on_the_wire(state_cluster())


if __name__ == "__main__":
    main({"plain": plain, "tls": tls})
