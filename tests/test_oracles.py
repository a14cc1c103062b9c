"""Independent oracles for the algorithm's numbers: each value rloo.py computes (the KL-penalized reward, the logged
metrics, evaluation, the reductions over ranks, which weights are trained) against a hand-computed number or a naive
Python loop written apart from the tensor expression it checks, so that a wrong sign, layout or term fails here."""

import functools
import json
import math
import signal
import statistics
import subprocess

import datasets
import pytest
import torch
import tyro
from transformers import AutoModelForCausalLM

import plumbing
import rloo
from conftest import REPO, cpu_env, policy_loss_of, policy_tokenizer, tiny_policy
from helpers import argv_of, python, valid_flags


# ---------------------------------------------------------------- naive oracles
def naive_logprobs(model, prompt: list[int], response: list[int], temperature: float) -> list[float]:
    """log p(response[t] | prompt, response[:t]) under softmax(logits / temperature), one token at a time, from a
    forward of the unpadded sequence alone."""
    out = []
    with torch.no_grad():
        for t in range(len(response)):
            logits = model(torch.tensor([prompt + response[:t]])).logits[0, -1].double() / temperature
            out.append((logits[response[t]] - torch.logsumexp(logits, 0)).item())
    return out


def naive_kl_sums(logprobs, ref_logprobs, mask) -> list[float]:
    """sum_t (logp_t - ref_logp_t) over each row's valid tokens, in a plain loop."""
    sums = []
    for i in range(len(mask)):
        total = 0.0
        for t in range(len(mask[i])):
            if mask[i][t]:
                total += float(logprobs[i][t]) - float(ref_logprobs[i][t])
        sums.append(total)
    return sums


def rollout_of(logprobs, ref_logprobs, mask, num_prompts: int) -> rloo.Rollout:
    mask = torch.tensor(mask)
    queries = torch.ones(num_prompts, 1, dtype=torch.long)
    return rloo.Rollout(queries, torch.ones_like(queries, dtype=torch.bool), mask.long() * 2, mask,
                        torch.tensor(logprobs) * mask, torch.tensor(ref_logprobs) * mask)


# ---------------------------------------------------------------- the KL-penalized reward
@pytest.mark.parametrize("token_level_kl", [False, True])
def test_rlhf_reward_is_the_score_minus_the_kl_to_the_reference_on_hand_computed_numbers(token_level_kl):
    # k = 2, one prompt; row 1's second token is padding (its made-up log-probs must not count)
    rollout = rollout_of([[-1.0, -2.0], [-0.5, -9.0]], [[-1.5, -1.0], [-0.25, -1.0]], [[True, True], [True, False]], 1)
    scores = torch.tensor([1.0, 2.0])
    out = rloo.compute_advantages(rollout, scores, rloo.Args(rloo_k=2, kl_coef=0.1, token_level_kl=token_level_kl))
    # row 0: sum_t (logp - ref) = (-1 + 1.5) + (-2 + 1) = -0.5 -> 1 - 0.1 * -0.5 = 1.05
    # row 1: (-0.5 + 0.25) = -0.25 -> 2 - 0.1 * -0.25 = 2.025
    assert out.rlhf_reward.tolist() == pytest.approx([1.05, 2.025])
    if not token_level_kl:
        assert out.advantages.tolist() == pytest.approx([1.05 - 2.025, 2.025 - 1.05])
    # a policy that puts more mass than the reference on its samples pays: its reward is below its score
    rollout = rollout_of([[-0.1]] * 2, [[-2.0]] * 2, [[True]] * 2, 1)
    out = rloo.compute_advantages(rollout, torch.zeros(2), rloo.Args(rloo_k=2, kl_coef=0.5,
                                                                     token_level_kl=token_level_kl))
    assert out.rlhf_reward.tolist() == pytest.approx([-0.95, -0.95])


