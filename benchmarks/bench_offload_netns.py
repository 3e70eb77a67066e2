"""Offload over a real (virtual) link: bench_offload's shape on the namespace cluster (cluster/netns_testbed.py).

The head's namespace holds the trainer (this driver, pinned to one core, as bench_offload pins it) and the head's
Ray on that core; one worker node, its own namespace and address, its Ray pinned to the other core; the link
between them capped at `--rates` with `tc tbf`. The workload is bench_offload's: CPU-bound ~1 ms a sample of
3x64x64 float32 (48 KiB), batch 64 (3 MiB a batch), 2 workers, and a training step per batch as long as the
batch's data work (S = D). Loaders: torch (workers forked on the trainer's core), raydl with TCP lanes (the
default: its placement puts the workers on the worker node), raydl with `ray_lane=False` (Ray's transfer); each
cluster again with Ray's TLS (lanes then TLS). Reported: samples/s (median of the measured epochs), the ratio to
torch in the same cluster, and the share of the link the batches used, so the bound can be read off: the data
core (~1,000 samples/s for 2 workers of 1 ms samples on one core), the trainer's core, or the link.
`--workload jpeg`: bench_images --offload's pipeline instead (examples/train_image_classifier.py: generated
500x375 JPEGs, PIL decode, RandomResizedCrop(224), flip, normalize; 3x224x224 float32 = 588 KiB a sample,
37.6 MiB a batch of 64), its JPEGs written once under /tmp/raydl-bench-images.

    sudo .venv/bin/python -m benchmarks.bench_offload_netns [--rates 10gbit,1gbit] [--samples 1024] [--epochs 2]
    sudo .venv/bin/python -m benchmarks.bench_offload_netns --workload jpeg --samples 512

Needs root (network namespaces) and 2 CPUs. A fresh cluster per rate and TLS setting.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from benchmarks.common.clusters import run_in_netns_head
from benchmarks.common.results import md_table, printed_report

BATCH = 64
SAMPLE_BYTES = {"cpu": 3 * 64 * 64 * 4, "jpeg": 3 * 224 * 224 * 4}
JPEG_DIR = "/tmp/raydl-bench-images/500x375-n{n}-c100-q90"


def _dataset(workload: str, samples: int):
    """The workload's dataset, and one core's time to make a batch of it (the 10th percentile of a few)."""
    from benchmarks.common.workloads import Workload, WorkloadDataset, calibrate_cpu_iters, sample_cost_s

    if workload == "jpeg":
        from examples.train_image_classifier import JpegFolder, TrainTransform

        ds = JpegFolder(JPEG_DIR.format(n=samples), TrainTransform(224))
        times = []
        for b in range(4):
            t0 = time.perf_counter()
            for i in range(b * BATCH, (b + 1) * BATCH):
                ds[i % len(ds)]
            times.append(time.perf_counter() - t0)
        return ds, sorted(times)[0]
    iters = calibrate_cpu_iters()
    wl = Workload("cpu", "CPU-bound ~1 ms/sample, 3x64x64 f32, batch 64", samples, BATCH, "cpu", iters)
    return WorkloadDataset(wl), sample_cost_s(wl.sample) * BATCH


def _driver(samples: int, epochs: int, loaders: list, workload: str) -> dict:
    """In the head's namespace, pinned to the trainer's core (importing common.offload pins it)."""
    import ray
    import torch

    import raydl
    from benchmarks.common.offload import TRAINER_CPU, TrainStep, run_epochs
    from benchmarks.common.workloads import register_by_value

    torch.set_num_threads(1)
    ds, per_batch_s = _dataset(workload, samples)
    ray.init()
    register_by_value()
    step = TrainStep(per_batch_s * 1e3)
    out: dict = {"trainer_cpu": TRAINER_CPU, "data_ms_per_batch": per_batch_s * 1e3}
    for name in loaders:
        kwargs = dict(batch_size=BATCH, num_workers=2, persistent_workers=True)
        if name == "torch":
            loader = torch.utils.data.DataLoader(ds, **kwargs)
        else:
            loader = raydl.DataLoader(
                ds, timeout=300, ray_startup_timeout_s=240, ray_lane=name == "raydl-lanes", **kwargs
            )
        rates = [run_epochs(loader, 1, step)["samples_per_s"] for _ in range(epochs)]
        where = sorted({r.node_ip for r in loader.worker_records}) if name != "torch" else ["trainer's core"]
        if name != "torch":
            loader.shutdown()
        out[name] = {"samples_per_s": rates, "workers_on": where}
        del loader
    ray.shutdown()
    return out


def _run(rate: str, tls: bool, samples: int, epochs: int, workload: str) -> dict:
    from cluster import netns_testbed

    cluster = netns_testbed.NetnsCluster(
        workers=1,
        tag=f"o{os.getpid() % 100000}{'t' if tls else ''}",
        rate=rate,
        tls=tls,
        node_cpus={0: "0", 1: "1"},
        worker_resources={"data": 4},
        object_store_bytes=400_000_000,
    )
    loaders = ["torch", "raydl-lanes", "raydl-ray"]
    with cluster:
        return run_in_netns_head(
            cluster, "bench_offload_netns", "--driver", ",".join(loaders), "--samples", str(samples), "--epochs",
            str(epochs), "--workload", workload,
        )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", default="10gbit,1gbit")
    ap.add_argument("--samples", type=int, default=1024)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--workload", choices=["cpu", "jpeg"], default="cpu")
    ap.add_argument("--tls", default="no,yes", help="Ray's TLS off, on, or both in turn (no,yes)")
    ap.add_argument("--driver", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.driver:
        print("RESULT " + json.dumps(_driver(a.samples, a.epochs, a.driver.split(","), a.workload)), flush=True)
        return
    from benchmarks.common.processes import REPO

    # every node's Ray processes import this checkout (the example's module, for the JPEG workload)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))
    if a.workload == "jpeg":
        from examples.train_image_classifier import write_jpeg_folder

        write_jpeg_folder(JPEG_DIR.format(n=a.samples), a.samples, 100, size=(500, 375), quality=90)
    from cluster.netns_testbed import _rate_bits

    rows = []
    t0 = time.time()
    for rate in a.rates.split(","):
        link = _rate_bits(rate) / 8
        for tls in [{"no": False, "yes": True}[t] for t in a.tls.split(",")]:
            res = _run(rate, tls, a.samples, a.epochs, a.workload)
            print(json.dumps({"rate": rate, "tls": tls, **res}), flush=True)
            torch_rate = statistics.median(res["torch"]["samples_per_s"])
            for name in ("torch", "raydl-lanes", "raydl-ray"):
                r = statistics.median(res[name]["samples_per_s"])
                label = {"torch": "torch (forked, trainer's core)", "raydl-lanes": "raydl, TCP lanes"}.get(
                    name, "raydl, Ray's transfer (ray_lane=False)"
                )
                rows.append(
                    [
                        rate,
                        "yes" if tls else "no",
                        label,
                        f"{r:,.0f}",
                        f"{r / torch_rate:.2f}×",
                        f"{r * SAMPLE_BYTES[a.workload] / link:.1%}",
                        ", ".join(f"{x:,.0f}" for x in res[name]["samples_per_s"]),
                        ", ".join(res[name]["workers_on"]),
                    ]
                )
    print(
        f"\n{a.workload}: {a.samples} samples an epoch, batch {BATCH}, 2 workers, step = the batch's data work; {time.time() - t0:.0f} s\n"
    )
    header = ["link", "Ray TLS", "loader", "samples/s", "/ torch", "of the link", "epochs", "workers on"]
    print(md_table(header, rows))


if __name__ == "__main__":
    with printed_report("bench_offload_netns", quick="--quick" in sys.argv, enabled="--driver" not in sys.argv):
        main()
