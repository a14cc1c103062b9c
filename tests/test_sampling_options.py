"""TRL's sampling options (--top_k, --top_p, --min_p, --repetition_penalty) and generation options
(--generation_batch_size, --num_generations_eval, --log_completions, --num_completions_to_print): the sampler and the
trainer score one distribution, neutral settings change nothing, active ones change training, resume stays exact."""

import contextlib
import math
import signal

import pytest
import torch
from safetensors.torch import load_file

import plumbing
import rloo
from conftest import policy_tokenizer, prompt_rows, read_metrics, run_rloo, tiny_policy, write_jsonl
from helpers import assert_same_run, interrupt_after_first_update, run_rloo_in_process

CPU = torch.device("cpu")
NO_AUTOCAST = contextlib.nullcontext
OPTIONS = {"top_k": ["--top_k", "3"], "top_p": ["--top_p", "0.6"], "min_p": ["--min_p", "0.9"],
           "repetition_penalty": ["--repetition_penalty", "1.8"]}
NEUTRAL = ["--top_k", "0", "--top_p", "1.0", "--min_p", "0", "--repetition_penalty", "1.0",
           "--num_generations_eval", "1"]
ALL = {"top_k": 5, "top_p": 0.8, "min_p": 0.1, "repetition_penalty": 1.3}
SETTINGS = [{"top_k": 3}, {"top_p": 0.6}, {"min_p": 0.3}, {"repetition_penalty": 1.8}, ALL]


def queries():
    tokenizer = policy_tokenizer()
    return plumbing.pad_sequences([tokenizer(t)["input_ids"] for t in ("a b c :", "d :", "e f a a :")],
                                  tokenizer.pad_token_id, CPU)  # (3, 6)


def reference_logits(logits, temperature, filters, history):
    """The filtered logits of one (V,) row, written out on its own from transformers' logits processors' rules."""
    x = logits.clone().double()
    if filters.repetition_penalty != 1.0:
        for token in set(history):
            x[token] = x[token] * filters.repetition_penalty if x[token] < 0 else x[token] / filters.repetition_penalty
    keep = torch.ones_like(x, dtype=torch.bool)
    scaled = x / temperature
    if filters.top_k:
        keep &= scaled >= scaled.sort(descending=True).values[filters.top_k - 1]
    if filters.top_p < 1:
        probs = scaled.masked_fill(~keep, -math.inf).softmax(-1)
        order = probs.argsort(descending=True)
        mass, nucleus = 0.0, torch.zeros_like(keep)
        for token in order.tolist():  # the fewest most likely tokens whose mass reaches top_p
            nucleus[token] = True
            mass += probs[token].item()
            if mass >= filters.top_p:
                break
        keep &= nucleus
    if filters.min_p:
        probs = scaled.masked_fill(~keep, -math.inf).softmax(-1)
        keep &= probs >= filters.min_p * probs.max()
    return x.masked_fill(~keep, -math.inf)


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: ",".join(s))
def test_sampling_logits_follow_transformers_rules(setting):
    filters = rloo.SamplingFilters(**setting)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 40, generator=gen) * 3  # (6, V)
    history = [torch.randint(0, 40, (5,), generator=gen).tolist() for _ in range(6)]
    seen = torch.zeros(6, 40, dtype=torch.bool)
    for row, tokens in enumerate(history):
        seen[row, tokens] = True
    out = rloo.sampling_logits(logits, 0.7, filters, seen)
    for row in range(6):
        expected = reference_logits(logits[row], 0.7, filters, history[row])
        kept = torch.isfinite(expected)
        assert torch.equal(out[row] > torch.finfo(torch.float32).min, kept)  # the same support
        torch.testing.assert_close(out[row][kept].double(), expected[kept])
    assert torch.isfinite(out).all()  # filtered: the lowest finite float, never -inf


