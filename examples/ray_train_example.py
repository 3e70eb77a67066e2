"""raydl with Ray Train: a `TorchTrainer` whose training workers each load data with raydl workers.

Build the raydl loader inside `train_loop_per_worker`, with a `DistributedSampler` of your own:

    loader = raydl.DataLoader(ds, batch_size=64, num_workers=2,
                              sampler=DistributedSampler(ds, shuffle=True, seed=0))
    loader = ray.train.torch.prepare_data_loader(loader)   # keeps it: it already has a DistributedSampler

`prepare_data_loader` only moves batches to the worker's device then. Given a loader *without* a
DistributedSampler and more than one training worker, it rebuilds a plain
`torch.utils.data.DataLoader(**kwargs)`, dropping raydl's class and `ray_*` options; if you rely
on that, call `raydl.patch(ray_remote_args=...)` at the top of `train_loop_per_worker` (each
training worker is its own process, so patching the driver does nothing there), and the rebuilt
loader loads with Ray workers too.

    python examples/ray_train_example.py                    # 2 training workers, 0.5 CPU each
    python examples/ray_train_example.py --train-workers 1

Ray: this script calls `ray.init()`, which joins RAY_ADDRESS if set and otherwise starts a local
Ray (on 127.0.0.1 only: the variable set before `import ray` below). The training workers are Ray
actors of that Ray; their raydl loaders find Ray already initialised and start their data workers
in the same cluster (0 CPUs each by default, so they always fit beside the training workers).
"""

from __future__ import annotations

import argparse
import os
import tempfile

# Before Ray is imported: a local Ray started by this script listens on 127.0.0.1 only.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import ray  # noqa: E402
import ray.train  # noqa: E402
import ray.train.torch  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from ray.train import Checkpoint, RunConfig, ScalingConfig  # noqa: E402
from ray.train.torch import TorchTrainer  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import Dataset, DistributedSampler  # noqa: E402

import raydl  # noqa: E402


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


def train_loop_per_worker(config: dict) -> None:
    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    dataset = SyntheticImages(config["samples"])
    raydl_loader = raydl.DataLoader(
        dataset,
        batch_size=config["batch_size"],
        sampler=DistributedSampler(dataset, shuffle=True, seed=0),  # this worker's shard
        num_workers=config["num_workers"],
        persistent_workers=True,
        ray_remote_args={"num_cpus": 0},
    )
    loader = ray.train.torch.prepare_data_loader(raydl_loader)  # kept as is; batches moved to the device

    torch.manual_seed(0)
    model = ray.train.torch.prepare_model(
        nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3))
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    my_pid = os.getpid()
    for epoch in range(config["epochs"]):
        loader.sampler.set_epoch(epoch)
        pids, seen, loss_sum = set(), 0, 0.0
        for images, labels, worker_pids in loader:
            loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            pids.update(worker_pids.tolist())
            seen += len(labels)
            loss_sum += loss.item() * len(labels)
        metrics = {
            "epoch": epoch,
            "loss": loss_sum / seen,
            "samples": seen,
            "worker_pids": sorted(pids),
            "train_worker_pid": my_pid,
            "from_ray_workers": my_pid not in pids,
        }
        with tempfile.TemporaryDirectory() as d:
            checkpoint = None
            if rank == 0:
                torch.save(model.state_dict(), os.path.join(d, "model.pt"))
                checkpoint = Checkpoint.from_directory(d)
            ray.train.report(metrics, checkpoint=checkpoint)
    raydl_loader.shutdown()  # release the persistent Ray workers now


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-workers", type=int, default=2)
    parser.add_argument("--cpus-per-train-worker", type=float, default=0.5)
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--num-workers", type=int, default=2, help="raydl workers per training worker")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--storage-path", default=None, help="where Ray Train keeps checkpoints; default: a temp dir")
    args = parser.parse_args()

    if os.environ.get("RAY_ADDRESS"):
        ray.init()  # join that cluster
    else:
        ray.init(include_dashboard=False)  # a new local Ray on loopback
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={
            "samples": args.samples,
            "batch_size": args.batch_size,
            "num_workers": args.num_workers,
            "epochs": args.epochs,
        },
        scaling_config=ScalingConfig(
            num_workers=args.train_workers, use_gpu=False, resources_per_worker={"CPU": args.cpus_per_train_worker}
        ),
        run_config=RunConfig(
            storage_path=args.storage_path or tempfile.mkdtemp(prefix="raydl_ray_train_"), name="raydl"
        ),
    )
    result = trainer.fit()
    print(f"ray_train_example: done, rank 0's last metrics: {result.metrics}", flush=True)


if __name__ == "__main__":
    main()
