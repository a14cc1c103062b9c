"""Each prompt computed once for its k completions gives what computing it once per completion gives, in every
phase: sampling, log-probs and entropy, reward scores, the loss and its gradients, a whole update (fp32, CPU), on
every architecture of the table; where it cannot (state-space layers) sharing is off and says so."""

from collections import Counter

import pytest
import torch
import transformers

import plumbing
from plumbing.sharing import probe_lengths, shares_prompts, sharing_key, sharing_probe
import rloo
from conftest import policy_loss_of, policy_tokenizer, read_metrics, run_rloo, tiny_reward_model
from helpers import (ARCHITECTURES, TINY, UNEVEN_PROMPTS, architecture_config, eos_prone_policy, sampled,
                     tiny_architecture, trained)


def probe_of(prompt: str) -> rloo.Completions:
    ids = policy_tokenizer()(prompt)["input_ids"]
    return rloo.Completions(**sharing_probe(ids, 8, 6, torch.device("cpu")))


def computed(model, reward_model=False):
    """What main's start-up check compares for the model: log-probs of the response tokens, or a reward model's
    scores."""
    if reward_model:
        return lambda c, share: rloo.reward_model_scores(model, c, share)
    return lambda c, share: rloo.forward_logprobs(model, c, 1.0, share)[0][c.response_mask]


def shares(model, requested, probe, notes, reward_model=False) -> bool:
    """The start-up decision as main makes it: the model's prompt sharing, checked on the probe."""
    name = "reward model" if reward_model else "policy"
    return shares_prompts(model, name, requested, probe, computed(model, reward_model), notes)


@pytest.mark.parametrize("k", [2, 4])
def test_sampling_prefills_each_prompt_once_and_draws_the_same_tokens(k):
    tokenizer, policy = eos_prone_policy()
    queries, query_mask = plumbing.pad_sequences([tokenizer(p)["input_ids"] for p in UNEVEN_PROMPTS], 0,
                                                 torch.device("cpu"))
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
        loss = policy_loss_of(logprobs, old, advantages, c.response_mask, 0.2, per_token=False)[0].mean()
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
    assert not rloo.logprobs_from_update(replace_args(args, num_ppo_epochs=1), rloo.compute_batch_sizes(args, 1), 0)


def replace_args(args: rloo.Args, **changes) -> rloo.Args:
    from dataclasses import replace

    return replace(args, **changes)


@pytest.mark.parametrize("k", [2, 4])
def test_a_whole_update_equals_unshared(k):
    _, c = sampled(k)  # 3 prompts of different widths: 3 micro-batches of one group, accumulated; 2 epochs
    flags = {"per_device_train_batch_size": k, "gradient_accumulation_steps": 3, "num_ppo_epochs": 2}
    shared, unshared = trained(True, c, False, **flags), trained(False, c, False, **flags)
    for name, value in unshared.items():
        if name != "stats":
            torch.testing.assert_close(shared[name], value, atol=1e-6, rtol=1e-5, msg=name)
    assert shared["stats"]["val/ratio"] != 1.0  # the second epoch is off-policy


def test_on_policy_the_update_computes_the_sampling_logprobs_itself():
    _, c = sampled(2)
    flags = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 3, "num_ppo_epochs": 1}
    args = rloo.Args(rloo_k=2, **flags)
    assert rloo.logprobs_from_update(args, rloo.compute_batch_sizes(args, 1), lookahead=0)
    assert not rloo.logprobs_from_update(args, rloo.compute_batch_sizes(args, 1), lookahead=1)  # async: stale weights
    separate, in_update = trained(True, c, False, **flags), trained(True, c, True, **flags)
    for name, value in separate.items():
        if name != "stats":
            torch.testing.assert_close(in_update[name], value, atol=1e-6, rtol=1e-5, msg=name)
    assert in_update["stats"]["val/ratio"] == 1.0 and in_update["stats"]["policy/clipfrac_avg"] == 0.0


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


