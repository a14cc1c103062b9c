"""The output directory's rules (only the run's own files are touched, inputs never inside it), the run identity
every checkpoint and metrics line carries, the inputs checked on resume, and the checkpoint reader under malformed
trainer states. In process where the rule is a function; end to end for what only a run shows."""

import dataclasses
import io
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import plumbing
from plumbing.checkpoints import (TRAINER_STATE_KEYS, check_resumable, check_same_inputs, file_digests,
                                  input_identities, load_safely, read_checkpoint, resume_checkpoint, save_checkpoint)
from plumbing.outputdir import MANIFEST, TRAINER_STATE, foreign_entries, settle_output_dir
import rloo
from conftest import REPO, read_metrics, script_command, script_env
from helpers import PER_UPDATE, RUN, fake_run, forge_manifest, policy_tokenizer, saved_steps, trainer_state, tree


# ---------------------------------------------------------------- the output directory's rules, over layouts
def layout(root: Path, name: str) -> tuple[Path, dict]:
    """A directory layout under root: (the cwd to run in, the flags); root/work is the cwd."""
    work = root / "work"
    (work / "inputs" / "policy").mkdir(parents=True)
    (work / "inputs" / "policy" / "config.json").write_text("{}")
    (work / "inputs" / "train.jsonl").write_text('{"prompt": "a"}\n')
    (work / "rewards.py").write_text("def f(**kwargs):\n    return None\n")
    flags = {"model_name_or_path": "inputs/policy", "dataset_name": "inputs/train.jsonl"}
    out = work / "out"
    if name == "new directory":
        pass
    elif name == "empty directory":
        out.mkdir()
    elif name == "a foreign log and notes":
        out.mkdir()
        (out / "log").write_text("rloo.py ...\n")
        (out / "notes.md").write_text("my notes\n")
    elif name == "a git checkout as .":
        (work / ".git").mkdir()
        (work / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
        (work / "rloo.py").write_text("# a copy\n")
        flags = {"model_name_or_path": str(root / "policy"), "dataset_name": str(root / "train.jsonl")}
        (root / "policy").mkdir()
        (root / "train.jsonl").write_text("{}\n")
        out = Path(".")
    elif name in ("another run", "another run, --overwrite_output_dir", "another run, --resume"):
        out.mkdir()
        fake_run(out, [1, 2])
    elif name == "a finished run whose checkpoints are gone, --resume":
        out.mkdir()
        fake_run(out, [1])
        for step in (out / "checkpoints").iterdir():
            (step / "manifest.json").unlink()
    elif name == "a user's model directory as output_dir":  # not an input of this run: config.json is the user's
        out.mkdir()
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_text("")
        (out / "args.json").write_text("{}")  # another tool's: no run id
    elif name == "holds the policy":
        out = work / "inputs"
    elif name == "is the policy":
        out = work / "inputs" / "policy"
    elif name == "inside the policy":
        out = work / "inputs" / "policy" / "run"
    elif name == "holds the data file":
        out = work / "inputs"
        flags = {"model_name_or_path": str(root / "elsewhere"), "dataset_name": "inputs/train.jsonl"}
    elif name == "holds the reward module":
        out = Path(".")
        flags = {"model_name_or_path": str(root / "elsewhere"), "dataset_name": "org/data", "reward_fn": ("rewards:f",)}
    elif name == "a parent of the cwd":
        out = Path("..")
    elif name == "the policy with a trailing slash and ./":
        out = Path("./inputs/policy/")
    elif name == "a symlink to the policy":
        (work / "link").symlink_to(work / "inputs" / "policy")
        out = work / "link"
    elif name == "a symlink to an input inside":
        out.mkdir()
        (out / "policy_link").symlink_to(work / "inputs" / "policy")
        flags = {**flags, "model_name_or_path": "out/policy_link"}
    elif name == "a symlink to a fresh directory":
        (root / "real_out").mkdir()
        (work / "out_link").symlink_to(root / "real_out")
        out = work / "out_link"
    elif name == "empty path":
        out = ""
    return work, {**flags, "output_dir": str(out)}


LAYOUTS = {  # layout: the verdict, None (accepted) or a fragment of the one-line refusal
    "new directory": None,
    "empty directory": None,
    "a foreign log and notes": None,
    "a git checkout as .": None,
    "a symlink to a fresh directory": None,
    "another run": "holds another run's files (checkpoints up to step_2): pass --resume",
    "another run, --overwrite_output_dir": None,
    "another run, --resume": "--resume: no checkpoint in",  # refused at its (fake) checkpoints, not the directory
    "a finished run whose checkpoints are gone, --resume": "holds a finished run without checkpoints: nothing to",
    "a user's model directory as output_dir": "holds args.json, config.json, model.safetensors, which no run of",
    "holds the policy": "holds the input --model_name_or_path inputs/policy",
    "is the policy": "is the input --model_name_or_path inputs/policy",
    "inside the policy": "is inside the input --model_name_or_path inputs/policy",
    "holds the data file": "holds the input --dataset_name inputs/train.jsonl",
    "holds the reward module": "holds the input --reward_fn rewards:f",
    "a parent of the cwd": "holds the input --model_name_or_path inputs/policy",
    "the policy with a trailing slash and ./": "is the input --model_name_or_path inputs/policy",
    "a symlink to the policy": "is the input --model_name_or_path inputs/policy",
    "a symlink to an input inside": "holds the input --model_name_or_path out/policy_link",
    "empty path": "--output_dir '' is empty: pass a directory",
}


@pytest.mark.parametrize("name", LAYOUTS, ids=list(LAYOUTS))
def test_the_output_dir_rules_over_layouts_touch_nothing_but_the_runs_files(tmp_path, monkeypatch, name):
    work, flags = layout(tmp_path, name)
    monkeypatch.chdir(work)
    monkeypatch.syspath_prepend(str(work))
    monkeypatch.delitem(sys.modules, "rewards", raising=False)
    args = rloo.Args(**flags, overwrite_output_dir="overwrite" in name, resume="--resume" in name)
    functions = plumbing.load_reward_functions(args.reward_fn)
    before = tree(tmp_path)
    lock = plumbing.OutputDirLock(args.output_dir)
    try:
        plumbing.Checkpointer(args, SimpleNamespace(rank=0, world_size=1), lock, functions)  # as rloo.main does
        verdict = None
    except plumbing.ConfigError as e:
        verdict = str(e)
        assert "\n" not in verdict
    finally:
        lock.release()
    expected = LAYOUTS[name]
    assert verdict is None if expected is None else expected in (verdict or ""), verdict
    assert tree(tmp_path) == before  # the checks move, write and delete nothing
    assert not (work / plumbing.LOCK).exists() and not (work / "out" / plumbing.LOCK).exists()
    if verdict is None and args.overwrite_output_dir:  # exactly the run's own files move aside, nothing else
        settle_output_dir(args, 0, {}, "run-b")
        after = tree(tmp_path)
        moved = {n for n in before if n not in after}
        assert moved == {n for n in before if n.startswith("work/out/") and (
            n.split("/")[2] in ("checkpoints", "metrics.jsonl", "args.json", "model.safetensors", "config.json",
                                "tokenizer.json"))}
        kept = {n for n in before if n.startswith("work/out/.git") or n.endswith(("my_plot.png", "notes.txt"))}
        assert kept <= set(after)


def test_an_overwrite_of_dot_in_a_git_checkout_moves_only_the_runs_files(tmp_path, monkeypatch):
    """Issue 32, example 1: `--output_dir . --overwrite_output_dir` moved .git, rloo.py and notes to abandoned/."""
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (tmp_path / "plumbing").mkdir()
    for name in ("rloo.py", "plumbing/__init__.py", "notes.md"):
        (tmp_path / name).write_text("kept\n")
    fake_run(tmp_path / "tmp", [1])  # a run's files, then moved up into the checkout
    for entry in (tmp_path / "tmp").iterdir():
        if entry.name not in (".git", "notes.txt", "my_plot.png"):
            entry.rename(tmp_path / entry.name)
    monkeypatch.chdir(tmp_path)
    args = rloo.Args(output_dir=".", overwrite_output_dir=True)
    resume_checkpoint(args)
    settle_output_dir(args, 0, {}, "run-b")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".git", "abandoned", "notes.md", "plumbing", "rloo.py",
                                                          "tmp"]
    (aside,) = (tmp_path / "abandoned").iterdir()
    assert sorted(p.name for p in aside.iterdir()) == ["args.json", "checkpoints", "config.json", "metrics.jsonl",
                                                      "model.safetensors", "tokenizer.json"]


