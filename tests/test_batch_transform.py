"""`batch_transform=` on ArrowDataset / ParquetDataset (NOTE [ raydl batch transforms ]) and the token helpers
(NOTE [ raydl token batches ]).

The references are computed without raydl: torch's own DataLoader over a plain list of row numbers, whose
collate_fn builds the expected batch from the table's rows one by one in Python. The transforms and collate
functions are module-level, so that they pickle to the workers.
"""

from __future__ import annotations

import os
import pickle
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch.utils.data import default_collate

import raydl
from raydl.worker.fetch import MapFetcher
from tests._parity import assert_batches_equal

pytestmark = pytest.mark.usefixtures("release_warm_workers_after_module")

N = 50
BATCH = 8
TIMEOUT_S = 60
_rng = np.random.default_rng(7)
TABLE = pa.table(
    {
        "x": pa.array(_rng.random(N).astype(np.float32)),
        "label": pa.array(_rng.integers(0, 5, N), type=pa.int32()),
        "tokens": pa.array(
            [_rng.integers(1, 1000, int(k)).tolist() for k in _rng.integers(0, 12, N)], pa.list_(pa.int32())
        ),
        "name": pa.array([f"row-{i}" for i in range(N)]),
    }
)


def prepare(batch: dict) -> dict:
    """The batch transform under test: a vectorized affine map, the label kept, tokens padded, names passed on."""
    out = {"x": batch["x"] * 2 + 1, "label": batch["label"]}
    out.update(raydl.pad_tokens(batch["tokens"], pad_value=-1))
    out["name"] = batch["name"]
    return out


def reference_collate(indices: list) -> dict:
    """The batch `prepare` must give, from the table's rows one by one (no raydl, no vectorization)."""
    rows = [TABLE.slice(i, 1).to_pylist()[0] for i in indices]
    width = max(len(r["tokens"]) for r in rows)
    return {
        "x": torch.tensor([np.float32(r["x"]) * np.float32(2) + np.float32(1) for r in rows], dtype=torch.float32),
        "label": torch.tensor([r["label"] for r in rows], dtype=torch.int32),
        "input_ids": torch.tensor([r["tokens"] + [-1] * (width - len(r["tokens"])) for r in rows], dtype=torch.int64),
        "attention_mask": torch.tensor([[1] * len(r["tokens"]) + [0] * (width - len(r["tokens"])) for r in rows]),
        "lengths": torch.tensor([len(r["tokens"]) for r in rows]),
        "name": [r["name"] for r in rows],
    }


def reference(**kwargs) -> list:
    return list(torch.utils.data.DataLoader(list(range(N)), collate_fn=reference_collate, **kwargs))


def with_pid(batch: dict) -> dict:
    return {"pid": np.full(len(batch["x"]), os.getpid()), "x": batch["x"]}


def fails_on_row_5(batch: dict) -> dict:
    if 5 in batch["label"].tolist():
        raise ValueError("row 5 is not welcome")
    return {"label": batch["label"]}


def rows_as_pairs(rows: list) -> tuple:
    """A user's collate_fn: it receives the transformed batch's rows."""
    return torch.stack([r["input_ids"] for r in rows]), [r["name"] for r in rows]


def _assert_same(got: list, want: list) -> None:
    assert len(got) == len(want), (len(got), len(want))
    for i, (a, b) in enumerate(zip(got, want)):
        assert_batches_equal(a, b, f"batch {i}")


# ---------------------------------------------------------------------------- batches


@pytest.mark.parametrize("num_workers", [0, 2])
def test_default_arguments_give_the_reference_batches(ray_session, num_workers):
    """shuffle=True with no generator (torch's global RNG): the reference's batches, in its order, both in this
    process (num_workers=0) and from Ray workers through the columnar path."""
    ds = raydl.ArrowDataset(TABLE, batch_transform=prepare)
    torch.manual_seed(11)
    want = reference(batch_size=BATCH, shuffle=True)
    torch.manual_seed(11)
    got = list(raydl.DataLoader(ds, batch_size=BATCH, shuffle=True, num_workers=num_workers, timeout=TIMEOUT_S))
    _assert_same(got, want)
    assert len({b["input_ids"].shape[1] for b in got}) > 1  # each batch padded to its own longest sequence