def greedy_without_cache(model, queries: torch.Tensor, query_mask: torch.Tensor, steps: int) -> torch.Tensor:
    """(N, steps) greedy tokens, each from a whole forward pass of the sequence so far: what sampling must draw."""
    tokens = []
    for _ in range(steps):
        with torch.no_grad():
            logits = model(input_ids=queries, attention_mask=query_mask.long(),
                           position_ids=rloo.position_ids_from_mask(query_mask)).logits[:, -1]  # (N, V)
        tokens.append(logits.argmax(-1))
        queries = torch.cat([queries, tokens[-1][:, None]], 1)
        query_mask = torch.cat([query_mask, torch.ones_like(query_mask[:, :1])], 1)
    return torch.stack(tokens, 1)


@pytest.mark.parametrize("family", ARCHITECTURES)
def test_every_architecture_shares_exactly_or_says_it_does_not(family):
    tokenizer, k = policy_tokenizer(), 3
    policy, fallback = tiny_architecture(family), ARCHITECTURES[family][2]
    queries, query_mask = plumbing.pad_sequences([tokenizer(p)["input_ids"] for p in UNEVEN_PROMPTS], 0,
                                                 torch.device("cpu"))
    # sampling: one prefill per prompt draws what k prefills draw, and greedy decoding what no cache at all gives
    for temperature in (0.0, 1.0):
        shared = rloo.generate(policy, queries, query_mask, 6, temperature, None, 0, torch.Generator().manual_seed(5),
                               k=k)  # (k*B, Tr)
        repeated = rloo.generate(policy, queries.repeat(k, 1), query_mask.repeat(k, 1), 6, temperature, None, 0,
                                 torch.Generator().manual_seed(5))
        assert torch.equal(shared, repeated)
    unbiased = tiny_architecture(family, likely_eos=False)  # its greedy tokens are not all EOS
    assert torch.equal(rloo.generate(unbiased, queries, query_mask, 8, 0.0, None, 0),
                       greedy_without_cache(unbiased, queries, query_mask, 8))
    c = rloo.sample_completions(policy, queries, query_mask, 6, 1.0, 1, 0, torch.Generator().manual_seed(0), k=k)
    assert len(set(c.response_mask.sum(1).tolist())) > 1 and c.query_mask.sum(1).max() + 6 > 4  # rows > window

    probe, notes = probe_of(UNEVEN_PROMPTS[0]), []
    reward_model = tiny_architecture(family, "ForSequenceClassification", seed=1) \
        if hasattr(transformers, type(policy).__name__.replace("ForCausalLM", "ForSequenceClassification")) else None
    if fallback is not None:  # off, in one line; refused when asked for
        assert fallback in plumbing.sharing.why_not_shared(policy)
        # grouped rows would be wrong: each response sees the ones before it through the state
        assert plumbing.sharing.sharing_error(policy, probe, computed(policy)) > 1e-3
        assert not shares(policy, None, probe, notes)
        assert notes == [f"prompt sharing is off for the policy: {plumbing.sharing.why_not_shared(policy)}; it "
                         "computes one row per completion"]
        with pytest.raises(plumbing.ConfigError, match="--share_prompt: the policy cannot share prompts exactly"):
            shares(policy, True, probe, notes)
        return
    assert shares(policy, None, probe, notes) and notes == []  # the start-up check
    if reward_model is not None:
        assert shares(reward_model, None, probe, notes, reward_model=True) and notes == []
    advantages = torch.randn(c.responses.shape[0], generator=torch.Generator().manual_seed(1))
    results = {}
    for share_prompt in (True, False):
        policy.zero_grad()
        logprobs, entropy = rloo.forward_logprobs(policy, c, 1.0, share_prompt, with_entropy=True)  # (k*B, Tr)
        loss = policy_loss_of(logprobs, torch.zeros(c.responses.shape), advantages, c.response_mask, 0.2,
                                per_token=False)[0].mean()
        loss.backward()
        results[share_prompt] = {
            "logprobs": logprobs.detach() * c.response_mask, "entropy": entropy * c.response_mask,
            "rewards": torch.zeros(1) if reward_model is None else rloo.reward_model_scores(reward_model, c,
                                                                                              share_prompt),
            **{name: p.grad.clone() for name, p in policy.named_parameters() if p.grad is not None}}
    assert results[True].keys() == results[False].keys()
    for name, value in results[False].items():
        torch.testing.assert_close(results[True][name], value, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("broken", ["window dropped", "responses see each other"])
def test_the_start_up_check_catches_a_broken_mask_and_falls_back(broken, monkeypatch):
    policy = tiny_architecture("gemma2")
    probe = probe_of(UNEVEN_PROMPTS[0])
    assert shares(policy, None, probe, [])
    grouped_rows = rloo.grouped_rows

    def broken_rows(c, float_mask_dtype=None, windows=None):
        if broken == "window dropped":
            return grouped_rows(c, float_mask_dtype)
        rows = grouped_rows(c, float_mask_dtype, windows)  # sdpa: boolean masks, one per layer type
        length = rows.input_ids.shape[1]
        earlier = torch.ones(length, length, dtype=torch.bool).tril()  # (L, L): the other responses' tokens too
        rows.attention_mask = {kind: mask | earlier if mask.dtype == torch.bool else mask.masked_fill(earlier, 0.0)
                               for kind, mask in rows.attention_mask.items()}  # boolean, or additive floats
        return rows

    monkeypatch.setattr(rloo, "grouped_rows", broken_rows)
    notes = []
    assert not shares(policy, None, probe, notes)
    # the two honest outcomes: the broken rows' results differ (transformers <= 5.23), or the forward itself fails on
    # them (as in transformers 5.24); either way sharing is off, with a note saying which
    assert len(notes) == 1 and notes[0].startswith((
        "prompt sharing is off for the policy: the start-up check found its grouped rows' results ",
        "prompt sharing is off for the policy: its forward fails on grouped rows (")), notes
    with pytest.raises(plumbing.ConfigError, match="start-up check|forward fails on grouped rows"):
        shares(policy, True, probe, [])
    assert not shares(policy, False, probe, [])  # --no-share_prompt: no check needed


def test_a_state_space_policy_trains_unshared_with_one_line_and_share_prompt_is_refused(assets, tmp_path):
    path = tmp_path / "falcon_h1"
    tiny_architecture("falcon_h1").save_pretrained(path)
    policy_tokenizer().save_pretrained(path)
    common = ("--model_name_or_path", path, "--reward_fn", "reward_fns:count_a", "--dataset_name", assets["train"],
              "--total_episodes", 8, "--rloo_k", 4, "--per_device_train_batch_size", 8, "--response_length", 6,
              "--max_prompt_length", 16, "--num_ppo_epochs", 1)
    result = run_rloo(*common, "--output_dir", tmp_path / "default")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "prompt sharing is off for the policy: its hybrid layers read the whole row in order, so responses would " \
           "see each other; it computes one row per completion" in result.stdout
    assert len(read_metrics(tmp_path / "default")) == 1
    result = run_rloo(*common, "--output_dir", tmp_path / "forced", "--share_prompt")
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1].startswith(
        "rloo.py: error: --share_prompt: the policy cannot share prompts exactly: its hybrid layers"), result.stderr


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2"])
def test_the_probe_is_as_long_as_the_check_needs_and_still_catches_a_broken_mask(family, monkeypatch):
    config = architecture_config(family)
    window = getattr(config, "sliding_window", None)
    policy = tiny_architecture(family)
    # TL;DR's lengths: no window, a short probe; a window, rows one token past it with training's responses
    lengths = probe_lengths(512, 53, policy, None)
    assert lengths == ((24, 8) if window is None else (24, 53))
    with_window = type(config)(**{**config.to_dict(), "sliding_window": 100}) if window else None
    if with_window is not None:  # a window longer than the default probe: the probe passes it
        assert probe_lengths(512, 53, type(policy)(with_window)) == (101, 53)
        assert probe_lengths(64, 53, type(policy)(with_window)) == (64, 53)  # never past training's prompts
        assert probe_lengths(512, 53, policy, type(policy)(with_window)) == (101, 53)  # both models'
    assert probe_lengths(10, 3, policy) == (10, 3)  # never longer than training's rows
    ids = policy_tokenizer()(UNEVEN_PROMPTS[0])["input_ids"] * 40
    lengths = probe_lengths(512, 53, policy)
    probe = rloo.Completions(**sharing_probe(ids, *lengths, torch.device("cpu")))
    assert shares(policy, None, probe, [])
    grouped_rows = rloo.grouped_rows

    def responses_see_each_other(c, float_mask_dtype=None, windows=None):
        rows = grouped_rows(c, float_mask_dtype, windows)
        length = rows.input_ids.shape[1]
        earlier = torch.ones(length, length, dtype=torch.bool).tril()  # (L, L)

        def see(mask):  # boolean (sdpa), or additive floats (eager attention: Gemma 2 in newer transformers)
            return mask | earlier if mask.dtype == torch.bool else mask.masked_fill(earlier, 0.0)

        masks = rows.attention_mask
        rows.attention_mask = {kind: see(m) for kind, m in masks.items()} if isinstance(masks, dict) else see(masks)
        return rows

    monkeypatch.setattr(rloo, "grouped_rows", responses_see_each_other)
    notes = []
    assert not shares(policy, None, probe, notes)
    # the two honest outcomes, as in test_the_start_up_check_catches_a_broken_mask_and_falls_back: the results differ,
    # or the forward fails on the broken rows (transformers 5.24)
    assert notes[0].startswith(("prompt sharing is off for the policy: the start-up check found ",
                                "prompt sharing is off for the policy: its forward fails on grouped rows (")), notes
    if window is not None:  # a window dropped shows in the shorter probe too: its rows pass the window
        monkeypatch.setattr(rloo, "grouped_rows", lambda c, float_mask_dtype=None, windows=None:
                            grouped_rows(c, float_mask_dtype))
        assert not shares(policy, None, probe, [])