def test_neutral_filters_are_the_logits_themselves():
    logits = torch.randn(4, 10)
    assert rloo.sampling_logits(logits, 0.7, rloo.SamplingFilters(min_p=0.0)) is logits
    assert rloo.SamplingFilters.of(rloo.Args()) == rloo.NO_FILTERS


def test_top_k_and_top_p_keep_ties_and_the_target_at_the_nucleus_edge():
    # four tokens tie at the edge of top_k 2 and of the nucleus: transformers and vLLM keep every tied token
    logits = torch.tensor([[3.0, 1.0, 1.0, 1.0, 1.0, -2.0, -5.0]])
    kept = rloo.sampling_logits(logits, 1.0, rloo.SamplingFilters(top_k=2)) > -1e30
    assert kept.tolist() == [[True, True, True, True, True, False, False]]
    # the trainer's forward may see the drawn token a rounding error outside the sampler's nucleus: it keeps it
    edge = rloo.sampling_logits(logits, 1.0, rloo.SamplingFilters(top_p=0.5))
    assert (edge > -1e30).sum() == 1  # token 0 alone holds more than half the mass
    target = torch.tensor([[3, 6]])  # (1, 2): an edge token and a token far outside
    trainer = rloo.sampling_logits(logits[:, None].expand(1, 2, 7), 1.0, rloo.SamplingFilters(top_p=0.5),
                                   keep=target)  # (1, 2, V)
    logprobs, entropy = plumbing.SelectiveLogSoftmax.apply(trainer, target, 1.0, True)
    assert torch.isfinite(logprobs).all() and torch.isfinite(entropy).all()
    torch.testing.assert_close(logprobs[0, 0], torch.tensor([3.0, 1.0]).log_softmax(-1)[1])  # in a support of two


def test_selective_log_softmax_on_filtered_logits_gives_the_filtered_distributions_values_and_gradients():
    logits = torch.randn(3, 5, 12, dtype=torch.float64).float().requires_grad_()
    targets = torch.randint(0, 12, (3, 5))
    filters = rloo.SamplingFilters(top_k=4, top_p=0.7)
    filtered = rloo.sampling_logits(logits, 0.7, filters, keep=targets)
    logprobs, entropy = plumbing.SelectiveLogSoftmax.apply(filtered, targets, 0.7, True)
    (logprobs.sum() + 0.1 * entropy.sum()).backward()
    support = filtered.detach() > -1e30
    plain = (logits.detach() / 0.7).masked_fill(~support, -math.inf).log_softmax(-1)  # the oracle, with -inf
    torch.testing.assert_close(logprobs.detach(), plain.gather(-1, targets[..., None])[..., 0])
    torch.testing.assert_close(entropy.detach(), -(plain.exp() * plain.nan_to_num(neginf=0.0)).sum(-1))
    assert torch.isfinite(logits.grad).all() and (logits.grad[~support] == 0).all()


@pytest.mark.parametrize("share_prompt", [False, True], ids=["unshared", "shared"])
@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: ",".join(s))
def test_the_samplers_and_the_trainers_log_probs_agree(setting, share_prompt):
    """rloo.py's sampler and the trainer's forward (and its entropy) under each option, prompts shared or not; the
    reference's are of the unfiltered distribution, and its KL is KL(sampled || reference)."""
    policy = tiny_policy(len(policy_tokenizer()))
    args = rloo.Args(rloo_k=3, response_length=8, temperature=0.7, local_rollout_forward_batch_size=6, **setting)
    q, mask = queries()
    c = rloo.sample_in_chunks(policy, q, mask, 3, args, 1, 0, torch.Generator().manual_seed(0), NO_AUTOCAST)
    assert c.response_mask.sum() > 30
    rollout = rloo.collect_rollout(policy, policy, c, args, share_prompt, False, NO_AUTOCAST,
                                   plumbing.PhaseTimer(CPU))
    torch.testing.assert_close(rollout.sampler_logprobs, rollout.logprobs, atol=2e-6, rtol=0)
    logprobs, entropy = rloo.forward_logprobs(policy, c, 0.7, share_prompt, True, rloo.SamplingFilters.of(args))
    assert torch.isfinite(entropy).all()
    torch.testing.assert_close(logprobs * c.response_mask, rollout.logprobs)
    unfiltered = rloo.forward_logprobs(policy, c, 0.7, share_prompt)[0] * c.response_mask
    torch.testing.assert_close(rollout.ref_logprobs, unfiltered)  # the reference: softmax(logits / T), no filter
    if "repetition_penalty" not in setting:  # a filter only removes mass: log p_sampled >= log p_reference
        assert (rollout.logprobs - rollout.ref_logprobs >= -1e-6).all()


