"""raydl.start(): Ray and idle workers come up in the background and the next loader takes them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import raydl
from tests._session import REPO, background, fresh_env, read_facts, run_command


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_workers=-1), "num_workers should be an int between 0 and 16"),
        (dict(num_workers=17), "num_workers should be an int between 0 and 16"),
        (dict(num_workers="2"), "num_workers should be an int"),
        (dict(num_workers=True), "num_workers should be an int"),
        (dict(num_workers=2, ray_remote_args={"num_cpus": 1}), "reserve .*CPU.* Fix: drop num_cpus"),
        (dict(num_workers=2, ray_remote_args={"resources": {"data": 1}}), "only workers that reserve no Ray resources"),
    ],
)
def test_bad_arguments_raise_before_anything_starts(kwargs, match):
    """Bad arguments raise ValueError at the call, naming the problem (and nothing is started)."""
    with pytest.raises(ValueError, match=match):
        raydl.start(**kwargs)


def test_bad_remote_args_type_raises_like_a_loader():
    """ray_remote_args that is not a mapping is refused with the loader's own error."""
    with pytest.raises((TypeError, ValueError), match="ray_remote_args"):
        raydl.start(num_workers=1, ray_remote_args=["num_cpus", 0])


_SCRIPT = r"""
import json, os, time
import ray
import raydl
from raydl.cluster.startup import _warm_key
from raydl.cluster.connect import worker_actor_options
from raydl.cluster.warm import WARM_POOL
from tests import _datasets as D

os.nice(1)  # the workers of raydl's own Ray keep the driver's niceness (NOTE [ raydl worker niceness ])
facts = {"ray_before": ray.is_initialized(), "driver_nice": os.getpriority(os.PRIO_PROCESS, 0)}
try:
    raydl.start(num_workers=1, ray_address="127.0.0.1:1").wait(60)
except ConnectionError as e:
    facts["bad_address_error"] = str(e)
started = raydl.start(num_workers=2)
facts["returned_before_ray_up"] = not ray.is_initialized() or not started.done()
# A loader iterated at once, while the start is still in progress, takes the started workers (every batch from
# them: no cold start, whose first batches would come from this process, NOTE [ raydl cold start ]).
loader = raydl.DataLoader(D.PidDataset(8), batch_size=2, num_workers=2, timeout=60, ray_cold_start=False)
batches = list(loader)
started.wait(60)
facts["batches"] = [b[:, 0].tolist() for b in batches]
facts["loader_pids"] = sorted({int(b[0, 1]) for b in batches})
key = _warm_key(worker_actor_options(None), ray.get_runtime_context().get_node_id())  # placed per node
facts["gcs_host"] = ray.get_runtime_context().gcs_address.rsplit(":", 1)[0]
facts["node_ip"] = ray.util.get_node_ip_address()
facts["idle_after_loader"] = WARM_POOL.idle_count(key)
# Idempotent: tops up to num_workers idle workers with these options, starts nothing more.
raydl.start(num_workers=2).wait(60)
facts["idle_after_second_start"] = WARM_POOL.idle_count(key)
again = raydl.start(num_workers=3)
again.wait(60)
facts["started_by_third"] = again.started
facts["idle_after_third_start"] = WARM_POOL.idle_count(key)
pids = set()
for entry in list(WARM_POOL._idle[key]):
    pids.add(ray.get(entry.actor.__ray_call__.remote(lambda self: os.getpid()), timeout=60))
    facts["worker_nice"] = ray.get(entry.actor.__ray_call__.remote(lambda self: os.getpriority(os.PRIO_PROCESS, 0)))
facts["loader_pids_still_idle"] = sorted(set(facts["loader_pids"]) & pids)
# The local Ray raydl started binds 127.0.0.1 only: every Ray process's listening socket is on loopback.
import psutil
ray_pids = {p.pid for p in psutil.process_iter(["cmdline"])
            if any(("ray" in part and "raylet" in part) or "gcs_server" in part or "ray::" in part
                   for part in (p.info["cmdline"] or []))}
ray_pids |= {c.pid for c in psutil.Process().children(recursive=True)}
facts["ray_processes_checked"] = len(ray_pids)
facts["listening_beyond_loopback"] = [
    (conn.pid, str(conn.laddr)) for conn in psutil.net_connections(kind="inet")
    if conn.status == psutil.CONN_LISTEN and conn.pid in ray_pids
    and conn.laddr.ip not in ("127.0.0.1", "::ffff:127.0.0.1", "::1")
]
print("FACTS " + json.dumps(facts), flush=True)
raydl.release_idle_workers()
"""


