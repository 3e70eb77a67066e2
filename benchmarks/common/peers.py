"""The loaders raydl is measured against, behind one small interface (`Loader`), for the image benchmarks.

`make_loader(kind, ds, args)` builds one: torch's DataLoader or raydl's with the same arguments
(`TorchLike`), Ray Data (`RayDataLoader`), an SPDL pipeline (`SpdlLoader`, the same per-sample
code or spdl.io's decoder) and torchdata.nodes (`NodesLoader`). `args` carries batch_size,
num_workers, spdl_threads and raydata_reservation. Each library is imported only when its loader
is built, so a child process measuring one loader imports only that one.
"""

from __future__ import annotations

import sys
import time
from typing import Iterator, Optional


class Loader:
    """One loader under test: `epoch()` iterates one epoch of (images, labels); `worker_pids()`; `close()`."""

    ray_workers_are_workers = False

    def epoch(self) -> Iterator:
        raise NotImplementedError

    def worker_pids(self) -> set:
        return set()

    def close(self) -> None:
        pass


class TorchLike(Loader):
    def __init__(self, kind: str, ds, args, raydl_kwargs: Optional[dict] = None) -> None:
        import torch

        common = dict(batch_size=args.batch_size, shuffle=True, num_workers=args.num_workers, persistent_workers=True)
        if kind == "torch":
            self.loader = torch.utils.data.DataLoader(ds, **common)
        else:
            import raydl

            kw = {"ray_threads_per_worker": 2} if kind == "raydl-threads2" else {}
            self.loader = raydl.DataLoader(ds, **common, **kw, **(raydl_kwargs or {}))
        self.kind = kind

    def epoch(self) -> Iterator:
        return iter(self.loader)

    def worker_pids(self) -> set:
        if self.kind == "torch":
            it = getattr(self.loader, "_iterator", None)
            return {w.pid for w in getattr(it, "_workers", [])}
        return {r.pid for r in self.loader.worker_records if r is not None}

    def close(self) -> None:
        if hasattr(self.loader, "shutdown"):
            self.loader.shutdown()
        self.loader = None


def _raydata_row(row: dict, _transform=[]) -> dict:  # noqa: B006 - a per-process cache of the transform
    """Ray Data's map function: the same load + transform as the dataset's __getitem__, numpy out."""
    from PIL import Image

    from examples.train_image_classifier import TrainTransform

    if not _transform:
        _transform.append(TrainTransform(224))
    with open(row["path"], "rb") as f:
        img = Image.open(f).convert("RGB")
    return {"image": _transform[0](img).numpy(), "label": row["label"]}


