"""The side-by-side benchmarks against TRL (benchmark/throughput.py, learning.py, trl_rloo.py) on minimal settings.

The runs need the TRL environment of `make bench-env`, finished; without it (or with an install that did not finish)
they are skipped, unless REQUIRE_BENCH_ENV=1 (as in CI, which builds it) makes that a failure.
"""

import json
import os
import subprocess

import pytest

from benchmark import synthetic_task
from benchmark.throughput import trl116_command, trl_environment_problem
from benchmark.trl_rloo import decode_for_monitors
from conftest import REPO
from helpers import python, run_benchmark_script

TRL_PYTHON = REPO / "benchmark" / ".venv-trl" / "bin" / "python"


@pytest.fixture(scope="session")
def trl_python():
    problem = trl_environment_problem(TRL_PYTHON)
    if problem:
        if os.environ.get("REQUIRE_BENCH_ENV") == "1":
            pytest.fail(problem)
        pytest.skip(problem)
    return TRL_PYTHON


@pytest.fixture(scope="session")
def trl116():
    """The command that runs benchmark/trl116_rloo.py with make bench-env's TRL 1.16 (benchmark/.trl116-site)."""
    command, problem = trl116_command("benchmark/.trl116-site")
    if problem:
        if os.environ.get("REQUIRE_BENCH_ENV") == "1":
            pytest.fail(problem)
        pytest.skip(problem)
    return command


def fake_python(env_dir, imports_trl: bool, finished: bool):
    """A stand-in for an environment's Python that only says whether `import trl` works; `finished`: the mark
    `make bench-env` leaves after its last install step."""
    python = env_dir / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f"#!/bin/sh\nexit {0 if imports_trl else 1}\n")
    python.chmod(0o755)
    if finished:
        (env_dir / ".rloo-installed-lock1").touch()
    return python


def test_a_half_built_trl_environment_is_not_taken_for_built(tmp_path):
    assert "no TRL environment" in trl_environment_problem(tmp_path / "none" / "bin" / "python")
    half_built = trl_environment_problem(fake_python(tmp_path / "half", imports_trl=False, finished=False))
    assert "is half-built" in half_built and "run `make bench-env`" in half_built
    assert trl_environment_problem(fake_python(tmp_path / "made", imports_trl=False, finished=True)) is None
    assert trl_environment_problem(fake_python(tmp_path / "by_hand", imports_trl=True, finished=False)) is None


def test_monitors_see_what_rloo_py_hands_reward_functions():
    import torch

    tokenizer = synthetic_task.build_tokenizer()  # <pad>=0 <eos>=1 a..l=2..13 :=14
    queries = [[0, 0, 4, 2, 14], [3, 5, 6, 7, 14]]  # left-padded "c a :" and "b d e f :"
    responses = [[2, 4, 1, 0], [3, 3, 3, 3]]  # "a c <eos>" then padding (TRL's truncation); no stop token
    texts = decode_for_monitors(tokenizer, torch.tensor([q + r for q, r in zip(queries, responses)]), 5, 1)
    assert texts == {"prompts": ["c a :", "b d e f :"], "completions": ["a c", "b b b b"],
                     "completion_ids": [[2, 4, 1], [3, 3, 3, 3]]}


