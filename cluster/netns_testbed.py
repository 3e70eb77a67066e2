#!/usr/bin/env python3
"""A Ray cluster on a real (virtual) network on this machine: a head and N worker nodes, each in its own Linux
network namespace with its own address on a bridge, links capped with `tc tbf`, optionally each worker node with a
private tmpfs folder (its own mount namespace) and optionally Ray's TLS with a CA and node certificates made here.

Needs root (or CAP_NET_ADMIN + CAP_SYS_ADMIN), `ip`, `tc`, `unshare` (and `openssl` for TLS). Nothing touches the
root namespace's links or routes: the bridge lives in a namespace of its own (`rdl-<tag>-br`, bridge `br0`), each
node `i` in `rdl-<tag>-n<i>` (0 = head) with `eth0` = 10.237.0.(10+i)/24 (`--subnet`), its veth peer `v<i>` on the
bridge. No namespace has a route off the bridge, so no packet of this cluster can leave it.

    cluster/netns_testbed.py up --workers 2 [--rate 10gbit] [--tls] [--private] [--tag c]
    cluster/netns_testbed.py env            # the driver's environment, as `export` lines
    cluster/netns_testbed.py exec 0 -- python train.py   # a command in node 0's (the head's) namespace, with it
    cluster/netns_testbed.py kill 2 | link-down 2 | link-up 2
    cluster/netns_testbed.py down           # also cleans what an earlier crashed run of the tag left

From Python (tests/_netns.py): `NetnsCluster(workers=2, tls=True).start()`; `stop()` is idempotent, and with
`reaper=True` a process of its own (its own session) tears the cluster down when the creating process dies, however
it dies (NOTE [ netns cluster teardown ]).

NOTE [ netns cluster teardown ]
Everything is found again from names alone, so a teardown also cleans what a killed run left: the namespaces are
`rdl-<tag>-*`, every Ray process of a node is a process in that node's network namespace (`ip netns pids`, which
reads /proc/<pid>/ns/net: no name matching, never another Ray on the machine), the private tmpfs exists only in
the mount namespace of the node's processes (it goes with the last of them), the veths and the bridge go with
their namespaces, and the files are under /tmp/rdl-<tag>. Order: SIGTERM to the namespaces' processes, SIGKILL to
those left after a grace, then `ip netns del`, then the folder.

NOTE [ netns cluster auth ]
Ray 2.60's `ray start` turns token authentication on when a token exists (~/.ray/auth_token, which any local
`ray.init()` creates). This cluster does not depend on that file: it makes a token of its own
(/tmp/rdl-<tag>/token) and starts every node with RAY_AUTH_MODE=token and RAY_AUTH_TOKEN_PATH pointing at it; a
driver needs the same two variables (`driver_env()`, `env`). With TLS, every Ray process (the driver included)
also gets RAY_USE_TLS=1 and RAY_TLS_SERVER_CERT/_KEY/RAY_TLS_CA_CERT: the node's own certificate, whose
subjectAltName names the node's IP (and 127.0.0.1), signed by the cluster's CA.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from typing import Optional

PREFIX = "rdl-"
RAY_PORT = 6379  # each node has its own network stack: Ray's default ports collide with nothing
START_TIMEOUT_S = 240.0  # one `ray start` on a loaded 2-core machine


def _run(*cmd: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {out.returncode}: {out.stderr.strip() or out.stdout.strip()}")
    return out


def can_make_namespaces() -> Optional[str]:
    """None where this process can make the cluster; else why not (for a test's skip)."""
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux's"
    if os.geteuid() != 0:
        try:
            with open("/proc/self/status") as f:
                caps = next(int(line.split()[1], 16) for line in f if line.startswith("CapEff:"))
        except (OSError, StopIteration, ValueError):
            caps = 0
        if not caps & (1 << 12):  # CAP_NET_ADMIN
            return "not root and no CAP_NET_ADMIN: cannot make network namespaces"
    probe = f"{PREFIX}probe-{os.getpid()}"
    out = _run("ip", "netns", "add", probe, check=False)
    if out.returncode != 0:
        return f"`ip netns add` failed: {out.stderr.strip()}"
    _run("ip", "netns", "del", probe, check=False)
    return None


def namespaces(tag: str) -> list[str]:
    """The network namespaces of cluster `tag` that exist now (of a live or a crashed run)."""
    out = _run("ip", "netns", "list", check=False).stdout
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return [n for n in names if n.startswith(f"{PREFIX}{tag}-")]


def ns_pids(ns: str) -> list[int]:
    out = _run("ip", "netns", "pids", ns, check=False).stdout
    return [int(p) for p in out.split() if p.isdigit() and int(p) != os.getpid()]


def teardown(tag: str, grace_s: float = 5.0) -> list[str]:
    """Remove everything of cluster `tag` (NOTE [ netns cluster teardown ]); idempotent. Returns what it removed."""
    removed = []
    spaces = namespaces(tag)
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        pids = [p for ns in spaces for p in ns_pids(ns)]
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while pids and time.monotonic() < deadline:
            pids = [p for ns in spaces for p in ns_pids(ns)]
            time.sleep(0.1)
        if not pids:
            break
    for ns in spaces:
        _run("ip", "netns", "del", ns, check=False)
        removed.append(ns)
    root = cluster_dir(tag)
    if os.path.isdir(root):
        shutil.rmtree(root, ignore_errors=True)
        removed.append(root)
    return removed


def sweep_orphans() -> list[str]:
    """Tear down the clusters of tag `p<pid>...` (a test session's, NOTE [ netns cluster teardown ]) whose process is
    gone: what a run killed with its reaper left. A live session's cluster is never touched."""
    out = _run("ip", "netns", "list", check=False).stdout
    tags = {line.split()[0][len(PREFIX) :].split("-")[0] for line in out.splitlines() if line.startswith(PREFIX + "p")}
    removed = []
    for tag in sorted(tags):
        pid = tag[1:].split("x")[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            removed += teardown(tag)
    return removed


def cluster_dir(tag: str) -> str:
    return f"/tmp/{PREFIX}{tag}"  # short: Ray's unix socket paths under it must fit 107 bytes


class NetnsCluster:
    """Head (node 0) + `workers` nodes, each in its own network namespace (see the module's docstring)."""

    def __init__(
        self,
        workers: int = 2,
        *,
        tag: str = "c",
        subnet: str = "10.237.0",
        rate: str = "10gbit",
        tls: bool = False,
        private: bool = False,
        head_cpus: int = 1,
        worker_cpus: int = 1,
        head_resources: Optional[dict] = None,
        worker_resources: Optional[dict] = None,
        object_store_bytes: int = 150_000_000,
        private_size: str = "256m",
        python: str = sys.executable,
        node_cpus: Optional[dict] = None,
    ) -> None:
        self.workers, self.tag, self.subnet, self.rate = workers, tag, subnet, rate
        self.tls, self.private, self.private_size = tls, private, private_size
        self.head_cpus, self.worker_cpus, self.object_store_bytes = head_cpus, worker_cpus, object_store_bytes
        self.head_resources = {"trainer": 1} if head_resources is None else head_resources
        self.worker_resources = {"data": 4} if worker_resources is None else worker_resources
        self.python = python
        self.node_cpus = dict(node_cpus or {})  # node -> a CPU list for `taskset -c` (its Ray processes pinned there)
        self.root = cluster_dir(tag)
        self.bridge_ns = f"{PREFIX}{tag}-br"
        self._reaper: Optional[subprocess.Popen] = None
        self._started = False

    # names and addresses
    def ns(self, node: int) -> str:
        return f"{PREFIX}{self.tag}-n{node}"

    def ip(self, node: int) -> str:
        return f"{self.subnet}.{10 + node}"

    @property
    def address(self) -> str:
        return f"{self.ip(0)}:{RAY_PORT}"

    @property
    def nodes(self) -> range:
        return range(self.workers + 1)

    @property
    def private_dir(self) -> str:
        """The path of each worker node's private tmpfs (the same path, a different folder in each node)."""
        return os.path.join(self.root, "private")

    def exec_prefix(self, node: Optional[int] = 0) -> list[str]:
        """A command's prefix that runs it in node `node`'s namespace (None: the bridge's, which sees all traffic)."""
        return ["ip", "netns", "exec", self.bridge_ns if node is None else self.ns(node)]

    def node_env(self, node: int) -> dict:
        """The environment of node `node`'s Ray processes, and of a driver in its namespace."""
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}
        env.update(
            RAY_AUTH_MODE="token",
            RAY_AUTH_TOKEN_PATH=os.path.join(self.root, "token"),
            RAY_USAGE_STATS_ENABLED="0",
            # on: a namespace's own address is what Ray must use (this project's venv defaults it to 0, loopback)
            RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="1",
            RAYDL_NETNS_CLUSTER=self.tag,
        )
        for k in ("RAY_AUTH_TOKEN", "RAY_USE_TLS", "RAY_TLS_SERVER_CERT", "RAY_TLS_SERVER_KEY", "RAY_TLS_CA_CERT"):
            env.pop(k, None)
        if self.tls:
            tls = os.path.join(self.root, "tls")
            env.update(
                RAY_USE_TLS="1",
                RAY_TLS_SERVER_CERT=os.path.join(tls, f"n{node}.crt"),
                RAY_TLS_SERVER_KEY=os.path.join(tls, f"n{node}.key"),
                RAY_TLS_CA_CERT=os.path.join(tls, "ca.crt"),
            )
        return env

    def driver_env(self) -> dict:
        """A driver in the head's namespace: node 0's environment and RAY_ADDRESS."""
        return dict(self.node_env(0), RAY_ADDRESS=self.address)

    # bring-up
    def start(self, reaper: bool = True, timeout_s: float = START_TIMEOUT_S) -> NetnsCluster:
        """Clean what an earlier run of the tag left, then make the network and start Ray on every node. On any
        failure everything made so far is removed before the error propagates."""
        why = can_make_namespaces()
        if why is not None:
            raise RuntimeError(why)
        teardown(self.tag)
        # cleanup first, before anything exists: this process's exit, and with `reaper` its death of any kind
        atexit.register(self.stop)
        if reaper:
            self._reaper = subprocess.Popen(
                [self.python, os.path.abspath(__file__), "reap", "--tag", self.tag],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,  # a Ctrl-C to the caller's process group must not end it first
            )
        self._started = True
        try:
            os.makedirs(self.root)
            self._network()
            self._credentials()
            self._ray()
            with open(os.path.join(self.root, "state.json"), "w") as f:
                json.dump(self.describe(), f)
        except BaseException:
            self.stop()
            raise
        return self

    def _network(self) -> None:
        taken = _run("ip", "route", check=False).stdout
        if f" {self.subnet}." in f" {taken}" or taken.startswith(f"{self.subnet}."):
            raise RuntimeError(f"{self.subnet}.0/24 is routed in the root namespace: pick another --subnet")
        br = self.bridge_ns
        _run("ip", "netns", "add", br)
        _run("ip", "-n", br, "link", "set", "lo", "up")
        _run("ip", "-n", br, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", br, "link", "set", "br0", "up")
        for node in self.nodes:
            ns = self.ns(node)
            _run("ip", "netns", "add", ns)
            _run("ip", "-n", br, "link", "add", f"v{node}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            _run("ip", "-n", br, "link", "set", f"v{node}", "master", "br0", "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.ip(node)}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            # the cap, both ways: the node's egress on eth0, its ingress as the bridge port's egress
            for where, dev in ((ns, "eth0"), (br, f"v{node}")):
                _run("ip", "netns", "exec", where, "tc", "qdisc", "add", "dev", dev, "root", *self._tbf())

    def _tbf(self) -> list[str]:
        bits = _rate_bits(self.rate)
        burst = max(64 * 1024, int(bits / 8 * 0.004))  # 4 ms of the rate: a timer tick of tokens, GSO frames fit
        return ["tbf", "rate", self.rate, "burst", str(burst), "latency", "50ms"]

    def _credentials(self) -> None:
        token = os.path.join(self.root, "token")
        with open(os.open(token, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
            f.write(secrets.token_hex(32))
        if not self.tls:
            return
        if shutil.which("openssl") is None:
            raise RuntimeError("--tls needs `openssl`")
        tls = os.path.join(self.root, "tls")
        os.makedirs(tls)
        p = lambda name: os.path.join(tls, name)  # noqa: E731
        ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
        _run("openssl", "req", "-x509", *ec, "-keyout", p("ca.key"), "-out", p("ca.crt"), "-days", "2",
             "-subj", f"/CN=raydl netns {self.tag} CA")  # fmt: skip
        for node in self.nodes:
            n = f"n{node}"
            _run("openssl", "req", *ec, "-keyout", p(f"{n}.key"), "-out", p(f"{n}.csr"), "-subj", f"/CN={n}")
            with open(p(f"{n}.ext"), "w") as f:
                f.write(f"subjectAltName=IP:{self.ip(node)},IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n")
            _run("openssl", "x509", "-req", "-in", p(f"{n}.csr"), "-CA", p("ca.crt"), "-CAkey", p("ca.key"),
                 "-CAcreateserial", "-out", p(f"{n}.crt"), "-days", "2", "-extfile", p(f"{n}.ext"))  # fmt: skip

    def _ray_cmd(self, node: int) -> list[str]:
        ray = os.path.join(os.path.dirname(self.python), "ray")
        cmd = [ray, "start", f"--node-ip-address={self.ip(node)}", f"--temp-dir={self.root}/n{node}"]
        cmd += [f"--object-store-memory={self.object_store_bytes}", "--disable-usage-stats", "--num-gpus=0"]
        if node == 0:
            cmd += ["--head", f"--port={RAY_PORT}", "--include-dashboard=false", f"--num-cpus={self.head_cpus}"]
            cmd += [f"--resources={json.dumps(self.head_resources)}"]
        else:
            cmd += [f"--address={self.address}", f"--num-cpus={self.worker_cpus}"]
            cmd += [f"--resources={json.dumps(self.worker_resources)}"]
        if node and self.private:
            # a mount namespace of its own with a tmpfs on private_dir: every Ray process of the node inherits it
            os.makedirs(self.private_dir, exist_ok=True)
            mount = f'mount -t tmpfs -o size={self.private_size},mode=1777 raydl-n{node} "$0" && exec "$@"'
            cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c", mount, self.private_dir, *cmd]
        if node in self.node_cpus:
            cmd = ["taskset", "-c", str(self.node_cpus[node]), *cmd]
        return self.exec_prefix(node) + cmd

    def _ray(self, tries: int = 3) -> None:
        """`ray start` on the head, then on the worker nodes at once. Ray gives a node 30 s (fixed) to register with
        the GCS, which a loaded 2-core machine can miss: a node that failed has its processes killed and is started
        again, up to `tries` times."""

        def launch(node: int, attempt: int) -> subprocess.Popen:
            with open(os.path.join(self.root, f"n{node}.log"), "a") as log:
                log.write(f"--- ray start, try {attempt + 1}\n")
                log.flush()
                return subprocess.Popen(
                    self._ray_cmd(node), env=self.node_env(node), stdin=subprocess.DEVNULL, stdout=log, stderr=log
                )

        def failed(node: int, proc: subprocess.Popen, deadline: float) -> Optional[str]:
            try:
                rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                rc = "timeout"
            if rc == 0:
                return None
            self.kill_node(node)
            with open(os.path.join(self.root, f"n{node}.log")) as f:
                return f"`ray start` of node {node} failed ({rc}):\n" + "".join(f.readlines()[-15:])

        todo, used = [0], {0: 0}  # the head first, then every worker node at once
        while todo:
            deadline = time.monotonic() + START_TIMEOUT_S
            procs = {node: launch(node, used.get(node, 0)) for node in todo}
            errors = {node: why for node, proc in procs.items() if (why := failed(node, proc, deadline))}
            for node in errors:
                used[node] = used.get(node, 0) + 1
                if used[node] >= tries:
                    raise RuntimeError(errors[node])
            todo = sorted(errors) or ([n for n in self.nodes if n] if todo == [0] else [])

    def describe(self) -> dict:
        return {
            "tag": self.tag,
            "address": self.address,
            "ips": [self.ip(n) for n in self.nodes],
            "namespaces": [self.ns(n) for n in self.nodes],
            "bridge_ns": self.bridge_ns,
            "rate": self.rate,
            "tls": self.tls,
            "private": self.private,
            "private_dir": self.private_dir,
        }

    # faults
    def kill_node(self, node: int) -> list[int]:
        """SIGKILL every process in the node's namespace (its raylet, workers, agents): a node that dies."""
        pids = ns_pids(self.ns(node))
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids

    def link_down(self, node: int) -> None:
        """The node's bridge port goes down: its packets go nowhere, no RST or FIN (a silent node)."""
        _run("ip", "-n", self.bridge_ns, "link", "set", f"v{node}", "down")

    def link_up(self, node: int) -> None:
        _run("ip", "-n", self.bridge_ns, "link", "set", f"v{node}", "up")

    def count_links(self) -> None:
        """From now on count the bytes each node sends to each other one, on the bridge itself: each bridge port's cap
        (a tbf) becomes an htb of the same rate with a class per sending node (a u32 match on its address), whose
        counters `link_bytes` reads. The packets are the kernel's, headers included: what the cluster's links
        carried, whatever sent it."""
        br, rate = self.bridge_ns, self.rate
        for dst in self.nodes:
            tc = ["ip", "netns", "exec", br, "tc"]
            dev = ["dev", f"v{dst}"]
            _run(*tc, "qdisc", "replace", *dev, "root", "handle", "1:", "htb", "default", "999", "r2q", "100000")
            _run(*tc, "class", "add", *dev, "parent", "1:", "classid", "1:1", "htb", "rate", rate, "ceil", rate)
            for src in [*[n for n in self.nodes if n != dst], None]:
                cls = f"1:{999 if src is None else 10 + src}"
                _run(*tc, "class", "add", *dev, "parent", "1:1", "classid", cls, "htb", "rate", rate, "ceil", rate)
                if src is not None:
                    match = ["u32", "match", "ip", "src", f"{self.ip(src)}/32", "flowid", cls]
                    _run(*tc, "filter", "add", *dev, "parent", "1:", "protocol", "ip", "prio", "1", *match)

    def link_bytes(self) -> dict:
        """{(from node, to node): bytes} the bridge carried since `count_links`."""
        out = {}
        for dst in self.nodes:
            text = _run("ip", "netns", "exec", self.bridge_ns, "tc", "-s", "class", "show", "dev", f"v{dst}").stdout
            for m in re.finditer(r"class htb 1:(\d+) parent 1:1 .*?\n\s*Sent (\d+) bytes", text):
                src = int(m.group(1)) - 10
                if src in self.nodes and src != dst:
                    out[(src, dst)] = int(m.group(2))
        return out

    def stop(self) -> None:
        """Tear everything down (idempotent; NOTE [ netns cluster teardown ])."""
        if not self._started:
            return
        self._started = False
        teardown(self.tag)
        if self._reaper is not None:
            try:
                self._reaper.stdin.close()  # it finds nothing left and exits
                self._reaper.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                pass
            self._reaper = None

    def __enter__(self) -> NetnsCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def from_state(tag: str = "c") -> NetnsCluster:
    """The running cluster `tag` (made by another process), from its state file: for its fault methods."""
    with open(os.path.join(cluster_dir(tag), "state.json")) as f:
        state = json.load(f)
    cluster = NetnsCluster(len(state["ips"]) - 1, tag=tag, subnet=state["ips"][0].rsplit(".", 1)[0])
    cluster.rate, cluster.tls, cluster.private = state["rate"], state["tls"], state["private"]
    return cluster


def _rate_bits(rate: str) -> float:
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12, "bit": 1}
    for unit, scale in units.items():
        if rate.lower().endswith(unit):
            return float(rate[: -len(unit)]) * scale
    raise ValueError(f"rate {rate!r}: use tc's bit units, e.g. 10gbit, 500mbit")


def sniff(marker: bytes, seconds: float) -> dict:
    """Frames seen in this process's network namespace (every interface, both ways; run it in the bridge's to see
    all of the cluster's traffic) for `seconds` or until SIGTERM: how many, their TCP bytes by port, and how many
    carry `marker` by port. `ip netns exec NS python netns_testbed.py sniff --marker HEX` prints it as JSON."""
    import socket
    import struct

    stop = [False]
    signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__(0, True))
    raw = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))  # ETH_P_ALL
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 20)
    raw.settimeout(0.2)
    frames = 0
    hits: dict = {}
    tcp_bytes: dict = {}
    deadline = time.monotonic() + seconds
    print("ready", flush=True)
    while not stop[0] and time.monotonic() < deadline:
        try:
            frame = raw.recv(1 << 17)
        except (socket.timeout, InterruptedError):
            continue
        frames += 1
        ports: tuple = ()
        if len(frame) > 38 and frame[12:14] == b"\x08\x00" and frame[23] == 6:  # IPv4, TCP
            at = 14 + (frame[14] & 0xF) * 4
            ports = struct.unpack("!HH", frame[at : at + 4])
            for port in ports:
                tcp_bytes[port] = tcp_bytes.get(port, 0) + len(frame)
        if marker in frame:
            for port in ports or (0,):
                hits[port] = hits.get(port, 0) + 1
    return {"frames": frames, "marker_frames": hits, "tcp_bytes": tcp_bytes}


