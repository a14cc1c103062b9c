"""The prompts: Hub datasets and local files (.jsonl, .json, .csv, compressed or not, .parquet, a save_to_disk
directory), read with one-line diagnostics of what is wrong in them, tokenized (prompt_token_ids) and held to
--max_prompt_length; a batch left-padded; the sampler that draws each rank's prompts of an update (PromptSampler).
"""

import bz2
import contextlib
import gzip
import json
import lzma
import time
from pathlib import Path
from typing import Callable, Literal, Optional

import numpy as np
import torch

from .errors import ConfigError, check_input_directory, describe, first_line, inert, input_file, reading, sized
from .faults import interruptible

__all__ = [  # what this module gives as plumbing.NAME (rloo.py, rloo_multinode.py, the tools, the tests)
    "PROMPT_IDS", "pad_sequences", "load_split", "has_splits", "check_prompt_values", "describe_dropped",
    "describe_prompt_lengths", "PROMPT_CHARS_PER_TOKEN", "cut_prompt", "startup_step", "prepare_prompts",
    "load_prompts", "prompt_token_ids", "PromptSampler",
]

PROMPT_IDS = "prompt_input_ids"  # the tokenized prompt column this script adds to the dataset


def pad_sequences(
    sequences: list[list[int]], pad_id: int, device: torch.device, side: Literal["left", "right"] = "left"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad token lists into (ids, mask), both (N, T_max). Queries are left-padded: generation continues from
    the right edge."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.bool)
    for i, s in enumerate(sequences):
        span = slice(width - len(s), width) if side == "left" else slice(0, len(s))
        ids[i, span], mask[i, span] = torch.tensor(s, dtype=torch.long), True
    return ids.to(device), mask.to(device)


LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}  # datasets' builder of each


COMPRESSIONS = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}  # of the text formats, read by datasets too


FORMATS = ".jsonl/.json/.csv (also .gz/.bz2/.xz) or .parquet file"


DATA_FIX = f"pass a {FORMATS} (UTF-8) or a save_to_disk directory with a prompt column of strings"


DATA_LIMIT = 16 << 30  # bytes of a prompt file, read line by line (and decompressed): larger, a save_to_disk directory
LINE_LIMIT = 64 << 20  # bytes of one line of a JSON lines file


def local_format(path: Path) -> Optional[str]:
    """The datasets builder that reads a local file of this name (x.jsonl, x.csv.gz, x.parquet), None for a name of
    another format."""
    suffixes = [suffix.lower() for suffix in path.suffixes[-2:]]  # PROMPTS.JSONL too
    if suffixes[-1:] and suffixes[-1] in COMPRESSIONS:
        suffixes = [suffix for suffix in suffixes[:-1] if suffix != ".parquet"]  # parquet compresses itself
    return LOCAL_FORMATS.get(suffixes[-1]) if suffixes else None


def is_local_file(name: str) -> bool:
    """Whether a dataset flag names a single local file (by a name of a format read here, or anything there that is
    not a directory: a FIFO, a file of another format), not a save_to_disk directory nor a Hub dataset."""
    path = Path(name)
    return local_format(path) is not None or (path.exists() and not path.is_dir())


def open_bytes(path: Path):
    """The file's bytes, decompressed as its name says."""
    return COMPRESSIONS.get(path.suffix.lower(), open)(path, "rb")


def load_split(name: str, split: str, config: Optional[str]):
    """A dataset split from a local file, a `save_to_disk` directory or the Hub; whatever reading it raises is one
    line naming it (reading)."""
    with reading(f"dataset {name} (split {split!r})", DATA_FIX):
        return _load_split(name, split, config)


