"""Ray start-up and the worker actors' Ray options: the only place raydl decides how to reach Ray.

Start-up precedence (first match wins), applied on a loader's first iteration, never at
construction:
  1. an explicit `ray_address` argument,
  2. the `RAY_ADDRESS` environment variable,
  3. a Ray this process has already initialised,
  4. under torchrun with several ranks on this node: the node's Ray, started by the first of
     them (NOTE [ raydl node Ray ] in cluster/node_ray.py),
  5. a local Ray started by raydl, listening on loopback only.

The private touches of Ray in raydl are here: its loopback flag, the lock around its
automatic init (`_init_unless_connected`) and the one around its shutdown (`ray_calls`). Ray reads `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`
once, when `ray` is imported, into `ray._private.ray_constants.ENABLE_RAY_CLUSTER`; while it
is False, a local Ray binds 127.0.0.1 instead of every interface. raydl sets it (and the
environment variable, which Ray's own processes inherit) only around its own local start and
restores both afterwards, so a later connection to a real cluster is unaffected. Checked
against ray 2.60.

NOTE [ raydl worker niceness ]
Ray's worker processes add 15 to the niceness they inherit (its `worker_niceness` setting), so
under full CPU load they yield to every normal process, the trainer included; torch's worker
processes run at the trainer's niceness. A local Ray that raydl starts for this process serves
this trainer's loaders only, so raydl starts it with `worker_niceness=0`: its workers keep the
driver's niceness, as torch's do (measured by bench_niceness, retired at 3d9a662:
docs/benchmark-notes.md#retired-benchmarks). A Ray raydl joins (an address, RAY_ADDRESS, a Ray already running)
keeps its own setting, and so does a user who sets RAY_worker_niceness.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import threading
import time
from typing import Any, Iterator, Mapping, Optional

from .._constants import CONNECT_PROBE_TIMEOUT_S, DEFAULT_WORKER_OPTIONS, LOCAL_FREE_OBJECTS_PERIOD_MS
from .node_ray import share_node_ray

__all__ = [
    "ensure_ray_initialized",
    "never_connected",
    "ray_session",
    "ray_calls",
    "worker_actor_options",
    "resource_request",
    "has_placement_hints",
    "describe_placement",
    "fits_available",
]

logger = logging.getLogger(__name__)

_LOOPBACK_ENV_VAR = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
_WORKER_NICENESS_ENV_VAR = "RAY_worker_niceness"
_init_lock = threading.Lock()
RAY_CALLS_WAIT_S = 0.5  # a background path's longest wait for a connect or shutdown in another thread (`ray_calls`)
_last_session: Optional[str] = None  # the Ray session this process last used, to say when it is gone


def _shutdown_lock(ray: Any) -> Any:
    """Ray's own re-entrant lock around `ray.init`'s connect and `ray.shutdown()` (its exit hook's too), or None."""
    worker = getattr(getattr(ray, "_private", None), "worker", None)
    return getattr(worker, "_connect_or_shutdown_lock", None)


def ray_session() -> Optional[str]:
    """This process's Ray session ("GCS address/job id"), or None while Ray is not initialized.

    NOTE [ raydl no Ray behind the user's back ]
    Ray starts a brand-new local Ray (dashboard included) when a process that is not connected
    calls `ray.get`, `ray.wait`, `ray.kill`, `ray.get_actor`, `ray.get_runtime_context` or
    `.remote()`. raydl's background paths (the warm pool's reaper, the job lease renewal, the
    finalizers of collected loaders and pools, the exit hook) run whenever they run, also after
    the user's `ray.shutdown()`: each asks this function first and does nothing with Ray when it
    returns None or another session than the one its actors belong to (their handles died with
    that session). Only a loader's own iteration (or `raydl.start()`) connects, by the module's
    precedence, and it says so when Ray was shut down after this process used it.
    A background path makes its check and its calls in one `ray_calls()` block, which holds the
    lock Ray itself holds around `ray.shutdown()` (the private touch of Ray here, checked against
    Ray 2.60): a shutdown waits for the block, and no block runs during a shutdown. Ray 2.60 ends
    the process (exit status 1, "The core worker has already been shutdown") when another thread
    reaches its core worker while `ray.shutdown()` tears it down (a call, or an ObjectRef freed):
    seen once at the end of the suite, as the session fixture shut Ray down with raydl's threads
    about. So a background path also frees no ref while Ray is shutting down.
    """
    ray = sys.modules.get("ray")
    if ray is None:
        return None
    with _shutdown_lock(ray) or contextlib.nullcontext():
        if not ray.is_initialized():
            return None
        try:
            ctx = ray.get_runtime_context()  # connected: no auto-init
            return f"{ctx.gcs_address}/{ctx.get_job_id()}"
        except Exception:  # shutting down under us
            return None


@contextlib.contextmanager
def ray_calls(session: Optional[str] = None) -> Iterator[Optional[str]]:
    """Around a background path's Ray calls: yields this process's Ray session, or None when Ray is down (or, with
    `session`, is another session) or is connecting or shutting down in another thread for more than
    RAY_CALLS_WAIT_S (then the path makes no call this time); `ray.shutdown()` waits until the block ends (NOTE
    [ raydl no Ray behind the user's back ]). Keep the block short: no unbounded wait inside."""
    ray = sys.modules.get("ray")
    lock = _shutdown_lock(ray) if ray is not None else None
    if ray is None or (lock is not None and not lock.acquire(timeout=RAY_CALLS_WAIT_S)):
        yield None
        return
    try:
        now = ray_session()
        yield now if session is None or now == session else None
    finally:
        if lock is not None:
            lock.release()


def never_connected() -> bool:
    """Whether this process has neither Ray initialized nor ever used one (a cold start, NOTE [ raydl cold start ])."""
    ray = sys.modules.get("ray")
    return _last_session is None and (ray is None or not ray.is_initialized())


def ensure_ray_initialized(ray_address: Optional[str]) -> None:
    """Connect to (or start) Ray following the module's precedence; no-op when already connected.

    Raises:
        ConnectionError: `ray_address` or `RAY_ADDRESS` names no reachable Ray cluster.
    """
    global _last_session
    with _init_lock:
        ray = sys.modules.get("ray")  # not imported yet: not initialized (NOTE [ raydl node Ray ] needs it unimported)
        if ray is not None and ray.is_initialized():
            _last_session = _last_session or ray_session()
            return
        if _last_session is not None:
            how = (
                f"joining {ray_address!r} (ray_address)"
                if ray_address is not None
                else f"joining RAY_ADDRESS={os.environ['RAY_ADDRESS']!r}"
                if os.environ.get("RAY_ADDRESS")
                else "starting Ray again as on first use"
            )
            logger.warning(
                "raydl: Ray was shut down after this process used it (session %s); a loader is iterated: %s",
                _last_session,
                how,
            )
        _connect_by_precedence(ray_address)
        _last_session = ray_session()


def _connect_by_precedence(ray_address: Optional[str]) -> None:
    if ray_address is not None:
        _connect(ray_address, source="ray_address")
    elif os.environ.get("RAY_ADDRESS"):
        _connect(os.environ["RAY_ADDRESS"], source="RAY_ADDRESS")
    elif not share_node_ray(_start_local_ray, _connect_loopback):
        _start_local_ray()


def _probe(address: str, source: str) -> None:
    """Fail within CONNECT_PROBE_TIMEOUT_S when `host:port` accepts no connection (ray.init would retry for minutes)."""
    target = address[len("ray://") :] if address.startswith("ray://") else address
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit():
        return  # "auto", "local" or a form Ray resolves itself
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_PROBE_TIMEOUT_S):
            pass
    except OSError as e:
        raise ConnectionError(
            f"raydl could not reach a Ray cluster at {address!r} (given by {source}): {e}. Fix: start the "
            f"cluster (`ray start --head`), correct the address, or unset {source} to let raydl start a local Ray."
        ) from None