ESTIMATORS = {"k1": lambda r: -r, "k2": lambda r: 0.5 * r * r, "k3": lambda r: math.exp(r) - r - 1}  # of r = ref - logp


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("kl_in_loss", [False, True])
def test_each_kl_estimator_against_its_formula_in_the_reward_and_in_the_loss(estimator, kl_in_loss):
    """--kl_estimator: Schulman's estimator of each valid token, r = ref - logp, summed over a completion, in a plain
    loop: the reward's penalty (kl_coef x it), or with --kl_in_loss the loss's term (the reward then holds none).
    objective/kl's helper stays the k1 log-ratio whatever the estimator."""
    gen = torch.Generator().manual_seed(5)
    n, width, kl_coef = 6, 4, 0.3
    mask = (torch.arange(width) < torch.randint(1, width + 1, (n,), generator=gen)[:, None]).tolist()
    logprobs = (-torch.rand(n, width, generator=gen) * 3).tolist()
    ref_logprobs = (-torch.rand(n, width, generator=gen) * 3).tolist()
    sums = [sum(ESTIMATORS[estimator](ref_logprobs[i][t] - logprobs[i][t]) for t in range(width) if mask[i][t])
            for i in range(n)]
    scores = torch.randn(n, generator=gen)
    args = rloo.Args(rloo_k=2, kl_coef=kl_coef, kl_estimator=estimator, kl_in_loss=kl_in_loss)
    rollout = rollout_of(logprobs, ref_logprobs, mask, 3)
    out = rloo.compute_advantages(rollout, scores, args)
    assert out.non_score_reward.tolist() == pytest.approx([0.0] * n if kl_in_loss else [-kl_coef * x for x in sums],
                                                          abs=1e-5)
    assert out.reward_kl.tolist() == pytest.approx(sums, abs=1e-5)  # objective/kl_<estimator>'s
    assert rloo.kl_to_reference(rollout).mul(rollout.response_mask).sum(1).tolist() == pytest.approx(
        naive_kl_sums(logprobs, ref_logprobs, mask), abs=1e-5)  # objective/kl: k1 whatever the estimator
    new = torch.tensor(logprobs)  # ratio 1 and advantages 0: the loss is the KL term alone
    losses, stats = policy_loss_of(new, new, torch.zeros(n), rollout.response_mask, ref_logprobs=rollout.ref_logprobs,
                                   kl_in_loss=True, kl_coef=kl_coef, kl_estimator=estimator)
    assert losses.tolist() == pytest.approx([kl_coef * x for x in sums], abs=1e-5)
    assert stats[f"policy/kl_{estimator}_avg"].item() == pytest.approx(sum(sums) / n, abs=1e-5)


def test_the_kl_in_the_reward_and_in_the_loss_are_trl_1_16s_on_the_same_batch():
    """TRL 1.16's own lines, pasted: RLOOTrainer folds k1 into the reward (`per_token_kl = old_per_token_logps -
    ref_per_token_logps`, summed over the completion mask, `rewards - self.beta * kl`), GRPOTrainer's loss adds
    `self.beta * per_token_kl` with k3 (`torch.exp(ref - logps) - (ref - logps) - 1`); ours by default, and k3 in the
    reward is that same k3 summed."""
    gen = torch.Generator().manual_seed(6)
    n, width, beta = 4, 5, 0.05
    completion_mask = (torch.arange(width) < torch.randint(1, width + 1, (n,), generator=gen)[:, None]).float()
    per_token_logps = -torch.rand(n, width, generator=gen) * 3 * completion_mask
    ref_per_token_logps = -torch.rand(n, width, generator=gen) * 3 * completion_mask
    rewards = torch.randn(n, generator=gen)
    old_per_token_logps = per_token_logps
    # ---- TRL 1.16, RLOOTrainer._generate_and_score_completions
    per_token_kl = old_per_token_logps - ref_per_token_logps
    kl = (per_token_kl * completion_mask).sum(-1)
    trl_rewards = rewards - beta * kl
    # ---- TRL 1.16, GRPOTrainer._compute_loss
    per_token_kl = (
        torch.exp(ref_per_token_logps - per_token_logps) - (ref_per_token_logps - per_token_logps) - 1
    )
    # ----
    rollout = rloo.Rollout(torch.ones(2, 1, dtype=torch.long), torch.ones(2, 1, dtype=torch.bool),
                           torch.ones(n, width, dtype=torch.long), completion_mask.bool(), per_token_logps,
                           ref_per_token_logps)
    out = rloo.compute_advantages(rollout, rewards, rloo.Args(rloo_k=2, kl_coef=beta))
    torch.testing.assert_close(out.rlhf_reward, trl_rewards)
    losses, _ = policy_loss_of(per_token_logps, per_token_logps, torch.zeros(n), completion_mask, per_token=True,
                               ref_logprobs=ref_per_token_logps, kl_in_loss=True, kl_coef=beta)
    torch.testing.assert_close(losses, beta * per_token_kl * completion_mask)
    k3 = rloo.compute_advantages(rollout, rewards, rloo.Args(rloo_k=2, kl_coef=beta, kl_estimator="k3"))
    torch.testing.assert_close(k3.reward_kl, (per_token_kl * completion_mask).sum(-1))


