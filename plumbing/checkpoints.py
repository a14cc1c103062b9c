"""Checkpoints and run identity: verified saves (a manifest of sizes and sha256s), resume from the newest good one, the
RNG states, the inputs' identities compared on resume, nothing run from a checkpoint's bytes (weights_only loads, the
DCP metadata's pickle read by an allow-list, its shards' other entries as plain values); the Checkpointer rloo.py
calls.
"""

import contextlib
import copy
import errno
import hashlib
import inspect
import io
import json
import math
import pickle
import random
import re
import shutil
import time
import uuid
import warnings
import zipfile
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch
import torch.distributed as dist

from .distributed import barrier, is_fsdp_unit, note_phase, rank0_view, seed_everything, unwrapped
from .errors import (WRITE_ERRORS, ConfigError, Fault, RewardFunctionError, describe, first_line, inert, program,
                     reading, without_credentials)
from .faults import RolloutSourceError
from .folders import Folder, FolderMoved, own_file_system
from .runlog import MetricsWriteError
from .models import AdaptersOff, load_pretrained, save_merged_policy
from .outputdir import (
    ABANDONED,
    CHECKPOINTS,
    MANIFEST,
    RUN_RECORD,
    STEP_DIR,
    TRAINER_STATE,
    OutputDirLock,
    check_output_dir,
    checkpoint_dirs,
    latest_checkpoint,
    move_aside,
    read_json,
    run_record,
    run_ids,
    settle_output_dir,
    steps_to_prune,
    take_output_dir,
)

__all__ = [  # given as plumbing.NAME to rloo.py, rloo_multinode.py and the tools; tests import the rest from the module
    "Generators", "run_inputs", "Checkpointer", "Verdict",
]


def rng_state(sampling: torch.Generator) -> dict:
    """Every generator's state, in tensors and plain values only (what torch.load reads with weights_only)."""
    _, keys, position, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(), "sampling": sampling.get_state(),
             "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "position": int(position),
                       "has_gauss": int(has_gauss), "gauss": float(gauss)}}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict, sampling: torch.Generator) -> None:
    random.setstate(state["python"])
    numpy_state = state["numpy"]
    np.random.set_state(("MT19937", numpy_state["keys"].numpy().astype(np.uint32), numpy_state["position"],
                         numpy_state["has_gauss"], numpy_state["gauss"]))
    torch.set_rng_state(state["torch"])
    sampling.set_state(state["sampling"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class Generators:
    """Every generator of a rank, seeded with `seed`: python's, numpy's, torch's (and CUDA's), and `sampling` (on
    `device`), the one sampling draws from; one part of the checkpoint (state_dict() / load_state_dict()).
    Checkpointer.restore sets them last, to the checkpoint's states on resume and to these seeded ones on a fresh
    start, so that nothing drawn during the set-up (a console, a logger) moves what the first update draws."""

    def __init__(self, seed: int, device: torch.device):
        seed_everything(seed)
        self.sampling = torch.Generator(device).manual_seed(seed)
        self.seeded = self.state_dict()

    def state_dict(self) -> dict:
        return rng_state(self.sampling)

    def load_state_dict(self, state: dict) -> None:
        problem = generators_problem(state, self.sampling.device)
        if problem is not None:  # never half set
            raise ValueError(problem)
        set_rng_state(state, self.sampling)


def generators_problem(state, device: torch.device) -> Optional[str]:
    """Why `state` (Generators.state_dict()'s) cannot set a rank's generators (on `device`), or None: each state tried
    on a scratch generator of its kind, so that a forged or foreign one is refused as a whole, and before any model
    loads (Checkpointer.check_continues)."""
    names = {"python", "torch", "sampling", "numpy"}
    if not isinstance(state, dict) or not names <= state.keys() <= names | {"cuda"}:
        return f"the generators' states are {describe_value(state)}, not {sorted(names)} (and 'cuda' on a GPU)"
    try:
        random.Random().setstate(state["python"])
        numpy_state = state["numpy"]
        np.random.RandomState().set_state(("MT19937", numpy_state["keys"].numpy().astype(np.uint32),
                                           numpy_state["position"], numpy_state["has_gauss"], numpy_state["gauss"]))
        torch.Generator().set_state(state["torch"])
        torch.Generator(device).set_state(state["sampling"])
        if "cuda" in state and torch.cuda.is_available():
            torch.Generator("cuda").set_state(state["cuda"])
    except Exception as e:  # whatever each kind's own check raises (TypeError, ValueError, RuntimeError, KeyError)
        return f"the generators' states cannot be set ({describe(e)})"
    return None


MAX_PICKLE_BYTES = 16 * 2**20  # the values outside tensors of one checkpoint file (the optimizer's layout, flags)


def load_safely(source: Path | io.BytesIO, name: Optional[str] = None):
    """torch.load with weights_only: tensors and plain Python values only, so that reading a checkpoint from
    elsewhere can never run code. Raises ConfigError naming the file (or `name`: what a message calls the source)."""
    name = name or str(source)
    if isinstance(source, Path):  # its values outside tensors unpickled one by one: minutes for an absurd list
        try:
            with zipfile.ZipFile(source) as archive:
                size = sum(info.file_size for info in archive.infolist() if info.filename.endswith("/data.pkl"))
        except (zipfile.BadZipFile, OSError):  # not torch.save's zip format: its whole size
            size = source.stat().st_size if source.is_file() else 0
        if size > MAX_PICKLE_BYTES:
            raise ConfigError(f"{name} holds {size / 2**20:.1f} MiB of values outside tensors, more than a checkpoint "
                              f"of this code writes ({MAX_PICKLE_BYTES // 2**20} MiB): not read") from None
    try:
        return torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        refused = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        raise ConfigError(f"{name} holds {refused.group(1) if refused else 'an object'}, not only tensors and plain "
                          "values: refused, as loading it could run code") from None
    except Exception as e:  # a truncated or foreign file: zip, EOF and OS errors
        raise ConfigError(f"{name} cannot be read ({first_line(e)})") from None


def save_policy(policy, tokenizer, path: Path | Folder, rank: int) -> None:
    """The policy in HF format (with --use_peft, its adapter in peft's format) and its tokenizer in the folder `path`,
    written by rank 0: the libraries write into a private folder of the run's, whose files then take their names in
    `path` (Folder.adopt: none over a name that is taken, none through a link). With FSDP a collective: every rank
    sends its shards to rank 0's CPU first, of the trained parameters alone with LoRA (the adapters whole; the frozen
    base, never saved, stays sharded)."""
    state, adapters = None, hasattr(policy, "peft_config")
    if is_fsdp_unit(policy):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                      ignore_frozen_params=adapters))
    if rank != 0:
        return
    with contextlib.ExitStack() as held:
        folder = path if isinstance(path, Folder) else held.enter_context(Folder.at(path, create=True))
        private = held.enter_context(folder.private(PRIVATE))
        try:
            policy.save_pretrained(private.os_path, state_dict=state)
            tokenizer.save_pretrained(private.os_path)
            if state is not None and not adapters:  # fully_shard renamed the class FSDP<Model>: record the model's own name
                with private.open_read("config.json") as f:
                    config = json.loads(f.read())
                config["architectures"] = [name.removeprefix("FSDP") for name in config.get("architectures") or []]
                private.write("config.json", json.dumps(config, indent=2) + "\n")
            folder.adopt(private)
        finally:
            folder.remove_tree(private.path.name)


PRIVATE = ".partial-"  # the start of the name of a private folder a library writes into (Folder.private)


OPTIMIZER_SHARDS = "optimizer"  # a checkpoint's directory of sharded optimizer state (FSDP)


def save_optimizer_state(model, optimizer, folder: Folder, trainer_state: dict, rank: int) -> None:
    """With FSDP every rank writes its own shard of the optimizer state into the folder's optimizer/ (a collective,
    torch.distributed.checkpoint, through new files only: own_file_system; no rank ever holds the whole); otherwise
    it goes into trainer_state."""
    if not is_fsdp_unit(model):
        trainer_state["optimizer"] = optimizer.state_dict()
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    if rank == 0:
        folder.new_folder(OPTIMIZER_SHARDS).close()
    barrier("saving the optimizer's shards")
    from torch.distributed.checkpoint.api import CheckpointException

    with folder.folder(OPTIMIZER_SHARDS) as shards:
        writer = dcp.FileSystemWriter(shards.os_path)
        writer.fs = own_file_system()
        try:
            dcp.save(get_optimizer_state_dict(model, optimizer), storage_writer=writer)
        except CheckpointException as e:  # a BaseException holding each rank's failure: a full disk, a planted link
            failures = [failure for failure, _ in e.failures.values()]
            raise next((f for f in failures if isinstance(f, WRITE_ERRORS)), OSError(describe(failures[0]))) from None
    trainer_state["optimizer"] = OPTIMIZER_SHARDS