def _load_split(name: str, split: str, config: Optional[str]):
    import datasets

    path = Path(name)
    if is_local_file(name):
        return load_local_file(path)
    if path.is_dir():
        check_input_directory(path, f"dataset directory {name}", "put the files written by save_to_disk back")
        try:
            loaded = datasets.load_from_disk(str(path))
        except (FileNotFoundError, ValueError) as e:
            raise ConfigError(f"dataset directory {name} is not a dataset written by save_to_disk "
                              f"({first_line(e)}); pass such a directory or a {FORMATS}") from None
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise ConfigError(f"dataset {name} has no split {split!r}; its splits are {list(loaded)}")
            return loaded[split]
        return loaded
    try:
        return datasets.load_dataset(name, config, split=split)
    except Exception as e:  # the Hub client raises many types; the user needs the first line of any
        raise ConfigError(
            f"could not load dataset {name!r} (split {split!r}) from the Hugging Face Hub: {describe(e)} - without "
            f"network, pass a local {FORMATS} or a save_to_disk directory"
        ) from None


def has_splits(name: str) -> bool:
    """Whether the dataset has named splits: a Hub dataset or a saved DatasetDict does, a single file or a saved
    Dataset does not (any split name would silently give the whole of it)."""
    path = Path(name)
    if is_local_file(name):
        return False
    return not path.is_dir() or (path / "dataset_dict.json").is_file()


def load_local_file(path: Path):
    """A .jsonl/.json/.csv (compressed or not) or .parquet file as one dataset; a file that cannot be read is named
    with its first bad line; anything else at the path (a FIFO, which datasets would read more than once, a file of
    another format) is named as what it is."""
    import datasets

    with input_file(path, f"dataset {path}", DATA_FIX, DATA_LIMIT):  # a regular file, of at most DATA_LIMIT bytes
        pass
    if local_format(path) is None:
        raise ConfigError(f"dataset file {path}: {''.join(path.suffixes[-2:]) or 'a name without a suffix'} is not a "
                          f"format read here; {DATA_FIX}")
    if path.stat().st_size == 0:
        raise ConfigError(f"dataset file {path} is empty")
    # pyarrow takes bytes that are not UTF-8 unchecked
    problem = not_utf8(path) if local_format(path) in ("json", "csv") else None
    if problem:
        raise ConfigError(f"dataset file {path} cannot be read: {problem}: re-encode it as UTF-8 "
                          "(e.g. iconv -f latin1 -t utf-8)")
    problem = bad_json_line(path)
    if problem:
        raise ConfigError(f"dataset file {path} cannot be read: {problem}")
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # it logs its own copy of a parse error first
    try:
        dataset = datasets.load_dataset(local_format(path), data_files=str(path), split="train")
    except Exception as e:  # pyarrow's and datasets' many types; the line that is wrong is what the user needs
        raise ConfigError(f"dataset file {path} cannot be read: {bad_json_line(path) or describe(e)}") from None
    finally:
        datasets.logging.set_verbosity(verbosity)
    if len(dataset) == 0:
        raise ConfigError(f"dataset file {path} has no rows")
    return dataset


def not_utf8(path: Path, chunk: int = 1 << 20) -> Optional[str]:
    """`line N is not UTF-8 text (...)` for the first bytes of the file that are not UTF-8, else None; read in
    chunks by the codec (C speed, constant memory). A compressed file that holds more than DATA_LIMIT bytes is
    refused (a decompression bomb)."""
    import codecs

    decoder, lines, read = codecs.getincrementaldecoder("utf-8")(), 1, 0
    with open_bytes(path) as f:
        while True:
            data = f.read(chunk)
            read += len(data)
            if read > DATA_LIMIT:
                raise ConfigError(f"dataset file {path} holds more than {sized(DATA_LIMIT)} once decompressed: pass a "
                                  "save_to_disk directory of its prompts")
            pending = decoder.getstate()[0]  # a character cut by the chunk's end: its first bytes
            try:
                decoder.decode(data, final=not data)
            except UnicodeDecodeError as e:  # e.start counts from the pending bytes
                seen = pending + data
                line = lines + seen[:e.start].count(b"\n")
                return f"line {line} is not UTF-8 text (byte {seen[e.start:e.start + 1]!r})"
            if not data:
                return None
            lines += data.count(b"\n")


