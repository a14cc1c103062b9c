"""The update's contract with whoever changes the algorithm: the advantage estimator reads only a completion's own
prompt group (the on-policy update relies on it) and gets its groups shaped (k, g); a minibatch's loss does not
depend on how it is cut into micro-batches."""

import pytest
import torch

import rloo
from helpers import sampled, trained


def random_rollout(k: int = 3, prompts: int = 5, width: int = 4) -> tuple[rloo.Rollout, torch.Tensor]:
    """k completions of each of `prompts` prompts, of different lengths, with random log-probs and scores."""
    gen = torch.Generator().manual_seed(0)
    queries = torch.randint(2, 10, (prompts, 3), generator=gen)
    lengths = torch.randint(1, width + 1, (k * prompts,), generator=gen)  # (k*B,)
    response_mask = torch.arange(width) < lengths[:, None]  # (k*B, Tr)
    responses = torch.randint(2, 10, (k * prompts, width), generator=gen) * response_mask
    logprobs, ref_logprobs = (-torch.rand(k * prompts, width, generator=gen) * response_mask for _ in range(2))
    rollout = rloo.Rollout(queries, torch.ones_like(queries, dtype=torch.bool), responses, response_mask, logprobs,
                           ref_logprobs)
    return rollout, torch.randn(k * prompts, generator=gen)


def check_reads_only_its_own_groups(args: rloo.Args) -> None:
    """compute_advantages (and so rloo.rloo_advantages, whatever it is now) of any whole prompt groups, in any order,
    gives what it gives them in the whole batch."""
    rollout, scores = random_rollout(k=args.rloo_k)
    out = rloo.compute_advantages(rollout, scores, args)
    num_prompts = rollout.queries.shape[0]
    for prompts in ([0], [4, 1], [2, 3, 0], [4, 3, 2, 1, 0]):
        prompts = torch.tensor(prompts)
        rows = rloo.completion_rows(prompts, num_prompts, args.rloo_k)  # (k*g,)
        part = rloo.compute_advantages(rollout.of_prompts(prompts), scores[rows], args)
        whole = out.advantages[rows] if part.advantages.dim() == 1 else \
            out.advantages[rows, :part.advantages.shape[1]]
        torch.testing.assert_close(part.advantages, whole, msg=f"prompts {prompts.tolist()}")
        torch.testing.assert_close(part.rlhf_reward, out.rlhf_reward[rows])


@pytest.mark.parametrize("token_level_kl", [False, True])
def test_the_first_updates_check_runs_compute_advantages_on_the_batch_itself(token_level_kl):
    """rloo.advantages_apart, what the on-policy shortcut waits for: on the rollout with every field it carries,
    stock compute_advantages gives each micro-batch of whole groups what it gives the whole batch; a statistic over
    the batch (--normalize_advantage) does not, and the value is named. The run's random draws are left as they
    were."""
    rollout, scores = random_rollout(k=3)  # 5 prompts
    args = rloo.Args(rloo_k=3, per_device_train_batch_size=3, gradient_accumulation_steps=5, num_ppo_epochs=1,
                     kl_coef=0.3, token_level_kl=token_level_kl)
    sizes, state, draws = rloo.compute_batch_sizes(args, 1), rloo.AlgorithmState.start(args), torch.get_rng_state()
    assert rloo.logprobs_from_update(args, sizes, 0)  # the settings allow the shortcut
    whole = rloo.compute_advantages(rollout, scores, args, state)
    assert rloo.advantages_apart(rollout, scores, whole, args, sizes, state) is None
    args = rloo.replace(args, normalize_advantage=True)
    assert rloo.logprobs_from_update(args, sizes, 0)  # decided on the batch, not on the flags
    whole = rloo.compute_advantages(rollout, scores, args, state)
    why = rloo.advantages_apart(rollout, scores, whole, args, sizes, state)
    assert why.startswith("gives advantages of a micro-batch's prompt groups ") and "away from the whole batch's" in why
    assert torch.equal(torch.get_rng_state(), draws)


@pytest.mark.parametrize("token_level_kl", [False, True])
def test_the_estimator_reads_only_its_own_prompt_group(token_level_kl):
    check_reads_only_its_own_groups(rloo.Args(rloo_k=3, kl_coef=0.3, token_level_kl=token_level_kl))


def batch_baseline(scores, kl, response_mask, kl_coef, token_level):
    """A baseline over the whole batch: it reads other prompts' rewards."""
    rlhf_reward = scores - kl_coef * (kl * response_mask).sum(-1)  # (k, g)
    return rlhf_reward - rlhf_reward.mean(), rlhf_reward


def trl_view_pasted(scores, kl, response_mask, kl_coef, token_level):
    """The leave-one-out baseline with TRL >= 0.22's `view(-1, k)` (its rows are prompt-major) pasted in."""
    rlhf_reward = scores - kl_coef * (kl * response_mask).sum(-1)  # (k, g)
    k = rlhf_reward.shape[0]
    grouped = rlhf_reward.view(-1, k)  # here: k samples of different prompts in a row
    advantages = grouped - (grouped.sum(1, keepdim=True) - grouped) / (k - 1)
    return advantages.view(rlhf_reward.shape), rlhf_reward