def test_same_batches_at_any_worker_count_and_on_resume(ray_session):
    """1 or 3 workers, and a loader resumed from a state saved after 2 batches: the reference's batches, with a
    seeded generator and drop_last."""
    ds = raydl.ArrowDataset(TABLE, batch_transform=prepare)
    kwargs = dict(batch_size=BATCH, shuffle=True, drop_last=True)
    want = reference(generator=torch.Generator().manual_seed(3), **kwargs)
    for workers in (1, 3):
        loader = raydl.DataLoader(ds, generator=torch.Generator().manual_seed(3), num_workers=workers, **kwargs)
        _assert_same(list(loader), want)
    loader = raydl.DataLoader(ds, generator=torch.Generator().manual_seed(3), num_workers=2, **kwargs)
    it = iter(loader)
    head = [next(it), next(it)]
    state = loader.state_dict()
    del it
    resumed = raydl.DataLoader(
        ds, generator=torch.Generator().manual_seed(3), num_workers=2, timeout=TIMEOUT_S, **kwargs
    )
    resumed.load_state_dict(state)
    _assert_same(head + list(resumed), want)


def test_torchs_dataloader_and_a_users_collate_get_the_transformed_rows(ray_session):
    """torch's DataLoader over the dataset (its __getitems__ then default_collate) makes the reference's batches; a
    user's collate_fn receives the transformed batch's rows, under torch and under raydl alike."""
    ds = raydl.ArrowDataset(TABLE, batch_transform=prepare)
    _assert_same(list(torch.utils.data.DataLoader(ds, batch_size=BATCH)), reference(batch_size=BATCH))
    want = list(torch.utils.data.DataLoader(ds, batch_size=BATCH, collate_fn=rows_as_pairs))
    got = list(raydl.DataLoader(ds, batch_size=BATCH, collate_fn=rows_as_pairs, num_workers=2, timeout=TIMEOUT_S))
    _assert_same(got, want)
    assert want[0][1] == [f"row-{i}" for i in range(BATCH)]
    assert_batches_equal(ds[3], {k: v[0] for k, v in reference_collate([3]).items()})  # a batch of one, its row


def test_the_transform_travels_with_every_kind_of_table(tmp_path, ray_session):
    """A memory-mapped Arrow IPC file (shipped as its path) and an in-memory table (shipped through the object
    store, or by plain pickle): the workers' batches are the reference's, through the columnar path."""
    path = str(tmp_path / "t.arrow")
    with pa.ipc.new_file(path, TABLE.schema) as writer:
        writer.write_table(TABLE, max_chunksize=20)
    mapped = raydl.ArrowDataset(path, batch_transform=prepare)
    assert mapped.is_memory_mapped and mapped.raydl_collate([0, 1]) is not None
    for ds in (
        mapped,
        pickle.loads(pickle.dumps(mapped)),
        pickle.loads(pickle.dumps(raydl.ArrowDataset(TABLE, batch_transform=prepare))),
    ):
        assert ds.raydl_batch_transform is prepare
        got = list(raydl.DataLoader(ds, batch_size=BATCH, num_workers=2, timeout=TIMEOUT_S))
        _assert_same(got, reference(batch_size=BATCH))


def test_it_runs_in_the_workers(ray_session):
    """With workers, the transform runs in their processes, never in the trainer's; num_workers=0 runs it here, as
    torch's num_workers=0 runs everything here."""
    ds = raydl.ArrowDataset(TABLE, batch_transform=with_pid)
    pids = {
        p for b in raydl.DataLoader(ds, batch_size=BATCH, num_workers=2, timeout=TIMEOUT_S) for p in b["pid"].tolist()
    }
    assert pids and os.getpid() not in pids
    pids = {p for b in raydl.DataLoader(ds, batch_size=BATCH) for p in b["pid"].tolist()}
    assert pids == {os.getpid()}


def test_parquet_dataset_batches(tmp_path, ray_session):
    """ParquetDataset with its own shuffle sampler, from Ray workers: the reference's batches in that sampler's order
    (torch's DataLoader drawing from the same generator); torch's DataLoader over the dataset gives them too."""
    pq.write_table(TABLE, tmp_path / "t.parquet", row_group_size=16)
    ds = raydl.ParquetDataset(str(tmp_path / "t.parquet"), cache_dir=str(tmp_path / "cache"), batch_transform=prepare)
    g = torch.Generator().manual_seed(4)
    want = reference(batch_size=BATCH, sampler=raydl.ParquetShuffleSampler(ds, g, BATCH), generator=g)
    g = torch.Generator().manual_seed(4)
    got = list(raydl.DataLoader(ds, batch_size=BATCH, shuffle=True, generator=g, num_workers=2, timeout=TIMEOUT_S))
    _assert_same(got, want)
    _assert_same(list(torch.utils.data.DataLoader(ds, batch_size=BATCH)), reference(batch_size=BATCH))
    assert_batches_equal(ds[-1], {k: v[0] for k, v in reference_collate([N - 1]).items()})


