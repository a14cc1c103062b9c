"""--use_peft: LoRA adapters on a frozen base, the reference the base itself with the adapters off."""

import json
import os
import re
import signal
import subprocess
from dataclasses import replace
from types import SimpleNamespace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import plumbing
from plumbing.checkpoints import save_policy
from plumbing.models import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from plumbing.outputdir import MERGED, latest_checkpoint
from plumbing.sharing import why_not_shared
import rloo
from conftest import REPO, cpu_env, policy_tokenizer, read_metrics, run_rloo, script_env, tiny_policy
from helpers import comparable, interrupt_after_first_update, python, tiny_architecture

LORA = ("--use_peft", "--lora_r", "4", "--lora_alpha", "8")
RUN = ("--reward_fn", "reward_fns:count_a", "--rloo_k", "4", "--per_device_train_batch_size", "16",
       "--response_length", "6", "--temperature", "1.0", "--max_prompt_length", "16",
       "--local_rollout_forward_batch_size", "32", "--learning_rate", "1e-2", "--num_sample_generations", "0")


def lora_args(assets, **changes) -> rloo.Args:
    return rloo.Args(**{"model_name_or_path": str(assets["policy"]), "reward_fn": ("reward_fns:count_a",),
                        "use_peft": True, "lora_r": 4, "lora_alpha": 8, **changes})


def some_completions(vocab_size: int) -> rloo.Completions:
    generator = torch.Generator().manual_seed(0)
    queries = torch.randint(2, vocab_size, (2, 5), generator=generator)  # (g, Tq)
    query_mask = torch.ones_like(queries, dtype=torch.bool)
    query_mask[1, :2] = False  # a left-padded prompt
    responses = torch.randint(2, vocab_size, (4, 3), generator=generator)  # (k*g, Tr), k = 2
    return rloo.Completions(queries, query_mask, responses, torch.ones_like(responses, dtype=torch.bool))


def test_only_adapters_train_and_the_reference_is_the_untouched_base(assets):
    args = lora_args(assets, lora_modules_to_save=("lm_head",))
    policy, ref, tokenizer, _ = rloo.load_policy(args, torch.device("cpu"))
    base = AutoModelForCausalLM.from_pretrained(assets["policy"], dtype=torch.float32)
    initial = {name: p.detach().clone() for name, p in policy.named_parameters()}
    trained = [name for name, p in policy.named_parameters() if p.requires_grad]
    assert trained and all(".lora_" in n or ".modules_to_save." in n for n in trained)
    assert list(ref.state_dict()) == [] and not list(ref.children())  # no second copy: the policy's own weights
    assert ref.config is policy.config and plumbing.accepts_logits_to_keep(ref) and why_not_shared(ref) is None
    assert plumbing.attention_windows(ref) == plumbing.attention_windows(policy)

    c = some_completions(len(tokenizer))
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-2)
    policy.train()
    for _ in range(3):
        logprobs, _ = rloo.forward_logprobs(policy, c, 1.0, share_prompt=True)  # (k*g, Tr)
        optimizer.zero_grad()
        (-logprobs.sum()).backward()
        optimizer.step()
    policy.eval()
    changed = {name for name, p in policy.named_parameters() if not torch.equal(p, initial[name])}
    assert changed == set(trained)  # every adapter (and lm_head's trained copy) moved, nothing else
    base_weights = base.state_dict()
    for name, p in policy.named_parameters():
        if name not in trained:  # the base, wrapped by peft: same tensors, bit-identical to the saved model
            own = name.replace(".base_layer", "").replace(".original_module", "")
            assert torch.equal(p, base_weights[own]), name

    with torch.no_grad():
        for share in (True, False):
            reference = rloo.forward_logprobs(ref, c, 0.7, share)[0]
            assert torch.equal(reference, rloo.forward_logprobs(base, c, 0.7, share)[0])  # the base's, exactly
            assert not torch.allclose(reference, rloo.forward_logprobs(policy, c, 0.7, share)[0])  # adapters on again
    assert [n for n, p in policy.named_parameters() if p.requires_grad] == trained  # still the ones to train
    with plumbing.visiting(ref, torch.device("cpu")):  # finds the policy's weights where they are
        pass


