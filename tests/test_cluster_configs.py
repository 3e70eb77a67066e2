"""cluster/: the AWS launcher and KubeRay configs, and the local multi-node cluster script.

The YAML tests only parse files (and run Ray's own launcher schema offline). The one `cluster`
test starts a real 3-node Ray on loopback with cluster/local_launcher.sh and stops it; deselect
it with `-m "not cluster"`. It never uses the suite's `ray_session` fixture.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import ray
import yaml

from tests._session import ENV_AT_START, background_call, run_command

CLUSTER_DIR = Path(__file__).resolve().parent.parent / "cluster"
AWS_YAML = CLUSTER_DIR / "aws-gpu-head-cpu-data.yaml"
KUBERAY_YAML = CLUSTER_DIR / "kuberay-raycluster.yaml"
LOCAL_SCRIPT = CLUSTER_DIR / "local_launcher.sh"

RAY_VERSION = ray.__version__
GPU_INSTANCE_FAMILIES = ("g4dn", "g5", "g6", "g6e", "p3", "p4d", "p5")


def _load(path: Path):
    with open(path) as f:
        return yaml.safe_load(f)


@pytest.fixture(scope="module")
def aws():
    return _load(AWS_YAML)


@pytest.fixture(scope="module")
def kuberay():
    return _load(KUBERAY_YAML)


def _aws_types(aws):
    head_type = aws["head_node_type"]
    (worker_type,) = [t for t in aws["available_node_types"] if t != head_type]
    return aws["available_node_types"][head_type], aws["available_node_types"][worker_type]


def _pip_installs(commands):
    return [c for c in commands if "pip install" in c]


# ---------------------------------------------------------------- AWS cluster launcher


def test_aws_has_required_fields_and_two_node_types(aws):
    """The launcher config names the cluster, an AWS provider, and exactly a head type and one worker type."""
    assert aws["cluster_name"]
    assert aws["provider"]["type"] == "aws" and aws["provider"]["region"]
    assert aws["head_node_type"] in aws["available_node_types"]
    assert len(aws["available_node_types"]) == 2
    assert aws["auth"]["ssh_user"]


def test_aws_head_is_a_gpu_trainer_node_without_data(aws):
    """The head is a GPU instance in the GPU image, carries {"trainer": 1} and no "data" resource."""
    head, _ = _aws_types(aws)
    assert head["node_config"]["InstanceType"].split(".")[0] in GPU_INSTANCE_FAMILIES
    assert head["resources"]["trainer"] == 1
    assert "data" not in head["resources"]
    assert aws["docker"]["head_image"].endswith("-gpu")
    assert any("--gpus" in opt for opt in aws["docker"]["head_run_options"])


def test_aws_data_workers_are_cpu_only_and_autoscale_0_to_8(aws):
    """The worker type is a non-GPU instance with a "data" resource, min_workers 0 and max_workers 8."""
    head, worker = _aws_types(aws)
    assert worker["node_config"]["InstanceType"].split(".")[0] not in GPU_INSTANCE_FAMILIES
    assert worker["min_workers"] == 0 and worker["max_workers"] == 8
    assert aws["max_workers"] >= worker["max_workers"]
    assert worker["resources"]["data"] >= 1
    assert "GPU" not in worker["resources"] and "trainer" not in worker["resources"]
    assert aws["docker"]["worker_image"].endswith("-cpu")


def test_aws_pins_the_installed_ray_version(aws):
    """Both docker images, the version check and the pip pins all name the installed Ray's version."""
    for key in ("head_image", "worker_image"):
        assert aws["docker"][key].startswith(f"rayproject/ray:{RAY_VERSION}-"), aws["docker"][key]
    assert any(f"'{RAY_VERSION}'" in c and "ray.__version__" in c for c in aws["setup_commands"])
    for key in ("head_setup_commands", "worker_setup_commands"):
        assert any(f"ray[default]=={RAY_VERSION}" in c for c in aws[key]), key


def test_aws_installs_raydl_on_every_node_type(aws):
    """Setup commands run on the head and on data nodes both pip-install raydl (and torch)."""
    for key in ("head_setup_commands", "worker_setup_commands"):
        installs = _pip_installs(aws["setup_commands"] + aws[key])
        assert any("raydl" in c for c in installs), key
        assert any("torch" in c for c in installs), key
    # Data nodes get the CPU build of torch.
    assert any("whl/cpu" in c for c in aws["worker_setup_commands"])


