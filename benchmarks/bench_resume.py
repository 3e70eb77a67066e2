#!/usr/bin/env python3
"""What mid-epoch resume costs: state_dict() in the driver, steady-state throughput, first batch after a load.

    python -m benchmarks.bench_resume            # full run
    python -m benchmarks.bench_resume --quick    # smoke run

Measures (NOTE [ raydl checkpoint ] in raydl/driver/state/checkpoint.py):
  (a) `DataLoader.state_dict()` in the driver, mid-epoch, map-style, with 2 and 32 workers,
      for a dataset whose workers' RNG never moves and for one that draws from torch's RNG in
      every sample (every worker snapshot then carries ~13 KB of generator states);
  (b) the driver's per-batch bookkeeping (the Tracker's hooks), timed alone;
  (c) steady-state throughput (samples/s, epochs after the first) with worker RNG tracking on
      and off (RAYDL_TRACK_WORKER_RNG=0), on the CPU-bound and overhead-floor workloads of
      bench_throughput, the variants alternating over repetitions; medians and paired ratios;
  (d) first batch after `load_state_dict()` + `iter()` mid-epoch, next to what it consists of:
      the sampler fast-forward (drawing the indices of the batches already handed out) and a
      fresh loader's first batch (worker start, warm pool);
  (e) what a worker adds to each batch: reading its random/torch/NumPy generators (and, when
      they moved, encoding them), wall and CPU time, in one process without Ray
      (`--only-worker` runs just this).
Outputs: a Markdown report on stdout and JSON lines in benchmarks/results/.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch.utils.data import Dataset

import raydl
from benchmarks.common.machine import LoadMonitor, describe_machine, machine_info
from benchmarks.common.results import Results, log, md_table, median, percentile
from benchmarks.common.workloads import Workload, WorkloadDataset, calibrate_cpu_iters
from raydl.driver.state.checkpoint import Tracker
from raydl.worker.actor import BatchMeta


class NoisyWorkload(WorkloadDataset):
    """The workload's sample plus a draw from torch's global RNG (random augmentation)."""

    def __getitem__(self, i: int):
        x, label = super().__getitem__(i)
        return x + torch.rand(()), label


def _loader(ds: Dataset, workers: int, batch_size: int, **kw) -> raydl.DataLoader:
    return raydl.DataLoader(
        ds,
        batch_size=batch_size,
        num_workers=workers,
        shuffle=True,
        timeout=300,
        ray_startup_timeout_s=900,
        generator=torch.Generator().manual_seed(0),
        **kw,
    )


def bench_state_dict(res: Results, quick: bool) -> list:
    rows = []
    for workers in (2, 32):
        for noisy in (False, True):
            wl = Workload("trivial", "", 64 * 200, 64, "trivial")
            ds = NoisyWorkload(wl) if noisy else WorkloadDataset(wl)
            with _loader(ds, workers, 64, persistent_workers=True) as loader:
                it = iter(loader)
                for _ in range(3 * workers):  # every worker has handed out batches
                    next(it)
                ts = []
                for _ in range(50 if quick else 300):
                    t0 = time.perf_counter()
                    loader.state_dict()
                    ts.append(time.perf_counter() - t0)
                size = len(repr(loader.state_dict()))
            rec = {
                "bench": "state_dict",
                "workers": workers,
                "worker_rng": noisy,
                "median_us": median(ts) * 1e6,
                "p99_us": percentile(ts, 99) * 1e6,
                "state_chars": size,
            }
            res.write(rec)
            rows.append(
                [
                    workers,
                    "draws from torch's RNG" if noisy else "no RNG draws",
                    f"{rec['median_us']:.0f}",
                    f"{rec['p99_us']:.0f}",
                    f"{size / 1e3:.0f} k",
                ]
            )
            log(f"state_dict {rec}")
    return rows


class _FakeLoader:
    """What Tracker reads from a loader, for timing its hooks alone."""

    def __init__(self, n: int, workers: int) -> None:
        self.dataset = WorkloadDataset(Workload("trivial", "", n, 64, "trivial"))
        self.num_workers, self.batch_size, self.drop_last = workers, 64, False
        self.generator = torch.Generator().manual_seed(0)  # as DataLoader(shuffle=True, generator=g) holds it
        self.sampler = torch.utils.data.RandomSampler(range(n), generator=self.generator)
        self.batch_sampler = torch.utils.data.BatchSampler(self.sampler, 64, False)


def _bookkeeping_once() -> float:
    """Seconds of Tracker hooks per batch over one 2000-batch epoch (the sampler's own draws subtracted)."""
    fake = _FakeLoader(64 * 2000, 2)
    tracker = Tracker(fake, fake.batch_sampler, None)
    it = tracker.sampler_iter()
    tracker.resume_main(it, 0, None)
    tracker.start_epoch(it, first_iter=True, epoch=0)
    metas = [BatchMeta(w, 0, 0.0, 0.0) for w in range(2)]
    draws = []
    t0 = time.perf_counter()
    for idx in range(2000):
        t1 = time.perf_counter()
        next(it)
        draws.append(time.perf_counter() - t1)
        tracker.on_draw(idx, it)
        tracker.on_batch_made(idx, idx % 2, metas[idx % 2])
        tracker.on_handed_out()
    return (time.perf_counter() - t0) / 2000 - median(draws)


def bench_bookkeeping(res: Results) -> float:
    """(b) Median of 7 epochs: one epoch alone can catch a full collection of the benchmark's heap."""
    runs = [_bookkeeping_once() * 1e6 for _ in range(7)]
    res.write({"bench": "bookkeeping", "per_batch_us": median(runs), "runs_us": runs})
    log(f"bookkeeping {median(runs):.1f} us/batch (runs {min(runs):.1f}-{max(runs):.1f})")
    return median(runs)


def bench_worker_capture(res: Results) -> list:
    """(e) What a worker adds to each batch (no Ray): reading the generators, unchanged and changed."""
    from raydl.worker.state import RngTracker

    tracker = RngTracker()
    tracker.changed()
    rows = []
    for case, draw in (
        ("generators unchanged (sends nothing)", False),
        ("torch generator moved (sends its ~6.7 KB)", True),
    ):
        walls, cpus = [], []
        for _ in range(15):
            w0, c0 = time.perf_counter(), time.thread_time()
            for _ in range(500):
                if draw:
                    torch.rand(())
                tracker.changed()
            walls.append((time.perf_counter() - w0) / 500)
            cpus.append((time.thread_time() - c0) / 500)
        res.write(
            {"bench": "worker_capture", "case": case, "wall_us": median(walls) * 1e6, "cpu_us": median(cpus) * 1e6}
        )
        rows.append([case, f"{median(walls) * 1e6:.1f}", f"{median(cpus) * 1e6:.1f}"])
    return rows


def _epoch_rate(loader, n: int) -> float:
    t0 = time.perf_counter()
    for _ in loader:
        pass
    return n / (time.perf_counter() - t0)


def bench_throughput(res: Results, quick: bool) -> list:
    iters = calibrate_cpu_iters()
    workloads = [
        Workload("cpu", "CPU-bound ~1 ms/sample, batch 64", 64 * (8 if quick else 48), 64, "cpu", iters),
        Workload("trivial", "overhead floor: 16 floats, batch 64", 64 * (40 if quick else 640), 64, "trivial"),
    ]
    # Epochs of 2 s (CPU-bound) and ~1 s (overhead floor), 8 pairs: shorter ones (0.3 s) could not
    # tell 2 % from the machine's own drift, even quiet.
    reps = 2 if quick else 8
    rows = []
    for wl in workloads:
        rates: dict[str, list[float]] = {"on": [], "off": []}
        loaders = {}
        for variant in ("on", "off"):
            os.environ["RAYDL_TRACK_WORKER_RNG"] = "1" if variant == "on" else "0"
            loaders[variant] = _loader(NoisyWorkload(wl), 2, wl.batch_size, persistent_workers=True)
            list(loaders[variant])  # first epoch: start-up, excluded
        os.environ.pop("RAYDL_TRACK_WORKER_RNG", None)
        for r in range(reps):
            order = ("on", "off") if r % 2 == 0 else ("off", "on")
            for variant in order:
                with LoadMonitor() as mon:
                    rate = _epoch_rate(loaders[variant], wl.n)
                rates[variant].append(rate)
                res.write(
                    {
                        "bench": "throughput",
                        "workload": wl.name,
                        "tracking": variant,
                        "rep": r,
                        "samples_per_s": rate,
                        "foreign_cores": mon.foreign_cores,
                    }
                )
        for loader in loaders.values():
            loader.shutdown()
        ratios = [a / b for a, b in zip(rates["on"], rates["off"])]
        rows.append(
            [
                wl.description,
                f"{median(rates['on']):.0f}",
                f"{median(rates['off']):.0f}",
                f"{median(ratios):.3f}",
                f"{min(ratios):.3f}-{max(ratios):.3f}",
            ]
        )
        log(f"throughput {wl.name}: {rows[-1]}")
    return rows


def bench_first_batch(res: Results, quick: bool) -> list:
    n, bs, k = 64 * 400, 64, 300
    wl = Workload("trivial", "", n, bs, "trivial")
    rows = []
    for rep in range(2 if quick else 5):
        with _loader(WorkloadDataset(wl), 2, bs) as loader:
            it = iter(loader)
            for _ in range(k):
                next(it)
            state = loader.state_dict()
        sampler = torch.utils.data.RandomSampler(range(n), generator=torch.Generator().manual_seed(0))
        t0 = time.perf_counter()
        bit = iter(torch.utils.data.BatchSampler(sampler, bs, False))
        for _ in range(k):
            next(bit)
        ff_s = time.perf_counter() - t0
        with _loader(WorkloadDataset(wl), 2, bs) as loader:
            t0 = time.perf_counter()
            next(iter(loader))
            fresh_s = time.perf_counter() - t0
        with _loader(WorkloadDataset(wl), 2, bs) as loader:
            loader.load_state_dict(state)
            t0 = time.perf_counter()
            next(iter(loader))
            resumed_s = time.perf_counter() - t0
        res.write(
            {
                "bench": "first_batch",
                "rep": rep,
                "k": k,
                "fast_forward_s": ff_s,
                "fresh_first_batch_s": fresh_s,
                "resumed_first_batch_s": resumed_s,
            }
        )
        rows.append((ff_s, fresh_s, resumed_s))
    ff, fresh, resumed = (median([r[i] for r in rows]) for i in range(3))
    return [
        [
            f"{k} of {n // bs}",
            f"{ff * 1e3:.1f}",
            f"{fresh * 1e3:.1f}",
            f"{(ff + fresh) * 1e3:.1f}",
            f"{resumed * 1e3:.1f}",
        ]
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only-worker", action="store_true", help="only (e), the worker-side cost (no Ray)")
    args = parser.parse_args()
    res = Results("bench_resume", args.quick)
    worker_rows = bench_worker_capture(res)
    worker_md = [
        "## (e) per batch in a worker: reading the generators (one process, no Ray)",
        "",
        md_table(["case", "wall µs/batch", "CPU µs/batch"], worker_rows),
        "",
    ]
    if args.only_worker:
        print("\n".join(worker_md))
        res.close()
        return
    import ray

    ray.init(address="local", include_dashboard=False)
    info = machine_info(ray.__version__)
    out = [f"# bench_resume ({'quick' if args.quick else 'full'})", "", describe_machine(info), ""]
    out += [
        "## (a) state_dict() in the driver, mid-epoch",
        "",
        md_table(["workers", "dataset", "median µs", "p99 µs", "state size (repr)"], bench_state_dict(res, args.quick)),
        "",
    ]
    out += [
        "## (b) driver bookkeeping per batch (Tracker hooks alone)",
        "",
        f"{bench_bookkeeping(res):.1f} µs per batch",
        "",
    ]
    out += [
        "## (c) steady-state throughput, worker RNG tracking on vs off (2 workers, persistent)",
        "",
        md_table(
            ["workload", "on (samples/s)", "off (samples/s)", "on/off median", "on/off range"],
            bench_throughput(res, args.quick),
        ),
        "",
    ]
    out += [
        "## (d) first batch after load_state_dict() + iter(), 2 workers",
        "",
        md_table(
            [
                "state at batch",
                "sampler fast-forward ms",
                "fresh loader first batch ms",
                "sum ms",
                "resumed first batch ms",
            ],
            bench_first_batch(res, args.quick),
        ),
        "",
    ]
    out += worker_md
    text = "\n".join(out)
    print(text)
    res.write_text(".md", text)
    res.close()
    ray.shutdown()


if __name__ == "__main__":
    main()
