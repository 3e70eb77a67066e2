"""Shared helpers of raydl's benchmarks: machine description, load monitoring, results files, workloads.

Importing this module sets RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (before Ray is imported), so any
local Ray a benchmark starts listens on 127.0.0.1 only. Import it before `ray`.

The workload datasets live here so that torch's forked workers, raydl's actors and Ray Data's
tasks all run the very same per-sample code; `register_by_value()` makes Ray's cloudpickle ship
this module by value (Ray's worker processes do not have benchmarks/ on their path).
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import platform  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Any, Callable, Iterable, Optional  # noqa: E402

import numpy as np  # noqa: E402
import psutil  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
RESULTS_DIR = os.path.join(HERE, "results")

# A measurement during which processes other than ours used more than this many cores on
# average is flagged as disturbed (and retried where the benchmark supports it).
DISTURBED_FOREIGN_CORES = 0.25


# --------------------------------------------------------------------------- machine


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info(ray_version: Optional[str] = None) -> dict:
    """What the results depend on. Pass `ray_version` to avoid importing Ray here (cold start-up is timed)."""
    if ray_version is None:
        import ray

        ray_version = ray.__version__
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = None
    return {
        "cpu_count": os.cpu_count(),
        "cpus_usable": affinity,
        "cpu_model": cpu_model(),
        "mem_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ray": ray_version,
        "numpy": np.__version__,
        "raydl_commit": _git_head(),
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
    }


def _git_head() -> str:
    try:
        out = subprocess.run(
            ["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        )
        dirty = subprocess.run(
            ["git", "-C", REPO, "status", "--porcelain", "raydl"], capture_output=True, text=True, timeout=10
        )
        return out.stdout.strip() + ("+dirty(raydl/)" if dirty.stdout.strip() else "")
    except Exception:
        return "unknown"


def describe_machine(info: dict) -> str:
    return (
        f"Machine: {info['cpu_count']} CPUs ({info['cpus_usable']} usable), {info['cpu_model']}, "
        f"{info['mem_gib']} GiB RAM; Python {info['python']}, torch {info['torch']}, ray {info['ray']}, "
        f"numpy {info['numpy']}; raydl at {info['raydl_commit']}; load average at start "
        f"{' / '.join(map(str, info['loadavg_at_start']))}"
    )


# --------------------------------------------------------------------------- load monitoring


def _tree_cpu_s(roots: Iterable[psutil.Process]) -> float:
    """CPU seconds of `roots` and all their descendants, reaped children included."""
    seen: set[int] = set()
    total = 0.0
    for root in roots:
        try:
            procs = [root] + root.children(recursive=True)
        except psutil.Error:
            continue
        for p in procs:
            if p.pid in seen:
                continue
            seen.add(p.pid)
            try:
                t = p.cpu_times()
                total += t.user + t.system + t.children_user + t.children_system
            except psutil.Error:
                pass
    return total


def _system_busy_s() -> float:
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + t.irq + t.softirq + getattr(t, "steal", 0.0)


class LoadMonitor:
    """How much CPU processes *other than ours* used during a measurement (in cores, averaged).

    Ours = this process and its descendants (a local Ray started by the driver is a child of
    it), plus any extra roots (`extra_roots()` returns processes of a cluster started apart).
    """

    def __init__(self, extra_roots: Optional[Callable[[], list]] = None) -> None:
        self._extra_roots = extra_roots or (lambda: [])

    def _ours(self) -> float:
        roots = [psutil.Process()] + [psutil.Process(p) for p in self._extra_roots() if psutil.pid_exists(p)]
        return _tree_cpu_s(roots)

    def __enter__(self) -> "LoadMonitor":
        self._t0 = time.perf_counter()
        self._sys0 = _system_busy_s()
        self._ours0 = self._ours()
        return self

    def __exit__(self, *exc: Any) -> None:
        wall = max(time.perf_counter() - self._t0, 1e-9)
        sys_busy = _system_busy_s() - self._sys0
        ours = self._ours() - self._ours0
        self.wall_s = wall
        self.ours_cores = ours / wall
        self.foreign_cores = max(0.0, (sys_busy - ours) / wall)

    @property
    def disturbed(self) -> bool:
        return self.foreign_cores > DISTURBED_FOREIGN_CORES


class QuietGate:
    """Before a measurement, wait (bounded) for a 1 s window in which other processes used < threshold cores.

    The machine these benchmarks run on may be shared (other test runs). Waiting a little for a
    quiet moment costs less than a disturbed measurement; the wait is bounded per call
    (`max_wait_s`) and in total (`budget_s`), after which measurements proceed regardless (and
    their foreign load is reported).
    """

    def __init__(self, max_wait_s: float, budget_s: float, extra_roots: Optional[Callable[[], list]] = None) -> None:
        self.max_wait_s, self.budget_s = max_wait_s, budget_s
        self.extra_roots = extra_roots
        self.waited_s = 0.0
        self.gave_up = 0

    def wait(self) -> float:
        """Seconds waited; 0 if the machine was quiet at once (or the budget is spent)."""
        if self.max_wait_s <= 0 or self.waited_s >= self.budget_s:
            return 0.0
        t0 = time.perf_counter()
        while True:
            with LoadMonitor(self.extra_roots) as mon:
                time.sleep(0.5)
            waited = time.perf_counter() - t0
            if not mon.disturbed:
                break
            if waited >= self.max_wait_s or self.waited_s + waited >= self.budget_s:
                self.gave_up += 1
                break
        self.waited_s += waited
        return waited


def cluster_pids(cluster_dir: str) -> list[int]:
    """Processes of a cluster started by cluster/local_cluster.sh (or like it) with RAYDL_CLUSTER_DIR=cluster_dir."""
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


# --------------------------------------------------------------------------- object store


def object_store_stats() -> dict:
    """Bytes and number of objects in the object store of the node this driver is on (Ray's internal API).

    `ray._private.internal_api.get_memory_info_reply` is what `ray memory --stats-only` reads;
    it needs no dashboard. Returns {} if this Ray has no such API.
    """
    import ray

    try:
        from ray._private import internal_api

        state = internal_api.get_state_from_address(ray.get_runtime_context().gcs_address)
        reply = internal_api.get_memory_info_reply(state)
        s = reply.store_stats
        return {"used_bytes": int(s.object_store_bytes_used), "num_objects": int(s.num_local_objects)}
    except Exception as e:  # private API: degrade to nothing rather than fail the run
        return {"error": f"{type(e).__name__}: {e}"}


# --------------------------------------------------------------------------- results


class Results:
    """JSON lines to benchmarks/results/<name>-<stamp>.jsonl, one per measurement."""

    def __init__(self, name: str, quick: bool) -> None:
        os.makedirs(RESULTS_DIR, exist_ok=True)
        self.stamp = time.strftime("%Y%m%d-%H%M%S")
        self.prefix = os.path.join(RESULTS_DIR, f"{name}{'-quick' if quick else ''}-{self.stamp}")
        self.jsonl_path = self.prefix + ".jsonl"
        self._f = open(self.jsonl_path, "w")

    def write(self, record: dict) -> None:
        self._f.write(json.dumps(record, default=_jsonable) + "\n")
        self._f.flush()

    def write_text(self, suffix: str, text: str) -> str:
        path = self.prefix + suffix
        with open(path, "w") as f:
            f.write(text)
        return path

    def close(self) -> None:
        self._f.close()

    def finish_cluster_report(self, lines: list[str], cluster_start_s: float, run_start_s: float) -> None:
        """End a cluster benchmark: add the start-up/run-time line, print the report, write it as .md, close."""
        lines += [
            "",
            f"Cluster start-up {cluster_start_s:.0f} s (not in the numbers). Run took "
            f"{(time.perf_counter() - run_start_s) / 60:.1f} min; load average at end "
            f"{' / '.join(f'{x:.2f}' for x in os.getloadavg())}.",
        ]
        report = "\n".join(lines)
        print(report)
        md = self.write_text(".md", report + "\n")
        self.close()
        print(f"\nresults: {self.jsonl_path}\n         {md}")


def _jsonable(x: Any) -> Any:
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    return str(x)


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    return float(np.percentile(np.asarray(xs), q))


def md_table(header: list[str], rows: list[list[Any]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for row in rows:
        out.append("| " + " | ".join(str(c) for c in row) + " |")
    return "\n".join(out)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- workloads


def calibrate_cpu_iters(target_s: float = 1e-3) -> int:
    """Number of numpy passes that make `cpu_sample` take about `target_s` on an uncontended core.

    Uses the 10th percentile of the timings, not the median: on a shared machine a sample is often
    preempted, and calibrating on contended timings would make the workload lighter than intended.
    """
    iters = 4
    for _ in range(6):
        ts = []
        for i in range(40):
            t0 = time.perf_counter()
            cpu_sample(i, iters)
            ts.append(time.perf_counter() - t0)
        per = percentile(ts, 10)
        iters = max(1, round(iters * target_s / per))
    return iters


def sample_cost_s(fn: Callable[[int], Any], n: int = 60) -> float:
    """Uncontended cost of one sample (10th percentile of `n` timings)."""
    ts = []
    for i in range(n):
        t0 = time.perf_counter()
        fn(i)
        ts.append(time.perf_counter() - t0)
    return percentile(ts, 10)


def cpu_sample(i: int, iters: int) -> np.ndarray:
    """~1 ms of Python + numpy work (with the calibrated `iters`) producing a 3x64x64 float32 image."""
    rng = np.random.default_rng(i)
    x = rng.standard_normal((3, 64, 64), dtype=np.float32)
    acc = 0.0
    for k in range(iters):
        x = np.tanh(x * 1.01 + 0.001 * k)
        acc += float(x[0, 0, k % 64])  # a little per-iteration Python work, as a decoder would have
    x[0, 0, 0] = acc
    return x


def trivial_sample(i: int) -> np.ndarray:
    return np.full((16,), i, dtype=np.float32)


def large_sample(i: int) -> np.ndarray:
    return np.full((3, 224, 224), i % 251, dtype=np.uint8)


IO_SLEEP_S = 0.004


def io_sample(i: int) -> np.ndarray:
    time.sleep(IO_SLEEP_S)  # stands in for a remote storage read
    return np.full((3, 64, 64), i % 7, dtype=np.float32)


def small_sample(i: int) -> np.ndarray:
    return np.full((3, 64, 64), i % 7, dtype=np.float32)


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    n: int
    batch_size: int
    kind: str  # cpu | trivial | large | io | small
    cpu_iters: int = 0

    def sample(self, i: int) -> np.ndarray:
        if self.kind == "cpu":
            return cpu_sample(i, self.cpu_iters)
        if self.kind == "trivial":
            return trivial_sample(i)
        if self.kind == "large":
            return large_sample(i)
        if self.kind == "io":
            return io_sample(i)
        if self.kind == "small":
            return small_sample(i)
        raise ValueError(self.kind)


class WorkloadDataset(Dataset):
    """Map-style dataset: sample i -> (tensor, label i). The same code for torch, raydl and Ray Data."""

    def __init__(self, workload: Workload, n: Optional[int] = None) -> None:
        self.workload = workload
        self.n = workload.n if n is None else n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return torch.from_numpy(self.workload.sample(int(i))), int(i)


class RayDataMap:
    """Ray Data `map_batches` function doing the same per-sample work as WorkloadDataset."""

    def __init__(self, workload: Workload) -> None:
        self.workload = workload

    def __call__(self, batch: dict) -> dict:
        ids = batch["id"]
        xs = [self.workload.sample(int(i)) for i in ids]
        return {"x": np.stack(xs), "y": np.asarray(ids, dtype=np.int64)}


def register_by_value() -> None:
    """Ship this module by value in Ray's pickles (Ray workers cannot import benchmarks/_common)."""
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])


