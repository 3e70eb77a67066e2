"""The driver's lane listener: who may become a worker's lane (NOTE [ raydl lane listener ]).

NOTE [ raydl lane listener ]
A lane's port (a TCP port on the driver's node IP, or an abstract Unix socket any local process can name) may be
reached by anyone: a port scanner, a stale worker, a hostile peer. So the connection that becomes a worker's lane
is chosen off the trainer's thread, by a `Greeter` thread per lane being opened: it accepts every connection
(non-blocking), makes its TLS handshake where the lane is TLS (NOTE [ raydl lane TLS ] in worker/lane_tls.py), and
reads exactly the lane's hello, the token's message as `Connection.send_bytes` frames it (a 4-byte length, 16, then
the 16 bytes), the token compared whole and in constant time (a drop at its first wrong byte would tell a prober
how much it guessed right). A connection is dropped, and the listener goes on listening for the worker, at the
first byte of the length that is not 16 (garbage, an HTTP request, a length prefix of 2**62: never a read of the
length it claims), at a wrong token, at its end, at a failed handshake (a certificate of another CA), or
LANE_HELLO_S after it came (a peer that opens and never writes). At most LANE_HELLO_PENDING connections are heard
at once (a flood drops the oldest), each holding a socket and 20 bytes: memory stays bounded, and the trainer's
thread only looks whether the lane's connection is there (`Lanes._accept`). Once it is, the listener closes.
"""

from __future__ import annotations

import hmac
import logging
import select
import socket
import struct
import threading
import time
from collections import OrderedDict
from multiprocessing.connection import Connection
from typing import Any, Optional

from ..._constants import LANE_HELLO_PENDING, LANE_HELLO_S
from ...worker.lane import tune_tcp
from ...worker.lane_tls import TlsConnection

__all__ = ["Greeter"]

logger = logging.getLogger(__name__)

_POLL_S = 0.2  # how often the greeter looks whether it was stopped


class _Caller:
    """A connection being heard: its socket (TLS once wrapped), the hello read so far, its deadline."""

    __slots__ = ("sock", "hello", "got", "deadline", "shaken")

    def __init__(self, sock: Any, deadline: float, shaken: bool) -> None:
        self.sock, self.deadline, self.shaken = sock, deadline, shaken
        self.hello = bytearray(4 + 16)
        self.got = 0