# its fresh process (a local Ray of its own) runs in the background while the in-process tests run (NOTE [ tests
# background commands ] in tests/_session.py)
background(
    "tests/test_startup.py::test_start_brings_up_loopback_ray_and_hands_workers_to_the_next_loader",
    "startup_script",
    [sys.executable, "-c", _SCRIPT],
    fresh_env({"PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}),
    240,
)


def test_start_brings_up_loopback_ray_and_hands_workers_to_the_next_loader():
    """In a fresh process with no Ray and no address: start() returns before Ray is up, the local Ray it starts
    listens on 127.0.0.1 only (every Ray process's sockets), the loader uses the
    started workers (no extra ones), repeated calls only top the idle workers up, workers keep the driver's niceness."""
    proc = run_command("startup_script")
    facts = read_facts(proc)
    assert "SIGTERM handler is not set" not in proc.stderr
    assert facts["ray_before"] is False and facts["returned_before_ray_up"]
    assert "could not reach a Ray cluster at '127.0.0.1:1'" in facts["bad_address_error"]
    assert facts["batches"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert len(facts["loader_pids"]) == 2
    assert facts["gcs_host"] == "127.0.0.1" and facts["node_ip"] == "127.0.0.1"
    assert facts["ray_processes_checked"] > 0, "found no Ray processes to check"
    assert facts["listening_beyond_loopback"] == [], "Ray listens beyond loopback"
    assert facts["idle_after_loader"] == 2  # the loader's two workers went back: they were start()'s
    assert facts["idle_after_second_start"] == 2
    assert facts["started_by_third"] == 1 and facts["idle_after_third_start"] == 3
    assert facts["loader_pids_still_idle"] == facts["loader_pids"]
    assert facts["worker_nice"] == facts["driver_nice"]  # not Ray's +15: torch's workers run at the trainer's


def test_worker_process_imports_none_of_the_driver_modules():
    """A worker imports raydl.worker.actor only: not the loader, the patch or pyarrow (each idle worker's memory)."""
    code = (
        "import sys, raydl.worker.actor; "
        "print(sorted(m for m in ('raydl.loader', 'raydl.driver.iter', 'raydl.driver.patch', 'raydl.data.arrow', 'pyarrow') "
        "if m in sys.modules))"
    )
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]"
    # and the public names still resolve, lazily
    assert raydl.DataLoader.__module__ == "raydl.loader" and callable(raydl.start) and "ArrowDataset" in dir(raydl)


_RETRY_SCRIPT = r"""
import json, logging
import psutil
import ray._private.node as node_mod
import raydl
from tests import _datasets as D
from tests._ray_start_timeout import time_out_node_starts

# The first node raydl starts times out exactly as on an overloaded host (tests/_ray_start_timeout.py).
started, records, first_pids = [], [], set()
real_init = node_mod.Node.__init__
def counting_init(self, *args, **kwargs):
    started.append(self)
    return real_init(self, *args, **kwargs)
node_mod.Node.__init__ = counting_init
time_out_node_starts(
    active=lambda: len(started) == 1,
    on_time_out=lambda: first_pids.update(i.process.pid for infos in started[0].all_processes.values() for i in infos),
)

class Keep(logging.Handler):
    def emit(self, record):
        records.append(record.getMessage())
logging.getLogger("raydl").addHandler(Keep())

batches = [b.flatten().tolist() for b in raydl.DataLoader(D.RangeDataset(6), batch_size=3, num_workers=1, timeout=60)]
facts = {
    "nodes_started": len(started),
    "first_processes": len(first_pids),
    "first_alive": [p for p in first_pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"],
    "batches": batches,
    "warned": [m for m in records if "attempt 2 of 2" in m],
}
print("FACTS " + json.dumps(facts), flush=True)
"""

background(
    "tests/test_startup.py::test_local_start_retries_once_when_rays_raylet_wait_runs_out",
    "startup_retry_script",
    [sys.executable, "-c", _RETRY_SCRIPT],
    fresh_env({"PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}),
    240,
)


def test_local_start_retries_once_when_rays_raylet_wait_runs_out():
    """Ray's own start gives up after a fixed 30 s wait for its raylet (a busy host): raydl's local start kills that
    half-started node's processes and starts Ray once more, and the loader's batches come (NOTE [ raydl local start
    retry ]). Any other start error is not retried (test_connect's bad addresses)."""
    facts = read_facts(run_command("startup_retry_script"))
    assert facts["nodes_started"] == 2
    assert facts["first_processes"] >= 2, "the first node started no processes: the timeout was not Ray's real one"
    assert facts["first_alive"] == [], "the half-started node's processes were left running"
    assert facts["batches"] == [[0, 1, 2], [3, 4, 5]]
    assert len(facts["warned"]) == 1