def _connect(address: str, source: str) -> None:
    import ray

    logger.debug("raydl: connecting to Ray at %s (from %s)", address, source)
    _probe(address, source)
    try:
        _init_unless_connected(ray, address=address)
    except (ConnectionError, TimeoutError, ValueError, RuntimeError) as e:
        raise ConnectionError(
            f"raydl could not connect to the Ray cluster at {address!r} (given by {source}): {e}. "
            "Fix: start the cluster (`ray start --head`), correct the address, or unset "
            f"{source} to let raydl start a local Ray."
        ) from None


@contextlib.contextmanager
def _loopback() -> Iterator[None]:
    """Ray's loopback flag set for what runs inside, then restored (see the module's docstring)."""
    import ray._private.ray_constants as ray_constants

    saved_flag = ray_constants.ENABLE_RAY_CLUSTER
    saved_env = os.environ.get(_LOOPBACK_ENV_VAR)
    ray_constants.ENABLE_RAY_CLUSTER = False
    os.environ[_LOOPBACK_ENV_VAR] = "0"
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved_flag
        if saved_env is None:
            os.environ.pop(_LOOPBACK_ENV_VAR, None)
        else:
            os.environ[_LOOPBACK_ENV_VAR] = saved_env


def _init_unless_connected(ray: Any, **kwargs: Any) -> None:
    """`ray.init(**kwargs)` under the lock Ray takes around its own automatic init (the second private touch of Ray
    here, checked against Ray 2.60), unless this process connected meanwhile.

    raydl may start Ray in a background thread (`raydl.start()`, a cold start: NOTE [ raydl cold start ] in
    driver/coldstart/iter.py) while the script's thread calls a Ray API that initializes Ray on first use
    (`ray.get_runtime_context()`, `ray.get`, `.remote()`): Ray checks and inits under this lock, so the script's call
    now waits for raydl's start and then uses that Ray, where two inits at once failed with Ray's "ray.init twice"
    error. And if the script's call connected first, raydl uses its Ray."""
    hook = getattr(getattr(ray, "_private", None), "auto_init_hook", None)
    lock = getattr(hook, "auto_init_lock", None)
    with lock if lock is not None else contextlib.nullcontext():
        if not ray.is_initialized():
            ray.init(**kwargs)


