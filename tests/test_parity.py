"""raydl yields exactly torch's batches: one harness, many configurations (tests/_parity.py)."""

from __future__ import annotations

import functools
import os
import time

import pytest
import torch

from tests import _datasets as D
from tests._parity import assert_same_batches

pytestmark = pytest.mark.usefixtures("ray_session")

N = 23  # not a multiple of any batch size used, so last-batch handling is exercised


# batch_size=None with drop_last=True is refused by torch (and raydl): tested in test_errors.
@pytest.mark.parametrize("batch_size, drop_last", [(None, False), (1, False), (1, True), (4, False), (4, True)])
@pytest.mark.parametrize("shuffle", [False, True])
def test_map_style_batching(batch_size, drop_last, shuffle):
    """Map-style: every batch_size / drop_last / shuffle combination matches torch, batch for batch."""
    assert_same_batches(lambda: D.RangeDataset(N), batch_size=batch_size, drop_last=drop_last, shuffle=shuffle)


@pytest.mark.parametrize("num_workers", [1, 3, 4])
def test_worker_counts(num_workers):
    """Round-robin over 1, 3 and 4 workers gives torch's order."""
    assert_same_batches(lambda: D.RangeDataset(N), batch_size=3, shuffle=True, num_workers=num_workers)


def test_sampler_and_batch_sampler_as_plain_lists():
    """A plain list works as sampler and as batch_sampler, as in torch."""
    order = [5, 3, 9, 0, 1, 22, 7]
    assert_same_batches(lambda: D.RangeDataset(N), sampler=order, batch_size=2)
    batches = [[1, 2], [9], [4, 8, 15], [0]]
    assert_same_batches(lambda: D.RangeDataset(N), batch_sampler=batches)


@pytest.mark.parametrize(
    "make",
    [
        functools.partial(D.DictDataset, N),
        functools.partial(D.NamedTupleDataset, N),
        functools.partial(D.StrDataset, N),
        functools.partial(D.GetItemsDataset, N),
    ],
    ids=["dict", "namedtuple", "str", "getitems"],
)
def test_sample_types(make):
    """dict, namedtuple (numpy inside), str samples and __getitems__ datasets collate as torch's."""
    assert_same_batches(make, batch_size=4, shuffle=True)
    assert_same_batches(make, batch_size=None)


def test_custom_and_lambda_collate_fn():
    """A module-level collate_fn and a lambda (shipped by value) both give torch's batches."""
    assert_same_batches(lambda: D.RangeDataset(N), batch_size=5, collate_fn=D.sum_collate)
    assert_same_batches(lambda: D.RangeDataset(N), batch_size=5, collate_fn=lambda b: [int(x) * 2 for x in b])


@pytest.mark.parametrize("prefetch_factor", [1, 3])
def test_prefetch_factor(prefetch_factor):
    """Any prefetch_factor yields the same batches."""
    assert_same_batches(lambda: D.RangeDataset(N), batch_size=2, shuffle=True, prefetch_factor=prefetch_factor)


def test_in_order_false_is_a_multiset_of_torch_batches():
    """in_order=False: a slow batch is overtaken, and the batches are torch's as a multiset."""
    make = functools.partial(D.SlowDataset, 16, {0: 0.5, 1: 0.5})
    batches = assert_same_batches(make, batch_size=2, in_order=False, compare="multiset")
    assert batches[0][0].tolist() != [[0], [1]], "the slow first batch should have been overtaken"


def test_worker_side_randomness_matches_torch():
    """torch, numpy and random draws inside workers are torch's: same seeds, same batch-to-worker mapping."""
    assert_same_batches(lambda: D.RandomAugmentDataset(12), batch_size=2, shuffle=True, num_workers=3)


def test_persistent_workers_over_epochs():
    """Persistent workers keep their RNG streams across 3 epochs, as torch's do."""
    assert_same_batches(
        lambda: D.RandomAugmentDataset(10), batch_size=3, shuffle=True, persistent_workers=True, epochs=3
    )


def test_non_persistent_epochs_reseed():
    """Without persistent workers, each epoch draws a new base seed, as torch does."""
    assert_same_batches(lambda: D.RandomAugmentDataset(8), batch_size=2, epochs=2)


def test_worker_init_fn_runs_in_each_worker():
    """worker_init_fn(worker_id) runs in each worker and can change that worker's dataset copy."""
    batches = assert_same_batches(lambda: D.InitSensitiveDataset(8), batch_size=2, worker_init_fn=D.set_offset_init_fn)
    assert batches[0][0].tolist() == [[1000], [1001]]
    assert batches[0][1].tolist() == [[2002], [2003]]


@pytest.mark.parametrize("batch_size", [None, 1, 3])
def test_iterable_sharded_with_worker_info(batch_size):
    """IterableDataset sharded by get_worker_info(): batches interleave across workers as in torch."""
    assert_same_batches(lambda: D.ShardedIterable(0, 24), batch_size=batch_size)


@pytest.mark.parametrize("drop_last", [False, True])
def test_iterable_uneven_workers(drop_last):
    """Workers that run dry at different times: the same batches as torch, drop_last per worker."""
    assert_same_batches(
        lambda: D.UnevenIterable([7, 2, 5]), batch_size=2, drop_last=drop_last, num_workers=3, compare="multiset"
    )


def test_iterable_unsharded_duplicates_like_torch():
    """An IterableDataset that ignores worker info is replicated per worker, as torch documents."""
    assert_same_batches(lambda: D.UnshardedIterable(6), batch_size=4)


def test_num_workers_zero_is_torch():
    """num_workers=0 loads in the calling process exactly as torch does."""
    assert_same_batches(lambda: D.RandomAugmentDataset(9), batch_size=2, shuffle=True, num_workers=0)


class _StuckOnce(torch.utils.data.Dataset):
    """Its first sample, the first time any process asks (a marker file says), never comes back in time: as a forked
    worker stuck on a lock held at the fork."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> torch.Tensor:
        if not os.path.exists(self.marker):
            open(self.marker, "w").close()
            time.sleep(60)
        return torch.tensor([i])


def test_a_torch_reference_that_times_out_is_made_again_from_the_same_rng(tmp_path):
    """tests/_parity.torch_epochs: torch's reference loader stuck once (a worker that never answers) times out and is
    made again with the global RNG and the loader's generator as they were: the same batches as a loader that never
    stuck, shuffle=True with and without a generator."""
    from tests._parity import assert_epochs_equal, torch_epochs

    never = tmp_path / "never-stuck"
    never.touch()
    for seed in (None, 5):
        kwargs = dict(batch_size=4, shuffle=True, num_workers=2, timeout=2)
        make = lambda: dict(kwargs, generator=torch.Generator().manual_seed(seed)) if seed else kwargs  # noqa: E731
        torch.manual_seed(3)
        want = torch_epochs(_StuckOnce(str(never)), 2, **make())
        torch.manual_seed(3)
        marker = tmp_path / f"stuck-{seed}"
        got = torch_epochs(_StuckOnce(str(marker)), 2, **make())
        assert marker.exists()
        assert_epochs_equal(want, got)