def load_optimizer_state(model, optimizer, checkpoint: Path, trainer_state: dict) -> None:
    if is_fsdp_unit(model):  # each rank reads its own shard
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

        state = get_optimizer_state_dict(model, optimizer)  # the layout to fill, with the state allocated
        read_shards(state, checkpoint / OPTIMIZER_SHARDS)
        set_optimizer_state_dict(model, optimizer, optim_state_dict=state)
    else:
        optimizer.load_state_dict(trainer_state["optimizer"])


def plain_values_load_planner(directory: Path, **options):
    """torch.distributed.checkpoint's default load planner (its `options`), but for the shards' entries that are not
    tensors (the optimizer's hyperparameters): the default unpickles those whole (torch.load with weights_only=False),
    so that a forged shard file could run code; here they are read as tensors and plain values only (load_safely),
    then handed to the default planner as bytes of their own making."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class PlainValuesLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            entry = load_safely(value, f"{directory.name}/*.distcp's entry {read_item.dest_index.fqn!r}")
            value = io.BytesIO()
            torch.save(entry, value)
            value.seek(0)
            super().load_bytes(read_item, value)

    return PlainValuesLoadPlanner(**options)


def read_shards(state: dict, directory: Path, no_dist: bool = False, **options) -> None:
    """torch.distributed.checkpoint's load of `state` (each rank its own share; collective when distributed, unless
    `no_dist`) from `directory` through plain_values_load_planner (its `options`); what it cannot read (a refused
    entry, a missing or truncated shard) is a ConfigError naming it, on every rank."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with warnings.catch_warnings():  # with no_dist: that it loads in one process, which is meant
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            dcp.load(state, checkpoint_id=str(directory), planner=plain_values_load_planner(directory, **options),
                     no_dist=no_dist)
    except CheckpointException as e:  # a BaseException holding each rank's
        failures = [failure for failure, _ in e.failures.values()]
        refused = next((f for f in failures if isinstance(f, ConfigError)), None)
        raise (refused or ConfigError(f"{directory} cannot be read ({describe(failures[0])})")) from None
    except Exception as e:  # a missing or foreign .metadata: OS and pickle errors
        raise ConfigError(f"{directory} cannot be read ({describe(e)})") from None


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def file_digests(root: Path, names: Optional[list[str]] = None) -> dict[str, Optional[dict]]:
    """{path relative to root: {"bytes": size, "sha256": hex digest} (None if missing)} of `names`, or of every
    file under root (as rank 0 sees them). Collective when distributed: each rank hashes a share (checkpoints are
    on a filesystem every rank sees), so that a save or a resume reads each file once, all ranks in parallel."""
    world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    if names is None:
        names = rank0_view(sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()))
    digests = {name: {"bytes": (root / name).stat().st_size, "sha256": sha256_of(root / name)}
               if (root / name).is_file() else None for name in names[rank::world]}
    if world > 1:
        shares = [None] * world
        dist.all_gather_object(shares, digests)
        digests = {name: value for share in shares for name, value in share.items()}
    return digests


def model_identity(path: str, revision: str = "main") -> dict:
    """What a model is: a local directory's files (top level, hidden ones aside) with their sha256, or a Hub
    model's revision: the commit of the snapshot it loads from (at --model_revision for the policy). Collective when
    distributed (file_digests)."""
    root = Path(path)
    if root.is_dir():
        names = sorted(p.name for p in root.iterdir() if p.is_file() and not p.name.startswith("."))
        return {"files": file_digests(root, rank0_view(names))}
    from transformers.utils import cached_file

    config = load_pretrained(cached_file, path, "policy", filename="config.json", revision=revision)  # .../<commit>/
    return {"revision": Path(config).parent.name}


INPUT_FLAGS = ("model_name_or_path", "sft_model_path", "reward_model_path", "dataset_name", "dataset_test_split",
               "reward_fn")  # the flags that name a run's inputs, fingerprinted at its first start


def run_inputs(args, reward_functions: list[tuple[str, Callable]] = ()) -> dict[str, tuple[str, Optional[Path]]]:
    """Each input of the run, by how a message names it: (what the flag says, its local path, or None for a Hub id,
    which is compared by name). A reward function's input is its source file."""
    inputs = {}
    for flag in INPUT_FLAGS[:4]:
        value = getattr(args, flag)
        if value:
            inputs[flag] = (value, Path(value) if Path(value).exists() else None)
    if args.dataset_test_split and Path(args.dataset_test_split).exists():  # else a split's name
        inputs["dataset_test_split"] = (args.dataset_test_split, Path(args.dataset_test_split))
    for spec, (_, fn) in zip(args.reward_fn, reward_functions):
        source = inspect.getsourcefile(inspect.unwrap(fn)) if callable(fn) else None
        inputs[f"reward_fn {spec}"] = (spec, Path(source) if source else None)
    return inputs


def input_identity(value: str, path: Optional[Path], model: bool, revision: str = "main") -> dict:
    """What an input is, to tell on resume whether it changed: a model as model_identity says; a local file or
    directory by its files' sha256 (every file, at any depth); a Hub dataset or a module without a source file by
    its name. The resolved path is kept to report a move, but not compared."""
    if model:
        identity = model_identity(value, revision)
    elif path is None:
        identity = {"name": value}
    elif path.is_dir():
        identity = {"files": file_digests(path)}
    else:
        identity = {"files": file_digests(path.parent, [path.name])}
    return {**identity, "path": str(path.resolve()) if path is not None else value}


def input_identities(args, reward_functions: list[tuple[str, Callable]] = ()) -> dict[str, dict]:
    """Every input's identity (input_identity), by its name in run_inputs. Collective when distributed."""
    policy = ("model_name_or_path", "sft_model_path")  # where --model_revision applies
    return {name: input_identity(value, path, name.endswith("model_path") or name == "model_name_or_path",
                                 args.model_revision if name in policy else "main")
            for name, (value, path) in run_inputs(args, reward_functions).items()}


def check_same_inputs(saved: dict, current: dict, allowed: tuple[str, ...]) -> list[str]:
    """On resume: every input must be the one the run started with (content, not path), unless its flag is in
    --allow_changed_inputs. Returns the notes to print (allowed changes, moved inputs)."""
    notes = []
    for name in sorted(saved.keys() | current.keys()):
        old, new = saved.get(name), current.get(name)
        content = [{k: v for k, v in (x or {}).items() if k != "path"} for x in (old, new)]
        if content[0] != content[1]:
            if old and new and "files" in old and "files" in new:
                what = "these files differ: " + ", ".join(sorted(
                    n for n in old["files"].keys() | new["files"].keys() if old["files"].get(n) != new["files"].get(n)))
            elif old and new:
                what = ", ".join(f"{k} {old.get(k)} -> {new.get(k)}" for k in sorted(old.keys() | new.keys())
                                 if k != "path" and old.get(k) != new.get(k))
            else:
                what = f"{(old or {}).get('path', 'none')} -> {(new or {}).get('path', 'none')}"
            if name.split(" ")[0] in allowed:
                notes.append(f"{name} changed ({what}), allowed by --allow_changed_inputs")
                continue
            raise ConfigError(f"cannot resume: the input --{name} is not the one the run started with ({what}): "
                              f"restore it, or pass --allow_changed_inputs {name.split(' ')[0]} to continue with it "
                              "as it is now")
        if old and new and old.get("path") != new.get("path"):
            notes.append(f"{name} moved ({old.get('path')} -> {new.get('path')}, same content)")
    return notes


# what the metadata of torch.distributed.checkpoint's optimizer shards is made of: nothing that runs code (the
# private names are what torch's pickle refers to, allowed when read, never called here)
DCP_METADATA_GLOBALS = frozenset({
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("collections", "OrderedDict")} | {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "MetadataIndex",
        "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING")})


class MetadataUnpickler(pickle.Unpickler):
    """Reads a pickle, refusing every global but those of DCP_METADATA_GLOBALS and torch's dtypes."""

    def find_class(self, module: str, name: str):
        if (module, name) in DCP_METADATA_GLOBALS or module == "torch" and isinstance(getattr(torch, name, None),
                                                                                      torch.dtype):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name}")


def unsafe_metadata(path: Path) -> Optional[str]:
    """Why torch.distributed.checkpoint must not unpickle this .metadata file (it uses plain pickle), or None."""
    try:
        with open(path, "rb") as f:
            metadata = MetadataUnpickler(f).load()
        files = {info.relative_path for info in metadata.storage_data.values()}
        dict(metadata.state_dict_metadata)  # what unsafe_shards reads next
    except pickle.UnpicklingError as e:
        return f"{path.name} refers to {e}, which could run code when loaded"
    except Exception as e:  # truncated, not a pickle at all, or a pickle of something else
        return f"{path.name} cannot be read ({describe(e)})"
    elsewhere = sorted(name for name in files if not isinstance(name, str) or Path(name).name != name)
    return f"{path.name} names shard files outside its directory ({elsewhere[0]!r})" if elsewhere else None


