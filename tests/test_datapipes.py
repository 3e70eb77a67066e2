"""torch's DataPipes with workers (NOTE [ raydl datapipes ]): sharded over the workers and shuffled with one shared seed
per epoch, batch for batch as torch's DataLoader gives them.

torch's own test_dataloader.py (IntegrationTestDataLoaderDataPipe.test_shuffler_iterdatapipe) found what look-alike
tests had not: with workers, each raydl worker yielded the whole pipe (every sample twice at 2 workers), and a shuffle
was not seeded from the loader's generator.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.data.datapipes.iter import IterableWrapper

import raydl
from tests._parity import BATCH_TIMEOUT_S, assert_epochs_equal, run_epochs, torch_epochs

pytestmark = pytest.mark.usefixtures("ray_session")

N = 60


def _scaled(x: int) -> torch.Tensor:
    return torch.tensor([x, x * 10])


def _shuffled_pipe():
    return IterableWrapper(range(N)).shuffle(buffer_size=8).sharding_filter().map(_scaled)


def _sharded_pipe():
    return IterableWrapper(range(N)).sharding_filter()


def _both(make, epochs: int, generator_seed, **kwargs):
    """torch's epochs and raydl's from equal RNG states (the global one, and the loader's generator when given); each
    run's global RNG afterwards, for the draws the two made from it."""
    out = []
    for run in ("torch", "raydl"):
        torch.manual_seed(123)
        kw = dict(kwargs)
        if generator_seed is not None:
            kw["generator"] = torch.Generator().manual_seed(generator_seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's DataPipes are deprecated: its warning is not what is tested
            if run == "torch":
                epochs_out = torch_epochs(make(), epochs, multiprocessing_context="fork", **kw)
            else:
                with raydl.DataLoader(make(), timeout=BATCH_TIMEOUT_S, **kw) as loader:
                    epochs_out = run_epochs(loader, epochs)
        out.append((epochs_out, torch.rand(4)))
    return out


@pytest.mark.parametrize("persistent", [False, True], ids=["fresh-workers", "persistent"])
@pytest.mark.parametrize("generator_seed", [None, 7], ids=["no-generator", "generator"])
def test_shuffled_pipe_gives_torchs_batches(persistent, generator_seed):
    """shuffle=True over `.shuffle().sharding_filter()`, 2 workers, 3 epochs: every sample once an epoch, each batch
    torch's; the epochs differ; the global RNG moves as torch's moves."""
    (expected, rng_t), (actual, rng_r) = _both(
        _shuffled_pipe, 3, generator_seed, batch_size=4, shuffle=True, num_workers=2, persistent_workers=persistent
    )
    for epoch in actual:
        assert sorted(int(r[0]) for b in epoch for r in b) == list(range(N)), "a sample missing or repeated"
    assert [b.tolist() for b in actual[0]] != [b.tolist() for b in actual[1]], "two epochs in the same order"
    assert_epochs_equal(expected, actual)
    assert torch.equal(rng_t, rng_r), "raydl drew from the global RNG otherwise than torch"


def test_sharding_filter_deals_each_sample_to_one_worker():
    """No shuffle, 3 workers: `sharding_filter` keeps each worker's share, in torch's order of batches."""
    (expected, _), (actual, _) = _both(_sharded_pipe, 1, 0, batch_size=5, num_workers=3)
    assert sorted(int(x) for b in actual[0] for x in b) == list(range(N))
    assert_epochs_equal(expected, actual)