def test_trl_runner_refuses_what_trl_cannot_do(trl_python, tmp_path):
    result = subprocess.run([str(trl_python), "benchmark/trl_rloo.py", "--model_name_or_path", "x",
                             "--reward_model_path", "y", "--max_grad_norm", "1.0"],
                            capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 2 and "never clips gradients: pass --max_grad_norm 0" in result.stderr
    result = subprocess.run([str(trl_python), "benchmark/trl_rloo.py", "--reward_model_path", "y", "--max_grad_norm",
                             "0", "--reward_fn", "benchmark.synthetic_task:true_reward"],
                            capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 2 and "--reward_weights 1 0" in result.stderr


@pytest.mark.bench
def test_trl116_runner_refuses_what_it_cannot_do_in_one_line_before_importing_trl():
    """The project's environment has no TRL: each refusal comes before TRL's import, and its absence is one line."""
    def run(*flags):
        result = subprocess.run([python(), "benchmark/trl116_rloo.py", *flags], capture_output=True, text=True,
                                cwd=REPO, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
        assert result.returncode == 2, result.stderr
        (line,) = result.stderr.strip().splitlines()
        return line

    assert "has no equivalent of --bf16_generation, --token_level_kl: drop them" in run(
        "--model_name_or_path", "x", "--reward_model_path", "y", "--token_level_kl", "--bf16_generation")
    assert "has no equivalent of --reward_weights, --resume: drop them" in run(  # what it does not map: refused
        "--model_name_or_path", "x", "--reward_model_path", "y", "--resume", "--reward_weights", "2",
        "--num_evals", "3")  # (evaluation, logging and saving flags have no effect here: not refused)
    assert "scores with a reward model: pass --reward_model_path" in run("--model_name_or_path", "x")
    assert "not divisible by rloo_k (3)" in run("--model_name_or_path", "x", "--reward_model_path", "y",
                                                 "--rloo_k", "3", "--per_device_train_batch_size", "4",
                                                 "--local_rollout_forward_batch_size", "4")
    assert "pass --local_rollout_forward_batch_size 8 (to both trainers) rather than 64" in run(
        "--model_name_or_path", "x", "--reward_model_path", "y")  # rloo.py's defaults: 8 and 64
    missing = run("--model_name_or_path", "x", "--reward_model_path", "y", "--local_rollout_forward_batch_size", "8")
    assert "which this Python cannot import" in missing and "benchmark/.trl116-site first on PYTHONPATH" in missing


@pytest.mark.bench
def test_trl116_runner_maps_epochs_and_minibatches_to_one_row_per_update(trl116, tmp_path):
    """num_ppo_epochs 2 x num_mini_batches 2: TRL 1.16's num_iterations 2, steps_per_generation 2 (micro-batches),
    4 optimizer steps per generation, one metrics row each with rloo.py's names; the training passes feed each
    completion twice; --stop_token None: every completion response_length tokens."""
    paths = synthetic_task.asset_paths(tmp_path / "cache")
    synthetic_task.build_assets(paths, policy_steps=2, reward_steps=2)
    result = subprocess.run(trl116 + [
        "--model_name_or_path", paths["policy"], "--reward_model_path", paths["reward_model"], "--dataset_name",
        paths["train"], "--output_dir", tmp_path / "run", "--rloo_k", "2", "--per_device_train_batch_size", "2",
        "--local_rollout_forward_batch_size", "2", "--num_mini_batches", "2", "--num_ppo_epochs", "2",
        "--total_episodes", "8", "--response_length", "5",
        "--stop_token", "None", "--max_grad_norm", "0"], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(row["update"], row["episode"]) for row in rows] == [(1, 4), (2, 8)]
    for row in rows:
        assert row["completions/mean_length"] == 5
        assert row["work/training_tokens"] == 2 * row["work/policy_forward_tokens"]  # 2 epochs
        assert row["time/update"] >= row["time/generation"] + row["time/training"] > 0
        assert {"objective/scores", "kl", "work/minimum_tokens", "time/reference_forward", "time/scoring"} <= set(row)
    assert (tmp_path / "run" / "model.safetensors").exists()


@pytest.mark.bench
def test_throughput_runs_both_trainers_and_reports_the_ratio_and_the_work(trl_python, trl116, tmp_path):
    run_benchmark_script("benchmark/throughput.py", "--trl_python", trl_python, "--repeats", "1", "--updates", "2",
               "--shapes", "pythia-14m", "--prompt_length", "72", "--response_length", "6",
               "--mean_response_length", "3", "--rloo_ks", "2", "--per_device_train_batch_size", "4",
               "--gradient_accumulation_steps", "1", "--local_rollout_forward_batch_size", "4",  # TRL 1.16: equal
               "--cache_dir", tmp_path / "cache", "--output_dir", tmp_path / "results", "--runs_dir", tmp_path / "runs")
    report = json.loads((tmp_path / "results" / "throughput_cpu.json").read_text())
    assert report["written_by"] == "benchmark/throughput.py"  # its mark: a rerun replaces it, nothing else
    result = report["results"]["pythia-14m k=2"]  # TL;DR-like prompt lengths (clipped to 64..72), EOS-prone policy
    for name in ("rloo.py", "trl", "trl116"):  # TRL 0.21 and TRL 1.16, each after rloo.py
        (run,) = result[name]
        assert run["updates_measured"] == 1 and run["episodes_per_s"] > 0 and run["peak_rss_gib"] > 0
        assert run["generation_s"] > 0 and run["training_s"] > 0
        assert run["forward_tokens"] >= run["minimum_tokens"] > 0
        assert run["mean_response_length"] < 6  # the calibrated EOS ends some responses early
        assert result["rloo.py"][0]["forward_tokens"] < run["forward_tokens"] or name == "rloo.py"  # prompts once
    assert result["trl116"][0]["policy_forward_s"] > 0  # TRL 1.16's old log-prob pass, even on-policy
    for ratio in ("ratio", "ratio_trl116"):
        assert result[ratio]["min"] == result[ratio]["median"] > 0
    table = (tmp_path / "results" / "throughput_cpu.md").read_text()
    assert "rloo.py / TRL 0.21" in table and "rloo.py / TRL 1.16" in table and "k=2 trl116 |" in table


@pytest.mark.bench
def test_learning_trains_both_and_plots(trl_python, tmp_path):
    paths = synthetic_task.asset_paths(tmp_path / "cache")
    synthetic_task.build_assets(paths, policy_steps=30, reward_steps=30)  # weak but quick
    run_benchmark_script("benchmark/learning.py", "--trl_python", trl_python, "--seeds", "1", "--total_episodes", "128",
               "--cache_dir", tmp_path / "cache", "--output_dir", tmp_path / "results", "--runs_dir", tmp_path / "runs")
    report = json.loads((tmp_path / "results" / "learning.json").read_text())
    assert report["written_by"] == "benchmark/learning.py"  # its mark: a rerun replaces it, nothing else
    for name in ("rloo.py", "trl"):
        (result,) = report["results"][name]
        assert 0 <= result["true_score_sampled"] <= 1 and 0 <= result["true_score_greedy"] <= 1
        assert result["training_seconds"] > 0
        rows = [json.loads(line) for line in (tmp_path / "runs" / f"{name.replace('.', '_')}_seed1" / "metrics.jsonl")
                .read_text().splitlines()]
        assert len(rows) == 2 and all("reward/true_reward/mean" in row for row in rows)  # 128 / 64 per update
    for png in ("learning_episodes.png", "learning_seconds.png"):
        assert (tmp_path / "results" / png).read_bytes()[:4] == b"\x89PNG"