def test_the_bf16_sampling_copy_holds_the_adapters_and_follows_them(assets):
    """--bf16_generation with LoRA: the bf16 copy is of the policy with its adapters, refreshed by copy_weights."""
    torch.manual_seed(0)  # the adapters' initial and "trained" weights: the same whatever ran before in the process
    policy, ref, _, _ = rloo.load_policy(lora_args(assets, bf16=True, bf16_generation=True), torch.device("cpu"))
    sampler = plumbing.bf16_copy(policy)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if ".lora_B." in name:
                p.normal_()  # as if trained: the adapters change the function
    plumbing.copy_weights(policy, sampler)
    ids = torch.tensor([[3, 4, 5, 14, 6]])
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            autocast = policy(input_ids=ids).logits.float()
        assert (sampler(input_ids=ids).logits.float() - autocast).abs().max() < 0.02  # bf16 rounding only
        assert (ref(input_ids=ids).logits.float() - autocast).abs().max() > 0.1  # the adapters count


def test_a_lora_run_resumes_bit_identical_and_both_saved_forms_load(assets, tmp_path):
    """With evaluation, gradient checkpointing, prompt sharing, two PPO epochs of two minibatches, and a trained
    lm_head copy: a run stopped by a signal after its first update and resumed ends as the uninterrupted one."""
    common = ["--model_name_or_path", os.path.relpath(assets["policy"], REPO),  # typed relative to the run's folder
              "--dataset_name", assets["train"], "--dataset_test_split", assets["test"], "--total_episodes", 32 * 4,
              *RUN, *LORA, "--lora_modules_to_save", "lm_head", "--num_ppo_epochs", "2", "--num_mini_batches", "2", "--num_evals", "2", "--gradient_checkpointing",
              "--merge_lora"]
    full, interrupted = tmp_path / "full", tmp_path / "interrupted"
    result = run_rloo(*common, "--output_dir", full)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "LoRA: " in result.stdout and "trainable parameters of" in result.stdout
    returncode, stdout, stderr = interrupt_after_first_update([*common, "--output_dir", interrupted], signal.SIGINT)
    # a fast run may be inside a later update, or in its reward function (stopped at once, its start kept)
    assert returncode == 0 and "SIGINT received" in stdout, stdout[-2000:] + stderr[-3000:]
    stopped_at = latest_checkpoint(str(interrupted))
    assert stopped_at.name != "step_4"  # stopped before the end
    assert sorted(p.name for p in stopped_at.glob("*.safetensors")) == [ADAPTER_WEIGHTS]  # the adapter only
    result = run_rloo(*common, "--output_dir", interrupted, "--resume")
    assert result.returncode == 0 and f"resuming from {stopped_at}" in result.stdout, result.stderr[-3000:]
    metrics = read_metrics(full)
    assert comparable(read_metrics(interrupted)) == comparable(metrics)
    train = [m for m in metrics if "objective/kl" in m]  # the update lines; eval lines from update 0 on
    assert metrics[0]["update"] == 0 and "eval/scores" in metrics[0] and train[0]["objective/kl"] == 0.0  # lora_B: 0
    a, b = load_file(full / ADAPTER_WEIGHTS), load_file(interrupted / ADAPTER_WEIGHTS)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # bit-identical

    # the adapter in peft's format on the base, and the merged model with transformers alone, compute the same
    assert json.loads((full / ADAPTER_CONFIG).read_text())["r"] == 4
    # its base is recorded absolute: the adapter alone loads from another folder (peft reads the base from there)
    assert json.loads((full / ADAPTER_CONFIG).read_text())["base_model_name_or_path"] == str(
        Path(assets["policy"]).resolve())
    loaded = subprocess.run([python(), "-c", "import sys; from peft import AutoPeftModelForCausalLM; "
                             "AutoPeftModelForCausalLM.from_pretrained(sys.argv[1])", str(full)], cwd=tmp_path,
                            capture_output=True, text=True, env=cpu_env())
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(assets["policy"]), full).eval()
    merged = AutoModelForCausalLM.from_pretrained(full / MERGED).eval()
    base = AutoModelForCausalLM.from_pretrained(assets["policy"]).eval()
    ids = torch.tensor([[3, 4, 5, 14, 6, 7]])
    with torch.no_grad():
        logits = adapted(input_ids=ids).logits
        torch.testing.assert_close(merged(input_ids=ids).logits, logits, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(base(input_ids=ids).logits, logits)  # it learned something
    assert (full / MERGED / "tokenizer.json").is_file()


def test_torchrun_lora_on_policy_with_bf16(assets, tmp_path):
    """Two DDP ranks, bf16 autocast, sampling from a bf16 copy, the on-policy fast path (one epoch, one minibatch):
    the run ends and its adapter (of every linear layer) loads."""
    out = tmp_path / "out"
    result = run_rloo("--model_name_or_path", assets["policy"], "--dataset_name", assets["train"], "--output_dir",
                      out, "--total_episodes", 2 * 16 * 3, *RUN, *LORA, "--num_ppo_epochs", "1", "--bf16",
                      "--bf16_generation", "--lora_target_modules", "all-linear", nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = read_metrics(out)
    assert len(metrics) == 3 and abs(metrics[0]["objective/kl"]) < 1e-6
    config = json.loads((out / ADAPTER_CONFIG).read_text())
    adapted = {name.split(".")[-1] for name in config["target_modules"]}  # all-linear: every one but the head
    assert adapted == {"query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"}
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(assets["policy"]), out)


def test_an_fsdp_lora_run_saves_the_adapter_whole_and_resumes_bit_identical(assets, tmp_path):
    """Two ranks with --fsdp and --offload, the adapters and lm_head's trained copy (beside the frozen head, in the
    root's unit), gradients summed over two micro-steps, gradient checkpointing, evaluation: the adapter saved is
    whole (gathered from both ranks' shards; test_distributed.py compares it with the unsharded one's) and loads in
    plain peft, merged as the adapter computes; a run stopped by a signal after its first update and resumed ends bit
    for bit as the uninterrupted one."""
    common = ["--model_name_or_path", assets["policy"], "--dataset_name", assets["train"], "--dataset_test_split",
              assets["test"], "--total_episodes", 2 * 32 * 3, *RUN, *LORA, "--lora_modules_to_save", "lm_head",
              "--gradient_accumulation_steps", "2", "--num_evals", "2", "--gradient_checkpointing", "--merge_lora",
              "--fsdp", "--offload"]
    full, interrupted = tmp_path / "full", tmp_path / "interrupted"
    result = run_rloo(*common, "--output_dir", full, nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    base = AutoModelForCausalLM.from_pretrained(assets["policy"])
    adapted = PeftModel.from_pretrained(base, full).eval()  # a rank's shard of a tensor would not fit its layer
    merged = AutoModelForCausalLM.from_pretrained(full / MERGED).eval()
    with torch.no_grad():
        ids = torch.tensor([[3, 4, 5, 14, 6, 7]])
        torch.testing.assert_close(merged(input_ids=ids).logits, adapted(input_ids=ids).logits, atol=1e-5, rtol=1e-5)

    _, stdout, stderr = interrupt_after_first_update([*common, "--output_dir", interrupted], signal.SIGUSR1, nproc=2)
    stopped_at = latest_checkpoint(str(interrupted))
    assert stopped_at is not None and stopped_at.name != "step_3", stdout[-2000:] + stderr[-3000:]
    assert sorted(p.name for p in stopped_at.glob("*.safetensors")) == [ADAPTER_WEIGHTS]  # the adapter only
    assert (stopped_at / plumbing.checkpoints.OPTIMIZER_SHARDS).is_dir()  # AdamW's state: each rank its shard
    result = run_rloo(*common, "--output_dir", interrupted, "--resume", nproc=2)
    assert result.returncode == 0 and f"resuming from {stopped_at}" in result.stdout, result.stderr[-3000:]
    assert comparable(read_metrics(interrupted)) == comparable(read_metrics(full))
    a, b = load_file(full / ADAPTER_WEIGHTS), load_file(interrupted / ADAPTER_WEIGHTS)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # bit-identical


def test_the_demo_task_learns_with_lora(tmp_path, synthetic_sft):
    """The demo's synthetic task, its true score as the reward: a LoRA run raises the true score of its samples."""
    from benchmark import synthetic_task

    tokenizer, sft, policy_dir = synthetic_sft["tokenizer"], synthetic_sft["policy"], synthetic_sft["path"]
    synthetic_task.write_prompts_jsonl(tmp_path / "train.jsonl", 512, seed=0)
    prompts = [row["prompt"] for row in synthetic_task.make_prompt_rows(64, seed=5)]
    out = tmp_path / "out"
    result = run_rloo("--model_name_or_path", policy_dir, "--dataset_name", tmp_path / "train.jsonl",
                      "--reward_fn", "benchmark.synthetic_task:true_reward", "--output_dir", out, "--use_peft",
                      "--lora_target_modules", "all-linear", "--rloo_k", "4", "--per_device_train_batch_size", "64",
                      "--num_ppo_epochs", "1", "--learning_rate", "3e-3", "--response_length", "8",
                      "--max_prompt_length", "16", "--temperature", "1.0", "--total_episodes", str(64 * 12),
                      "--num_sample_generations", "0", "--merge_lora", env={"PYTHONPATH": f"{REPO}:{REPO / 'tests'}"})
    assert result.returncode == 0, result.stderr[-3000:]
    before = synthetic_task.mean_true_score(sft, tokenizer, prompts)
    after = synthetic_task.mean_true_score(AutoModelForCausalLM.from_pretrained(out / MERGED), tokenizer, prompts)
    assert after > before + 0.05, (before, after)


@pytest.mark.parametrize("flags,message", [
    ({"lora_sync": "adapters", "use_dora": True}, "vLLM 0.32 cannot load an adapter with --use_dora"),
    ({"lora_sync": "adapters", "lora_modules_to_save": ("lm_head",)}, "cannot load an adapter with --lora_modules_to"),
    ({"lora_sync": "adapters", "lora_r": 600}, "vLLM serves LoRA ranks up to 512, not --lora_r 600"),
    ({"lora_sync": "adapters", "vllm_mode": "colocate", "lora_target_parameters": ("mlp.experts.gate_up_proj",),
      "lora_dropout": 0.0}, "cannot load an adapter with --lora_target_parameters"),
    ({"load_in_4bit": True}, "--load_in_4bit with rloo_multinode.py is not supported yet"),
    ({"use_peft": False, "lora_sync": "adapters"}, "--lora_sync adapters says how LoRA adapters reach the engines"),
], ids=["dora", "modules_to_save", "rank", "target_parameters_colocated", "qlora", "without_use_peft"])
def test_lora_with_engines_that_cannot_take_it_is_refused_in_one_line_before_models_load(assets, tmp_path, flags,
                                                                                         message):
    """What vLLM cannot load as an adapter (--lora_sync adapters: DoRA, trained copies of modules, adapted
    parameters, ranks above 512) is refused with the fix (--lora_sync merged sends it merged); hf engines hold the
    trainer's own peft modules and take every adapter."""
    import rloo_multinode

    args = lora_args(assets, dataset_name=str(assets["train"]), output_dir=str(tmp_path / "out"))
    with pytest.raises(plumbing.ConfigError, match=re.escape(message)):
        rloo_multinode.main(rloo_multinode.Args(**(vars(args) | flags)))
    assert not (tmp_path / "out").exists()
    if "use_dora" in flags or "lora_modules_to_save" in flags:  # the hf engine takes them
        rloo_multinode.validate_lora_sync(rloo_multinode.Args(**(vars(args) | flags | {"engine": "hf"})))


def test_plan_memory_counts_the_adapters_state_and_no_reference(assets):
    import plan_memory

    args = plan_memory.PlanArgs(model_name_or_path=str(assets["policy"]), use_peft=True, lora_r=4, lora_alpha=8,
                                world_size=2)
    shape = plan_memory.model_shape(str(assets["policy"]), False, False, args)
    policy, ref, _, _ = rloo.load_policy(lora_args(assets), torch.device("cpu"))
    assert shape.parameters == sum(p.numel() for p in policy.parameters())  # the base and its adapters
    assert shape.trainable == sum(p.numel() for p in policy.parameters() if p.requires_grad)
    resident = plan_memory.plan(args, shape, None)["resident"]
    assert resident["AdamW m and v (fp32)"] == 8 * shape.trainable and resident["reference policy"] == 0.0
    assert resident["DDP gradient buckets"] == 4 * shape.trainable
    full = plan_memory.plan(replace(args, use_peft=False), plan_memory.model_shape(args.model_name_or_path, False,
                                                                                    False), None)["resident"]
    assert full["reference policy"] == 4 * plan_memory.model_shape(args.model_name_or_path, False, False).parameters
    sharded = plan_memory.plan(replace(args, fsdp=True), shape, None)["resident"]  # the base sharded, the adapters'
    assert sharded["policy weights (fp32)"] == 4 * shape.parameters / 2  # gradients held whole between micro-steps
    assert sharded["policy gradients (fp32)"] == 4 * shape.trainable and sharded["DDP gradient buckets"] == 0.0
    assert sharded["AdamW m and v (fp32)"] == 8 * shape.trainable / 2
    # pythia-6.9b with adapters of rank 16 on its attention: its fp32 base alone is 27 GB, over a 24 GiB GPU
    pythia_6p9b = plan_memory.Shape(parameters=6_865_690_624, hidden=4096, intermediate=16384, layers=32,
                                    vocab=50304, trainable=32 * 16 * (4096 + 3 * 4096))
    planned = replace(args, world_size=8, gpu_gib=24, bf16=True, per_device_train_batch_size=8,
                      local_rollout_forward_batch_size=16, response_length=53)
    assert plan_memory.peak_bytes(plan_memory.plan(planned, pythia_6p9b, None)) > 24 * plan_memory.GIB
    assert any(label.startswith("--fsdp") for label, _ in plan_memory.options_that_fit(planned, pythia_6p9b, None))


def test_plan_memory_refuses_a_4bit_base_it_would_count_in_fp32(assets):
    import plan_memory

    args = plan_memory.PlanArgs(model_name_or_path=str(assets["policy"]), reward_fn=("m:f",), use_peft=True,
                                load_in_4bit=True)
    with pytest.raises(plumbing.ConfigError, match="plan without the flag for an upper bound"):
        plan_memory.validate_plan_args(args)


def test_an_adapter_that_does_not_match_the_flags_is_refused_and_a_matching_one_loads_exactly(assets, tmp_path):
    policy, _, tokenizer, _ = rloo.load_policy(lora_args(assets), torch.device("cpu"))
    with torch.no_grad():
        for p in policy.parameters():
            if p.requires_grad:
                p.normal_()
    save_policy(policy, tokenizer, tmp_path, 0)
    loaded, _, _, _ = rloo.load_policy(lora_args(assets), torch.device("cpu"), checkpoint=tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(policy.state_dict().values(), loaded.state_dict().values()))
    with pytest.raises(plumbing.ConfigError, match="cannot resume: the adapter in .* does not match --lora_"):
        rloo.load_policy(lora_args(assets, lora_r=8), torch.device("cpu"), checkpoint=tmp_path)


# ---------------------------------------------------------------- QLoRA: --load_in_4bit, where bitsandbytes is installed
def bitsandbytes():
    """bitsandbytes, or the test skipped where it is not installed (a failure under REQUIRE_BITSANDBYTES=1, as in
    make test-qlora, which installs it)."""
    if os.environ.get("REQUIRE_BITSANDBYTES") == "1":
        import bitsandbytes as bnb

        return bnb
    return pytest.importorskip("bitsandbytes")


def with_bitsandbytes() -> dict:
    """A run's environment that finds bitsandbytes where this process found it (make test-qlora's PYTHONPATH)."""
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "tests"), os.environ.get("PYTHONPATH")]))}


