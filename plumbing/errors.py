"""How a run ends when it cannot go on, in one line: ConfigError (bad input: the problem and its fix, exit 2), Fault (a
run stopped by a fault, exit 4) and RewardFunctionError; `reading` turns a library's exception while an input is read
into such a line; `inert` makes what an outside party wrote (a server, a file, a library, a reward function) safe to
show in one. It imports no other module of this package.
"""

import contextlib
import re
import stat
import unicodedata
from pathlib import Path
from typing import Optional

import torch

__all__ = [  # what this module gives as plumbing.NAME (rloo.py, rloo_multinode.py, the tools, the tests)
    "ConfigError", "Fault", "inert", "describe", "not_a_file", "reading", "first_line", "RewardFunctionError",
]


class ConfigError(Exception):
    """Bad input the user can fix; reported as one line and exit status 2."""


class Fault(Exception):
    """A failure outside the training state stopped the run (a reward function, the disk, a rank that stopped
    answering); reported as one line saying what was saved, exit status 4. `announce`: whether this rank prints it
    (one rank says it for all)."""

    def __init__(self, message: str, announce: bool = True):
        super().__init__(message)
        self.announce = announce


SHOWN = 300  # characters of an outside party's text in a one-line message


def inert(text, limit: int = SHOWN) -> str:
    """`text` as one line of inert text, at most about `limit` characters: line breaks and other whitespace runs
    become one space; control characters (ESC of terminal sequences, CR, NUL, DEL, C1), bidirectional overrides and
    other invisible format characters are written as escapes (`\\x1b`, `\\u202e`), so that nothing a server, a file
    or a library wrote can move the cursor, clear the screen, retitle the window or fake a line of its own; a longer
    text is cut, saying how much was left out."""
    whole = str(text)
    text = re.sub(r"\s+", " ", whole.lstrip()[:8 * limit]).strip()  # of a 2 MB body only the start can be shown
    shown, length = [], 0
    for char in text:
        if unicodedata.category(char) in ("Cc", "Cf", "Cs", "Co", "Zl", "Zp"):
            char = char.encode("unicode_escape", "backslashreplace").decode("ascii")
        if length + len(char) > limit:
            return "".join(shown).rstrip() + f"... (cut: {len(whole)} characters in all)"
        shown.append(char)
        length += len(char)
    return "".join(shown)


def describe(e: BaseException) -> str:
    """What an exception says, in one line, for the one-line errors: bytes that are not UTF-8 named as such."""
    if isinstance(e, UnicodeError):
        where = f" (byte {e.object[e.start:e.start + 1]!r} at offset {e.start})" if isinstance(
            e, UnicodeDecodeError) else ""
        return f"it is not UTF-8 text{where}"
    return f"{type(e).__name__}: {first_line(e)}"


def not_a_file(path: Path) -> Optional[str]:
    """Why `path` cannot be read as a file, in words (`does not exist`, `is a FIFO (named pipe)`, ...); None for a
    regular file (or a link to one)."""
    try:
        mode = path.stat().st_mode
    except OSError as e:
        return "is a broken symbolic link" if path.is_symlink() else \
            "does not exist" if isinstance(e, FileNotFoundError) else f"cannot be read ({e.strerror or e})"
    kinds = ((stat.S_ISREG, None), (stat.S_ISDIR, "is a directory"), (stat.S_ISFIFO, "is a FIFO (named pipe)"),
             (stat.S_ISSOCK, "is a socket"), (stat.S_ISCHR, "is a character device"),
             (stat.S_ISBLK, "is a block device"))
    return next((kind for test, kind in kinds if test(mode)), "is not a file")


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


def first_line(e: BaseException, limit: int = SHOWN) -> str:
    """An exception's message in one line of inert text (a library's or user code's words: inert), for one-line
    errors."""
    text = str(e).strip()
    return inert(text.splitlines()[0], limit) if text else type(e).__name__


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
