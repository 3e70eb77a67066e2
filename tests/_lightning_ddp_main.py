"""Lightning DDP (2 processes, CPU, gloo) over a raydl loader; run by tests/test_integrations.py.

    RAY_ADDRESS=<a running Ray> python tests/_lightning_ddp_main.py --out DIR

Lightning's "ddp" strategy relaunches this script for rank 1 with the same environment, so both
ranks' raydl loaders join the Ray named by RAY_ADDRESS. With use_distributed_sampler=True,
Lightning re-instantiates the loader in each rank with a DistributedSampler; each rank writes
`rank{R}.json` to DIR: the class and ray_ options of the loader it trained on, its sampler, the
Ray it joined and, per sample, [index, worker id, pid, parent pid] of the process that made it.
The classes are defined here, in `__main__`, so Ray pickles them by value.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before Ray is imported: loopback only

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import Dataset, get_worker_info  # noqa: E402

import raydl  # noqa: E402


class Provenance(Dataset):
    """Item i: (features, label, [i, worker id, pid, parent pid])."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        info = get_worker_info()
        meta = torch.tensor([i, -1 if info is None else info.id, os.getpid(), os.getppid()])
        return torch.rand(4), torch.tensor(i % 2), meta


class Model(L.LightningModule):
    def __init__(self, out: str) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 2)
        self.out = out
        self.rows: list = []

    def training_step(self, batch, batch_idx):
        x, y, meta = batch
        self.rows += meta.tolist()
        return nn.functional.cross_entropy(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def on_train_end(self) -> None:
        import ray

        loader = self.trainer.train_dataloader
        record = {
            "rank": self.global_rank,
            "world_size": self.trainer.world_size,
            "pid": os.getpid(),
            "class": f"{type(loader).__module__}.{type(loader).__qualname__}",
            "ray_remote_args": loader.ray_remote_args,
            "ray_startup_timeout_s": loader.ray_startup_timeout_s,
            "sampler": type(loader.sampler).__name__,
            "gcs_address": ray.get_runtime_context().gcs_address,
            "rows": self.rows,
        }
        with open(os.path.join(self.out, f"rank{self.global_rank}.json"), "w") as f:
            json.dump(record, f)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--max-steps", type=int, default=3)
    args = parser.parse_args()

    loader = raydl.DataLoader(
        Provenance(args.samples),
        batch_size=4,
        shuffle=True,
        num_workers=2,
        timeout=60,
        ray_remote_args={"num_cpus": 0, "scheduling_strategy": "DEFAULT"},
        ray_startup_timeout_s=45.0,
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        use_distributed_sampler=True,
        max_steps=args.max_steps,
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Model(args.out), loader)


if __name__ == "__main__":
    main()
