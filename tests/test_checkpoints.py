"""Checkpoints that survive preemption, exact resume, and stopping loudly on NaN/inf."""

import contextlib
import json
import os
import pickle
import random
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable

import datasets
import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from transformers import AutoModelForCausalLM

import plumbing
from plumbing.checkpoints import (RANK_FILE, check_same_inputs, checkpoint_problem, load_safely,
                                  model_identity, read_shards, resume_checkpoint, save_final_policy, set_rng_state,
                                  unsafe_metadata)
from plumbing.data import prepare_prompts
from plumbing.faults import ConsoleStream, NonFiniteError, StartupInterrupted
from plumbing.outputdir import TRAINER_STATE, checkpoint_dirs, latest_checkpoint, settle_output_dir, steps_to_prune
import rloo
from helpers import (K, NOT_REPRODUCIBLE, PER_UPDATE, PROMPTS, REPO, RUN, assert_same_run,  # noqa: F401 (kept here)
                     comparable, fake_run, forge_manifest, hub_cache_repo, interrupt_after_first_update, launch,
                     pid_of, policy_tokenizer, prompt_rows, python, read_metrics, run_main, run_rloo, saved_steps,
                     script_command, script_env, tiny_policy, trainer_state, tree, updates_logged, wait_until,
                     write_jsonl)



@pytest.mark.parametrize("nproc,sig,extra", [(0, signal.SIGINT, []), (2, signal.SIGUSR1, []),
                                             (2, signal.SIGUSR1, ["--fsdp", "--fsdp_generation", "per_block"])],
                         ids=["python-SIGINT", "torchrun-SIGUSR1", "torchrun-fsdp-SIGUSR1"])
def test_signal_saves_and_resume_is_exact(assets, tmp_path, nproc, sig, extra):
    # 64 prompts: an epoch is 8 updates of one rank (4 of two), so the resumed run reshuffles the data, as a long run
    # does, in 12 updates (6 of two ranks)
    train = write_jsonl(tmp_path / "train.jsonl", prompt_rows(64, seed=0))
    common = ["--model_name_or_path", assets["policy"], "--dataset_name", train, "--dataset_test_split",
              assets["test"], "--total_episodes", PER_UPDATE * 12 if not nproc else PER_UPDATE * 6 * nproc, *RUN,
              *extra]
    if nproc:  # a reward model beside the function: loaded on every rank, and resumed with the run
        common += ["--reward_model_path", assets["reward_model"]]
    full, interrupted = tmp_path / "full", tmp_path / "interrupted"
    result = run_rloo(*common, "--output_dir", full, nproc=nproc)
    assert result.returncode == 0, result.stderr[-3000:]

    def second_run_is_refused(first: subprocess.Popen) -> None:  # a job submitted twice, a requeue too early
        os.kill(pid_of(first), signal.SIGSTOP)  # holding its lock, it must not finish meanwhile
        second = run_rloo(*common, "--output_dir", interrupted, "--resume")
        os.kill(pid_of(first), signal.SIGCONT)
        assert second.returncode == 2 and second.stderr.count("\n") == 1, second.stderr[-3000:]
        assert f"is in use by another run (pid {pid_of(first)} on {socket.gethostname()}, since " in second.stderr

    returncode, stdout, stderr = interrupt_after_first_update([*common, "--output_dir", interrupted], sig, nproc,
                                                              second_run_is_refused if nproc == 0 else lambda p: None)
    # the signal stops the run after an update, or at once when it lands in a reward function (the update's start
    # kept): either way a checkpoint to resume from, exactly
    assert f"{sig.name} received: stopped after update" in stdout or \
        f"{sig.name} received while a reward function ran: stopped at once" in stdout, stdout[-2000:] + stderr[-3000:]
    if nproc == 0:
        assert returncode == 0  # (torchrun's own agent exits non-zero after forwarding a signal)
    assert not (interrupted / "model.safetensors").exists()  # not a finished run
    assert (interrupted / "preempted").read_text().strip() == str(latest_checkpoint(str(interrupted)))
    stopped_at = latest_checkpoint(str(interrupted))
    assert stopped_at is not None and len(read_metrics(interrupted)) < len(read_metrics(full))

    result = run_rloo(*common, "--output_dir", interrupted, "--resume", nproc=nproc)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resuming from {stopped_at}" in result.stdout and not (interrupted / "preempted").exists()
    assert_same_run(full, interrupted)  # metrics.jsonl appended line by line, same weights
    AutoModelForCausalLM.from_pretrained(interrupted)  # a plain HF checkpoint, also when saved from FSDP shards


@pytest.mark.parametrize("reward_fn", ["count_a_python_noise", "count_a_numpy_noise", "count_a_torch_noise"])
def test_a_reward_function_drawing_random_numbers_resumes_exactly(assets, tmp_path, reward_fn):
    """The generators are restored as the last step before the first resumed update (nothing draws from them in
    between, the console's construction included): a reward function drawing from python's, numpy's or torch's
    global generator scores a resumed run as it scores an uninterrupted one, bit for bit."""
    flags = {"model_name_or_path": str(assets["policy"]), "dataset_name": str(assets["train"]),
             "reward_fn": [f"reward_fns:{reward_fn}"], "kl_coef": 0.1}
    run_main(rloo, **flags, output_dir=str(tmp_path / "full"), total_episodes=3 * K * PROMPTS)
    run_main(rloo, **flags, output_dir=str(tmp_path / "resumed"), total_episodes=K * PROMPTS)
    run_main(rloo, **flags, output_dir=str(tmp_path / "resumed"), total_episodes=3 * K * PROMPTS, resume=True)
    assert len({m["objective/raw_scores"] for m in read_metrics(tmp_path / "full")}) == 3
    assert_same_run(tmp_path / "full", tmp_path / "resumed")


def files_of(directory: Path) -> dict:
    return {str(p.relative_to(directory)): p.stat().st_mtime_ns for p in directory.rglob("*")
            if p.is_file() and p.name != plumbing.LOCK}


