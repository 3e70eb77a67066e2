"""Cold start-up: time to the first batch of the first loader in a new process with no Ray running.

    python -m benchmarks.bench_startup                # 3 repetitions
    python -m benchmarks.bench_startup --reps 5 --num-workers 4

Each measurement is a fresh Python process (`--child MODE`), timed from before `import torch`
to the first batch in hand, with no Ray running beforehand; the loader is built and iterated at once:
  * torch: torch's DataLoader (fork);
  * raydl: raydl.DataLoader as it is by default: on a cold start the first batches are made by
    start-up processes forked from the trainer, each as its worker would, while Ray and the workers
    start (NOTE [ raydl cold start ]);
  * raydl-in-process: raydl.DataLoader(ray_cold_start="in_process"): those batches made in the
    trainer's own process instead (the opt-in; raydl's default before start-up processes);
  * raydl-no-cold: raydl.DataLoader(ray_cold_start=False): Ray's start and the workers' start in
    series before the first batch (raydl before the cold start);
  * raydl+start: `raydl.start(num_workers)` called right after the import, then a model build of
    `--build-s` seconds (a CPU-bound loop in the main process), then the loader (no cold start:
    the batches come from the workers). The same build runs in every mode, so the columns compare
    the same script.
The child reports its phases (import torch, import the loader, Ray up, workers ready, first
batch) from raydl's debug log. Repetitions rotate the order of the modes; each raydl mode's
ratio to torch is taken within a repetition (the same minute of a shared machine), and reported
as median and range over the repetitions, with the load other processes put on the machine.
Results: one JSON line per run, then markdown tables.
"""

t0 = __import__("time").perf_counter()  # the clock starts before anything is imported (but `benchmarks`: os only)

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

from benchmarks.common.processes import REPO, child_result, script_command, with_retries  # noqa: E402 - no torch, no Ray
from benchmarks.common.results import printed_report  # noqa: E402

MODES = ("torch", "raydl", "raydl-in-process", "raydl-no-cold", "raydl+start")


def _build_model(seconds: float) -> None:
    """Stand-in for building a model: `seconds` of single-threaded CPU work in the main process."""
    import torch

    end = time.perf_counter() + seconds
    layers = []
    while time.perf_counter() < end:
        layers.append(torch.nn.Linear(256, 256))
        if len(layers) > 64:
            layers.clear()


_KINDS = (
    ("gcs_server", "gcs"),
    ("raylet", "raylet"),
    ("dashboard.py", "api server"),
    ("DashboardAgent", "agents"),
    ("RuntimeEnvAgent", "agents"),
    ("log_monitor", "monitors"),
    ("monitor.py", "monitors"),
    ("ray::Worker", "workers"),
    ("ray::IDLE", "idle Ray workers"),
)


def _cpu_by_process_kind() -> dict:
    """CPU seconds used so far by this process and each kind of process under it (load-independent work)."""
    import psutil

    me = psutil.Process()
    t = me.cpu_times()
    out = {"driver": round(t.user + t.system, 2)}
    for p in me.children(recursive=True):
        try:
            label = " ".join(p.cmdline()) or p.name()
            ct = p.cpu_times()
        except psutil.Error:
            continue
        forked = label == " ".join(me.cmdline())  # torch's workers are forks of this process
        kind = "workers" if forked else next((k for needle, k in _KINDS if needle in label), "other")
        out[kind] = round(out.get(kind, 0.0) + ct.user + ct.system, 2)
    return out


