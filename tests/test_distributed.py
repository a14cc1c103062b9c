"""A 2-process gloo run updates the parameters exactly as one process does on the same global batch, with DDP
and with FSDP2; FSDP2's rollout mode uses its public API only."""

import subprocess
import sys

import pytest
import torch

import plumbing
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


def test_unshard_generation_without_fsdps_public_method_is_one_line(monkeypatch):
    """FSDPModule.set_reshard_after_forward (torch >= 2.8) is the only way used to keep the blocks gathered: a torch
    without it is told the fix before anything changes, not worked around through FSDP's private state."""
    policy = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))  # its blocks stand for FSDP units
    monkeypatch.setattr(plumbing, "is_fsdp_unit", lambda module: isinstance(module, torch.nn.Linear))
    with pytest.raises(plumbing.ConfigError, match="--fsdp_generation unshard needs FSDPModule.set_reshard_after_"
                                                   "forward .torch >= 2.8.: upgrade torch, or pass --fsdp_generation "
                                                   "per_block"):
        with plumbing.gathered_for_rollout(policy, "unshard"):
            pytest.fail("the rollout ran")
