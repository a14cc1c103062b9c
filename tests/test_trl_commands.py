"""A TRL user's command, config file and habits through rloo.py: TRL 1.16's defaults typed out (the committed table
against TRL's dataclasses), `--config FILE.yaml` in TRL's recipe format, the `trl rloo` commands and recipes of TRL's
docs, the `trl` launcher's options, and TRL's meaning for the names rloo.py shares: weight decay, epochs, evaluation
strategy, fractional intervals, TensorBoard, and the advantages of masked and unscored completions against TRL 1.16's
own code."""

import dataclasses
import json
import os
import subprocess
import sys
import types

import pytest
import torch
import yaml

import plumbing
import rloo
import rloo_multinode
from conftest import REPO, read_metrics, run_rloo, tiny_policy, write_jsonl
from helpers import TRL116_RECIPES, cpu_env, python

SITE = "benchmark/.trl116-site"


def parse(*argv, cls=rloo.Args, prog="rloo.py"):
    return plumbing.parse_args(cls, argv=[str(a) for a in argv], prog=prog)


def refusal(capsys, *argv, cls=rloo.Args, prog="rloo.py") -> str:
    """The one line a refused command prints (exit status 2)."""
    with pytest.raises(SystemExit) as exit_info:
        parse(*argv, cls=cls, prog=prog)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and error.startswith(f"{prog}: error: "), error
    return error.strip()


def trl116_problem() -> str | None:
    """Why TRL 1.16 (make bench-env's benchmark/.trl116-site) cannot be used here, or None."""
    from benchmark.throughput import trl116_command

    problem = trl116_command(SITE)[1]
    if problem and os.environ.get("REQUIRE_BENCH_ENV") == "1":
        pytest.fail(problem)
    return problem