def test_resume_refuses_meaning_changes_reports_harmless_ones_and_continues_wandb(assets, tmp_path):
    out = tmp_path / "run"
    common = ["--model_name_or_path", assets["policy"], "--dataset_name", assets["train"], "--output_dir", out,
              "--track", *RUN]
    result = run_rloo(*common, "--total_episodes", PER_UPDATE * 3, "--save_steps", 1, "--save_total_limit", 2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_2", "step_3"]  # the newest 2
    assert AutoModelForCausalLM.from_pretrained(out / "checkpoints" / "step_3")  # loadable on its own
    final = out / "checkpoints" / "step_3"
    assert (out / "model.safetensors").samefile(final / "model.safetensors")  # the final policy stored once
    assert len({p.stat().st_mode for p in (out / "model.safetensors", out / "config.json", out / "metrics.jsonl",
                                           final / "trainer_state.pt")}) == 1  # weights readable as the others

    (out / "preempted").write_text(f"{out / 'checkpoints' / 'step_3'}\n")  # as a stop by a signal leaves it
    refused = run_rloo(*common, "--total_episodes", PER_UPDATE * 4, "--resume", "--rloo_k", 2, "--learning_rate", 1e-3)
    assert refused.returncode == 2
    assert "rloo_k (4 -> 2)" in refused.stderr and "learning_rate (0.003 -> 0.001)" in refused.stderr
    assert not (out / "preempted").exists()  # a job script requeueing on it would fail the same way forever

    result = run_rloo(*common, "--total_episodes", PER_UPDATE * 4, "--resume", "--num_evals", 1)
    assert result.returncode == 0, result.stderr[-3000:]
    assert ("changed: num_evals (3 -> 1), save_steps (1 -> 0), save_total_limit (2 -> None), "
            "total_episodes (96 -> 128)") in result.stdout
    assert [m["update"] for m in read_metrics(out)] == [1, 2, 3, 4]  # appended, never truncated
    assert (out / "model.safetensors").samefile(out / "checkpoints" / "step_4" / "model.safetensors")
    assert checkpoint_problem(final) is None  # its policy files unchanged by the new final policy
    run_ids = {p.name.rsplit("-", 1)[1] for p in (out / "wandb").glob("offline-run-*")}
    assert len(list((out / "wandb").glob("offline-run-*"))) == 2 and len(run_ids) == 1  # the same wandb run


def test_no_flag_restart_or_damage_loses_a_checkpoint(assets, tmp_path):
    out = tmp_path / "run"
    common = ["--model_name_or_path", assets["policy"], "--dataset_name", assets["train"], "--output_dir", out, *RUN]
    result = run_rloo(*common, "--total_episodes", PER_UPDATE * 4, "--save_steps", 1)
    assert result.returncode == 0, result.stderr[-3000:]
    checkpoints = out / "checkpoints"
    before = files_of(out)

    # a fresh run into a directory holding a run: refused, nothing touched
    fresh = run_rloo(*common, "--total_episodes", PER_UPDATE * 4)
    assert fresh.returncode == 2 and files_of(out) == before
    assert ("holds another run's files (checkpoints up to step_4): pass --resume to continue it, another --output_dir, "
            "or --overwrite_output_dir") in fresh.stderr.strip().splitlines()[-1]

    # a damaged newest checkpoint: --resume names it, sets it aside and continues from the newest intact one
    model = checkpoints / "step_4" / "model.safetensors"
    model.write_bytes(model.read_bytes()[:1000])
    result = run_rloo(*common, "--total_episodes", PER_UPDATE * 5, "--resume")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "skipped damaged checkpoint step_4: model.safetensors has 1000 bytes where the manifest says" in result.stdout
    assert f"resuming from {checkpoints / 'step_3'} after update 3" in result.stdout
    (aside,) = (out / "abandoned").iterdir()
    assert (aside / "checkpoints" / "step_4" / "model.safetensors").stat().st_size == 1000  # kept, as it was
    assert [m["update"] for m in read_metrics(aside)] == [4]
    assert [m["update"] for m in read_metrics(out)] == [1, 2, 3, 4, 5]  # one timeline: update 4 once

    # --resume_from an older step: the later checkpoints are another timeline, never pruned in place of this one's
    # nor picked by a later --resume
    result = run_rloo(*common, "--total_episodes", PER_UPDATE * 4, "--resume_from", checkpoints / "step_2",
                      "--save_total_limit", 1)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [p.name for p in checkpoints.iterdir()] == ["step_4"] and latest_checkpoint(str(out)).name == "step_4"
    (branched,) = [p for p in (out / "abandoned").iterdir() if p != aside]
    assert sorted(p.name for p in (branched / "checkpoints").iterdir()) == ["step_3", "step_5"]  # step_5: the last
    assert [m["update"] for m in read_metrics(out)] == [1, 2, 3, 4]


def test_resume_from_a_path_and_without_checkpoint(assets, tmp_path):
    args = ["--model_name_or_path", assets["policy"], "--dataset_name", assets["train"], *RUN]
    missing = run_rloo(*args, "--output_dir", tmp_path / "a", "--resume_from", tmp_path / "nowhere")
    assert missing.returncode == 2 and "not a checkpoint" in missing.stderr
    fresh = run_rloo(*args, "--output_dir", tmp_path / "a", "--resume", "--total_episodes", PER_UPDATE)  # nothing yet
    assert fresh.returncode == 0 and "resuming" not in fresh.stdout
    other = run_rloo(*args, "--output_dir", tmp_path / "b", "--resume_from", tmp_path / "a" / "checkpoints" / "step_1",
                     "--total_episodes", 2 * PER_UPDATE)
    assert other.returncode == 0 and [m["update"] for m in read_metrics(tmp_path / "b")] == [2]


def test_sigkill_during_saves_never_leaves_a_broken_latest_checkpoint(tmp_path):
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'tests'}:{REPO}"}
    rng = random.Random(0)
    out = tmp_path / "out"

    def latest_step() -> int:
        latest = latest_checkpoint(str(out))
        return 0 if latest is None else int(latest.name.removeprefix("step_"))

    for _ in range(4):  # each attempt resumes the run, and is killed once it has saved (the first: twice)
        before = max(latest_step(), 1)
        process = subprocess.Popen([python(), str(REPO / "tests" / "save_loop.py"), str(out)], env=env)
        wait_until(lambda: latest_step() > before, process, "a checkpoint saved")
        time.sleep(rng.uniform(0.0, 0.5))
        os.kill(pid_of(process), signal.SIGKILL)  # the process that saves (a fork: not its client)
        process.wait()
        latest = latest_checkpoint(str(out))
        assert latest is not None and latest.name.startswith("step_")
        state = torch.load(latest / TRAINER_STATE, weights_only=False)
        assert f"step_{state['update']}" == latest.name
        assert AutoModelForCausalLM.from_pretrained(latest).num_parameters() > 0
    # debris of a killed save, and a directory that merely looks like a checkpoint, are never picked up
    (out / "checkpoints" / ".tmp_step_999").mkdir(exist_ok=True)
    (out / "checkpoints" / "step_1000").mkdir()
    assert latest_checkpoint(str(out)) == latest


@pytest.mark.parametrize("disk_full", [False, True], ids=["batch-written", "disk-full"])
def test_nonfinite_loss_stops_the_run_and_saves_the_batch(assets, tmp_path, disk_full):
    out = tmp_path / "run"
    # disk-full: the batch's file cannot be written (ENOSPC): the run stops all the same, and says so
    result = run_rloo("--model_name_or_path", assets["policy"], "--dataset_name", assets["train"], "--output_dir", out,
                      "--total_episodes", PER_UPDATE * 5, *RUN[2:], "--reward_fn", "reward_fns:huge_at_second_call",
                      env=full_disk("update_2_rank_0.jsonl") if disk_full else None)
    assert result.returncode == 3, result.stderr[-3000:]
    error = result.stderr.strip().splitlines()[-1]
    assert "non-finite loss at update 2 on rank 0" in error and "Traceback" not in result.stderr
    assert [m["update"] for m in read_metrics(out)] == [1]
    if disk_full:
        assert error.endswith(f"the offending batch could not be written to {out / 'nonfinite'} (No space left on "
                              "device)")
        return
    dump = (out / "nonfinite" / "update_2_rank_0.jsonl").read_text().splitlines()
    assert len(dump) == PER_UPDATE and all(f'"{key}": ' in dump[0] for key in ("prompt", "completion"))
    assert '"score": 3' in dump[0]  # 3e38


def test_nonfinite_on_one_rank_stops_every_rank(assets, tmp_path):
    out = tmp_path / "run"
    result = run_rloo("--model_name_or_path", assets["policy"], "--dataset_name", assets["train"], "--output_dir", out,
                      "--total_episodes", PER_UPDATE * 2 * 4, *RUN[2:], "--reward_fn", "reward_fns:huge_on_rank_one",
                      nproc=2, timeout=600)
    assert result.returncode != 0
    assert "non-finite loss at update 1 on rank 1" in result.stderr
    assert (out / "nonfinite" / "update_1_rank_1.jsonl").exists()
    assert not (out / "nonfinite" / "update_1_rank_0.jsonl").exists()


def test_no_optimizer_step_on_a_nonfinite_loss():
    tokenizer = policy_tokenizer()
    policy = tiny_policy(len(tokenizer))
    queries, mask = plumbing.pad_sequences([tokenizer("a b :")["input_ids"]] * 2, 0, torch.device("cpu"))
    c = rloo.sample_completions(policy, queries, mask, 4, 1.0, 1, 0, k=2)  # 4 completions
    rollout = rloo.Rollout(c.queries, c.query_mask, c.responses, c.response_mask, torch.zeros(4, 4), None)
    args = rloo.Args(rloo_k=2, per_device_train_batch_size=4, num_ppo_epochs=1, temperature=1.0)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1.0)
    with pytest.raises(NonFiniteError, match="non-finite loss on rank 0"):
        rloo.ppo_update(policy, optimizer, rollout, torch.tensor([1.0, float("inf"), 0.0, 0.0]), args,  # NaN: unscored
                        rloo.compute_batch_sizes(args, 1), True, lambda: torch.autocast("cpu", enabled=False))
    assert all(torch.equal(before[k], v) for k, v in policy.state_dict().items())


# ---------------------------------------------------------------- checkpoints in this process
def test_save_total_limit_keeps_the_newest_and_never_deletes_it(tmp_path):
    assert steps_to_prune([1, 2, 3], 2, newest=3) == [1]
    assert steps_to_prune([1, 2, 3], 1, newest=3) == [1, 2]
    assert steps_to_prune([4, 9], 1, newest=4) == [9]  # the one just written stays, whatever its number
    assert steps_to_prune([1, 2], None, newest=2) == []
    for limit in (0, -1):  # refused as flags too (test_cli.py)
        with pytest.raises(ValueError, match="would remove the checkpoint just written"):
            steps_to_prune([1, 2], limit, newest=2)
    saved_steps(tmp_path, [1, 2, 3], keep=1)
    assert [p.name for p in checkpoint_dirs(str(tmp_path))] == ["step_3"]


def no_hard_links(source, target, **where):
    raise OSError(18, "Invalid cross-device link")


