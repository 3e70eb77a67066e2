"""One Ray session shared by the whole suite, on loopback, sized for a 2-core machine."""

from __future__ import annotations

import os

# Before Ray is imported: a local Ray then binds 127.0.0.1 only (see raydl/cluster/connect.py).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# Ray exports metrics every 10 s by default; tests/test_stats.py reads raydl's back from Ray's
# Prometheus endpoint, with a bounded wait.
os.environ.setdefault("RAY_metrics_report_interval_ms", "2000")
# Every Ray the suite starts (this session, the ray.cluster_utils clusters of the fresh drivers,
# cluster/local_launcher.sh) runs its workers at the test process's niceness, as raydl's own local
# Ray does (NOTE [ raydl worker niceness ]). At Ray's default (+15) any busy process on a shared CI
# machine starves them, and the suite's bounded waits become failures.
os.environ.setdefault("RAY_worker_niceness", "0")
# Ray's log monitor globs the session's log folder for new worker logs every 0.1 s while it holds fewer than
# RAY_LOG_MONITOR_MANY_FILES_THRESHOLD (1,000) files, every 0.5 s past it. The suite's Ray gathers hundreds of
# worker logs: its log monitor was 72 of the suite's ~2,800 core-s (tests/suite_cost.py); at 0.5 s from the start
# it used 2.7 core-s where it used 5.0 over tests/test_recovery.py and test_lifecycle.py. A new worker's first
# lines reach the driver up to 0.5 s later; no test reads them sooner.
os.environ.setdefault("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD", "0")

# A loader iterated in a process with no Ray yet makes its first batches in that process (NOTE [ raydl cold
# start ]): the default, which the fresh drivers (the examples, the README's commands) run with. In pytest's own
# process loaders default to ray_cold_start=False (`pytest_configure`): its tests check what workers do, and one
# that iterates before another built the suite's Ray (`ray_session`) would otherwise make its batches here.

import pytest  # noqa: E402


def pytest_addoption(parser):
    parser.addoption(
        "--ray-batches-per-call",
        default=None,
        help="run every raydl.DataLoader built in this process with this ray_batches_per_call by default "
        "(an int forces several batches per actor call; NOTE [ raydl calls ]): the parity and property tests "
        "must pass unchanged with it",
    )
    parser.addoption(
        "--no-ray-lane",
        action="store_true",
        help="run every raydl.DataLoader built in this process with ray_lane=False by default (every call through "
        "Ray, NOTE [ raydl lane ]): the parity, property and recovery tests pass either way",
    )


def _compile_sources() -> None:
    """Write the bytecode of raydl/ and tests/ once, in this process.

    NOTE [ tests bytecode ]: every Ray worker and fresh driver the suite starts (hundreds) imports raydl and the
    tests' datasets from source. Where PYTHONDONTWRITEBYTECODE is set (CI machines set it) no process caches what
    it compiled, and each compiles those modules again: about 55 ms of CPU a worker, 0.3 s a fresh driver, on this
    2-core machine. Reading .pyc files is not affected by that variable, so one compile here serves them all."""
    import compileall

    from tests._session import REPO

    for sub in ("raydl", "tests"):
        compileall.compile_dir(os.path.join(REPO, sub), quiet=2)


def pytest_configure(config):
    from raydl.loader import DataLoader

    _compile_sources()
    DataLoader.__init__.__kwdefaults__["ray_cold_start"] = False  # this process only (see above)
    if config.getoption("--no-ray-lane"):
        DataLoader.__init__.__kwdefaults__["ray_lane"] = False
    k = config.getoption("--ray-batches-per-call")
    if k is not None:
        DataLoader.__init__.__kwdefaults__["ray_batches_per_call"] = k if k == "auto" else int(k)


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray with 2 CPUs, a 200 MB object store and the dashboard (for the state API leak checks)."""
    import ray

    if not ray.is_initialized():
        ray.init(
            address="local",
            num_cpus=2,
            num_gpus=0,
            object_store_memory=200 * 1024**2,
            # The leak checks read Ray's state API, which needs the dashboard; RAYDL_TEST_NO_DASHBOARD=1
            # runs the rest on a minimal Ray (e.g. the GPU-only tests on a machine with a slim Ray).
            include_dashboard=os.environ.get("RAYDL_TEST_NO_DASHBOARD") != "1",
        )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def joined_ray(ray_session):
    """`run_python`'s env_extra to join the suite's own Ray (NOTE [ tests joined cold starts ] in tests/_session.py):
    the cold starts of fresh drivers without a Ray start each."""
    import raydl

    raydl.release_idle_workers()  # this process's warm workers are not the fresh driver's to count or reuse
    # RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0: without it the driver's ray.init rewrites 127.0.0.1 to the machine's
    # routable IP, where this loopback-only Ray does not listen (the driver then waits out its timeout).
    return {
        "RAY_ADDRESS": ray_session.get_runtime_context().gcs_address,
        "RAY_AUTH_MODE": "token",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    }


@pytest.fixture
def unpatched():
    """The test starts and ends with torch's own DataLoader iteration, whatever it patched."""
    import raydl

    raydl.unpatch()
    yield
    raydl.unpatch()


