"""Resume a training loop mid-epoch, exactly: the loader's state goes into the checkpoint.

A job checkpoints `{"model", "optimizer", "loader": loader.state_dict()}` with torch.save every
few steps and is preempted; the restarted job builds everything again, loads the checkpoint
with torch.load(weights_only=True) and calls `loader.load_state_dict(...)`: it continues with
exactly the batches the uninterrupted job would have trained on, worker-side random
augmentation included. This script runs the three jobs (uninterrupted, preempted, restarted) in
one process and checks that. Run:

    python examples/resume_example.py --num-workers 2 --stop-after 5
"""

from __future__ import annotations

import argparse
import os
import tempfile

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from raydl import DataLoader


class AugmentedPoints(Dataset):
    """Fixed 8-dim points with a worker-side random augmentation (noise from torch's RNG in the worker)."""

    def __init__(self, n: int) -> None:
        rng = np.random.default_rng(0)
        self.x = torch.from_numpy(rng.random((n, 8), dtype=np.float32))
        self.y = (self.x.sum(dim=1) > 4).long()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i] + 0.01 * torch.randn(8), self.y[i], i


def build(args):
    """What a (re)started job builds: the same model, optimizer and loader, from the same seeds."""
    torch.manual_seed(0)
    model = nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(
        AugmentedPoints(args.samples),
        batch_size=args.batch_size,
        shuffle=True,
        generator=torch.Generator().manual_seed(42),
        num_workers=args.num_workers,
        timeout=120,
    )
    return model, optimizer, loader


def train(model, optimizer, loader, steps, on_step=None) -> list:
    """Up to `steps` SGD steps; returns what each step trained on (indices and augmented inputs)."""
    seen = []
    for step, (x, y, idx) in enumerate(loader):
        if step == steps:
            break
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        seen.append((idx.tolist(), x))
        if on_step is not None:
            on_step(step + 1)
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--stop-after", type=int, default=5, help="steps before the preemption")
    parser.add_argument("--checkpoint-every", type=int, default=1)
    args = parser.parse_args()
    path = os.path.join(tempfile.mkdtemp(), "checkpoint.pt")

    model, optimizer, loader = build(args)
    with loader:
        uninterrupted = train(model, optimizer, loader, steps=10**9)
    final_uninterrupted = model.weight.detach().clone()

    # The preempted job: checkpoints every few steps, then dies after --stop-after steps.
    model, optimizer, loader = build(args)

    def checkpoint(step: int) -> None:
        if step % args.checkpoint_every == 0:
            torch.save(
                {
                    "step": step,
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "loader": loader.state_dict(),
                },
                path,
            )

    with loader:
        before = train(model, optimizer, loader, steps=args.stop_after, on_step=checkpoint)

    # The restarted job: everything built anew, then the checkpoint loaded.
    model, optimizer, loader = build(args)
    ckpt = torch.load(path, weights_only=True)
    model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    loader.load_state_dict(ckpt["loader"])
    with loader:
        after = train(model, optimizer, loader, steps=10**9)

    resumed = before[: ckpt["step"]] + after
    same = len(resumed) == len(uninterrupted) and all(
        a[0] == b[0] and torch.equal(a[1], b[1]) for a, b in zip(resumed, uninterrupted)
    )
    print(
        f"checkpoint at step {ckpt['step']}; uninterrupted run: {len(uninterrupted)} batches; "
        f"preempted + restarted: {ckpt['step']} + {len(after)} batches"
    )
    print(f"resumed run matches the uninterrupted one, augmentation included: {same}")
    print(f"same final weights: {torch.equal(model.weight.detach(), final_uninterrupted)}")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