def unsafe_shards(directory: Path) -> Optional[str]:
    """Why the optimizer shards in `directory` must not be loaded, or None: their metadata (unsafe_metadata), or an
    entry that is not a tensor and holds more than plain values (read here, before any model loads, as the load
    itself reads it: plain_values_load_planner)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    problem = unsafe_metadata(directory / ".metadata")
    if problem is not None:
        return problem
    with open(directory / ".metadata", "rb") as f:
        metadata = MetadataUnpickler(f).load()
    entries = {fqn: None for fqn, kind in metadata.state_dict_metadata.items()
               if isinstance(kind, BytesStorageMetadata)}  # the optimizer's hyperparameters
    try:
        read_shards(entries, directory, flatten_state_dict=False, no_dist=True)  # this rank alone
    except ConfigError as e:
        return str(e)
    return None


def unreadable_weights(path: Path) -> Optional[str]:
    """Why a *.safetensors file is not one (a pickle under that name, bytes cut short), or None: its header read."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as f:
            f.keys()
    except Exception as e:  # safetensors' own error types, and OS errors
        return f"{path.name} is not a safetensors file ({describe(e)})"
    return None


def checkpoint_problem(path: Path) -> Optional[str]:
    """Why a checkpoint cannot be resumed from, or None when it is intact: its manifest (which every save writes
    last) is missing or unreadable, a file it lists is missing or differs in size or sha256, its
    weights are not in safetensors (a pickle is never loaded) or not readable as such, or its optimizer shards hold
    more than tensors and plain values (unsafe_shards). Collective when distributed."""
    shards = path / OPTIMIZER_SHARDS
    try:
        listed = read_json(path, MANIFEST)["files"]
    except FileNotFoundError:
        return f"no {MANIFEST}, which every save writes: a copy that did not finish, or a damaged checkpoint"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{MANIFEST} cannot be read ({type(e).__name__}: {first_line(e)})"
    found = file_digests(path, sorted(listed))
    for name, expected in sorted(listed.items()):
        if found[name] is None:
            return f"{name} is missing"
        if found[name]["bytes"] != expected["bytes"]:
            return f"{name} has {found[name]['bytes']} bytes where the manifest says {expected['bytes']}"
        if found[name]["sha256"] != expected["sha256"]:
            return f"{name} differs from the manifest (sha256)"
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        others = [p.name for p in sorted(path.iterdir()) if p.suffix in (".bin", ".pt", ".pth", ".ckpt")
                  and not RANK_FILE.fullmatch(p.name) and p.name != TRAINER_STATE]
        return f"no weights in safetensors ({', '.join(others) or 'none'} instead): a pickle is never loaded"
    problem = next(filter(None, map(unreadable_weights, weights)), None)
    return problem or (unsafe_shards(shards) if (shards / ".metadata").is_file() else None)


def rank_file(rank: int) -> str:
    """The file of a rank's own parts (every part but the model-sized ones), in each checkpoint."""
    return f"rank{rank}.pt"


RANK_FILE_KEYS = ("run_id", "update", "rank", "parts")  # what a rank file holds: whose parts, and the parts


def rank_file_contents(run_id: Optional[str], update: int, rank: int, parts: dict) -> dict:
    """What rank<r>.pt holds: the rank's own parts ({name: state_dict()}) and what proves whose they are (the run id,
    the update and the rank), checked against the checkpoint's manifest on resume (rank_file_problem)."""
    return {"run_id": run_id, "update": update, "rank": rank, "parts": parts}


def rank_file_problem(saved, name: str, manifest: dict) -> Optional[str]:
    """Why the rank file `name`, as loaded, is not that rank's file of the checkpoint whose manifest is `manifest`
    (another run's, another update's, another rank's, an older format), or None."""
    if not isinstance(saved, dict) or sorted(saved) != sorted(RANK_FILE_KEYS):
        return (f"{name} holds {describe_value(saved) if not isinstance(saved, dict) else sorted(saved)}, not "
                f"{list(RANK_FILE_KEYS)} (written by an older rloo.py, or not by a run)")
    rank = int(name.removeprefix("rank").removesuffix(".pt"))
    for key, expected in (("run_id", manifest.get("run_id")), ("update", manifest.get("update")), ("rank", rank)):
        value = saved[key]
        if type(value) is not type(expected) or value != expected:
            where = "its name" if key == "rank" else MANIFEST
            return f"{name} is of {key.replace('_', ' ')} {inert(repr(value), 80)}, but {where} says {expected!r}"
    if not isinstance(saved["parts"], dict) or not all(isinstance(k, str) for k in saved["parts"]):
        return f"{name}'s parts are {describe_value(saved['parts'])}, not a dict of parts by name"
    return None


def checkpoint_run_id(folder: Folder, name: str) -> Optional[str]:
    """The run id that the checkpoint `name` in `folder` (a step_<n>, or the debris of a save, .tmp_step_<n>) names:
    its manifest's, else its rank0.pt's; None where it names none (a folder of the user's, a link to one, a file)."""
    with contextlib.suppress(OSError, ValueError, ConfigError, AttributeError), folder.folder(
            name, follow=True) as checkpoint:
        if checkpoint.lstat(MANIFEST) is not None:
            with checkpoint.open_read(MANIFEST) as f:
                run_id = json.loads(f.read(1 << 20)).get("run_id")
        else:
            run_id = load_safely(Path(checkpoint.os_path) / rank_file(0), f"{name}/{rank_file(0)}").get("run_id")
        return run_id if isinstance(run_id, str) else None
    return None


def holds_no_file(folder: Folder, name: str) -> bool:
    """Whether the folder `name` (not a link) holds no file at any depth: the debris of a save killed before it wrote
    anything, which removing loses nothing."""
    if not folder.is_folder(name):
        return False
    with folder.folder(name) as inner:
        return all(holds_no_file(inner, entry) for entry in inner.entries())


def remove_own_checkpoint(folder: Folder, name: str, run_id: Optional[str]) -> bool:
    """The checkpoint `name` in `folder` (checkpoints/) removed if it is this run's (checkpoint_run_id: a link by its
    name alone, never followed to remove) or holds no file; False, and nothing removed, otherwise."""
    if folder.lstat(name) is None:
        return True
    if not (run_id is not None and checkpoint_run_id(folder, name) == run_id) and not holds_no_file(folder, name):
        return False
    folder.remove_tree(name)
    return True


def open_checkpoints(output_dir: str, identities: dict, create: bool = False) -> Folder:
    """output_dir/checkpoints, held (a link to a folder followed: on another disk, where the checkpoints live); with
    `identities` ({"output_dir": ..., CHECKPOINTS: ...}, the Folder identities taken at the run's start or first
    save), FolderMoved if either is no longer the folder it was."""
    with Folder.at(output_dir, identities.get("output_dir"), create=create) as root:
        checkpoints = root.folder(CHECKPOINTS, create=create, follow=True)
    if identities.get(CHECKPOINTS) is not None and checkpoints.identity != identities[CHECKPOINTS]:
        checkpoints.close()
        raise FolderMoved(errno.ESTALE, f"{inert(Path(output_dir) / CHECKPOINTS, 200)} is no longer the folder the "
                                        "run started with (renamed, moved or replaced while the run wrote it)")
    return checkpoints


