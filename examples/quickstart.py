"""raydl quickstart: a short training loop whose data comes from Ray actors.

Change one import (`from raydl import DataLoader`) and torch's DataLoader arguments keep their
meaning; the workers become Ray actors. With no Ray running, raydl starts a local one (on
loopback) on the first iteration. Run:

    python examples/quickstart.py --epochs 2 --num-workers 2
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, get_worker_info

from raydl import DataLoader


class TintedNoise(Dataset):
    """3x32x32 noise images; the class (0, 1, 2 = red, green, blue) brightens its own channel by `tint`.

    Deterministic from `seed`. A worker-side augmentation flips images at random, drawn from the
    worker's seeded RNG exactly as in torch's workers.
    """

    def __init__(self, n: int, tint: float = 0.3, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.labels = rng.integers(0, 3, n)
        self.images = rng.random((n, 3, 32, 32), dtype=np.float32)  # uniform in [0, 1)
        self.images[np.arange(n), self.labels] += tint

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        image = torch.from_numpy(self.images[i])
        if torch.rand(()) < 0.5:
            image = image.flip(-1)
        return image, int(self.labels[i])


def announce_worker(worker_id: int) -> None:
    """worker_init_fn: torch's get_worker_info() works inside raydl's Ray actors."""
    info = get_worker_info()
    print(f"  worker {info.id}/{info.num_workers} started with seed {info.seed}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--ray-address", default=None, help="Ray cluster to use; default: start a local Ray")
    args = parser.parse_args()

    torch.manual_seed(0)  # the model's initial weights
    loader = DataLoader(
        TintedNoise(args.samples),
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.num_workers,
        persistent_workers=True,
        worker_init_fn=announce_worker,
        generator=torch.Generator().manual_seed(0),  # the shuffle order and the workers' seeds
        ray_address=args.ray_address,
    )
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3)
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    loss_fn = nn.CrossEntropyLoss()

    with loader:  # releases the persistent Ray workers at the end
        for epoch in range(args.epochs):
            start = time.perf_counter()
            total, correct, loss_sum = 0, 0, 0.0
            for images, labels in loader:
                optimizer.zero_grad()
                logits = model(images)
                loss = loss_fn(logits, labels)
                loss.backward()
                optimizer.step()
                loss_sum += loss.item() * len(labels)
                correct += (logits.argmax(1) == labels).sum().item()
                total += len(labels)
            where = sorted({r.node_ip for r in loader.worker_records})
            print(
                f"epoch {epoch}: loss {loss_sum / total:.3f}, accuracy {correct / total:.2%}, "
                f"{total} samples in {time.perf_counter() - start:.2f} s from {len(loader.worker_records)} "
                f"Ray workers on {where}"
            )


if __name__ == "__main__":
    main()