def test_one_check_for_a_policy_and_reward_model_that_agree(monkeypatch):
    calls = []
    sharing_error = plumbing.sharing.sharing_error
    monkeypatch.setattr(plumbing.sharing, "sharing_error",
                        lambda model, *a: calls.append(model) or sharing_error(model, *a))
    policy, reward_model = tiny_architecture("llama"), tiny_architecture("llama", "ForSequenceClassification", seed=1)
    probe, notes, checked = probe_of(UNEVEN_PROMPTS[0]), [], {}
    assert sharing_key(policy) == sharing_key(reward_model)  # the heads differ, the backbone not
    assert shares_prompts(policy, "policy", None, probe, computed(policy), notes, checked)
    assert shares_prompts(reward_model, "reward model", None, probe, computed(reward_model, True), notes,
                          checked)
    assert calls == [policy] and notes == []  # the reward model's verdict is the policy's check
    for other in (tiny_architecture("llama", "ForSequenceClassification").to(torch.bfloat16),  # another dtype
                  tiny_architecture("mistral", "ForSequenceClassification"),  # another architecture
                  transformers.LlamaForSequenceClassification(transformers.LlamaConfig(
                      **{**TINY, "num_hidden_layers": 3}, num_labels=1))):  # another config
        calls.clear()
        assert sharing_key(other) != sharing_key(policy)
        assert shares_prompts(other, "reward model", None, probe, computed(other, True), notes, checked)
        assert calls == [other]
    # a verdict against sharing is carried as well, with its reason in each model's note
    checked, notes = {}, []
    for seed in (0, 1):
        falcon = tiny_architecture("falcon_h1", seed=seed)
        calls.clear()
        assert not shares_prompts(falcon, "policy", None, probe, computed(falcon), notes, checked)
        assert calls == []  # why_not_shared decides before any forward pass
    assert len(checked) == 1 and len(notes) == 2 and notes[0] == notes[1]
