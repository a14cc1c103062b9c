"""plan_memory.py's arithmetic against what PyTorch's memory tracker measures on tiny GPT-NeoX models (CPU)."""

import subprocess
from dataclasses import replace

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

import plan_memory
import plumbing
import rloo
from conftest import REPO
from helpers import cpu_env, python

ACTIVATION_TOLERANCE = 0.15  # relative, without gradient checkpointing (docs/speed-and-memory.md)


def tiny(tmp_path, hidden=64, layers=4, intermediate=256, vocab=2000):
    config = GPTNeoXConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                           intermediate_size=intermediate, max_position_embeddings=256)
    path = tmp_path / f"h{hidden}_l{layers}_i{intermediate}_v{vocab}"
    config.save_pretrained(path)
    return path, config


def measure_update(config, micro, prompt, response, checkpointing, k=1) -> dict[str, dict[str, int]]:
    """Bytes by kind: at the peak of one forward/backward of `micro` sequences (k completions of each of
    micro / k prompts, prompts shared), and after the AdamW step that follows (tracked apart: at the step's own peak
    the activations are gone)."""
    torch.manual_seed(0)
    model = GPTNeoXForCausalLM(config)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    queries = torch.randint(2, config.vocab_size, (micro // k, prompt))
    responses = torch.randint(2, config.vocab_size, (micro, response))
    named = lambda snapshot: {str(k).split(".")[-1]: v for k, v in next(iter(snapshot.values())).items()}  # noqa: E731
    backward = MemTracker()
    backward.track_external(model)
    with backward:
        c = rloo.Completions(queries, torch.ones_like(queries, dtype=torch.bool), responses,
                             torch.ones_like(responses, dtype=torch.bool))
        logprobs, _ = rloo.forward_logprobs(model, c, 1.0, share_prompt=k > 1, with_entropy=True)
        logprobs.sum().backward()
    step = MemTracker()
    step.track_external(model, optimizer)
    with step:
        optimizer.step()
    return {"peak": named(backward.get_tracker_snapshot("peak")), "now": named(step.get_tracker_snapshot())}


def args_for(path, **overrides) -> plan_memory.PlanArgs:
    return plan_memory.PlanArgs(model_name_or_path=str(path), reward_model_path=str(path), world_size=1,
                                **overrides)


def test_parameter_count_matches_the_real_model(tmp_path):
    path, config = tiny(tmp_path)
    shape = plan_memory.model_shape(str(path), False, False)
    assert shape.parameters == sum(p.numel() for p in GPTNeoXForCausalLM(config).parameters())
    assert (shape.hidden, shape.intermediate, shape.layers, shape.vocab) == (64, 256, 4, 2000)


def test_weights_gradients_and_optimizer_state_exactly(tmp_path):
    path, config = tiny(tmp_path)
    shape = plan_memory.model_shape(str(path), False, False)
    groups = plan_memory.plan(args_for(path, max_prompt_length=20, response_length=10), shape, None)
    measured = measure_update(config, 2, 20, 10, False)["now"]
    assert measured["PARAM"] == groups["resident"]["policy weights (fp32)"]
    assert measured["GRAD"] == groups["resident"]["policy gradients (fp32)"]
    num_tensors = len(list(GPTNeoXForCausalLM(config).parameters()))  # AdamW's step counters, 4 bytes each
    assert measured["OPT"] == groups["resident"]["AdamW m and v (fp32)"] + 4 * num_tensors


@pytest.mark.parametrize("hidden, layers, intermediate, vocab, micro, prompt, response, k", [
    (64, 4, 256, 2000, 4, 40, 20, 2),
    (64, 4, 256, 2000, 8, 80, 20, 4),
    (64, 4, 128, 500, 8, 50, 10, 2),   # intermediate = 2 x hidden: the formula's second term
    (64, 4, 256, 2000, 4, 40, 20, 1),  # unshared: a row per completion
])
def test_activations_without_checkpointing(tmp_path, hidden, layers, intermediate, vocab, micro, prompt, response, k):
    path, config = tiny(tmp_path, hidden, layers, intermediate, vocab)
    shape = plan_memory.model_shape(str(path), False, False)
    groups = plan_memory.plan(args_for(path, per_device_train_batch_size=micro, max_prompt_length=prompt,
                                       response_length=response, rloo_k=max(k, 2), share_prompt=k > 1), shape, None)
    predicted = groups["training"]["activations of a micro-batch"] + \
        groups["training"]["logits and log-softmax of a micro-batch"]
    peak = measure_update(config, micro, prompt, response, False, k)["peak"]
    assert abs(peak["ACT"] + peak["TEMP"] - predicted) <= ACTIVATION_TOLERANCE * predicted


def test_activations_with_checkpointing_are_an_upper_bound(tmp_path):
    path, config = tiny(tmp_path, 128, 8, 512, 2000)
    shape = plan_memory.model_shape(str(path), False, False)
    args = args_for(path, per_device_train_batch_size=4, max_prompt_length=40, response_length=20,
                    gradient_checkpointing=True, share_prompt=False)
    training = sum(plan_memory.plan(args, shape, None)["training"].values())
    peak = measure_update(config, 4, 40, 20, True)["peak"]
    assert peak["ACT"] + peak["TEMP"] <= training <= 2 * (peak["ACT"] + peak["TEMP"])


def test_cli_prints_the_plan_and_the_options_that_fit(tmp_path):
    path, _ = tiny(tmp_path)
    result = subprocess.run([python(), "plan_memory.py", "--model_name_or_path", path, "--reward_model_path",
                             path, "--dataset_name", "unused", "--world_size", "2", "--gpu_gib", "0.02"],
                            capture_output=True, text=True, cwd=REPO, env=cpu_env())
    assert result.returncode == 0, result.stderr
    assert "does NOT fit in 0.02 GiB" in result.stdout and "options that fit:" in result.stdout
    assert "--fsdp" in result.stdout.split("options that fit:")[1]
    result = subprocess.run([python(), "plan_memory.py", "--model_name_or_path", path, "--dataset_name", "x",
                             "--reward_model_path", path, "--rloo_k", "1"], capture_output=True, text=True, cwd=REPO,
                            env=cpu_env())
    assert result.returncode == 2 and "plan_memory.py: error: rloo_k = 1" in result.stderr


def test_offload_leaves_no_resident_policy_state_and_is_the_one_gpu_answer_for_6p9b():
    pythia_6p9b = plan_memory.Shape(parameters=6_857_302_016, hidden=4096, intermediate=16384, layers=32, vocab=50304)
    args = plan_memory.PlanArgs(model_name_or_path="unused", world_size=1, gpu_gib=80, bf16=True,
                                per_device_train_batch_size=8, local_rollout_forward_batch_size=16, response_length=53)
    offloaded = plan_memory.plan(replace(args, fsdp=True, offload=True), pythia_6p9b, pythia_6p9b)
    assert sum(offloaded["resident"].values()) == 0
    assert offloaded["rollout"]["offloaded frozen models, visiting"] == 2 * 2 * pythia_6p9b.parameters  # bf16 ref + RM
    assert plan_memory.peak_bytes(plan_memory.plan(args, pythia_6p9b, pythia_6p9b)) > 80 * plan_memory.GIB
    fitting = [label for label, _ in plan_memory.options_that_fit(args, pythia_6p9b, pythia_6p9b)]
    assert fitting and all("--offload" in label for label in fitting)  # 16 bytes per parameter cannot stay on one GPU
    assert plan_memory.peak_bytes(offloaded) < 80 * plan_memory.GIB


def test_an_entropy_in_the_loss_costs_the_one_logit_buffer_the_plan_adds(tmp_path):
    """--entropy_in_loss: the log-probs' backward keeps one more (N, Tr, V) fp32 buffer, measured on the kernel."""
    n, width, vocab = 4, 8, 4096
    buffer = n * width * vocab * 4

    def peak(entropy_in_loss: bool) -> int:
        logits = torch.randn(n, width, vocab, requires_grad=True)
        targets = torch.randint(vocab, (n, width))
        tracker = MemTracker()
        tracker.track_external(logits)
        with tracker:
            logprobs, entropy = plumbing.SelectiveLogSoftmax.apply(logits, targets, 1.0, True)  # as in training
            (logprobs.sum() + (entropy.sum() if entropy_in_loss else 0)).backward()
        return next(iter(tracker.get_tracker_snapshot("peak").values()))["Total"]

    assert peak(True) - peak(False) == pytest.approx(buffer, rel=0.05)
    path, _ = tiny(tmp_path)
    shape = plan_memory.model_shape(str(path), False, False)
    line = "logits and log-softmax of a micro-batch"
    args = args_for(path, max_prompt_length=20, response_length=width, per_device_train_batch_size=n)
    without, with_entropy = (plan_memory.plan(replace(args, entropy_in_loss=e), shape, None)["training"][line]
                             for e in (False, True))
    assert with_entropy - without == n * width * shape.vocab * 4


@pytest.mark.parametrize("size,value", [("num_hidden_layers", 0), ("num_hidden_layers", -2), ("hidden_size", -64),
                                        ("hidden_size", 0), ("intermediate_size", -5), ("vocab_size", -3),
                                        ("vocab_size", 0), ("num_hidden_layers", 10**12)])
def test_a_config_whose_sizes_make_no_model_is_one_line(tmp_path, size, value):
    """A 0 or a negative size was a ZeroDivisionError or a negative dimension (a traceback), 10^12 layers a build
    on the meta device that never ended: one line naming the size, for the policy and the reward model."""
    import json

    path, config = tiny(tmp_path)
    fields = json.loads((path / "config.json").read_text()) | {size: value}
    (path / "config.json").write_text(json.dumps(fields))
    good, _ = tiny(tmp_path, hidden=32)
    for args in (plan_memory.PlanArgs(model_name_or_path=str(path), reward_fn=("m:f",), world_size=1),
                 plan_memory.PlanArgs(model_name_or_path=str(good), reward_model_path=str(path), world_size=1)):
        with pytest.raises(plumbing.ConfigError, match=f"config has {size} = {value:,}" if value > 10**4 else
                           f"config has {size} = {value}: a model's sizes are whole numbers >= 1"):
            plan_memory.main(args)
