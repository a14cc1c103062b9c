"""The demo's synthetic task and tools, and the benchmark scripts that need no TRL, on small settings (the full
demo is `make demo`)."""

import json
import random
import shutil
from pathlib import Path

import pytest
import tyro

import rloo
from benchmark import demo, learning, sync_cost, synthetic_task, throughput
from benchmark.plot_metrics import plot_curves
from conftest import REPO
from helpers import planned_commands, run_benchmark_script


def test_true_score_by_hand():
    assert synthetic_task.true_score("c a f :", "a c f") == 1.0
    assert synthetic_task.true_score("c a f :", "a b") == pytest.approx(0.5 * 2 / 3)  # half in prompt, too short
    assert synthetic_task.true_score("c a f :", "a a a a a a a a") == pytest.approx(1 / 3)  # two letters too many
    assert synthetic_task.true_score("c a f :", "") == 0.0
    assert synthetic_task.true_reward(["c a f :"], ["a"], letters=["acf"]) == [pytest.approx(1 / 3)]


def test_tokenizer_and_prompts():
    tokenizer = synthetic_task.build_tokenizer()
    assert tokenizer("c a f :")["input_ids"] == [4, 2, 7, 14]
    assert tokenizer.decode([4, 2, 1], skip_special_tokens=True) == "c a"
    rows = synthetic_task.make_prompt_rows(50, seed=0)
    assert rows == synthetic_task.make_prompt_rows(50, seed=0)  # deterministic
    for row in rows:
        letters = row["prompt"].split()[:-1]
        assert 3 <= len(letters) <= 6 and len(set(letters)) == len(letters) and row["letters"] == "".join(sorted(letters))


def test_sft_policy_is_imperfect_and_improvable(synthetic_sft):
    tokenizer, policy = synthetic_sft["tokenizer"], synthetic_sft["policy"]
    prompts = [row["prompt"] for row in synthetic_task.make_prompt_rows(32, seed=5)]
    score = synthetic_task.mean_true_score(policy, tokenizer, prompts)
    assert 0.2 < score < 0.8  # learned something, far from perfect


def test_demo_command_uses_only_real_flags():
    command = demo.rloo_command(demo.Args(), {k: "x" for k in ("policy", "reward_model", "train", "test")})
    assert command[1] == "rloo.py"
    args = tyro.cli(rloo.Args, args=command[2:])
    rloo.compute_batch_sizes(args, world_size=1)  # the demo's batch sizes are consistent


def test_make_demo_replaces_its_own_finished_run_and_nothing_else(tmp_path):
    """A finished demo run (its args.json: the demo's name, inputs and output_dir) is deleted, its files only: not
    abandoned/ nor a file of the user's; another run's, an unfinished one, an args.json that is not a run's record
    are left to rloo.py's --overwrite_output_dir, which moves them aside."""
    assets = {"policy": "/cache/policy", "train": "/cache/train.jsonl"}
    out = tmp_path / "demo"

    def demo_run(**record) -> None:
        (out / "checkpoints" / "step_3").mkdir(parents=True)
        (out / "checkpoints" / "step_3" / "trainer_state.pt").write_text("x")
        (out / "abandoned" / "20260101_overwritten").mkdir(parents=True)
        for name in ("metrics.jsonl", "curves.png", "model.safetensors", "config.json", "notes.txt"):
            (out / name).write_text("x")
        (out / "args.json").write_text(json.dumps({
            "exp_name": demo.EXP_NAME, "model_name_or_path": assets["policy"], "dataset_name": assets["train"],
            "output_dir": str(out), "run_id": "r1", "files": ["model.safetensors", "config.json"], **record}))

    demo_run()
    assert demo.replace_previous_demo(str(out), assets) == ["args.json", "checkpoints", "config.json", "curves.png",
                                                           "metrics.jsonl", "model.safetensors"]
    assert sorted(p.name for p in out.iterdir()) == ["abandoned", "notes.txt"]
    assert (out / "abandoned" / "20260101_overwritten").is_dir()
    for other in ({"exp_name": "mine"}, {"model_name_or_path": "/my/policy"}, {"output_dir": "/elsewhere"},
                  {"run_id": None}):
        shutil.rmtree(out)
        demo_run(**other)
        assert demo.replace_previous_demo(str(out), assets) == [] and (out / "model.safetensors").exists()
    (out / "args.json").unlink()  # an unfinished run: no record
    assert demo.replace_previous_demo(str(out), assets) == [] and (out / "metrics.jsonl").exists()
    assert demo.EXP_NAME in demo.rloo_command(demo.Args(), {k: "x" for k in ("policy", "reward_model", "train",
                                                                              "test")})


