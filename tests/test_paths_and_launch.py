"""Silent or wrong words and tracebacks of the paths a run is given and the environment it starts in, each a line
before anything loads: a quoted ~ or $VAR, a typo in a local path, a dataset of another format or a FIFO, a reward
model of another vocabulary without its tokenizer, a context too short, torchrun's variables left behind, an
output_dir past the file system's limits; pruning never follows a symbolic link; the weight sync's gloo sockets
listen where the group is served."""

import bz2
import gzip
import json
import lzma
import os
import shutil
import socket
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import transformers
from transformers import GPT2Config, GPTNeoXConfig, LlamaConfig, MambaConfig, OPTConfig

import plan_memory
import plumbing
import rloo
import rloo_multinode as mn
from conftest import REPO, policy_tokenizer, prompt_rows, tiny_reward_model, write_jsonl
from helpers import listening_sockets, saved_steps


def args_of(assets, **changes) -> rloo.Args:
    return rloo.Args(**{"model_name_or_path": str(assets["policy"]), "dataset_name": str(assets["train"]),
                        "reward_fn": ("reward_fns:count_a",), "max_prompt_length": 16, "response_length": 6,
                        **changes})


# ---------------------------------------------------------------- path flags as the shell would have given them
def test_a_quoted_tilde_is_the_home_directory_in_every_path_flag(assets, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    for name in ("policy", "reward_model", "train", "test"):
        (tmp_path / assets[name].name).symlink_to(assets[name])
    args = args_of(assets, model_name_or_path="~/policy", sft_model_path="~/policy", reward_model_path="~/reward_model",
                   dataset_name="~/train.jsonl", dataset_test_split="~/test.jsonl", output_dir="~/runs/x",
                   resume_from="~/runs/x/checkpoints/step_1")
    plumbing.validate_args(args)
    for flag in plumbing.PATH_FLAGS:
        assert getattr(args, flag).startswith(str(tmp_path) + "/"), (flag, getattr(args, flag))
    assert not (tmp_path / "~").exists()


@pytest.mark.parametrize("flag", ["output_dir", "model_name_or_path", "dataset_name"])
def test_a_shell_variable_left_unexpanded_is_refused(assets, tmp_path, flag):
    with pytest.raises(plumbing.ConfigError, match=rf"^--{flag} \$HOME/x: \$HOME was not expanded \(quoted\?\)"):
        plumbing.validate_args(args_of(assets, **{flag: "$HOME/x"}))
    (tmp_path / "a$b").mkdir()  # a name that holds a $ and exists is taken as it is
    plumbing.resolve_paths(args_of(assets, output_dir=str(tmp_path / "a$b")))


@pytest.mark.parametrize("flag,typo,closest", [
    ("model_name_or_path", "{root}/polcy", "{root}/policy"), ("sft_model_path", "{root}/policy_x", "{root}/policy"),
    ("reward_model_path", "{root}/reward_modle", "{root}/reward_model"),
    ("dataset_name", "{root}/train.jsonl.gz", "{root}/train.jsonl"), ("dataset_name", "{root}/nowhere/x/y", None),
    ("dataset_test_split", "{root}/tset.jsonl", "{root}/test.jsonl"),
])
def test_a_typo_in_a_local_path_is_no_such_file_with_the_closest_one(assets, flag, typo, closest):
    root = assets["policy"].parent
    line = rf"^--{flag} {typo.format(root=root)}: no such file or directory" + (
        rf" \(the closest that exists: {closest.format(root=root)}\)$" if closest else "$")
    with pytest.raises(plumbing.ConfigError, match=line):
        plumbing.validate_args(args_of(assets, **{flag: typo.format(root=root)}))


def test_a_relative_typo_and_hub_ids_are_told_apart(assets, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "policy").symlink_to(assets["policy"])
    for typo in ("./polcy", f"../{tmp_path.name}/polcy", "polcy/x/y"):
        assert plumbing.missing_local_path(typo).startswith("no such file or directory"), typo
    assert plumbing.missing_local_path("./polcy") == "no such file or directory (the closest that exists: policy)"
    (tmp_path / "models").mkdir()
    assert plumbing.missing_local_path("models/pythia")  # its owner is a local directory
    for hub_id in ("EleutherAI/pythia-1b-deduped", "gpt2", "trl-lib/tldr", "policy"):
        assert plumbing.missing_local_path(hub_id) is None, hub_id
    with pytest.raises(plumbing.ConfigError, match=r"could not load tokenizer from './polcy': no such file or dir"):
        plumbing.load_tokenizer("./polcy", False)  # judge.py's and plan_memory.py's loads too


# ---------------------------------------------------------------- datasets of every kind a path can hold
def test_compressed_json_lines_and_csv_load_and_other_kinds_are_named(tmp_path):
    rows = prompt_rows(4, seed=0)
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(text.encode()))
    (tmp_path / "a.json.gz").write_bytes(gzip.compress(json.dumps(rows).encode()))
    csv = "prompt,target\n" + "".join(f"{r['prompt']},{r['target']}\n" for r in rows)
    (tmp_path / "a.csv").write_text(csv)
    (tmp_path / "a.csv.bz2").write_bytes(bz2.compress(csv.encode()))
    (tmp_path / "B.JSONL.XZ").write_bytes(lzma.compress(text.encode()))  # a name in capitals
    for name in ("a.jsonl.gz", "a.json.gz", "a.csv", "a.csv.bz2", "B.JSONL.XZ"):
        loaded = plumbing.load_split(str(tmp_path / name), "train", None)
        assert loaded["prompt"] == [r["prompt"] for r in rows], name
        assert not plumbing.has_splits(str(tmp_path / name))
    os.mkfifo(tmp_path / "pipe.jsonl")
    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "prompts.txt").write_text("a b :\n")
    (tmp_path / "dir.jsonl").mkdir()
    (tmp_path / "bad.jsonl.gz").write_bytes(b"not gzip")
    (tmp_path / "zero.jsonl").symlink_to("/dev/zero")
    for name, line in (("pipe.jsonl", r"is a FIFO \(named pipe\), not a regular file: pass a .jsonl/.json/.csv"),
                       ("pipe", r"is a FIFO \(named pipe\)"), ("prompts.txt", ".txt is not a format read here"),
                       ("dir.jsonl", "is a directory"), ("bad.jsonl.gz", "BadGzipFile: Not a gzipped file"),
                       ("nope.csv.xz", "does not exist"), ("zero.jsonl", "is a character device, not a regular file")):
        with pytest.raises(plumbing.ConfigError, match=line) as refused:  # a FIFO is never opened: no wait
            plumbing.load_split(str(tmp_path / name), "train", None)
        assert "\n" not in str(refused.value)


