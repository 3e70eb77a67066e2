#!/usr/bin/env bash
# A real multi-node Ray cluster on this one machine, for trying raydl's placement options
# (ray_remote_args resources / scheduling) without a cloud account.
#
#   cluster/local_launcher.sh start N   head node {"trainer": 1} + N worker nodes {"data": 4}
#   cluster/local_launcher.sh stop      stop the nodes this script started, and nothing else
#   cluster/local_launcher.sh status    are they running, and what the cluster holds
#   cluster/local_launcher.sh address   the address a driver connects to (127.0.0.1:6390)
#
# Every node is a separate `ray start` (its own raylet, object store and agents) joined to
# one head. What this script guarantees, and how:
#
#   * Loopback only. Every process it starts listens on 127.0.0.1, never on a routable
#     interface (`status` re-checks it with `ss`). Stock `ray start` cannot do that on Linux:
#     it rewrites `--node-ip-address=127.0.0.1` (and `--address=127.0.0.1:...`) to the
#     machine's routable IP (ray._private.services.resolve_ip_for_localhost), and a node
#     whose IP is not loopback binds its gRPC servers on every interface. The only public
#     switch that keeps 127.0.0.1, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, makes a worker
#     node's `ray start` refuse to join. So the script runs Ray's own CLI entry point
#     (ray.scripts.scripts:main, what the `ray` command runs) with that one rewrite turned
#     off, and removes RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER from its environment.
#     Checked against ray 2.60.0.
#     Drivers must connect directly (ray.init / raydl's ray_address); Ray Client (ray://)
#     and `ray job submit` entrypoints hit the same rewrite inside Ray and do not work here.
#   * No collision with another Ray on the machine: its own temp dir ($RAYDL_CLUSTER_DIR,
#     default /tmp/raydl-cluster), GCS on 6390 (not 6379), Ray Client on 6391 (not 10001),
#     autoscaler and dashboard metrics on 6392/6393 (not 44217/44227), dashboard on
#     127.0.0.1:8290 (not 8265), dashboard agent of node i on 6400+i (not 52365); every
#     other port is picked free by the kernel.
#   * Token authentication (Ray 2.60): every node runs with RAY_AUTH_MODE=token and the
#     token Ray finds for this user: $RAY_AUTH_TOKEN, else the file $RAY_AUTH_TOKEN_PATH,
#     else ~/.ray/auth_token (created with `ray get-auth-token --generate` if missing,
#     never overwritten). Drivers need the same mode and token; `start` prints the exports.
#   * `stop` never runs `ray stop` (which kills every Ray of every user on the machine). It
#     signals only processes whose environment carries RAYDL_LOCAL_CLUSTER_DIR=<this dir>
#     (set on every `ray start` here) or Ray daemons whose command line names this
#     cluster's temp dir, their descendants, and the process groups `start` created for
#     them with setsid; never its caller or the caller's process group.
#
# Connecting a driver (from this machine only):
#   export RAY_AUTH_MODE=token                 # plus RAY_AUTH_TOKEN(_PATH) if you use one
#   export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 # a driver on Linux would otherwise also
#                                              # rewrite 127.0.0.1 to the routable IP
#   python -c 'import ray; ray.init(address="127.0.0.1:6390"); print(ray.nodes())'
#
# Settings (environment variables, all optional):
#   RAYDL_CLUSTER_DIR (/tmp/raydl-cluster)  RAYDL_CLUSTER_PORT (6390)
#   RAYDL_CLUSTER_DASHBOARD_PORT (8290)     RAYDL_CLUSTER_HEAD_CPUS (1)
#   RAYDL_CLUSTER_DATA_CPUS (2)             RAYDL_CLUSTER_DATA_SLOTS (4: the "data" resource per worker node)
#   RAYDL_CLUSTER_OBJECT_STORE_BYTES (200000000 per node)
#   RAYDL_CLUSTER_START_TIMEOUT_S (300 per `ray start`: a loaded 2-core machine needs minutes)  RAYDL_CLUSTER_STOP_GRACE_S (8)
#   RAYDL_CLUSTER_PYTHON (python3, else python: the interpreter Ray is installed in)

set -euo pipefail