def test_aws_token_auth_reaches_every_node_and_ray_start(aws):
    """The token file is file-mounted to every node, and every ray start runs with RAY_AUTH_MODE=token."""
    assert aws["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        starts = [c for c in aws[key] if "ray start" in c]
        assert starts, key
        assert all("RAY_AUTH_MODE=token" in c for c in starts), key
    assert any("export RAY_AUTH_MODE=token" in c and ".bashrc" in c for c in aws["setup_commands"])


def test_aws_config_passes_rays_launcher_validation(aws):
    """Ray's own launcher preparation and schema validation (offline) accept the config and reject a broken copy."""
    pytest.importorskip("jsonschema", reason="Ray's launcher validation needs jsonschema")
    try:
        from ray.autoscaler._private.util import prepare_config, validate_config
    except ImportError as e:
        pytest.skip(f"Ray's launcher validation is not importable offline here: {e}")
    prepared = prepare_config(copy.deepcopy(aws))
    validate_config(prepared)
    # The merged per-type setup commands (what really runs on each node) install raydl.
    assert any("raydl" in c for c in _pip_installs(prepared["head_setup_commands"]))
    assert any("raydl" in c for c in _pip_installs(prepared["worker_setup_commands"]))
    broken = copy.deepcopy(prepared)
    broken["not_a_launcher_field"] = 1
    with pytest.raises(Exception):  # noqa: B017 (Ray's validator raises its schema library's own error)
        validate_config(broken)


# ---------------------------------------------------------------- KubeRay


def _containers(kuberay):
    head = kuberay["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
    workers = [c for g in kuberay["spec"]["workerGroupSpecs"] for c in g["template"]["spec"]["containers"]]
    return head, workers


def _start_resources(group) -> dict:
    """KubeRay's rayStartParams.resources: a JSON object inside a JSON string."""
    raw = group["rayStartParams"]["resources"]
    value = json.loads(raw)
    return json.loads(value) if isinstance(value, str) else value


def test_kuberay_is_a_raycluster_on_the_installed_ray(kuberay):
    """kind RayCluster, apiVersion ray.io/v1, rayVersion and every image tag equal the installed Ray's version."""
    assert kuberay["apiVersion"] == "ray.io/v1"
    assert kuberay["kind"] == "RayCluster"
    assert kuberay["metadata"]["name"]
    assert kuberay["spec"]["rayVersion"] == RAY_VERSION
    head, workers = _containers(kuberay)
    for c in head + workers:
        assert re.fullmatch(rf"rayproject/ray:{re.escape(RAY_VERSION)}-py311(-\w+)?", c["image"]), c["image"]


def test_kuberay_head_has_a_gpu_and_the_trainer_resource(kuberay):
    """The head container requests and limits one nvidia.com/gpu and ray start gets {"trainer": 1}, no "data"."""
    group = kuberay["spec"]["headGroupSpec"]
    (head,) = group["template"]["spec"]["containers"]
    assert str(head["resources"]["limits"]["nvidia.com/gpu"]) == "1"
    assert str(head["resources"]["requests"]["nvidia.com/gpu"]) == "1"
    assert _start_resources(group) == {"trainer": 1}


def test_kuberay_data_group_is_cpu_only_and_autoscales_0_to_8(kuberay):
    """One worker group "data": no GPU, min 0 / max 8 replicas, in-tree autoscaling, one "data" unit per CPU."""
    spec = kuberay["spec"]
    assert spec["enableInTreeAutoscaling"] is True
    (group,) = spec["workerGroupSpecs"]
    assert group["groupName"] == "data"
    assert group["minReplicas"] == 0 and group["maxReplicas"] == 8
    (container,) = group["template"]["spec"]["containers"]
    for section in ("limits", "requests"):
        assert "nvidia.com/gpu" not in container["resources"].get(section, {})
    resources = _start_resources(group)
    assert set(resources) == {"data"}
    assert resources["data"] == int(container["resources"]["limits"]["cpu"])


def test_kuberay_token_auth_on_every_container_and_the_autoscaler(kuberay):
    """Head, data workers and the autoscaler sidecar all get RAY_AUTH_MODE=token and RAY_AUTH_TOKEN from one Secret."""
    head, workers = _containers(kuberay)
    env_lists = [c["env"] for c in head + workers] + [kuberay["spec"]["autoscalerOptions"]["env"]]
    secrets = set()
    for env in env_lists:
        by_name = {e["name"]: e for e in env}
        assert by_name["RAY_AUTH_MODE"]["value"] == "token"
        ref = by_name["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
        secrets.add((ref["name"], ref["key"]))
    assert len(secrets) == 1


def test_kuberay_installs_raydl_before_ray_start_in_every_container(kuberay):
    """Each container pip-installs torch and $RAYDL_PIP_SPEC (naming raydl), then runs KubeRay's generated ray start."""
    assert kuberay["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    head, workers = _containers(kuberay)
    for c in head + workers:
        script = " ".join(c["args"])
        assert "pip install" in script and "torch" in script
        assert '"$RAYDL_PIP_SPEC"' in script and f"ray[default]=={RAY_VERSION}" in script
        assert script.rstrip().endswith("$KUBERAY_GEN_RAY_START_CMD")
        spec = {e["name"]: e for e in c["env"]}["RAYDL_PIP_SPEC"]["value"]
        assert "raydl" in spec


# ---------------------------------------------------------------- local multi-node cluster


def test_local_launcher_never_runs_a_bare_ray_stop():
    """The script is valid bash, starts every node on 127.0.0.1 without the loopback switch, and never calls `ray stop`."""
    subprocess.run(["bash", "-n", str(LOCAL_SCRIPT)], check=True, timeout=30)
    code = [line for line in LOCAL_SCRIPT.read_text().splitlines() if not line.lstrip().startswith("#")]
    text = "\n".join(code)
    assert "--node-ip-address=127.0.0.1" in text
    assert "-u RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" in text
    assert "RAY_AUTH_MODE=token" in text
    assert not re.search(r"\bray\s+stop\b", text)
    assert not re.search(r'"\$RAY_CLI"\s+stop\b', text)


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) != 0


_DRIVER = textwrap.dedent(
    """
    import json, ray, raydl
    from torch.utils.data import Dataset

    class NodeOf(Dataset):
        def __len__(self):
            return 16
        def __getitem__(self, i):
            return ray.get_runtime_context().get_node_id()

    ray.init(address=ADDRESS)
    alive = [n for n in ray.nodes() if n["Alive"]]
    loader = raydl.DataLoader(NodeOf(), batch_size=4, num_workers=4, collate_fn=list,
                              ray_remote_args={"num_cpus": 0.5, "resources": {"data": 1}})
    used = sorted({node for batch in loader for node in batch})
    loader.shutdown()
    print("RESULT " + json.dumps({
        "alive": len(alive),
        "ips": sorted({n["NodeManagerAddress"] for n in alive}),
        "data": sum(n["Resources"].get("data", 0) for n in alive),
        "trainer": sum(n["Resources"].get("trainer", 0) for n in alive),
        "data_nodes": sorted(n["NodeID"] for n in alive if n["Resources"].get("data")),
        "used": used,
    }))
    """
)


# Loaded by every Python the launcher's `start` runs; acts only in the first `ray start --head`, whose raylet wait runs
# out as on a busy host (tests/_ray_start_timeout.py).
_FIRST_HEAD_TIMES_OUT = """
import os, sys
if sys.argv[1:3] == ["start", "--head"] and not os.path.exists(MARK):
    open(MARK, "w").close()
    sys.path.insert(0, REPO)
    from tests._ray_start_timeout import time_out_node_starts
    time_out_node_starts()
"""


def _local_launcher_run() -> None:
    """The whole check of test_local_launcher_starts_three_loopback_nodes_and_stops_them (fresh processes only: it runs
    in the background while the in-process tests run, NOTE [ tests background commands ] in tests/_session.py)."""
    tmp_path = tempfile.mkdtemp(prefix="raydl_local_launcher_")
    if shutil.which("ss") is None or shutil.which("setsid") is None:
        pytest.skip("needs ss and setsid (iproute2, util-linux)")
    # Own temp dir and ports: never touches a cluster someone started with the defaults.
    cluster_dir = f"/tmp/raydl-cluster/t{os.getpid()}"  # short: Ray's socket paths must fit 107 bytes
    port, dashboard_port = 6490, 8390
    needed = (port, port + 1, port + 2, port + 3, port + 10, port + 11, port + 12, dashboard_port)
    busy = [p for p in needed if not _port_free(p)]
    if busy:
        pytest.skip(f"ports {busy} on 127.0.0.1 are in use")
    env = {k: v for k, v in ENV_AT_START.items() if k not in ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}
    env.update(
        RAYDL_CLUSTER_DIR=cluster_dir,
        RAYDL_CLUSTER_PORT=str(port),
        RAYDL_CLUSTER_DASHBOARD_PORT=str(dashboard_port),
        RAYDL_CLUSTER_PYTHON=sys.executable,
        RAYDL_CLUSTER_STOP_GRACE_S="5",
    )

    def script(*args, check=True, extra_env=None):
        return subprocess.run(
            ["bash", str(LOCAL_SCRIPT), *args],
            env=dict(env, **(extra_env or {})),
            capture_output=True,
            text=True,
            timeout=480,
            check=check,
        )

    # The head's first `ray start` times out as on a busy host (NOTE [ launcher start retry ]): a sitecustomize that
    # only the `start` call sees makes Ray's raylet wait run out once; the launcher stops what it left and retries.
    site = os.path.join(tmp_path, "site")
    os.mkdir(site)
    with open(os.path.join(site, "sitecustomize.py"), "w") as f:
        f.write(
            _FIRST_HEAD_TIMES_OUT.replace("MARK", repr(os.path.join(tmp_path, "first_head_started"))).replace(
                "REPO", repr(str(CLUSTER_DIR.parent))
            )
        )
    try:
        started = script("start", "2", check=False, extra_env={"PYTHONPATH": site})
        assert started.returncode == 0, started.stdout + started.stderr
        assert "retrying (attempt 2 of 2)" in started.stdout, started.stdout
        with open(os.path.join(cluster_dir, "state", "head.attempt1.log")) as f:
            assert "timed out during startup" in f.read()
        assert "export RAY_AUTH_MODE=token" in started.stdout
        address = script("address").stdout.strip()
        assert address == f"127.0.0.1:{port}"

        status = script("status")
        assert "NOT LOOPBACK" not in status.stdout, status.stdout
        assert f"[::ffff:127.0.0.1]:{port}" in status.stdout or f"127.0.0.1:{port}" in status.stdout

        # The driver: token auth as the script prints it. RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 is
        # for the driver only: without it, ray.init rewrites 127.0.0.1 to the routable IP,
        # where this loopback-only cluster does not listen (the nodes themselves run without it).
        driver_env = dict(env, RAY_AUTH_MODE="token", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
        repo = str(CLUSTER_DIR.parent)
        driver_env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo, env.get("PYTHONPATH")]))
        driver = subprocess.run(
            [sys.executable, "-c", f"ADDRESS = {address!r}\n" + _DRIVER],
            env=driver_env,
            capture_output=True,
            text=True,
            timeout=240,
            cwd=tmp_path,
        )
        lines = [line for line in driver.stdout.splitlines() if line.startswith("RESULT ")]
        assert driver.returncode == 0 and lines, driver.stdout[-3000:] + driver.stderr[-3000:]
        result = json.loads(lines[-1][len("RESULT ") :])
        assert result["alive"] == 3
        assert result["ips"] == ["127.0.0.1"]
        assert result["data"] == 8 and result["trainer"] == 1
        assert result["used"] and set(result["used"]) <= set(result["data_nodes"])

        # examples/cluster_training.py, as its docstring says to run it, against this cluster.
        example = subprocess.run(
            [sys.executable, os.path.join(repo, "examples", "cluster_training.py"), "--address", address],
            env=driver_env,
            capture_output=True,
            text=True,
            timeout=240,
            cwd=repo,
        )
        assert example.returncode == 0, example.stdout[-3000:] + example.stderr[-3000:]
        assert "finished: workers ran on 2 data node(s)" in example.stdout, example.stdout[-3000:]
    finally:
        stopped = script("stop", check=False)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    after = script("status", check=False)
    assert after.returncode == 3, after.stdout + after.stderr  # "not running": no process of ours left
    assert _port_free(port) and _port_free(dashboard_port)
    shutil.rmtree(cluster_dir, ignore_errors=True)  # logs are kept only when something failed
    shutil.rmtree(tmp_path, ignore_errors=True)


_LOCAL_LAUNCHER_TEST = "test_local_launcher_starts_three_loopback_nodes_and_stops_them"
background_call(f"tests/test_cluster_configs.py::{_LOCAL_LAUNCHER_TEST}", "local_launcher", _local_launcher_run, 840)


@pytest.mark.cluster
@pytest.mark.timeout(900)  # sized for a loaded 2-core machine: 3 `ray start`s, a driver, the example, `stop`
def test_local_launcher_starts_three_loopback_nodes_and_stops_them():
    """`start 2`: 3 alive loopback nodes (8 "data", 1 "trainer"), raydl "data" workers only on data nodes; `stop` cleans up."""
    run_command("local_launcher")
