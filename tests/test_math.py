"""The pure functions of the algorithm, on hand-computed numbers."""

import dataclasses
import functools
import math

import pytest
import torch

import plumbing
import rloo
from conftest import policy_loss_of


# ---------------------------------------------------------------- leave-one-out baseline
def brute_force_advantages(rewards: torch.Tensor, k: int) -> torch.Tensor:
    """Loop over prompts and samples: advantage = reward - mean of the other samples of the same prompt."""
    b = rewards.numel() // k
    out = torch.zeros_like(rewards)
    for i in range(b):  # prompt
        samples = [rewards[j * b + i] for j in range(k)]  # (k, B) layout: sample j of prompt i at j*B + i
        for j in range(k):
            others = [samples[m] for m in range(k) if m != j]
            out[j * b + i] = samples[j] - sum(others) / (k - 1)
    return out


def test_baseline_worked_example_from_the_docs():
    # k=4, B=3: rows are samples, columns prompts
    rewards = torch.tensor([[1, 2, 3], [2, 3, 4], [5, 6, 7], [8, 9, 10]], dtype=torch.float).flatten()
    advantages = rewards - rloo.leave_one_out_baseline(rloo.in_groups(rewards, 4)).flatten()
    assert advantages[0].item() == pytest.approx(1 - (2 + 5 + 8) / 3)  # prompt 0, sample 0
    assert advantages[7].item() == pytest.approx(6 - (3 + 2 + 9) / 3)  # prompt 1, sample 2
    torch.testing.assert_close(advantages, brute_force_advantages(rewards, 4))


@pytest.mark.parametrize("k,b", [(2, 1), (2, 5), (3, 4), (4, 3), (8, 2)])
def test_baseline_matches_brute_force(k, b):
    rewards = torch.randn(k * b, generator=torch.Generator().manual_seed(k * 10 + b))
    group = functools.partial(rloo.in_groups, k=k)
    advantages, _ = rloo.rloo_advantages(group(rewards), group(torch.zeros(k * b, 3)),
                                         group(torch.ones(k * b, 3, dtype=torch.bool)), kl_coef=0.1, token_level=False)
    torch.testing.assert_close(advantages.flatten(), brute_force_advantages(rewards, k))
    # the advantages of each prompt's samples sum to zero: the baseline adds no bias on average
    torch.testing.assert_close(advantages.reshape(k, b).sum(0), torch.zeros(b), atol=1e-5, rtol=0)


def test_an_unscored_completion_is_left_out_of_its_groups_baselines_with_advantage_zero():
    """TRL's nan-aware leave-one-out: a NaN reward (no source scored it) is not in its siblings' baselines, and a
    completion with no scored sibling, or none itself, gets advantage 0."""
    nan = math.nan
    rewards = torch.tensor([[1.0, 5.0, nan], [nan, 6.0, 2.0], [3.0, nan, nan], [5.0, nan, nan]])  # (k=4, g=3)
    baseline = rloo.leave_one_out_baseline(rewards)
    torch.testing.assert_close(baseline[[0, 2, 3], 0], torch.tensor([4.0, 3.0, 2.0]))  # over the other 2 scored
    torch.testing.assert_close(baseline[:2, 1], torch.tensor([6.0, 5.0]))  # the other one
    assert baseline[1, 0].isnan() and baseline[1, 2].isnan()  # unscored; the only scored one of its group
    rollout = rloo.Rollout(torch.ones(3, 1, dtype=torch.long), torch.ones(3, 1, dtype=torch.bool),
                           torch.ones(12, 1, dtype=torch.long), torch.ones(12, 1, dtype=torch.bool),
                           torch.zeros(12, 1), torch.zeros(12, 1))
    out = rloo.compute_advantages(rollout, rewards.flatten(), rloo.Args(rloo_k=4, kl_coef=0.1))
    assert out.advantages.tolist() == [-3.0, -1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 3.0, 0.0, 0.0]
    out = rloo.compute_advantages(rollout, rewards.flatten(),
                                  rloo.Args(rloo_k=4, kl_coef=0.1, normalize_advantage=True))
    scored = torch.tensor([-3.0, -1.0, 1.0, 0.0, 3.0])  # whitened over the 5 with an advantage: mean 0, std sqrt(5)
    torch.testing.assert_close(out.advantages[[0, 1, 4, 6, 9]], scored / (math.sqrt(5) + 1e-8))
    assert out.advantages[[2, 3, 5, 7, 8, 10, 11]].abs().sum() == 0


