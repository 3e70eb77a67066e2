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
from raydl.data.unit_order import shard_aware_order, slotted_order
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


def test_defaults_one_node_is_the_window_shuffle_with_torch_parity(ray_session, corpus, tmp_path):
    """Issue 64: `shuffle=True` with defaults only (no generator) on one node: one slot a node settles one slot, so the
    epoch is the window shuffle (every batch mixes the whole window); ray_seed is "batch"; every sample once; with a
    generator the batches are torch's DataLoader's over the same sampler, num_workers=0's and torch's round robin's;
    stats say why no node slots were dealt."""
    ds = _ds(corpus, tmp_path)
    assert ds.shuffle_window == 4 and ds.node_slots is None
    plain = raydl.DataLoader(ds, batch_size=BATCH, shuffle=True, num_workers=2, timeout=60)
    assert plain.ray_seed == "batch"
    got = _ids(plain)
    assert sorted(i for b in got for i in b) == list(range(len(ds)))
    placement = plain.stats().cache["placement"]
    assert placement["mode"] == "round robin" and "one node slot" in placement["why"], placement
    plain.shutdown()

    want = _torch_reference(ds, 7, epochs=2)
    g = torch.Generator().manual_seed(7)
    seed = [torch.empty((), dtype=torch.int64).random_(generator=g).item() for _ in range(2)][
        1
    ]  # after torch's base seed
    assert [i for b in want[0] for i in b] == ds.shuffled_order(seed).tolist()  # the window shuffle itself
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
    assert _ids(rr) == want[0]
    assert "ray_seed='worker'" in rr.stats().cache["placement"]["why"]
    rr.shutdown()


def test_node_slots_given_keeps_its_order_and_deal(ray_session, corpus, tmp_path):
    """`node_slots=4` given: the order of 4 slots of a quarter of the window each, whatever the nodes (the behaviour
    before slots per node, exactly): torch's batches over the same sampler, dealt by node slot."""
    ds = _ds(corpus, tmp_path, node_slots=4)
    want = _torch_reference(ds, 7, epochs=2)
    starts = np.concatenate([[0], np.cumsum(ds._rows)])
    g = torch.Generator().manual_seed(7)
    seed = [torch.empty((), dtype=torch.int64).random_(generator=g).item() for _ in range(2)][1]
    assert [i for b in want[0] for i in b] == slotted_order(starts, ds._rows, 4, 4, BATCH, seed)[0].tolist()
    loader = raydl.DataLoader(
        ds, batch_size=BATCH, shuffle=True, num_workers=2, generator=torch.Generator().manual_seed(7), timeout=60
    )
    assert loader.ray_seed == "batch"
    assert [_ids(loader) for _ in range(2)] == want
    placement = loader.stats().cache["placement"]
    assert placement["mode"] == "node slots" and placement["node_slots"] == 4
    assert sum(placement["batches_by_node"].values()) == len(want[1])
    loader.shutdown()


def _units_per_batch(starts, order, batch) -> float:
    unit = np.searchsorted(starts, order, side="right") - 1
    return float(np.mean([len(set(unit[i : i + batch].tolist())) for i in range(0, len(order) - batch + 1, batch)]))


@pytest.mark.parametrize("nodes", [1, 2, 3, 4])
def test_one_slot_a_node_mixes_as_the_window_shuffle(nodes):
    """Issue 64: with slots per node each batch draws from a whole window of its node's (not the window shared out),
    so it mixes as many units as the window shuffle on one node (>= 0.9x), at any node count; 12 slots given mix
    fewer. 96 units of 50 rows, a window of 8, batches of 64."""
    rows = np.full(96, 50)
    starts = np.concatenate([[0], np.cumsum(rows)])
    window_shuffle = np.mean([_units_per_batch(starts, shard_aware_order(starts, rows, 8, s), 64) for s in range(4)])
    per_node = np.mean(
        [_units_per_batch(starts, slotted_order(starts, rows, 8, nodes, 64, s, slot_window=8)[0], 64) for s in range(4)]
    )
    twelve = np.mean([_units_per_batch(starts, slotted_order(starts, rows, 8, 12, 64, s)[0], 64) for s in range(4)])
    assert per_node >= 0.9 * window_shuffle, (per_node, window_shuffle)
    assert twelve < 0.5 * window_shuffle, (twelve, window_shuffle)


