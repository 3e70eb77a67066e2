"""The trainer's GPU path on CUDA: host-to-device bytes/s and GPU idle time, against the copy engine's own limit.

Three parts, in one run, so every figure is from the same machine:
  * limits: the copy engine's rate (a pinned host buffer copied to the GPU with non_blocking=True, timed with
    CUDA events), the same from pageable memory, and one core's (and N cores') memcpy into pinned memory (the copy
    a pinning loader makes in the trainer before the device copy);
  * transfer: a transfer-bound loop: 32 MiB float batches (batch_size=None, so the workers only send), a trivial
    step (a sum). GPU idle = 1 - (bytes / limit + step time) / wall: the share of the time the GPU's copy engine
    and its cores both had nothing to do. H2D bytes/s = bytes / wall, also as a share of the limit;
  * classifier: a small conv net's training step on 3x96x96 images with ~0.5 ms of CPU work each (an image
    classifier's shape). GPU idle = 1 - step time / wall (its cores waiting for data, copies on the step's stream
    counted as waiting).
The loaders: torch's DataLoader(pin_memory=True) + `.to("cuda", non_blocking=True)` in the loop; raydl the same;
raydl(ray_device="cuda") (batches arrive on the GPU, copied on a side stream); each raydl one also with its pinning
copy on 1 thread (RAYDL_PIN_COPY_THREADS=1, NOTE [ raydl pin copy ]), and, in the transfer part, raydl with no
pinning at all (the rate batches reach the trainer). Each repetition builds every loader anew, in rotated order.

    python -m benchmarks.bench_gpu --reps 2 --json out.json     # needs CUDA
    python -m benchmarks.bench_gpu --smoke-cpu                  # the script's own code, on CPU, tiny sizes
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from benchmarks.common.results import printed_report

MiB = 1024 * 1024


class Chunks(Dataset):
    """Item i: a float32 tensor of `mib` MiB (the same one each time: the workers' work is only sending it)."""

    def __init__(self, n: int, mib: int) -> None:
        self.n, self.numel = n, mib * MiB // 4
        self._base = None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        if self._base is None:
            self._base = torch.rand(self.numel, generator=torch.Generator().manual_seed(0))
        return self._base


class Images(Dataset):
    """3x96x96 float images with ~`work_ms` of numpy work each (a CPU-side augmentation stand-in)."""

    def __init__(self, n: int, work_ms: float) -> None:
        self.n, self.work_ms = n, work_ms

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        rng = np.random.default_rng(i)
        img = rng.random((3, 96, 96), dtype=np.float32)
        end = time.perf_counter() + self.work_ms / 1000
        while time.perf_counter() < end:
            img = np.flip(img, axis=2).copy()
        return torch.from_numpy(img), i % 10


def model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(1024, 10),
    )  # fmt: skip


