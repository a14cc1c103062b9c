"""A TRL 1.16 recipe's run length and settings through rloo.py, with --trl_defaults 1.16 and without, against TRL
1.16's own arithmetic: its RLOOConfig (its defaults, its __post_init__'s steps_per_generation and
generation_batch_size) and RLOOTrainer._prepare_inputs' own line that says how often a generation batch is made
(one per `generate_every` micro-steps, reused num_iterations times). With --trl_defaults 1.16 rloo.py must run TRL's
run: the same updates, episodes and settings; without it, the run TRL makes when given the TRL <= 0.21 defaults that
rloo.py keeps (the values its start-up line names). And the arithmetic tests/test_trl116_run.py computes of TRL 1.16
from the committed table (helpers.trl116_run: the generation batch, RepeatSampler's length, the generations) against
TRL 1.16's own RLOOConfig, RepeatSampler and that line, for its eight recipes. Run with TRL 1.16 first on PYTHONPATH
(tests/test_trl_commands.py does); prints one line per case, exits 1 on a difference.
"""

import inspect
import re
import sys
import tempfile
from types import SimpleNamespace

from pathlib import Path

from trl import RLOOConfig
from trl.trainer.rloo_trainer import RLOOTrainer
from trl.trainer.utils import RepeatSampler

import plumbing
import rloo
from helpers import TRL116_RECIPES, trl116_run

SOURCE = inspect.getsource(RLOOTrainer._prepare_inputs)
GENERATE_EVERY = re.search(r"generate_every = (.+)", SOURCE).group(1)  # TRL's own expression
assert "self._step % generate_every == 0" in SOURCE  # a generation at every generate_every-th micro-step

RECIPES = [  # TRL 1.16 flags, as a `trl rloo` command or recipe gives them
    {"num_generations": 4, "beta": 0.1, "max_steps": 40, "per_device_train_batch_size": 8},
    {"num_generations": 2, "max_steps": 24, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2,
     "steps_per_generation": 4},
    {"num_generations": 8, "max_steps": 64, "per_device_train_batch_size": 4, "generation_batch_size": 32,
     "learning_rate": 2e-6},
    {"num_generations": 4, "max_steps": 12, "per_device_train_batch_size": 8, "num_iterations": 2, "temperature": 0.9,
     "max_completion_length": 64},
]

SETTINGS = {"num_generations": "rloo_k", "beta": "kl_coef", "num_iterations": "num_ppo_epochs", "temperature":
            "temperature", "learning_rate": "learning_rate", "max_completion_length": "response_length",
            "epsilon": "cliprange", "num_train_epochs": "num_train_epochs"}  # TRL 1.16's name: rloo.py's


def trl_run(recipe: dict, output_dir: str) -> dict:
    """Optimizer-step count, generations (rloo.py's updates), completions generated and settings of TRL 1.16's run."""
    config = RLOOConfig(output_dir=output_dir, use_cpu=True, bf16=False, report_to="none", **recipe)
    generate_every = eval(GENERATE_EVERY, {"self": SimpleNamespace(args=config, num_iterations=config.num_iterations)})
    micro_steps = config.max_steps * config.gradient_accumulation_steps  # TRL's _step counts micro-steps
    generations = sum(step % generate_every == 0 for step in range(micro_steps))
    return {"updates": generations, "episodes": generations * config.generation_batch_size,
            **{trl: getattr(config, trl) for trl in SETTINGS}}


def rloo_run(recipe: dict, trl116: bool) -> tuple[dict, dict]:
    """rloo.py's run of the recipe's command line: its updates, completions and settings, and the TRL <= 0.21
    defaults in force (TRL's names: values) that TRL must be given to make the same run."""
    words = [w for name, value in recipe.items() for w in (f"--{name}", str(value))]
    args = plumbing.parse_args(rloo.Args, argv=words + (["--trl_defaults", "1.16"] if trl116 else []), prog="rloo.py")
    sizes = rloo.compute_batch_sizes(args, 1)
    updates = args.max_steps // (args.num_ppo_epochs * sizes.minibatches)  # as rloo.main counts them
    kept = {} if trl116 else {trl: getattr(args, own) for trl, own in SETTINGS.items()
                              if own in plumbing.algorithm_defaults(rloo.Args) and trl not in recipe}
    return {"updates": updates, "episodes": updates * sizes.all_ranks,
            **{trl: getattr(args, own) for trl, own in SETTINGS.items()}}, kept


def arithmetic_of_the_tests(recipe: dict, num_prompts: int, output_dir: str) -> tuple[dict, dict]:
    """What tests/test_trl116_run.py computes of TRL 1.16 from the committed table (helpers.trl116_run), and what TRL
    1.16 itself makes of the recipe: its RLOOConfig's generation batch, its RepeatSampler's length (the prompts of
    whole generation batches), and the generations of _prepare_inputs' own line."""
    ours = trl116_run(recipe, num_prompts, Path(output_dir))
    config = RLOOConfig(output_dir=output_dir, use_cpu=True, bf16=False, report_to="none", **recipe)
    sampler = RepeatSampler(range(num_prompts), mini_repeat_count=config.num_generations,
                            batch_size=config.generation_batch_size // config.num_generations,
                            repeat_count=config.num_iterations * config.steps_per_generation, seed=config.seed)
    generate_every = eval(GENERATE_EVERY, {"self": SimpleNamespace(args=config, num_iterations=config.num_iterations)})
    theirs = {"steps_per_generation": config.steps_per_generation, "generation_batch_size": config.generation_batch_size,
              "samples": len(list(sampler)), "updates": sum(step % generate_every == 0 for step in range(
                  ours["steps"] * config.gradient_accumulation_steps))}
    return {key: ours[key] for key in theirs}, theirs


def main() -> int:
    failed = 0
    with tempfile.TemporaryDirectory() as output_dir:
        for i, (recipe, num_prompts) in enumerate(TRL116_RECIPES, 1):
            ours, theirs = arithmetic_of_the_tests(recipe, num_prompts, output_dir)
            failed += ours != theirs
            print(f"tests' recipe {i} ({num_prompts} prompts, {ours['samples']} sampled): "
                  + ("same" if ours == theirs else f"the tests' {ours} != TRL's {theirs}"))
        for i, recipe in enumerate(RECIPES):
            for trl116 in (True, False):
                ours, kept = rloo_run(recipe, trl116)
                theirs = trl_run(recipe | kept, output_dir)
                same = ours == theirs
                failed += not same
                print(f"recipe {i} {'with' if trl116 else 'without'} --trl_defaults 1.16 ({ours['updates']} updates, "
                      f"{ours['episodes']} episodes): " + ("same" if same else f"rloo.py {ours} != TRL {theirs}"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
