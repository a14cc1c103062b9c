"""rloo.py's pieces on tiny real models: generation, reward reading, re-tokenization, one update, data."""

import json
import math
import sys
import threading

import datasets
import numpy as np
import pytest
import torch

import plumbing
from plumbing.data import describe_dropped, prepare_prompts
from plumbing.measure import forward_bytes_per_row
import rloo
from helpers import left_padded  # noqa: F401 (kept importable from here)
from conftest import LETTERS, policy_tokenizer, tiny_policy, tiny_reward_model, word_tokenizer


def NO_AUTOCAST():
    return torch.autocast("cpu", enabled=False)


# ---------------------------------------------------------------- generation
def test_generation_matches_the_unpadded_greedy_continuation():
    tokenizer = policy_tokenizer()
    policy = tiny_policy(len(tokenizer))
    queries, mask = left_padded(tokenizer, ["a b c d e :", "f :"])  # (2, 6), the second left-padded
    batched = rloo.generate(policy, queries, mask, 6, temperature=0.0, stop_token_id=None, pad_token_id=0)
    for row, text in enumerate(["a b c d e :", "f :"]):
        q, m = left_padded(tokenizer, [text])
        alone = rloo.generate(policy, q, m, 6, temperature=0.0, stop_token_id=None, pad_token_id=0)
        assert batched[row].tolist() == alone[0].tolist()
        # greedy decoding by hand, one full forward per token
        ids = q
        for _ in range(6):
            ids = torch.cat([ids, policy(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
        assert alone[0].tolist() == ids[0, q.shape[1]:].tolist()


@pytest.mark.parametrize("backend", [None, "eager"], ids=["static_cache", "static_cache_compiled"])
def test_static_decoder_samples_the_same_tokens(backend):
    """--compile_generation's cache of fixed length and (dynamo-traced) step give the tokens of the default cache
    sized to each batch, with the same random numbers; the cache is reused across calls of one batch size, prompts
    of any width."""
    tokenizer = policy_tokenizer()
    policy = tiny_policy(len(tokenizer))
    decoder = plumbing.StaticDecoder(policy, max_length=12 + 6, **({"backend": backend} if backend else {}))
    if backend is None:
        decoder.step = policy  # the static cache alone
    for texts in (["a b c d e :", "f :", "g h :"], ["a :", "b c d e f g h :", "c :"]):  # widths 6 then 8
        queries, mask = left_padded(tokenizer, texts)
        for temperature, stop, bf16 in ((0.0, None, False), (1.0, 1, False), (1.0, None, True)):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):  # keys fp32, values bf16
                sized = rloo.generate(policy, queries, mask, 6, temperature, stop, 0,
                                      torch.Generator().manual_seed(3))
                static = rloo.generate(policy, queries, mask, 6, temperature, stop, 0,
                                       torch.Generator().manual_seed(3), decoder)
            assert torch.equal(static, sized)
    assert list(decoder.caches) == [3]


def test_forward_chunks_are_sized_to_the_free_memory(monkeypatch):
    tokenizer = policy_tokenizer()
    policy = tiny_policy(len(tokenizer))
    config, cpu = policy.config, torch.device("cpu")
    h, i, layers, vocab = config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.vocab_size
    assert forward_bytes_per_row(config, "generation", 16, 8, 4) == \
        (4 * h + i) * 24 * 4 + 2 * layers * h * 24 * 4 + 3 * vocab * 4  # activations + KV cache + a step's logits
    assert forward_bytes_per_row(config, "logprobs", 16, 8, 2) == (4 * h + i) * 24 * 2 + 2 * 8 * vocab * 4
    args = rloo.Args(local_rollout_forward_batch_size=0, max_prompt_length=16, response_length=8)
    per_row = forward_bytes_per_row(config, "generation", 16, 8, 4)
    monkeypatch.setattr(plumbing.measure, "free_memory_bytes", lambda device: int(10.5 * per_row / 0.9))
    assert plumbing.rows_per_forward(args, policy, "generation", cpu, 64) == 10  # 90% of what is free
    assert plumbing.rows_per_forward(args, policy, "generation", cpu, 4) == 4  # never more than there are
    assert plumbing.rows_per_forward(args, None, "scoring", cpu, 64) == 64  # no model: nothing to size
    monkeypatch.setattr(plumbing.measure, "free_memory_bytes", lambda device: 0)
    assert plumbing.rows_per_forward(args, policy, "logprobs", cpu, 64) == 1  # at least one row, even when full
    assert plumbing.rows_per_forward(rloo.Args(local_rollout_forward_batch_size=16), policy, "generation", cpu, 64) == 16


def test_generation_pads_after_the_stop_token():
    tokenizer = policy_tokenizer()
    policy = tiny_policy(len(tokenizer))
    with torch.no_grad():  # make the EOS (id 1) likely so some rows stop early
        head = policy.get_output_embeddings().weight  # (V, H)
        head[1] = head[2:].mean(0) + 2 * head.abs().max()
    torch.manual_seed(0)
    queries, mask = left_padded(tokenizer, ["a b :"] * 16)
    c = rloo.sample_completions(policy, queries, mask, 8, temperature=1.0, stop_token_id=1, pad_token_id=0)
    assert c.responses.shape == (16, 8)
    ended = c.ended(1)
    assert ended.any()
    for response, valid in zip(c.responses, c.response_mask):
        stops = (response == 1).nonzero().flatten()
        if len(stops):
            assert valid.sum() == stops[0] + 1 and (response[stops[0] + 1:] == 0).all()


@pytest.mark.parametrize("share_prompt", [True, False], ids=["shared", "unshared"])
def test_forward_logprobs_are_the_sampling_distribution(share_prompt):
    tokenizer = policy_tokenizer()
    policy = tiny_policy(len(tokenizer))
    queries, mask = left_padded(tokenizer, ["a b c :", "d :"])
    c = rloo.sample_completions(policy, queries, mask, 3, temperature=0.7, stop_token_id=None, pad_token_id=0, k=2)
    logprobs, entropy = rloo.forward_logprobs(policy, c, 0.7, share_prompt, with_entropy=True)  # (4, 3) each
    for row in range(4):  # one unpadded step-by-step forward per token; row j*2 + i: sample j of prompt i
        ids = torch.tensor([tokenizer(["a b c :", "d :"][row % 2])["input_ids"]])
        for t in range(3):
            dist = (policy(ids).logits[0, -1] / 0.7).log_softmax(-1)
            token = c.responses[row, t]
            assert logprobs[row, t].item() == pytest.approx(dist[token].item(), abs=1e-5)
            assert entropy[row, t].item() == pytest.approx(-(dist.exp() * dist).sum().item(), abs=1e-5)
            ids = torch.cat([ids, token.view(1, 1)], 1)


class WithoutLogitsToKeep(torch.nn.Module):
    """A causal LM whose forward has no `logits_to_keep` argument, as some remote-code models."""

    def __init__(self, model):
        super().__init__()
        self.model, self.config = model, model.config

    def forward(self, input_ids, attention_mask, position_ids, use_cache, past_key_values=None):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=use_cache, past_key_values=past_key_values)


def test_models_without_logits_to_keep_give_the_same_samples_and_logprobs():
    tokenizer = policy_tokenizer()
    policy = tiny_policy(len(tokenizer))
    wrapped = WithoutLogitsToKeep(policy)
    assert plumbing.accepts_logits_to_keep(policy) and not plumbing.accepts_logits_to_keep(wrapped)
    queries, mask = left_padded(tokenizer, ["a b c :", "d :"])
    tokens = [rloo.generate(m, queries, mask, 5, 0.0, None, 0) for m in (policy, wrapped)]
    assert torch.equal(*tokens)
    c = rloo.sample_completions(policy, queries, mask, 5, temperature=1.0, stop_token_id=None, pad_token_id=0, k=2)
    for share_prompt in (True, False):
        kept, full = (rloo.forward_logprobs(m, c, 1.0, share_prompt)[0] for m in (policy, wrapped))
        assert torch.allclose(kept, full, atol=1e-6)


def test_gradient_checkpointing_gives_the_same_gradients():
    tokenizer = policy_tokenizer()
    queries, mask = left_padded(tokenizer, ["a b c :", "d :"])
    c = rloo.sample_completions(tiny_policy(len(tokenizer)), queries, mask, 5, 1.0, None, 0, k=2)
    grads = []
    for checkpointing in (False, True):
        policy = tiny_policy(len(tokenizer))
        if checkpointing:
            policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        policy.train()  # checkpointing is active in train mode only (dropout is off in these models)
        logprobs, _ = rloo.forward_logprobs(policy, c, 1.0, share_prompt=True)
        logprobs.sum().backward()
        grads.append({n: p.grad for n, p in policy.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, atol=1e-6, rtol=1e-5, msg=name)


# ---------------------------------------------------------------- rewards
def test_reward_is_read_at_the_last_real_token_under_left_and_right_padding():
    tokenizer = policy_tokenizer()
    rm = tiny_reward_model(len(tokenizer))
    texts = ["a b c d e : f g <eos>", "a : b", "c d : e f g h"]
    sequences = [tokenizer(t)["input_ids"] for t in texts]
    # query left-padded, response right-padded, as rollouts are laid out
    rows, masks = [], []  # each row: [left padding][query][response][right padding]
    width = 14
    for seq, n_left in zip(sequences, (2, 5, 3)):
        row = [0] * n_left + seq
        rows.append(row + [0] * (width - len(row)))
        masks.append([False] * n_left + [True] * len(seq) + [False] * (width - len(row)))
    ids, mask = torch.tensor(rows), torch.tensor(masks)
    scores = rloo.sequence_rewards(rm, ids, mask)
    for i, seq in enumerate(sequences):
        alone = rm(torch.tensor([seq])).logits[0, 0]  # no padding at all: HF reads the last token
        assert scores[i].item() == pytest.approx(alone.item(), abs=1e-5)


def test_reward_model_with_another_tokenizer_gets_retokenized_text():
    policy_tok = policy_tokenizer()
    other_tok = word_tokenizer(["<eos>", ":", *reversed(LETTERS), "<pad>"])
    assert plumbing.same_vocabulary(policy_tok, policy_tokenizer())
    assert not plumbing.same_vocabulary(policy_tok, other_tok)
    rm = tiny_reward_model(len(other_tok), seed=3, pad_token_id=other_tok.pad_token_id)
    queries, query_mask = left_padded(policy_tok, ["a b c :", "d :"])
    responses = torch.tensor([[5, 6, 1, 0], [7, 8, 9, 10]])  # "d e <eos>" and "f g h i" (no EOS)
    responses, response_mask = rloo.truncate_after_stop(responses, 1, 0)
    completions = rloo.Completions(queries, query_mask, responses, response_mask)
    sources = plumbing.RewardSources(rm, other_tok, [], torch.tensor([1.0]))
    scores, means = rloo.score_completions(sources, completions, {"prompt": ["a b c :", "d :"]}, "prompt",
                                           policy_tok, 1, 8, NO_AUTOCAST)
    expected = [rm(torch.tensor([other_tok("a b c : d e")["input_ids"] + [other_tok.eos_token_id]])).logits[0, 0],
                rm(torch.tensor([other_tok("d : f g h i")["input_ids"]])).logits[0, 0]]
    assert scores.tolist() == pytest.approx([e.item() for e in expected], abs=1e-5)
    assert means["reward/reward_model/mean"] == pytest.approx(scores.mean().item(), abs=1e-6)


def test_reward_functions_get_texts_ids_and_columns_and_combine_with_weights():
    tokenizer = policy_tokenizer()
    queries, query_mask = left_padded(tokenizer, ["a b :", "c :"])  # B = 2, k = 2 -> 4 completions
    responses = torch.tensor([[2, 1, 0], [4, 4, 1], [2, 3, 4], [4, 1, 0]])  # "a", "c c", "a b c", "c"
    responses, response_mask = rloo.truncate_after_stop(responses, 1, 0)
    completions = rloo.Completions(queries, query_mask, responses, response_mask)
    seen = {}

    def spy(prompts, completions, completion_ids, target, **kwargs):
        seen.update(prompts=prompts, completions=completions, completion_ids=completion_ids, target=target,
                    others=sorted(kwargs))
        return [float(len(c.split())) for c in completions]

    def meddle(prompts, completions, completion_ids, target, **kwargs):  # changes what it is given, in place
        completions.reverse(), prompts.clear(), completion_ids[0].append(99), target.__setitem__(0, "z")
        return [0.0] * len(completions)

    from reward_fns import only_even_lengths
    sources = plumbing.RewardSources(None, None, [("meddle", meddle), ("spy", spy), ("even", only_even_lengths)],
                                 torch.tensor([1.0, 1.0, 10.0]))
    rows = {"prompt": ["a b :", "c :"], "target": ["x", "y"], plumbing.PROMPT_IDS: [[2, 3, 5], [4, 5]]}  # dataset rows
    scores, means = rloo.score_completions(sources, completions, rows, "prompt", tokenizer, 1, 8, NO_AUTOCAST)
    assert seen["prompts"] == ["a b :", "c :", "a b :", "c :"]  # the (k, B) layout
    assert seen["target"] == ["x", "y", "x", "y"]
    assert seen["others"] == []  # not the token ids, not the prompt column a second time
    assert seen["completions"] == ["a", "c c", "a b c", "c"]  # EOS and padding removed
    assert seen["completion_ids"] == [[2, 1], [4, 4, 1], [2, 3, 4], [4, 1]]
    assert scores.tolist() == [1.0, 2.0 + 10.0, 3.0, 1.0]
    assert {k: v for k, v in means.items() if k.endswith("/mean")} == {
        "reward/meddle/mean": 0.0, "reward/spy/mean": 1.75, "reward/even/mean": 1.0}
    assert means["reward/meddle/std"] == 0.0 and means["reward/spy/std"] == pytest.approx(torch.tensor(
        [1.0, 2.0, 3.0, 1.0]).std().item())
    assert math.isnan(means["reward/even/std"])  # one completion it applies to: no spread (NaN, as TRL's nanstd)


def test_reward_function_values_numpy_accepted_and_every_misuse_named():
    call = lambda fn: plumbing.call_reward_function("f", lambda **kwargs: fn(), 3, completions=["a", "b", "c"])  # noqa
    values, applies = call(lambda: [np.float32(0.5), np.int64(2), None])  # numpy scalars, as from np.mean
    assert values.tolist() == [0.5, 2.0, 0.0] and applies.tolist() == [True, True, False]
    assert call(lambda: np.array([1.0, 2.0, 3.0]))[0].tolist() == [1.0, 2.0, 3.0]
    assert call(lambda: torch.tensor([1.0, 2.0, 3.0]))[0].tolist() == [1.0, 2.0, 3.0]
    with torch.no_grad():  # as evaluation calls it: so does the function, in its own thread
        assert call(lambda: [float(torch.is_grad_enabled())] * 3)[0].tolist() == [0.0] * 3
    for returns, message in ((lambda: 1 / 0, "'f' raised ZeroDivisionError: division by zero"),
                             (lambda: 3.0, "'f' returned 3.0, not a list of 3 numbers"),
                             (lambda: [1.0, 2.0], "'f' returned 2 values for 3 completions"),
                             (lambda: [1.0, "2", 3.0], "'f' returned '2' .str. among its values"),
                             (lambda: sys.exit(0), "'f' raised SystemExit: 0"),
                             (lambda: sys.exit(), "'f' raised SystemExit: SystemExit"),
                             (lambda: [1.0, 1e39, 0.0], "'f' returned 1e.39 for completion 1: each value must be a "
                                                        "finite float32"),
                             (lambda: [1.0, None, np.inf], "'f' returned inf for completion 2"),
                             (lambda: [np.float64("nan"), 2.0, 3.0], "'f' returned nan for completion 0")):
        with pytest.raises(plumbing.RewardFunctionError, match=message):  # a timeout only a hang reaches
            plumbing.call_reward_function("f", lambda **kwargs: returns(), 3, 600, completions=["a", "b", "c"])
    never = threading.Event()  # a certain hang: waits for an event that never comes
    with pytest.raises(plumbing.RewardFunctionError, match="'f' did not return within --reward_fn_timeout 0.2 s"):
        plumbing.call_reward_function("f", lambda **kwargs: never.wait(), 3, 0.2, completions=["a", "b", "c"])


# ---------------------------------------------------------------- one update
def test_one_update_with_positive_advantage_raises_that_completions_logprob():
    tokenizer = policy_tokenizer()
    policy = tiny_policy(len(tokenizer))
    plumbing.disable_dropout(policy)
    torch.manual_seed(0)
    queries, query_mask = left_padded(tokenizer, ["a b :", "c d e :"])
    c = rloo.sample_completions(policy, queries, query_mask, 5, 1.0, 1, 0, k=2)  # k = 2, B = 2
    with torch.no_grad():
        old, _ = rloo.forward_logprobs(policy, c, 1.0, share_prompt=True)
    old = old * c.response_mask
    rollout = rloo.Rollout(c.queries, c.query_mask, c.responses, c.response_mask, old, None)
    scores = torch.tensor([1.0, 0.0, 0.0, 0.0])  # (k, B) layout: advantages [1, 0, -1, 0]
    args = rloo.Args(rloo_k=2, per_device_train_batch_size=2, gradient_accumulation_steps=2, num_ppo_epochs=1,
                     temperature=1.0)
    sizes = rloo.compute_batch_sizes(args, 1)
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.5)
    stats, values = rloo.ppo_update(policy, optimizer, rollout, scores, args, sizes, True, NO_AUTOCAST)
    assert values.advantages.tolist() == [1.0, 0.0, -1.0, 0.0]
    with torch.no_grad():
        new, _ = rloo.forward_logprobs(policy, c, 1.0, share_prompt=True)
    new_total = (new * c.response_mask).sum(1)
    assert new_total[0] > old.sum(1)[0] + 1e-3
    assert stats["val/ratio"] == pytest.approx(1.0) and stats["policy/clipfrac_avg"] == 0.0  # one epoch: on-policy


# ---------------------------------------------------------------- data
def test_prompt_sources_string_chat_and_pretokenized(tmp_path):
    tokenizer = policy_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}:"
    rows = [{"prompt": "a b :", "extra": 1}, {"prompt": "c :", "extra": 2}]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = plumbing.load_split(str(path), "ignored", None)
    ds, dropped = prepare_prompts(ds, tokenizer, "prompt", 16, "p.jsonl", None, plumbing.prompt_token_ids)
    assert ds[plumbing.PROMPT_IDS] == [[2, 3, 14], [4, 14]] and dropped | {"empty": 0, "too_long": 0} == dropped
    assert ds["extra"] == [1, 2]

    chat = datasets.Dataset.from_list([{"messages": [{"role": "user", "content": "a b"}]}])
    chat, _ = prepare_prompts(chat, tokenizer, "messages", 16, "chat", None, plumbing.prompt_token_ids)
    assert chat[plumbing.PROMPT_IDS] == [[2, 3, 14]]

    pretokenized = datasets.Dataset.from_dict({"query_token": [[0, 0, 2, 3, 14], [0, 4, 5, 6, 14]]})
    pretokenized.save_to_disk(str(tmp_path / "disk"))
    ds = plumbing.load_split(str(tmp_path / "disk"), "train", None)
    ds, _ = prepare_prompts(ds, tokenizer, "prompt", 16, "disk", None, plumbing.prompt_token_ids)
    assert ds[plumbing.PROMPT_IDS] == [[2, 3, 14], [4, 5, 6, 14]]

    datasets.DatasetDict({"train": chat}).save_to_disk(str(tmp_path / "dict"))
    assert len(plumbing.load_split(str(tmp_path / "dict"), "train", None)) == 1
    with pytest.raises(plumbing.ConfigError, match="no split 'test'"):
        plumbing.load_split(str(tmp_path / "dict"), "test", None)

    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "p.parquet"))
    assert len(plumbing.load_split(str(tmp_path / "p.parquet"), "train", None)) == 2