def test_the_reference_kl_at_the_start_is_the_mass_the_filter_cut():
    """Policy = reference: the per-token KL is log p_filtered(y) - log p(y) = -log(mass of the support under p)."""
    policy = tiny_policy(len(policy_tokenizer()))
    args = rloo.Args(rloo_k=2, response_length=6, temperature=1.0, top_k=3)
    q, mask = queries()
    c = rloo.sample_in_chunks(policy, q, mask, 2, args, None, 0, torch.Generator().manual_seed(1), NO_AUTOCAST)
    rollout = rloo.collect_rollout(policy, policy, c, args, True, False, NO_AUTOCAST, plumbing.PhaseTimer(CPU))
    inputs = rloo.unshared_inputs(c)
    logits = policy(**inputs).logits[:, q.shape[1] - 1 : -1]  # (k*B, Tr, V)
    mass = logits.softmax(-1).topk(3, dim=-1).values.sum(-1)  # (k*B, Tr) the top-3's mass
    torch.testing.assert_close(rloo.kl_to_reference(rollout), -mass.log(), atol=1e-5, rtol=0)


def test_the_repetition_penalty_reads_each_completions_own_tokens_in_a_grouped_row():
    """tokens_before in the grouped layout (each predictor its own completion's history) equals the plain layout's."""
    policy = tiny_policy(len(policy_tokenizer()))
    q, mask = queries()
    c = rloo.sample_completions(policy, q, mask, 7, 1.0, None, 0, torch.Generator().manual_seed(2), k=3)
    vocab = len(policy_tokenizer())
    plain = rloo.tokens_before(c, vocab)  # (k*g, Tr, V)
    rows = rloo.grouped_rows_for(policy, c)
    grouped = rloo.tokens_before(c, vocab, rows)  # (g, P, V)
    group = torch.arange(3).repeat(3)[:, None]  # (k*g, 1)
    assert torch.equal(grouped[group, rows.slots][c.response_mask], plain[c.response_mask])
    for n in range(9):  # and plain is the prompt's tokens and the response's earlier ones
        for t in range(c.responses.shape[1]):
            expected = set(q[n % 3][mask[n % 3]].tolist()) | set(c.responses[n, :t].tolist())
            assert set(plain[n, t].nonzero().flatten().tolist()) == expected


def test_the_hf_engine_samples_with_the_filters(assets):
    """rloo_multinode.py's hf engine draws through rloo.sample_in_chunks: the same tokens and log-probs."""
    import rloo_multinode

    args = rloo_multinode.Args(model_name_or_path=str(assets["policy"]), rloo_k=2, response_length=6,
                               temperature=0.7, **ALL)
    engine = rloo_multinode.HFEngine(args, CPU)
    q, mask = queries()
    generator = torch.Generator().manual_seed(3)
    out = engine.generate({"queries": q, "query_mask": mask, "k": 2, "stop_token_id": 1, "pad_token_id": 0,
                           "rng_state": generator.get_state(),
                           **rloo_multinode.sampling_request(rloo.SamplingSettings.of(args), args)})
    c = rloo.sample_in_chunks(engine.model, q, mask, 2, args, 1, 0, generator, NO_AUTOCAST)
    answer = rloo_multinode.answered(out, rloo_multinode.Asked("engine 0", 2 * len(q), 6),
                                     engine.model.config.vocab_size, 1, 0)  # as the trainer takes it
    assert torch.equal(answer.responses, c.responses)
    trainer = rloo.forward_logprobs(engine.model, c, 0.7, True, filters=rloo.SamplingFilters.of(args))[0]
    torch.testing.assert_close(answer.sampler_logprobs, trainer * c.response_mask, atol=2e-6, rtol=0)


