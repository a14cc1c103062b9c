"""rloo.py run as users run it: end to end, under torchrun, and on bad input."""

import json
import shutil
from dataclasses import asdict, fields
from pathlib import Path

import datasets
import docstring_parser
import pytest
import torch
import tyro
from transformers import AutoModelForCausalLM, AutoTokenizer

import plumbing
import rloo
from helpers import argv_of, valid_flags  # noqa: F401 (kept importable from here)
from conftest import (REPO, neox_config, policy_tokenizer, read_metrics, run_rloo, tiny_policy, word_tokenizer,
                      write_jsonl)

TINY_RUN = ("--rloo_k", "4", "--per_device_train_batch_size", "16", "--response_length", "6", "--temperature", "1.0",
            "--max_prompt_length", "16", "--local_rollout_forward_batch_size", "32", "--num_ppo_epochs", "1")


def assert_one_line_error(result, *fragments: str) -> None:
    """Exit status 2, no traceback, and the last line of stderr says what is wrong and how to fix it."""
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("rloo.py: error: "), result.stderr
    for fragment in fragments:
        assert fragment in error, error


def test_reward_rises_end_to_end(assets, tmp_path):
    out = tmp_path / "run"
    result = run_rloo("--model_name_or_path", assets["policy"], "--reward_fn", "reward_fns:count_a",
                      "--dataset_name", assets["train"], "--dataset_test_split", assets["test"], "--output_dir", out,
                      "--total_episodes", 16 * 40, "--learning_rate", 3e-3, "--kl_coef", 0.01,
                      "--num_sample_generations", 2, "--num_evals", 2, "--lr_scheduler_type", "constant", *TINY_RUN)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = read_metrics(out)
    train = [m for m in metrics if "objective/scores" in m]
    evals = [m for m in metrics if "eval/scores" in m]
    assert len(train) == 40 and [m["update"] for m in evals] == [0, 20, 40]  # the initial policy, then --num_evals
    start = sum(m["objective/scores"] for m in train[:5]) / 5
    end = sum(m["objective/scores"] for m in train[-5:]) / 5
    assert end > start + 0.5, (start, end)  # count of `a` among 6 sampled tokens, from ~0.4 at random init
    for key in ("eps", "objective/kl", "objective/entropy", "objective/non_score_reward", "objective/rlhf_reward",
                "policy/approxkl_avg", "policy/clipfrac_avg", "loss/policy_avg", "policy/entropy_avg", "val/ratio",
                "val/ratio_var", "val/num_eos_tokens", "lr", "episode", "completions/mean_length",
                "completions/clipped_ratio", "reward_std", "frac_reward_zero_std", "reward/count_a/mean",
                "time/generation", "time/scoring", "time/training"):
        assert key in train[-1], key
    assert train[-1]["episode"] == 640 and train[0]["val/ratio"] == pytest.approx(1.0, abs=1e-4)
    assert "samples at episode" in result.stdout and "update 40/40" in result.stdout
    # the saved policy loads with transformers alone
    model = AutoModelForCausalLM.from_pretrained(out)
    assert AutoTokenizer.from_pretrained(out).pad_token == "<pad>"
    assert model.num_parameters() == AutoModelForCausalLM.from_pretrained(assets["policy"]).num_parameters()
    assert (out / "args.json").exists()


def test_reward_model_with_its_own_tokenizer_and_every_option(assets, tmp_path):
    out = tmp_path / "run"
    result = run_rloo("--model_name_or_path", assets["policy"], "--reward_model_path", assets["other_rm"],
                      "--reward_fn", "reward_fns:matches_target", "--reward_weights", "1.0", "0.5",
                      "--dataset_name", assets["train"], "--output_dir", out, "--total_episodes", 64,
                      "--token_level_kl", "--normalize_reward", "--normalize_advantage", "--missing_eos_penalty", 1.0,
                      "--gradient_accumulation_steps", 2, "--num_mini_batches", 2, "--num_ppo_epochs", 2,
                      "--gradient_checkpointing", "--bf16", *TINY_RUN[:2], "--per_device_train_batch_size", 4,
                      *TINY_RUN[4:], "--compile_generation", "--bf16_generation", "--local_rollout_forward_batch_size", 0)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = read_metrics(out)
    assert len(metrics) == 4
    assert {"reward/reward_model/mean", "reward/matches_target/mean"} <= set(metrics[0])
    assert "['reward_model', 'matches_target']" in result.stdout


@pytest.mark.parametrize("sharding", [[], ["--fsdp", "--bf16", "--gradient_checkpointing", "--offload"]],
                         ids=["ddp", "fsdp-bf16-offload"])
