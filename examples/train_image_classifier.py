"""Train a small CNN on synthetic images with CPU-heavy augmentation: torch's DataLoader vs raydl's.

Both loaders get the same arguments (dataset, batch size, workers, seeded generator, persistent
workers); only the class differs. Each epoch's time is printed for both, so the cost of data
loading and what Ray workers change can be seen on this machine (on a laptop they share its
cores, as torch's workers do; on a Ray cluster they can run on other nodes: pass --ray-address).

    python examples/train_image_classifier.py                          # both loaders, 2 epochs each
    python examples/train_image_classifier.py --loader raydl --num-workers 8 --ray-address auto

torch's loader runs first, before Ray is started (torch forks its workers from this process);
raydl then starts a local Ray on loopback on its first batch, unless --ray-address or
RAY_ADDRESS names one. Ray's start-up (and the first start of each worker) is reported apart
from the epoch times, and the first raydl epoch includes starting the worker actors.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import Dataset

import raydl

_BLUR = torch.tensor([1.0, 4.0, 6.0, 4.0, 1.0])
_BLUR = (_BLUR[:, None] * _BLUR[None, :] / _BLUR.sum() ** 2).expand(3, 1, 5, 5).contiguous()


class AugmentedImages(Dataset):
    """Synthetic 3x32x32 images (label: the brightest channel), augmented `repeats` times per item.

    Each round is a random rotation and scale (grid_sample), a 5x5 Gaussian blur and a colour
    jitter, drawn from the worker's seeded torch RNG: a few milliseconds of CPU per image.
    """

    def __init__(self, n: int, repeats: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.images = torch.rand(n, 3, 32, 32, generator=g)
        self.images[torch.arange(n), torch.randint(0, 3, (n,), generator=g)] += 0.5
        self.labels = self.images.mean(dim=(2, 3)).argmax(dim=1)
        self.repeats = repeats

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        x = self.images[i].unsqueeze(0)
        for _ in range(self.repeats):
            angle = (torch.rand(()) - 0.5) * 0.6
            scale = 0.9 + 0.2 * torch.rand(())
            cos, sin, zero = torch.cos(angle) * scale, torch.sin(angle) * scale, torch.zeros(())
            theta = torch.stack([torch.stack([cos, -sin, zero]), torch.stack([sin, cos, zero])]).unsqueeze(0)
            grid = F.affine_grid(theta, (1, 3, 32, 32), align_corners=False)
            x = F.grid_sample(x, grid, align_corners=False, padding_mode="reflection")
            x = F.conv2d(F.pad(x, (2, 2, 2, 2), mode="reflect"), _BLUR, groups=3)
            x = x * (0.8 + 0.4 * torch.rand(1, 3, 1, 1)) + 0.1 * (torch.rand(()) - 0.5)
        return x.squeeze(0), int(self.labels[i])


def small_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 3),
    )


def train(name: str, loader, epochs: int) -> None:
    torch.manual_seed(0)
    model = small_cnn()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for epoch in range(epochs):
        start = time.perf_counter()
        seen, correct, loss_sum = 0, 0, 0.0
        for images, labels in loader:
            logits = model(images)
            loss = F.cross_entropy(logits, labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            seen += len(labels)
            correct += (logits.argmax(1) == labels).sum().item()
            loss_sum += loss.item() * len(labels)
        elapsed = time.perf_counter() - start
        print(
            f"{name}: epoch {epoch}: {elapsed:.2f} s ({seen / elapsed:.0f} images/s), "
            f"loss {loss_sum / seen:.3f}, accuracy {correct / seen:.1%}",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loader", choices=("both", "torch", "raydl"), default="both")
    parser.add_argument("--samples", type=int, default=1536)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--augment-repeats", type=int, default=8, help="rounds of augmentation per image")
    parser.add_argument("--ray-address", default=None, help="Ray cluster for raydl's workers; default: a local Ray")
    args = parser.parse_args()

    dataset = AugmentedImages(args.samples, args.augment_repeats)
    common = dict(
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.num_workers,
        persistent_workers=args.num_workers > 0,
    )
    print(
        f"{args.samples} images, batch {args.batch_size}, {args.num_workers} workers, "
        f"{args.augment_repeats} augmentation rounds per image, {args.epochs} epochs per loader",
        flush=True,
    )
    if args.loader in ("both", "torch"):
        train("torch DataLoader", TorchDataLoader(dataset, generator=torch.Generator().manual_seed(0), **common), args.epochs)
    if args.loader in ("both", "raydl"):
        if args.num_workers > 0:
            # Join or start Ray (as the first batch would) and start one worker before timing epochs.
            start = time.perf_counter()
            with raydl.DataLoader(range(2), num_workers=1, ray_address=args.ray_address) as warmup:
                list(warmup)
            print(f"raydl: Ray and a first worker started in {time.perf_counter() - start:.2f} s", flush=True)
        loader = raydl.DataLoader(
            dataset, generator=torch.Generator().manual_seed(0), ray_address=args.ray_address, **common
        )
        with loader:
            train("raydl DataLoader", loader, args.epochs)
            where = sorted({r.node_ip for r in loader.worker_records if r is not None})
            print(f"raydl DataLoader: {len(loader.worker_records)} Ray workers on {where}", flush=True)


if __name__ == "__main__":
    main()