def quantized_base(assets, **config):
    """The saved tiny policy quantized by transformers alone, as the 4-bit base the adapters must see."""
    from transformers import BitsAndBytesConfig

    return plumbing.load_causal_lm(str(assets["policy"]), torch.float32, False, quantization_config=BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32, **{"bnb_4bit_quant_type": "nf4", **config}))


@pytest.mark.parametrize("quant_type,nested", [("nf4", False), ("fp4", True)])
def test_qlora_adapters_train_on_the_4bit_base_which_is_the_reference(assets, quant_type, nested):
    bnb = bitsandbytes()
    args = lora_args(assets, load_in_4bit=True, bnb_4bit_quant_type=quant_type, use_bnb_nested_quant=nested)
    plumbing.validate_args(args)
    policy, ref, tokenizer, _ = rloo.load_policy(args, torch.device("cpu"))
    layers = [m for m in policy.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert layers and all(m.weight.quant_state.quant_type == quant_type for m in layers)
    assert all(m.weight.quant_state.nested == nested for m in layers)
    trained = [name for name, p in policy.named_parameters() if p.requires_grad]
    assert trained and all(".lora_" in n for n in trained)
    assert all(p.dtype == torch.float32 for p in policy.parameters() if p.requires_grad)
    base = quantized_base(assets, bnb_4bit_quant_type=quant_type, bnb_4bit_use_double_quant=nested).eval()
    c = some_completions(len(tokenizer))
    with torch.no_grad():
        for p in policy.parameters():
            if p.requires_grad:
                p.normal_()  # as if trained: the adapters change the function
        for share in (True, False):  # the reference is the 4-bit base itself, with the adapters off
            assert torch.equal(rloo.forward_logprobs(ref, c, 0.7, share)[0],
                               rloo.forward_logprobs(base, c, 0.7, share)[0])
        sampled = rloo.forward_logprobs(policy, c, 0.7, True)[0]  # what the sampler's no-grad forward computes
    trained_logprobs = rloo.forward_logprobs(policy, c, 0.7, True)[0]  # the trainer's, with gradient
    assert torch.equal(sampled, trained_logprobs)  # one 4-bit base for both (no bf16 repacking without gradient)
    assert not torch.allclose(sampled, rloo.forward_logprobs(ref, c, 0.7, True)[0])
    trained_logprobs.sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in policy.parameters() if p.requires_grad)


