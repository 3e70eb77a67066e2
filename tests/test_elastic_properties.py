"""Property tests (hypothesis): random resizes and worker kills mid-epoch give a fixed pool's batches (NOTE [ raydl elastic pool ])."""

from __future__ import annotations

import functools
import os

import pytest

hypothesis = pytest.importorskip("hypothesis")
import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import raydl  # noqa: E402
from tests import _elastic_helpers as E  # noqa: E402
from tests._parity import assert_batches_equal  # noqa: E402

N, BATCH, SEED = 32, 2, 11
BATCHES = N // BATCH
TIMEOUT_S = 60

# (after batch k, action, argument): "resize" to n workers, or "kill" the j-th worker (active or retiring)
events = st.lists(
    st.tuples(
        st.integers(0, BATCHES - 3),
        st.sampled_from(["resize", "resize", "kill"]),
        st.integers(1, 4),
    ),
    min_size=1,
    max_size=4,
).filter(lambda evs: sum(e[1] == "kill" for e in evs) <= 2)


def _loader(seed_mode: str, in_order: bool) -> raydl.DataLoader:
    return raydl.DataLoader(
        E.SlowRandomDataset(N, delay_s=0.003),
        batch_size=BATCH,
        shuffle=True,
        generator=torch.Generator().manual_seed(SEED),
        num_workers=2,
        in_order=in_order,
        timeout=TIMEOUT_S,
        ray_seed=seed_mode,
    )


@functools.lru_cache(maxsize=None)
def _fixed_pool_batches(seed_mode: str) -> list:
    """The undisturbed run: a fixed pool of 2 workers."""
    return list(_loader(seed_mode, in_order=True))


def _disturbed_run(seed_mode: str, in_order: bool, evs: list) -> list:
    import ray

    loader = _loader(seed_mode, in_order)
    it = iter(loader)
    todo = sorted(evs, key=lambda e: e[0])
    out = []
    for k, batch in enumerate(it):
        out.append(batch)
        while todo and todo[0][0] == k:
            _, action, arg = todo.pop(0)
            if action == "resize":
                loader.set_num_workers(arg)
            else:
                alive = [w for w in [*it._sched.active, *sorted(it._elastic.retiring)] if w not in it._pool.released]
                ray.kill(it._pool.actors[alive[arg % len(alive)]], no_restart=True)
    return out


def _by_first_index(batches: list) -> list:
    return sorted(batches, key=lambda b: b["i"].tolist())


@pytest.mark.usefixtures("ray_session")
@pytest.mark.parametrize("seed_mode", ["batch", "worker"])
@settings(
    max_examples=4,
    deadline=None,
    derandomize=bool(os.environ.get("CI")),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.filter_too_much],
)
@given(evs=events, in_order=st.booleans())
def test_resizes_and_kills_give_the_fixed_pools_batches(seed_mode, evs, in_order):
    """Any resizes and kills: every batch once, in sampler order; "batch" seeding: identical content; "worker": same indices."""
    expected = _fixed_pool_batches(seed_mode)
    actual = _disturbed_run(seed_mode, in_order, evs)
    if not in_order:
        expected, actual = _by_first_index(expected), _by_first_index(actual)
    assert len(actual) == len(expected) == BATCHES
    if seed_mode == "batch":
        for k, (a, e) in enumerate(zip(actual, expected)):
            assert_batches_equal(a, e, f"batch {k}")
    else:
        assert [b["i"].tolist() for b in actual] == [b["i"].tolist() for b in expected]