@pytest.mark.parametrize("k", [2, 4])
def test_rlhf_reward_against_a_naive_loop(k):
    gen = torch.Generator().manual_seed(k)
    n, width, kl_coef = k * 3, 5, 0.3
    lengths = torch.randint(1, width + 1, (n,), generator=gen)
    mask = (torch.arange(width) < lengths[:, None]).tolist()
    logprobs = (-torch.rand(n, width, generator=gen) * 3).tolist()
    ref_logprobs = (-torch.rand(n, width, generator=gen) * 3).tolist()
    scores = torch.randn(n, generator=gen)
    rollout = rollout_of(logprobs, ref_logprobs, mask, 3)
    out = rloo.compute_advantages(rollout, scores, rloo.Args(rloo_k=k, kl_coef=kl_coef))
    kl = naive_kl_sums(logprobs, ref_logprobs, mask)
    expected = [scores[i].item() - kl_coef * kl[i] for i in range(n)]
    assert out.rlhf_reward.tolist() == pytest.approx(expected, abs=1e-5)
    assert rloo.kl_to_reference(rollout).mul(rollout.response_mask).sum(1).tolist() == pytest.approx(kl, abs=1e-5)


# ---------------------------------------------------------------- completion_metrics: the (k, B) layout
@pytest.mark.parametrize("k", [2, 4])
def test_completion_metrics_values_in_the_k_b_layout(k):
    b = 2 if k == 4 else 4  # 8 completions either way; (k, B) and (B, k) group different rows
    scores = torch.tensor([1.0, 1.0, 3.0, 5.0, 1.0, 1.0, 7.0, 9.0])
    lengths = [3, 1, 4, 2, 4, 4, 0, 2]
    mask = torch.arange(4) < torch.tensor(lengths)[:, None]
    has_stop = torch.tensor([True, False, True, True, False, False, True, True])
    out = plumbing.completion_metrics(mask, has_stop, scores, rloo.in_groups(scores, k))
    # prompt i's samples are rows j*B + i
    groups = [[scores[j * b + i].item() for j in range(k)] for i in range(b)]
    stds = [math.sqrt(sum((x - sum(g) / k) ** 2 for x in g) / (k - 1)) for g in groups]
    assert out["reward_std"] == pytest.approx(statistics.stdev(scores.tolist()))  # TRL 1.16's: over all completions
    assert out["frac_reward_zero_std"] == pytest.approx(sum(s == 0 for s in stds) / b)
    if k == 2:  # by hand: prompts (1, 1), (1, 1), (3, 7), (5, 9): two with zero spread
        assert out["frac_reward_zero_std"] == 0.5
    assert out["completions/mean_terminated_length"] == (3 + 4 + 2 + 0 + 2, 5)  # a pair: over every rank's (TRL's)
    assert out["completions/mean_length"] == pytest.approx(20 / 8)
    assert (out["completions/min_length"], out["completions/max_length"]) == (0, 4)
    assert out["completions/clipped_ratio"] == pytest.approx(3 / 8) and out["val/num_eos_tokens"] == 5


def test_the_global_mean_and_std_by_hand():
    x = torch.tensor([1.0, 2.0, 4.0, 100.0])
    mean, std = plumbing.global_mean_std(x, torch.tensor([True, True, True, False]))
    assert mean.item() == pytest.approx(7 / 3)
    assert std.item() == pytest.approx(math.sqrt(((1 - 7 / 3) ** 2 + (2 - 7 / 3) ** 2 + (4 - 7 / 3) ** 2) / 2))
    whitened = rloo.whiten(x, torch.tensor([True, True, True, False]))
    assert whitened.tolist() == pytest.approx([(v - 7 / 3) / std.item() for v in (1, 2, 4)] + [0.0], abs=1e-6)


