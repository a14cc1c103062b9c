"""A 2-process gloo run updates the parameters exactly as one process does on the same global batch, with DDP
and with FSDP2."""

import subprocess
import sys

import pytest
import torch

from conftest import REPO, cpu_env, tiny_policy, policy_tokenizer


def run(script_args: list[str], out, wrapper: str = "ddp") -> None:
    env = cpu_env({"PYTHONPATH": f"{REPO / 'tests'}:{REPO}"})
    result = subprocess.run([sys.executable, *script_args, str(REPO / "tests" / "ddp_update.py"), str(out), wrapper],
                            capture_output=True, text=True, env=env, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp", "fsdp_offload"])
def test_two_rank_update_equals_one_rank_update(tmp_path, wrapper):
    run([], tmp_path / "one.pt")
    run(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"], tmp_path / "two.pt", wrapper)
    one, two = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    initial = tiny_policy(len(policy_tokenizer()), seed=0).state_dict()
    moved = 0
    for name, value in one.items():
        torch.testing.assert_close(two[name], value, atol=1e-6, rtol=1e-5, msg=name)
        moved += not torch.equal(value, initial[name])
    assert moved > len(one) // 2  # the update did change the parameters
