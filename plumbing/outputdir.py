"""The output directory: one run at a time (a lock), the names of the files a run writes and what it owns, no input or
other run's file written over, work set aside in abandoned/ and never deleted.
"""

import atexit
import contextlib
import fcntl
import fnmatch
import hashlib
import itertools
import json
import os
import re
import socket
import sys
import time
import zlib
from pathlib import Path
from typing import Optional

from .distributed import rank0_view
from .errors import ConfigError, inert, not_a_file, program
from .folders import Folder
from .faults import signals_held

__all__ = [  # given as plumbing.NAME to rloo.py, rloo_multinode.py and the tools; tests import the rest from the module
    "LOCK", "ABANDONED", "OutputDirLock", "run_record", "run_owned", "check_outputs", "check_new_output_dir",
    "written_by", "marked_text",
]

CHECKPOINTS = "checkpoints"


STEP_DIR = re.compile(r"^step_(\d+)$")


TRAINER_STATE = "trainer_state.pt"


MANIFEST = "manifest.json"  # written last into a checkpoint: the size and sha256 of each of its other files


PREEMPTED = "preempted"  # in output_dir while a run stopped by a signal waits to be resumed; job scripts requeue on it


LOCK = "run.lock"  # flock'ed by the run that writes to output_dir, and holding its pid and host


ABANDONED = "abandoned"  # output_dir/abandoned/<time>_<why>/: work a run set aside (never deleted)


MERGED = "merged"  # output_dir/merged: --merge_lora's policy, written with the final one


RUN_OUTPUTS = (CHECKPOINTS, "metrics.jsonl*", "curves.png", PREEMPTED, "nonfinite", "wandb", "tensorboard", LOCK,
               ABANDONED, "engine_*.log", "engines.json", "lora_sync")  # what a run writes before it ends (the last
# three: rloo_multinode.py's; lora_sync/ holds the adapter `vllm serve` loads at a sync)