def with_trl116(*command: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """A command of this Python with TRL 1.16 first on PYTHONPATH (and the repository, tests/), or a skip."""
    problem = trl116_problem()
    if problem:
        pytest.skip(problem)
    env = cpu_env({"PYTHONPATH": os.pathsep.join([str(REPO / SITE), str(REPO), str(REPO / "tests")])})
    return subprocess.run([python(), *command], capture_output=True, text=True, cwd=REPO, env=env,
                          timeout=timeout)


# ---------------------------------------------------------------- TRL 1.16's defaults, typed out
def test_the_committed_table_of_trl_defaults_is_trl_1_16s():
    result = with_trl116("benchmark/trl116_defaults.py", "--check")
    assert result.returncode == 0, "run: PYTHONPATH=benchmark/.trl116-site python benchmark/trl116_defaults.py"


def cli_words(value) -> list[str]:
    """A default as a command line spells it."""
    if isinstance(value, list):
        return [str(v) for v in value]
    return [json.dumps(value) if isinstance(value, dict) else str(value)]


NOTHING_DEFAULTS = {name: default for name, default in plumbing.TRL116.items() if default in plumbing.NOTHING
                    and name not in ("dataset_name", "bf16")}  # TRL's None: no dataset given; bf16 unless fp16


@pytest.mark.parametrize("script", ["rloo.py", "rloo_multinode.py"])
def test_every_trl_default_that_asks_for_nothing_is_accepted_and_changes_nothing(script):
    """--max_steps -1, --weight_decay 0.0, --disable_dropout False, --do_train False, --eval_strategy no, --fp16 False,
    --push_to_hub False, ...: each TRL 1.16 field at its default "not set" / "off" value, on one command line."""
    cls = rloo.Args if script == "rloo.py" else rloo_multinode.Args
    names = dict(NOTHING_DEFAULTS)
    if script == "rloo_multinode.py":
        names.pop("use_vllm")  # TRL's False is rloo.py's sampling: refused there, naming rloo.py (test_trl_parity)
    argv = [word for name, default in names.items() for word in (f"--{name}", *cli_words(default))]
    args, plain = parse(*argv, cls=cls, prog=script), parse(cls=cls, prog=script)
    assert args.eval_strategy == "no" and args.dataset_test_split is None  # TRL's: no evaluation
    for field in plain.__dataclass_fields__:  # nothing else moved from the script's defaults
        if field != "eval_strategy":
            assert getattr(args, field) == getattr(plain, field), field
    for spelling in (["--max_steps=-1"], ["--fp16", "false"], ["--fp16", "0"], ["--push-to-hub", "False"],
                     ["--do_train=False"], ["--warmup_steps", "0.0"], ["--include_for_metrics"], ["--debug", ""],
                     ["--report_to", "none"], ["--use_vllm", "false"] if script == "rloo.py" else [],
                     ["--gradient_checkpointing_kwargs", "null"], ["--save_total_limit", "None"]):
        assert parse(*spelling, cls=cls, prog=script) == plain, spelling


def test_trls_not_set_after_a_value_of_the_same_flag_still_wins():
    """A TRL "not set" is this script's default, not a flag left out: the last occurrence wins, as argparse's."""
    assert parse("--max_steps", 12, "--max_steps", -1).max_steps is None
    assert parse("--save_total_limit", 2, "--save_total_limit=None").save_total_limit is None
    assert parse("--fsdp", "--fsdp", "None").fsdp is False and parse("--top_k", 5, "--top_k", 0).top_k == 0
    assert parse("--report_to", "wandb", "--report_to", "none").track is False
    assert parse("--normalize_advantages", "--normalize_advantages", "False").normalize_advantage is False
    assert parse("--output_dir", "runs/a", "--output_dir", "None").output_dir == rloo.Args().output_dir


def test_a_recipe_of_every_trl_default_runs_through_the_parser(tmp_path):
    """A YAML of all of TRL 1.16's `trl rloo` fields at their defaults (what RLOOConfig() and ModelConfig() hold):
    TRL's meaning where rloo.py has the flag (its learning rate, epochs, completion length, gradient checkpointing,
    bf16 unless fp16), and nothing asked by the others."""
    recipe = tmp_path / "defaults.yaml"
    recipe.write_text(yaml.safe_dump({**plumbing.TRL116, "dataset_name": "data/train.jsonl"}))
    args = parse("--config", recipe)
    trl = plumbing.TRL116
    assert (args.learning_rate, args.num_train_epochs, args.response_length, args.rloo_k, args.kl_coef,
            args.num_ppo_epochs, args.seed, args.logging_steps, args.save_steps, args.lora_dropout) == (
        trl["learning_rate"], trl["num_train_epochs"], trl["max_completion_length"], trl["num_generations"],
        trl["beta"], trl["num_iterations"], trl["seed"], trl["logging_steps"], trl["save_steps"], trl["lora_dropout"])
    assert args.gradient_checkpointing and args.bf16  # TRL's RLOOConfig defaults: True, and None = bf16 unless fp16
    assert args.max_steps is None and args.weight_decay == 0.0 and args.dataset_test_split is None
    # TRL's None: a default
    assert args.dataset_name == "data/train.jsonl" and args.output_dir == rloo.Args().output_dir


def test_trl_defaults_1_16_gives_every_algorithm_flag_left_out_trl_1_16s_default(tmp_path):
    """--trl_defaults 1.16: each algorithm flag whose TRL 1.16 default sets something takes it (num_iterations 1,
    temperature 1.0, learning rate 1e-6, 512 new tokens, 3 epochs), and of the run's flags those that change what it
    computes (gradient checkpointing, seed 42, bf16 where there is a GPU: on this CPU a line says it is off); the
    others keep this script's; a flag given wins wherever it stands; a --config file may choose it too."""
    switched = plumbing.algorithm_defaults(rloo.Args) | {"gradient_checkpointing": (False, True), "seed": (1, 42)}
    assert plumbing.release_defaults(rloo.Args, "1.16") == switched  # bf16: (False, False) on a CPU, not switched
    assert {"num_ppo_epochs", "temperature", "learning_rate", "response_length", "num_train_epochs"} <= switched.keys()
    assert plumbing.algorithm_defaults(rloo_multinode.Args) == plumbing.algorithm_defaults(rloo.Args)  # not vllm_mode
    trl_name = {own: trl for trl, own in plumbing.TRL_NAMES.items()}
    args, old = parse("--trl_defaults", "1.16"), rloo.Args()
    for f in dataclasses.fields(rloo.Args):
        trl = trl_name.get(f.name, f.name)
        if f.name in switched:
            trl = trl if trl in plumbing.TRL116 else f.name  # gradient_checkpointing: TRL 1.16's transformers' name
            assert getattr(args, f.name) == plumbing.TRL116[trl] == switched[f.name][1] != getattr(old, f.name)
        else:  # the same default in both releases, a "not set" of TRL's, or a run's flag (output_dir, save_steps)
            assert getattr(args, f.name) == getattr(old, f.name) or f.name == "trl_defaults", f.name
    assert (args.num_ppo_epochs, args.temperature, args.learning_rate, args.response_length) == (1, 1.0, 1e-6, 512)
    for argv in (["--num_iterations", 2, "--trl_defaults", "1.16"], ["--trl-defaults=1.16", "--num_ppo_epochs", 2]):
        assert parse(*argv).num_ppo_epochs == 2 and parse(*argv).temperature == 1.0
    assert parse("--trl_defaults", "1.16", "--trl_defaults", "0.21").num_ppo_epochs == 4  # the last one
    path = tmp_path / "recipe.yaml"
    path.write_text("trl_defaults: 1.16\nnum_generations: 4\n")
    assert parse("--config", path).num_ppo_epochs == 1 and parse("--config", path, "--trl_defaults", "0.21") \
        .num_ppo_epochs == 4


def test_trl_names_or_a_config_file_bring_a_line_naming_the_defaults_in_force(capsys, tmp_path):
    """Every algorithm setting left out that the other release's default would change, in one line with the flag that
    switches; nothing for a command in this script's own names; given flags are not named."""
    parse("--num_generations", 4, "--beta", 0.1, "--max_steps", 40, "--temperature", 0.9)
    line = capsys.readouterr().out
    assert line.count("\n") == 1 and line.startswith("rloo.py: TRL <= 0.21's defaults in force (--trl_defaults 0.21)")
    for named in ("--num_ppo_epochs (--num_iterations) 4 (TRL 1.16's: 1)", "--learning_rate 3e-06 (TRL 1.16's: 1e-06)",
                  "--response_length (--max_completion_length) 53 (TRL 1.16's: 512)",
                  "; --trl_defaults 1.16 takes TRL 1.16's"):
        assert named in line, line
    assert "--temperature" not in line and "--num_train_epochs" not in line  # given; not in force with --max_steps
    parse("--rloo_k", 4, "--kl_coef", 0.1)
    assert capsys.readouterr().out == ""  # TRL <= 0.21's names: TRL <= 0.21's defaults, as its users expect
    path = tmp_path / "recipe.yaml"
    path.write_text("rloo_k: 4\n")
    parse("--config", path)
    assert "--num_train_epochs 1.0 (TRL 1.16's: 3.0)" in capsys.readouterr().out
    parse("--num_generations", 4, "--trl_defaults", "1.16", "--learning_rate", 1e-6)
    line, bf16 = capsys.readouterr().out.splitlines()
    assert "TRL 1.16's defaults in force (--trl_defaults 1.16): " in line and "(TRL <= 0.21's: 4)" in line
    assert "--learning_rate" not in line and line.strip().endswith("--trl_defaults 0.21 takes TRL <= 0.21's")
    for named in ("--gradient_checkpointing (--activation_checkpointing) True (TRL <= 0.21's: False)",
                  "--seed 42 (TRL <= 0.21's: 1)"):  # the run's flags it switches too
        assert named in line, line
    # said even without TRL's names; not with --bf16 given
    assert bf16 == "rloo.py: TRL 1.16's default bf16 is off here: no GPU (on the CPU, --bf16 computes in bf16 " \
                   "anyway, slowly)"
    parse("--trl_defaults", "1.16", "--seed", 3, "--gradient_checkpointing")
    assert capsys.readouterr().out == bf16 + "\n"
    parse("--trl_defaults", "1.16", "--no-bf16")
    assert capsys.readouterr().out == ""
    parse("--num_generations", 4, "--num_iterations", 4, "--temperature", 1, "--learning_rate", 1, "--num_train_epochs",
          1, "--max_completion_length", 8, "--seed", 42, "--gradient_checkpointing", "False")
    assert capsys.readouterr().out == ""  # every switched setting given: nothing to say


def test_a_trl_recipe_runs_trls_updates_and_episodes_with_and_without_trl_1_16s_defaults():
    """Against TRL 1.16's RLOOConfig and RLOOTrainer._prepare_inputs' own line (tests/trl116_run_length.py); and the
    arithmetic of TRL 1.16 that tests/test_trl116_run.py computes from the committed table, against TRL 1.16's."""
    result = with_trl116("tests/trl116_run_length.py")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count(": same") == 8 + len(TRL116_RECIPES)


@pytest.mark.parametrize("argv,message", [
    (["--fp16", "True"], "fp16 needs loss scaling"),
    (["--push_to_hub", "True"], "nothing is uploaded"),
    (["--per_device_eval_batch_size", "4"], "--local_rollout_forward_batch_size"),
    (["--disable_dropout", "False", "--shuffle_dataset", "False"], "reshuffled every epoch"),
    (["--tf32", "False"], "matmul precision"),
    (["--average_tokens_across_devices", "False"], "divided by its completions over all ranks"),
    (["--vllm_mode", "server"], "rloo_multinode.py"),  # not TRL's default colocate: asks for engines
])
def test_a_trl_value_other_than_its_default_still_needs_a_meaning_here(capsys, argv, message):
    assert message in refusal(capsys, *argv)


@pytest.mark.parametrize("argv,message", [
    (["--num_processes", "4"], "torchrun --nproc_per_node 4 rloo.py"),
    (["--accelerate_config", "zero2"], "launch rloo.py with torchrun"),
    (["--config_file", "deepspeed_zero3.yaml"], "launch rloo.py with torchrun"),
    (["--num_machines", "4", "--machine_rank", "0"], "--nnodes N --rdzv_backend c10d --rdzv_endpoint HOST:PORT"),
])
def test_the_trl_launchers_options_name_torchrun(capsys, argv, message):
    error = refusal(capsys, *argv)
    assert message in error and f"--{argv[0][2:]}" in error, error


def test_the_trl_launchers_process_count_of_the_processes_the_run_has_asks_for_nothing(capsys, tmp_path, monkeypatch):
    """`--num_processes 1` (a `trl rloo` recipe's, or the command line's) asks for the one process `python rloo.py`
    is; under torchrun, WORLD_SIZE's number. Another number names torchrun."""
    path = tmp_path / "recipe.yaml"
    path.write_text("num_processes: 1\n")
    assert parse("--num_processes", 1).rloo_k == parse("--config", path).rloo_k == parse().rloo_k
    monkeypatch.setenv("WORLD_SIZE", "2")
    parse("--num_processes", 2)
    assert "torchrun --nproc_per_node 1 rloo.py" in refusal(capsys, "--config", path)


@pytest.mark.parametrize("argv,message", [
    (["--loss_type", "dapo"], "--loss_type is TRL's GRPOTrainer's (GRPOConfig), not RLOO's: RLOO's loss is"),
    (["--scale_rewards", "group"], "--scale_rewards is TRL's GRPOTrainer's (GRPOConfig), not RLOO's: "),
    (["--importance_sampling_level", "token"], "not RLOO's: the ratio is the sequence's; --token_level_kl"),
    (["--top_entropy_quantile", "0.2"], "--top_entropy_quantile is TRL's GRPOTrainer's (GRPOConfig), not RLOO's: "
                                        "RLOOConfig has no such option"),
    (["--bias", "all"], "--bias is an option of peft's LoraConfig that the adapters here do not take"),
    (["--init_lora_weights", "pissa"], "the LoRA flags are --lora_r, --lora_alpha"),
])
def test_grpo_and_peft_options_are_named_as_what_they_are(capsys, argv, message):
    error = refusal(capsys, *argv)
    assert message in error and "did you mean" not in error, error


def test_every_grpo_only_option_is_named_as_grpos_and_peft_names_of_the_lora_flags_are_taken(capsys, tmp_path):
    """Each GRPOConfig field RLOOConfig lacks (TRL 1.16's, in the committed table) that rloo.py does not have; LoRA's
    rank under OpenRLHF's and verl's name and peft's, peft's target names, on the command line and in a recipe."""
    mine = set(rloo.Args.__dataclass_fields__)
    assert "loss_type" in plumbing.GRPO_ONLY and "vllm_importance_sampling_cap" in plumbing.GRPO_ONLY & mine
    for name in sorted(plumbing.GRPO_ONLY - mine):
        assert f"--{name} is TRL's GRPOTrainer's (GRPOConfig), not RLOO's" in refusal(capsys, f"--{name}", "1")
    args = parse("--lora_rank", 8, "--target_modules", "q_proj", "v_proj", "--modules_to_save", "lm_head")
    assert (args.lora_r, args.lora_target_modules, args.lora_modules_to_save) == (8, ("q_proj", "v_proj"), ("lm_head",))
    assert parse("--r", 4, "--target_parameters", "mlp.experts").lora_target_parameters == ("mlp.experts",)
    path = tmp_path / "recipe.yaml"
    path.write_text("lora_rank: 4\ntarget_modules: [q_proj]\n")
    assert (parse("--config", path).lora_r, parse("--config", path, "--lora_r", 9).lora_r) == (4, 9)
    assert parse("--config", path).lora_target_modules == ("q_proj",)


@pytest.mark.parametrize("text,message", [
    ("num_processes: 4\n", "--num_processes: `trl`'s accelerate option; launch rloo.py with torchrun"),
    ("accelerate_config: zero2\n", "--accelerate_config: `trl`'s accelerate option"),
    ("datasets:\n  - path: trl-lib/tldr\n", "--datasets (TRL's) has no meaning here: one dataset per run"),
    ("loss_type: dapo\n", "--loss_type is TRL's GRPOTrainer's"),
])
def test_a_recipes_refused_lines_name_the_file(capsys, tmp_path, text, message):
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    assert refusal(capsys, "--config", path).startswith(f"rloo.py: error: --config {path}: {message}")
    flag = text.partition(":")[0]
    error = refusal(capsys, "--config", path, f"--{flag}", "x")  # the command line's own: not the file's
    assert f"--config {path}" not in error and message.split(":")[0].split(" ")[0] in error, error


# ---------------------------------------------------------------- --config FILE.yaml
def recipe(tmp_path, text: str, name: str = "recipe.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_trl_recipe_with_rloo_names_and_the_command_line_winning(tmp_path):
    path = recipe(tmp_path, """
# TRL's names, rloo.py's, and TRL's forms of values
model_name_or_path: models/policy
num_generations: 4
beta: 0.03
learning_rate: 1.0e-6
max_completion_length: 64
reward_funcs:
  - my_rewards.lengths.reward_len
  - my_rewards.format.has_answer
report_to: wandb
save_strategy: no
bf16: true
gradient_checkpointing: false
total_episodes: 4096
lora_target_modules: [q_proj, v_proj]
share_prompt: false
""")
    args = parse("--config", path)
    assert (args.model_name_or_path, args.rloo_k, args.kl_coef, args.learning_rate, args.response_length) == (
        "models/policy", 4, 0.03, 1e-6, 64)
    assert args.reward_fn == ("my_rewards.lengths:reward_len", "my_rewards.format:has_answer") and args.track
    assert args.save_strategy == "no" and args.bf16 and not args.gradient_checkpointing  # YAML's unquoted no: "no"
    assert args.total_episodes == 4096 and args.lora_target_modules == ("q_proj", "v_proj")
    assert args.share_prompt is False  # an optional switch: True / False as TRL's bools
    # the command line wins, under either name, list flags included (replaced, not added to)
    args = parse("--rloo_k", 2, f"--config={path}", "--kl-coef", 0.1, "--reward_fn", "mine:f", "--no-track",
                 "--lora_target_modules", "all-linear")
    assert (args.rloo_k, args.kl_coef, args.reward_fn, args.track, args.lora_target_modules) == (
        2, 0.1, ("mine:f",), False, ("all-linear",))
    assert args.learning_rate == 1e-6  # what the command line leaves alone


@pytest.mark.parametrize("text,message", [
    ("learning_rat: 1.0e-6\n", "unknown key 'learning_rat': did you mean learning_rate?"),
    ("rloo_kk: 4\n", "did you mean rloo_k?"),
    ("zzzz: 1\n", "not a flag of this script, nor of TRL's `trl rloo`"),
    ("env:\n  CUDA_VISIBLE_DEVICES: 0\nlearning_rate: 1.0e-6\n", "set them in the shell"),
    ("- learning_rate\n- 1.0e-6\n", "holds a YAML list, not a mapping"),
    ("# nothing but a comment\n", "is empty, not a mapping of flag names to values"),
    ("learning_rate: [1.0e-6\n", "is not valid YAML (line 2)"),
    ("config: other.yaml\n", "a --config file cannot name another"),
    ("num_processes: 4\n", "torchrun --nproc_per_node 4 rloo.py"),  # the clis.md recipe's launcher key
    ("fp16: true\n", "fp16 needs loss scaling"),
])
def test_a_recipe_that_cannot_run_is_one_line_naming_the_file(capsys, tmp_path, text, message):
    path = recipe(tmp_path, text)
    error = refusal(capsys, "--config", path)
    assert message in error, error
    if "unknown key" in message or "YAML" in message or "shell" in message:
        assert str(path) in error


@pytest.mark.parametrize("argv,message", [
    (["--config", "no_such.yaml"], "--config no_such.yaml does not exist: pass a YAML file"),
    (["--config"], "--config needs a file"),
    (["--config", "a.yaml", "--config", "b.yaml"], "--config is given twice"),
])
def test_config_flags_that_name_no_file(capsys, tmp_path, argv, message):
    assert message in refusal(capsys, *argv)


def test_a_recipe_in_another_encoding_is_named(capsys, tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("run_name: caf\xe9\n".encode("latin-1"))
    assert "is not UTF-8 text (byte b'\\xe9')" in refusal(capsys, "--config", path)


# ---------------------------------------------------------------- TRL's docs: `trl rloo` commands and recipes
# Copied from TRL's docs (docs/source/clis.md, examples/cli_configs/example_config.yaml, trl/scripts/rloo.py's
# docstring, the RLOO page's VLM command), with local paths for the Hub's models and datasets: (argv, recipe, what
# rloo.py must make of them: {flag: value} or a fragment of the one-line refusal)
POLICY, DATA = "models/Qwen2.5-0.5B", "data/Polaris-Dataset-53K.jsonl"
TRL_DOCS = {
    "clis.md: trl rloo with a built-in reward": (
        ["--model_name_or_path", POLICY, "--dataset_name", DATA, "--reward_funcs", "accuracy_reward"], None,
        "TRL's built-in reward functions are not here; pass a dotted import path"),
    "clis.md: trl rloo with a reward of one's own": (
        ["--model_name_or_path", POLICY, "--dataset_name", DATA, "--reward_funcs", "my_rewards.accuracy"], None,
        {"model_name_or_path": POLICY, "dataset_name": DATA, "reward_fn": ("my_rewards:accuracy",)}),
    "clis.md: --num_processes 4": (
        ["--model_name_or_path", POLICY, "--dataset_name", DATA, "--reward_funcs", "my_rewards.accuracy",
         "--num_processes", "4"], None, "torchrun --nproc_per_node 4 rloo.py"),
    "clis.md: --accelerate_config zero2": (
        ["--model_name_or_path", POLICY, "--accelerate_config", "zero2"], None, "launch rloo.py with torchrun"),
    "clis.md: rloo_config.yaml": (
        ["--config", "rloo_config.yaml"],
        f"model_name_or_path: {POLICY}\ndataset_name: {DATA}\nreward_funcs:\n  - my_rewards.accuracy\n",
        {"model_name_or_path": POLICY, "dataset_name": DATA, "reward_fn": ("my_rewards:accuracy",)}),
    "clis.md: rloo_config.yaml with num_processes": (
        ["--config", "rloo_config.yaml"],
        f"model_name_or_path: {POLICY}\ndataset_name: {DATA}\nreward_funcs:\n  - my_rewards.accuracy\n"
        "num_processes: 4\n", "torchrun --nproc_per_node 4 rloo.py"),
    "clis.md: trl rloo --config rloo_config.yaml --output_dir test-rloo": (
        ["--config", "rloo_config.yaml", "--output_dir", "test-rloo"],
        f"model_name_or_path: {POLICY}\ndataset_name: {DATA}\nreport_to: none\n",
        {"output_dir": "test-rloo", "track": False}),
    "example_config.yaml": (
        ["--config", "example_config.yaml"],
        f"# env:\n#   CUDA_VISIBLE_DEVICES: 0\n\nmodel_name_or_path:\n  {POLICY}\ndataset_name:\n  {DATA}\n"
        "report_to:\n  none\nlearning_rate:\n  0.0001\nlr_scheduler_type:\n  cosine\n",
        {"learning_rate": 1e-4, "lr_scheduler_type": "cosine", "track": False}),
    "trl/scripts/rloo.py: TL;DR with a reward model": (
        ["--dataset_name", "data/tldr.jsonl", "--reward_model_name_or_path", "models/rm", "--model_name_or_path",
         POLICY], None, {"reward_model_path": "models/rm", "dataset_name": "data/tldr.jsonl"}),
    "rloo_trainer.md: the VLM command": (
        ["--model_name_or_path", POLICY, "--output_dir", "rloo-Qwen2.5-VL-3B-Instruct", "--learning_rate", "1e-5",
         "--dtype", "bfloat16", "--max_completion_length", "1024", "--use_vllm", "--vllm_mode", "colocate",
         "--use_peft", "--lora_target_modules", "q_proj,", "v_proj", "--log_completions"], None, "pass --bf16 instead"),
}


@pytest.mark.parametrize("case", TRL_DOCS, ids=list(TRL_DOCS))
def test_the_trl_rloo_commands_and_recipes_of_trls_docs(case, capsys, tmp_path, monkeypatch):
    argv, text, expected = TRL_DOCS[case]
    monkeypatch.chdir(tmp_path)  # the recipe beside the command, as the docs write them
    if text is not None:
        (tmp_path / argv[1]).write_text(text)
    if isinstance(expected, str):
        assert expected in refusal(capsys, *argv), case
        return
    args = parse(*argv)
    for name, value in expected.items():
        assert getattr(args, name) == value, (case, name)


def test_the_vlm_command_without_its_dtype_goes_to_rloo_multinode(capsys):
    """The same command with --bf16 for TRL's --dtype bfloat16: rloo.py names rloo_multinode.py for vLLM, and
    rloo_multinode.py takes it (colocated vLLM, LoRA, the completions logged)."""
    argv = ["--model_name_or_path", POLICY, "--learning_rate", "1e-5", "--bf16", "--max_completion_length", "1024",
            "--use_vllm", "--vllm_mode", "colocate", "--use_peft", "--lora_target_modules", "q_proj", "v_proj",
            "--log_completions"]
    assert "rloo_multinode.py" in refusal(capsys, *argv)
    args = parse(*argv, cls=rloo_multinode.Args, prog="rloo_multinode.py")
    assert (args.engine, args.vllm_mode, args.use_peft, args.response_length, args.log_completions) == (
        "vllm", "colocate", True, 1024, True)


# ---------------------------------------------------------------- TRL's meaning for the names rloo.py shares
def test_weight_decay_is_trls_default_and_decays_what_transformers_trainer_decays(tmp_path):
    """0.0 by default (both TRLs); otherwise the groups of transformers' Trainer.create_optimizer, which TRL's
    RLOOTrainer inherits: the same parameters decay, biases and norms do not."""
    from transformers import Trainer, TrainingArguments

    assert rloo.Args().weight_decay == 0.0 == plumbing.TRL116["weight_decay"]
    policy = tiny_policy(15)
    trainable = [p for p in policy.parameters() if p.requires_grad]
    assert plumbing.weight_decay_groups(policy, trainable, 0.0) == [{"params": trainable, "weight_decay": 0.0}]
    ours = plumbing.weight_decay_groups(policy, trainable, 0.1)
    trainer = Trainer(model=policy, args=TrainingArguments(output_dir=str(tmp_path), weight_decay=0.1, use_cpu=True,
                                                           report_to="none"))
    theirs = trainer.create_optimizer().param_groups
    by_decay = lambda groups: {g["weight_decay"]: {id(p) for p in g["params"]} for g in groups}  # noqa: E731
    assert by_decay(ours) == by_decay(theirs)
    assert len(by_decay(ours)[0.0]) > 0 and len(by_decay(ours)[0.1]) > 0


def test_evaluation_schedules():
    """--eval_strategy steps every --eval_steps (--logging_steps when None, fractions of the run, optimizer steps
    with --max_steps), epoch at each pass's end, no never; by default --num_evals spread over the run."""
    at = lambda steps_per_update=1, updates_per_epoch=4, **flags: plumbing.evaluation_updates(  # noqa: E731
        rloo.Args(**flags), plumbing.RunLength(10, steps_per_update), updates_per_epoch)
    assert at(eval_strategy="steps", eval_steps=3) == {3, 6, 9}
    assert at(eval_strategy="steps", logging_steps=5) == {5, 10}  # TRL: eval_steps defaults to logging_steps
    assert at(eval_strategy="steps", eval_steps=0.25) == {3, 6, 9}  # ceil(2.5)
    assert at(eval_strategy="steps", eval_steps=8, max_steps=40, steps_per_update=4) == {2, 4, 6, 8, 10}
    assert at(eval_strategy="epoch") == {4, 8, 10}  # and the end of the last pass, whole or not (TRL's Trainer)
    assert at(eval_strategy="no") == set() and at(num_evals=2) == {5, 10}


def test_eval_strategy_picks_trls_test_split_and_no_loads_none():
    assert parse("--eval_strategy", "steps").dataset_test_split == "test"  # TRL's default split
    assert parse("--eval_strategy", "epoch", "--dataset_test_split", "validation").dataset_test_split == "validation"
    assert parse("--eval_strategy", "no", "--dataset_test_split", "validation").dataset_test_split is None
    assert parse("--dataset_test_split", "validation").eval_strategy is None  # rloo.py's own: --num_evals times


def test_logprobs_from_the_update_needs_a_training_forward_that_samples_as_the_sampler():
    """On-policy the update's own forward gives the old log-probs: not with LoRA dropout (TRL's 0.05 default),
    which the sampler's forward does not have."""
    sizes = rloo.compute_batch_sizes(rloo.Args(num_ppo_epochs=1, rloo_k=2), 1)
    for use_peft, dropout, expected in ((False, 0.05, True), (True, 0.0, True), (True, 0.05, False)):
        args = rloo.Args(num_ppo_epochs=1, rloo_k=2, use_peft=use_peft, lora_dropout=dropout)
        assert rloo.logprobs_from_update(args, sizes, 0) is expected


def test_masked_and_unscored_completions_advantages_are_trl_1_16s_on_the_same_batch():
    """TRL 1.16's own lines (RLOOTrainer._generate_and_score_completions: the completion mask of
    mask_truncated_completions, the nan-aware leave-one-out of unscorable completions) against compute_advantages on
    the same batch, for every combination (tests/trl116_same_batch.py)."""
    result = with_trl116("tests/trl116_same_batch.py")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count(": same") == 48


def test_report_to_tensorboard_is_the_tensorboard_flag_and_without_the_package_one_line(monkeypatch):
    args = parse("--report_to", "wandb", "tensorboard")
    assert args.track and args.tensorboard and not parse("--report_to", "none", "--tensorboard", "False").tensorboard
    find_spec = plumbing.flags.importlib.util.find_spec
    monkeypatch.setattr(plumbing.flags.importlib.util, "find_spec",
                        lambda name, *rest: None if name == "tensorboard" else find_spec(name, *rest))
    with pytest.raises(plumbing.ConfigError, match="needs the tensorboard package: pip install tensorboard"):
        plumbing.validate_args(rloo.Args(model_name_or_path="p", reward_fn=("m:f",), tensorboard=True))


def test_tensorboard_gets_every_metric_at_its_episode_and_a_resume_purges_the_later_ones(tmp_path, monkeypatch):
    """RunLogger's writer (torch.utils.tensorboard.SummaryWriter; here a stand-in that records its calls)."""
    made = []

    class Writer:
        def __init__(self, log_dir, purge_step=None, flush_secs=120):
            made.append(self)
            self.log_dir, self.purge_step, self.scalars, self.closed = os.path.realpath(log_dir), purge_step, [], False

        def add_scalar(self, key, value, step):
            self.scalars.append((key, value, step))

        def close(self):
            self.closed = True

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=Writer))
    args = rloo.Args(output_dir=str(tmp_path), tensorboard=True)
    for start_update in (0, 3):
        logger = plumbing.RunLogger(args, "run", 5, start_update, None, "run-a", 1)
        logger.log(start_update + 1, {"objective/scores": 0.5, "episode": 16 * (start_update + 1)})
        logger.log_eval(start_update + 1, {"eval/scores": 0.25}, 16 * (start_update + 1))
        logger.close()
    fresh, resumed = made
    assert fresh.log_dir == str(tmp_path / "tensorboard") and fresh.purge_step is None and fresh.closed  # by handle
    assert ("objective/scores", 0.5, 16) in fresh.scalars and ("eval/scores", 0.25, 16) in fresh.scalars
    assert resumed.purge_step == 64  # the first episode the resumed timeline writes again


def test_tensorboard_event_files_hold_the_metrics(tmp_path):
    """With the tensorboard package (an extra: pip install tensorboard), what TensorBoard reads back."""
    pytest.importorskip("tensorboard", reason="needs the tensorboard package (pip install tensorboard)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = plumbing.RunLogger(rloo.Args(output_dir=str(tmp_path), tensorboard=True), "run", 2, 0, None, "run-a", 1)
    for update in (1, 2):
        logger.log(update, {"objective/scores": 0.25 * update, "episode": 16 * update})
    logger.log_eval(2, {"eval/scores": 0.75}, 32)
    logger.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("objective/scores")] == [(16, 0.25), (32, 0.5)]
    assert [(e.step, e.value) for e in events.Scalars("eval/scores")] == [(32, 0.75)]


def test_trl_names_of_the_lora_options_reach_peft():
    """--lora_target_parameters (peft's target_parameters: adapters on parameters, beside the modules'), which peft
    takes without dropout only: refused in one line with TRL's --lora_dropout 0.05, before anything loads."""
    assert rloo.Args().lora_dropout == 0.05 == plumbing.TRL116["lora_dropout"]
    targets = {"use_peft": True, "lora_target_parameters": ("mlp.dense_h_to_4h.weight",)}  # and peft's default modules
    with pytest.raises(plumbing.ConfigError,
                       match="take no dropout, and --lora_dropout is 0.05 .* pass --lora_dropout 0"):
        plumbing.validate_args(rloo.Args(model_name_or_path="p", reward_fn=("m:f",), **targets))
    args = rloo.Args(lora_dropout=0.0, **targets)
    assert plumbing.lora_config(args).target_parameters == ["mlp.dense_h_to_4h.weight"]
    policy, base = tiny_policy(15), tiny_policy(15)
    plumbing.add_adapters(policy, args, None)
    adapted = {name.split(".lora_")[0].split(".", 3)[-1] for name, p in policy.named_parameters() if p.requires_grad}
    assert adapted == {"attention.query_key_value", "mlp.dense_h_to_4h"}, adapted
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_()
    ids = torch.tensor([[2, 3, 4, 5]])
    torch.testing.assert_close(plumbing.AdaptersOff(policy)(ids).logits, base(ids).logits)  # the reference


# ---------------------------------------------------------------- a run: epochs, evaluation at each, the start-up lines
def test_num_train_epochs_is_passes_over_the_prompts_and_the_start_up_says_it_in_numbers(assets, tmp_path):
    """8 prompts, k=4, 16 completions per update: an epoch is 32 completions, 2 updates; 2 epochs are 4 updates,
    evaluated after each epoch (TRL's --eval_strategy epoch), with a console line every half of the run. The reward
    function scores the completions of an even number of words only: the others are unscored, as in TRL (the run
    goes on, its means over the scored ones)."""
    prompts = write_jsonl(tmp_path / "eight.jsonl", [{"prompt": f"{a} {b} :"} for a, b in zip("abcdefgh", "hgfedcba")])
    result = run_rloo("--model_name_or_path", assets["policy"], "--dataset_name", prompts, "--reward_fn",
                      "reward_fns:only_even_lengths", "--output_dir", tmp_path / "out", "--rloo_k", "4",
                      "--per_device_train_batch_size", "16", "--num_ppo_epochs", "1", "--response_length", "4",
                      "--max_prompt_length", "16", "--num_train_epochs", "2", "--eval_strategy", "epoch",
                      "--dataset_test_split", assets["test"], "--logging_steps", "0.5", "--num_sample_generations",
                      "0", "--learning_rate", "1e-3")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "4 updates x 16 completions" in result.stdout
    assert "an epoch: 8 prompts x k=4 = 32 completions = 2 updates" in result.stdout
    assert "the learning rates of the run's optimizer steps sum to 0.0025: AdamW moves each weight by at most " \
           "about that much" in result.stdout  # 1e-3 x (1 + 3/4 + 2/4 + 1/4), linear decay
    metrics = read_metrics(tmp_path / "out")
    assert [m["update"] for m in metrics if "eval/scores" in m] == [0, 2, 4]
    assert all(m["objective/scores"] == 1.0 and m["reward"] == 1.0 for m in metrics if "objective/scores" in m)
    assert all(m["eval/scores"] == 1.0 for m in metrics if "eval/scores" in m)  # over the scored completions
    assert [line.split()[1] for line in result.stdout.splitlines() if line.startswith("update ")] == ["2/4,", "4/4,"]


# ---------------------------------------------------------------- a TRL 1.16 user's small frictions, each answered
def test_warmup_steps_is_transformers_5s_and_one_warmup_is_asked_for(tmp_path):
    """transformers 5 (TRL 1.16's) has --warmup_steps only: >= 1 a number of steps, below 1 a share of them; the
    warmup of TRL 1.16's arithmetic is the installed transformers' own count."""
    from transformers import TrainingArguments

    for value in (0.1, 3, 0.25, 0):
        args = parse("--trl_defaults", "1.16", "--warmup_steps", value)
        assert args.warmup_steps == value
        expected = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, warmup_steps=value).get_warmup_steps(21)
        assert plumbing.warmup_length(args, 21) == expected
    for flags, message in (({"warmup_ratio": 0.1, "warmup_steps": 2}, "without --warmup_steps"),
                           ({"warmup_steps": 2.5}, "warmup_steps = 2.5 must be a whole number of steps >= 0")):
        with pytest.raises(plumbing.ConfigError, match=message):
            plumbing.validate_args(rloo.Args(model_name_or_path="p", reward_fn=("m:f",), **flags))


