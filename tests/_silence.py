"""Silent-node helpers for tests on one node: workers reported on another node, and that node's raylet probe told
what to answer (NOTE [ raydl silent node ])."""

from __future__ import annotations

import contextlib
import os
import signal


@contextlib.contextmanager
def frozen(pid: int):
    """The process stopped (SIGSTOP) inside the block: it holds its connections open and sends nothing."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        try:
            os.kill(pid, signal.SIGCONT)  # (killed by its replacement's start already, normally)
        except ProcessLookupError:
            pass


def workers_on_another_node(monkeypatch, probe: bool = True) -> tuple[dict, list]:
    """Every started worker is reported on "another-node"; with `probe`, the raylet probe of a node answers
    `verdicts[node]` ("answers" at first) and records the nodes it was asked about in `asked`."""
    from raydl.driver.transport import calls as C
    from raydl.driver.transport import lane as L
    from raydl.driver.transport import ray_silence as RS

    real = L.worker_node

    def fake(pool, w):
        return None if real(pool, w) is None else "another-node"

    monkeypatch.setattr(L, "worker_node", fake)
    verdicts = {"another-node": "answers"}
    asked: list = []
    if probe:
        monkeypatch.setattr(C, "worker_node", fake)

        def reach(node, timeout_s):
            asked.append(node)
            return verdicts.get(node, "unknown")

        monkeypatch.setattr(RS, "reach_raylet", reach)
    return verdicts, asked
