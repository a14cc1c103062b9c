"""The tests' shared helpers, in one module of their own (test files import from here, never from each other): tiny
models and tokenizers built in code (no network), prompt files, running rloo.py as a user would (a process of its own)
or in the test's process (one import shared by every run), and the checks of a resumed run. conftest.py holds the
fixtures (the tiny assets, built once per session) and keeps these names importable from it."""

import atexit
import functools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (GPTNeoXConfig, GPTNeoXForCausalLM, GPTNeoXForSequenceClassification,
                          PreTrainedTokenizerFast)

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # rloo.py is a script at the top level, not a package
LETTERS = "abcdefghijkl"

import plumbing  # noqa: E402  (from REPO, put on the path above)
import forked_python  # noqa: E402


def word_tokenizer(words: list[str], pad: str | None = "<pad>", eos: str = "<eos>") -> PreTrainedTokenizerFast:
    """Whitespace word-level tokenizer; ids follow the order of `words` (special tokens included there)."""
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    special = {"eos_token": eos} | ({"pad_token": pad} if pad else {})
    return PreTrainedTokenizerFast(tokenizer_object=backend, padding_side="left", **special)


def policy_tokenizer() -> PreTrainedTokenizerFast:
    return word_tokenizer(["<pad>", "<eos>", *LETTERS, ":"])