def test_over_long_and_empty_prompts_are_dropped_and_counted_apart():
    tokenizer = policy_tokenizer()
    ds = datasets.Dataset.from_list([{"prompt": "a b c d :"}, {"prompt": "a :"}, {"prompt": ""}, {"prompt": "b c :"}])
    ds, dropped = prepare_prompts(ds, tokenizer, "prompt", 3, "d", None, plumbing.prompt_token_ids)
    assert {k: dropped[k] for k in ("empty", "too_long")} == {"empty": 1, "too_long": 1} and ds["prompt"] == ["a :", "b c :"]
    assert describe_dropped(dropped, 3) == "1 dropped as longer than 3 tokens, 1 empty"
    with pytest.raises(plumbing.ConfigError, match="longer than max_prompt_length"):
        prepare_prompts(ds.remove_columns("prompt_input_ids"), tokenizer, "prompt", 1, "d", None,
                        plumbing.prompt_token_ids)  # the prompts as read: the ids' column is the script's


def test_a_prompt_longer_by_far_is_tokenized_that_far_only_and_the_drops_still_count_right():
    """A prompt over max_prompt_length x PROMPT_CHARS_PER_TOKEN characters is tokenized that far only (a 200 MB line
    would take minutes and gigabytes): dropped when that part alone has too many tokens; kept, tokenized whole, when
    the tokenizer makes few tokens of many characters (here an unknown word of 1000 letters is one token)."""
    tokenizer, given = policy_tokenizer(), []
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}:"
    limit = 4 * plumbing.data.PROMPT_CHARS_PER_TOKEN

    def token_ids(rows: dict, tokenizer, column: str) -> list[list[int]]:
        given.extend(rows[column])
        return plumbing.prompt_token_ids(rows, tokenizer, column)

    many_words, one_word = "a " * 100_000 + ":", "a " + "x" * 1000 + " :"
    ds = datasets.Dataset.from_list([{"prompt": many_words}, {"prompt": "a b :"}, {"prompt": one_word}])
    ds, dropped = prepare_prompts(ds, tokenizer, "prompt", 4, "d", None, token_ids)
    assert ds["prompt"] == ["a b :", one_word] and ds[plumbing.PROMPT_IDS] == [[2, 3, 14], [2, 0, 14]]
    assert (dropped["too_long"], dropped["cut"]) == (1, 1) and many_words not in given
    assert max(len(prompt) for prompt in given if prompt != one_word) == limit
    assert "max 128 (1 longer than 256 characters, tokenized that far only); 1 dropped as longer than 4 tokens" in \
        plumbing.describe_prompt_lengths(dropped, 4)
    given.clear()
    chat = datasets.Dataset.from_list([{"messages": [{"role": "system", "content": "b " * 100},
                                                     {"role": "user", "content": "c " * 100_000}]},
                                       {"messages": [{"role": "user", "content": "a b"}]}])
    chat, dropped = prepare_prompts(chat, tokenizer, "messages", 4, "chat", None, token_ids)
    assert chat[plumbing.PROMPT_IDS] == [[2, 3, 14]] and (dropped["too_long"], dropped["cut"]) == (1, 1)
    assert max(sum(len(m["content"]) for m in messages) for messages in given) == limit