@pytest.fixture(scope="module")
def release_warm_workers_after_module():
    """Idle warm workers (and node caches) are released when the module ends, so later tests find the cluster as it was."""
    yield
    import raydl
    from tests._session import end_node_caches

    raydl.release_idle_workers()
    end_node_caches()


def pytest_collection_finish(session):
    """Fresh drivers the selected tests read start in the background (NOTE [ tests background commands ])."""
    if not session.config.option.collectonly:
        from tests._session import start_background

        start_background([item.nodeid for item in session.items])


# RAYDL_TEST_PROFILE=1: per test (setup, call and teardown together) the machine's busy core-seconds and the worker
# processes the suite's Ray started (one per actor or task worker: each imports torch), and the workers per module
# (the sum of its tests'), printed at the end of the run. The suite is CPU-bound on 2 cores, so core-seconds are
# what a cut saves; process starts are their largest share. RAYDL_TEST_PROFILE_FILE=path also appends each test's
# end time and costs there as a JSON line: tests/suite_cost.py charges every process's CPU to what started it
# (NOTE [ tests suite cost ]).
_TEST_COSTS: dict[str, tuple[str, float, int]] = {}  # node id -> (module, core-seconds, worker processes)


def _worker_processes_started(since: tuple[str, int] | None = None) -> tuple[str, int]:
    """(the suite's Ray session, its worker processes so far), or how many started `since` an earlier look (all of
    the session's when a test ended the Ray of that look and began another)."""
    import glob

    import ray

    if not ray.is_initialized():
        now = ("", 0)
    else:
        session_dir = ray._private.worker._global_node.get_session_dir_path()
        now = (session_dir, len(glob.glob(os.path.join(session_dir, "logs", "python-core-worker-*.log"))))
    if since is None:
        return now
    return now[0], now[1] - (since[1] if since[0] == now[0] else 0)


def _machine_core_seconds() -> float:
    """The machine's busy CPU time so far (every process, from /proc/stat), in core-seconds; 0 without /proc."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return 0.0
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle and iowait
    return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if os.environ.get("RAYDL_TEST_PROFILE") != "1":
        yield
        return
    cpu, workers = _machine_core_seconds(), _worker_processes_started()
    yield
    cost = (item.nodeid.split("::")[0], _machine_core_seconds() - cpu, _worker_processes_started(workers)[1])
    _TEST_COSTS[item.nodeid] = cost
    if os.environ.get("RAYDL_TEST_PROFILE_FILE"):  # each test's end, for tests/suite_cost.py
        import json
        import time

        with open(os.environ["RAYDL_TEST_PROFILE_FILE"], "a") as f:
            f.write(
                json.dumps({"nodeid": item.nodeid, "t1": time.time(), "core_s": cost[1], "workers": cost[2]}) + "\n"
            )


def pytest_terminal_summary(terminalreporter):
    if not _TEST_COSTS:
        return
    terminalreporter.write_sep("=", "the machine's busy core-seconds and worker processes started, per test (top 40)")
    for nodeid, (_, cpu, n) in sorted(_TEST_COSTS.items(), key=lambda kv: -kv[1][1])[:40]:
        terminalreporter.write_line(f"{cpu:7.1f} core-s {n:4d} workers  {nodeid}")
    terminalreporter.write_line(f"{sum(c for _, c, _ in _TEST_COSTS.values()):7.1f} core-s in all")
    per_module: dict[str, int] = {}
    for module, _, n in _TEST_COSTS.values():
        per_module[module] = per_module.get(module, 0) + n
    terminalreporter.write_sep("=", "worker processes started in the suite's Ray, per module")
    for name, n in sorted(per_module.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{n:5d}  {name}")
    terminalreporter.write_line(f"{sum(per_module.values()):5d}  in all")
