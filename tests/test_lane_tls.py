"""TCP lanes under Ray's TLS (NOTE [ raydl lane TLS ]) and the lane listener's defences (NOTE [ raydl lane
listener ]), at the socket level on 127.0.0.1: the driver's listener as `Lanes._ask` sets it up (`listen_for_lane`)
and the worker's end as `serve_lane` connects (`connect_lane`), with a throwaway CA made by `openssl`."""

from __future__ import annotations

import logging
import pickle
import socket
import struct
import subprocess
import threading
import time

import numpy as np
import pytest
import torch

from raydl._constants import LANE_HELLO_PENDING, LANE_TCP_WAKE_BYTES
from raydl.driver.transport.lane import listen_for_lane
from raydl.worker import lane_tls
from raydl.worker.lane import connect_lane, recv_reply, send_reply
from raydl.worker.transfer import decode, encode

MARKER = b"raydl-secret-marker-6b1f"
TOKEN = bytes(range(16))


def _openssl(tmp, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=tmp, check=True, capture_output=True, timeout=30)


def _ca(tmp, name: str) -> None:
    _openssl(
        tmp,
        *("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"),
        *("-keyout", f"{name}.key", "-out", f"{name}.crt", "-days", "2", "-subj", f"/CN={name}"),
    )


def _node(tmp, ca: str, name: str, san: str = "IP:127.0.0.1,DNS:localhost") -> dict:
    """A node's key and certificate signed by `ca`, valid for `san`: the env a Ray process has."""
    (tmp / f"{name}.ext").write_text(
        f"subjectAltName={san}\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth,clientAuth\n"
    )
    _openssl(
        tmp,
        *("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"),
        *("-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", "/CN=raydl-test-node"),
    )
    _openssl(
        tmp,
        *("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key", "-CAcreateserial"),
        *("-out", f"{name}.crt", "-days", "2", "-extfile", f"{name}.ext"),
    )
    return {
        "RAY_USE_TLS": "1",
        "RAY_TLS_SERVER_CERT": str(tmp / f"{name}.crt"),
        "RAY_TLS_SERVER_KEY": str(tmp / f"{name}.key"),
        "RAY_TLS_CA_CERT": str(tmp / f"{ca}.crt"),
    }


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """The cluster's CA and a node certificate; another CA and a node certificate of its own; a certificate of the
    cluster's CA that names another IP."""
    tmp = tmp_path_factory.mktemp("pki")
    _ca(tmp, "ca")
    _ca(tmp, "other-ca")
    return {
        "node": _node(tmp, "ca", "node"),
        "stranger": _node(tmp, "other-ca", "stranger"),
        "elsewhere": _node(tmp, "ca", "elsewhere", san="IP:10.9.8.7,DNS:elsewhere"),
    }


def _use(monkeypatch, env: dict | None) -> None:
    for name in ("RAY_USE_TLS", "RAY_TLS_SERVER_CERT", "RAY_TLS_SERVER_KEY", "RAY_TLS_CA_CERT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)


def _listen(token: bytes = TOKEN):
    """The driver's end of a TCP lane as `Lanes._ask` makes it: (its greeter, the address the worker is sent)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    return listen_for_lane(listener, listener.getsockname()[:2], token, remote=True)


def _taken(greeter, within_s: float = 10.0):
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        conn = greeter.take()
        if conn is not None:
            return conn
        time.sleep(0.01)
    return None


def _batch():
    return {
        "x": torch.arange(200_000, dtype=torch.float32),
        "note": MARKER.decode(),
        "raw": np.frombuffer(MARKER * 4000, np.uint8),
    }


def _round_trip(driver, worker) -> None:
    """A call from the driver, a reply (in-band marker, out-of-band arrays) back, as the lanes send them."""
    driver.send_bytes(pickle.dumps((0, 0, [(0, "work")]), protocol=5))
    assert pickle.loads(worker.recv_bytes()) == (0, 0, [(0, "work")])
    reply = ([encode(_batch())], [("meta", 1)])
    writer = threading.Thread(target=send_reply, args=(worker, reply))
    writer.start()
    batches, metas = recv_reply(driver, LANE_TCP_WAKE_BYTES)
    writer.join(30)
    got = decode(batches[0])
    assert metas == [("meta", 1)] and got["note"] == MARKER.decode()
    assert torch.equal(got["x"], _batch()["x"]) and bytes(got["raw"]) == MARKER * 4000


class _Sniffer:
    """A TCP proxy on loopback between the worker and the driver's listener, keeping every byte it forwards."""

    def __init__(self, target) -> None:
        self.seen = bytearray()
        self._target = target
        self._server = socket.create_server(("127.0.0.1", 0))
        self.address = self._server.getsockname()[:2]
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        client, _ = self._server.accept()
        upstream = socket.create_connection(self._target)
        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src, dst) -> None:
        try:
            while data := src.recv(1 << 16):
                self.seen += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


