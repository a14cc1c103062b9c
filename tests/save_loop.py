"""Saves checkpoints of a tiny policy forever into argv[1], one run resumed: steps 1, 2, ..., or after the latest
checkpoint there, as --resume continues (its debris and its checkpoints are its own: one run id); test_checkpoints.py
kills it with SIGKILL at random moments."""

import itertools
import shutil
import sys
from pathlib import Path

import torch

from conftest import policy_tokenizer, tiny_policy
from plumbing.checkpoints import save_checkpoint
from plumbing.outputdir import latest_checkpoint

if __name__ == "__main__":
    tokenizer = policy_tokenizer()
    policy = tiny_policy(len(tokenizer))
    optimizer = torch.optim.AdamW(policy.parameters())
    ballast = torch.randn(4_000_000)  # 16 MB of state, so that a save takes long enough to be interrupted
    for debris in (Path(sys.argv[1]) / "checkpoints").glob(".tmp_step_*"):  # a killed save's, which a resume moves
        shutil.rmtree(debris)  # aside before its first save (its rank file may be cut short: no run id to read)
    latest = latest_checkpoint(sys.argv[1])
    for step in itertools.count(1 if latest is None else int(latest.name.removeprefix("step_")) + 1):
        save_checkpoint(sys.argv[1], step, policy, optimizer, tokenizer,
                        {"update": step, "ballast": ballast, "run_id": "save-loop"}, 0, 3, {})
