"""A 2-process gloo run updates the parameters exactly as one process does on the same global batch, with DDP
and with FSDP2 (with LoRA adapters too, and on every architecture of the tests' table); FSDP2's rollout mode uses its
public API only."""

import gc
import subprocess
import threading

import pytest
import torch
import torch.distributed as dist
import tyro
from safetensors.torch import load_file
from torch.nn.parallel import DistributedDataParallel as DDP

import plumbing
import rloo
from conftest import REPO, cpu_env
from helpers import ARCHITECTURES, argv_of, free_port, python, valid_flags

TWO_RANKS = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def run(script_args: list[str], out, wrapper: str = "ddp", families: str = "gpt_neox") -> None:
    env = cpu_env({"PYTHONPATH": f"{REPO / 'tests'}:{REPO}"})
    result = subprocess.run([python(), *script_args, str(REPO / "tests" / "ddp_update.py"), str(out), wrapper,
                             families], capture_output=True, text=True, env=env, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]


def assert_same_update(one: dict, two: dict, lora: bool) -> None:
    """The parameters after the update, and the policy's log-probs then (FSDP's blocks gathered as for a rollout);
    with LoRA, also the reference's (the adapters off)."""
    assert one["initial"].keys() == two["final"].keys() == one["final"].keys()
    for name, value in one["final"].items():
        torch.testing.assert_close(two["final"][name], value, atol=1e-6, rtol=1e-5, msg=name)
    assert one["logprobs"].keys() == two["logprobs"].keys() == {"policy", *(["reference"] if lora else [])}
    for name, value in one["logprobs"].items():  # the policy and (LoRA) the reference, FSDP's blocks gathered
        torch.testing.assert_close(two["logprobs"][name], value, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp", "fsdp_offload", "fsdp_lora"])
def test_two_rank_update_equals_one_rank_update(tmp_path, wrapper):
    """With LoRA adapters (a tied Llama-like model: every block's unit holds frozen and trained weights, the root's only
    frozen ones) the adapter is saved whole; FSDP2 reduce-scatters at every micro-step, but with LoRA at an optimizer
    step's last alone."""
    run([], tmp_path / "one.pt", "lora" if "lora" in wrapper else "ddp")
    run(TWO_RANKS, tmp_path / "two.pt", wrapper)
    one, two = (torch.load(tmp_path / f"{run}.pt")["gpt_neox"] for run in ("one", "two"))
    assert_same_update(one, two, "lora" in wrapper)
    moved = {name for name, value in one["final"].items() if not torch.equal(value, one["initial"][name])}
    if "lora" in wrapper:  # the adapters, all of them, and nothing else; saved whole from the shards
        assert moved == {name for name in one["final"] if ".lora_" in name}
        assert not torch.allclose(two["logprobs"]["reference"], two["logprobs"]["policy"])  # the adapters count
        unsharded, saved = (load_file(tmp_path / f"{run}.pt.gpt_neox.adapter" / plumbing.models.ADAPTER_WEIGHTS)
                            for run in ("one", "two"))
        assert saved.keys() == unsharded.keys() and len(saved) == len(moved)
        for name, value in unsharded.items():
            torch.testing.assert_close(saved[name], value, atol=1e-6, rtol=1e-5, msg=name)
    else:
        assert len(moved) > len(one["final"]) // 2  # the update did change the parameters
    # two epochs of one minibatch, of two micro-steps each on each of the two ranks; FSDP2: whether a micro-step
    # left gradient shards (it reduce-scattered), at each one, or with LoRA at each step's last alone
    assert [last for last, _ in two["synced"]] == [False, True] * 2
    if wrapper.startswith("fsdp"):
        assert [reduced for _, reduced in two["synced"]] == ([False, True] * 2 if "lora" in wrapper else [True] * 4)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_two_rank_fsdp_update_equals_one_rank_update_on_every_architecture(tmp_path, lora):
    """Llama, GPT-2 (tied embeddings), Mistral and Gemma 2 (sliding windows), GPT-OSS and Qwen3-MoE (experts),
    Falcon-H1 (state-space, unshared): FSDP2 shards each by its own transformer blocks and updates it as one process
    does, in one torchrun for all; with LoRA adapters on every linear layer too, the adapters alone moving, the
    reference (adapters off) the base's."""
    families = ",".join(ARCHITECTURES)
    run([], tmp_path / "one.pt", "lora" if lora else "ddp", families)
    run(TWO_RANKS, tmp_path / "two.pt", "fsdp_lora" if lora else "fsdp", families)
    one, two = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    assert list(one) == list(two) == list(ARCHITECTURES)
    for family in ARCHITECTURES:
        assert_same_update(one[family], two[family], lora)
        moved = {name for name, value in one[family]["final"].items()
                 if not torch.equal(value, one[family]["initial"][name])}
        if lora:  # the adapters, all of them, and nothing else
            assert moved == {name for name in one[family]["final"] if ".lora_" in name}, family
        else:  # the update did change the parameters
            assert len(moved) > len(one[family]["final"]) // 2, family


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
    plumbing.run_script(rloo.main, tyro.cli(rloo.Args, args=argv), "rloo.py", end_process=False)
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



def test_a_rendezvous_that_does_not_answer_is_said_at_once_then_waited_for_until_ddp_timeout(monkeypatch, capsys):
    """RANK 1 of 2 whose MASTER_ADDR:MASTER_PORT nothing listens on: one line naming the address as soon as the wait
    has taken RENDEZVOUS_NOTICE (torch says nothing until --ddp_timeout), the wait goes on, and torch's failure at
    --ddp_timeout is one line (a Fault: exit status 4). init_process_group here waits until the address was tried,
    then fails as torch's does at its timeout."""
    port = free_port()
    for name, value in {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(name, value)
    tried, probe = threading.Event(), plumbing.distributed.rendezvous_problem

    def init_process_group(**kwargs) -> None:
        tried.wait()
        raise dist.DistNetworkError(f"The client socket has timed out after 2000ms while trying to connect to "
                                    f"(127.0.0.1, {port}).")

    monkeypatch.setattr(plumbing.distributed, "rendezvous_problem", lambda *a: (probe(*a), tried.set())[0])
    monkeypatch.setattr(plumbing.distributed, "RENDEZVOUS_NOTICE", 0.0)
    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    with pytest.raises(plumbing.Fault, match=rf"^rank 1: the rendezvous at 127.0.0.1:{port} \(MASTER_ADDR:MASTER_PORT\) "
                                             r"failed after \d+ s \(--ddp_timeout 2 s\): The client socket has timed "
                                             rf"out after 2000ms while trying to connect to \(127.0.0.1, {port}\); "
                                             "check the address, and that every rank starts$"):
        plumbing.setup_distributed(2.0)
    said = capsys.readouterr().err.splitlines()
    assert [line.partition(": ")[2] for line in said] == [
        f"rank 1: the rendezvous at 127.0.0.1:{port} (MASTER_ADDR:MASTER_PORT) does not answer (connection refused: "
        "nothing listens there); waiting on, up to --ddp_timeout 2 s: check the address, and that rank 0 has started"]


def test_an_empty_master_addr_is_one_line_not_torchs_traceback(monkeypatch):
    """MASTER_ADDR set but empty (an unset variable expanded by a job script): torch's env:// rendezvous raises
    ValueError at once; one line naming it."""
    for name, value in {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "",
                        "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(plumbing.ConfigError, match="^rank 1: torch.distributed refused the launch's environment: .*"
                                                   "MASTER_ADDR expected, but not set; launch with torchrun"):
        plumbing.setup_distributed(600.0)