@pytest.mark.parametrize("link", [os.link, no_hard_links], ids=["hard links", "a filesystem without them"])
def test_the_final_policy_is_the_final_checkpoints_stored_once_where_the_filesystem_can(tmp_path, monkeypatch, link):
    policy, _, tokenizer = saved_steps(tmp_path, [1])
    step = tmp_path / "checkpoints" / "step_1"
    (tmp_path / "model.safetensors").write_text("this run's, of an earlier finish")
    (tmp_path / "args.json").write_text(json.dumps({"run_id": "run-a", "files": ["model.safetensors"]}))
    (tmp_path / "config.json").write_text("a user's, come while the run ran")
    monkeypatch.setattr(os, "link", link)
    with pytest.raises(plumbing.Fault, match="config.json appeared while the run ran and is not this run's: the "):
        save_final_policy(policy, tokenizer, str(tmp_path), 0, step, "run-a")
    assert (tmp_path / "config.json").read_text() == "a user's, come while the run ran"
    (tmp_path / "config.json").unlink()
    (tmp_path / "args.json").unlink()
    with pytest.raises(plumbing.Fault, match="model.safetensors appeared while the run ran"):  # no record lists it
        save_final_policy(policy, tokenizer, str(tmp_path), 0, step, "run-b")
    (tmp_path / "args.json").write_text(json.dumps({"run_id": "run-a", "files": ["model.safetensors"]}))
    save_final_policy(policy, tokenizer, str(tmp_path), 0, step, "run-a")
    (tmp_path / "args.json").unlink()
    names = sorted(p.name for p in tmp_path.iterdir() if p.is_file())
    assert names == sorted(p.name for p in step.iterdir() if p.name not in ("trainer_state.pt", "manifest.json")
                           and not RANK_FILE.fullmatch(p.name) and p.is_file())
    for name in names:
        assert (tmp_path / name).samefile(step / name) == (link is not no_hard_links), name
        assert (tmp_path / name).read_bytes() == (step / name).read_bytes(), name
    assert checkpoint_problem(step) is None
    assert AutoModelForCausalLM.from_pretrained(tmp_path).num_parameters() == policy.num_parameters()


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def without_manifest(damage: Callable) -> Callable:
    """A checkpoint copied without its manifest, then damaged: the manifest's absence is the reason given."""
    return lambda step: ((step / "manifest.json").unlink(), damage(step))


def pickled_weights(step: Path) -> None:
    """The weights as a pickle (pytorch_model.bin) that would run code, listed by a true manifest."""
    torch.save({"gpt_neox.embed_in.weight": Payload(step.parent.parent / "ran")}, step / "pytorch_model.bin")
    (step / "model.safetensors").unlink()
    forge_manifest(step)


NO_MANIFEST = "no manifest.json, which every save writes: a copy that did not finish, or a damaged checkpoint"
DAMAGE = {"truncated weights": (lambda step: truncate(step / "model.safetensors"), "model.safetensors has"),
          "truncated trainer state": (lambda step: truncate(step / "trainer_state.pt"), "trainer_state.pt has"),
          "a missing rank file": (lambda step: (step / "rank0.pt").unlink(), "rank0.pt is missing"),
          "no manifest": (lambda step: (step / "manifest.json").rename(step / "kept"), NO_MANIFEST),
          "no manifest, truncated weights": (without_manifest(lambda step: truncate(step / "model.safetensors")),
                                             NO_MANIFEST),
          "no manifest, weights missing": (without_manifest(lambda step: (step / "model.safetensors").unlink()),
                                           NO_MANIFEST),
          "weights in a pickle": (pickled_weights, "no weights in safetensors (pytorch_model.bin instead): a pickle "
                                                   "is never loaded")}


@pytest.mark.parametrize("damage", DAMAGE, ids=list(DAMAGE))
def test_resume_skips_a_damaged_newest_checkpoint_and_names_it(tmp_path, damage):
    saved_steps(tmp_path, [1, 2, 3])
    damage_step, reason = DAMAGE[damage]
    step_3 = tmp_path / "checkpoints" / "step_3"
    damage_step(step_3)
    start = resume_checkpoint(rloo.Args(output_dir=str(tmp_path), resume=True))
    assert start.checkpoint == tmp_path / "checkpoints" / "step_2" and start.state["update"] == 2
    assert list(start.skipped) == [step_3] and reason in start.skipped[step_3]
    with pytest.raises(plumbing.ConfigError, match=re.escape(f"--resume_from {step_3} is damaged: {reason}")):
        resume_checkpoint(rloo.Args(output_dir=str(tmp_path), resume_from=str(step_3)))
    notes = settle_output_dir(rloo.Args(output_dir=str(tmp_path), resume=True), 2, start.skipped)
    assert any(f"skipped damaged checkpoint step_3: {reason}" in note for note in notes)
    (aside,) = (tmp_path / "abandoned").iterdir()  # moved, not deleted
    assert (aside / "checkpoints" / "step_3").is_dir() and reason in (aside / "why.txt").read_text()
    assert latest_checkpoint(str(tmp_path)) == tmp_path / "checkpoints" / "step_2"
    assert not (tmp_path / "ran").exists()  # nothing was unpickled


def test_a_step_directory_without_manifest_or_trainer_state_is_no_checkpoint(tmp_path):
    saved_steps(tmp_path, [1, 2])
    step_2 = tmp_path / "checkpoints" / "step_2"
    (step_2 / "manifest.json").unlink()
    (step_2 / "trainer_state.pt").unlink()
    start = resume_checkpoint(rloo.Args(output_dir=str(tmp_path), resume=True))
    assert start.checkpoint == tmp_path / "checkpoints" / "step_1" and start.skipped == {}


class Payload:
    """Unpickled, it creates the file `marker` (open(marker, "w")): any code could run in its place."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def test_checkpoints_cannot_run_code(tmp_path):
    policy, optimizer, _ = saved_steps(tmp_path, [1])
    step, marker = tmp_path / "checkpoints" / "step_1", tmp_path / "ran"
    torch.save({"update": 1, "note": Payload(marker)}, step / "trainer_state.pt")
    torch.save({"generators": {"python": Payload(marker)}}, step / "rank0.pt")
    forge_manifest(step)
    assert checkpoint_problem(step) is None  # the manifest matches: only what the files hold can tell
    with pytest.raises(plumbing.ConfigError, match="trainer_state.pt holds io.open, not only tensors"):
        resume_checkpoint(rloo.Args(output_dir=str(tmp_path), resume_from=str(step)))
    with pytest.raises(plumbing.ConfigError, match="rank0.pt holds io.open"):
        load_safely(step / "rank0.pt")
    # torch.distributed.checkpoint unpickles its metadata with pickle: read by an allow-list first
    dcp.save({"optimizer": optimizer.state_dict()}, checkpoint_id=str(step / "optimizer"))
    forge_manifest(step)
    assert unsafe_metadata(step / "optimizer" / ".metadata") is None  # a real one passes
    (step / "optimizer" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    forge_manifest(step)
    assert "refers to io.open, which could run code" in checkpoint_problem(step)
    assert not marker.exists()
    torch.load(step / "trainer_state.pt", weights_only=False)  # what loading used to do
    assert marker.exists()  # the payload is real


def sharded_checkpoint(root: Path) -> Path:
    """A checkpoint as an --fsdp run writes it, in root/run: the optimizer state in DCP shards (optimizer/), not in
    trainer_state.pt; the initial policy in root/initial."""
    policy, optimizer, tokenizer = saved_steps(root / "run", [1])
    policy.save_pretrained(root / "initial")
    tokenizer.save_pretrained(root / "initial")
    step = root / "run" / "checkpoints" / "step_1"
    torch.save(trainer_state(1, optimizer="optimizer"), step / "trainer_state.pt")
    dcp.save(get_optimizer_state_dict(policy, optimizer), checkpoint_id=str(step / "optimizer"))
    forge_manifest(step)
    return step


def forged_shard_entry(step: Path, payload: Payload) -> None:
    """The optimizer's shards written again with a payload for one of their non-tensor entries."""
    policy = AutoModelForCausalLM.from_pretrained(step)
    state = get_optimizer_state_dict(policy, torch.optim.AdamW(policy.parameters()))
    state["param_groups"][0]["lr"] = payload
    dcp.save(state, checkpoint_id=str(step / "optimizer"))


def pickle_as(name: str) -> Callable:
    return lambda step, payload: (step / name).write_bytes(pickle.dumps(payload))


# every kind of file a checkpoint holds, forged with a payload that would run code: how resuming from it ends (the
# line of its refusal; None: it resumes, the file never read)
FORGED = {
    "trainer_state.pt": (lambda step, payload: torch.save(trainer_state(1, note=payload), step / "trainer_state.pt"),
                         "trainer_state.pt holds io.open, not only tensors and plain values"),
    "the optimizer state in trainer_state.pt": (
        lambda step, payload: torch.save(trainer_state(1, optimizer={"state": {}, "param_groups": [{"lr": payload}]}),
                                         step / "trainer_state.pt"), "trainer_state.pt holds io.open"),
    "rank0.pt": (lambda step, payload: torch.save({"python": payload}, step / "rank0.pt"),
                     "rank0.pt holds io.open"),
    "optimizer/.metadata": (pickle_as("optimizer/.metadata"), ".metadata refers to io.open, which could run code"),
    "optimizer/__0_0.distcp": (forged_shard_entry, "optimizer/*.distcp's entry 'param_groups.0.lr' holds io.open"),
    "model.safetensors": (pickle_as("model.safetensors"), "model.safetensors is not a safetensors file"),
    "adapter_model.safetensors": (pickle_as("adapter_model.safetensors"),
                                  "adapter_model.safetensors is not a safetensors file"),
    "adapter_model.bin": (lambda step, payload: torch.save({"w": payload}, step / "adapter_model.bin"), None),
    "pytorch_model.bin": (lambda step, payload: torch.save({"w": payload}, step / "pytorch_model.bin"), None),
    "config.json": (pickle_as("config.json"), None),
    "generation_config.json": (pickle_as("generation_config.json"), None),
    "tokenizer.json": (pickle_as("tokenizer.json"), None),
    "tokenizer_config.json": (pickle_as("tokenizer_config.json"), None),
    "manifest.json": (pickle_as("manifest.json"), "manifest.json cannot be read"),
}


