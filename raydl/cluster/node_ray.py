"""One local Ray per node for the ranks of a torchrun job, with no address to pass around.

NOTE [ raydl node Ray ]
Under torchrun each rank is its own process, and with no Ray running and no RAY_ADDRESS each
rank's loader would start its own local Ray: W Rays on one node, each with its own object store
and daemons, and no pool the ranks could share (`ray_job`). When torchrun's variables say this
process is one of several ranks on this node (LOCAL_RANK, LOCAL_WORLD_SIZE > 1, MASTER_ADDR,
MASTER_PORT), the ranks of the node share one local Ray instead:
  * they meet in a directory named after the job (MASTER_ADDR, MASTER_PORT, torchrun's run id
    and restart count) in the system's temp directory, under a file lock;
  * the first rank there starts the local Ray (on loopback, as raydl's own start) and writes its
    address, pid and Ray's auth mode; the others take that mode (Ray reads it when first imported,
    which raydl does only then: a script that imported Ray itself before must set RAY_AUTH_MODE)
    and connect;
  * each rank leaves a member file while it runs; the rank that started Ray keeps it up at its
    exit until the other members left (at most NODE_RAY_LINGER_S), since its process owns Ray.
An address file whose owner no longer runs (an earlier attempt that died) is replaced by a new
Ray. A launcher restart (a new restart count) meets in a new directory. RAY_ADDRESS, a
`ray_address` or a Ray already initialized in the process still win (NOTE in cluster/connect.py).
"""

from __future__ import annotations

import atexit
import fcntl
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from typing import Callable, Optional

__all__ = ["node_ray_dir", "share_node_ray"]

logger = logging.getLogger(__name__)

NODE_RAY_LINGER_S = 120.0  # how long the owner's exit waits for the other ranks of the node


def node_ray_dir() -> Optional[str]:
    """The meeting directory of this torchrun job's ranks on this node, or None when this is no such rank."""
    env = os.environ
    if not all(k in env for k in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return None
    try:
        if int(env["LOCAL_WORLD_SIZE"]) < 2:
            return None
    except ValueError:
        return None
    job = ":".join(
        env.get(k, "") for k in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")
    )
    key = hashlib.sha1(job.encode()).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), f"raydl-node-ray-{key}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def share_node_ray(start_local: Callable[[], str], connect: Callable[[str], None]) -> bool:
    """Join (or start) this node's Ray for the job's ranks; False when this process is no torchrun rank of several.

    `start_local()` starts a local Ray and returns its address; `connect(address)` joins one.
    """
    directory = node_ray_dir()
    if directory is None:
        return False
    os.makedirs(directory, exist_ok=True)
    address_file = os.path.join(directory, "address.json")
    with open(os.path.join(directory, "lock"), "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # held by one rank for a Ray start at most
        try:
            found = None
            if os.path.exists(address_file):
                with open(address_file) as f:
                    found = json.load(f)
                if not _alive(int(found["pid"])):
                    found = None
            if found is not None:
                if found.get("auth_mode") and "ray" not in sys.modules:
                    # Ray reads its auth mode once, when it is first imported: before that, in this process
                    os.environ.setdefault("RAY_AUTH_MODE", found["auth_mode"])
                connect(found["address"])
                owner = False
                logger.info("raydl: joined this node's Ray for the job's ranks at %s", found["address"])
            else:
                address = start_local()
                with open(address_file + ".tmp", "w") as f:
                    json.dump({"address": address, "pid": os.getpid(), "auth_mode": os.environ.get("RAY_AUTH_MODE")}, f)
                os.replace(address_file + ".tmp", address_file)
                owner = True
                logger.info("raydl: started this node's Ray for the job's ranks at %s", address)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    member = os.path.join(directory, f"member-{os.getpid()}")
    open(member, "w").close()
    # atexit runs last-registered first: this runs before Ray's own shutdown hook
    atexit.register(_leave, directory, member, owner)
    return True


def _leave(directory: str, member: str, owner: bool) -> None:
    try:
        os.remove(member)
    except OSError:
        pass
    if not owner:
        return
    deadline = time.monotonic() + NODE_RAY_LINGER_S
    while time.monotonic() < deadline:
        others = [n for n in os.listdir(directory) if n.startswith("member-") and _alive(int(n.split("-", 1)[1]))]
        if not others:
            break
        time.sleep(0.2)
    shutil.rmtree(directory, ignore_errors=True)  # the job's ranks on this node are done
