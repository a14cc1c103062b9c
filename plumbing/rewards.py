"""The reward sources: the reward model and reward functions loaded and checked against the data, a function called in
a thread of its own with a timeout and its values read, and a failure on one rank raised on every rank together.
"""

import contextlib
import copy
import importlib.util
import inspect
import numbers
import os
import sys
import threading
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .data import PROMPT_IDS
from .distributed import all_reduce, seed_everything, wait_for_peers
from .errors import FLOAT32_MAX, ConfigError, RewardFunctionError, describe, first_line
from .faults import stop_signals_at_once
from .models import disable_dropout, has_tokenizer, load_reward_model, load_tokenizer, same_vocabulary


@dataclass
class RewardSources:
    """Everything that scores completions: a reward model (with its tokenizer) and reward functions."""

    model: Optional[torch.nn.Module]
    model_tokenizer: Optional[object]  # None when the policy's token ids can be fed as they are
    functions: list[tuple[str, Callable]]
    weights: torch.Tensor  # (S,)
    share_prompt: bool = False  # the reward model reads a prompt group as one row (grouped_rows)
    timeout: Optional[float] = None  # seconds a reward function's call may take (--reward_fn_timeout)

    @property
    def names(self) -> list[str]:
        return (["reward_model"] if self.model is not None else []) + [name for name, _ in self.functions]


def load_reward_sources(args, tokenizer, functions: list[tuple[str, Callable]], device: torch.device):
    """The reward model (frozen, with its own tokenizer when the vocabularies differ) and the reward functions."""
    model, model_tokenizer = None, None
    if args.reward_model_path is not None:
        seed_everything(args.seed)  # a head missing from the checkpoint starts alike on every rank and resume
        model = load_reward_model(args.reward_model_path, torch.bfloat16 if args.bf16 else torch.float32,
                                  args.trust_remote_code, args.attn_implementation)
        disable_dropout(model)
        model = model.to("cpu" if args.offload else device).eval().requires_grad_(False)
        # no tokenizer saved with the reward model: it reads the policy's ids (of a vocabulary of the same size:
        # check_reward_model_config)
        own_tokenizer = load_tokenizer(args.reward_model_path, args.trust_remote_code) \
            if has_tokenizer(args.reward_model_path) else tokenizer
        model_tokenizer = None if same_vocabulary(own_tokenizer, tokenizer) else own_tokenizer
    num_sources = int(model is not None) + len(functions)
    return RewardSources(model, model_tokenizer, functions, torch.tensor(args.reward_weights or [1.0] * num_sources),
                         timeout=args.reward_fn_timeout or args.ddp_timeout / 2)


REWARD_FUNCTION_ARGUMENTS = ("prompts", "completions", "completion_ids")  # and every other dataset column


def load_reward_functions(specs: tuple[str, ...]) -> list[tuple[str, Callable]]:
    """Import each `package.module:function` spec; each must take **kwargs (it is called with every column)."""
    functions = []
    # the directory the command runs in, as `python -m` has it: `python path/to/rloo.py` puts only the script's own
    # directory first on sys.path. Last, so that a file there never shadows an installed package
    if specs and os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    for spec in specs:
        module_name, _, attr = spec.partition(":")
        if not module_name or not attr:
            raise ConfigError(f"--reward_fn {spec!r} is not of the form package.module:function")
        cwd = os.getcwd()
        try:
            module = importlib.import_module(module_name)
            if os.getcwd() != cwd:  # relative paths (output_dir, data files) would now point elsewhere
                os.chdir(cwd)
                raise ConfigError(f"reward function {spec!r}: importing {module_name!r} changed the working "
                                  "directory: give it absolute paths instead of os.chdir")
        except ConfigError:
            raise
        except ImportError as e:
            top = module_name.split(".")[0]
            if e.name is not None and e.name != module_name and not module_name.startswith(e.name + "."):
                raise ConfigError(f"reward function {spec!r}: importing {module_name!r} failed: it imports "
                                  f"{e.name!r}, which is not installed ({first_line(e)})") from None
            where = os.pathsep.join(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)
            raise ConfigError(f"unknown reward function {spec!r}: cannot import {module_name!r} ({first_line(e)}); "
                              f"looked in the working directory {os.getcwd()}, PYTHONPATH ({where or 'unset'}) and "
                              f"the installed packages: run from the folder that holds {top}.py (or the package "
                              f"{top}/), or add that folder to PYTHONPATH") from None
        except (Exception, SystemExit) as e:  # a SyntaxError, anything the module's own code raises
            raise ConfigError(f"reward function {spec!r}: importing {module_name!r} failed with {type(e).__name__}: "
                              f"{first_line(e)}") from None
        fn = getattr(module, attr, None)
        if not callable(fn):
            raise ConfigError(f"unknown reward function {spec!r}: module {module_name!r} has no function {attr!r}")
        kinds = {p.kind for p in inspect.signature(fn).parameters.values()}
        if inspect.Parameter.VAR_KEYWORD not in kinds:
            raise ConfigError(f"reward function {spec!r} takes no **kwargs: it is called with prompts, completions, "
                              "completion_ids and every other dataset column as keywords; add **kwargs")
        functions.append((attr, fn))
    return functions