def test_a_prompt_file_is_read_within_limits(monkeypatch, tmp_path):
    """A prompt file larger than DATA_LIMIT, on disk or once decompressed (a decompression bomb), and a JSON line
    longer than LINE_LIMIT are one line each, read in constant memory."""
    monkeypatch.setattr(plumbing.data, "DATA_LIMIT", 4096)
    monkeypatch.setattr(plumbing.data, "LINE_LIMIT", 1024)
    (tmp_path / "big.jsonl").write_text('{"prompt": "a"}\n' * 300)
    (tmp_path / "bomb.jsonl.gz").write_bytes(gzip.compress(b'{"prompt": "a"}\n' * 300))
    (tmp_path / "long.jsonl").write_text('{"prompt": "a"}\n{"prompt": "' + "a" * 2000 + '"}\n')
    for name, line in (("big.jsonl", "is 4,800 bytes, over the limit of 4 KiB for this input"),
                       ("bomb.jsonl.gz", "holds more than 4 KiB once decompressed: pass a save_to_disk directory"),
                       ("long.jsonl", "line 2 is over 1 KiB, not a row of prompts")):
        with pytest.raises(plumbing.ConfigError, match=line):
            plumbing.load_split(str(tmp_path / name), "train", None)


# ---------------------------------------------------------------- the models' configs
@pytest.mark.parametrize("name,kind,line", [
    ("config.json", "fifo", r"config.json is a FIFO \(named pipe\), not a regular file: put the file"),
    ("chat_template.jinja", "/dev/zero", "chat_template.jinja is a character device, not a regular file"),
    ("tokenizer_config.json", "big", "tokenizer_config.json is .* bytes, over the limit of 4 KiB for this input"),
    ("model.safetensors", "/dev/urandom", "model.safetensors is a character device"),
    ("additional_chat_templates/tool.jinja", "fifo", r"tool.jinja is a FIFO"),  # a subdirectory's file
])
def test_a_model_directory_holds_regular_files_within_limits_or_is_one_line(assets, tmp_path, monkeypatch, name, kind,
                                                                           line):
    """What transformers would read of a local model directory: a FIFO (which would block the load), a device (which
    would fill the memory) or a config over TEXT_LIMIT bytes is one line naming the file, before any loader runs
    (the config, the tokenizer, the model: load_pretrained). Weights may be of any size."""
    monkeypatch.setattr(plumbing.errors, "TEXT_LIMIT", 4096)
    policy = tmp_path / "policy"
    shutil.copytree(assets["policy"], policy)
    path = policy / name
    path.parent.mkdir(exist_ok=True)
    path.unlink(missing_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "big":
        path.write_text(json.dumps({"padding": "x" * 5000}))
    else:
        path.symlink_to(kind)
    with pytest.raises(plumbing.ConfigError, match=line) as refused:
        plumbing.load_config(str(policy), "policy", False)
    assert "\n" not in str(refused.value)


def test_a_dataset_directory_holds_regular_files(tmp_path):
    """A save_to_disk directory whose files are not regular (a FIFO for its state.json) is one line naming the file,
    never a load that waits for a writer."""
    import datasets

    datasets.Dataset.from_list([{"prompt": "a b :"}]).save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "saved" / "state.json").unlink()
    os.mkfifo(tmp_path / "saved" / "state.json")
    with pytest.raises(plumbing.ConfigError, match=r"state.json is a FIFO \(named pipe\), not a regular file: put "
                                                   "the files written by save_to_disk back"):
        plumbing.load_split(str(tmp_path / "saved"), "train", None)