# ---- output_dir: one run at a time, nothing deleted
class OutputDirLock:
    """An exclusive advisory lock (flock) on output_dir/run.lock, held from acquire() until release() or this
    process exits; the OS releases it then, so a crash never leaves a stale lock. A second run into the same
    output_dir (a job submitted twice, a requeue while the old job still runs) stops at acquire(), naming the
    holder's pid and host. rloo.main makes one at its start and holds it for the whole run: rank 0 acquires it
    (take_output_dir), the stop signals consult it."""

    def __init__(self, output_dir: str):
        self.output_dir = output_dir
        self.file = None  # the lock file, open while held
        self.identity = None  # output_dir's (Folder.identity), once held: the folder the run writes in
        self.created: list[Path] = []  # the directories made for it, the deepest first

    @property
    def held(self) -> bool:
        return self.file is not None

    def acquire(self) -> None:
        if self.held:
            return
        path = Path(self.output_dir)
        created = [d for d in (path, *path.parents) if not d.exists()]
        try:
            with Folder.at(path, create=True) as root:
                lock = root.append(LOCK, "a+")  # a backup's hard link (cp -al) keeps the old file
                self.identity = root.identity
                at_path = root.lstat(LOCK)
        except OSError as e:
            raise ConfigError(f"cannot write to --output_dir {inert(self.output_dir, 120)}: {e.strerror or e}"
                              ) from None
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if at_path is None or os.fstat(lock.fileno()).st_ino != os.stat(path / LOCK).st_ino:  # removed by the
                lock.close()  # run that held it between our open and our flock: lock the file now at that path
                return self.acquire()
        except FileNotFoundError:  # removed by the run that held it after our flock: the same
            lock.close()
            return self.acquire()
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "a process that has not written its pid yet"
            lock.close()
            raise ConfigError(f"--output_dir {inert(self.output_dir, 120)} is in use by another run "
                              f"({inert(holder)}): wait for it to end or stop it, or pass another --output_dir"
                              ) from None
        except OSError as e:  # a filesystem without locks (Lustre without -o flock, some NFS setups)
            print(f"{program()}: warning: cannot lock --output_dir {inert(self.output_dir, 120)} "
                  f"({e.strerror or e}): a second run into it would not be stopped", file=sys.stderr)
        lock.seek(0)
        lock.truncate()
        lock.write(f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        lock.flush()
        self.file, self.created = lock, created
        atexit.register(self.release)  # whatever ends the run (sys.exit, an exception), but os._exit and SIGKILL

    def mark_preempted(self, note: str) -> None:
        """The marker job scripts requeue on (PREEMPTED), saying what a resume starts from."""
        with Folder.at(self.output_dir, self.identity) as root:
            root.write(PREEMPTED, f"{note}\n")

    def release(self) -> None:
        """When the run ends (finished, refused, stopped, failed), by the process that holds it: the lock file
        removed (while still locked: a run that opened it meanwhile sees it gone and locks the new one), and after
        a refused start the directories made for it if they are empty."""
        if not self.held:
            return
        with contextlib.suppress(OSError), Folder.at(self.output_dir, self.identity) as root:  # moved: left there
            at_path = root.lstat(LOCK)
            if at_path is not None and at_path.st_ino == os.fstat(self.file.fileno()).st_ino:
                root.unlink(LOCK)  # its own lock file, never one that another run made since
        self.file.close()
        self.file = None
        for directory in self.created:
            try:
                directory.rmdir()
            except OSError:  # not empty
                break


def path_problem(path: str, below: int = 0) -> Optional[str]:
    """Why nothing can be made at `path`, found before anything is written, in words: a name or a whole path longer
    than its file system takes (with `below` more bytes: the longest path a run writes under its output_dir), a
    file (or a FIFO, a device) on the way to it; None if none of these (what is at the path itself is the caller's
    to judge; a read-only or full file system shows when it is written)."""
    absolute = Path(os.path.abspath(path))
    existing = next((p for p in absolute.parents if os.path.lexists(p)), absolute)  # `/` at least
    limits = existing if existing.is_dir() else existing.parent
    name_max, path_max = os.pathconf(limits, "PC_NAME_MAX"), os.pathconf(limits, "PC_PATH_MAX")
    long = next((part for part in absolute.parts if len(os.fsencode(part)) > name_max), None)
    if long is not None:
        return f"has a name of {len(os.fsencode(long))} bytes, but its file system takes at most {name_max}"
    if len(os.fsencode(str(absolute))) + below >= path_max:
        return (f"is a path of {len(os.fsencode(str(absolute)))} bytes" + (
            f", and the run's files below it take up to {below} more," if below else ",")
            + f" but the system takes at most {path_max - 1}")
    if not existing.is_dir():
        return f"passes through {existing}, which {not_a_file(existing) or 'is a file'}"
    return None


OWN_ENTRIES = {  # what a run's entry at the top of output_dir holds when a run wrote it: a file's first bytes, a
    # directory's entries (rloo_multinode.py's engine logs and placement: any regular file)
    LOCK: re.compile(rb"(pid \d+ on .*, since |$)"),
    "metrics.jsonl*": re.compile(rb'(\{"update": |$)'),
    "curves.png": lambda path: written_by(path) is not None,  # a PNG of this project's: its mark
    PREEMPTED: re.compile(rb"(.*/)?checkpoints/step_\d+\n|stopped during start-up|no update had finished"),
    CHECKPOINTS: re.compile(r"\.?(tmp_)?step_\d+"),
    "nonfinite": re.compile(r"\.?update_\d+_rank_\d+\.jsonl(\.partial)?"),  # (a batch written whole: .partial first)
    "tensorboard": re.compile(r"events\.out\.tfevents\..*"), ABANDONED: re.compile(r"\d{8}-\d{6}_.*"),
    "engine_*.log": None, "engines.json": None, "lora_sync": re.compile(r"rloo-[0-9a-f]{8}-v\d+"),
}


def foreign_entry(entry: Path) -> Optional[str]:
    """Why an entry of output_dir under one of a run's names is not a run's, in words, or None: a symbolic link
    (a run writes through none; output_dir/checkpoints alone may be one to a directory, on another disk), another
    kind of file than the run writes there, or what no run writes (a user's own curves.png or preempted, a folder
    of theirs named checkpoints). wandb/ is wandb's, a folder per run, never written over: not judged."""
    pattern = next((OWN_ENTRIES[n] for n in OWN_ENTRIES if fnmatch.fnmatchcase(entry.name, n)), "")
    if pattern == "":  # the finished run's record and policy files: judged by check_output_dir, links here
        return "is a symbolic link" if entry.is_symlink() else None
    if entry.is_symlink() and not (entry.name == CHECKPOINTS and entry.is_dir()):
        return "is a symbolic link"
    if isinstance(pattern, re.Pattern) and isinstance(pattern.pattern, str):  # a directory of the run's
        if not entry.is_dir():
            return "is not a directory"
        strange = sorted(p.name for p in entry.iterdir() if not pattern.fullmatch(p.name))
        links = sorted(p.name for p in entry.iterdir() if p.is_symlink() and entry.name != CHECKPOINTS)
        return f"holds {inert(strange[0], 80)}, which no run writes there" if strange else \
            f"holds the symbolic link {inert(links[0], 80)}" if links else None
    if not entry.is_file():
        return "is not a regular file"
    if pattern is None:  # a file with other names (a backup by `cp -al`) is fine: the run writes a copy of its own
        return None
    if not isinstance(pattern, re.Pattern):
        return None if pattern(entry) else "holds what no run of this project wrote"
    try:
        with open(entry, "rb") as f:
            head = f.read(4096)
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    return None if pattern.match(head) else "holds what no run of this project wrote"


def foreign_entries(root: Path) -> list[str]:
    """`NAME (why)` of each entry of output_dir under a run's name that is not a run's (foreign_entry)."""
    if not root.is_dir():
        return []
    names = [p for p in root.iterdir() if any(fnmatch.fnmatchcase(p.name, n) for n in (*OWN_ENTRIES, RUN_RECORD,
                                                                                        MERGED, *POLICY_FILES))]
    found = [(p, why) for p in sorted(names) if (why := foreign_entry(p))]
    return [f"{inert(p.name, 80)} ({why})" for p, why in found]


RUN_PATHS_BELOW = 200  # bytes: the longest path a run writes below output_dir, with room (abandoned/<time>_<why>/
# checkpoints/step_<n>/<a tokenizer's or a shard's file>)


def take_output_dir(lock: OutputDirLock, rank: int, inputs: Optional[dict] = None) -> None:
    """Before anything is read from output_dir, rank 0 makes it this run's: refused if empty or if it is, holds or
    lies inside one of the run's `inputs` (run_inputs), so that not even the lock is written there; locked (`lock`
    acquired), the marker of an earlier stop removed (a resume that then fails or is refused is not requeued
    forever). The temporary folders of killed saves are the Checkpointer's (notes)."""
    if not lock.output_dir.strip():
        raise ConfigError(f"--output_dir {lock.output_dir!r} is empty: pass a directory (`.` for this one)")
    path = Path(lock.output_dir)
    problem = path_problem(lock.output_dir, below=RUN_PATHS_BELOW)
    if problem is None and path.exists() and not path.is_dir():
        problem = not_a_file(path) or "is a file"
    if problem is None and Path(os.path.abspath(path)).parent == Path(os.path.abspath(path)):
        problem = "is the root directory, which holds the whole system"
    if problem:
        raise ConfigError(f"--output_dir {inert(lock.output_dir, 120)} {problem}: pass a directory")
    check_no_input_inside(lock.output_dir, inputs or {})
    if rank != 0:
        return
    foreign = foreign_entries(path)
    if foreign:
        raise ConfigError(f"--output_dir {inert(lock.output_dir, 120)} holds {', '.join(foreign[:3])} under the "
                          "name of a file a run writes, which no run wrote: a run writes only files it made; move "
                          "it, or pass another --output_dir")
    lock.acquire()
    with Folder.at(path, lock.identity) as root:
        root.unlink(PREEMPTED)  # a run's (foreign_entries said so)


def steps_to_prune(steps: list[int], keep: Optional[int], newest: int) -> list[int]:
    """The checkpoints --save_total_limit `keep` removes: all but the newest `keep`, never `newest` (the one just
    written); None keeps all."""
    if keep is None:
        return []
    if keep < 1:
        raise ValueError(f"save_total_limit = {keep} would remove the checkpoint just written")
    others = sorted(s for s in steps if s != newest)
    return others[: max(0, len(others) - (keep - 1))]


def checkpoint_dirs(output_dir: str) -> list[Path]:
    """The complete step_<n> directories, newest first; temporary directories are never candidates."""
    root = Path(output_dir) / CHECKPOINTS
    steps = [(int(m.group(1)), d) for d in root.glob("step_*") if (m := STEP_DIR.match(d.name))
             and ((d / MANIFEST).is_file() or (d / TRAINER_STATE).is_file())] if root.is_dir() else []
    return [d for _, d in sorted(steps, reverse=True)]


def latest_checkpoint(output_dir: str) -> Optional[Path]:
    """The complete step_<n> directory with the largest n (not verified: see resume_checkpoint)."""
    return next(iter(checkpoint_dirs(output_dir)), None)


RUN_RECORD = "args.json"  # written last by a finished run: its flags, run_id, and the files it wrote in output_dir


POLICY_FILES = ("config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json", "tokenizer*",
                "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt", "chat_template.*",
                "*.model", "adapter_config.json")  # what a finished run may write at the top of output_dir


def read_json(folder: Path, name: str, limit: int = 64 << 20):
    """The JSON file `name` in `folder` (a manifest, a run record), read only where it is a regular file (never
    through a link, never a FIFO, which would block) of at most `limit` bytes. OSError or ValueError otherwise."""
    with Folder.at(folder) as held, held.open_read(name) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{name} is larger than {limit} bytes")
    return json.loads(data)


def run_record(root: Path) -> Optional[dict]:
    """A finished run's record (args.json holding a run_id), or None: an args.json without one is not this
    project's, as a user's model directory may hold one."""
    try:
        record = read_json(root, RUN_RECORD)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("run_id"), str) else None