def bad_json_line(path: Path) -> Optional[str]:
    """`line N: what is wrong` for the first line of a JSON-lines file that is not a JSON object (or for a .json
    file that is not JSON, or a list holding something else than objects); None when every line is. Checked before
    datasets reads the file: some files of JSON values that are not objects crash its reader (a segmentation fault,
    datasets 4 with pyarrow 22), which no except clause catches."""
    if local_format(path) != "json":
        return None
    if ".json" in [suffix.lower() for suffix in path.suffixes[-2:]]:
        with open_bytes(path) as f:  # one JSON document: read whole (a byte-order mark too, as datasets does)
            text = f.read().decode("utf-8-sig", errors="replace")
        try:
            whole = json.loads(text)
            if isinstance(whole, list):
                item = next((i for i, row in enumerate(whole) if not isinstance(row, dict)), None)
                return None if item is None else (f"item {item} of its top-level list is a JSON "
                                                  f"{type(whole[item]).__name__}, not an object with a prompt column")
            return None if isinstance(whole, dict) else (f"it holds a JSON {type(whole).__name__}, not a list of "
                                                         "objects with a prompt column")
        except json.JSONDecodeError as whole:
            try:  # JSON lines under a .json name have a valid first line
                json.loads(next((line for line in text.split("\n") if line.strip()), ""))
            except json.JSONDecodeError:
                return f"line {whole.lineno} is not valid JSON ({whole.msg}, column {whole.colno})"
    with open_bytes(path) as f:  # line by line: constant memory, whatever the file's size
        for number, raw in enumerate(iter(lambda: f.readline(LINE_LIMIT + 1), b""), 1):  # split at b"\n" only:
            if len(raw) > LINE_LIMIT:  # JSON strings may hold U+2028 and its kin
                return f"line {number} is over {sized(LINE_LIMIT)}, not a row of prompts"
            line = raw.decode("utf-8-sig" if number == 1 else "utf-8", errors="replace")
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                return f"line {number} is not valid JSON ({e.msg}, column {e.colno})"
            if not isinstance(row, dict):
                return f"line {number} is a JSON {type(row).__name__}, not an object with a prompt column"
    return None


def is_prompt(value) -> bool:
    """A prompt is a string, or chat messages: a list of {"role": ..., "content": ...} dicts."""
    if isinstance(value, str):
        return True
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) and "content" in m for m in value)


def check_prompt_values(rows: dict, indices: list[int], prompt_column: str, name: str) -> None:
    """Refuse, naming the first offending row of a batch, prompts that are neither strings nor chat messages (None,
    numbers) and pre-tokenized queries that are not lists of token ids."""
    if prompt_column in rows:
        column, valid, what = prompt_column, is_prompt, "a string or a list of chat messages"
    else:
        column, what = "query_token", "a list of token ids"
        valid = lambda ids: isinstance(ids, list) and all(isinstance(t, int) for t in ids)  # noqa: E731
    for row, value in zip(indices, rows[column]):
        if not valid(value):
            raise ConfigError(f"dataset {name}, row {row}: column {column!r} holds {inert(repr(value), 60)}, not "
                              f"{what}")


def describe_dropped(dropped: dict[str, int], max_prompt_length: int) -> str:
    return (f"{dropped['too_long']} dropped as longer than {max_prompt_length} tokens"
            + (f", {dropped['empty']} empty" if dropped["empty"] else ""))


