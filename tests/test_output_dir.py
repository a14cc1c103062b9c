"""The output directory's rules (only the run's own files are touched, inputs never inside it), the run identity
every checkpoint and metrics line carries, the inputs checked on resume, and the checkpoint reader under malformed
trainer states. In process where the rule is a function; end to end for what only a run shows."""

import dataclasses
import io
import json
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import plumbing
import rloo
from conftest import REPO, read_metrics, script_command, script_env
from helpers import PER_UPDATE, RUN, fake_run, saved_steps, trainer_state, tree


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
        plumbing.settle_output_dir(args, 0, {}, "run-b")
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
    plumbing.resume_checkpoint(args)
    plumbing.settle_output_dir(args, 0, {}, "run-b")
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
    state = plumbing.load_safely(out / "checkpoints" / "step_1" / plumbing.TRAINER_STATE)
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
        plumbing.resume_checkpoint(args)
    # renamed: step_3 of run a holds update 2
    os.replace(tmp_path / "a" / "checkpoints" / "step_3", tmp_path / "b" / "checkpoints" / "step_3")
    os.replace(tmp_path / "a" / "checkpoints" / "step_2", tmp_path / "a" / "checkpoints" / "step_3")
    with pytest.raises(plumbing.ConfigError, match="it holds update 2, not that of its directory step_3 .renamed"):
        plumbing.resume_checkpoint(args)
    with pytest.raises(plumbing.ConfigError, match="it holds update 2, not that of its directory step_3"):
        plumbing.resume_checkpoint(rloo.Args(output_dir=str(tmp_path / "c"),
                                             resume_from=str(tmp_path / "a" / "checkpoints" / "step_3")))
    # run b's checkpoint continued in a directory of its own: accepted
    start = plumbing.resume_checkpoint(rloo.Args(output_dir=str(tmp_path / "c"),
                                                 resume_from=str(tmp_path / "b" / "checkpoints" / "step_3")))
    assert start.state["run_id"] == "run-b"
    # metrics lines of another run are never kept as this run's
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "metrics.jsonl").write_text('{"update": 1, "run_id": "run-x"}\n'
                                                  '{"update": 2, "run_id": "run-b"}\n')
    plumbing.settle_output_dir(rloo.Args(output_dir=str(tmp_path / "c")), 3, {}, "run-b")
    assert read_metrics(tmp_path / "c") == [{"update": 2, "run_id": "run-b"}]


def test_a_legacy_checkpoint_without_a_run_id_is_refused_in_one_line(tmp_path):
    saved_steps(tmp_path, [1])
    step = tmp_path / "checkpoints" / "step_1"
    state = trainer_state(1)
    del state["run_id"]
    write_state(step, state)
    with pytest.raises(plumbing.ConfigError, match="trainer_state.pt has no run_id: written by an older rloo.py"):
        plumbing.resume_checkpoint(rloo.Args(output_dir=str(tmp_path), resume_from=str(step)))


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
    saved = plumbing.input_identities(args, functions)
    assert set(saved) == {"model_name_or_path", "reward_model_path", "dataset_name", "dataset_test_split",
                          "reward_fn my_rewards:f"}
    same = rloo.Args(**{**flags, "model_name_or_path": str(tmp_path / "a" / "policy"),
                        "reward_model_path": "a/reward_model/"})
    assert plumbing.check_same_inputs(saved, plumbing.input_identities(same, functions), ()) == []
    assert plumbing.check_resumable(dataclasses.asdict(args), same, 1, 1) == []  # the same inputs, other spellings
    edits = {"reward_model_path": tmp_path / "a" / "reward_model" / "model.safetensors",
             "dataset_name": tmp_path / "train.jsonl", "dataset_test_split": tmp_path / "test.jsonl",
             "reward_fn my_rewards:f": tmp_path / "my_rewards.py"}
    for name, path in edits.items():
        original = path.read_bytes()
        path.write_bytes(original + b"\n")
        with pytest.raises(plumbing.ConfigError, match=(
                f"the input --{name} is not the one the run started with .these files differ: {path.name}.: restore "
                f"it, or pass --allow_changed_inputs {name.split()[0]} to continue")):
            plumbing.check_same_inputs(saved, plumbing.input_identities(args, functions), ())
        (note,) = plumbing.check_same_inputs(saved, plumbing.input_identities(args, functions), (name.split()[0],))
        assert "allowed by --allow_changed_inputs" in note
        path.write_bytes(original)
    hub = rloo.Args(**{**flags, "dataset_name": "org/data"})  # a Hub id is compared as a string
    with pytest.raises(plumbing.ConfigError, match="the input --dataset_name is not the one"):
        plumbing.check_same_inputs(saved, plumbing.input_identities(hub, functions), ())