def test_a_qlora_run_resumes_bit_identical_and_merges_the_4bit_base(assets, tmp_path):
    """A run on a 4-bit base resumed from its checkpoint after update 2 ends as the uninterrupted one (the base is
    quantized again, the adapter read back); prompt sharing passes its start-up check; --merge_lora writes the
    dequantized 4-bit base with the adapter merged, which computes what the adapter on the 4-bit base computes."""
    bitsandbytes()
    common = ["--model_name_or_path", assets["policy"], "--dataset_name", assets["train"], "--total_episodes",
              32 * 4, *RUN, *LORA, "--load_in_4bit", "--use_bnb_nested_quant", "--num_ppo_epochs", "2",
              "--num_mini_batches", "2", "--kl_coef", "0.1", "--merge_lora"]
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    result = run_rloo(*common, "--save_steps", "2", "--output_dir", full, env=with_bitsandbytes())
    assert result.returncode == 0, result.stderr[-3000:]
    assert "prompt sharing is off" not in result.stdout + result.stderr and not result.stderr.strip()
    result = run_rloo(*common, "--output_dir", resumed, "--resume_from", full / "checkpoints" / "step_2",
                      env=with_bitsandbytes())
    assert result.returncode == 0 and "resuming from" in result.stdout, result.stderr[-3000:]
    metrics = read_metrics(full)
    assert comparable(read_metrics(resumed)) == comparable(metrics[2:]) and metrics[-1]["objective/kl"] != 0
    a, b = load_file(full / ADAPTER_WEIGHTS), load_file(resumed / ADAPTER_WEIGHTS)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # bit-identical

    adapted = PeftModel.from_pretrained(quantized_base(assets, bnb_4bit_use_double_quant=True), full).eval()
    merged = AutoModelForCausalLM.from_pretrained(full / MERGED).eval()  # plain transformers, fp32
    assert "quantization_config" not in json.loads((full / MERGED / "config.json").read_text())
    ids = torch.tensor([[3, 4, 5, 14, 6, 7]])
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, adapted(input_ids=ids).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("flags,message", [
    ({"load_in_4bit": True, "use_peft": False}, "a 4-bit model cannot train itself: add --use_peft"),
    ({"bnb_4bit_quant_type": "fp4"}, "--bnb_4bit_quant_type is an option of the 4-bit base: add --load_in_4bit"),
    ({"use_bnb_nested_quant": True}, "--use_bnb_nested_quant is an option of the 4-bit base: add --load_in_4bit"),
    ({"load_in_4bit": True, "bf16": True, "bf16_generation": True}, "drop --bf16_generation"),
])
def test_qlora_flags_that_clash_are_refused(assets, flags, message):
    if flags.get("use_peft", True) and flags.get("load_in_4bit"):
        bitsandbytes()  # else the missing package is what the line says (the next test)
    with pytest.raises(plumbing.ConfigError, match=message):
        plumbing.validate_args(lora_args(assets, **flags))


