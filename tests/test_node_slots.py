"""Issue 58 (NOTE [ raydl node slots ]): `shuffle=True` over a streamed dataset cuts its order over node slots, and
the loader makes each slot's batches on one node. The order's properties, the loader's defaults, parity with torch's
DataLoader over the same sampler, the path `loader.stats()` reports, and exact resume. The bytes across nodes are
measured through plain caches in tests/test_parquet.py and on the namespace cluster in tests/test_netns.py."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import raydl
from raydl.data.parquet_shuffle import shard_aware_order, slotted_order
from raydl.driver.node_slots import SlotDeal

BATCH = 16


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """12 Parquet row groups of 40 rows (ids 0..479) and a cache of 8 of them: a window of 4, 4 slots."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("slots")
    for f in range(3):
        ids = np.arange(f * 160, (f + 1) * 160)
        pq.write_table(pa.table({"id": ids, "pad": [b"x" * 200] * len(ids)}), root / f"p{f}.parquet", row_group_size=40)
    return str(root)


@pytest.fixture(autouse=True)
def _end_node_caches():
    yield
    from tests._session import end_node_caches

    end_node_caches()


def _ds(corpus, tmp_path, **kw):
    whole = raydl.ParquetDataset(corpus, cache_dir=str(tmp_path / "probe"))
    kw.setdefault("cache_limit", int(whole.unit_nbytes.max() + 64) * 8)
    return raydl.ParquetDataset(corpus, cache_dir=str(tmp_path / "cache"), **kw)


def _ids(batches) -> list:
    return [b["id"].tolist() for b in batches]


