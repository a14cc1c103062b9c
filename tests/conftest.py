"""The fixtures: tiny models and datasets built in code (no network), once per session. The helpers are in
helpers.py (their names stay importable from here)."""

import signal
from pathlib import Path

import pytest

from helpers import (LETTERS, ON_CPU, REPO, cpu_env, forked_interpreter, neox_config,  # noqa: F401
                     policy_loss_of, policy_tokenizer, prompt_rows, read_metrics, run_rloo, script_command, script_env,
                     tiny_policy, tiny_reward_model, word_tokenizer, write_jsonl)


def pytest_sessionstart(session):
    """The server of forked interpreters (helpers.python) imports its libraries while this worker collects tests;
    xdist's controller runs none."""
    if hasattr(session.config, "workerinput") or not getattr(session.config.option, "numprocesses", None):
        forked_interpreter()


def pytest_configure(config):
    config.addinivalue_line("markers", "bench: a benchmark script run end to end (its trainers, TRL's too): make "
                            "test-bench, kept out of make test's 4 minutes")


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
