"""The reward sources: the reward model and reward functions loaded and checked against the data, a function called in
a thread of its own with a timeout and its values read, and a failure on one rank raised on every rank together.
"""

import atexit
import contextlib
import copy
import functools
import gc
import importlib.util
import inspect
import math
import multiprocessing
import numbers
import os
import posix
import signal
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .data import PROMPT_IDS, pad_sequences
from .distributed import all_reduce, seed_everything, wait_for_peers
from .errors import (FLOAT32_MAX, ConfigError, RewardFunctionError, describe, first_line, inert, input_file, not_a_file,
                     program)
from .faults import StopSignal, run_only, stop_signals_at_once
from .threads import in_a_thread
from .models import disable_dropout, has_tokenizer, load_reward_model, load_tokenizer, same_vocabulary

__all__ = [  # given as plumbing.NAME to rloo.py, rloo_multinode.py and the tools; tests import the rest from the module
    "RewardSources", "load_reward_sources", "load_reward_functions", "check_reward_function_arguments",
    "call_reward_function", "reward_faults", "said_if_unscored", "retokenize", "prompt_values",
]


@dataclass
class RewardSources:
    """Everything that scores completions: a reward model (with its tokenizer) and reward functions."""

    model: Optional[torch.nn.Module]
    model_tokenizer: Optional[object]  # None when the policy's token ids can be fed as they are
    functions: list[tuple[str, Callable]]
    weights: torch.Tensor  # (S,)
    share_prompt: bool = False  # the reward model reads a prompt group as one row (grouped_rows)
    timeout: Optional[float] = None  # seconds a reward function's call may take (--reward_fn_timeout)
    scored_any: bool = False  # whether any completion was scored yet in this process (said_if_unscored)
    said_unscored: set = field(default_factory=set)  # the functions said to have scored nothing in an update

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


def get_umask() -> str:
    """The umask, in octal: from /proc where there is one (Linux), else set and put back at once (reading it sets
    it, meanwhile for every thread)."""
    with contextlib.suppress(OSError, StopIteration, ValueError):
        status = Path("/proc/self/status").read_text().splitlines()
        return oct(int(next(line for line in status if line.startswith("Umask:")).split()[1], 8))
    umask = os.umask(0o022)
    os.umask(umask)
    return oct(umask)


def set_flags(module, names: tuple[str, ...], values: tuple) -> None:
    for name, value in zip(names, values):
        setattr(module, name, value)


class IntervalTimer:
    """An interval timer's setting (signal.setitimer's; signal.alarm sets the real one), compared as user_code
    compares settings: armed or not, and its interval (the time left runs down); restore() sets it as it was read."""

    def __init__(self, which: int):
        self.which = which
        self.value, self.interval = signal.getitimer(which)

    def __eq__(self, other) -> bool:
        return (self.value > 0, self.interval) == (other.value > 0, other.interval)

    def __repr__(self) -> str:
        return "off" if not self.value else f"{self.value:.3g} s" + (f", then every {self.interval:g} s" if
                                                                    self.interval else "")

    def restore(self) -> None:
        signal.setitimer(self.which, self.value, self.interval)


TIMER_SIGNALS = {signal.ITIMER_REAL: signal.SIGALRM, signal.ITIMER_VIRTUAL: signal.SIGVTALRM,
                 signal.ITIMER_PROF: signal.SIGPROF}  # what each interval timer sends: by default, the end of the run


CUDNN, MATMUL = ("enabled", "benchmark", "deterministic", "allow_tf32"), (
    "allow_fp16_reduced_precision_reduction", "allow_bf16_reduced_precision_reduction")
SDPA = ("flash", "mem_efficient", "math", "cudnn")  # scaled_dot_product_attention's kernels