def test_missing_prompt_column_is_named():
    ds = datasets.Dataset.from_list([{"text": "a"}])
    with pytest.raises(plumbing.ConfigError, match="no 'prompt' column .* columns are \\['text'\\]"):
        prepare_prompts(ds, policy_tokenizer(), "prompt", 8, "d", None, plumbing.prompt_token_ids)


@pytest.mark.parametrize("column", ["completions", "prompts", "completion_ids"])
def test_a_column_named_as_a_reward_functions_argument_is_refused_naming_it(column):
    ds = datasets.Dataset.from_list([{"prompt": "a", column: "x", "label": 1}])

    def fn(completions, **kwargs):
        return [0.0] * len(completions)

    with pytest.raises(plumbing.ConfigError, match=f"dataset d has a column '{column}', the name of an argument"):
        plumbing.check_reward_function_arguments([("fn", fn)], [("d", ds)], "prompt")
    plumbing.check_reward_function_arguments([], [("d", ds)], "prompt")  # no reward function: nothing collides
    plumbing.check_reward_function_arguments([("fn", fn)], [("d", ds.rename_column("prompt", "p"))], column)


def test_a_column_named_as_the_prompt_ids_column_is_refused_not_replaced():
    ds = datasets.Dataset.from_list([{"prompt": "a b", plumbing.PROMPT_IDS: [9, 9, 9]}])
    with pytest.raises(plumbing.ConfigError, match="dataset d\\\\x1b has a column 'prompt_input_ids'.*rename it"):
        prepare_prompts(ds, policy_tokenizer(), "prompt", 8, "d\x1b", None, plumbing.prompt_token_ids)


