"""raydl.TarDataset: WebDataset tar shards through the node cache, checked against webdataset's own tar reader."""

from __future__ import annotations

import io
import os
import random
import signal
import tarfile
import time

import pytest
import torch

import raydl
import raydl.data.tar as tar_module
from raydl.data.sources import expand_braces
from raydl.data.tar_index import TarFormatError
from tests._parity import BATCH_TIMEOUT_S
from tests._resume_parity import _roundtrip

SHARDS, PER_SHARD = 4, 9


def _member(tar: tarfile.TarFile, name: str, data: bytes, **pax: str) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    if pax:
        info.pax_headers = pax
    tar.addfile(info, io.BytesIO(data))


def write_shards(folder: str, fmt: int = tarfile.PAX_FORMAT, shards: int = SHARDS, seed: int = 0) -> list:
    """Shards with what real corpora hold: directories, links, long names, pax records, upper-case extensions,
    several fields per key, multi-dot fields, metadata members, a name without a dot, a key split in two runs."""
    os.makedirs(folder, exist_ok=True)
    rnd = random.Random(seed)
    paths = []
    for s in range(shards):
        path = os.path.join(folder, f"train-{s:03d}.tar")
        with tarfile.open(path, "w", format=fmt) as tar:
            d = tarfile.TarInfo("imgs")
            d.type = tarfile.DIRTYPE
            tar.addfile(d)
            _member(tar, "__meta__", b"corpus metadata")
            for k in range(PER_SHARD):
                key = f"imgs/{s:03d}_{k:04d}" + ("_" + "n" * 140 if k == 2 else "")
                for ext in ("JPG", "cls", "meta.json"):
                    data = bytes(rnd.getrandbits(8) for _ in range(rnd.randint(0, 2500)))
                    _member(tar, f"{key}.{ext}", data, **({"comment": "é"} if k == 3 else {}))
                if k == 1:
                    link = tarfile.TarInfo("imgs/latest.jpg")
                    link.type = tarfile.SYMTYPE
                    link.linkname = f"{key}.JPG"
                    tar.addfile(link)
                    _member(tar, "imgs/README", b"no dot: no sample")
            _member(tar, f"imgs/{s:03d}_0000.extra", b"the first key again, after the others")
        paths.append(path)
    return paths


def webdataset_samples(paths: list) -> list:
    """What webdataset's tar reader yields for these shards (its grouping, its skips)."""
    from webdataset.tariterators import group_by_keys, tar_file_expander, url_opener

    out = []
    for s in group_by_keys(tar_file_expander(url_opener([{"url": p} for p in paths]))):
        s.pop("__local_path__", None)
        out.append(s)
    return out


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_shards(str(tmp_path_factory.mktemp("tar") / "data"))


@pytest.fixture
def small_units(monkeypatch):
    """Units of about 12 KB: several per shard, so batches mix units and shards."""
    monkeypatch.setattr(tar_module, "_UNIT_BYTES", 12_000)


def _keys(batches) -> list:
    return [k for b in batches for k in b]


def _field_bytes(sample: dict) -> int:
    return sum(len(v) for k, v in sample.items() if not k.startswith("__"))


def _key_collate(samples):
    return [s["__key__"] + "|" + s["__url__"] for s in samples]


# ------------------------------------------------------------------ what a sample is


