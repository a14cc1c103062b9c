"""Reward functions the tests pass to rloo.py as `--reward_fn reward_fns:NAME`."""


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