def neox_config(vocab_size: int, **overrides) -> GPTNeoXConfig:
    return GPTNeoXConfig(**{"vocab_size": vocab_size, "hidden_size": 32, "num_hidden_layers": 2,
                            "num_attention_heads": 4, "intermediate_size": 64, "max_position_embeddings": 64,
                            "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 1, **overrides})


def tiny_policy(vocab_size: int, seed: int = 0) -> GPTNeoXForCausalLM:
    torch.manual_seed(seed)
    return GPTNeoXForCausalLM(neox_config(vocab_size)).eval()


def tiny_reward_model(vocab_size: int, seed: int = 0, **config) -> GPTNeoXForSequenceClassification:
    torch.manual_seed(seed)
    return GPTNeoXForSequenceClassification(neox_config(vocab_size, num_labels=1, **config)).eval()


def policy_loss_of(new, old, advantages, mask, cliprange=0.2, per_token=False, entropy=None, in_loss=None,
                   sampler_logprobs=None, ref_logprobs=None, **flags):
    """rloo.policy_loss of loose tensors, log-probs and mask (N, Tr): a micro-batch of N completions (of one-token
    prompts) holding them, and Args with the flags (per_token: --token_level_kl)."""
    import rloo
    batch = rloo.Rollout(torch.ones(len(new), 1, dtype=torch.long), torch.ones(len(new), 1, dtype=torch.bool),
                         torch.ones(new.shape, dtype=torch.long), mask.bool(), old, ref_logprobs, in_loss=in_loss,
                         sampler_logprobs=sampler_logprobs)
    values = rloo.Advantages(advantages, *(torch.zeros(len(new)) for _ in range(3)))  # what the loss reads of them
    return rloo.policy_loss(new, batch, values, rloo.Args(cliprange=cliprange, token_level_kl=per_token, **flags),
                            entropy)


def prompt_rows(n: int, seed: int) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        letters = [LETTERS[i] for i in torch.randperm(len(LETTERS), generator=gen)[:4].tolist()]
        rows.append({"prompt": " ".join(letters) + " :", "target": letters[0]})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def hub_cache_repo(name: str) -> tuple[str, Path]:
    """A model id of the tests' own Hugging Face cache (HF_HUB_CACHE, set by conftest) and its folder there, for a
    test to put snapshots in as a download of them leaves them: `name` the test's own (its tmp_path's)."""
    return f"org/{name}", Path(os.environ["HF_HUB_CACHE"]) / f"models--org--{name}"


@functools.cache
def forked_interpreter() -> forked_python.Interpreter | None:
    """This pytest worker's server of forked interpreters (tests/forked_python.py), started at the first call; None
    where TESTS_FORK=0."""
    if os.environ.get("TESTS_FORK", "1") == "0":
        return None
    directory = tempfile.mkdtemp(prefix="forked-python-")
    interpreter = forked_python.Interpreter(directory, script_env())
    atexit.register(shutil.rmtree, directory, True)
    atexit.register(interpreter.close)
    return interpreter


def python() -> str:
    """The Python that the tests run the project's scripts with, as `python` would run them: a fork of a process that
    has imported the libraries (milliseconds instead of seconds per start), or sys.executable where TESTS_FORK=0."""
    interpreter = forked_interpreter()
    return interpreter.path if interpreter else sys.executable


def pid_of(process: subprocess.Popen) -> int:
    """The pid of the run a Popen of python() stands for (the one its lock file and messages name)."""
    interpreter = forked_interpreter()
    return interpreter.pid_of(process) if interpreter else process.pid


def script_command(script: str, *args, nproc: int = 0) -> list[str]:
    """`python SCRIPT ARGS`, or `torchrun --nproc_per_node NPROC SCRIPT ARGS`."""
    launcher = [python(), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)
                ] if nproc else [python()]
    return [*launcher, str(REPO / script), *map(str, args)]


# What the tests mean: the CPU, also on a machine with a GPU (two ranks cannot share one GPU); the GPU tests pass
# their own CUDA_VISIBLE_DEVICES.
ON_CPU = {"CUDA_VISIBLE_DEVICES": ""}


def cpu_env(env: dict | None = None) -> dict:
    """This process's environment for a subprocess that runs on the CPU, offline, plus `env`."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", **ON_CPU, **(env or {})}


def script_env(env: dict | None = None) -> dict:
    """The environment of a run: tests/ importable (reward functions), offline, on the CPU."""
    return cpu_env({"PYTHONPATH": str(REPO / "tests"), "WANDB_MODE": "offline", **(env or {})})


def run_rloo(*args: str, nproc: int = 0, env: dict | None = None, timeout: int = 300,
             script: str = "rloo.py") -> subprocess.CompletedProcess:
    """`python rloo.py ARGS`, or `torchrun --nproc_per_node NPROC rloo.py ARGS` (or another SCRIPT), to the end."""
    return subprocess.run(script_command(script, *args, nproc=nproc), capture_output=True, text=True,
                          env=script_env(env), timeout=timeout, cwd=REPO)


def read_metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def run_rloo_in_process(*args: str) -> None:
    """rloo.py ARGS in this process: its command line parsed as `python rloo.py` parses it, then rloo.main, pytest's
    signal handlers put back after. No imports paid again: for a test that needs the run's files, not its exit
    status or console (those need run_rloo)."""
    import plumbing
    import rloo

    saved = {sig: signal.getsignal(sig) for sig in plumbing.StopSignal.SIGNALS}
    try:
        rloo.main(plumbing.parse_args(rloo.Args, [str(a) for a in args], prog="rloo.py"))
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def free_port() -> int:
    """A port with nothing listening on it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def valid_flags(assets, output_dir: Path) -> dict:
    """A valid command, as {flag: value}."""
    return {"model_name_or_path": assets["policy"], "dataset_name": assets["train"], "output_dir": output_dir,
            "reward_fn": "reward_fns:count_a", "max_prompt_length": 16, "response_length": 6}


def argv_of(flags: dict) -> list[str]:
    return [s for name, value in flags.items() for s in (f"--{name}", *([] if value is None else [str(value)]))]


def left_padded(tokenizer, texts):
    return plumbing.pad_sequences([tokenizer(t)["input_ids"] for t in texts], tokenizer.pad_token_id,
                                  torch.device("cpu"))


def NO_AUTOCAST():
    return torch.autocast("cpu", enabled=False)


# ---------------------------------------------------------------- checkpoints: runs stopped, resumed and compared
RUN = ("--reward_fn", "reward_fns:count_a", "--rloo_k", "4", "--per_device_train_batch_size", "16",
       "--response_length", "6", "--temperature", "1.0", "--max_prompt_length", "16",
       "--local_rollout_forward_batch_size", "32", "--num_ppo_epochs", "2", "--num_mini_batches", "2",
       "--learning_rate", "3e-3", "--num_sample_generations", "0", "--num_evals", "3")
PER_UPDATE = 32  # completions per update and rank: 16 x 1 x 2 minibatches (8 prompts x k=4)
NOT_REPRODUCIBLE = ("eps", "time/", "run_id")  # wall-clock measurements, and each run's own id


def comparable(metrics: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if not k.startswith(NOT_REPRODUCIBLE)} for m in metrics]


