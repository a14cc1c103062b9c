"""A 2-process gloo run updates the parameters exactly as one process does on the same global batch, with DDP
and with FSDP2 (FSDP2 on every architecture of the tests' table); FSDP2's rollout mode uses its public API only."""

import gc
import subprocess

import pytest
import torch
import torch.distributed as dist
import tyro
from torch.nn.parallel import DistributedDataParallel as DDP

import plumbing
import rloo
from conftest import REPO, cpu_env, tiny_policy, policy_tokenizer
from helpers import ARCHITECTURES, argv_of, free_port, python, tiny_architecture, valid_flags

TWO_RANKS = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def run(script_args: list[str], out, wrapper: str = "ddp", families: str = "gpt_neox") -> None:
    env = cpu_env({"PYTHONPATH": f"{REPO / 'tests'}:{REPO}"})
    result = subprocess.run([python(), *script_args, str(REPO / "tests" / "ddp_update.py"), str(out), wrapper,
                             families], capture_output=True, text=True, env=env, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]


def assert_same_update(one: dict, two: dict, initial: dict) -> None:
    moved = 0
    for name, value in one.items():
        torch.testing.assert_close(two[name], value, atol=1e-6, rtol=1e-5, msg=name)
        moved += not torch.equal(value, initial[name])
    assert moved > len(one) // 2  # the update did change the parameters


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp", "fsdp_offload"])
def test_two_rank_update_equals_one_rank_update(tmp_path, wrapper):
    run([], tmp_path / "one.pt")
    run(TWO_RANKS, tmp_path / "two.pt", wrapper)
    one, two = torch.load(tmp_path / "one.pt")["gpt_neox"], torch.load(tmp_path / "two.pt")["gpt_neox"]
    assert_same_update(one, two, tiny_policy(len(policy_tokenizer()), seed=0).state_dict())


def test_two_rank_fsdp_update_equals_one_rank_update_on_every_architecture(tmp_path):
    """Llama, GPT-2 (tied embeddings), Mistral and Gemma 2 (sliding windows), GPT-OSS and Qwen3-MoE (experts),
    Falcon-H1 (state-space, unshared): FSDP2 shards each by its own transformer blocks and updates it as one process
    does, in one torchrun for all."""
    families = ",".join(ARCHITECTURES)
    run([], tmp_path / "one.pt", "ddp", families)
    run(TWO_RANKS, tmp_path / "two.pt", "fsdp", families)
    one, two = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    assert list(one) == list(two) == list(ARCHITECTURES)
    for family in ARCHITECTURES:
        assert_same_update(one[family], two[family], tiny_architecture(family).state_dict())


def test_a_run_frees_its_ddp_wrapper_before_the_process_group(assets, tmp_path, monkeypatch):
    """DDP's reducer holds the process group: freed last, in a destructor that keeps the GIL, it would join gloo's
    worker threads while one of them waits for the GIL (a rare hang at the very end of a CPU run, seen in CI). A run
    as torchrun's one rank, with DDP, destroys the group when no DDP module is left."""
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(name, value)
    ddp_modules = lambda: sum(type(o) is DDP for o in gc.get_objects())  # noqa: E731
    before, alive, destroy = ddp_modules(), [], dist.destroy_process_group

    def destroy_and_count(*args):
        alive.append(ddp_modules())
        destroy(*args)

    monkeypatch.setattr(dist, "destroy_process_group", destroy_and_count)
    argv = argv_of(valid_flags(assets, tmp_path / "out") | {"total_episodes": 8, "num_ppo_epochs": 1})
    plumbing.run_script(rloo.main, tyro.cli(rloo.Args, args=argv), "rloo.py")
    assert alive == [before] and not dist.is_initialized()
    assert (tmp_path / "out" / "model.safetensors").exists()  # the run finished


def test_unshard_generation_without_fsdps_public_method_is_one_line(monkeypatch):
    """FSDPModule.set_reshard_after_forward (torch >= 2.8) is the only way used to keep the blocks gathered: a torch
    without it is told the fix before anything changes, not worked around through FSDP's private state."""
    policy = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))  # its blocks stand for FSDP units
    monkeypatch.setattr(plumbing.distributed, "is_fsdp_unit", lambda module: isinstance(module, torch.nn.Linear))
    with pytest.raises(plumbing.ConfigError, match="--fsdp_generation unshard needs FSDPModule.set_reshard_after_"
                                                   "forward .torch >= 2.8.: upgrade torch, or pass --fsdp_generation "
                                                   "per_block"):
        with plumbing.gathered_for_rollout(policy, "unshard"):
            pytest.fail("the rollout ran")
