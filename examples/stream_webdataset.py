"""Train on WebDataset tar shards streamed through raydl's node cache, checkpoint mid-epoch, resume exactly.

    python examples/stream_webdataset.py

With no `--url` it writes 8 small shards to a temp folder, as webdataset's TarWriter would: each sample is
`<key>.npy` (a 4x4 float32 array) and `<key>.cls` (its class, one of 4); the shards are sorted by class,
so reading them in turn would feed the model one class at a time. `raydl.TarDataset` indexes the shards
once, cuts them into units of whole samples, and `shuffle=True` permutes the units and shuffles the
samples within windows that fit in half of `cache_limit` (docs/shards.md). Decoding is the `transform`,
run in the Ray workers.

The script trains a small model for `--epochs` epochs, saves `{"model", "optimizer", "loader":
loader.state_dict()}` in the middle of the last one, finishes the epoch, then builds a new model and
loader, loads the checkpoint and checks that the resumed loader gives exactly the batches the
uninterrupted run trained on after the checkpoint, and the same final weights.

`--url "s3://bucket/train-{000000..000007}.tar"` (a brace pattern, a prefix, or a folder) reads existing
shards with the same fields instead (write them with `--dir DIR`, then `aws s3 cp --recursive DIR/shards
s3://bucket/`). The dataset reaches S3 through pyarrow's S3FileSystem with its default credential chain,
in the driver (listing, indexing) and in each node's cache actor (the units): AWS_ACCESS_KEY_ID /
AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN), or AWS_PROFILE and ~/.aws, or the instance's role;
AWS_REGION / AWS_DEFAULT_REGION; AWS_ENDPOINT_URL for MinIO or another S3-compatible store. On a
cluster they must be set on every node, where the caches run. RAY_ADDRESS picks the Ray to join, else a
local one starts.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import tarfile
import tempfile

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # a local Ray stays on 127.0.0.1

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import raydl  # noqa: E402

CLASSES = 4


def write_shards(folder: str, samples: int, shards: int) -> str:
    """`shards` tar shards sorted by class (shard s holds class s * CLASSES // shards); returns their brace pattern."""
    rng = np.random.default_rng(0)
    centers = rng.normal(0, 1.5, size=(CLASSES, 4, 4))
    per_shard = samples // shards
    for s in range(shards):
        label = s * CLASSES // shards
        with tarfile.open(os.path.join(folder, f"train-{s:06d}.tar"), "w") as tar:
            for i in range(s * per_shard, (s + 1) * per_shard):
                array = io.BytesIO()
                np.save(array, (centers[label] + rng.normal(0, 1, size=(4, 4))).astype(np.float32))
                for field, data in (("npy", array.getvalue()), ("cls", str(label).encode())):
                    info = tarfile.TarInfo(f"{i:06d}.{field}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return os.path.join(folder, f"train-{{000000..{shards - 1:06d}}}.tar")


def decode(sample: dict) -> dict:
    """transform, in the workers: a sample's bytes to tensors (put an image decoder and augmentations here)."""
    x = torch.from_numpy(np.load(io.BytesIO(sample["npy"]))).flatten()
    return {"x": x, "label": int(sample["cls"]), "id": int(sample["__key__"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="existing shards (s3://bucket/train-{000000..000007}.tar) instead of local ones")
    parser.add_argument("--dir", help="where to write the shards and the cache (kept); default: a temp folder, removed")
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--cache-limit", default="512KB", help="bytes the node cache holds (a quarter of the shards)")
    args = parser.parse_args()

    root = args.dir or tempfile.mkdtemp(prefix="raydl-shards-")
    source = args.url
    if source is None:
        os.makedirs(os.path.join(root, "shards"), exist_ok=True)
        source = write_shards(os.path.join(root, "shards"), args.samples, args.shards)
    ds = raydl.TarDataset(source, transform=decode, cache_dir=os.path.join(root, "cache"), cache_limit=args.cache_limit)
    print(f"{source}: {ds}, fields {ds.fields}, shuffle window {ds.shuffle_window} units")

    def build():
        """What a (re)started job builds: the same model, optimizer and loader."""
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, CLASSES))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = raydl.DataLoader(
            ds,
            batch_size=args.batch_size,
            shuffle=True,
            generator=torch.Generator().manual_seed(0),
            num_workers=args.num_workers,
            persistent_workers=True,
        )
        return model, optimizer, loader

    def step(model, optimizer, batch) -> tuple[float, int]:
        logits = model(batch["x"])
        loss = F.cross_entropy(logits, batch["label"])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.item() * len(logits), int((logits.argmax(1) == batch["label"]).sum())

    path = os.path.join(root, "checkpoint.pt")
    model, optimizer, loader = build()
    after_checkpoint = []  # the ids of each batch the uninterrupted run trains on after the checkpoint
    with loader:
        for epoch in range(args.epochs):
            last = epoch == args.epochs - 1
            ids, loss_sum, correct, mixed = [], 0.0, 0, 0
            for i, batch in enumerate(loader):
                if last and i >= len(loader) // 2:
                    after_checkpoint.append(batch["id"].tolist())
                loss, right = step(model, optimizer, batch)
                loss_sum, correct = loss_sum + loss, correct + right
                if last and i + 1 == len(loader) // 2:  # mid-epoch, after a step: the state is the next batch's
                    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
                    torch.save({"epoch": epoch, "step": i + 1, **state, "loader": loader.state_dict()}, path)
                ids += batch["id"].tolist()
                mixed += len(set(batch["label"].tolist())) == CLASSES
            print(
                f"epoch {epoch}: loss {loss_sum / len(ids):.3f}, accuracy {100 * correct / len(ids):.1f}% over "
                f"{len(ids)} samples, {mixed}/{len(loader)} batches hold all {CLASSES} classes; every sample once: "
                f"{len(ids) == len(set(ids)) == len(ds)}"
            )
    final = [p.detach().clone() for p in model.parameters()]

    # The restarted job: everything built anew, the checkpoint loaded, the rest of the epoch trained.
    model, optimizer, loader = build()
    ckpt = torch.load(path, weights_only=True)
    model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    loader.load_state_dict(ckpt["loader"])
    resumed = []
    with loader:
        for batch in loader:
            step(model, optimizer, batch)
            resumed.append(batch["id"].tolist())
    same_batches = resumed == after_checkpoint
    same_weights = all(torch.equal(a, b.detach()) for a, b in zip(final, model.parameters()))
    print(
        f"checkpoint at batch {ckpt['step']} of epoch {ckpt['epoch']}; the resumed loader gave {len(resumed)} "
        f"batches, the remaining ones of the uninterrupted run: {same_batches}; same final weights: {same_weights}"
    )
    raydl.release_node_caches()  # the node cache actors end (their files stay, for a next run)
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)
    if not (same_batches and same_weights):
        raise SystemExit(1)
    print("stream_webdataset: done")


if __name__ == "__main__":
    main()