def launch(args: list, nproc: int = 0, script: Path = REPO / "rloo.py") -> subprocess.Popen:
    """`script` (rloo.py, or an edited copy elsewhere: the repository is on its path) with `args`, on `nproc` ranks."""
    launcher = [python(), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
                "--signals_to_handle", "SIGTERM,SIGINT,SIGUSR1"] if nproc else [python()]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO)]), "HF_HUB_OFFLINE": "1",
           "WANDB_MODE": "offline"}
    return subprocess.Popen([*launcher, str(script), *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)


def interrupt_after_first_update(args: list, sig: signal.Signals, nproc: int = 0,
                                 meanwhile: Callable = lambda process: None,
                                 script: Path = REPO / "rloo.py") -> tuple[int, str, str]:
    """Start a run, once it has logged an update call `meanwhile` and send it a real signal, wait for it to end."""
    process = launch(args, nproc, script)
    metrics = Path(args[args.index("--output_dir") + 1]) / "metrics.jsonl"
    deadline = time.time() + 600  # a hang guard only
    while not (metrics.exists() and metrics.read_text().count("\n") >= 1) and process.poll() is None:
        assert time.time() < deadline, "the run never logged an update"
        time.sleep(0.05)
    meanwhile(process)
    process.send_signal(sig)
    stdout, stderr = process.communicate(timeout=600)
    return process.returncode, stdout, stderr


def assert_same_run(full: Path, resumed: Path) -> None:
    run_id = json.loads((resumed / "args.json").read_text())["run_id"]  # the id drawn at the first start, kept
    assert {m["run_id"] for m in read_metrics(resumed)} == {run_id}
    assert comparable(read_metrics(resumed)) == comparable(read_metrics(full))
    a, b = load_file(full / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # bit-identical


def trainer_state(update: int, run_id: str = "run-a", **changes) -> dict:
    """A trainer state as Checkpointer.save writes it (the optimizer's is added by save_checkpoint)."""
    return {"update": update, "episode": update, "sampler": {"epoch": 0, "position": 0}, "elapsed": 0.0,
            "world_size": 1, "args": {}, "wandb_run_id": None, "run_id": run_id, "inputs": {}, **changes}


def saved_steps(out: Path, steps, keep=None, run_id: str = "run-a") -> tuple:
    """Checkpoints of a tiny policy at these steps in out/checkpoints, as a run writes them."""
    tokenizer = policy_tokenizer()
    policy = tiny_policy(len(tokenizer))
    optimizer = torch.optim.AdamW(policy.parameters())
    for step in steps:
        plumbing.save_checkpoint(str(out), step, policy, optimizer, tokenizer, trainer_state(step, run_id), 0, keep,
                                 {})
    return policy, optimizer, tokenizer


def fake_run(out: Path, steps: list[int], run_id: str = "run-a") -> None:
    """What rloo.py leaves in output_dir, in outline: checkpoints, metrics, a final policy and its run record, and
    files of the user's (a plot, notes, a git checkout)."""
    for step in steps:
        (out / "checkpoints" / f"step_{step}").mkdir(parents=True)
        (out / "checkpoints" / f"step_{step}" / "manifest.json").write_text(json.dumps({"files": {}, "run_id": run_id}))
    lines = [json.dumps({"update": step, "run_id": run_id}) + "\n" for step in range(1, max(steps) + 1)]
    (out / "metrics.jsonl").write_text("".join(lines) + '{"update": 4, "objective/sc')  # the last one cut short
    policy_files = ["model.safetensors", "config.json", "tokenizer.json"]
    (out / "args.json").write_text(json.dumps({"run_id": run_id, "files": policy_files}))
    for name in policy_files + ["my_plot.png", "notes.txt"]:
        (out / name).write_text("{}")
    (out / ".git").mkdir()
    (out / ".git" / "HEAD").write_text("ref: refs/heads/main\n")


def tree(root: Path) -> dict[str, bytes]:
    """Every file under root (but the lock) with its bytes: what a run may not have changed."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and not p.is_symlink() and p.name != plumbing.LOCK}


# ---------------------------------------------------------------- the Makefile
def planned_commands(target: str, env_dir, **variables) -> list[str]:
    """The commands `make TARGET` would run (make -n), with the environment at env_dir and no active one."""
    environment = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "CONDA_PREFIX", "MAKEFLAGS")}
    overrides = [f"{k}={v}" for k, v in {"ENV": env_dir, **variables}.items()]
    result = subprocess.run(["make", "-n", "-C", str(REPO), target, *overrides], capture_output=True, text=True,
                            env=environment)
    assert result.returncode == 0, result.stderr
    return [line for line in result.stdout.splitlines() if not line.startswith("make")]


def position(commands: list[str], pattern: str) -> int:
    matches = [i for i, c in enumerate(commands) if re.search(pattern, c)]
    assert matches, (pattern, commands)
    return matches[0]
