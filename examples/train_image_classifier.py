"""Train a small CNN on synthetic images with CPU-heavy augmentation: torch's DataLoader vs raydl's.

Both loaders get the same arguments (dataset, batch size, workers, seeded generator, persistent
workers); only the class differs. Each epoch's time is printed for both, so the cost of data
loading and what Ray workers change can be seen on this machine (on a laptop they share its
cores, as torch's workers do; on a Ray cluster they can run on other nodes: pass --ray-address).

    python examples/train_image_classifier.py                          # both loaders, 2 epochs each
    python examples/train_image_classifier.py --loader raydl --num-workers 8 --ray-address auto
    python examples/train_image_classifier.py --real-images               # JPEGs: decode + augment
    python examples/train_image_classifier.py --jpeg-dir ~/imagenet/train --crop-size 224

With --jpeg-dir (an ImageFolder layout: one folder per class, its name the label) or
--real-images (a small such folder of generated JPEGs is written first, 160x120 by default, and
reused), each sample is the ImageNet training pipeline: PIL decode, RandomResizedCrop, random
horizontal flip, to tensor, normalize. benchmarks/bench_shards.py measures this same transform from S3 against
other loaders (the retired bench_images, commit 3d9a662, measured `JpegFolder` at 500x375 -> 224: see
docs/benchmark-notes.md#retired-benchmarks).
torchvision is not needed: the transforms below follow torchvision's (v1, PIL) algorithms.

torch's loader runs first, before Ray is started (torch forks its workers from this process);
raydl then starts a local Ray on loopback on its first batch, unless --ray-address or
RAY_ADDRESS names one. Ray's start-up (and the first start of each worker) is reported apart
from the epoch times, and the first raydl epoch includes starting the worker actors.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import tempfile
import time

import numpy as np
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


# --------------------------------------------------------------------------- JPEG pipeline

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def random_resized_crop_box(width: int, height: int, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)) -> tuple:
    """(left, top, crop width, crop height) of a random crop, drawn as torchvision's RandomResizedCrop draws it.

    Area fraction uniform in `scale`, log aspect ratio uniform in log(`ratio`), 10 attempts, then a
    centre crop clamped to `ratio`; from torch's global RNG (seeded per worker by both loaders).
    """
    area = width * height
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(10):
        target = area * torch.empty(1).uniform_(scale[0], scale[1]).item()
        aspect = math.exp(torch.empty(1).uniform_(log_lo, log_hi).item())
        w = int(round(math.sqrt(target * aspect)))
        h = int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = torch.randint(0, height - h + 1, size=(1,)).item()
            left = torch.randint(0, width - w + 1, size=(1,)).item()
            return left, top, w, h
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        w, h = int(round(height * max(ratio))), height
    else:
        w, h = width, height
    return (width - w) // 2, (height - h) // 2, w, h


class TrainTransform:
    """PIL image -> normalized float tensor 3 x size x size: RandomResizedCrop(size) (bilinear), flip (p=0.5),
    ToTensor, Normalize(ImageNet mean/std), in torchvision's order and with its arithmetic."""

    def __init__(self, size: int = 224) -> None:
        self.size = size
        self.mean = torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
        self.std = torch.tensor(IMAGENET_STD).view(3, 1, 1)

    def __call__(self, img):
        from PIL import Image

        left, top, w, h = random_resized_crop_box(*img.size)
        img = img.crop((left, top, left + w, top + h)).resize((self.size, self.size), Image.BILINEAR)
        if torch.rand(1).item() < 0.5:
            img = img.transpose(Image.FLIP_LEFT_RIGHT)
        x = torch.from_numpy(np.array(img, copy=True)).permute(2, 0, 1).contiguous()
        x = x.float().div_(255)
        return x.sub_(self.mean).div_(self.std)


