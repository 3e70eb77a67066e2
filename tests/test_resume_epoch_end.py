"""torchdata's end-of-epoch and just-after-iter() states, both ways (issue 25, point 3).

A job that builds its loader with a seeded `torch.Generator` and restarts from a state taken at the
end of an epoch re-seeds that generator for the new loader: the next epoch must be the saved run's,
as StatefulDataLoader's is, with random content drawn in the workers (tests/_resume_parity.py,
`check_epoch_end`). A state taken right after `iter()`, before any batch, has StatefulDataLoader's
layout (a snapshot for every worker: its dataset's or its stream's state as it started) and continues
identically loaded either way (`check_resume` with a state at 0 batches).
"""

from __future__ import annotations

import pytest
import torch

from tests import _datasets as D
from tests import _resume_datasets as RD
from tests._resume_parity import check_epoch_end, check_resume

pytestmark = pytest.mark.usefixtures("ray_session")

N = 8  # 4 batches of 2


@pytest.mark.parametrize(
    "make_dataset, shuffle",
    [
        (lambda: D.RandomAugmentDataset(N), False),
        (lambda: D.RandomAugmentDataset(N), True),
        (lambda: RD.StatefulIterable(N), False),
    ],
    ids=["map", "map-shuffle", "iterable-2-shards"],
)
def test_end_of_epoch_state_with_the_generator_reseeded_gives_the_saved_next_epoch(make_dataset, shuffle):
    """After the last batch and after StopIteration, raydl's and torchdata's states, loaded into either loader
    built with the same generator re-seeded, give the saver's next epoch (worker-drawn content included)."""
    check_epoch_end(make_dataset, lambda: {"batch_size": 2, **({"shuffle": True} if shuffle else {})})


def _seq() -> dict:
    return {"batch_size": 2, "generator": torch.Generator().manual_seed(7)}


@pytest.mark.parametrize(
    "make_dataset",
    [lambda: RD.StatefulIterable(N), lambda: RD.CountingDataset(N)],
    ids=["iterable-2-shards", "map-with-state"],
)
def test_state_right_after_iter_has_torchdata_layout_and_resumes_both_ways(make_dataset):
    """Right after iter(): every worker's snapshot is the one it started with (a stream's position, a dataset's
    state), as torchdata's; either loader continues either state exactly as its saver would have."""
    check_resume(make_dataset, _seq, num_workers=2, ks=(0,))


def test_state_right_after_iter_default_shuffle_both_ways():
    """shuffle=True and no generator, right after iter(): torchdata's layout (its own sampler draws another order,
    so the values differ), and each loader continues the other's state with the saver's order."""
    check_resume(
        lambda: D.RandomAugmentDataset(N),
        lambda: {"batch_size": 2, "shuffle": True},
        num_workers=2,
        ks=(0,),
        same_uninterrupted=False,
        td_resume_exact=True,
    )
