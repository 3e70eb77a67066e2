"""Property-based parity (hypothesis): random loader configurations agree with torch's DataLoader."""

from __future__ import annotations

import os

import pytest

hypothesis = pytest.importorskip("hypothesis")
import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import raydl  # noqa: E402
from tests import _datasets as D  # noqa: E402
from tests._parity import assert_same_batches  # noqa: E402


@st.composite
def configurations(draw):
    n = draw(st.integers(min_value=0, max_value=40))
    cfg = dict(
        num_workers=draw(st.integers(min_value=1, max_value=4)),
        prefetch_factor=draw(st.integers(min_value=1, max_value=4)),
        in_order=draw(st.booleans()),
    )
    sampling = draw(st.sampled_from(["sequential", "shuffle", "sampler", "batch_sampler", "no_batching"]))
    if sampling == "batch_sampler":
        flat = draw(st.permutations(range(n))) if n else []
        cuts = sorted(draw(st.lists(st.integers(0, n), max_size=6)))
        edges = [0, *cuts, n]
        cfg["batch_sampler"] = [list(flat[a:b]) for a, b in zip(edges, edges[1:]) if b > a]
    elif sampling == "no_batching":
        cfg["batch_size"] = None
        cfg["shuffle"] = draw(st.booleans())
    else:
        cfg["batch_size"] = draw(st.integers(min_value=1, max_value=9))
        cfg["drop_last"] = draw(st.booleans())
        if sampling == "shuffle":
            cfg["shuffle"] = True
        elif sampling == "sampler":
            cfg["sampler"] = draw(st.lists(st.integers(0, max(n - 1, 0)), max_size=30)) if n else []
    return n, cfg


@pytest.mark.usefixtures("ray_session")
@settings(
    max_examples=25,
    deadline=None,
    derandomize=bool(os.environ.get("CI")),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(configurations(), st.integers(min_value=0, max_value=2**31 - 1))
def test_random_configurations_match_torch(config, seed):
    """Any dataset size, batching, sampler, num_workers, prefetch_factor and in_order gives torch's batches."""
    n, cfg = config
    try:
        torch.utils.data.DataLoader(D.RangeDataset(n), **cfg)
    except ValueError as expected:  # e.g. shuffle over an empty dataset: raydl must refuse it alike
        with pytest.raises(ValueError) as actual:
            raydl.DataLoader(D.RangeDataset(n), **cfg)
        assert str(actual.value) == str(expected)
        return
    compare = "exact" if cfg["in_order"] else "multiset"
    assert_same_batches(lambda: D.RangeDataset(n), seed=seed, compare=compare, torch_workers=0, **cfg)