def test_a_model_trained_through_the_default_shuffle_learns_as_through_the_window_shuffle(tmp_path):
    """Issue 64 (a shuffle exists for the model): a corpus stored one class per file, a small model with batch norm
    (whose batch statistics see what a batch mixes) trained one epoch by SGD through the loader's order at its defaults
    scores as the window shuffle's on a uniform test set at one node (the same order), and within 0.02 of it at 4 nodes
    (their slots, each a whole window; the mean of 2 seeds); 7 slots given, a seventh of the window each (the default
    before slots per node cut the window so), score far lower. Measured: 0.48 / 0.49 / 0.17 (benchmarks/bench_mixing.py
    for the peers)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    classes, per_file, dim = 10, 400, 16
    gen = np.random.default_rng(0)
    means = gen.normal(0, 1.0, (classes, dim)).astype(np.float32)
    for c in range(classes):  # a file per class, 4 row groups each
        for half in range(2):
            x = means[c] + gen.normal(0, 1.6, (per_file // 2, dim)).astype(np.float32)
            table = pa.table({**{f"x{d}": x[:, d] for d in range(dim)}, "y": np.full(len(x), c)})
            pq.write_table(table, tmp_path / f"c{c}_{half}.parquet", row_group_size=per_file // 4)
    test_y = gen.integers(0, classes, 2000)
    test_x = torch.from_numpy(means[test_y] + gen.normal(0, 1.6, (2000, dim)).astype(np.float32))
    probe = raydl.ParquetDataset(str(tmp_path), cache_dir=str(tmp_path / "probe"))
    limit = int(probe.unit_nbytes.max() + 64) * 16  # a window of 7 of the 40 row groups

    def accuracy(node_slots=None, nodes=1, seed=1) -> float:
        ds = raydl.ParquetDataset(
            str(tmp_path), cache_dir=str(tmp_path / "c"), cache_limit=limit, node_slots=node_slots
        )
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(dim, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(), torch.nn.Linear(32, classes)
        )
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(seed)
        sampler = raydl.ParquetShuffleSampler(ds, g, 32, node_slots=None if node_slots else nodes)
        for batch in torch.utils.data.DataLoader(ds, batch_size=32, sampler=sampler):
            x = torch.stack([batch[f"x{d}"] for d in range(dim)], 1).float()
            loss = torch.nn.functional.cross_entropy(model(x), batch["y"])
            opt.zero_grad()
            loss.backward()
            opt.step()
        model.eval()
        return float((model(test_x).argmax(1).numpy() == test_y).mean())

    def mean(**kw) -> float:
        return float(np.mean([accuracy(seed=s, **kw) for s in (1, 2)]))

    window = mean(node_slots=1)
    assert mean() == window  # one node: the window shuffle's order, batch for batch
    assert mean(nodes=4) >= window - 0.02, (mean(nodes=4), window)
    assert mean(node_slots=7) < window - 0.15, (mean(node_slots=7), window)


def test_node_slots_one_is_the_window_shuffle_and_bad_values_are_refused(corpus, tmp_path):
    """node_slots=1 keeps the window shuffle (ray_seed stays torch's); a node_slots over the window is refused with
    the numbers to change, and so is a sampler given other slots than its dataset."""
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
    with pytest.raises(ValueError, match="node_slots=3, but the dataset was built with node_slots=1"):
        raydl.ParquetShuffleSampler(one, g, BATCH, node_slots=3)


def test_an_epoch_ends_with_whole_windows_the_short_one_first(corpus, tmp_path):
    """The windows' units: the short window (the units a window does not fill) comes first and the epoch ends with
    whole ones, in every slot; a state saved when the short window came last is refused (its seed now gives another
    order), for one process and for a DDP job."""
    starts, rows = np.arange(0, 50, 5), np.full(10, 5)
    unit = np.searchsorted(starts, shard_aware_order(starts, rows, 4, seed=3), side="right") - 1
    windows = [set(unit[:10].tolist()), set(unit[10:30].tolist()), set(unit[30:].tolist())]
    assert [len(w) for w in windows] == [2, 4, 4] and set().union(*windows) == set(range(10))
    order, slots = slotted_order(starts, rows, 3, 2, 5, seed=1, slot_window=3)  # 5 units a slot: windows of 2, 3
    for s in (0, 1):
        mine = np.concatenate([order[i * 5 : (i + 1) * 5] for i in np.flatnonzero(slots == s)])
        units = np.searchsorted(starts, mine, side="right") - 1
        assert len(set(units[:10].tolist())) == 2 and len(set(units[10:].tolist())) == 3

    ds = _ds(corpus, tmp_path)
    it = iter(raydl.ParquetShuffleSampler(ds, torch.Generator().manual_seed(0), BATCH))
    next(it)
    sd = it.state_dict()
    old = dict(sd, layout=sd["layout"].replace("/o2", ""))
    with pytest.raises(ValueError, match="put each slot's short window last"):
        iter(raydl.ParquetShuffleSampler(ds, torch.Generator().manual_seed(0), BATCH)).load_state_dict(old)
    dist = raydl.ParquetDistributedSampler(ds, num_replicas=2, rank=0, batch_size=BATCH)
    saved = dist.raydl_order_state()
    dist.raydl_load_order(saved)
    with pytest.raises(ValueError, match="put each slot's short window last"):
        dist.raydl_load_order({k: v for k, v in saved.items() if k != "order"})


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


def test_a_run_settled_at_three_nodes_resumes_its_slots_on_one(ray_session, corpus, tmp_path, monkeypatch):
    """Issue 64: the slot count a run settled (its first epoch's nodes; 3 here, as a loader over 3 nodes settles it) is
    in its state: a resume on one node deals those 3 slots to the node it has, and the rest of the epoch and the next
    are the 3-slot run's, exactly (torch's DataLoader over a sampler of 3 slots); a fresh run there settles 1."""
    from raydl.data.units import UnitDataset

    settle = UnitDataset.raydl_settle_slots
    ds = _ds(corpus, tmp_path)
    g = torch.Generator().manual_seed(4)
    ref = torch.utils.data.DataLoader(
        ds, batch_size=BATCH, sampler=raydl.ParquetShuffleSampler(ds, g, BATCH, node_slots=3), generator=g
    )
    want = [_ids(ref) for _ in range(2)]

    def loader():
        g = torch.Generator().manual_seed(4)
        return raydl.DataLoader(ds, batch_size=BATCH, shuffle=True, num_workers=2, generator=g, timeout=60)

    with monkeypatch.context() as m:  # the first run's workers on 3 nodes
        m.setattr(UnitDataset, "raydl_settle_slots", staticmethod(lambda it, nodes: settle(it, 3)))
        first = loader()
        it = iter(first)
        got = [next(it)["id"].tolist() for _ in range(7)]
        state = first.state_dict()
        assert first.stats().cache["placement"]["node_slots"] == 3
        first.shutdown()
    saved = state["_snapshot"]["_main_snapshot"]["_sampler_iter_state"]
    assert saved["sampler_iter_state"]["slots"] == 3, saved
    resumed = loader()
    resumed.load_state_dict(state)
    got += _ids(resumed)
    assert got == want[0] and _ids(resumed) == want[1]
    assert resumed.stats().cache["placement"]["node_slots"] == 3
    resumed.shutdown()
    fresh = loader()
    assert _ids(fresh) != want[0] and "one node slot" in fresh.stats().cache["placement"]["why"]
    fresh.shutdown()


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
    assert ds.node_slots is None
    want = _torch_reference(ds, 2)
    loader = raydl.DataLoader(
        ds, batch_size=BATCH, shuffle=True, num_workers=2, generator=torch.Generator().manual_seed(2), timeout=60
    )
    assert _ids(loader) == want[0]
    assert "one node slot" in loader.stats().cache["placement"]["why"]  # one node: the window shuffle
    loader.shutdown()


# ---------------------------------------------------------------------- DDP (NOTE [ raydl distributed slots ])


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(st.integers(1, 30), min_size=1, max_size=20),
    slots=st.integers(2, 5),
    batch=st.integers(1, 12),
    world=st.integers(1, 4),
    drop_last=st.booleans(),
    seed=st.integers(0, 2**40),
)
def test_the_job_s_order_is_dealt_by_batch_with_torch_s_counts(rows, slots, batch, world, drop_last, seed):
    """torch's DistributedSampler contract over the slotted order dealt by batch: equal counts per rank, every sample
    once over the ranks (padding repeats the order's head, `drop_last` cuts), each rank's head batches one job batch of
    one slot each, and after c samples a rank each the job has consumed the first W * c positions of its order."""
    from raydl.data.unit_order import _dealt_by_batch

    rows = np.array(rows)
    starts = np.concatenate([[0], np.cumsum(rows)])
    n = int(starts[-1])
    order, batch_slots = slotted_order(starts, rows, 4, slots, batch, seed, slot_window=4)
    total = (n // world) * world if drop_last else -(-n // world) * world
    shares = [_dealt_by_batch(order, batch_slots, batch, world, r, total) for r in range(world)]
    assert {len(m) for m, _ in shares} == {total // world}
    got = sorted(i for m, _ in shares for i in m)
    if drop_last:
        assert len(set(got)) == len(got) and set(got) <= set(range(n))
    else:
        assert set(got) == set(range(n)) and len(got) - n == total - n
    rounds = len(order) // batch // world
    for r, (mine, mine_slots) in enumerate(shares):
        assert len(mine_slots) == -(-len(mine) // batch)
        for k in range(rounds):
            assert (
                mine[k * batch : (k + 1) * batch]
                == order[(k * world + r) * batch : (k * world + r + 1) * batch].tolist()
            )
            assert mine_slots[k] == batch_slots[k * world + r]
    for c in range(0, rounds * batch + 1, batch):  # the consumed prefix, as NOTE [ raydl global epoch ] counts it
        assert sorted(i for m, _ in shares for i in m[:c]) == sorted(order[: world * c].tolist())


def _lockstep(loaders, first=None):
    """Batches of ranks stepping together, as DDP does (`first`: only that many steps)."""
    its = [iter(lo) for lo in loaders]
    out = [[] for _ in loaders]
    step = 0
    while first is None or step < first:
        done = 0
        for r, it in enumerate(its):
            b = next(it, None)
            if b is None:
                done += 1
            else:
                out[r].append(b["id"].tolist())
        if done == len(its):
            break
        step += 1
    return out


def test_ddp_ranks_batches_are_made_on_their_slots_nodes_and_resume_at_another_world_size(
    ray_session, corpus, tmp_path
):
    """Two ranks, each its own pool, over a job order of 3 slots (as three nodes settle it): each rank's batches are
    torch's DataLoader's over the same sampler, placed by node slot, every sample once over the ranks; a state taken
    after 3 steps resumes at world size 2 with the same batches, and at 1 and 3 with exactly the samples not consumed."""
    ds = _ds(corpus, tmp_path)

    def sampler(world, rank, batch_size=None):
        return raydl.ParquetDistributedSampler(
            ds, num_replicas=world, rank=rank, seed=3, node_slots=3, batch_size=batch_size
        )

    def loader(world, rank):
        return raydl.DataLoader(ds, batch_size=BATCH, sampler=sampler(world, rank), num_workers=2, timeout=60)

    want = [_ids(torch.utils.data.DataLoader(ds, batch_size=BATCH, sampler=sampler(2, r, BATCH))) for r in range(2)]
    assert want[0] != want[1] and sorted(i for w in want for b in w for i in b) == list(range(len(ds)))
    ranks = [loader(2, r) for r in range(2)]
    assert all(lo.ray_seed == "batch" and lo.sampler.batch_size == BATCH for lo in ranks)
    assert _lockstep(ranks) == want
    for lo in ranks:
        placement = lo.stats().cache["placement"]
        assert placement["mode"] == "node slots" and placement["node_slots"] == 3, placement
        lo.shutdown()

    ranks = [loader(2, r) for r in range(2)]
    head = _lockstep(ranks, first=3)
    states = [lo.state_dict() for lo in ranks]
    for lo in ranks:
        lo.shutdown()
    consumed = [i for h in head for b in h for i in b]
    for world in (2, 1, 3):
        again = [loader(world, r) for r in range(world)]
        for r, lo in enumerate(again):
            lo.load_state_dict(states[r % 2])
        rest = _lockstep(again)
        for lo in again:
            lo.shutdown()
        if world == 2:
            assert [h + r for h, r in zip(head, rest)] == want
        flat = [i for r in rest for b in r for i in b]
        assert sorted(set(consumed + flat)) == list(range(len(ds))) and not set(consumed) & set(flat), world
        assert len(flat) - len(set(flat)) < world, world  # padding, as torch pads, at most W - 1


def test_a_ray_job_s_ranks_batches_go_to_their_slots_nodes(ray_session, corpus, tmp_path, monkeypatch):
    """`ray_job` (one pool for the job's ranks) over a job order of 3 slots: each rank's batches are torch's over the
    same sampler, each placed on its slot's node among the job's workers, every sample once over the ranks."""
    ds = _ds(corpus, tmp_path)

    def sampler(rank, batch_size=None):
        return raydl.ParquetDistributedSampler(
            ds, num_replicas=2, rank=rank, seed=5, node_slots=3, batch_size=batch_size
        )

    want = [_ids(torch.utils.data.DataLoader(ds, batch_size=BATCH, sampler=sampler(r, BATCH))) for r in range(2)]
    loaders = []
    for rank in range(2):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        loaders.append(
            raydl.DataLoader(
                ds, batch_size=BATCH, sampler=sampler(rank), num_workers=1, ray_job="slots-job", timeout=60
            )
        )
    try:
        assert _lockstep(loaders) == want
        for lo in loaders:
            placement = lo.stats().cache["placement"]
            assert placement["mode"] == "node slots" and sum(placement["batches_by_node"].values()) == len(want[0])
    finally:
        for lo in loaders:
            lo.shutdown()


def _agree_main(rank: int, port: int, corpus: str, cache: str, nodes: list, out) -> None:
    """One of two gloo ranks (a spawned process, no Ray): settle the default slots from this rank's own node count."""
    from datetime import timedelta
    from types import SimpleNamespace

    import torch.distributed as dist

    from raydl.driver.node_slots import settle_slots

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=30))
    ds = raydl.ParquetDataset(corpus, cache_dir=cache, cache_limit="1MB")
    sampler = raydl.ParquetDistributedSampler(ds, batch_size=BATCH)
    it = SimpleNamespace(sampler=sampler)  # a batch iterator over the sampler's own epoch
    settle_slots(ds, it, nodes[rank])
    first = sampler.slots
    settle_slots(ds, it, nodes[rank] + 3 * rank)  # a later epoch, the pools moved: the run's count, no collective
    dist.barrier()  # the group still works: no rank was left inside a broadcast
    out.put((rank, first, sampler.slots))
    dist.destroy_process_group()


@pytest.mark.parametrize("nodes", [[2, 1], [1, 3]])
def test_ddp_ranks_agree_the_slots_whatever_each_rank_s_node_count(corpus, tmp_path, nodes):
    """Two real gloo ranks whose workers sit on different numbers of nodes at the first epoch (private pools): both
    take rank 0's count (a rank on one node used to skip the broadcast and leave rank 0 waiting in it), once."""
    import multiprocessing as mp
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_agree_main, args=(r, port, corpus, str(tmp_path / "cache"), nodes, out)) for r in range(2)
    ]
    for p in procs:
        p.start()
    try:
        got = sorted(out.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert got == [(0, nodes[0], nodes[0]), (1, nodes[0], nodes[0])]
    assert [p.exitcode for p in procs] == [0, 0]