class JpegFolder(Dataset):
    """An ImageFolder layout (root/<class name>/<image>.jpg), labels the sorted class names' indices.

    `limit` keeps that many files spread over the classes (every k-th of the sorted list).
    """

    def __init__(self, root: str, transform=None, limit: int | None = None) -> None:
        self.root = root
        self.classes = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
        self.samples = [
            (os.path.join(root, c, f), label)
            for label, c in enumerate(self.classes)
            for f in sorted(os.listdir(os.path.join(root, c)))
            if f.lower().endswith((".jpg", ".jpeg"))
        ]
        if not self.samples:
            raise ValueError(f"no .jpg/.jpeg files in class folders under {root!r}")
        if limit is not None and limit < len(self.samples):
            step = len(self.samples) / limit
            self.samples = [self.samples[int(k * step)] for k in range(limit)]
        self.transform = transform

    def __len__(self) -> int:
        return len(self.samples)

    def load(self, i: int):
        """The decoded RGB image of sample i and its label (torchvision's pil_loader)."""
        from PIL import Image

        path, label = self.samples[i]
        with open(path, "rb") as f:
            img = Image.open(f)
            return img.convert("RGB"), label

    def __getitem__(self, i: int):
        img, label = self.load(i)
        return (self.transform(img) if self.transform is not None else img), label


@functools.lru_cache(maxsize=4)
def _one_over_f(height: int, width: int) -> np.ndarray:
    """Amplitude spectrum 1/f^1.1 on the rfft2 grid of an image (natural images fall off about as 1/f)."""
    f = np.hypot(np.fft.fftfreq(height)[:, None], np.fft.rfftfreq(width)[None, :])
    f[0, 0] = 1.0
    return (f**-1.1).astype(np.float32)


def synthetic_photo(rng: np.random.Generator, width: int, height: int, tint: np.ndarray) -> np.ndarray:
    """An HxWx3 uint8 image with a photo's statistics: 1/f noise (scene texture), a gradient (light),
    a few soft-edged shapes (objects), sensor noise; so a JPEG of it costs what a photo costs to decode."""
    amp = _one_over_f(height, width)
    fields = []
    for _ in range(3):
        re, im = rng.standard_normal((2, *amp.shape), dtype=np.float32)
        field = np.fft.irfft2(amp * (re + 1j * im), s=(height, width)).astype(np.float32)
        fields.append(field / field.std())
    lum, c1, c2 = fields
    img = np.empty((height, width, 3), np.float32)
    img[...] = 120.0 + 40.0 * lum[..., None]
    img[..., 0] += 14.0 * c1
    img[..., 2] += 14.0 * c2
    angle = rng.uniform(0, 2 * np.pi)
    gx = (30.0 * np.cos(angle) * (np.arange(width, dtype=np.float32) / width - 0.5))[None, :, None]
    gy = (30.0 * np.sin(angle) * (np.arange(height, dtype=np.float32) / height - 0.5))[:, None, None]
    img += gx + gy + tint
    for _ in range(rng.integers(2, 6)):  # objects: soft-edged ellipses, each with its own colour and texture
        cx, cy = rng.uniform(0, width), rng.uniform(0, height)
        rx, ry = rng.uniform(0.05, 0.3) * width, rng.uniform(0.05, 0.3) * height
        x0, x1 = int(max(0, cx - 1.5 * rx)), int(min(width, cx + 1.5 * rx + 1))
        y0, y1 = int(max(0, cy - 1.5 * ry)), int(min(height, cy + 1.5 * ry + 1))
        xs = (np.arange(x0, x1, dtype=np.float32) - cx) / rx
        ys = (np.arange(y0, y1, dtype=np.float32) - cy) / ry
        d = ys[:, None] ** 2 + xs[None, :] ** 2
        mask = 1.0 / (1.0 + np.exp(np.minimum((d - 1.0) * 8.0, 30.0)))
        colour = rng.uniform(-70, 70, 3).astype(np.float32)
        img[y0:y1, x0:x1] += mask[..., None] * (colour + 20.0 * lum[y0:y1, x0:x1, None])
    img += rng.normal(0.0, 3.0, img.shape).astype(np.float32)
    return np.clip(img, 0, 255).astype(np.uint8)