def batch_samples(batch: Any) -> int:
    """Number of samples in a batch from any of the loaders (tuple/list or Ray Data dict)."""
    if isinstance(batch, dict):
        return len(next(iter(batch.values())))
    if isinstance(batch, (tuple, list)):
        return len(batch[1])
    return len(batch)


# --------------------------------------------------------------------------- local multi-node clusters


LOCAL_CLUSTER_SH = os.path.join(REPO, "cluster", "local_cluster.sh")

# Ray's CLI with 127.0.0.1 kept as 127.0.0.1: the same rewrite cluster/local_cluster.sh does (see
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
    """A cluster from cluster/local_cluster.sh in its own directory and ports; always stopped on exit.

    `start N` starts a head ({"trainer": 1}) and N worker nodes ({"data": ...}); `add_worker_node`
    starts one more worker node the same way (loopback only, token auth, the script's marker in
    its environment so that `local_cluster.sh stop` stops it too), optionally pinned to CPUs with
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
        cmd = (["taskset", "-c", taskset] if taskset else []) + ["bash", LOCAL_CLUSTER_SH, *args]
        log(f"$ {' '.join(cmd)}   (RAYDL_CLUSTER_DIR={self.dir}, port {self.port})")
        proc = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0:
            raise RuntimeError(
                f"local_cluster.sh {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
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
        """One more `ray start --address=...` worker node, as local_cluster.sh starts them."""
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
    """ray.init to a local_cluster.sh cluster, as its header says a driver must (token auth, loopback kept)."""
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
