"""The node-slot plan at 16, 64 and 256 nodes, simulated without Ray: storage bytes, bytes between nodes, the nodes'
shares of the work, what one node's loss re-plans (issue 58 item 3, NOTE [ raydl node slots ]), and how much a batch
and 8 consecutive batches mix (units drawn from), against one node's window shuffle (issue 64). 1 slot a node is the
default (each slot a whole window: half a node's cache); 4 slots a node is `node_slots=4 x nodes` given.

A corpus of `--tb` TB in units of `--unit-gb` GB (`--rows` samples each, batches of `--batch`); each node's cache holds
a quarter of its share of the units. The planner is raydl's own: the dataset's order over `slots` node slots
(`slotted_order`, data/unit_order.py) with each slot's window half a node's cache over its slots, the driver's
deal of slots to nodes (`SlotDeal`, driver/node_slots.py, one worker a node), and the caches' owner rule (`plan_owners`,
cluster/cache/driver_feed.py). Each node's cache is simulated as NodeCache evicts (Belady: the unit used farthest
ahead goes first) over the batches its node makes; a unit used by several nodes is fetched by its owner and sent
once to each other user. The loss: the node making batch 0 is lost at half the epoch, its slots dealt to the others;
the units it had fetched and its successors still need are read again from storage.

    .venv/bin/python -m benchmarks.sim_node_slots                      # 10 TB of 1 GB units, 16/64/256 nodes
    .venv/bin/python -m benchmarks.sim_node_slots --nodes 16 --tb 1    # quicker
"""

from __future__ import annotations

import argparse
import heapq
import os
import sys

import numpy as np

from benchmarks.common.results import md_table, printed_report


def _belady_fetches(accesses: list, capacity: int) -> int:
    """Fetches of a cache of `capacity` units serving `accesses` (one list of units per batch, in order), evicting the
    unit used farthest ahead."""
    flat = [(t, u) for t, us in enumerate(accesses) for u in us]
    nxt = [0] * len(flat)
    seen: dict = {}
    for i in range(len(flat) - 1, -1, -1):
        u = flat[i][1]
        nxt[i] = seen.get(u, 1 << 60)
        seen[u] = i
    held: dict = {}  # unit -> its next use
    heap: list = []  # (-next use, unit), stale entries skipped
    fetches = 0
    for i, (_t, u) in enumerate(flat):
        if u not in held:
            fetches += 1
            while len(held) >= capacity:
                d, v = heapq.heappop(heap)
                if held.get(v) == -d:
                    del held[v]
        held[u] = nxt[i]
        heapq.heappush(heap, (-nxt[i], u))
    return fetches