def test_a_foreign_log_is_no_reason_to_refuse_the_run_carries_its_id_and_leaves_no_lock(assets, tmp_path):
    """Issue 32, example 1's reverse: `python rloo.py --output_dir runs/x > runs/x/log` was refused."""
    out = tmp_path / "runs" / "x"
    out.mkdir(parents=True)
    args = ["--model_name_or_path", assets["policy"], "--dataset_name", assets["train"], "--output_dir", out, *RUN,
            "--total_episodes", PER_UPDATE]
    with open(out / "log", "w") as log:
        result = subprocess.run(script_command("rloo.py", *args), stdout=log, stderr=subprocess.PIPE, text=True,
                                env=script_env(), timeout=600, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "update 1/1" in (out / "log").read_text()
    assert not (out / plumbing.LOCK).exists()  # a finished run leaves no lock
    record = json.loads((out / "args.json").read_text())
    run_id = record["run_id"]
    assert {m["run_id"] for m in read_metrics(out)} == {run_id}
    state = load_safely(out / "checkpoints" / "step_1" / TRAINER_STATE)
    assert state["run_id"] == run_id and set(state["inputs"]) == {"model_name_or_path", "dataset_name",
                                                                  "reward_fn reward_fns:count_a"}
    assert "model.safetensors" in record["files"] and plumbing.run_owned(out) == sorted(
        ["args.json", "checkpoints", "curves.png", "metrics.jsonl", *record["files"]])
    # an empty --output_dir is refused, and nothing is written into the cwd
    refused = subprocess.run(script_command("rloo.py", *args[:-4], "--output_dir", ""), capture_output=True,
                             text=True, env=script_env(), timeout=600, cwd=tmp_path)
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
        "rloo.py: error: --output_dir '' is empty: pass a directory (`.` for this one)"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]


# ---------------------------------------------------------------- the run identity
def test_a_checkpoint_of_another_run_or_another_update_is_refused(tmp_path):
    """Issue 32, example 2: a checkpoint of another run copied into checkpoints/ was resumed, two runs mixed."""
    saved_steps(tmp_path / "a", [1, 2], run_id="run-a")
    saved_steps(tmp_path / "b", [3], run_id="run-b")
    os.replace(tmp_path / "b" / "checkpoints" / "step_3", tmp_path / "a" / "checkpoints" / "step_3")
    args = rloo.Args(output_dir=str(tmp_path / "a"), resume=True)
    with pytest.raises(plumbing.ConfigError, match=r"it is a checkpoint of run run-b, but .* holds run run-a's "
                                                   r"\(checkpoints/step_1\): move step_3 out of .*--resume_from it"):
        resume_checkpoint(args)
    # renamed: step_3 of run a holds update 2
    os.replace(tmp_path / "a" / "checkpoints" / "step_3", tmp_path / "b" / "checkpoints" / "step_3")
    os.replace(tmp_path / "a" / "checkpoints" / "step_2", tmp_path / "a" / "checkpoints" / "step_3")
    with pytest.raises(plumbing.ConfigError, match="it holds update 2, not that of its directory step_3 .renamed"):
        resume_checkpoint(args)
    with pytest.raises(plumbing.ConfigError, match="it holds update 2, not that of its directory step_3"):
        resume_checkpoint(rloo.Args(output_dir=str(tmp_path / "c"),
                                    resume_from=str(tmp_path / "a" / "checkpoints" / "step_3")))
    # run b's checkpoint continued in a directory of its own: accepted
    start = resume_checkpoint(rloo.Args(output_dir=str(tmp_path / "c"),
                                        resume_from=str(tmp_path / "b" / "checkpoints" / "step_3")))
    assert start.state["run_id"] == "run-b"
    # metrics lines of another run are never kept as this run's
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "metrics.jsonl").write_text('{"update": 1, "run_id": "run-x"}\n'
                                                  '{"update": 2, "run_id": "run-b"}\n')
    settle_output_dir(rloo.Args(output_dir=str(tmp_path / "c")), 3, {}, "run-b")
    assert read_metrics(tmp_path / "c") == [{"update": 2, "run_id": "run-b"}]


