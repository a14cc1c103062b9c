"""The sampler/trainer mismatch: measured (mismatch/* metrics) and corrected (truncated importance sampling)."""

import copy
import dataclasses
import functools
import itertools
import math

import pytest
import torch

import plumbing
import rloo
from conftest import policy_loss_of, policy_tokenizer, read_metrics, run_rloo, tiny_policy

CPU = torch.device("cpu")


def NO_AUTOCAST():
    return torch.autocast("cpu", enabled=False)


def BF16_AUTOCAST():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def hand_made_rollout() -> rloo.Rollout:
    """2 completions of 3 tokens, the second ending after 2; trainer and sampler log-probs chosen by hand."""
    mask = torch.tensor([[True, True, True], [True, True, False]])
    trainer = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.1, 0.0]])
    sampler = torch.tensor([[-1.2, -1.9, -0.5], [-0.3, -0.7, 0.0]])  # differences 0.2, -0.1, 0 | 0, 0.6
    return rloo.Rollout(torch.ones(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.bool),
                        torch.ones(2, 3, dtype=torch.long), mask, trainer, None, sampler_logprobs=sampler)


def test_mismatch_metrics_by_hand():
    rollout = hand_made_rollout()
    ratios = [math.exp(0.2 - 0.1), math.exp(0.6)]  # p_trainer / p_sampler of each completion: 1.105, 1.822
    metrics = plumbing.mismatch_metrics(rollout, 0.2, 0.2)
    assert metrics["mismatch/logprob_diff_mean"] == pytest.approx((0.2 + 0.1 + 0 + 0 + 0.6) / 5)  # 5 valid tokens
    assert metrics["mismatch/logprob_diff_max"] == pytest.approx(0.6)
    assert metrics["mismatch/ratio_mean"] == pytest.approx(sum(ratios) / 2)
    assert metrics["mismatch/ratio_std"] == pytest.approx(abs(ratios[0] - ratios[1]) / math.sqrt(2))
    assert metrics["mismatch/clipfrac"] == 0.5  # 1.822 is outside [0.8, 1.2]
    assert "mismatch/is_weight_mean" not in metrics
    metrics = plumbing.mismatch_metrics(rollout, 0.2, 0.2, 1.5, functools.partial(
        rloo.importance_weights, mode="sequence_truncate", cap=1.5))  # --vllm_importance_sampling_correction's
    assert metrics["mismatch/is_weight_mean"] == pytest.approx((ratios[0] + 1.5) / 2)
    assert metrics["mismatch/is_capped_frac"] == 0.5


def test_importance_weights_by_hand_in_every_mode():
    rollout = hand_made_rollout()
    weights = {mode: rloo.importance_weights(rollout.logprobs, rollout.sampler_logprobs, rollout.response_mask,
                                             mode, cap=1.5)
               for mode in ("sequence_truncate", "sequence_mask", "token_truncate", "token_mask")}
    e = math.exp
    torch.testing.assert_close(weights["sequence_truncate"], torch.tensor([e(0.1), 1.5]))
    torch.testing.assert_close(weights["sequence_mask"], torch.tensor([e(0.1), 0.0]))
    torch.testing.assert_close(weights["token_truncate"], torch.tensor([[e(0.2), e(-0.1), 1.0], [1.0, 1.5, 1.0]]))
    torch.testing.assert_close(weights["token_mask"], torch.tensor([[e(0.2), e(-0.1), 1.0], [1.0, 0.0, 1.0]]))
    # a ratio too large for float is capped or masked, never a NaN
    huge = rloo.importance_weights(torch.tensor([[0.0]]), torch.tensor([[-1e4]]), torch.ones(1, 1), "sequence_mask", 3)
    assert huge.tolist() == [0.0]


