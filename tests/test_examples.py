"""Every example runs as a user runs it: one command, in a fresh process, exit code 0, its key lines.

The two multi-process examples (Lightning DDP, torchrun) run exactly as on a fresh laptop, with
no Ray for them: their rank 0 starts a local Ray on loopback and the other ranks join it, which
is what they demonstrate. The single-driver examples join the test session's Ray through
RAY_ADDRESS, as a user's driver joins a cluster (a new local Ray per example would only add its
start-up time; raydl's own local start is covered by the quickstart tests). The environment is
this one minus every RAY_* variable (plus RAY_ADDRESS and the auth mode where a session Ray is
joined) and PYTHONPATH to this checkout. Sizes are reduced where the defaults only make the run
longer, not different.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

import raydl
from tests._integration_helpers import RAY_TRAIN_QUICK_ENV
from tests._session import background, run_command_once_more_if_ray_did_not_start

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(REPO, "examples")
TIMEOUT_S = 170


def _session_ray_env(ray_session) -> dict:
    """Join the test session's Ray: its address, the token auth mode ray.init chose for it, loopback."""
    env = {"RAY_ADDRESS": ray_session.get_runtime_context().gcs_address, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    if os.environ.get("RAY_AUTH_MODE"):
        env["RAY_AUTH_MODE"] = os.environ["RAY_AUTH_MODE"]
    release = getattr(raydl, "release_idle_workers", None)
    if release is not None:
        release()  # idle warm workers of earlier tests may hold CPUs the example's trainers need
    return env


def _env(extra_env: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(extra_env or {})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _checked(proc: subprocess.CompletedProcess) -> str:
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit code {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    return output


def _run(args: list[str], extra_env: dict | None = None) -> str:
    proc = subprocess.run(
        [sys.executable, *args], cwd=REPO, env=_env(extra_env), capture_output=True, text=True, timeout=TIMEOUT_S
    )
    return _checked(proc)


# The examples that run with no Ray (each starts a local Ray of its own) share nothing with the suite's Ray: they run
# in the background while the in-process tests run (NOTE [ tests background commands ] in tests/_session.py).
_OWN_RAY = {  # name: (the test that reads its output, the module it needs, its arguments, its environment)
    "lightning_example": (
        "test_lightning_example_ddp_two_ranks_share_one_ray",
        "lightning",
        [os.path.join(EXAMPLES, "lightning_example.py"), "--devices", "2", "--samples", "256", "--max-epochs", "1"],
        {},
    ),
    "ddp_torchrun_example": (
        "test_ddp_torchrun_example_ranks_see_disjoint_shards",
        None,
        ["-m", "torch.distributed.run", "--nproc_per_node=2", os.path.join(EXAMPLES, "ddp_torchrun_example.py")]
        + ["--samples", "256", "--epochs", "2"],
        {},
    ),
    "quickstart": (
        "test_quickstart_as_shipped_learns_and_says_only_what_helps",
        None,
        ["examples/quickstart.py"],
        {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"},
    ),
}
for _name, (_test, _needs, _args, _extra) in _OWN_RAY.items():
    if _needs is None or importlib.util.find_spec(_needs) is not None:
        background(
            f"tests/test_examples.py::{_test}", f"example:{_name}", [sys.executable, *_args], _env(_extra), TIMEOUT_S
        )


def _run_own_ray(name: str) -> str:
    """An example that starts its own Ray: its output (run in the background if the suite started it there)."""
    return _checked(run_command_once_more_if_ray_did_not_start(f"example:{name}"))


def test_lightning_example_ddp_two_ranks_share_one_ray():
    """lightning_example.py --devices 2: both DDP ranks train on re-instantiated raydl loaders fed by Ray workers."""
    pytest.importorskip("lightning")
    out = _run_own_ray("lightning_example")
    assert "lightning_example: done, 4 steps per rank on 2 process(es)" in out
    assert re.search(r"started a local Ray at 127\.0\.0\.1:\d+", out)
    pools = []
    for rank in (0, 1):
        line = re.search(rf"^rank {rank}: 4 steps on raydl\.loader\.DataLoader .*$", out, re.M)
        assert line, out[-3000:]
        assert "ray_remote_args={'num_cpus': 0}" in line.group(0) and "sampler DistributedSampler" in line.group(0)
        assert "ray_job=True" in line.group(0) and line.group(0).endswith(": True")
        pools.append(re.search(r"worker pids \[([\d, ]+)\]", line.group(0)).group(1))
    ranks = [set(p.split(", ")) for p in pools]
    # private pools would share no worker; one pool of 2 x 2 workers serves both ranks
    assert len(ranks[0] | ranks[1]) <= 4 and ranks[0] & ranks[1], f"one pool of 2 x 2 workers for both ranks: {pools}"


def test_accelerate_example_trains_on_ray_workers(ray_session):
    """accelerate_example.py: prepare() rebuilds the loader, and under raydl.patch() every epoch's batches come from Ray workers."""
    pytest.importorskip("accelerate")
    out = _run(
        [os.path.join(EXAMPLES, "accelerate_example.py"), "--samples", "256", "--epochs", "2"],
        _session_ray_env(ray_session),
    )
    assert "accelerate prepared a DataLoaderShard around a torch.utils.data.dataloader.DataLoader" in out
    epochs = re.findall(r"^epoch \d: loss [\d.]+ over 256 samples; .*: (True|False)$", out, re.M)
    assert epochs == ["True", "True"], out[-3000:]
    assert "accelerate_example: done" in out


def test_ray_train_example_two_training_workers(ray_session):
    """ray_train_example.py: a TorchTrainer with 2 training workers, each fed by its own raydl workers."""
    pytest.importorskip("ray.train.torch")
    out = _run(
        [os.path.join(EXAMPLES, "ray_train_example.py"), "--samples", "128", "--epochs", "1", "--num-workers", "1"],
        {**_session_ray_env(ray_session), **RAY_TRAIN_QUICK_ENV},
    )
    line = re.search(r"^ray_train_example: done, rank 0's last metrics: (.*)$", out, re.M)
    assert line, out[-4000:]
    assert "'samples': 64" in line.group(1) and "'from_ray_workers': True" in line.group(1)


def test_ddp_torchrun_example_ranks_see_disjoint_shards():
    """torchrun, 2 gloo ranks, no Ray running: the ranks share one local Ray and one pool (ray_job=True), each rank's
    raydl loader reads a disjoint half."""
    out = _run_own_ray("ddp_torchrun_example")
    assert re.search(
        r"Ray of each rank: \['127\.0\.0\.1:\d+', '127\.0\.0\.1:\d+'\]; one Ray for the node's ranks: True", out
    ), out[-3000:]
    for rank in (0, 1):
        for epoch in (0, 1):
            assert re.search(rf"^rank {rank}: epoch {epoch}: 128 samples, .*not among them\)$", out, re.M), out[-3000:]
    pools = re.findall(
        r"samples per rank \[128, 128\], shards disjoint: True, cover the dataset: True; "
        r"workers used: (\d+) \(the job's pool has 4\), serving every rank: (\d+)",
        out,
    )
    assert len(pools) == 2, out[-3000:]
    # private pools would never serve both ranks; one pool of 2 x 2 workers does (each rank picks its workers
    # by their batch times, so in a given epoch the ranks may also split the pool between them)
    assert all(int(used) <= 4 for used, _ in pools) and max(int(shared) for _, shared in pools) >= 1, pools
    assert "ddp_torchrun_example: done, 2 ranks" in out


def test_train_image_classifier_times_both_loaders_with_identical_training(ray_session):
    """train_image_classifier.py: prints each epoch's time for torch's and raydl's loader; same seeds give the same losses."""
    out = _run(
        [
            os.path.join(EXAMPLES, "train_image_classifier.py"),
            "--samples",
            "256",
            "--epochs",
            "2",
            "--augment-repeats",
            "2",
        ],
        _session_ray_env(ray_session),
    )
    runs = {}
    for name in ("torch", "raydl"):
        runs[name] = re.findall(rf"^{name} DataLoader: epoch (\d): [\d.]+ s \(\d+ images/s\), (loss .*)$", out, re.M)
        assert [epoch for epoch, _ in runs[name]] == ["0", "1"], out[-3000:]
    assert runs["torch"] == runs["raydl"]  # same batches, same worker-side augmentation, same training
    assert re.search(r"^raydl DataLoader: 2 Ray workers on \['127\.0\.0\.1'\]$", out, re.M)


def test_train_image_classifier_real_images_runs_the_jpeg_pipeline_identically(ray_session, tmp_path):
    """--real-images: writes a small JPEG folder, then decode + RandomResizedCrop + flip + normalize in both loaders'
    workers; the same seeds give the same losses (the crops are drawn from the worker's torch RNG)."""
    out = _run(
        [
            os.path.join(EXAMPLES, "train_image_classifier.py"),
            "--real-images",
            "--samples",
            "256",
            "--epochs",
            "2",
            "--cache-dir",
            str(tmp_path),
        ],
        _session_ray_env(ray_session),
    )
    assert re.search(r"^256 JPEGs in 4 classes, PIL decode \+ RandomResizedCrop\(64\)", out, re.M), out[-3000:]
    runs = {
        name: re.findall(rf"^{name} DataLoader: epoch (\d): [\d.]+ s \(\d+ images/s\), (loss .*)$", out, re.M)
        for name in ("torch", "raydl")
    }
    assert [epoch for epoch, _ in runs["torch"]] == ["0", "1"], out[-3000:]
    assert runs["torch"] == runs["raydl"]
    assert len(os.listdir(tmp_path)) == 1  # one cached folder, reused on a second run


def test_resume_example_restarted_job_matches_the_uninterrupted_one(ray_session):
    """resume_example.py: checkpoint with torch.save every step, stop, restart from it: same batches, same weights."""
    out = _run(
        [os.path.join(EXAMPLES, "resume_example.py"), "--samples", "48", "--stop-after", "3"],
        _session_ray_env(ray_session),
    )
    assert "resumed run matches the uninterrupted one, augmentation included: True" in out, out[-3000:]
    assert "same final weights: True" in out, out[-3000:]


def test_quickstart_as_shipped_learns_and_says_only_what_helps():
    """The README's first command: no Ray running, default arguments. It starts its own Ray, and its small model learns
    (seeded data, weights and shuffle, so the figures do not depend on the machine's load): the loss falls by more than
    half and the last epoch is at least 90 % accurate over 3 classes (chance is 33 %). Its output holds no stall hint
    (its epochs are short: the hint needs 100 batches and 5 s) and each worker's log lines carry that worker's id."""
    out = _run_own_ray("quickstart")
    # not anchored to line ends: the workers' log lines, printed by another thread, may land inside a line
    epochs = re.findall(
        r"epoch (\d+): loss ([\d.]+), accuracy ([\d.]+)%, 2048 samples in [\d.]+ s from 2 Ray workers", out
    )
    assert [epoch for epoch, _, _ in epochs] == ["0", "1"], out[-3000:]
    (_, first_loss, _), (_, last_loss, last_accuracy) = epochs
    assert float(last_loss) < 0.5 * float(first_loss) and float(last_accuracy) >= 90.0, epochs
    assert "waited for data" not in out and "raydl loader" not in out, out[-3000:]
    assert "id=-1" not in out, out[-3000:]
    for w in (0, 1):
        assert re.search(rf"raydl\.Worker\(id={w}\) pid=\d+\)\S*\s+worker {w}/2 started", out), out[-3000:]


_RESUMED = r"the resumed loader gave (\d+) batches, the remaining ones of the uninterrupted run: True; same final weights: True"


def test_stream_parquet_example_trains_and_resumes_mid_epoch(ray_session, tmp_path):
    """stream_parquet.py: a class-sorted Parquet folder through ParquetDataset's node cache, shuffle=True, 2 workers;
    a new loader loading the mid-epoch state gives exactly the uninterrupted run's remaining batches."""
    out = _run(
        [os.path.join(EXAMPLES, "stream_parquet.py"), "--rows", "1024", "--files", "8", "--dir", str(tmp_path)],
        _session_ray_env(ray_session),
    )
    assert re.search(r"ParquetDataset\(8 files, 1024 rows, 16 row groups, \d+ bytes\)", out), out[-3000:]
    epochs = re.findall(r"^epoch (\d): loss [\d.]+, accuracy [\d.]+% over 1024 samples", out, re.M)
    assert epochs == ["0", "1"], out[-3000:]
    assert re.search(rf"^rank 0: checkpoint at batch 8 of epoch 1; {_RESUMED}", out, re.M), out[-3000:]
    assert "stream_parquet: done, 1 process(es)" in out


def test_stream_parquet_example_torchrun_sees_every_sample_once(ray_session, tmp_path):
    """torchrun, 2 gloo ranks joining the session's Ray, a worker each: ParquetDistributedSampler; rank 0 gathers the ids and checks
    every sample came once per epoch over the ranks, that the ranks settled the same node slot count, and each rank's
    resumed loader gives its remaining batches."""
    out = _run(
        [
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            os.path.join(EXAMPLES, "stream_parquet.py"),
        ]
        + ["--rows", "1024", "--files", "8", "--num-workers", "1", "--dir", str(tmp_path)],
        _session_ray_env(ray_session),
    )
    for epoch in (0, 1):
        assert re.search(
            rf"^epoch {epoch}: samples per rank \[512, 512\], every sample seen exactly once over the 2 ranks: True$",
            out,
            re.M,
        ), out[-3000:]
    assert re.search(r"^node slots per rank after the first epoch: \[(\d+), \1\], agreed: True$", out, re.M), out[
        -3000:
    ]
    for rank in (0, 1):
        assert re.search(rf"^rank {rank}: checkpoint at batch 4 of epoch 1; {_RESUMED}", out, re.M), out[-3000:]
    assert "stream_parquet: done, 2 process(es)" in out


def test_stream_webdataset_example_trains_and_resumes_mid_epoch(ray_session, tmp_path):
    """stream_webdataset.py: class-sorted tar shards of npy samples through TarDataset's node cache, shuffle=True,
    decoded in 2 workers; every sample once per epoch, and the mid-epoch state resumes exactly."""
    out = _run(
        [os.path.join(EXAMPLES, "stream_webdataset.py"), "--samples", "512", "--dir", str(tmp_path)],
        _session_ray_env(ray_session),
    )
    assert re.search(r"TarDataset\(8 shards, 512 samples, \d+ units, \d+ bytes\), fields \['npy', 'cls'\]", out)
    epochs = re.findall(r"^epoch (\d): .* over 512 samples, .*; every sample once: True$", out, re.M)
    assert epochs == ["0", "1"], out[-3000:]
    assert re.search(rf"^checkpoint at batch 8 of epoch 1; {_RESUMED}", out, re.M), out[-3000:]
    assert "stream_webdataset: done" in out
