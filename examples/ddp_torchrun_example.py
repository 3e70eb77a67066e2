"""raydl with plain DDP under torchrun: the ranks' raydl loaders share one Ray and one pool of workers.

One command on one machine (2 CPU processes, gloo):

    torchrun --nproc_per_node=2 examples/ddp_torchrun_example.py
    # or: python -m torch.distributed.run --nproc_per_node=2 examples/ddp_torchrun_example.py

Each rank builds `raydl.DataLoader(ds, sampler=DistributedSampler(ds), num_workers=...,
ray_job=True)` as it would build torch's, so the ranks see disjoint shards; with `ray_job=True`
the ranks' loaders share one pool of `num_workers x world size` Ray actors (the job is named
after torchrun's MASTER_ADDR:MASTER_PORT), and each batch goes to the job's least busy worker.

Which Ray the ranks share, with no code here for it:
  * RAY_ADDRESS set (a cluster; with token auth also `export RAY_AUTH_MODE=token`): every rank's
    loader joins it (raydl's precedence);
  * otherwise the ranks of this node share one local Ray on 127.0.0.1: the first rank to iterate
    starts it, the others find its address through a file lock in the temp directory
    (NOTE [ raydl node Ray ] in raydl/cluster/node_ray.py). Its owner keeps it up at exit until
    the node's other ranks are done.

Every sample carries its index and the pid of the process that made it; each rank prints its
sample count per epoch and which processes made its batches, and rank 0 checks that the ranks'
shards are disjoint and cover the dataset, and that the ranks' batches came from one pool.
"""

from __future__ import annotations

import argparse
import os
import sys

# Before Ray is imported (raydl imports it lazily): a local Ray listens on 127.0.0.1 only, and
# a rank connecting to one on 127.0.0.1 does not rewrite that address to a routable IP.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402
from torch.utils.data import Dataset, DistributedSampler  # noqa: E402

import raydl  # noqa: E402


class IndexedPoints(Dataset):
    """Point i: 8 features, a label, and (i, pid of the process that made it)."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=g)
        self.y = (self.x.sum(dim=1) > 0).long()

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i], torch.tensor([i, os.getpid()])


def say(*parts: object, flush: bool = True) -> None:
    """Print one line with a single write: lines of concurrent ranks never interleave in a shared pipe."""
    sys.stdout.write(" ".join(str(p) for p in parts) + "\n")
    if flush:
        sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--num-workers", type=int, default=2, help="raydl workers per rank")
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()

    dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    rank, world_size = dist.get_rank(), dist.get_world_size()

    dataset = IndexedPoints(args.samples)
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = raydl.DataLoader(
        dataset,
        batch_size=args.batch_size,
        sampler=sampler,
        num_workers=args.num_workers,
        persistent_workers=True,
        ray_job=True,  # one pool for the job's ranks (NOTE [ raydl job pool ])
    )
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    with loader:
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            indices, pids, loss_sum = [], set(), 0.0
            for x, y, meta in loader:
                loss = F.cross_entropy(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                indices += meta[:, 0].tolist()
                pids.update(meta[:, 1].tolist())
                loss_sum += loss.item() * len(y)
            say(
                f"rank {rank}: epoch {epoch}: {len(indices)} samples, loss {loss_sum / len(indices):.3f}, "
                f"made by Ray worker pids {sorted(pids)} (this rank's pid {os.getpid()}: "
                f"{'not among them' if os.getpid() not in pids else 'AMONG THEM'})",
                flush=True,
            )
            shards, workers = [None] * world_size, [None] * world_size
            dist.all_gather_object(shards, indices)
            dist.all_gather_object(workers, sorted(pids))
            if rank == 0:
                sets = [set(s) for s in shards]
                disjoint = sum(len(s) for s in sets) == len(set().union(*sets))
                pool = set().union(*map(set, workers))
                shared = set.intersection(*map(set, workers))
                say(
                    f"epoch {epoch}: samples per rank {[len(s) for s in shards]}, shards disjoint: {disjoint}, "
                    f"cover the dataset: {set().union(*sets) == set(range(len(dataset)))}; "
                    f"workers used: {len(pool)} (the job's pool has {args.num_workers * world_size}), "
                    f"serving every rank: {len(shared)}",
                    flush=True,
                )
    import ray

    addresses = [None] * world_size
    dist.all_gather_object(addresses, ray.get_runtime_context().gcs_address)
    if rank == 0:
        say(f"Ray of each rank: {addresses}; one Ray for the node's ranks: {len(set(addresses)) == 1}", flush=True)
        say(f"ddp_torchrun_example: done, {world_size} ranks", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