@pytest.mark.parametrize(
    "fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT], ids=["pax", "gnu", "ustar"]
)
def test_samples_are_webdatasets(tmp_path, fmt, small_units):
    """Every sample, field and byte equals webdataset's tar reader's on the same shards: pax, GNU long names or
    ustar prefixes, directories and links skipped, `__meta__` and dot-less names skipped, upper-case fields
    lower-cased, a key whose members are not adjacent giving a second sample (as webdataset)."""
    if fmt == tarfile.USTAR_FORMAT:  # no pax or GNU records: a name past 100 bytes splits into ustar's prefix
        folder = tmp_path / "data"
        folder.mkdir()
        paths = [str(folder / "train-000.tar")]
        with tarfile.open(paths[0], "w", format=fmt) as tar:
            for k in range(5):
                _member(tar, f"{'deep/' * 25}{k:03d}.txt", f"sample {k}".encode())
                _member(tar, f"{'deep/' * 25}{k:03d}.cls", str(k).encode())
    else:
        paths = write_shards(str(tmp_path / "data"), fmt=fmt, shards=2)
    ds = raydl.TarDataset(paths, cache_dir=str(tmp_path / "cache"))
    want = webdataset_samples(paths)
    assert len(ds) == len(want) and [ds[i] for i in range(len(ds))] == want
    if fmt == tarfile.PAX_FORMAT:
        keys = [s["__key__"] for s in want]
        assert len(keys) - len(set(keys)) == 2, "each shard's first key comes back once more at its end"
        assert {"jpg", "cls", "meta.json"} <= set(ds.fields) and "JPG" not in ds.fields


def test_a_brace_pattern_a_folder_and_a_list_name_the_same_shards(shards, tmp_path):
    folder = os.path.dirname(shards[0])
    cache = str(tmp_path / "cache")
    by_braces = raydl.TarDataset(os.path.join(folder, "train-{000..003}.tar"), cache_dir=cache)
    by_folder = raydl.TarDataset(folder, cache_dir=cache)
    by_list = raydl.TarDataset(shards, cache_dir=cache)
    assert by_braces.urls == by_folder.urls == by_list.urls == shards
    assert len(by_braces) == len(by_folder) == SHARDS * (PER_SHARD + 1)
    assert expand_braces("a-{8..10}-{x,y}.tar") == [
        "a-8-x.tar",
        "a-8-y.tar",
        "a-9-x.tar",
        "a-9-y.tar",
        "a-10-x.tar",
        "a-10-y.tar",
    ]
    assert expand_braces("s-{000..002}.tar") == ["s-000.tar", "s-001.tar", "s-002.tar"]


def test_the_index_is_kept_and_a_changed_shard_is_indexed_again(tmp_path):
    paths = write_shards(str(tmp_path / "data"), shards=2)
    cache = str(tmp_path / "cache")
    first = raydl.TarDataset(paths, cache_dir=cache)
    assert first.index_bytes == sum(os.path.getsize(p) for p in paths)
    again = raydl.TarDataset(paths, cache_dir=cache)
    assert again.index_bytes == 0 and [again[i] for i in range(len(again))] == [first[i] for i in range(len(first))]
    with tarfile.open(paths[1], "w") as tar:  # the shard is rewritten: other size and time
        _member(tar, "new/0.txt", b"a new sample")
    os.utime(paths[1], ns=(1, 1))
    changed = raydl.TarDataset(paths, cache_dir=cache)
    assert changed.index_bytes == os.path.getsize(paths[1])
    assert changed[len(changed) - 1]["txt"] == b"a new sample" and len(changed) == PER_SHARD + 2


# ------------------------------------------------------------------ bad input