# the process-wide settings the run relies on and user code can change (its module at import, a reward function as it
# runs): {name: (read, write, how to do without changing it)}. Each is put back after the code ran; a change is one
# line naming it, as the code's later calls would compute with the setting they left if the run kept it
RUN_SETTINGS = {
    "the working directory": (os.getcwd, os.chdir, "give it absolute paths instead of os.chdir"),
    "torch's default dtype": (torch.get_default_dtype, torch.set_default_dtype, "pass dtype= where it makes tensors"),
    "torch's default device": (torch.get_default_device, torch.set_default_device, "pass device= where it makes "
                                                                                   "tensors"),
    "torch's float32 matmul precision": (torch.get_float32_matmul_precision, torch.set_float32_matmul_precision,
                                         "set it back before returning"),
    "torch's deterministic algorithms": (
        lambda: (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()),
        lambda mode: torch.use_deterministic_algorithms(mode[0], warn_only=mode[1]), "set them back before returning"),
    "torch's anomaly detection": (torch.is_anomaly_enabled, torch.set_anomaly_enabled,
                                  "use torch.autograd.detect_anomaly() as a with-block"),
    "cuDNN's flags": (lambda: tuple(getattr(torch.backends.cudnn, n) for n in CUDNN),
                      lambda values: set_flags(torch.backends.cudnn, CUDNN, values),
                      "use torch.backends.cudnn.flags() as a with-block"),
    "CUDA matmul's reduced-precision reductions": (
        lambda: tuple(getattr(torch.backends.cuda.matmul, n) for n in MATMUL),
        lambda values: set_flags(torch.backends.cuda.matmul, MATMUL, values), "set them back before returning"),
    "torch's attention kernels": (lambda: tuple(getattr(torch.backends.cuda, f"{n}_sdp_enabled")() for n in SDPA),
                                  lambda values: [getattr(torch.backends.cuda, f"enable_{n}_sdp")(v)
                                                  for n, v in zip(SDPA, values)],
                                  "use torch.nn.attention.sdpa_kernel() as a with-block"),
    "sys.stdout": (lambda: sys.stdout, lambda stream: setattr(sys, "stdout", stream),
                   "use contextlib.redirect_stdout as a with-block"),
    "sys.stderr": (lambda: sys.stderr, lambda stream: setattr(sys, "stderr", stream),
                   "use contextlib.redirect_stderr as a with-block"),
    "the umask": (get_umask, lambda umask: os.umask(int(umask, 8)), "set file modes with os.chmod instead"),
} | {f"the {sig.name} handler": (functools.partial(signal.getsignal, sig), functools.partial(signal.signal, sig),
                                 "leave the stop signals to the run") for sig in StopSignal.SIGNALS} | {
    f"the {name} interval timer": (functools.partial(IntervalTimer, which), IntervalTimer.restore,
                                   f"time the work with a timeout of its own: {TIMER_SIGNALS[which].name} would end "
                                   "the run, or interrupt it later") for which, name in (
        (signal.ITIMER_REAL, "real (signal.alarm's)"), (signal.ITIMER_VIRTUAL, "virtual"),
        (signal.ITIMER_PROF, "profiling"))} | {  # the timers before their signals' handlers: put back in this order
    f"the {sig.name} handler": (functools.partial(signal.getsignal, sig), functools.partial(signal.signal, sig),
                                "time the work with a timeout of its own (a thread's join, subprocess's timeout=)")
    for sig in TIMER_SIGNALS.values()}


EXIT_HANDLER_TIMEOUT = 10.0  # seconds an atexit handler that user code registered may take as the process exits
EXIT_HANDLERS = [0]  # how many atexit handlers user code registered (ExitHandler): the exit's time (exit_bounded)
LEFT_RUNNING: dict[int, tuple[str, str]] = {}  # the processes user code started and left running, ended as the script
# ends (end_processes_left): {pid: (its start time, what started it)}. Process-wide as the processes are


def descendants(roots: Optional[list[int]] = None) -> dict[int, str]:
    """The descendants of `roots` (default: this process), children of children included: {pid: its start time}
    (/proc's, which tells a pid taken again by another process; {} where there is no /proc)."""
    children, started = {}, {}
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            with contextlib.suppress(OSError, IndexError, ValueError):
                if entry.name.isdigit():
                    text = Path("/proc", entry.name, "stat").read_text()
                    after = text[text.rindex(")") + 2:].split()  # state, ppid, ... (the name may hold spaces)
                    if after[0] not in "ZX":  # a zombie has ended
                        children.setdefault(int(after[1]), []).append(int(entry.name))
                        started[int(entry.name)] = after[19]
    found, parents = {}, list(roots or [os.getpid()])
    while parents:
        for child in children.get(parents.pop(), ()):
            found[child] = started[child]
            parents.append(child)
    return found