# ---------------------------------------------------------------------------- errors


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_transform_that_raises_is_named_and_the_loader_goes_on(ray_session, num_workers):
    """The transform's error reaches the loop with its type, names the transform and the dataset; the next batches
    still come (torch's rule for a dataset's error)."""
    ds = raydl.ArrowDataset({"label": np.arange(20)}, batch_transform=fails_on_row_5)
    it = iter(raydl.DataLoader(ds, batch_size=4, num_workers=num_workers, timeout=TIMEOUT_S))
    outcomes = []
    while True:
        try:
            outcomes.append(next(it)["label"].tolist())
        except StopIteration:
            break
        except ValueError as e:
            text = str(e) + "".join(getattr(e, "__notes__", []))
            assert "row 5 is not welcome" in text
            if sys.version_info >= (3, 11):  # exception notes
                assert "batch_transform fails_on_row_5 of ArrowDataset" in text, text
            outcomes.append("error")
    assert outcomes == [[0, 1, 2, 3], "error", [8, 9, 10, 11], [12, 13, 14, 15], [16, 17, 18, 19]]


def test_contradictory_arguments_are_refused(tmp_path):
    """transform= with batch_transform=, a batch_transform that is not callable, and ray_seed="sample" (each sample
    seeded alone) with a batch transform: errors that name the problem and the fix."""
    with pytest.raises(ValueError, match="both given; pass one: do the per-row work inside batch_transform"):
        raydl.ArrowDataset(TABLE, transform=dict, batch_transform=prepare)
    pq.write_table(TABLE, tmp_path / "t.parquet")
    with pytest.raises(ValueError, match="both given"):
        raydl.ParquetDataset(str(tmp_path / "t.parquet"), transform=dict, batch_transform=prepare)
    with pytest.raises(TypeError, match="batch_transform should be callable"):
        raydl.ArrowDataset(TABLE, batch_transform="pad")
    ds = raydl.ArrowDataset(TABLE, batch_transform=prepare)
    with pytest.raises(ValueError, match="ray_seed='sample' .* use ray_seed='batch'"):
        next(iter(raydl.DataLoader(ds, batch_size=4, ray_seed="sample")))


def _out(result):
    """A batch transform returning `result` whatever it is given."""
    return lambda batch: result


@pytest.mark.parametrize(
    "result, match",
    [
        ([1, 2], "returned list .* should return a dict of columns"),
        ({}, "should return a dict of columns"),
        ({"a": np.zeros(3), "b": np.zeros(2)}, r"columns of different lengths \{'a': 3, 'b': 2\}"),
        ({"a": np.zeros(0)}, "returned no rows"),
        ({"ids": [[1, 2], [3]]}, "returned 'ids' as list: .* pad a ragged column, e.g. with raydl.pad_tokens"),
        ({"ids": np.array([np.zeros(2), np.zeros(1)], dtype=object)}, "returned 'ids' as ndarray of object"),
        ({"n": 3}, "returned 'n' as int"),
        ({"when": np.array(["2026-01-01"] * 3, dtype="datetime64[D]")}, "returned 'when' as ndarray of datetime64"),
    ],
)
def test_bad_outputs_name_the_column_and_the_fix(result, match):
    """Every path (the worker's columnar one, __getitems__, ds[i]) refuses the same outputs with the same message."""
    ds = raydl.ArrowDataset({"x": np.arange(3)}, batch_transform=_out(result))
    for read in (lambda: ds.raydl_collate([0, 1, 2]), lambda: ds.__getitems__([0, 1, 2])):
        with pytest.raises((TypeError, ValueError), match=match):
            read()