class Span:
    """GPU time of a piece of the loop: CUDA events on the current stream (wall time on CPU, for --smoke-cpu)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda, self.pairs = cuda, []

    def start(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def end(self, start) -> None:
        self.pairs.append((start, self.start()))

    def total_s(self) -> float:
        if self.cuda:
            return sum(s.elapsed_time(e) for s, e in self.pairs) / 1000
        return sum(e - s for s, e in self.pairs)


def sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


# --- limits ---------------------------------------------------------------------------------------------------


def h2d_rate(src: torch.Tensor, reps: int) -> float:
    """Bytes/s of `src` copied to the current GPU with non_blocking=True, `reps` times, timed with CUDA events."""
    gpu = torch.empty_like(src, device="cuda")
    gpu.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        gpu.copy_(src, non_blocking=True)
    end.record()
    torch.cuda.synchronize()
    return src.numel() * src.element_size() * reps / (start.elapsed_time(end) / 1000)


def limits(dev: torch.device, mib: int, reps: int) -> dict:
    """The copy engine's H2D rate from pinned and from pageable memory, and memcpy into pinned memory (bytes/s)."""
    from raydl.worker import transfer

    cuda = dev.type == "cuda"
    n = mib * MiB
    pageable = torch.rand(n // 4)
    pinned = torch.empty(n // 4, pin_memory=cuda)
    pinned.copy_(pageable)
    out = {"bytes": n}
    if cuda:
        out["h2d_pinned"] = h2d_rate(pinned, reps)
        out["h2d_pageable"] = h2d_rate(pageable, reps)
    dst, src = pinned.numpy(), pageable.numpy()
    from raydl import _constants

    for threads in sorted({1, 2, 4, _constants.PIN_COPY_THREADS}):
        saved = _constants.PIN_COPY_THREADS
        _constants.PIN_COPY_THREADS = threads
        try:
            transfer.copy_array(dst, src)
            t0 = time.perf_counter()
            for _ in range(reps):
                transfer.copy_array(dst, src)
            out[f"memcpy_to_pinned_{threads}t"] = n * reps / (time.perf_counter() - t0)
        finally:
            _constants.PIN_COPY_THREADS = saved
    print(json.dumps({"part": "limits", **{k: round(v / 1e9, 2) if k != "bytes" else v for k, v in out.items()}}))
    return out


# --- the loaders ----------------------------------------------------------------------------------------------

TORCH_PIN = "torch pin_memory + .to(non_blocking)"
RAYDL_HOST = "raydl, no pinning (host only)"
RAYDL_PIN_1T = "raydl pin_memory + .to(non_blocking), 1 copy thread"
RAYDL_PIN = "raydl pin_memory + .to(non_blocking)"
RAYDL_DEV_1T = "raydl ray_device='cuda', 1 copy thread"
RAYDL_DEV = "raydl ray_device='cuda'"


def make_loader(name: str, ds: Dataset, common: dict, cuda: bool):
    """A new loader of kind `name`, whether the loop copies its batches to the GPU itself, and the pin copy's threads."""
    import raydl
    from raydl import _constants

    threads = 1 if name in (RAYDL_PIN_1T, RAYDL_DEV_1T) else DEFAULT_THREADS
    _constants.PIN_COPY_THREADS = threads  # read at each copy (in the trainer's pin thread)
    if name == TORCH_PIN:
        return torch.utils.data.DataLoader(ds, pin_memory=cuda, **common), cuda, 1
    if name == RAYDL_HOST:
        return raydl.DataLoader(ds, **common), False, threads
    if name in (RAYDL_PIN, RAYDL_PIN_1T):
        return raydl.DataLoader(ds, pin_memory=cuda, **common), cuda, threads
    return raydl.DataLoader(ds, ray_device="cuda", **common), False, threads


DEFAULT_THREADS = 1  # set in main() from raydl's own default


def run_transfer(name: str, loader, to_device: bool, epochs: int, dev: torch.device, limit: float) -> dict:
    cuda = dev.type == "cuda"
    results = []
    for epoch in range(epochs):
        steps = Span(cuda)
        sync(cuda)
        t0 = time.perf_counter()
        nbytes = 0
        sink = torch.zeros((), device=dev) if name != RAYDL_HOST else None
        for x in loader:
            if sink is None:  # the host-only rate: the batch reached the trainer, nothing else
                nbytes += x.numel() * x.element_size()
                continue
            if to_device:
                x = x.to(dev, non_blocking=True)
            s = steps.start()
            sink += x.sum()
            steps.end(s)
            nbytes += x.numel() * x.element_size()
        sync(cuda)
        wall = time.perf_counter() - t0
        results.append({"wall_s": wall, "bytes": nbytes, "step_s": steps.total_s() if sink is not None else 0.0})
    steady = results[1:] or results
    wall = sum(r["wall_s"] for r in steady)
    nbytes = sum(r["bytes"] for r in steady)
    step = sum(r["step_s"] for r in steady)
    rate = nbytes / wall
    row = {
        "part": "transfer",
        "loader": name,
        "first_epoch_s": round(results[0]["wall_s"], 3),
        "steady_wall_s": round(wall / len(steady), 3),
        "h2d_GBps": round(rate / 1e9, 2),
        "of_limit_pct": round(100 * rate / limit, 1) if limit else None,
        "gpu_idle_pct": round(100 * max(0.0, 1 - (nbytes / limit + step) / wall), 1)
        if limit and name != RAYDL_HOST
        else None,
        "step_s": round(step / len(steady), 4),
    }
    print(json.dumps(row), flush=True)
    return row


def run_classifier(name: str, loader, to_device: bool, epochs: int, dev: torch.device, limit: float) -> dict:
    cuda = dev.type == "cuda"
    net = model().to(dev)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss()
    results = []
    for epoch in range(epochs):
        steps = Span(cuda)
        sync(cuda)
        t0 = time.perf_counter()
        n = nbytes = 0
        for x, y in loader:
            if to_device:
                x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            s = steps.start()
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(net(x), y)
            loss.backward()
            opt.step()
            steps.end(s)
            n += len(y)
            nbytes += x.numel() * x.element_size() + y.numel() * y.element_size()
        sync(cuda)
        wall = time.perf_counter() - t0
        results.append({"wall_s": wall, "busy_s": steps.total_s(), "samples": n, "bytes": nbytes})
    steady = results[1:] or results
    wall = sum(r["wall_s"] for r in steady)
    busy = sum(r["busy_s"] for r in steady)
    rate = sum(r["bytes"] for r in steady) / wall
    row = {
        "part": "classifier",
        "loader": name,
        "first_epoch_s": round(results[0]["wall_s"], 2),
        "steady_wall_s": round(wall / len(steady), 3),
        "gpu_busy_s": round(busy / len(steady), 3),
        "gpu_idle_pct": round(100 * (1 - busy / wall), 1),
        "samples_per_s": round(sum(r["samples"] for r in steady) / wall, 1),
        "h2d_GBps": round(rate / 1e9, 3),
        "of_limit_pct": round(100 * rate / limit, 1) if limit else None,
    }
    print(json.dumps(row), flush=True)
    return row


def part(name: str, loaders: tuple, ds: Dataset, common: dict, reps: int, epochs: int, dev, limit, runner) -> list:
    rows = []
    cuda = dev.type == "cuda"
    if not cuda:
        loaders = tuple(n for n in loaders if "ray_device" not in n)
    for rep in range(reps):
        order = loaders[rep % len(loaders) :] + loaders[: rep % len(loaders)]
        for loader_name in order:
            loader, to_device, threads = make_loader(loader_name, ds, common, cuda)
            row = runner(loader_name, loader, to_device, epochs, dev, limit)
            row.update(rep=rep, copy_threads=threads)
            rows.append(row)
            if hasattr(loader, "shutdown"):
                loader.shutdown()
            del loader
    return rows


def table(rows: list, cols: list) -> str:
    """Medians (min-max) over the repetitions, a line per loader, in first-seen order."""
    names = list(dict.fromkeys(r["loader"] for r in rows))
    lines = ["| loader | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for name in names:
        cells = []
        for c in cols:
            xs = [r[c] for r in rows if r["loader"] == name and r.get(c) is not None]
            cells.append(f"{np.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})" if xs else "—")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    global DEFAULT_THREADS
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--reps", type=int, default=2, help="repetitions; the loaders' order rotates each time")
    parser.add_argument("--epochs", type=int, default=3, help="per loader; the first is excluded")
    parser.add_argument("--chunk-mib", type=int, default=32, help="transfer part: MiB per batch")
    parser.add_argument("--chunks", type=int, default=160, help="transfer part: batches per epoch")
    parser.add_argument("--images", type=int, default=4096, help="classifier part: samples per epoch")
    parser.add_argument("--batch-size", type=int, default=128, help="classifier part")
    parser.add_argument("--work-ms", type=float, default=0.5, help="classifier part: CPU work per sample")
    parser.add_argument("--parts", default="limits,transfer,classifier")
    parser.add_argument("--json", default="", help="also write every row here")
    parser.add_argument("--smoke-cpu", action="store_true", help="tiny sizes on CPU: checks the script, no figures")
    args = parser.parse_args()
    from raydl import _constants

    DEFAULT_THREADS = _constants.PIN_COPY_THREADS
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke_cpu:
        sys.exit("bench_gpu needs CUDA (or --smoke-cpu to check the script on CPU)")
    if args.smoke_cpu:
        cuda = False
        args.workers, args.reps, args.epochs = 2, 1, 2
        args.chunk_mib, args.chunks, args.images, args.batch_size = 8, 6, 64, 16
    dev = torch.device("cuda" if cuda else "cpu")
    parts = args.parts.split(",")
    lim = limits(dev, 256 if cuda else 16, 20 if cuda else 2)
    limit = lim.get("h2d_pinned", 0.0)
    rows = []
    if "transfer" in parts:
        common = dict(batch_size=None, num_workers=args.workers, persistent_workers=True)
        loaders = (TORCH_PIN, RAYDL_HOST, RAYDL_PIN_1T, RAYDL_PIN, RAYDL_DEV_1T, RAYDL_DEV)
        ds = Chunks(args.chunks, args.chunk_mib)
        rows += part("transfer", loaders, ds, common, args.reps, args.epochs, dev, limit, run_transfer)
    if "classifier" in parts:
        common = dict(batch_size=args.batch_size, shuffle=True, num_workers=args.workers, persistent_workers=True)
        loaders = (TORCH_PIN, RAYDL_PIN_1T, RAYDL_PIN, RAYDL_DEV)
        ds = Images(args.images, args.work_ms)
        rows += part("classifier", loaders, ds, common, args.reps, args.epochs, dev, limit, run_classifier)

    name = torch.cuda.get_device_name() if cuda else "CPU (smoke run: no figures)"
    print(
        f"\n{name} | {os.cpu_count()} CPUs | torch {torch.__version__} | {args.workers} workers | "
        f"default pin copy threads {DEFAULT_THREADS} | {args.reps} repetitions, rotated order; medians (min-max); "
        f"first epochs excluded"
    )
    print("\nlimits (GB/s): " + ", ".join(f"{k} {v / 1e9:.2f}" for k, v in lim.items() if k != "bytes"))
    tr = [r for r in rows if r["part"] == "transfer"]
    if tr:
        print(f"\ntransfer-bound loop: {args.chunk_mib} MiB float32 batches, {args.chunks} a epoch, a sum as the step")
        print(table(tr, ["h2d_GBps", "of_limit_pct", "gpu_idle_pct", "steady_wall_s", "first_epoch_s"]))
    cl = [r for r in rows if r["part"] == "classifier"]
    if cl:
        print(f"\nclassifier step: batch {args.batch_size} of 3x96x96 float32, {args.work_ms} ms CPU work a sample")
        print(table(cl, ["gpu_idle_pct", "samples_per_s", "h2d_GBps", "of_limit_pct", "steady_wall_s"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "cpus": os.cpu_count(), "args": vars(args), "limits": lim, "rows": rows}, f)


if __name__ == "__main__":
    with printed_report("bench_gpu", quick="--smoke-cpu" in sys.argv):
        main()