MULTIPROCESSING_HELPERS = (b"from multiprocessing.forkserver import main", b"from multiprocessing.resource_tracker "
                           b"import main")  # the command lines of multiprocessing's helper processes


def multiprocessings_own() -> set[int]:
    """The processes multiprocessing itself ends as Python exits: its children (a Pool's workers, a
    ProcessPoolExecutor's, a Process), its forkserver and resource tracker (which end once this process is gone), and
    what those started. Ended from outside before that, a pool worker holding its queue's lock would leave the pool's
    own end waiting for the lock forever."""
    roots = [child.pid for child in multiprocessing.active_children()]
    for pid in descendants():
        with contextlib.suppress(OSError):
            if any(helper in Path(f"/proc/{pid}/cmdline").read_bytes() for helper in MULTIPROCESSING_HELPERS):
                roots.append(pid)
    return {*roots, *descendants(roots)} if roots else set()


def end_processes_left(program: str, at_once: bool = False) -> None:
    """Ends the processes that user code started and left running (user_code records them), whatever they hold (the
    console's pipe: `rloo.py | cat` would wait for them): SIGTERM, then SIGKILL to those still running after 2 s,
    and one line naming them. A pid now another process's (another start time) is left alone. Multiprocessing's
    own (multiprocessings_own) are left to Python's exit, where multiprocessing ends them (its workers take SIGTERM:
    given_back_in_child), unless the process exits `at_once` (os._exit, which runs no exit handler)."""
    import time

    spared = set() if at_once else multiprocessings_own()
    alive = lambda: {pid: what for pid, (start, what) in LEFT_RUNNING.items()  # noqa: E731
                     if descendants().get(pid) == start and pid not in spared}
    left = alive()
    if not left:
        return
    for parent in list(left):  # and what they started since (a shell's children), ended with them
        for pid, start in descendants([parent]).items():
            LEFT_RUNNING.setdefault(pid, (start, LEFT_RUNNING[parent][1]))
    left = alive()
    print(f"{program}: ending {len(left)} process(es) that user code started and left running: "
          + ", ".join(f"pid {pid} ({what})" for pid, what in left.items()), file=sys.stderr, flush=True)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in left:
            with contextlib.suppress(OSError):
                os.kill(pid, sig)
        deadline = time.monotonic() + 2.0
        while left and time.monotonic() < deadline:
            for pid in left:  # a child of this process lingers as a zombie until reaped
                with contextlib.suppress(ChildProcessError, OSError):
                    os.waitpid(pid, os.WNOHANG)
            left = alive()
            time.sleep(0.02)
    LEFT_RUNNING.clear()


def exit_bounded(program: str, status: int) -> None:
    """As the process goes on to Python's exit: multiprocessing ends its children there (a pool's workers, with
    SIGTERM) and waits for each, and a pool's end waits for its task queue's lock: a worker that does not end (its
    own code ignores SIGTERM) or one that a signal ended while it held the lock (Ctrl-C reaches every process of the
    terminal's group) would keep the process from ever exiting. When any of multiprocessing's children is left, a
    watchdog thread gives the exit the exit handlers' time (EXIT_HANDLER_TIMEOUT for each of user code's, and once
    more), then names and kills what this process still has below it, and after 2 s more (at most as long again)
    exits with `status`."""
    import time

    if not multiprocessing.active_children():
        return
    limit = EXIT_HANDLER_TIMEOUT * (1 + EXIT_HANDLERS[0])

    def kill_all_below() -> list[int]:  # a pool replaces a worker that died: what it started meanwhile too
        left = sorted(descendants())
        for pid in left:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        return left

    def watch() -> None:
        time.sleep(limit)
        left = kill_all_below()
        if left:
            print(f"{program}: processes of user code's multiprocessing still ran {limit:g} s after the run's end: "
                  f"killed pid {', '.join(map(str, left))}", file=sys.stderr, flush=True)
        time.sleep(min(2.0, limit))
        print(f"{program}: the exit did not finish {limit + min(2.0, limit):g} s after the run's end (a "
              "multiprocessing pool's end waits for a lock that a worker ended by a signal held): exiting with status "
              f"{status} without it", file=sys.stderr, flush=True)
        kill_all_below()
        os._exit(status)

    threading.Thread(target=watch, name="exit watchdog", daemon=True).start()