def describe_prompt_lengths(dropped: dict[str, int], max_prompt_length: int) -> str:
    """Tokens per prompt before any was dropped: a tokenizer that does not fit the prompts shows here."""
    cut = (f" ({dropped['cut']} longer than {max_prompt_length * PROMPT_CHARS_PER_TOKEN} characters, tokenized that "
           "far only)") if dropped.get("cut") else ""
    return (f"tokens per prompt min {dropped['min_tokens']} / median {dropped['median_tokens']} / max "
            f"{dropped['max_tokens']}{cut}; {describe_dropped(dropped, max_prompt_length)}")


PROMPT_CHARS_PER_TOKEN = 64  # characters per --max_prompt_length token beyond which a prompt is tokenized only that
# far (cut_prompt): text has 3-5 a token, code's runs of spaces a few tens


def cut_prompt(value, limit: int):
    """A prompt (a string, or chat messages: their contents in turn) cut to `limit` characters of text; the same
    object when it has no more."""
    if isinstance(value, str):
        return value if len(value) <= limit else value[:limit]
    if sum(len(m["content"]) for m in value if isinstance(m.get("content"), str)) <= limit:
        return value
    cut = []
    for message in value:
        content = message.get("content")
        if isinstance(content, str):
            message, limit = {**message, "content": content[:limit]}, max(0, limit - len(content))
        cut.append(message)
    return cut


@contextlib.contextmanager
def startup_step(what: str, announce: bool):
    """Rank 0 (`announce`) says what a set-up step did and its time: `what in T s`, then the lines the block adds
    to the list it gets."""
    details: list[str] = []
    start = time.perf_counter()
    yield details
    if announce:
        print(f"{what} in {time.perf_counter() - start:.1f} s" + "".join(f"; {d}" for d in details), flush=True)


def prepare_prompts(dataset, tokenizer, prompt_column: str, max_prompt_length: int, name: str,
                    vocab_size: Optional[int], prompt_token_ids: Callable):
    """Add the PROMPT_IDS column (prompt_token_ids(rows, tokenizer, prompt_column)), drop empty prompts and prompts
    longer than max_prompt_length. Returns (dataset, dropped), dropped = {"empty": count, "too_long": count}. With
    `vocab_size`, token ids the policy cannot embed are refused (a tokenizer of another model, pre-tokenized ids of
    another vocabulary). Whatever reading the rows raises is one line naming the dataset (reading)."""
    with reading(f"dataset {name}", DATA_FIX):
        return _prepare_prompts(dataset, tokenizer, prompt_column, max_prompt_length, name, vocab_size,
                                prompt_token_ids)


