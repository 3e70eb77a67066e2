"""Train on Parquet streamed through raydl's node cache, checkpoint mid-epoch, resume exactly.

    python examples/stream_parquet.py
    # DDP, 2 CPU ranks (gloo) on one machine:
    torchrun --nproc_per_node=2 examples/stream_parquet.py

With no `--url` it writes a small corpus to a temp folder: 12 files of 2 row groups each, columns x0..x7
(float features), label (4 classes), id (the row's number) and an unused text column that `columns=`
leaves unread. The files are sorted by class, so an order that read them in turn would feed the model
one class at a time: `shuffle=True` (or `raydl.ParquetDistributedSampler` under DDP) permutes the row
groups and shuffles rows within windows that fit in half of `cache_limit` (docs/streaming.md).

The script trains a small model for `--epochs` epochs, saves `{"model", "optimizer", "loader":
loader.state_dict()}` in the middle of the last one, finishes the epoch, then builds a new model and
loader, loads the checkpoint and checks that the resumed loader gives exactly the batches the
uninterrupted run trained on after the checkpoint, and the same final weights. Under torchrun each rank
checkpoints its own loader, and rank 0 checks (all_gather of the ids) that the ranks saw every sample
once per epoch and agreed on the node slot count the order is dealt over.

`--url s3://bucket/prefix` reads an existing folder with the same columns instead (write one with
`--dir DIR`, then `aws s3 cp --recursive DIR/corpus s3://bucket/prefix`). The dataset reaches S3 through
pyarrow's S3FileSystem with its default credential chain, in the driver (listing, footers) and in each
node's cache actor (the row groups): AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN),
or AWS_PROFILE and ~/.aws, or the instance's role; AWS_REGION / AWS_DEFAULT_REGION; AWS_ENDPOINT_URL for
MinIO or another S3-compatible store (or pass `filesystem=pyarrow.fs.S3FileSystem(endpoint_override=...)`).
On a cluster they must be set on every node, where the caches run.

Which Ray: RAY_ADDRESS if set, else a local Ray (under torchrun one for the node's ranks, as in
examples/ddp_torchrun_example.py).
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import sys
import tempfile

# Before Ray is imported: a local Ray listens on 127.0.0.1 only; do not rewrite that address to a routable IP.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import raydl  # noqa: E402

FEATURES = [f"x{j}" for j in range(8)]
CLASSES = 4


def write_corpus(folder: str, rows: int, files: int) -> None:
    """`files` Parquet files of 2 row groups, sorted by class: file f holds only class f * CLASSES // files."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    centers = rng.normal(0, 1.5, size=(CLASSES, len(FEATURES)))
    per_file = rows // files
    for f in range(files):
        label = f * CLASSES // files
        ids = np.arange(f * per_file, (f + 1) * per_file)
        x = centers[label] + rng.normal(0, 1, size=(per_file, len(FEATURES)))
        table = pa.table(
            {
                **{name: x[:, j].astype(np.float32) for j, name in enumerate(FEATURES)},
                "label": np.full(per_file, label),
                "id": ids,
                "text": [f"row {i}" for i in ids],
            }
        )
        pq.write_table(table, os.path.join(folder, f"part-{f:03d}.parquet"), row_group_size=-(-per_file // 2))


def to_tensors(batch: dict) -> dict:
    """batch_transform, in the workers: the feature columns stacked into one float32 tensor per batch."""
    x = np.stack([batch[name] for name in FEATURES], axis=1).astype(np.float32)
    return {"x": torch.from_numpy(x), "label": batch["label"], "id": batch["id"]}


def say(*parts: object) -> None:
    """One line in one write: the lines of concurrent ranks do not interleave."""
    sys.stdout.write(" ".join(str(p) for p in parts) + "\n")
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="an existing Parquet folder (s3://bucket/prefix) instead of a local corpus")
    parser.add_argument("--dir", help="where to write the corpus and the cache (kept); default: a temp folder, removed")
    parser.add_argument("--rows", type=int, default=3072)
    parser.add_argument("--files", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument(
        "--cache-limit", default="150KB", help="bytes the node cache holds (its shuffle window: half of it)"
    )
    args = parser.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    ddp = world > 1
    if ddp:
        dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    rank = dist.get_rank() if ddp else 0

    # the corpus: rank 0 writes it, every rank reads the same folder
    box = [args.url or args.dir or (tempfile.mkdtemp(prefix="raydl-parquet-") if rank == 0 else None)]
    if rank == 0 and not args.url:
        os.makedirs(os.path.join(box[0], "corpus"), exist_ok=True)
        write_corpus(os.path.join(box[0], "corpus"), args.rows, args.files)
    if ddp:
        dist.broadcast_object_list(box, src=0)
    source = box[0] if args.url else os.path.join(box[0], "corpus")
    cache_dir = os.path.join(tempfile.gettempdir(), "raydl-cache") if args.url else os.path.join(box[0], "cache")
    ds = raydl.ParquetDataset(
        source,
        columns=[*FEATURES, "label", "id"],  # the text column is never fetched
        batch_transform=to_tensors,
        cache_dir=cache_dir,
        cache_limit=args.cache_limit,
    )
    if rank == 0:
        say(f"{source}: {ds}, shuffle window {ds.shuffle_window} row groups")

    def build():
        """What a (re)started job builds: the same model, optimizer and loader."""
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(len(FEATURES), 32), nn.ReLU(), nn.Linear(32, CLASSES))
        if ddp:
            model = nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        sampler = raydl.ParquetDistributedSampler(ds, seed=0) if ddp else None
        loader = raydl.DataLoader(
            ds,
            batch_size=args.batch_size,
            shuffle=not ddp,
            sampler=sampler,
            generator=None if ddp else torch.Generator().manual_seed(0),
            num_workers=args.num_workers,
            persistent_workers=True,
        )
        return model, optimizer, sampler, loader

    def step(model, optimizer, batch) -> tuple[float, int]:
        logits = model(batch["x"])
        loss = F.cross_entropy(logits, batch["label"])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.item() * len(logits), int((logits.argmax(1) == batch["label"]).sum())

    path = os.path.join(tempfile.mkdtemp(prefix="raydl-ckpt-"), f"checkpoint-rank{rank}.pt")
    model, optimizer, sampler, loader = build()
    after_checkpoint = []  # the ids of each batch the uninterrupted run trains on after the checkpoint
    with loader:
        for epoch in range(args.epochs):
            if ddp:
                sampler.set_epoch(epoch)
            last = epoch == args.epochs - 1
            ids, loss_sum, correct, mixed, batches = [], 0.0, 0, 0, 0
            for i, batch in enumerate(loader):
                if last and i >= len(loader) // 2:
                    after_checkpoint.append(batch["id"].tolist())
                loss, right = step(model, optimizer, batch)
                loss_sum, correct = loss_sum + loss, correct + right
                if last and i + 1 == len(loader) // 2:  # mid-epoch, after a step: the state is the next batch's
                    torch.save(
                        {
                            "epoch": epoch,
                            "step": i + 1,
                            "model": model.state_dict(),
                            "optimizer": optimizer.state_dict(),
                            "loader": loader.state_dict(),
                        },
                        path,
                    )
                ids += batch["id"].tolist()
                mixed += len(set(batch["label"].tolist())) == CLASSES
                batches += 1
            figures = [(ids, loss_sum, correct, mixed, batches, sampler.slots if ddp else None)]
            if ddp:
                figures = [None] * world
                dist.all_gather_object(figures, (ids, loss_sum, correct, mixed, batches, sampler.slots))
            if rank == 0:
                seen = [i for f in figures for i in f[0]]
                say(
                    f"epoch {epoch}: loss {sum(f[1] for f in figures) / len(seen):.3f}, accuracy "
                    f"{100 * sum(f[2] for f in figures) / len(seen):.1f}% over {len(seen)} samples, "
                    f"{sum(f[3] for f in figures)}/{sum(f[4] for f in figures)} batches hold all {CLASSES} classes"
                )
                if ddp:
                    counts = collections.Counter(seen)
                    padding = sampler.total_size - len(ds)
                    once = set(counts) == set(range(len(ds))) and len(seen) == len(ds) + padding
                    say(
                        f"epoch {epoch}: samples per rank {[len(f[0]) for f in figures]}, every sample seen exactly "
                        f"once over the {world} ranks: {once and padding == 0}"
                    )
                    if epoch == 0:
                        slots = [f[5] for f in figures]
                        say(f"node slots per rank after the first epoch: {slots}, agreed: {len(set(slots)) == 1}")
    final = [p.detach().clone() for p in model.parameters()]

    # The restarted job: everything built anew, the checkpoint loaded, the rest of the epoch trained.
    model, optimizer, sampler, loader = build()
    ckpt = torch.load(path, weights_only=True)
    model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    if ddp:
        sampler.set_epoch(ckpt["epoch"])
    loader.load_state_dict(ckpt["loader"])
    resumed = []
    with loader:
        for batch in loader:
            step(model, optimizer, batch)
            resumed.append(batch["id"].tolist())
    same_batches = resumed == after_checkpoint
    same_weights = all(torch.equal(a, b.detach()) for a, b in zip(final, model.parameters()))
    say(
        f"rank {rank}: checkpoint at batch {ckpt['step']} of epoch {ckpt['epoch']}; the resumed loader gave "
        f"{len(resumed)} batches, the remaining ones of the uninterrupted run: {same_batches}; same final weights: "
        f"{same_weights}"
    )
    if ddp:
        dist.barrier()
        dist.destroy_process_group()
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    if rank == 0:
        raydl.release_node_caches()  # the node cache actors end (their files stay, for a next run)
        if not (args.url or args.dir):
            shutil.rmtree(box[0], ignore_errors=True)
    if not (same_batches and same_weights):
        raise SystemExit(1)
    if rank == 0:
        say(f"stream_parquet: done, {world} process(es)")


if __name__ == "__main__":
    main()