class ExitHandler:
    """An atexit handler that user code registered, run as the process exits for at most EXIT_HANDLER_TIMEOUT
    seconds (in a thread of its own): one that sleeps or waits would keep a finished run from exiting. Equal to the
    function it runs, so that atexit.unregister(fn) finds it."""

    def __init__(self, fn: Callable, args: tuple, kwargs: dict):
        self.fn, self.args, self.kwargs = fn, args, kwargs
        EXIT_HANDLERS[0] += 1

    def __eq__(self, other) -> bool:
        return other is self or other == self.fn

    __hash__ = object.__hash__

    def __call__(self) -> None:
        name = getattr(self.fn, "__qualname__", None) or repr(self.fn)
        outcome = in_a_thread(lambda: self.fn(*self.args, **self.kwargs), f"atexit {name}", EXIT_HANDLER_TIMEOUT)
        if not outcome:
            print(f"{program()}: an exit handler of user code ({name}) did not return within "
                  f"{EXIT_HANDLER_TIMEOUT:g} s: exiting without it", file=sys.stderr, flush=True)
        elif "error" in outcome:
            raise outcome["error"]


class ExitRefused(SystemExit):
    """os._exit called by user code while it runs inside the run (user_code): it would end the process at once, with
    the status it names (0 included), nothing saved."""


def disarmed_by_the_run(name: str, old, new) -> bool:
    """Whether RUN_SETTINGS' `name`, a stop signal's handler, went from the run's StopSignal to the default by that
    StopSignal's own doing (a first Ctrl-C, landing while user code ran, arms the second): not the code's change."""
    stop = getattr(old, "__self__", None)
    return isinstance(stop, StopSignal) and new == signal.SIG_DFL and any(
        name == f"the {signal.Signals(sig).name} handler" for sig in stop.disarmed)


