"""Multi-node Rays on this machine: cluster/local_launcher.sh's loopback nodes in a benchmark's own directory and ports.

`LocalCluster` starts and stops them (always, on exit, bounded waits, never `ray stop`);
`connect_driver` and `wait_for_nodes` join the driver to one; `cluster_pids` finds its processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any, Optional

import psutil

from benchmarks.common import REPO
from benchmarks.common.results import log


def cluster_pids(cluster_dir: str) -> list[int]:
    """Processes of a cluster started by cluster/local_launcher.sh (or like it) with RAYDL_CLUSTER_DIR=cluster_dir."""
    real = os.path.realpath(cluster_dir)
    marker = ("RAYDL_LOCAL_CLUSTER_DIR=" + real).encode()
    needle = (real + "/ray/").encode()
    pids = []
    for p in psutil.process_iter(["pid"]):
        try:
            with open(f"/proc/{p.pid}/environ", "rb") as f:
                env = f.read()
            with open(f"/proc/{p.pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if marker in env.split(b"\0") or needle in cmd:
            pids.append(p.pid)
    return pids


LOCAL_LAUNCHER_SH = os.path.join(REPO, "cluster", "local_launcher.sh")

# Ray's CLI with 127.0.0.1 kept as 127.0.0.1: the same rewrite cluster/local_launcher.sh does (see
# its header): stock `ray start` on Linux replaces --node-ip-address=127.0.0.1 with the routable IP.
RAY_CLI_LOOPBACK = """
import sys
import ray._private.services as services
if not hasattr(services, "resolve_ip_for_localhost"):
    sys.exit("this Ray has no services.resolve_ip_for_localhost (checked against ray 2.60)")
services.resolve_ip_for_localhost = lambda host: host
from ray.scripts.scripts import main
sys.argv[0] = "ray"
sys.exit(main())
"""


class LocalCluster:
    """A cluster from cluster/local_launcher.sh in its own directory and ports; always stopped on exit.

    `start N` starts a head ({"trainer": 1}) and N worker nodes ({"data": ...}); `add_worker_node`
    starts one more worker node the same way (loopback only, token auth, the script's marker in
    its environment so that `local_launcher.sh stop` stops it too), optionally pinned to CPUs with
    `taskset`. Every subprocess is bounded in time.
    """

    def __init__(self, cluster_dir: str, port: int, dashboard_port: int, env: Optional[dict] = None) -> None:
        self.dir = cluster_dir
        self.port = port
        self.address = f"127.0.0.1:{port}"
        self.env = {
            k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
        }
        self.env.update(
            {
                "RAYDL_CLUSTER_DIR": cluster_dir,
                "RAYDL_CLUSTER_PORT": str(port),
                "RAYDL_CLUSTER_DASHBOARD_PORT": str(dashboard_port),
                # the nodes run the interpreter this benchmark runs in (a venv's python is not on PATH)
                "RAYDL_CLUSTER_PYTHON": sys.executable,
            }
        )
        self.env.update(env or {})
        self.extra_nodes = 0

    def _script(self, *args: str, taskset: Optional[str] = None, timeout_s: float = 600) -> None:
        cmd = (["taskset", "-c", taskset] if taskset else []) + ["bash", LOCAL_LAUNCHER_SH, *args]
        log(f"$ {' '.join(cmd)}   (RAYDL_CLUSTER_DIR={self.dir}, port {self.port})")
        proc = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0:
            raise RuntimeError(
                f"local_launcher.sh {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
            )

    def start(self, n_worker_nodes: int, taskset: Optional[str] = None) -> None:
        self._script("start", str(n_worker_nodes), taskset=taskset)

    def add_worker_node(
        self,
        num_cpus: float,
        resources: dict,
        object_store_bytes: int,
        taskset: Optional[str] = None,
        timeout_s: float = 180,
    ) -> None:
        """One more `ray start --address=...` worker node, as local_launcher.sh starts them."""
        self.extra_nodes += 1
        name = f"x{self.extra_nodes}"
        state_dir = os.path.join(self.dir, "state")
        os.makedirs(state_dir, exist_ok=True)
        env = dict(
            self.env,
            RAY_AUTH_MODE="token",
            RAY_USAGE_STATS_ENABLED="0",
            RAYDL_LOCAL_CLUSTER_DIR=os.path.realpath(self.dir),
        )
        cmd = (["taskset", "-c", taskset] if taskset else []) + [
            "timeout",
            "--kill-after=10",
            str(int(timeout_s)),
            "setsid",
            sys.executable,
            "-c",
            RAY_CLI_LOOPBACK,
            "start",
            f"--address={self.address}",
            "--node-ip-address=127.0.0.1",
            f"--temp-dir={os.path.join(self.dir, 'ray', name)}",
            f"--num-cpus={num_cpus}",
            "--num-gpus=0",
            f"--resources={json.dumps(resources)}",
            f"--object-store-memory={object_store_bytes}",
            f"--dashboard-agent-listen-port={self.port + 30 + self.extra_nodes}",
            "--disable-usage-stats",
        ]
        log(f"$ {' '.join(cmd[:3]) if taskset else ''} ray start --address={self.address} {resources} ({name})")
        with open(os.path.join(state_dir, f"{name}.log"), "w") as out:
            proc = subprocess.run(
                cmd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s + 20
            )
        if proc.returncode != 0:
            with open(os.path.join(state_dir, f"{name}.log")) as f:
                tail = f.read()[-3000:]
            raise RuntimeError(f"worker node {name} did not start ({proc.returncode}):\n{tail}")

    def stop(self) -> None:
        try:
            self._script("stop", timeout_s=180)
        except Exception as e:  # report, never mask the benchmark's own error
            log(f"stopping the cluster in {self.dir} failed: {e}")
        left = cluster_pids(self.dir)
        if left:
            log(f"WARNING: processes of {self.dir} still alive after stop: {left}")

    def pids(self) -> list[int]:
        return cluster_pids(self.dir)

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def disconnect_and_stop(cluster: "LocalCluster") -> None:
    """Release raydl's idle workers, leave Ray and stop the benchmark's cluster, whatever failed before."""
    try:
        import raydl

        raydl.release_idle_workers()
    except Exception:
        pass
    try:
        import ray

        ray.shutdown()
    except Exception:
        pass
    cluster.stop()


def connect_driver(address: str) -> None:
    """ray.init to a local_launcher.sh cluster, as its header says a driver must (token auth, loopback kept)."""
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import ray

    ray.init(address=address, log_to_driver=False)


def wait_for_nodes(n: int, timeout_s: float = 120) -> list[dict]:
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        nodes = [x for x in ray.nodes() if x.get("Alive")]
        if len(nodes) >= n:
            return nodes
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {len(nodes)} of {n} Ray nodes alive after {timeout_s} s")
        time.sleep(0.5)


def run_in_netns_head(cluster: Any, script: str, *args: str, timeout_s: float = 900, **env: str) -> dict:
    """`python -m benchmarks.<script> *args` as a driver in the head's namespace of a namespace cluster
    (cluster/netns_testbed.py), with the cluster's driver environment plus `env`; its `RESULT {json}` line, or
    SystemExit with its output when it failed."""
    from benchmarks.common.processes import child_result, script_command

    cmd = [*cluster.exec_prefix(0), *script_command(script, *args)]
    proc = subprocess.run(
        cmd, env=dict(cluster.driver_env(), PYTHONPATH=REPO, **env), capture_output=True, text=True, timeout=timeout_s
    )
    try:
        return child_result(proc, f"{script} {' '.join(args)}")
    except RuntimeError as e:
        raise SystemExit(str(e)) from None
