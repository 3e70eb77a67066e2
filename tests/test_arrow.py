"""raydl.ArrowDataset and Arrow sharing (NOTE [ raydl arrow ], NOTE [ raydl shared memory ]).

Parity: every source kind gives the same batches through torch's DataLoader (0 and 2 forked
workers) and raydl's. Zero-copy: what a worker holds is measured from inside it (tests/_arrow_helpers.py
MemoryProbe): where the table's buffers live (Ray's object store, a mapped file, or the heap),
that writing to them fails, and how much its memory grew against a worker holding a tiny table.
"""

from __future__ import annotations

import os
import pickle

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # nothing is downloaded: datasets are built here
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.csv as pacsv  # noqa: E402
import pyarrow.feather as feather  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import raydl  # noqa: E402
from raydl.data.share import Shipped, pack  # noqa: E402
from raydl.worker.actor import WorkerPayload  # noqa: E402
from tests import _arrow_helpers as H  # noqa: E402
from tests._parity import assert_same_batches  # noqa: E402

datasets = pytest.importorskip("datasets")

N = 50
TIMEOUT_S = 60
BIG_ROWS = 5_000_000  # one int64 column: 40 MB


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Every file-backed source, written once: Parquet (one, several, a folder), IPC, Feather, CSV, HF caches."""
    root = tmp_path_factory.mktemp("arrow")
    table = pa.table(H.metadata_columns(N))
    paths = {}
    pq.write_table(table, root / "one.parquet")
    folder = root / "parts"
    folder.mkdir()
    for k, start in enumerate(range(0, N, 20)):
        pq.write_table(table.slice(start, 20), folder / f"part-{k}.parquet")
    paths["parquet"] = str(root / "one.parquet")
    paths["parquet_files"] = sorted(str(p) for p in folder.iterdir())
    paths["parquet_folder"] = str(folder)
    feather.write_feather(table, root / "t.arrow", compression="uncompressed")
    paths["ipc"] = str(root / "t.arrow")
    feather.write_feather(table, root / "t.feather", compression="uncompressed")
    paths["feather"] = str(root / "t.feather")
    pacsv.write_csv(table.drop_columns(["box"]), root / "t.csv")
    paths["csv"] = str(root / "t.csv")
    datasets.Dataset.from_dict(H.metadata_columns(N)).save_to_disk(str(root / "hf"))
    paths["hf_cached"] = str(root / "hf")
    return paths


def _sources(files) -> dict:
    """kind -> a function that builds a fresh dataset of that kind (each loader gets its own)."""
    cols = H.metadata_columns(N)
    return {
        "table": lambda: raydl.ArrowDataset(pa.table(cols)),
        "record_batch": lambda: raydl.ArrowDataset(pa.RecordBatch.from_pydict(cols)),
        "dict": lambda: raydl.ArrowDataset(cols),
        "pandas": lambda: raydl.ArrowDataset(pa.table(cols).to_pandas()),
        "parquet": lambda: raydl.ArrowDataset(files["parquet"]),
        "parquet_files": lambda: raydl.ArrowDataset(files["parquet_files"]),
        "parquet_folder": lambda: raydl.ArrowDataset(files["parquet_folder"]),
        "ipc": lambda: raydl.ArrowDataset(files["ipc"]),
        "feather": lambda: raydl.ArrowDataset(files["feather"]),
        "csv": lambda: raydl.ArrowDataset(files["csv"]),
        "hf_memory": lambda: raydl.ArrowDataset(datasets.Dataset.from_dict(cols)),
        "hf_cached": lambda: raydl.ArrowDataset(datasets.load_from_disk(files["hf_cached"])),
        "hf_straight": lambda: datasets.load_from_disk(files["hf_cached"]),  # no ArrowDataset at all
        "hf_straight_memory": lambda: datasets.Dataset.from_dict(cols),
    }


KINDS = list(
    _sources(
        {"parquet": "", "parquet_files": [], "parquet_folder": "", "ipc": "", "feather": "", "csv": "", "hf_cached": ""}
    )
)


# ---------------------------------------------------------------------- parity


@pytest.mark.parametrize("torch_workers", [0, 2])
@pytest.mark.parametrize("kind", KINDS)
def test_batches_match_torch_for_every_source(ray_session, files, kind, torch_workers):
    """Every source kind: raydl's batches equal torch's (0 and 2 forked workers), shuffled, batch for batch."""
    batches = assert_same_batches(
        _sources(files)[kind], torch_workers=torch_workers, num_workers=2, batch_size=6, shuffle=True
    )
    assert sum(len(b["label"]) for b in batches[0]) == N


def test_columns_and_transform_match_torch(ray_session, files):
    """columns= and transform= (row -> (features, label)) over Parquet: same batches, two persistent epochs."""
    make = lambda: raydl.ArrowDataset(files["parquet"], columns=["caption", "label", "score"], transform=H.row_to_pair)  # noqa: E731
    assert make().column_names == ["caption", "label", "score"]
    batches = assert_same_batches(
        make,
        torch_workers=2,
        num_workers=2,
        batch_size=8,
        shuffle=True,
        drop_last=True,
        persistent_workers=True,
        epochs=2,
    )
    assert batches[0][0][0].dtype == torch.float32 and batches[0][0][0].shape == (8, 2)


def test_rows_hold_python_and_numpy_values(files):
    """ds[i] is a dict of Python values, with lists of numbers as NumPy arrays; __getitems__ gives the same rows."""
    ds = raydl.ArrowDataset(files["ipc"])
    row = ds[3]
    assert row["path"] == "images/000003.jpg" and row["label"] == 3 and row["score"] == 0.3
    assert isinstance(row["box"], np.ndarray) and row["box"].dtype == np.int64 and row["box"].tolist() == [3, 4, 5]
    assert ds[-1]["label"] == (N - 1) % 7
    many = ds.__getitems__([3, -1, 0])
    assert [r["path"] for r in many] == [ds[3]["path"], ds[-1]["path"], ds[0]["path"]]


@settings(max_examples=40, deadline=None)
@given(
    values=st.lists(st.one_of(st.none(), st.integers(-(2**40), 2**40)), min_size=1, max_size=30),
    picks=st.lists(st.integers(0, 10**6), max_size=40),
    chunk=st.integers(1, 8),
)
def test_getitems_equals_row_by_row(values, picks, chunk):
    """For any table (nulls, several chunks) and any indices (negatives too): one take == indexing row by row."""
    n = len(values)
    table = pa.Table.from_batches(
        [
            pa.RecordBatch.from_pydict(
                {
                    "v": values[i : i + chunk],
                    "s": [None if v is None else str(v) for v in values[i : i + chunk]],
                    "l": [None if v is None else [v, 1] for v in values[i : i + chunk]],
                },
                schema=pa.schema([("v", pa.int64()), ("s", pa.string()), ("l", pa.list_(pa.int64()))]),
            )
            for i in range(0, n, chunk)
        ]
    )
    ds = raydl.ArrowDataset(table)
    idx = [p % (2 * n) - n for p in picks]  # in [-n, n)
    batch = ds.__getitems__(idx)
    single = [ds[i] for i in idx]
    assert len(batch) == len(single)
    for a, b in zip(batch, single):
        assert a["v"] == b["v"] and a["s"] == b["s"]
        assert (a["l"] is None and b["l"] is None) or np.array_equal(a["l"], b["l"])


# ---------------------------------------------------------------------- pickling


@pytest.mark.parametrize("kind", ["table", "parquet", "ipc", "hf_cached", "hf_memory"])
def test_plain_pickle_round_trip(files, kind):
    """Plain pickle (torch's spawn): same rows; a memory-mapped dataset comes back mapped, by path."""
    ds = _sources(files)[kind]()
    back = pickle.loads(pickle.dumps(ds))
    assert len(back) == len(ds) and back.__getitems__(range(N)) is not None
    assert [r["caption"] for r in back.__getitems__(list(range(N)))] == [
        r["caption"] for r in ds.__getitems__(list(range(N)))
    ]
    assert back.is_memory_mapped == (kind == "ipc")
    if kind == "ipc":
        assert len(pickle.dumps(ds)) < 2000  # the path, not the table


# ---------------------------------------------------------------------- bad input


def test_missing_file_is_named(tmp_path):
    """A path that does not exist: FileNotFoundError naming it."""
    with pytest.raises(FileNotFoundError, match="no such file or folder: .*nothere.parquet"):
        raydl.ArrowDataset(str(tmp_path / "nothere.parquet"))


@pytest.mark.parametrize("kind", ["table", "parquet", "ipc", "csv", "hf_cached"])
def test_unknown_column_is_named(files, kind):
    """columns= naming a column the source lacks: ValueError naming it and listing the real ones."""
    source = {
        "table": lambda: pa.table(H.metadata_columns(N)),
        "hf_cached": lambda: datasets.load_from_disk(files["hf_cached"]),
    }.get(kind, lambda: files[kind])()
    with pytest.raises(ValueError, match=r"unknown column\(s\) \['colour'\]; the table has columns \[.*'label'"):
        raydl.ArrowDataset(source, columns=["label", "colour"])


def test_index_out_of_range(ray_session, files):
    """ds[len] and a batch holding a bad index raise IndexError naming the index, also from a raydl worker."""
    ds = raydl.ArrowDataset(files["ipc"])
    with pytest.raises(IndexError, match=f"index {N} is out of range for a dataset of {N} rows"):
        ds[N]
    with pytest.raises(IndexError, match=f"index {-N - 1} is out of range"):
        ds.__getitems__([0, -N - 1])
    with pytest.raises(TypeError, match="indices are integers"):
        ds["3"]
    loader = raydl.DataLoader(ds, batch_sampler=[[0, 1], [2, N + 5]], num_workers=1, timeout=TIMEOUT_S)
    with pytest.raises(IndexError, match=f"index {N + 5} is out of range"):
        list(loader)


@pytest.mark.parametrize(
    "source, error, match",
    [
        (42, TypeError, "cannot read a builtins.int: pass a pyarrow Table"),
        ([1, 2, 3], TypeError, "cannot read a builtins.list"),
        (object(), TypeError, "cannot read a builtins.object"),
        ({"a": [1, 2], "b": [1]}, ValueError, "dict of columns is not a table"),
    ],
)
def test_non_tabular_source_is_named(source, error, match):
    """A source that is not tabular: an error naming its type and the kinds that are accepted."""
    with pytest.raises(error, match=match):
        raydl.ArrowDataset(source)


def test_bad_files_are_named(tmp_path):
    """A file that is not of its kind, an unknown suffix, an empty folder, mixed kinds: errors naming them."""
    fake = tmp_path / "fake.parquet"
    fake.write_text("not parquet")
    with pytest.raises(ValueError, match="fake.parquet is not a readable Parquet file"):
        raydl.ArrowDataset(str(fake))
    fake_ipc = tmp_path / "fake.arrow"
    fake_ipc.write_text("not arrow")
    with pytest.raises(ValueError, match="fake.arrow is not an Arrow IPC / Feather file"):
        raydl.ArrowDataset(str(fake_ipc))
    odd = tmp_path / "t.xlsx"
    odd.write_text("x")
    with pytest.raises(ValueError, match="cannot tell the format of .*t.xlsx"):
        raydl.ArrowDataset(str(odd))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="folder .*empty holds no"):
        raydl.ArrowDataset(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="files of several kinds"):
        raydl.ArrowDataset([str(fake), str(fake_ipc)])
    with pytest.raises(TypeError, match="pick a split"):
        raydl.ArrowDataset(datasets.DatasetDict({"train": datasets.Dataset.from_dict({"a": [1]})}))