def test_a_reward_model_without_tokenizer_files_must_share_the_policys_vocabulary(assets, tmp_path):
    vocab = len(policy_tokenizer())
    tiny_reward_model(vocab + 7).save_pretrained(tmp_path / "other_vocab")  # no tokenizer saved
    with pytest.raises(plumbing.ConfigError, match=rf"has no tokenizer files, so it would read the policy's token "
                                                   rf"ids, but its vocabulary has {vocab + 7} ids and the policy's "
                                                   rf"{vocab}: save the reward model's tokenizer"):
        plumbing.prepare_tokenizer(args_of(assets, reward_model_path=str(tmp_path / "other_vocab")))
    tiny_reward_model(vocab).save_pretrained(tmp_path / "same_vocab")
    args = args_of(assets, reward_model_path=str(tmp_path / "same_vocab"))
    tokenizer, _ = plumbing.prepare_tokenizer(args)
    sources = plumbing.load_reward_sources(args, tokenizer, [], torch.device("cpu"))
    assert sources.model_tokenizer is None  # it reads the policy's ids, of its own vocabulary


def test_a_context_shorter_than_prompt_and_response_is_refused_where_positions_are_a_learned_table(tmp_path,
                                                                                                     capsys):
    args = rloo.Args(response_length=53)  # the longest prompt: 100 tokens
    for config in (GPT2Config(n_positions=128), OPTConfig(max_position_embeddings=128)):  # an embedding per position
        with pytest.raises(plumbing.ConfigError, match=r"the longest prompt, 100 tokens, \+ --response_length 53 = 153 "
                                                       r"tokens, but the policy has 128 positions .*a learned "
                                                       r"table .*lower --max_prompt_length to 75 or less"):
            plumbing.check_context(config, "policy", args, 100)
    for config in (GPTNeoXConfig(max_position_embeddings=64), LlamaConfig(max_position_embeddings=64)):  # rotary
        plumbing.check_context(config, "policy", args, 100)
        assert "exceed the policy's 64 positions" in capsys.readouterr().err
    for config in (MambaConfig(), GPT2Config(n_positions=153)):  # no limit; a limit that holds them
        plumbing.check_context(config, "policy", args, 100)
        assert capsys.readouterr().err == ""
    config = GPT2Config(vocab_size=50, n_embd=32, n_layer=1, n_head=4, n_positions=64)
    config.save_pretrained(tmp_path / "short")
    plan = plan_memory.PlanArgs(model_name_or_path=str(tmp_path / "short"), reward_fn=("reward_fns:count_a",),
                                world_size=1, dataset_name="unused")
    with pytest.raises(plumbing.ConfigError, match="but the policy has 64 positions"):  # plans prompts of 512
        plan_memory.main(plan)
    config.save_pretrained(tmp_path / "reward_model")  # a reward model's table too
    with pytest.raises(plumbing.ConfigError, match="but the reward model has 64 positions"):
        plumbing.check_reward_model_config(str(tmp_path / "reward_model"), False, None,
                                           replace(args, response_length=6), 60)