def test_what_the_transform_receives():
    """A dict of private, writable NumPy arrays, one per column in the table's order: numbers in their Arrow dtype,
    nested fixed-size lists as N-D arrays, variable-length lists as object arrays of 1-D arrays, strings and bytes
    as object arrays; nulls in a numeric column are refused with the column named; a row count that changes is
    a batch (packing), not a sample."""
    seen = {}

    def look(batch):
        seen.update(batch)
        for v in batch.values():
            assert v.flags.writeable
        return {"n": np.arange(len(batch["i8"]))}

    image = pa.FixedSizeListArray.from_arrays(
        pa.FixedSizeListArray.from_arrays(pa.array(np.arange(3 * 2 * 2, dtype=np.uint8)), 2), 2
    )
    ds = raydl.ArrowDataset(
        {
            "i8": pa.array([1, 2, 3], pa.int8()),
            "f16": pa.array(np.ones(3, dtype=np.float16)),
            "ok": pa.array([True, False, True]),
            "image": image,
            "ids": pa.array([[1], [2, 3], []], pa.list_(pa.int64())),
            "s": pa.array(["a", None, "c"]),
            "b": pa.array([b"x", b"y", b"z"]),
        },
        batch_transform=look,
    )
    ds.raydl_collate([2, 0, 1])
    assert list(seen) == ["i8", "f16", "ok", "image", "ids", "s", "b"]
    assert [seen[k].dtype for k in ("i8", "f16", "ok", "image")] == [np.int8, np.float16, np.bool_, np.uint8]
    assert seen["i8"].tolist() == [3, 1, 2] and seen["image"].shape == (3, 2, 2)
    assert seen["image"][1].tolist() == [[0, 1], [2, 3]]
    assert seen["ids"].dtype == object and [a.tolist() for a in seen["ids"]] == [[], [1], [2, 3]]
    assert seen["s"].tolist() == ["c", "a", None] and seen["b"].tolist() == [b"z", b"x", b"y"]
    seen["i8"][0] = 100  # a private copy: the table is unchanged
    assert ds.table.column("i8").to_pylist() == [1, 2, 3]
    nulls = raydl.ArrowDataset({"v": pa.array([1.0, None])}, batch_transform=look)
    with pytest.raises(ValueError, match="column 'v' has nulls in this batch, .*fill_null"):
        nulls.raydl_collate([0, 1])
    packed = raydl.ArrowDataset(
        {"ids": pa.array([[1, 2], [3], [4, 5]])}, batch_transform=lambda b: raydl.pack_tokens(b["ids"], 8)
    )
    assert packed.raydl_collate([0, 1, 2])["input_ids"].tolist() == [[1, 2, 3, 4, 5, 0, 0, 0]]
    with pytest.raises(ValueError, match=r"made 0 rows of one|no rows"):
        raydl.ArrowDataset(
            {"ids": pa.array([[]], pa.list_(pa.int64()))}, batch_transform=lambda b: raydl.pack_tokens(b["ids"], 8)
        )[0]
    fetcher = MapFetcher(ds, True, default_collate, columnar=True)
    with pytest.raises(ValueError, match="ray_seed='sample'"):
        fetcher.fetch([0, 1], lambda i: None)


# ---------------------------------------------------------------------------- token helpers


def _sequences(seed: int) -> list:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 50_000, int(k)).tolist() for k in rng.integers(0, 20, 40)]


def _forms(seqs: list) -> dict:
    """The same sequences in every form the helpers accept."""
    arrow = pa.array(seqs, pa.list_(pa.int32()))
    objects = np.empty(len(seqs), dtype=object)
    for i, s in enumerate(seqs):
        objects[i] = np.asarray(s, dtype=np.int64)
    return {
        "list": seqs,
        "arrow": arrow,
        "arrow-chunked-sliced": pa.chunked_array([arrow.slice(0, 15), arrow.slice(15)]),
        "large_list": pa.array(seqs, pa.large_list(pa.int64())),
        "numpy-objects": objects,
        "tensors": [torch.tensor(s, dtype=torch.int64) for s in seqs],
    }


def pad_reference(seqs, max_length=None, pad_value=0, truncate=False, side="right"):
    width = max(len(s) for s in seqs) if max_length is None else max_length
    ids, mask, lengths = [], [], []
    for s in seqs:
        s = s[:width] if truncate else s
        pad = [pad_value] * (width - len(s))
        ids.append(s + pad if side == "right" else pad + s)
        ones = [1] * len(s)
        mask.append(ones + [0] * len(pad) if side == "right" else [0] * len(pad) + ones)
        lengths.append(len(s))
    return {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask), "lengths": torch.tensor(lengths)}