def _prepare_prompts(dataset, tokenizer, prompt_column: str, max_prompt_length: int, name: str,
                     vocab_size: Optional[int], prompt_token_ids: Callable):
    import pyarrow.compute as pc

    if prompt_column not in dataset.column_names and "query_token" not in dataset.column_names:
        raise ConfigError(
            f"dataset {name} has no {prompt_column!r} column (string or chat messages) and no pre-tokenized "
            f"'query_token' column; its columns are {dataset.column_names}: pass --prompt_column NAME"
        )

    if PROMPT_IDS in dataset.column_names:  # the column this script adds: it would replace the dataset's silently
        raise ConfigError(f"dataset {inert(name, 120)} has a column {PROMPT_IDS!r}, the name of the column this script "
                          "adds (the prompts' token ids): rename it (pre-tokenized prompts go in 'query_token')")
    limit, cut = max_prompt_length * PROMPT_CHARS_PER_TOKEN, []  # cut: how many prompts were tokenized in part

    def tokenize(rows: dict, indices: list[int]) -> dict:
        """The prompts' token ids, a prompt longer than `limit` characters tokenized that far only (a 200 MB line
        would take minutes and gigabytes): dropped as too long when that part alone has more tokens than
        max_prompt_length, else (a tokenizer of more characters a token) tokenized whole after all."""
        check_prompt_values(rows, indices, prompt_column, name)
        if prompt_column not in rows:  # pre-tokenized
            return {PROMPT_IDS: prompt_token_ids(rows, tokenizer, prompt_column)}
        parts = [cut_prompt(value, limit) for value in rows[prompt_column]]
        ids = prompt_token_ids({**rows, prompt_column: parts}, tokenizer, prompt_column)
        partly = [i for i, (part, value) in enumerate(zip(parts, rows[prompt_column])) if part is not value]
        whole = [i for i in partly if len(ids[i]) <= max_prompt_length]
        if whole:
            again = prompt_token_ids({column: [values[i] for i in whole] for column, values in rows.items()},
                                     tokenizer, prompt_column)
            for i, row_ids in zip(whole, again):
                ids[i] = row_ids
        cut.append(len(partly) - len(whole))
        return {PROMPT_IDS: ids}

    # in memory: no cache files for torchrun's ranks to race on; in a thread: a stop signal acts while it runs
    dataset = interruptible(lambda: dataset.map(tokenize, with_indices=True, batched=True, keep_in_memory=True),
                            f"tokenizing {name}")
    ids = dataset.with_format("arrow")[PROMPT_IDS]  # lengths and extremes in Arrow: no Python list per token
    lowest, highest = pc.min_max(pc.list_flatten(ids)).values()
    if vocab_size is not None and lowest.is_valid and not 0 <= lowest.as_py() <= highest.as_py() < vocab_size:
        row, bad = next((i, t) for i, row_ids in enumerate(dataset[PROMPT_IDS]) for t in row_ids
                        if not 0 <= t < vocab_size)
        raise ConfigError(f"dataset {name}, row {row}: token id {bad} is outside the policy's vocabulary of "
                          f"{vocab_size}: tokenize with the policy's tokenizer")
    lengths = pc.list_value_length(ids).to_numpy(zero_copy_only=False)
    dropped = {"empty": int((lengths == 0).sum()), "too_long": int((lengths > max_prompt_length).sum()),
               "min_tokens": int(lengths.min()), "median_tokens": int(np.median(lengths)),
               "max_tokens": int(lengths.max()), "cut": sum(cut)}
    kept = (lengths > 0) & (lengths <= max_prompt_length)
    dropped["longest_kept"] = int(lengths[kept].max()) if kept.any() else 0  # what the models' positions must hold
    dataset = dataset.select(np.flatnonzero(kept), keep_in_memory=True)
    if len(dataset) == 0:
        raise ConfigError(f"every prompt of {name} is empty or longer than max_prompt_length ({max_prompt_length})")
    return dataset, dropped


def load_prompts(args, tokenizer, vocab_size: Optional[int], prompt_token_ids: Callable):
    """Train prompts tokenized by prompt_token_ids, test prompts (None without --dataset_test_split), and how many
    were dropped (see prepare_prompts); the longest prompt kept, train or test, and its response checked against the
    models' positions (check_positions)."""
    test_is_file = args.dataset_test_split is not None and is_local_file(args.dataset_test_split)
    for flag, split in (("--dataset_train_split", args.dataset_train_split), ("--dataset_test_split",
                                                                               args.dataset_test_split)):
        if split not in (None, "train") and not (flag == "--dataset_test_split" and test_is_file) \
                and not has_splits(args.dataset_name):
            fix = "pass the test prompts as a file: --dataset_test_split test.jsonl" \
                if flag == "--dataset_test_split" else f"drop {flag}"
            raise ConfigError(f"{flag} {split}: dataset {args.dataset_name} has no splits (a single file or saved "
                              f"Dataset is one split, whatever its name); {fix}")
    dataset = load_split(args.dataset_name, args.dataset_train_split, args.dataset_config)
    dataset, dropped = prepare_prompts(dataset, tokenizer, args.prompt_column, args.max_prompt_length,
                                       args.dataset_name, vocab_size, prompt_token_ids)
    eval_dataset, longest = None, dropped["longest_kept"]
    if args.dataset_test_split is not None:
        source = args.dataset_test_split if test_is_file else args.dataset_name
        eval_dataset, eval_dropped = prepare_prompts(load_split(source, args.dataset_test_split, args.dataset_config),
                                                     tokenizer, args.prompt_column, args.max_prompt_length, source,
                                                     vocab_size, prompt_token_ids)
        longest = max(longest, eval_dropped["longest_kept"])
    from .models import check_positions  # models.py reads the data's files through this module

    check_positions(args, longest)
    return dataset, eval_dataset, dropped


