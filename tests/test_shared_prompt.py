"""Each prompt computed once for its k completions gives what computing it once per completion gives, in every
phase: sampling, log-probs and entropy, reward scores, the loss and its gradients, a whole update (fp32, CPU)."""

from collections import Counter

import pytest
import torch

import rloo
from conftest import policy_tokenizer, tiny_policy, tiny_reward_model

PROMPTS = ["a b c d e f :", "g :", "h i :"]  # 3 prompts of 7, 2 and 3 tokens


def NO_AUTOCAST():
    return torch.autocast("cpu", enabled=False)


def eos_prone_policy(seed: int = 0, attention: str = "sdpa"):
    """A tiny policy whose EOS (id 1) is likely, so that completions end at different lengths."""
    tokenizer = policy_tokenizer()
    policy = tiny_policy(len(tokenizer), seed=seed)
    policy.set_attn_implementation(attention)
    with torch.no_grad():
        policy.get_output_embeddings().weight[1] *= 3
    return tokenizer, policy


def sampled(k: int, attention: str = "sdpa", seed: int = 0) -> tuple[torch.nn.Module, rloo.Completions]:
    tokenizer, policy = eos_prone_policy(attention=attention)
    queries, query_mask = rloo.pad_sequences([tokenizer(p)["input_ids"] for p in PROMPTS], 0, torch.device("cpu"))
    c = rloo.sample_completions(policy, queries, query_mask, 6, 1.0, 1, 0, torch.Generator().manual_seed(seed), k=k)
    assert len(set(c.response_mask.sum(1).tolist())) > 1  # responses of several lengths
    return policy, c


@pytest.mark.parametrize("k", [2, 4])
def test_sampling_prefills_each_prompt_once_and_draws_the_same_tokens(k):
    tokenizer, policy = eos_prone_policy()
    queries, query_mask = rloo.pad_sequences([tokenizer(p)["input_ids"] for p in PROMPTS], 0, torch.device("cpu"))
    for temperature in (0.0, 1.0):
        shared = rloo.generate(policy, queries, query_mask, 6, temperature, 1, 0, torch.Generator().manual_seed(5),
                               k=k)  # (k*B, Tr)
        repeated = rloo.generate(policy, queries.repeat(k, 1), query_mask.repeat(k, 1), 6, temperature, 1, 0,
                                 torch.Generator().manual_seed(5))  # each prompt prefilled k times
        assert torch.equal(shared, repeated)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("k", [2, 4])
def test_logprobs_entropy_rewards_loss_and_gradients_equal_unshared(k, attention):
    policy, c = sampled(k, attention)
    reward_model = tiny_reward_model(len(policy_tokenizer()))
    reward_model.set_attn_implementation(attention)
    advantages = torch.randn(c.responses.shape[0], generator=torch.Generator().manual_seed(1))
    old = torch.zeros(c.responses.shape)
    results = {}
    for share_prompt in (True, False):
        policy.zero_grad()
        logprobs, entropy = rloo.forward_logprobs(policy, c, 1.0, share_prompt, with_entropy=True)  # (k*B, Tr)
        loss, _ = rloo.policy_loss(logprobs, old, advantages, c.response_mask, 0.2)
        loss.backward()
        results[share_prompt] = {
            "logprobs": logprobs.detach() * c.response_mask, "entropy": entropy * c.response_mask, "loss": loss.detach(),
            "rewards": rloo.reward_model_scores(reward_model, c, share_prompt),
            **{name: p.grad.clone() for name, p in policy.named_parameters()}}
    for name, value in results[False].items():
        torch.testing.assert_close(results[True][name], value, atol=1e-5, rtol=1e-4, msg=name)


