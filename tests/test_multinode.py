"""rloo_multinode.py on CPU: hf engines in separate processes, weights over gloo, no vLLM."""

import json
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Optional

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import plumbing
from plumbing.outputdir import TRAINER_STATE, latest_checkpoint
import rloo
import rloo_multinode as mn
from conftest import REPO, policy_tokenizer, read_metrics, script_env, tiny_policy
from helpers import (ARCHITECTURES, ENGINE_RUN, PER_UPDATE, SECRET, engine_comparable, free_port, left_padded,
                     listening_sockets, live_processes_in_group, lora_targets, run_script, tiny_architecture,
                     wait_for_updates, wait_until)
import fsdp_lora_weights
from vllm_standin import BAD_ANSWERS

pytestmark = pytest.mark.engines  # make test-engines

ENGINE_NEVER_ANSWERS = """import sys, threading
if sys.argv[1:2] == ["serve"]:  # an engine process: it never starts, however fast the machine
    threading.Event().wait()
"""


def test_buckets_pack_in_order_and_unpack_to_the_same_tensors():
    tensors = {"a": torch.randn(3, 4), "b": torch.randn(10), "c": torch.randn(2, 2, 2), "d": torch.randn(1)}
    info = mn.weights_info([(k, v.shape) for k, v in tensors.items()], torch.float32)
    assert info == {"names": ["a", "b", "c", "d"], "dtype_names": ["float32"] * 4,
                    "shapes": [[3, 4], [10], [2, 2, 2], [1]]}
    buckets = mn.plan_buckets(info, bucket_bytes=64)
    # a bucket ends with the parameter that takes it past 64 bytes: 48 + 40 > 64, then 32 + 4 and the end
    assert [[name for name, _, _ in bucket] for bucket in buckets] == [["a", "b"], ["c", "d"]]
    for bucket in buckets:
        flat = mn.pack_bucket([tensors[name] for name, _, _ in bucket], bucket)
        assert flat.dtype == torch.uint8 and flat.numel() == mn.bucket_nbytes(bucket)
        for name, tensor in mn.unpack_bucket(flat, bucket):
            assert torch.equal(tensor, tensors[name])
    bf16 = mn.plan_buckets(mn.weights_info([(k, v.shape) for k, v in tensors.items()], torch.bfloat16), 2**20)
    assert len(bf16) == 1 and mn.bucket_nbytes(bf16[0]) == 2 * 31
    with pytest.raises(ValueError, match="not a torch dtype"):  # a name from the network never reaches beyond dtypes
        mn.plan_buckets(info | {"dtype_names": ["float32", "load", "float32", "float32"]}, 64)


def tied_llama(vocab_size: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        tie_word_embeddings=True))


@pytest.mark.parametrize("architecture", ["gpt_neox", "tied_llama", *ARCHITECTURES])
def test_after_a_sync_every_engine_holds_the_trainers_weights_bit_for_bit(architecture, tmp_path):
    """Every architecture of the tests' table too (GPT-2, sliding windows, experts, state-space): the hf engine loads
    it and takes the trainer's weights by name; it samples with rloo.py's own sampler (test_shared_prompt.py)."""
    tokenizer = policy_tokenizer()
    policy = tiny_policy(len(tokenizer)) if architecture == "gpt_neox" else tied_llama(len(tokenizer)) \
        if architecture == "tied_llama" else tiny_architecture(architecture)
    policy.save_pretrained(tmp_path / "policy")
    args = mn.Args(model_name_or_path=str(tmp_path / "policy"), engine="hf", output_dir=str(tmp_path / "out"),
                   engine_port=free_port(), sync_bucket_mb=0, engine_timeout=120)  # 0 MB: one bucket per tensor
    dist_info = plumbing.Dist(0, 0, 1, torch.device("cpu"))
    store = mn.control_store(args, dist_info, torch.device("cpu"), mn.secret_key(SECRET))
    engines = mn.ServedEngines(args, dist_info, store, mn.launch_engines(args, dist_info, store, SECRET))
    rollouts = mn.EngineRollouts(policy, args, None, 0, torch.Generator(), dist_info, engines)
    try:
        with torch.no_grad():  # a trained policy: every weight moved away from what the engine loaded
            for p in policy.parameters():
                p.add_(torch.randn_like(p))
        rollouts.policy_updated(1, policy)
        engine = engines.engine_state_dict(0, 1)
        for name, tensor in policy.state_dict().items():
            assert torch.equal(engine[name], tensor), name
        if architecture == "tied_llama":  # one tensor sent, both ends of the tie updated
            assert torch.equal(engine["lm_head.weight"], policy.model.embed_tokens.weight)
        queries, query_mask = left_padded(tokenizer, ["a b :", "c :", "d e f :"])  # a batch, its prompts' rows
        rollouts.submit(queries, query_mask, rloo.SamplingSettings.of(args), torch.tensor([9, 2, 5]))
        completions, _ = rollouts.take()
        assert completions.prompt_index.tolist() == [9, 2, 5] and completions.responses.shape[0] == 3 * args.rloo_k
    finally:
        rollouts.close()


@pytest.mark.parametrize("family", ["tied_llama", *ARCHITECTURES])
def test_an_hf_engine_of_every_family_takes_a_lora_sync_merged_or_as_adapters(family, tmp_path):
    """What the syncs send (SyncedWeights: the merged weights, or the adapters alone), loaded by an hf engine of each
    family (HFEngine, in this process: its load by name is the one its process runs, test_after_a_sync_...'s engines
    show the transfer): with the adapters its peft modules give the trainer's logits bit for bit, merged its plain
    model gives them within fp32 rounding. GPT-NeoX: the test below, with engine processes."""
    tokenizer = policy_tokenizer()
    base = tied_llama(len(tokenizer)) if family == "tied_llama" else tiny_architecture(family)
    base.save_pretrained(tmp_path / "policy")
    tokens = torch.tensor([[5, 6, 7, 8, 9, 10]])
    for lora_sync in ("adapters", "merged"):
        args = mn.Args(model_name_or_path=str(tmp_path / "policy"), engine="hf", use_peft=True, lora_r=4,
                       lora_alpha=8, lora_dropout=0.0, lora_sync=lora_sync,
                       lora_target_modules=lora_targets("llama" if family == "tied_llama" else family))
        policy = plumbing.load_causal_lm(str(tmp_path / "policy"), torch.float32, False).eval()
        plumbing.add_adapters(policy, args, None)
        with torch.no_grad():  # trained adapters: peft starts B at 0, which merges to the base
            for p in policy.parameters():
                if p.requires_grad:
                    p.normal_(0, 0.1)
        engine = mn.HFEngine(args, torch.device("cpu"))
        synced = mn.SyncedWeights(policy, args)
        engine.load_weights([(name, weight.value().detach()) for name, weight in synced.weights.items()])
        with torch.no_grad():
            trainer, served = policy(tokens).logits, engine.model(tokens).logits
        if lora_sync == "adapters":
            assert torch.equal(served, trainer), family
        else:
            torch.testing.assert_close(served, trainer, rtol=1e-5, atol=1e-5, msg=family)
        assert not torch.allclose(served, base(tokens).logits, atol=1e-3)  # the adapters count


LORA = ("--use_peft", "--lora_r", 4, "--lora_alpha", 8)


