"""Tunable constants of raydl's driver. Every duration carries its unit in its name."""

from __future__ import annotations

# How long one `ray.wait` slice lasts before the driver re-checks deadlines and liveness.
# Short enough that a timeout or a dead worker is noticed promptly, long enough to stay off
# the CPU while waiting.
STATUS_CHECK_INTERVAL_S = 0.1

# How long the driver waits for every worker actor to be placed and to finish __init__
# (dataset deserialisation, seeding, worker_init_fn) before giving up with a placement error.
DEFAULT_STARTUP_TIMEOUT_S = 60.0

# A worker request that no node of the cluster could ever satisfy (by total resources) is
# reported after this grace period instead of the full startup timeout. The grace lets a
# node that is joining (or an autoscaler) show up first.
INFEASIBLE_GRACE_S = 10.0

# How long shutdown waits for the pin-memory thread to notice its stop event.
PIN_THREAD_JOIN_TIMEOUT_S = 5.0

# Batches handed to the pin-memory thread ahead of the one being consumed, so that pinning
# of batch k+1 overlaps the training step on batch k.
PIN_LOOKAHEAD_BATCHES = 2

# NOTE [ raydl pin copy ] in worker/transfer.py: an array of at least PIN_COPY_SPLIT_BYTES is copied into pinned
# memory by PIN_COPY_THREADS threads at once (the pin thread and helpers), each a page-aligned slice: one core's
# memcpy is below a GPU's host-to-device rate. A quarter of this process's cores, at most 4; 1 (off) on a machine
# of under 8 cores; RAYDL_PIN_COPY_THREADS sets it.
PIN_COPY_SPLIT_BYTES = 4 * 1024 * 1024