def _reap(tag: str) -> None:
    """Wait for the creating process to end (EOF on stdin), then tear the cluster down."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        sys.stdin.buffer.read()
    finally:
        teardown(tag)


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=["up", "down", "env", "exec", "kill", "link-down", "link-up", "sniff", "reap"])
    ap.add_argument("node", nargs="?", type=int, help="the node (0 = head) of exec, kill, link-down, link-up")
    ap.add_argument("--tag", default="c")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rate", default="10gbit")
    ap.add_argument("--subnet", default="10.237.0")
    ap.add_argument("--tls", action="store_true")
    ap.add_argument("--private", action="store_true")
    ap.add_argument("--marker")
    ap.add_argument("--seconds", type=float, default=60)
    argv = sys.argv[1:] if argv is None else argv
    command = argv[argv.index("--") + 1 :] if "--" in argv else []
    a = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if a.command == "up":
        c = NetnsCluster(a.workers, tag=a.tag, subnet=a.subnet, rate=a.rate, tls=a.tls, private=a.private)
        c.start(reaper=False)
        atexit.unregister(c.stop)  # it stays up until `down`
        print(json.dumps(c.describe(), indent=1))
        print(f"driver: {sys.argv[0]} exec 0 --tag {a.tag} -- python your_script.py")
    elif a.command == "down":
        print("removed:", " ".join(teardown(a.tag)) or "nothing")
    elif a.command == "env":
        env = from_state(a.tag).driver_env()
        for k in sorted(env):
            if k.startswith(("RAY_", "RAYDL_NETNS")):
                print(f"export {k}={env[k]}")
    elif a.command == "exec":
        c, node = from_state(a.tag), a.node or 0
        env = c.driver_env() if node == 0 else c.node_env(node)
        return subprocess.call(c.exec_prefix(node) + (command or [os.environ.get("SHELL", "sh")]), env=env)
    elif a.command in ("kill", "link-down", "link-up"):
        c = from_state(a.tag)
        print({"kill": c.kill_node, "link-down": c.link_down, "link-up": c.link_up}[a.command](a.node))
    elif a.command == "sniff":
        print(json.dumps(sniff(bytes.fromhex(a.marker), a.seconds)), flush=True)
    elif a.command == "reap":
        _reap(a.tag)
    return 0


if __name__ == "__main__":
    sys.exit(main())