def run_owned(root: Path) -> list[str]:
    """The entries of output_dir that runs of this project wrote, which alone a run may move or write over:
    those of RUN_OUTPUTS, and a finished run's record with the files it lists (its policy and tokenizer) and
    merged/. Everything else is the user's and is never touched."""
    if not root.is_dir():
        return []
    record = run_record(root)
    listed = {RUN_RECORD, MERGED, *[n for n in record.get("files", []) if isinstance(n, str)]} if record else set()
    return sorted(p.name for p in root.iterdir()
                  if p.name in listed or any(fnmatch.fnmatchcase(p.name, n) for n in RUN_OUTPUTS))


def path_forms(path: Path) -> set[Path]:
    """A path as typed (made absolute) and with its symlinks resolved: both are compared."""
    return {Path(os.path.abspath(path)), path.resolve()}


def same_file(a: Path, b: Path) -> bool:
    """Whether two paths name one file: as typed (`./x` and `x`), through symbolic links, or by device and inode
    (a hard link, a bind mount, another case of a name on a case-insensitive file system)."""
    if path_forms(a) & path_forms(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet)
        return False


# ---- a script's mark: in the metadata of what it writes, never found in a file's text
PNG_MARK = b"rloo written by"  # the keyword of a PNG text chunk of this project's own: `SCRIPT sha256 <digest>`
TEXT_MARK = re.compile(r"<!-- written by (\S{1,200}); sha256 of the text above: ([0-9a-f]{64}) -->\n?")  # last line
MARK_READ = 64 << 20  # bytes of a file read to find its mark: more is no file a script of this project writes


