"""Two gloo ranks under torchrun, scoring as rloo.py's update does. First a reward function that raises on rank 1
only: both ranks stop with rank 1's error. Then rank 1 stalls in the scoring of the next update: rank 0 stops
after --ddp_timeout (argv[2] seconds) with a Fault naming rank 1 and its phase. Rank 0 writes what it saw to
argv[1] as JSON. Used by test_checkpoints.py."""

import json
import os
import sys
import time
from pathlib import Path

import rloo


def judge(completions, **kwargs):
    raise ConnectionError("the judge does not answer")


if __name__ == "__main__":
    dist_info = rloo.setup_distributed(timeout=float(sys.argv[2]))
    seen = {}
    try:
        with rloo.reward_faults(dist_info.device, "scoring of update 1"):
            rloo.note_phase("scoring")
            if dist_info.rank == 1:
                rloo.call_reward_function("judge", judge, 2, completions=["a", "b"])
    except rloo.RewardFunctionError as e:
        seen["failed"] = [str(e), e.announce]
    try:
        with rloo.reward_faults(dist_info.device, "scoring of update 2"):
            rloo.note_phase("scoring")
            if dist_info.rank == 1:
                time.sleep(float(sys.argv[2]) + 3)
                os._exit(0)  # never arrives
    except rloo.Fault as e:
        seen["stuck"] = [str(e), e.announce]
    if dist_info.rank == 0:
        Path(sys.argv[1]).write_text(json.dumps(seen))
    os._exit(0)  # no process group teardown: rank 1 is gone