def test_a_masked_completions_kl_leaves_its_reward_which_stays_in_its_groups_baseline():
    """--mask_truncated_completions, TRL 1.16's meaning: the completion mask of a truncated completion is zeroed,
    so its reward is its score alone, and its siblings' baselines see that."""
    rollout = rloo.Rollout(torch.ones(1, 1, dtype=torch.long), torch.ones(1, 1, dtype=torch.bool),
                           torch.ones(2, 1, dtype=torch.long), torch.ones(2, 1, dtype=torch.bool),
                           torch.tensor([[-0.2], [-0.4]]), torch.tensor([[-0.6], [-1.0]]), in_loss=torch.tensor(
                               [True, False]))
    out = rloo.compute_advantages(rollout, torch.tensor([1.0, 2.0]), rloo.Args(rloo_k=2, kl_coef=0.5))
    # completion 0: 1 - 0.5 x 0.4 = 0.8; completion 1 (masked): 2, its KL 0.6 left out
    torch.testing.assert_close(out.rlhf_reward, torch.tensor([0.8, 2.0]))
    torch.testing.assert_close(out.advantages, torch.tensor([0.8 - 2.0, 2.0 - 0.8]))


def test_k_below_two_is_refused():
    with pytest.raises(ValueError, match="k >= 2"):
        rloo.leave_one_out_baseline(torch.ones(1, 4))
    with pytest.raises(plumbing.ConfigError, match="rloo_k = 1"):
        rloo.compute_batch_sizes(rloo.Args(rloo_k=1), world_size=1)


# ---------------------------------------------------------------- batch arithmetic
def test_batch_sizes_spelled_out():
    args = rloo.Args(rloo_k=4, per_device_train_batch_size=16, gradient_accumulation_steps=16, num_mini_batches=2)
    sizes = rloo.compute_batch_sizes(args, world_size=8)
    assert (sizes.micro, sizes.mini, sizes.local, sizes.prompts, sizes.all_ranks) == (16, 256, 512, 128, 4096)


def test_indivisible_batch_names_the_numbers():
    args = rloo.Args(rloo_k=3, per_device_train_batch_size=4, gradient_accumulation_steps=2, num_mini_batches=1)
    with pytest.raises(plumbing.ConfigError) as e:
        rloo.compute_batch_sizes(args, world_size=1)
    assert "per_device_train_batch_size (4)" in str(e.value) and "= 8" in str(e.value) and "rloo_k (3)" in str(e.value)


# ---------------------------------------------------------------- sequence- vs token-level KL
def rloo_advantages(scores, kl, mask, kl_coef, k, token_level):
    """rloo.rloo_advantages on (k*B,) rows, as compute_advantages calls it."""
    advantages, rlhf_reward = rloo.rloo_advantages(*(rloo.in_groups(x, k) for x in (scores, kl, mask)), kl_coef,
                                                   token_level)
    return advantages.flatten(0, 1), rlhf_reward.flatten()


def test_sequence_and_token_level_agree_without_kl():
    scores = torch.tensor([1.0, 0.0, 2.0, 5.0])  # k=2, B=2
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    kl = torch.randn(4, 3)
    seq, seq_reward = rloo_advantages(scores, kl, mask, kl_coef=0.0, k=2, token_level=False)
    tok, tok_reward = rloo_advantages(scores, kl, mask, kl_coef=0.0, k=2, token_level=True)
    torch.testing.assert_close(tok, seq[:, None] * mask)  # every valid token carries the sequence advantage
    torch.testing.assert_close(tok_reward, seq_reward)