def prompt_token_ids(examples: dict, tokenizer, prompt_column: str) -> list[list[int]]:
    """Token ids of a batch of dataset rows: a string prompt, chat messages, or pre-tokenized `query_token`."""
    if prompt_column in examples:
        prompts = examples[prompt_column]
        if prompts and isinstance(prompts[0], list):  # chat messages
            if tokenizer.chat_template is None:
                raise ConfigError(f"column {prompt_column!r} holds chat messages but the tokenizer has no chat "
                                  "template")
            with reading("the tokenizer's chat template", "fix the template (chat_template.jinja or "
                         "tokenizer_config.json) or give the prompts as strings"):
                texts = [tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in prompts]
            return tokenizer(texts, add_special_tokens=False)["input_ids"]
        return tokenizer(prompts)["input_ids"]
    # TL;DR schema: queries pre-tokenized and left-padded with the pad id; strip the padding
    return [[t for t in ids if t != tokenizer.pad_token_id] for ids in examples["query_token"]]


class PromptSampler:
    """Each rank's B prompt indices per update. The dataset is cycled, reshuffled every epoch; every rank
    computes the same permutation from (seed, epoch) and takes its own slice, so no communication is needed."""

    def __init__(self, num_prompts: int, prompts_per_rank: int, rank: int, world_size: int, seed: int):
        self.per_update = prompts_per_rank * world_size
        if num_prompts < self.per_update:
            raise ConfigError(f"the training split has {num_prompts} prompts, fewer than one update takes "
                              f"({prompts_per_rank} per rank x {world_size} ranks); use a larger dataset or smaller "
                              "batches")
        self.num_prompts, self.prompts_per_rank, self.rank, self.seed = num_prompts, prompts_per_rank, rank, seed
        self.epoch, self.position = 0, 0
        self._permutation = self._shuffle()

    def _shuffle(self) -> torch.Tensor:
        return torch.randperm(self.num_prompts, generator=torch.Generator().manual_seed(self.seed + self.epoch))

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        """A saved position, checked against this run's data and batch (a forged or another run's state would draw
        other prompts, or none): an epoch >= 0 and a position that the draws reach, a multiple of the prompts per
        update within the training split."""
        if not isinstance(state, dict) or sorted(state) != ["epoch", "position"] or not all(
                type(state[key]) is int for key in state):
            raise ValueError(f"the sampler's state is {inert(repr(state), 80)}, not {{'epoch': int, 'position': int}}")
        if not 0 <= state["epoch"] < 2**62 or not 0 <= state["position"] <= self.num_prompts or \
                state["position"] % self.per_update:
            raise ValueError(f"the sampler's position {state['position']} (epoch {state['epoch']}) is none that this "
                             f"run reaches: a multiple of its {self.per_update} prompts per update within its "
                             f"{self.num_prompts} prompts, in an epoch >= 0 (the training split or the batch changed "
                             "since it was saved?)")
        self.epoch, self.position = state["epoch"], state["position"]
        self._permutation = self._shuffle()

    def next_indices(self) -> list[int]:
        if self.position + self.per_update > self.num_prompts:  # drop the epoch's remainder, reshuffle
            self.epoch, self.position = self.epoch + 1, 0
            self._permutation = self._shuffle()
        start = self.position + self.rank * self.prompts_per_rank
        self.position += self.per_update
        return self._permutation[start : start + self.prompts_per_rank].tolist()