@contextlib.contextmanager
def user_code(what: str, error: type):
    """Around code of the user's in this process (a reward module's import, a reward function's call): while it runs,
    os._exit (posix._exit) in this process raises ExitRefused instead (a process forked meanwhile exits as asked).
    After it, torch's random generators, which the run draws from (minibatch order), are as they were: the code drew
    from a copy, so that its draws or seeds never move the run's, which stays deterministic and resumes exactly
    (python's and numpy's, which the run does not draw from, are the code's own, continued from call to call and
    checkpointed); so are torch's thread count, the garbage collector and the recursion limit (speed only). Any other
    setting it changed (RUN_SETTINGS) is put back and raised as `error` (ConfigError, RewardFunctionError): `what`
    changed it, the values, the fix."""
    settings = {name: read() for name, (read, _, _) in RUN_SETTINGS.items()}
    generators = torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    speed = torch.get_num_threads(), gc.isenabled(), sys.getrecursionlimit()
    real_exit, pid, real_register, processes = os._exit, os.getpid(), atexit.register, descendants()
    fired = []  # a timer's signal while the code runs: by default the end of the run (SIGALRM: exit 142)

    @run_only  # a process the code forks meanwhile gets the default back
    def recorder(signum, frame) -> None:
        fired.append(signal.Signals(signum).name)

    caught = [sig for sig in TIMER_SIGNALS.values() if threading.current_thread() is threading.main_thread()
              and signal.getsignal(sig) == signal.SIG_DFL]
    for sig in caught:
        signal.signal(sig, recorder)

    def register(fn: Callable, *args, **kwargs) -> Callable:
        real_register(ExitHandler(fn, args, kwargs))
        return fn

    def exit_refused(status: int) -> None:
        if os.getpid() != pid:  # a child forked by the code: its exit is the child's
            real_exit(status)
        raise ExitRefused(f"os._exit({status})")

    os._exit = posix._exit = exit_refused  # the same function, by its two names
    atexit.register = register  # `from atexit import register` in the code's module too: bound as the process exits
    try:
        yield
    finally:
        os._exit = posix._exit = real_exit
        atexit.register = real_register
        LEFT_RUNNING.update({child: (start, what) for child, start in descendants().items()
                             if processes.get(child) != start})
        torch.set_rng_state(generators[0])
        if generators[1] is not None:
            torch.cuda.set_rng_state_all(generators[1])
        torch.set_num_threads(speed[0])
        (gc.enable if speed[1] else gc.disable)()
        sys.setrecursionlimit(speed[2])
        now = {name: RUN_SETTINGS[name][0]() for name in settings}
        changed = {name: (old, now[name]) for name, old in settings.items()
                   if (signal.SIG_DFL if now[name] is recorder else now[name]) != old
                   and not disarmed_by_the_run(name, old, now[name])}
        for name, (old, _) in changed.items():  # the timers first: off before their signals' handlers are put back
            RUN_SETTINGS[name][1](old)
        for sig in caught:
            if signal.getsignal(sig) is recorder:
                signal.signal(sig, signal.SIG_DFL)
    if fired:
        raise error(f"{what} set a timer whose {fired[0]} came while it ran (signal.alarm, signal.setitimer): it would "
                    "have ended the run at once, nothing saved; time the work with a timeout of its own (a thread's "
                    "join, subprocess's timeout=)")
    if changed:
        name, values = next(iter(changed.items()))
        old, new = (getattr(value, "__qualname__", None) or repr(value) for value in values)  # a handler by its name
        others = f" (and {', '.join(list(changed)[1:])})" if len(changed) > 1 else ""
        raise error(f"{what} changed {name} ({old} -> {new}){others} and did not set it back: the run relies on "
                    "it, and putting it back behind the code's back would change what its next calls compute; "
                    f"{RUN_SETTINGS[name][2]}")


def module_source(module_name: str) -> Optional[Path]:
    """The source file that `import module_name` reads, of any kind (a FIFO, a device: which the import system skips,
    as no module, or as a namespace package for a package's __init__.py), found in sys.path's folders in their order
    as the import system looks there (a package's __init__.py, else the module's .py); None for a module imported
    already or found nowhere there (an installed editable finder's, a built-in, an extension module)."""
    if module_name in sys.modules:
        return None
    *parents, last = module_name.split(".")
    for folder in (f for f in sys.path if isinstance(f, str)):
        package, module = Path(folder or ".", *parents, last, "__init__.py"), Path(folder or ".", *parents, f"{last}.py")
        found = [path for path in (package, module) if os.path.lexists(path)]
        if found:
            return next((path for path in found if not not_a_file(path)), found[0])
    return None