def check_reward_function_arguments(functions: list[tuple[str, Callable]], splits: list[tuple[str, object]],
                                    prompt_column: str) -> None:
    """Each parameter a reward function requires must be one it is given, for each (name, dataset) of `splits`
    (None: absent): a fixed argument, or a column other than the prompt's (given as `prompts`)."""
    for dataset_name, dataset in splits:
        columns = [] if dataset is None else [c for c in dataset.column_names if c not in (PROMPT_IDS, prompt_column)]
        for name, fn in functions if dataset is not None else ():
            for parameter in inspect.signature(fn).parameters.values():
                required = parameter.default is inspect.Parameter.empty and parameter.kind in (
                    inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
                if required and parameter.name not in (*REWARD_FUNCTION_ARGUMENTS, *columns):
                    raise ConfigError(f"reward function {name!r} needs {parameter.name!r}, which is neither one of "
                                      f"{list(REWARD_FUNCTION_ARGUMENTS)} nor a column of dataset {dataset_name} (its "
                                      f"columns: {columns})")


def is_number(value) -> bool:
    """A Python, numpy or 0-d tensor/array number."""
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        value = value.item()
    return isinstance(value, numbers.Real)


def call_reward_function(name: str, fn: Callable, n: int, timeout: Optional[float] = None, /,
                         **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """Values (n,) and an applies-mask (n,) from a reward function returning a number or None per completion.
    Whatever it raises (SystemExit included), anything else it returns, a value outside float32's range, and not
    returning within `timeout` seconds become a RewardFunctionError naming it. It runs in a thread of its own while
    this one waits, so that neither a function stuck in C code or a sleep nor its own `except` clauses can keep a
    stop signal from acting (stop_signals_at_once); it gets its own copies of the arguments to change as it likes."""
    kwargs, outcome = copy.deepcopy(kwargs), {}
    cuda_device = torch.cuda.current_device() if torch.cuda.is_initialized() else None  # both are per thread
    grad_enabled = torch.is_grad_enabled()

    def call() -> None:
        try:
            if cuda_device is not None:
                torch.cuda.set_device(cuda_device)
            with torch.set_grad_enabled(grad_enabled):
                outcome["out"] = fn(**kwargs)
        except BaseException as e:  # the user's code: any type, sys.exit included
            outcome["error"] = e

    thread = threading.Thread(target=call, name=f"reward function {name}", daemon=True)  # abandoned if it hangs
    cwd = os.getcwd()
    with stop_signals_at_once():
        thread.start()
        thread.join(timeout)
    if os.getcwd() != cwd:  # relative paths (output_dir) would now point elsewhere
        os.chdir(cwd)
        raise RewardFunctionError(f"reward function {name!r} changed the working directory: give it absolute paths "
                                  "instead of os.chdir")
    if thread.is_alive():
        raise RewardFunctionError(f"reward function {name!r} did not return within --reward_fn_timeout {timeout:g} s")
    if "error" in outcome:
        e = outcome["error"]
        raise RewardFunctionError(f"reward function {name!r} raised {type(e).__name__}: {first_line(e)}") from e
    try:  # the boundary of what it returns: whatever reading it raises is one line naming the function
        return reward_values(name, outcome["out"], n)
    except RewardFunctionError:
        raise
    except Exception as e:  # a value whose __len__, __iter__ or __float__ raises, an int beyond a float, ...
        raise RewardFunctionError(f"reward function {name!r} returned values that cannot be read as numbers "
                                  f"({describe(e)}): return a list of {n} floats (or None), one per completion") \
            from None


def reward_values(name: str, out, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Values (n,) and an applies-mask (n,) of a reward function's return value `out`; anything but a number (bool
    as 0/1) or None per completion, or a value beyond float32, is a RewardFunctionError."""
    if isinstance(out, (str, bytes, dict)) or not hasattr(out, "__len__"):
        raise RewardFunctionError(f"reward function {name!r} returned {repr(out)[:80]}, not a list of {n} numbers "
                                  "(or None), one per completion")
    out = list(out)
    if len(out) != n:
        raise RewardFunctionError(f"reward function {name!r} returned {len(out)} values for {n} completions: it must "
                                  "return one number (or None) per completion")
    for i, v in enumerate(out):
        if v is None:
            continue
        if not is_number(v):
            raise RewardFunctionError(f"reward function {name!r} returned {repr(v)[:80]} ({type(v).__name__}) "
                                      "among its values: each must be a number or None")
        value = v.item() if hasattr(v, "item") else v
        if isinstance(value, numbers.Integral) and abs(value) > FLOAT32_MAX:  # float() of it may overflow
            shown = f"an int of {int(value).bit_length()} bits"
        elif not abs(float(value)) <= FLOAT32_MAX:  # nan and inf too
            shown = repr(float(value))
        else:
            continue
        raise RewardFunctionError(f"reward function {name!r} returned {shown} for completion {i}: each value must "
                                  f"be a finite float32 (at most {FLOAT32_MAX:.4g} in magnitude)")
    applies = torch.tensor([v is not None for v in out])
    return torch.tensor([0.0 if v is None else float(v) for v in out]), applies


@contextlib.contextmanager
def reward_faults(device: torch.device, what: str, after_training: bool = False):
    """Around the scoring of completions: a RewardFunctionError on any rank is raised on every rank together, with
    the failing rank's message (said once, by rank 0), instead of the others waiting for it in the next collective;
    a rank that has not finished within --ddp_timeout is named (wait_for_peers)."""
    error = None
    try:
        yield
    except RewardFunctionError as e:
        error = e
    if not dist.is_initialized():
        if error is not None:
            error.after_training = after_training
            raise error
        return
    wait_for_peers(what)
    if not all_reduce(torch.tensor([float(error is not None)], device=device), dist.ReduceOp.MAX).item():
        return
    messages = [None] * dist.get_world_size()
    dist.all_gather_object(messages, None if error is None else (str(error), error.signal_name))
    rank, (message, signal_name) = min(((r, m) for r, m in enumerate(messages) if m is not None),
                                       key=lambda failed: failed[1][1] is not None)  # a failure before a signal
    raise RewardFunctionError(f"{message} (rank {rank}, {what})", announce=dist.get_rank() == 0,
                              after_training=after_training, signal_name=signal_name) from None