@pytest.mark.parametrize("flags", [{}, {"use_dora": True}, {"use_rslora": True, "merge_lora": True},
                                   {"bnb_4bit_quant_type": "nf4", "use_bnb_nested_quant": False}])
def test_lora_flags_without_a_4bit_base_pass_the_checks(assets, flags):
    plumbing.validate_args(lora_args(assets, **flags))


def test_load_in_4bit_without_bitsandbytes_is_one_line_naming_the_fix(assets, tmp_path, monkeypatch):
    real = plumbing.flags.importlib.util.find_spec  # the module validate_args checks bitsandbytes with
    monkeypatch.setattr(plumbing.flags.importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes"
                        else real(name, *a))
    with pytest.raises(plumbing.ConfigError, match="bitsandbytes, which is not installed: pip install bitsandbytes"):
        plumbing.validate_args(lora_args(assets, load_in_4bit=True))


def test_bitsandbytes_imports_with_hub_kernels_blocked(tmp_path):
    """bitsandbytes' import on a CPU with AVX512-BF16 runs a kernel fetched from the Hub when the `kernels` package is
    installed. Stand-ins for both record what the import could reach; `kernels` is importable again afterwards."""
    (tmp_path / "kernels.py").write_text("def get_kernel(*args, **kwargs):\n    raise AssertionError('fetched')\n")
    (tmp_path / "bitsandbytes").mkdir()
    (tmp_path / "bitsandbytes" / "__init__.py").write_text(
        "try:\n    import kernels\n    REACHED = 'kernels'\nexcept ImportError:\n    REACHED = 'blocked'\n")
    code = ("import sys, plumbing, rloo\n"
            "try:\n    plumbing.flags.quantization_config(rloo.Args(load_in_4bit=True, use_peft=True))\n"
            "except Exception:\n    pass  # the stand-in is no real bitsandbytes for transformers' config\n"
            "import bitsandbytes, kernels\nprint(bitsandbytes.REACHED, kernels.__name__)\n")
    result = subprocess.run([python(), "-c", code], capture_output=True, text=True, cwd=REPO,
                            env=script_env({"PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"}))
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["blocked", "kernels"]