def save_checkpoint(output_dir: str, update: int, model, optimizer, tokenizer, trainer_state: dict, rank: int,
                    save_total_limit: Optional[int], rank_state: dict, identities: Optional[dict] = None) -> Path:
    """Write output_dir/checkpoints/step_<update>: the policy in HF format (loadable on its own) and its
    tokenizer, trainer_state.pt (counters, args; the optimizer, or with FSDP the optimizer/ directory of shards;
    the reference's weights where they changed), every rank's own parts `rank_state` in rank<r>.pt (with the run
    id, the update and the rank: rank_file_contents) and, last, manifest.json with the size and sha256 of every
    file, by which a resume tells an intact checkpoint from a damaged one. Everything goes into a private temporary
    folder first (mode 0700, each file new: no link is followed, nothing is written over), renamed into place once
    complete, so a process killed mid-save leaves the previous checkpoints intact and no half-written step_<n>; a
    save that fails (a full disk) removes its temporary folder and raises a Fault saying so. --save_total_limit
    removes only checkpoints of this run (their run id). `identities`: see open_checkpoints. Multi-node runs need
    output_dir on a shared filesystem: every rank writes its own file there."""
    name, partial = f"step_{update}", f".tmp_step_{update}"
    run_id, what, identities = trainer_state.get("run_id"), f"saving checkpoint {name}", identities or {}
    where = Path(output_dir) / CHECKPOINTS
    writing = f"{where / partial / rank_file(rank)}"
    note_phase(what)
    try:
        if rank == 0:
            with open_checkpoints(output_dir, identities, create=True) as checkpoints:
                if not remove_own_checkpoint(checkpoints, partial, run_id):  # debris of an earlier save of this run
                    raise Fault(f"{Path(output_dir) / CHECKPOINTS / partial} exists and is not this run's: move it "
                                "out of the run's folder, then continue with --resume")
                checkpoints.new_folder(partial).close()  # private while written: 0700
        barrier(what)
        with open_checkpoints(output_dir, identities) as checkpoints, checkpoints.folder(partial) as folder:
            with folder.create(rank_file(rank)) as f:
                torch.save(rank_file_contents(run_id, update, rank, rank_state), f)
            barrier(what)
            writing = f"{where / partial / OPTIMIZER_SHARDS}/" if is_fsdp_unit(model) else "the optimizer's state"
            save_optimizer_state(model, optimizer, folder, trainer_state, rank)
            writing = f"the policy and tokenizer in {where / partial}"
            save_policy(unwrapped(model), tokenizer, folder, rank)
            writing = f"{where / partial / TRAINER_STATE}"
            if rank == 0:
                with folder.create(TRAINER_STATE) as f:
                    torch.save(trainer_state, f)
            barrier(what)
            writing = f"{where / partial / MANIFEST}"
            strange = rank0_view(folder.strange_entries() if rank == 0 else [])
            if strange:  # planted while it was written: nothing was written through it, but it is no checkpoint
                raise OSError(errno.EPERM, f"{partial} holds {inert(strange[0], 120)}, which the run did not write: "
                                           "something else writes in the run's folders")
            digests = file_digests(Path(folder.os_path))
            if rank == 0:
                with folder.create(MANIFEST, binary=False) as f:
                    f.write(json.dumps({"files": digests, "run_id": run_id, "update": update}, indent=1) + "\n")
                folder.chmod()  # readable as the umask says, now that it is whole
                writing = f"{where / name} (renamed from {partial})"
                if not remove_own_checkpoint(checkpoints, name, run_id):  # this run's, written again after a fault
                    raise Fault(f"{Path(output_dir) / CHECKPOINTS / name} exists and is not this run's: the "
                                "checkpoint cannot take its name; move it out of the run's folder, then continue "
                                "with --resume")
                checkpoints.move(partial, checkpoints, name)  # atomic: step_<update> appears complete or not at all
                ours = [int(m.group(1)) for n in checkpoints.entries() if (m := STEP_DIR.match(n))
                        and checkpoint_run_id(checkpoints, n) == run_id]
                for old in steps_to_prune(ours, save_total_limit, update):
                    remove_own_checkpoint(checkpoints, f"step_{old}", run_id)
    except FolderMoved as e:
        raise Fault(f"could not write checkpoint {name}: {e.strerror}; the run's checkpoints are where it left them: "
                    "put the folder back, then continue with --resume") from None
    except WRITE_ERRORS as e:
        if rank == 0:
            with contextlib.suppress(OSError), open_checkpoints(output_dir, identities) as checkpoints:
                checkpoints.remove_tree(partial)
        raise save_failed(e, f"checkpoint {name}", writing, output_dir) from e
    barrier(what)
    return Path(output_dir) / CHECKPOINTS / name


def save_failed(e: BaseException, what: str, writing: str, output_dir: str) -> Fault:
    """A failed save's one line: what could not be written (`writing`) and why, and which checkpoint is intact."""
    previous = latest_checkpoint(output_dir)
    return Fault(f"could not write {what} ({inert(writing, 160)}): {why_not_written(e, output_dir)}; the partial one "
                 "is removed and " + (f"the newest, {previous}, is intact" if previous else "there is no earlier "
                                      "checkpoint") + ": free space (or fix the filesystem) and continue with --resume")


def why_not_written(e: BaseException, output_dir: str) -> str:
    """Why a write failed, in words (torch hides a full disk's ENOSPC in 'unexpected pos 64 vs 0': the OSError it
    met is its context), with the space left on output_dir's filesystem."""
    cause = e if isinstance(e, OSError) else e.__context__ if isinstance(e.__context__, OSError) else e
    why = (cause.strerror + (f": {inert(cause.filename, 120)}" if cause.filename else "")) if isinstance(
        cause, OSError) and cause.strerror else first_line(cause)
    with contextlib.suppress(OSError):
        why += f" ({shutil.disk_usage(output_dir).free / 2**30:.3g} GiB free on its filesystem)"
    return why


def save_final_policy(policy, tokenizer, output_dir: str, rank: int, checkpoint: Optional[Path] = None,
                      run_id: Optional[str] = None) -> list[str]:
    """The finished run's policy and tokenizer in output_dir: hard links to those of `checkpoint`, the final one
    (stored once; a change to either shows in the checkpoint's manifest), copies where the filesystem has no hard
    links, or written (save_policy) when there is no checkpoint. A name that is taken is replaced only if this run
    wrote it (its run record, run `run_id`'s, lists it: an earlier finish); anything else there stops the save. A
    failed write says how to redo it. Returns the names written (on rank 0), which the run record lists as the run's
    own."""
    written = []
    try:
        with contextlib.ExitStack() as held:
            root = held.enter_context(Folder.at(output_dir)) if rank == 0 else None
            if checkpoint is None:  # written by the libraries into a private folder, then moved into place
                with (root.private(PRIVATE) if rank == 0 else contextlib.nullcontext()) as fresh:
                    try:
                        save_policy(policy, tokenizer, fresh, rank)
                        if rank == 0:
                            written = fresh.entries()
                            clear_own_names(root, written, output_dir, run_id)
                            for name in written:
                                fresh.move(name, root)
                    finally:
                        if rank == 0:
                            root.remove_tree(fresh.path.name)
            elif rank == 0:
                source = held.enter_context(Folder.at(checkpoint))
                written = [n for n in source.entries() if not source.is_folder(n) and not source.is_link(n)
                           and n not in (TRAINER_STATE, MANIFEST) and not RANK_FILE.fullmatch(n)]
                clear_own_names(root, written, output_dir, run_id)
                for name in written:
                    try:
                        source.link(name, root)
                    except OSError as e:
                        if e.errno == errno.EEXIST:
                            raise
                        root.copy_from(source, name)  # a filesystem without hard links
    except WRITE_ERRORS as e:
        raise Fault(f"could not write the final policy to {output_dir}: {why_not_written(e, output_dir)}; the final "
                    f"checkpoint {latest_checkpoint(output_dir)} is intact: free space and run the same command with "
                    "--resume to write it") from e
    return written


def clear_own_names(root: Folder, names: list[str], output_dir: str, run_id: Optional[str]) -> None:
    """The final policy's `names` free in output_dir: each one there removed if this run's record lists it (an
    earlier finish of this run); one that no record of this run lists (it appeared while the run ran) is a Fault."""
    record = run_record(Path(root.os_path))
    own = set(record.get("files", [])) if record and record.get("run_id") == run_id else set()
    for name in names:
        if root.lstat(name) is None:
            continue
        if name not in own:
            raise Fault(f"{inert(Path(output_dir) / name, 160)} appeared while the run ran and is not this run's: "
                        "the final policy would take its name; move it, then run the same command with --resume to "
                        "write the final policy")
        root.unlink(name)


RANK_FILE = re.compile(r"rank\d+\.pt")  # rank_file's names
TRAINER_STATE_KEYS = {"update": int, "episode": int, "elapsed": float, "world_size": int,
                      "args": dict, "run_id": str, "inputs": dict, "optimizer": (dict, str)}  # and their types