class Greeter:
    """Hears the connections to `listener` (bound, listening, non-blocking) until one proves itself with `token`:
    then `conn` is that lane's connection (a `Connection`, or a `TlsConnection` with `tls_context`). `remote`: a TCP
    lane (its sockets tuned, `tune_tcp`). `refused` counts the connections dropped, `why` says the last reason."""

    def __init__(self, listener: socket.socket, token: bytes, remote: bool, tls_context: Any = None) -> None:
        assert len(token) == 16
        self._listener = listener
        self._expected = struct.pack("!i", len(token)) + token
        self._remote = remote
        self._tls = tls_context
        self._lock = threading.Lock()
        self._stopped = False
        self.conn: Optional[Any] = None
        self.refused = 0
        self.why: Optional[str] = None
        self._thread = threading.Thread(target=self._run, name="raydl-lane-listen", daemon=True)
        self._thread.start()

    def take(self) -> Optional[Any]:
        """The lane's connection once one proved itself (handed over once), else None."""
        with self._lock:
            conn, self.conn = self.conn, None
        return conn

    def stop(self) -> None:
        """Stop listening (the thread closes the listener and any connection not handed over)."""
        with self._lock:
            self._stopped = True
            conn, self.conn = self.conn, None
        if conn is not None:
            conn.close()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # refuses new connections now (and wakes the poll on Linux)
        except OSError:
            pass

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)

    def _run(self) -> None:
        callers: OrderedDict[int, _Caller] = OrderedDict()
        poller = select.poll()
        lfd = self._listener.fileno()
        poller.register(lfd, select.POLLIN)
        try:
            while not self._stopped:
                now = time.monotonic()
                wait_s = min([_POLL_S] + [c.deadline - now for c in callers.values()])
                for fd, _ in poller.poll(max(0.0, wait_s) * 1000):
                    if fd == lfd:
                        self._accept_all(callers, poller)
                    elif fd in callers:
                        self._hear(fd, callers, poller)
                    if self._stopped or self.conn is not None:
                        return
                now = time.monotonic()
                for fd in [fd for fd, c in callers.items() if c.deadline <= now]:
                    self._drop(fd, callers, poller, "no hello within LANE_HELLO_S")
        except Exception as e:  # noqa: BLE001 - the listener failed: no lane (the worker keeps Ray's calls)
            self.why = repr(e)
            logger.debug("raydl: a lane's listener failed", exc_info=True)
        finally:
            for fd in list(callers):
                self._drop(fd, callers, poller, None)
            self._listener.close()

    def _accept_all(self, callers: OrderedDict, poller: Any) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                if self._stopped:
                    return
                raise
            sock.setblocking(False)
            if self._remote:
                tune_tcp(sock)
            if len(callers) >= LANE_HELLO_PENDING:  # a flood: the oldest gives its place
                self._drop(next(iter(callers)), callers, poller, "too many connections at once")
            if self._tls is not None:
                try:
                    sock = self._tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
                except OSError as e:
                    sock.close()
                    self._note_refusal(f"TLS: {e}")
                    continue
            fd = sock.fileno()
            callers[fd] = _Caller(sock, time.monotonic() + LANE_HELLO_S, shaken=self._tls is None)
            poller.register(fd, select.POLLIN)
            self._hear(fd, callers, poller)  # a TLS handshake starts at once; a hello may already be in

    def _hear(self, fd: int, callers: OrderedDict, poller: Any) -> None:
        """Go on with a connection's handshake and hello as far as its bytes allow."""
        import ssl

        caller = callers[fd]
        try:
            if not caller.shaken:
                caller.sock.do_handshake()
                caller.shaken = True
            view = memoryview(caller.hello)
            while caller.got < len(caller.hello):
                n = caller.sock.recv_into(view[caller.got :], len(caller.hello) - caller.got)
                if n == 0:
                    self._drop(fd, callers, poller, "it ended before its hello")
                    return
                head = min(caller.got + n, 4)  # the length prefix, checked as it comes (the token only whole)
                if caller.got < 4 and view[caller.got : head] != self._expected[caller.got : head]:
                    self._drop(fd, callers, poller, "not a lane's hello")  # never a read of the length it claims
                    return
                caller.got += n
        except (ssl.SSLWantReadError, BlockingIOError, InterruptedError):
            poller.modify(fd, select.POLLIN)
            return
        except ssl.SSLWantWriteError:
            poller.modify(fd, select.POLLOUT)
            return
        except OSError as e:  # a failed handshake (ssl.SSLError: a certificate of another CA), a reset
            self._drop(fd, callers, poller, f"{type(e).__name__}: {e}")
            return
        if not hmac.compare_digest(bytes(caller.hello), self._expected):  # in constant time: no byte-by-byte oracle
            self._drop(fd, callers, poller, "a wrong token")
            return
        poller.unregister(fd)
        del callers[fd]
        conn = self._connection(caller.sock)
        with self._lock:
            if self._stopped:
                conn.close()
                return
            self.conn = conn

    def _connection(self, sock: Any) -> Any:
        if self._tls is not None:
            return TlsConnection(sock)  # stays non-blocking: its calls wait outside their lock
        sock.setblocking(True)
        return Connection(sock.detach())

    def _drop(self, fd: int, callers: OrderedDict, poller: Any, why: Optional[str]) -> None:
        caller = callers.pop(fd)
        if why is not None:
            self._note_refusal(why)
        try:
            poller.unregister(fd)
        except (KeyError, ValueError):
            pass
        try:
            caller.sock.close()
        except OSError:
            pass

    def _note_refusal(self, why: str) -> None:
        self.refused += 1
        self.why = why
        logger.debug("raydl: a connection to a lane's listener was dropped: %s", why)
