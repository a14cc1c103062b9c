"""Checkpoints that survive preemption, exact resume, and stopping loudly on NaN/inf."""

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import rloo
from conftest import REPO, policy_tokenizer, read_metrics, run_rloo, tiny_policy

RUN = ("--reward_fn", "reward_fns:count_a", "--rloo_k", "4", "--per_device_train_batch_size", "16",
       "--response_length", "6", "--temperature", "1.0", "--max_prompt_length", "16",
       "--local_rollout_forward_batch_size", "32", "--num_ppo_epochs", "2", "--num_mini_batches", "2",
       "--learning_rate", "3e-3", "--num_sample_generations", "0", "--num_evals", "3")
PER_UPDATE = 32  # completions per update and rank: 16 x 1 x 2 minibatches (8 prompts x k=4)
NOT_REPRODUCIBLE = ("eps", "time/")  # wall-clock measurements


def comparable(metrics: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if not k.startswith(NOT_REPRODUCIBLE)} for m in metrics]


def launch(args: list, nproc: int = 0) -> subprocess.Popen:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
                "--signals_to_handle", "SIGTERM,SIGINT,SIGUSR1"] if nproc else [sys.executable]
    env = {**os.environ, "PYTHONPATH": str(REPO / "tests"), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    return subprocess.Popen([*launcher, str(REPO / "rloo.py"), *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)


def interrupt_after_first_update(args: list, sig: signal.Signals, nproc: int = 0) -> tuple[int, str, str]:
    """Start a run, send it a real signal once it has logged an update, wait for it to end."""
    process = launch(args, nproc)
    metrics = Path(args[args.index("--output_dir") + 1]) / "metrics.jsonl"
    deadline = time.time() + 120
    while not (metrics.exists() and metrics.read_text().count("\n") >= 1) and process.poll() is None:
        assert time.time() < deadline, "the run never logged an update"
        time.sleep(0.05)
    process.send_signal(sig)
    stdout, stderr = process.communicate(timeout=120)
    return process.returncode, stdout, stderr


def assert_same_run(full: Path, resumed: Path) -> None:
    assert comparable(read_metrics(resumed)) == comparable(read_metrics(full))
    a, b = load_file(full / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # bit-identical


@pytest.mark.parametrize("nproc,sig,extra", [(0, signal.SIGTERM, []), (2, signal.SIGUSR1, []),
                                             (2, signal.SIGUSR1, ["--fsdp", "--fsdp_generation", "per_block"])],
                         ids=["python-SIGTERM", "torchrun-SIGUSR1", "torchrun-fsdp-SIGUSR1"])
def test_signal_saves_and_resume_is_exact(assets, tmp_path, nproc, sig, extra):
    common = ["--model_name_or_path", assets["policy"], "--dataset_name", assets["train"], "--dataset_test_split",
              assets["test"], "--total_episodes", PER_UPDATE * 40 * max(nproc, 1), *RUN, *extra]
    if nproc:  # a causal LM as reward model, as in TRL's getting-started command: its one-label head is new,
        common += ["--reward_model_path", assets["policy"]]  # and must start the same on every rank and resume
    full, interrupted = tmp_path / "full", tmp_path / "interrupted"
    result = run_rloo(*common, "--output_dir", full, nproc=nproc)
    assert result.returncode == 0, result.stderr[-3000:]

    returncode, stdout, stderr = interrupt_after_first_update([*common, "--output_dir", interrupted], sig, nproc)
    assert f"{sig.name} received: stopped after update" in stdout, stdout[-2000:] + stderr[-3000:]
    if nproc == 0:
        assert returncode == 0  # (torchrun's own agent exits non-zero after forwarding a signal)
    assert not (interrupted / "model.safetensors").exists()  # not a finished run
    assert (interrupted / "preempted").read_text().strip() == str(rloo.latest_checkpoint(str(interrupted)))
    stopped_at = rloo.latest_checkpoint(str(interrupted))
    assert stopped_at is not None and len(read_metrics(interrupted)) < len(read_metrics(full))

    result = run_rloo(*common, "--output_dir", interrupted, "--resume", nproc=nproc)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resuming from {stopped_at}" in result.stdout and not (interrupted / "preempted").exists()
    assert_same_run(full, interrupted)  # metrics.jsonl appended line by line, same weights
    AutoModelForCausalLM.from_pretrained(interrupted)  # a plain HF checkpoint, also when saved from FSDP shards


def test_resume_refuses_meaning_changes_reports_harmless_ones_and_continues_wandb(assets, tmp_path):
    out = tmp_path / "run"
    common = ["--model_name_or_path", assets["policy"], "--dataset_name", assets["train"], "--output_dir", out,
              "--track", *RUN]
    result = run_rloo(*common, "--total_episodes", PER_UPDATE * 3, "--save_steps", 1, "--save_total_limit", 2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_2", "step_3"]  # the newest 2
    assert AutoModelForCausalLM.from_pretrained(out / "checkpoints" / "step_3")  # loadable on its own

    refused = run_rloo(*common, "--total_episodes", PER_UPDATE * 4, "--resume", "--rloo_k", 2, "--learning_rate", 1e-3)
    assert refused.returncode == 2
    assert "rloo_k (4 -> 2)" in refused.stderr and "learning_rate (0.003 -> 0.001)" in refused.stderr

    result = run_rloo(*common, "--total_episodes", PER_UPDATE * 4, "--resume", "--num_evals", 1)
    assert result.returncode == 0, result.stderr[-3000:]
    assert ("changed: num_evals (3 -> 1), save_steps (1 -> 0), save_total_limit (2 -> None), "
            "total_episodes (96 -> 128)") in result.stdout
    assert [m["update"] for m in read_metrics(out)] == [1, 2, 3, 4]  # appended, never truncated
    run_ids = {p.name.rsplit("-", 1)[1] for p in (out / "wandb").glob("offline-run-*")}
    assert len(list((out / "wandb").glob("offline-run-*"))) == 2 and len(run_ids) == 1  # the same wandb run


def test_resume_from_a_path_and_without_checkpoint(assets, tmp_path):
    args = ["--model_name_or_path", assets["policy"], "--dataset_name", assets["train"], *RUN]
    missing = run_rloo(*args, "--output_dir", tmp_path / "a", "--resume_from", tmp_path / "nowhere")
    assert missing.returncode == 2 and "not a checkpoint" in missing.stderr
    fresh = run_rloo(*args, "--output_dir", tmp_path / "a", "--resume", "--total_episodes", PER_UPDATE)  # nothing yet
    assert fresh.returncode == 0 and "resuming" not in fresh.stdout
    other = run_rloo(*args, "--output_dir", tmp_path / "b", "--resume_from", tmp_path / "a" / "checkpoints" / "step_1",
                     "--total_episodes", 2 * PER_UPDATE)
    assert other.returncode == 0 and [m["update"] for m in read_metrics(tmp_path / "b")] == [2]


def test_sigkill_during_saves_never_leaves_a_broken_latest_checkpoint(tmp_path):
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'tests'}:{REPO}"}
    rng = random.Random(0)
    out = tmp_path / "out"
    for attempt in range(4):
        process = subprocess.Popen([sys.executable, str(REPO / "tests" / "save_loop.py"), str(out)], env=env)
        deadline = time.time() + 60
        while rloo.latest_checkpoint(str(out)) is None or attempt == 0 and len(list((out / "checkpoints").glob("step_*"))) < 2:
            assert time.time() < deadline and process.poll() is None
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 0.5))
        process.send_signal(signal.SIGKILL)
        process.wait()
        latest = rloo.latest_checkpoint(str(out))
        assert latest is not None and latest.name.startswith("step_")
        state = torch.load(latest / rloo.TRAINER_STATE, weights_only=False)
        assert f"step_{state['update']}" == latest.name
        assert AutoModelForCausalLM.from_pretrained(latest).num_parameters() > 0
    # debris of a killed save, and a directory that merely looks like a checkpoint, are never picked up
    (out / "checkpoints" / ".tmp_step_999").mkdir(exist_ok=True)
    (out / "checkpoints" / "step_1000").mkdir()
    assert rloo.latest_checkpoint(str(out)) == latest


def test_nonfinite_reward_stops_the_run_and_saves_the_batch(assets, tmp_path):
    out = tmp_path / "run"
    result = run_rloo("--model_name_or_path", assets["policy"], "--dataset_name", assets["train"], "--output_dir", out,
                      "--total_episodes", PER_UPDATE * 5, *RUN[2:], "--reward_fn", "reward_fns:nan_at_second_call")
    assert result.returncode == 3, result.stderr[-3000:]
    error = result.stderr.strip().splitlines()[-1]
    assert "non-finite reward at update 2 on rank 0" in error and "Traceback" not in result.stderr
    assert [m["update"] for m in read_metrics(out)] == [1]
    dump = (out / "nonfinite" / "update_2_rank_0.jsonl").read_text().splitlines()
    assert len(dump) == PER_UPDATE and '"score": NaN' in dump[0] and '"prompt": ' in dump[0] and '"completion": ' in dump[0]


def test_nonfinite_on_one_rank_stops_every_rank(assets, tmp_path):
    out = tmp_path / "run"
    result = run_rloo("--model_name_or_path", assets["policy"], "--dataset_name", assets["train"], "--output_dir", out,
                      "--total_episodes", PER_UPDATE * 2 * 4, *RUN[2:], "--reward_fn", "reward_fns:nan_on_rank_one", nproc=2,
                      timeout=120)
    assert result.returncode != 0
    assert "non-finite reward at update 1 on rank 1" in result.stderr
    assert (out / "nonfinite" / "update_1_rank_1.jsonl").exists()
    assert not (out / "nonfinite" / "update_1_rank_0.jsonl").exists()


def test_no_optimizer_step_on_a_nonfinite_loss():
    tokenizer = policy_tokenizer()
    policy = tiny_policy(len(tokenizer))
    queries, mask = rloo.pad_sequences([tokenizer("a b :")["input_ids"]] * 2, 0, torch.device("cpu"))
    c = rloo.sample_completions(policy, queries, mask, 4, 1.0, 1, 0, k=2)  # 4 completions
    rollout = rloo.Rollout(c.queries, c.query_mask, c.responses, c.response_mask, torch.zeros(4, 4), None)
    args = rloo.Args(rloo_k=2, per_device_train_batch_size=4, num_ppo_epochs=1, temperature=1.0)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1.0)
    with pytest.raises(rloo.NonFiniteError, match="non-finite loss on rank 0"):
        rloo.ppo_update(policy, optimizer, rollout, torch.zeros(4), torch.tensor([1.0, float("nan"), 0.0, 0.0]),
                        args, rloo.compute_batch_sizes(args, 1), True, lambda: torch.autocast("cpu", enabled=False))
    assert all(torch.equal(before[k], v) for k, v in policy.state_dict().items())