def trainer_state_problem(state) -> Optional[str]:
    """Why a loaded trainer state is not one this version writes (a foreign, forged or older file), or None."""
    if not isinstance(state, dict):
        return f"{TRAINER_STATE} holds a {type(state).__name__}, not a dict"
    if "run_id" not in state and "update" in state:
        return (f"{TRAINER_STATE} has no run_id: written by an older rloo.py, which did not fingerprint its inputs; "
                "continue it with that version, or start a new run")
    for key, kind in TRAINER_STATE_KEYS.items():
        value = state.get(key)
        if key not in state:
            return f"{TRAINER_STATE} has no {key!r}"
        if isinstance(value, bool) or not isinstance(value, kind if kind is not float else (int, float)):
            expected = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
            return f"{TRAINER_STATE}'s {key!r} is of type {type(value).__name__}, not {expected}"
    if not 0 <= state["update"] < 2**62 or not 0 <= state["world_size"] < 2**31 or not 0 <= state["episode"] < 2**62:
        return f"{TRAINER_STATE}'s update, episode or world_size is out of range"
    if not (math.isfinite(state["elapsed"]) and 0 <= state["elapsed"] < 1e10):  # seconds: over 300 years is junk
        return f"{TRAINER_STATE}'s elapsed time {state['elapsed']!r} is not a finite number of seconds"
    try:  # flags, inputs and ids are plain values: compared with ==, never a tensor or an object
        json.dumps([state["args"], state["inputs"], state["run_id"], state.get("wandb_run_id")], allow_nan=False)
    except (TypeError, ValueError, RecursionError) as e:
        return f"{TRAINER_STATE}'s args or inputs are not plain values ({first_line(e)})"
    return None


def read_checkpoint(path: Path) -> tuple[Optional[dict], Optional[str]]:
    """(its trainer state, None), or (None, why it cannot be resumed from, in one line): intact (checkpoint_problem),
    a trainer state this version writes, of the run and update its manifest names, and one rank file per rank of
    its world size, each of that run, update and rank (rank_file_problem). Collective when distributed."""
    problem = checkpoint_problem(path)
    if problem is not None:
        return None, problem
    try:
        state = load_safely(path / TRAINER_STATE)
        problem = trainer_state_problem(state)
        if problem is not None:
            return None, problem
        manifest = read_json(path, MANIFEST)
        for key in ("run_id", "update"):
            if manifest.get(key) != state[key]:
                return None, (f"{MANIFEST} is of {key.replace('_', ' ')} {inert(repr(manifest.get(key)), 80)}, but "
                              f"{TRAINER_STATE} of {state[key]!r}")
        found = sorted((p.name for p in path.iterdir() if RANK_FILE.fullmatch(p.name)), key=lambda n: (len(n), n))
        world = state["world_size"]
        if found != [rank_file(rank) for rank in range(len(found))] or len(found) != world:
            return None, (f"holds {len(found)} rank files ({', '.join(found[:3])}{', ...' if len(found) > 3 else ''})"
                          f", but a run of world size {world} writes {rank_file(0)} to {rank_file(world - 1)}")
        for name in found:  # read again by restore(): refused here, before any model loads
            if problem := rank_file_problem(load_safely(path / name), name, manifest):
                return None, problem
    except ConfigError as e:
        return None, " ".join(str(e).split())
    except RecursionError:
        return None, f"{TRAINER_STATE} is nested too deeply"
    except (OSError, ValueError, AttributeError) as e:
        return None, f"{MANIFEST} cannot be read ({describe(e)})"
    return state, None


@dataclass
class Resumption:
    checkpoint: Optional[Path]  # None: start fresh
    state: Optional[dict]  # its trainer state
    skipped: dict  # {damaged checkpoint newer than `checkpoint`: why}


def check_of_this_run(path: Path, state: dict, root: Path) -> None:
    """A checkpoint continues the run of output_dir only if its stored update is its directory's and every other
    record of output_dir names its run id."""
    if path.name != f"step_{state['update']}":
        raise ConfigError(f"cannot resume from {path}: it holds update {state['update']}, not that of its directory "
                          f"{path.name} (renamed or copied): move it back to step_{state['update']}, or pass another "
                          "checkpoint")
    others = {where: i for where, i in rank0_view(run_ids(root)).items() if i != state["run_id"]
              and where != f"{CHECKPOINTS}/{path.name}"}
    if others and path.resolve().parent == (root / CHECKPOINTS).resolve():
        where, other = next(iter(sorted(others.items())))
        raise ConfigError(f"cannot resume from {path}: it is a checkpoint of run {state['run_id']}, but {root} holds "
                          f"run {other}'s ({where}): move {path.name} out of {root / CHECKPOINTS}, and continue its "
                          "run with --resume_from it and another --output_dir")


def resume_checkpoint(args, inputs: Optional[dict] = None) -> Resumption:
    """Where the run starts: --resume_from, or with --resume the newest intact checkpoint of output_dir (the
    damaged newer ones it skips are named), or nothing. Refused: the output_dir rules (check_output_dir); a
    damaged --resume_from; --resume when no checkpoint is intact; a checkpoint of another run or in a directory
    not its own (check_of_this_run). Collective when distributed."""
    inputs = run_inputs(args) if inputs is None else inputs
    ours = rank0_view(checkpoint_dirs(args.output_dir))
    root = Path(args.output_dir)
    set_aside = f"--overwrite_output_dir to move them to {root / ABANDONED}/ and start over"
    check_output_dir(args, inputs, ours, set_aside)
    earlier = f"an earlier run (checkpoints up to {ours[0].name})" if ours else ""
    if args.resume_from is not None:
        path = Path(args.resume_from)
        if not (path / TRAINER_STATE).is_file():
            raise ConfigError(f"--resume_from {path}: not a checkpoint (no {TRAINER_STATE}); checkpoints are "
                              f"{root / CHECKPOINTS}/step_<n>")
        state, problem = read_checkpoint(path)
        if problem is not None:
            raise ConfigError(f"--resume_from {path} is damaged: {problem}; pass another checkpoint")
        if ours and path.resolve().parent != (root / CHECKPOINTS).resolve() and not args.overwrite_output_dir:
            raise ConfigError(f"--output_dir {args.output_dir} holds {earlier}, not {path}'s: pass another "
                              f"--output_dir, or {set_aside}")
        check_of_this_run(path, state, root)
        return Resumption(path, state, {})
    if args.resume:
        skipped = {}
        for path in ours:
            state, problem = read_checkpoint(path)
            if problem is None:
                check_of_this_run(path, state, root)
                return Resumption(path, state, skipped)
            skipped[path] = problem
        if skipped:
            raise ConfigError(f"--resume: no checkpoint in {root / CHECKPOINTS} is intact ("
                              + "; ".join(f"{p.name}: {why}" for p, why in skipped.items())
                              + f"): pass --resume_from a checkpoint elsewhere, or without --resume, {set_aside}")
    return Resumption(None, None, {})


def check_resumable(saved: dict, args, world_size: int, saved_world_size: int) -> list[str]:
    """Refuse a resume that would silently be another experiment; return the harmless changes to report. The
    flags that name inputs are compared by what they name (check_same_inputs), not as strings."""
    current = asdict(args)
    # a flag the checkpoint's script does not have (rloo_multinode.py's own, in a rloo.py checkpoint) is no change
    changed = {k: (saved[k], v) for k, v in current.items() if k in saved and saved[k] != v and k not in INPUT_FLAGS}
    refused = sorted(k for k in changed if k not in args.resumable_changes)
    if world_size != saved_world_size:
        refused.append("world size")
        changed["world size"] = (saved_world_size, world_size)
    if refused:
        raise ConfigError("cannot resume: these differ from the checkpoint's run and change its meaning: "
                          + ", ".join(f"{k} ({changed[k][0]!r} -> {changed[k][1]!r})" for k in refused)
                          + "; start a new run in another --output_dir instead")
    return [f"{k} ({old!r} -> {new!r})" for k, (old, new) in sorted(changed.items())
            if k not in ("resume", "resume_from")]


def algorithm_state_values(state) -> dict:
    """The fields of the algorithm's state (a dataclass, rloo.AlgorithmState) as a checkpoint holds them: tensors
    copied to the CPU, plain values (None, bool, int, float, str, and lists, tuples and str-keyed dicts of them) as
    they are; anything else (an object a weights_only load would refuse) raises a TypeError naming it."""

    def plain(value, where: str):
        if torch.is_tensor(value):
            return value.detach().cpu().clone()
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, (list, tuple)):
            return type(value)(plain(v, f"{where}[{i}]") for i, v in enumerate(value))
        if isinstance(value, dict) and all(isinstance(key, str) for key in value):
            return {key: plain(v, f"{where}[{key!r}]") for key, v in value.items()}
        raise TypeError(f"{type(state).__name__}.{where} holds a {type(value).__name__}: a checkpoint keeps tensors "
                        "and plain values (numbers, strings, lists, str-keyed dicts) only; store it as one of those")

    return {f.name: plain(getattr(state, f.name), f.name) for f in fields(state)}


MAX_PLAIN_VALUES = 1_000_000  # numbers and strings outside tensors in one part: more is data, not state