# ---------------------------------------------------------------- the loss and the sampler's pieces, by hand
def test_clipping_is_symmetric_and_the_gradient_flows_through_the_ratio():
    # one token each; ratios e^0.5 (above 1.2) and e^-0.5 (below 0.8), advantages of both signs
    new = torch.tensor([[0.5], [-0.5], [0.5], [-0.5]], requires_grad=True)
    old, mask = torch.zeros(4, 1), torch.ones(4, 1, dtype=torch.bool)
    advantages = torch.tensor([1.0, -1.0, -1.0, 1.0])
    losses, stats = policy_loss_of(new, old, advantages, mask, cliprange=0.2, per_token=False)
    up, down = math.exp(0.5), math.exp(-0.5)
    # max(-A r, -A clip(r)): A > 0 above the range and A < 0 below it are clipped; the others are not
    assert losses.tolist() == pytest.approx([-1.2, 0.8, up, -down])
    assert stats["policy/clipfrac_avg"].item() == 0.5
    assert stats["policy/approxkl_avg"].item() == pytest.approx(0.5 * 0.25)
    losses.sum().backward()
    assert new.grad.flatten().tolist() == pytest.approx([0.0, 0.0, up, -down])  # clipped: no gradient


@pytest.mark.parametrize("token_level_kl", [False, True])
def test_kl_in_the_loss_is_kl_coef_times_k3_by_hand_and_leaves_the_reward(token_level_kl):
    # ratio 1 and advantages 0: the loss is the KL term alone. Row 1's second token is padding (made-up values)
    mask = torch.tensor([[True, True], [True, False]])
    new = torch.tensor([[-1.0, -2.0], [-0.5, 7.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0], [-0.25, -9.0]])
    losses, _ = policy_loss_of(new, new.detach(), torch.zeros(2), mask, per_token=token_level_kl, ref_logprobs=ref,
                               kl_in_loss=True, kl_coef=0.1)
    d = [[-0.5, 1.0], [0.25, None]]  # ref - new on the valid tokens; k3 = e^d - d - 1
    k3 = [[math.exp(x) - x - 1 if x is not None else 0.0 for x in row] for row in d]
    expected = [[0.1 * x for x in row] for row in k3] if token_level_kl else [0.1 * sum(row) for row in k3]
    torch.testing.assert_close(losses.detach(), torch.tensor(expected))
    losses.sum().backward()  # d k3 / d new = 1 - e^d: towards the reference
    grad = [[0.1 * (1 - math.exp(x)) if x is not None else 0.0 for x in row] for row in d]
    torch.testing.assert_close(new.grad, torch.tensor(grad))
    # the reward has no KL then: rlhf_reward is the score, non_score_reward 0
    rollout = rollout_of([[-1.0, -2.0], [-0.5, -9.0]], [[-1.5, -1.0], [-0.25, -1.0]], [[True, True], [True, False]], 1)
    scores = torch.tensor([1.0, 2.0])
    out = rloo.compute_advantages(rollout, scores, rloo.Args(rloo_k=2, kl_coef=0.1, kl_in_loss=True,
                                                             token_level_kl=token_level_kl))
    assert out.rlhf_reward.tolist() == [1.0, 2.0] and out.non_score_reward.abs().sum() == 0
    with pytest.raises(plumbing.ConfigError, match="--kl_in_loss .* kl_coef 0 there is no reference"):
        rloo.algorithm_checks(rloo.Args(kl_coef=0.0, kl_in_loss=True))


def test_which_completions_count_in_the_loss_by_hand():
    scores, has_stop = torch.tensor([1.0, 2.0, 2.0, 3.0]), torch.tensor([True, False, True, False])
    assert rloo.completions_in_loss(scores, has_stop, rloo.Args(rloo_k=2)) is None  # all
    kept = rloo.completions_in_loss(scores, has_stop, rloo.Args(rloo_k=2, mask_truncated_completions=True))
    assert kept.tolist() == [True, False, True, False]  # the ones that stopped