CLUSTER_DIR="${RAYDL_CLUSTER_DIR:-/tmp/raydl-cluster}"
RAY_TEMP_DIR="$CLUSTER_DIR/ray"          # Ray's --temp-dir per node: ray/head, ray/w1, ...
STATE_DIR="$CLUSTER_DIR/state"           # this script's own files: ray start output, address
HEAD_PORT="${RAYDL_CLUSTER_PORT:-6390}"
CLIENT_PORT=$((HEAD_PORT + 1))
AUTOSCALER_METRIC_PORT=$((HEAD_PORT + 2))   # Ray's defaults (44217, 44227) are fixed ports
DASHBOARD_METRIC_PORT=$((HEAD_PORT + 3))    # that any other Ray on the machine also takes
AGENT_PORT_BASE=$((HEAD_PORT + 10))      # node i (0 = head) serves its dashboard agent on base + i
DASHBOARD_PORT="${RAYDL_CLUSTER_DASHBOARD_PORT:-8290}"
HEAD_CPUS="${RAYDL_CLUSTER_HEAD_CPUS:-1}"
DATA_CPUS="${RAYDL_CLUSTER_DATA_CPUS:-2}"
DATA_SLOTS="${RAYDL_CLUSTER_DATA_SLOTS:-4}"
OBJECT_STORE_BYTES="${RAYDL_CLUSTER_OBJECT_STORE_BYTES:-200000000}"
START_TIMEOUT_S="${RAYDL_CLUSTER_START_TIMEOUT_S:-300}"
STOP_GRACE_S="${RAYDL_CLUSTER_STOP_GRACE_S:-8}"
MAX_WORKER_NODES=16
ADDRESS="127.0.0.1:$HEAD_PORT"

die() { echo "local_launcher.sh: $*" >&2; exit 1; }

find_python() {
    local candidate
    for candidate in "${RAYDL_CLUSTER_PYTHON:-}" python3 python; do
        [[ -n "$candidate" ]] || continue
        if command -v "$candidate" >/dev/null 2>&1 &&
            "$candidate" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("ray") is None)' 2>/dev/null; then
            echo "$candidate"
            return 0
        fi
    done
    die "no Python with Ray installed found (set RAYDL_CLUSTER_PYTHON)"
}
PY="$(find_python)"

# Ray's CLI (`ray ...`), except that 127.0.0.1 stays 127.0.0.1 (see the header).
read -r -d '' RAY_CLI <<'EOF' || true
import sys
import ray._private.services as services
if not hasattr(services, "resolve_ip_for_localhost"):
    sys.exit("local_launcher.sh: this Ray has no services.resolve_ip_for_localhost; "
             "the loopback-only start is only checked against ray 2.60")
services.resolve_ip_for_localhost = lambda host: host
from ray.scripts.scripts import main
sys.argv[0] = "ray"
sys.exit(main())
EOF

# Finds, lists and signals this cluster's processes. Usage: procs {pids|stop GRACE_S|listeners}
read -r -d '' PROCS <<'EOF' || true
import os, signal, subprocess, sys, time

cluster_dir = os.path.realpath(os.environ["RAYDL_LOCAL_CLUSTER_DIR_QUERY"])
marker = ("RAYDL_LOCAL_CLUSTER_DIR=" + cluster_dir).encode()
needle = (cluster_dir + "/ray/").encode()    # Ray's --temp-dir, with its separator

def read(path):
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""

def snapshot():
    procs = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        stat = read(f"/proc/{pid}/stat")
        if not stat:
            continue
        fields = stat[stat.rfind(b")") + 2:].split()
        state, ppid, pgid, sid = fields[0], int(fields[1]), int(fields[2]), int(fields[3])
        procs[pid] = dict(state=state, ppid=ppid, pgid=pgid, sid=sid,
                          cmdline=read(f"/proc/{pid}/cmdline"),
                          environ=read(f"/proc/{pid}/environ"))
    return procs

def is_ray(cmdline):
    """A Ray daemon (gcs_server, raylet, or Python running Ray's own code), not e.g. `less` on a log."""
    argv = cmdline.split(b"\0")
    if os.path.basename(argv[0]) in (b"gcs_server", b"raylet"):
        return True
    return any(b"-packages/ray/" in a or a.startswith(b"ray.") for a in argv[1:4])