def test_sampler_cycles_reshuffles_and_splits_ranks():
    samplers = [plumbing.PromptSampler(10, 2, rank, 2, seed=3) for rank in range(2)]
    first_epoch = [samplers[r].next_indices() for _ in range(2) for r in range(2)]
    flat = [i for chunk in first_epoch for i in chunk]
    assert len(set(flat)) == 8  # ranks never share a prompt within an epoch
    next_epoch = samplers[0].next_indices()  # 2 left < 4 per update: the remainder is dropped, reshuffled
    assert samplers[0].epoch == 1 and samplers[0].position == 4
    assert next_epoch == plumbing.PromptSampler(10, 2, 0, 2, seed=4).next_indices()  # epoch 1 = seed + 1 permutation
    with pytest.raises(plumbing.ConfigError, match="has 3 prompts, fewer than one update"):
        plumbing.PromptSampler(3, 2, 0, 2, seed=0)


def test_pad_token_is_added_only_when_the_embedding_has_room():
    tokenizer = word_tokenizer(["<eos>", "a", "b"], pad=None)
    with pytest.raises(plumbing.ConfigError, match="no pad token: save one with a pad token, or pass --pad_token"):
        plumbing.ensure_pad_token(tokenizer, None, 8, "m")
    with pytest.raises(plumbing.ConfigError, match="gives id 3, outside the model's 3-row embedding"):
        plumbing.ensure_pad_token(word_tokenizer(["<eos>", "a", "b"], pad=None), "[PAD]", 3, "m")
    tokenizer = word_tokenizer(["<eos>", "a", "b"], pad=None)
    plumbing.ensure_pad_token(tokenizer, "[PAD]", 8, "m")
    assert tokenizer.pad_token == "[PAD]" and tokenizer.pad_token_id == 3