def test_bad_input_is_named(tmp_path, shards):
    cache = str(tmp_path / "cache")
    folder = tmp_path / "bad"
    folder.mkdir()
    with pytest.raises(FileNotFoundError, match="train-9.tar"):
        raydl.TarDataset(str(folder / "train-{8..9}.tar"), cache_dir=cache)
    with pytest.raises(ValueError, match="never closed"):
        raydl.TarDataset(str(folder / "train-{0..9.tar"), cache_dir=cache)
    (folder / "notes.txt").write_text("not a shard")
    with pytest.raises(ValueError, match=r"no \.tar under"):
        raydl.TarDataset(str(folder), cache_dir=cache)
    junk = folder / "junk.tar"
    junk.write_bytes(os.urandom(4096))
    with pytest.raises(TarFormatError, match=r"junk\.tar: not a tar file"):
        raydl.TarDataset(str(junk), cache_dir=cache)
    data = open(shards[0], "rb").read()
    cut = folder / "cut.tar"
    cut.write_bytes(data[: len(data) // 2 + 100])
    with pytest.raises(TarFormatError, match=r"cut\.tar: truncated at byte"):
        raydl.TarDataset(str(cut), cache_dir=cache)
    corrupt = bytearray(data)
    header = _second_header(data)
    corrupt[header + 10] ^= 0x20
    flipped = folder / "flipped.tar"
    flipped.write_bytes(bytes(corrupt))
    with pytest.raises(TarFormatError, match=rf"flipped\.tar: the tar header at byte {header} fails its checksum"):
        raydl.TarDataset(str(flipped), cache_dir=cache)
    with pytest.raises(ValueError, match=r"cache_limit=1000 bytes is too small.*Raise cache_limit to \d+"):
        raydl.TarDataset(shards, cache_dir=cache, cache_limit=1000)
    # the folder's metadata counts against the limit: the shards' index, and here a large stray one beside it
    fits = raydl.TarDataset(shards, cache_dir=cache, cache_limit="1MB")
    assert 0 < fits.cache_metadata_bytes < 10_000
    (tmp_path / "cache" / "tar-index" / "stray.json").write_bytes(b" " * 999_000)
    with pytest.raises(ValueError, match=r"too small \(\d+ bytes of it hold the metadata in .*cache: tar-index/"):
        raydl.TarDataset(shards, cache_dir=cache, cache_limit="1MB")
    with pytest.raises(ValueError, match="not both"):
        raydl.TarDataset(shards, cache_dir=cache, transform=len, batch_transform=len)


def _second_header(data: bytes) -> int:
    """Byte offset of the shard's second header (the first is the directory's)."""
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        return tar.getmembers()[1].offset


# ------------------------------------------------------------------ through the loader and the node cache


def _loader(ds, **kw):
    kw.setdefault("num_workers", 2)
    return raydl.DataLoader(ds, batch_size=4, collate_fn=_key_collate, timeout=BATCH_TIMEOUT_S, **kw)


def test_shuffle_default_gives_every_sample_once_and_resumes_exactly(ray_session, shards, tmp_path, small_units):
    """shuffle=True with no generator: every sample once per epoch, epochs in different orders, batches mixing
    shards; a state taken mid-epoch gives exactly the rest in a new loader."""
    ds = raydl.TarDataset(shards, cache_dir=str(tmp_path / "cache"), cache_limit=60_000)
    assert ds.num_units > SHARDS and ds.shuffle_window >= 2
    every = sorted(f"{s['__key__']}|{s['__url__']}" for s in (ds[i] for i in range(len(ds))))
    loader = _loader(ds, shuffle=True)
    epochs = [list(loader) for _ in range(2)]
    for batches in epochs:
        assert sorted(_keys(batches)) == every
    assert _keys(epochs[0]) != _keys(epochs[1])
    assert any(len({k.split("|")[1] for k in b}) > 1 for b in epochs[0]), "no batch mixes two shards"
    it = iter(loader)
    for _ in range(3):
        next(it)
    state = _roundtrip(loader.state_dict())
    rest = list(it)
    resumed = _loader(raydl.TarDataset(shards, cache_dir=str(tmp_path / "cache"), cache_limit=60_000), shuffle=True)
    resumed.load_state_dict(state)
    assert list(resumed) == rest
    figures = loader.stats().cache
    assert figures["corrupt"] == 0 and figures["failures"] == 0, figures


def test_default_collate_and_transforms(ray_session, shards, tmp_path):
    """torch's default_collate over samples (bytes fields become lists), a per-sample transform, and a
    batch_transform that makes the whole batch in the worker."""
    ds = raydl.TarDataset(shards, cache_dir=str(tmp_path / "cache"), transform=_field_bytes)
    plain = raydl.TarDataset(shards, cache_dir=str(tmp_path / "cache"))
    lengths = [_field_bytes(plain[i]) for i in range(len(plain))]
    batch = next(iter(raydl.DataLoader(plain, batch_size=4, num_workers=1, timeout=BATCH_TIMEOUT_S)))
    assert isinstance(batch["cls"], list) and batch["__key__"] == [plain[i]["__key__"] for i in range(4)]
    got = torch.cat(list(raydl.DataLoader(ds, batch_size=5, num_workers=2, timeout=BATCH_TIMEOUT_S))).tolist()
    assert got == lengths

    def sizes(samples):
        return torch.tensor([_field_bytes(s) for s in samples])

    batched = raydl.TarDataset(shards, cache_dir=str(tmp_path / "cache"), batch_transform=sizes)
    out = torch.cat(list(raydl.DataLoader(batched, batch_size=6, num_workers=2, timeout=BATCH_TIMEOUT_S)))
    assert out.tolist() == sizes([plain[i] for i in range(len(plain))]).tolist()


def test_from_s3_through_the_cache(ray_session, shards, tmp_path, small_units):
    """The shards in S3 (moto behind a fault proxy): the samples equal the local ones; 503s and reset connections
    while indexing and while the cache fetches are retried; an epoch fetches each byte of the units once."""
    from tests._s3 import FaultProxy, MotoServer, s3fs, stop_all, upload_folder

    moto = MotoServer()
    proxy = None
    try:
        moto.make_bucket("shards")
        upload_folder(os.path.dirname(shards[0]), moto.filesystem(), "shards/train")
        proxy = FaultProxy(moto.port)
        proxy.inject("503", "reset", path="train-001")  # the index's streamed read of one shard, twice
        ds = raydl.TarDataset(
            "s3://shards/train/train-{000..003}.tar", filesystem=s3fs(proxy.port), cache_dir=str(tmp_path / "c")
        )
        assert proxy.injected == 2
        local = raydl.TarDataset(shards, cache_dir=str(tmp_path / "local"))
        assert ds.urls[0] == "s3://shards/train/train-000.tar"
        proxy.reset_counts()
        proxy.inject("503", "reset", "503", path="train-00")  # the node cache's ranged reads
        assert [{**ds[i], "__url__": None} for i in range(len(ds))] == [
            {**local[i], "__url__": None} for i in range(len(local))
        ]
        assert proxy.injected == 3 and proxy.get_bytes <= ds.nbytes * 1.15, (proxy.get_bytes, ds.nbytes)
        loader = _loader(ds, shuffle=True)
        assert sorted(_keys(loader)) == sorted(_key_collate(ds[i] for i in range(len(ds))))
    finally:
        stop_all(proxy, moto)


def _state(pid: int) -> str:
    """A process's state letter (Z: a zombie, dead), "" once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


def test_worker_killed_then_flipped_bits_in_the_cache(ray_session, shards, tmp_path, small_units):
    """A worker killed mid-epoch costs no sample; then every cached unit gets one flipped bit and a new job over the
    same folder reads every sample right, counting and refetching each corrupt unit."""
    import ray

    from tests._session import end_node_caches

    cache = str(tmp_path / "cache")
    ds = raydl.TarDataset(shards, cache_dir=cache)
    every = sorted(_key_collate([ds[i] for i in range(len(ds))]))
    # torch's round robin: the killed worker surely gets a batch after its death (over node slots the least busy
    # worker of the node makes each batch, and the other one may make all the rest of this short epoch)
    loader = _loader(ds, shuffle=True, persistent_workers=True, ray_seed="worker")
    keys = []
    for k, b in enumerate(loader):
        keys.extend(b)
        if k == 3:  # its process, at once (ray.kill is asynchronous: its lane could still serve the next batch)
            pid = loader.stats().workers[0].pid
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 30
            while os.path.exists(f"/proc/{pid}") and _state(pid) != "Z" and time.monotonic() < deadline:
                time.sleep(0.05)
    assert sorted(keys) == every and loader.stats().workers[0].restarts == 1
    loader.shutdown()
    end_node_caches()
    units = [n for n in os.listdir(cache) if n in {spec[3] for spec in ds.raydl_cache_units()}]
    assert len(units) == ds.num_units
    for name in units:
        with open(os.path.join(cache, name), "r+b") as f:
            f.seek(os.fstat(f.fileno()).st_size // 2)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0x10]))
    again = raydl.TarDataset(shards, cache_dir=cache)
    assert sorted(_keys(_loader(again, shuffle=True))) == every
    from raydl.cluster.cache.handles import _name

    cache_actor = ray.get_actor(_name(ray.get_runtime_context().get_node_id(), again.cache_dir), namespace="raydl")
    figures = ray.get(cache_actor.stats.remote(), timeout=30)  # the new job's cache, from its start
    assert figures["corrupt"] == ds.num_units and figures["bytes_fetched"] == ds.nbytes, figures


def test_distributed_sampler_gives_each_rank_an_equal_share(ray_session, shards, tmp_path):
    """ParquetDistributedSampler works over any dataset with units: two ranks, equal counts, every sample once."""
    ds = raydl.TarDataset(shards, cache_dir=str(tmp_path / "cache"))
    got = []
    for rank in range(2):
        sampler = raydl.ParquetDistributedSampler(ds, num_replicas=2, rank=rank, seed=5)
        got.append(_keys(_loader(ds, sampler=sampler, num_workers=1)))
    assert len(got[0]) == len(got[1]) == len(ds) // 2
    assert sorted(got[0] + got[1]) == sorted(_key_collate([ds[i] for i in range(len(ds))]))


def test_one_job_pool_over_shards_and_a_killed_worker_costs_no_sample(ray_session, shards, tmp_path, monkeypatch):
    """`ray_job` over a TarDataset (docs/shards.md): two ranks in lockstep, as DDP steps, each with
    ParquetDistributedSampler, share one pool; a job worker SIGKILLed mid-epoch costs neither rank a sample. Each rank
    gets exactly its private loader's batches, in order."""
    ds = raydl.TarDataset(shards, cache_dir=str(tmp_path / "cache"))
    world = 2

    def rank_loader(rank: int, job):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", str(world))
        sampler = raydl.ParquetDistributedSampler(ds, num_replicas=world, rank=rank, seed=7)
        return _loader(ds, sampler=sampler, num_workers=1, ray_job=job, persistent_workers=True)

    expected = [list(rank_loader(r, None)) for r in range(world)]  # batches of keys
    loaders = [rank_loader(r, "tar-job") for r in range(world)]
    try:
        its = [iter(loader) for loader in loaders]  # each iter() reads RANK when its pool client starts
        got: list = [[] for _ in range(world)]
        killed = []
        for step in range(len(expected[0])):
            for r in range(world):
                got[r].append(next(its[r]))
            if step == 1:
                pid = its[0]._pool.records[1].pid
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
        for r in range(world):
            with pytest.raises(StopIteration):
                next(its[r])
        assert killed and [len(_keys(g)) for g in got] == [len(ds) // world] * world
        assert got == expected, "a rank's batches differ from its private loader's"
        assert sorted(_keys(got[0] + got[1])) == sorted(_key_collate([ds[i] for i in range(len(ds))]))
        assert max(n for it in its for n in it._pool.restarts) == 1, "the killed worker replaced once for the job"
    finally:
        for loader in loaders:
            loader.shutdown()


def _retype(path: str, index: int, kind: bytes) -> None:
    """Give the shard's `index`-th header (extended headers counted) the tar type `kind`, its checksum made again."""
    data = bytearray(open(path, "rb").read())
    offset, seen = 0, 0
    while seen < index:
        size = int(data[offset + 124 : offset + 136].split(b"\0", 1)[0].strip() or b"0", 8)
        offset += 512 + (size + 511) // 512 * 512
        seen += 1
    data[offset + 156 : offset + 157] = kind
    data[offset + 148 : offset + 156] = b" " * 8
    data[offset + 148 : offset + 156] = b"%06o\0 " % sum(data[offset : offset + 512])
    open(path, "wb").write(bytes(data))


def test_webdatasets_rules_at_the_edges(tmp_path, monkeypatch):
    """Cases webdataset's reader decides one way that a scan could decide another (found by comparing with webdataset
    1.0.2 over its own test tars and hand-made ones): a sample with a non-empty `__bad__` member is dropped; a member
    named as field `__key__` or `__url__` is refused, as a repeated field; a Solaris `X` extended header names its
    member as a pax `x` does; a global header's `path` holds for every later member; a pax sparse file and a
    malformed pax size are named, never read as wrong bytes; `file:` relative URLs are read."""
    from webdataset.tariterators import group_by_keys, tar_file_expander, url_opener

    cache = str(tmp_path / "cache")

    def shard(name, members, **open_kw):
        path = str(tmp_path / name)
        with tarfile.open(path, "w", format=tarfile.PAX_FORMAT, **open_kw) as tar:
            for member in members:
                _member(tar, *member[:2], **(member[2] if len(member) > 2 else {}))
        return path

    def webdataset_raises(path) -> bool:
        try:
            list(group_by_keys(tar_file_expander(url_opener([{"url": path}]))))
        except ValueError:
            return True
        return False

    bad = shard(
        "bad.tar", [("a.txt", b"1"), ("a.__bad__", b"yes"), ("b.txt", b"2"), ("c.txt", b"3"), ("c.__bad__", b"")]
    )
    ds = raydl.TarDataset(bad, cache_dir=cache)
    assert [ds[i] for i in range(len(ds))] == webdataset_samples([bad]) and [ds[i]["__key__"] for i in range(2)] == [
        "b",
        "c",
    ]
    for field in ("__key__", "__url__", "__KEY__"):
        reserved = shard(f"reserved{field}.tar", [("a.txt", b"1"), (f"a.{field}", b"K")])
        assert webdataset_raises(reserved)
        with pytest.raises(ValueError, match="repeats field"):
            raydl.TarDataset(reserved, cache_dir=cache)
    solaris = shard("solaris.tar", [("real/a.txt", b"T", {"path": "real/a.txt"}), ("real/a.cls", b"C")])
    _retype(solaris, 0, b"X")  # the pax header of the first member, now Solaris's type
    ds = raydl.TarDataset(solaris, cache_dir=cache)
    assert [ds[i] for i in range(len(ds))] == webdataset_samples([solaris]) and len(ds) == 1
    glob = shard("global.tar", [("a.txt", b"1"), ("b.cls", b"2")], pax_headers={"path": "g/x.txt"})
    assert webdataset_raises(glob)
    with pytest.raises(ValueError, match="repeats field"):
        raydl.TarDataset(glob, cache_dir=cache)
    sparse = shard("sparse.tar", [("sp.bin", b"x" * 10, {"GNU.sparse.major": "1", "GNU.sparse.minor": "0"})])
    with pytest.raises(TarFormatError, match="GNU sparse file"):
        raydl.TarDataset(sparse, cache_dir=cache)
    malformed = shard("malformed.tar", [("a.txt", b"1", {"size": "abc"})])
    with pytest.raises(TarFormatError, match="malformed size"):
        raydl.TarDataset(malformed, cache_dir=cache)
    monkeypatch.chdir(tmp_path)
    ds = raydl.TarDataset("file:bad.tar", cache_dir=cache)
    assert [ds[i] for i in range(len(ds))] == webdataset_samples(["file:bad.tar"])


def test_a_shard_that_changes_size_mid_job_is_named(ray_session, tmp_path):
    """A shard rewritten after the dataset indexed it: the batch that needs it fails naming the shard, never serves
    other bytes (the node cache compares the object's size with the indexed one)."""
    paths = write_shards(str(tmp_path / "data"), shards=2)
    ds = raydl.TarDataset(paths, cache_dir=str(tmp_path / "cache"))
    with open(paths[1], "ab") as f:
        f.write(bytes(1024))  # two more zero blocks: the same samples, another size
    loader = _loader(ds, num_workers=1)
    with pytest.raises(OSError, match=r"train-001\.tar changed since it was indexed"):
        list(loader)


def _write_dali_index(shard: str) -> None:
    """A `.idx` file beside the shard in DALI's wds2idx layout: `v1.2 N`, then `ext offset size name` per member."""
    rows, last = [], None
    with tarfile.open(shard) as tar:
        for m in tar.getmembers():
            if not m.isreg() or "." not in os.path.basename(m.name):
                continue
            folder, name = os.path.split(m.name)
            stem, ext = name.split(".", 1)
            base = os.path.join(folder, stem)
            if base != last:
                rows.append([])
                last = base
            rows[-1].append(f"{ext} {m.offset_data} {m.size} {m.name}")
    with open(shard[: -len(".tar")] + ".idx", "w") as f:
        f.write(f"v1.2 {len(rows)}\n" + "".join(" ".join(r) + "\n" for r in rows))


def test_shipped_indexes_dali_and_wids(tmp_path):
    """index='dali' reads the shards' `.idx` files instead of scanning them: the same samples; a stale one is named.
    A wids shard index as the source names the shards and has its counts checked."""
    import json

    paths = write_shards(str(tmp_path / "data"), shards=2)
    for p in paths:
        _write_dali_index(p)
    scanned = raydl.TarDataset(paths, cache_dir=str(tmp_path / "scan"))
    shipped = raydl.TarDataset(paths, cache_dir=str(tmp_path / "dali"), index="dali")
    assert shipped.index_bytes == 0
    assert [shipped[i] for i in range(len(shipped))] == [scanned[i] for i in range(len(scanned))]
    with open(paths[1][: -len(".tar")] + ".idx", "a") as f:
        f.write("jpg 99999999 10 imgs/far.jpg\n")
    with pytest.raises(ValueError, match=r"train-001\.idx"):
        raydl.TarDataset(paths, cache_dir=str(tmp_path / "dali2"), index="dali")
    counts = [sum(1 for _ in webdataset_samples([p])) for p in paths]
    doc = {"wids_version": 1, "shardlist": [{"url": os.path.basename(p), "nsamples": n} for p, n in zip(paths, counts)]}
    (tmp_path / "data" / "train.json").write_text(json.dumps(doc))
    by_wids = raydl.TarDataset(str(tmp_path / "data" / "train.json"), cache_dir=str(tmp_path / "scan"))
    assert by_wids.urls == paths and len(by_wids) == sum(counts)
    doc["shardlist"][0]["nsamples"] += 1
    (tmp_path / "data" / "bad.json").write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=r"says .*train-000\.tar holds \d+ samples; it holds"):
        raydl.TarDataset(str(tmp_path / "data" / "bad.json"), cache_dir=str(tmp_path / "scan"))


def test_resume_at_another_world_size(ray_session, shards, tmp_path):
    """A state of 2 ranks (ParquetDistributedSampler over the shards) loaded at world size 1 gives exactly the samples
    not yet read."""
    ds = raydl.TarDataset(shards, cache_dir=str(tmp_path / "cache"))

    def loader(world: int, rank: int):
        sampler = raydl.ParquetDistributedSampler(ds, num_replicas=world, rank=rank, seed=11)
        return _loader(ds, sampler=sampler, num_workers=1, ray_remote_args={"num_cpus": 0})

    ranks = [loader(2, r) for r in range(2)]
    its = [iter(lo) for lo in ranks]
    read = [k for _ in range(2) for it in its for k in next(it)]  # lockstep, as DDP
    state = _roundtrip(ranks[0].state_dict())
    for lo in ranks:
        lo.shutdown()
    resumed = loader(1, 0)
    resumed.load_state_dict(state)
    rest = _keys(resumed)
    assert len(read) == 16 and sorted(read + rest) == sorted(_key_collate([ds[i] for i in range(len(ds))]))


def test_ctrl_c_while_indexing_keeps_what_was_indexed(tmp_path, monkeypatch):
    """KeyboardInterrupt in the middle of indexing: it reaches the caller, and the shards indexed before it are not
    scanned again by the next run."""
    import raydl.data.tar_index as tar_index

    paths = write_shards(str(tmp_path / "data"), shards=3)
    real = tar_index.scan_shard
    folder = tmp_path / "cache" / "tar-index"

    def interrupted(fs, path, size, url, mode="auto"):
        if path.endswith("train-002.tar"):
            deadline = time.monotonic() + 30
            while len(list(folder.glob("*.json"))) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)  # the two others are written first
            raise KeyboardInterrupt
        return real(fs, path, size, url, mode)

    monkeypatch.setattr(tar_index, "scan_shard", interrupted)
    with pytest.raises(KeyboardInterrupt):
        raydl.TarDataset(paths, cache_dir=str(tmp_path / "cache"))
    monkeypatch.setattr(tar_index, "scan_shard", real)
    again = raydl.TarDataset(paths, cache_dir=str(tmp_path / "cache"))
    assert again.index_bytes == os.path.getsize(paths[2])


def test_streamed_and_hopping_scans_agree(tmp_path, monkeypatch):
    """The two ways of reading a shard's headers (one stream, as for object storage; positioned reads, as on a local
    disk) give the same index, with stream chunks smaller than the members so that data is hopped over."""
    import pyarrow.fs as pafs

    import raydl.data.tar_index as tar_index

    monkeypatch.setattr(tar_index, "_STREAM_CHUNK", 1000)
    paths = write_shards(str(tmp_path / "data"), shards=1, fmt=tarfile.GNU_FORMAT)
    fs, size = pafs.LocalFileSystem(), os.path.getsize(paths[0])
    hop = tar_index.scan_shard(fs, paths[0], size, paths[0], "hop")
    assert tar_index.scan_shard(fs, paths[0], size, paths[0], "stream") == hop and len(hop) == PER_SHARD + 1


def test_a_state_saved_over_other_units_is_refused(ray_session, shards, tmp_path, small_units):
    """The epoch's order depends on the units and the window, which follow cache_limit: a state saved with one
    cache_limit does not silently resume another order under another one."""
    ds = raydl.TarDataset(shards, cache_dir=str(tmp_path / "cache"), cache_limit=60_000)
    loader = _loader(ds, shuffle=True, num_workers=1)
    it = iter(loader)
    next(it)
    state = _roundtrip(loader.state_dict())
    del it
    other = _loader(
        raydl.TarDataset(shards, cache_dir=str(tmp_path / "cache"), cache_limit=90_000), shuffle=True, num_workers=1
    )
    other.load_state_dict(state)
    with pytest.raises(ValueError, match="cache_limit, shuffle_window or node_slots changed"):
        next(iter(other))


def test_index_progress_is_logged_where_there_is_no_terminal(caplog):
    """Off a terminal, indexing progress goes to log lines (shards, GB, time left), at most one every 10 s."""
    import logging

    import raydl.data.tar_index as tar_index

    progress = tar_index._Progress(3, 3_000_000_000)
    progress._tty = False
    with caplog.at_level(logging.INFO, logger="raydl.data"):
        progress.done(1_000_000_000)  # the first line comes 2 s after the start: none yet
        progress._last -= 10.0
        progress.done(1_000_000_000)
        progress.done(1_000_000_000)  # within 10 s of the last line: none
    lines = [r.getMessage() for r in caplog.records if "indexing tar shards" in r.getMessage()]
    assert len(lines) == 1 and "2/3 shards, 2.00/3.00 GB" in lines[0] and "s left" in lines[0], lines
    # shipped indexes (index="dali" / "wids") read no shard's bytes: the time left is counted in shards
    shipped = tar_index._Progress(4, 0)
    shipped.t0 -= 6.0
    shipped.shards = 2
    assert shipped.line().endswith("2/4 shards, 6 s, about 6 s left"), shipped.line()
    assert "unknown" in tar_index._Progress(4, 0).line()


def test_a_random_sampler_reads_every_sample_once(ray_session, shards, tmp_path, small_units):
    """sampler=RandomSampler(ds) works over the shards (at the price of more fetches): every sample once an epoch."""
    ds = raydl.TarDataset(shards, cache_dir=str(tmp_path / "cache"), cache_limit=60_000)
    sampler = torch.utils.data.RandomSampler(ds, generator=torch.Generator().manual_seed(4))
    assert sorted(_keys(_loader(ds, sampler=sampler))) == sorted(_key_collate([ds[i] for i in range(len(ds))]))