def ours(procs):
    protected = set()
    pid = os.getpid()
    while pid in procs and pid not in protected:      # this helper and everything above it
        protected.add(pid)
        pid = procs[pid]["ppid"]
    protected_groups = {procs[p]["pgid"] for p in protected} | {procs[p]["sid"] for p in protected}
    live = {p: i for p, i in procs.items() if i["state"] != b"Z"}
    seeds = {p for p, i in live.items()
             if marker in i["environ"].split(b"\0") or (needle in i["cmdline"] and is_ray(i["cmdline"]))}
    found = set(seeds)
    # Descendants: ray::* processes rename themselves and lose both markers.
    children = {}
    for p, i in live.items():
        children.setdefault(i["ppid"], []).append(p)
    stack = list(seeds)
    while stack:
        for c in children.get(stack.pop(), []):
            if c not in found:
                found.add(c)
                stack.append(c)
    # Process groups that `start` created with setsid (group == session), led by our
    # processes' group id, and never the caller's own group or session.
    groups = {live[p]["pgid"] for p in seeds
              if live[p]["pgid"] == live[p]["sid"] and live[p]["pgid"] not in protected_groups}
    found |= {p for p, i in live.items() if i["pgid"] in groups}
    return sorted(found - protected)

def listeners(pids):
    """(pid, local address) of every listening TCP socket of `pids`, from `ss`."""
    try:
        out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        sys.exit(f"cannot run ss to check listening addresses: {e}")
    wanted, result = set(pids), []
    for line in out.splitlines():
        cols = line.split()
        if len(cols) < 4:
            continue
        for part in line.split("pid=")[1:]:
            pid = int(part.split(",")[0])
            if pid in wanted:
                result.append((pid, cols[3]))
    return result

def is_loopback(local):
    host = local.rsplit(":", 1)[0].strip("[]")
    if host.startswith("::ffff:"):
        host = host[len("::ffff:"):]
    return host.startswith("127.") or host == "::1"

cmd = sys.argv[1]
if cmd == "pids":
    print(" ".join(map(str, ours(snapshot()))))
elif cmd == "listeners":
    pids = ours(snapshot())
    bad = 0
    for pid, local in sorted(set(listeners(pids)), key=lambda x: (x[1], x[0])):
        ok = is_loopback(local)
        bad += not ok
        print(f"  {'ok ' if ok else 'NOT LOOPBACK'} {local:<28} pid {pid}")
    sys.exit(1 if bad else 0)
elif cmd == "stop":
    grace = float(sys.argv[2])
    pids = ours(snapshot())
    if not pids:
        print("no process of this cluster is running")
        sys.exit(0)
    print(f"stopping {len(pids)} processes: {' '.join(map(str, pids))}")

    def name(snap, pid):
        return os.path.basename(snap[pid]["cmdline"].split(b"\0")[0]).decode(errors="replace")

    def terminate(select, sig, timeout):
        """Send `sig` once to each selected process of ours; poll until they are gone or `timeout`."""
        sent, deadline = set(), time.monotonic() + timeout
        while True:
            snap = snapshot()    # re-derived each round: never signal a recycled pid
            live = [p for p in ours(snap) if select(snap, p)]
            if not live or time.monotonic() > deadline:
                return sorted({name(snap, p) for p in live if p in snap})
            for pid in live:
                if pid not in sent:
                    sent.add(pid)
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        pass
            time.sleep(0.2)

    # Raylets, workers and agents first, while the GCS they deregister from is still up
    # (they exit promptly then); the GCS and the head's other daemons after them.
    terminate(lambda snap, p: name(snap, p) != "gcs_server", signal.SIGTERM, grace)
    left = terminate(lambda snap, p: True, signal.SIGTERM, grace)
    if left:
        print(f"still alive after SIGTERM ({', '.join(left)}): SIGKILL")
        left = terminate(lambda snap, p: True, signal.SIGKILL, 10)
        if left:
            sys.exit(f"still alive after SIGKILL: {', '.join(left)}")
    print("stopped")
EOF

procs() { RAYDL_LOCAL_CLUSTER_DIR_QUERY="$CLUSTER_DIR" "$PY" -c "$PROCS" "$@"; }

# The environment of every `ray start`: token auth on, no loopback switch, no inherited
# cluster address, and the marker `stop` looks for.
ray_env() {
    env -u RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER -u RAY_ADDRESS \
        RAY_AUTH_MODE=token \
        RAY_USAGE_STATS_ENABLED=0 \
        AUTOSCALER_METRIC_PORT="$AUTOSCALER_METRIC_PORT" \
        DASHBOARD_METRIC_PORT="$DASHBOARD_METRIC_PORT" \
        RAYDL_LOCAL_CLUSTER_DIR="$(realpath -m "$CLUSTER_DIR")" \
        "$@"
}

