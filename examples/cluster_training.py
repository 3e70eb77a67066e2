"""Train with raydl workers on the CPU-only "data" nodes of a multi-node Ray cluster.

Start the local multi-node cluster first (a head with resource "trainer" and worker nodes with
resource "data", all on loopback), then run this against it:

    cluster/local_launcher.sh start 2
    RAY_AUTH_MODE=token RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 \\
        python examples/cluster_training.py --address "$(cluster/local_launcher.sh address)"
    cluster/local_launcher.sh stop

The same script works on a cloud or KubeRay cluster built from cluster/*.yaml (run it on the
head node with --address auto). Every worker asks for one "data" unit, so none runs on the
trainer's node; the script prints where each worker ran and the per-epoch time.
"""

from __future__ import annotations

import argparse
import collections
import time

import numpy as np
import ray
import torch
from torch import nn
from torch.utils.data import Dataset

import raydl


class AugmentedImages(Dataset):
    """Synthetic 3x32x32 images with a CPU-heavy augmentation, and the node that made each sample."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        rng = np.random.default_rng(i)
        image = rng.random((3, 32, 32), dtype=np.float32)
        for _ in range(4):  # stand-in for decode + random crops/flips
            image = np.roll(image, int(rng.integers(0, 4)), axis=2)
        label = int(image.mean(axis=(1, 2)).argmax())
        return torch.from_numpy(image), label, ray.get_runtime_context().get_node_id()


def main() -> None:
    parser = argparse.ArgumentParser(description="raydl on a multi-node Ray cluster")
    parser.add_argument("--address", default="auto", help="Ray cluster address (cluster/local_launcher.sh address)")
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--num-workers", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--cpus-per-worker", type=float, default=0.5)
    args = parser.parse_args()

    ray.init(address=args.address)
    trainer_node = ray.get_runtime_context().get_node_id()
    data_nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("data")]
    print(f"cluster: {len(ray.nodes())} nodes, {len(data_nodes)} with 'data'; trainer on {trainer_node[:8]}")

    loader = raydl.DataLoader(
        AugmentedImages(args.samples),
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.num_workers,
        persistent_workers=True,
        generator=torch.Generator().manual_seed(0),
        # CPU-only data nodes, never the trainer's node:
        ray_remote_args={"num_cpus": args.cpus_per_worker, "resources": {"data": 1}},
    )
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 3)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with loader:
        for epoch in range(args.epochs):
            start = time.perf_counter()
            per_node: collections.Counter = collections.Counter()
            for images, labels, nodes in loader:
                optimizer.zero_grad()
                loss = nn.functional.cross_entropy(model(images), labels)
                loss.backward()
                optimizer.step()
                per_node.update(nodes)
            spread = ", ".join(f"{node[:8]}: {count}" for node, count in sorted(per_node.items()))
            print(
                f"epoch {epoch}: loss {loss.item():.3f} in {time.perf_counter() - start:.2f} s; samples per node: {spread}"
            )
            assert trainer_node not in per_node, "a worker ran on the trainer's node"
        workers = ", ".join(f"{r.worker_id}->{r.node_id[:8]}" for r in loader.worker_records)
        print(f"workers: {workers}")
    print("finished: workers ran on", len({r.node_id for r in loader.worker_records} or per_node), "data node(s)")


if __name__ == "__main__":
    main()