def test_the_missing_eos_penalty_and_truncation_by_hand():
    scores = torch.tensor([1.0, 1.0])
    assert rloo.apply_missing_eos_penalty(scores, torch.tensor([True, False]), 0.5).tolist() == [1.0, 0.5]
    responses, mask = rloo.truncate_after_stop(torch.tensor([[5, 1, 6, 1, 7], [1, 5, 5, 5, 5]]), 1, 0)
    assert responses.tolist() == [[5, 1, 0, 0, 0], [1, 0, 0, 0, 0]]
    assert mask.tolist() == [[True, True, False, False, False], [True, False, False, False, False]]


def test_sampling_at_a_temperature_follows_the_tempered_softmax():
    logits = torch.tensor([[0.0, 1.0, 2.0]]).expand(20000, 3)
    draws = rloo.sample_tokens(logits, 0.5, torch.Generator().manual_seed(0))
    expected = torch.softmax(torch.tensor([0.0, 1.0, 2.0]) / 0.5, 0)  # 0.016, 0.117, 0.867
    frequencies = torch.bincount(draws, minlength=3).float() / len(draws)
    torch.testing.assert_close(frequencies, expected, atol=0.01, rtol=0)


def test_a_token_of_zero_probability_is_never_drawn_even_at_the_edge_of_the_cdf():
    logits = torch.tensor([[0.0, -math.inf, 0.0, -math.inf]])
    generator = torch.Generator().manual_seed(0)
    draws = torch.cat([rloo.sample_tokens(logits.expand(5000, 4), 1.0, generator) for _ in range(4)])
    assert set(draws.tolist()) <= {0, 2}


def test_the_learning_rate_schedule_by_hand():
    args = rloo.Args(learning_rate=0.8)
    rate = plumbing.learning_rates(args, plumbing.RunLength(4, 1))
    assert [rate(u) for u in (1, 2, 3, 4)] == pytest.approx([0.8, 0.6, 0.4, 0.2])


def test_the_minibatch_plan_covers_every_completion_once_in_minibatches_of_mini():
    args = rloo.Args(rloo_k=2, per_device_train_batch_size=2, gradient_accumulation_steps=2, num_mini_batches=3)
    sizes = rloo.compute_batch_sizes(args, world_size=1)
    assert (sizes.micro, sizes.mini, sizes.local, sizes.prompts) == (2, 4, 12, 6)
    rollout = rollout_of([[-1.0]] * 12, [[-1.0]] * 12, [[True]] * 12, 6)
    plan = rloo.minibatch_plan(rollout, sizes, 2)
    assert [sum(len(rows) for rows in minibatch) for minibatch in plan] == [4, 4, 4]
    rows = sorted(r for minibatch in plan for micro in minibatch for r in micro.tolist())
    assert rows == list(range(12))
    for minibatch in plan:  # each micro-batch: a prompt's 2 samples, rows i and 6 + i
        for micro in minibatch:
            assert micro[1].item() - micro[0].item() == 6


# ---------------------------------------------------------------- a short run, its numbers checked independently
@pytest.fixture(scope="module")
def short_run(assets, tmp_path_factory):
    """A run of 6 updates, in this process, with every rollout and score recorded as main computed it."""
    out = tmp_path_factory.mktemp("short_run") / "out"
    flags = valid_flags(assets, out) | {"total_episodes": 48, "rloo_k": 2, "per_device_train_batch_size": 8,
                                        "num_ppo_epochs": 2, "learning_rate": 3e-3, "kl_coef": 0.2,
                                        "temperature": 0.9, "dataset_test_split": assets["test"]}
    recorded = run_in_process(flags)
    return {"out": out, "flags": flags, **recorded}


def run_in_process(flags: dict) -> dict:
    """rloo.main with these flags; the rollouts and scores of each update as main held them."""
    rollouts, scores, weights = [], [], []
    collect, score, handlers = rloo.collect_rollout, rloo.score_completions, {
        sig: signal.getsignal(sig) for sig in plumbing.StopSignal.SIGNALS}

    def collect_and_keep(*args, **kwargs):
        rollout = collect(*args, **kwargs)
        weights.append({k: v.detach().clone() for k, v in plumbing.unwrapped(args[0]).state_dict().items()})
        rollouts.append(rollout)  # the object ppo_update fills on-policy: its log-probs are final after the update
        return rollout

    def score_and_keep(sources, completions, *args, **kwargs):
        values, means = score(sources, completions, *args, **kwargs)
        if completions is (rollouts[-1] if rollouts else None):
            scores.append(values.clone())
        return values, means

    rloo.collect_rollout, rloo.score_completions = collect_and_keep, score_and_keep
    try:
        rloo.main(tyro.cli(rloo.Args, args=argv_of(flags)))
    finally:
        rloo.collect_rollout, rloo.score_completions = collect, score
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return {"rollouts": rollouts, "scores": scores, "weights": weights}