SOURCE_LIMIT = 64 << 20  # bytes of a reward module's source file (compiled extension modules: any size)


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
        source = module_source(module_name)
        if source is not None:  # a FIFO: no module, or a namespace package, as far as the import system can tell
            with input_file(source, f"reward function {spec!r}: {inert(source, 200)}", "put the module's source there "
                            "(Python's import skips a file that is not regular)", SOURCE_LIMIT):
                pass
        try:
            with user_code(f"reward function {spec!r}: importing {module_name!r}", ConfigError):
                module = importlib.import_module(module_name)
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
    (None: absent): a fixed argument, or a column other than the prompt's (given as `prompts`). A column named as
    one of the fixed arguments (`completions`, ...) would be passed twice: refused, naming it."""
    for dataset_name, dataset in splits:
        columns = [] if dataset is None else [c for c in dataset.column_names if c not in (PROMPT_IDS, prompt_column)]
        clash = [c for c in columns if c in REWARD_FUNCTION_ARGUMENTS] if functions else []
        if clash:
            raise ConfigError(f"dataset {inert(dataset_name, 120)} has a column {clash[0]!r}, the name of an argument "
                              f"the reward functions are given ({', '.join(REWARD_FUNCTION_ARGUMENTS)}): rename the "
                              "column")
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
    Whatever it raises (SystemExit included), anything else it returns, a value outside float32's range, not
    returning within `timeout` seconds, a call of os._exit and a setting of the run's left changed (user_code) become
    a RewardFunctionError naming it. It runs in a thread of its own while
    this one waits, so that neither a function stuck in C code or a sleep nor its own `except` clauses can keep a
    stop signal from acting (stop_signals_at_once); it gets its own copies of the arguments to change as it likes."""
    kwargs = copy.deepcopy(kwargs)
    cuda_device = torch.cuda.current_device() if torch.cuda.is_initialized() else None  # both are per thread
    grad_enabled = torch.is_grad_enabled()

    def call():
        if cuda_device is not None:
            torch.cuda.set_device(cuda_device)
        with torch.set_grad_enabled(grad_enabled):
            return fn(**kwargs)

    with user_code(f"reward function {name!r}", RewardFunctionError):
        with stop_signals_at_once(came_before=bool(LEFT_RUNNING or multiprocessing.active_children())):
            outcome = in_a_thread(call, f"reward function {name}", timeout)  # abandoned if it hangs
        if not outcome:
            raise RewardFunctionError(f"reward function {name!r} did not return within --reward_fn_timeout "
                                      f"{timeout:g} s")
        if isinstance(outcome.get("error"), ExitRefused):
            raise RewardFunctionError(f"reward function {name!r} called {outcome['error']}, which would end the run "
                                      "at once, nothing saved: return its values, or raise")
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


def said_if_unscored(update: int, sources: RewardSources, scores: torch.Tensor,
                     per_source: dict) -> tuple[torch.Tensor, dict]:
    """An update's scores (k*B,) and per-source metrics as score_completions returns them, checked for what was
    scored on this rank: a reward function that scored none of the completions (returned only None; TRL warns) is
    said in one line, once a run; an update none of whose completions any source scored, before any completion was
    ever scored, is a RewardFunctionError (a run that would train on nothing: a completion no source scores is left
    out of the loss)."""
    rank = f" on rank {dist.get_rank()}" if dist.is_initialized() else ""
    unscored = bool(scores.isnan().all())
    if unscored and not sources.scored_any:
        raise RewardFunctionError(f"no completion of update {update} was scored{rank}: every reward function returned "
                                  "only None (and no reward model scores them), so the run would train on nothing: "
                                  "return a number for the completions a function applies to")
    for name, _ in sources.functions:
        if math.isnan(per_source[f"reward/{name}/mean"]) and name not in sources.said_unscored:
            sources.said_unscored.add(name)
            print(f"{program()}: warning: reward function {name!r} scored none of the {len(scores)} "
                  f"completions of update {update}{rank}: it returned only None (said once a run)", file=sys.stderr,
                  flush=True)
    sources.scored_any = sources.scored_any or not unscored
    return scores, per_source


def retokenize(texts: list[str], ended: list[bool], tokenizer,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Query + completion texts in another tokenizer, with its EOS where the completion stopped.
    Returns right-padded (ids, mask), both (N, T)."""
    encoded = tokenizer(texts)["input_ids"]
    sequences = [ids + [tokenizer.eos_token_id] if e and tokenizer.eos_token_id is not None else ids
                 for ids, e in zip(encoded, ended)]
    return pad_sequences(sequences, 0, device, side="right")  # pad id 0: reward_model_scores masks padding


def prompt_values(examples: dict, prompt_column: str, tokenizer) -> list:
    """What reward functions see as `prompts`: the dataset's prompt column, or the decoded query tokens."""
    if prompt_column in examples:
        return examples[prompt_column]
    return tokenizer.batch_decode(examples[PROMPT_IDS], skip_special_tokens=True)