def test_the_weights_multiply_each_actions_clipped_loss():
    """The weights policy_loss computes from the batch's sampler log-probs (chosen so that they are the ones below)
    multiply each action's clipped loss."""
    new = torch.tensor([[-0.9, -2.0, -0.5], [-0.2, -0.2, 0.0]])
    rollout = hand_made_rollout()
    old, mask = rollout.logprobs, rollout.response_mask
    advantages = torch.tensor([1.0, -2.0])
    weights = torch.tensor([0.5, 2.0])
    sequence = {"vllm_importance_sampling_correction": True, "vllm_importance_sampling_cap": 10.0,
                "sampler_logprobs": old - torch.tensor([[1.0, 0.0, 0.0]]) * weights.log()[:, None]}  # on token 0
    plain, _ = policy_loss_of(new, old, advantages, mask, 0.2, per_token=False)
    per_completion = [policy_loss_of(new[i:i + 1], old[i:i + 1], advantages[i:i + 1], mask[i:i + 1], 0.2,
                                     per_token=False)[0] for i in range(2)]
    weighted, _ = policy_loss_of(new, old, advantages, mask, 0.2, per_token=False, **sequence)
    torch.testing.assert_close(plain, torch.cat(per_completion))
    torch.testing.assert_close(weighted, torch.cat([0.5 * per_completion[0], 2.0 * per_completion[1]]))
    # per-token actions: a token's weight multiplies its own loss; a sequence's weight each of its tokens'
    token_advantages = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, 0.0]])
    token_weights = torch.tensor([[0.5, 1.0, 2.0], [3.0, 0.0, 1.0]])  # 0: a ratio of 10, above the cap of 5
    tokens = {"vllm_importance_sampling_correction": True, "vllm_importance_sampling_cap": 5.0,
              "vllm_importance_sampling_mode": "token_mask",
              "sampler_logprobs": old - torch.where(token_weights > 0, token_weights, 10.0).log()}
    per_token = policy_loss_of(new, old, token_advantages, mask, 0.2, per_token=True)
    by_token, _ = policy_loss_of(new, old, token_advantages, mask, 0.2, per_token=True, **tokens)
    ratio = (new - old).exp()
    unclipped = -token_advantages * ratio
    clipped = -token_advantages * ratio.clamp(0.8, 1.2)
    expected = torch.max(unclipped, clipped) * token_weights * mask  # (2, 3)
    torch.testing.assert_close(by_token, expected)
    by_sequence, _ = policy_loss_of(new, old, token_advantages, mask, 0.2, per_token=True, **sequence)
    torch.testing.assert_close(by_sequence, torch.max(unclipped, clipped) * weights[:, None] * mask)
    assert not torch.equal(per_token[0], by_token)


def sample_and_recompute(sampler, policy, args, sampler_autocast, trainer_autocast) -> rloo.Rollout:
    tokenizer = policy_tokenizer()
    queries, mask = plumbing.pad_sequences([tokenizer(t)["input_ids"] for t in ("a b c :", "d :", "e f :")],
                                           tokenizer.pad_token_id, CPU)  # (3, 4)
    c = rloo.sample_in_chunks(sampler, queries, mask, args.rloo_k, args, tokenizer.eos_token_id,
                              tokenizer.pad_token_id, torch.Generator().manual_seed(0), sampler_autocast)
    return rloo.collect_rollout(policy, None, c, args, False, False, trainer_autocast, plumbing.PhaseTimer(CPU))


