"""How a run ends when it cannot go on, in one line: ConfigError (bad input: the problem and its fix, exit 2), Fault (a
run stopped by a fault, exit 4) and RewardFunctionError; `reading` turns a library's exception while an input is read
into such a line, and read_input (input_file) is how the run reads an input's bytes by path: a regular file within a
size limit; `inert` makes what an outside party wrote (a server, a file, a library, a reward function) safe to
show in one; open_own, new_file and write_own write a file without following a link. It imports no other module
of this package.
"""

import contextlib
import errno
import os
import re
import stat
import sys
import unicodedata
from pathlib import Path
from typing import Optional

import torch

__all__ = [  # given as plumbing.NAME to rloo.py, rloo_multinode.py and the tools; tests import the rest from the module
    "ConfigError", "Fault", "inert", "describe", "not_a_file", "reading", "first_line", "RewardFunctionError",
    "without_credentials", "new_file", "write_own", "open_own",
]


def program() -> str:
    """The running script's name, which the lines a run prints start with (argparse's prog): a copy of rloo.py says
    its own."""
    return Path(sys.argv[0]).name


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
    text is cut, saying how much was left out. A URL's credentials are masked (without_credentials)."""
    whole = without_credentials(text)
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


# scheme://user:password@; a scheme starts where no scheme character precedes it and is at most 32 long: linear in
# the text (a scheme matched from every letter of a 2 MB run of letters was quadratic: minutes)
URL_CREDENTIALS = re.compile(r"(?<![A-Za-z0-9+.-])([A-Za-z][A-Za-z0-9+.-]{0,31}://)[^\s/?#@]*@")


def without_credentials(text) -> str:
    """`text` with the user and password of every URL in it (`http://user:secret@host`) written as `***`: what the
    one-line errors, the logs and the run's records show of a URL."""
    return URL_CREDENTIALS.sub(r"\1***@", str(text))


def shown(message) -> str:
    """A whole message of this project's as it is printed (an error's line, a note): inert, never cut, so that a
    path or a value holding ESC, an RLO or a line break shows as escapes, and a URL without its credentials."""
    return inert(message, 1 << 20)


def describe(e: BaseException) -> str:
    """What an exception says, in one line, for the one-line errors: bytes that are not UTF-8 named as such."""
    if isinstance(e, UnicodeError):
        where = f" (byte {e.object[e.start:e.start + 1]!r} at offset {e.start})" if isinstance(
            e, UnicodeDecodeError) else ""
        return f"it is not UTF-8 text{where}"
    return f"{type(e).__name__}: {first_line(e)}"


def file_kind(mode: int) -> Optional[str]:
    """What a file of this st_mode is, in words (`is a FIFO (named pipe)`, ...); None for a regular file."""
    kinds = ((stat.S_ISREG, None), (stat.S_ISDIR, "is a directory"), (stat.S_ISFIFO, "is a FIFO (named pipe)"),
             (stat.S_ISSOCK, "is a socket"), (stat.S_ISCHR, "is a character device"),
             (stat.S_ISBLK, "is a block device"))
    return next((kind for test, kind in kinds if test(mode)), "is not a file")


def not_a_file(path: Path) -> Optional[str]:
    """Why `path` cannot be read as a file, in words (`does not exist`, `is a FIFO (named pipe)`, ...); None for a
    regular file (or a link to one)."""
    try:
        mode = path.stat().st_mode
    except OSError as e:
        return "is a broken symbolic link" if path.is_symlink() else \
            "does not exist" if isinstance(e, FileNotFoundError) else f"cannot be read ({e.strerror or e})"
    return file_kind(mode)


@contextlib.contextmanager
def reading(what: str, fix: str):
    """The one boundary of an input: whatever reading `what` raises (an error of this project's passes as it is)
    becomes a ConfigError, one line naming the input, what is wrong and `fix`. Each input is read inside one; its
    bytes, where the run reads them itself, through read_input."""
    try:
        yield
    except (ConfigError, Fault):
        raise
    except Exception as e:  # any library's, any type: the user needs the input, the first line, the fix
        raise ConfigError(f"{what}: {describe(e)}; {fix}") from None


def sized(limit: int) -> str:
    """A byte count in words: 1 MiB, 256 MiB, 4 GiB."""
    unit = next(u for u in range(4, -1, -1) if limit >= 1 << (10 * u))
    return f"{limit / (1 << (10 * unit)):g} {('bytes', 'KiB', 'MiB', 'GiB', 'TiB')[unit]}"