@pytest.mark.parametrize("tls", [True, False])
def test_a_reply_round_trips_and_a_sniffer_sees_plaintext_only_without_tls(pki, monkeypatch, tls):
    """Driver and worker ends as the lanes make them, through a proxy that keeps the bytes: with Ray's TLS on the
    address says TLS, the reply arrives whole and no byte of the marker (in band or out of band) nor the token
    crosses in the clear; without TLS (the control) the proxy sees both."""
    _use(monkeypatch, pki["node"] if tls else None)
    greeter, address = _listen()
    assert (address[2:] == (lane_tls.TLS_FLAG,)) == tls
    sniffer = _Sniffer(address[:2])
    worker = connect_lane((*sniffer.address, *address[2:]), TOKEN)
    driver = _taken(greeter)
    try:
        assert driver is not None, greeter.why
        assert isinstance(driver, lane_tls.TlsConnection) == tls
        _round_trip(driver, worker)
        assert (MARKER in sniffer.seen) == (not tls) and (TOKEN in sniffer.seen) == (not tls)
    finally:
        greeter.stop()
        worker.close()
        if driver is not None:
            driver.close()


@pytest.mark.parametrize("who", ["worker", "driver"])
def test_a_peer_with_a_certificate_of_another_ca_is_refused(pki, monkeypatch, who):
    """A worker presenting another CA's certificate is dropped by the listener (which goes on listening); a driver
    presenting one is refused by the worker (no token sent to it); a driver whose certificate names another IP too."""
    if who == "worker":
        _use(monkeypatch, pki["node"])
        greeter, address = _listen()
        _use(monkeypatch, pki["stranger"])
        try:
            try:  # TLS 1.3: the client may finish its side before the server refuses its certificate
                stranger = connect_lane(address, TOKEN)
                with pytest.raises((OSError, EOFError)):
                    stranger.recv_bytes()
            except OSError:
                pass
            assert _taken(greeter, 1.0) is None and greeter.refused >= 1, greeter.why
            _use(monkeypatch, pki["node"])  # the listener still takes the real worker
            worker = connect_lane(address, TOKEN)
            conn = _taken(greeter)
            assert conn is not None, greeter.why
            conn.close()
            worker.close()
        finally:
            greeter.stop()
    else:
        for cert in ("stranger", "elsewhere"):
            _use(monkeypatch, pki[cert])
            greeter, address = _listen()
            _use(monkeypatch, pki["node"])
            try:
                with pytest.raises(OSError):
                    connect_lane(address, TOKEN)
                assert _taken(greeter, 0.5) is None
            finally:
                greeter.stop()