# ---------------------------------------------------------------- --bf16_generation
def test_the_bf16_sampling_copy_holds_the_new_weights_after_every_update():
    tokenizer = policy_tokenizer()
    policy = tiny_policy(len(tokenizer))
    args = rloo.Args(bf16=True, bf16_generation=True, rloo_k=2, response_length=4, temperature=1.0,
                     local_rollout_forward_batch_size=8)
    rollouts = rloo.LocalRollouts(policy, args, 1, 0, torch.Generator().manual_seed(0), NO_AUTOCAST)
    assert rollouts.sampler is not policy
    for update in (1, 2):
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(torch.randn_like(p) * 0.1)  # an optimizer step
        rollouts.policy_updated(update, policy)
        for s, p in zip(rollouts.sampler.parameters(), policy.parameters()):
            assert s.dtype == torch.bfloat16 and torch.equal(s, p.to(torch.bfloat16))
    queries, mask = left_padded(tokenizer, ["a b :", "c :"])
    rollouts.submit(queries, mask, rloo.SamplingSettings.of(args), torch.tensor([7, 3]))
    completions, _ = rollouts.take()
    assert completions.responses.shape == (4, 4) and completions.prompt_index.tolist() == [7, 3]  # carried


def test_the_bf16_copy_samples_from_the_distribution_of_the_fp32_policy_under_autocast():
    """Along the same token sequences, each next-token distribution of the bf16 copy is within 0.005 total
    variation of the fp32 weights' under bf16 autocast (what sampling used before): bf16 rounding only (0.0003 here)."""
    tokenizer = policy_tokenizer()
    policy = tiny_policy(len(tokenizer))
    copy = plumbing.bf16_copy(policy)
    queries, mask = left_padded(tokenizer, ["a b c d :", "e :", "f g :"])
    c = rloo.sample_completions(copy, queries, mask, 8, 1.0, None, 0, torch.Generator().manual_seed(0), k=4)
    with torch.no_grad():
        inputs = rloo.unshared_inputs(c)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            reference = policy(**inputs).logits.float().softmax(-1)  # (12, Tq + 8, V)
        fast = copy(**inputs).logits.float().softmax(-1)
    positions = slice(queries.shape[1] - 1, -1)  # those that predict a response token
    total_variation = 0.5 * (fast[:, positions] - reference[:, positions]).abs().sum(-1)  # (12, 8)
    assert total_variation.max() < 0.005, total_variation.max()


