"""benchmark/tldr launch scripts, run with stand-ins for torchrun, srun and scontrol: valid bash, only real
rloo.py and torchrun flags, the published settings, the batch sizes their comments claim, the environment
overrides, and the SLURM file's signal handling and requeue."""

import dataclasses
import json
import math
import os
import re
import subprocess
import sys

import pytest
from torch.distributed.run import get_args_parser

import plumbing
import rloo
from conftest import REPO

TLDR = REPO / "benchmark" / "tldr"
SCRIPTS = sorted(TLDR.glob("*.sh"))
SBATCH = TLDR / "rloo_tldr.sbatch"
PUBLISHED = {  # TRL's 1B run, shared by every script
    "dataset_name": "trl-internal-testing/tldr-preference-sft-trl-style", "dataset_test_split": "validation",
    "kl_coef": 0.03, "missing_eos_penalty": 1.0, "stop_token": "eos", "response_length": 53, "temperature": 0.7,
    "num_ppo_epochs": 2, "num_mini_batches": 2, "total_episodes": 1_000_000, "local_rollout_forward_batch_size": 16,
    "bf16": True, "track": True, "save_steps": 10, "resume": True, "seed": 1,
}
def pythia(size: str) -> dict:
    """The N+ details work's SFT and reward models of one Pythia size."""
    return {"model_name_or_path": f"EleutherAI/pythia-{size}-deduped",
            "sft_model_path": f"cleanrl/EleutherAI_pythia-{size}-deduped__sft__tldr",
            "reward_model_path": f"cleanrl/EleutherAI_pythia-{size}-deduped__reward__tldr"}


TRL_1B_SCHEDULE = {"rloo_k": 2, "learning_rate": 3e-6, "lr_scheduler_type": "linear"}
LARGE_BATCH = {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 32, "gradient_checkpointing": True}
PER_SCRIPT = {
    "rloo_tldr_1b.sh": {
        **pythia("1b"), **TRL_1B_SCHEDULE, "per_device_train_batch_size": 16, "gradient_accumulation_steps": 16,
        "gradient_checkpointing": False, "output_dir": "models/rloo_tldr_1b_seed1",
    },
    "rloo_tldr_2p8b.sh": {
        **pythia("2.8b"), **TRL_1B_SCHEDULE, **LARGE_BATCH, "fsdp": False, "output_dir": "models/rloo_tldr_2p8b_seed1",
    },
    "rloo_tldr_6p9b.sh": {
        **pythia("6.9b"), **TRL_1B_SCHEDULE, **LARGE_BATCH, "fsdp": True, "fsdp_generation": "unshard",
        "output_dir": "models/rloo_tldr_6p9b_seed1",
    },
    "rloo_tldr_1b_k4_back_to_basics.sh": {
        **pythia("1b"), "rloo_k": 4, "learning_rate": 1e-6, "lr_scheduler_type": "constant",
        "per_device_train_batch_size": 16, "gradient_accumulation_steps": 16, "gradient_checkpointing": False,
        "output_dir": "models/rloo_tldr_1b_k4_back_to_basics_seed1",
    },
}
OVERRIDES = ("SEED", "K", "OUTPUT_DIR", "NPROC", "TORCHRUN_ARGS", "SCRIPT", "PYTHIA", "TRAINER", "TP", "PYTHON",
             "TRAIN_NODES", "ENGINE_PORT", "MASTER_PORT", "ENGINES", "SERVE_MODEL", "MAX_MODEL_LEN", "MAX_REQUEUES",
             "SLURM_RESTART_COUNT")