def test_two_process_torchrun(assets, tmp_path, sharding):
    out = tmp_path / "run"
    result = run_rloo("--model_name_or_path", assets["policy"], "--reward_model_path", assets["reward_model"],
                      "--reward_fn", "reward_fns:only_even_lengths",  # applies to some completions only
                      "--dataset_name", assets["train"], "--dataset_test_split", assets["test"], "--output_dir", out,
                      "--total_episodes", 16 * 2 * 3, "--num_evals", 1, *TINY_RUN, *sharding, nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = read_metrics(out)
    assert [m["episode"] for m in metrics if "eval/scores" not in m] == [32, 64, 96]  # rank 0 alone writes
    assert all(m["reward/reward_model/mean"] == m["reward/reward_model/mean"] for m in metrics if "episode" in m
               and "eval/scores" not in m)  # not NaN
    assert "2 ranks" in result.stdout
    assert (out / "model.safetensors").exists()


def test_tracking_with_wandb_offline_and_no_reference_without_kl(assets, tmp_path):
    out = tmp_path / "run"
    result = run_rloo("--model_name_or_path", assets["policy"], "--reward_fn", "reward_fns:count_a", "--track",
                      "--kl_coef", 0, "--dataset_name", assets["train"], "--output_dir", out, "--total_episodes", 32,
                      *TINY_RUN)
    assert result.returncode == 0, result.stderr[-3000:]
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb"))
    for line in read_metrics(out):  # kl_coef = 0: the reference model is never built nor run
        assert "time/reference_forward" not in line and line["objective/kl"] == 0.0


# ---------------------------------------------------------------- bad input: one line, exit status 2
def base(assets, tmp_path) -> list:
    return ["--model_name_or_path", assets["policy"], "--dataset_name", assets["train"], "--output_dir",
            tmp_path / "out", "--reward_fn", "reward_fns:count_a"]


def test_a_run_in_which_no_completion_is_scored_is_refused_and_a_function_scoring_nothing_is_said(assets, tmp_path):
    """A reward function that returns only None trained on nothing, exit 0, no word: now its update is refused
    (exit 4, the run's last finished update kept) and, beside one that scores, it is said once in one line."""
    result = run_rloo(*base(assets, tmp_path)[:-2], "--reward_fn", "reward_fns:scores_nothing", "--total_episodes",
                      "64", *TINY_RUN)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 4 and len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith("rloo.py: error: no completion of update 1 was scored: every reward function returned "
                               "only None"), lines
    out = tmp_path / "out2"
    result = run_rloo(*base(assets, tmp_path)[:-3], str(out), "--reward_fn", "reward_fns:count_a",
                      "reward_fns:scores_nothing", "--total_episodes", "64", *TINY_RUN)
    assert result.returncode == 0, result.stderr[-3000:]
    said = [line for line in result.stderr.splitlines() if "scored none" in line]
    assert said == ["rloo.py: warning: reward function 'scores_nothing' scored none of the 16 completions of update "
                    "1: it returned only None (said once a run)"], result.stderr[-3000:]


def test_k_equal_one_is_refused(assets, tmp_path):
    assert_one_line_error(run_rloo(*base(assets, tmp_path), "--rloo-k", "1"), "rloo_k = 1", "--rloo_k 2")


def test_indivisible_batch_sizes_are_refused(assets, tmp_path):
    result = run_rloo(*base(assets, tmp_path), "--rloo_k", "3", "--per_device_train_batch_size", "4")
    assert_one_line_error(result, "per_device_train_batch_size (4)", "= 4 completions", "rloo_k (3)")


def test_missing_prompt_column_is_refused(assets, tmp_path):
    result = run_rloo(*base(assets, tmp_path), "--prompt_column", "question")
    assert_one_line_error(result, "no 'question' column", "'target'", "--prompt_column")


def test_unknown_reward_function_is_refused(assets, tmp_path):
    args = base(assets, tmp_path)[:-2]
    assert_one_line_error(run_rloo(*args, "--reward_fn", "reward_fns:nope"), "reward_fns:nope", "no function 'nope'")
    assert_one_line_error(run_rloo(*args, "--reward_fn", "no_such_module:f"), "cannot import 'no_such_module'")


def test_tokenizer_without_pad_token_is_refused(tmp_path):
    from conftest import tiny_policy

    path = tmp_path / "no_pad"
    tokenizer = word_tokenizer(["<eos>", "a", "b", ":"], pad=None)
    tiny_policy(len(tokenizer)).save_pretrained(path)  # the embedding has no spare row for a new token
    tokenizer.save_pretrained(path)
    (tmp_path / "d.jsonl").write_text('{"prompt": "a b :"}\n' * 8)
    result = run_rloo("--model_name_or_path", path, "--dataset_name", tmp_path / "d.jsonl", "--reward_fn",
                      "reward_fns:count_a", "--output_dir", tmp_path / "out", "--pad_token", "None")
    assert_one_line_error(result, "has no pad token", "--pad_token")
    result = run_rloo("--model_name_or_path", path, "--dataset_name", tmp_path / "d.jsonl", "--reward_fn",
                      "reward_fns:count_a", "--output_dir", tmp_path / "out")
    assert_one_line_error(result, "has no pad token", "outside the model's 4-row embedding")


def test_no_reward_and_clashing_weights_are_refused(assets, tmp_path):
    args = base(assets, tmp_path)
    assert_one_line_error(run_rloo(*args[:-2]), "no reward")
    assert_one_line_error(run_rloo(*args, "--reward_weights", "1", "2"), "2 values but there are 1 reward sources")


def test_the_published_command_fails_cleanly_without_the_hub(tmp_path):
    # TRL's getting-started command, unchanged but for the script name (and the output dir, kept in tmp)
    result = run_rloo("--dataset_name", "trl-internal-testing/descriptiveness-sentiment-trl-style",
                      "--dataset_train_split", "descriptiveness", "--learning_rate", "3e-6",
                      "--output_dir", tmp_path / "models/minimal/rloo", "--per_device_train_batch_size", "64",
                      "--gradient_accumulation_steps", "1", "--total_episodes", "10000",
                      "--model_name_or_path", "EleutherAI/pythia-14m", "--reward_model_path", "EleutherAI/pythia-14m",
                      "--missing_eos_penalty", "1.0")
    assert_one_line_error(result, "could not load", "without network")


def test_fsdp_outside_torchrun_is_refused(assets, tmp_path):
    assert_one_line_error(run_rloo(*base(assets, tmp_path), "--fsdp"), "--fsdp shards", "launch with torchrun")
    assert_one_line_error(run_rloo(*base(assets, tmp_path), "--offload"), "--offload works through FSDP2",
                          "add --fsdp")


# ---------------------------------------------------------------- TRL >= 0.22's names
TRL_VALUES = {"num_generations": ("4", 4), "beta": ("0.03", 0.03), "epsilon": ("0.3", 0.3), "num_iterations": ("2", 2),
              "max_completion_length": ("17", 17), "normalize_advantages": (None, True),
              "reward_model_name_or_path": ("models/rm", "models/rm"), "activation_checkpointing": (None, True)}


def test_every_trl_name_sets_rloo_flag():
    import rloo

    assert set(TRL_VALUES) == set(plumbing.TRL_NAMES)  # a new alias gets a case here
    for trl_name, own in plumbing.TRL_NAMES.items():
        text, expected = TRL_VALUES[trl_name]
        for spelling in (trl_name, trl_name.replace("_", "-")):
            args = plumbing.parse_args(rloo.Args, argv=[f"--{spelling}"] + ([text] if text is not None else []))
            assert getattr(args, own) == expected, (trl_name, getattr(args, own))
    assert plumbing.parse_args(rloo.Args, argv=["--no-normalize_advantages"]).normalize_advantage is False
    assert plumbing.parse_args(rloo.Args, argv=["--beta=0.5", "--kl_coef", "0.50"]).kl_coef == 0.5  # equal values: no clash
    args = plumbing.parse_args(rloo.Args, argv=["--steps_per_generation", "8", "--gradient_accumulation_steps", "4"])
    assert (args.num_mini_batches, args.gradient_accumulation_steps) == (2, 4)  # micro-batches -> optimizer steps
    assert plumbing.parse_args(rloo.Args, argv=["--steps_per_generation", "3"]).num_mini_batches == 3  # accumulation 1 by default
    assert plumbing.parse_args(rloo.Args, argv=["--run_name", "tldr_seed1"]).run_name == "tldr_seed1"
    args = plumbing.parse_args(rloo.Args, argv=["--steps_per_generation", "8", "--gradient_accumulation_steps", "4",
                                                "--num_mini_batches", "1"])
    assert args.num_mini_batches == 2  # --num_mini_batches at its default is not told from one left out (no clash)


@pytest.mark.parametrize("argv,own,expected", [
    (["--rloo_k", "2", "--num_generations", "4"], "rloo_k", 4),
    (["--num_generations", "4", "--rloo-k", "2"], "rloo_k", 2),
    (["--normalize_advantage", "--no-normalize_advantages"], "normalize_advantage", False),
    (["--kl_coef=0.1", "--beta", "0.1", "--kl-coef", "0.2"], "kl_coef", 0.2),
], ids=["rloo_k", "own name last", "bool", "thrice"])
def test_a_flag_under_both_names_takes_the_last_value(argv, own, expected):
    # tyro's aliases: two names of one flag are one flag, given twice (refused in one line before tyro parsed them)
    assert getattr(plumbing.parse_args(rloo.Args, argv=argv), own) == expected


@pytest.mark.parametrize("argv,fragments", [
    (["--steps_per_generation", "6", "--gradient_accumulation_steps", "4"], ["--steps_per_generation 6", "not a multiple"]),
    (["--steps_per_generation", "0"], ["--steps_per_generation 0", "not a multiple"]),
    (["--steps_per_generation", "8", "--gradient_accumulation_steps", "4", "--num_mini_batches", "3"],
     ["means --num_mini_batches 2", "--num_mini_batches 3 is given too"]),
], ids=["indivisible", "zero", "both"])
def test_steps_per_generation_that_is_no_num_mini_batches_is_one_line(capsys, argv, fragments):
    with pytest.raises(SystemExit) as exit_info:
        plumbing.parse_args(rloo.Args, argv=argv, prog="rloo.py")
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and error.startswith("rloo.py: error: "), error
    assert all(f in error for f in fragments), error


def test_a_list_flag_given_several_times_keeps_every_value_and_another_flag_its_last():
    args = plumbing.parse_args(rloo.Args, argv=["--reward_fn", "m:a", "--seed", "3", "--reward-fn=m:b", "--reward_fn",
                                                "m:c", "m:d", "--reward_weights", "1", "--fsdp", "--reward_weights",
                                                "-0.5", "2", "--seed", "4", "--no-fsdp"])
    assert args.reward_fn == ("m:a", "m:b", "m:c", "m:d")  # docs/flags.md's repeatable --reward_fn: each counts
    assert args.reward_weights == (1.0, -0.5, 2.0)
    assert args.seed == 4 and args.fsdp is False  # any other flag: the last wins, as a launch script's "$@" expects
    assert plumbing.parse_args(rloo.Args, argv=[]).reward_weights is None  # not given: the default
    for argv, expected in ((["None"], None), (["q", "k", "--lora_target_modules", "None"], None),
                           (["None", "--lora_target_modules", "q", "k"], ("q", "k"))):  # None resets a list flag
        assert plumbing.parse_args(rloo.Args, argv=["--lora_target_modules", *argv]).lora_target_modules == expected


def test_help_shows_the_args_groups_with_flat_names_aliases_and_whole_sentences(capsys, monkeypatch):
    import plan_memory
    import rloo_multinode

    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit) as exit_info:
        plumbing.parse_args(rloo_multinode.Args, argv=["--help"], prog="rloo_multinode.py")
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out.splitlines()
    titles = [line[:-len("options")].strip() for line in (line.strip("╭─╮ ") for line in printed)
              if line.endswith("options")]
    lines = [line[1:].rstrip(" │") for line in printed]  # within a box's borders (unicode on a terminal, else spaces)
    assert titles == ["", "models", "data", "RLOO", "generation", "optimization", "engines", "experiment",
                      "memory and speed", "LoRA adapters", "samples and evaluation",
                      "checkpoints and faults"]  # the `# ----- x -----` lines: the inputs', Args's, the run's
    assert plumbing.help_groups(plan_memory.PlanArgs, "plan_memory.py")["world_size"] == "plan_memory.py"
    text = " ".join(" ".join(lines).split())
    for trl_name, own in plumbing.TRL_NAMES.items():
        assert f"--{trl_name}" in text and f"--{own}" in text, trl_name
    assert "--steps_per_generation {None}|INT" in text and plumbing.TRL_DEFAULTS.split("\n")[0] in printed
    docs = {p.arg_name: p.description for c in (plumbing.InputArgs, plumbing.RunArgs, rloo.Args, rloo_multinode.Args)
            for p in docstring_parser.parse_from_object(c).params}
    for f in fields(rloo_multinode.Args):  # every docstring, its source lines joined
        assert " ".join(docs[f.name].split()) in text, f.name
    # a description line ends only where the next word would not fit (no sentence broken where a source line was)
    described = [(line, following) for line, following in zip(lines, lines[1:])
                 if line.startswith(" " * 7) and following.startswith(" " * 7)]
    width = max(len(line) for pair in described for line in pair)
    for line, following in described:
        assert len(line) + 1 + len(following.split()[0]) > width, (line, following)


