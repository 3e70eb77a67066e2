"""The namespace cluster (cluster/netns_testbed.py) for tests: a module-scoped fixture factory and a driver runner.

`namespace_cluster(**kwargs)` is a generator for a `scope="module"` fixture: it skips (with the reason) where network
namespaces cannot be made, starts the cluster with a tag of this process (`p<pid>`, so concurrent sessions never
meet), and always tears it down; a reaper process of its own tears it down if pytest dies without its
finalizers (SIGKILL, a lost terminal), and the next session sweeps what a dead session's reaper could not
(NOTE [ netns cluster teardown ] in cluster/netns_testbed.py). `run_driver` runs a tests._netns_main scenario in the
head's namespace, bounded in time, and returns its facts.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys

import pytest

from tests._session import REPO, read_facts


def _load():
    spec = importlib.util.spec_from_file_location("netns_testbed", os.path.join(REPO, "cluster", "netns_testbed.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("netns_testbed", module)
    spec.loader.exec_module(module)
    return module


netns = _load()


def namespace_cluster(index: int = 0, **kwargs):
    """Yields a started NetnsCluster (tag `p<pid>x<index>`: one per module at a time); skips where it cannot be made."""
    why = netns.can_make_namespaces()
    if why is not None:
        pytest.skip(f"namespace cluster: {why}")
    netns.sweep_orphans()
    cluster = netns.NetnsCluster(tag=f"p{os.getpid()}x{index}", **kwargs)
    try:
        cluster.start(reaper=True)
        yield cluster
    finally:
        cluster.stop()


def run_driver(cluster, scenario: str, timeout_s: float, module: str = "tests._netns_main") -> dict:
    """`python -m MODULE SCENARIO` (tests._netns_main by default) in the head's namespace with the cluster's driver
    environment; killed (its process group) past `timeout_s`, which fails the test with its output."""
    env = dict(cluster.driver_env(), PYTHONPATH=REPO, RAYDL_NETNS_STATE=cluster.root)
    proc = subprocess.Popen(
        [*cluster.exec_prefix(0), sys.executable, "-m", module, scenario],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        err += f"\n[tests/_netns.py: the driver was killed after {timeout_s} s]"
    return read_facts(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