@pytest.fixture
def fake_bin(tmp_path):
    """A PATH entry with a torchrun that records its argv and working directory (exit status $FAKE_STATUS),
    an srun that runs its command, and an scontrol that records its argv."""
    bin_dir, log = tmp_path / "bin", tmp_path / "log"
    bin_dir.mkdir()
    log.mkdir()
    (bin_dir / "torchrun").write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        f"json.dump({{'argv': sys.argv[1:], 'cwd': os.getcwd()}}, open({str(log / 'torchrun.json')!r}, 'w'))\n"
        "sys.exit(int(os.environ.get('FAKE_STATUS', '0')))\n")
    (bin_dir / "srun").write_text('#!/bin/sh\nexec "$@"\n')
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {log / "scontrol.log"}\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    return bin_dir, log


def launch(fake_bin, command: list, cwd, **env: str) -> dict:
    """Run a script with the stand-ins first on PATH; returns torchrun's argv, parsed by torchrun's own parser
    into `torchrun` and by rloo.py's (parse_args: TRL's names, repeated flags) into `args`, its working directory
    and the scontrol calls."""
    bin_dir, log = fake_bin
    clean = {k: v for k, v in os.environ.items() if k not in OVERRIDES}
    subprocess.run(["bash", *map(str, command)], cwd=cwd, check=True, timeout=30,
                   env={**clean, "PATH": f"{bin_dir}:{os.environ['PATH']}", **env})
    record = json.loads((log / "torchrun.json").read_text())
    torchrun = get_args_parser().parse_args(record["argv"])
    scontrol = log / "scontrol.log"
    return {"torchrun": torchrun, "args": plumbing.parse_args(rloo.Args, argv=torchrun.training_script_args),
            "cwd": record["cwd"], "scontrol": scontrol.read_text().splitlines() if scontrol.exists() else []}


def claimed(script_text: str, pattern: str) -> int:
    """A number the script's comment states, e.g. the `4096` of `= 4096 completions per update`."""
    match = re.search(pattern, script_text)
    assert match, f"no {pattern!r} in the comment"
    return int(match.group(1).replace(",", ""))


@pytest.mark.parametrize("path", [*SCRIPTS, SBATCH], ids=lambda p: p.name)
def test_bash_syntax(path):
    subprocess.run(["bash", "-n", str(path)], check=True)


def test_every_script_is_checked():
    assert {p.name for p in SCRIPTS} == set(PER_SCRIPT)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_runs_the_published_settings_from_any_directory(script, fake_bin, tmp_path, monkeypatch):
    run = launch(fake_bin, [script], cwd=tmp_path)
    args = run["args"]
    assert run["cwd"] == str(REPO)
    assert run["torchrun"].nproc_per_node == "8" and run["torchrun"].training_script == "rloo.py"
    expected = PUBLISHED | PER_SCRIPT[script.name]
    assert {name: getattr(args, name) for name in expected} == expected
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "8"), ("MASTER_ADDR", "127.0.0.1"),
                        ("MASTER_PORT", "29500")):
        monkeypatch.setenv(name, value)  # as torchrun starts it
    plumbing.validate_args(args)
    sizes = rloo.compute_batch_sizes(args, world_size=8)
    text = script.read_text()
    assert sizes.all_ranks == claimed(text, r"= (\d+) completions per update") == 4096
    assert sizes.local == claimed(text, r"= (\d+) completions per GPU") == 512
    assert sizes.prompts == claimed(text, r"\((\d+) prompts x k=") == 512 // args.rloo_k
    assert math.ceil(args.total_episodes / sizes.all_ranks) == claimed(text, r"episodes = (\d+) updates") == 245
    assert args.total_episodes == claimed(text, r"([\d,]+) episodes =")


def test_environment_overrides_and_extra_arguments(fake_bin, tmp_path):
    run = launch(fake_bin, [TLDR / "rloo_tldr_1b.sh", "--num_evals", "8", "--learning_rate", "1e-5"], cwd=tmp_path,
                 SEED="3", K="4", OUTPUT_DIR="models/mine", NPROC="4", TORCHRUN_ARGS="--max_restarts 2")
    args = run["args"]
    assert (args.seed, args.rloo_k, args.output_dir, args.num_evals, args.learning_rate) == (3, 4, "models/mine", 8, 1e-5)
    assert (run["torchrun"].nproc_per_node, run["torchrun"].max_restarts) == ("4", 2)