def test_the_context_check_offers_only_fixes_that_fit():
    """TRL 1.16's 512 new tokens on a model of 128 positions: a shorter prompt cannot make room; nor, when the
    longest prompt alone fills them, a shorter response."""
    from transformers import GPT2Config

    config = GPT2Config(n_positions=128)  # a learned table of positions
    for response, longest, fix in ((512, 100, "lower --response_length to 28 or less"),
                                   (53, 300, "lower --max_prompt_length to 75 or less (longer prompts are dropped)"),
                                   (512, 300, "lower --max_prompt_length and --response_length to a sum of 128")):
        with pytest.raises(plumbing.ConfigError) as refused:
            plumbing.check_context(config, "policy", rloo.Args(response_length=response), longest)
        assert str(refused.value).endswith(fix + (" or less" if "sum" in fix else "")), str(refused.value)


def test_an_invalid_choice_lists_the_choices_in_one_order(capsys):
    """tyro gives an Optional[Literal]'s choices from a set: their order changed from process to process."""
    event = plumbing.cli.tyro._errors.InvalidChoice(
        prog="rloo.py", argument=types.SimpleNamespace(lowered=types.SimpleNamespace(name_or_flags=["--kl_estimator"])),
        value="k4", choices=("k3", "None", "k1", "k2"))
    assert plumbing.cli.parse_error_line(event, []) == "--kl_estimator 'k4' is not one of k1, k2, k3, None"
    assert refusal(capsys, "--kl_estimator", "k4").endswith("--kl_estimator 'k4' is not one of k1, k2, k3, None")