def png_chunks(data: bytes) -> Optional[list[tuple[int, int, bytes, bytes]]]:
    """A PNG's chunks as (start, end, type, data), or None for bytes that are not a whole PNG."""
    if not data.startswith(b"\x89PNG\r\n\x1a\n"):
        return None
    chunks, at = [], 8
    while at + 12 <= len(data):
        length, kind = int.from_bytes(data[at:at + 4], "big"), data[at + 4:at + 8]
        end = at + 12 + length
        if end > len(data):
            return None
        chunks.append((at, end, kind, data[at + 8:at + 8 + length]))
        at = end
        if kind == b"IEND":
            return chunks if at == len(data) else None
    return None


def marked_png(data: bytes, writer: str) -> bytes:
    """A PNG (as matplotlib writes it) with `writer`'s mark: a text chunk of this project's own after the header,
    holding the script's name and the sha256 of the file without that chunk. The digest is what proves the file is
    the script's: a text chunk alone can be copied into any picture, or kept by an editor that changed the image; a
    mark whose digest matches says the bytes are exactly what the script drew, so that replacing them loses nothing
    it cannot draw again."""
    header_end = png_chunks(data)[0][1]
    text = PNG_MARK + b"\x00" + f"{writer} sha256 {hashlib.sha256(data).hexdigest()}".encode()
    chunk = len(text).to_bytes(4, "big") + b"tEXt" + text + zlib.crc32(b"tEXt" + text).to_bytes(4, "big")
    return data[:header_end] + chunk + data[header_end:]