@pytest.mark.parametrize("estimator", [batch_baseline, trl_view_pasted])
def test_an_estimator_that_reads_other_groups_is_caught(monkeypatch, estimator):
    monkeypatch.setattr(rloo, "rloo_advantages", estimator)
    with pytest.raises(AssertionError):
        check_reads_only_its_own_groups(rloo.Args(rloo_k=3, kl_coef=0.3))
    # and the on-policy update, which computes each micro-batch's groups apart, trains on other values
    _, c = sampled(2)
    flags = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 3, "num_ppo_epochs": 1}
    separate, in_update = trained(True, c, False, **flags), trained(True, c, True, **flags)
    assert not torch.allclose(in_update["gpt_neox.embed_in.weight"], separate["gpt_neox.embed_in.weight"])


def test_an_estimator_that_loses_the_groups_layout_is_refused(monkeypatch):
    monkeypatch.setattr(rloo, "rloo_advantages", lambda scores, *_: (scores.T, scores))  # (g, k)
    rollout, scores = random_rollout()
    with pytest.raises(ValueError, match=r"advantages \(5, 3\) and rlhf_reward \(3, 5\) for groups \(k, g\) = "
                                         r"\(3, 5\): it must keep that layout"):
        rloo.compute_advantages(rollout, scores, rloo.Args(rloo_k=3))


@pytest.mark.parametrize("token_level_kl", [False, True])
@pytest.mark.parametrize("micro", [1, 3])
def test_an_update_does_not_depend_on_the_micro_batch_split(token_level_kl, micro):
    """The same minibatch (3 prompt groups of k = 2) in micro-batches of m and 2m completions (single completions,
    then whole groups when 2m is a multiple of k), two epochs (the second off-policy, so that clipping acts)."""
    _, c = sampled(2)
    runs = [trained(True, c, False, per_device_train_batch_size=m, gradient_accumulation_steps=6 // m,
                    num_ppo_epochs=2, token_level_kl=token_level_kl) for m in (micro, 2 * micro)]
    for name, value in runs[0].items():
        if name != "stats":
            torch.testing.assert_close(runs[1][name], value, atol=1e-6, rtol=1e-5, msg=name)
    assert runs[0]["stats"]["loss/policy_avg"] == pytest.approx(runs[1]["stats"]["loss/policy_avg"], rel=1e-5)
    stats = runs[0]["stats"]
    assert stats["val/ratio"] != 1.0 and stats["policy/clipfrac_avg"] > 0  # the second epoch clips


@pytest.mark.parametrize("token_level_kl", [False, True])
def test_kl_in_the_loss_trains_otherwise_and_the_same_on_policy_in_the_update(token_level_kl):
    """--kl_in_loss: the KL leaves the reward for the loss, which changes the update; on-policy (the update's own
    forward gives the old log-probs, ratio 1) it trains as the plain path does."""
    _, c = sampled(2)
    flags = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 3, "num_ppo_epochs": 1,
             "token_level_kl": token_level_kl}
    in_reward, in_loss = trained(True, c, False, **flags), trained(True, c, False, kl_in_loss=True, **flags)
    assert not torch.allclose(in_loss["gpt_neox.embed_in.weight"], in_reward["gpt_neox.embed_in.weight"])
    on_policy = trained(True, c, True, kl_in_loss=True, **flags)
    for name, value in in_loss.items():
        if name != "stats":
            torch.testing.assert_close(on_policy[name], value, atol=1e-6, rtol=1e-5, msg=name)


def test_the_update_steps_the_optimizer_at_the_schedules_rates_and_stops_where_the_run_ends():
    """ppo_update sets each optimizer step's learning rate (step s of the run: learning_rate(s)) and takes the first
    `steps` of its num_ppo_epochs x minibatches (TRL 1.16's last update stops at the run's max_steps); TRL 1.16's
    schedule is transformers' stepped after each optimizer step, so the run's first step has the full rate."""
    import plumbing
    from helpers import NO_AUTOCAST, policy_tokenizer, tiny_policy

    rates = []

    class Recorded(torch.optim.SGD):
        def step(self, closure=None):
            rates.append(self.param_groups[0]["lr"])
            return super().step(closure)

    _, c = sampled(k=2)
    args = rloo.Args(rloo_k=2, num_ppo_epochs=2, num_mini_batches=2, per_device_train_batch_size=4, kl_coef=0.0,
                     trl_defaults="1.16", learning_rate=1.0)
    run = plumbing.RunLength(2, 4, 7)  # 7 optimizer steps: 4, then 3
    assert [run.steps_in(u) for u in (1, 2)] == [4, 3]
    schedule = plumbing.learning_rates(args, run)
    assert [schedule(s) for s in range(1, 8)] == pytest.approx([1 - s / 7 for s in range(7)])  # linear, from s - 1
    policy = tiny_policy(len(policy_tokenizer()), seed=3)
    with torch.no_grad():
        logprobs = rloo.forward_logprobs(policy, c, 1.0, False)[0] * c.response_mask  # (k*B, Tr)
    rollout = rloo.Rollout(c.queries, c.query_mask, c.responses, c.response_mask, logprobs, None)
    scores = torch.randn(c.responses.shape[0], generator=torch.Generator().manual_seed(2))
    rloo.ppo_update(policy, Recorded(policy.parameters(), lr=5.0), rollout, scores, args,
                    rloo.compute_batch_sizes(args, 1), False, NO_AUTOCAST, None, 4, None, schedule, run.steps_in(2))
    assert rates == pytest.approx([schedule(s) for s in (5, 6, 7)])  # the second update: steps 5 to 7 of the run
