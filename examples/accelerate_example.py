"""raydl with Hugging Face accelerate: `Accelerator.prepare()` and a training loop on Ray workers.

`accelerator.prepare(model, optimizer, loader)` rebuilds every DataLoader it is given: a
`DataLoaderShard` around a new plain `torch.utils.data.DataLoader`, built from torch's
arguments only (raydl's class and `ray_*` options are dropped). `raydl.patch()` makes that
rebuilt loader, like every torch DataLoader with num_workers > 0, load with Ray workers; give it
the `ray_*` options the rebuilt loader should use:

    import raydl
    raydl.patch(ray_remote_args={"num_cpus": 0})   # before iterating the prepared loader
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

(or `with raydl.patched(...):` around prepare() *and* the training loop: the patch acts when the
loader is iterated, not when it is built.)

    python examples/accelerate_example.py

Ray: raydl starts a local Ray on loopback on the first batch, or joins RAY_ADDRESS. Each batch
carries the pid of the process that made it; the script prints them.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import nn
from torch.utils.data import Dataset

import raydl


class SyntheticImages(Dataset):
    """3x16x16 images whose label is the brightest channel, flipped at random in the worker; plus the worker's pid."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.images = torch.rand(n, 3, 16, 16, generator=g)
        self.images[torch.arange(n), torch.randint(0, 3, (n,), generator=g)] += 0.5
        self.labels = self.images.mean(dim=(2, 3)).argmax(dim=1)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        image = self.images[i]
        if torch.rand(()) < 0.5:
            image = image.flip(-1)
        return image, self.labels[i], os.getpid()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()

    torch.manual_seed(0)
    # The only raydl line: every torch DataLoader (accelerate's rebuilt one included) loads with Ray workers.
    raydl.patch(ray_remote_args={"num_cpus": 0})

    accelerator = Accelerator(cpu=True)
    loader = raydl.DataLoader(
        SyntheticImages(args.samples),
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.num_workers,
        generator=torch.Generator().manual_seed(0),
    )
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3)
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    print(
        f"accelerate prepared a {type(loader).__name__} around a {type(loader.base_dataloader).__module__}.DataLoader"
    )

    trainer_pid = os.getpid()
    for epoch in range(args.epochs):
        pids, seen, loss_sum = set(), 0, 0.0
        for images, labels, worker_pids in loader:
            loss = F.cross_entropy(model(images), labels)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            pids.update(worker_pids.tolist())
            seen += len(labels)
            loss_sum += loss.item() * len(labels)
        accelerator.print(
            f"epoch {epoch}: loss {loss_sum / seen:.3f} over {seen} samples; batches made by worker pids "
            f"{sorted(pids)}, not by this trainer (pid {trainer_pid}): {trainer_pid not in pids}"
        )
    raydl.unpatch()
    accelerator.print("accelerate_example: done")


if __name__ == "__main__":
    main()