def _connect_loopback(address: str) -> None:
    """Join a Ray on this node's loopback (it keeps 127.0.0.1, not a routable address)."""
    with _loopback():
        _connect(address, source="this node's Ray for the job's ranks")


def _start_local_ray() -> str:
    """Start a local Ray on loopback for this process; returns its address."""
    import ray

    logger.debug("raydl: starting a local Ray on loopback")
    t0 = time.monotonic()
    with _loopback():
        # Batches are dropped at the loader's pace: free them in small, frequent batches so the
        # store never holds up to a second's worth of batches already handed out (Ray's default).
        system_config: dict[str, Any] = {"free_objects_period_milliseconds": LOCAL_FREE_OBJECTS_PERIOD_MS}
        if _WORKER_NICENESS_ENV_VAR not in os.environ:
            # Ray raises its workers' niceness by 15 (below the trainer); torch's worker processes
            # run at the trainer's. On the Ray raydl starts for this process only, keep them there
            # too (NOTE [ raydl worker niceness ]); RAY_worker_niceness, if set, still wins.
            system_config["worker_niceness"] = 0
        for attempt in range(1, LOCAL_START_ATTEMPTS + 1):
            try:
                _init_unless_connected(ray, address="local", include_dashboard=False, _system_config=system_config)
                break
            except Exception as e:
                if attempt == LOCAL_START_ATTEMPTS or not _raylet_start_timed_out(e):
                    raise
                _stop_half_started_node(e)
                logger.warning(
                    "raydl: Ray's local start timed out waiting for its raylet (Ray waits a fixed 30 s; this host "
                    "is busy); its processes are stopped and Ray is started once more (attempt %d of %d)",
                    attempt + 1,
                    LOCAL_START_ATTEMPTS,
                )
        logger.debug("raydl: local Ray up in %.2f s", time.monotonic() - t0)
    return ray.get_runtime_context().gcs_address


# NOTE [ raydl local start retry ]
# Ray's own start waits a fixed 30 s for the new raylet to register with the GCS (ray/_private/node.py, not
# configurable in Ray 2.60) and raises a bare Exception past it. On an overloaded host (2 cores beside two CPU
# spinners, a laptop compiling) that wait was exceeded once in a hundred starts: the user's first loader failed with
# no fault of theirs. raydl retries that one failure, and only it: the half-started node's processes (GCS, raylet,
# reaper), which Ray leaves running when its Node constructor raises, are found through the traceback's frame and
# killed first, so two Rays never share the host. Any other start error propagates unchanged.
LOCAL_START_ATTEMPTS = 2
_RAYLET_TIMEOUT_TEXT = "The current node timed out during startup"


def _raylet_start_timed_out(error: BaseException) -> bool:
    return _RAYLET_TIMEOUT_TEXT in str(error)


