"""Zero-copy batch transfer and threaded fetching: same batches as torch, tensors safe to use."""

from __future__ import annotations

import functools
import pickle
import warnings
from collections import namedtuple

import pytest
import torch

import raydl
from raydl.worker.transfer import _TensorView, decode, encode
from tests import _datasets as D
from tests._parity import assert_same_batches

Pair = namedtuple("Pair", ["a", "b"])


def test_encode_decode_round_trip_keeps_types_and_values():
    """Dense tensors (large and small) become views and come back equal, writable; others travel untouched."""
    big = torch.arange(50000, dtype=torch.float32).view(500, 100)
    batch = {
        "big": big,
        "small": torch.ones(3),
        "pair": Pair(torch.zeros(40000, dtype=torch.int64), "x"),
        "bf16": torch.ones(100000, dtype=torch.bfloat16),
        "strided": torch.ones(400, 400)[:, ::2],
        "list": [big, 7],
    }
    encoded = encode(batch)
    assert type(encoded["big"]) is _TensorView and type(encoded["pair"].a) is _TensorView
    assert type(encoded["small"]) is _TensorView, "small tensors avoid torch's slow storage pickling too"
    assert type(encoded["bf16"]) is torch.Tensor
    assert type(encoded["strided"]) is torch.Tensor, "non-contiguous tensors keep torch's strides via pickling"
    decoded = decode(pickle.loads(pickle.dumps(encoded)))
    assert type(decoded["pair"]) is Pair and decoded["list"][1] == 7
    for key in ("big", "small", "bf16", "strided"):
        assert torch.equal(decoded[key], batch[key]) and decoded[key].stride() == batch[key].stride()
    decoded["big"][0, 0] = -1.0  # writable, like torch's
    decoded["small"][0] = -1.0
    assert batch["big"][0, 0] == 0.0 and batch["small"][0] == 1.0
    received = pickle.loads(pickle.dumps(encoded))
    view, copied = decode(received)["big"], decode(received, copy=True)["big"]  # copy: the Ray Client path
    assert view.data_ptr() == received["big"].array.ctypes.data, "without pinning the tensor is the received memory"
    assert copied.data_ptr() != view.data_ptr() and torch.equal(copied, view)


@pytest.mark.parametrize("writable", [True, False])
def test_decode_makes_tensors_over_the_received_memory_without_a_warning(monkeypatch, writable):
    """Writable memory (a lane's buffers) goes straight to `torch.from_numpy`; read-only memory (Ray's object store)
    too, with torch's once-a-process warning kept from the user, however torch's warnings are set."""
    import warnings

    import raydl.worker.transfer as transfer

    monkeypatch.setattr(transfer, "_read_only_warned", False)
    received = pickle.loads(pickle.dumps(encode({"x": torch.arange(6.0), "y": torch.ones(2, 3, dtype=torch.int64)})))
    for view in received.values():
        view.array.flags.writeable = writable
    for _ in range(2):  # the first read-only array, then the next
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            decoded = decode(received)
        assert decoded["x"].data_ptr() == received["x"].array.ctypes.data
        assert torch.equal(decoded["x"], torch.arange(6.0)) and decoded["y"].shape == (2, 3)
    assert transfer._read_only_warned is (not writable)


@pytest.mark.usefixtures("ray_session")
def test_large_batches_match_torch_and_are_writable():
    """Image-sized batches (uint8, float16, bool, int64, bfloat16) equal torch's and can be written in place."""
    batches = assert_same_batches(functools.partial(D.ImageDataset, 12), batch_size=4, shuffle=True)
    for batch in batches[0]:
        batch["image"] += 1
        batch["half"].mul_(2)
        assert batch["image"].is_contiguous()


@pytest.mark.usefixtures("ray_session")
def test_kept_batches_outlive_their_loader_and_do_not_alias():
    """Batch tensors live over object-store memory: views kept after the loader is gone keep their values,
    writes stay private to each batch, and later batches never reuse the memory of a batch still held."""
    import gc
    import warnings

    import numpy as np

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "non-writable NumPy array" warning reaches the user
        loader = raydl.DataLoader(D.ImageDataset(16), batch_size=4, num_workers=2, timeout=60)
        kept = [b["image"][1:] for b in loader]  # views only: the batches themselves are dropped
    expected = [b["image"][1:].clone() for b in torch.utils.data.DataLoader(D.ImageDataset(16), batch_size=4)]
    loader.shutdown()
    del loader
    gc.collect()
    kept[0].fill_(7)  # writable, like torch's; .numpy() too
    kept[1].numpy()[...] = 9
    # Push fresh batches through the store: they must not land on memory the kept views still use.
    for _ in raydl.DataLoader(D.ImageDataset(64), batch_size=8, num_workers=2, timeout=60):
        pass
    gc.collect()
    assert torch.all(kept[0] == 7) and np.all(kept[1].numpy() == 9)
    for got, want in zip(kept[2:], expected[2:]):
        assert torch.equal(got, want)


