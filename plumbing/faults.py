"""Stop signals and faults: SIGTERM, SIGUSR1, SIGINT and SIGHUP ask the run to stop after the update with a checkpoint
(at once during start-up); signals held while files move; NaN or inf checked on every rank at once, the offending
batch kept; the rollout source's failure; a console that goes away (a closed pipe, a terminal gone, a full disk) never
stops the run.
"""

import contextlib
import json
import os
import signal
import sys
import threading
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .distributed import all_reduce
from .errors import RewardFunctionError, describe, program
from .folders import Folder

__all__ = [  # given as plumbing.NAME to rloo.py, rloo_multinode.py and the tools; tests import the rest from the module
    "RolloutSourceError", "check_finite", "batch_kept_if_nonfinite", "StopSignal", "signals_held",
]


class RolloutSourceError(Exception):
    """The completions of an update cannot be had (an engine died): the run checkpoints and stops."""


class NonFiniteError(Exception):
    """A NaN or inf in a quantity that training would otherwise use; raised on every rank at once."""

    def __init__(self, quantity: str, ranks: list[int], unwritten: Optional[str] = None):
        super().__init__(f"non-finite {quantity} on rank {', '.join(map(str, ranks))}")
        self.quantity, self.ranks = quantity, ranks
        self.unwritten = unwritten  # why the offending batch could not be written (a full disk), if it could not


def check_finite(named: dict[str, Optional[torch.Tensor]], device: torch.device) -> None:
    """Collective: every rank learns whether any rank holds a NaN/inf in one of the named tensors, so that all
    of them stop together instead of the healthy ones waiting forever in the next collective."""
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    bad = torch.zeros(len(named), world_size, device=device)  # (quantities, ranks)
    for i, value in enumerate(named.values()):
        if value is not None and not torch.isfinite(value).all():
            bad[i, rank] = 1.0
    all_reduce(bad)
    for (name, _), ranks in zip(named.items(), bad):
        if ranks.any():
            raise NonFiniteError(name, ranks.nonzero().flatten().tolist())


def dump_batch(output_dir: str, name: str, tokenizer, rollout, scores: torch.Tensor) -> None:
    """One JSON line per completion of the offending batch, in output_dir/nonfinite/`name` (written whole, never
    through a link): prompt, completion, score and log-prob sum (null where the update had not computed them yet; the
    advantages are the update's own, computed from these)."""
    num_prompts, lines = rollout.queries.shape[0], []
    for i in range(len(scores)):
        prompt = rollout.queries[i % num_prompts][rollout.query_mask[i % num_prompts]]
        completion = rollout.responses[i][rollout.response_mask[i]]
        lines.append(json.dumps({
            "prompt": tokenizer.decode(prompt), "completion": tokenizer.decode(completion), "score": scores[i].item(),
            "logprob_sum": None if rollout.logprobs is None else rollout.logprobs[i].sum().item(),
        }) + "\n")
    with Folder.at(output_dir) as root, root.folder("nonfinite", create=True) as folder:
        folder.write(name, "".join(lines))


@contextlib.contextmanager
def batch_kept_if_nonfinite(output_dir: str, update: int, rank: int, tokenizer, rollout, scores: torch.Tensor):
    """For the training step: a NaN/inf (NonFiniteError, on every rank at once) stops the run before any optimizer
    step on it, the ranks that hold it writing the offending batch to output_dir/nonfinite/ first."""
    try:
        yield
    except NonFiniteError as e:
        unwritten = None
        if rank in e.ranks:
            try:
                dump_batch(output_dir, f"update_{update}_rank_{rank}.jsonl", tokenizer, rollout, scores)
            except OSError as error:  # a full disk: the run stops all the same, and says the batch is not there
                unwritten = error.strerror or str(error)
        raise NonFiniteError(f"{e.quantity} at update {update}", e.ranks, unwritten) from None


class StartupInterrupted(BaseException):
    """A signal arrived before the first update: there is nothing to save, so the run ends at once. A
    BaseException, as KeyboardInterrupt is, so that library code's `except Exception` lets it through."""

    def __init__(self, signal_name: str):
        super().__init__(f"{signal_name} received during start-up: stopped before the first update, nothing was "
                         "trained; run the same command again to start")
        self.signal_name = signal_name


def run_only(handler: Callable) -> Callable:
    """Marks a signal handler as the run's own process's: a process forked from the run does not keep it
    (given_back_in_child)."""
    handler.run_only = True
    return handler


def given_back_in_child() -> None:
    """In a process forked from the run (a reward function's multiprocessing pool, fork or forkserver, os.fork): each
    signal whose handler is the run's (run_only: the stop signals', a timer's while user code runs, the end's) gets
    the disposition a Python process starts with (SIGINT: KeyboardInterrupt; the others: their default action), and
    the stop signals are unblocked. The run's handlers only record a signal for its update loop: a worker keeping them
    would outlive SIGTERM (multiprocessing's own terminate() included), and a run's end would wait for it forever. A
    disposition the run found (nohup's ignored SIGHUP) is kept. A child that exec's a program (subprocess) gets the
    default actions from exec itself."""
    for sig in signal.valid_signals() - {signal.SIGKILL, signal.SIGSTOP}:
        if getattr(signal.getsignal(sig), "run_only", False):
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, StopSignal.SIGNALS)


os.register_at_fork(after_in_child=given_back_in_child)  # os.fork, which multiprocessing's fork and forkserver use