def test_the_samplers_log_probs_are_the_trainers_in_fp32_and_differ_for_the_bf16_copy():
    policy = tiny_policy(len(policy_tokenizer()))
    # chunks of 4 completions (2 prompt groups): the log-probs are put back in the rows of their completions
    args = rloo.Args(rloo_k=2, response_length=8, temperature=0.7, local_rollout_forward_batch_size=4)
    same = sample_and_recompute(policy, policy, args, NO_AUTOCAST, NO_AUTOCAST)
    assert same.response_mask.sum() > 20 and (same.sampler_logprobs[~same.response_mask] == 0).all()
    torch.testing.assert_close(same.sampler_logprobs, same.logprobs, atol=1e-5, rtol=0)
    metrics = plumbing.mismatch_metrics(same, args.cliprange, args.cliprange_high)
    assert metrics["mismatch/logprob_diff_max"] < 1e-5 and metrics["mismatch/clipfrac"] == 0
    assert metrics["mismatch/ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    # the bf16 copy samples; the trainer recomputes under bf16 autocast with fp32 weights (--bf16 --bf16_generation)
    bf16 = sample_and_recompute(plumbing.bf16_copy(policy), policy, args, NO_AUTOCAST, BF16_AUTOCAST)
    # here: mean 6e-4, max 2e-3 (fp32: max below 1e-6)
    metrics = plumbing.mismatch_metrics(bf16, args.cliprange, args.cliprange_high)
    assert metrics["mismatch/logprob_diff_mean"] > 1e-4 and metrics["mismatch/logprob_diff_max"] > 5e-4, metrics


class GradientOf(torch.optim.Optimizer):
    """An optimizer whose step only records the gradient it was given (flattened)."""

    def __init__(self, params):
        super().__init__(params, {})

    def step(self, closure=None):
        self.gradient = torch.cat([p.grad.flatten() for group in self.param_groups for p in group["params"]])


def test_the_correction_brings_a_perturbed_samplers_gradient_back_to_the_on_policy_one():
    """The sampler draws the rewarded token `a` with its logit raised by 0.5 (a sampler that is not the trainer).
    Against the exact on-policy gradient of E[reward] (all 15^3 responses enumerated), one update's gradient from
    2048 sampled completions is 0.53 off (relative error) without the correction, 0.11 with it (sequence_truncate,
    cap 3), 0.10 when the trainer samples itself."""
    tokenizer = policy_tokenizer()
    policy = tiny_policy(len(tokenizer))
    a = tokenizer.convert_tokens_to_ids("a")
    prompt = torch.tensor([tokenizer("b c :")["input_ids"]])  # (1, 3)
    prompt_mask = torch.ones_like(prompt, dtype=torch.bool)
    length, num_prompts, k = 3, 512, 4

    def reward(responses: torch.Tensor) -> torch.Tensor:
        return (responses == a).float().sum(1)  # (N,)

    every = torch.tensor(list(itertools.product(range(len(tokenizer)), repeat=length)))  # (15^3, 3)
    logp = rloo.forward_logprobs(policy, rloo.Completions(prompt, prompt_mask, every, torch.ones_like(every).bool()),
                                 1.0, False)[0].sum(1)  # (15^3,)
    assert logp.exp().sum().item() == pytest.approx(1.0, abs=1e-5)
    (-(logp.exp().detach() * reward(every) * logp).sum()).backward()  # what the loss's gradient estimates
    exact = torch.cat([p.grad.flatten() for p in policy.parameters()])
    policy.zero_grad()

    sampler = copy.deepcopy(policy)
    with torch.no_grad():
        w = sampler.get_output_embeddings().weight  # (V, H)
        sampler.gpt_neox.final_layer_norm.bias.add_(0.5 * w[a] / w[a].square().sum())  # a's logit + 0.5

    def error(sampler, correction: bool) -> float:
        args = rloo.Args(rloo_k=k, per_device_train_batch_size=k * num_prompts, num_ppo_epochs=1, temperature=1.0,
                         response_length=length, kl_coef=0.0, max_grad_norm=0, stop_token=None,
                         local_rollout_forward_batch_size=k * num_prompts,
                         vllm_importance_sampling_correction=correction)
        c = rloo.sample_in_chunks(sampler, prompt.repeat(num_prompts, 1), prompt_mask.repeat(num_prompts, 1), k,
                                  args, None, 0, torch.Generator().manual_seed(0), NO_AUTOCAST)
        rollout = rloo.collect_rollout(policy, None, c, args, False, False, NO_AUTOCAST, plumbing.PhaseTimer(CPU))
        scores = reward(c.responses)
        optimizer = GradientOf(policy.parameters())
        rloo.ppo_update(policy, optimizer, rollout, scores, args, rloo.compute_batch_sizes(args, 1), False,
                        NO_AUTOCAST)
        return ((optimizer.gradient - exact).norm() / exact.norm()).item()

    on_policy, uncorrected, corrected = error(policy, False), error(sampler, False), error(sampler, True)
    assert on_policy < 0.2 and uncorrected > 0.4, (on_policy, uncorrected)
    assert corrected < uncorrected / 3 and corrected < 0.2, (corrected, uncorrected)


def test_token_modes_need_per_token_actions():
    args = rloo.Args(model_name_or_path="p", reward_fn=("m:f",), vllm_importance_sampling_correction=True,
                     vllm_importance_sampling_mode="token_mask")
    with pytest.raises(plumbing.ConfigError, match="add --token_level_kl or pass a sequence_ mode"):
        plumbing.validate_args(args)
    args = dataclasses.replace(args, token_level_kl=True)
    plumbing.validate_args(args)


def test_a_bf16_generation_run_logs_the_mismatch_and_corrects_it(assets, tmp_path):
    out = tmp_path / "run"
    result = run_rloo("--model_name_or_path", assets["policy"], "--reward_fn", "reward_fns:count_a",
                      "--dataset_name", assets["train"], "--output_dir", out, "--total_episodes", 32,
                      "--rloo_k", 4, "--per_device_train_batch_size", 16, "--response_length", 6,
                      "--max_prompt_length", 16, "--num_ppo_epochs", 2, "--bf16", "--bf16_generation",
                      "--vllm_importance_sampling_correction", "--vllm_importance_sampling_cap", 2.0)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = read_metrics(out)
    assert len(metrics) == 2
    for m in metrics:
        assert 1e-4 < m["mismatch/logprob_diff_mean"] < m["mismatch/logprob_diff_max"] < 1.0, m
        assert 0 < m["mismatch/ratio_std"] and 0 < m["mismatch/is_weight_mean"] <= 2.0, m
        assert 0 <= m["mismatch/clipfrac"] <= 1 and 0 <= m["mismatch/is_capped_frac"] <= 1, m


def test_the_log_warns_once_when_the_mismatch_passes_the_threshold(tmp_path, capsys):
    logger = plumbing.RunLogger(rloo.Args(output_dir=str(tmp_path)), "run", 3, 0, None)
    base = {"episode": 8, "mismatch/logprob_diff_mean": 0.01, "mismatch/logprob_diff_max": 0.3}
    for update, clipfrac in enumerate((0.01, 0.3, 0.4), 1):
        logger.log(update, {**base, "mismatch/clipfrac": clipfrac})
    logger.close()
    warnings = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "30% of completions" in warnings[0], warnings
    assert "--vllm_importance_sampling_correction" in warnings[0]