@pytest.mark.parametrize("forged", FORGED, ids=list(FORGED))
def test_no_file_of_a_checkpoint_can_run_code(tmp_path, forged):
    """Each file of a (sharded) checkpoint forged, its manifest made to match: a resume refuses it in one line, before
    any model loads, or never reads it; nothing is unpickled beyond tensors and plain values."""
    step, marker = sharded_checkpoint(tmp_path), tmp_path / "ran"
    forge, refusal = FORGED[forged]
    forge(step, Payload(marker))
    if forged != "manifest.json":
        forge_manifest(step)
    args = rloo.Args(model_name_or_path=str(tmp_path / "initial"), output_dir=str(tmp_path / "run"),
                     resume_from=str(step))
    try:  # what a resume reads: at start-up, then the weights and each rank's optimizer shard and generators
        start = resume_checkpoint(args)
        policy, _, _, _ = rloo.load_policy(args, torch.device("cpu"), start.checkpoint, policy_tokenizer())
        read_shards(get_optimizer_state_dict(policy, torch.optim.AdamW(policy.parameters())),
                    step / "optimizer")
        load_safely(step / "rank0.pt")
        problem = None
    except plumbing.ConfigError as e:
        problem = str(e)
    assert not marker.exists()
    if refusal is None:
        assert problem is None, problem
    else:
        assert problem.startswith(f"--resume_from {step} is damaged: ") and refusal in problem, problem
        assert "\n" not in problem
    if forged.endswith(".distcp"):  # torch's default planner would have run it
        policy = AutoModelForCausalLM.from_pretrained(tmp_path / "initial")
        dcp.load(get_optimizer_state_dict(policy, torch.optim.AdamW(policy.parameters())),
                 checkpoint_id=str(step / "optimizer"))
        assert marker.exists()


def test_a_forged_shard_is_refused_in_one_line_before_anything_loads(assets, tmp_path):
    step, marker = sharded_checkpoint(tmp_path), tmp_path / "ran"
    forged_shard_entry(step, Payload(marker))
    forge_manifest(step)
    result = run_rloo("--model_name_or_path", tmp_path / "initial", "--dataset_name", assets["train"],
                      "--reward_fn", "reward_fns:count_a", "--output_dir", tmp_path / "run", "--resume_from", step)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr[-3000:]
    assert "optimizer/*.distcp's entry 'param_groups.0.lr' holds io.open" in result.stderr
    assert not marker.exists() and "loaded the policy" not in result.stdout


def forged_optimizer(change: Callable) -> Callable:
    """A forgery of a checkpoint's optimizer state (trainer_state.pt's) by `change(state_dict)`."""
    def forge(step: Path) -> None:
        state = torch.load(step / "trainer_state.pt", weights_only=True)
        change(state["optimizer"])
        torch.save(state, step / "trainer_state.pt")
    return forge


def forged_part(name: str, value) -> Callable:
    """A forgery of rank 0's part `name` in its rank0.pt (a rank file of another run, update or rank:
    test_output_dir.py's test_a_rank_file_proves_whose_it_is)."""
    def forge(step: Path) -> None:
        saved = torch.load(step / "rank0.pt", weights_only=True)
        saved["parts"][name] = value
        torch.save(saved, step / "rank0.pt")
    return forge


def forged_reference(step: Path) -> None:
    """A trainer state holding reference weights of another shape (the reference's are saved once they change)."""
    state = torch.load(step / "trainer_state.pt", weights_only=True)
    state["reference"] = {"gpt_neox.embed_in.weight": torch.zeros(3, 4)}
    torch.save(state, step / "trainer_state.pt")


FORGED_CONTENTS = {  # a forgery of the right kinds of values (a weights_only load reads it): what it says
    "a wrong-shaped exp_avg": (forged_optimizer(lambda o: o["state"][0].update(exp_avg=torch.zeros(3, 5))),
                               "trainer_state.pt state[0]['exp_avg'] has shape (3, 5), but its parameter has (15, 32)"),
    "three betas": (forged_optimizer(lambda o: o["param_groups"][0].update(betas=(0.9, 0.99, 0.999))),
                    "trainer_state.pt param_groups[0]['betas'] is (0.9, 0.99, 0.999) (a tuple), not a tuple of 2"),
    "a negative step": (forged_optimizer(lambda o: o["state"][1].update(step=torch.tensor(-2.0))),
                        "trainer_state.pt state[1]['step'] is -2.0, not a count >= 0"),
    "a NaN in exp_avg_sq": (forged_optimizer(lambda o: o["state"][2]["exp_avg_sq"].view(-1)[0].fill_(float("nan"))),
                            "trainer_state.pt state[2]['exp_avg_sq'] holds a value that is not finite"),
    "a string lr": (forged_optimizer(lambda o: o["param_groups"][0].update(lr="0.1")),
                    "trainer_state.pt param_groups[0]['lr'] is '0.1' (a str), not a float"),
    "a state of no parameter": (forged_optimizer(lambda o: o["state"].update({999: {}})),
                                "trainer_state.pt state[999] is of no parameter of the optimizer"),
    "kl_coef: True in the algorithm state": (forged_part("algorithm_state", {"kl_coef": True}),
                                             "rank0.pt's part 'algorithm_state': its fields are ['kl_coef'] but "
                                             "AlgorithmState has []"),
    "a sampler's epoch as a string": (forged_part("sampler", {"epoch": "x", "position": 0}),
                                      "rank0.pt's part 'sampler': "),
    "a part the run does not have": (forged_part("replay", [0] * 10),
                                     "part 'replay' is in rank0.pt but not in this run"),
    "an absurd size": (forged_part("algorithm_state", {"notes": "x" * 17_000_000}),
                       "rank0.pt holds 16.2 MiB of values outside tensors, more than a checkpoint of this code writes "
                       "(16 MiB): not read"),
    "no generators": (forged_part("generators", None), "rank0.pt's part 'generators': "),
    "a sampler position of 10^15": (forged_part("sampler", {"epoch": 0, "position": 10**15}), "rank0.pt's part "
                                    "'sampler': the sampler's position 1000000000000000 (epoch 0) is none that this "
                                    "run "
                                    "reaches: a multiple of its 8 prompts per update within its"),
    "a sampler position of -3": (forged_part("sampler", {"epoch": 0, "position": -3}), "the sampler's position -3"),
    "generators of another kind": (forged_part("generators", {"python": 1, "torch": 2, "sampling": 3, "numpy": 4}),
                                   "rank0.pt's part 'generators': the generators' states cannot be set (TypeError"),
    # found once the models are loaded (they need them), before anything in output_dir moves
    "a forged verdict for settings that rule the shortcut out": (
        forged_part("on_policy_shortcut", {"checked": True, "on": True}), "rank0.pt's part 'on_policy_shortcut': "
        "OnPolicyShortcut says the shortcut is on, which this run's settings rule out"),
    "reference weights of another shape": (forged_reference, "the reference's weights in trainer_state.pt lack "),
}
AFTER_THE_MODELS_LOAD = ("a wrong-shaped exp_avg", "three betas", "a negative step", "a NaN in exp_avg_sq",
                         "a string lr", "a state of no parameter", "a part the run does not have",
                         "a forged verdict for settings that rule the shortcut out",
                         "reference weights of another shape")  # what needs the models (or the rollout source)


@pytest.fixture(scope="module")
def one_update(assets, tmp_path_factory) -> Path:
    """A run of one update (single process) and its checkpoint."""
    out = tmp_path_factory.mktemp("one_update") / "run"
    result = run_rloo("--model_name_or_path", assets["policy"], "--dataset_name", assets["train"], "--output_dir", out,
                      *RUN[:-2], "--total_episodes", PER_UPDATE)
    assert result.returncode == 0, result.stderr[-3000:]
    return out / "checkpoints" / "step_1"


@pytest.mark.parametrize("forged", FORGED_CONTENTS, ids=list(FORGED_CONTENTS))
def test_a_checkpoints_contents_are_checked_by_type_and_shape_before_training(assets, tmp_path, one_update, forged):
    """Values of the right kinds that do not fit the run (a forged or foreign checkpoint): one line naming the file
    and the field, exit 2, no traceback, before the first update."""
    step = tmp_path / "checkpoints" / "step_1"
    shutil.copytree(one_update, step)
    forge, refusal = FORGED_CONTENTS[forged]
    forge(step)
    forge_manifest(step)
    result = run_rloo("--model_name_or_path", assets["policy"], "--dataset_name", assets["train"], "--output_dir",
                      tmp_path / "run", *RUN[:-2], "--total_episodes", 2 * PER_UPDATE, "--resume_from", step)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr[-3000:]
    assert str(step) in result.stderr and refusal in result.stderr, result.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not read_metrics(tmp_path / "run")
    assert ("loaded the policy" in result.stdout) == (forged in AFTER_THE_MODELS_LOAD), result.stdout