@pytest.mark.usefixtures("ray_session")
def test_threads_per_worker_keeps_order_and_content():
    """ray_threads_per_worker fetches a batch's samples on several threads, in the batch's order."""
    kwargs = dict(batch_size=8, num_workers=1, timeout=60)
    plain = [b[:, 0].tolist() for b in raydl.DataLoader(D.SleepyDataset(32, 0.01), **kwargs)]
    batches = list(raydl.DataLoader(D.SleepyDataset(32, 0.01), ray_threads_per_worker=8, **kwargs))
    assert [b[:, 0].tolist() for b in batches] == plain == [list(range(i, i + 8)) for i in range(0, 32, 8)]
    assert max(len(set(b[:, 1].tolist())) for b in batches) > 1, "samples were not fetched on several threads"


def test_threads_per_worker_validation():
    """ray_threads_per_worker must be a positive int."""
    with pytest.raises(ValueError, match="ray_threads_per_worker"):
        raydl.DataLoader(D.RangeDataset(4), num_workers=1, ray_threads_per_worker=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int16, torch.bool, torch.float64])
@pytest.mark.parametrize("threads", [1, 3])
def test_large_copies_split_among_threads_keep_every_byte(monkeypatch, dtype, threads):
    """NOTE [ raydl pin copy ]: arrays over the split size are copied in page-aligned slices by several threads; every
    element lands where it belongs, for sizes that are no multiple of a page or of the thread count."""
    from raydl import _constants
    from raydl.worker import transfer

    monkeypatch.setattr(_constants, "PIN_COPY_THREADS", threads)
    monkeypatch.setattr(_constants, "PIN_COPY_SPLIT_BYTES", 1024)
    g = torch.Generator().manual_seed(1)
    for numel in (100, 4097, 3 * 4096 + 5, 1_000_003):
        src = (torch.rand(numel, generator=g) * 1000).to(dtype)
        batch = decode(encode({"x": src.reshape(1, numel)}), copy=True)
        assert torch.equal(batch["x"], src.reshape(1, numel)), (dtype, threads, numel)
        assert batch["x"].data_ptr() != src.data_ptr()
    if threads > 1:
        assert transfer._copy_pool is not None and transfer._copy_pool._max_workers == threads - 1


def _odd_tensors(i: int) -> dict:
    base = torch.complex(torch.arange(4.0) + i, torch.arange(4.0) * 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.nested's prototype warning
        nested = torch.nested.nested_tensor([torch.full((5,), float(i)), torch.arange(3.0)])
        jagged = torch.nested.nested_tensor([torch.full((2,), float(i)), torch.arange(3.0)], layout=torch.jagged)
    return {"nested": nested, "jagged": jagged, "conj": base.conj(), "neg": base.conj().imag}


def _first(samples: list) -> dict:
    return samples[0]


@pytest.mark.usefixtures("ray_session")
def test_tensors_numpy_cannot_read_travel_as_torch_pickles_them():
    """Nested tensors (torch.nested's default layout says it is strided and contiguous), jagged ones, lazy conjugate
    and negative views: numpy() refuses them, so a worker sends them pickled, as torch's workers do; each batch equals
    what the dataset made. torchdata's test_dataloader.py found the nested case (test_nested_tensor_multiprocessing)."""
    dataset = [_odd_tensors(i) for i in range(4)]
    encoded = encode(dataset[0])
    assert not any(isinstance(v, _TensorView) for v in encoded.values()), "a tensor numpy() cannot read became a view"
    with raydl.DataLoader(dataset, batch_size=1, collate_fn=_first, num_workers=2, timeout=60) as loader:
        got = list(loader)
    assert len(got) == 4
    for i, batch in enumerate(got):
        want = dataset[i]
        for key in ("nested", "jagged"):
            assert batch[key].is_nested and all(
                torch.equal(a, b) for a, b in zip(batch[key].unbind(), want[key].unbind())
            )
        assert batch["conj"].is_conj() and torch.equal(batch["conj"], want["conj"])
        assert torch.equal(batch["neg"], want["neg"])
