"""CPU per MB of a TCP lane with TLS (NOTE [ raydl lane TLS ]) against a plain one, on loopback: the driver's reader
and the worker's writer, each its own thread's CPU time, over the lanes' own send_reply / recv_reply.

    .venv/bin/python -m benchmarks.bench_lane_tls [--mb 64] [--batch-mb 4] [--reps 5]

Makes a throwaway CA and node certificate with `openssl` in a temporary directory (no Ray needed).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from benchmarks.common.results import printed_report
from raydl._constants import LANE_TCP_WAKE_BYTES
from raydl.driver.transport.lane import listen_for_lane
from raydl.worker.lane import connect_lane, recv_reply, send_reply


def _certs(tmp: str) -> dict:
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=tmp, check=True, capture_output=True)

    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "1", "-subj", "/CN=bench-ca")
    run("req", *ec, "-keyout", "node.key", "-out", "node.csr", "-subj", "/CN=bench-node")
    with open(os.path.join(tmp, "node.ext"), "w") as f:
        f.write("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n")
    sign = ("x509", "-req", "-in", "node.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial")
    run(*sign, "-out", "node.crt", "-days", "1", "-extfile", "node.ext")
    return {
        "RAY_TLS_SERVER_CERT": os.path.join(tmp, "node.crt"),
        "RAY_TLS_SERVER_KEY": os.path.join(tmp, "node.key"),
        "RAY_TLS_CA_CERT": os.path.join(tmp, "ca.crt"),
    }


def _one(total_mb: int, batch_mb: int) -> tuple[float, float]:
    """(reader CPU ms per MB, writer CPU ms per MB) for `total_mb` of replies of one `batch_mb` array each."""
    token = os.urandom(16)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    greeter, address = listen_for_lane(listener, listener.getsockname()[:2], token, remote=True)
    worker = connect_lane(address, token)
    while (driver := greeter.take()) is None:
        time.sleep(0.001)
    greeter.stop()
    batch = np.random.default_rng(0).integers(0, 255, batch_mb << 20, dtype=np.uint8)
    n = total_mb // batch_mb
    cpu = {}

    def write() -> None:
        t0 = time.thread_time()
        for _ in range(n):
            send_reply(worker, ([batch], []))
        cpu["write"] = time.thread_time() - t0

    writer = threading.Thread(target=write)
    writer.start()
    t0 = time.thread_time()
    for _ in range(n):
        recv_reply(driver, LANE_TCP_WAKE_BYTES)
    cpu["read"] = time.thread_time() - t0
    writer.join()
    worker.close()
    driver.close()
    mb = n * batch_mb
    return 1000 * cpu["read"] / mb, 1000 * cpu["write"] / mb


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=64)
    parser.add_argument("--batch-mb", type=int, default=4)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        env = _certs(tmp)
        results: dict[str, list] = {"plain": [], "tls": []}
        for _ in range(args.reps):  # alternated, so a busy moment of the machine touches both
            for kind in ("plain", "tls"):
                os.environ.pop("RAY_USE_TLS", None)
                if kind == "tls":
                    os.environ.update(env, RAY_USE_TLS="1")
                results[kind].append(_one(args.mb, args.batch_mb))
    for kind, runs in results.items():
        read = statistics.median(r[0] for r in runs)
        write = statistics.median(r[1] for r in runs)
        print(
            f"{kind:5s}: driver's reader {read:.2f} ms CPU/MB, worker's writer {write:.2f} ms CPU/MB (median of {len(runs)})"
        )
    extra = [
        statistics.median(t[i] for t in results["tls"]) - statistics.median(p[i] for p in results["plain"])
        for i in (0, 1)
    ]
    print(f"TLS adds {extra[0]:.2f} ms CPU/MB on the driver's reader, {extra[1]:.2f} on the worker's writer")


if __name__ == "__main__":
    with printed_report("bench_lane_tls", quick="--quick" in sys.argv):
        main()
