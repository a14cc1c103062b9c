"""Reward functions the tests pass to rloo.py as `--reward_fn reward_fns:NAME`."""

import os
import time


def count_a(completions, **kwargs):
    """Number of times the letter `a` appears: a reward a random tiny policy can learn in seconds."""
    return [float(c.split().count("a")) for c in completions]


def matches_target(completions, target, **kwargs):
    """Reads the dataset's extra `target` column: 1.0 when the completion starts with it."""
    return [float(c.split()[:1] == [t]) for c, t in zip(completions, target)]


def only_even_lengths(completions, **kwargs):
    """Applies to some completions only (None elsewhere)."""
    return [1.0 if len(c.split()) % 2 == 0 else None for c in completions]


def not_a_list(**kwargs):
    return 3.0


_calls = 0


def nan_at_second_call(completions, **kwargs):
    """A reward that breaks at the second update: one NaN among finite scores."""
    global _calls
    _calls += 1
    return [float("nan") if _calls == 2 and i == 0 else 1.0 for i in range(len(completions))]


def nan_on_rank_one(completions, **kwargs):
    """Breaks on torchrun's rank 1 only, at its first call: the other rank must not wait forever."""
    bad = os.environ.get("RANK") == "1"
    return [float("nan") if bad and i == 0 else float(c.split().count("a")) for i, c in enumerate(completions)]


_count_a_calls = 0


def count_a_failing(completions, **kwargs):
    """count_a, but it raises at the call numbered REWARD_FAILS_AT_CALL: a reward service that goes down."""
    global _count_a_calls
    _count_a_calls += 1
    if str(_count_a_calls) == os.environ.get("REWARD_FAILS_AT_CALL"):
        raise ConnectionError("the judge at http://judge:8000 does not answer")
    return count_a(completions)


def count_a_slowly(completions, **kwargs):
    """count_a, taking a second per call: a signal then arrives in the middle of an update."""
    time.sleep(1.0)
    return count_a(completions)


def without_kwargs(completions):
    return [0.0 for _ in completions]


def needs_answer(completions, answer, **kwargs):
    return [float(c == a) for c, a in zip(completions, answer)]