def test_compressed_feather_is_read_with_a_warning(tmp_path):
    """A compressed Feather file cannot be mapped: it is read into memory, with a warning saying how to fix it."""
    path = tmp_path / "z.feather"
    feather.write_feather(pa.table({"x": np.arange(1_000_000)}), path, compression="lz4")
    with pytest.warns(UserWarning, match="could not be memory-mapped"):
        ds = raydl.ArrowDataset(str(path))
    assert not ds.is_memory_mapped and ds[5] == {"x": 5}


# ---------------------------------------------------------------------- zero copy


def _probe(data, **loader_kwargs) -> dict:
    """What one fresh raydl worker reports about `data` (tests/_arrow_helpers.py MemoryProbe)."""
    loader = raydl.DataLoader(
        H.MemoryProbe(data, n=1),
        batch_size=None,
        num_workers=1,
        collate_fn=H.identity,
        timeout=TIMEOUT_S,
        ray_reuse_workers=False,
        **loader_kwargs,
    )
    (report,) = list(loader)
    return report


@pytest.fixture(scope="module")
def idle(ray_session):
    """A fresh worker holding a tiny table: the fixed cost every comparison subtracts."""
    return _probe(pa.table({"x": np.arange(10)}))


def _big_table() -> pa.Table:
    return pa.table({"x": np.arange(BIG_ROWS, dtype=np.int64)})