# ---------------------------------------------------------------- the checkpoint reader, under malformed states
def write_state(step: Path, state) -> None:
    """trainer_state.pt holding `state` (or these raw bytes), with a manifest that matches: only what the file holds
    can tell it is wrong."""
    if isinstance(state, bytes):
        (step / plumbing.TRAINER_STATE).write_bytes(state)
    else:
        torch.save(state, step / plumbing.TRAINER_STATE)
    (step / plumbing.MANIFEST).write_text(json.dumps({"files": plumbing.file_digests(step, sorted(
        p.name for p in step.iterdir() if p.is_file() and p.name != plumbing.MANIFEST))}))


class Payload:
    def __reduce__(self):
        return os.system, ("touch /tmp/rloo-test-ran",)


plain = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8) |
                     st.binary(max_size=8), lambda children: st.lists(children, max_size=3) |
                     st.dictionaries(st.text(max_size=5), children, max_size=3), max_leaves=8)
field_values = {key: plain for key in plumbing.TRAINER_STATE_KEYS}


@st.composite
def malformed_states(draw):
    """A trainer state with one field missing, of a wrong type, huge or nested junk; or not a dict; or bytes cut
    short, random bytes, a pickle of code."""
    kind = draw(st.sampled_from(["missing", "wrong", "huge", "not a dict", "truncated", "random", "code"]))
    state = trainer_state(1, optimizer={})
    key = draw(st.sampled_from(sorted(plumbing.TRAINER_STATE_KEYS)))
    if kind == "missing":
        del state[key]
    elif kind == "wrong":
        kinds = plumbing.TRAINER_STATE_KEYS[key]
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
    assert plumbing.read_checkpoint(one_checkpoint)[0] is None
    with pytest.raises(plumbing.ConfigError) as refused:
        plumbing.resume_checkpoint(rloo.Args(output_dir=str(one_checkpoint.parent.parent / "new"),
                                             resume_from=str(one_checkpoint)))
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"--resume_from {one_checkpoint} is damaged: ")
    assert not Path("/tmp/rloo-test-ran").exists()


def test_the_reader_accepts_what_a_run_writes(one_checkpoint):
    write_state(one_checkpoint, trainer_state(1, optimizer={}))
    state, problem = plumbing.read_checkpoint(one_checkpoint)
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
    assert plumbing.foreign_entries(out) == []
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
    assert plumbing.foreign_entries(out) == []
    for note in ("checkpoints/step_3", "stopped during start-up, before any update",
                 "no update had finished, nothing to save"):
        lock.mark_preempted(note)
        assert plumbing.foreign_entries(out) == []
    lock.release()
    (out / "run.lock").write_text("")  # a run killed between its open and its write
    (out / "tensorboard").mkdir()
    (out / "tensorboard" / "events.out.tfevents.1.host.1.0").write_bytes(b"")
    (out / "checkpoints" / ".tmp_step_3").mkdir()
    assert plumbing.foreign_entries(out) == [] and plumbing.written_by(out / "curves.png") == "rloo.py"


def test_an_overwrite_never_moves_wandb_which_holds_other_projects_runs(tmp_path):
    """Issue 47: --overwrite_output_dir with output_dir at home moved ~/wandb (other projects' runs) into abandoned/."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "wandb" / "run-20250101_000000-otherproj").mkdir(parents=True)
    (home / "wandb" / "run-20250101_000000-otherproj" / "files").write_text("theirs")
    fake_run(home, [1])
    args = rloo.Args(output_dir=str(home), overwrite_output_dir=True)
    plumbing.resume_checkpoint(args)
    lines = plumbing.settle_output_dir(args, 0, {}, "run-b")
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


def test_a_run_file_hard_linked_to_a_file_elsewhere_is_refused(tmp_path):
    """A metrics.jsonl in the run's own words that is also a file elsewhere: appending would change that file."""
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "elsewhere.jsonl").write_text('{"update": 1, "run_id": "a"}\n')
    os.link(tmp_path / "elsewhere.jsonl", out / "metrics.jsonl")
    assert "holds metrics.jsonl (has another name (a hard link)) under the name" in refusal(out, resume=True)
    assert (tmp_path / "elsewhere.jsonl").read_text() == '{"update": 1, "run_id": "a"}\n'
