"""Two gloo ranks under torchrun, scoring as rloo.py's update does. First a reward function that raises on rank 1
only: both ranks stop with rank 1's error. Then rank 1's reward function hangs: past its timeout (both ranks stop
with its error); until rank 1 gets a SIGTERM (both stop as for a signal); the same while rank 0's raises (its failure
wins). Then rank 1 stalls in the scoring of the next update: rank 0 stops after --ddp_timeout (argv[2] seconds)
with a Fault naming rank 1 and its phase. Rank 0 writes what it saw to
argv[1] as JSON. Used by test_checkpoints.py."""

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import plumbing


def judge(completions, **kwargs):
    raise ConnectionError("the judge does not answer")


if __name__ == "__main__":
    dist_info = plumbing.setup_distributed(timeout=float(sys.argv[2]))
    seen = {}
    try:
        with plumbing.reward_faults(dist_info.device, "scoring of update 1"):
            plumbing.note_phase("scoring")
            if dist_info.rank == 1:
                plumbing.call_reward_function("judge", judge, 2, completions=["a", "b"])
    except plumbing.RewardFunctionError as e:
        seen["failed"] = [str(e), e.announce]
    stop = plumbing.StopSignal(plumbing.OutputDirLock(str(Path(sys.argv[1]).parent)), announce=False)
    stop.training = True  # a signal while a reward function runs stops the run at once, on every rank
    for phase, timeout, signalled, rank_0_fails in (("hung", 1.0, False, False), ("signalled", 30.0, True, False),
                                                    ("failed and signalled", 30.0, True, True)):
        try:  # rank 1's function hangs, past its timeout or until rank 1 gets a SIGTERM
            with plumbing.reward_faults(dist_info.device, f"scoring of {phase}"):
                if dist_info.rank == 1:
                    if signalled:
                        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
                    plumbing.call_reward_function("judge", lambda **kwargs: time.sleep(3600), 2, timeout,
                                              completions=["a", "b"])
                elif rank_0_fails:
                    plumbing.call_reward_function("judge", judge, 2, timeout, completions=["a", "b"])
        except plumbing.RewardFunctionError as e:
            seen[phase] = [str(e), e.signal_name, e.announce]
    try:
        with plumbing.reward_faults(dist_info.device, "scoring of update 2"):
            plumbing.note_phase("scoring")
            if dist_info.rank == 1:
                time.sleep(float(sys.argv[2]) + 3)
                os._exit(0)  # never arrives
    except plumbing.Fault as e:
        seen["stuck"] = [str(e), e.announce]
    if dist_info.rank == 0:
        Path(sys.argv[1]).write_text(json.dumps(seen))
    os._exit(0)  # no process group teardown: rank 1 is gone
