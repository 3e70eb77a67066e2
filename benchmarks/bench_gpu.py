"""GPU idle time waiting for data, in a small conv-net training loop on CUDA.

Compares, in one run and with the same dataset and worker count:
  * torch's DataLoader(pin_memory=True) + `.to("cuda", non_blocking=True)` in the loop;
  * raydl.DataLoader(pin_memory=True) + the same `.to(...)` in the loop;
  * raydl.DataLoader(ray_device="cuda"): batches arrive on the GPU, copied on a side stream.
GPU busy time is measured with CUDA events around each training step; idle = wall - busy.

    python -m benchmarks.bench_gpu --workers 4 --epochs 3 --reps 3

Each repetition builds a new loader of each kind, in rotated order (so slow drifts hit all of
them); the table shows medians and each loader's samples/s over torch's in the same repetition.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402

from benchmarks.common.results import printed_report


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


def run(name: str, loader, to_device: bool, epochs: int) -> dict:
    dev = torch.device("cuda")
    net = model().to(dev)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss()
    results = []
    for epoch in range(epochs):
        events = []
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        n = 0
        for x, y in loader:
            if to_device:
                x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(net(x), y)
            loss.backward()
            opt.step()
            end.record()
            events.append((start, end))
            n += len(y)
        torch.cuda.synchronize()
        wall_s = time.perf_counter() - t0
        busy_s = sum(s.elapsed_time(e) for s, e in events) / 1000
        results.append({"epoch": epoch, "wall_s": wall_s, "gpu_busy_s": busy_s, "samples": n})
    steady = results[1:] or results
    wall = sum(r["wall_s"] for r in steady)
    busy = sum(r["gpu_busy_s"] for r in steady)
    row = {
        "loader": name,
        "first_epoch_s": round(results[0]["wall_s"], 2),
        "steady_wall_s": round(wall / len(steady), 3),
        "gpu_busy_s": round(busy / len(steady), 3),
        "gpu_idle_pct": round(100 * (1 - busy / wall), 1),
        "samples_per_s": round(sum(r["samples"] for r in steady) / wall, 1),
    }
    print(json.dumps(row), flush=True)
    return row


LOADERS = ("torch pin_memory + .to(non_blocking)", "raydl pin_memory + .to(non_blocking)", "raydl ray_device='cuda'")


def make_loader(name: str, ds: Dataset, common: dict):
    """A new loader of kind `name` and whether the loop must copy its batches to the GPU itself."""
    import raydl

    if name == LOADERS[0]:
        return torch.utils.data.DataLoader(ds, pin_memory=True, **common), True
    if name == LOADERS[1]:
        return raydl.DataLoader(ds, pin_memory=True, **common), True
    return raydl.DataLoader(ds, ray_device="cuda", **common), False


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--work-ms", type=float, default=0.5)
    parser.add_argument("--reps", type=int, default=3, help="repetitions; the loaders' order rotates each time")
    args = parser.parse_args()

    ds = Images(args.samples, args.work_ms)
    common = dict(batch_size=args.batch_size, shuffle=True, num_workers=args.workers, persistent_workers=True)
    rows: dict[str, list[dict]] = {name: [] for name in LOADERS}
    for rep in range(args.reps):
        order = LOADERS[rep % len(LOADERS) :] + LOADERS[: rep % len(LOADERS)]
        for name in order:
            loader, to_device = make_loader(name, ds, common)
            row = run(name, loader, to_device, args.epochs)
            row["rep"] = rep
            rows[name].append(row)
            if hasattr(loader, "shutdown"):
                loader.shutdown()
            del loader

    def med(xs):
        return float(np.median(xs))

    print(
        f"\n{torch.cuda.get_device_name()} | {os.cpu_count()} CPUs | torch {torch.__version__} | "
        f"{args.workers} workers, batch {args.batch_size}, {args.work_ms} ms CPU work per sample | "
        f"{args.reps} repetitions, loaders in rotated order; medians, (min-max); first epochs excluded"
    )
    print("| loader | steady epoch s | GPU busy s | GPU idle % | samples/s | vs torch (paired) |")
    print("|---|---|---|---|---|---|")
    base = rows[LOADERS[0]]
    for name in LOADERS:
        rs = rows[name]
        idle = [r["gpu_idle_pct"] for r in rs]
        ratios = [r["samples_per_s"] / b["samples_per_s"] for r, b in zip(rs, base)]
        print(
            f"| {name} | {med([r['steady_wall_s'] for r in rs]):.3f} | {med([r['gpu_busy_s'] for r in rs]):.3f} | "
            f"{med(idle):.1f} ({min(idle):.1f}-{max(idle):.1f}) | {med([r['samples_per_s'] for r in rs]):,.0f} | "
            f"{med(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) |"
        )


if __name__ == "__main__":
    with printed_report("bench_gpu", quick="--quick" in sys.argv):
        main()