# Makes sure a token exists where Ray will look, and says where (never prints the token).
ensure_token() {
    if [[ -n "${RAY_AUTH_TOKEN:-}" ]]; then
        TOKEN_SOURCE="\$RAY_AUTH_TOKEN (from your environment)"
        TOKEN_EXPORT="export RAY_AUTH_TOKEN=...   # the same token"
    elif [[ -n "${RAY_AUTH_TOKEN_PATH:-}" ]]; then
        [[ -s "$RAY_AUTH_TOKEN_PATH" ]] || die "RAY_AUTH_TOKEN_PATH=$RAY_AUTH_TOKEN_PATH is missing or empty"
        TOKEN_SOURCE="$RAY_AUTH_TOKEN_PATH (\$RAY_AUTH_TOKEN_PATH)"
        TOKEN_EXPORT="export RAY_AUTH_TOKEN_PATH=$RAY_AUTH_TOKEN_PATH"
    else
        local default_token="$HOME/.ray/auth_token"
        if [[ ! -s "$default_token" ]]; then
            echo "no Ray auth token yet: generating $default_token"
            ray_env "$PY" -c "$RAY_CLI" get-auth-token --generate >/dev/null
            [[ -s "$default_token" ]] || die "could not create $default_token"
        fi
        TOKEN_SOURCE="$default_token"
        TOKEN_EXPORT=""
    fi
}