def write_jpeg_folder(root: str, n: int, num_classes: int, size=(500, 375), quality: int = 90, seed: int = 0) -> str:
    """Write n generated JPEGs in num_classes class folders under root (each class a colour cast, so the
    label is learnable); reuse them when root already holds this exact set. Returns root."""
    from PIL import Image

    spec = {"n": n, "num_classes": num_classes, "size": list(size), "quality": quality, "seed": seed, "version": 1}
    marker = os.path.join(root, "dataset.json")
    try:
        with open(marker) as f:
            if json.load(f) == spec:
                return root
    except (OSError, ValueError):
        pass
    tints = np.random.default_rng(seed).uniform(-35, 35, (num_classes, 3)).astype(np.float32)
    for c in range(num_classes):
        os.makedirs(os.path.join(root, f"class_{c:03d}"), exist_ok=True)
    for i in range(n):
        c = i % num_classes
        rng = np.random.default_rng([seed, i])
        pixels = synthetic_photo(rng, size[0], size[1], tints[c])
        Image.fromarray(pixels).save(os.path.join(root, f"class_{c:03d}", f"img_{i:06d}.jpg"), quality=quality)
    with open(marker, "w") as f:
        json.dump(spec, f)
    return root


def small_cnn(num_classes: int = 3) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, num_classes),
    )


def train(name: str, loader, epochs: int, num_classes: int = 3) -> None:
    torch.manual_seed(0)
    model = small_cnn(num_classes)
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
    parser.add_argument("--samples", type=int, default=1536, help="images (with --jpeg-dir: at most this many)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--augment-repeats", type=int, default=8, help="rounds of augmentation per image")
    parser.add_argument("--ray-address", default=None, help="Ray cluster for raydl's workers; default: a local Ray")
    jpeg = parser.add_mutually_exclusive_group()
    jpeg.add_argument("--jpeg-dir", default=None, help="train on the JPEGs of this ImageFolder-style directory")
    jpeg.add_argument(
        "--real-images",
        action="store_true",
        help="write --samples generated JPEGs (--image-size) to --cache-dir once, then train on them",
    )
    parser.add_argument("--image-size", default="160x120", help="WxH of the --real-images JPEGs")
    parser.add_argument("--classes", type=int, default=4, help="class folders of the --real-images JPEGs")
    parser.add_argument("--crop-size", type=int, default=64, help="RandomResizedCrop size of the JPEG pipeline")
    parser.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "raydl-example-jpegs"))
    args = parser.parse_args()

    if args.jpeg_dir or args.real_images:
        root = args.jpeg_dir
        if root is None:
            w, h = (int(v) for v in args.image_size.lower().split("x"))
            root = os.path.join(args.cache_dir, f"{w}x{h}-n{args.samples}-c{args.classes}")
            start = time.perf_counter()
            write_jpeg_folder(root, args.samples, args.classes, size=(w, h))
            print(f"JPEGs in {root} ({time.perf_counter() - start:.1f} s to write or find)", flush=True)
        dataset = JpegFolder(root, TrainTransform(args.crop_size), limit=args.samples)
        num_classes = len(dataset.classes)
        what = (
            f"{len(dataset)} JPEGs in {num_classes} classes, PIL decode + RandomResizedCrop({args.crop_size}) "
            "+ flip + normalize"
        )
    else:
        dataset = AugmentedImages(args.samples, args.augment_repeats)
        num_classes = 3
        what = f"{args.samples} images, {args.augment_repeats} augmentation rounds per image"
    common = dict(
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.num_workers,
        persistent_workers=args.num_workers > 0,
    )
    print(f"{what}, batch {args.batch_size}, {args.num_workers} workers, {args.epochs} epochs per loader", flush=True)
    if args.loader in ("both", "torch"):
        loader = TorchDataLoader(dataset, generator=torch.Generator().manual_seed(0), **common)
        train("torch DataLoader", loader, args.epochs, num_classes)
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
            train("raydl DataLoader", loader, args.epochs, num_classes)
            where = sorted({r.node_ip for r in loader.worker_records if r is not None})
            print(f"raydl DataLoader: {len(loader.worker_records)} Ray workers on {where}", flush=True)


if __name__ == "__main__":
    main()