def test_grouped_rows_put_responses_back_to_back_hide_them_from_each_other_and_count_from_the_prompt():
    c = rloo.Completions(queries=torch.tensor([[0, 7, 8]]), query_mask=torch.tensor([[False, True, True]]),
                         responses=torch.tensor([[3, 4], [5, 0]]),  # k = 2; the second stopped after one token
                         response_mask=torch.tensor([[True, True], [True, False]]))
    rows = rloo.grouped_rows(c)
    assert rows.input_ids.tolist() == [[0, 7, 8, 3, 4, 5]]  # each response at its own length, no padding between
    assert rows.position_ids.tolist() == [[0, 0, 1, 2, 3, 2]]  # each response continues the prompt alone
    assert rows.attention_mask[0, 0].int().tolist() == [[1, 0, 0, 0, 0, 0],  # padding sees only itself
                                                         [0, 1, 0, 0, 0, 0],
                                                         [0, 1, 1, 0, 0, 0],
                                                         [0, 1, 1, 1, 0, 0],  # response 0
                                                         [0, 1, 1, 1, 1, 0],
                                                         [0, 1, 1, 0, 0, 1]]  # response 1: the prompt and itself
    assert rows.predictors.tolist() == [2, 2, 3, 4]  # the prompt's last position once per response, then the rest
    assert rows.targets.tolist() == [[3, 5, 4, 0]]  # what each predicts; the row's last token predicts nothing
    assert rows.slots.tolist() == [[0, 2], [1, 3]]  # response 0: 3 (from 2), 4 (from 3); response 1: 5 (from 2)
    assert rows.last_positions.tolist() == [4, 5]  # where each completion's reward is read


def rollout_of(k: int, num_prompts: int) -> rloo.Rollout:
    lengths = torch.arange(num_prompts) % 3 + 1  # prompts of 1-3 tokens
    query_mask = torch.arange(3)[None, :] >= 3 - lengths[:, None]  # (B, 3) left-padded
    responses = torch.ones(k * num_prompts, 2, dtype=torch.long)
    return rloo.Rollout(torch.ones(num_prompts, 3, dtype=torch.long), query_mask, responses,
                        torch.ones_like(responses, dtype=torch.bool), None, None)