port_in_use() {
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

# ray_start NAME ARGS...: one `ray start` in its own session (setsid), bounded in time, with
# Ray's temp dir $RAY_TEMP_DIR/NAME and its output in $STATE_DIR/NAME.log.
ray_start() {
    local name="$1" log="$STATE_DIR/$1.log"
    shift
    if ! ray_env timeout --kill-after=10 "$START_TIMEOUT_S" setsid "$PY" -c "$RAY_CLI" start "$@" \
            --node-ip-address=127.0.0.1 \
            --temp-dir="$RAY_TEMP_DIR/$name" \
            --object-store-memory="$OBJECT_STORE_BYTES" \
            --disable-usage-stats \
            </dev/null >"$log" 2>&1; then
        echo "---- last lines of $log ----" >&2
        tail -n 25 "$log" >&2 || true
        return 1
    fi
}

# start_nodes N: the head, then N worker nodes in parallel; returns 1 (nothing stopped) if any `ray start` failed.
start_nodes() {
    local n="$1"
    echo "starting head node: {\"trainer\": 1}, $HEAD_CPUS CPU, GCS on $ADDRESS"
    if ! ray_start head --head \
            --port="$HEAD_PORT" \
            --ray-client-server-port="$CLIENT_PORT" \
            --dashboard-host=127.0.0.1 --dashboard-port="$DASHBOARD_PORT" \
            --dashboard-agent-listen-port="$AGENT_PORT_BASE" \
            --num-cpus="$HEAD_CPUS" --num-gpus=0 \
            --resources='{"trainer": 1}'; then
        return 1
    fi
    # Worker nodes start in parallel, each with a temp dir of its own (no shared socket names).
    local i failed="" pids=()
    for ((i = 1; i <= n; i++)); do
        echo "starting worker node $i/$n: {\"data\": $DATA_SLOTS}, $DATA_CPUS CPU"
        ray_start "w$i" \
            --address="$ADDRESS" \
            --dashboard-agent-listen-port=$((AGENT_PORT_BASE + i)) \
            --num-cpus="$DATA_CPUS" --num-gpus=0 \
            --resources="{\"data\": $DATA_SLOTS}" &
        pids+=($!)
    done
    for i in "${!pids[@]}"; do
        wait "${pids[$i]}" || failed+=" $((i + 1))"
    done
    if [[ -n "$failed" ]]; then
        echo "local_launcher.sh: worker node(s)$failed did not start" >&2
        return 1
    fi
}

cmd_start() {
    local n="${1:-}"
    [[ "$n" =~ ^[0-9]+$ ]] && ((n <= MAX_WORKER_NODES)) \
        || die "usage: local_launcher.sh start N   (N worker nodes, 0..$MAX_WORKER_NODES)"
    local tool
    for tool in ss setsid timeout; do
        command -v "$tool" >/dev/null || die "needs '$tool' (ss checks that every node listens on loopback only)"
    done
    # Ray's unix sockets live at <temp dir>/wNN/session_<date>_<pid>/sockets/plasma_store,
    # and a socket path must fit 107 bytes.
    (($(realpath -m "$RAY_TEMP_DIR" | wc -c) <= 40)) \
        || die "RAYDL_CLUSTER_DIR=$CLUSTER_DIR is too long for Ray's socket paths (keep it under ~35 characters)"
    [[ -z "$(procs pids)" ]] || die "a cluster from $CLUSTER_DIR is already running; run 'local_launcher.sh stop' first"
    local port
    for port in "$HEAD_PORT" "$CLIENT_PORT" "$AUTOSCALER_METRIC_PORT" "$DASHBOARD_METRIC_PORT" \
            "$DASHBOARD_PORT" $(seq "$AGENT_PORT_BASE" $((AGENT_PORT_BASE + n))); do
        ! port_in_use "$port" \
            || die "port $port on 127.0.0.1 is in use (set RAYDL_CLUSTER_PORT / RAYDL_CLUSTER_DASHBOARD_PORT)"
    done
    ensure_token
    mkdir -p "$STATE_DIR" "$RAY_TEMP_DIR"
    rm -f "$STATE_DIR"/*.log "$STATE_DIR/address"
    rm -rf "${RAY_TEMP_DIR:?}"/head "${RAY_TEMP_DIR:?}"/w[0-9]*   # logs of the previous run

    local attempt
    for attempt in 1 2; do
        start_nodes "$n" && break
        cmd_stop >/dev/null || true
        # NOTE [ launcher start retry ]: Ray's `ray start` waits a fixed 30 s for its new raylet to register and
        # then gives up with "The current node timed out during startup", leaving what it started running. On a
        # busy host that is load, not a fault: stop everything this cluster started and start once more, keeping
        # the first attempt's logs. Any other failure ends the start.
        if ((attempt == 1)) && grep -qs "timed out during startup" "$STATE_DIR"/*.log; then
            local log
            for log in "$STATE_DIR"/*.log; do mv "$log" "${log%.log}.attempt1.log"; done
            echo "Ray's raylet wait ran out (a busy host): stopped this cluster's processes, retrying (attempt 2 of 2)"
            continue
        fi
        die "the cluster did not start (logs in $STATE_DIR)"
    done
    if ! procs listeners >"$STATE_DIR/listeners.txt"; then
        cat "$STATE_DIR/listeners.txt" >&2
        cmd_stop >/dev/null || true
        die "a process of this cluster listens on a non-loopback address; stopped everything"
    fi
    echo "$ADDRESS" >"$STATE_DIR/address"
    cat <<EOF
Ray cluster up: 1 head + $n worker nodes on 127.0.0.1 (temp dir $RAY_TEMP_DIR,
dashboard http://127.0.0.1:$DASHBOARD_PORT). Token: $TOKEN_SOURCE.
A driver on this machine must export:
  export RAY_AUTH_MODE=token
${TOKEN_EXPORT:+  $TOKEN_EXPORT
}  export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0   # keeps ray.init from rewriting 127.0.0.1
  export RAY_ADDRESS=$ADDRESS             # or raydl.DataLoader(..., ray_address="$ADDRESS")
Stop it with: $0 stop
EOF
}

cmd_stop() {
    procs stop "$STOP_GRACE_S"
    rm -f "$STATE_DIR/address"
}

cmd_status() {
    local pids
    pids="$(procs pids)"
    if [[ -z "$pids" ]]; then
        echo "not running (no process of $CLUSTER_DIR)"
        return 3
    fi
    echo "running: $(wc -w <<<"$pids") processes, address $ADDRESS"
    echo "listening sockets (all must be loopback):"
    procs listeners || echo "WARNING: a process of this cluster listens on a non-loopback address"
    ray_env timeout 60 "$PY" -c "$RAY_CLI" status --address="$ADDRESS" || true
}

case "${1:-}" in
    start) shift; cmd_start "$@" ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
    address) echo "$ADDRESS" ;;
    *) echo "usage: $0 {start N|stop|status|address}" >&2; exit 2 ;;
esac