def test_a_legacy_checkpoint_without_a_run_id_is_refused_in_one_line(tmp_path):
    saved_steps(tmp_path, [1])
    step = tmp_path / "checkpoints" / "step_1"
    state = trainer_state(1)
    del state["run_id"]
    write_state(step, state)
    with pytest.raises(plumbing.ConfigError, match="trainer_state.pt has no run_id: written by an older rloo.py"):
        resume_checkpoint(rloo.Args(output_dir=str(tmp_path), resume_from=str(step)))


def test_every_input_is_fingerprinted_and_a_change_is_refused_unless_allowed(assets, tmp_path, monkeypatch):
    """Issue 32, example 2: a reward model or data file replaced between start and resume went unnoticed; the same
    model written `a/policy/` or by its absolute path was refused."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("policy", "reward_model"):
        (tmp_path / "a" / name).mkdir(parents=True)
        for f in assets[name].iterdir():
            (tmp_path / "a" / name / f.name).write_bytes(f.read_bytes())
    (tmp_path / "train.jsonl").write_bytes(assets["train"].read_bytes())
    (tmp_path / "test.jsonl").write_bytes(assets["test"].read_bytes())
    (tmp_path / "my_rewards.py").write_text("def f(**kwargs):\n    return None\n")
    flags = dict(model_name_or_path="a/policy/", reward_model_path="./a/reward_model", dataset_name="train.jsonl",
                 dataset_test_split="test.jsonl", reward_fn=("my_rewards:f",))
    args = rloo.Args(**flags)
    functions = plumbing.load_reward_functions(args.reward_fn)
    saved = input_identities(args, functions)
    assert set(saved) == {"model_name_or_path", "reward_model_path", "dataset_name", "dataset_test_split",
                          "reward_fn my_rewards:f"}
    same = rloo.Args(**{**flags, "model_name_or_path": str(tmp_path / "a" / "policy"),
                        "reward_model_path": "a/reward_model/"})
    assert check_same_inputs(saved, input_identities(same, functions), ()) == []
    assert check_resumable(dataclasses.asdict(args), same, 1, 1) == []  # the same inputs, other spellings
    edits = {"reward_model_path": tmp_path / "a" / "reward_model" / "model.safetensors",
             "dataset_name": tmp_path / "train.jsonl", "dataset_test_split": tmp_path / "test.jsonl",
             "reward_fn my_rewards:f": tmp_path / "my_rewards.py"}
    for name, path in edits.items():
        original = path.read_bytes()
        path.write_bytes(original + b"\n")
        with pytest.raises(plumbing.ConfigError, match=(
                f"the input --{name} is not the one the run started with .these files differ: {path.name}.: restore "
                f"it, or pass --allow_changed_inputs {name.split()[0]} to continue")):
            check_same_inputs(saved, input_identities(args, functions), ())
        (note,) = check_same_inputs(saved, input_identities(args, functions), (name.split()[0],))
        assert "allowed by --allow_changed_inputs" in note
        path.write_bytes(original)
    hub = rloo.Args(**{**flags, "dataset_name": "org/data"})  # a Hub id is compared as a string
    with pytest.raises(plumbing.ConfigError, match="the input --dataset_name is not the one"):
        check_same_inputs(saved, input_identities(hub, functions), ())


# ---------------------------------------------------------------- the checkpoint reader, under malformed states
def write_state(step: Path, state) -> None:
    """trainer_state.pt holding `state` (or these raw bytes), with a manifest that matches: only what the file holds
    can tell it is wrong."""
    if isinstance(state, bytes):
        (step / TRAINER_STATE).write_bytes(state)
    else:
        torch.save(state, step / TRAINER_STATE)
    (step / MANIFEST).write_text(json.dumps({"files": file_digests(step, sorted(
        p.name for p in step.iterdir() if p.is_file() and p.name != MANIFEST)), "run_id": "run-a",
        "update": 1}))


class Payload:
    def __reduce__(self):
        return os.system, ("touch /tmp/rloo-test-ran",)


plain = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8) |
                     st.binary(max_size=8), lambda children: st.lists(children, max_size=3) |
                     st.dictionaries(st.text(max_size=5), children, max_size=3), max_leaves=8)
field_values = {key: plain for key in TRAINER_STATE_KEYS}


@st.composite
def malformed_states(draw):
    """A trainer state with one field missing, of a wrong type, huge or nested junk; or not a dict; or bytes cut
    short, random bytes, a pickle of code."""
    kind = draw(st.sampled_from(["missing", "wrong", "huge", "not a dict", "truncated", "random", "code"]))
    state = trainer_state(1, optimizer={})
    key = draw(st.sampled_from(sorted(TRAINER_STATE_KEYS)))
    if kind == "missing":
        del state[key]
    elif kind == "wrong":
        kinds = TRAINER_STATE_KEYS[key]
        kinds = (int, float) if kinds is float else kinds
        state[key] = draw(plain.filter(lambda v: isinstance(v, bool) or not isinstance(v, kinds)))
    elif kind == "huge":
        state[draw(st.sampled_from(["update", "episode", "world_size", "elapsed"]))] = draw(
            st.sampled_from([2**70, -1, float("inf"), float("nan"), -1e300]))
    elif kind == "not a dict":
        return draw(plain)
    else:
        buffer = io.BytesIO()
        torch.save(state, buffer)
        data = buffer.getvalue()
        if kind == "truncated":
            return data[:draw(st.integers(0, len(data) - 1))]
        if kind == "random":
            return draw(st.binary(max_size=256))
        return pickle.dumps({"update": 1, "run_id": Payload()})
    return state


@pytest.fixture(scope="module")
def one_checkpoint(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("reader")
    saved_steps(root, [1])
    return root / "checkpoints" / "step_1"


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(state=malformed_states())
def test_a_malformed_trainer_state_is_one_line_naming_the_checkpoint_never_a_traceback_or_code(one_checkpoint, state):
    write_state(one_checkpoint, state)
    assert read_checkpoint(one_checkpoint)[0] is None
    with pytest.raises(plumbing.ConfigError) as refused:
        resume_checkpoint(rloo.Args(output_dir=str(one_checkpoint.parent.parent / "new"),
                                    resume_from=str(one_checkpoint)))
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"--resume_from {one_checkpoint} is damaged: ")
    assert not Path("/tmp/rloo-test-ran").exists()


def test_the_reader_accepts_what_a_run_writes(one_checkpoint):
    write_state(one_checkpoint, trainer_state(1, optimizer={}))
    state, problem = read_checkpoint(one_checkpoint)
    assert problem is None and state["run_id"] == "run-a"


# ---------------------------------------------------------------- the run writes only files it made
RUN_NAMES = ["run.lock", "metrics.jsonl", "args.json", "curves.png", "preempted", "model.safetensors", "config.json",
             "tokenizer.json", "metrics.jsonl.tmp", "abandoned", "tensorboard", "nonfinite", "merged", "engines.json",
             "lora_sync"]


def refusal(out: Path, **flags) -> str:
    """The one line a run into `out` is refused with, before anything is written (as rloo.main: the Checkpointer)."""
    args = rloo.Args(output_dir=str(out), **flags)
    lock = plumbing.OutputDirLock(args.output_dir)
    try:
        with pytest.raises(plumbing.ConfigError) as refused:
            plumbing.Checkpointer(args, SimpleNamespace(rank=0, world_size=1), lock, [])
    finally:
        lock.release()
    assert "\n" not in str(refused.value)
    return str(refused.value)


@pytest.mark.parametrize("dangling", [False, True], ids=["to a file", "dangling"])
@pytest.mark.parametrize("name", RUN_NAMES)
def test_a_symlink_under_a_run_name_is_refused_and_nothing_is_written_through_it(tmp_path, name, dangling):
    """Issue 47: run.lock truncated an outside file, metrics.jsonl appended to one, a dangling args.json made one."""
    out, outside = tmp_path / "out", tmp_path / "outside"
    out.mkdir()
    if not dangling:
        outside.write_text("precious\n")
    (out / name).symlink_to(outside)
    for flags in ({}, {"overwrite_output_dir": True}, {"resume": True}):
        line = refusal(out, **flags)
        assert f"holds {name} (is a symbolic link) under the name of a file a run writes" in line, line
    assert (outside.read_text() == "precious\n") if not dangling else not outside.exists()
    assert sorted(p.name for p in out.iterdir()) == [name] and (out / name).is_symlink()


def test_a_symlinked_checkpoints_folder_is_where_checkpoints_live_links_inside_other_folders_are_refused(tmp_path):
    out, scratch = tmp_path / "out", tmp_path / "scratch"
    out.mkdir()
    scratch.mkdir()
    (out / "checkpoints").symlink_to(scratch)  # a larger disk: the documented use
    assert foreign_entries(out) == []
    (out / "nonfinite").mkdir()
    (out / "nonfinite" / "update_2_rank_0.jsonl").symlink_to(tmp_path / "elsewhere.jsonl")
    assert refusal(out).startswith(f"--output_dir {out} holds nonfinite (holds the symbolic link update_2_rank_0")
    (out / "checkpoints").unlink()
    (out / "checkpoints").symlink_to(tmp_path / "missing")  # dangling: no directory of the user's to hold them
    assert "checkpoints (is a symbolic link)" in refusal(out)


FOREIGN = {  # a user's own file under a run's name: (what it is, what is said)
    "curves.png": (b"\x89PNG\r\n\x1a\n my own plot", "curves.png (holds what no run of this project wrote)"),
    "preempted": (b"my notes on preemption\n", "preempted (holds what no run of this project wrote)"),
    "run.lock": (b"my lock of another tool\n", "run.lock (holds what no run of this project wrote)"),
    "metrics.jsonl": (b'{"loss": 1.0}\n', "metrics.jsonl (holds what no run of this project wrote)"),
    "metrics.jsonl.old": (b"a,b\n1,2\n", "metrics.jsonl.old (holds what no run of this project wrote)"),
    "checkpoints/my_model.bin": (b"weights", "checkpoints (holds my_model.bin, which no run writes there)"),
    "tensorboard/notes.txt": (b"notes", "tensorboard (holds notes.txt, which no run writes there)"),
    "abandoned/old stuff.txt": (b"mine", "abandoned (holds old stuff.txt, which no run writes there)"),
    "nonfinite": (b"a file, not a folder", "nonfinite (is not a directory)"),
    "curves.png/": (None, "curves.png (is not a regular file)"),
    "preempted|fifo": (None, "preempted (is not a regular file)"),
}


@pytest.mark.parametrize("name", FOREIGN)
def test_a_users_own_file_under_a_run_name_is_refused_never_written_over_moved_or_deleted(tmp_path, name):
    """Issue 47: a user's curves.png was overwritten, their preempted deleted."""
    out = tmp_path / "out"
    content, said = FOREIGN[name]
    path = out / name.rstrip("/").removesuffix("|fifo")
    path.parent.mkdir(parents=True)
    if name.endswith("/"):
        path.mkdir()
    elif name.endswith("|fifo"):
        os.mkfifo(path)  # never opened: a read would block
    else:
        path.write_bytes(content)
    before = tree(tmp_path)
    for flags in ({}, {"overwrite_output_dir": True}, {"resume": True}):
        line = refusal(out, **flags)
        assert line == (f"--output_dir {out} holds {said} under the name of a file a run writes, which no run "
                        "wrote: a run writes only files it made; move it, or pass another --output_dir"), line
    assert tree(tmp_path) == before  # (tree leaves run.lock out: its bytes checked here)
    lock = out / plumbing.LOCK
    assert lock.read_bytes() == content if name == plumbing.LOCK else not lock.exists()


