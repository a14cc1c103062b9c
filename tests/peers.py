"""Two gloo ranks under torchrun, scoring as rloo.py's update does. First a reward function that raises on rank 1
only: both ranks stop with rank 1's error. Then rank 1's reward function hangs: past its timeout (both ranks stop
with its error); until rank 1 gets a SIGTERM (both stop as for a signal); the same while rank 0's raises (its failure
wins). Then rank 1 stalls in the scoring of the next update: rank 0 stops after the ranks' timeout (--ddp_timeout,
argv[2] seconds, then argv[3]) with a Fault naming rank 1 and its phase. Rank 0 writes what it saw to argv[1] as
JSON. Used by test_checkpoints.py."""

import datetime
import json
import os
import signal
import sys
import threading
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
    # rank 1's hang is certain; its timeout (1 s) well below --ddp_timeout (argv[2]), rank 0's wait for its report
    for phase, timeout, signalled, rank_0_fails in (("hung", 1.0, False, False), ("signalled", 600.0, True, False),
                                                    ("failed and signalled", 600.0, True, True)):
        try:  # rank 1's function hangs, past its timeout or until rank 1 gets a SIGTERM
            with plumbing.reward_faults(dist_info.device, f"scoring of {phase}"):
                if dist_info.rank == 1:  # hangs for certain; signalled, from inside the function, once it runs
                    def hang(**kwargs):
                        if signalled:
                            os.kill(os.getpid(), signal.SIGTERM)
                        threading.Event().wait()  # an event that never comes
                    plumbing.call_reward_function("judge", hang, 2, timeout, completions=["a", "b"])
                elif rank_0_fails:
                    plumbing.call_reward_function("judge", judge, 2, timeout, completions=["a", "b"])
        except plumbing.RewardFunctionError as e:
            seen[phase] = [str(e), e.signal_name, e.announce]
    # the ranks' waits time out sooner from here on (the store's timeout, which --ddp_timeout sets): rank 1 stalls
    # until rank 0 has given up, however long that takes
    plumbing.distributed.process_group_store().set_timeout(datetime.timedelta(seconds=float(sys.argv[3])))
    try:
        with plumbing.reward_faults(dist_info.device, "scoring of update 2"):
            plumbing.note_phase("scoring")
            if dist_info.rank == 1:
                while not Path(sys.argv[1]).exists():  # stalls until rank 0 has given up on it and said so
                    threading.Event().wait(0.1)
                os._exit(0)
    except plumbing.Fault as e:
        seen["stuck"] = [str(e), e.announce]
    if dist_info.rank == 0:
        Path(sys.argv[1]).write_text(json.dumps(seen))
    os._exit(0)  # no process group teardown: rank 1 is gone