def marked_text(text: str, writer: str) -> str:
    """A Markdown report with `writer`'s mark as its last line: the script's name and the sha256 of the text above
    it, so that a quote of the mark in a user's notes, or a report edited since, is no mark."""
    text = text if text.endswith("\n") else text + "\n"
    digest = hashlib.sha256(text.encode()).hexdigest()
    return f"{text}<!-- written by {writer}; sha256 of the text above: {digest} -->\n"


def written_by(path: Path) -> Optional[str]:
    """Which script of this project wrote the file at `path`, from the mark it left in what it wrote, or None (a
    user's file, a model's, one edited since): a PNG's own text chunk whose digest matches the rest (marked_png); a
    Markdown report's last line whose digest matches the text above (marked_text); a JSON file whose top-level
    object's first key is "written_by" (a report), or whose first line is such an object (a JSON-lines file the
    script appends to). A mark quoted anywhere else in a file is text, not a mark."""
    try:
        with open(path, "rb") as f:
            data = f.read(MARK_READ + 1)
    except OSError:
        return None
    if len(data) > MARK_READ:
        data = data[:MARK_READ]
        chunks = None
    else:
        chunks = png_chunks(data)
    if chunks is not None:
        marks = [(start, end, body) for start, end, kind, body in chunks if kind == b"tEXt"
                 and body.partition(b"\x00")[0] == PNG_MARK]
        if len(marks) != 1:
            return None
        start, end, body = marks[0]
        writer, _, digest = body.partition(b"\x00")[2].decode("latin-1").rpartition(" sha256 ")
        return writer if digest == hashlib.sha256(data[:start] + data[end:]).hexdigest() and writer else None
    text = data.decode("utf-8", errors="replace")
    head, _, last = text.rstrip("\n").rpartition("\n")
    found = TEXT_MARK.fullmatch(last + "\n")
    if found and found.group(2) == hashlib.sha256((head + "\n").encode()).hexdigest():
        return found.group(1)
    for candidate in (text, text.partition("\n")[0]):  # a whole JSON report, or a JSON-lines file's first line
        try:
            value = json.loads(candidate)
        except ValueError:
            continue
        if isinstance(value, dict) and next(iter(value), None) == "written_by" and isinstance(
                value["written_by"], str):
            return value["written_by"]
    return None


def check_outputs(outputs: list[tuple[str, Path]], inputs: list[tuple[str, Path]], writer: str,
                  overwrite: bool = False) -> None:
    """Before a script writes anything: each file it writes is none of the files it reads (same_file) nor inside
    an input directory, and if it exists a file (not a directory, a FIFO, a device, a symbolic link) that `writer`
    (the script) wrote (written_by: it replaces its own output), at a path that can be (path_problem); each named
    by the flag that gives it. Refused in one line, so that a typo never replaces an input, a model, a run's file
    or a script of the repository; `overwrite` (the script's explicit flag) lets it replace a file it did not
    write, never an input."""
    for output_flag, output in outputs:
        problem = path_problem(str(output))
        if problem:
            raise ConfigError(f"{output_flag} {inert(output, 120)} {problem}: pass another {output_flag}")
        for input_flag, source in inputs:
            inside = source.is_dir() and any(held in out.parents for out in path_forms(output)
                                             for held in path_forms(source))
            if inside or same_file(output, source):
                raise ConfigError(f"{output_flag} {inert(output, 120)} is {'inside ' if inside else ''}the input "
                                  f"{input_flag} {inert(source, 120)}: it would be written over; pass another "
                                  f"{output_flag}")
        if output.is_symlink():
            raise ConfigError(f"{output_flag} {inert(output, 120)} is a symbolic link, which is never written "
                              f"through: pass another {output_flag}")
        if output.exists() and not_a_file(output):
            raise ConfigError(f"{output_flag} {inert(output, 120)} {not_a_file(output)}: pass the path of a file to "
                              "write")
        if output.exists() and not overwrite and written_by(output) != writer:
            raise ConfigError(f"{output_flag} {inert(output, 120)} exists and {writer} did not write it: it would "
                              f"be replaced; pass a new path, or move that file")