# ---------------------------------------------------------------- GPUs
def test_more_ranks_than_gpus_is_one_line_naming_the_fix(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(plumbing.ConfigError, match=r"2 ranks on this node but 1 GPU\(s\) visible: .*--nproc_per_node 1; "
                                               r"for a CPU \(gloo\) run, set CUDA_VISIBLE_DEVICES="):
        plumbing.setup_distributed()  # before any CUDA call: no 'invalid device ordinal' traceback


def test_cudnn_attention_is_off_for_steady_times_at_changing_lengths():
    import torch

    torch.backends.cuda.enable_cudnn_sdp(True)
    plumbing.choose_kernels()  # what main does first
    assert not torch.backends.cuda.cudnn_sdp_enabled() and torch.backends.cuda.matmul.allow_tf32
# ---------------------------------------------------------------- bad input, table-driven, in this process
def snapshot(directory: Path) -> dict:
    """Every file under directory with its size and modification time; the lock file is the run's, not data."""
    return {str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in directory.rglob("*") if p.is_file() and p.name != plumbing.LOCK}


def checkpoint_of(output_dir: Path, update: int, args: rloo.Args, inputs: dict) -> Path:
    """A checkpoint after `update` of a run with these args and these inputs, as Checkpointer.save writes it."""
    tokenizer = policy_tokenizer()
    policy = tiny_policy(len(tokenizer))
    state = {"update": update, "episode": 0, "sampler": {"epoch": 0, "position": 0}, "elapsed": 0.0, "world_size": 1,
             "args": asdict(args), "wandb_run_id": None, "run_id": "run-a", "inputs": inputs}
    return plumbing.save_checkpoint(str(output_dir), update, policy, torch.optim.AdamW(policy.parameters()), tokenizer,
                                state, 0, None, {})


@pytest.fixture(scope="module")
def bad_files(assets, tmp_path_factory) -> dict[str, Path]:
    """Broken datasets, models, checkpoints and output directories, one of each kind."""
    root = tmp_path_factory.mktemp("bad")
    files = {name: root / name for name in ("malformed.jsonl", "empty.jsonl", "none.jsonl", "numbers.jsonl",
                                            "list_line.jsonl", "malformed.json")}
    files["malformed.jsonl"].write_text('{"prompt": "a :"}\n{"prompt": "b :"\n{"prompt": "c :"}\n')
    files["empty.jsonl"].write_text("")
    files["none.jsonl"].write_text('{"prompt": "a :"}\n{"prompt": null}\n')
    files["numbers.jsonl"].write_text('{"prompt": 1}\n{"prompt": 2}\n')
    files["list_line.jsonl"].write_text('{"prompt": "a :"}\n["b :"]\n')
    files["malformed.json"].write_text('[{"prompt": "a :"},\n {"prompt": }]\n')
    for name, encoding in (("latin1.jsonl", "latin-1"), ("utf16.jsonl", "utf-16"), ("latin1.json", "latin-1")):
        rows = [{"prompt": f"caf\xe9 {letter} :"} for letter in "abcdefgh"]
        files[name] = root / name
        files[name].write_bytes((json.dumps(rows, ensure_ascii=False) if name.endswith(".json") else "".join(
            json.dumps(row, ensure_ascii=False) + "\n" for row in rows)).encode(encoding))
    files["nulls.jsonl"] = root / "nulls.jsonl"  # datasets' reader can crash (SIGSEGV) on such a file
    files["nulls.jsonl"].write_text('null\n{"prompt": null}\nfalse\nnull\n')
    files["chat.jsonl"] = write_jsonl(root / "chat.jsonl", [{"prompt": [{"role": "user", "content": "a b"}]}] * 64)
    files["raising_template"] = root / "raising_template"  # the policy, with a chat template that raises
    shutil.copytree(assets["policy"], files["raising_template"])
    tokenizer = AutoTokenizer.from_pretrained(files["raising_template"])
    tokenizer.chat_template = "{{ raise_exception('this template takes no user role') }}"
    tokenizer.save_pretrained(files["raising_template"])
    files["three_prompts.jsonl"] = root / "three_prompts.jsonl"
    files["three_prompts.jsonl"].write_text("".join(f'{{"prompt": "{p} :"}}\n' for p in ("a b", "c", "d e")))
    files["not_a_dataset"] = root / "not_a_dataset"
    files["not_a_dataset"].mkdir()
    (files["not_a_dataset"] / "notes.txt").write_text("hello\n")
    files["foreign_ids"] = root / "foreign_ids"
    datasets.Dataset.from_dict({"query_token": [[0, 2, 3], [4, 99, 5]]}).save_to_disk(str(files["foreign_ids"]))
    files["two_label_rm"] = root / "two_label_rm"  # only its config is read before the refusal
    neox_config(15, num_labels=2, architectures=["GPTNeoXForSequenceClassification"]).save_pretrained(
        files["two_label_rm"])
    files["modules"] = root / "modules"  # reward modules that fail at import
    files["modules"].mkdir()
    (files["modules"] / "syntax_error.py").write_text("def f(completions, **kwargs)\n    return [0.0]\n")
    (files["modules"] / "raises_at_import.py").write_text("raise RuntimeError('set JUDGE_KEY first')\n")
    (files["modules"] / "exits_at_import.py").write_text("import sys\nsys.exit('needs a GPU')\n")
    files["a_file"] = root / "a_file"
    files["a_file"].write_text("not a directory\n")
    files["earlier_run"] = root / "earlier_run"
    (files["earlier_run"] / "checkpoints" / "step_3").mkdir(parents=True)
    (files["earlier_run"] / "checkpoints" / "step_3" / plumbing.MANIFEST).write_text('{"files": {}}\n')
    files["policy"], files["a_model"], files["new_dir"] = assets["policy"], root / "a_model", root / "new" / "dir"
    files["above_policy"] = assets["policy"].parent
    tiny_policy(15).save_pretrained(files["a_model"])
    files["leftovers"] = root / "leftovers"  # what runs that stopped before their first checkpoint leave
    for name in ("wandb/run/x", "nonfinite/update_1_rank_0.jsonl", "metrics.jsonl", "engine_0.log",
                 "engines.json", "abandoned/20250101-000000_overwritten/config.json"):  # as runs write them
        (files["leftovers"] / name).parent.mkdir(parents=True, exist_ok=True)
        (files["leftovers"] / name).write_text('{"update": 1, "run_id": "a"}\n')
    for name, edited in (("resumable", None), ("edited_initial_model", "model.safetensors")):
        files[name] = root / name  # the table's valid command, checkpointed after update 5 (8 episodes each)
        args = tyro.cli(rloo.Args, args=argv_of(valid_flags(assets, files[name])))
        inputs = plumbing.input_identities(args, plumbing.load_reward_functions(args.reward_fn))  # their sha256
        if edited:
            inputs["model_name_or_path"]["files"][edited]["sha256"] = "0" * 64
        checkpoint_of(files[name], 5, args, inputs)
    step = checkpoint_of(root / "pickled", 1, rloo.Args(), {})
    torch.save(tiny_policy(15).state_dict(), step / "pytorch_model.bin")  # the weights as a pickle
    (step / "model.safetensors").unlink()
    (step / plumbing.MANIFEST).unlink()
    (step / plumbing.MANIFEST).write_text(json.dumps({"files": plumbing.file_digests(step)}))  # true to what it holds
    files["pickled_step"] = step
    return files


BAD_INPUTS = {  # case: (flags that replace or add to a valid command, fragments of the one error line)
    "save_total_limit -1": ({"save_total_limit": "-1"}, ["save_total_limit = -1", "at least 1"]),
    "save_total_limit 0": ({"save_total_limit": "0"}, ["save_total_limit = 0", "None to keep every"]),
    "save_steps -1": ({"save_steps": "-1"}, ["save_steps = -1"]),
    "temperature inf": ({"temperature": "inf"}, ["temperature = inf", "a finite number >= 0.01"]),
    "temperature 1e-40": ({"temperature": "1e-40"}, ["temperature = 1e-40", ">= 0.01 (vLLM's floor: logits are divided "
                                                     "by it; below, log-probs overflow float32)"]),  # update 1's NaN
    "temperature nan": ({"temperature": "nan"}, ["temperature = nan"]),
    "temperature -1": ({"temperature": "-1"}, ["temperature = -1.0"]),
    "cliprange 0": ({"cliprange": "0"}, ["cliprange = 0.0", "> 0"]),
    "vllm_importance_sampling_cap nan": ({"vllm_importance_sampling_cap": "nan"},
                                          ["vllm_importance_sampling_cap = nan", "finite number > 0"]),
    "token importance weights without per-token actions": ({"vllm_importance_sampling_mode": "token_mask"},
                                                           ["token_mask weights tokens", "add --token_level_kl"]),
    "learning_rate -1e-3": ({"learning_rate": "-1e-3"}, ["learning_rate = -0.001", "in [0, 1]"]),
    "learning_rate 2": ({"learning_rate": "2"}, ["learning_rate = 2.0", "in [0, 1] (AdamW's step size per weight)"]),
    "weight_decay past 1 / learning_rate": ({"weight_decay": "2000", "learning_rate": "1e-3"},
                                             ["weight_decay = 2000.0", "in [0, 1000] (1 / --learning_rate"]),
    "repetition_penalty 1e-30": ({"repetition_penalty": "1e-30"}, ["repetition_penalty = 1e-30", "in [0.01, 100]"]),
    "learning_rate nan": ({"learning_rate": "nan"}, ["learning_rate = nan"]),
    "kl_coef nan": ({"kl_coef": "nan"}, ["kl_coef = nan"]),
    "kl_coef beyond float32": ({"kl_coef": "1e39"}, ["kl_coef = 1e+39", "in [0, 1e+06]"]),
    "kl_coef 1e30": ({"kl_coef": "1e30"}, ["kl_coef = 1e+30", "in [0, 1e+06] (beyond, the first updates' gradients "
                                                             "overflow float32)"]),  # update 2's NaN
    "missing_eos_penalty 1e30": ({"missing_eos_penalty": "1e30"}, ["missing_eos_penalty = 1e+30", "at most 1e+06"]),
    "learning_rate beyond float32": ({"learning_rate": "1e50"}, ["learning_rate = 1e+50"]),
    "reward_weights beyond float32": ({"reward_weights": "-1e39"}, ["reward_weights = (-1e+39,)", "at most 1e+06 in "
                                                                                                 "magnitude"]),
    "reward_weights 1e30": ({"reward_weights": "1e30"}, ["reward_weights = (1e+30,)", "the first updates' gradients"]),
    "reward_fn_timeout beyond ddp_timeout": ({"reward_fn_timeout": "600"},
                                             ["reward_fn_timeout = 600.0", "below --ddp_timeout (600; raise it too)"]),
    "reward_fn_timeout 0": ({"reward_fn_timeout": "0"}, ["reward_fn_timeout = 0.0", "seconds > 0"]),
    "eval_max_prompts 0": ({"eval_max_prompts": "0"}, ["eval_max_prompts = 0", "at least 1"]),
    "num_train_epochs 0": ({"num_train_epochs": "0"}, ["num_train_epochs = 0.0"]),
    "seed -1": ({"seed": "-1"}, ["seed = -1"]),
    "ddp_timeout 0": ({"ddp_timeout": "0"}, ["ddp_timeout = 0.0", "seconds > 0"]),
    "overwrite and resume": ({"overwrite_output_dir": None, "resume": None}, ["--overwrite_output_dir", "--resume"]),
    "reward function without **kwargs": ({"reward_fn": "reward_fns:without_kwargs"},
                                         ["'reward_fns:without_kwargs' takes no **kwargs", "add **kwargs"]),
    "reward module with a SyntaxError": ({"reward_fn": "syntax_error:f"},
                                         ["'syntax_error:f': importing 'syntax_error' failed with SyntaxError: "
                                          "expected ':' (syntax_error.py, line 1)"]),
    "reward module raising at import": ({"reward_fn": "raises_at_import:f"},
                                        ["importing 'raises_at_import' failed with RuntimeError: set JUDGE_KEY first"]),
    "reward module exiting at import": ({"reward_fn": "exits_at_import:f"},
                                        ["importing 'exits_at_import' failed with SystemExit: needs a GPU"]),
    "reward function needs a missing column": ({"reward_fn": "reward_fns:needs_answer"},
                                               ["'needs_answer' needs 'answer'", "'target'"]),
    "output_dir is a file": ({"output_dir": "a_file"}, ["a_file is a file", "pass a directory"]),
    "output_dir holds an earlier run": ({"output_dir": "earlier_run"},
                                        ["holds another run's files (checkpoints up to step_3)", "--resume",
                                         "--overwrite_output_dir"]),
    "output_dir is the policy's directory": ({"output_dir": "policy", "overwrite_output_dir": None},
                                             ["is the input --model_name_or_path", "never move or write over its "
                                              "inputs"]),
    "output_dir holds the policy's directory": ({"output_dir": "above_policy", "overwrite_output_dir": None},
                                                ["holds the input --model_name_or_path"]),
    "output_dir holds a model": ({"output_dir": "a_model"},
                                 ["holds config.json, generation_config.json, model.safetensors, which no run of this "
                                  "project wrote and the finished run would write over: move them"]),
    "output_dir holds a model, with --resume": ({"output_dir": "a_model", "resume": None},
                                                ["holds config.json, generation_config.json"]),
    "a refused run into a new output_dir": ({"output_dir": "new_dir", "dataset_name": "empty.jsonl"},
                                            ["empty.jsonl is empty"]),
    "output_dir holds what runs leave before a checkpoint": ({"output_dir": "leftovers",
                                                              "dataset_name": "empty.jsonl"},
                                                             ["empty.jsonl is empty"]),  # not refused for them
    "total_episodes below the checkpoint": ({"output_dir": "resumable", "resume": None, "total_episodes": "16"},
                                            ["step_5 is after update 5, but this run ends after update 2",
                                             "--total_episodes 40 or more"]),
    "the initial model edited": ({"output_dir": "edited_initial_model", "resume": None},
                                 ["the input --model_name_or_path is not the one the run started with",
                                  "these files differ: model.safetensors", "--allow_changed_inputs model_name_or_path"]),
    "weights in a pickle": ({"resume_from": "pickled_step"},
                            ["step_1 is damaged: no weights in safetensors (pytorch_model.bin instead)",
                             "a pickle is never loaded"]),
    "stop_token_id outside the vocabulary": ({"stop_token_id": "99"}, ["stop_token_id = 99", "vocabulary of 15"]),
    "test split of a single file": ({"dataset_test_split": "validation"},
                                    ["--dataset_test_split validation", "has no splits", "test.jsonl"]),
    "train split of a single file": ({"dataset_train_split": "descriptiveness"},
                                     ["--dataset_train_split descriptiveness", "has no splits"]),
    "malformed jsonl line": ({"dataset_name": "malformed.jsonl"}, ["malformed.jsonl", "line 2 is not valid JSON"]),
    "malformed json": ({"dataset_name": "malformed.json"}, ["malformed.json cannot be read", "line 2"]),
    "a jsonl line that is a list": ({"dataset_name": "list_line.jsonl"}, ["line 2 is a JSON list"]),
    "empty file": ({"dataset_name": "empty.jsonl"}, ["empty.jsonl is empty"]),
    "a None prompt": ({"dataset_name": "none.jsonl"}, ["none.jsonl, row 1", "None", "a string or a list of chat"]),
    "numbers as prompts": ({"dataset_name": "numbers.jsonl"}, ["numbers.jsonl, row 0", "1"]),
    "a directory that is not a dataset": ({"dataset_name": "not_a_dataset"},
                                          ["not_a_dataset is not a dataset written by save_to_disk"]),
    "token ids outside the vocabulary": ({"dataset_name": "foreign_ids"},
                                         ["foreign_ids, row 1", "token id 99", "vocabulary of 15"]),
    "fewer prompts than one update": ({"dataset_name": "three_prompts.jsonl"},
                                      ["has 3 prompts, fewer than one update takes", "smaller batches"]),
    "bytes that are not UTF-8 (latin-1)": ({"dataset_name": "latin1.jsonl"},
                                           ["latin1.jsonl cannot be read: line 1 is not UTF-8 text (byte b'\\xe9')",
                                            "re-encode it as UTF-8"]),
    "UTF-16 with its byte order mark": ({"dataset_name": "utf16.jsonl"}, ["line 1 is not UTF-8 text (byte b'\\xff')"]),
    "a .json file in latin-1": ({"dataset_name": "latin1.json"}, ["latin1.json cannot be read: line 1 is not UTF-8"]),
    "JSON lines that are not objects": ({"dataset_name": "nulls.jsonl"},
                                        ["nulls.jsonl cannot be read: line 1 is a JSON NoneType, not an object"]),
    "a chat template that raises": ({"model_name_or_path": "raising_template", "dataset_name": "chat.jsonl"},
                                    ["the tokenizer's chat template: TemplateError: this template takes no user role",
                                     "fix the template"]),
    "a causal LM as reward model": ({"reward_model_path": "policy"},
                                    ["is a GPTNeoXForCausalLM, not a reward model: its score head would be newly "
                                     "initialized", "AutoModelForSequenceClassification with num_labels=1"]),
    "zero updates": ({"num_train_epochs": "0.0001"},
                     ["--num_train_epochs 0.0001 of 256 prompts x k=2 is 0 episodes: no update (one takes 8)",
                      "--num_train_epochs 0.0156 or more, or --total_episodes 8"]),
    "absurd num_train_epochs": ({"num_train_epochs": "1e15"},  # a Python sum over every update's learning rate
                                ["--num_train_epochs 1e+15 is 64,000,000,000,000,000 updates, more than the 1,000,000 a "
                                 "run takes: pass --num_train_epochs 15600 or less"]),
    "absurd max_steps": ({"max_steps": str(10 ** 20)}, ["--max_steps 100000000000000000000 is 25,000,000,000,000,000,000 updates",
                                          "pass --max_steps 4000000 or less"]),
    "absurd total_episodes": ({"total_episodes": str(10 ** 30)}, ["--total_episodes 1000000000000000000000000000000 is",
                                                                   "pass --total_episodes 8000000 or less"]),
    "fractional logging_steps above 1": ({"logging_steps": "2.5"}, ["logging_steps = 2.5", "a share of the run"]),
    "eval_steps without eval_strategy steps": ({"eval_steps": "10"}, ["--eval_steps 10 spaces the evaluations"]),
    "LoRA on parameters with dropout": ({"use_peft": None, "lora_target_parameters": "mlp.dense_h_to_4h.weight"},
                                        ["take no dropout", "pass --lora_dropout 0"]),
    "reward model with two labels": ({"reward_model_path": "two_label_rm"},
                                     ["two_label_rm", "2-label classification head", "num_labels=1"]),
    "QLoRA with FSDP": ({"use_peft": None, "load_in_4bit": None, "fsdp": None}, ["--load_in_4bit with --fsdp",
                                                                                 "drop --fsdp"]),
    "LoRA rank 0": ({"use_peft": None, "lora_r": "0"}, ["--lora_r 0", "the rank must be >= 1"]),
    "merge_lora without LoRA": ({"merge_lora": None}, ["--merge_lora merges LoRA adapters", "add --use_peft"]),
}


@pytest.mark.parametrize("case", BAD_INPUTS, ids=list(BAD_INPUTS))
def test_bad_input_is_one_line_before_any_model_loads_and_changes_nothing(case, assets, bad_files, tmp_path, capfd,
                                                                          monkeypatch):
    changes, fragments = BAD_INPUTS[case]
    for loader in ("load_causal_lm", "load_reward_model"):  # any weights loaded: the check came too late
        for where in (plumbing, plumbing.models, plumbing.rewards):  # wherever a caller looks the loader up
            if hasattr(where, loader):
                monkeypatch.setattr(where, loader, lambda *a, **kw: pytest.fail("a model loaded before the error"))
    monkeypatch.syspath_prepend(bad_files["modules"])
    out = tmp_path / "out"  # what an earlier attempt without checkpoints leaves
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"update": 1}\n')
    flags = valid_flags(assets, out)
    for name, value in changes.items():
        flags[name] = None if value is None else bad_files.get(value, value)
    output_dir = Path(flags["output_dir"])
    watched = output_dir if output_dir.is_dir() else out
    before, existed = snapshot(watched), [output_dir.exists(), output_dir.parent.exists()]
    argv = argv_of(flags)
    capfd.readouterr()
    with pytest.raises(SystemExit) as exit_status:
        plumbing.run_script(rloo.main, tyro.cli(rloo.Args, args=argv), "rloo.py")
    stderr = capfd.readouterr().err
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert exit_status.value.code == 2 and len(lines) == 1, stderr
    assert lines[0].startswith("rloo.py: error: "), stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert snapshot(watched) == before
    assert not (out / "checkpoints").exists()
    assert not (watched / plumbing.LOCK).exists() and [output_dir.exists(), output_dir.parent.exists()] == existed


def test_the_docs_of_a_local_files_split_say_what_the_code_does():
    """A single file is one split, `train`: another --dataset_train_split is refused (the refusal: the cases above),
    and flags.md says so instead of "ignored"."""
    row = next(line for line in (REPO / "docs" / "flags.md").read_text().splitlines() if "`--dataset_train_split`" in
               line)
    assert "ignored" not in row and "another name is refused" in row


def test_the_flags_cap_alone_neither_refuses_nor_warns(assets, capsys):
    """--max_prompt_length 60 + --response_length 10 exceed the tiny policy's 64 positions, but no prompt has been read:
    nothing said (the data's longest prompt is checked once read: test_paths_and_launch.py)."""
    plumbing.prepare_tokenizer(rloo.Args(model_name_or_path=str(assets["policy"]), max_prompt_length=60,
                                         response_length=10))
    assert capsys.readouterr().err == ""