def test_the_context_check_reads_the_datas_longest_prompt_not_the_flags_cap(assets, tmp_path, capsys):
    """A learned position table of 16 and prompts of 5 tokens, under --max_prompt_length 512: accepted, nothing said
    (as a rotary model of 64 positions); a response that does not fit after the longest prompt, train or test, is
    refused (a learned table) or warned about (rotary), naming that prompt's length."""
    tokenizer = policy_tokenizer()
    learned = tmp_path / "learned"
    GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=4, n_positions=16, bos_token_id=1,
               eos_token_id=1).save_pretrained(learned)
    tokenizer.save_pretrained(learned)
    test = write_jsonl(tmp_path / "test.jsonl", [{"prompt": "a b c d e f g h i :"}])  # 10 tokens
    for policy in (learned, assets["policy"]):
        plumbing.load_prompts(args_of(assets, model_name_or_path=str(policy), max_prompt_length=512,
                                      response_length=11), tokenizer, len(tokenizer), plumbing.prompt_token_ids)
        assert "warning" not in capsys.readouterr().err  # 5 + 11 tokens
    with pytest.raises(plumbing.ConfigError, match=r"^the longest prompt, 5 tokens, \+ --response_length 12 = 17 "
                                                   r"tokens, but the policy has 16 positions"):
        plumbing.load_prompts(args_of(assets, model_name_or_path=str(learned), max_prompt_length=512,
                                      response_length=12), tokenizer, len(tokenizer), plumbing.prompt_token_ids)
    with pytest.raises(plumbing.ConfigError, match=r"^the longest prompt, 10 tokens, \+ --response_length 11"):
        plumbing.load_prompts(args_of(assets, model_name_or_path=str(learned), response_length=11,
                                      dataset_test_split=str(test)), tokenizer, len(tokenizer),
                              plumbing.prompt_token_ids)
    plumbing.load_prompts(args_of(assets, response_length=60), tokenizer, len(tokenizer), plumbing.prompt_token_ids)
    assert "warning: the longest prompt, 5 tokens, + --response_length = 65 tokens exceed the policy's 64 " \
           "positions" in capsys.readouterr().err