def test_a_refused_resume_moves_nothing_in_output_dir(assets, tmp_path, one_update):
    """Issue 56: a refusal made while restoring came after the metrics lines past the checkpoint were moved into
    abandoned/. Every refusal comes before output_dir is settled for the timeline continued."""
    out = tmp_path / "run"
    shutil.copytree(one_update.parent.parent, out)
    with open(out / "metrics.jsonl", "a") as f:  # an update logged, not checkpointed, before a kill
        f.write(json.dumps({"update": 2, "episode": 2 * PER_UPDATE, "run_id": read_metrics(out)[0]["run_id"]}) + "\n")
    forged_part("on_policy_shortcut", {"checked": True, "on": True})(out / "checkpoints" / "step_1")
    forge_manifest(out / "checkpoints" / "step_1")
    before = tree(out)
    result = run_rloo("--model_name_or_path", assets["policy"], "--dataset_name", assets["train"], "--output_dir", out,
                      *RUN[:-2], "--total_episodes", 2 * PER_UPDATE, "--resume")
    assert result.returncode == 2 and "'on_policy_shortcut': OnPolicyShortcut says the shortcut is on" in result.stderr
    assert tree(out) == before and not (out / "abandoned").exists() and not (out / "run.lock").exists()


def test_a_checkpoint_cannot_choose_the_code_that_runs(tmp_path):
    """--resume --trust_remote_code: the architecture and any remote code come from the initial model, only the
    weights from the checkpoint."""
    tokenizer = policy_tokenizer()
    initial = tmp_path / "initial"
    tiny_policy(len(tokenizer), seed=1).save_pretrained(initial)
    tokenizer.save_pretrained(initial)
    trained, _, _ = saved_steps(tmp_path / "run", [1])
    step, marker = tmp_path / "run" / "checkpoints" / "step_1", tmp_path / "ran"
    (step / "evil.py").write_text(f"open({str(marker)!r}, 'w')\nfrom transformers import GPTNeoXForCausalLM as Evil\n")
    config = json.loads((step / "config.json").read_text())
    (step / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoModelForCausalLM": "evil.Evil"}}))
    forge_manifest(step)
    args = rloo.Args(model_name_or_path=str(initial), output_dir=str(tmp_path / "run"), resume=True,
                     trust_remote_code=True)
    start = resume_checkpoint(args)
    assert start.checkpoint == step
    policy, reference, _, _ = rloo.load_policy(args, torch.device("cpu"), start.checkpoint, tokenizer)
    assert not marker.exists()
    expected = {"policy": trained.state_dict(), "reference": AutoModelForCausalLM.from_pretrained(initial).state_dict()}
    for name, model in (("policy", policy), ("reference", reference)):
        assert all(torch.equal(value, expected[name][key]) for key, value in model.state_dict().items()), name


def hub_snapshot(root: Path, commit: str) -> None:
    """A model in the tests' Hugging Face cache (its folder `root`), its main branch at `commit`, as a download
    leaves it."""
    (root / "snapshots" / commit).mkdir(parents=True)
    (root / "snapshots" / commit / "config.json").write_text("{}")
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(commit)


INITIAL_MODEL_CHANGES = {  # what happens to the initial model between a save and a resume: the error's fragment
    "weights edited": (lambda root: truncate(root / "model.safetensors"), "these files differ: model.safetensors"),
    "a file added": (lambda root: (root / "extra.py").write_text(""), "these files differ: extra.py"),
    "config edited": (lambda root: (root / "config.json").write_text("{}"), "these files differ: config.json"),
    "a new Hub revision": (lambda root: hub_snapshot(root, "b" * 40), f"revision {'a' * 40} -> {'b' * 40}"),
}


@pytest.mark.parametrize("change", INITIAL_MODEL_CHANGES, ids=list(INITIAL_MODEL_CHANGES))
def test_a_resume_refuses_an_initial_model_that_changed(tmp_path, change):
    tokenizer = policy_tokenizer()
    model, root = hub_cache_repo(tmp_path.name) if change == "a new Hub revision" else (str(tmp_path), tmp_path)
    if change == "a new Hub revision":
        hub_snapshot(root, "a" * 40)
    else:
        tiny_policy(len(tokenizer)).save_pretrained(root)
        tokenizer.save_pretrained(root)
    identity = lambda: model_identity(model)  # noqa: E731
    saved = {"model_name_or_path": identity()}
    assert check_same_inputs(saved, {"model_name_or_path": identity()}, ()) == []  # unchanged: resumes
    apply, fragment = INITIAL_MODEL_CHANGES[change]
    apply(root)
    with pytest.raises(plumbing.ConfigError, match=re.escape(
            f"cannot resume: the input --model_name_or_path is not the one the run started with ({fragment}): restore "
            "it, or pass --allow_changed_inputs model_name_or_path to continue with it as it is now")):
        check_same_inputs(saved, {"model_name_or_path": identity()}, ())
    (note,) = check_same_inputs(saved, {"model_name_or_path": identity()}, ("model_name_or_path",))
    assert note.startswith(f"model_name_or_path changed ({fragment}), allowed by --allow_changed_inputs")


def test_rng_states_survive_a_safe_round_trip(tmp_path):
    sampling = torch.Generator().manual_seed(3)
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(4)

    def draws() -> tuple:
        return random.random(), np.random.rand(), torch.rand(1).item(), torch.rand(1, generator=sampling).item()

    torch.save(plumbing.checkpoints.rng_state(sampling), tmp_path / "rng.pt")
    expected = draws()
    set_rng_state(load_safely(tmp_path / "rng.pt"), sampling)
    assert draws() == expected


def test_another_timeline_is_moved_aside_and_an_overwrite_moves_only_the_runs_files(tmp_path):
    fake_run(tmp_path, [1, 2, 3])
    with pytest.raises(plumbing.ConfigError, match="holds another run's files .checkpoints up to step_3.: pass --resume"):
        resume_checkpoint(rloo.Args(output_dir=str(tmp_path)))
    saved_steps(tmp_path / "other_run", [1])  # another run's checkpoint would mix two runs in one directory
    with pytest.raises(plumbing.ConfigError, match="holds an earlier run .*, not .*other_run.*'s: pass another"):
        resume_checkpoint(rloo.Args(output_dir=str(tmp_path),
                                         resume_from=str(tmp_path / "other_run" / "checkpoints" / "step_1")))
    # --resume_from step_1: steps 2, 3 and the metrics after update 1 are another timeline
    notes = settle_output_dir(rloo.Args(output_dir=str(tmp_path), resume_from="step_1"), 1, {}, "run-a")
    (aside,) = (tmp_path / "abandoned").iterdir()
    assert aside.name.endswith("_after_update_1") and str(aside) in notes[-1]
    assert sorted(p.name for p in (aside / "checkpoints").iterdir()) == ["step_2", "step_3"]
    assert [p.name for p in checkpoint_dirs(str(tmp_path))] == ["step_1"]
    assert (tmp_path / "metrics.jsonl").read_text() == '{"update": 1, "run_id": "run-a"}\n'
    assert (aside / "metrics.jsonl").read_text().splitlines()[0] == '{"update": 2, "run_id": "run-a"}'
    assert settle_output_dir(rloo.Args(output_dir=str(tmp_path)), 1, {}, "run-a") == []  # nothing later
    # --overwrite_output_dir: the run's files move aside, and nothing else (the user's plot, notes, .git, the
    # other directory stay where they are)
    users = {name: data for name, data in tree(tmp_path).items() if not name.startswith(("abandoned/", "checkpoints/"))
             and name not in ("args.json", "metrics.jsonl", "model.safetensors", "config.json", "tokenizer.json")}
    resume_checkpoint(rloo.Args(output_dir=str(tmp_path), overwrite_output_dir=True))
    settle_output_dir(rloo.Args(output_dir=str(tmp_path), overwrite_output_dir=True), 0, {}, "run-b")
    overwritten = next(p for p in (tmp_path / "abandoned").iterdir() if p.name.endswith("_overwritten"))
    assert sorted(p.name for p in overwritten.iterdir()) == ["args.json", "checkpoints", "config.json",
                                                            "metrics.jsonl", "model.safetensors", "tokenizer.json"]
    assert {n: d for n, d in tree(tmp_path).items() if not n.startswith("abandoned/")} == users
    assert sorted(p.name for p in tmp_path.iterdir()) == [".git", "abandoned", "my_plot.png", "notes.txt", "other_run"]


def test_a_signal_during_start_up_stops_at_once_and_marks_a_preemption(tmp_path):
    saved = {sig: signal.getsignal(sig) for sig in plumbing.StopSignal.SIGNALS}
    try:
        lock = plumbing.OutputDirLock(str(tmp_path))
        stop = plumbing.StopSignal(lock, announce=False)
        with pytest.raises(StartupInterrupted, match="SIGUSR1 received during start-up"):
            os.kill(os.getpid(), signal.SIGUSR1)  # before output_dir is this run's: no marker
        assert not (tmp_path / "preempted").exists()
        lock.acquire()  # the marker is written only by the run holding output_dir
        with pytest.raises(StartupInterrupted, match="SIGTERM received during start-up: .*nothing was trained"):
            os.kill(os.getpid(), signal.SIGTERM)
        assert (tmp_path / "preempted").exists()
        stop.training = True  # from then on a signal is only recorded, for the update loop to act on
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.name == "SIGUSR1"
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def test_a_signal_while_prompts_are_tokenized_stops_the_start_up_at_once(tmp_path):
    """A tokenizer's Rust code keeps the thread that calls it for as long as it runs, and Python runs signal handlers
    in the main thread only: the prompts are tokenized in a thread the main thread waits for, which a stop signal
    ends at once."""
    release, returned = threading.Event(), []

    def stuck(rows: dict, tokenizer, column: str) -> list[list[int]]:  # a call that returns when the test says so
        os.kill(os.getpid(), signal.SIGTERM)
        release.wait(600)  # a hang guard only
        returned.append(True)
        return plumbing.prompt_token_ids(rows, tokenizer, column)

    plumbing.StopSignal(plumbing.OutputDirLock(str(tmp_path)), announce=False)
    try:
        with pytest.raises(StartupInterrupted, match="SIGTERM received during start-up"):
            prepare_prompts(datasets.Dataset.from_list([{"prompt": "a :"}]), policy_tokenizer(), "prompt", 4,
                            "d", None, stuck)
        assert not returned  # stopped while the tokenizer still ran
    finally:
        release.set()


def test_sighup_stops_a_run_as_sigterm_does_unless_ignored_at_start(tmp_path):
    """A terminal or SSH session closed: SIGHUP asks for the stop with a checkpoint, as SIGTERM does; under nohup
    (SIGHUP ignored when the run starts) it stays ignored."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)  # a terminal's session, whatever this process inherited (nohup)
    lock = plumbing.OutputDirLock(str(tmp_path))
    lock.acquire()
    stop = plumbing.StopSignal(lock, announce=False)
    with pytest.raises(StartupInterrupted, match="SIGHUP received during start-up: .*nothing was trained"):
        signal.raise_signal(signal.SIGHUP)
    assert (tmp_path / "preempted").exists()
    stop.training = True
    signal.raise_signal(signal.SIGHUP)
    assert stop.name == "SIGHUP"
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as nohup starts a process
    stop = plumbing.StopSignal(lock, announce=False)
    stop.training = True
    signal.raise_signal(signal.SIGHUP)
    signal.raise_signal(signal.SIGTERM)
    assert stop.name == "SIGTERM" and signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    lock.release()


def test_a_console_gone_or_a_thread_left_running_never_keeps_a_run_from_stopping_or_ending(assets, tmp_path):
    """`python rloo.py ... 2>&1 | tee log`, then Ctrl-C, which reaches tee too: the run writes into a closed pipe, and
    its reward function has left a thread running that is not a daemon. It stops after the update with a checkpoint
    a resume takes, exits 0, each metrics.jsonl line saying that the console went away."""
    out = tmp_path / "run"
    process = subprocess.Popen(script_command(
        "rloo.py", "--model_name_or_path", assets["policy"], "--dataset_name", assets["train"], "--output_dir", out,
        "--reward_fn", "reward_fns:count_a_leaving_a_thread", "--rloo_k", "2", "--per_device_train_batch_size", "4",
        "--response_length", "4", "--num_ppo_epochs", "1", "--num_sample_generations", "0", "--total_episodes",
        4000), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=script_env(), cwd=REPO)  # 1000 updates
    process.stdout.close()  # the reader is gone before the run writes a line
    try:
        wait_until(lambda: updates_logged(out) >= 1, process, "an update logged")
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=600) == 0
    finally:  # a run that hangs does not outlive the test
        process.kill()
    stopped_at = latest_checkpoint(str(out))
    assert stopped_at is not None and (out / "preempted").read_text().strip() == str(stopped_at)
    assert resume_checkpoint(rloo.Args(output_dir=str(out), resume=True)).checkpoint == stopped_at
    assert all("stdout: BrokenPipeError" in line["console_lost"] for line in read_metrics(out))


def test_a_console_write_that_fails_is_dropped_and_remembered(tmp_path):
    """Whatever way a console goes (a closed pipe, a full disk, a closed file) a write or flush to it returns, its
    descriptor then points at /dev/null (later writes, Python's flush at exit, succeed), and `lost` says what
    failed; text the console cannot encode is written escaped."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    cases = {"a closed pipe": (open(write_end, "w"), "BrokenPipeError"),
             "a full disk": (open("/dev/full", "w"), "No space left on device"),
             "a closed file": (open(tmp_path / "closed", "w"), "I/O operation on closed file")}
    cases["a closed file"][0].close()
    for case, (stream, why) in cases.items():
        console = ConsoleStream(stream, "stdout")
        assert console.write("x" * 100_000) == 100_000 and console.flush() is None, case
        console.write("later\n")
        console.flush()
        assert console.lost.startswith("stdout: ") and why in console.lost, (case, console.lost)
        if not stream.closed:
            assert os.path.samefile(f"/proc/self/fd/{stream.fileno()}", os.devnull), case
            stream.close()
    ascii_file = tmp_path / "ascii"
    with open(ascii_file, "w", encoding="ascii") as stream:
        console = ConsoleStream(stream, "stdout")
        console.write("score \u2713 \u00e9\n")
        assert console.lost is None
    assert ascii_file.read_text() == "score \\u2713 \\xe9\n"


@pytest.mark.parametrize("limit", ["a file size limit", "a full disk"])
def test_a_full_disk_during_a_save_keeps_the_previous_checkpoint_and_says_so(tmp_path, limit):
    """Issue 56: a full disk showed torch's "unexpected pos 64 vs 0": the line says what the disk said, and where."""
    script = (
        "import os, resource, signal, sys, torch\n"
        "from conftest import policy_tokenizer, tiny_policy\n"
        "import plumbing\n"
        "plumbing.quiet_hub_progress_bars()\n"
        "out, tokenizer = sys.argv[1], policy_tokenizer()\n"
        "policy = tiny_policy(len(tokenizer))\n"
        "optimizer = torch.optim.AdamW(policy.parameters())\n"
        "from helpers import trainer_state\n"
        "full, os.environ['FULL_DISK'] = os.environ.get('FULL_DISK'), ''\n"
        "plumbing.checkpoints.save_checkpoint(out, 1, policy, optimizer, tokenizer, trainer_state(1), 0, None, {})\n"
        "os.environ['FULL_DISK'] = full or ''\n"
        "if not full:\n"
        "    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails (EFBIG)\n"
        "    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))\n"
        "state = {'update': 2, 'run_id': 'run-a', 'ballast': torch.zeros(1 << 20)}  # 4 MB\n"
        "save = plumbing.checkpoints.save_checkpoint\n"
        "plumbing.run_script(lambda _: save(out, 2, policy, optimizer, tokenizer, state, 0, None, {}), None, 'rloo.py')\n")
    env = script_env({"PYTHONPATH": f"{REPO / 'tests'}:{REPO}"} if limit == "a file size limit" else {
        **full_disk("trainer_state.pt"), "PYTHONPATH": f"{REPO / 'tests' / 'full_disk'}:{REPO / 'tests'}:{REPO}"})
    result = subprocess.run([python(), "-c", script, str(tmp_path)], capture_output=True, text=True, env=env,
                            timeout=600)
    assert result.returncode == 4 and result.stderr.strip().count("\n") == 0, result.stderr[-3000:]
    step_1 = tmp_path / "checkpoints" / "step_1"
    why = "File too large" if limit == "a file size limit" else "No space left on device"
    assert (f"rloo.py: error: could not write checkpoint step_2 ({tmp_path}/checkpoints/.tmp_step_2/trainer_state.pt): "
            f"{why} (") in result.stderr, result.stderr
    assert "free on its filesystem); " in result.stderr and f"the newest, {step_1}, is intact" in result.stderr
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_1"]  # the partial one removed
    assert resume_checkpoint(rloo.Args(output_dir=str(tmp_path), resume=True)).checkpoint == step_1


def full_disk(*names: str) -> dict:
    """The environment of a run whose writes to files of these names fail with ENOSPC (tests/full_disk)."""
    return {"PYTHONPATH": f"{REPO / 'tests' / 'full_disk'}{os.pathsep}{REPO / 'tests'}", "FULL_DISK": ",".join(names)}


def test_a_full_disk_outside_a_save_stops_with_a_checkpoint_and_one_line(assets, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    result = run_rloo("--model_name_or_path", assets["policy"], "--dataset_name", assets["train"], "--output_dir", out,
                      *RUN, "--total_episodes", PER_UPDATE * 3, env=full_disk("metrics.jsonl"))  # every write: ENOSPC
    assert result.returncode == 4 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == (
        f"rloo.py: error: could not write {out / 'metrics.jsonl'} (No space left on device) after update 1; "
        f"checkpoint of update 1 saved to {out / 'checkpoints' / 'step_1'}; fix it, then continue with --resume")
    assert latest_checkpoint(str(out)).name == "step_1"
    script = (  # a line that does not fit is cut off again: metrics.jsonl never ends in half a line
        "import resource, signal, sys\n"
        "from pathlib import Path\n"
        "import plumbing\n"
        "logger = object.__new__(plumbing.RunLogger)\n"
        "logger.metrics_path = Path(sys.argv[1])\n"
        "logger.metrics_path.touch()\n"
        "logger.output_dir, logger.identity, logger.run_id = sys.argv[1].rpartition('/')[0], None, None\n"
        "logger.write_metrics({'update': 1})\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails (EFBIG)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))\n"
        "plumbing.run_script(lambda _: logger.write_metrics({'update': 2, 'text': 'x' * 10000}), None, 'rloo.py')\n")
    env = script_env({"PYTHONPATH": f"{REPO / 'tests'}:{REPO}"})  # offline: as the server of forks
    result = subprocess.run([python(), "-c", script, str(tmp_path / "metrics.jsonl")], capture_output=True,
                            text=True, env=env, timeout=600)
    assert result.returncode == 4 and result.stderr.startswith("rloo.py: error: could not write "), result.stderr
    assert (tmp_path / "metrics.jsonl").read_text() == '{"update": 1, "run_id": null}\n'


def test_output_dir_renamed_while_the_run_writes_stops_it_in_one_line(assets, tmp_path):
    """Issue 56: output_dir renamed mid-run gave a FileNotFoundError traceback. The next write there says which folder
    went, in one line, exit 4; nothing is written elsewhere, and the moved folder holds the run up to then."""
    out = tmp_path / "run"
    result = run_rloo("--model_name_or_path", assets["policy"], "--dataset_name", assets["train"], "--output_dir", out,
                      "--reward_fn", "reward_fns:count_a_moving_the_run", *RUN[2:-2], "--num_evals", "0",
                      "--total_episodes", PER_UPDATE * 3, "--save_steps", "1",
                      env={"REWARD_MOVES_AT_CALL": "2", "REWARD_MOVES": str(out)})
    assert result.returncode == 4 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == (
        f"rloo.py: error: could not write checkpoint step_2: {out} is gone (renamed, moved or removed while the run "
        "wrote it); the run's checkpoints are where it left them: put the folder back, then continue with --resume")
    moved = tmp_path / "run.moved"
    assert not out.exists() and [p.name for p in (moved / "checkpoints").iterdir()] == ["step_1"]
    assert [m["update"] for m in read_metrics(moved)] == [1]


RANK_0_IN_COLLECTIVES = """import os
import torch.distributed as dist
if os.environ.get("RANK") == "0":  # rank 0 says when it enters and leaves each collective, in the file RANK_0_WAITING
    def entered(name, function):
        def logged(*args, **kwargs):
            with open(os.environ["RANK_0_WAITING"], "a") as f:
                f.write(f"{os.getpid()} entered {name}\\n")
            result = function(*args, **kwargs)
            with open(os.environ["RANK_0_WAITING"], "a") as f:
                f.write(f"{os.getpid()} left {name}\\n")
            return result
        return logged
    for name in ("init_process_group", "barrier", "all_reduce", "broadcast", "broadcast_object_list", "all_gather",
                 "all_gather_object", "gather_object", "monitored_barrier"):
        setattr(dist, name, entered(name, getattr(dist, name)))
"""


def blocked_in_a_collective(waiting: Path) -> bool:
    """Rank 0 has entered a collective (RANK_0_IN_COLLECTIVES' file) and its main thread sleeps there, in C++,
    where no Python signal handler runs until the collective returns or fails."""
    lines = waiting.read_text().splitlines() if waiting.exists() else []
    if not lines or " entered " not in lines[-1]:
        return False
    try:
        return Path(f"/proc/{lines[-1].split()[0]}/stat").read_text().rsplit(")", 1)[1].split()[0] == "S"
    except (FileNotFoundError, IndexError):
        return False


BLOCK_AFTER_INIT = """import os, time
from pathlib import Path
import torch.distributed as dist
if os.environ.get("RANK") == "1":  # rank 1 stalls once the process group exists; rank 0 loads the models, then waits
    init_process_group = dist.init_process_group
    def stalling(*args, **kwargs):
        init_process_group(*args, **kwargs)
        Path(os.environ["BLOCKING_IMPORT_READY"]).write_text(f"{os.getpid()}\\n")
        time.sleep(60)
    dist.init_process_group = stalling
"""


STOPPED_IN_START_UP = "rloo.py: rank 1: SIGTERM received during start-up: stopped before the first update, nothing " \
    "was trained; run the same command again to start"
START_UP_CASES = {  # case: (where rank 1 stalls, the signal it gets, the one line, whole or its start)
    "SIGTERM in the reward module's import": ("reward module import", signal.SIGTERM, STOPPED_IN_START_UP),
    "SIGTERM after init_process_group": ("after init_process_group", signal.SIGTERM, STOPPED_IN_START_UP),
    "SIGKILL after init_process_group": ("after init_process_group", signal.SIGKILL, "rloo.py: rank 0: error: a "
                                         "collective failed (a rank stopped, was lost or timed out): [/"),
}


SIGNAL_WHILE_SAYING_HOW_IT_ENDED = """import os, signal, sys
import plumbing
class Late(plumbing.ConfigError):
    def __str__(self):  # the signal lands while run_script says how the run ended, whatever the machine's speed
        os.kill(os.getpid(), getattr(signal, sys.argv[1]))
        return "the input is wrong"
def stop(signum, frame):  # what plumbing.StopSignal does before training
    raise plumbing.faults.StartupInterrupted(signal.Signals(signum).name)
for sig in (signal.SIGTERM, signal.SIGUSR1):
    signal.signal(sig, stop)
def main(args):
    raise Late()
plumbing.run_script(main, None, "rloo.py")
"""


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGUSR1"])
def test_a_signal_while_the_run_says_how_it_ended_does_not_cut_the_line_into_a_traceback(sig):
    """torchrun sends SIGTERM to the other ranks once one has failed: it may reach a rank while that rank is saying
    why it stopped (a collective failed). The line is said whole, then the process exits with its own status."""
    result = subprocess.run([python(), "-c", SIGNAL_WHILE_SAYING_HOW_IT_ENDED, sig], capture_output=True,
                            text=True, cwd=REPO, env=script_env(), timeout=120)
    assert (result.returncode, result.stderr) == (2, "rloo.py: error: the input is wrong\n"), result.stderr[-3000:]


@pytest.mark.parametrize("case", START_UP_CASES, ids=list(START_UP_CASES))
def test_a_signal_to_one_rank_during_start_up_stops_every_rank_with_one_line(assets, tmp_path, case):
    where, sig, line = START_UP_CASES[case]
    ready, hook = tmp_path / "stalled", tmp_path / "hook"  # rank 1 alone stalls in start-up: rank 0 waits for it
    waiting = tmp_path / "rank_0_waiting"
    env = script_env({"BLOCKING_IMPORT_READY": str(ready), "BLOCKING_IMPORT_RANK": "1",
                      "RANK_0_WAITING": str(waiting)})
    hook.mkdir()  # a sitecustomize of this test's own, for its ranks only
    (hook / "sitecustomize.py").write_text(RANK_0_IN_COLLECTIVES + (
        BLOCK_AFTER_INIT if where == "after init_process_group" else ""))
    env["PYTHONPATH"] = f"{hook}:{env['PYTHONPATH']}"
    reward_fn = "reward_fns_blocking_import:count_a" if where == "reward module import" else "reward_fns:count_a"
    process = subprocess.Popen(script_command("rloo.py", "--model_name_or_path", assets["policy"], "--dataset_name",
                                              assets["train"], *RUN[2:], "--output_dir", tmp_path / "run",
                                              "--reward_fn", reward_fn, nproc=2),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env,
                               start_new_session=True)
    try:
        looks = []

        def asleep() -> bool:  # rank 1 stalled, rank 0 seen in a collective on 3 looks running (not a moment's lock)
            looks.append(ready.exists() and blocked_in_a_collective(waiting))
            return looks[-3:] == [True] * 3

        wait_until(asleep, process, "rank 0 waiting in a collective")
        started = time.time()
        os.kill(int(ready.read_text()), sig)  # rank 1's process, not torchrun's
        _, stderr = process.communicate(timeout=600)
    finally:  # torchrun and its ranks do not outlive the test
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode != 0 and time.time() - started < 300, stderr[-3000:]  # not --ddp_timeout (600 s) later
    said = [said for said in stderr.splitlines() if said.startswith("rloo.py")]  # SIGKILL: rank 0 says what it saw
    assert len(said) == 1 and said[0].startswith(line) and (sig == signal.SIGKILL or said[0] == line), stderr[-3000:]
    assert str(REPO / "rloo.py") + '", line' not in stderr  # no traceback from a rank (torchrun prints its own)
    exits = dict(re.findall(r"rank +: (\d+) \(local_rank: \d+\)\n +exitcode +: (-?\d+)", stderr))  # torchrun's
    assert exits.get("0", "-9") != "-9", stderr[-3000:]  # rank 0 answered its SIGTERM, not killed after its grace


def test_a_failing_or_stuck_rank_stops_every_rank_with_one_line_naming_it(tmp_path):
    env = script_env({"PYTHONPATH": f"{REPO / 'tests'}:{REPO}"})  # offline: as the server of forks
    result = subprocess.run([python(), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                             str(REPO / "tests" / "peers.py"), str(tmp_path / "seen.json"), "10", "2"],
                            capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen["failed"] == ["reward function 'judge' raised ConnectionError: the judge does not answer (rank 1, "
                              "scoring of update 1)", True]  # on rank 0 too, which said it
    assert seen["hung"] == ["reward function 'judge' did not return within --reward_fn_timeout 1 s (rank 1, scoring "
                            "of hung)", None, True]
    assert seen["signalled"] == ["SIGTERM received while a reward function ran (rank 1, scoring of signalled)",
                                 "SIGTERM", True]  # rank 0 stops too, though it got no signal
    assert seen["failed and signalled"] == ["reward function 'judge' raised ConnectionError: the judge does not "
                                            "answer (rank 0, scoring of failed and signalled)", None, True]
    message, announce = seen["stuck"]
    assert announce and message.startswith("the other ranks waited --ddp_timeout 2 s after scoring of update 2: "
                                           "rank 1 is in 'scoring' since ")
    assert "nothing saved, a checkpoint needs every rank" in message


def test_a_reward_function_that_raises_stops_with_the_last_update_saved_and_resume_is_exact(assets, tmp_path):
    common = ["--model_name_or_path", assets["policy"], "--dataset_name", assets["train"], *RUN[2:],
              "--reward_fn", "reward_fns:count_a_failing", "--total_episodes", PER_UPDATE * 3]
    full, run = tmp_path / "full", tmp_path / "run"
    result = run_rloo(*common, "--output_dir", full)
    assert result.returncode == 0, result.stderr[-3000:]
    failed = run_rloo(*common, "--output_dir", run, env={"REWARD_FAILS_AT_CALL": "3"})  # in update 3
    assert failed.returncode == 4 and "Traceback" not in failed.stderr, failed.stderr[-3000:]
    assert failed.stderr.strip().splitlines()[-1] == (
        "rloo.py: error: reward function 'count_a_failing' raised ConnectionError: the judge at http://judge:8000 "
        f"does not answer; checkpoint of update 2 saved to {run / 'checkpoints' / 'step_2'}; fix it, then continue "
        "with --resume")
    result = run_rloo(*common, "--output_dir", run, "--resume")
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_run(full, run)  # the saved state is the one before update 3 began: data position and RNGs


FIX = "; fix it, then continue with --resume"
REWARD_FAULTS = {  # case: (what the reward function does at its 3rd call, the signal sent while it hangs, flags,
    # exit status, the run's last line after "rloo.py: " with {step_2} for the checkpoint's path)
    "sys.exit(0)": ("exit", None, [], 4, "error: reward function 'misbehaving' raised SystemExit: 0; checkpoint of "
                                         "update 2 saved to {step_2}" + FIX),
    "nan": ("nan", None, [], 4, "error: reward function 'misbehaving' returned nan for completion 0: each value must "
                                "be a finite float32 (at most 3.403e+38 in magnitude); checkpoint of update 2 saved to "
                                "{step_2}" + FIX),
    "1e39": ("huge", None, [], 4, "error: reward function 'misbehaving' returned 1e+39 for completion 0: each value "
                                  "must be a finite float32 (at most 3.403e+38 in magnitude); checkpoint of update 2 "
                                  "saved to {step_2}" + FIX),
    "hangs past --reward_fn_timeout": ("hang", None, ["--reward_fn_timeout", 3], 4,
                                       "error: reward function 'misbehaving' did not return within --reward_fn_timeout "
                                       "3 s; checkpoint of update 2 saved to {step_2}" + FIX),
    "SIGTERM while it hangs": ("hang", signal.SIGTERM, [], 0, "SIGTERM received while a reward function ran: stopped "
                               "at once; checkpoint of update 2 saved to {step_2}; continue with the same command and "
                               "--resume"),
    "SIGINT while it hangs": ("hang", signal.SIGINT, [], 0, "SIGINT received while a reward function ran: stopped at "
                              "once; checkpoint of update 2 saved to {step_2}; continue with the same command and "
                              "--resume"),
}


@pytest.mark.parametrize("case", REWARD_FAULTS, ids=list(REWARD_FAULTS))
def test_a_reward_function_that_exits_returns_no_float32_or_hangs_stops_with_the_last_update_saved(assets, tmp_path,
                                                                                                  case):
    behaviour, sig, flags, status, line = REWARD_FAULTS[case]
    out, hanging = tmp_path / "run", tmp_path / "hanging"
    env = script_env({"REWARD_MISBEHAVES_AT_CALL": "3", "REWARD_MISBEHAVIOUR": behaviour, "REWARD_HANGING": hanging})
    process = subprocess.Popen(script_command("rloo.py", "--model_name_or_path", assets["policy"], "--dataset_name",
                                              assets["train"], "--output_dir", out, *RUN[2:], "--reward_fn",
                                              "reward_fns:misbehaving", "--total_episodes", PER_UPDATE * 4, *flags),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    try:
        if sig is not None:
            wait_until(hanging.exists, process, "the reward function hanging")
            process.send_signal(sig)
        stdout, stderr = process.communicate(timeout=600)
    finally:  # a run that hangs does not outlive the test
        process.kill()
    assert process.returncode == status and "Traceback" not in stderr, stderr[-3000:]
    said = (stdout if status == 0 else stderr).strip().splitlines()[-1]
    assert said == "rloo.py: " + line.format(step_2=out / "checkpoints" / "step_2")
    assert latest_checkpoint(str(out)).name == "step_2" and [m["update"] for m in read_metrics(out)] == [1, 2]
    assert (out / "preempted").exists() == (status == 0)  # a signal: requeue; a fault: fix it first


CTRL_C_AT_UPDATE_2 = """import os, signal
import plumbing
gathered_for_rollout, calls = plumbing.gathered_for_rollout, []
def ctrl_c_at_update_2(*args, **kwargs):  # the start of each update's rollout, in the main thread
    calls.append(1)
    if len(calls) == 2:
        os.kill(os.getpid(), signal.SIGINT)
    return gathered_for_rollout(*args, **kwargs)
plumbing.gathered_for_rollout = ctrl_c_at_update_2
"""


def test_ctrl_c_twice_exits_at_once_and_a_signal_during_start_up_trains_nothing(assets, tmp_path):
    common = ["--model_name_or_path", assets["policy"], "--dataset_name", assets["train"], *RUN[2:],
              "--total_episodes", PER_UPDATE * 40, "--save_steps", 1]
    out, stderr_path, hook = tmp_path / "run", tmp_path / "stderr", tmp_path / "hook"
    # the first Ctrl-C as update 2's rollout starts: a real SIGINT, sent by a sitecustomize of this test's own at a
    # point that does not depend on timing (one that landed in a reward function would stop the run at once, as
    # it should); the second from here, once update 2's reward function runs, which then hangs for certain: the
    # update cannot end before the second Ctrl-C, however slow the machine
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(CTRL_C_AT_UPDATE_2)
    hanging = tmp_path / "hanging"
    env = script_env({"PYTHONPATH": f"{hook}:{REPO}:{REPO / 'tests'}", "REWARD_MISBEHAVES_AT_CALL": "2",
                      "REWARD_MISBEHAVIOUR": "hang", "REWARD_HANGING": str(hanging)})
    with open(stderr_path, "w") as stderr:
        process = subprocess.Popen(script_command("rloo.py", *common, "--output_dir", out, "--reward_fn",
                                                  "reward_fns:misbehaving"),
                                   stdout=subprocess.DEVNULL, stderr=stderr, env=env, cwd=REPO)
        wait_until(lambda: "rloo.py: SIGINT received: stopping after this update with a checkpoint; Ctrl-C again "
                   "exits at once without one" in stderr_path.read_text() and hanging.exists(), process,
                   "the first SIGINT's line, the reward function hanging", log=stderr_path)
        process.send_signal(signal.SIGINT)
        process.wait(timeout=600)
    assert process.returncode == -signal.SIGINT  # killed in the middle of the update, which is not saved
    assert len(read_metrics(out)) == 1 and latest_checkpoint(str(out)).name == "step_1"
    assert not (out / "preempted").exists()

    ready = tmp_path / "importing"
    process = subprocess.Popen(script_command("rloo.py", *common, "--output_dir", tmp_path / "start", "--reward_fn",
                                              "reward_fns_blocking_import:count_a"), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=script_env({"BLOCKING_IMPORT_READY": str(ready)}),
                               cwd=REPO)
    wait_until(ready.exists, process, "the reward function's module importing")
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=600)
    assert process.returncode == 0 and stderr.strip().splitlines() == [
        "rloo.py: SIGTERM received during start-up: stopped before the first update, nothing was trained; run the "
        "same command again to start"]
    assert not (tmp_path / "start").exists()