class StopSignal:
    """SIGTERM and SIGUSR1 (what SLURM sends before preemption or the time limit), SIGINT (Ctrl-C, and what many
    launchers send) and SIGHUP (the terminal or SSH session closed; unless ignored at start, as under nohup: then it
    stays ignored) ask the run to stop after the current update with a checkpoint; the handler only records the
    signal, the update loop decides when to act on it. After a first SIGINT, a second one kills the process at
    once (the default action, which works even inside a hung collective). Until `training` is set there is nothing
    to save: a signal ends the run at once (StartupInterrupted), all but SIGINT leaving the `preempted` marker so
    that a job script requeues the run."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP)

    def __init__(self, lock, announce: bool):
        self.name: Optional[str] = None
        self.training = False
        self.at_once = False  # the main thread only waits for a reward function (stop_signals_at_once)
        self.lock = lock  # the run's OutputDirLock: output_dir marked as preempted only by the run holding it
        self.announce = announce
        self.pid = os.getpid()  # the run's process: in any other (a child forked by user code) the signal is its own
        self.disarmed: set[int] = set()  # signals whose handler this object gave back to the default itself
        for sig in self.SIGNALS:
            if sig != signal.SIGHUP or signal.getsignal(sig) is not signal.SIG_IGN:  # nohup's choice is kept
                signal.signal(sig, self._record)

    @run_only
    def _record(self, signum, frame) -> None:
        if os.getpid() != self.pid:  # a child forked by user code that kept the handler (a fork in C code): its own
            given_back_in_child()
            os.kill(os.getpid(), signum)  # delivered again, to the handler it now has (SIGINT: KeyboardInterrupt)
            return
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            self.disarmed.add(signum)
        name = signal.Signals(signum).name
        if not self.training:
            if signum != signal.SIGINT and self.lock.held:
                self.lock.mark_preempted("stopped during start-up, before any update")
            raise StartupInterrupted(name)
        self.name = self.name or name
        if self.at_once:  # the function may never return: stop now, from the state at the start of the update
            raise RewardFunctionError(f"{name} received while a reward function ran", signal_name=name)
        if signum == signal.SIGINT and self.announce:  # os.write: print() is not safe inside a signal handler
            with contextlib.suppress(OSError):  # stderr gone (a closed pipe: Ctrl-C reached `| tee` too)
                os.write(2, f"{program()}: SIGINT received: stopping after this update with a checkpoint; "
                            "Ctrl-C again exits at once without one\n".encode())

    def requested(self, device: torch.device) -> bool:
        """Collective: True on every rank as soon as any rank got a signal."""
        return bool(all_reduce(torch.tensor([float(self.name is not None)], device=device), dist.ReduceOp.MAX).item())


@contextlib.contextmanager
def signals_held():
    """The stop signals are delivered only after the block: a move of several directories is never cut in half."""
    signal.pthread_sigmask(signal.SIG_BLOCK, StopSignal.SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, StopSignal.SIGNALS)


@contextlib.contextmanager
def stop_signals_at_once(came_before: bool = False):
    """While the main thread only waits for a reward function (running in a thread of its own), a stop signal stops
    the run at once, raising there, instead of after the update: the function may be stuck for good. With
    `came_before` (user code has processes of its own: a pool's workers), so does one that came before the call, in
    the update: sent to the process group (Ctrl-C) or by SLURM to every process of the job, it may have ended them,
    and the function would wait for them until its timeout."""
    stop = getattr(signal.getsignal(signal.SIGTERM), "__self__", None)
    if not isinstance(stop, StopSignal) or not stop.training or threading.current_thread() != threading.main_thread():
        yield
        return
    if came_before and stop.name is not None:
        raise RewardFunctionError(f"{stop.name} received while a reward function ran", signal_name=stop.name)
    stop.at_once = True
    try:
        yield
    finally:
        stop.at_once = False


class ConsoleStream:
    """sys.stdout or sys.stderr as a run writes to them: a write or flush that fails because the console went away (a
    closed pipe: Ctrl-C reached `| tee` too; a terminal gone; a full disk; a closed file) is dropped, not raised into
    training or a save, and the stream's file descriptor is pointed at /dev/null, so that whatever writes to it later
    (print, rich, a library writing to the descriptor, Python's own flush at exit) succeeds quietly. `lost`: what
    failed, first (metrics.jsonl records it). Text the stream cannot encode is written with backslash escapes."""

    def __init__(self, stream, name: str):
        self.stream, self.name, self.lost = stream, name, None

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except UnicodeEncodeError:
            encoding = self.stream.encoding or "utf-8"
            return self.write(text.encode(encoding, "backslashreplace").decode(encoding))
        except (OSError, ValueError) as e:
            self.drop(e)
            return len(text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        try:
            self.stream.flush()
        except (OSError, ValueError) as e:
            self.drop(e)

    def drop(self, error: Exception) -> None:
        self.lost = self.lost or f"{self.name}: {describe(error)}"
        with contextlib.suppress(OSError, ValueError):  # ValueError: the stream was closed, it has no descriptor
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, self.stream.fileno())
            os.close(null)
            self.stream.flush()  # what the failed write left in the buffer, into /dev/null

    def __getattr__(self, name: str):  # fileno, isatty, encoding, buffer, ...: the stream's
        if name == "stream":  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self.stream, name)


def console_survives() -> None:
    """A run's console made one that never stops it (ConsoleStream), for stdout and stderr. Descriptors 0-2 closed at
    start (`>&-`) are opened on /dev/null first, so that no file the run opens gets one of their numbers and takes
    what is written to the console. Idempotent."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:  # open() takes the lowest free descriptor: this one
            os.open(os.devnull, os.O_RDWR)
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if not isinstance(stream, ConsoleStream):
            setattr(sys, name, ConsoleStream(stream or open(os.devnull, "w"), name))


def console_lost() -> Optional[str]:
    """What failed first on a console that went away (ConsoleStream.lost), or None."""
    return next(filter(None, (getattr(stream, "lost", None) for stream in (sys.stdout, sys.stderr))), None)