@contextlib.contextmanager
def input_file(path, what: str, fix: str, limit: int):
    """An input the run reads by path (a --config recipe, accelerate's config, a prompt file, a reward module's
    source, a model's or a dataset's files), opened for reading: only a regular file (or a link to one) of at most
    `limit` bytes, opened without blocking (a FIFO never waits for a writer, a terminal never becomes the run's),
    anything else one ConfigError naming `what` (the input and its path), what it is instead, and `fix`. Yields the
    binary file. read_input reads one whole."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as e:
        with contextlib.suppress(OSError):  # a socket cannot be opened at all (ENXIO): named as what it is
            kind = file_kind(os.stat(path).st_mode)
            if kind:
                raise ConfigError(f"{what} {kind}, not a regular file: {fix}") from None
        problem = "does not exist" if isinstance(e, FileNotFoundError) and not os.path.islink(path) else \
            "is a broken symbolic link" if isinstance(e, FileNotFoundError) else f"cannot be read ({e.strerror or e})"
        raise ConfigError(f"{what} {problem}: {fix}") from None
    info = os.fstat(fd)
    problem = file_kind(info.st_mode) and f"{file_kind(info.st_mode)}, not a regular file" or (
        f"is {info.st_size:,} bytes, over the limit of {sized(limit)} for this input" if info.st_size > limit else None)
    if problem:
        os.close(fd)
        raise ConfigError(f"{what} {problem}: {fix}")
    os.set_blocking(fd, True)
    with os.fdopen(fd, "rb") as file:
        yield file


def read_input(path, what: str, fix: str, limit: int) -> bytes:
    """The bytes of an input the run reads by path, whole (input_file: a regular file within `limit`, or one line);
    a file that grows past `limit` while it is read is refused as well."""
    with input_file(path, what, fix, limit) as file:
        try:
            data = file.read(limit + 1)
        except OSError as e:
            raise ConfigError(f"{what} cannot be read ({e.strerror or e}): {fix}") from None
    if len(data) > limit:
        raise ConfigError(f"{what} is over the limit of {sized(limit)} for this input: {fix}")
    return data


TEXT_LIMIT = 256 << 20  # bytes of a file of a model or a dataset that a library reads whole: a config, a tokenizer
WHOLE_FILES = (".json", ".jinja", ".txt", ".model", ".py", ".yaml", ".md")  # what such a library reads whole


def check_input_directory(path, what: str, fix: str) -> None:
    """A model's or a dataset's local directory, before a library reads it: each file in it and in its
    subdirectories (a DatasetDict's splits, additional chat templates) a regular file, or a link to one, and
    those read whole (WHOLE_FILES: configs, tokenizers, chat templates) at most TEXT_LIMIT bytes (input_file's
    line, naming the file): a FIFO never blocks a loader, /dev/zero never fills the memory. The weights (any other
    name) may be of any size. A broken link is left to the library (it reads only the files it needs)."""
    for entry in sorted(Path(path).iterdir()) + sorted(p for d in Path(path).iterdir() if d.is_dir() and not
                                                       d.name.startswith(".") for p in d.iterdir()):
        if entry.is_dir() or not entry.exists():
            continue
        limit = TEXT_LIMIT if entry.suffix.lower() in WHOLE_FILES else 1 << 62
        with input_file(entry, f"{what}: {inert(entry, 200)}", fix, limit):
            pass


# ---- files of one's own: never written through a link, never a file made by another
def open_own(path: Path, mode: str = "a"):
    """A file of the run's own opened to append to ('a'; 'a+' to read it too), created if missing: never through a
    symbolic link (O_NOFOLLOW), never a FIFO or a device (which would block or swallow the writes), never a file
    that also has another name (a hard link: the writes would land in a file elsewhere). OSError saying why
    otherwise. A file written whole goes through write_own."""
    flags = {"a": os.O_WRONLY, "a+": os.O_RDWR}[mode] | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
    try:
        fd = os.open(path, flags | os.O_CLOEXEC, 0o666)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise OSError(errno.ELOOP, f"{inert(path, 200)} is a symbolic link, which a run never writes through")
        if e.errno == errno.ENXIO:  # a FIFO without a reader, a device without its driver
            raise OSError(errno.ENXIO, f"{inert(path, 200)} is not a regular file")
        raise
    info = os.fstat(fd)
    problem = None if stat.S_ISREG(info.st_mode) else "is not a regular file"
    problem = problem or (f"has {info.st_nlink} names (a hard link), which a run never writes through"
                          if info.st_nlink > 1 else None)
    if problem:
        os.close(fd)
        raise OSError(errno.EPERM, f"{inert(path, 200)} {problem}")
    os.set_blocking(fd, True)
    return os.fdopen(fd, mode)


def new_file(path: Path, binary: bool = False):
    """A file created for writing where none is (O_EXCL: not a link, not a file already there): the debris of an
    earlier attempt of the caller's under that name (a hidden `.NAME.partial`) removed first."""
    path = Path(path)
    path.unlink(missing_ok=True)  # a link itself, never what it points to
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    return os.fdopen(fd, "wb" if binary else "w")


def write_own(path: Path, data: str | bytes) -> None:
    """A file written whole: into a new hidden `.NAME.partial` beside it (new_file), then renamed over `path`, which
    replaces the name (a link there is replaced, never followed); a reader never sees half."""
    path = Path(path)
    partial = path.with_name(f".{path.name}.partial")
    with new_file(partial, binary=isinstance(data, bytes)) as f:
        f.write(data)
    os.replace(partial, path)


FLOAT32_MAX = float(torch.finfo(torch.float32).max)  # 3.4e38: beyond it a value is inf in the tensors it meets


def first_line(e: BaseException, limit: int = SHOWN) -> str:
    """An exception's message in one line of inert text (a library's or user code's words: inert), for one-line
    errors: its first line, or where that is a heading ending in a colon (torch's "Error(s) in loading state_dict
    for X:"), the lines under it too."""
    lines = [line for line in str(e).strip().splitlines() if line.strip()]
    if not lines:
        return type(e).__name__
    return inert(" ".join(lines) if lines[0].rstrip().endswith(":") else lines[0], limit)


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
