"""Under torchrun with 2 ranks: plumbing.reduce_metrics of values each rank makes up from its rank, written to
argv[1]/rank{r}.json for tests/test_oracles.py to compare with a hand computation."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import plumbing

dist.init_process_group("gloo")
r = dist.get_rank()
metrics = {"objective/scores": 1.0 + r, "val/num_eos_tokens": 3.0 + r, "completions/min_length": 2.0 + 2 * r,
           "completions/max_length": 9.0 - 4 * r, "memory/peak_gib": 5.0 - 2 * r,
           "reward/f/mean": 4.0 if r == 0 else float("nan"), "mismatch/max": 0.25 + 0.5 * r}
out = plumbing.reduce_metrics(metrics, torch.device("cpu"), max_metrics=("mismatch/max",))
(Path(sys.argv[1]) / f"rank{r}.json").write_text(json.dumps(out))
dist.destroy_process_group()
