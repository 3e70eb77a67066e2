"""Runs a Ray Train `TorchTrainer` in its own driver process, joined to the suite's Ray (RAY_ADDRESS).

Why a separate driver: in the full suite, once a TorchTrainer's controller actor had run and exited
in the pytest process, that process stopped hearing that new actors were alive (Ray 2.60: its log
shows "A worker is dead. subscription_failure_callback will be invoked" for the controller, then no
ALIVE notification again), so every later loader waited out its start-up timeout. Ray Train is a
driver of its own in real jobs too.

Usage: python tests/_ray_train_main.py MODE=OUT_DIR [MODE=OUT_DIR]   (MODE: prepare or resume; each run in turn)
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


def main(runs: list) -> None:
    import ray

    import raydl

    ray.init(address=os.environ["RAY_ADDRESS"])
    raydl.release_idle_workers()  # idle workers holding reserved CPUs would keep the trainers from being placed
    for mode, out in runs:
        run(mode, out)
    ray.shutdown()


def run(mode: str, out: str) -> None:
    import torch
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from tests import _integration_helpers as H
    from tests import _resume_datasets as RD

    if mode == "prepare":
        trainer = TorchTrainer(
            H.ray_train_loop,
            train_loop_config={"out": out, "samples": 16},
            scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 0.5}),
            run_config=RunConfig(storage_path=os.path.join(out, "storage"), name="raydl_ray_train"),
        )
        trainer.fit()
    else:
        trainer = TorchTrainer(
            RD.ray_train_resume_loop,
            train_loop_config={"out": out, "tag": "first", "stop_after": 2, "resume_from": None},
            scaling_config=ScalingConfig(num_workers=1, use_gpu=False, resources_per_worker={"CPU": 0.5}),
            run_config=RunConfig(storage_path=os.path.join(out, "storage"), name="resume_first"),
        )
        result = trainer.fit()
        assert result.checkpoint is not None, "the loop reported no checkpoint"
        with result.checkpoint.as_directory() as d:
            state = torch.load(f"{d}/state.pt", weights_only=True)
        torch.save(state, os.path.join(out, "reported_state.pt"))
    print("RESULT " + json.dumps({"mode": mode}), flush=True)


if __name__ == "__main__":
    main([arg.split("=", 1) for arg in sys.argv[1:]])