def value_problem(value, like, where: str, counted: Optional[list] = None) -> Optional[str]:
    """Why a checkpoint's `value` cannot stand where the run holds `like` (its field's value now), or None: another
    type (a bool is not a number; an int stands for a float), a number that is not finite, a tensor of another dtype
    or with a non-finite value, a list or tuple of another length where `like` is a fixed-length tuple, a dict with
    other than str keys, more than MAX_PLAIN_VALUES plain values in all. `like` None (an unset field): any of those."""
    counted = [0] if counted is None else counted
    counted[0] += 1
    if counted[0] > MAX_PLAIN_VALUES:
        return f"holds more than {MAX_PLAIN_VALUES:,} values outside tensors (a state keeps statistics, not data)"
    if torch.is_tensor(like) or (like is None and torch.is_tensor(value)):
        if not torch.is_tensor(value) or (like is not None and value.dtype != like.dtype):
            return f"{where} is {describe_value(value)}, not a {like.dtype} tensor"
        local = value.to_local() if hasattr(value, "to_local") else value  # an FSDP shard: this rank's own
        if (local.is_floating_point() or local.is_complex()) and not bool(torch.isfinite(local).all()):
            return f"{where} holds a value that is not finite"
        return None
    if isinstance(like, bool) or (like is None and isinstance(value, bool)):
        return None if isinstance(value, bool) else f"{where} is {describe_value(value)}, not a bool"
    if isinstance(like, (int, float)) or (like is None and isinstance(value, (int, float))):
        if isinstance(value, bool) or not isinstance(value, (float, int) if isinstance(like, float) or like is None
                                                       else int):
            return f"{where} is {describe_value(value)}, not {'an int' if isinstance(like, int) else 'a float'}"
        return None if math.isfinite(value) else f"{where} is {value!r}, not a finite number"
    if isinstance(like, str) or (like is None and isinstance(value, str)):
        return None if isinstance(value, str) else f"{where} is {describe_value(value)}, not a str"
    if isinstance(like, (list, tuple)) or (like is None and isinstance(value, (list, tuple))):
        if not isinstance(value, (list, tuple)) or (isinstance(like, tuple) and len(value) != len(like)):
            return f"{where} is {describe_value(value)}, not a {type(like).__name__} of {len(like)}" \
                if isinstance(like, tuple) else f"{where} is {describe_value(value)}, not a list"
        if len(value) > MAX_PLAIN_VALUES - counted[0]:
            return f"{where} holds {len(value):,} values (a state keeps statistics, not data: keep them as a tensor)"
        for i, item in enumerate(value):
            template = like[i] if isinstance(like, tuple) else None
            if problem := value_problem(item, template, f"{where}[{i}]", counted):
                return problem
        return None
    if isinstance(like, dict) or (like is None and isinstance(value, dict)):
        if not isinstance(value, dict) or not all(isinstance(key, str) for key in value):
            return f"{where} is {describe_value(value)}, not a dict with str keys"
        for key, item in value.items():
            if problem := value_problem(item, like.get(key) if like else None, f"{where}[{key!r}]", counted):
                return problem
        return None
    if like is None and value is None:
        return None
    return f"{where} is {describe_value(value)}, not {describe_value(like)}"


def weights_problem(saved, own: dict) -> Optional[str]:
    """Why `saved` ({name: tensor}) cannot be loaded into a module whose state_dict() is `own`, in words, or None: a
    name missing or extra, a tensor of another shape or dtype, a value that is not finite (value_problem)."""
    if not isinstance(saved, dict):
        return f"are {describe_value(saved)}, not a dict of tensors"
    missing, extra = sorted(own.keys() - saved.keys()), sorted(saved.keys() - own.keys(), key=str)
    if missing or extra:
        return (f"lack {len(missing)} of the reference's tensors ({missing[0]!r}, ...)" if missing else
                f"hold {len(extra)} tensors the reference does not have ({inert(repr(extra[0]), 80)}, ...)")
    for name, tensor in own.items():
        value = saved[name]
        if torch.is_tensor(value) and value.shape != tensor.shape:
            return f"hold {name!r} of shape {tuple(value.shape)}, but the reference's is {tuple(tensor.shape)}"
        if problem := value_problem(value, tensor, f"hold {name!r}, which"):
            return problem
    return None


def describe_value(value) -> str:
    """A value as a one-line message shows it: a short one itself, else its type and size."""
    if torch.is_tensor(value):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    if isinstance(value, (list, tuple, dict)) and len(value) > 4:
        return f"a {type(value).__name__} of {len(value):,} items"
    text = repr(value)
    return f"{text} (a {type(value).__name__})" if len(text) <= 40 else f"a {type(value).__name__}"


class FieldsState:
    """The checkpoint's interface (state_dict() / load_state_dict()) of a dataclass of plain values and tensors, such
    as rloo.AlgorithmState: its fields, tensors copied to the CPU; on load, every field checked against the type of
    the value it holds now (value_problem) and set, bit for bit."""

    def state_dict(self) -> dict:
        return algorithm_state_values(self)

    def load_state_dict(self, saved: dict) -> None:
        names = [f.name for f in fields(self)]
        if not isinstance(saved, dict) or sorted(saved) != sorted(names):
            raise ValueError(f"its fields are {sorted(saved) if isinstance(saved, dict) else saved!r} but "
                             f"{type(self).__name__} has {sorted(names)} (the code changed since it was saved): "
                             "resume with the code that wrote it, or start a new run in another --output_dir")
        counted = [0]
        for name in names:
            problem = value_problem(saved[name], getattr(self, name), f"{type(self).__name__}.{name}", counted)
            if problem:
                raise ValueError(problem)
        for name in names:
            setattr(self, name, saved[name])


class Verdict(FieldsState):
    """A shortcut's verdict (a dataclass with the bools `checked` and `on`), a part of the checkpoint: made with
    checked=True where the run's settings rule the shortcut out, then `checked` by the run's first update, which
    turns it `on` where its check passed. A saved verdict is taken only where these settings could have reached it:
    `on` after a check, and never where the settings rule the shortcut out (a forged verdict, or another run's)."""

    def load_state_dict(self, saved: dict) -> None:
        if isinstance(saved, dict) and saved.get("on") is True and (self.checked or saved.get("checked") is not True):
            raise ValueError(f"{type(self).__name__} says the shortcut is on, which " + (
                "this run's settings rule out" if self.checked else "no check of a first update turned on"))
        super().load_state_dict(saved)


def optimizer_state_problem(saved, optimizer: torch.optim.Optimizer) -> Optional[str]:
    """Why `saved` (an optimizer's state_dict()) cannot be loaded into `optimizer`, or None: not its groups or their
    parameters, a hyperparameter of another type than the optimizer's own (value_problem: three betas, a string lr)
    or out of its range, a per-parameter state of another shape than its parameter, a step that is not a finite
    count >= 0, a value that is not finite."""
    ours = optimizer.state_dict()
    if not isinstance(saved, dict) or not isinstance(saved.get("state"), dict) or \
            not isinstance(saved.get("param_groups"), list):
        return "is not an optimizer's state ({'state': dict, 'param_groups': list})"
    if len(saved["param_groups"]) != len(ours["param_groups"]):
        return f"has {len(saved['param_groups'])} parameter groups, not {len(ours['param_groups'])}"
    parameters = {}  # index in the state_dict -> the parameter
    for i, (group, own, live) in enumerate(zip(saved["param_groups"], ours["param_groups"], optimizer.param_groups)):
        where = f"param_groups[{i}]"
        if not isinstance(group, dict) or sorted(group) != sorted(own):
            return f"{where} has keys {sorted(group) if isinstance(group, dict) else group!r}, not {sorted(own)}"
        if group["params"] != own["params"]:
            return f"{where}['params'] are not the optimizer's {len(own['params'])} parameters"
        parameters.update(zip(own["params"], live["params"]))
        for key, value in group.items():
            if key != "params" and (problem := value_problem(value, own[key], f"{where}[{key!r}]")):
                return problem
        bad = [key for key, ok in (("lr", lambda v: v >= 0), ("eps", lambda v: v > 0),
                                   ("weight_decay", lambda v: v >= 0),
                                   ("betas", lambda v: all(0 <= b < 1 for b in v)))
               if key in group and not ok(group[key])]
        if bad:
            return f"{where}[{bad[0]!r}] is {group[bad[0]]!r}, out of its range"
    adam = isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))
    for index, entry in saved["state"].items():
        where = f"state[{index!r}]"
        if index not in parameters or not isinstance(entry, dict):
            return f"{where} is of no parameter of the optimizer" if index not in parameters else \
                f"{where} is {describe_value(entry)}, not a dict"
        missing = sorted({"step", "exp_avg", "exp_avg_sq"} - entry.keys()) if adam else []
        if missing:
            return f"{where} has no {missing[0]!r}"
        parameter = parameters[index]
        for key, value in entry.items():
            if not torch.is_tensor(value):
                return f"{where}[{key!r}] is {describe_value(value)}, not a tensor"
            if key == "step":
                step = value.to_local() if hasattr(value, "to_local") else value
                if step.numel() != 1 or not bool(torch.isfinite(step).all()) or step.item() < 0 or \
                        step.item() != int(step.item()):
                    return f"{where}['step'] is {describe_value(step) if step.numel() != 1 else step.item()!r}, " \
                           "not a count >= 0"
            elif value.shape != parameter.shape:
                return f"{where}[{key!r}] has shape {tuple(value.shape)}, but its parameter has " \
                       f"{tuple(parameter.shape)}"
            elif problem := value_problem(value, None, f"{where}[{key!r}]"):
                return problem
    return None