def test_tls_that_cannot_be_set_up_means_no_tcp_lane_and_is_logged_once(pki, monkeypatch, caplog, tmp_path):
    """RAY_USE_TLS with a key file nobody can read: the driver's listener is not made (OSError: the worker keeps
    Ray's calls), nor the worker's connection, never a plaintext one; the reason is logged once per process."""
    env = dict(pki["node"], RAY_TLS_SERVER_KEY=str(tmp_path / "missing.key"))
    _use(monkeypatch, env)
    monkeypatch.setattr(lane_tls, "_told", set())
    caplog.set_level(logging.WARNING, logger=lane_tls.__name__)
    for _ in range(2):
        with pytest.raises(OSError, match="TLS files could not be loaded"):
            _listen()
    plain = socket.create_server(("127.0.0.1", 0))
    try:
        with pytest.raises(OSError):
            connect_lane(plain.getsockname()[:2], TOKEN)  # Ray's TLS on here: no plaintext lane either
        assert plain.accept()[0].recv(64) == b""  # it connected, then closed without a byte
    finally:
        plain.close()
    said = [r for r in caplog.records if "cannot be set up" in r.getMessage()]
    assert len(said) == 1, said  # the same reason for the listener and the worker: said once


def _prober(address, payload: bytes | None, hold_s: float = 0.0):
    sock = socket.create_connection(address)
    if payload:
        sock.sendall(payload)
    if hold_s:
        time.sleep(hold_s)
    return sock


@pytest.mark.parametrize("tls", [True, False])
def test_bad_input_on_the_listener_is_dropped_and_the_worker_still_gets_its_lane(pki, monkeypatch, tls):
    """A connection without a token, a wrong token, garbage, a length prefix of 2**62, one that opens and never
    writes, and a flood of them: each dropped without a read of what it claims, at most LANE_HELLO_PENDING heard at
    once, the trainer's thread never waiting; the worker's own connection then becomes its lane and carries a
    reply."""
    from raydl import _constants as K
    from raydl.driver.transport import lane_accept

    monkeypatch.setattr(lane_accept, "LANE_HELLO_S", 1.0)  # a silent peer is dropped after 1 s here
    _use(monkeypatch, pki["node"] if tls else None)
    greeter, address = _listen()
    target = address[:2]
    wrong = struct.pack("!i", 16) + bytes(16)
    probes = [
        _prober(target, None),  # opens, never writes
        _prober(target, wrong),  # a wrong token (in the clear: to a TLS listener, not even a handshake)
        _prober(target, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"),  # garbage
        _prober(target, struct.pack("!iQ", -1, 1 << 62) + b"x" * 64),  # a length prefix of 2**62
        _prober(target, struct.pack("!i", 16)),  # the right length, then nothing
    ]
    closed = socket.create_connection(target)
    closed.close()  # connects and goes: no token at all
    flood = [socket.create_connection(target) for _ in range(3 * LANE_HELLO_PENDING)]
    try:
        started = time.monotonic()
        assert greeter.take() is None and time.monotonic() - started < 0.05  # the trainer's look never waits
        if tls:  # a TLS peer with the right certificate and a wrong token
            wrong_peer = connect_lane(address, bytes(16))
            flood.append(wrong_peer)
        time.sleep(0.3)
        worker = connect_lane(address, TOKEN)
        driver = _taken(greeter)
        assert driver is not None, greeter.why
        _round_trip(driver, worker)
        assert greeter.refused >= 4 + 2 * LANE_HELLO_PENDING, (greeter.refused, greeter.why)
        assert K.LANE_HELLO_PENDING == LANE_HELLO_PENDING
        worker.close()
        driver.close()
    finally:
        greeter.stop()
        for sock in probes + flood:
            sock.close()
    greeter.join(5)
    assert not greeter._thread.is_alive()  # the listener's thread ends with the lane's opening


def test_a_silent_peer_is_dropped_after_its_time_and_the_listener_keeps_no_state(monkeypatch):
    """A connection that never writes is dropped LANE_HELLO_S after it came; the greeter then holds nothing."""
    from raydl.driver.transport import lane_accept

    monkeypatch.setattr(lane_accept, "LANE_HELLO_S", 0.5)
    _use(monkeypatch, None)
    greeter, address = _listen()
    silent = socket.create_connection(address)
    try:
        silent.settimeout(5)
        started = time.monotonic()
        assert silent.recv(1) == b""  # the listener closed it
        assert 0.3 < time.monotonic() - started < 3
        assert greeter.refused == 1 and "no hello" in greeter.why
    finally:
        silent.close()
        greeter.stop()