def test_arrow_dataset_is_mapped_from_the_object_store(ray_session, idle):
    """A worker reads an in-memory ArrowDataset from Ray's object store: no growth by its size, read-only views."""
    table = _big_table()
    report = _probe(raydl.ArrowDataset(table))
    assert report["sum"] == BIG_ROWS * (BIG_ROWS - 1) // 2
    assert report["places"] == ["plasma"]
    assert report["write_fails"]
    assert report["uss"] - idle["uss"] < table.nbytes / 4, (report, idle)
    assert report["anon"] - idle["anon"] < table.nbytes / 4, (report, idle)


def test_driver_keeps_one_copy_and_puts_once(ray_session):
    """After a loader, the driver's ArrowDataset reads the object-store copy too; a second loader puts nothing."""
    ds = raydl.ArrowDataset({"x": np.arange(100_000)})
    assert H.buffer_places(ds.table) == {"heap"}
    list(raydl.DataLoader(ds, batch_size=1000, num_workers=1, timeout=TIMEOUT_S))
    ref = ds._ref
    assert H.buffer_places(ds.table) == {"plasma"}
    assert next(iter(torch.utils.data.DataLoader(ds, batch_size=4)))["x"].tolist() == [0, 1, 2, 3]
    list(raydl.DataLoader(ds, batch_size=1000, num_workers=1, timeout=TIMEOUT_S))
    assert ds._ref is ref


