"""raydl.FileDataset: plain files under a folder or prefix, grouped into samples, many objects to a cached unit."""

from __future__ import annotations

import os
import random

import pytest

import raydl
import raydl.data.files as files_module
from tests._parity import BATCH_TIMEOUT_S
from tests._resume_parity import _roundtrip

CLASSES, PER_CLASS = ("cat", "dog", "eel"), 8


def write_image_folder(root: str, seed: int = 0) -> dict:
    """An ImageFolder: class/NNNN.jpg with a .json beside most, a few upper-case extensions, a file without a dot.
    Returns {key: {field: bytes}}."""
    rnd = random.Random(seed)
    want: dict = {}
    for c in CLASSES:
        os.makedirs(os.path.join(root, c), exist_ok=True)
        for k in range(PER_CLASS):
            key = f"{c}/{k:04d}"
            fields = {"JPG" if k == 5 else "jpg": bytes(rnd.getrandbits(8) for _ in range(rnd.randint(1, 3000)))}
            if k % 3:
                fields["json"] = f'{{"k": {k}}}'.encode()
            for ext, data in fields.items():
                with open(os.path.join(root, f"{key}.{ext}"), "wb") as f:
                    f.write(data)
            want[key] = {e.lower(): d for e, d in fields.items()}
    with open(os.path.join(root, "LICENSE"), "w") as f:
        f.write("no dot: not a sample")
    return want


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("files") / "train")
    return root, write_image_folder(root)


@pytest.fixture
def small_units(monkeypatch):
    monkeypatch.setattr(files_module, "_UNIT_BYTES", 9_000)
    monkeypatch.setattr(files_module, "_UNIT_OBJECTS", 5)


def _fields(sample: dict) -> dict:
    return {k: v for k, v in sample.items() if not k.startswith("__")}


def _key_collate(samples):
    return [s["__key__"] for s in samples]


def test_objects_group_into_samples_by_key(image_folder, tmp_path, small_units):
    root, want = image_folder
    ds = raydl.FileDataset(root, cache_dir=str(tmp_path / "cache"))
    assert len(ds) == len(want) and ds.num_units > 3
    got = {ds[i]["__key__"]: _fields(ds[i]) for i in range(len(ds))}
    assert got == want
    assert ds[0]["__url__"] == os.path.join(root, "cat", "0000.jpg")
    assert sorted({k.rsplit("/", 1)[0] for k in got}) == list(CLASSES)
    # a manifest of the same objects, and the kept listing
    manifest = tmp_path / "manifest.txt"
    named = [os.path.join(c, n) for c in ("cat", "eel") for n in sorted(os.listdir(os.path.join(root, c)))]
    manifest.write_text("# the cats and eels\n" + "\n".join(os.path.join(root, n) for n in named))
    by_manifest = raydl.FileDataset(str(manifest), cache_dir=str(tmp_path / "cache"))
    assert by_manifest.listed and sorted(by_manifest.key(i) for i in range(len(by_manifest))) == sorted(
        k for k in want if not k.startswith("dog")
    )
    again = raydl.FileDataset(root, cache_dir=str(tmp_path / "cache"))
    assert not again.listed and len(again) == len(ds)


def test_bad_input_is_named(tmp_path):
    cache = str(tmp_path / "cache")
    with pytest.raises(FileNotFoundError, match="nowhere"):
        raydl.FileDataset(str(tmp_path / "nowhere"), cache_dir=cache)
    clash = tmp_path / "clash"
    clash.mkdir()
    (clash / "a.JPG").write_bytes(b"1")
    (clash / "a.jpg").write_bytes(b"2")
    with pytest.raises(ValueError, match=r"both field 'jpg' of sample 'a'"):
        raydl.FileDataset(str(clash), cache_dir=cache)
    reserved = tmp_path / "reserved"
    reserved.mkdir()
    (reserved / "a.jpg").write_bytes(b"1")
    (reserved / "a.__url__").write_bytes(b"2")  # would overwrite the sample's own __url__
    with pytest.raises(ValueError, match=r"field '__url__' of sample 'a', which every sample has already"):
        raydl.FileDataset(str(reserved), cache_dir=cache)
    big = tmp_path / "big"
    big.mkdir()
    (big / "x.bin").write_bytes(bytes(50_000))
    with pytest.raises(ValueError, match=r"cache_limit=10000 bytes is too small"):
        raydl.FileDataset(str(big), cache_dir=cache, cache_limit=10_000)


def test_shuffle_resume_and_worker_loss_through_the_cache(ray_session, image_folder, tmp_path, small_units):
    """shuffle=True, no generator: every sample once an epoch, different orders; exact resume mid-epoch; a worker
    killed mid-epoch costs no sample."""
    import ray

    root, want = image_folder
    ds = raydl.FileDataset(root, cache_dir=str(tmp_path / "cache"), cache_limit=40_000)
    loader = raydl.DataLoader(
        ds, batch_size=4, shuffle=True, num_workers=2, collate_fn=_key_collate, timeout=BATCH_TIMEOUT_S
    )
    epochs = [[k for b in loader for k in b] for _ in range(2)]
    assert sorted(epochs[0]) == sorted(epochs[1]) == sorted(want) and epochs[0] != epochs[1]
    it = iter(loader)
    for _ in range(2):
        next(it)
    state = _roundtrip(loader.state_dict())
    rest = list(it)
    resumed = raydl.DataLoader(
        ds, batch_size=4, shuffle=True, num_workers=2, collate_fn=_key_collate, timeout=BATCH_TIMEOUT_S
    )
    resumed.load_state_dict(state)
    assert list(resumed) == rest
    persistent = raydl.DataLoader(
        ds,
        batch_size=4,
        shuffle=True,
        num_workers=2,
        collate_fn=_key_collate,
        persistent_workers=True,
        timeout=BATCH_TIMEOUT_S,
    )
    keys = []
    for k, b in enumerate(persistent):
        keys.extend(b)
        if k == 2:
            ray.kill(persistent._iterator._pool.actors[0], no_restart=True)
    assert sorted(keys) == sorted(want)
    persistent.shutdown()


def test_from_s3_many_objects_a_unit(ray_session, image_folder, tmp_path, small_units):
    """An ImageFolder in S3 (moto): the same samples as the local folder; an epoch fetches each object once."""
    from tests._s3 import MotoServer, s3fs, stop_all

    root, want = image_folder
    moto = MotoServer()
    try:
        moto.make_bucket("images")
        fs = moto.filesystem()
        for key, fields in want.items():
            for field, data in fields.items():
                ext = "JPG" if key.endswith("0005") and field == "jpg" else field
                with fs.open_output_stream(f"images/train/{key}.{ext}") as f:
                    f.write(data)
        ds = raydl.FileDataset("s3://images/train/", filesystem=s3fs(moto.port, 3), cache_dir=str(tmp_path / "c"))
        assert {ds[i]["__key__"]: _fields(ds[i]) for i in range(len(ds))} == want
        assert ds[0]["__url__"] == "s3://images/train/cat/0000.jpg"
        loader = raydl.DataLoader(
            ds, batch_size=4, shuffle=True, num_workers=2, collate_fn=_key_collate, timeout=BATCH_TIMEOUT_S
        )
        assert sorted(k for b in loader for k in b) == sorted(want)
    finally:
        stop_all(moto)