def read_lines(out) -> tuple[list[dict], list[dict]]:
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [m for m in lines if "objective/kl" in m], [m for m in lines if "eval/scores" in m]


def test_the_logged_objective_metrics_against_a_naive_loop_over_the_rollouts(short_run):
    train, _ = read_lines(short_run["out"])
    kl_coef = short_run["flags"]["kl_coef"]
    assert len(train) == len(short_run["rollouts"]) == len(short_run["scores"]) == 6
    for metrics, rollout, scores in zip(train, short_run["rollouts"], short_run["scores"]):
        mask, logprobs, ref = rollout.response_mask.tolist(), rollout.logprobs.tolist(), rollout.ref_logprobs.tolist()
        kl = naive_kl_sums(logprobs, ref, mask)
        entropy = [-sum(lp for lp, m in zip(row, mrow) if m) for row, mrow in zip(logprobs, mask)]
        n = len(kl)
        assert metrics["objective/kl"] == pytest.approx(sum(kl) / n, abs=1e-5)
        assert metrics["objective/entropy"] == pytest.approx(sum(entropy) / n, abs=1e-5)
        assert metrics["objective/non_score_reward"] == pytest.approx(-kl_coef * sum(kl) / n, abs=1e-5)
        assert metrics["objective/scores"] == pytest.approx(scores.mean().item(), abs=1e-5)
        assert metrics["objective/rlhf_reward"] == pytest.approx(
            sum(scores[i].item() - kl_coef * kl[i] for i in range(n)) / n, abs=1e-5)
        # TRL 1.16's names, TRL 1.16's meanings: kl per token; reward_std over all completions; frac_reward_zero_std
        # of the prompts whose k KL-penalized rewards (the (k, B) layout: prompt i's are rows i, i + B) are all equal
        assert metrics["kl"] == pytest.approx(sum(kl) / sum(map(sum, mask)), abs=1e-6)
        assert metrics["reward_std"] == pytest.approx(statistics.stdev(scores.tolist()), abs=1e-5)
        rlhf, b = [scores[i].item() - kl_coef * kl[i] for i in range(n)], n // 2
        same = [math.isclose(rlhf[i], rlhf[i + b], abs_tol=1e-7) for i in range(b)]
        assert metrics["frac_reward_zero_std"] == pytest.approx(sum(same) / b)


def test_the_rollouts_log_probs_are_the_models_and_the_kl_to_the_initial_policy_grows_positive(short_run, assets):
    """The reference's log-probs are the initial policy's at every update; the first update's policy log-probs are
    too (the policy starts as the reference); after training the saved policy is measurably away from the initial one,
    with a positive KL on the run's own samples, as objective/kl says."""
    temperature = short_run["flags"]["temperature"]
    initial = AutoModelForCausalLM.from_pretrained(assets["policy"]).eval()
    first, last = short_run["rollouts"][0], short_run["rollouts"][-1]
    rows = range(0, len(first.responses), 3)  # every third completion: the oracle is slow on purpose

    def check(rollout, which, model):
        b = rollout.queries.shape[0]
        for i in rows:
            prompt = rollout.queries[i % b][rollout.query_mask[i % b]].tolist()
            response = rollout.responses[i][rollout.response_mask[i]].tolist()
            expected = naive_logprobs(model, prompt, response, temperature)
            got = getattr(rollout, which)[i][rollout.response_mask[i]].tolist()
            assert got == pytest.approx(expected, abs=1e-4), (which, i)

    check(first, "ref_logprobs", initial)
    check(first, "logprobs", initial)
    check(last, "ref_logprobs", initial)
    # the exact KL (full distributions, per token) of each update's sampling policy to the initial one on that update's
    # own samples: what objective/kl estimates from the sampled tokens alone
    exact = [exact_kl(rollout, weights, initial, temperature)
             for rollout, weights in zip(short_run["rollouts"], short_run["weights"])]
    train, _ = read_lines(short_run["out"])
    sampled = [m["objective/kl"] for m in train]
    assert exact[0] == pytest.approx(0, abs=1e-9) and sampled[0] == pytest.approx(0, abs=1e-6)  # policy = reference
    assert all(kl > 1e-3 for kl in exact[1:]), exact  # training moved the policy away, and KL >= 0
    later = slice(1, None)  # 5 updates x 8 samples: the sampled estimate's noise averages out
    mean_exact, mean_sampled = sum(exact[later]) / 5, sum(sampled[later]) / 5
    assert 0.5 * mean_exact < mean_sampled < 2 * mean_exact, (sampled, exact)
    final_weights = AutoModelForCausalLM.from_pretrained(short_run["out"]).state_dict()
    assert exact_kl(last, final_weights, initial, temperature) > 1e-3  # the saved policy too