def test_a_refusal_names_each_flag_as_the_command_gave_it(tmp_path, capsys):
    """--beta 0 --kl_in_loss was refused naming --kl_coef; a recipe's key counts as given; a flag given under this
    script's name keeps it."""
    with pytest.raises(plumbing.ConfigError) as refused:
        rloo.algorithm_checks(parse("--beta", 0, "--kl_in_loss"))
    line = f"rloo.py: error: {refused.value}"
    plumbing.cli.say(line, ["--beta", "0", "--kl_in_loss"])
    said = capsys.readouterr().err
    assert said.count("\n") == 1 and "with beta 0 there is no reference: set --beta (the KL term's weight)" in said
    assert "kl_coef" not in said
    path = tmp_path / "recipe.yaml"
    path.write_text("beta: 0\nnum_generations: 4\n")
    assert "set --beta" in plumbing.cli.as_given(line, ["--config", str(path), "--kl_in_loss"])
    assert plumbing.cli.as_given(line, ["--kl_coef", "0", "--kl_in_loss"]) == line
    assert plumbing.cli.as_given("rloo_k = 1: pass --rloo_k 2 or more", ["--num_generations=1"]) == \
        "num_generations = 1: pass --num_generations 2 or more"


def test_use_cpu_hides_the_gpus_before_anything_looks_for_one(tmp_path):
    """TRL's --use_cpu trains on the CPU (it was refused): the process sees no GPU from the parse on; every look for
    a GPU comes after it (each one recorded with the CUDA_VISIBLE_DEVICES it saw)."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import json, os, sys\nsys.path.insert(0, sys.argv[1])\nimport torch\nseen = []\n\n\n"
        "def recorded(look):\n    return lambda *a: seen.append(os.environ.get('CUDA_VISIBLE_DEVICES')) or look(*a)"
        "\n\n\n"
        "torch.cuda.is_available = recorded(torch.cuda.is_available)\n"
        "torch.cuda.device_count = recorded(torch.cuda.device_count)\n"
        "import plumbing, rloo\n"
        "args = plumbing.parse_args(rloo.Args, ['--use_cpu', '--trl_defaults', '1.16'])\n"
        "print(json.dumps([seen, os.environ['CUDA_VISIBLE_DEVICES'], args.bf16]))\n")
    env = {name: value for name, value in cpu_env().items() if name != "CUDA_VISIBLE_DEVICES"}
    result = subprocess.run([python(), str(probe), str(REPO)], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    seen, visible, bf16 = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen and set(seen) == {""} and visible == "" and not bf16, result.stdout  # looked, after the flag only
    assert parse("--use_cpu", "False").rloo_k == 2  # TRL's default: asks for nothing


def test_a_refusal_under_torchrun_is_the_last_entry_of_its_summary(tmp_path):
    """torchrun ends a failed run with its own traceback and a summary of the failed ranks: the rank's one line is the
    summary's last entry (torchrun's error file), not a pointer to its docs."""
    result = run_rloo("--rloo_k", "1", "--output_dir", tmp_path / "out", nproc=1)
    assert result.returncode != 0
    tail = result.stderr.rstrip().splitlines()[-2:]
    assert tail[0].strip().startswith("traceback : rloo.py: error: ") and set(tail[1]) == {"="}, tail