def test_token_level_kl_differs_where_it_must():
    scores = torch.tensor([1.0, 3.0])  # k=2, B=1
    kl = torch.tensor([[0.5, 1.0, 2.0], [0.0, 0.0, 9.0]])  # the 9.0 sits on padding: must be ignored
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    c = 0.1
    seq, seq_reward = rloo_advantages(scores, kl, mask, kl_coef=c, k=2, token_level=False)
    tok, tok_reward = rloo_advantages(scores, kl, mask, kl_coef=c, k=2, token_level=True)
    # same totals: rlhf reward = score - c * sum of valid kl
    expected_reward = torch.tensor([1.0 - c * 3.5, 3.0])
    torch.testing.assert_close(seq_reward, expected_reward)
    torch.testing.assert_close(tok_reward, expected_reward)
    # sequence level: one advantage per completion
    torch.testing.assert_close(seq, torch.tensor([expected_reward[0] - 3.0, 3.0 - expected_reward[0]]))
    # token level: token t's return only holds the KL of tokens t.. (and the score), minus the same baseline
    returns0 = torch.tensor([1.0 - c * 3.5, 1.0 - c * 3.0, 1.0 - c * 2.0])
    torch.testing.assert_close(tok[0], returns0 - 3.0)
    torch.testing.assert_close(tok[1], torch.tensor([3.0, 3.0, 0.0]) - expected_reward[0] * torch.tensor([1, 1, 0]))
    torch.testing.assert_close(tok[:, 0], seq)  # the first token sees the whole sequence
    assert not torch.allclose(tok[0, 1:], seq[0].expand(2))  # later tokens differ


# ---------------------------------------------------------------- truncation and EOS penalty
def test_truncate_after_first_stop_token():
    pad, eos = 0, 1
    responses = torch.tensor([[5, 1, 6, 1], [5, 6, 7, 8], [1, 5, 5, 5]])
    out, mask = rloo.truncate_after_stop(responses, eos, pad)
    assert out.tolist() == [[5, 1, 0, 0], [5, 6, 7, 8], [1, 0, 0, 0]]
    assert mask.tolist() == [[True, True, False, False], [True] * 4, [True, False, False, False]]
    same, all_valid = rloo.truncate_after_stop(responses, None, pad)
    assert same.equal(responses) and all_valid.all()


def test_missing_eos_penalty():
    scores = torch.tensor([1.0, 2.0, 3.0])
    ended = torch.tensor([True, False, True])
    assert rloo.apply_missing_eos_penalty(scores, ended, 1.5).tolist() == [1.0, 0.5, 3.0]
    assert rloo.apply_missing_eos_penalty(scores, ended, None).tolist() == [1.0, 2.0, 3.0]


def test_completions_ended_ignores_stop_ids_on_padding():
    c = rloo.Completions(queries=torch.tensor([[9]]), query_mask=torch.ones(1, 1, dtype=torch.bool),
                         responses=torch.tensor([[5, 1, 0], [5, 6, 1]]),  # k = 2 completions of one prompt
                         response_mask=torch.tensor([[1, 1, 0], [1, 1, 0]], dtype=torch.bool))
    assert c.ended(1).tolist() == [True, False]
    assert c.ended(None).tolist() == [False, False]


# ---------------------------------------------------------------- the clipped loss
def test_sequence_level_loss_on_hand_computed_numbers():
    mask = torch.tensor([[1, 1], [1, 0]], dtype=torch.bool)
    old = torch.tensor([[-1.0, -1.0], [-2.0, 0.0]])
    new = torch.tensor([[-0.9, -0.8], [-2.5, 7.0]])  # 7.0 sits on padding
    advantages = torch.tensor([1.0, -2.0])
    losses, stats = policy_loss_of(new, old, advantages, mask, cliprange=0.2, per_token=False)
    r0, r1 = math.exp(0.3), math.exp(-0.5)  # sequence ratios: exp of summed log-ratios over valid tokens
    # sample 0: A>0, ratio 1.35 > 1.2 -> clipped to 1.2; sample 1: A<0, ratio 0.61 < 0.8 -> clipped to 0.8
    assert losses.tolist() == pytest.approx([max(-1.0 * r0, -1.0 * 1.2), max(2.0 * r1, 2.0 * 0.8)])
    assert stats["policy/clipfrac_avg"].item() == pytest.approx(1.0)
    assert stats["policy/approxkl_avg"].item() == pytest.approx(0.5 * (0.3**2 + 0.5**2) / 2)
    ratios = rloo.sequence_log_ratio(new, old, mask).exp()
    assert ratios.tolist() == pytest.approx([r0, r1])


