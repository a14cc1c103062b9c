"""Tiny models and datasets built in code (no network), and a helper to run rloo.py as a user would."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (GPTNeoXConfig, GPTNeoXForCausalLM, GPTNeoXForSequenceClassification,
                          PreTrainedTokenizerFast)

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # rloo.py is a script at the top level, not a package
LETTERS = "abcdefghijkl"


def pytest_configure(config):
    config.addinivalue_line("markers", "bench: a benchmark script run end to end (its trainers, TRL's too): make "
                            "test-bench, kept out of make test's 15 minutes")


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


@pytest.fixture(scope="session")
def assets(tmp_path_factory) -> dict[str, Path]:
    """Saved policy, reward model, a reward model with another tokenizer, train and test prompt files."""
    root = tmp_path_factory.mktemp("assets")
    tokenizer = policy_tokenizer()
    paths = {"policy": root / "policy", "reward_model": root / "reward_model", "other_rm": root / "other_rm"}
    tiny_policy(len(tokenizer)).save_pretrained(paths["policy"])
    tokenizer.save_pretrained(paths["policy"])
    tiny_reward_model(len(tokenizer)).save_pretrained(paths["reward_model"])
    tokenizer.save_pretrained(paths["reward_model"])
    # the same words in another order: ids differ, so rloo.py must decode and re-tokenize for this model
    other = word_tokenizer(["<eos>", ":", *reversed(LETTERS), "<pad>"], pad="<pad>")
    tiny_reward_model(len(other), seed=1, pad_token_id=other.pad_token_id).save_pretrained(paths["other_rm"])
    other.save_pretrained(paths["other_rm"])
    paths["train"] = write_jsonl(root / "train.jsonl", prompt_rows(256, seed=0))
    paths["test"] = write_jsonl(root / "test.jsonl", prompt_rows(16, seed=1))
    return paths


def script_command(script: str, *args, nproc: int = 0) -> list[str]:
    """`python SCRIPT ARGS`, or `torchrun --nproc_per_node NPROC SCRIPT ARGS`."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)
                ] if nproc else [sys.executable]
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


@pytest.fixture(scope="session")
def synthetic_sft(tmp_path_factory) -> dict:
    """The demo's synthetic task: its tokenizer and an SFT policy of 150 steps (weak, improvable), built once."""
    from benchmark import synthetic_task

    tokenizer = synthetic_task.build_tokenizer()
    path = tmp_path_factory.mktemp("synthetic_sft") / "policy"
    return {"tokenizer": tokenizer, "policy": synthetic_task.build_policy(tokenizer, path, steps=150), "path": path}


@pytest.fixture
def signal_handlers_kept():
    """rloo.main installs its signal handlers in this process: put pytest's back."""
    import plumbing

    saved = {sig: signal.getsignal(sig) for sig in plumbing.StopSignal.SIGNALS}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)
