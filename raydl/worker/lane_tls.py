"""TLS for TCP lanes, when Ray's own TLS is on (NOTE [ raydl lane TLS ]).

NOTE [ raydl lane TLS ]
On a cluster whose Ray runs with TLS (`RAY_USE_TLS` set, with `RAY_TLS_SERVER_CERT`, `RAY_TLS_SERVER_KEY` and
`RAY_TLS_CA_CERT` in every Ray process's environment), a TCP lane (a worker on another node) is TLS 1.3 with those
files, checked as Ray's gRPC checks its channels: each end presents the node's certificate and verifies the other's
against the CA (the driver, as gRPC's server with client authentication, requires the worker's; the worker, as
gRPC's client, also requires the driver's certificate to name the address it dialled: a subject alternative name
equal to the IP, DNS or IP entry alike, as gRPC compares them). The driver tells the worker through the lane's
address that TLS is expected; either end with TLS on in its own environment insists on it too. Never plaintext:
where a context cannot be made (no `ssl` module, a file missing or unreadable, a key that does not fit), the
driver asks no TCP lane (its workers on other nodes keep Ray's calls) and the worker refuses one (`open_lane` is
False), each logging why once per process. Unix-socket lanes on the driver's node stay as they are.
An SSL object must not be used by two threads at once, and a lane has a reader and a writer on each end
(NOTE [ raydl lane ]): `TlsConnection` keeps its socket non-blocking and makes each SSL call under a lock, waiting
for the socket outside it.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import select
import socket
import struct
import threading
from typing import Any, Optional

__all__ = ["tls_wanted", "tls_context", "TlsConnection", "tls_connect", "TLS_FLAG"]

logger = logging.getLogger(__name__)

# the third item of a TCP lane's address when the driver expects TLS on it
TLS_FLAG = "tls"
_ENV = ("RAY_TLS_SERVER_CERT", "RAY_TLS_SERVER_KEY", "RAY_TLS_CA_CERT")
_contexts: dict[tuple, Any] = {}  # (server side, env values) -> an SSLContext, or the OSError making it raised
_told: set[str] = set()  # reasons already logged by this process
_lock = threading.Lock()


def tls_wanted() -> bool:
    """Whether Ray's TLS is on in this process's environment (any value but an empty or false one: Ray itself
    reads "1" and "true"; reading more as on errs towards TLS)."""
    return os.environ.get("RAY_USE_TLS", "").strip().lower() not in ("", "0", "false", "no", "off")


def tls_context(server: bool) -> Any:
    """The SSLContext of a TCP lane's end (`server`: the driver's listener), made from Ray's TLS files once per
    process. OSError (logged once) when it cannot be made: the caller keeps Ray's calls."""
    key = (server, *(os.environ.get(name) for name in _ENV))
    with _lock:
        made = _contexts.get(key)
        if made is None:
            try:
                made = _make_context(server, key[1:])
            except OSError as e:
                made = e
            _contexts[key] = made
    if isinstance(made, OSError):
        _tell_once(str(made))
        raise made
    return made


def _tell_once(why: str) -> None:
    with _lock:
        if why in _told:
            return
        _told.add(why)
    logger.warning(
        "raydl: Ray's TLS is on but a TLS lane cannot be set up (%s): workers on other nodes keep Ray's calls", why
    )


def _make_context(server: bool, files: tuple) -> Any:
    try:
        import ssl
    except ImportError as e:
        raise OSError(f"Python's ssl module is missing: {e}") from None
    missing = [name for name, path in zip(_ENV, files) if not path]
    if missing:
        raise OSError(f"RAY_USE_TLS is set without {', '.join(missing)}")
    cert, key, ca = files
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3  # both ends are raydl: no renegotiation, no older protocol
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.check_hostname = False  # the worker checks the driver's name itself, as gRPC does (`_check_name`)
    if server:
        ctx.num_tickets = 0  # one connection a lane: no session to resume
    try:
        ctx.load_cert_chain(cert, key)
        ctx.load_verify_locations(cafile=ca)
    except (OSError, ValueError) as e:  # ssl.SSLError is an OSError
        raise OSError(f"Ray's TLS files could not be loaded ({cert}, {key}, {ca}): {e}") from None
    return ctx