def test_plot_curves_writes_a_png(tmp_path):
    rng = random.Random(0)
    lines = [{"update": u, "episode": 64 * u, "objective/scores": rng.random(), "objective/rlhf_reward": rng.random(),
              "objective/kl": rng.random()} for u in range(1, 30)] + [{"update": 29, "episode": 1856, "eval/scores": 1.0}]
    path = tmp_path / "run" / "metrics.jsonl"
    path.parent.mkdir()
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    plot_curves([path, path], tmp_path / "curves.png")
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.bench
def test_options_cost_runs_an_option_set(tmp_path):
    """The set that launches the most (torchrun, FSDP, offload); the baseline is throughput.py's run, tested there."""
    run_benchmark_script(
        "benchmark/options_cost.py", "--options", "fsdp_offload", "--updates", "2",
        "--prompt_length", "8", "--response_length", "4", "--per_device_train_batch_size", "2",
        "--gradient_accumulation_steps", "1", "--num_mini_batches", "2", "--num_ppo_epochs", "1",
        "--local_rollout_forward_batch_size", "4", "--cache_dir", tmp_path / "cache",
        "--output_dir", tmp_path / "results", "--runs_dir", tmp_path / "runs")
    report = json.loads((tmp_path / "results" / "options_cost_cpu.json").read_text())
    assert list(report["results"]) == ["pythia-14m fsdp_offload"]
    assert report["written_by"] == "benchmark/options_cost.py"  # its mark: a rerun replaces it, nothing else
    for run in report["results"].values():
        assert run["updates_measured"] == 1 and run["seconds_per_update"] > 0 and run["peak_rss_gib"] > 0


def test_sync_cost_counts_the_parameters_it_sends(tmp_path):
    """The computed tables at one shape (the measured LoRA syncs: the bench test below)."""
    run_benchmark_script("benchmark/sync_cost.py", "--shapes", "pythia-70m", "--output", tmp_path / "cost.md",
                         "--measured_shape", "None")
    text = (tmp_path / "cost.md").read_text()
    from benchmark.sync_cost import parameter_count
    params = parameter_count("pythia-70m")
    assert 70e6 < params < 71e6  # pythia-70m: 70.4M parameters
    assert f"| pythia-70m | {params / 1e9:.2f} B | {2 * params / 1e9:.1f} GB |" in text
    assert "LoRA syncs measured" not in text


@pytest.mark.bench
def test_sync_cost_measures_merged_and_adapter_syncs_with_an_hf_engine(tmp_path):
    """The measured LoRA syncs at one rank and target (each case an engine process of its own: the committed table's
    eight take a minute)."""
    run_benchmark_script("benchmark/sync_cost.py", "--shapes", "pythia-70m", "--output", tmp_path / "cost.md",
                         "--lora_ranks", "8", "--lora_targets", "all-linear", "--syncs", "2")
    text = (tmp_path / "cost.md").read_text()
    measured = [line for line in text.splitlines() if line.startswith("| all-linear | 8 | ")]
    assert [line.split(" | ")[2] for line in measured] == ["merged", "adapters"], text
    assert all(float(line.split(" | ")[5]) >= 0 for line in measured), text  # ms per sync, median: a number


def test_make_bench_writes_where_git_does_not_track_and_only_bench_results_replaces_the_committed(tmp_path):
    for target, results in (("bench", "runs/bench"), ("bench-results", "benchmark/results")):
        runs = [c for c in planned_commands(target, tmp_path / "env") if "benchmark/" in c and "--output_dir" in c]
        assert len(runs) == 2 and all(c.endswith(f"--output_dir {results}") for c in runs), runs
    ignored = (REPO / ".gitignore").read_text().splitlines()
    for default in (throughput.Args().output_dir, learning.Args().output_dir, sync_cost.Args().output):
        assert f"{Path(default).parts[0]}/" in ignored, default  # the scripts run by hand: runs/, untracked
