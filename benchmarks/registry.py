"""The benchmarks `python -m benchmarks NAME` runs: one entry a comparison, what it needs and how long it takes.

NOTE [ bench registry ]: a name here is the one command a reader needs to rerun a table of benchmarks/README.md.
The scripts stay runnable alone (`python -m benchmarks.bench_x`, with every option of its own); the runner adds what
they should not each carry: the record of a run (benchmarks/common/records.py) and the README's tables made from
the latest records. A benchmark whose figure is recorded in docs/benchmark-notes.md and no longer rerun leaves this
list and the folder (docs/benchmark-notes.md#retired-benchmarks names the commit that still has it).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Bench:
    script: str  # benchmarks/<script>.py, run as `python -m benchmarks.<script>`
    what: str  # one line: what is compared
    args: tuple[str, ...] = ()  # always passed (a second comparison of one script is a second name)
    quick: tuple[str, ...] = ()  # the arguments of a smoke run (`--quick`)
    needs: str = ""  # what the machine must have beyond the README's set-up
    minutes: float = 5  # a full run on this project's 2-core VM, quiet
    tables: tuple[int, ...] = ()  # which of its report's tables the README shows (all when empty)
    timeout: float = 0  # seconds; 0: four times `minutes`, at least 10 minutes

    @property
    def module(self) -> str:
        return self.script if "." in self.script else f"benchmarks.{self.script}"

    @property
    def timeout_s(self) -> float:
        """The runner stops a run this far past its usual time (a hang must end, not hold the machine)."""
        return self.timeout or max(600.0, self.minutes * 60 * 4)


_PEER_VENVS = "moto[server]; a venv a peer, built once under ~/.cache/raydl-bench-peers (from the package registry)"

BENCHMARKS: dict[str, Bench] = {
    "throughput": Bench(
        "bench_throughput",
        "raydl vs torch's DataLoader vs Ray Data on one machine: samples/s of four workloads, first batch, memory",
        quick=("--quick",),
        needs="ray[data], psutil",
        minutes=5,
    ),
    "streaming": Bench(
        "bench_streaming",
        "Parquet from S3 (moto, 20 ms a request), a quarter cached: raydl vs Ray Data vs a naive torch dataset",
        quick=("--files", "8", "--groups", "4", "--naive-s", "5"),
        needs="moto[server], ray[data]",
        minutes=1.5,
    ),
    "shards": Bench(
        "bench_shards",
        "JPEG tar shards and plain files from S3: raydl vs webdataset vs Ray Data vs torch in memory, decode ceiling",
        args=("--images", "1536"),  # issue 57's corpus; with 768 a quarter of the cache is a window of 2 shards
        quick=("--images", "192"),
        needs="moto[server], ray[data], webdataset, pillow",
        minutes=5,
    ),
    "peers": Bench(
        "bench_peers",
        "raydl beside Mosaic Streaming and litdata on bench_streaming's Parquet rows from S3, each in its own format",
        quick=("--quick",),
        needs=_PEER_VENVS,
        minutes=10,
    ),
    "peers_shards": Bench(
        "bench_peers",
        "raydl beside Mosaic Streaming and litdata on bench_shards' JPEG tar shards from S3, each in its own format",
        args=("--workload", "shards", "--cap-s", "600"),  # Mosaic with a quarter cached needs ~320 s a run
        quick=("--quick",),
        needs=_PEER_VENVS,
        minutes=11,
    ),
    "mixing": Bench(
        "bench_mixing",
        "does the shuffle mix: a model trained on a class-sorted corpus through raydl, Ray Data and a uniform shuffle",
        quick=("--quick",),
        needs="moto[server], ray[data]",
        minutes=6,
    ),
    "across_nodes": Bench(
        "bench_across_nodes",
        "bytes read from S3 per epoch over 1-4 data nodes of a namespace cluster, and DDP ranks, node slots",
        quick=("--nodes", "2"),
        needs="root (network namespaces), moto[server]",
        minutes=8,
        tables=(0,),  # the paired ratios' table is in the record
    ),
    "ddp": Bench(
        "bench_across_nodes",
        "two DDP ranks over three data nodes: bytes from S3 and between nodes, as torchrun starts the ranks",
        args=("--nodes", "3", "--ddp", "2", "--deals", "batch,ranks,job"),
        quick=("--deals", "ranks"),
        needs="root (network namespaces), moto[server]",
        minutes=5,
    ),
    "resume": Bench(
        "bench_resume",
        "what exact resume costs: state_dict() with 2 and 32 workers, tracking on/off, the first batch after a load",
        quick=("--quick",),
        minutes=4,
    ),
    "arrow": Bench(
        "bench_arrow",
        "Arrow data in memory, columnar batches: raydl vs torch vs Ray Data vs Hugging Face vs one process's ceiling",
        quick=("--rows", "50000", "--epochs", "1"),
        needs="ray[data], datasets",
        minutes=2,
    ),
    "gpu": Bench(
        "bench_gpu",
        "the trainer's GPU path: GPU idle % and H2D GB/s against the copy engine's limit, torch vs raydl",
        quick=("--reps", "1"),
        needs="CUDA",
        minutes=1.5,
    ),
    "h2d_sources": Bench(
        "probe_h2d_sources",
        "where a transfer-bound loop's bytes/s can come from: pinned memcpy, registered /dev/shm and object store",
        needs="CUDA",
        minutes=1,
    ),
}
