"""Helpers over the suite's shared Ray session: bounded waits, counting raydl's worker actors, a fresh Python.

A driver that must have a Ray (or a cluster) of its own runs in a fresh interpreter and reports
what it saw as one line, `FACTS {json}`: `read_facts()` reads it, `run_main()` runs a tests._*_main module.

Every count asks the state API of *this* session's GCS (other Rays may run on the machine) and,
unless told otherwise, first releases the idle workers the warm pool keeps, so that a count is
of the workers loaders still hold.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import raydl

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def wait_until(predicate, timeout_s: float = 30.0, interval_s: float = 0.2) -> bool:
    """Poll `predicate` until it holds or `timeout_s` passes; its last value (never a hang)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


# ray.cluster_utils waits 30 s for a node to register; a loaded 2-core machine can need minutes.
CLUSTER_NODE_WAIT_S = 180.0


def patient_clusters() -> None:
    """Make ray.cluster_utils.Cluster wait up to CLUSTER_NODE_WAIT_S for each node (in a fresh driver, before its cluster)."""
    from ray.cluster_utils import Cluster

    if getattr(Cluster, "_raydl_patient", False):
        return
    wait_node, wait_nodes = Cluster._wait_for_node, Cluster.wait_for_nodes

    def _wait_for_node(self, node, timeout: float = 30):
        return wait_node(self, node, timeout=max(timeout, CLUSTER_NODE_WAIT_S))

    def _wait_for_nodes(self, timeout: float = 30):
        return wait_nodes(self, timeout=max(timeout, CLUSTER_NODE_WAIT_S))

    Cluster._wait_for_node, Cluster.wait_for_nodes = _wait_for_node, _wait_for_nodes
    Cluster._raydl_patient = True


def end_node_caches() -> int:
    """Kill the node cache actors (NOTE [ raydl node cache ]) of this session; returns how many.

    They are detached and exit after RAYDL_CACHE_IDLE_S (15 min) unused: a test that made one per
    temporary folder would otherwise leave a Ray process each for the rest of the suite."""
    import ray

    if not ray.is_initialized():
        return 0
    ended = 0
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["namespace"] == "raydl" and actor["name"].startswith("raydl-cache-"):
            try:
                ray.kill(ray.get_actor(actor["name"], namespace="raydl"), no_restart=True)
                ended += 1
            except ValueError:  # gone meanwhile
                pass
    return ended


def gcs_address() -> str:
    import ray

    return ray.get_runtime_context().gcs_address


def worker_actors(alive_only: bool = False, detail: bool = False) -> list:
    """raydl worker actors of this session (the state API's records)."""
    from ray.util.state import list_actors

    filters = [("class_name", "=", "Worker")] + ([("state", "=", "ALIVE")] if alive_only else [])
    return list_actors(
        address=gcs_address(), filters=filters, detail=detail, limit=10000, raise_on_missing_output=False
    )


def alive_worker_actors(release_warm: bool = True) -> int:
    """How many raydl worker actors are alive (after releasing the warm pool's idle ones, by default)."""
    if release_warm:
        raydl.release_idle_workers()
    return len(worker_actors(alive_only=True))


def settled_alive_worker_actors(timeout_s: float = 20.0) -> int:
    """`alive_worker_actors()` once two reads 1 s apart agree (actors just killed still read ALIVE for a moment)."""
    deadline = time.monotonic() + timeout_s
    last = alive_worker_actors()
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = alive_worker_actors()
        if now == last:
            return now
        last = now
    return last


# Variables a fresh interpreter keeps although it must not join this session's Ray: the suite's
# worker niceness and log monitor interval (tests/conftest.py).
SUITE_RAY_ENV = ("RAY_worker_niceness", "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD")


# This process's environment when the suite was collected: what a background run starts from, whatever a test
# running meanwhile sets in os.environ (monkeypatch.setenv) (NOTE [ tests background commands ]).
ENV_AT_START = dict(os.environ)


def fresh_env(extra: dict | None = None, base: dict | None = None) -> dict:
    """This process's environment (or `base`) without the RAY_* variables that would join its Ray, plus `extra`."""
    env = {
        k: v
        for k, v in (os.environ if base is None else base).items()
        if not k.startswith("RAY_") or k in SUITE_RAY_ENV
    }
    env.update(extra or {})
    return env


