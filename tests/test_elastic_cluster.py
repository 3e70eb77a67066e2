"""A node leaves mid-epoch and no node has room for its worker's replacement (NOTE [ raydl elastic pool ])."""

from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_node_removed_with_no_room_the_survivors_finish_the_epoch_bit_identical():
    """Loopback 3-node cluster: its data node removed mid-epoch, the survivors finish; every batch once, in order, identical to undisturbed (ray_seed="batch")."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    proc = subprocess.run(
        [sys.executable, "-m", "tests._elastic_cluster_main"], cwd=REPO, env=env, capture_output=True, text=True, timeout=240
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("FACTS ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    facts = json.loads(lines[-1][len("FACTS ") :])
    assert facts["placement_as_planned"], facts
    assert facts["batches"] == [24, 24], facts
    assert facts["in_order"] and facts["identical"] is True, facts
    assert facts["warning_names_worker_and_node"], facts
    assert len(facts["survivors"]) == 2 and facts["lost"] not in facts["survivors"] and facts["survivors_on_b"], facts