def fingerprint(tensors) -> str:
    """The sha256 of these tensors' bytes (an FSDP shard: this rank's own), to tell whether weights changed."""
    digest = hashlib.sha256()
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        digest.update(t.detach().reshape(-1).contiguous().view(torch.uint8).cpu().numpy())
    return digest.hexdigest()


def reference_tensors(reference) -> list:
    """What a reference's fingerprint covers: its state_dict; with --use_peft (AdaptersOff) the policy's base under
    the adapters (its frozen parameters), which no checkpoint saves."""
    if isinstance(reference, AdaptersOff):
        return [p for p in reference.parameters() if not p.requires_grad]
    return list(reference.state_dict().values())


WHOLE_PARTS = ("policy", "tokenizer", "optimizer", "reference")  # model-sized, in their own formats, once per run


class Checkpointer:
    """The run's checkpoints, behind two calls: restore(**parts) is given every stateful part of the run (restored
    from the checkpoint on resume, the generators last), save(update) writes them all. The model-sized parts
    (WHOLE_PARTS: the same on every rank) are written once: the policy in HF format with its tokenizer (a resume
    loads it with load_policy), the optimizer (with FSDP each rank its shard), the reference's weights whenever they
    are no longer those it was loaded with (its fingerprint, compared at each save); every other part is anything
    with state_dict() / load_state_dict() (None: no such part in this run), saved per rank, each rank's in its own
    rank<r>.pt, so that a value a rank holds for itself resumes with that rank's value. Created first thing, it
    takes output_dir (locked: a second run into it stops there) and finds the checkpoint to start from, so that a
    refused resume fails before anything loads."""

    def __init__(self, args, dist_info, lock: OutputDirLock, reward_functions: list[tuple[str, Callable]] = ()):
        self.args, self.dist_info, self.lock, self.reward_functions = args, dist_info, lock, reward_functions
        inputs = run_inputs(args, reward_functions)
        take_output_dir(lock, dist_info.rank, inputs)
        with self.refusal_leaves_nothing():
            start = resume_checkpoint(args, inputs)  # verified; --resume falls back past damaged checkpoints
            self.path, self.state, self.skipped = start.checkpoint, start.state, start.skipped
            self.changes = check_resumable(self.state["args"], args, dist_info.world_size,
                                           self.state["world_size"]) if self.state else []
        self.start_update = self.state["update"] if self.state else 0
        self.wandb_run_id = self.state["wandb_run_id"] if self.state else None
        # the run's identity: drawn at its first start, in args.json, every checkpoint and every metrics line
        self.run_id = self.state["run_id"] if self.state else rank0_view(uuid.uuid4().hex)
        with Folder.at(args.output_dir) as root:  # the folders the run writes in: the same ones until it ends
            self.identities = {"output_dir": root.identity}

    def check_continues(self, num_updates: int, episodes_per_update: int, **parts) -> None:
        """Refuse, before any model loads, a resume past this run's end, of a run whose inputs changed since its
        first start, or whose rank file holds what these `parts` (the per-rank ones the run has by now, by name:
        restore's) or the generators cannot take: each is tried on a copy."""
        if self.state and self.start_update > num_updates:
            raise ConfigError(f"cannot resume: {self.path} is after update {self.start_update}, but this run ends "
                              f"after update {num_updates}: pass --total_episodes "
                              f"{self.start_update * episodes_per_update} or more, or --resume_from an earlier "
                              "checkpoint")
        self.episodes_per_update = episodes_per_update
        self.inputs = input_identities(self.args, self.reward_functions)
        if self.state:
            self.changes += check_same_inputs(self.state["inputs"], self.inputs, self.args.allow_changed_inputs)
            saved = load_safely(self.path / rank_file(self.dist_info.rank))["parts"]  # read_checkpoint checked it
            for name, part in parts.items():
                self.restore_part(name, copy.deepcopy(part), saved)
            if problem := generators_problem(saved.get("generators"), self.dist_info.device):
                raise ConfigError(f"cannot resume from {self.path}: {rank_file(self.dist_info.rank)}'s part "
                                  f"'generators': {problem}: {self.refuse}")

    @contextlib.contextmanager
    def refusal_leaves_nothing(self):
        """For the set-up: a refused run (ConfigError) releases output_dir as it found it."""
        try:
            yield
        except ConfigError:
            self.lock.release()
            raise

    def restore(self, **parts) -> None:
        """Every stateful part of the run, by name (WHOLE_PARTS and the per-rank ones: see the class): remembered for
        the saves and, on resume, restored from the checkpoint, the generators last (nothing may draw from them
        between this and the first update). A part the checkpoint cannot restore exactly (missing, extra, or not
        fitting it) is refused in one line naming the part and the file."""
        self.parts = parts
        self.own = {name: part for name, part in parts.items() if name not in WHOLE_PARTS and part is not None}
        for name, part in self.own.items():
            if not (callable(getattr(part, "state_dict", None)) and callable(getattr(part, "load_state_dict", None))):
                raise TypeError(f"the checkpoint's part {name!r} is a {type(part).__name__}, which has no state_dict() "
                                "and load_state_dict(): give it those (plumbing.checkpoints.FieldsState does, for a "
                                "dataclass)")
        reference = parts.get("reference")
        self.reference_loaded = None if reference is None else fingerprint(reference_tensors(reference))
        self.start_time = time.time()
        if not self.state:
            for part in self.own.values():  # a fresh start's generators: as seeded, whatever the set-up drew
                if isinstance(part, Generators):
                    part.load_state_dict(part.seeded)
            return
        model, optimizer = parts["policy"], parts["optimizer"]
        refuse = self.refuse
        if "reference" in self.state:
            if reference is None or isinstance(reference, AdaptersOff):
                raise ConfigError(f"cannot resume from {self.path}: it holds weights of a reference, which this run "
                                  f"does not have (part 'reference'): {refuse}")
            if problem := weights_problem(self.state["reference"], reference.state_dict()):
                raise ConfigError(f"cannot resume from {self.path}: the reference's weights in {TRAINER_STATE} "
                                  f"{problem}: {refuse}")
            with reading(f"cannot resume from {self.path}: the reference's weights in {TRAINER_STATE}", refuse):
                reference.load_state_dict(self.state["reference"])
        if is_fsdp_unit(model):
            with reading(f"cannot resume from {self.path}: its {OPTIMIZER_SHARDS}/", refuse):
                load_optimizer_state(model, optimizer, self.path, self.state)
            problem = optimizer_state_problem(optimizer.state_dict(), optimizer)
        else:
            problem = optimizer_state_problem(self.state["optimizer"], optimizer)
        if problem:
            where = f"{OPTIMIZER_SHARDS}/" if is_fsdp_unit(model) else TRAINER_STATE
            raise ConfigError(f"cannot resume from {self.path}: the optimizer's state in {where} {problem}: {refuse}")
        if not is_fsdp_unit(model):
            with reading(f"cannot resume from {self.path}: the optimizer's state in {TRAINER_STATE}", refuse):
                optimizer.load_state_dict(self.state["optimizer"])
        own_file = self.path / rank_file(self.dist_info.rank)
        saved = load_safely(own_file)["parts"]  # of this run, update and rank: read_checkpoint checked them all
        for name in sorted(saved.keys() ^ self.own.keys()):
            raise ConfigError(f"cannot resume from {self.path}: part {name!r} is "
                              + (f"in {own_file.name} but not in this run" if name in saved else
                                 f"in this run but not in {own_file.name} (added since it was saved)") + f": {refuse}")
        last = [name for name, part in self.own.items() if isinstance(part, Generators)]
        for name in sorted(self.own, key=lambda name: name in last):  # the generators last
            self.restore_part(name, self.own[name], saved)
        self.start_time -= self.state["elapsed"]

    @property
    def refuse(self) -> str:
        return f"resume with the code and flags that wrote {self.path}, or start a new run in another --output_dir"

    def restore_part(self, name: str, part, saved: dict) -> None:
        """`part` set to its state in this rank's file (`saved`: its parts), or one line saying why it cannot be."""
        if name not in saved:
            raise ConfigError(f"cannot resume from {self.path}: part {name!r} is in this run but not in "
                              f"{rank_file(self.dist_info.rank)} (added since it was saved): {self.refuse}")
        try:
            part.load_state_dict(saved[name])
        except Exception as e:  # a part's own check (FieldsState's), or whatever a part that does not fit raises
            raise ConfigError(f"cannot resume from {self.path}: {rank_file(self.dist_info.rank)}'s part {name!r}: "
                              f"{describe(e) if not isinstance(e, (ValueError, ConfigError)) else first_line(e)}"
                              ) from None

    def notes(self) -> list[str]:
        """Rank 0, before the run writes anything: output_dir settled for this timeline (settle_output_dir), the
        temporary folders of killed saves removed where they are this run's (they can be as large as a checkpoint)
        and set aside in abandoned/ where not; what to print about it."""
        notes = settle_output_dir(self.args, self.start_update, self.skipped, self.run_id)
        with contextlib.suppress(FileNotFoundError), open_checkpoints(self.args.output_dir, self.identities) as \
                checkpoints:
            debris = [name for name in checkpoints.entries() if name.startswith(".tmp_step_")
                      and not remove_own_checkpoint(checkpoints, name, self.run_id)]
            if debris:
                folder = move_aside(self.args.output_dir, [f"{CHECKPOINTS}/{name}" for name in debris], "debris")
                notes.append(f"the temporary folders of saves that did not finish, not this run's ("
                             f"{', '.join(debris)}), moved to {folder}")
        if self.state:
            notes.append(f"resuming from {self.path} after update {self.start_update}"
                         + (f"; changed: {', '.join(self.changes)}" if self.changes else ""))
        return notes

    def save(self, update: int, **states) -> Path:
        """A resumable checkpoint after `update` of every part (restore's), each as its state_dict() gives it now,
        or as `states` give it (by name: the sampler before the oldest batch not yet trained on, the generators at an
        update's start)."""
        trainer_state = {
            "update": update, "episode": update * self.episodes_per_update,
            "elapsed": time.time() - self.start_time, "world_size": self.dist_info.world_size,
            "args": asdict(self.args), "wandb_run_id": self.wandb_run_id, "run_id": self.run_id,
            "inputs": self.inputs,
        }
        reference = self.parts.get("reference")
        now = None if reference is None else fingerprint(reference_tensors(reference))
        prints = [(self.reference_loaded, now)] * self.dist_info.world_size  # every rank's (as loaded, now)
        if dist.is_initialized():
            dist.all_gather_object(prints, prints[0])
        if any(loaded != now for loaded, now in prints):  # on any rank: on every rank alike
            if isinstance(reference, AdaptersOff):
                raise Fault("with --use_peft the reference is the policy's base under its adapters, and its weights "
                            "changed during the run, which no checkpoint keeps (it saves the adapters): change only "
                            "the adapters, or train without --use_peft for a reference of its own")
            if len({now for _, now in prints}) > 1:
                raise Fault("the reference's weights differ between ranks, so one copy cannot be saved: change them "
                            "alike on every rank (from values reduced over ranks)")
            # the same on every rank: rank 0's copy is every rank's
            trainer_state["reference"] = {name: t.detach().cpu() for name, t in reference.state_dict().items()}
        rank_state = {name: states[name] if name in states else part.state_dict() for name, part in self.own.items()}
        if not rank0_view((Path(self.args.output_dir) / CHECKPOINTS).exists()):  # removed meanwhile: a new one
            self.identities.pop(CHECKPOINTS, None)
        path = save_checkpoint(self.args.output_dir, update, self.parts["policy"], self.parts["optimizer"],
                               self.parts["tokenizer"], trainer_state, self.dist_info.rank,
                               self.args.save_total_limit, rank_state, self.identities)
        if CHECKPOINTS not in self.identities:  # the folder of the first save: the one of every later save
            with open_checkpoints(self.args.output_dir, self.identities) as checkpoints:
                self.identities[CHECKPOINTS] = checkpoints.identity
        return path

    def keep(self, finished: int, **states) -> str:
        """After a fault: the state after update `finished` saved (unless it is already; `states`: save's), and how
        to continue."""
        if finished == self.start_update:  # nothing new: the run can start again as it did
            return "no update had finished since the start, nothing new to save; fix it and run the same command"
        path = Path(self.args.output_dir) / CHECKPOINTS / f"step_{finished}"  # saved already when save_steps divides
        path = path if path.is_dir() else self.save(finished, **states)
        return f"checkpoint of update {finished} saved to {path}; fix it, then continue with --resume"

    def states(self) -> dict:
        """Every per-rank part's state now, copied: at an update's start, what a stop or a fault during it saves."""
        return copy.deepcopy({name: part.state_dict() for name, part in self.own.items()})

    @contextlib.contextmanager
    def kept_if_rollouts_fail(self, finished: int, states: dict):
        """Around taking a batch from the rollout source: where it fails (RolloutSourceError), the state after update
        `finished` is intact: saved (with `states`: save's), and the error says where, then stops the run."""
        try:
            yield
        except RolloutSourceError as e:
            path = self.save(finished, **states)
            raise RolloutSourceError(f"{e}; checkpoint of update {finished} saved to {path}") from None

    def fault(self, e: Fault, update: int, after: dict, restart: dict, logger) -> None:
        """A fault during `update`: a reward function's (every rank at once) keeps the last finished update (keep:
        this one's with `after`'s states when it came after training, else the one before with `restart`'s, the
        states at this update's start) and raises it again saying where, or, when a stop signal came while a reward
        function ran, stops as a signal does; metrics rank 0 could not write (MetricsWriteError) keep this update
        in one process (a checkpoint needs every rank: torchrun stops the others)."""
        if isinstance(e, RewardFunctionError):
            where = self.keep(update, **after) if e.after_training else self.keep(update - 1, **restart)
            if e.signal_name is None:
                raise RewardFunctionError(f"{e}; {where}", e.announce) from None
            return self.stopped(logger, f"{e.signal_name} received while a reward function ran: stopped at once")
        where = "no checkpoint: it needs every rank (torchrun stops the others)" if dist.is_initialized() else \
            self.keep(update, **after)
        raise MetricsWriteError(f"{e} after update {update}; {where}") from None

    def finish(self, policy, num_updates: int, logger) -> None:
        """The end of a finished run: the final policy and tokenizer (save_final), the merged model with
        --merge_lora, then on rank 0 (the one with a logger), last, args.json: their presence marks a finished run."""
        self.save_final(policy, num_updates)
        if self.args.merge_lora and self.dist_info.master:
            save_merged_policy(self.args, policy.config, self.parts["tokenizer"])
        if logger is not None:
            self.mark_finished()
            logger.say(f"saved the policy and tokenizer to {self.args.output_dir}")

    def save_final(self, policy, num_updates: int) -> None:
        """The finished run's policy and tokenizer in output_dir, stored once with the final checkpoint's (the one
        this run wrote, or resumed from, as rank 0 sees it)."""
        final = Path(self.args.output_dir) / CHECKPOINTS / f"step_{num_updates}"
        self.final_files = save_final_policy(policy, self.parts["tokenizer"], self.args.output_dir, self.dist_info.rank,
                                             final if rank0_view(final.is_dir()) else None, self.run_id)

    def mark_finished(self) -> None:
        """Rank 0, last: the run record args.json (its flags, run_id and the files it wrote at the top of output_dir,
        which run_owned reads), whose presence with the policy marks a finished run."""
        flags = {k: without_credentials(v) if isinstance(v, str) else v for k, v in asdict(self.args).items()}
        record = {**flags, "run_id": self.run_id, "files": getattr(self, "final_files", [])}
        try:
            with Folder.at(self.args.output_dir, self.identities["output_dir"]) as root:
                root.write(RUN_RECORD, json.dumps(record, indent=2))
        except WRITE_ERRORS as e:
            raise Fault(f"could not write {Path(self.args.output_dir) / RUN_RECORD}: "
                        f"{why_not_written(e, self.args.output_dir)}; the final policy is written: run the same "
                        "command with --resume to finish") from None

    def stopped(self, logger, what: str) -> None:
        """After a stop signal, on rank 0 (the one with a logger): the marker job scripts requeue on, naming the newest
        checkpoint, and a line saying `what` happened and how to continue."""
        if logger is None:
            return
        path = latest_checkpoint(self.args.output_dir)
        where = "no update had finished, nothing to save" if path is None else \
            f"checkpoint of update {path.name.removeprefix('step_')} saved to {path}"
        try:
            self.lock.mark_preempted(str(path or where))
        except OSError as e:  # output_dir moved away meanwhile, a full disk: said, the stop stands
            where += f" (output_dir/preempted could not be written: {e.strerror or e})"
        logger.say(f"{program()}: {what}; {where}; continue with the same command and --resume")
