"""README.md's "Changing the algorithm" and docs/algorithm.md's "Worked examples": each diff, an edit of one function,
applied to a copy of rloo.py and trained with for a few updates on the tiny models, does what it says."""

import functools
import importlib.util
import math
import re

import pytest
import torch

import plumbing
import rloo
from conftest import REPO, policy_tokenizer, prompt_rows, tiny_policy, tiny_reward_model
from test_components import left_padded
from test_shared_prompt import NO_AUTOCAST

CPU = torch.device("cpu")
K, PROMPTS = 4, 4  # 16 completions an update


def examples() -> dict[str, list[str]]:
    """The sections' diff blocks (an example's hunks), by the bold title of the paragraph before each."""
    found = {}
    for page, heading in (("README.md", "Changing the algorithm"), ("docs/algorithm.md", "Worked examples")):
        section = (REPO / page).read_text().split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
        for block in re.finditer(r"```diff\n(.*?)```", section, re.S):
            prose = re.sub(r"```.*?```", "", section[:block.start()], flags=re.S)  # code may hold a `**`
            title = re.findall(r"\*\*([^*]+)\*\*", prose)[-1]
            found.setdefault(" ".join(title.split()), []).append(block.group(1))
    return found


def edited_rloo(diffs: list[str], tmp_path):
    """rloo.py with the diffs applied (each one's context and removed lines found exactly once), imported as a
    module."""
    source = (REPO / "rloo.py").read_text()
    for diff in (hunk for block in diffs for hunk in re.split(r"^@@.*\n", block, flags=re.M)):  # @@: a new hunk
        lines = diff.splitlines()
        old = "".join(line[1:] + "\n" for line in lines if line[:1] in (" ", "-"))
        new = "".join(line[1:] + "\n" for line in lines if line[:1] in (" ", "+"))
        assert source.count(old) == 1, f"the example's lines are not in rloo.py once:\n{old}"
        source = source.replace(old, new)
    path = tmp_path / "rloo.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"rloo_edited_{tmp_path.name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def train(module, updates: int, score, **flags) -> tuple[torch.nn.Module, list]:
    """`updates` updates of the tiny policy on 4 prompts x 4 completions with module's functions as main calls them:
    sample, log-probs (unless the update computes them; the reference's with kl_coef > 0), score(completions), which
    count in the loss, ppo_update. Returns the policy and each update's (rollout, stats)."""
    tokenizer = policy_tokenizer()
    policy = tiny_policy(len(tokenizer), seed=0)
    reference = tiny_policy(len(tokenizer), seed=0).requires_grad_(False) if flags.get("kl_coef") else None
    args = module.Args(**{"rloo_k": K, "per_device_train_batch_size": K * PROMPTS, "num_ppo_epochs": 1,
                          "temperature": 1.0, "response_length": 5, "kl_coef": 0.0,
                          "local_rollout_forward_batch_size": K * PROMPTS} | flags)
    sizes = module.compute_batch_sizes(args, 1)
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.5)
    generator = torch.Generator().manual_seed(0)
    rows = prompt_rows(PROMPTS * updates, seed=3)
    history = []
    for update in range(updates):
        queries, query_mask = left_padded(tokenizer, [r["prompt"] for r in rows[update * PROMPTS:][:PROMPTS]])
        c = module.sample_completions(policy, queries, query_mask, args.response_length, 1.0, 1, 0, generator, k=K,
                                      filters=module.SamplingFilters.of(args))
        rollout = module.collect_rollout(policy, reference, c, args, True, module.logprobs_from_update(args, sizes, 0),
                                         NO_AUTOCAST, plumbing.PhaseTimer(CPU))
        scores = score(c)  # (k*B,)
        rollout.in_loss = module.completions_in_loss(scores, rollout.ended(1), args)
        torch.manual_seed(update)
        stats = module.ppo_update(policy, optimizer, rollout, scores, args, sizes, True, NO_AUTOCAST)
        history.append((rollout, stats))
    return policy, history


@functools.cache
def reward_model() -> torch.nn.Module:
    return tiny_reward_model(len(policy_tokenizer()))


def reward_model_score(c) -> torch.Tensor:
    return 10 * rloo.reward_model_scores(reward_model(), c, True)  # (k*B,): groups with a spread of rewards