def child(mode: str, num_workers: int, build_s: float) -> None:
    import logging

    marks: dict = {}

    def mark(name: str) -> None:
        marks[name] = round(time.perf_counter() - t0, 3)

    class _Marks(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            msg = record.getMessage()
            for needle, name in (
                ("Ray up", "ray_up"),
                ("workers ready", "workers_ready"),
                ("starting a local Ray", "ray_start_begin"),
            ):
                if needle in msg and name not in marks:
                    mark(name)

    raydl_log = logging.getLogger("raydl")
    raydl_log.setLevel(logging.DEBUG)
    raydl_log.addHandler(_Marks())
    raydl_log.propagate = False

    import torch

    mark("import_torch")

    class Samples(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 1024

        def __getitem__(self, i: int):
            return torch.full((3, 32, 32), float(i))

    if mode == "torch":
        from torch.utils.data import DataLoader
    else:
        import raydl

        DataLoader = raydl.DataLoader
        marks["raydl_file"] = raydl.__file__
        if mode == "raydl-in-process":
            DataLoader = functools.partial(raydl.DataLoader, ray_cold_start="in_process")
        elif mode != "raydl":  # NOTE [ raydl cold start ]: only on by default in the plain modes
            DataLoader = functools.partial(raydl.DataLoader, ray_cold_start=False)
    mark("import_loader")
    if mode == "raydl+start":
        raydl.start(num_workers=num_workers)
        mark("start_returned")
    if build_s:
        _build_model(build_s)
        mark("model_built")
    loader = DataLoader(Samples(), batch_size=64, num_workers=num_workers)
    it = iter(loader)
    mark("iter")
    next(it)
    mark("first_batch")
    marks["cpu_s"] = _cpu_by_process_kind()
    if hasattr(it, "fork_s"):  # a cold start's pieces: each fork, then the rest of the epoch and its handover
        marks["fork_ms"] = round(1000 * max(it.fork_s, default=0.0), 2)
        for _ in it:
            pass
        mark("epoch_end")
        marks["handover_s"] = round(it.handover_s, 3)
        marks["startup_batches"] = it.batches_in_driver
    print("RESULT " + json.dumps({"mode": mode, "num_workers": num_workers, "build_s": build_s, **marks}), flush=True)
    del it, loader


def _foreign_load(seconds: float, fn):
    """Run fn(); also return the machine's average busy cores meanwhile (all processes, ours included)."""
    import psutil

    before = psutil.cpu_times()
    start = time.perf_counter()
    out = fn()
    after = psutil.cpu_times()
    busy = sum(getattr(after, f) - getattr(before, f) for f in ("user", "nice", "system", "irq", "softirq"))
    return out, round(busy / max(time.perf_counter() - start, 1e-9), 2)


def _run_child_once(mode: str, num_workers: int, build_s: float) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    cmd = [
        *script_command("bench_startup"),
        "--child",
        mode,
        "--num-workers",
        str(num_workers),
        "--build-s",
        str(build_s),
    ]
    wall0 = time.perf_counter()
    proc, load = _foreign_load(0, lambda: subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300))
    rec = child_result(proc, mode)
    rec["process_wall_s"] = round(time.perf_counter() - wall0, 2)
    rec["machine_busy_cores"] = load
    return rec


def run_child(*args, **kwargs) -> dict:
    """One measurement in a child process, retried when the child fails (see processes.with_retries)."""
    return with_retries(_run_child_once, *args, **kwargs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", choices=MODES)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--num-workers", type=int, default=2)
    ap.add_argument("--build-s", type=float, default=0.0, help="seconds of model building before the loader")
    ap.add_argument("--modes", default=",".join(MODES))
    args = ap.parse_args()
    if args.child:
        child(args.child, args.num_workers, args.build_s)
        return
    modes = args.modes.split(",")
    runs: dict = {m: [] for m in modes}
    for rep in range(args.reps):
        order = modes[rep % len(modes) :] + modes[: rep % len(modes)]
        for mode in order:
            rec = run_child(mode, args.num_workers, args.build_s)
            rec["rep"] = rep
            print(json.dumps(rec), flush=True)
            runs[mode].append(rec)
    med = lambda recs, k: statistics.median(r[k] for r in recs if k in r) if any(k in r for r in recs) else None  # noqa: E731
    print(
        f"\nCold first batch, {args.num_workers} workers, model build {args.build_s:g} s, median of {args.reps} "
        f"(s from before `import torch`; machine busy cores = all processes' CPU use during the run, 2 cores)\n"
    )
    print(
        "| loader | first batch | import torch | import loader | Ray up | workers ready | after model built | busy cores | CPU s (all processes) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    fmt = lambda v: "—" if v is None else f"{v:.2f}"  # noqa: E731
    for mode in modes:
        recs = runs[mode]
        after_build = None
        if args.build_s:
            after_build = statistics.median(r["first_batch"] - r["model_built"] for r in recs)
        print(
            f"| {mode} | {fmt(med(recs, 'first_batch'))} | {fmt(med(recs, 'import_torch'))} | "
            f"{fmt(med(recs, 'import_loader'))} | {fmt(med(recs, 'ray_up'))} | {fmt(med(recs, 'workers_ready'))} | "
            f"{fmt(after_build)} | {fmt(med(recs, 'machine_busy_cores'))} | "
            f"{fmt(statistics.median(sum(r['cpu_s'].values()) for r in recs) if all('cpu_s' in r for r in recs) else None)} |"
        )
    kinds = sorted({k for m in modes for r in runs[m] for k in r.get("cpu_s", {})})
    if kinds:
        print("\nCPU seconds by process up to the first batch (median), the work itself whatever the load:\n")
        print("| loader | " + " | ".join(kinds) + " |")
        print("|---|" + "---|" * len(kinds))
        for mode in modes:
            cells = [fmt(statistics.median(r["cpu_s"].get(k, 0.0) for r in runs[mode])) for k in kinds]
            print(f"| {mode} | " + " | ".join(cells) + " |")
    if "torch" in modes:
        _print_ratios(runs, modes, args.reps)
    _print_pieces(runs, modes)


def _print_pieces(runs: dict, modes: list) -> None:
    """A cold start's pieces (median): the slowest fork, the handover's own time, and who made the epoch."""
    cold = [m for m in modes if any("handover_s" in r for r in runs[m])]
    if not cold:
        return
    print("\nCold start's pieces (median): slowest fork of a start-up process, the handover itself (the Ray")
    print("iterator built from the start-up state, its workers configured), batches made before it (of 16):\n")
    print("| loader | fork ms | handover s | batches before the handover | epoch end s |")
    print("|---|---|---|---|---|")
    for mode in cold:
        recs = [r for r in runs[mode] if "handover_s" in r]
        med = lambda k: statistics.median(r[k] for r in recs)  # noqa: E731
        print(
            f"| {mode} | {med('fork_ms'):.2f} | {med('handover_s'):.3f} | {med('startup_batches'):.0f} | "
            f"{med('epoch_end'):.2f} |"
        )


def _print_ratios(runs: dict, modes: list, reps: int) -> None:
    """Each raydl mode's first batch over torch's in the same repetition: median and range."""
    print(f"\nNew process to first batch, ratio to torch within each repetition ({reps} repetitions):\n")
    print("| loader | first batch s, median (range) | torch's, same runs | ratio to torch, median (range) |")
    print("|---|---|---|---|")
    torch_by_rep = {r["rep"]: r["first_batch"] for r in runs["torch"]}
    for mode in modes:
        if mode == "torch":
            continue
        pairs = [(r["first_batch"], torch_by_rep[r["rep"]]) for r in runs[mode] if r["rep"] in torch_by_rep]
        if not pairs:
            continue
        mine, theirs = [p[0] for p in pairs], [p[1] for p in pairs]
        ratios = [a / b for a, b in pairs]
        print(
            f"| {mode} | {statistics.median(mine):.2f} ({min(mine):.2f}-{max(mine):.2f}) | "
            f"{statistics.median(theirs):.2f} ({min(theirs):.2f}-{max(theirs):.2f}) | "
            f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) |"
        )


if __name__ == "__main__":
    with printed_report("bench_startup", quick="--quick" in sys.argv, enabled="--child" not in sys.argv):
        main()