def pack_reference(seqs, max_length, pad_value=0, truncate=False):
    rows = []  # each row: its list of (sequence number in row, position, token)
    for s in seqs:
        s = s[:max_length] if truncate else s
        if not s:
            continue
        if not rows or len(rows[-1]) + len(s) > max_length:
            rows.append([])
        number = (rows[-1][-1][0] + 1) if rows[-1] else 1
        rows[-1].extend((number, p, t) for p, t in enumerate(s))
    fill = lambda row, k, blank: [x[k] for x in row] + [blank] * (max_length - len(row))  # noqa: E731
    return {
        "input_ids": torch.tensor([fill(r, 2, pad_value) for r in rows], dtype=torch.int64).reshape(-1, max_length),
        "segment_ids": torch.tensor([fill(r, 0, 0) for r in rows], dtype=torch.int64).reshape(-1, max_length),
        "position_ids": torch.tensor([fill(r, 1, 0) for r in rows], dtype=torch.int64).reshape(-1, max_length),
        "attention_mask": torch.tensor([[1] * len(r) + [0] * (max_length - len(r)) for r in rows]).reshape(
            -1, max_length
        ),
    }


@pytest.mark.parametrize(
    "options",
    [{}, {"side": "left", "pad_value": -100}, {"max_length": 24}, {"max_length": 7, "truncate": True, "side": "left"}],
    ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "defaults",
)
def test_pad_tokens_matches_a_per_row_reference(options):
    """Every input form, padded on either side, to the batch's longest or to max_length, truncated or not."""
    seqs = _sequences(1)
    want = pad_reference(seqs, **options)
    for form, value in _forms(seqs).items():
        assert_batches_equal(raydl.pad_tokens(value, **options), want, form)
    narrow = raydl.pad_tokens(np.array([[1, 2], [3, 4]], dtype=np.int16), dtype=torch.int32)
    assert narrow["input_ids"].dtype == torch.int32 and narrow["attention_mask"].tolist() == [[1, 1], [1, 1]]


@pytest.mark.parametrize("max_length, truncate", [(32, False), (19, False), (6, True)])
def test_pack_tokens_matches_a_per_row_reference(max_length, truncate):
    """Next-fit packing, in order, of every input form: ids, segment numbers, positions and mask as the reference."""
    seqs = _sequences(2)
    want = pack_reference(seqs, max_length, pad_value=3, truncate=truncate)
    assert len(want["input_ids"]) < len(seqs)
    for form, value in _forms(seqs).items():
        assert_batches_equal(raydl.pack_tokens(value, max_length, pad_value=3, truncate=truncate), want, form)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: raydl.pad_tokens([]), ValueError, "no sequence given"),
        (lambda: raydl.pad_tokens("abc"), TypeError, "got str"),
        (lambda: raydl.pad_tokens([[1], [0.5]]), TypeError, "token ids should be integers; sequence 1 holds float64"),
        (lambda: raydl.pad_tokens([[1], 2]), TypeError, "sequence 1 is not a 1-D sequence of token ids"),
        (lambda: raydl.pad_tokens(pa.array([[1], None, [2]])), ValueError, "sequence 1 is null"),
        (lambda: raydl.pad_tokens(pa.array([[1], [2, None]])), ValueError, r"null token id \(in sequence 1\)"),
        (lambda: raydl.pad_tokens(pa.array(["a"])), TypeError, "list array of token ids, got one of string"),
        (
            lambda: raydl.pad_tokens([[1, 2, 3]], max_length=2),
            ValueError,
            "sequence 0 has 3 tokens, more than max_length=2",
        ),
        (lambda: raydl.pad_tokens([[1]], max_length=0), ValueError, "max_length should be a positive int"),
        (lambda: raydl.pad_tokens([[1]], side="middle"), ValueError, "side should be 'right' or 'left'"),
        (lambda: raydl.pad_tokens([[70_000]], dtype=torch.int16), ValueError, "torch.int16 cannot hold"),
        (lambda: raydl.pad_tokens([[1]], dtype=torch.float32), ValueError, "integer torch dtype"),
        (lambda: raydl.pack_tokens([[1, 2, 3]], 2), ValueError, "pack_tokens: sequence 0 has 3 tokens"),
        (lambda: raydl.pack_tokens([[1]], None), ValueError, "max_length should be a positive int"),
    ],
)
def test_token_helpers_refuse_bad_input(call, error, match):
    """Bad input raises with the problem (and the sequence) named."""
    with pytest.raises(error, match=match):
        call()