def simulate(units: int, rows: int, batch: int, nodes: int, slots_per_node: int, seed: int = 7) -> dict:
    from raydl.cluster.cache.driver_feed import plan_owners
    from raydl.data.unit_order import shard_aware_order, slotted_order
    from raydl.driver.node_slots import SlotDeal

    cache = max(2, units // nodes // 4)  # units a node's cache holds: a quarter of its share
    slots = nodes * slots_per_node
    window = slots * max(1, cache // 2 // slots_per_node)  # each slot's window: half the cache over its slots
    starts = np.arange(units + 1, dtype=np.int64) * rows
    order, batch_slots = slotted_order(starts, np.full(units, rows), window, slots, batch, seed)
    unit_of = order // rows
    n_batches = len(batch_slots)
    steps = [np.unique(unit_of[i * batch : (i + 1) * batch]) for i in range(n_batches)]
    half = n_batches // 2
    # the mixing: units a batch draws from, and 8 consecutive batches, against one node's window shuffle (its whole
    # cache's window of half of it), on the same units
    alone = shard_aware_order(starts, np.full(units, rows), max(1, cache // 2), seed) // rows
    mixing = {
        "units_per_batch": _per_batch(unit_of, batch, 1),
        "units_per_8_batches": _per_batch(unit_of, batch, 8),
        "window_shuffle_units_per_batch": _per_batch(alone, batch, 1),
    }

    def plan(workers: list, lost_at: int = -1) -> tuple:
        deal = SlotDeal(batch_slots, lambda w: w)
        before = deal.nodes(0, n_batches, list(range(nodes)))
        after = deal.nodes(0, n_batches, workers) if lost_at >= 0 else before
        return np.array([b if p < max(lost_at, 0) or lost_at < 0 else a for p, (b, a) in enumerate(zip(before, after))])

    def figures(where: np.ndarray) -> dict:
        lens = np.array([len(s) for s in steps])
        flat_units = np.concatenate(steps)
        pos = np.repeat(np.arange(n_batches), lens)
        node = np.repeat(where, lens)
        owners = plan_owners(flat_units, pos, node, nodes, np.ones(units, np.int64))
        users = np.zeros(units, np.int64)
        pairs = np.unique(flat_units * nodes + node)
        np.add.at(users, pairs // nodes, 1)
        storage = 0
        for n in range(nodes):  # each node fetches, of its own batches' units, those it owns
            mine = [[u for u in s.tolist() if owners[u] == n] for s, w in zip(steps, where) if w == n]
            storage += _belady_fetches(mine, cache)
        shares = np.bincount(where, minlength=nodes) / n_batches * nodes
        return {"storage": storage / units, "between": int((users - 1).clip(0).sum()) / units, "shares": shares}

    whole = figures(plan(list(range(nodes))))
    lost = plan(list(range(1, nodes)), lost_at=half)
    after = np.bincount(lost[half:], minlength=nodes)[1:] / (n_batches - half) * (nodes - 1)
    gone_before = {u for s, w in zip(steps[:half], lost[:half]) if w == 0 for u in s.tolist()}
    needed_after = {u for s in steps[half:] for u in s.tolist()}
    return {
        "nodes": nodes,
        "slots": slots,
        "cache_units": cache,
        "window_per_slot": window // slots,
        "storage": whole["storage"],
        "between": whole["between"],
        "max_share": float(whole["shares"].max()),
        "min_share": float(whole["shares"].min()),
        "loss_max_share": float(after.max()),
        "loss_reread": len(gone_before & needed_after) / units,
        **mixing,
    }


def _per_batch(unit_of: np.ndarray, batch: int, span: int) -> float:
    """Distinct units in each run of `span` consecutive batches, the mean (the first 2,000 runs: enough for a mean)."""
    step = batch * span
    runs = range(0, min(len(unit_of) - step + 1, 2000 * step), step)
    return float(np.mean([len(np.unique(unit_of[i : i + step])) for i in runs]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tb", type=float, default=10.0)
    ap.add_argument("--unit-gb", type=float, default=1.0)
    ap.add_argument("--rows", type=int, default=1000, help="samples per unit")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--nodes", default="16,64,256")
    ap.add_argument("--slots-per-node", default="1,4")
    ap.add_argument("--png", default=os.path.join("benchmarks", "figures", "sim_node_slots.png"))
    args = ap.parse_args()
    units = int(args.tb * 1000 / args.unit_gb)
    rows = []
    results = []
    for n in [int(x) for x in args.nodes.split(",")]:
        for k in [int(x) for x in args.slots_per_node.split(",")]:
            r = simulate(units, args.rows, args.batch, n, k)
            results.append(r)
            print(r, file=sys.stderr, flush=True)
            rows.append(
                [
                    n,
                    r["slots"],
                    r["cache_units"],
                    r["window_per_slot"],
                    f"{r['storage']:.3f}x",
                    f"{r['between']:.3f}x",
                    f"{r['max_share']:.2f} / {r['min_share']:.2f}",
                    f"{r['loss_max_share']:.2f}",
                    f"{r['loss_reread']:.4f}x",
                    f"{r['units_per_batch']:.1f} ({r['units_per_batch'] / r['window_shuffle_units_per_batch']:.2f}x)",
                    f"{r['units_per_8_batches']:.1f}",
                ]
            )
    print(
        f"\n{args.tb:g} TB in {units} units of {args.unit_gb:g} GB, {args.rows} samples each, batch {args.batch}; "
        "each node's cache a quarter of its share\n"
    )
    header = ["nodes", "node slots", "cache (units)", "window per slot", "storage / data", "between nodes / data"]
    header += ["largest / smallest share (1 = even)", "largest share after one loss", "re-read after the loss"]
    header += ["units per batch (/ one node's window shuffle)", "units per 8 batches"]
    print(md_table(header, rows))
    _png(results, args.png)


def _png(results: list, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the figure is optional: the table says it all
        return
    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels = [f"{r['nodes']} nodes\n{r['slots']} slots" for r in results]
    x = np.arange(len(results))
    ax.bar(x - 0.2, [r["storage"] for r in results], 0.4, label="storage / data")
    ax.bar(x + 0.2, [r["between"] for r in results], 0.4, label="between nodes / data")
    ax.axhline(1.15, color="grey", ls=":", lw=1)
    ax.axhline(0.15, color="grey", ls="--", lw=1)
    ax.set_xticks(x, labels, fontsize=8)
    ax.set_ylabel("bytes per epoch / data")
    ax.set_title("node slots, simulated (benchmarks/sim_node_slots.py)")
    ax.legend(fontsize=8)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"\nfigure: {path}")


if __name__ == "__main__":
    with printed_report("sim_node_slots"):
        main()
