"""The fixtures: tiny models and datasets built in code (no network), once per session. The helpers are in
helpers.py (their names stay importable from here)."""

import atexit
import os
import shutil
import signal
import tempfile
from pathlib import Path

# One OpenMP thread per process, this one and every run it starts (inherited), unless the caller set its own: the
# models are tiny, the pytest workers are one per core, and each run's threads would contend for cores the other
# worker's run is using. Set before torch loads (helpers imports it): OpenMP reads it then.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Offline, and the tests' own Hugging Face home, one per pytest process, empty at the start, never the user's (their
# token, their accelerate config): a test that needs a model "from the Hub" puts its snapshots in its cache under a
# name of its own (helpers.hub_cache_repo). This process and every run it starts read the same one, forks of the
# server included (huggingface_hub reads them as it imports).
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_HOME"] = tempfile.mkdtemp(prefix="rloo-tests-hf-home-")
os.environ["HF_HUB_CACHE"] = os.path.join(os.environ["HF_HOME"], "hub")
atexit.register(shutil.rmtree, os.environ["HF_HOME"], True)

import pytest  # noqa: E402

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
    config.addinivalue_line("markers", "engines: rloo_multinode.py with engines in processes of their own (every "
                            "test of test_multinode.py too): make test-engines, kept out of make test's 4 minutes")


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


@pytest.fixture(autouse=True)
def signal_dispositions_kept():
    """Every signal's disposition as it was before the test: what rloo.main or run_script install or ignore in the
    test's process (a run ending ignores SIGTERM) would otherwise reach the later tests and every process they start
    (an ignored signal is inherited)."""
    saved = {sig: signal.getsignal(sig) for sig in signal.Signals if sig not in (signal.SIGKILL, signal.SIGSTOP)}
    yield
    for sig, handler in saved.items():
        if handler is not None and signal.getsignal(sig) is not handler:
            signal.signal(sig, handler)