def test_vllm_sampling_parameters_carry_the_filters():
    import rloo_multinode

    params = rloo_multinode.vllm_sampling(rloo_multinode.Args(top_k=3, repetition_penalty=1.2, min_p=0.1), 1)
    assert (params["top_k"], params["top_p"], params["min_p"], params["repetition_penalty"]) == (3, 1.0, 0.1, 1.2)
    neutral = rloo_multinode.vllm_sampling(rloo_multinode.Args(), 1)
    assert (neutral["top_k"], neutral["top_p"], neutral["min_p"], neutral["repetition_penalty"]) == (0, 1.0, 0.0, 1.0)
    # vLLM applies min-p before top-p, the trainer after: refused together
    with pytest.raises(plumbing.ConfigError, match="vLLM filters by min-p before top-p"):
        rloo_multinode.validate_engine_args(rloo_multinode.Args(min_p=0.1, top_p=0.9), 1)


@pytest.mark.parametrize("values,message", [
    ({"top_p": 0.0}, "top_p = 0.0 must be in (0, 1]"), ({"top_p": 1.5}, "top_p = 1.5 must be in (0, 1]"),
    ({"top_k": -1}, "top_k = -1 must be >= 0"), ({"min_p": 2.0}, "min_p = 2.0 must be in [0, 1]"),
    ({"repetition_penalty": 0.0}, "repetition_penalty = 0.0 must be in [0.01, 100]"),
    ({"repetition_penalty": math.nan}, "repetition_penalty = nan must be"),
    ({"num_generations_eval": 0}, "num_generations_eval = 0 must be at least 1"),
    ({"num_completions_to_print": 0}, "num_completions_to_print = 0 must be at least 1"),
    ({"generation_batch_size": 20}, "--generation_batch_size 20 must be a multiple of"),
    ({"generation_batch_size": 32, "num_mini_batches": 3}, "and not --num_mini_batches 3 with it"),
])
def test_bad_sampling_values_are_refused(values, message):
    args = rloo.Args(model_name_or_path="m", reward_fn=("reward_fns:count_a",), per_device_train_batch_size=8,
                     **values)
    with pytest.raises(plumbing.ConfigError) as refused:
        plumbing.validate_args(args)
        rloo.compute_batch_sizes(args, 1)
    assert message in str(refused.value)


def test_a_bad_sampling_flag_is_one_line_before_models_load(assets, tmp_path):
    result = run_rloo("--model_name_or_path", assets["policy"], "--dataset_name", assets["train"], "--reward_fn",
                      "reward_fns:count_a", "--output_dir", tmp_path / "out", "--top_p", "0")
    assert result.returncode == 2 and result.stderr.strip() == "rloo.py: error: top_p = 0.0 must be in (0, 1] (1: no " \
        "nucleus filter)", result.stderr[-2000:]


def test_generation_batch_size_sets_the_minibatches():
    args = rloo.Args(per_device_train_batch_size=4, gradient_accumulation_steps=2, rloo_k=4,
                     generation_batch_size=48)
    sizes = rloo.compute_batch_sizes(args, world_size=2)  # 4 x 2 x 2 ranks = 16 completions per optimizer step
    assert (sizes.minibatches, sizes.local, sizes.all_ranks, sizes.prompts) == (3, 24, 48, 6)
    assert rloo.compute_batch_sizes(rloo.replace(args, num_mini_batches=3), 2) == sizes  # said twice, alike
    assert not rloo.logprobs_from_update(rloo.replace(args, num_ppo_epochs=1), sizes, 0)  # 3 steps: not on-policy
    one = rloo.compute_batch_sizes(rloo.replace(args, generation_batch_size=16), 2)
    assert one.minibatches == 1 and rloo.logprobs_from_update(rloo.replace(args, num_ppo_epochs=1), one, 0)