def test_what_a_run_writes_under_its_names_is_its_own(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    fake_run(out, [1, 2])
    plumbing.plot_curves(out / "metrics.jsonl", out / "curves.png")
    lock = plumbing.OutputDirLock(str(out))
    lock.acquire()
    lock.mark_preempted(str(out / "checkpoints" / "step_2"))
    assert foreign_entries(out) == []
    for note in ("checkpoints/step_3", "stopped during start-up, before any update",
                 "no update had finished, nothing to save"):
        lock.mark_preempted(note)
        assert foreign_entries(out) == []
    lock.release()
    (out / "run.lock").write_text("")  # a run killed between its open and its write
    (out / "tensorboard").mkdir()
    (out / "tensorboard" / "events.out.tfevents.1.host.1.0").write_bytes(b"")
    (out / "checkpoints" / ".tmp_step_3").mkdir()
    assert foreign_entries(out) == [] and plumbing.written_by(out / "curves.png") == "rloo.py"


def test_an_overwrite_never_moves_wandb_which_holds_other_projects_runs(tmp_path):
    """Issue 47: --overwrite_output_dir with output_dir at home moved ~/wandb (other projects' runs) into abandoned/."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "wandb" / "run-20250101_000000-otherproj").mkdir(parents=True)
    (home / "wandb" / "run-20250101_000000-otherproj" / "files").write_text("theirs")
    fake_run(home, [1])
    args = rloo.Args(output_dir=str(home), overwrite_output_dir=True)
    resume_checkpoint(args)
    lines = settle_output_dir(args, 0, {}, "run-b")
    assert "wandb" not in lines[0] and (home / "wandb" / "run-20250101_000000-otherproj" / "files").exists()


def test_the_writers_never_follow_a_link_into_a_fifo_or_through_a_hard_link(tmp_path):
    outside = tmp_path / "outside"
    outside.write_text("precious\n")
    (tmp_path / "link").symlink_to(outside)
    os.link(outside, tmp_path / "hard")
    os.mkfifo(tmp_path / "fifo")
    for name, why in (("link", "is a symbolic link, which a run never writes through"),
                      ("hard", "has 2 names (a hard link), which a run never writes through"),
                      ("fifo", "is not a regular file")):
        for mode in ("a", "a+"):
            with pytest.raises(OSError, match=re.escape(why)):
                plumbing.open_own(tmp_path / name, mode)  # the FIFO: no waiting for a reader
    plumbing.write_own(tmp_path / "link", "mine\n")  # the link itself replaced, never followed
    with plumbing.new_file(tmp_path / "hard") as f:  # the name is made anew: the other name keeps its bytes
        f.write("mine\n")
    assert outside.read_text() == "precious\n" and not (tmp_path / "link").is_symlink()
    with pytest.raises(FileExistsError):
        with plumbing.new_file(tmp_path / "fifo") as f:  # unlinked first, so made anew: no error...
            raise FileExistsError  # ...and nothing blocks
    assert outside.read_text() == "precious\n"


def test_a_hard_linked_backup_of_the_run_folder_is_never_written_through_and_no_reason_to_refuse(tmp_path):
    """Issue 56: `cp -al out backup` stopped the run (metrics.jsonl has two names) and its resume was refused "which
    no run wrote" about the run's own files. A hard-linked copy is the user's backup: the run goes on and resumes,
    writing a file of its own wherever a name is shared, so that the backup keeps its bytes."""
    out, backup = tmp_path / "out", tmp_path / "backup"
    out.mkdir()
    saved_steps(out, [1])
    (out / "metrics.jsonl").write_text('{"update": 1, "run_id": "run-a"}\n')
    (out / "preempted").write_text(f"{out}/checkpoints/step_1\n")
    (out / "run.lock").write_text("pid 1 on node7, since 2025-01-10 09:12:03\n")
    subprocess.run(["cp", "-al", str(out), str(backup)], check=True)
    before = tree(backup) | {"run.lock": (backup / "run.lock").read_bytes()}
    args = rloo.Args(output_dir=str(out), resume=True)
    lock = plumbing.OutputDirLock(args.output_dir)
    try:
        checkpoints = plumbing.Checkpointer(args, SimpleNamespace(rank=0, world_size=1), lock, [])  # resumes
        assert checkpoints.start_update == 1 and lock.held and not (out / "preempted").exists()
        logger = plumbing.RunLogger(args, "run", 2, 1, None, "run-a", 1)
        logger.write_metrics({"update": 2, "episode": 2})
        logger.progress.stop()
        lock.mark_preempted("checkpoints/step_2")
    finally:
        lock.release()
    assert tree(backup) | {"run.lock": (backup / "run.lock").read_bytes()} == before  # the backup unchanged
    assert [m["update"] for m in read_metrics(out)] == [1, 2] and (out / "metrics.jsonl").stat().st_nlink == 1
    assert (backup / "preempted").exists() and (out / "preempted").read_text() == "checkpoints/step_2\n"


def test_links_planted_in_a_checkpoint_being_written_are_never_written_through(tmp_path):
    """Issue 56: symbolic links planted in checkpoints/.tmp_step_N while it was written got files outside output_dir
    overwritten with trainer_state.pt, manifest.json and tokenizer.json. Every file of a save is new (O_EXCL) in the
    folder the run made (held by its handle), or written by a library into a private folder of a random name and
    then linked in, never over a name that is taken: a planted link (symbolic or hard, to a file or dangling), a
    FIFO, or a link in place of the folder itself stops the save in one line, and nothing outside is written."""
    out = tmp_path / "out"
    policy, optimizer, tokenizer = saved_steps(out, [1])
    outside = {name: tmp_path / f"outside_{name}" for name in ("trainer_state.pt", "manifest.json", "tokenizer.json")}
    for path in outside.values():
        path.write_text("precious\n")
    plants = {  # what is planted in .tmp_step_2 as the policy is saved (by a wrapper of the tokenizer's save)
        "symbolic links": lambda folder: [(folder / n).symlink_to(outside[n]) for n in outside],
        "dangling links": lambda folder: [(folder / n).symlink_to(tmp_path / f"new_{n}") for n in outside],
        "a hard link": lambda folder: os.link(outside["tokenizer.json"], folder / "tokenizer.json"),
        "a FIFO": lambda folder: os.mkfifo(folder / "trainer_state.pt"),
    }

    class Planting:  # the tokenizer, whose save plants `plant` in the checkpoint's temporary folder first
        def __init__(self, plant):
            self.plant = plant

        def save_pretrained(self, path):
            self.plant(Path(os.path.realpath(path)).parent)  # the private folder's parent: .tmp_step_2
            return tokenizer.save_pretrained(path)

    for name, plant in plants.items():
        with pytest.raises(plumbing.Fault, match=r"could not write checkpoint step_2 \(.*\.tmp_step_2") as failed:
            save_checkpoint(str(out), 2, policy, optimizer, Planting(plant), trainer_state(2), 0, None, {})
        assert "\n" not in str(failed.value) and ("File exists" in str(failed.value) or "appeared while the run wrote "
                                                  "it" in str(failed.value)), (name, str(failed.value))
        assert all(path.read_text() == "precious\n" for path in outside.values()), name
        assert not list(tmp_path.glob("new_*")) and sorted(os.listdir(out / "checkpoints")) == ["step_1"], name
    (out / "checkpoints" / ".tmp_step_2").symlink_to(tmp_path)  # the temporary folder's own name: a link
    with pytest.raises(plumbing.Fault, match="checkpoints/.tmp_step_2 exists and is not this run's: move it"):
        save_checkpoint(str(out), 2, policy, optimizer, tokenizer, trainer_state(2), 0, None, {})
    assert (out / "checkpoints" / ".tmp_step_2").is_symlink() and (tmp_path / "out").is_dir()


def other_runs_checkpoints(root: Path, steps: list[int]) -> Path:
    """A folder holding checkpoints of run-b (their manifests), as another run leaves it."""
    for step in steps:
        (root / f"step_{step}").mkdir(parents=True)
        (root / f"step_{step}" / "manifest.json").write_text(json.dumps({"files": {}, "run_id": "run-b"}))
    return root


def test_pruning_removes_only_this_runs_checkpoints_and_a_swapped_folder_stops_the_save(tmp_path):
    """Issue 56: checkpoints/ replaced mid-run by a link to a folder of another run's checkpoints, with
    --save_total_limit 1, deleted them (pruning went by name). The folders a run saves into are those it started
    with (a swap stops the save in one line), and pruning removes only checkpoints of its own run id: another run's,
    a link to a folder of the user's, a folder without a manifest are kept; a link to this run's own is unlinked."""
    out = tmp_path / "out"
    policy, optimizer, tokenizer = saved_steps(out, [1])
    with plumbing.folders.Folder.at(out) as root, root.folder("checkpoints") as checkpoints:
        identities = {"output_dir": root.identity, "checkpoints": checkpoints.identity}
    theirs = other_runs_checkpoints(tmp_path / "theirs", [1, 2])
    (out / "checkpoints").rename(tmp_path / "ours")
    (out / "checkpoints").symlink_to(theirs)
    with pytest.raises(plumbing.Fault, match="checkpoints is no longer the folder the run started with"):
        save_checkpoint(str(out), 2, policy, optimizer, tokenizer, trainer_state(2), 0, 1, {}, identities)
    assert sorted(os.listdir(theirs)) == ["step_1", "step_2"]
    save_checkpoint(str(out), 3, policy, optimizer, tokenizer, trainer_state(3), 0, 1, {})  # a link from
    assert sorted(os.listdir(theirs)) == ["step_1", "step_2", "step_3"]  # the start: where checkpoints live
    (out / "checkpoints").unlink()
    (tmp_path / "ours").rename(out / "checkpoints")
    (tmp_path / "mine").mkdir()
    (out / "checkpoints" / "step_2").symlink_to(tmp_path / "mine")  # a folder of the user's
    (out / "checkpoints" / "step_0").symlink_to(theirs / "step_3")  # this run's, kept elsewhere
    (out / "checkpoints" / "step_5").mkdir()  # no manifest: no run's
    (out / "checkpoints" / "step_5" / "notes").write_text("mine")
    save_checkpoint(str(out), 6, policy, optimizer, tokenizer, trainer_state(6), 0, 1, {})
    assert sorted(os.listdir(out / "checkpoints")) == ["step_2", "step_5", "step_6"]
    assert (tmp_path / "mine").is_dir() and (theirs / "step_3" / "manifest.json").is_file()


def test_the_debris_of_a_killed_save_is_removed_only_where_it_is_this_runs(tmp_path):
    """A save killed midway leaves checkpoints/.tmp_step_N: removed at the next start (it can be as large as a
    checkpoint) where its rank file names this run, or it holds no file; moved to abandoned/ otherwise."""
    out = tmp_path / "out"
    saved_steps(out, [1])
    saved_steps(tmp_path / "other", [4], run_id="run-b")
    checkpoints = out / "checkpoints"
    shutil.copytree(checkpoints / "step_1", checkpoints / ".tmp_step_2")  # this run's
    (checkpoints / ".tmp_step_2" / "manifest.json").unlink()
    (checkpoints / ".tmp_step_3" / ".partial-0123456789abcdef").mkdir(parents=True)  # killed at once: nothing in it
    shutil.copytree(tmp_path / "other" / "checkpoints" / "step_4", checkpoints / ".tmp_step_4")  # another run's
    (checkpoints / ".tmp_step_5").mkdir()
    (checkpoints / ".tmp_step_5" / "notes.txt").write_text("mine")  # a file no run wrote
    args = rloo.Args(output_dir=str(out), resume=True)
    lock = plumbing.OutputDirLock(args.output_dir)
    try:
        notes = plumbing.Checkpointer(args, SimpleNamespace(rank=0, world_size=1), lock, []).notes()
    finally:
        lock.release()
    assert sorted(os.listdir(checkpoints)) == ["step_1"]
    moved = next((out / "abandoned").iterdir())
    assert sorted(os.listdir(moved / "checkpoints")) == [".tmp_step_4", ".tmp_step_5"] and moved.name.endswith("debris")
    assert (moved / "checkpoints" / ".tmp_step_5" / "notes.txt").read_text() == "mine"
    assert any("(.tmp_step_4, .tmp_step_5), moved to" in note for note in notes), notes


def test_a_rank_file_proves_whose_it_is(tmp_path):
    """Issue 56: a rank file of another run, or of an earlier step of this one, resumed silently. Each carries the
    run id, the update and the rank, checked against the manifest before any model loads, as is their number."""
    saved_steps(tmp_path / "a", [1, 2])
    saved_steps(tmp_path / "b", [2], run_id="run-b")
    step = tmp_path / "a" / "checkpoints" / "step_2"
    original = (step / "rank0.pt").read_bytes()
    cases = {
        "another run's": (lambda: shutil.copy(tmp_path / "b" / "checkpoints" / "step_2" / "rank0.pt", step),
                          "rank0.pt is of run id 'run-b', but manifest.json says 'run-a'"),
        "an earlier step's": (lambda: shutil.copy(step.parent / "step_1" / "rank0.pt", step),
                              "rank0.pt is of update 1, but manifest.json says 2"),
        "another rank's name": (lambda: (step / "rank0.pt").rename(step / "rank1.pt"),
                                "holds 1 rank files (rank1.pt), but a run of world size 1 writes rank0.pt to rank0.pt"),
        "one more": (lambda: shutil.copy(step / "rank0.pt", step / "rank1.pt"),
                     "holds 2 rank files (rank0.pt, rank1.pt), but a run of world size 1 writes rank0.pt to rank0.pt"),
        "an older format": (lambda: torch.save({"sampler": {}}, step / "rank0.pt"),
                            "rank0.pt holds ['sampler'], not ['run_id', 'update', 'rank', 'parts'] (written by an "),
        "a world size of 10^9": (lambda: torch.save(trainer_state(2, world_size=10**9, optimizer={}),
                                                    step / "trainer_state.pt"),
                                 "holds 1 rank files (rank0.pt), but a run of world size 1000000000 writes"),
    }
    for name, (damage, said) in cases.items():
        damage()
        forge_manifest(step)
        state, problem = read_checkpoint(step)
        assert state is None and problem.startswith(said), (name, problem)
        for extra in step.glob("rank*.pt"):
            extra.unlink()
        (step / "rank0.pt").write_bytes(original)
        torch.save(trainer_state(2, optimizer={}), step / "trainer_state.pt")
    forge_manifest(step)
    manifest = json.loads((step / "manifest.json").read_text())
    (step / "manifest.json").write_text(json.dumps({**manifest, "run_id": "run-b"}))
    assert read_checkpoint(step)[1] == "manifest.json is of run id 'run-b', but trainer_state.pt of 'run-a'"


def test_output_dir_renamed_or_replaced_while_the_run_writes_is_one_line(tmp_path):
    """Issue 56: output_dir renamed mid-run gave a FileNotFoundError traceback. The run writes in the folders it
    started with: renamed, removed or replaced by another (or a link to one), the next write says so in one line and
    writes nothing elsewhere; the lock file of a run that took the old name since is never removed."""
    out = tmp_path / "out"
    args = rloo.Args(output_dir=str(out))
    lock = plumbing.OutputDirLock(args.output_dir)
    lock.acquire()
    logger = plumbing.RunLogger(args, "run", 2, 0, None, "run-a", 1)
    for swap in ("renamed", "replaced by a link"):
        out.rename(tmp_path / f"moved_{swap}")
        if swap == "replaced by a link":
            (tmp_path / "elsewhere").mkdir()
            out.symlink_to(tmp_path / "elsewhere")
        with pytest.raises(plumbing.MetricsWriteError) as failed:
            logger.write_metrics({"update": 1, "episode": 1})
        assert "\n" not in str(failed.value) and str(failed.value).startswith(f"could not write {out}/metrics.jsonl ("
                                                                               f"{out} "), str(failed.value)
        assert "(renamed, moved or" in str(failed.value)
        with pytest.raises(OSError, match="renamed, moved or"):
            lock.mark_preempted("checkpoints/step_1")
        if swap == "renamed":
            (tmp_path / "moved_renamed").rename(out)
            logger.write_metrics({"update": 1, "episode": 1})  # put back: the same folder, written again
    (tmp_path / "elsewhere" / "run.lock").write_text("pid 2 on node7, since 2025-01-10 09:12:03\n")  # another run's
    lock.release()
    assert (tmp_path / "elsewhere" / "run.lock").exists() and os.listdir(tmp_path / "elsewhere") == ["run.lock"]
    logger.progress.stop()  # (close would draw curves.png: into no folder but the one the run started in)


def test_links_planted_in_the_runs_other_files_and_folders_are_never_followed(tmp_path):
    """Neighbours of the planted checkpoint: metrics.jsonl made a symbolic link or a FIFO mid-run, tensorboard/ and
    nonfinite/ made links to folders elsewhere, preempted a link: one line each (MetricsWriteError for what the
    logger writes), no wait on the FIFO, and nothing elsewhere written; preempted's link is replaced, not followed."""
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "metrics.jsonl").write_text("precious\n")
    args = rloo.Args(output_dir=str(out), tensorboard=True)
    lock = plumbing.OutputDirLock(args.output_dir)
    lock.acquire()
    logger = plumbing.RunLogger(args, "run", 2, 0, None, "run-a", 1)
    logger.progress.stop()
    (out / "metrics.jsonl").unlink()
    (out / "metrics.jsonl").symlink_to(elsewhere / "metrics.jsonl")
    with pytest.raises(plumbing.MetricsWriteError, match="metrics.jsonl is a symbolic link, which a run never"):
        logger.write_metrics({"update": 1, "episode": 1})
    (out / "metrics.jsonl").unlink()
    os.mkfifo(out / "metrics.jsonl")
    with pytest.raises(plumbing.MetricsWriteError, match="metrics.jsonl is not a regular file"):
        logger.write_metrics({"update": 1, "episode": 1})
    (out / "tensorboard").symlink_to(elsewhere)
    with pytest.raises(plumbing.MetricsWriteError, match="tensorboard is a symbolic link, which a run never follows"):
        logger.publish({"objective/scores": 0.5}, 1)
    (out / "nonfinite").symlink_to(elsewhere)
    ids, mask = torch.zeros(2, 2, dtype=torch.long), torch.ones(2, 2, dtype=torch.bool)
    rollout = SimpleNamespace(queries=ids[:1], query_mask=mask[:1], responses=ids, response_mask=mask, logprobs=None)
    with pytest.raises(OSError, match="nonfinite is a symbolic link"):
        plumbing.faults.dump_batch(str(out), "update_1_rank_0.jsonl", policy_tokenizer(), rollout, torch.zeros(2))
    (out / "preempted").symlink_to(elsewhere / "metrics.jsonl")
    lock.mark_preempted("checkpoints/step_1")
    lock.release()
    assert os.listdir(elsewhere) == ["metrics.jsonl"] and (elsewhere / "metrics.jsonl").read_text() == "precious\n"
    assert not (out / "preempted").is_symlink() and (out / "preempted").read_text() == "checkpoints/step_1\n"