def _check_name(sock: Any, host: str) -> None:
    """The driver's certificate (verified against the CA) must name `host`, as gRPC's client requires: an IP equal
    to a subject alternative name's text (DNS or IP entry), a host name matching a DNS entry, or with no such names
    at all the common name (never for an IP)."""
    cert = sock.getpeercert() or {}
    sans = cert.get("subjectAltName", ())
    try:
        ip: Optional[Any] = ipaddress.ip_address(host)
    except ValueError:
        ip = None
    for kind, value in sans:
        if value == host:
            return
        if ip is not None and kind == "IP Address":
            try:
                if ipaddress.ip_address(value.strip()) == ip:
                    return
            except ValueError:
                pass
    if not sans and ip is None:
        for rdn in cert.get("subject", ()):
            if any(k == "commonName" and v == host for k, v in rdn):
                return
    raise OSError(f"the driver's TLS certificate does not name {host}")


def tls_connect(sock: socket.socket, host: str, timeout_s: float) -> TlsConnection:
    """The worker's end: TLS over a connected TCP socket, both certificates verified and the driver's name checked
    (OSError when not: the lane is refused)."""
    ctx = tls_context(server=False)
    sock.settimeout(timeout_s)
    tls = ctx.wrap_socket(sock, server_side=False)
    try:
        _check_name(tls, host)
    except OSError:
        tls.close()
        raise
    tls.settimeout(0.0)
    return TlsConnection(tls)


def _wait(fd: int, events: int) -> None:
    poller = select.poll()
    poller.register(fd, events)
    poller.poll()  # until ready, or the connection ends or errs (the next SSL call says which)


class TlsConnection:
    """A TLS lane's connection: the parts of multiprocessing's `Connection` the lanes use (`send_bytes`,
    `recv_bytes`, its framing), plus `write_all` / `read_into` for a reply's out-of-band buffers. Its SSL socket is
    non-blocking; each SSL call is made under `_lock` (a reader and a writer share it), waits outside it."""

    _CHUNK = 1 << 20

    def __init__(self, sock: Any) -> None:
        import ssl

        self._sock = sock
        self._fd = sock.fileno()
        self._lock = threading.Lock()
        self._want = (ssl.SSLWantReadError, ssl.SSLWantWriteError)
        self.closed = False

    def fileno(self) -> int:
        if self.closed:
            raise OSError("the lane's connection is closed")
        return self._fd

    def close(self) -> None:
        with self._lock:
            if not self.closed:
                self.closed = True
                self._sock.close()

    def _call(self, op: Any, *args: Any) -> int:
        while True:
            with self._lock:
                if self.closed:
                    raise OSError("the lane's connection is closed")
                try:
                    return op(*args)
                except self._want as e:
                    wait_for = select.POLLOUT if isinstance(e, self._want[1]) else select.POLLIN
            _wait(self._fd, wait_for)

    def write_all(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        sent = 0
        while sent < view.nbytes:
            sent += self._call(self._sock.send, view[sent : sent + self._CHUNK])

    def read_into(self, view: memoryview) -> None:
        """Fill `view`; EOFError when the connection ends first."""
        got = 0
        while got < view.nbytes:
            n = self._call(self._sock.recv_into, view[got:], view.nbytes - got)
            if n == 0:
                raise EOFError("the lane ended in the middle of a message")
            got += n

    def send_bytes(self, data: Any) -> None:
        n = memoryview(data).nbytes
        head = struct.pack("!i", n) if n <= 0x7FFFFFFF else struct.pack("!iQ", -1, n)
        if n <= self._CHUNK:
            self.write_all(head + bytes(data))
        else:
            self.write_all(head)
            self.write_all(data)

    def recv_bytes(self, maxlength: Optional[int] = None) -> bytearray:
        head = bytearray(4)
        self.read_into(memoryview(head))
        (size,) = struct.unpack("!i", head)
        if size == -1:
            big = bytearray(8)
            self.read_into(memoryview(big))
            (size,) = struct.unpack("!Q", big)
        if size < 0 or (maxlength is not None and size > maxlength):
            raise OSError("bad message length")
        buf = bytearray(size)
        self.read_into(memoryview(buf))
        return buf