def test_bf16_generation_needs_bf16_and_a_replicated_policy():
    for flags in ({"bf16_generation": True}, {"bf16_generation": True, "bf16": True, "fsdp": True}):
        with pytest.raises(plumbing.ConfigError, match="--bf16_generation samples from a bf16 copy"):
            plumbing.validate_args(rloo.Args(model_name_or_path="p", reward_fn=("m:f",), **flags))


def test_the_phase_timer_counts_the_tokens_fed_and_the_bytes_each_decoding_step_reads():
    tokenizer = policy_tokenizer()
    policy = tiny_policy(len(tokenizer))
    timer = plumbing.PhaseTimer(torch.device("cpu"))
    timer.count_tokens_of(policy, policy)  # watched once
    queries, mask = left_padded(tokenizer, ["a b :", "c :"])  # (2, 3)
    with timer("generation"):
        rloo.sample_completions(policy, queries, mask, 5, 1.0, None, 0, k=2)
    policy(input_ids=queries)  # outside any phase: not counted
    metrics = timer.metrics()
    assert metrics["work/generation_tokens"] == 2 * 3 + 4 * 4  # the prefill of 2 prompts, 4 steps of 4 rows
    weights = sum(p.nbytes for p in policy.parameters()) - policy.get_input_embeddings().weight.nbytes
    config = policy.config
    cache = 2 * config.num_hidden_layers * 4 * config.hidden_size * (3 + 5) * 4  # K and V, 4 rows of 8 positions, fp32
    assert metrics["work/decode_bytes"] == 4 * (weights + cache)
    timer.start_update()
    assert timer.metrics()["work/forward_tokens"] == 0