def test_the_sample_table_shows_each_prompts_completions_together():
    sizes = rloo.compute_batch_sizes(rloo.Args(per_device_train_batch_size=8, rloo_k=2), 1)  # B = 4
    assert rloo.table_rows(rloo.Args(), sizes) == [0, 1, 2, 3]  # the first completion of (up to 5) prompts
    assert rloo.table_rows(rloo.Args(log_completions=True), sizes) == [0, 4, 1, 5, 2, 6, 3, 7]
    assert rloo.table_rows(rloo.Args(num_completions_to_print=3), sizes) == [0, 4, 1]


# ----- end to end: tiny runs of rloo.py
def tiny_run(assets, out) -> list:
    return ["--model_name_or_path", assets["policy"], "--dataset_name", assets["train"],
            "--dataset_test_split", assets["test"], "--reward_fn", "reward_fns:count_a", "--rloo_k", "2",
            "--per_device_train_batch_size", "8", "--response_length", "6", "--temperature", "1.0",
            "--total_episodes", "24", "--num_ppo_epochs", "2", "--num_sample_generations", "0",
            "--num_evals", "1", "--eval_max_prompts", "4", "--learning_rate", "3e-3", "--output_dir", out]


def run(assets, out, *flags):
    result = run_rloo(*tiny_run(assets, out), *flags)
    assert result.returncode == 0, result.stderr[-3000:]
    return load_file(out / "model.safetensors"), result


def run_here(assets, out, *flags) -> dict:
    """The same run in this process (its imports shared with the other runs of the test): the trained weights."""
    run_rloo_in_process(*tiny_run(assets, out), *flags)
    return load_file(out / "model.safetensors")


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_neutral_settings_train_bit_identically_and_each_option_changes_training(assets, tmp_path):
    # six runs in this process: one import for all (a process of its own each took 5-6 s of imports more)
    plain = run_here(assets, tmp_path / "plain")
    neutral = run_here(assets, tmp_path / "neutral", *NEUTRAL, "--generation_batch_size", "8")
    assert same(plain, neutral)
    for name, flags in OPTIONS.items():
        active = run_here(assets, tmp_path / name, *flags)
        assert not same(plain, active), name
    assert same(plain, run_here(assets, tmp_path / "plain_again"))  # the runs before it left nothing behind


def test_num_generations_eval_and_log_completions(assets, tmp_path):
    _, result = run(assets, tmp_path / "out", "--num_generations_eval", "3", "--log_completions",
                    "--num_completions_to_print", "3")
    assert result.stdout.count("samples at episode") == 3  # every update
    evaluation = [m for m in read_metrics(tmp_path / "out") if "eval/scores" in m]
    assert evaluation and all(math.isfinite(m["eval/scores"]) for m in evaluation)


def test_resume_is_exact_with_every_sampling_option(assets, tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", prompt_rows(64, seed=0))
    common = ["--model_name_or_path", assets["policy"], "--dataset_name", train, "--reward_fn", "reward_fns:count_a",
              "--rloo_k", "4", "--per_device_train_batch_size", "16", "--response_length", "6", "--temperature",
              "1.0", "--num_ppo_epochs", "2", "--num_mini_batches", "2", "--learning_rate", "3e-3",
              "--num_sample_generations", "0", "--num_evals", "0", "--total_episodes", str(32 * 12),
              *[f"--{name}={value}" for name, value in ALL.items()]]
    full, interrupted = tmp_path / "full", tmp_path / "interrupted"
    assert run_rloo(*common, "--output_dir", full).returncode == 0
    interrupt_after_first_update([*common, "--output_dir", interrupted], signal.SIGINT)
    result = run_rloo(*common, "--output_dir", interrupted, "--resume")
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_run(full, interrupted)

