"""raydl with PyTorch Lightning: `Trainer.fit` on a raydl DataLoader, on one CPU process or with DDP.

The one change in a Lightning project is the loader's class:

    from raydl import DataLoader          # was: from torch.utils.data import DataLoader

Lightning re-instantiates loaders from their attributes when it must change their sampler (DDP
with use_distributed_sampler=True, predict): raydl's `ray_*` options are `__init__` arguments
stored as attributes, so the rebuilt loader is again a `raydl.DataLoader` with the same options.

    python examples/lightning_example.py                   # 1 CPU process
    python examples/lightning_example.py --devices 2       # DDP over 2 CPU processes (gloo)

Ray: with one process, raydl starts a local Ray on loopback on the first batch (or joins
RAY_ADDRESS / --ray-address). With --devices > 1, every rank's loader must join the same Ray:
this script (rank 0, before Lightning launches the other ranks) starts the local Ray itself and
exports RAY_ADDRESS; Lightning's "ddp" strategy relaunches this script for the other ranks with
that environment, so their loaders join it. With RAY_ADDRESS already set, all ranks join that.

Each batch carries the pid of the process that made it; every rank prints which processes made
its batches, and the class and ray_ options of the loader Lightning trained on.
"""

from __future__ import annotations

import argparse
import os
import sys

# Before Ray is imported: a local Ray started by this script listens on 127.0.0.1 only.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402

from raydl import DataLoader  # noqa: E402


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


class Classifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3)
        )
        self.worker_pids: set[int] = set()

    def training_step(self, batch, batch_idx):
        images, labels, pids = batch
        self.worker_pids.update(pids.tolist())
        loss = F.cross_entropy(self.net(images), labels)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)

    def on_train_end(self) -> None:
        loader = self.trainer.train_dataloader
        cls = f"{type(loader).__module__}.{type(loader).__qualname__}"
        trainer_pid = os.getpid()
        from_ray = trainer_pid not in self.worker_pids and len(self.worker_pids) > 0
        # One write per line: the ranks share the output pipe, and print() writes the newline separately.
        sys.stdout.write(
            f"rank {self.global_rank}: {self.trainer.global_step} steps on {cls} "
            f"(ray_remote_args={loader.ray_remote_args}, ray_job={loader.ray_job}, sampler {type(loader.sampler).__name__}); "
            f"batches made by worker pids {sorted(self.worker_pids)}, not by this trainer (pid {trainer_pid}): {from_ray}\n"
        )
        sys.stdout.flush()


def start_shared_ray_for_ranks() -> None:
    """Rank 0 of a multi-process run: start the local Ray (loopback) that every rank's loader will join."""
    if os.environ.get("RAY_ADDRESS") or "LOCAL_RANK" in os.environ:
        return  # a cluster is named already, or this is a rank Lightning launched
    import ray

    ray.init(include_dashboard=False)  # a new local Ray, on 127.0.0.1 (see the variable set at the top)
    os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address  # inherited by the other ranks
    print(
        f"started a local Ray at {os.environ['RAY_ADDRESS']} for {os.environ.get('WORLD_SIZE', 'all')} ranks",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--max-epochs", type=int, default=2)
    parser.add_argument("--devices", type=int, default=1, help="CPU processes; > 1 trains with DDP")
    parser.add_argument("--ray-address", default=None, help="Ray cluster to join; default: RAY_ADDRESS or a local Ray")
    args = parser.parse_args()

    if args.devices > 1 and args.ray_address is None:
        start_shared_ray_for_ranks()
    loader = DataLoader(
        SyntheticImages(args.samples),
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.num_workers,
        persistent_workers=True,
        ray_address=args.ray_address,
        ray_remote_args={"num_cpus": 0},  # kept by Lightning's re-instantiation, as every ray_ option
        # DDP: the ranks' loaders share one pool of num_workers x ranks workers (NOTE [ raydl job pool ])
        ray_job=True if args.devices > 1 else None,
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        max_epochs=args.max_epochs,
        use_distributed_sampler=True,
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Classifier(), loader)
    trainer.train_dataloader.shutdown()  # release the persistent Ray workers now
    if trainer.global_rank == 0:
        print(
            f"lightning_example: done, {trainer.global_step} steps per rank on {args.devices} process(es)", flush=True
        )


if __name__ == "__main__":
    main()