def test_unclipped_loss_is_reinforce_at_ratio_one():
    logprobs = torch.randn(4, 3, requires_grad=True)
    mask = torch.ones(4, 3, dtype=torch.bool)
    advantages = torch.tensor([1.0, -1.0, 0.5, 2.0])
    losses, stats = policy_loss_of(logprobs, logprobs.detach(), advantages, mask, cliprange=0.2, per_token=False)
    losses.mean().backward()
    assert stats["policy/clipfrac_avg"].item() == 0 and stats["policy/approxkl_avg"].item() == 0
    # d loss / d logprob_t = -A / N for every token: the REINFORCE gradient with the leave-one-out baseline
    torch.testing.assert_close(logprobs.grad, -advantages[:, None].expand(4, 3) / 4)


def test_padding_never_counts():
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    old = torch.randn(2, 4)
    new = old + 0.1 * torch.randn(2, 4)
    noisy_new = torch.where(mask, new, torch.full_like(new, 50.0))
    noisy_old = torch.where(mask, old, torch.full_like(old, -50.0))
    for advantages in (torch.tensor([1.0, -1.0]), torch.randn(2, 4)):
        per_token = advantages.dim() == 2
        loss, stats = policy_loss_of(new, old, advantages, mask, 0.2, per_token)
        loss2, stats2 = policy_loss_of(noisy_new, noisy_old, advantages, mask, 0.2, per_token)
        torch.testing.assert_close(loss, loss2)
        for key in stats:
            assert stats[key].item() == pytest.approx(stats2[key].item())
    # KL and entropy sums use the mask too
    entropy = torch.tensor([[1.0, 2.0, -99.0, -99.0], [3.0, -99.0, -99.0, -99.0]])
    assert rloo.masked_mean(entropy, mask).item() == pytest.approx(2.0)
    kl = torch.tensor([[0.5, 0.5, 9.0, 9.0], [1.0, 9.0, 9.0, 9.0]])
    _, rlhf_reward = rloo_advantages(torch.zeros(2), kl, mask, kl_coef=1.0, k=2, token_level=False)
    assert rlhf_reward.tolist() == [-1.0, -1.0]


def test_token_level_loss_uses_per_token_ratios():
    mask = torch.tensor([[1, 1]], dtype=torch.bool)
    old = torch.tensor([[-1.0, -1.0]])
    new = torch.tensor([[-0.5, -1.0]])  # token 0's ratio e^0.5 is clipped, token 1's ratio is 1
    advantages = torch.tensor([[1.0, 1.0]])
    losses, stats = policy_loss_of(new, old, advantages, mask, cliprange=0.2, per_token=True)
    assert losses.tolist() == [pytest.approx([-1.2, -1.0])]
    assert stats["policy/clipfrac_avg"].item() == pytest.approx(0.5)
    # each completion's advantage on its tokens, the level said, not read from the advantages' shape
    same, _ = policy_loss_of(new, old, torch.tensor([1.0]), mask, cliprange=0.2, per_token=True)
    assert torch.equal(same, losses)
    with pytest.raises(ValueError, match="per-token advantages"):
        policy_loss_of(new, old, advantages, mask, cliprange=0.2, per_token=False)


def test_whiten_and_global_stats_single_process():
    x = torch.tensor([1.0, 2.0, 3.0, 100.0])
    mask = torch.tensor([True, True, True, False])
    mean, std = plumbing.global_mean_std(x, mask)
    assert mean.item() == pytest.approx(2.0) and std.item() == pytest.approx(1.0)
    assert rloo.whiten(x, mask).tolist() == pytest.approx([-1.0, 0.0, 1.0, 0.0], abs=1e-6)


def test_combine_rewards_with_none():
    values = torch.tensor([[1.0, 2.0, 0.0], [10.0, 0.0, 30.0]])
    applies = torch.tensor([[True, True, False], [True, False, True]])
    combined = rloo.combine_rewards(values, applies, torch.tensor([1.0, 0.5]))
    assert combined.tolist() == [6.0, 2.0, 15.0]
    # a completion no source applies to is NaN (TRL's: every function returned None), left out of its baselines
    unscored = rloo.combine_rewards(values, torch.tensor([[True, False, True], [False, False, True]]), torch.ones(2))
    assert unscored[1].isnan() and unscored[[0, 2]].tolist() == [1.0, 30.0]


