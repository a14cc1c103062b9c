"""A researcher's first hour: rloo.py run by its path from their own folder with their reward function, the OpenMP
wait policy, the run's own curves and evaluation schedule, start-up lines, an adapter loaded from elsewhere."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import plumbing
import rloo
from conftest import REPO, cpu_env, read_metrics
from helpers import python

TINY_RUN = ("--rloo_k", "4", "--per_device_train_batch_size", "16", "--response_length", "6", "--temperature", "1.0",
            "--max_prompt_length", "16", "--local_rollout_forward_batch_size", "32", "--num_ppo_epochs", "1")

MY_REWARDS = '''
def has_a(completions, **kwargs):
    return [float("a" in c) for c in completions]
'''


def run_from(folder: Path, *args, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python /path/to/rloo.py ARGS` typed in `folder`, with neither folder nor tests/ on PYTHONPATH."""
    environment = cpu_env({"WANDB_MODE": "offline", **(env or {})})
    environment.pop("PYTHONPATH", None)
    environment.update(env or {})
    return subprocess.run([python(), str(REPO / "rloo.py"), *map(str, args)], capture_output=True, text=True,
                          env=environment, cwd=folder, timeout=300)


def test_reward_fn_from_the_folder_the_command_runs_in(assets, tmp_path):
    """The README's command, typed in the user's folder: the reward module beside them, rloo.py by its path; the run
    evaluates the initial policy (update 0), then as --num_evals says, and draws its curves."""
    (tmp_path / "my_rewards.py").write_text(MY_REWARDS)
    result = run_from(tmp_path, "--model_name_or_path", assets["policy"], "--dataset_name", assets["train"],
                      "--dataset_test_split", assets["test"], "--reward_fn", "my_rewards:has_a", "--output_dir", "run",
                      "--total_episodes", 16 * 3, "--num_evals", 1, *TINY_RUN)
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / "run"
    assert [m["update"] for m in read_metrics(out) if "eval/scores" in m] == [0, 3]
    assert [m["episode"] for m in read_metrics(out) if "eval/scores" in m] == [0, 48]
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "reward/has_a/mean" in read_metrics(out)[-2]
    # start-up says what it does, a line per step with its time
    lines = result.stdout.splitlines()
    for step in ("loaded the tokenizer in ", "loaded the prompts in ", "loaded the policy and its reference in ",
                 "set up the reward functions in ", "start-up check of prompt sharing"):
        assert any(line.startswith(step) for line in lines), (step, result.stdout[:3000])
    prompts = next(line for line in lines if line.startswith("loaded the prompts"))
    assert "256 train, 16 test; tokens per prompt min 5 / median 5 / max 5; 0 dropped" in prompts, prompts


def test_a_reward_module_not_found_says_where_it_looked(assets, tmp_path):
    result = run_from(tmp_path, "--model_name_or_path", assets["policy"], "--dataset_name", assets["train"],
                      "--reward_fn", "my_rewards:has_a", "--output_dir", "run", env={"PYTHONPATH": "/nowhere"})
    assert result.returncode == 2, result.stderr
    error = result.stderr.strip().splitlines()[-1]
    for fragment in ("cannot import 'my_rewards'", f"working directory {tmp_path}", "/nowhere",
                     "run from the folder that holds my_rewards.py", "PYTHONPATH"):
        assert fragment in error, error


def test_a_reward_module_whose_own_import_fails_names_that(assets, tmp_path):
    (tmp_path / "my_rewards.py").write_text("import no_such_package_here\n" + MY_REWARDS)
    result = run_from(tmp_path, "--model_name_or_path", assets["policy"], "--dataset_name", assets["train"],
                      "--reward_fn", "my_rewards:has_a", "--output_dir", "run")
    assert result.returncode == 2, result.stderr
    assert "it imports 'no_such_package_here', which is not installed" in result.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("script, own", [("rloo", None), ("rloo", ""), ("rloo", "ACTIVE"), ("rloo_multinode", None),
                                         ("plan_memory", None)])
