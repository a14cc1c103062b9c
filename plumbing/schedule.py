"""The run's clock: its length in updates and optimizer steps, the unit of --logging_steps, --save_steps and
--eval_steps, and the learning rate of every optimizer step. Two arithmetics, as the two TRL generations count: TRL
<= 0.21's (the default: a run of episodes, the schedule stepped once per update) and, with --trl_defaults 1.16, TRL
1.16's Trainer's (a run of optimizer steps, transformers' schedule stepped once per optimizer step).
"""

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .errors import ConfigError

__all__ = [  # what this module gives as plumbing.NAME (rloo.py, rloo_multinode.py, the tools, the tests)
    "trl116_arithmetic", "RunLength", "MAX_UPDATES", "run_length", "in_updates", "firing_updates", "update_intervals",
    "evaluation_updates", "warmup_length", "learning_rates",
]


def trl116_arithmetic(args) -> bool:
    """Whether the run counts as TRL 1.16's Trainer does (--trl_defaults 1.16): its length and the interval flags in
    optimizer steps, the learning rate set before every optimizer step."""
    return args.trl_defaults == "1.16"


@dataclass(frozen=True)
class RunLength:
    """`updates` updates (each draws its prompts and samples their k completions: one of TRL's generation batches) of
    `steps_per_update` optimizer steps (num_ppo_epochs x num_mini_batches), `steps` in all: every update's (None), or
    with TRL 1.16's arithmetic fewer, where the run ends inside its last update (TRL's Trainer stops at max_steps,
    whatever step of a generation batch it is at)."""

    updates: int
    steps_per_update: int
    steps: Optional[int] = None

    def __post_init__(self) -> None:
        if self.steps is None:
            object.__setattr__(self, "steps", self.updates * self.steps_per_update)

    def steps_in(self, update: int) -> int:
        """The optimizer steps of update `update` (1 .. updates): all of them but, maybe, in the last."""
        return min(self.steps_per_update, self.steps - (update - 1) * self.steps_per_update)


def round_down(x: float, digits: int = 3) -> float:
    """x > 0 rounded down to `digits` significant digits: a limit shown as a number that stays within it."""
    unit = 10.0 ** (math.floor(math.log10(x)) - digits + 1)
    return math.floor(x / unit) * unit


MAX_UPDATES = 1_000_000  # a run's updates: a million at 0.1 s each is 28 hours of the fastest tiny run