def test_a_verdict_is_taken_only_where_the_settings_could_have_reached_it():
    """plumbing.Verdict (rloo.OnPolicyShortcut): "on" only after a check, and never where the settings rule the
    shortcut out (made checked=True)."""
    for checked_at_start, saved, taken in ((True, {"checked": True, "on": True}, False),
                                           (False, {"checked": False, "on": True}, False),
                                           (False, {"checked": True, "on": True}, True),
                                           (True, {"checked": True, "on": False}, True),
                                           (False, {"checked": False, "on": False}, True)):
        verdict = rloo.OnPolicyShortcut(checked=checked_at_start)
        if taken:
            verdict.load_state_dict(saved)
            assert (verdict.checked, verdict.on) == (saved["checked"], saved["on"])
        else:
            with pytest.raises(ValueError, match="OnPolicyShortcut says the shortcut is on, which"):
                verdict.load_state_dict(saved)


def test_a_load_error_under_a_heading_says_its_whole_reason_in_one_line():
    """Issue 56: the reference's load error was cut to "Error(s) in loading state_dict for GPTNeoXForCausalLM:;" (its
    first line): a first line that is a heading (ending in a colon) is said with the lines under it."""
    with pytest.raises(RuntimeError) as failed:
        torch.nn.Linear(2, 2).load_state_dict({"weight": torch.zeros(3, 2), "bias": torch.zeros(2)})
    line = plumbing.first_line(failed.value)
    assert line.startswith("Error(s) in loading state_dict for Linear: size mismatch for weight: copying a param with "
                           "shape torch.Size([3, 2]) from checkpoint"), line
    assert plumbing.first_line(ValueError("one line\nand a second")) == "one line"


def test_a_fifo_or_a_link_where_a_checkpoint_has_its_manifest_never_blocks_a_resume(tmp_path):
    """What a resume reads of each checkpoint (its manifest, the run record) is read only as a regular file: a FIFO
    there, which would block the read forever, makes that checkpoint damaged, and --resume goes to the one before."""
    saved_steps(tmp_path, [1, 2, 3])
    (tmp_path / "checkpoints" / "step_3" / "manifest.json").unlink()
    os.mkfifo(tmp_path / "checkpoints" / "step_3" / "manifest.json")
    (tmp_path / "checkpoints" / "step_2" / "manifest.json").rename(tmp_path / "manifest.json")
    (tmp_path / "checkpoints" / "step_2" / "manifest.json").symlink_to(tmp_path / "manifest.json")
    start = resume_checkpoint(rloo.Args(output_dir=str(tmp_path), resume=True))
    assert start.checkpoint == tmp_path / "checkpoints" / "step_1"
    assert [why.split(" (")[0] for why in start.skipped.values()] == ["manifest.json cannot be read"] * 2
