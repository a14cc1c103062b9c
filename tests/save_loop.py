"""Saves checkpoints of a tiny policy forever (steps 1, 2, ...) into argv[1]; test_checkpoints.py kills it with
SIGKILL at random moments."""

import itertools
import sys

import torch

from conftest import policy_tokenizer, tiny_policy
from plumbing.checkpoints import save_checkpoint

if __name__ == "__main__":
    tokenizer = policy_tokenizer()
    policy = tiny_policy(len(tokenizer))
    optimizer = torch.optim.AdamW(policy.parameters())
    ballast = torch.randn(4_000_000)  # 16 MB of state, so that a save takes long enough to be interrupted
    for step in itertools.count(1):
        save_checkpoint(sys.argv[1], step, policy, optimizer, tokenizer, {"update": step, "ballast": ballast}, 0, 3, {})