def test_reduce_metrics_single_process():
    metrics = {"objective/scores": 1.5, "reward/f/mean": float("nan"), "loss/policy_avg": float("nan"),
               "val/num_eos_tokens": 3.0, "completions/min_length": 2.0, "completions/max_length": 7.0, "memory/peak_gib": 2.0}
    out = plumbing.reduce_metrics(metrics, torch.device("cpu"))
    assert "reward/f/mean" not in out  # a source that applied to nothing has no mean
    assert math.isnan(out["loss/policy_avg"])  # any other NaN is reported, never hidden
    assert {k: v for k, v in out.items() if k != "loss/policy_avg"} == {
        "objective/scores": 1.5, "val/num_eos_tokens": 3.0, "completions/min_length": 2.0,
        "completions/max_length": 7.0, "memory/peak_gib": 2.0}


def test_linear_learning_rate_decay():
    args = rloo.Args(learning_rate=1.0)
    assert [plumbing.learning_rates(args, plumbing.RunLength(4, 1))(u) for u in (1, 2, 4)] == [1.0, 0.75, 0.25]
    args = dataclasses.replace(args, lr_scheduler_type="constant")
    assert plumbing.learning_rates(args, plumbing.RunLength(4, 1))(4) == 1.0


# ---------------------------------------------------------------- sampling and log-probs kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_selective_log_softmax_matches_log_softmax_values_and_gradient(dtype):
    torch.manual_seed(0)
    logits = (3 * torch.randn(3, 5, 11)).to(dtype).requires_grad_()
    targets = torch.randint(0, 11, (3, 5))
    weights = torch.randn(3, 5)  # an arbitrary upstream gradient
    logprobs, entropy = plumbing.SelectiveLogSoftmax.apply(logits, targets, 0.7, True)
    (logprobs * weights).sum().backward()
    ours = logits.grad.clone()
    logits.grad = None
    reference = (logits.float() / 0.7).log_softmax(-1)  # (3, 5, 11)
    expected = reference.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    (expected * weights).sum().backward()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.allclose(logprobs, expected, atol=tol)
    assert torch.allclose(entropy, -(reference.exp() * reference).sum(-1), atol=tol)
    assert ours.dtype == dtype and torch.allclose(ours.float(), logits.grad.float(), atol=tol)
    with torch.no_grad():  # the rollout's call: no entropy, nothing kept
        again, none = plumbing.SelectiveLogSoftmax.apply(logits, targets, 0.7, False)
    assert none is None and torch.equal(again, logprobs.detach())


@pytest.mark.parametrize("uses", ["entropy", "both"])
def test_the_entropy_is_differentiable(uses):
    """An entropy bonus trains: the entropy's gradient is log_softmax's, alone or with the log-probs'."""
    torch.manual_seed(0)
    logits = (3 * torch.randn(3, 5, 11)).requires_grad_()
    targets = torch.randint(0, 11, (3, 5))
    weights = torch.randn(2, 3, 5)  # arbitrary upstream gradients of the log-probs and of the entropy
    logits[0, 0, 3].data.fill_(-1e4)  # a probability that underflows to 0: no NaN from 0 * log 0

    def loss(logprobs, entropy):
        return (entropy * weights[1]).sum() + ((logprobs * weights[0]).sum() if uses == "both" else 0.0)

    loss(*plumbing.SelectiveLogSoftmax.apply(logits, targets, 0.7, True)).backward()
    ours, logits.grad = logits.grad.clone(), None
    reference = (logits / 0.7).log_softmax(-1)  # (3, 5, 11)
    loss(reference.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(reference.exp() * reference).sum(-1)).backward()
    assert torch.isfinite(ours).all()
    torch.testing.assert_close(ours, logits.grad, atol=1e-5, rtol=1e-4)


def test_sample_tokens_follows_the_softmax_and_never_draws_a_masked_token():
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, float("-inf")]]).expand(200_000, 5)
    tokens = rloo.sample_tokens(logits, temperature=0.7)  # (200000,)
    frequencies = torch.bincount(tokens, minlength=5).float() / tokens.numel()
    expected = torch.softmax(logits[0] / 0.7, -1)
    assert frequencies[4] == 0  # probability 0
    assert torch.allclose(frequencies, expected, atol=4e-3)  # ~4 standard errors at the largest probability