def test_plan_memory_plans_what_rloo_py_runs_and_refuses_what_it_refuses(assets, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    plan = dict(model_name_or_path=str(assets["policy"]), reward_fn=("reward_fns:count_a",), max_prompt_length=16,
                dataset_name="unused")
    plan_memory.main(plan_memory.PlanArgs(**plan, fsdp=True, world_size=2))  # a torchrun launch, planned without one
    assert "fits in 80 GiB" in capsys.readouterr().out
    with pytest.raises(plumbing.ConfigError, match="^--use_peft: Target modules nothing_here not found .* pass "
                                                   "--lora_target_modules"):
        plan_memory.main(plan_memory.PlanArgs(**plan, use_peft=True, lora_target_modules=("nothing_here",)))
    monkeypatch.setattr(transformers.GPTNeoXPreTrainedModel, "_no_split_modules", None)  # a model naming none
    with pytest.raises(plumbing.ConfigError, match="^--fsdp: GPTNeoXForCausalLM names no transformer block class"):
        plan_memory.main(plan_memory.PlanArgs(**plan, fsdp=True, world_size=2))


# ---------------------------------------------------------------- torchrun's variables
TORCHRUN = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


@pytest.mark.parametrize("env,line", [
    ({"RANK": "0", "WORLD_SIZE": "1"}, "RANK, WORLD_SIZE are set but LOCAL_RANK, MASTER_ADDR, MASTER_PORT are not"),
    ({"LOCAL_RANK": "0"}, "LOCAL_RANK is set but RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT are not"),
    ({**TORCHRUN, "WORLD_SIZE": "two"}, "torchrun's variables are not all numbers where they must be"),
    ({**TORCHRUN, "RANK": "1"}, "RANK=1, LOCAL_RANK=0, WORLD_SIZE=1, MASTER_PORT=29500 do not fit together"),
    ({**TORCHRUN, "MASTER_PORT": "70000"}, "do not fit together"),
])
def test_torchruns_variables_left_in_the_environment_are_one_line(monkeypatch, env, line):
    for name in TORCHRUN:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(plumbing.ConfigError, match=line + ".*launch with torchrun, or unset"):
        plumbing.check_launch_environment()


@pytest.mark.parametrize("main", [rloo.main, mn.main], ids=["rloo.py", "rloo_multinode.py"])
def test_a_plain_run_with_ranks_left_in_the_environment_stops_before_anything(assets, tmp_path, monkeypatch, main):
    for name in TORCHRUN:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "abc")  # rloo_multinode.py read it as a number first: a ValueError
    args = args_of(assets, output_dir=str(tmp_path / "out"))
    if main is mn.main:
        args = mn.Args(**vars(args), engine="hf")
    with pytest.raises(plumbing.ConfigError, match="^RANK, WORLD_SIZE are set but LOCAL_RANK, MASTER_ADDR, "
                                                   "MASTER_PORT are not: launch with torchrun, or unset RANK"):
        main(args)
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- output_dir's path
def test_an_output_dir_no_file_system_can_hold_is_one_line_and_leaves_nothing(tmp_path):
    (tmp_path / "file").write_text("")
    os.mkfifo(tmp_path / "pipe")
    cases = {"n" * 300: r"has a name of 300 bytes, but its file system takes at most \d+",
             "/".join(["d" * 200] * 25): r"is a path of \d+ bytes, and the run's files below it take up to 200 more, "
                                         r"but the system takes at most \d+",
             "file/run": f"passes through {tmp_path / 'file'}, which is a file",
             "pipe": r"is a FIFO \(named pipe\)", "pipe/run": r"which is a FIFO \(named pipe\)", "file": "is a file"}
    for name, line in cases.items():
        lock = plumbing.OutputDirLock(str(tmp_path / name))
        with pytest.raises(plumbing.ConfigError, match=f"^--output_dir .*{line}: pass a directory$"):
            plumbing.take_output_dir(lock, 0, {})
        assert not lock.held
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "pipe"]
    # issue 47: a 4,069-byte output_dir trained, then could not save (said: free space); `/` was a StopIteration
    deep = str(tmp_path)
    while 4069 - len(deep) - 1 > 200:
        deep += "/" + "d" * 200
    deep += "/" + "e" * (4069 - len(deep) - 1)
    assert len(deep) == 4069
    root = "is the root directory, which holds the whole system"
    for path, line in ((deep, "is a path of 4069 bytes, and the run's files below it take up to 200 more, but the "
                              r"system takes at most 4095"), ("/", root), ("//", root)):
        lock = plumbing.OutputDirLock(path)
        with pytest.raises(plumbing.ConfigError, match=f"^--output_dir .*{line}: pass a directory$"):
            plumbing.take_output_dir(lock, 0, {})
        assert not lock.held
    with pytest.raises(plumbing.ConfigError, match="^--png-path / is a directory"):
        plumbing.check_outputs([("--png-path", Path("/"))], [], "x.py")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "pipe"]
    if Path("/proc/self").is_dir():  # a file system that makes no directory: the kernel's own words, one line
        with pytest.raises(plumbing.ConfigError, match="^cannot write to --output_dir /proc/rloo: "):
            plumbing.take_output_dir(plumbing.OutputDirLock("/proc/rloo"), 0, {})