def test_the_adapters_come_in_eval_mode_so_that_their_dropout_waits_for_training():
    """peft's new modules start in train mode: with --lora_dropout (TRL's 0.05, the default) a resumed policy's
    start-up check of prompt sharing (its adapters not 0) saw dropout's noise, switched sharing off, and the resume
    was not bit-identical (test_a_lora_run_resumes_bit_identical_and_both_saved_forms_load)."""
    policy = tiny_policy(len(policy_tokenizer()))
    plumbing.add_adapters(policy, rloo.Args(use_peft=True, lora_r=4), None)
    assert rloo.Args().lora_dropout > 0 and not any(module.training for module in policy.modules())


def test_the_reference_of_a_sharded_lora_policy_leaves_its_adapters_trainable_when_it_runs_first(tmp_path):
    """--fsdp: the reference (AdaptersOff) switches the adapters off and on, and peft sets requires_grad on whatever
    tensors are registered at the time: the shards before a forward, the gathered tensors after one that keeps its
    units gathered (gathered_for_rollout). Its forward first in a rollout (rloo_multinode.py with vLLM engines and
    --lora_sync adapters: the sampler's log-probs, no policy forward before it) left the shards frozen, and the
    update's loss without a gradient. One rank, in this process."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        policy = tiny_policy(len(policy_tokenizer()))
        plumbing.add_adapters(policy, rloo.Args(use_peft=True, lora_r=4, lora_dropout=0.0), None)
        plumbing.distributed.shard_policy(policy, bf16=False)
        reference, tokens = plumbing.AdaptersOff(policy), torch.arange(8).view(2, 4)
        with plumbing.gathered_for_rollout(policy, "unshard"), torch.no_grad():
            reference(tokens)
            policy(tokens)
        policy(tokens).logits.sum().backward()
        adapters = [p for name, p in policy.named_parameters() if "lora_" in name]
        assert adapters and all(p.requires_grad and p.grad is not None for p in adapters)
    finally:
        dist.destroy_process_group()


def test_all_linear_on_a_state_space_hybrid_is_refused_in_one_line_naming_the_module():
    """peft cannot adapt Mamba's out_proj, which all-linear reaches in Falcon-H1: one line, peft's reason and the
    flag to change (not all-linear again); its attention and in_proj take adapters (tests/ddp_update.py)."""
    with pytest.raises(plumbing.ConfigError, match=r"^--use_peft: .*'out_proj' is incompatible with Mamba-based "
                                                   r"models.* - pass --lora_target_modules \(module names\)$"):
        plumbing.add_adapters(tiny_architecture("falcon_h1"), rloo.Args(use_peft=True, lora_target_modules=(
            "all-linear",)), None)


def test_bnb_4bit_quant_storage_is_the_dtype_the_4bit_weights_are_packed_in(assets):
    """TRL's ModelConfig.bnb_4bit_quant_storage, passed to bitsandbytes as TRL's get_quantization_config does."""
    bnb = bitsandbytes()
    args = lora_args(assets, load_in_4bit=True, bnb_4bit_quant_storage="bfloat16")
    plumbing.validate_args(args)
    assert plumbing.flags.quantization_config(args).bnb_4bit_quant_storage == torch.bfloat16
    policy, _, _, _ = rloo.load_policy(args, torch.device("cpu"))
    layers = [m for m in policy.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert layers and all(m.weight.dtype == torch.bfloat16 for m in layers)


def test_a_change_to_the_base_under_the_adapters_is_refused_at_the_next_save(assets, tmp_path):
    """With --use_peft the reference is the policy's base with the adapters off (AdaptersOff): an edit that changes
    the reference (an EMA of the policy, written as for a reference of its own) changes the base, which no checkpoint
    keeps (it saves the adapters). The next save refuses it in one line; until then, saves go on as usual."""
    args = lora_args(assets, output_dir=str(tmp_path / "out"), dataset_name=str(assets["train"]))
    policy, reference, tokenizer, _ = rloo.load_policy(args, torch.device("cpu"))
    assert isinstance(reference, plumbing.AdaptersOff)
    lock = plumbing.OutputDirLock(args.output_dir)
    try:
        checkpoints = plumbing.Checkpointer(args, SimpleNamespace(rank=0, world_size=1), lock)
        checkpoints.check_continues(4, 16)
        optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad])
        checkpoints.restore(policy=policy, tokenizer=tokenizer, optimizer=optimizer, reference=reference)
        with torch.no_grad():
            next(p for p in policy.parameters() if p.requires_grad).add_(1.0)  # the adapters: saved, as usual
        step = checkpoints.save(1)
        assert "reference" not in torch.load(step / "trainer_state.pt", weights_only=True)
        with torch.no_grad():
            next(p for p in reference.parameters() if not p.requires_grad).mul_(0.5)
        with pytest.raises(plumbing.Fault) as refused:
            checkpoints.save(2)
        assert str(refused.value).startswith("with --use_peft the reference is the policy's base under its adapters, "
                                             "and its weights changed during the run, which no checkpoint keeps")
        assert "\n" not in str(refused.value)
    finally:
        lock.release()