def check_new_output_dir(output_dir: str, inputs: dict[str, tuple[str, Optional[Path]]]) -> None:
    """For a script that writes its files into output_dir without a run's bookkeeping (the TRL drivers of the
    benchmarks): a new or empty directory, at a path that can be one, neither being, holding nor inside an input;
    else refused in one line, before anything loads: what is there would be written over."""
    path = Path(output_dir)
    problem = path_problem(output_dir) or (not_a_file(path) or "is a file" if path.exists() and not path.is_dir()
                                           else None)
    if problem:
        raise ConfigError(f"--output_dir {inert(output_dir, 120)} {problem}: pass a new or empty directory")
    check_no_input_inside(output_dir, inputs)
    held = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
    if held:
        raise ConfigError(f"--output_dir {output_dir} holds {', '.join(held[:3])}{', ...' if len(held) > 3 else ''}: "
                          "this script writes metrics.jsonl and the policy there, over what is there; pass a new or "
                          "empty directory")


def check_no_input_inside(output_dir: str, inputs: dict[str, tuple[str, Optional[Path]]]) -> None:
    """output_dir neither is, holds nor lies inside an input (any local path of run_inputs), the paths compared
    as typed and with their symlinks resolved."""
    for name, (value, path) in inputs.items():
        if path is None:
            continue
        for out in path_forms(Path(output_dir)):
            for held in path_forms(path):
                if out == held or out in held.parents or held in out.parents:
                    where = "is" if out == held else "holds" if out in held.parents else "is inside"
                    what = name if name.startswith("reward_fn ") else f"{name} {value}"  # the name has the spec
                    raise ConfigError(f"--output_dir {output_dir} {where} the input --{what}: a run "
                                      "must never move or write over its inputs; pass another --output_dir")


def check_output_dir(args, inputs: dict[str, tuple[str, Optional[Path]]], ours: list[Path], set_aside: str) -> None:
    """The output_dir rules, before anything loads: no input inside it or around it (check_no_input_inside);
    another run's files (checkpoints, a finished run's record) are refused unless the run continues them
    (--resume, --resume_from) or --overwrite_output_dir sets them aside; a file the final policy would write over
    that is not a run's is refused. Other files (a log, notes, .git) are the user's: fine."""
    root = Path(args.output_dir)
    check_no_input_inside(args.output_dir, inputs)
    owned = rank0_view(run_owned(root))
    record = rank0_view(run_record(root) is not None)
    if (ours or record) and not (args.resume or args.resume_from or args.overwrite_output_dir):
        what = f"checkpoints up to {ours[0].name}" if ours else "a finished run"
        raise ConfigError(f"--output_dir {root} holds another run's files ({what}): pass --resume to continue it, "
                          f"another --output_dir, or {set_aside}")
    if record and not ours and not args.overwrite_output_dir:  # nothing to continue: its files would be written over
        raise ConfigError(f"--output_dir {root} holds a finished run without checkpoints: nothing to resume; pass "
                          f"another --output_dir, or {set_aside}")
    written = (RUN_RECORD, *POLICY_FILES, *(["README.md"] if args.use_peft else []))  # peft writes a model card
    foreign_policy_files = rank0_view(sorted(
        p.name for p in root.iterdir() if p.name not in owned and p.is_file() and any(
            fnmatch.fnmatchcase(p.name, n) for n in written)) if root.is_dir() else [])
    if foreign_policy_files:
        raise ConfigError(f"--output_dir {root} holds {', '.join(foreign_policy_files[:4])}, which no run of this "
                          "project wrote and the finished run would write over: move them, or pass another "
                          "--output_dir")