# ---------------------------------------------------------------- pruning and symbolic links
def test_pruning_removes_a_symlinked_checkpoint_never_what_it_points_to(tmp_path):
    out = tmp_path / "run"
    saved_steps(out, [1, 2])
    kept = tmp_path / "elsewhere" / "step_1"  # the user moved a checkpoint to keep it, and linked it back
    kept.parent.mkdir()
    os.replace(out / "checkpoints" / "step_1", kept)
    (out / "checkpoints" / "step_1").symlink_to(kept)
    (tmp_path / "precious").mkdir()  # a link to a directory that is no checkpoint at all
    (tmp_path / "precious" / "notes.txt").write_text("keep")
    (out / "checkpoints" / "step_0").symlink_to(tmp_path / "precious")
    saved_steps(out, [3], keep=1)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_0", "step_3"]  # the user's link: kept
    assert (kept / plumbing.MANIFEST).is_file() and (tmp_path / "precious" / "notes.txt").read_text() == "keep"


def test_a_symlinked_checkpoints_directory_holds_the_runs_checkpoints(tmp_path):
    scratch = tmp_path / "scratch" / "checkpoints"
    scratch.mkdir(parents=True)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoints").symlink_to(scratch)  # checkpoints on a larger disk
    saved_steps(tmp_path / "run", [1, 2, 3], keep=2)
    assert sorted(p.name for p in scratch.iterdir()) == ["step_2", "step_3"]
    assert (tmp_path / "run" / "checkpoints").is_symlink()


# ---------------------------------------------------------------- where the weight sync listens
def an_interface_off_loopback() -> str | None:
    """A network interface of this machine with an address that is not loopback, if one (gloo can bind to)."""
    for _, name in socket.if_nameindex():
        if name != "lo":
            try:
                torch.distributed.ProcessGroupGloo.create_device(interface=name)
                return name
            except RuntimeError:
                continue
    return None