def _torch_reference(ds, seed: int, epochs: int = 1) -> list:
    """torch's DataLoader over the dataset's own sampler cut for BATCH, drawing from one generator as the loader."""
    g = torch.Generator().manual_seed(seed)
    ref = torch.utils.data.DataLoader(
        ds, batch_size=BATCH, sampler=raydl.ParquetShuffleSampler(ds, g, BATCH), generator=g
    )
    return [_ids(ref) for _ in range(epochs)]


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(st.integers(1, 30), min_size=1, max_size=24),
    window=st.integers(1, 8),
    slots=st.integers(1, 8),
    batch=st.integers(1, 20),
    seed=st.integers(0, 2**40),
)
def test_order_is_a_permutation_cut_into_one_slot_batches(rows, window, slots, batch, seed):
    """Every sample once; each batch before the last ones takes its rows from the units of its slot only; the slots
    take turns; each slot's leftover (under a batch) is one unit's rows when a unit of its last rows has enough; one
    slot is the window shuffle itself."""
    rows = np.array(rows)
    starts = np.concatenate([[0], np.cumsum(rows)])
    order, batch_slots = slotted_order(starts, rows, window, slots, batch, seed)
    assert sorted(order.tolist()) == list(range(int(starts[-1])))
    assert len(batch_slots) == -(-len(order) // batch)
    eff = max(1, min(slots, len(rows)))
    if eff == 1:
        assert order.tolist() == shard_aware_order(starts, rows, window, seed).tolist()
        return
    perm = np.random.default_rng(seed).permutation(len(rows))
    slot_of_unit = np.empty(len(rows), np.int64)
    for s in range(eff):
        slot_of_unit[perm[s::eff]] = s
    unit = np.searchsorted(starts, order, side="right") - 1
    full = [int(rows[perm[s::eff]].sum()) // batch for s in range(eff)]
    head = sum(full)
    for b in range(head):  # the turns: each batch of one slot's units, the slot the plan says
        assert set(slot_of_unit[unit[b * batch : (b + 1) * batch]].tolist()) == {int(batch_slots[b])}
    turns = [s for r in range(max(full)) for s in range(eff) if r < full[s]]
    assert batch_slots[:head].tolist() == turns
    tail_units = unit[head * batch :]
    tail_slots = slot_of_unit[tail_units]
    assert tail_slots.tolist() == sorted(tail_slots.tolist())  # slot after slot
    for s in set(tail_slots.tolist()):
        left = tail_units[tail_slots == s]
        assert len(left) == int(rows[perm[s::eff]].sum()) % batch
        if window // eff == 1 and rows.min() >= batch:  # a unit of its last rows has enough: the leftover is its
            assert len(set(left.tolist())) == 1, (s, left)


def test_slot_deal_follows_workers_and_nodes():
    """Slots go to nodes in proportion to their workers, in node order; when the nodes change, a slot stays on its
    node while it is there, a lost node's slots go to the least loaded, a new node takes a fair share."""
    where = {0: "b", 1: "a", 2: "a", 3: "c"}
    deal = SlotDeal(np.array([0, 1, 2, 3, 4, 5] * 2), where.get)
    assert deal.deal([0, 1, 2, 3]) == ["a", "a", "a", "b", "c", "c"]  # 6 slots, workers a, a, b, c
    assert deal.nodes(0, 3, [0, 1, 2, 3]) == ["a", "a", "a"]
    # a's workers gone: b and c keep their slots, a's go to the fewest slots per worker, ties to the first node
    assert deal.deal([0, 3]) == ["b", "b", "c", "b", "c", "c"]
    where[4] = "d"  # a node joins: it takes slots from the most loaded while that evens them out
    assert deal.deal([0, 3, 4]) == ["b", "b", "c", "d", "c", "d"]
    assert deal.node_at(99, [0]) is None
    where[0] = None  # a worker whose node is not known yet
    assert deal.deal([0]) == [None] * 6


def test_more_nodes_than_slots_is_said_once_with_the_fix(caplog):
    """Nodes beyond the slots make no batch: a warning names how many and the node_slots to give; said once."""
    import raydl.driver.node_slots as node_slots

    node_slots._WARNED.clear()
    where = {0: "a", 1: "b", 2: "c"}
    with caplog.at_level("WARNING", logger="raydl.driver.node_slots"):
        deal = SlotDeal(np.array([0, 1] * 4), where.get)
        assert deal.deal([0, 1, 2]) == ["a", "c"]  # the worker at (s + 1/2) x 3 / 2: a and c
        SlotDeal(np.array([0, 1] * 4), where.get).deal([0, 1, 2])
    said = [r.getMessage() for r in caplog.records if "make no batch" in r.getMessage()]
    assert len(said) == 1 and "1 of the 3 nodes" in said[0] and "node_slots=3" in said[0], said
    assert deal.figures()["nodes_without_slots"] == 1


def test_defaults_batch_seeding_torch_parity_and_placement_reported(ray_session, corpus, tmp_path):
    """`shuffle=True` with defaults only (no generator): ray_seed is "batch", the epoch's batches come from the
    dataset's order over its slots, every sample once; with a generator they are torch's DataLoader's over the same
    sampler, and num_workers=0's; stats say the node slots were used, or why torch's round robin was."""
    ds = _ds(corpus, tmp_path)
    assert ds.shuffle_window == 4 and ds.node_slots == 4
    plain = raydl.DataLoader(ds, batch_size=BATCH, shuffle=True, num_workers=2, timeout=60)
    assert plain.ray_seed == "batch"
    got = _ids(plain)
    assert sorted(i for b in got for i in b) == list(range(len(ds)))
    placement = plain.stats().cache["placement"]
    assert placement["mode"] == "node slots" and placement["node_slots"] == 4
    assert sum(placement["batches_by_node"].values()) == len(got)
    plain.shutdown()

    want = _torch_reference(ds, 7, epochs=2)
    loader = raydl.DataLoader(
        ds, batch_size=BATCH, shuffle=True, num_workers=2, generator=torch.Generator().manual_seed(7), timeout=60
    )
    assert [_ids(loader) for _ in range(2)] == want
    loader.shutdown()
    zero = raydl.DataLoader(ds, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(7))
    assert _ids(zero) == want[0]

    rr = raydl.DataLoader(
        ds, batch_size=BATCH, shuffle=True, num_workers=2, generator=torch.Generator().manual_seed(7), ray_seed="worker"
    )
    assert _ids(rr) == want[0]  # the same order, by torch's round robin
    assert "ray_seed='worker'" in rr.stats().cache["placement"]["why"]
    rr.shutdown()


def test_node_slots_one_is_the_window_shuffle_and_bad_values_are_refused(corpus, tmp_path):
    """node_slots=1 keeps the window shuffle (ray_seed stays torch's); a node_slots over the window is refused with
    the numbers to change."""
    one = _ds(corpus, tmp_path, node_slots=1)
    assert raydl.DataLoader(one, batch_size=BATCH, shuffle=True, num_workers=2).ray_seed == "worker"
    g = torch.Generator().manual_seed(3)
    order = list(raydl.ParquetShuffleSampler(one, g, BATCH))
    seed = torch.empty((), dtype=torch.int64).random_(generator=torch.Generator().manual_seed(3)).item()
    assert order == one.shuffled_order(seed).tolist()
    with pytest.raises(ValueError, match=r"node_slots=5 is more than shuffle_window=4.*Lower node_slots to 4"):
        _ds(corpus, tmp_path, node_slots=5)
    with pytest.raises(ValueError, match="node_slots should be a positive int"):
        _ds(corpus, tmp_path, node_slots=0)


@pytest.mark.parametrize("workers", [0, 2])
def test_exact_resume_mid_epoch_and_a_state_of_other_slots_refused(ray_session, corpus, tmp_path, workers):
    """state_dict() after 5 batches, loaded into a new loader (another generator): the rest of the epoch and the next
    are the uninterrupted run's (the sampler's generator goes on from the saved epoch's draw); a dataset with other
    node slots refuses the state."""
    ds = _ds(corpus, tmp_path)

    def loader(seed, dataset=ds):
        g = torch.Generator().manual_seed(seed)
        return raydl.DataLoader(dataset, batch_size=BATCH, shuffle=True, num_workers=workers, generator=g, timeout=60)

    whole = loader(5)
    want = [_ids(whole) for _ in range(2)]
    first = loader(5)
    it = iter(first)
    got = [next(it)["id"].tolist() for _ in range(5)]
    state = first.state_dict()
    first.shutdown()
    resumed = loader(99)
    resumed.load_state_dict(state)
    got += _ids(resumed)
    assert got == want[0] and _ids(resumed) == want[1]
    resumed.shutdown()
    fewer = loader(99, dataset=_ds(corpus, tmp_path, node_slots=2))
    with pytest.raises(ValueError, match="node_slots changed"):
        fewer.load_state_dict(state)
        next(iter(fewer))


def test_tar_shards_take_the_same_path(ray_session, tmp_path):
    """A TarDataset's shuffle=True is cut over node slots too: torch's batches over its sampler, placement reported."""
    import io
    import tarfile

    for f in range(2):
        with tarfile.open(tmp_path / f"s{f}.tar", "w") as tar:
            for i in range(f * 60, (f + 1) * 60):
                for ext, data in (("id", str(i).encode()), ("bin", os.urandom(300))):
                    info = tarfile.TarInfo(f"{i:05d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    ds = raydl.TarDataset(
        str(tmp_path / "s{0..1}.tar"),
        cache_dir=str(tmp_path / "cache"),
        cache_limit=128 * 1024,  # units of 8 KiB (a sixteenth), a window of 8
        transform=lambda s: {"id": int(s["id"])},
    )
    assert ds.node_slots > 1
    want = _torch_reference(ds, 2)
    loader = raydl.DataLoader(
        ds, batch_size=BATCH, shuffle=True, num_workers=2, generator=torch.Generator().manual_seed(2), timeout=60
    )
    assert _ids(loader) == want[0]
    assert loader.stats().cache["placement"]["mode"] == "node slots"
    loader.shutdown()