def run_ids(root: Path) -> dict[str, str]:
    """{where: run id} of every record in output_dir that names one: each checkpoint's manifest, the finished run's
    record, metrics.jsonl (its last line with one)."""
    ids = {}
    for path in checkpoint_dirs(str(root)):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            ids[f"{CHECKPOINTS}/{path.name}"] = read_json(path, MANIFEST).get("run_id")
    if (record := run_record(root)) is not None:
        ids[RUN_RECORD] = record["run_id"]
    with contextlib.suppress(OSError):
        for line in (root / "metrics.jsonl").read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError, AttributeError):
                ids["metrics.jsonl"] = json.loads(line).get("run_id") or ids.get("metrics.jsonl")
    return {where: i for where, i in ids.items() if isinstance(i, str)}


def move_aside(output_dir: str, names: list[str], why: str) -> Path:
    """Move these entries of output_dir (paths relative to it, none through a link but output_dir/checkpoints) into
    a new output_dir/abandoned/<time>_<why>/, where they keep their relative paths. Signals wait until every entry
    has moved."""
    root = Path(output_dir)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    with Folder.at(output_dir) as top, top.folder(ABANDONED, create=True) as abandoned:
        for n in itertools.count(1):
            try:
                folder = f"{stamp}_{why}" + (f"_{n}" if n > 1 else "")
                abandoned.new_folder(folder, 0o777).close()
                break
            except FileExistsError:
                continue
        with abandoned.folder(folder) as into, signals_held():
            for name in names:
                *parents, entry = name.split("/")
                with contextlib.ExitStack() as held:
                    source, target = top, into
                    for part in parents:
                        source = held.enter_context(source.folder(part, follow=part == CHECKPOINTS))
                        target = held.enter_context(target.folder(part, create=True))
                    source.move(entry, target)
    return root / ABANDONED / folder


def settle_output_dir(args, start_update: int, skipped: dict, run_id: Optional[str] = None) -> list[str]:
    """Rank 0, before the run writes anything: what output_dir holds beyond the update the run starts from is
    moved to output_dir/abandoned/ (nothing is deleted). With --overwrite_output_dir, every run-owned file
    (run_owned) and nothing else. Otherwise the checkpoints of later updates (another timeline, after
    --resume_from an older one, or damaged ones --resume skipped) and the metrics.jsonl lines after that update or
    of another run id (those of a timeline abandoned, of updates that a killed run logged but did not checkpoint,
    of an earlier run). Then --resume and metrics.jsonl only ever see the timeline being continued. Returns the
    lines to print."""
    root = Path(args.output_dir)
    if args.overwrite_output_dir:
        names = [n for n in run_owned(root) if n not in (LOCK, ABANDONED, "wandb")]  # wandb/: a folder per run,
        # other projects' too where output_dir is shared (home): nothing of it is written over
        if not names:
            return []
        folder = move_aside(args.output_dir, names, "overwritten")
        return [f"--overwrite_output_dir: the earlier run's files ({', '.join(names)}) moved to {folder}"]
    later = [d for d in reversed(checkpoint_dirs(args.output_dir)) if int(d.name.removeprefix("step_")) > start_update]
    metrics = root / "metrics.jsonl"
    kept, dropped = [], []
    for line in metrics.read_text(errors="replace").splitlines(keepends=True) if metrics.is_file() else []:
        try:
            record = json.loads(line)
            (kept if record["update"] <= start_update and record.get("run_id") == run_id else dropped).append(line)
        except (ValueError, KeyError, TypeError, AttributeError):  # a line cut short by a kill
            dropped.append(line)
    if not later and not dropped:
        return []
    folder = move_aside(args.output_dir, [f"{CHECKPOINTS}/{d.name}" for d in later], f"after_update_{start_update}")
    reasons = [f"{d.name}: {skipped[d]}" for d in later if d in skipped]
    with Folder.at(args.output_dir) as top, top.folder(ABANDONED) as abandoned, abandoned.folder(folder.name) as into:
        if dropped:
            with into.create("metrics.jsonl", binary=False) as f:
                f.write("".join(dropped))
            top.write("metrics.jsonl", "".join(kept))
        with into.create("why.txt", binary=False) as f:
            f.write(f"set aside when a run continued from update {start_update}, on "
                    f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n" + "".join(f"{r}\n" for r in reasons))
    lines = [f"skipped damaged checkpoint {r}" for r in reasons]
    return lines + [f"continuing from update {start_update}: moved what lies after it ("
                    + ", ".join([d.name for d in later] + ([f"{len(dropped)} metrics.jsonl lines"] if dropped else []))
                    + f") to {folder}"]
