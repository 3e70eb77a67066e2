"""What reading a local lane's reply costs the trainer's core: over the socket against through the lane's shared
memory (NOTE [ raydl lane memory ] in raydl/worker/lane_memory.py), with raydl's own functions on both ends.

    python -m benchmarks.bench_lane_reply            # bench_arrow's batch: 18 columns, 1024 rows, 336 KB
    python -m benchmarks.bench_lane_reply --quick

A forked process writes N replies of two batches each (as a worker's call of two tasks) over a Unix socket pair, the
way a worker's lane thread does (`MemoryWriter.reply`: `send_reply`, or into the slots its call was given); this process reads
them as the driver does (`recv_reply` into its reused receive buffers, or over the slots) and makes the tensors
(`decode`). Reported: this thread's CPU per batch (`time.thread_time`), read and decode apart; the writer's CPU is
not counted (a worker's). The slots are taken as the driver takes them, and a reply's tensors are kept until four
replies later (a trainer's step, the reorder buffer), so slots and buffers are used again as in a real loop.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from multiprocessing.connection import Connection

import torch

from benchmarks.common.results import printed_report
from raydl.driver.transport.buffers import ReceiveBuffers
from raydl.driver.transport.lane_memory import memory_for
from raydl.worker.lane import MemoryWriter, recv_reply
from raydl.worker.lane_memory import recv_message
from raydl.worker.transfer import decode, encode


def _batch(rows: int) -> dict:
    d = {f"f{i}": torch.randn(rows) for i in range(16)}
    d["label"] = torch.randint(0, 10, (rows,))
    d["emb"] = torch.randn(rows, 64)
    return d


def run(way: str, replies: int, rows: int) -> tuple[float, float]:
    """(read, decode) CPU microseconds per batch of this thread, `way` "socket" or "memory"."""
    reply = ([encode(_batch(rows)), encode(_batch(rows))], [None, None])
    batch_bytes = sum(v.nbytes for v in _batch(rows).values())
    memory = memory_for(batch_bytes, 8) if way == "memory" else None
    a, b = socket.socketpair()
    writer, reader = Connection(a.detach()), Connection(b.detach())
    if memory is not None:
        memory.send(reader)  # the driver's end sends the memory; the fork below reads it on the other end
    pid = os.fork()
    if pid == 0:  # the worker's end
        try:
            reader.close()
            into = MemoryWriter()
            if memory is not None:
                body, fd = recv_message(writer)
                into.map(fd, memory.size)
            for _ in range(replies):
                into.reply(writer, reply, writer.recv())
        finally:
            os._exit(0)
    writer.close()
    buffers = ReceiveBuffers(2 * 8 + 4)
    kept: list = []
    t_read = t_decode = 0.0
    for _ in range(replies):
        taken = memory.take(2) if memory is not None else None
        regions, slots = taken if taken is not None else (None, None)
        reader.send(slots)
        reader.poll(None)
        t0 = time.thread_time()
        batches, _ = recv_reply(reader, alloc=buffers.take, regions=regions)
        regions = None
        t1 = time.thread_time()
        out = [decode(x) for x in batches]
        t2 = time.thread_time()
        del batches
        kept.append(out)
        del kept[:-4]
        t_read += t1 - t0
        t_decode += t2 - t1
    os.waitpid(pid, 0)
    reader.close()
    n = 2 * replies
    return t_read / n * 1e6, t_decode / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--replies", type=int, default=3000)
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    replies = 300 if args.quick else args.replies
    rows = {}
    for _ in range(args.rounds):
        for way in ("socket", "memory"):
            rows.setdefault(way, []).append(run(way, replies, args.rows))
    print(f"\nreplies of 2 batches, {args.rows} rows x 18 columns, {replies} replies, best of {args.rounds} rounds\n")
    print("| way | read, us a batch | tensors, us a batch | total |")
    print("|---|---|---|---|")
    for way, results in rows.items():
        read, dec = min(results, key=sum)
        print(f"| {way} | {read:.0f} | {dec:.0f} | {read + dec:.0f} |")


if __name__ == "__main__":
    with printed_report("bench_lane_reply", quick="--quick" in sys.argv):
        main()