def run_python(code: str, timeout_s: int = 360, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    """`code` in a new interpreter at the repository root, with no RAY_* variable of this process (no Ray to join)."""
    env = fresh_env(env_extra)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def joinable_ray(num_cpus: int = 2, wait_s: float = 240.0, client_port: int | None = None):
    """A generator for a fixture: a Ray head of its own on loopback (`ray start --head --block` in a new process
    group), yielding the `env_extra` with which a fresh driver (`run_python`) joins it; stopped by its process group
    (never `ray stop`, which would stop every Ray here). Needs the token `ray_session`'s `ray.init` wrote (a head
    started while ~/.ray/auth_token exists asks for it).

    NOTE [ tests joined cold starts ]: a cold start is a process with no Ray *in it* at `iter()`; whether raydl then
    starts a local Ray or joins RAY_ADDRESS in the background is the same path (NOTE [ raydl cold start ]). Fresh
    drivers that test the cold start join the suite's own Ray (conftest's `joined_ray`) instead of each starting a
    Ray (4-10 s quiet, 20-30 s on a loaded 2-core VM, and the same again to stop it); a head of a module's own (this
    function) cost as much again for each module. The tests of the local start keep theirs."""
    import socket
    import tempfile

    import pytest

    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    temp = tempfile.mkdtemp(prefix="rdl-head-")
    argv = [
        ray_bin, "start", "--head", "--block", f"--port={port}", "--node-ip-address=127.0.0.1",
        f"--num-cpus={num_cpus}", "--include-dashboard=false", f"--temp-dir={temp}",
        "--object-store-memory=150000000", "--disable-usage-stats",
    ]  # fmt: skip
    if client_port is not None:  # Ray Client's server on that port (ray://127.0.0.1:client_port)
        argv.append(f"--ray-client-server-port={client_port}")
    env = fresh_env({"RAY_AUTH_MODE": "token", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"})  # loopback only
    deadline = time.monotonic() + wait_s
    for attempt in (1, 2):  # once more when Ray's own fixed 30 s raylet wait ran out (RAY_START_TIMED_OUT, below)
        proc = subprocess.Popen(
            argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        _BACKGROUND.procs.add(proc)
        said: list[str] = []
        ready = _wait_for_line(proc, "block forever", said, deadline)
        if ready or attempt == 2 or RAY_START_TIMED_OUT not in "".join(said):
            break
        _BACKGROUND.procs.discard(proc)
        _end_group(proc, graceful=False)
    try:
        if not ready:
            pytest.fail(f"ray start --head did not come up in {wait_s:.0f} s: {''.join(said)[-3000:]}")
        exposed = listeners_off_loopback(proc.pid)
        if exposed:
            pytest.fail(f"the test head listens beyond loopback: {exposed}")
        yield {"RAY_ADDRESS": f"127.0.0.1:{port}", "RAY_AUTH_MODE": "token"}
    finally:
        _BACKGROUND.procs.discard(proc)
        # SIGKILL at once: `ray start --block` took longer than _end_group's 10 s grace to act on SIGTERM (each
        # module's teardown was 10.1 s), and a throwaway head has nothing to save; its group holds every process it
        # started (GCS, raylet, agents, workers), so none is left.
        _end_group(proc, graceful=False)
        import shutil

        shutil.rmtree(temp, ignore_errors=True)


def listeners_off_loopback(pgid: int) -> list[str]:
    """The TCP listening sockets of process group `pgid`'s processes bound to anything but loopback (`ss -ltnp`)."""
    import re

    pids = set()
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[2]) == pgid:
                pids.add(entry)
        except (OSError, IndexError, ValueError):  # gone meanwhile
            pass
    out = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True, timeout=30).stdout
    loopback = ("127.", "[::1]", "[::ffff:127.")
    exposed = []
    for line in out.splitlines():
        fields = line.split()  # State Recv-Q Send-Q Local-Address:Port Peer-Address:Port Process
        if len(fields) > 3 and not fields[3].startswith(loopback) and set(re.findall(r"pid=(\d+)", line)) & pids:
            exposed.append(fields[3])
    return exposed


def _wait_for_line(proc: subprocess.Popen, marker: str, said: list, deadline: float) -> bool:
    """Read `proc`'s output into `said` until a line holds `marker` (True), it ends or `deadline` passes (False)."""
    import threading

    found = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            said.append(line)
            if marker in line:
                found.set()
        found.set()  # ended: the caller looks at `said`

    threading.Thread(target=read, daemon=True).start()  # (keeps draining the pipe afterwards)
    found.wait(max(0.0, deadline - time.monotonic()))
    return any(marker in line for line in said)


def read_facts(proc: subprocess.CompletedProcess) -> dict:
    """The last `FACTS {json}` line a fresh driver printed; fails with its output if it failed or printed none."""
    lines = [line for line in proc.stdout.splitlines() if line.startswith("FACTS ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(lines[-1][len("FACTS ") :])


def _run_command(argv: list[str], env: dict, timeout_s: int) -> subprocess.CompletedProcess:
    """`argv` at the repository root in a new process group, killed (with what it started) past `timeout_s`."""
    proc = subprocess.Popen(
        argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    _BACKGROUND.procs.add(proc)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _end_group(proc)
        out, err = proc.communicate()
        err += f"\n[tests/_session.py: killed after {timeout_s} s]"
    finally:
        _BACKGROUND.procs.discard(proc)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _end_group(proc: subprocess.Popen, graceful: bool = True) -> None:
    """SIGTERM to the process group (what the command started too), SIGKILL if it lingers (at once: not graceful)."""
    import signal

    steps = ((signal.SIGTERM, 10), (signal.SIGKILL, 10)) if graceful else ((signal.SIGKILL, 10),)
    for sig, wait_s in steps:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            pass


# NOTE [ tests background commands ]: the fresh drivers that start a Ray or a multi-node cluster of
# their own (ray.cluster_utils, the examples run with no Ray) share nothing with the suite's Ray,
# and use well under this machine's 2 cores (most of their time is Ray's processes starting and
# Ray's own waits). Each is declared, with the node id of a test that reads its output, by
# `background()` when its test module is imported; tests/conftest.py's collection hook then queues
# those the selected tests need, in suite order, and ONE background thread runs them one at a time
# while the in-process tests run. `run_command` (and `run_main`) only read the output, waiting,
# bounded, if the command is still running; a command not started yet when its test comes is taken
# back and run by the test itself, so each is run once and a failure is the test's.
# While processes other than the suite's keep the machine busy (`_machine_busy`), the thread starts
# nothing: the tests run their commands themselves, one at a time, as without it.
# RAYDL_TEST_NO_BACKGROUND=1 runs every one in its test.


def _foreign_runnable(samples: int = 5, interval_s: float = 0.2) -> float | None:
    """How many processes that are not this suite's (this process and its descendants: its Rays, their workers,
    the fresh drivers) are running or waiting for a CPU, averaged over `samples` looks at /proc; None without /proc."""
    if not os.path.isdir("/proc/self"):
        return None
    me = os.getpid()
    total = 0
    for i in range(samples):
        parent, running = {}, []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:  # gone meanwhile
                continue
            fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state, ppid, ...
            parent[int(entry)] = int(fields[1])
            if fields[0] == "R":
                running.append(int(entry))
        for pid in running:
            p, hops = pid, 0
            while p > 1 and p != me and hops < 64:
                p, hops = parent.get(p, 0), hops + 1
            total += p != me
        if i + 1 < samples:
            time.sleep(interval_s)
    return total / samples


def _machine_busy() -> bool:
    """Whether processes other than this suite's keep the machine busy: on average one or more of them running
    (two CPU-spinning processes beside the suite make 2; a quiet machine about 0). A busy machine runs no command
    beside the tests: a Ray's node start gives up after 30 s (Ray's own bound), which Rays started side by side on
    an overloaded machine can exceed. RAYDL_TEST_BACKGROUND_MAX_FOREIGN overrides the bound (without /proc: the
    1-minute load average above twice the cores)."""
    foreign = _foreign_runnable()
    if foreign is None:
        return os.getloadavg()[0] > 2 * (os.cpu_count() or 1)
    return foreign >= float(os.environ.get("RAYDL_TEST_BACKGROUND_MAX_FOREIGN", "1.0"))


class _Background:
    """The declared commands, the queue, the thread that runs them, their results."""

    def __init__(self) -> None:
        import threading

        self.lock = threading.Lock()
        # key -> (node id prefixes (a tuple), argv (or a callable), env, timeout in seconds)
        self.declared: dict[str, tuple] = {}
        self.queue: list[str] = []
        self.jobs: dict[str, dict] = {}  # key -> {"done": Event, "result": CompletedProcess or an exception}
        self.procs: set = set()
        self.thread = None

    def start(self, keys: list[str]) -> None:
        import atexit
        import threading

        with self.lock:
            self.queue = [k for k in keys if k not in self.jobs]
        if self.queue and self.thread is None:
            self.thread = threading.Thread(target=self._run, name="tests_background", daemon=True)
            self.thread.start()
            atexit.register(self.end)

    def _run(self) -> None:
        import threading
        import time

        while True:
            with self.lock:
                if not self.queue:
                    return
            if _machine_busy():  # each test runs its own command meanwhile (claim takes it off the queue)
                time.sleep(5)
                continue
            with self.lock:
                if not self.queue:
                    return
                key = self.queue.pop(0)
                job = self.jobs[key] = {"done": threading.Event()}
                _, argv, env, timeout_s = self.declared[key]
            try:
                job["result"] = argv() if callable(argv) else _run_command(argv, env, timeout_s)
            except BaseException as e:  # handed to the test that reads the output (pytest's skips too)
                job["result"] = e
            job["done"].set()

    def claim(self, key: str):
        """The background job of `key` if it started; None (and it leaves the queue) if not."""
        with self.lock:
            self.queue = [k for k in self.queue if k != key]
            return self.jobs.get(key)

    def remember(self, key: str, result):
        """`result` kept as `key`'s job, run in a test (claim hands it to a later reader); returned."""
        import threading

        job = {"done": threading.Event(), "result": result}
        job["done"].set()
        with self.lock:
            self.jobs[key] = job
        return result

    def end(self) -> None:
        """At exit: no background command outlives the suite."""
        with self.lock:
            self.queue = []
        for proc in list(self.procs):
            _end_group(proc)


_BACKGROUND = _Background()


def _declare(nodeid_prefix: str, key: str, argv, env, timeout_s: int) -> None:
    """`key` declared once (its first declaration's command); tests of several modules may read it, each module
    adding its prefix (one run serves them all: tests/_multinode_main.py's cluster)."""
    prefixes, *rest = _BACKGROUND.declared.get(key, ((), argv, env, timeout_s))
    _BACKGROUND.declared[key] = (prefixes + (nodeid_prefix,), *rest)


def background(nodeid_prefix: str, key: str, argv: list[str], env: dict, timeout_s: int) -> None:
    """Declare `argv` as the command whose output the tests under `nodeid_prefix` read through `run_command(key)`."""
    _declare(nodeid_prefix, key, list(argv), dict(env), timeout_s)


def background_call(nodeid_prefix: str, key: str, fn, timeout_s: int) -> None:
    """Declare `fn()` (a test's whole run of fresh processes, bounded within `timeout_s`; it may assert or skip) as
    what the tests under `nodeid_prefix` read through `run_command(key)`: its value, or its exception raised again."""
    _declare(nodeid_prefix, key, fn, None, timeout_s)


def start_background(nodeids: list[str]) -> None:
    """Queue the declared commands the tests `nodeids` need, in their order (NOTE [ tests background commands ])."""
    if os.environ.get("RAYDL_TEST_NO_BACKGROUND") == "1":
        return
    keys = []
    for nodeid in nodeids:
        for key, (prefixes, *_) in _BACKGROUND.declared.items():
            if nodeid.startswith(prefixes) and key not in keys:
                keys.append(key)
    _BACKGROUND.start(keys)


def run_command(key: str) -> subprocess.CompletedProcess:
    """The declared command `key`'s completed process (or callable's value): from the background run if one
    started, else run now; either way run once, its result kept for every later reader."""
    job = _BACKGROUND.claim(key)
    _, argv, env, timeout_s = _BACKGROUND.declared[key]
    if job is None:
        return _BACKGROUND.remember(key, argv() if callable(argv) else _run_command(argv, env, timeout_s))
    assert job["done"].wait(timeout_s + 60), f"the background run of {key} did not end in {timeout_s + 60} s"
    if isinstance(job["result"], BaseException):
        raise job["result"]
    return job["result"]


# Ray's own node start gives up after a fixed 30 s (ray/_private/node.py: "The current node timed out during
# startup"), which a 2-core VM running two CPU spinners beside the suite can exceed (seen at stops 42 and 43, the
# Lightning example's own ray.init; at stop 45 tests/_multinode_main.py's cluster_utils nodes). That is Ray's start,
# not raydl's behaviour: a command that failed with it alone is run once more, in the test.
RAY_START_TIMED_OUT = "The current node timed out during startup"


def run_command_once_more_if_ray_did_not_start(key: str) -> subprocess.CompletedProcess:
    """`run_command(key)`, run again once (in the foreground) if it failed because Ray's own node start timed out."""
    proc = run_command(key)
    if proc.returncode != 0 and RAY_START_TIMED_OUT in f"{proc.stdout}{proc.stderr}":
        _, argv, env, timeout_s = _BACKGROUND.declared[key]
        proc = _BACKGROUND.remember(key, argv() if callable(argv) else _run_command(argv, env, timeout_s))
    return proc


def background_main(nodeid_prefix: str, module: str, timeout_s: int = 540) -> None:
    """Declare `python -m <module>` (a tests._*_main driver with a cluster of its own) for `run_main`."""
    background(nodeid_prefix, module, [sys.executable, "-m", module], fresh_env(), timeout_s)


def run_main(module: str, timeout_s: int = 540) -> dict:
    """`python -m <module>` (a tests._*_main driver with its own cluster) in a fresh interpreter: its facts (from
    its background run if its test module declared it: NOTE [ tests background commands ])."""
    if module not in _BACKGROUND.declared:
        background_main("-", module, timeout_s)
    return read_facts(run_command_once_more_if_ray_did_not_start(module))
