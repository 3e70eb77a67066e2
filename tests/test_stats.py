"""`loader.stats()`, the data-stall hint, Ray metrics and the timeline (NOTE [ raydl stats ]).

Controlled datasets give known figures: SleepyDataset sleeps 10 ms per sample, so a batch of 8
takes ~80 ms in its worker. Tolerances are wide enough for a shared, noisy 2-core machine, and
narrow enough that a wrong figure (a stall counted where there is none, a batch time off by a
factor) fails.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import time
import urllib.request

import pytest
import torch

import raydl
from raydl._measures import batch_nbytes
from raydl.driver.stats.snapshot import _percentile
from tests import _datasets as D

TIMEOUT_S = 60
SAMPLE_S = 0.01
BATCH = 8
BATCH_S = SAMPLE_S * BATCH  # ~80 ms per batch in a worker


def _hint_records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "raydl.stats" and "waited for data" in r.getMessage()]


def _run_epoch(loader, loop_s: float) -> int:
    n = 0
    for _ in loader:
        time.sleep(loop_s)
        n += 1
    return n


# --------------------------------------------------------------------------- figures and the hint


@pytest.mark.usefixtures("ray_session")
def test_slow_loop_shows_no_stall_and_per_worker_figures(caplog):
    """A loop slower than the data waits near 0 after its first batch; each worker shows ~80 ms per batch; no hint."""
    caplog.set_level(logging.INFO, logger="raydl.stats")
    n_batches = 10
    loader = raydl.DataLoader(
        D.SleepyDataset(n_batches * BATCH, SAMPLE_S),
        batch_size=BATCH,
        num_workers=2,
        persistent_workers=True,
        timeout=TIMEOUT_S,
    )
    with loader:
        assert loader.stats() is None  # before the first iteration
        assert _run_epoch(loader, 0.0) == n_batches  # epoch 0: start-up, and a loop that waits (a hint may come)
        caplog.clear()
        assert _run_epoch(loader, 0.1) == n_batches  # loop 100 ms > data 40 ms per batch (2 workers)
        s = loader.stats()
        records = {r.worker_id: r for r in loader.worker_records}
    assert s.finished and s.epoch == 1 and s.batches == n_batches and s.samples == n_batches * BATCH
    assert s.wall_s >= n_batches * 0.1
    # the loop is 5x slower than the data: it barely waits (bounds leave room for a loaded machine's round trips)
    assert s.steady_wait_share < 0.15, str(s)
    assert s.wait_share < 0.3, str(s)  # the first batch's ~80 ms is the only real wait
    assert [w.worker_id for w in s.workers] == [0, 1]
    for w in s.workers:
        assert w.batches == n_batches // 2 and w.samples == w.batches * BATCH
        # sleeps of BATCH_S: never shorter; longer by what a loaded machine's scheduling adds
        assert 0.9 * BATCH_S <= w.median_s <= 3 * BATCH_S, str(s)
        assert w.median_s <= w.p95_s <= w.busy_s  # one batch's time, never more than the worker's whole epoch's
        assert w.cpu_s < 0.5 * w.busy_s  # sleeping, not computing
        assert w.bytes == w.batches * BATCH * 2 * 8  # int64 [i, thread] per sample
        assert (w.pid, w.node_ip) == (records[w.worker_id].pid, records[w.worker_id].node_ip)
        assert w.restarts == 0
        assert w.total_batches == 2 * w.batches
    assert s.total.epochs == 2 and s.total.batches == 2 * n_batches
    assert s.batches_in_flight == 0 and s.store_bytes_held == 0
    assert not _hint_records(caplog), [r.getMessage() for r in caplog.records]
    table = str(s)
    assert "median ms" in table and table.count("127.0.0.1") == 2


@pytest.fixture
def short_epochs_hint(monkeypatch):
    """The hint's minimum epoch (100 batches, 5 s) lowered, so a test's short epochs can show it."""
    from raydl.driver.stats import report as _stats_report

    monkeypatch.setattr(_stats_report, "HINT_MIN_BATCHES", 2)
    monkeypatch.setattr(_stats_report, "HINT_MIN_EPOCH_S", 0.0)


@pytest.mark.usefixtures("ray_session", "short_epochs_hint")
def test_fast_loop_stall_matches_and_hint_is_logged(caplog):
    """A loop faster than the data waits ~(data - loop) / data of the epoch, and one hint line says what would help;
    a later epoch of the same loader stalling as much gives none (once per loader)."""
    caplog.set_level(logging.INFO, logger="raydl.stats")
    n_batches, loop_s = 12, 0.02
    # a started worker for the loader to reuse: the epoch measures the loop against steady batches, not a process's
    # start (a just-started worker's batch took 1.08 s in a CI run, and the share went to 0.90)
    assert len(list(raydl.DataLoader(D.SleepyDataset(2 * BATCH, 0.0), batch_size=BATCH, num_workers=1))) == 2
    caplog.clear()
    loader = raydl.DataLoader(
        D.SleepyDataset(n_batches * BATCH, SAMPLE_S),
        batch_size=BATCH,
        num_workers=1,
        timeout=TIMEOUT_S,
        ray_name="fast_loop",
    )
    assert _run_epoch(loader, loop_s) == n_batches
    s = loader.stats()
    expected = (BATCH_S - loop_s) / BATCH_S  # 0.75
    assert expected - 0.12 <= s.steady_wait_share <= expected + 0.1, str(s)
    assert s.name == "fast_loop" and s.workers[0].batches == n_batches
    hints = _hint_records(caplog)
    assert len(hints) == 1, [r.getMessage() for r in caplog.records]
    msg = hints[0].getMessage()
    assert "'fast_loop'" in msg and "ray_threads_per_worker" in msg  # sleeping workers: threads help
    caplog.clear()
    assert _run_epoch(loader, loop_s) == n_batches
    assert loader.stats().steady_wait_share > 0.4 and not _hint_records(caplog)


def test_no_hint_after_a_short_epoch(caplog):
    """With the shipped thresholds an epoch under 100 batches or 5 s gives no hint, however much the loop waited."""
    from raydl.driver.stats.report import hint

    caplog.set_level(logging.INFO, logger="raydl.stats")
    stats = _fake_stats(busy_s=0.9, cpu_s=0.1)
    assert stats.steady_wait_share > 0.2
    assert hint(stats, 1, lambda: (2.0, 0.0)) is False and not caplog.records
    long = dataclasses.replace(stats, batches=100, wall_s=5.0, wait_s=3.0)
    assert hint(long, 1, lambda: (2.0, 0.0)) is True and len(caplog.records) == 1


@pytest.mark.usefixtures("ray_session", "short_epochs_hint")
def test_hint_names_a_slow_worker_and_can_be_silenced(caplog):
    """One worker much slower than the others is named in the hint; setLevel(WARNING) on raydl.stats silences it."""
    caplog.set_level(logging.INFO, logger="raydl.stats")
    n = 6 * BATCH
    # worker 1 gets batches 1, 3, 5 (round robin): 30 ms per sample there, 5 ms elsewhere
    delays = {i: (0.03 if (i // BATCH) % 2 else 0.005) for i in range(n)}
    loader = raydl.DataLoader(D.SlowDataset(n, delays), batch_size=BATCH, num_workers=2, timeout=TIMEOUT_S)
    assert _run_epoch(loader, 0.0) == 6
    msgs = [r.getMessage() for r in _hint_records(caplog)]
    assert len(msgs) == 1 and "worker 1 (pid" in msgs[0] and "slowest" in msgs[0], msgs
    logging.getLogger("raydl.stats").setLevel(logging.WARNING)
    try:
        caplog.clear()
        assert _run_epoch(loader, 0.0) == 6
        assert not _hint_records(caplog)
    finally:
        logging.getLogger("raydl.stats").setLevel(logging.INFO)


@pytest.mark.usefixtures("ray_session")
def test_replaced_worker_shows_its_restart():
    """A worker killed mid-epoch is replaced: its row shows 1 restart and the new pid; every batch is counted."""
    n_batches = 12
    loader = raydl.DataLoader(D.SleepyDataset(n_batches * 2, 0.02), batch_size=2, num_workers=2, timeout=TIMEOUT_S)
    it = iter(loader)
    next(it)
    old_pid = it.worker_records[1].pid
    os.kill(old_pid, signal.SIGKILL)
    assert 1 + sum(1 for _ in it) == n_batches
    s = loader.stats()
    w1 = s.workers[1]
    assert (s.workers[0].restarts, w1.restarts) == (0, 1)
    assert w1.pid != old_pid and w1.pid > 0
    assert s.batches == n_batches and sum(w.batches for w in s.workers) >= n_batches


# --------------------------------------------------------------------------- timeline


@pytest.mark.usefixtures("ray_session")
def test_timeline_trace_has_one_track_per_worker_and_png(tmp_path):
    """The Chrome trace is valid JSON with one named track per worker holding its batch spans, and the loop's waits; the PNG is written."""
    pytest.importorskip("matplotlib")
    n_batches = 9
    loader = raydl.DataLoader(D.SleepyDataset(n_batches * 4, 0.005), batch_size=4, num_workers=3, timeout=TIMEOUT_S)
    _run_epoch(loader, 0.0)
    paths = loader.stats().timeline(str(tmp_path / "epoch.json"))
    assert paths == [str(tmp_path / "epoch.json"), str(tmp_path / "epoch.png")]
    with open(paths[0]) as f:
        doc = json.load(f)
    events = doc["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    worker_tids = {tid for tid, name in names.items() if name.startswith("worker ")}
    assert len(worker_tids) == 3
    spans = [e for e in events if e["ph"] == "X"]
    per_tid: dict = {}
    for e in spans:
        per_tid.setdefault(e["tid"], []).append(e)
        assert e["dur"] >= 0 and e["ts"] >= -1e5  # within the epoch (worker clocks: same machine)
    assert {tid: len(per_tid.get(tid, [])) for tid in worker_tids} == {tid: 3 for tid in worker_tids}
    loop_tid = next(tid for tid, name in names.items() if name.startswith("training loop"))
    assert len(per_tid[loop_tid]) >= n_batches  # one wait per next() (and the one that ended the epoch)
    with open(paths[1], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(paths[1]) > 2000


# --------------------------------------------------------------------------- Ray metrics


def _prometheus_text() -> str:
    import ray

    node = next(n for n in ray.nodes() if n["Alive"])
    url = f"http://127.0.0.1:{node['MetricsExportPort']}/metrics"
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()


def _metric_sum(text: str, name: str, loader: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and f'loader="{loader}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.mark.skipif(os.environ.get("RAYDL_TEST_NO_DASHBOARD") == "1", reason="Ray without its metrics agent")
@pytest.mark.usefixtures("ray_session")
def test_metrics_reach_rays_prometheus_endpoint():
    """Counters and histograms tagged with the loader's name appear on Ray's Prometheus endpoint (127.0.0.1)."""
    n_batches = 6
    loader = raydl.DataLoader(
        D.SleepyDataset(n_batches * 4, 0.002), batch_size=4, num_workers=2, timeout=TIMEOUT_S, ray_name="metrics_test"
    )
    assert _run_epoch(loader, 0.0) == n_batches
    # Ray exports every metrics_report_interval_ms (tests/conftest.py lowers it to 2 s): bounded wait
    deadline = time.monotonic() + 30
    wanted = {
        "ray_raydl_batches_total": n_batches,
        "ray_raydl_samples_total": n_batches * 4,
        "ray_raydl_batch_seconds_count": n_batches,
        "ray_raydl_epochs_total": 1,
    }
    seen: dict = {}
    while time.monotonic() < deadline:
        text = _prometheus_text()
        seen = {name: _metric_sum(text, name, "metrics_test") for name in wanted}
        if seen == wanted and "ray_raydl_wait_seconds_total{" in text:
            break
        time.sleep(0.5)
    assert seen == wanted, seen
    assert _metric_sum(text, "ray_raydl_batch_bytes_total", "metrics_test") == n_batches * 4 * 16


# --------------------------------------------------------------------------- switches and units


@pytest.mark.usefixtures("ray_session")
def test_stats_off_changes_nothing_but_stats():
    """ray_stats=False: same batches; stats() says it is off."""
    loader = raydl.DataLoader(D.RangeDataset(10), batch_size=3, num_workers=2, ray_stats=False, timeout=TIMEOUT_S)
    assert [b.flatten().tolist() for b in loader] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    with pytest.raises(RuntimeError, match="ray_stats=False"):
        loader.stats()


def test_stats_options_are_validated():
    with pytest.raises(TypeError, match="ray_stats should be True or False"):
        raydl.DataLoader(D.RangeDataset(4), num_workers=1, ray_stats="yes")
    with pytest.raises(ValueError, match="ray_name should be a non-empty str"):
        raydl.DataLoader(D.RangeDataset(4), num_workers=1, ray_name="")
    with pytest.raises(RuntimeError, match="num_workers=0"):
        raydl.DataLoader(D.RangeDataset(4)).stats()


def test_batch_nbytes_and_percentile():
    from raydl.worker.transfer import encode

    batch = encode(
        {"x": torch.zeros(4, 8, dtype=torch.float32), "y": [torch.zeros(3, dtype=torch.int64), "ab"], "n": 5}
    )
    assert batch_nbytes(batch) == 4 * 8 * 4 + 3 * 8 + 2
    assert _percentile([], 50) == 0.0
    xs = sorted(float(i) for i in range(1, 101))
    assert (_percentile(xs, 50), _percentile(xs, 95), _percentile(xs, 100)) == (50.0, 95.0, 100.0)


def test_pin_spans_and_waits_reach_the_trace(tmp_path):
    """The recorder's own logic, without Ray: next() spans are waits, pin-thread calls a pin track, batches per worker."""
    from raydl.driver.stats.recorder import StatsRecorder
    from raydl.worker.actor import BatchMeta

    rec = StatsRecorder("unit")  # fed by events only: no pool, no schedule sent here
    rec._next_flush = float("inf")  # no Ray metrics in this test
    rec.begin_epoch()
    pin = rec.timed_pin(lambda x: (time.sleep(0.002), x)[1])
    now = time.time()
    for k in range(4):
        rec.batch_made(BatchMeta(k % 2, k, now + 0.01 * k, 0.01, samples=3, nbytes=100, cpu_s=0.001))
        with rec.next_call():
            pin(k)
    s = rec.snapshot()
    assert (s.batches, s.samples, s.batches_in_flight) == (4, 12, 0)
    assert [(w.worker_id, w.batches, w.bytes) for w in s.workers] == [(0, 2, 200), (1, 2, 200)]
    assert s.wait_s >= 4 * 0.002
    doc_path = s.timeline(str(tmp_path / "t.json"))[0]
    with open(doc_path) as f:
        events = json.load(f)["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    pin_tid = next(t for t, n in names.items() if n == "pin / device copy")
    assert sum(1 for e in events if e["ph"] == "X" and e["tid"] == pin_tid) == 4
    assert rec.snapshot().batches_in_flight == 0  # no schedule was sent (`watch`): nothing in flight to count


def _fake_stats(busy_s: float, cpu_s: float, medians=(0.05, 0.05)) -> "raydl.LoaderStats":
    from raydl.driver.stats.snapshot import LoaderStats, StatsTotals, WorkerStats

    workers = tuple(
        WorkerStats(
            worker_id=i,
            node_ip="10.0.0.1",
            node_id="n",
            pid=100 + i,
            batches=10,
            samples=80,
            median_s=m,
            p95_s=m,
            busy_s=busy_s,
            cpu_s=cpu_s,
            bytes=0,
            restarts=0,
            total_batches=10,
            total_bytes=0,
            total_busy_s=busy_s,
        )
        for i, m in enumerate(medians)
    )
    return LoaderStats(
        name="fake",
        epoch=0,
        finished=True,
        batches=20,
        samples=160,
        wall_s=1.0,
        wait_s=0.6,
        workers=workers,
        batches_in_flight=0,
        store_bytes_held=0,
        total=StatsTotals(1, 20, 160, 1.0, 0.6),
        first_batch_s=0.1,
        _first_wait_s=0.1,
    )


@pytest.mark.usefixtures("short_epochs_hint")
def test_hint_branches_and_stderr_fallback(caplog, capsys):
    """The hint's advice follows where the time goes; without any logging handler it is printed to stderr."""
    from raydl.driver.stats.report import hint, logger

    caplog.set_level(logging.INFO, logger="raydl.stats")
    cpus = lambda: (16.0, 12.0)  # noqa: E731
    cases = [
        (_fake_stats(busy_s=0.1, cpu_s=0.1), "only 10% of the epoch"),  # idle workers: not theirs to fix
        (_fake_stats(busy_s=0.9, cpu_s=0.1), "ray_threads_per_worker=8"),  # waiting on I/O
        (_fake_stats(busy_s=0.9, cpu_s=0.85), "the cluster has 16 CPUs (12 unreserved) for 2 workers"),
        (_fake_stats(busy_s=0.9, cpu_s=0.85, medians=(0.05, 0.2)), "worker 1 (pid 101, node 10.0.0.1) is the slowest"),
    ]
    for stats, expected in cases:
        caplog.clear()
        hint(stats, 1, cpus)
        assert len(caplog.records) == 1 and expected in caplog.records[0].getMessage(), caplog.records
    caplog.clear()
    hint(_fake_stats(busy_s=0.9, cpu_s=0.85), 1, lambda: (2.0, 0.0))
    assert "CPU-bound and the cluster's 2 CPUs are taken" in caplog.records[0].getMessage()
    propagate = logger.propagate
    logger.propagate = False  # no handler anywhere: Python would drop an INFO record
    try:
        capsys.readouterr()
        hint(_fake_stats(busy_s=0.9, cpu_s=0.1), 1, cpus)
        assert "waited for data 56% of epoch 0" in capsys.readouterr().err
    finally:
        logger.propagate = propagate
