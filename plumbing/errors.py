"""How a run ends when it cannot go on, in one line: ConfigError (bad input: the problem and its fix, exit 2), Fault (a
run stopped by a fault, exit 4) and RewardFunctionError; `reading` turns a library's exception while an input is read
into such a line. It imports no other module of this package.
"""

import contextlib
from typing import Optional

import torch


class ConfigError(Exception):
    """Bad input the user can fix; reported as one line and exit status 2."""


class Fault(Exception):
    """A failure outside the training state stopped the run (a reward function, the disk, a rank that stopped
    answering); reported as one line saying what was saved, exit status 4. `announce`: whether this rank prints it
    (one rank says it for all)."""

    def __init__(self, message: str, announce: bool = True):
        super().__init__(message)
        self.announce = announce


def describe(e: BaseException) -> str:
    """What an exception says, in one line, for the one-line errors: bytes that are not UTF-8 named as such."""
    if isinstance(e, UnicodeError):
        where = f" (byte {e.object[e.start:e.start + 1]!r} at offset {e.start})" if isinstance(
            e, UnicodeDecodeError) else ""
        return f"it is not UTF-8 text{where}"
    return f"{type(e).__name__}: {first_line(e)}"


@contextlib.contextmanager
def reading(what: str, fix: str):
    """The one boundary of an input: whatever reading `what` raises (an error of this project's passes as it is)
    becomes a ConfigError, one line naming the input, what is wrong and `fix`. Each input is read inside one."""
    try:
        yield
    except (ConfigError, Fault):
        raise
    except Exception as e:  # any library's, any type: the user needs the input, the first line, the fix
        raise ConfigError(f"{what}: {describe(e)}; {fix}") from None


FLOAT32_MAX = float(torch.finfo(torch.float32).max)  # 3.4e38: beyond it a value is inf in the tensors it meets


def first_line(e: BaseException) -> str:
    """An exception's message in one line, for one-line errors."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


class RewardFunctionError(Fault):
    """A reward function raised, hung or returned something that is not one number (or None) per completion. The run
    keeps the last finished update (a checkpoint) and stops; `after_training`: the update in progress had trained
    already (the failure was in its evaluation). `signal_name`: no failure, a stop signal came while a reward
    function ran (stop_signals_at_once): the same checkpoint, then the exit of a signal."""

    def __init__(self, message: str, announce: bool = True, after_training: bool = False,
                 signal_name: Optional[str] = None):
        super().__init__(message, announce)
        self.after_training, self.signal_name = after_training, signal_name


try:  # what a failed write raises: OSError from Python, RuntimeError from torch.save, SafetensorError
    from safetensors import SafetensorError
    WRITE_ERRORS: tuple = (OSError, RuntimeError, SafetensorError)
except ImportError:
    WRITE_ERRORS = (OSError, RuntimeError)