def _stop_half_started_node(error: BaseException) -> None:
    """Kill the processes of the Ray node whose constructor raised `error` (Ray keeps no handle to it)."""
    try:
        from ray._private.node import Node
    except ImportError:  # pragma: no cover - a Ray without that module
        return
    tb = error.__traceback__
    while tb is not None:
        node = tb.tb_frame.f_locals.get("self")
        if isinstance(node, Node):
            try:
                node.kill_all_processes(check_alive=False, allow_graceful=False, wait=True)
            except Exception as kill_error:  # the next start is still worth a try
                logger.warning("raydl: could not stop the half-started Ray node: %s", kill_error)
            return
        tb = tb.tb_next


def worker_actor_options(ray_remote_args: Optional[Mapping[str, Any]]) -> dict:
    """raydl's default worker options overridden, key by key, by the user's `ray_remote_args` (no per-node strategy)."""
    options = dict(DEFAULT_WORKER_OPTIONS)
    if ray_remote_args:
        options.update(ray_remote_args)
    # Hints but no strategy: Ray spreads resource-reserving actors well. Without hints raydl
    # places each worker itself (NOTE [ raydl placement ]).
    if has_placement_hints(options) and options.get("scheduling_strategy") is None:
        options["scheduling_strategy"] = "SPREAD"
    # The driver owns recovery and ordering; a worker must never run two fetches at once.
    options.setdefault("max_concurrency", 1)
    return options


def resource_request(options: Mapping[str, Any]) -> dict[str, float]:
    """The resources one worker asks Ray for, in the names `ray.nodes()` uses."""
    request: dict[str, float] = {}
    for key, name in (("num_cpus", "CPU"), ("num_gpus", "GPU"), ("memory", "memory")):
        value = options.get(key)
        if value:
            request[name] = float(value)
    for name, value in (options.get("resources") or {}).items():
        if value:
            request[name] = float(value)
    return request


def has_placement_hints(options: Mapping[str, Any]) -> bool:
    """Whether worker actor options say where workers go: resources beyond num_cpus=0, a label_selector or a strategy.

    raydl's defaults carry none of these, so on the merged options this is a question about the
    user's `ray_remote_args`.
    """
    return bool(
        resource_request(options) or options.get("label_selector") or options.get("scheduling_strategy") is not None
    )


def _fits(request: Mapping[str, float], resources: Mapping[str, float]) -> bool:
    return all(resources.get(name, 0.0) >= amount for name, amount in request.items())


def fits_available(request: Mapping[str, float]) -> bool:
    """Whether the cluster has `request` free now (`ray.available_resources()`, summed over nodes)."""
    import ray

    return _fits(request, ray.available_resources())


def describe_placement(options: Mapping[str, Any], num_pending: int, num_workers: int) -> tuple[bool, str]:
    """Whether any alive node could ever host one worker, and a message naming the shortfall and the fix."""
    import ray

    request = resource_request(options)
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    feasible = any(_fits(request, n.get("Resources", {})) for n in nodes)
    available = ray.available_resources()
    total = ray.cluster_resources()
    shown = sorted(set(request) | {"CPU"})
    fmt = lambda res: "{" + ", ".join(f"{k}: {res.get(k, 0):g}" for k in shown) + "}"  # noqa: E731
    label = options.get("label_selector")
    label_note = f" and label_selector={label!r}" if label else ""
    asks = f"each asks for {fmt(request)}{label_note}"
    where = f"Cluster total {fmt(total)}, available {fmt(available)} across {len(nodes)} node(s)"
    if feasible and not label and _fits(request, available):
        # Resources are free: what is missing is the worker processes themselves.
        msg = (
            f"{num_pending} of {num_workers} raydl workers did not start: {asks} and the cluster has that "
            f"free, but Ray has not got their processes running. The node may be overloaded, or worker "
            f"processes fail while starting (see the worker-*.err and raylet.out logs in the Ray session's "
            f"logs directory, /tmp/ray/session_latest/logs by default). {where}. Fix what the logs show, or "
            "raise ray_startup_timeout_s if start-up is just slow."
        )
        return feasible, msg
    why = (
        "no node of the cluster has that much in total"
        if not feasible
        else "the cluster has it in total but not free now (other actors or loaders hold it)"
    )
    msg = (
        f"{num_pending} of {num_workers} raydl workers could not be placed: {asks}; {why}. {where}. "
        "Fix: lower the request in ray_remote_args (e.g. {'num_cpus': 0.5}), use fewer num_workers, add "
        "nodes with those resources, or raise ray_startup_timeout_s if nodes are still joining."
    )
    return feasible, msg