@pytest.mark.parametrize("shared", [False, True])
def test_pyarrow_inside_any_dataset_is_shared_only_when_asked(ray_session, idle, shared):
    """A pa.Table held by a user dataset: a private copy per worker by default; mapped, read-only, with the flag."""
    table = _big_table()
    report = _probe(table, ray_shared_dataset_memory=shared)
    assert report["sum"] == BIG_ROWS * (BIG_ROWS - 1) // 2
    grew = report["uss"] - idle["uss"]
    if shared:
        assert report["places"] == ["plasma"] and report["write_fails"]
        assert grew < table.nbytes / 4, (report, idle)
    else:
        assert report["places"] == ["heap"]
        assert grew > table.nbytes * 0.8, (report, idle)  # the control: a copy is visible to this measure


def test_list_of_paths_to_pyarrow_array(ray_session):
    """docs/data-sources.md: a Python list of paths -> pa.array(paths) with ray_shared_dataset_memory=True, same batches, shared."""
    paths = [f"/data/images/{i:07d}.jpg" for i in range(1000)]
    expected = list(torch.utils.data.DataLoader(H.PathsDataset(paths, as_arrow=False), batch_size=100))
    got = list(
        raydl.DataLoader(
            H.PathsDataset(paths, as_arrow=True),
            batch_size=100,
            num_workers=2,
            timeout=TIMEOUT_S,
            ray_shared_dataset_memory=True,
        )
    )
    assert got == expected
    report = _probe(pa.array(paths), ray_shared_dataset_memory=True)
    assert report["places"] == ["plasma"] and report["write_fails"]