def test_the_sections_have_the_examples():
    assert list(examples()) == ["Equal-reward groups leave the loss", "GRPO's group-normalized advantage",
                                "Another KL estimator in the loss", "Dual-clip PPO", "Epsilon sampling",
                                "An entropy bonus", "DAPO's token mean"]


def weights(policy) -> list[torch.Tensor]:
    return [p.detach().clone() for p in policy.parameters()]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_equal_reward_groups_leave_the_loss(tmp_path):
    """Prompts 0 and 1 get k equal scores: their completions leave the loss (the others stay), their KL no longer
    trains, and the baselines of every group are unchanged."""
    filtered = edited_rloo(examples()["Equal-reward groups leave the loss"], tmp_path)

    def score(c):
        scores = reward_model_score(c).view(K, PROMPTS)  # (k, B)
        scores[:, :2] = 1.0
        return scores.flatten()

    (stock, plain), (policy, history) = (train(module, 2, score, kl_coef=0.1) for module in (rloo, filtered))
    for (rollout, _), (kept, _) in zip(plain, history):
        assert rollout.in_loss is None
        assert kept.in_loss.view(K, PROMPTS).tolist() == [[False, False, True, True]] * K
    torch.testing.assert_close(history[0][0].advantages, plain[0][0].advantages, rtol=0, atol=0)  # the same start
    assert not same(weights(policy), weights(stock))
    both = train(filtered, 1, score, kl_coef=0.1, mask_truncated_completions=True)[1][0][0]
    assert both.in_loss.tolist() == (both.ended(1) & history[0][0].in_loss).tolist()  # with the flag's too


def test_another_kl_estimator_in_the_loss_trains_otherwise(tmp_path):
    """k2 instead of k3, with --kl_in_loss: 2 epochs, so that the policy leaves the reference and the KL acts."""
    k2 = edited_rloo(examples()["Another KL estimator in the loss"], tmp_path)
    flags = {"kl_coef": 1.0, "kl_in_loss": True, "num_ppo_epochs": 2}
    (k3_policy, k3_history), (k2_policy, k2_history) = (train(m, 2, reward_model_score, **flags) for m in (rloo, k2))
    assert not same(weights(k2_policy), weights(k3_policy))
    for rollout, stats in k2_history:  # the reward holds no KL: it is in the loss
        assert torch.equal(rollout.non_score_reward, torch.zeros_like(rollout.non_score_reward))
        assert all(math.isfinite(v) for v in stats.values())
    new, ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])
    batch = k2.Rollout(torch.ones(1, 1, dtype=torch.long), torch.ones(1, 1, dtype=torch.bool), torch.ones(1, 2).long(),
                       torch.ones(1, 2, dtype=torch.bool), new, ref, advantages=torch.zeros(1))
    losses, _ = k2.policy_loss(new, batch, k2.Args(kl_coef=1.0, kl_in_loss=True))
    assert losses.tolist() == pytest.approx([0.5 * (0.5**2 + 1.0**2)])  # sum_t (ref - new)^2 / 2


def test_dual_clip_caps_the_loss_of_a_negative_advantage(tmp_path):
    dual = edited_rloo(examples()["Dual-clip PPO"], tmp_path)
    new = torch.tensor([[math.log(5.0)], [math.log(5.0)], [math.log(0.5)]])  # ratios 5, 5, 0.5
    batch = dual.Rollout(torch.ones(3, 1, dtype=torch.long), torch.ones(3, 1, dtype=torch.bool),
                         torch.ones(3, 1, dtype=torch.long), torch.ones(3, 1, dtype=torch.bool), torch.zeros(3, 1),
                         None, advantages=torch.tensor([-1.0, 1.0, -1.0]))
    for module, expected in ((rloo, [5.0, -1.2, 0.8]), (dual, [3.0, -1.2, 0.8])):  # max(-A r, -A clip(r)), then <= 3|A|
        losses, _ = module.policy_loss(new, batch, module.Args(cliprange=0.2))
        assert losses.tolist() == pytest.approx(expected)
    _, history = train(dual, 2, reward_model_score, num_ppo_epochs=2)
    assert all(math.isfinite(v) for _, stats in history for v in stats.values())


