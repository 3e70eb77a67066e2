"""Stalls, bad input, interrupts, memory pressure and many loader cycles: clear errors, nothing leaked."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap

import pytest

import raydl
from tests import _datasets as D
from tests._session import REPO, fresh_env, run_python
from tests._session import alive_worker_actors as _alive_workers
from tests._session import settled_alive_worker_actors as _settled_alive_workers
from tests._session import wait_until as _wait_until

TIMEOUT_S = 60


def test_stalled_batch_is_reported(ray_session, monkeypatch):
    """timeout=0: a batch stuck far longer than its peers is reported with its worker and indices, and still arrives."""
    import raydl._constants as C

    monkeypatch.setattr(C, "STALL_WARN_MIN_S", 1.0)
    loader = raydl.DataLoader(D.SlowDataset(8, {5: 3.0}), batch_size=1, num_workers=2)
    with pytest.warns(RuntimeWarning, match=r"batch 5 \(indices \[5\]\) has been outstanding .* raydl worker 1"):
        batches = [int(b) for b in loader]
    assert batches == list(range(8))


def test_sampler_index_the_dataset_rejects(ray_session):
    """A sampler yielding an index the dataset rejects: the dataset's own IndexError, naming worker and indices."""
    loader = raydl.DataLoader(D.ListDataset(5), sampler=[0, 1, 9, 2], batch_size=2, num_workers=2, timeout=TIMEOUT_S)
    it = iter(loader)
    assert next(it).tolist() == [0, 1]
    with pytest.raises(IndexError, match=r"raydl worker 1 .*batch 1 \(indices \[9, 2\]\)") as info:
        next(it)
    assert "list index out of range" in str(info.value)


@pytest.mark.parametrize("source", ["ray_address", "RAY_ADDRESS"])
def test_address_pointing_nowhere_fails_fast(source):
    """ray_address / RAY_ADDRESS naming no cluster: a ConnectionError naming it and the fix, within seconds."""
    arg = ', ray_address="127.0.0.1:9"' if source == "ray_address" else ""
    proc = run_python(
        f"""
        import time, raydl
        from tests import _datasets as D
        t0 = time.monotonic()
        try:
            list(raydl.DataLoader(D.RangeDataset(4), num_workers=1{arg}))
        except ConnectionError as e:
            print("ERR", round(time.monotonic() - t0, 1), e)
        """,
        env_extra={"RAY_ADDRESS": "127.0.0.1:9"} if source == "RAY_ADDRESS" else None,
        timeout_s=60,
    )
    assert "ERR" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("ERR"))
    assert float(line.split()[1]) < 30
    assert "127.0.0.1:9" in line and source in line and "Fix:" in line


def test_interrupted_driver_leaves_no_actor(ray_session):
    """A driver process interrupted (SIGINT) or exiting mid-epoch on a shared cluster leaves no worker behind (the two
    drivers run side by side, each with its own persistent workers)."""
    import ray

    base = _settled_alive_workers()
    env = fresh_env(
        {
            "RAY_ADDRESS": ray.get_runtime_context().gcs_address,
            "RAY_AUTH_MODE": "token",
            # a driver joining a loopback cluster must not rewrite 127.0.0.1 to the routable IP
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        }
    )
    procs = {}
    for how, stop in (("sigint", "os.kill(os.getpid(), signal.SIGINT)"), ("exit", "sys.exit(3)")):
        code = f"""
            import os, signal, sys, raydl
            from tests import _datasets as D
            # Ctrl-C raises KeyboardInterrupt, as in a terminal, even when the suite was started in the background
            # (a shell starts background commands with SIGINT ignored, and a child inherits that)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            loader = raydl.DataLoader(D.SlowDataset(64, {{i: 0.2 for i in range(64)}}), batch_size=2, num_workers=3,
                                      persistent_workers=True)
            for i, batch in enumerate(loader):
                print("batch", i, flush=True)
                if i == 2:
                    {stop}
            """
        procs[how] = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(code)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    outs = {}
    try:
        for how, proc in procs.items():
            outs[how] = proc.communicate(timeout=360)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    for how, proc in procs.items():
        stdout, stderr = outs[how]
        detail = (how, proc.returncode, stdout[-2000:] + stderr[-3000:])
        assert "batch 2" in stdout and "batch 3" not in stdout, detail  # each stopped where it was told to
        assert proc.returncode != 0, detail
    assert "KeyboardInterrupt" in outs["sigint"][1], outs["sigint"][1][-3000:]
    assert procs["exit"].returncode == 3, outs["exit"][1][-3000:]
    assert _wait_until(lambda: _alive_workers() <= base, timeout_s=45)


def test_two_hundred_cycles_leave_resources_and_memory_where_they_began(ray_session):
    """200 cycles of create / iterate partly / drop (1 or 2 workers, shuffled): no actor, object, Ray resource or
    raydl thread leaked; driver RSS flat."""
    import threading

    import psutil
    import ray
    from ray.util.state import list_objects

    def cycle(i):
        loader = raydl.DataLoader(
            D.RangeDataset(64), batch_size=4, num_workers=1 + i % 2, shuffle=True, timeout=TIMEOUT_S
        )
        it = iter(loader)
        for _ in range(i % 4):
            next(it)
        del it, loader

    for i in range(20):  # warm up: imports, warm pool, caches
        cycle(i)
    gc.collect()
    base_workers = _settled_alive_workers()
    base_resources = ray.available_resources()
    address = ray.get_runtime_context().gcs_address
    base_objects = len(list_objects(address=address, raise_on_missing_output=False))
    base_threads = threading.active_count()
    rss0 = psutil.Process().memory_info().rss
    for i in range(200):
        cycle(i)
    gc.collect()
    rss1 = psutil.Process().memory_info().rss
    assert _wait_until(lambda: _alive_workers() <= base_workers, timeout_s=60)
    assert _wait_until(lambda: len(list_objects(address=address, raise_on_missing_output=False)) <= base_objects)
    after = ray.available_resources()
    assert {k: v for k, v in after.items() if k != "object_store_memory"} == {
        k: v for k, v in base_resources.items() if k != "object_store_memory"
    }
    assert threading.active_count() <= base_threads
    assert not [t for t in threading.enumerate() if t.name == "raydl_pin"]
    assert rss1 - rss0 < 0.05 * rss0 + 30 * 1024**2, f"driver RSS grew {(rss1 - rss0) / 1024**2:.1f} MiB"


def test_batches_larger_than_the_object_store_comfortably_holds(ray_session):
    """Batches of 48 MB with 4 in flight against a 200 MB store: spilling or back-pressure, never a crash or loss."""
    loader = raydl.DataLoader(D.BigSampleDataset(24, mb=12), batch_size=4, num_workers=2, timeout=120)
    it = iter(loader)
    sums = []
    for batch in it:
        assert it._sched.tasks_outstanding <= 2 * 2
        sums.append(float(batch[:, 0].sum()))
        del batch
    assert sums == [float(sum(range(i, i + 4))) for i in range(0, 24, 4)]
