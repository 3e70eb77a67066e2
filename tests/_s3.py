"""A real S3 endpoint on loopback for the streaming tests: moto's server as a subprocess, and a fault proxy.

`MotoServer` runs `python -m moto.server` on a free loopback port (killed by its pid on `stop`);
`FaultProxy` is an HTTP proxy in a thread in front of it that counts the bytes of the GET
responses it relays (what storage sent) and injects faults on demand: latency per request, a
503 SlowDown answer, or a reset connection, each for a bounded number of requests.
pyarrow's `S3FileSystem(endpoint_override=..., scheme="http")`, the client users run, talks to
either.
"""

from __future__ import annotations

import http.client
import socket
import struct
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional

_KEY, _SECRET, _REGION = "testing", "testing", "us-east-1"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _wait_port(port: int, timeout_s: float, host: str = "127.0.0.1") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"nothing listens on {host}:{port} after {timeout_s} s")


def s3fs(port: int, attempts: int = 0, host: str = "127.0.0.1"):
    """pyarrow's S3 client on an endpoint (loopback unless `host`); its own retries off (`attempts=0`) so raydl's
    are seen."""
    import pyarrow.fs as pafs

    return pafs.S3FileSystem(
        access_key=_KEY,
        secret_key=_SECRET,
        region=_REGION,
        endpoint_override=f"{host}:{port}",
        scheme="http",
        connect_timeout=2,
        request_timeout=5,
        retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=attempts),
        allow_bucket_creation=True,
    )


class MotoServer:
    """moto's S3 server as a subprocess on a free port of `host` (loopback by default)."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self.port = free_port(host)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", host, "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            _wait_port(self.port, 30, host)
        except Exception:
            self.stop()
            raise

    def make_bucket(self, name: str) -> None:
        self.filesystem().create_dir(name)

    def filesystem(self):
        return s3fs(self.port, attempts=3, host=self.host)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # this process's own child, by its handle
        self.proc.wait(timeout=10)


class FaultProxy:
    """An HTTP proxy to `upstream_port` with latency, 503s and connection resets on demand, bounded in requests.

    It listens on `host` (loopback by default; a namespace cluster's head address for clients on other nodes) and
    relays to `upstream_host`; `get_bytes_by_client` splits `get_bytes` by the client's IP address."""

    def __init__(self, upstream_port: int, host: str = "127.0.0.1", upstream_host: str = "127.0.0.1") -> None:
        self.upstream_port, self.upstream_host = upstream_port, upstream_host
        self.latency_s = 0.0
        self.lock = threading.Lock()
        self.faults: list = []  # (kind, path part) still to inject, one per matching GET ("503", "reset")
        self.injected = 0
        self.get_bytes = 0  # body bytes of GET responses relayed: what storage sent
        self.get_bytes_by_client: dict = {}  # client IP -> its share of get_bytes
        self.requests = 0
        self.requests_by_method: dict = {}  # "GET", "HEAD", ... -> how many
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _relay(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with proxy.lock:
                    proxy.requests += 1
                    proxy.requests_by_method[self.command] = proxy.requests_by_method.get(self.command, 0) + 1
                    fault = None
                    if self.command == "GET":
                        for j, (kind, part) in enumerate(proxy.faults):
                            if part in self.path:
                                fault = kind
                                del proxy.faults[j]
                                proxy.injected += 1
                                break
                if proxy.latency_s:
                    time.sleep(proxy.latency_s)
                if fault == "reset":
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.connection.close()
                    self.close_connection = True
                    return
                if fault == "503":
                    msg = b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(msg)))
                    self.end_headers()
                    self.wfile.write(msg)
                    return
                conn = http.client.HTTPConnection(proxy.upstream_host, proxy.upstream_port, timeout=30)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection",)}
                    conn.request(self.command, self.path, body=body or None, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                finally:
                    conn.close()
                if self.command == "GET":
                    client = self.client_address[0]
                    with proxy.lock:
                        proxy.get_bytes += len(data)
                        proxy.get_bytes_by_client[client] = proxy.get_bytes_by_client.get(client, 0) + len(data)
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length", "server", "date"):
                        self.send_header(k, v)
                # a HEAD answer keeps the object's length (pyarrow reads the file size from it)
                length = resp.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", length or str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _relay

        self.server = ThreadingHTTPServer((host, 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
        self.thread.start()

    def inject(self, *kinds: str, path: str = "") -> None:
        """Answer the next GETs whose URL path contains `path` with these faults, one each."""
        with self.lock:
            self.faults.extend((k, path) for k in kinds)

    def reset_counts(self) -> None:
        with self.lock:
            self.get_bytes = self.requests = self.injected = 0
            self.requests_by_method = {}
            self.get_bytes_by_client = {}

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def upload_folder(local_dir: str, fs, prefix: str) -> None:
    """Copy the files of a local folder to `prefix` (bucket/path) on an S3 filesystem."""
    import os

    for name in sorted(os.listdir(local_dir)):
        path = os.path.join(local_dir, name)
        if os.path.isfile(path):
            with open(path, "rb") as src, fs.open_output_stream(f"{prefix}/{name}") as dst:
                dst.write(src.read())


def stop_all(*things: Optional[object]) -> None:
    for t in things:
        if t is not None:
            t.stop()  # type: ignore[attr-defined]