@pytest.mark.parametrize("lora_sync", ["merged", "adapters"])
def test_after_a_lora_sync_an_hf_engine_holds_the_merged_weights_or_the_adapters_bit_for_bit(assets, tmp_path,
                                                                                             lora_sync):
    """merged: the engine's plain model holds base + scale * B @ A (peft's own merge, bit for bit), sent whole at the
    first sync and after it only for the adapted modules and their siblings, the trainer's base untouched. adapters:
    the engine holds the trainer's own peft modules, and only the adapters travel."""
    args = mn.Args(model_name_or_path=str(assets["policy"]), engine="hf", output_dir=str(tmp_path / "out"),
                   engine_port=free_port(), engine_timeout=120, use_peft=True, lora_r=4, lora_alpha=8,
                   lora_target_modules=("query_key_value", "dense_h_to_4h"), lora_sync=lora_sync)
    policy, _, _, _ = rloo.load_policy(args, torch.device("cpu"))
    base = {name: p.detach().clone() for name, p in policy.named_parameters() if not p.requires_grad}
    dist_info = plumbing.Dist(0, 0, 1, torch.device("cpu"))
    store = mn.control_store(args, dist_info, torch.device("cpu"), mn.secret_key(SECRET))
    engines = mn.ServedEngines(args, dist_info, store, mn.launch_engines(args, dist_info, store, SECRET))
    commands = []
    command = engines.command
    engines.command = lambda **c: commands.append(c) or command(**c)  # what each sync announces to the engines
    rollouts = mn.EngineRollouts(policy, args, None, 0, torch.Generator(), dist_info, engines)
    try:
        with torch.no_grad():  # trained adapters (and a trained lm_head copy would be trained too)
            for p in policy.parameters():
                if p.requires_grad:
                    p.normal_(0, 0.3)
        rollouts.policy_updated(1, policy)
        engine = engines.engine_state_dict(0, 1)
        expected = {name: w.value() for name, w in mn.engine_weights(policy).items()} if lora_sync == "merged" \
            else policy.state_dict()
        assert engine.keys() == expected.keys()
        assert all(torch.equal(engine[name], expected[name]) for name in expected)
        assert all(torch.equal(base[name], p) for name, p in policy.named_parameters() if name in base)
        first, later = [c["info"]["names"] for c in commands if c["kind"] == "sync"]
        if lora_sync == "merged":
            assert first == list(mn.engine_weights(policy)) and "gpt_neox.embed_in.weight" in first
            assert later == [f"gpt_neox.layers.{i}.{module}.{kind}" for i in range(2) for module in (
                "attention.query_key_value", "attention.dense", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h")
                for kind in ("weight", "bias")]  # the adapted modules and their siblings, whole
            assert not torch.equal(engine["gpt_neox.layers.0.attention.query_key_value.weight"],
                                   base["gpt_neox.layers.0.attention.query_key_value.base_layer.weight"])
        else:
            assert first == later == [name for name, p in policy.named_parameters() if p.requires_grad]
            assert all(".lora_" in name for name in later)
    finally:
        rollouts.close()


def test_the_weights_merged_weights_and_adapter_files_of_an_fsdp_sharded_policy_are_the_unsharded_ones():
    """engine_weights gathers each weight of the sharded policy by its name; with LoRA it gathers each FSDP2 unit
    around an adapted layer for peft's merge (peft's arithmetic on the sharded DTensors gives other numbers), then
    reshards it; adapter_files gathers the adapters. Checked on 2 ranks for every family, without LoRA and with
    adapters on every linear layer (merged as merge_and_unload merges; on GPT-NeoX DoRA too), the policy sharded as
    --fsdp shards it."""
    result = run_script("tests/fsdp_lora_weights.py", nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    expected = [f"{family} {case} ok" for family, cases in fsdp_lora_weights.CASES.items() for case in cases]
    assert [line for line in result.stderr.splitlines() if line.startswith(tuple(fsdp_lora_weights.CASES))] == \
        expected, result.stderr[-3000:]


def test_lora_runs_with_hf_engines_equal_rloo_py_s_and_resume_with_the_other_sync(assets, tmp_path):
    """Two ranks, LoRA with --fsdp (the adapters sharded with their blocks: every sync gathers them, and the merged
    weights gather each adapted layer's unit). rloo_multinode.py with hf engines, 2 updates sending the adapters (the
    engine holds the trainer's own peft modules: it samples as rloo.py, bit for bit), then resumed for a third
    sending merged weights (the engine's plain model samples from base + scale * B @ A: its log-probs the trainer's
    within fp32 rounding, about 1e-6, the tokens drawn the same): the metrics and the trained adapter are rloo.py's."""
    common = ["--model_name_or_path", assets["policy"], "--dataset_name", assets["train"], *ENGINE_RUN, *LORA,
              "--kl_coef", 0.05, "--lr_scheduler_type", "constant", "--fsdp"]  # the same steps, however long the run
    local = run_script("rloo.py", *common, "--total_episodes", 3 * 2 * PER_UPDATE, "--output_dir", tmp_path / "local",
                       nproc=2)
    assert local.returncode == 0, local.stderr[-3000:]
    out, metrics = tmp_path / "engines", []
    for updates, lora_sync in ((2, "adapters"), (3, "merged")):
        engines = run_script("rloo_multinode.py", *common, "--total_episodes", updates * 2 * PER_UPDATE,
                             "--output_dir", out, "--engine", "hf", "--engine_port", free_port(), "--lora_sync",
                             lora_sync, *(["--resume"] if lora_sync == "merged" else []), nproc=2)
        assert engines.returncode == 0, engines.stderr[-3000:]
    metrics = read_metrics(out)
    assert [m["update"] for m in metrics] == [1, 2, 3]
    for update, (engine, local) in enumerate(zip(engine_comparable(metrics),
                                                 engine_comparable(read_metrics(tmp_path / "local")), strict=True)):
        mismatch = {k: (engine.pop(k), local.pop(k)) for k in list(local) if k.startswith("mismatch/")}
        assert engine == local  # the same tokens, rewards, losses
        assert all(abs(e - l) < 1e-5 for e, l in mismatch.values()), mismatch
        print(f"update {update + 1}: sampler - trainer log-prob, max {mismatch['mismatch/logprob_diff_max'][0]:.1e}")
        assert mismatch["mismatch/logprob_diff_max"][0] < 1e-5  # merged or not: fp32 rounding
    trained = [load_file(tmp_path / d / plumbing.ADAPTER_WEIGHTS) for d in ("local", "engines")]
    assert trained[0].keys() == trained[1].keys() and all(torch.equal(trained[0][k], trained[1][k]) for k in trained[0])


@pytest.mark.parametrize("nproc,flags", [(0, []), (2, ["--fsdp", "--num_engines", 2, "--sync_bucket_mb", 1])],
                         ids=["one_process", "fsdp_two_ranks_two_engines"])
def test_hf_engine_run_equals_rloo_run_with_the_same_seed(assets, tmp_path, nproc, flags):
    common = ["--model_name_or_path", assets["policy"], "--dataset_name", assets["train"], *ENGINE_RUN,
              "--total_episodes", 3 * PER_UPDATE * max(nproc, 1), "--kl_coef", 0.05, *flags[:1]]
    local = run_script("rloo.py", *common, "--output_dir", tmp_path / "local", nproc=nproc)
    assert local.returncode == 0, local.stderr[-3000:]
    engines = run_script("rloo_multinode.py", *common, *flags[1:], "--output_dir", tmp_path / "engines", "--engine",
                         "hf", "--engine_port", free_port(), nproc=nproc)
    assert engines.returncode == 0, engines.stderr[-3000:]
    local_metrics, engine_metrics = read_metrics(tmp_path / "local"), read_metrics(tmp_path / "engines")
    # the same numbers, but the engines' own log-probs of their tokens: another process's kernels round otherwise
    # (the mismatch metrics are themselves rounding, ~1e-7 apart between the two runs: within 1e-6 of each other)
    for engine, local in zip(engine_comparable(engine_metrics), engine_comparable(local_metrics), strict=True):
        mismatch = [k for k in local if k.startswith("mismatch/")]
        assert mismatch and [engine.pop(k) for k in mismatch] == pytest.approx([local.pop(k) for k in mismatch],
                                                                              rel=1e-6, abs=1e-6)
        assert engine == local
    assert [m["rollout/staleness"] for m in engine_metrics] == [0, 0, 0]
    assert all(m["time/weight_sync"] >= 0 for m in engine_metrics)
    assert all(abs(m["val/ratio"] - 1) < 0.05 for m in engine_metrics)
    assert all(m["mismatch/logprob_diff_max"] < 1e-5 for m in engine_metrics)  # fp32 engines: float rounding
    trained = [AutoModelForCausalLM.from_pretrained(tmp_path / d).state_dict() for d in ("local", "engines")]
    assert all(torch.equal(trained[0][k], trained[1][k]) for k in trained[0])


def test_engines_of_ranks_split_each_batch_by_prompt():
    assert mn.engines_of_ranks(4, 2) == [[0], [1], [0], [1]] and mn.engines_of_ranks(2, 6) == [[0, 2, 4], [1, 3, 5]]
    assert mn.duties(0, 4, 2) == [(0, 0), (2, 0)] and mn.duties(4, 2, 6) == [(0, 2)]
    parts = mn.split_by_prompt(num_prompts=5, parts=2)  # each engine samples all k completions of its prompts
    assert [p.tolist() for p in parts] == [[0, 1, 2], [3, 4]]
    rows = [rloo.completion_rows(p, 5, 4).tolist() for p in parts]  # where they land: row j*5 + b, sample j of b
    assert rows == [[0, 1, 2, 5, 6, 7, 10, 11, 12, 15, 16, 17], [3, 4, 8, 9, 13, 14, 18, 19]]


def test_async_generation_with_two_engines_trains_one_step_off_policy_with_and_without_fsdp(assets, tmp_path):
    """One rank whose batches are split over 2 engines; without FSDP, and with FSDP (one rank: still shards, and
    the units gathered by a forward), whose sampling weights are put in place and back shard by shard."""
    metrics = {}
    for fsdp in (False, True):
        out = tmp_path / f"async_fsdp{fsdp}"
        result = run_script("rloo_multinode.py", "--model_name_or_path", assets["policy"], "--dataset_name",
                            assets["train"], *ENGINE_RUN, "--num_ppo_epochs", 1,
                            "--num_mini_batches", 1,  # one step per batch: 16 per update
                            "--total_episodes", 3 * PER_UPDATE // 2, "--output_dir", out, "--engine", "hf",
                            "--num_engines", 2, "--async_generation", "--engine_port", free_port(),
                            *(["--fsdp"] if fsdp else []), nproc=1 if fsdp else 0)
        assert result.returncode == 0, result.stderr[-3000:]
        metrics[fsdp] = read_metrics(out)
        assert [m["rollout/staleness"] for m in metrics[fsdp]] == [0, 1, 1]  # the first batch waits for nothing
        # the ratio is taken against the weights that sampled: the current ones for the first batch (exactly 1),
        # the previous update's for the others (off 1)
        assert abs(metrics[fsdp][0]["val/ratio"] - 1) < 1e-5
        assert all(abs(m["val/ratio"] - 1) > 1e-4 for m in metrics[fsdp][1:])
        # the engines' log-probs of their tokens are the trainer's under the weights that sampled, not the current
        assert all(m["mismatch/logprob_diff_max"] < 1e-5 and m["mismatch/clipfrac"] == 0 for m in metrics[fsdp])
        assert json.loads((out / "engines.json").read_text()).keys() == {"0", "1"}
    for plain, sharded in zip(metrics[False], metrics[True]):  # the same run, to float tolerance
        for key in ("val/ratio", "loss/policy_avg", "objective/scores", "objective/kl", "policy/entropy_avg"):
            assert sharded[key] == pytest.approx(plain[key], rel=1e-4, abs=1e-6), key


def test_an_engine_that_dies_stops_the_run_with_a_checkpoint_and_names_it(assets, tmp_path):
    out = tmp_path / "dies"
    trainer = run_script("rloo_multinode.py", "--model_name_or_path", assets["policy"], "--dataset_name",
                         assets["train"], *ENGINE_RUN, "--total_episodes", 1000 * PER_UPDATE, "--output_dir", out,
                         "--engine", "hf", "--engine_port", free_port(), wait=False)
    wait_for_updates(trainer, out, 1)
    os.kill(json.loads((out / "engines.json").read_text())["0"]["pid"], signal.SIGKILL)
    stdout, stderr = trainer.communicate(timeout=60)  # never a hang
    assert trainer.returncode == 4, stderr[-3000:]
    assert "engine 0" in stderr and "checkpoint of update" in stderr and "Traceback" not in stderr
    assert "continue with the same command and --resume once the engines are healthy" in stderr, stderr[-3000:]
    checkpoint = latest_checkpoint(str(out))
    saved = torch.load(checkpoint / TRAINER_STATE, weights_only=False)["update"] if checkpoint else 0
    assert saved >= 1
    # the same command with --resume continues with fresh engines, which start from the checkpoint's weights
    resumed = run_script("rloo_multinode.py", "--model_name_or_path", assets["policy"], "--dataset_name",
                         assets["train"], *ENGINE_RUN, "--total_episodes", (saved + 1) * PER_UPDATE, "--output_dir",
                         out, "--engine", "hf", "--engine_port", free_port(), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {checkpoint}" in resumed.stdout and read_metrics(out)[-1]["update"] == saved + 1


def vllm_standin(tmp_path, name: str, policy, *flags) -> tuple[subprocess.Popen, str, object]:
    """A stand-in `vllm serve` (tests/vllm_standin.py) started on a free port: the process, its URL, its log."""
    port, log = free_port(), tmp_path / f"{name}.jsonl"
    process = subprocess.Popen([sys.executable, str(REPO / "tests" / "vllm_standin.py"), "--model", str(policy),
                                "--port", str(port), "--log", str(log), *map(str, flags)], env=script_env(), cwd=REPO)
    return process, f"http://127.0.0.1:{port}", log


def logged_requests(log) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_attached_vllm_servers_serve_two_ranks_and_hold_the_trainers_weights(assets, tmp_path):
    out = tmp_path / "attached"
    servers = [vllm_standin(tmp_path, "a", assets["policy"], "--workers", 2),
               vllm_standin(tmp_path, "b", assets["policy"])]
    try:
        result = run_script("rloo_multinode.py", "--model_name_or_path", assets["policy"], "--dataset_name",
                            assets["train"], *ENGINE_RUN, "--output_dir", out, "--num_ppo_epochs", 1,
                            "--num_mini_batches", 1,  # one step per batch, at the sampling weights;
                            "--total_episodes", 2 * 2 * PER_UPDATE // 2,  # 16 per update and rank
                            "--engine_urls", ",".join(url for _, url, _ in servers), "--engine_port", free_port(),
                            nproc=2)
    finally:
        for process, _, _ in servers:
            process.kill()
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = read_metrics(out)
    assert [m["rollout/staleness"] for m in metrics] == [0, 0]
    # the ratio against log-probs the trainer recomputed with the weights the servers sampled with: exactly 1
    assert all(abs(m["val/ratio"] - 1) < 1e-5 and m["time/weight_sync"] > 0 for m in metrics)
    # and the servers' own log-probs of the tokens they drew (fp32 on both sides) are the trainer's
    assert all(m["mismatch/logprob_diff_max"] < 1e-5 and m["mismatch/clipfrac"] == 0 for m in metrics)
    trained = AutoModelForCausalLM.from_pretrained(out).state_dict()
    for (_, _, log), workers in zip(servers, (2, 1)):
        held = torch.load(log.with_suffix(".pt"))  # every worker's weights after the last sync
        assert len(held) == workers
        assert all(torch.equal(worker[name], trained[name]) for worker in held for name in trained)
        requests = logged_requests(log)
        # vLLM's weight-transfer protocol: the group joined once, then per sync (the start's weights, each update's)
        # start, update (every parameter, the engine dtype), finish, and the prefix cache reset
        syncs = [r["path"] for r in requests if r["path"] != "/v1/completions"]
        assert syncs == ["/init_weight_transfer_engine"] + ["/start_weight_update", "/update_weights",
                                                            "/finish_weight_update", "/reset_prefix_cache"] * 3 + [
            "/shutdown_weight_transfer_engine"]
        update = next(r["body"]["update_info"] for r in requests if r["path"] == "/update_weights")
        assert update["names"] == list(dict(AutoModelForCausalLM.from_pretrained(out).named_parameters()))
        assert set(update["dtype_names"]) == {"float32"}
        completions = [r["body"] for r in requests if r["path"] == "/v1/completions"]
        assert len(completions) == 2  # one per update from the one rank this server serves
        assert all(c["max_tokens"] == 6 and c["temperature"] == 1.0 and c["stop_token_ids"] == [1] for c in completions)


def test_one_rank_over_two_vllm_servers_splits_by_prompt_and_stops_with_a_checkpoint_when_one_dies(assets, tmp_path):
    out = tmp_path / "dies"
    servers = [vllm_standin(tmp_path, name, assets["policy"]) for name in "ab"]
    trainer = run_script("rloo_multinode.py", "--model_name_or_path", assets["policy"], "--dataset_name",
                         assets["train"], *ENGINE_RUN, "--total_episodes", 1000 * PER_UPDATE, "--output_dir", out,
                         "--engine_urls", ",".join(url for _, url, _ in servers), "--async_generation",
                         "--engine_port", free_port(), wait=False)
    try:
        wait_for_updates(trainer, out, 2)
    finally:
        servers[1][0].kill()
    assert [m["rollout/staleness"] for m in read_metrics(out)[:2]] == [0, 1]
    _, stderr = trainer.communicate(timeout=60)  # never a hang
    servers[0][0].kill()
    assert trainer.returncode == 4, stderr[-3000:]
    assert f"vLLM server {servers[1][1]}" in stderr and "checkpoint of update" in stderr, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    # each batch: 8 prompts x k=4, 4 prompts to each server with all their k samples
    batches = [[r["body"]["prompt"] for r in logged_requests(log) if r["path"] == "/v1/completions"][:2]
               for _, _, log in servers]
    for a, b in zip(*batches):
        assert len(a) == len(b) == PER_UPDATE // 2
        assert all(a.count(p) == 4 for p in a) and all(b.count(p) == 4 for p in b)
        assert not {tuple(p) for p in a} & {tuple(p) for p in b}


def test_a_vllm_server_without_development_mode_is_refused_with_the_fix(assets, tmp_path):
    server, url, _ = vllm_standin(tmp_path, "a", assets["policy"], "--no-dev_mode")
    try:
        result = run_script("rloo_multinode.py", "--model_name_or_path", assets["policy"], "--dataset_name",
                            assets["train"], *ENGINE_RUN, "--total_episodes", PER_UPDATE, "--output_dir",
                            tmp_path / "out", "--engine_urls", url, "--engine_port", free_port())
    finally:
        server.kill()
    assert result.returncode == 4 and "VLLM_SERVER_DEV_MODE=1" in result.stderr, result.stderr[-3000:]
    assert "Traceback" not in result.stderr


def test_vllm_servers_that_cannot_serve_the_run_are_refused_with_the_fix(assets, tmp_path):
    cases = {"no_weight_transfer": (["--weight_transfer", "None"],
                                    """restart it with --weight-transfer-config '{"backend": "gloo"}'"""),
             "nccl": (["--weight_transfer", "nccl"], "takes weights over nccl but this trainer sends them over gloo"),
             "too_short": (["--max_model_len", 20], "restart it with --max-model-len 22"),
             "raw_logprobs": (["--logprobs_mode", "raw_logprobs"],
                              "restart it with --logprobs-mode processed_logprobs")}
    servers = {name: vllm_standin(tmp_path, name, assets["policy"], *flags) for name, (flags, _) in cases.items()}

    def refused(url: str, fix: str, **flags) -> None:
        args = mn.Args(model_name_or_path=str(assets["policy"]), engine_urls=url, engine_port=free_port(),
                       max_prompt_length=16, response_length=6, engine_timeout=300, **flags)
        attached = mn.VLLMServers(args, plumbing.Dist(0, 0, 1, torch.device("cpu")))
        with pytest.raises(mn.EngineError, match=re.escape(fix)):
            attached.connect("gloo", 2**20)
        attached.close()

    try:
        for name, (_, fix) in cases.items():
            refused(servers[name][1], fix)
        # --lora_sync adapters: a server that serves the run but for LoRA (the last one, its --logprobs-mode fixed),
        # then with LoRA of rank 8 fixed at start-up, then loading LoRA while it runs, of rank 1 at most
        url, lora = servers["raw_logprobs"][1], {"use_peft": True, "lora_r": 4, "lora_sync": "adapters",
                                                 "output_dir": str(tmp_path)}
        start = "but --lora_sync adapters loads rank-4 adapters into it at every sync: restart it with"
        for changes, fix in (({"logprobs_mode": "processed_logprobs"}, "serves no LoRA adapter, " + start +
                              " --enable-lora --max-lora-rank 8"),
                             ({"max_lora_rank": 8}, "loads no adapter while it runs, " + start +
                              " VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 in its environment"),
                             ({"max_lora_rank": 1, "runtime_lora": True}, "serves LoRA ranks up to 1, " + start +
                              " --enable-lora --max-lora-rank 8")):
            mn.http_json(f"{url}/standin/set", changes, 60)
            refused(url, fix, **lora)
    finally:
        for process, _, _ in servers.values():
            process.kill()


def test_engine_flags_that_clash_are_refused_in_one_line(assets, tmp_path):
    common = ["--model_name_or_path", assets["policy"], "--dataset_name", assets["train"], *ENGINE_RUN,
              "--output_dir", tmp_path]
    tensor_parallel = run_script("rloo_multinode.py", *common, "--engine", "hf", "--vllm_tensor_parallel_size", 2)
    assert tensor_parallel.returncode == 2 and "the hf engine is one device" in tensor_parallel.stderr
    # the same check, in process (plumbing.run_script turns a ConfigError into the one line and exit 2 shown above)
    with pytest.raises(plumbing.ConfigError, match="drop --engine hf"):
        mn.validate_engine_args(mn.Args(model_name_or_path="m", engine="hf", engine_urls="http://a:8000"), 1)
    with pytest.raises(plumbing.ConfigError, match="--num_engines 3 but 2 --engine_urls"):
        mn.validate_engine_args(mn.Args(model_name_or_path="m", engine_urls="http://a:8000,http://b:8000",
                                        num_engines=3), 2)
    with pytest.raises(plumbing.ConfigError, match="--num_engines 3 for 2 training rank.*must be a multiple"):
        mn.validate_engine_args(mn.Args(model_name_or_path="m", engine="hf", num_engines=3), 2)
    with pytest.raises(plumbing.ConfigError, match="engines: 3 for 2 training rank"):
        mn.validate_engine_args(mn.Args(model_name_or_path="m", engine_urls="http://a,http://b,http://c"), 2)
    mn.validate_engine_args(mn.Args(model_name_or_path="m", engine="hf", num_engines=4), 2)  # 2 engines per rank
    try:
        import vllm  # noqa: F401
    except ImportError:
        no_vllm = run_script("rloo_multinode.py", *common)
        assert no_vllm.returncode == 2 and "--engine vllm needs vLLM" in no_vllm.stderr
        assert len(no_vllm.stderr.strip().splitlines()) == 1


class RunsCode:
    """A pickle that runs a command when unpickled: what anyone who reaches the control store could write into it."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("url, problem", [
    ("file:///etc/passwd", "has the scheme file://; an engine is reached over http or https only"),
    ("ftp://a:21", "has the scheme ftp://"), ("FILE:///etc/hosts", "has the scheme file://"),
    ("a:8000", "has no scheme"), ("localhost", "has no scheme"), ("//a:8000", "has no scheme"),
    ("http://", "names no host"), ("http://:8000", "names no host"),
    ("http://a:99999", "has a port that is not a number"), ("http://a:80x", "has a port that is not a number"),
    ("http://a:0", "has a port that is not a number from 1 to 65535"), ("https://[::1]:00/", "from 1 to 65535"),
    ("http://u:s3cret@a:8000,gopher://u:s3cret@b", "has the scheme gopher://"),
    ("http://a\x1b[2J:1", "is not a URL"), ("http://a\x1b:1", "names no host"),
    ("javascript:alert(1)", "has no scheme"),
])
def test_an_engine_url_of_another_scheme_is_refused_at_once_its_credentials_never_shown(url, problem):
    """Before any request: no waiting out --engine_timeout, no file:// read as an answer, no password shown."""
    with pytest.raises(plumbing.ConfigError, match=re.escape(problem)) as refused:
        mn.validate_engine_args(mn.Args(model_name_or_path="m", engine_urls=url), 1)
    line = str(refused.value)
    assert "s3cret" not in line and "\x1b" not in line and "\n" not in line and "pass each engine as http" in line
    for good in ("http://a:8000", "HTTPS://a.example/v1/", "http://[::1]:8000", "http://u:p@a:8000"):
        assert mn.engine_urls(mn.Args(model_name_or_path="m", engine_urls=good)) == [good.rstrip("/")]


def test_an_engine_urls_credentials_are_sent_as_basic_authentication_and_never_shown():
    import base64
    import http.server
    import threading

    seen = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            seen.append((self.path, self.headers.get("Authorization")))
            self.send_response(500 if self.path == "/fail" else 200)
            self.end_headers()
            self.wfile.write(b"http://u:s3cret@echoed" if self.path == "/fail" else b'{"ok": 1}')

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://us%40er:s3cret@127.0.0.1:{server.server_address[1]}"
        assert mn.http_json(f"{base}/health", None, 10) == {"ok": 1}
        assert seen[-1] == ("/health", "Basic " + base64.b64encode(b"us@er:s3cret").decode())
        with pytest.raises(mn.EngineError) as failed:
            mn.http_json(f"{base}/fail", None, 10)
        assert "s3cret" not in str(failed.value) and "answered 500: http://***@echoed" in str(failed.value)
        with pytest.raises(mn.EngineError) as unreachable:
            mn.http_json("http://u:s3cret@127.0.0.1:1/health", None, 10)
        assert "s3cret" not in str(unreachable.value)
    finally:
        server.shutdown()
    assert plumbing.without_credentials("a https://x:y@h/p and ftp://@h") == "a https://***@h/p and ftp://***@h"


def serve_engine(port: int, *flags, secret: str = SECRET, env: dict | None = None) -> subprocess.CompletedProcess:
    """`rloo_multinode.py serve` for the control store at 127.0.0.1:port, run to its end."""
    return subprocess.run([sys.executable, str(REPO / "rloo_multinode.py"), "serve", "--trainer_address",
                           f"127.0.0.1:{port}", "--engine_index", "0", "--connect_timeout", "60", *map(str, flags)],
                          capture_output=True, text=True, env=script_env({mn.SECRET_VARIABLE: secret, **(env or {})}),
                          cwd=REPO, timeout=120)


def test_a_pickle_sent_to_the_control_store_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "code_ran"
    payload = pickle.dumps(RunsCode(marker), protocol=2)  # torch.save's protocol
    with pytest.raises(mn.UntrustedMessageError, match="not plain data"):
        mn.loads(payload)
    with pytest.raises(mn.UntrustedMessageError, match="not plain data"):
        mn.loads(pickle.dumps(RunsCode(marker)))  # Python's default protocol
    request = mn.loads(mn.dumps({"queries": torch.ones(2, 3), "rng_state": torch.Generator().get_state(),
                                 "info": {"names": ["a"], "shapes": [[1]]}}))
    assert request["info"]["names"] == ["a"] and torch.equal(request["queries"], torch.ones(2, 3))
    # an engine reading it where the trainer publishes the run's configuration: one line, exit 2, no command run
    port = free_port()
    store = mn.tcp_store("127.0.0.1", port, True, 60.0)  # listening on loopback alone
    store.set("config", payload)
    engine = serve_engine(port, "--model", "m")
    assert engine.returncode == 2, engine.stderr[-3000:]
    assert engine.stderr.strip().startswith("rloo_multinode.py serve: error: refused a control-store message")
    assert len(engine.stderr.strip().splitlines()) == 1 and not marker.exists()


def remote_code_model(path: Path, marker: Path) -> Path:
    """A model directory whose configuration names code of its own (auto_map), which touches `marker` when
    imported: what a configuration naming another model, with trust_remote_code, would run."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "runs_code", "auto_map": {
        "AutoConfig": "runs_code.Config", "AutoModelForCausalLM": "runs_code.Model"}}))
    (path / "runs_code.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n")
    return path


@pytest.mark.parametrize("case", ["unsigned", "wrong_secret", "another_model", "remote_code"])
def test_an_engine_refuses_a_configuration_not_signed_by_the_run_or_naming_another_model_or_code(
        assets, tmp_path, case):
    """The run's configuration as an engine finds it in the store: without the run's tag (written by someone
    who reaches the port), or signed but asking for a model or code other than the engine's command line names.
    The engine stops in one line, exit 2, loads nothing, and leaves its account for the trainer."""
    marker = tmp_path / "code_ran"
    elsewhere = remote_code_model(tmp_path / "elsewhere", marker)
    wanted = elsewhere if case in ("another_model", "remote_code") else assets["policy"]
    config = {"args": asdict(mn.Args(model_name_or_path=str(wanted), engine="hf",
                                     trust_remote_code=case in ("another_model", "remote_code"))),
              "world_size": 1, "trainer_device_type": "cpu", "backend": "gloo", "init_infos": []}
    port = free_port()
    store = mn.tcp_store("127.0.0.1", port, True, 60.0)  # listening on loopback alone
    another = "another run's secret " + "0" * 32
    signer = mn.ControlStore(store, mn.secret_key(another if case == "wrong_secret" else SECRET))
    if case == "unsigned":
        store.set("config", mn.dumps(config))
    else:
        signer.set("config", config)
    engine_model = elsewhere if case == "remote_code" else assets["policy"]  # the same model, not its code
    engine = serve_engine(port, "--model", engine_model, env={"HF_HOME": str(tmp_path / "hf")})
    expected = {"unsigned": "refused a control-store message under 'config' at 127.0.0.1",
                "wrong_secret": "refused a control-store message under 'config' at 127.0.0.1",
                "another_model": f"the trainer's policy is '{elsewhere}' but this engine was started with --model "
                                 f"'{assets['policy']}'",
                "remote_code": "the trainer runs with --trust_remote_code but this engine does not"}[case]
    assert engine.returncode == 2, engine.stderr[-3000:]
    assert engine.stderr.strip().startswith(f"rloo_multinode.py serve: error: {expected}"), engine.stderr[-3000:]
    assert len(engine.stderr.strip().splitlines()) == 1 and not marker.exists()
    # the trainer's check() reads this: the engine's own account, under the run's tag
    account = mn.ControlStore(store, mn.secret_key(SECRET)).get("failed")["error"]
    assert account.startswith("engine 0 (") and expected in account


def test_the_trainer_refuses_a_forged_or_moved_engine_message_and_a_replayed_heartbeat(tmp_path):
    args = mn.Args(model_name_or_path="m", engine="hf", engine_port=free_port(), output_dir=str(tmp_path))
    dist_info = plumbing.Dist(0, 0, 1, torch.device("cpu"))
    store = mn.control_store(args, dist_info, torch.device("cpu"), mn.secret_key(SECRET))
    engines = mn.ServedEngines(args, dist_info, store, {})
    engine = mn.ControlStore(torch.distributed.TCPStore("127.0.0.1", args.engine_port), mn.secret_key(SECRET))
    engine.set("engine/0/beat", {"beat": 2})
    engines.check()
    old_beat = store.store.get("engine/0/beat")
    engine.set("engine/0/beat", {"beat": 3})
    engines.check()
    last = engines.beats[0]  # (3, since when)
    store.store.set("engine/0/beat", old_beat)  # an older beat replayed: no sign of life
    engines.check()
    assert engines.beats[0] == last and last[0] == 3
    engine.set("out/0/0/0", {"responses": torch.zeros(2, 3, dtype=torch.long)})
    store.store.set("out/1/0/0", store.store.get("out/0/0/0"))  # batch 0's completions offered as batch 1's
    engines.parts_sent = {1: (1, mn.engine_deadline(args))}
    with pytest.raises(mn.EngineError, match="refused a control-store message under 'out/1/0/0'"):
        engines.receive(1)
    engine.set("engine/0/beat", {"beat": "4"})  # a count of another type: no sign of life either, but said
    with pytest.raises(mn.EngineError, match=r"^engine 0 sent the heartbeat '4', not a count$"):
        engines.check()
    engine.set("engine/0/beat", {"beat": 4})
    store.store.set("failed", b"engine 0 failed: stop the run")  # anyone who reaches the port could write this
    with pytest.raises(mn.EngineError, match="^refused a control-store message under 'failed' at 127.0.0.1"):
        engines.check()
    engine.set("failed", {"account": "not the field an engine writes"})  # signed, of another shape: still a failure
    with pytest.raises(mn.EngineError, match=r"^an engine reported a failure in another shape: \{'account': "):
        engines.check()


def test_the_trainer_and_its_engines_listen_on_master_addr_never_on_every_interface(tmp_path):
    """One node (MASTER_ADDR unset: 127.0.0.1): the control store and the weight group's rendezvous listen on
    loopback; no socket of the trainer or its engine, gloo's own included, listens on a wildcard address."""
    policy = tiny_policy(len(policy_tokenizer()))
    policy.save_pretrained(tmp_path / "policy")
    args = mn.Args(model_name_or_path=str(tmp_path / "policy"), engine="hf", output_dir=str(tmp_path / "out"),
                   engine_port=free_port(), engine_timeout=120)
    dist_info = plumbing.Dist(0, 0, 1, torch.device("cpu"))
    before = listening_sockets([os.getpid()])
    store = mn.control_store(args, dist_info, torch.device("cpu"), mn.secret_key(SECRET))
    engines = mn.ServedEngines(args, dist_info, store, mn.launch_engines(args, dist_info, store, SECRET))
    rollouts = mn.EngineRollouts(policy, args, None, 0, torch.Generator(), dist_info, engines)  # group joined
    try:
        trainer = {inode: s for inode, s in listening_sockets([os.getpid()]).items() if inode not in before}
        engine = listening_sockets(live_processes_in_group(engines.processes[0].pid))
        print(f"listening: trainer {sorted(trainer.values())}, engine {sorted(engine.values())}")
        served = {port: address for address, port in trainer.values()}
        assert served.get(args.engine_port) == served.get(args.engine_port + 1) == "127.0.0.1", served
        wildcard = [s for s in [*trainer.values(), *engine.values()] if s[0] in ("0.0.0.0", "::")]
        assert not wildcard
        # launched with the trainer's stop signals held (so a signal cannot come between its start and its record),
        # the engine releases them: a SIGTERM sent to it still ends it
        status = Path(f"/proc/{engines.processes[0].pid}/status").read_text()
        assert int(re.search(r"^SigBlk:\s*(\w+)", status, re.M).group(1), 16) == 0
    finally:
        rollouts.close()


@pytest.mark.parametrize("how", ["error", "signal"])
def test_engines_started_at_start_up_are_ended_when_start_up_fails_or_is_signalled(assets, tmp_path, how):
    """An engine is started (and never answers), then start-up fails (an engine timeout of 1 s) or the trainer gets
    SIGTERM while it waits for the engine: the engine's whole process group ends with the trainer."""
    out, hook = tmp_path / "out", tmp_path / "hook"
    hook.mkdir()  # a sitecustomize of this test's own: the engine hangs for certain before it answers
    (hook / "sitecustomize.py").write_text(ENGINE_NEVER_ANSWERS)
    trainer = run_script("rloo_multinode.py", "--model_name_or_path", assets["policy"], "--dataset_name",
                         assets["train"], *ENGINE_RUN, "--total_episodes", PER_UPDATE, "--output_dir", out, "--engine",
                         "hf", "--engine_port", free_port(), *(["--engine_timeout", 1] if how == "error" else []),
                         wait=False, env={"PYTHONPATH": f"{hook}:{REPO}:{REPO / 'tests'}"})
    wait_until((out / "engines.json").is_file, trainer, "the engines started")
    engine = json.loads((out / "engines.json").read_text())["0"]["pid"]
    if how == "signal":
        trainer.send_signal(signal.SIGTERM)
    _, stderr = trainer.communicate(timeout=600)
    if how == "error":
        assert trainer.returncode == 4, stderr[-3000:]
        assert "engine 0 (loading its model) did not answer within --engine_timeout 1 s" in stderr, stderr[-3000:]
    else:
        assert trainer.returncode == 0 and "SIGTERM received during start-up" in stderr, stderr[-3000:]
    wait_until(lambda: live_processes_in_group(engine) == [], what="the engine's group reaped")  # the trainer killed it


def test_an_engine_started_by_hand_with_the_secret_and_the_model_serves_a_run(assets, tmp_path, monkeypatch):
    """docs/scaling-out.md's several-node lines on one machine: the engine first (it waits), then the trainer with
    --no-launch_engines; both have the secret in their environment, the engine the model on its command line."""
    port, out, log = free_port(), tmp_path / "out", tmp_path / "engine.log"
    engine = subprocess.Popen([sys.executable, str(REPO / "rloo_multinode.py"), "serve", "--trainer_address",
                               f"127.0.0.1:{port}", "--engine_index", "0", "--model", str(assets["policy"])],
                              stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=REPO,
                              env=script_env({mn.SECRET_VARIABLE: SECRET}))
    try:
        common = ["--model_name_or_path", assets["policy"], "--dataset_name", assets["train"], *ENGINE_RUN,
                  "--total_episodes", PER_UPDATE, "--output_dir", out, "--engine", "hf", "--engine_port", port,
                  "--no-launch_engines"]
        monkeypatch.delenv(mn.SECRET_VARIABLE, raising=False)
        refused = run_script("rloo_multinode.py", *common)  # without the secret: one line, before anything loads
        assert refused.returncode == 2 and f"{mn.SECRET_VARIABLE}=$(openssl rand -hex 32)" in refused.stderr
        assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr[-3000:]
        monkeypatch.setenv(mn.SECRET_VARIABLE, SECRET)
        result = run_script("rloo_multinode.py", *common)
        assert result.returncode == 0, result.stderr[-3000:]
        assert [m["update"] for m in read_metrics(out)] == [1]
        assert engine.wait(timeout=60) == 0, log.read_text()[-3000:]  # stopped by the trainer
    finally:
        engine.kill()


def test_an_engine_timeout_of_zero_and_a_port_in_use_or_ephemeral_are_refused_before_anything_loads():
    for timeout in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(plumbing.ConfigError, match="engine_timeout = .* must be a finite number of seconds > 0"):
            mn.validate_engine_args(mn.Args(model_name_or_path="m", engine="hf", engine_timeout=timeout), 1)
    low, high = mn.ephemeral_ports()
    if high >= low:  # Linux: a port an outgoing connection may take before the weight group listens there
        for engine_port in (low - 1, low, high):  # the weight group's port in the range, or both
            with pytest.raises(plumbing.ConfigError, match=rf"^--engine_port {engine_port}: port \d+ lies in this "
                               rf"host's ephemeral range {low}-{high} .* below {low - 1}$"):
                mn.validate_engine_args(mn.Args(model_name_or_path="m", engine="hf", engine_port=engine_port), 1)
    with socket.socket() as taken:  # what an earlier run, or anything else, listening there looks like
        taken.bind(("127.0.0.1", free_port()))
        taken.listen()
        port = taken.getsockname()[1]
        for engine_port in (port, port - 1):  # the control store's port, or the weight group's after it
            with pytest.raises(plumbing.ConfigError, match=rf"--engine_port {engine_port}: port \d+ is in use.* another"):
                mn.validate_engine_args(mn.Args(model_name_or_path="m", engine="hf", engine_port=engine_port), 1)


def test_a_port_the_kernel_reserves_inside_its_ephemeral_range_is_taken(monkeypatch):
    """net.ipv4.ip_local_reserved_ports: ports of the ephemeral range no outgoing connection takes ("8000,9000-9010",
    or nothing): an --engine_port whose pair is reserved there is taken, one a port short of it refused."""
    assert mn.reserved_ports("") == mn.reserved_ports("\n") == set()
    assert mn.reserved_ports("8000,9000-9002\n") == {8000, 9000, 9001, 9002}
    port, parse = mn.free_engine_port(), mn.reserved_ports
    monkeypatch.setattr(mn, "ephemeral_ports", lambda: (port - 4, port + 4))
    monkeypatch.setattr(mn, "reserved_ports", lambda: parse(f"{port - 1}-{port + 1}"))
    mn.validate_engine_args(mn.Args(model_name_or_path="m", engine="hf", engine_port=port), 1)  # port and port + 1
    with pytest.raises(plumbing.ConfigError, match=rf"^--engine_port {port - 2}: port {port - 2} lies in this host's "
                       rf"ephemeral range {port - 4}-{port + 4} "):
        mn.validate_engine_args(mn.Args(model_name_or_path="m", engine="hf", engine_port=port - 2), 1)


def test_a_master_addr_not_of_this_host_and_a_missing_or_short_secret_are_refused_in_one_line(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "192.0.2.1")  # TEST-NET-1: no address of this host
    with pytest.raises(plumbing.ConfigError, match=r"^MASTER_ADDR 192.0.2.1: rank 0 cannot listen there .* set MASTER"):
        mn.validate_engine_args(mn.Args(model_name_or_path="m", engine="hf", engine_port=free_port()), 1)
    monkeypatch.delenv("MASTER_ADDR")
    monkeypatch.setenv(mn.SECRET_VARIABLE, "short")
    with pytest.raises(plumbing.ConfigError, match=r"^\$RLOO_ENGINE_SECRET has 5 characters, too few for a secret"):
        mn.check_engine_secret(mn.Args(model_name_or_path="m", engine="hf"))
    serve_args = mn.ServeArgs(trainer_address=f"127.0.0.1:{free_port()}", engine_index=0, model="m")
    with pytest.raises(plumbing.ConfigError, match="has 5 characters"):  # before it connects
        mn.serve(serve_args)
    monkeypatch.delenv(mn.SECRET_VARIABLE)
    with pytest.raises(plumbing.ConfigError, match=r"^\$RLOO_ENGINE_SECRET is not set: an engine started by hand"):
        mn.serve(serve_args)
    mn.check_engine_secret(mn.Args(model_name_or_path="m", engine="hf"))  # engines it starts: the trainer draws one


def test_colocated_flags_that_clash_are_refused_in_one_line(assets, tmp_path):
    """--vllm_mode colocate: nothing that places engines elsewhere; sleep mode only colocated, and only on CUDA
    (vLLM's sleep mode works through CUDA's allocator); without vLLM installed, one line before anything loads."""
    for flags, message in [({"engine": "hf"}, "drop --engine hf"), ({"num_engines": 2}, "drop --num_engines"),
                           ({"engine_urls": "http://a:8000"}, "drop --engine_urls"),
                           ({"engine_devices": "1"}, "drop --engine_devices"),
                           ({"launch_engines": False}, "drop --no-launch_engines"),
                           ({"async_generation": True}, "drop --async_generation"),
                           ({"vllm_tensor_parallel_size": 2}, "drop --vllm_tensor_parallel_size")]:
        with pytest.raises(plumbing.ConfigError, match=message):
            mn.validate_engine_args(mn.Args(model_name_or_path="m", vllm_mode="colocate", **flags), 1)
    with pytest.raises(plumbing.ConfigError, match="add --vllm_mode colocate"):
        mn.validate_engine_args(mn.Args(model_name_or_path="m", vllm_enable_sleep_mode=True), 1)
    common = ["--model_name_or_path", assets["policy"], "--dataset_name", assets["train"], *ENGINE_RUN,
              "--output_dir", tmp_path, "--vllm_mode", "colocate"]
    if not torch.cuda.is_available():
        sleep = run_script("rloo_multinode.py", *common, "--vllm_enable_sleep_mode")
        assert sleep.returncode == 2 and "--vllm_enable_sleep_mode needs CUDA" in sleep.stderr, sleep.stderr
        assert len(sleep.stderr.strip().splitlines()) == 1
    try:
        import vllm  # noqa: F401
    except ImportError:
        no_vllm = run_script("rloo_multinode.py", *common)
        assert no_vllm.returncode == 2 and "--vllm_mode colocate needs vLLM" in no_vllm.stderr, no_vllm.stderr
        assert len(no_vllm.stderr.strip().splitlines()) == 1


def test_the_generation_modes_benchmark_passes_only_real_flags():
    """benchmark/generation_modes.py's three commands parse as rloo.py's and rloo_multinode.py's flags."""
    import tyro

    from benchmark import generation_modes as gm
    from benchmark.throughput import trainer_flags

    args = gm.Args(vllm_enable_sleep_mode=True)
    flags = trainer_flags(args, args.rloo_k, {"policy": "p", "reward_model": "r", "prompts": "d"}, Path("out"))
    for mode in gm.MODES:
        command = gm.mode_command(mode, args)
        parsed = tyro.cli(rloo.Args if mode == "rloo.py" else mn.Args, args=command[2:] + flags)
        assert getattr(parsed, "vllm_mode", None) == {"rloo.py": None, "colocate": "colocate", "server": "server"}[mode]
    assert "--vllm_enable_sleep_mode" in gm.mode_command("colocate", args)


def test_a_run_with_hf_engines_and_every_option_equals_rloo_py_s(assets, tmp_path):
    """rloo_multinode.py's hf engines sample with rloo.py's own filtered sampler: the same run, bit for bit."""
    common = ["--model_name_or_path", assets["policy"], "--dataset_name", assets["train"], *ENGINE_RUN,
              "--total_episodes", 2 * PER_UPDATE, "--top_k", 5, "--top_p", 0.8, "--min_p", 0.1,
              "--repetition_penalty", 1.3]
    local = run_script("rloo.py", *common, "--output_dir", tmp_path / "local")
    assert local.returncode == 0, local.stderr[-3000:]
    engines = run_script("rloo_multinode.py", *common, "--output_dir", tmp_path / "engines", "--engine", "hf",
                         "--engine_port", free_port())
    assert engines.returncode == 0, engines.stderr[-3000:]
    for engine, local in zip(engine_comparable(read_metrics(tmp_path / "engines")),
                             engine_comparable(read_metrics(tmp_path / "local")), strict=True):
        mismatch = [k for k in local if k.startswith("mismatch/")]
        assert mismatch and engine["mismatch/logprob_diff_max"] < 1e-5  # the engine's filtered log-probs, fp32
        # a few float32 steps apart at most: the engine process sums its log-probs (1-4 nats, whose float32 step is
        # 1.2e-7 to 4.8e-7) with its own threads' order; training reads the trainer's, which the rest shows equal
        assert [engine.pop(k) for k in mismatch] == pytest.approx([local.pop(k) for k in mismatch], rel=1e-6,
                                                                  abs=1e-6)
        assert engine == local
    trained = [AutoModelForCausalLM.from_pretrained(tmp_path / d).state_dict() for d in ("local", "engines")]
    assert all(torch.equal(trained[0][k], trained[1][k]) for k in trained[0])


# ----- no weight sync can hang: every exchange with the engines bounded, an engine failing mid-sync named
ENGINE_FAULT_AT_BUCKET = """import os, signal, sys, threading
if sys.argv[1:2] == ["serve"]:  # an engine process: at its {at}-th weight bucket (counted over the run), {what}
    import torch.distributed as dist
    broadcast, calls = dist.ProcessGroupGloo.broadcast, []
    def fault(self, *args, **kwargs):
        calls.append(None)
        if len(calls) == {at}:
            {fault}
        return broadcast(self, *args, **kwargs)
    dist.ProcessGroupGloo.broadcast = fault
"""
FAULTS = {"dies": ("it kills itself", "os.kill(os.getpid(), signal.SIGKILL)"),
          "stalls": ("it stops for good, its heartbeats going on", "threading.Event().wait()")}


def parameters_of(policy) -> int:
    """The buckets of a sync with --sync_bucket_mb 0: one per parameter."""
    return len(list(AutoModelForCausalLM.from_pretrained(policy).parameters()))


def assert_stopped_at_update_2(result: subprocess.CompletedProcess, out: Path, names: str, ranks: int = 1) -> str:
    """The run stopped with exit 4 (on every rank) in one line naming the engine(s), having saved update 1: the sync
    after update 1 failed, and update 2 never sampled. Its line is returned."""
    lines = [line for line in result.stderr.splitlines() if line.startswith("rloo_multinode.py: error: ")]
    assert len(lines) == 1 and lines[0].startswith(f"rloo_multinode.py: error: {names}"), result.stderr[-3000:]
    assert "; checkpoint of update 1 saved to" in lines[0], lines[0]
    if ranks == 1:
        assert result.returncode == 4 and lines[0] == result.stderr.strip().splitlines()[-1], result.stderr[-3000:]
        assert "Traceback" not in result.stderr, result.stderr[-3000:]
    else:  # torchrun's report of each rank's status (and its own traceback, its way of saying so)
        assert result.returncode == 1 and result.stderr.count("exitcode  : 4 ") == ranks, result.stderr[-3000:]
        assert 'rloo_multinode.py", line' not in result.stderr, result.stderr[-3000:]  # no rank's traceback
    assert [m["update"] for m in read_metrics(out)] == [1]
    assert latest_checkpoint(str(out)).name == "step_1"
    return lines[0]


@pytest.mark.parametrize("fault", FAULTS)
def test_an_hf_engine_that_dies_or_stalls_mid_sync_stops_every_rank_with_a_checkpoint(assets, tmp_path, fault):
    """The engine's second bucket of the sync after update 1: killed there, the run stops as soon as the trainer
    notices (the process gone), naming it; stalled there (alive, its heartbeats going on), it stops at
    --weight_sync_timeout, naming it. On 2 ranks: both stop at the same update."""
    out, hook = tmp_path / "out", tmp_path / "hook"
    hook.mkdir()
    what, code = FAULTS[fault]
    (hook / "sitecustomize.py").write_text(ENGINE_FAULT_AT_BUCKET.format(
        at=parameters_of(assets["policy"]) + 2, what=what, fault=code))
    result = run_script("rloo_multinode.py", "--model_name_or_path", assets["policy"], "--dataset_name",
                        assets["train"], *ENGINE_RUN, "--total_episodes", 100 * 2 * PER_UPDATE, "--output_dir", out,
                        "--engine", "hf", "--engine_port", free_port(), "--sync_bucket_mb", 0,
                        "--weight_sync_timeout", 5, nproc=2, env={"PYTHONPATH": f"{hook}:{REPO}:{REPO / 'tests'}"})
    line = assert_stopped_at_update_2(result, out, "engine 0", ranks=2)
    print(line)
    if fault == "dies":  # the process found gone, or (its sockets close before it is) the broadcast's failure
        assert re.search(r"engine 0 \(pid \d+\) exited with status -9|engine 0 \(weight sync 1, bucket \d+ of \d+\) "
                         r"failed: ", line), line
    else:
        assert "did not answer within --weight_sync_timeout 5 s" in line, line
    engine = json.loads((out / "engines.json").read_text())["0"]["pid"]
    wait_until(lambda: live_processes_in_group(engine) == [], what="the engine's group reaped")  # the trainer killed it


def test_a_weight_transfer_that_never_returns_is_bounded_and_leaves_the_process_free_to_exit(assets, tmp_path):
    """NCCL's broadcast has no timeout: rank 0's weight group is vLLM's NCCL one (NcclWeightGroup) around a stand-in
    communicator whose broadcast of the sync after update 1's second bucket never returns. The bound fires at
    --weight_sync_timeout, the run saves update 1 and exits: the thread still blocked in the broadcast keeps nothing
    alive (this test waits for the process's exit)."""
    out = tmp_path / "out"
    result = run_script("tests/faulty_engines.py", "--model_name_or_path", assets["policy"], "--dataset_name",
                        assets["train"], *ENGINE_RUN, "--total_episodes", 100 * PER_UPDATE, "--output_dir", out,
                        "--engine", "hf", "--engine_port", free_port(), "--sync_bucket_mb", 0,
                        "--weight_sync_timeout", 5,
                        env={"NCCL_BLOCKS_AT": str(parameters_of(assets["policy"]) + 2)})
    line = assert_stopped_at_update_2(result, out, "engine 0 (weight sync 1, bucket 2 of ")
    assert "did not answer within --weight_sync_timeout 5 s" in line, line
    assert "without waiting for what was left running" not in result.stderr  # a daemon thread: nothing to wait for


@pytest.mark.parametrize("fault", ["die_at_sync", "stall_at_sync", "stall_at_adapter"])
def test_a_vllm_server_that_dies_or_stalls_mid_sync_stops_the_run_with_a_checkpoint(assets, tmp_path, fault):
    """A `vllm serve` (the stand-in) killed, or stalled for good, once its worker took the first bucket of its second
    sync (the one after update 1); or, with --lora_sync adapters, stalled in its second adapter load."""
    out = tmp_path / "out"
    lora = fault.endswith("adapter")
    server, url, log = vllm_standin(tmp_path, "a", assets["policy"], f"--{fault}", 2,
                                    *(["--max_lora_rank", 8, "--runtime_lora"] if lora else []))
    try:
        result = run_script("rloo_multinode.py", "--model_name_or_path", assets["policy"], "--dataset_name",
                            assets["train"], *ENGINE_RUN, "--total_episodes", 100 * PER_UPDATE, "--output_dir", out,
                            "--engine_urls", url, "--engine_port", free_port(), "--sync_bucket_mb", 0,
                            "--weight_sync_timeout", 5,
                            *(["--use_peft", "--lora_r", 4, "--lora_sync", "adapters"] if lora else []))
    finally:
        server.kill()
    line = assert_stopped_at_update_2(result, out, f"vLLM server {url}")
    print(line)
    if fault.startswith("stall"):
        assert "did not answer within --weight_sync_timeout 5 s" in line, line
    if lora:  # the first adapter loaded and named by the first batch's requests; the second's load never answered;
        # both unloaded as the run stopped, their files removed
        assert f"vLLM server {url} (/v1/load_lora_adapter) did not answer" in line, line
        requests = logged_requests(log)
        loads = [r["body"]["lora_name"] for r in requests if r["path"] == "/v1/load_lora_adapter"]
        assert len(loads) == 2 and loads[0].endswith("-v0") and loads[1].endswith("-v1"), loads
        assert {r["body"]["model"] for r in requests if r["path"] == "/v1/completions"} == {loads[0]}
        assert [r["body"]["lora_name"] for r in requests if r["path"] == "/v1/unload_lora_adapter"] == loads
        assert not (out / mn.LORA_SYNC_FOLDER).exists()


@pytest.mark.parametrize("fault", ["fail_init", "no_join"])
def test_a_weight_group_that_fails_or_never_forms_stops_start_up_naming_the_server(url_transport, fault):
    """A server whose /init_weight_transfer_engine fails (its workers cannot join): the wait for the group stops at
    once with the server's account, long before --weight_sync_timeout; one that answers but never joins the group:
    at --weight_sync_timeout, naming it and the group's address. (An EngineError at start-up is the run's one line,
    exit 4, as test_a_vllm_server_without_development_mode_is_refused_with_the_fix shows.)"""
    args, url, _, _ = url_transport
    mn.http_json(f"{url}/standin/set", {"fail_init": True} if fault == "fail_init" else {"join": False}, 60)
    args = replace(args, engine_port=free_port(), weight_sync_timeout=290 if fault == "fail_init" else 3)
    try:
        servers = mn.VLLMServers(args, plumbing.Dist(0, 0, 1, torch.device("cpu")))
        with pytest.raises(mn.EngineError) as failed:
            servers.connect("gloo", 2**20)
    finally:
        mn.http_json(f"{url}/standin/set", {"fail_init": False, "join": True}, 60)
    print(failed.value)
    if fault == "fail_init":
        assert str(failed.value).startswith(f"vLLM server {url}/init_weight_transfer_engine answered 500: ")
        assert "cannot join the weight group" in str(failed.value)
    else:
        assert str(failed.value) == (f"vLLM server {url} (joining the weight group at 127.0.0.1:{args.engine_port + 1}"
                                     ") did not answer within --weight_sync_timeout 3 s")


def test_a_served_engine_whose_weight_transfer_init_fails_stops_start_up_in_one_line(assets, tmp_path, monkeypatch):
    """An engine started by hand (tests/faulty_engines.py) whose init_weight_transfer_engine raises: the trainer,
    waiting for the weight group, stops with the engine's own account, not at --weight_sync_timeout."""
    port, log = free_port(), tmp_path / "engine.log"
    engine = subprocess.Popen([sys.executable, str(REPO / "tests" / "faulty_engines.py"), "serve", "--trainer_address",
                               f"127.0.0.1:{port}", "--engine_index", "0", "--model", str(assets["policy"])],
                              stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=REPO,
                              env=script_env({mn.SECRET_VARIABLE: SECRET, "INIT_FAILS": "1"}))
    monkeypatch.setenv(mn.SECRET_VARIABLE, SECRET)
    try:
        result = run_script("rloo_multinode.py", "--model_name_or_path", assets["policy"], "--dataset_name",
                            assets["train"], *ENGINE_RUN, "--total_episodes", PER_UPDATE, "--output_dir",
                            tmp_path / "out", "--engine", "hf", "--engine_port", port, "--no-launch_engines",
                            "--weight_sync_timeout", 290)
    finally:
        engine.kill()
    assert result.returncode == 4 and "Traceback" not in result.stderr, result.stderr[-3000:]
    line = result.stderr.strip().splitlines()[-1]
    assert re.match(r"rloo_multinode.py: error: engine 0 \(.*, pid \d+\) failed: RuntimeError: the test's failure",
                    line), line


def test_a_weight_sync_timeout_at_or_above_the_ddp_timeout_is_refused_before_anything_loads():
    for timeout in (0.0, -1.0, float("nan"), float("inf"), 600.0, 601.0):
        with pytest.raises(plumbing.ConfigError, match=r"weight_sync_timeout = .* must be a number of seconds > 0 "
                                                       r"and below --ddp_timeout \(600; raise it too\), or None"):
            mn.validate_engine_args(mn.Args(model_name_or_path="m", engine="hf", weight_sync_timeout=timeout), 1)
    mn.validate_engine_args(mn.Args(model_name_or_path="m", engine="hf", weight_sync_timeout=599.0), 1)
    assert mn.sync_seconds(mn.Args(model_name_or_path="m", ddp_timeout=1800)) == 900  # the default: half of it


# ----- what an engine answers: every answer checked at the one boundary (mn.answered) before anything uses it
ASKED = dict(rloo_k=2, response_length=6, max_prompt_length=16)  # 3 prompts: 6 choices of 6 tokens at most
BAD_ANSWER_LINES = {  # what the run says each engine sent (after "<engine> sent ")
    "one_choice_fewer": "5 choices for the 6 completions asked",
    "one_choice_more": "7 choices for the 6 completions asked",
    "no_choices": "an answer without a list of choices: ",
    "choices_not_a_list": "an answer without a list of choices: ",
    "choice_not_an_object": "a choice that is no JSON object: [0]",
    "duplicate_index": "the choice index 0 twice",
    "index_out_of_range": "a choice with the index 1000000, not one of the 6 asked (0 to 5)",
    "negative_index": "a choice with the index -1, not one of the 6 asked (0 to 5)",
    "index_as_text": "a choice with the index '0', not one of the 6 asked (0 to 5)",
    "index_as_float": "a choice with the index 0.0, not one of the 6 asked (0 to 5)",
    "index_as_bool": "a choice with the index False, not one of the 6 asked (0 to 5)",
    "no_index": "a choice with the index None, not one of the 6 asked (0 to 5)",
    "float_token_id": "the token id 2.0 in choice 0, not an integer",
    "token_id_as_text": "the token id '2' in choice 0, not an integer",
    "token_id_as_bool": "the token id True in choice 0, not an integer",
    "null_token_id": "the token id None in choice 0, not an integer",
    "token_id_as_list": "the token id [2] in choice 0, not an integer",
    "token_id_of_a_million": "the token id 1000000 in choice 0, outside the policy's vocabulary (0 to 14)",
    "negative_token_id": "the token id -5 in choice 0, outside the policy's vocabulary (0 to 14)",
    "token_id_beyond_int64": f"the token id {2**70} in choice 0, outside the policy's vocabulary (0 to 14)",
    "token_id_of_the_vocabulary_size": "the token id 15 in choice 0, outside the policy's vocabulary (0 to 14)",
    "token_ids_as_text": "choice 0 without a list of token ids: 'ab'",
    "more_tokens_than_asked": "64 tokens in choice 0, for at most 6 asked",
    "fewer_tokens_without_the_stop_token": "1 token in choice 0 without the stop token 1 at their end, for 6 asked",
    "no_tokens": "0 tokens in choice 0 without the stop token 1 at their end, for 6 asked",
    "tokens_after_the_stop_token": "tokens after the stop token 1 in choice 0",
    **{case: f"the log-prob {value} for token 0 of choice 0: a sampled token's log-prob is finite and at most 0"
       for case, value in [("nan_logprob", "nan"), ("logprob_of_plus_50", "50.0"), ("tiny_positive_logprob", "1e-30"),
                           ("infinite_logprob", "inf"), ("minus_infinite_logprob", "-inf"),
                           ("logprob_beyond_float32", "-1e+300")]},
    "logprob_as_text": "the log-prob '-0.5' in choice 0, not a number",
    "null_logprob": "the log-prob None in choice 0, not a number",
    "logprob_as_bool": "the log-prob False in choice 0, not a number",
    "one_logprob_fewer": " log-probs for the ",
    "no_logprobs": "choice 0 without a list of log-probs: None",
}
RNG_STATES = {  # a served hf engine's RNG state, which the requesting rank's sampling generator takes
    "rng_state_of_another_size": torch.zeros(10, dtype=torch.uint8),
    "rng_state_of_floats": torch.zeros(5056),
    "rng_state_not_mt19937": torch.full((5056,), 255, dtype=torch.uint8),
    "rng_state_as_text": "ab",
}


def asked_request(args: mn.Args) -> dict:
    """A part of a batch as a rank sends it: 3 prompts of different lengths, k=2."""
    tokenizer = policy_tokenizer()
    queries = torch.tensor([[0, 0, 2, 3, 14], [0, 4, 5, 6, 14], [7, 8, 9, 10, 14]])  # (3, 5) left-padded, ":" last
    assert len(tokenizer) == 15 and tokenizer.convert_ids_to_tokens(14) == ":"
    return {"queries": queries, "query_mask": queries != 0, "k": 2, "stop_token_id": 1, "pad_token_id": 0,
            "rng_state": torch.Generator().manual_seed(0).get_state(),
            **mn.sampling_request(rloo.SamplingSettings.of(args), args)}


def good_answer() -> dict:
    """What an engine answers to asked_request: 6 choices, each 6 tokens or fewer ending with the stop token 1."""
    return {"choices": [mn.choice(i, [2, 3, 1] if i % 2 else [4, 5, 6, 7, 8, 9], [-0.5] * (3 if i % 2 else 6))
                        for i in range(6)], "rng_state": torch.Generator().manual_seed(1).get_state()}


@pytest.fixture(scope="module")
def served_transport(tmp_path_factory):
    """Rank 0's end of the control store, and a malicious engine's: it signs whatever it sends with the run's
    secret, as an engine does."""
    args = mn.Args(model_name_or_path="m", engine="hf", engine_port=free_port(), engine_timeout=60,
                   output_dir=str(tmp_path_factory.mktemp("served")), **ASKED)
    dist_info = plumbing.Dist(0, 0, 1, torch.device("cpu"))
    engines = mn.ServedEngines(args, dist_info, mn.control_store(args, dist_info, torch.device("cpu"),
                                                                 mn.secret_key(SECRET)), {})
    engine = mn.ControlStore(torch.distributed.TCPStore("127.0.0.1", args.engine_port), mn.secret_key(SECRET))
    return args, engines, engine, iter(range(10**6))


def served_answer(served_transport, answer: dict) -> dict:
    """`answer` sent by a served engine through the control store, as the trainer receives it."""
    args, engines, engine, batches = served_transport
    batch = next(batches)
    engine.set("engine/0/beat", {"beat": batch + 1})  # alive
    engines.send(batch, [asked_request(args)])
    engine.set(f"out/{batch}/0/0", answer)
    return engines.receive(batch)[0]


@pytest.fixture(scope="module")
def url_transport(assets, tmp_path_factory):
    """A stand-in `vllm serve`, attached by URL, made to answer wrongly as each case asks (/standin/set)."""
    server, url, _ = vllm_standin(tmp_path_factory.mktemp("standin"), "a", assets["policy"])
    args = mn.Args(model_name_or_path=str(assets["policy"]), engine_urls=url, engine_timeout=300, **ASKED)
    try:
        yield args, url, mn.VLLMServers(args, plumbing.Dist(0, 0, 1, torch.device("cpu"))), iter(range(10**6))
    finally:
        server.kill()


def url_answer(url_transport, case: Optional[str]) -> dict:
    """The stand-in's answer to asked_request, made wrong as `case` makes it (None: as it sampled)."""
    args, url, servers, batches = url_transport
    mn.http_json(f"{url}/standin/set", {"bad_answer": case}, 60)
    batch = next(batches)
    servers.send(batch, [asked_request(args)])
    return servers.receive(batch)[0]


def checked(answer: dict, engine: str) -> mn.Answer:
    return mn.answered(answer, mn.Asked(engine, 6, 6), 15, 1, 0, torch.Generator())


@pytest.mark.parametrize("transport", ["served", "url"])
@pytest.mark.parametrize("case", [None, *BAD_ANSWER_LINES])
def test_an_engines_answer_is_checked_before_use_and_a_bad_one_named_in_one_line(request, transport, case):
    """Each way an answer can be other than what was asked, sent by a served engine through the control store and by
    a `vllm serve` over HTTP (JSON: NaN, infinities and big integers survive it): refused naming the engine and what
    it sent. (None: a good answer, taken as it is.)"""
    if transport == "served":
        answer = good_answer()
        if case is not None:
            BAD_ANSWERS[case](answer, 1, 15)
        answer, engine = served_answer(request.getfixturevalue("served_transport"), answer), "engine 0"
    else:
        url_transport = request.getfixturevalue("url_transport")
        answer, engine = url_answer(url_transport, case), f"vLLM server {url_transport[1]}"
    if case is None:
        taken = checked(answer, engine)
        assert taken.responses.shape == taken.sampler_logprobs.shape == (6, 6)
        assert (taken.sampler_logprobs <= 0).all() and (taken.responses < 15).all()
        return
    with pytest.raises(mn.EngineError) as refused:
        checked(answer, engine)
    assert str(refused.value).startswith(f"{engine} sent ") and BAD_ANSWER_LINES[case] in str(refused.value), \
        str(refused.value)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("case", RNG_STATES)
def test_a_served_engines_rng_state_is_checked_before_the_generator_takes_it(served_transport, case):
    answer = served_answer(served_transport, good_answer() | {"rng_state": RNG_STATES[case]})
    with pytest.raises(mn.EngineError, match="^engine 0 sent a sampling RNG state the generator does not take"):
        checked(answer, "engine 0")
    assert mn.answered(answer, mn.Asked("engine 0", 6, 6), 15, 1, 0).rng_state is None  # used only with one engine


@pytest.mark.parametrize("world_size", [10**9, 0, -1, "2", 2.0, True, None, [2]])
def test_a_world_size_a_server_reports_is_checked_before_the_weight_group_is_sized(url_transport, world_size):
    _, url, servers, _ = url_transport
    mn.http_json(f"{url}/standin/set", {"world_size_answer": json.dumps(world_size)}, 60)
    try:
        with pytest.raises(mn.EngineError, match=re.escape(f"vLLM server {url} sent the world size {world_size!r}, "
                                                           f"not a number of workers from 1 to {mn.MAX_WORKERS}")):
            servers.workers(url)
    finally:
        mn.http_json(f"{url}/standin/set", {"world_size_answer": None}, 60)
    assert servers.workers(url) == 1


@pytest.mark.parametrize("transport", ["served", "url"])
def test_a_bad_answer_mid_run_stops_every_rank_with_a_checkpoint_naming_the_engine(assets, tmp_path, transport,
                                                                                   monkeypatch):
    """The boundary in a run: the second batch's answer is bad (a NaN log-prob from a `vllm serve`; a duplicate
    choice index from a served engine started by hand): update 1 is saved, the run stops in one line, exit 4."""
    out = tmp_path / "out"
    common = ["--model_name_or_path", assets["policy"], "--dataset_name", assets["train"], *ENGINE_RUN,
              "--total_episodes", 100 * PER_UPDATE, "--output_dir", out, "--engine_port", free_port()]
    if transport == "url":
        server, url, _ = vllm_standin(tmp_path, "a", assets["policy"], "--bad_answer", "nan_logprob", "--bad_from", 2)
        names, sent = f"vLLM server {url}", BAD_ANSWER_LINES["nan_logprob"]
        flags = ["--engine_urls", url]
    else:
        port = common[-1]
        server = subprocess.Popen([sys.executable, str(REPO / "tests" / "faulty_engines.py"), "serve",
                                   "--trainer_address", f"127.0.0.1:{port}", "--engine_index", "0", "--model",
                                   str(assets["policy"])], stdout=open(tmp_path / "engine.log", "w"),
                                  stderr=subprocess.STDOUT, cwd=REPO, env=script_env({
                                      mn.SECRET_VARIABLE: SECRET, "BAD_ANSWER": "duplicate_index", "BAD_FROM": "2"}))
        monkeypatch.setenv(mn.SECRET_VARIABLE, SECRET)
        names, sent = "engine 0", BAD_ANSWER_LINES["duplicate_index"]
        flags = ["--engine", "hf", "--no-launch_engines"]
    try:
        result = run_script("rloo_multinode.py", *common, *flags)
    finally:
        server.kill()
    line = assert_stopped_at_update_2(result, out, f"{names} sent {sent}")
    assert line.endswith("; continue with the same command and --resume once the engines are healthy"), line