def run_length(args, epoch: int, per_update: int, steps_per_update: int) -> RunLength:
    """The run's updates and optimizer steps. `epoch`: the completions of a pass over the prompts (each sampled k
    times: TRL 1.16's epoch), `per_update`: an update's, all ranks; `steps_per_update`: its optimizer steps.
    TRL <= 0.21's arithmetic: --max_steps optimizer steps (a multiple of an update's), else --total_episodes or
    --num_train_epochs x `epoch` completions, rounded up to whole updates. TRL 1.16's (trl116_arithmetic), as its
    Trainer counts: --max_steps, else ceil(--num_train_epochs x an epoch's optimizer steps), an epoch being the
    generation batches its prompts fill (TRL's RepeatSampler leaves the rest of them out, as the prompt sampler does
    each epoch) x steps_per_update; the run's last update stops at its last step (--total_episodes: whole updates).
    None is refused: saving the input weights as a finished run would hide a tiny epoch."""
    if trl116_arithmetic(args):
        steps = args.max_steps or (math.ceil(args.total_episodes / per_update) * steps_per_update if args.total_episodes
                                   else math.ceil(args.num_train_epochs * (epoch // per_update * steps_per_update)))
        return RunLength(-(-steps // steps_per_update), steps_per_update, steps)
    if args.max_steps is not None and args.max_steps % steps_per_update:
        minibatches = steps_per_update // args.num_ppo_epochs
        raise ConfigError(f"--max_steps {args.max_steps} is not a multiple of an update's optimizer steps "
                          f"(num_ppo_epochs {args.num_ppo_epochs} x num_mini_batches {minibatches}): pass a multiple, "
                          "or --num_iterations 1 (TRL 1.16's default), or --trl_defaults 1.16, whose last update stops "
                          "at the step, as TRL's Trainer")
    episodes = args.total_episodes or int(args.num_train_epochs * epoch)
    num_updates = args.max_steps // steps_per_update if args.max_steps else math.ceil(episodes / per_update)
    if num_updates < 1:
        raise ConfigError(f"--num_train_epochs {args.num_train_epochs:g} of {epoch // args.rloo_k} prompts x "
                          f"k={args.rloo_k} is {episodes} episodes: no update (one takes {per_update}); pass "
                          f"--num_train_epochs {per_update / epoch:.3g} or more, or --total_episodes {per_update}")
    return RunLength(num_updates, steps_per_update)


def in_updates(steps, args, run: RunLength) -> int:
    """An interval flag (--save_steps, --logging_steps, --eval_steps) in updates. Below 1, that share of the run,
    rounded up (TRL's fractions); else updates, as in TRL <= 0.21, whose names the flags keep, but with --max_steps
    or TRL 1.16's arithmetic optimizer steps, as TRL >= 0.22's Trainer counts them (an update is num_ppo_epochs x
    num_mini_batches of them): the first update that reaches the step (a share: of the run's optimizer steps)."""
    in_steps = args.max_steps is not None or trl116_arithmetic(args)
    if 0 < steps < 1:
        return -(-math.ceil(steps * run.steps) // run.steps_per_update) if in_steps else math.ceil(steps * run.updates)
    return math.ceil(steps / run.steps_per_update) if in_steps else int(steps)


def firing_updates(steps, args, run: RunLength) -> int | set[int]:
    """The updates after which an interval flag (--logging_steps, --eval_steps) acts: every this many, or these. In
    updates: every in_updates-th. In optimizer steps (--max_steps, TRL 1.16's arithmetic): each update in which the
    run's step count passes a multiple of the interval, as TRL's Trainer acts at every step where global_step % steps
    == 0 (a share below 1: of the run's steps, rounded up); every this many where that is regular."""
    if not (args.max_steps is not None or trl116_arithmetic(args)):
        return in_updates(steps, args, run)
    every, per = math.ceil(steps * run.steps) if 0 < steps < 1 else int(steps), run.steps_per_update
    if every % per == 0 or every < per:  # shorter than an update: every update holds a multiple
        return max(every // per, 1)
    return {u for u in range(1, run.updates + 1) if min(u * per, run.steps) // every > (u - 1) * per // every}


def update_intervals(args, run: RunLength) -> tuple[int, int | set[int]]:
    """--save_steps in updates (in_updates; in optimizer steps a checkpoint needs a whole update: --save_steps a
    multiple of its optimizer steps), and the updates of --logging_steps' console lines (firing_updates). A run of
    more than MAX_UPDATES updates is refused, naming the most the flag that set its length can take: what start-up
    counts over updates (the evaluation updates, the learning rates' sum) stays bounded."""
    if run.updates > MAX_UPDATES:
        scale = MAX_UPDATES / run.updates
        flag, most = ("max_steps", f"{MAX_UPDATES * run.steps_per_update}") if args.max_steps is not None else (
            "total_episodes", f"{int(args.total_episodes * scale)}") if args.total_episodes is not None else (
            "num_train_epochs", f"{round_down(args.num_train_epochs * scale):g}")
        value = getattr(args, flag)
        raise ConfigError(f"--{flag} {f'{value:g}' if isinstance(value, float) else value} is {run.updates:,} "
                          f"updates, more than the {MAX_UPDATES:,} a run takes: pass --{flag} {most} or less")
    if (args.max_steps is not None or trl116_arithmetic(args)) and args.save_steps >= 1 \
            and args.save_steps % run.steps_per_update:
        why = "with --max_steps" if args.max_steps is not None else "with --trl_defaults 1.16"
        raise ConfigError(f"--save_steps {args.save_steps} counts optimizer steps {why} (TRL >= 0.22's unit), and "
                          f"a checkpoint comes after a whole update of {run.steps_per_update} steps (num_ppo_epochs x "
                          f"num_mini_batches): pass a multiple of {run.steps_per_update}")
    return in_updates(args.save_steps, args, run), firing_updates(args.logging_steps, args, run)


def evaluation_updates(args, run: RunLength, updates_per_epoch: int) -> set[int]:
    """The updates after which the policy is evaluated (the initial policy's evaluation, update 0, comes on top).
    --eval_strategy steps: every --eval_steps (else --logging_steps; firing_updates), and with TRL 1.16's arithmetic
    at the end of the run too (transformers 5's Trainer evaluates its last step); epoch: at the end of each pass over
    the prompts (updates_per_epoch) and at the end of the run, the end of its last pass, whole or not (TRL's
    Trainer's: a run shorter than an epoch evaluates at its end); no: none. By default --num_evals of them spread
    evenly over the run, the last at its end (--num_evals 0: only the end)."""
    num_updates = run.updates
    if args.eval_strategy == "steps":
        at = firing_updates(args.logging_steps if args.eval_steps is None else args.eval_steps, args, run)
        at = set(range(at, num_updates + 1, at)) if isinstance(at, int) else at
        return at | ({num_updates} if trl116_arithmetic(args) else set())
    if args.eval_strategy == "epoch":
        every = max(1, updates_per_epoch)
        return set(range(every, num_updates + 1, every)) | {num_updates}
    if args.eval_strategy == "no":
        return set()
    return {math.ceil(i * num_updates / args.num_evals) for i in range(1, args.num_evals + 1)} if args.num_evals \
        else {num_updates}


def warmup_length(args, num_steps: int) -> int:
    """The schedule's steps of linear warmup out of `num_steps`: --warmup_ratio's share, rounded up (TRL <= 0.21's
    transformers), or --warmup_steps as transformers 5's TrainingArguments.get_warmup_steps takes it (TRL 1.16's):
    >= 1, that many steps; below 1, that share, rounded up."""
    if args.warmup_ratio:
        return math.ceil(args.warmup_ratio * num_steps)
    return int(args.warmup_steps) if args.warmup_steps >= 1 else math.ceil(num_steps * args.warmup_steps)


def update_learning_rate(update: int, num_updates: int, args, warmup: int) -> float:
    """TRL <= 0.21's arithmetic, one rate per update: a linear rise over the first `warmup` updates (update u of w:
    learning_rate x u / w), then linear or cosine decay from learning_rate towards 0 over the other updates, or
    constant."""
    if update <= warmup:
        return args.learning_rate * update / warmup
    if args.lr_scheduler_type in ("constant", "constant_with_warmup"):
        return args.learning_rate
    progress = (update - 1 - warmup) / (num_updates - warmup)  # 0 at the first update after the warmup
    if args.lr_scheduler_type == "cosine":
        return args.learning_rate * 0.5 * (1.0 + math.cos(math.pi * progress))
    return args.learning_rate * (1.0 - progress)


def learning_rates(args, run: RunLength) -> Callable[[int], float]:
    """The learning rate of each optimizer step of the run, step -> rate (steps 1 .. run.steps), set before the step.
    TRL 1.16's arithmetic (trl116_arithmetic): transformers' own schedule (get_scheduler's factor for
    --lr_scheduler_type, the --warmup_steps or --warmup_ratio warmup, over run.steps), stepped after every optimizer
    step as TRL's Trainer steps it: step s takes the factor at s - 1 (without warmup the first step has the full rate;
    `constant` takes no warmup, as transformers'). TRL <= 0.21's: every step of update u at update_learning_rate(u)."""
    if not trl116_arithmetic(args):
        warmup = warmup_length(args, run.updates)
        return lambda step: update_learning_rate(-(-step // run.steps_per_update), run.updates, args, warmup)
    from transformers import get_scheduler

    probe = torch.optim.SGD([torch.zeros(1)], lr=1.0)  # the schedule's factor is a function of the step alone
    factor = get_scheduler(args.lr_scheduler_type, probe, num_warmup_steps=warmup_length(args, run.steps),
                           num_training_steps=run.steps).lr_lambdas[0]
    return lambda step: args.learning_rate * factor(step - 1)