def test_the_weight_groups_gloo_sockets_listen_on_the_served_address_alone(monkeypatch):
    """gloo's default would listen where GLOO_SOCKET_IFNAME (or the hostname) points: set it off loopback, and the
    group, served on 127.0.0.1, must still listen there alone."""
    interface = an_interface_off_loopback()
    if interface is not None:
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", interface)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    before = listening_sockets([os.getpid()])
    groups, received = {}, {}

    def member(rank: int) -> None:
        groups[rank] = mn.GlooWeightGroup("127.0.0.1", port, rank, 2, 60.0)
        received[rank] = groups[rank].broadcast(torch.arange(4.0) if rank == 0 else torch.zeros(4))

    threads = [threading.Thread(target=member, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert torch.equal(received[1], torch.arange(4.0))
    opened = [s for inode, s in listening_sockets([os.getpid()]).items() if inode not in before]
    assert len(opened) >= 2 and {address for address, _ in opened} == {"127.0.0.1"}, (interface, opened)


# ---------------------------------------------------------------- a launch gets what it asked for
LAUNCHERS = ("ACCELERATE_NUM_PROCESSES", "ACCELERATE_MIXED_PRECISION", "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS",
             "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE", "GROUP_WORLD_SIZE", "TORCHELASTIC_RUN_ID")


@pytest.mark.parametrize("env,line", [
    ({"ACCELERATE_NUM_PROCESSES": "4"}, "ACCELERATE_NUM_PROCESSES=4 asks for that many processes, but this run has 1 "
                                        r"process \(no torchrun's WORLD_SIZE\)"),
    ({**TORCHRUN, "WORLD_SIZE": "2", "ACCELERATE_NUM_PROCESSES": "4"}, "=4 asks .* but this run has WORLD_SIZE=2"),
    ({"SLURM_STEP_NUM_TASKS": "8"}, "SLURM_STEP_NUM_TASKS=8 tasks were started, but this run has 1 process .* each "
                                    "task would train alone"),
    ({"OMPI_COMM_WORLD_SIZE": "2"}, "OMPI_COMM_WORLD_SIZE=2 tasks were started, but this run has 1 process"),
    ({"PMI_SIZE": "3"}, "PMI_SIZE=3 tasks"),
    ({**TORCHRUN, "TORCHELASTIC_RUN_ID": "x", "GROUP_WORLD_SIZE": "1", "SLURM_STEP_NUM_TASKS": "2"},
     "SLURM_STEP_NUM_TASKS=2 tasks were started, but this run has GROUP_WORLD_SIZE=1 torchrun agents"),
    ({"ACCELERATE_MIXED_PRECISION": "no", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
     r"accelerate launch's config .*default_config.yaml \(num_processes\) asks for 4 processes, but this run has 1 "
     "process"),
])
def test_a_launch_that_asked_for_other_processes_is_one_line_naming_both(monkeypatch, tmp_path, env, line):
    """accelerate's (its simple launcher runs a MULTI_CPU config's script once: it sets MASTER_ADDR, not WORLD_SIZE;
    the number from its command line or config file), srun's and mpirun's task counts against the processes (or,
    under torchrun, torchrun's agents: one per node) this run has."""
    for name in (*TORCHRUN, *LAUNCHERS):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    (tmp_path / "accelerate").mkdir()
    (tmp_path / "accelerate" / "default_config.yaml").write_text("distributed_type: MULTI_CPU\nnum_processes: 4\n")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(plumbing.ConfigError, match=line + ".*launch with torchrun: torchrun --nproc_per_node N") as e:
        plumbing.check_launch_environment()
    assert "\n" not in str(e.value)


BOMB = "a: &a [x, x, x, x, x, x, x, x]\n" + "".join(f"{n}: &{n} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n"
                                                    for p, n in zip("abcdefgh", "bcdefghi"))


@pytest.mark.parametrize("config,line", [
    ("num_processes: 1\n", None), ("num_processes: '1'\n", None),  # the one process this run has: asked for
    ("{num_processes: 1, distributed_type: MULTI_CPU}\n", None),
    ("fifo", r"default_config.yaml is a FIFO \(named pipe\), not a regular file: write it again"),
    ("/dev/zero", "default_config.yaml is a character device, not a regular file"),  # a MemoryError before
    ("dir", "default_config.yaml is a directory, not a regular file"),
    ("num_processes: 4\n" + "#" * (64 << 10), "is 65,553 bytes, over the limit of 64 KiB for this input"),
    (BOMB + "num_processes: 4\n", r"\(num_processes\) asks for 4 processes"),  # aliases never expanded
    ("- a list\n", r"accelerate launch \(it set MASTER_ADDR\) asks for several processes"),
    ("[" * 60_000, "asks for several processes"),  # YAML nested past the parser's recursion
])
def test_accelerates_default_config_is_read_as_an_input(monkeypatch, tmp_path, config, line):
    """accelerate's default config, read where `accelerate launch` may have started this process without torchrun:
    a config asking for the one process the run has passes; anything but a regular file of at most 64 KiB is one
    line at once (a FIFO never waited on, /dev/zero never read to the end)."""
    for name in (*TORCHRUN, *LAUNCHERS):
        monkeypatch.delenv(name, raising=False)
    for name, value in {"HF_HOME": str(tmp_path), "ACCELERATE_MIXED_PRECISION": "no", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    path = tmp_path / "accelerate" / "default_config.yaml"
    path.parent.mkdir()
    if config == "fifo":
        os.mkfifo(path)
    elif config == "dir":
        path.mkdir()
    elif config.startswith("/"):
        path.symlink_to(config)
    else:
        path.write_text(config)
    if line is None:
        plumbing.check_launch_environment()
        return
    with pytest.raises(plumbing.ConfigError, match=line) as e:
        plumbing.check_launch_environment()
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("env", [
    {"ACCELERATE_NUM_PROCESSES": "1"},
    {**TORCHRUN, "WORLD_SIZE": "2", "ACCELERATE_NUM_PROCESSES": "2", "ACCELERATE_MIXED_PRECISION": "no"},  # its
    # torchrun launcher (a MULTI_GPU config)
    {"ACCELERATE_MIXED_PRECISION": "no"},  # accelerate launch of one process: no MASTER_ADDR
    {"SLURM_NTASKS": "8"},  # salloc -n 8, then a single process (or torchrun --nproc_per_node 2): an allocation's
    {**TORCHRUN, "WORLD_SIZE": "16", "RANK": "9", "LOCAL_RANK": "1", "TORCHELASTIC_RUN_ID": "x",
     "GROUP_WORLD_SIZE": "2", "SLURM_STEP_NUM_TASKS": "2"},  # srun -N 2 --ntasks-per-node 1 torchrun --nnodes 2
    {**TORCHRUN, "WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "3", "SLURM_STEP_NUM_TASKS": "4"},  # srun's tasks as
    # the ranks (RANK from SLURM_PROCID), no torchrun
])
def test_a_launch_that_got_what_it_asked_for_passes(monkeypatch, env):
    for name in (*TORCHRUN, *LAUNCHERS):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    plumbing.check_launch_environment()


def test_accelerate_launch_of_a_multi_cpu_config_is_refused_naming_its_processes(tmp_path):
    """The real launcher: `accelerate launch --config_file` of a MULTI_CPU config of 2 processes ran one process. Its
    traceback follows the refusal, which names --quiet (with it, accelerate exits 1 saying nothing more: its
    simple_launcher)."""
    config = tmp_path / "multi_cpu.yaml"
    config.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\nnum_processes: 2\n"
                      "num_machines: 1\nmachine_rank: 0\nmixed_precision: 'no'\nuse_cpu: true\n")
    probe = tmp_path / "probe.py"
    probe.write_text(f"import sys\nsys.path.insert(0, {str(REPO)!r})\nimport plumbing\n"
                     "plumbing.run_script(lambda _: plumbing.check_launch_environment(), None, 'probe.py')\n")
    env = {name: value for name, value in os.environ.items() if name not in (*TORCHRUN, *LAUNCHERS)}
    # real interpreters, not forks: the probe reads its launcher's command line (/proc/PPID/cmdline), and a fork's
    # parent is the server of forks; the tests' Hugging Face home has no default config of accelerate's
    result = subprocess.run([str(Path(sys.executable).with_name("accelerate")), "launch", "--config_file",
                             str(config), str(probe)], capture_output=True, text=True, cwd=tmp_path, env=env,
                            timeout=300)
    line = next(line for line in result.stderr.splitlines() if line.startswith("probe.py: error: "))
    assert f"accelerate launch's config {config} (num_processes) asks for 2 processes, but this run has 1 " \
           "process" in line, result.stderr[-2000:]
    assert line.endswith("(accelerate launch's traceback follows it: accelerate launch --quiet leaves that out)")
    assert "CalledProcessError" in result.stderr.split(line)[1]
