"""Runs a Ray Train `TorchTrainer` in its own driver process, joined to the suite's Ray (RAY_ADDRESS).

Why a separate driver: in the full suite, once a TorchTrainer's controller actor had run and exited
in the pytest process, that process stopped hearing that new actors were alive (Ray 2.60: its log
shows "A worker is dead. subscription_failure_callback will be invoked" for the controller, then no
ALIVE notification again), so every later loader waited out its start-up timeout. Ray Train is a
driver of its own in real jobs too.

Usage: python tests/_ray_train_main.py prepare=OUT_DIR resume=OUT_DIR
One fit of 2 training workers runs both loops (tests/_integration_helpers.py's ray_train_prepare_then_resume_loop):
each fit starts Ray Train's controller, placement group cleaner, dataset manager and synchronization actor, ~30
core-s here, so the two checks share one.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


def main(outs: dict) -> None:
    import ray
    import torch
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    import raydl
    from tests import _integration_helpers as H

    ray.init(address=os.environ["RAY_ADDRESS"])
    raydl.release_idle_workers()  # idle workers holding reserved CPUs would keep the trainers from being placed
    trainer = TorchTrainer(
        H.ray_train_prepare_then_resume_loop,
        train_loop_config={
            "prepare": {"out": outs["prepare"], "samples": 16},
            "resume": {"out": outs["resume"], "tag": "first", "stop_after": 2, "resume_from": None},
        },
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 0.5}),
        run_config=RunConfig(storage_path=os.path.join(outs["resume"], "storage"), name="raydl_ray_train"),
    )
    result = trainer.fit()
    assert result.checkpoint is not None, "the loop reported no checkpoint"
    with result.checkpoint.as_directory() as d:
        state = torch.load(f"{d}/state.pt", weights_only=True)
    torch.save(state, os.path.join(outs["resume"], "reported_state.pt"))
    print("RESULT " + json.dumps({"modes": sorted(outs)}), flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main(dict(arg.split("=", 1) for arg in sys.argv[1:]))