class RayDataLoader(Loader):
    ray_workers_are_workers = True

    def __init__(self, ds, args, remote_args: Optional[dict] = None) -> None:
        """`remote_args`: Ray remote arguments of the shuffle's and the map's tasks (where they run)."""
        import ray

        _start_local_ray_like_raydl()
        import ray.data
        from ray import cloudpickle

        from examples import train_image_classifier

        cloudpickle.register_pickle_by_value(train_image_classifier)  # the transform travels by value
        cloudpickle.register_pickle_by_value(sys.modules[__name__])  # and the map function
        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False
        # Ray Data's per-operator CPU reservation leaves its map 1 task at a time on 2 CPUs (see
        # bench_throughput.py); off unless --raydata-reservation, so the map really runs 2 tasks.
        ctx.op_resource_reservation_enabled = args.raydata_reservation
        items = [{"path": p, "label": y} for p, y in ds.samples]
        # One block per batch of paths: with from_items' default (up to 200 blocks) the per-epoch
        # shuffle and the map are hundreds of tiny tasks (measured 60 vs 250-340 images/s).
        blocks = max(1, -(-len(items) // args.batch_size))
        ra = remote_args or {}
        self.ds = ray.data.from_items(items, override_num_blocks=blocks).random_shuffle(**ra).map(_raydata_row, **ra)
        self.batch_size = args.batch_size
        self._ray = ray

    def epoch(self) -> Iterator:
        for b in self.ds.iter_torch_batches(batch_size=self.batch_size):
            yield b["image"], b["label"]

    def close(self) -> None:
        self.ds = None


def _start_local_ray_like_raydl() -> None:
    """The local Ray raydl starts for itself (loopback, no dashboard, workers at the driver's niceness,
    dropped objects freed every 100 ms), so Ray Data runs on the same Ray."""
    import ray

    from raydl.cluster import connect

    if not ray.is_initialized():
        connect._start_local_ray()


class SpdlLoader(Loader):
    """An SPDL pipeline per epoch (threads in this process): the same per-sample code, or spdl.io's decoder."""

    def __init__(self, kind: str, ds, args) -> None:
        import spdl.pipeline  # noqa: F401
        import torch

        self.kind, self.ds, self.args = kind, ds, args
        self.generator = torch.Generator()
        self.generator.manual_seed(int(time.time()))
        if kind == "spdl-io":
            import spdl.io

            spdl.io.demux_image(ds.samples[0][0])  # loads FFmpeg's libraries (raises here if missing)
            self.mean = torch.tensor((0.485, 0.456, 0.406)).view(1, 3, 1, 1)
            self.std = torch.tensor((0.229, 0.224, 0.225)).view(1, 3, 1, 1)

    def _decode(self, i: int):
        import spdl.io
        import torch

        from examples.train_image_classifier import random_resized_crop_box

        path, label = self.ds.samples[i]
        packets = spdl.io.demux_image(path)
        left, top, w, h = random_resized_crop_box(packets.width, packets.height)
        flip = ",hflip" if torch.rand(1).item() < 0.5 else ""
        desc = f"crop={w}:{h}:{left}:{top},scale=224:224:flags=bilinear{flip},format=rgb24"
        return spdl.io.decode_packets(packets, filter_desc=desc), label

    def _batch_frames(self, items: list):
        import spdl.io
        import torch

        frames = [f for f, _ in items]
        x = torch.from_numpy(spdl.io.to_numpy(spdl.io.convert_frames(frames)))  # B x H x W x 3 uint8
        x = x.permute(0, 3, 1, 2).contiguous().float().div_(255)
        x.sub_(self.mean).div_(self.std)
        return x, torch.tensor([y for _, y in items])

    def epoch(self) -> Iterator:
        import torch
        from spdl.pipeline import PipelineBuilder
        from torch.utils.data import default_collate

        order = torch.randperm(len(self.ds), generator=self.generator).tolist()
        c = self.args.spdl_threads or self.args.num_workers
        if self.kind == "spdl":
            b = PipelineBuilder().add_source(order).pipe(self.ds.__getitem__, concurrency=c)
            b = b.aggregate(self.args.batch_size).pipe(default_collate)
        else:
            b = PipelineBuilder().add_source(order).pipe(self._decode, concurrency=c)
            b = b.aggregate(self.args.batch_size).pipe(self._batch_frames)
        pipeline = b.add_sink(3).build(num_threads=c)
        with pipeline.auto_stop():
            yield from pipeline.get_iterator(timeout=120)


class _MapAndCollate:
    """torchdata.nodes' DataLoader-migration recipe: a batch of indices -> collate([dataset[i], ...])."""

    def __init__(self, ds) -> None:
        self.ds = ds

    def __call__(self, indices: list):
        from torch.utils.data import default_collate

        return default_collate([self.ds[i] for i in indices])


class NodesLoader(Loader):
    def __init__(self, ds, args) -> None:
        import torch
        import torchdata.nodes as tn

        node = tn.SamplerWrapper(torch.utils.data.RandomSampler(ds))
        node = tn.Batcher(node, batch_size=args.batch_size, drop_last=False)
        node = tn.ParallelMapper(
            node,
            map_fn=_MapAndCollate(ds),
            num_workers=args.num_workers,
            method="process",
            multiprocessing_context="fork",
            in_order=True,
        )
        node = tn.Prefetcher(node, prefetch_factor=args.num_workers * 2)
        self.loader = tn.Loader(node)

    def epoch(self) -> Iterator:
        return iter(self.loader)


def make_loader(kind: str, ds, args) -> Loader:
    if kind in ("torch", "raydl", "raydl-threads2"):
        return TorchLike(kind, ds, args)
    if kind == "raydata":
        return RayDataLoader(ds, args)
    if kind in ("spdl", "spdl-io"):
        return SpdlLoader(kind, ds, args)
    if kind == "nodes":
        return NodesLoader(ds, args)
    raise ValueError(kind)