def top_level_names(path) -> set[str]:
    """The names a module's own source defines at its top level (functions, classes, assignments), not imports."""
    import ast

    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            names |= {t.id for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                      if isinstance(t, ast.Name)}
    return names


def plumbing_names_used(path) -> set[str]:
    """Every NAME of `plumbing.NAME` and `from plumbing import NAME` in a file's code (not its docstrings or
    comments)."""
    import ast

    tree = ast.parse(path.read_text())
    return {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name) and node.value.id == "plumbing"} | {
        alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module == "plumbing"
        and node.level == 0 for alias in node.names}


def test_each_plumbing_module_names_its_exports_and_every_name_the_scripts_use_is_one_of_them():
    """plumbing/__init__.py star-imports every module: each names what it gives in __all__, only what it defines
    itself (never a module or a name it imports), no name is given by two modules, every plumbing.NAME that the
    repository's scripts use is given by one, and every name given is used by a script (not the tests alone, which
    import a module's other names from the module: plumbing.checkpoints.NAME). A failure names the name and the module
    whose __all__ to fix."""
    import importlib
    from pathlib import Path

    folder = Path(plumbing.__file__).parent
    defined, given, problems = {}, {}, []
    for path in sorted(folder.glob("*.py")):
        if path.name == "__init__.py":
            continue
        module = importlib.import_module(f"plumbing.{path.stem}")
        defined[path.stem] = top_level_names(path)
        if not isinstance(getattr(module, "__all__", None), list):
            problems.append(f"plumbing/{path.name} has no __all__ list: name what it gives as plumbing.NAME")
            continue
        for name in module.__all__:
            if name not in defined[path.stem]:
                problems.append(f"plumbing/{path.name}'s __all__ names {name!r}, which it does not define itself")
            if name in given:
                problems.append(f"{name!r} is in the __all__ of plumbing/{given[name]}.py and of plumbing/{path.name}: "
                                "keep it in one")
            given.setdefault(name, path.stem)
    root = folder.parent
    scripts = [path.relative_to(root) for pattern in ("*.py", "benchmark/**/*.py", "tests/*.py", "docs/*.py")
               for path in sorted(root.glob(pattern)) if path.name != "test_components.py"
               and not any(part.startswith(".") for part in path.relative_to(root).parts)]  # not the environments
    used_by_scripts = set()
    for script in scripts:
        names = plumbing_names_used(root / script) - set(defined)  # plumbing.module.x: a path
        used_by_scripts |= names if script.parts[0] != "tests" else set()
        for name in sorted(names):
            if name not in given:
                home = [stem for stem, names in defined.items() if name in names]
                problems.append(f"plumbing.{name}, used in {script}, is missing from the __all__ of " +
                                (f"plumbing/{home[0]}.py" if home else "any module (no plumbing module defines it)")
                                + (f" (a test: use plumbing.{home[0]}.{name})" if home and script.parts[0] == "tests"
                                   else ""))
    problems += [f"plumbing.{name} is used by no script, only by tests (or nothing): drop it from the __all__ of "
                 f"plumbing/{given[name]}.py" for name in sorted(set(given) - used_by_scripts)]
    assert not problems, "\n".join(problems)
    assert set(given) <= set(dir(plumbing))  # all of them reach the package's namespace
    with pytest.raises(AttributeError, match="it is plumbing.checkpoints.save_checkpoint, a name its module keeps"):
        plumbing.save_checkpoint  # noqa: B018  a name kept to its module: where it is, said


def test_each_plumbing_module_imports_only_the_modules_before_it():
    """The package's rooms, in plumbing/__init__.py's order: a module imports (at its top or inside a function) only
    modules listed before it, so that nothing imports in a cycle."""
    import ast
    import re
    from pathlib import Path

    folder = Path(plumbing.__file__).parent
    order = re.findall(r"^from \.(\w+) import \*", (folder / "__init__.py").read_text(), flags=re.M)
    assert sorted(order) == sorted(p.stem for p in folder.glob("*.py") if p.name != "__init__.py")
    late = [f"plumbing/{module}.py imports .{node.module} (line {node.lineno}), which comes after it"
            for module in order for node in ast.walk(ast.parse((folder / f"{module}.py").read_text()))
            if isinstance(node, ast.ImportFrom) and node.level == 1 and order.index(node.module) >= order.index(module)]
    assert not late, late