def exact_kl(rollout, weights: dict, initial, temperature: float) -> float:
    """Mean over the rollout's completions of sum_t KL(policy(. | context_t) || initial(. | context_t)), the policy
    being `weights` loaded into a copy of the initial model."""
    policy = AutoModelForCausalLM.from_config(initial.config).eval()
    policy.load_state_dict(weights)
    b, total = rollout.queries.shape[0], 0.0
    with torch.no_grad():
        for i in range(len(rollout.responses)):
            prompt = rollout.queries[i % b][rollout.query_mask[i % b]].tolist()
            ids = torch.tensor([prompt + rollout.responses[i][rollout.response_mask[i]].tolist()])
            steps = slice(len(prompt) - 1, ids.shape[1] - 1)
            p = torch.log_softmax(policy(ids).logits[0, steps].double() / temperature, -1)
            q = torch.log_softmax(initial(ids).logits[0, steps].double() / temperature, -1)
            total += (p.exp() * (p - q)).sum().item()
    return total / len(rollout.responses)


def test_evaluation_metrics_against_what_the_reward_function_saw(assets):
    tokenizer = policy_tokenizer()
    policy = tiny_policy(len(tokenizer), seed=3)
    seen = []

    def length_reward(completions, completion_ids, **kwargs):
        seen.extend(completion_ids)
        return [float(len(ids)) * 10 + 1 for ids in completion_ids]

    prompts = [f"{a} {b} :" for a, b in zip("abcdefg", "hijklab")]
    eval_dataset = datasets.Dataset.from_dict({"prompt": prompts,
                                               plumbing.PROMPT_IDS: tokenizer(prompts)["input_ids"]})
    sources = plumbing.RewardSources(None, None, [("length", length_reward)], torch.ones(1))
    args = rloo.Args(response_length=5, eval_max_prompts=6, local_rollout_forward_batch_size=4)
    out = rloo.evaluate(policy, eval_dataset, sources, tokenizer, args, tokenizer.eos_token_id,
                        plumbing.Dist(0, 0, 1, torch.device("cpu")),
                        functools.partial(torch.autocast, "cpu", enabled=False))
    assert len(seen) == 6  # eval_max_prompts of the 7, one completion each
    lengths = [len(ids) for ids in seen]  # each completion's tokens, its EOS included
    assert out["eval/mean_length"] == pytest.approx(sum(lengths) / 6)
    assert out["eval/scores"] == pytest.approx(sum(10 * n + 1 for n in lengths) / 6)
    assert out["eval/eos_frac"] == pytest.approx(sum(ids[-1] == tokenizer.eos_token_id for ids in seen if ids) / 6)


def test_the_evaluation_lines_of_a_run_are_its_reward_on_its_test_prompts(short_run):
    _, evals = read_lines(short_run["out"])
    assert evals and all(0 <= m["eval/eos_frac"] <= 1 and 0 < m["eval/mean_length"] <= 6 for m in evals)