def test_openmp_threads_sleep_unless_the_user_says_otherwise(script, own):
    """OpenMP itself reports the policy it runs with (OMP_DISPLAY_ENV), once torch has loaded it."""
    env = {**os.environ, "OMP_DISPLAY_ENV": "TRUE", "PYTHONPATH": str(REPO)}
    env.pop("OMP_WAIT_POLICY", None)
    if own is not None:
        env["OMP_WAIT_POLICY"] = own
    result = subprocess.run([sys.executable, "-c", f"import {script}, torch; torch.ones(8).sum()"],
                            capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert f"OMP_WAIT_POLICY = '{own or 'PASSIVE'}'" in result.stderr, result.stderr


@pytest.mark.parametrize("num_updates, num_evals, expected", [
    (7, 4, {2, 4, 6, 7}), (7, 0, {7}), (7, 1, {7}), (7, 7, set(range(1, 8))), (7, 20, set(range(1, 8))),
    (40, 2, {20, 40}), (10, 3, {4, 7, 10}), (1, 4, {1}), (245, 4, {62, 123, 184, 245})])
def test_num_evals_is_the_number_of_evaluations(num_updates, num_evals, expected):
    at = plumbing.evaluation_updates(rloo.Args(num_evals=num_evals), plumbing.RunLength(num_updates, 1), 1)
    assert at == expected
    assert len(at) == min(max(num_evals, 1), num_updates) and max(at) == num_updates


def metrics_file(path: Path, sources: list[str], evals: bool = True, mismatch: float | None = None) -> Path:
    lines = [{"update": 0, "episode": 0, "eval/scores": 0.1}] if evals else []
    for update in range(1, 6):
        lines.append({"update": update, "episode": 64 * update, "objective/scores": 0.1 * update,
                      "objective/rlhf_reward": 0.1 * update, "objective/kl": 0.01 * update,
                      "completions/mean_length": 5.0, "objective/entropy": 9.0 - update,
                      **{f"reward/{s}/mean": 0.5 for s in sources},
                      **({"mismatch/logprob_diff_mean": mismatch} if mismatch is not None else {})})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.mark.parametrize("sources, title", [(["reward_model"], "score (reward model)"),
                                            (["count_a"], "score (count_a())"),
                                            (["reward_model", "count_a"], "score (reward model, count_a())")])
def test_curve_titles_say_what_the_score_is(tmp_path, sources, title):
    runs = [(plumbing.read_metrics(path), plumbing.read_metrics(path, evals=True))
            for path in [metrics_file(tmp_path / "metrics.jsonl", sources)]]
    panels = plumbing.curve_panels(runs)
    assert panels[0][1] == title and panels[1][0] == "eval/scores" and title[6:-1] in panels[1][1]
    assert len(panels) == 6  # no mismatch logged, no mismatch panel


def test_curves_panels_follow_what_was_logged(tmp_path):
    """The reward, the evaluation, the KL, length and entropy first; the sampler/trainer mismatch only where a sampler
    differs from the trainer (a bf16 copy: ~1e-2 per token), not at float32's rounding (the same weights: ~1e-7)."""
    first = ["objective/scores", "objective/kl", "completions/mean_length", "objective/entropy",
             "objective/rlhf_reward"]
    for mismatch, panels in ((1e-7, first), (2e-2, [*first, "mismatch/logprob_diff_mean"])):
        path = metrics_file(tmp_path / f"{mismatch}" / "metrics.jsonl", ["count_a"], evals=False, mismatch=mismatch)
        runs = [(plumbing.read_metrics(path), plumbing.read_metrics(path, evals=True))]
        assert [key for key, _, _ in plumbing.curve_panels(runs)] == panels
    plumbing.plot_curves([path, metrics_file(tmp_path / "b" / "metrics.jsonl", ["count_a"])], tmp_path / "c.png")
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    from PIL import Image

    assert Image.open(tmp_path / "c.png").size == (1380, 1020)  # 7 panels: a grid of 3 columns and 3 rows


def test_a_run_without_matplotlib_says_so_once_and_goes_on(tmp_path, monkeypatch):
    path = metrics_file(tmp_path / "metrics.jsonl", ["count_a"])
    said = []
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import matplotlib.figure raises ImportError
    sink = plumbing.CurvesSink(path, said.append)
    for _ in range(3):
        sink.draw(force=True)
    assert len(said) == 1 and "matplotlib" in said[0] and not (tmp_path / "curves.png").exists()


def test_a_failing_drawing_never_stops_a_run(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"update": 1, "episode": 1, "objective/scores": "not a number"\n')  # a cut-off line
    said = []
    sink = plumbing.CurvesSink(path, said.append)
    sink.draw(force=True)
    sink.draw(force=True)
    assert len(said) == 1 and said[0].startswith("warning: drawing")


def test_a_policy_directory_without_tokenizer_files_is_named_as_that(assets, tmp_path):
    """transformers builds an empty tokenizer from a config alone: every prompt would be empty."""
    from conftest import tiny_policy

    tiny_policy(16).save_pretrained(tmp_path / "policy")  # weights and config, no tokenizer
    (tmp_path / "my_rewards.py").write_text(MY_REWARDS)
    result = run_from(tmp_path, "--model_name_or_path", "policy", "--dataset_name", assets["train"],
                      "--reward_fn", "my_rewards:has_a", "--output_dir", "run")
    assert result.returncode == 2, result.stderr[-2000:]
    error = result.stderr.strip().splitlines()[-1]
    assert "policy has no tokenizer files" in error and "tokenizer.save_pretrained" in error, error
    assert not (tmp_path / "run").exists()


def test_make_help_lists_every_described_target():
    result = subprocess.run(["make", "-s", "help"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    described = [line.split(":")[0] for line in (REPO / "Makefile").read_text().splitlines() if " ## " in line
                 and not line.startswith(("\t", "#"))]
    listed = [line.split()[1] for line in result.stdout.splitlines()]
    assert listed == described and {"demo", "test", "test-newest", "help"} <= set(listed), result.stdout
    assert all(len(line.split(None, 2)) == 3 for line in result.stdout.splitlines())  # each with its description
    assert "$(" not in result.stdout and "TRL 0.21 in benchmark/.venv-trl" in result.stdout  # variables expanded
