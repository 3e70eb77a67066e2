"""On a real multi-node Ray cluster on localhost: placement, parity, node loss, clean shutdown."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def facts():
    """Runs tests/_multinode_main.py once (its own 3-node cluster, in a subprocess) and returns what it saw."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    proc = subprocess.run(
        [sys.executable, "-m", "tests._multinode_main"], cwd=REPO, env=env, capture_output=True, text=True, timeout=240
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("FACTS ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(lines[-1][len("FACTS ") :])


def test_cluster_has_three_nodes(facts):
    """The harness really runs a head and two worker nodes."""
    assert facts["nodes"] == 3


def test_default_placement_spreads_and_matches_torch(facts):
    """By default, workers spread over several nodes and batches are torch's, batch for batch."""
    assert facts["default_nodes"] >= 2
    assert facts["default_same_as_torch"]


def test_resources_keep_workers_on_data_nodes(facts):
    """ray_remote_args resources put workers on both data nodes and never on the trainer's node."""
    assert facts["data_nodes_used"] == 2
    assert not facts["on_trainer_node"]


def test_batches_from_other_nodes_are_pulled_ahead(facts):
    """While the caller is busy, finished batches of workers on other nodes already move to the driver's node."""
    assert facts["prefetch_outstanding"] == 4
    assert facts["prefetch_local_before_next"] == facts["prefetch_outstanding"]
    assert facts["prefetch_rest_complete"]


def test_node_removed_mid_epoch_is_recovered(facts):
    """A data node removed mid-epoch: its workers are replaced on the survivor; all batches once, in order."""
    assert facts["after_removal_complete_in_order"]
    assert facts["restarts"] >= 1
    assert facts["survivor_node_only"]


def test_no_actor_left_behind(facts):
    """After the loaders are dropped, no actor is alive anywhere in the cluster."""
    assert facts["alive_actors_after"] == 0