@pytest.mark.parametrize("script, k, output_dir", [
    ("rloo_tldr_1b.sh", 4, "models/rloo_tldr_1b_k4_seed2"),
    ("rloo_tldr_1b_k4_back_to_basics.sh", 8, "models/rloo_tldr_1b_k4_back_to_basics_k8_seed2"),
])
def test_default_output_dir_names_seed_and_k(script, k, output_dir, fake_bin, tmp_path):
    args = launch(fake_bin, [TLDR / script], cwd=tmp_path, SEED="2", K=str(k))["args"]
    assert (args.output_dir, args.seed, args.rloo_k) == (output_dir, 2, k)


def test_sbatch_directives():
    text = SBATCH.read_text()
    for directive in ("--signal=USR1@300", "--requeue", "--open-mode=append", "--nodes=1", "--gpus-per-node=8"):
        assert re.search(rf"^#SBATCH .*{re.escape(directive)}", text, re.M), directive
    assert 'if [ -f "$OUTPUT_DIR/preempted" ]; then' in text


@pytest.mark.parametrize("preempted, restarts, requeued", [(True, None, True), (False, None, False),
                                                           (True, "49", True), (True, "50", False)],
                         ids=["preempted", "finished-or-failed", "49th-restart", "50th-restart"])
def test_sbatch_forwards_signals_and_requeues_only_a_preempted_run_a_bounded_number_of_times(
        preempted, restarts, requeued, fake_bin, tmp_path):
    output_dir = tmp_path / "out"
    if preempted:  # what rloo.py leaves after a signal; a finished or failed run leaves none
        output_dir.mkdir()
        (output_dir / "preempted").write_text("out/checkpoints/step_3\n")
    # torchrun exits non-zero after forwarding a signal: the script must still reach its requeue test
    run = launch(fake_bin, [SBATCH, "--num_evals", "8"], cwd=REPO, SLURM_JOB_ID="42", OUTPUT_DIR=str(output_dir),
                 SCRIPT="benchmark/tldr/rloo_tldr_2p8b.sh", FAKE_STATUS="1",
                 **({"SLURM_RESTART_COUNT": restarts} if restarts else {}))
    assert run["torchrun"].signals_to_handle == "SIGTERM,SIGINT,SIGUSR1"
    assert run["torchrun"].shutdown_timeout == 280
    assert (run["args"].output_dir, run["args"].num_evals) == (str(output_dir), 8)
    assert run["args"].model_name_or_path == "EleutherAI/pythia-2.8b-deduped"
    assert run["scontrol"] == (["requeue 42"] if requeued else [])
    # the requeue consumes the marker: an attempt that fails before rloo.py removes it is not requeued again;
    # past the bound the marker stays, for whoever resubmits the job
    assert (output_dir / "preempted").exists() == (preempted and not requeued)


def test_sbatch_default_script_and_output_dir_match_the_1b_script(fake_bin):
    run = launch(fake_bin, [SBATCH], cwd=REPO, SLURM_JOB_ID="7", SEED="5")
    assert run["args"].model_name_or_path == "EleutherAI/pythia-1b-deduped"
    assert run["args"].output_dir == "models/rloo_tldr_1b_seed5"
    assert run["scontrol"] == []  # no models/rloo_tldr_1b_seed5/preempted: finished or failed, not requeued