def _pin_copy_threads() -> int:
    import os

    if os.environ.get("RAYDL_PIN_COPY_THREADS"):
        return max(1, int(os.environ["RAYDL_PIN_COPY_THREADS"]))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(4, cores // 4))


PIN_COPY_THREADS = _pin_copy_threads()

# Default options of a worker actor; `ray_remote_args` overrides them key by key.
# num_cpus=0: like torch's worker processes, raydl workers do not reserve CPUs, so the
# default request always fits (a laptop with 2 cores can run a loader with 8 workers, and a
# validation loader beside a training loader). Ask for CPUs with ray_remote_args to have
# Ray reserve them (and an autoscaler add nodes for them).
# No scheduling strategy: with no placement hint raydl gives each worker its node itself
# (NOTE [ raydl placement ] in cluster/placement.py); with resources or labels but no strategy, the
# workers get "SPREAD" (_ray_utils.worker_actor_options).
DEFAULT_WORKER_OPTIONS: dict = {"num_cpus": 0}

# How many times a worker id may be replaced after its actor dies (NOTE [ raydl recovery ]).
DEFAULT_MAX_WORKER_RESTARTS = 3

# Idle worker actors kept warm for new loaders (NOTE [ raydl warm pool ]): how long one may stay
# idle (overridable with RAYDL_IDLE_WORKER_TIMEOUT_S) and how many per set of actor options.
WARM_IDLE_TIMEOUT_S = 120.0
WARM_MAX_IDLE_PER_KEY = 16
# A warm worker still running abandoned tasks this long after its loader ended is killed.
WARM_DRAIN_TIMEOUT_S = 30.0

# How long raydl tries to open a TCP connection to an explicit Ray address before reporting that
# nothing listens there (ray.init itself retries for minutes).
CONNECT_PROBE_TIMEOUT_S = 5.0

# NOTE [ raydl recovery ] stalls: with timeout=0, a batch outstanding this long, and more than
# STALL_FACTOR times the typical batch latency, is reported once with a RuntimeWarning.
STALL_WARN_MIN_S = 60.0
STALL_FACTOR = 10.0

# How often the raylet of a local Ray that raydl starts frees dropped objects (Ray's default is
# 1000 ms); only for the local Ray raydl starts itself, never for a cluster it joins.
LOCAL_FREE_OBJECTS_PERIOD_MS = 100

# NOTE [ raydl placement ]: how many times one worker is re-planned, within one wait for the
# workers to start, because its planned node left before the worker was placed there.
PLACEMENT_RETRIES = 3

# Autoscaler (NOTE [ raydl elastic pool ] in cluster/elastic.py): a decision is taken over a window of at
# least this many batches (and twice the pool's size) and this many seconds of the loop.
AUTOSCALE_WINDOW_BATCHES = 16
AUTOSCALE_WINDOW_MIN_S = 1.0
# NOTE [ raydl rebalance ]: how often an elastic pool looks whether a node joined that should take a worker (a
# ray.nodes() call and the state API's free CPUs, each ~ms)
REBALANCE_INTERVAL_S = 5.0
# Add a worker while the loop waits for data more than this fraction of its time.
AUTOSCALE_ADD_WAIT_FRACTION = 0.10
# ... and only while the workers are busy at least this fraction of the time (else the wait is latency).
AUTOSCALE_ADD_BUSY_FRACTION = 0.75
# Retire one while the loop waits less than this fraction and one worker fewer would be busy
# less than AUTOSCALE_RETIRE_BUSY_FRACTION of the time (far from the add threshold: hysteresis).
AUTOSCALE_RETIRE_WAIT_FRACTION = 0.02
AUTOSCALE_RETIRE_BUSY_FRACTION = 0.6
# An addition is undone when this many windows in a row after it show less than a quarter of
# its possible gain.
AUTOSCALE_UNDO_WINDOWS = 2

# NOTE [ raydl calls ] in driver/schedule.py: a worker's call carries as many batches as fit in this much of
# its measured batch time (a batch this long or longer goes alone: Ray's ~0.4 ms per call no longer matters) ...
CALL_TARGET_S = 0.005
# ... and never more than this many, nor more than the worker's share of the prefetch bound.
MAX_BATCHES_PER_CALL = 8
# ... and, for a worker on another node whose calls go through Ray, batches that Ray sends inline with the call's
# reply stay inline: k batches together must fit in this share of Ray's inline limit (its
# `max_direct_call_object_size`, 100 KiB unless RAY_max_direct_call_object_size says otherwise), else the call's
# object waits in the worker's node for a pull (measured on two loopback nodes, 64 KiB batches: 617 batches/s one
# a call, 147 at two).
RAY_INLINE_SHARE = 0.75
RAY_INLINE_BYTES_DEFAULT = 100 * 1024
# NOTE [ raydl lane, driver ] in driver/transport/lane.py: the longest a worker's lane may take to open (else Ray's calls) ...
LANE_OPEN_S = 10.0
# ... and the largest batch (bytes of its arrays) for which a worker gets a lane: above it, copying the batch
# through a socket costs the trainer more than Ray's call, and Ray's object store maps it without a copy
# (NOTE [ raydl zero-copy ]) ...
LANE_MAX_BATCH_BYTES = 4 * 1024 * 1024
# ... and the smallest array a lane's reply carries out of band (its own write and read; smaller ones in the pickle).
LANE_OUT_OF_BAND_BYTES = 64 * 1024
# ... and the largest slot a local lane's shared memory grows to for batches larger than its first (NOTE [ raydl lane
# memory ]): 4x the largest first batch that gets a lane. A reply larger goes over the socket; a slot's pages cost
# nothing until written, so the cap bounds address space (32 slots at most), not memory used.
LANE_MEMORY_MAX_SLOT_BYTES = 4 * LANE_MAX_BATCH_BYTES
# ... and the most calls a lane sends without slots after a reply that could not use its memory (larger than the cap,
# or refused by the plain pickler): 1 after the first such reply, doubling with each next one; a reply through the
# memory ends the pauses. The worker then skips a pickling attempt that fails (NOTE [ raydl lane memory ], pauses).
LANE_MEMORY_MAX_PAUSE = 64
# ... and, with in_order=False while some workers have lanes and others Ray's calls, the slices the driver waits
# on the lanes between looks at Ray's refs: from the first, doubling up to the last (a Ray batch waits at most one).
MIXED_WAIT_FIRST_S = 0.001
MIXED_WAIT_MAX_S = 0.016
# ... and, for a TCP lane to a worker on another node (NOTE [ raydl lane ]), when a silent peer ends it: keepalive
# probes after this long idle, this often, this many unanswered; or this long with data unacknowledged. About Ray's
# own time to declare a silent node dead (its health checks), so a vanished node ends the lane no later.
LANE_TCP_KEEPALIVE_IDLE_S = 10
LANE_TCP_KEEPALIVE_INTERVAL_S = 5
LANE_TCP_KEEPALIVE_COUNT = 3
LANE_TCP_USER_TIMEOUT_S = 30
# ... and, on such a lane, how often the worker writes at least a heartbeat (an empty message), so that the driver
# can tell a silent node from a slow batch: nothing received for `ray_silence_timeout_s` (default below, at least
# LANE_SILENCE_MIN_BEATS heartbeats long) means the node went silent (NOTE [ raydl silent node ]).
LANE_HEARTBEAT_S = 0.5
LANE_SILENCE_MIN_BEATS = 4
DEFAULT_SILENCE_TIMEOUT_S = 4.0
# A worker reached over Ray's calls: after `ray_silence_timeout_s` with nothing from it, one TCP connection to its
# node's raylet port, given this long to be answered (TCP resends a lost SYN after 1 s: one loss is forgiven).
RAYLET_PROBE_S = 1.5
# ... and, for a Ray Client driver whose probe a task on another node makes, how long past that the task may take to be
# placed and started (a new worker process for it where none is idle: about a second on a quiet node).
CLUSTER_PROBE_SLACK_S = 3.0
# ... and the longest a worker tries to connect to it (a worker's calls wait meanwhile; a node that cannot reach the
# driver's, behind a firewall, keeps Ray's calls and is not asked again by this process).
LANE_TCP_CONNECT_S = 3.0
# ... and how much of a large reply's buffer the kernel lets in before it wakes the lane's reader (SO_RCVLOWAT):
# per 38.5 MB batch on loopback, 61 reads and 17 ms of CPU at every segment, 13 reads and 12 ms at 1 MiB.
LANE_TCP_WAKE_BYTES = 1 << 20
# ... and, on the driver's listener, the longest a connection may take to prove itself (its TLS handshake, if any,
# and the lane's token) before it is dropped, and how many such connections are heard at once (a new one beyond
# drops the oldest): a stray or hostile peer on the port costs a slot for a while, never the trainer's thread.
LANE_HELLO_S = 5.0
LANE_HELLO_PENDING = 16
# NOTE [ raydl collate buffers ] in worker/collate.py: a worker stacks a batch tensor of at least this many bytes
# into memory it keeps and reuses (fresh memory costs a page fault per 4 KiB page) ...
REUSE_MIN_BYTES = 1024 * 1024
# ... keeping at most this many buffers of one dtype and shape ...
REUSE_KEEP = 2
# ... for at most this many shapes (the last used; an epoch's last batch is often smaller).
REUSE_SHAPES = 2
