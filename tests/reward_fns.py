"""Reward functions the tests pass to rloo.py as `--reward_fn reward_fns:NAME`."""

import os
import sys
import threading
from pathlib import Path


def count_a(completions, **kwargs):
    """Number of times the letter `a` appears: a reward a random tiny policy can learn in seconds."""
    return [float(c.split().count("a")) for c in completions]


def matches_target(completions, target, **kwargs):
    """Reads the dataset's extra `target` column: 1.0 when the completion starts with it."""
    return [float(c.split()[:1] == [t]) for c, t in zip(completions, target)]


def only_even_lengths(completions, **kwargs):
    """Applies to some completions only (None elsewhere)."""
    return [1.0 if len(c.split()) % 2 == 0 else None for c in completions]


def scores_nothing(completions, **kwargs):
    """Applies to no completion: only None (TRL warns; nothing to train on)."""
    return [None] * len(completions)


def not_a_list(**kwargs):
    return 3.0


_calls = 0


def huge_at_second_call(completions, **kwargs):
    """A reward that breaks the update at the second call: 3e38 is a float32, but the baseline's sum of k of them is
    inf, and so is the loss."""
    global _calls
    _calls += 1
    return [3e38 if _calls == 2 else 1.0 for _ in completions]


def huge_on_rank_one(completions, **kwargs):
    """Breaks the loss on torchrun's rank 1 only, at its first call: the other rank must not wait forever."""
    return [3e38 if os.environ.get("RANK") == "1" else float(c.split().count("a")) for c in completions]


def nan_at_second_call(completions, **kwargs):
    """A reward function's bug at the second call: one NaN among finite scores."""
    global _calls
    _calls += 1
    return [float("nan") if _calls == 2 and i == 0 else 1.0 for i in range(len(completions))]


_count_a_calls = 0


def count_a_failing(completions, **kwargs):
    """count_a, but it raises at the call numbered REWARD_FAILS_AT_CALL: a reward service that goes down."""
    global _count_a_calls
    _count_a_calls += 1
    if str(_count_a_calls) == os.environ.get("REWARD_FAILS_AT_CALL"):
        raise ConnectionError("the judge at http://judge:8000 does not answer")
    return count_a(completions)


def without_kwargs(completions):
    return [0.0 for _ in completions]


def needs_answer(completions, answer, **kwargs):
    return [float(c == a) for c, a in zip(completions, answer)]


_misbehaving_calls = 0


def misbehaving(completions, **kwargs):
    """count_a, until the call numbered REWARD_MISBEHAVES_AT_CALL does REWARD_MISBEHAVIOUR: exit (sys.exit(0)), nan,
    huge (1e39: inf in float32), or hang (for certain: waiting for an event that never comes, after writing the file
    REWARD_HANGING)."""
    global _misbehaving_calls
    _misbehaving_calls += 1
    if str(_misbehaving_calls) == os.environ.get("REWARD_MISBEHAVES_AT_CALL"):
        behaviour = os.environ["REWARD_MISBEHAVIOUR"]
        if behaviour == "exit":
            sys.exit(0)
        if behaviour in ("nan", "huge"):
            return [float("nan") if behaviour == "nan" else 1e39] + [1.0] * (len(completions) - 1)
        Path(os.environ["REWARD_HANGING"]).write_text("hanging\n")
        threading.Event().wait()
    return count_a(completions)


def huge_int(completions, **kwargs):
    """An int beyond any float (float() of it raises OverflowError): a value no reward can be."""
    return [10**400] * len(completions)


def count_a_leaving_a_thread(completions, **kwargs):
    """count_a, having started at its first call a thread that never ends and is not a daemon (Python's exit would
    wait for it forever)."""
    if not any(t.name == "left running" for t in threading.enumerate()):
        threading.Thread(target=threading.Event().wait, name="left running", daemon=False).start()
    return count_a(completions)


def count_a_python_noise(completions, **kwargs):
    """count_a plus noise from Python's global generator (random): a resume is exact only if it continues it."""
    import random

    return [count_a([c])[0] + random.random() for c in completions]


def count_a_numpy_noise(completions, **kwargs):
    """count_a plus noise from numpy's global generator."""
    import numpy as np

    return [count_a([c])[0] + float(np.random.rand()) for c in completions]


def count_a_torch_noise(completions, **kwargs):
    """count_a plus noise from torch's global generator."""
    import torch

    return [count_a([c])[0] + torch.rand(()).item() for c in completions]


_moving_calls = 0


def count_a_moving_the_run(completions, **kwargs):
    """count_a, but the call numbered REWARD_MOVES_AT_CALL renames the folder REWARD_MOVES (the run's output_dir) to
    <it>.moved: a user tidying up while the run writes."""
    global _moving_calls
    _moving_calls += 1
    if str(_moving_calls) == os.environ.get("REWARD_MOVES_AT_CALL"):
        os.rename(os.environ["REWARD_MOVES"], os.environ["REWARD_MOVES"] + ".moved")
    return count_a(completions)