def test_grpo_advantages_have_unit_std_in_each_group(tmp_path):
    grpo = edited_rloo(examples()["GRPO's group-normalized advantage"], tmp_path)
    for module, unit in ((grpo, True), (rloo, False)):
        _, history = train(module, 2, reward_model_score)
        for rollout, _ in history:
            advantages, rewards = (x.view(K, PROMPTS) for x in (rollout.advantages, rollout.rlhf_reward))  # (k, B)
            spread = rewards.std(0) > 0.1  # groups whose rewards differ
            assert spread.sum() >= 2
            torch.testing.assert_close(advantages.mean(0), torch.zeros(PROMPTS), atol=1e-5, rtol=0)
            std = advantages.std(0)[spread]
            assert torch.allclose(std, torch.ones_like(std), atol=1e-3) == unit, std


def mean_entropy(policy, c) -> float:
    with torch.no_grad():
        entropy = rloo.forward_logprobs(policy, c, 1.0, True, with_entropy=True)[1]  # (k*B, Tr)
    return rloo.masked_mean(entropy, c.response_mask).item()


def test_an_entropy_bonus_trains_the_entropy(tmp_path):
    """With every score equal the advantages are 0: RLOO's update changes nothing, the bonus raises the entropy."""
    bonus = edited_rloo(examples()["An entropy bonus"], tmp_path)
    start = tiny_policy(len(policy_tokenizer()), seed=0)
    for module in (rloo, bonus):
        policy, history = train(module, 2, lambda c: torch.zeros(len(c.responses)))
        first = history[0][0]
        changed = any(not torch.equal(p, q) for p, q in zip(policy.parameters(), start.parameters()))
        assert changed == (module is bonus)
        if module is bonus:
            assert mean_entropy(policy, first) > mean_entropy(start, first)  # near log(V) already: a little


def test_dapo_token_mean_divides_by_tokens_whatever_the_micro_batches(tmp_path):
    dapo = edited_rloo(examples()["DAPO's token mean"], tmp_path)
    flags = {"token_level_kl": True, "per_device_train_batch_size": K, "gradient_accumulation_steps": PROMPTS}
    (_, stock), (policy, token_mean) = (train(module, 2, reward_model_score, **flags) for module in (rloo, dapo))
    rollout = stock[0][0]  # the first update's, from the same start
    tokens, completions = rollout.response_mask.sum().item(), len(rollout.responses)
    assert token_mean[0][1]["loss/policy_avg"] == pytest.approx(
        stock[0][1]["loss/policy_avg"] * completions / tokens, rel=1e-4)
    assert tokens != completions
    flags.update(per_device_train_batch_size=2 * K, gradient_accumulation_steps=PROMPTS // 2)
    halves, _ = train(dapo, 2, reward_model_score, **flags)  # the same minibatches in micro-batches twice as large
    for p, q in zip(policy.parameters(), halves.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)


def test_epsilon_sampling_cuts_the_same_tokens_in_the_sampler_and_the_trainer(tmp_path):
    """The filter acts by default (cuts), in the sampler and in the trainer's forward alike: on peaked logits every
    token below epsilon is out of the support; a training run samples, scores and updates with finite values, its
    sampler's log-probs the trainer's."""
    eps = edited_rloo(examples()["Epsilon sampling"], tmp_path)
    filters = eps.SamplingFilters.of(eps.Args(epsilon_cutoff=3e-4))
    assert filters.cuts and not filters.neutral and eps.SamplingFilters.of(eps.Args()).neutral
    logits = torch.tensor([[8.0, 4.0, 0.0, -1.0, -9.0]])  # probabilities ~0.98, 0.018, 3e-4, 1e-4, 4e-8
    kept = eps.sampling_logits(logits, 1.0, filters) > -1e30
    assert kept.tolist() == [[True, True, True, False, False]]
    policy, history = train(eps, 2, reward_model_score, epsilon_cutoff=3e-4)
    for rollout, stats in history:
        assert all(torch.isfinite(torch.tensor(v)) for v in stats.values())
    tokenizer = policy_tokenizer()
    queries, query_mask = left_padded(tokenizer, ["a b :", "c :"])
    c = eps.sample_in_chunks(policy, queries, query_mask, K, eps.Args(rloo_k=K, response_length=5, temperature=1.0,
                                                                      epsilon_cutoff=3e-4),
                             1, 0, torch.Generator().manual_seed(0), NO_AUTOCAST)
    trainer = eps.forward_logprobs(policy, c, 1.0, True, filters=filters)[0] * c.response_mask
    torch.testing.assert_close(c.sampler_logprobs, trainer, atol=2e-6, rtol=0)