def test_every_micro_batch_holds_whole_prompt_groups_shuffled_by_group():
    k, num_prompts = 4, 8
    rollout = rollout_of(k, num_prompts)
    args = rloo.Args(rloo_k=k, per_device_train_batch_size=8, gradient_accumulation_steps=2, num_mini_batches=2)
    sizes = rloo.compute_batch_sizes(args, 1)
    torch.manual_seed(0)
    plans = [rloo.minibatch_plan(rollout, sizes, k) for _ in range(2)]
    for plan in plans:
        assert len(plan) == 2 and all(len(minibatch) == 2 for minibatch in plan)
        seen = torch.cat([rows for minibatch in plan for rows in minibatch])
        assert sorted(seen.tolist()) == list(range(k * num_prompts))  # every completion once
        for minibatch in plan:
            for rows in minibatch:
                groups = Counter((rows % num_prompts).tolist())
                assert all(count == k for count in groups.values()), groups  # no prompt split between micro-batches
                batch = rloo.micro_batch(rollout, rows, k)
                assert batch.queries.shape[0] == len(groups) and batch.k == k  # one prompt row per group
            lengths = [rollout.query_mask[rows[: len(rows) // k]].sum(1).tolist() for rows in minibatch]
            assert sum(lengths, []) == sorted(sum(lengths, []))  # length-sorted within the minibatch
    assert [r.tolist() for m in plans[0] for r in m] != [r.tolist() for m in plans[1] for r in m]  # reshuffled


def test_micro_batches_smaller_than_a_group_train_single_completions():
    k, num_prompts = 4, 4
    rollout = rollout_of(k, num_prompts)
    args = rloo.Args(rloo_k=k, per_device_train_batch_size=2, gradient_accumulation_steps=8)
    plan = rloo.minibatch_plan(rollout, rloo.compute_batch_sizes(args, 1), k)
    batch = rloo.micro_batch(rollout, plan[0][0], k)
    assert batch.k == 1 and batch.queries.shape[0] == 2  # its own prompt row each
    assert not rloo.skips_logprob_pass(replace_args(args, num_ppo_epochs=1), rloo.compute_batch_sizes(args, 1), 0)


def replace_args(args: rloo.Args, **changes) -> rloo.Args:
    from dataclasses import replace

    return replace(args, **changes)


def trained(share_prompt: bool, c: rloo.Completions, logprobs_from_update: bool, **flags) -> dict:
    """Parameters after a ppo_update from the same start and the same random draws."""
    k = c.k
    policy = tiny_policy(len(policy_tokenizer()), seed=3)
    args = rloo.Args(rloo_k=k, temperature=1.0, kl_coef=0.1, **flags)
    sizes = rloo.compute_batch_sizes(args, 1)
    with torch.no_grad():
        ref, _ = rloo.forward_logprobs(tiny_policy(len(policy_tokenizer()), seed=4), c, 1.0, share_prompt)
        logprobs = None if logprobs_from_update else rloo.forward_logprobs(policy, c, 1.0, share_prompt)[0] * c.response_mask
    rollout = rloo.Rollout(c.queries, c.query_mask, c.responses, c.response_mask, logprobs, ref * c.response_mask)
    scores = torch.randn(c.responses.shape[0], generator=torch.Generator().manual_seed(2))
    advantages = None if logprobs_from_update else rloo.advantages_of(rollout, scores, args).advantages
    torch.manual_seed(7)
    stats = rloo.ppo_update(policy, torch.optim.SGD(policy.parameters(), lr=1.0), rollout, scores, advantages, args,
                            sizes, share_prompt, NO_AUTOCAST)
    return {"stats": stats, "logprobs": rollout.logprobs, **{n: p.detach() for n, p in policy.named_parameters()}}


@pytest.mark.parametrize("k", [2, 4])
def test_a_whole_update_equals_unshared(k):
    _, c = sampled(k)  # 3 prompts of different widths: 3 micro-batches of one group, accumulated; 2 epochs
    flags = {"per_device_train_batch_size": k, "gradient_accumulation_steps": 3, "num_ppo_epochs": 2}
    shared, unshared = trained(True, c, False, **flags), trained(False, c, False, **flags)
    for name, value in unshared.items():
        if name != "stats":
            torch.testing.assert_close(shared[name], value, atol=1e-6, rtol=1e-5, msg=name)
    assert shared["stats"]["ratio"] != 1.0  # the second epoch is off-policy


def test_on_policy_the_update_computes_the_sampling_logprobs_itself():
    _, c = sampled(2)
    flags = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 3, "num_ppo_epochs": 1}
    args = rloo.Args(rloo_k=2, **flags)
    assert rloo.skips_logprob_pass(args, rloo.compute_batch_sizes(args, 1), lookahead=0)
    assert not rloo.skips_logprob_pass(args, rloo.compute_batch_sizes(args, 1), lookahead=1)  # async: stale weights
    assert not rloo.skips_logprob_pass(replace_args(args, normalize_advantage=True), rloo.compute_batch_sizes(args, 1), 0)
    separate, in_update = trained(True, c, False, **flags), trained(True, c, True, **flags)
    for name, value in separate.items():
        if name != "stats":
            torch.testing.assert_close(in_update[name], value, atol=1e-6, rtol=1e-5, msg=name)
    assert in_update["stats"]["ratio"] == 1.0 and in_update["stats"]["clipfrac"] == 0.0


def test_chunks_of_whole_groups_pad_to_their_own_lengths():
    policy, c = sampled(2)
    whole = rloo.forward_logprobs(policy, c, 1.0, True)[0] * c.response_mask
    chunks = rloo.chunks_by_prompt_length(c.query_mask, 1)
    assert [c.query_mask[p].sum().item() for p in chunks] == [2, 3, 7]  # shortest prompt first
    widths = []

    def logprobs(part):
        widths.append(part.queries.shape[1])
        return rloo.forward_logprobs(policy, part, 1.0, True)[0]

    chunked = rloo.in_chunks(c, 2, logprobs, width=c.responses.shape[1]) * c.response_mask  # one group per chunk
    assert widths == [2, 3, 7]  # no chunk padded to the batch's longest prompt
    torch.testing.assert_close(chunked, whole, atol=1e-6, rtol=1e-5)