def test_memory_mapped_file_is_reopened_not_copied(ray_session, idle, tmp_path):
    """An ArrowDataset over an IPC file travels as its path; the worker maps the file (no heap growth)."""
    path = tmp_path / "big.arrow"
    table = _big_table()
    feather.write_feather(table, path, compression="uncompressed")
    ds = raydl.ArrowDataset(str(path))
    assert len(pack(WorkerPayload(ds, False, True, H.identity, False, None), False)) < 5000
    report = _probe(ds)
    assert report["places"] == ["file:big.arrow"]
    assert report["write_fails"]
    assert report["anon"] - idle["anon"] < table.nbytes / 4, (report, idle)


# ---------------------------------------------------------------------- Hugging Face datasets


@pytest.fixture(scope="module")
def idle_hf(ray_session):
    """A fresh worker holding a tiny Hugging Face dataset (importing `datasets` costs a worker tens of MB)."""
    return _probe(datasets.Dataset.from_dict({"x": np.arange(10)}))


def test_hf_cache_files_are_mapped_by_each_worker(ray_session, idle_hf, tmp_path):
    """A datasets.Dataset from cache files travels as paths (nothing put on one node); workers map the files."""
    hf = datasets.Dataset.from_dict({"x": np.arange(2_000_000)})
    hf.save_to_disk(str(tmp_path / "hf"))
    hf = datasets.load_from_disk(str(tmp_path / "hf"))
    shipped = pack(WorkerPayload(hf, False, True, H.identity, False, None), False)
    assert isinstance(shipped, bytes) and len(shipped) < 20_000  # paths only: no table, no object-store copy
    report = _probe(hf)
    assert report["places"] == ["file:data-00000-of-00001.arrow"]
    assert report["anon"] - idle_hf["anon"] < 16_000_000 / 4, (report, idle_hf)
    assert report["sum"] == 2_000_000 * 1_999_999 // 2


def test_hf_in_memory_table_is_shared(ray_session):
    """A datasets.Dataset built in memory: its table goes to the object store once, workers map it read-only."""
    hf = datasets.Dataset.from_dict({"x": np.arange(100_000)})
    shipped = pack(WorkerPayload(hf, False, True, H.identity, False, None), False)
    assert isinstance(shipped, Shipped) and len(shipped.refs) == 1 and len(shipped.data) < 20_000
    report = _probe(hf)
    assert report["places"] == ["plasma"] and report["write_fails"]


def test_missing_cache_file_without_a_copy_is_named(ray_session, tmp_path):
    """On one node nothing is shipped: a worker that cannot find a cache file raises FileNotFoundError naming it."""
    datasets.Dataset.from_dict({"x": list(range(20))}).save_to_disk(str(tmp_path / "hf"))
    hf = datasets.load_from_disk(str(tmp_path / "hf"))
    os.rename(tmp_path / "hf", tmp_path / "moved")  # the driver's own map stays valid
    loader = raydl.DataLoader(hf, batch_size=5, num_workers=1, timeout=TIMEOUT_S)
    with pytest.raises(
        FileNotFoundError, match=r"memory-mapped file .*hf/data-00000-of-00001.arrow is missing on node .* Fix:"
    ):
        list(loader)


def test_file_of_another_size_is_not_mapped(tmp_path):
    """A worker maps a file by path only if its size is the driver's; otherwise the shipped copy, or an error naming it."""
    from raydl.data.share import files_here

    path = tmp_path / "f.arrow"
    path.write_bytes(b"x" * 10)
    assert files_here([str(path)], [10], None, "t")
    assert not files_here([str(path)], [11], "a shipped copy", "t")
    with pytest.raises(FileNotFoundError, match=r"f.arrow is not the driver's \(another size"):
        files_here([str(path)], [11], None, "t")