# ---------------------------------------------------------------- reductions over ranks
def test_metrics_reduced_over_two_ranks(tmp_path):
    """Rank r logs objective/scores 1 + r, a count 3 + r, min/max lengths, a peak memory and a rank-0-only optional
    metric: the reduction gives means, sums, minima and maxima as a hand computation does."""
    env = cpu_env({"PYTHONPATH": f"{REPO / 'tests'}:{REPO}"})
    result = subprocess.run([python(), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                             str(REPO / "tests" / "two_rank_metrics.py"), str(tmp_path)],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        out = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert out == {"objective/scores": 1.5, "val/num_eos_tokens": 7.0, "completions/min_length": 2.0,
                       "completions/max_length": 9.0, "memory/peak_gib": 5.0, "reward/f/mean": 4.0,
                       "mismatch/max": 0.75}


# ---------------------------------------------------------------- --sft_model_path end to end
def test_sft_model_path_trains_the_sft_weights_with_the_tokenizer_of_model_name_or_path(assets, tmp_path):
    """The TL;DR recipe's split: the tokenizer at --model_name_or_path (here with other weights beside it), the
    weights at --sft_model_path (no tokenizer there). The policy sampled and its reference are the SFT weights."""
    sft = tmp_path / "sft"
    tiny_policy(len(policy_tokenizer()), seed=7).save_pretrained(sft)
    flags = valid_flags(assets, tmp_path / "out") | {"sft_model_path": sft, "total_episodes": 8, "rloo_k": 2,
                                                     "per_device_train_batch_size": 8, "num_ppo_epochs": 1}
    rollout = run_in_process(flags)["rollouts"][0]
    temperature = rloo.Args().temperature
    for path, expected_equal in ((sft, True), (assets["policy"], False)):
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        for i in (0, 5):
            prompt = rollout.queries[i % 4][rollout.query_mask[i % 4]].tolist()
            response = rollout.responses[i][rollout.response_mask[i]].tolist()
            expected = naive_logprobs(model, prompt, response, temperature)
            for which in ("logprobs", "ref_logprobs"):
                got = getattr(rollout, which)[i][rollout.response_mask[i]].tolist()
                assert (got == pytest.approx(expected, abs=1e-4)) is expected_equal, (path, which, i)
    assert (tmp_path / "out" / "tokenizer.json").exists()  # the tokenizer of --model_name_or_path, saved with it


# ---------------------------------------------------------------- survivors of tests/mutation.py, each by hand
def test_the_last_real_token_under_left_right_and_no_padding():
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 1], [1, 0, 0, 0]])
    assert rloo.last_true_index(mask).tolist() == [2, 3, 3, 0]


def test_per_token_losses_are_zero_on_padding():
    new = torch.tensor([[-1.0, -2.0, 5.0]])  # the third entry is padding with a made-up log-prob
    old = torch.tensor([[-1.0, -1.0, 0.0]])
    losses, _ = policy_loss_of(new, old, torch.tensor([2.0]), torch.tensor([[True, True, False]]), 0.2,
                                 per_token=True)
    # token 1: ratio e^-1 < 0.8, advantage 2 > 0: max(-2 e^-1, -2 * 0.8) = -2 e^-1
    assert losses[0].tolist() == pytest.approx([-2.0, -2 * math.exp(-1), 0.0])


def test_the_loss_normalizer_counts_the_minibatchs_completions():
    rollout = rollout_of([[-1.0]] * 6, [[-1.0]] * 6, [[True]] * 6, 3)
    assert rloo.loss_normalizer(rollout, [torch.tensor([0, 3]), torch.tensor([1, 4])]).item() == 4.0


def test_a_source_that_does_not_apply_adds_nothing_whatever_its_value():
    values = torch.tensor([[1.0, 7.0], [5.0, 2.0]])  # 7.0: a value the source gave with applies False
    applies = torch.tensor([[True, False], [True, True]])
    assert rloo.combine_rewards(values, applies, torch.tensor([1.0, 0.5])).tolist() == [3.5, 1.0]


def test_a_uniform_draw_of_exactly_zero_never_picks_a_leading_masked_token(monkeypatch):
    """torch.rand draws from [0, 1): a draw of 0 must still land on the first token of positive probability."""
    monkeypatch.setattr(torch, "rand", lambda *shape, **kwargs: torch.zeros(*shape))
    logits = torch.tensor([[-math.inf, -math.inf, 0.0, 1.0], [-math.inf, 2.0, -math.inf, 0.0]])
    assert rloo.sample_tokens(logits, 0.7).tolist() == [2, 1]