def run_multinode_sbatch(fake_bin, *args: str, **env: str):
    """rloo_tldr_multinode.sbatch on 3 stand-in nodes with TP=2; returns the engine lines ("CUDA_VISIBLE_DEVICES
    argv", sorted) and the trainer's rloo_multinode.py Args."""
    import rloo_multinode

    bin_dir, log = fake_bin
    (bin_dir / "scontrol").write_text('#!/bin/sh\nprintf "node0\\nnode1\\nnode2\\n"\n')
    (bin_dir / "srun").write_text('#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\n'
                                  'SLURM_NODEID=0 exec "$@"\n')  # drops srun's options, runs one task
    for engine in ("fake_python", "vllm"):  # the `serve` engines' python, and vLLM's CLI
        (bin_dir / engine).write_text('#!/bin/sh\necho "$CUDA_VISIBLE_DEVICES ${VLLM_SERVER_DEV_MODE:-} '
                                      f'${{PYTHONPATH:-}} $*" >> {log / "engines.log"}\n')
        (bin_dir / engine).chmod(0o755)
    sbatch = TLDR / "rloo_tldr_multinode.sbatch"
    subprocess.run(["bash", "-n", str(sbatch)], check=True)
    clean = {k: v for k, v in os.environ.items() if k not in OVERRIDES}
    subprocess.run(["bash", str(sbatch), *args], cwd=REPO, check=True, timeout=30, env={
        **clean, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "node[0-2]", "TP": "2",
        "PYTHON": str(bin_dir / "fake_python"), "PYTHONPATH": "", **env})
    engines = sorted(" ".join(line.split()) for line in (log / "engines.log").read_text().splitlines())
    record = json.loads((log / "torchrun.json").read_text())
    torchrun = get_args_parser().parse_args(record["argv"])
    assert (torchrun.nnodes, torchrun.node_rank, torchrun.master_addr) == ("2", 0, "node0")
    assert torchrun.nproc_per_node == "8" and torchrun.training_script == "rloo_multinode.py"
    args = plumbing.parse_args(rloo_multinode.Args, argv=torchrun.training_script_args)
    assert {name: getattr(args, name) for name in PUBLISHED} == PUBLISHED  # the 1B run's settings, unchanged
    return engines, args


def test_multinode_sbatch_starts_engines_on_the_last_node_and_trains_on_the_others(fake_bin):
    """3 nodes, TP=2: node2 runs 4 engines of 2 GPUs; node0 and node1 run torchrun with rank 0 on node0."""
    import rloo_multinode

    engines, args = run_multinode_sbatch(fake_bin, "--async_generation")
    model = "cleanrl/EleutherAI_pythia-1b-deduped__sft__tldr"  # the trainer's --sft_model_path
    assert engines == [f"{i * 2},{i * 2 + 1} rloo_multinode.py serve --trainer_address node0:29600 --engine_index {i} "
                       f"--model {model}" for i in range(4)]
    assert args.sft_model_path == model
    assert (args.engine, args.num_engines, args.vllm_tensor_parallel_size, args.launch_engines) == ("vllm", 4, 2, False)
    assert args.async_generation and args.engine_port == 29600
    rloo_multinode.validate_engine_args(dataclasses.replace(args, engine="hf", vllm_tensor_parallel_size=1), 16)


def test_multinode_sbatch_with_vllm_serve_engines_attaches_the_trainer_to_them(fake_bin):
    import rloo_multinode

    engines, args = run_multinode_sbatch(fake_bin, ENGINES="vllm-serve", PYTHIA="2.8b")
    model = "cleanrl/EleutherAI_pythia-2.8b-deduped__sft__tldr"
    assert engines == [f"{i * 2},{i * 2 + 1} 1 serve {model} --host node2 --port {8000 + i} --tensor-parallel-size 2 "
                       f"--seed {i} --dtype bfloat16 --max-model-len 565 --enable-prefix-caching "
                       """--weight-transfer-config {"backend": "nccl"}""" for i in range(4)]
    assert args.engine_urls == ",".join(f"http://node2:{8000 + i}" for i in range(4))
    assert args.engine == "vllm" and args.num_engines == 1  # one engine per URL
    assert rloo_multinode.engine_urls(args) == args.engine_urls.split(",")
    assert f"--max-model-len {args.max_prompt_length + args.response_length}" in engines[0]
