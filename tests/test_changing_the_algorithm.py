"""README.md's "Changing the algorithm" and docs/algorithm.md's "Worked examples": each diff, an edit of one function,
applied to a copy of rloo.py and trained with for a few updates on the tiny models, does what it says."""

import math
import os
import re
import signal
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import plumbing
from plumbing.checkpoints import reference_tensors
from plumbing.outputdir import latest_checkpoint
import rloo
from conftest import REPO, policy_tokenizer, prompt_rows, read_metrics, run_rloo, tiny_policy
from helpers import (ENGINE_RUN, K, NO_AUTOCAST, PER_UPDATE, PROMPTS, RUN, TWO_RANKS, assert_same_run, edited_rloo,
                     engine_comparable, free_port, interrupt_after_first_update, launch, left_padded,
                     reward_model_score, run_main, stopped_and_resumed_on_two_ranks, train, wait_until, write_jsonl)


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


def test_the_sections_have_the_examples():
    assert list(examples()) == ["Equal-reward groups leave the loss", "GRPO's group-normalized advantage",
                                "Another KL estimator", "Dual-clip PPO", "Epsilon sampling",
                                "An entropy bonus", "DAPO's token mean", "A z-score over the batch",
                                "An adaptive KL controller", "An EMA reference", "A rank-local statistic",
                                "A per-prompt running baseline",
                                "A temperature schedule", "A response-length schedule"]


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
    for (rollout, _, _), (kept, _, _) in zip(plain, history):
        assert rollout.in_loss is None
        assert kept.in_loss.view(K, PROMPTS).tolist() == [[False, False, True, True]] * K
    torch.testing.assert_close(history[0][2].advantages, plain[0][2].advantages, rtol=0, atol=0)  # the same start
    assert not same(weights(policy), weights(stock))
    both = train(filtered, 1, score, kl_coef=0.1, mask_truncated_completions=True)[1][0][0]
    assert both.in_loss.tolist() == (both.ended(1) & history[0][0].in_loss).tolist()  # with the flag's too


def test_another_kl_estimator_in_the_reward_and_in_the_loss(tmp_path):
    """verl's |r| added as a --kl_estimator choice: the reward's penalty is kl_coef x its sum (the k1 log-ratio that
    objective/kl reads unchanged), and with --kl_in_loss the loss's term; it trains otherwise than k1 and k3."""
    absolute = edited_rloo(examples()["Another KL estimator"], tmp_path)
    flags = {"kl_coef": 1.0, "num_ppo_epochs": 2}
    (k1_policy, _), (abs_policy, history) = (train(m, 2, reward_model_score, **flags, **extra)
                                             for m, extra in ((rloo, {}), (absolute, {"kl_estimator": "abs"})))
    assert not same(weights(abs_policy), weights(k1_policy))
    rollout, _, values = history[1]  # the second update's: the policy has left its reference
    log_ratio = (rollout.logprobs - rollout.ref_logprobs) * rollout.response_mask  # (k*B, Tr)
    torch.testing.assert_close(values.non_score_reward, -log_ratio.abs().sum(1), rtol=0, atol=1e-6)
    torch.testing.assert_close(absolute.kl_to_reference(rollout) * rollout.response_mask, log_ratio)
    in_loss = train(absolute, 2, reward_model_score, kl_in_loss=True, kl_estimator="abs", **flags)[1]
    for _, stats, values in in_loss:  # the reward holds no KL: it is in the loss
        assert torch.equal(values.non_score_reward, torch.zeros_like(values.non_score_reward))
        assert stats["policy/kl_abs_avg"] > 0 and all(math.isfinite(v) for v in stats.values())


def test_the_k3_kl_in_the_reward_leaves_objective_kl_k1s(assets, tmp_path):
    """--kl_estimator k3 in a run: the first update samples the same completions from the same policy, so
    objective/kl (the k1 sum) is k1's run's to the bit; the reward is penalized by objective/kl_k3, which differs.
    (--top_k: the policy's sampled distribution is not the reference's from the start, so the KL is not 0.)"""
    flags = {"model_name_or_path": str(assets["policy"]), "dataset_name": str(assets["train"]), "kl_coef": 0.5,
             "num_ppo_epochs": 2, "total_episodes": 2 * K * PROMPTS, "top_k": 5}
    run_main(rloo, **flags, output_dir=str(tmp_path / "k1"))
    run_main(rloo, **flags, output_dir=str(tmp_path / "k3"), kl_estimator="k3")
    k1, k3 = read_metrics(tmp_path / "k1"), read_metrics(tmp_path / "k3")
    assert k3[0]["objective/kl"] == k1[0]["objective/kl"] and "objective/kl_k3" not in k1[0]
    for m in k3:
        assert m["objective/kl_k3"] >= 0 and m["objective/kl_k3"] != m["objective/kl"]
        assert m["objective/non_score_reward"] == pytest.approx(-0.5 * m["objective/kl_k3"], rel=1e-5, abs=1e-7)


def test_dual_clip_caps_the_loss_of_a_negative_advantage(tmp_path):
    dual = edited_rloo(examples()["Dual-clip PPO"], tmp_path)
    new = torch.tensor([[math.log(5.0)], [math.log(5.0)], [math.log(0.5)]])  # ratios 5, 5, 0.5
    batch = dual.Rollout(torch.ones(3, 1, dtype=torch.long), torch.ones(3, 1, dtype=torch.bool),
                         torch.ones(3, 1, dtype=torch.long), torch.ones(3, 1, dtype=torch.bool), torch.zeros(3, 1),
                         None)
    values = dual.Advantages(torch.tensor([-1.0, 1.0, -1.0]), *(torch.zeros(3) for _ in range(3)))
    for module, expected in ((rloo, [5.0, -1.2, 0.8]), (dual, [3.0, -1.2, 0.8])):  # max(-A r, -A clip(r)), then <= 3|A|
        losses, _ = module.policy_loss(new, batch, values, module.Args(cliprange=0.2))
        assert losses.tolist() == pytest.approx(expected)
    _, history = train(dual, 2, reward_model_score, num_ppo_epochs=2)
    assert all(math.isfinite(v) for _, stats, _ in history for v in stats.values())


def test_grpo_advantages_have_unit_std_in_each_group(tmp_path):
    grpo = edited_rloo(examples()["GRPO's group-normalized advantage"], tmp_path)
    for module, unit in ((grpo, True), (rloo, False)):
        _, history = train(module, 2, reward_model_score)
        for _, _, values in history:
            advantages, rewards = (x.view(K, PROMPTS) for x in (values.advantages, values.rlhf_reward))  # (k, B)
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
    for _, stats, _ in history:
        assert all(torch.isfinite(torch.tensor(v)) for v in stats.values())
    tokenizer = policy_tokenizer()
    queries, query_mask = left_padded(tokenizer, ["a b :", "c :"])
    c = eps.sample_in_chunks(policy, queries, query_mask, K, eps.Args(rloo_k=K, response_length=5, temperature=1.0,
                                                                      epsilon_cutoff=3e-4),
                             1, 0, torch.Generator().manual_seed(0), NO_AUTOCAST)
    trainer = eps.forward_logprobs(policy, c, 1.0, True, filters=filters)[0] * c.response_mask
    torch.testing.assert_close(c.sampler_logprobs, trainer, atol=2e-6, rtol=0)


ON_POLICY = {"num_ppo_epochs": 1, "per_device_train_batch_size": K, "gradient_accumulation_steps": PROMPTS}


def test_a_statistic_over_the_batch_trains_the_same_on_policy_as_on_the_plain_path(tmp_path):
    """The z-score over the batch, in compute_advantages alone: with on-policy settings (a prompt group per
    micro-batch) the first update's check finds it and the run keeps the plain path, so it trains as settings that
    never take the shortcut (single completions per micro-batch, the same minibatch); the shortcut taken anyway
    would train on per-group z-scores."""
    zscore = edited_rloo(examples()["A z-score over the batch"], tmp_path)
    on_policy, history = train(zscore, 2, reward_model_score, **ON_POLICY)
    plain, _ = train(zscore, 2, reward_model_score, num_ppo_epochs=1, per_device_train_batch_size=1,
                     gradient_accumulation_steps=K * PROMPTS)
    for p, q in zip(on_policy.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)
    advantages = history[0][2].advantages  # (k*B,) z-scored over the batch: mean 0, std 1
    assert abs(advantages.mean().item()) < 1e-5 and advantages.std().item() == pytest.approx(1.0, abs=1e-4)
    zscore.advantages_apart = lambda *_, **__: None  # the shortcut without its check
    unchecked, _ = train(zscore, 2, reward_model_score, **ON_POLICY)
    assert not same(weights(unchecked), weights(on_policy))


ADDED_FIELD = """
     ref_logprobs: Optional[torch.Tensor]  # (k*B, Tr) reference log-probs (0 on padding); None if kl_coef = 0
+    lengths: Optional[torch.Tensor] = field(default=None, kw_only=True)  # (k*B,) each response's length
@@ main
             has_stop = rollout.ended(stop_token_id)  # (k*B,)
+            rollout.lengths = rollout.response_mask.sum(1).float()  # (k*B,)
@@ compute_advantages
     advantages = advantages.flatten(0, 1)  # (k*g,), or (k*g, Tr)
+    advantages = advantages - 0.1 * {}  # a length penalty
"""


@pytest.mark.parametrize("penalty,shortcut", [("(c.lengths - c.lengths.mean())", False), ("c.lengths", True)],
                         ids=["from-the-batch-mean", "per-completion"])
def test_an_estimator_reading_a_field_added_to_the_rollout_is_checked_on_the_first_update(
        assets, tmp_path, capsys, penalty, shortcut):
    """A field a researcher adds to Rollout, set in main, read by compute_advantages: the first update takes the plain
    path and checks compute_advantages on its own batch with that field; one that reads the batch's mean (not
    local) turns the shortcut off, in one line, and every update keeps the separate log-prob pass; one that reads
    each completion's own keeps it, from the second update on."""
    edited = edited_rloo([ADDED_FIELD.format(penalty)], tmp_path)
    in_update = []
    run_main(edited, model_name_or_path=str(assets["policy"]), dataset_name=str(assets["train"]),
             output_dir=str(tmp_path / "out"), total_episodes=3 * K * PROMPTS, in_update=in_update, **ON_POLICY)
    out = capsys.readouterr().out.splitlines()
    lines = [line for line in out if "on-policy shortcut" in line]
    if shortcut:
        assert len(lines) == 1 and lines[0].startswith("on-policy shortcut on from update 2: "), lines
        assert in_update == [False, True, True]
    else:
        assert len(lines) == 1 and lines[0].startswith("on-policy shortcut off: compute_advantages gives advantages "
                                                       "of a micro-batch's prompt groups "), lines
        assert in_update == [False, False, False]
    assert sum(line.startswith("the PPO ratio was 1 at every step of update 1, ") for line in out) == 1


@dataclass
class KLState(plumbing.checkpoints.FieldsState):  # an AlgorithmState as a researcher extends it
    kl_coef: float = 0.05
    steps: int = 0
    history: list = field(default_factory=list)
    running: torch.Tensor = field(default_factory=lambda: torch.zeros(3))
    pair: tuple = (0.0, 1)


def test_the_algorithm_state_is_saved_whole_or_refused():
    with pytest.raises(AttributeError, match="Args.kl_coef cannot change during a run .* AlgorithmState"):
        rloo.Args().kl_coef = 0.1
    assert rloo.AlgorithmState().state_dict() == {}
    with pytest.raises(ValueError, match=r"its fields are \['kl_coef'\] but AlgorithmState has \[\] \(the code "
                                         r"changed since it was saved\)"):
        rloo.AlgorithmState().load_state_dict({"kl_coef": 0.1})
    saved = KLState(0.2, 3, [1.5, {"a": 2}], torch.ones(3), (0.5, 2)).state_dict()
    state = KLState()
    state.load_state_dict(saved)  # bit for bit, and an int where a float is
    assert (state.kl_coef, state.steps, state.history, state.pair) == (0.2, 3, [1.5, {"a": 2}], (0.5, 2))
    assert torch.equal(state.running, torch.ones(3))
    state.load_state_dict(saved | {"kl_coef": 1})
    assert state.kl_coef == 1


@pytest.mark.parametrize("field_name,value,refusal", [
    ("kl_coef", True, "KLState.kl_coef is True (a bool), not a float"),
    ("kl_coef", float("nan"), "KLState.kl_coef is nan, not a finite number"),
    ("kl_coef", float("inf"), "KLState.kl_coef is inf, not a finite number"),
    ("kl_coef", "0.1", "KLState.kl_coef is '0.1' (a str), not a float"),
    ("kl_coef", torch.tensor(0.1), "KLState.kl_coef is a torch.float32 tensor of shape (), not a float"),
    ("steps", 2.0, "KLState.steps is 2.0 (a float), not an int"),
    ("history", [1.0, float("nan")], "KLState.history[1] is nan, not a finite number"),
    ("history", {"a": 1}, "KLState.history is {'a': 1} (a dict), not a list"),
    ("history", [0] * 20_000_000, "KLState.history holds 20,000,000 values (a state keeps statistics, not data: "
                                  "keep them as a tensor)"),
    ("running", torch.tensor([1.0, float("nan"), 0.0]), "KLState.running holds a value that is not finite"),
    ("running", torch.zeros(3, dtype=torch.int64), "KLState.running is a torch.int64 tensor of shape (3,), not a "
                                                   "torch.float32 tensor"),
    ("running", [0.0, 0.0, 0.0], "KLState.running is [0.0, 0.0, 0.0] (a list), not a torch.float32 tensor"),
    ("pair", (0.5, 1, 2), "KLState.pair is (0.5, 1, 2) (a tuple), not a tuple of 2"),
])
def test_an_algorithm_state_of_the_wrong_type_is_refused_naming_the_field(field_name, value, refusal):
    """A forged or foreign checkpoint's algorithm state: every field against the type of the value the run holds,
    numbers finite, no absurd sizes; nothing set unless every field passes."""
    state = KLState()
    with pytest.raises(ValueError) as refused:
        state.load_state_dict(KLState().state_dict() | {field_name: value})
    assert str(refused.value) == refusal
    assert (state.kl_coef, state.steps, state.history, state.pair) == (0.05, 0, [], (0.0, 1))  # nothing set
    assert torch.equal(state.running, torch.zeros(3))


def test_an_adaptive_kl_controller_resumes_bit_identically(assets, tmp_path):
    """The controller's coefficient moves every update, is saved with the checkpoint, and a run stopped after update
    2 and resumed ends with the metrics and the weights of a run of 4 updates."""
    controller = edited_rloo(examples()["An adaptive KL controller"], tmp_path)
    flags = {"model_name_or_path": str(assets["policy"]), "dataset_name": str(assets["train"]), "kl_coef": 0.5,
             "kl_target": 0.05, "kl_horizon": 2, "num_ppo_epochs": 2}
    run_main(controller, **flags, output_dir=str(tmp_path / "full"), total_episodes=4 * K * PROMPTS)
    run_main(controller, **flags, output_dir=str(tmp_path / "resumed"), total_episodes=2 * K * PROMPTS)
    run_main(controller, **flags, output_dir=str(tmp_path / "resumed"), total_episodes=4 * K * PROMPTS, resume=True)
    coefficients = [m["objective/kl_coef"] for m in read_metrics(tmp_path / "full")]
    assert coefficients[0] == 0.5 and len(set(coefficients)) == 4, coefficients
    saved = torch.load(tmp_path / "resumed" / "checkpoints" / "step_2" / "rank0.pt", weights_only=True)
    assert saved["parts"]["algorithm_state"] == {"kl_coef": coefficients[2]}
    assert_same_run(tmp_path / "full", tmp_path / "resumed")


def test_an_on_policy_run_resumes_with_its_shortcut_verdict_bit_identically(assets, tmp_path):
    """The on-policy shortcut is decided once, on the first update's batch; the checkpoint holds the verdict, so a run
    stopped after update 2 and resumed takes the shortcut at update 3 as the uninterrupted run does (checking again,
    it would take the plain path there: the same values but for rounding) and ends bit-identical to it."""
    flags = {"model_name_or_path": str(assets["policy"]), "dataset_name": str(assets["train"]), "kl_coef": 0.5,
             **ON_POLICY}
    full, stopped, resumed = [], [], []
    run_main(rloo, full, **flags, output_dir=str(tmp_path / "full"), total_episodes=4 * K * PROMPTS)
    run_main(rloo, stopped, **flags, output_dir=str(tmp_path / "resumed"), total_episodes=2 * K * PROMPTS)
    run_main(rloo, resumed, **flags, output_dir=str(tmp_path / "resumed"), total_episodes=4 * K * PROMPTS,
             resume=True)
    assert full == [False, True, True, True] and stopped + resumed == full, (full, stopped, resumed)
    saved = torch.load(tmp_path / "resumed" / "checkpoints" / "step_2" / "rank0.pt", weights_only=True)
    assert saved["parts"]["on_policy_shortcut"] == {"checked": True, "on": True}
    assert_same_run(tmp_path / "full", tmp_path / "resumed")


def test_an_ema_reference_resumes_bit_identically_on_two_ranks(assets, tmp_path):
    """The reference mixed with the policy after every update: its weights differ from the initial model's, so every
    checkpoint saves them (the fingerprint), and the resumed run's KL and weights are the uninterrupted run's."""
    ema = edited_rloo(examples()["An EMA reference"], tmp_path)
    stopped = stopped_and_resumed_on_two_ranks(ema, assets, tmp_path, "--kl_coef", "0.5")
    step = latest_checkpoint(str(stopped))
    saved = torch.load(step / "trainer_state.pt", weights_only=True)["reference"]
    initial = AutoModelForCausalLM.from_pretrained(assets["policy"]).state_dict()
    assert saved.keys() == initial.keys() and not all(torch.equal(saved[k], initial[k]) for k in saved)


def test_the_reference_fingerprint_sees_any_change_and_nothing_else():
    """What decides whether a checkpoint saves the reference: equal weights, equal fingerprints (a stock reference,
    never changed, is not saved); a change of one weight by 1e-7 is seen."""
    tokenizer = policy_tokenizer()
    policy, reference = tiny_policy(len(tokenizer)), tiny_policy(len(tokenizer)).requires_grad_(False)
    assert plumbing.checkpoints.fingerprint(reference_tensors(reference)) == \
        plumbing.checkpoints.fingerprint(reference_tensors(policy))
    before = plumbing.checkpoints.fingerprint(reference_tensors(reference))
    rloo.sync_reference(reference, policy, 0.5)  # the same weights mixed: unchanged
    assert plumbing.checkpoints.fingerprint(reference_tensors(reference)) == before
    with torch.no_grad():
        next(reference.parameters())[0, 0] += 1e-7
    assert plumbing.checkpoints.fingerprint(reference_tensors(reference)) != before


def test_a_rank_local_statistic_resumes_with_each_ranks_own_value(assets, tmp_path):
    """Each rank's running scale of its own scores: saved in its own rank<r>.pt (the ranks' values differ), and the
    resumed run is the uninterrupted one's, bit for bit."""
    local = edited_rloo(examples()["A rank-local statistic"], tmp_path)
    stopped = stopped_and_resumed_on_two_ranks(local, assets, tmp_path)
    step = latest_checkpoint(str(stopped))
    scales = [torch.load(step / f"rank{r}.pt", weights_only=True)["parts"]["algorithm_state"]["score_scale"]
              for r in (0, 1)]
    assert scales[0] != scales[1] and all(0 < s < 5 for s in scales), scales


def test_a_per_prompt_running_baseline_resumes_bit_identically_on_two_ranks(assets, tmp_path):
    """Each prompt's mean reward over its earlier updates, in one table every rank holds alike: 8 prompts on two ranks
    of 4 each, so every update is an epoch and every prompt is trained in each, on the rank the epoch's shuffle
    deals it to; stopped by SIGTERM and resumed, the run is the uninterrupted one's bit for bit, and at the end both
    ranks hold the same table, each prompt counted once per update."""
    baseline = edited_rloo(examples()["A per-prompt running baseline"], tmp_path)
    eight = write_jsonl(tmp_path / "eight.jsonl", prompt_rows(8, seed=5))
    stopped = stopped_and_resumed_on_two_ranks(baseline, {**assets, "train": eight}, tmp_path)
    tables = [torch.load(stopped / "checkpoints" / "step_4" / f"rank{r}.pt", weights_only=True)["parts"][
        "algorithm_state"] for r in (0, 1)]
    assert tables[0]["visits"].tolist() == [4] * 8 and torch.equal(tables[1]["visits"], tables[0]["visits"])
    assert torch.equal(tables[0]["prompt_reward"], tables[1]["prompt_reward"])
    assert tables[0]["prompt_reward"].abs().sum() > 0


def test_every_batch_carries_the_rows_its_prompts_were_drawn_from(assets, tmp_path):
    """Completions.prompt_index, from main's draw through the rollout source (LocalRollouts) into every chunk and
    micro-batch: each prompt of each update's batch is the text of the dataset row it names."""
    import json

    rows = [json.loads(line)["prompt"] for line in assets["train"].read_text().splitlines()]
    tokenizer = policy_tokenizer()
    for rollout in run_main(rloo, model_name_or_path=str(assets["policy"]), dataset_name=str(assets["train"]),
                            output_dir=str(tmp_path / "out"), total_episodes=2 * K * PROMPTS, **ON_POLICY):
        assert rollout.prompt_index.dtype == torch.long and rollout.prompt_index.shape == (PROMPTS,)
        texts = [tokenizer.decode(q[m]) for q, m in zip(rollout.queries, rollout.query_mask)]
        assert texts == [tokenizer.decode(tokenizer(rows[i])["input_ids"]) for i in rollout.prompt_index.tolist()]
        part = rloo.micro_batch(rollout, rloo.completion_rows(torch.tensor([2, 0]), PROMPTS, K), K)
        assert part.prompt_index.tolist() == rollout.prompt_index[[2, 0]].tolist()
        single = rollout.one_per_row(torch.tensor([1, PROMPTS + 3]))  # completion 1 of prompt 1, 1 of prompt 3
        assert single.prompt_index.tolist() == rollout.prompt_index[[1, 3]].tolist()


@dataclass
class Counted(plumbing.UpdateState):  # a state of the same rules as AlgorithmState
    count: int = 0
    running: torch.Tensor = field(default_factory=lambda: torch.zeros(2))

    def after_update(self, step: float) -> dict:
        self.count += 1
        self.running = self.running + step
        return {"count": self.count}


def test_the_algorithm_state_changes_only_in_after_update_and_only_to_finite_values():
    """An assignment outside after_update is refused at once, naming the field, the place and the method; a change
    in place is found at the next call; a value that is not finite is refused when the call returns; a restore sets
    the fields."""
    state = Counted()
    assert state.after_update(1.0) == {"count": 1} and state.count == 1
    with pytest.raises(AttributeError) as refused:
        state.count = 5
    assert re.fullmatch(r"Counted\.count is assigned in test_the_algorithm_state_changes_only_in_after_update_and_only_"
                        r"to_finite_values \(test_changing_the_algorithm\.py:\d+\): the algorithm's state changes only in "
                        r"Counted\.after_update, which main calls once per update after training \(so that a stop, a "
                        r"fault and a resume find it as it was at the update's start\): make the change there",
                        str(refused.value)), str(refused.value)
    assert state.count == 1
    state.running.add_(1.0)  # in place: seen at the next call
    with pytest.raises(RuntimeError, match=r"^Counted\.running changed in place outside Counted\.after_update "):
        state.after_update(1.0)
    restored = Counted()
    restored.load_state_dict({"count": 3, "running": torch.ones(2)})
    assert restored.after_update(0.5) == {"count": 4} and restored.running.tolist() == [1.5, 1.5]
    with pytest.raises(plumbing.Fault, match=r"^Counted\.running holds a value that is not finite after "
                                             r"Counted\.after_update: a checkpoint keeps finite state only, so the run "
                                             r"stops here with nothing saved"):
        Counted().after_update(float("nan"))
    stock = rloo.AlgorithmState.start(rloo.Args(), 3)
    assert stock.after_update(rloo.Args(), None, None, None, {}) == {} and stock.state_dict() == {}


DRAWN_INTO_THE_STATE = """
     Stock RLOO keeps none; docs/algorithm.md has worked examples.\"\"\"
+    drawn: list = field(default_factory=list)  # every prompt drawn so far
@@ main
                     batch = plumbing.PromptBatch.of(dataset, rows, sampler_state, tokenizer.pad_token_id, device)
+                    state.drawn = state.drawn + rows  # where the batch is drawn
"""


def test_the_algorithm_state_changed_where_a_batch_is_drawn_is_refused_at_once(assets, tmp_path):
    """The natural place for a replay buffer, where main draws a batch: a stop during the update would save the state
    of after the draw with the sampler of before it. Refused on the first update, naming the field and the line."""
    edited = edited_rloo([DRAWN_INTO_THE_STATE], tmp_path)
    line = next(i for i, text in enumerate(Path(edited.__file__).read_text().splitlines(), 1) if "state.drawn =" in text)
    with pytest.raises(AttributeError, match=rf"^AlgorithmState\.drawn is assigned in main \(rloo\.py:{line}\): the "
                                             r"algorithm's state changes only in AlgorithmState\.after_update, "):
        run_main(edited, model_name_or_path=str(assets["policy"]), dataset_name=str(assets["train"]),
                 output_dir=str(tmp_path / "out"), total_episodes=2 * K * PROMPTS)


OWN_PART = """
+@dataclass
+class Drawn(plumbing.checkpoints.FieldsState):  # a stateful part of the researcher's own: the prompts drawn so far
+    count: int = 0
+
+
 def main(args: Args, make_rollouts: Callable[..., RolloutSource] = LocalRollouts) -> None:
@@ main
         generators = plumbing.Generators(args.seed + dist_info.rank, device)
+        so_far = Drawn()
@@ main
             algorithm_state=state,  # this and every part below: per rank, each rank's own
+            drawn=so_far,
@@ main
                     batch = plumbing.PromptBatch.of(dataset, rows, sampler_state, tokenizer.pad_token_id, device)
+                    so_far.count += len(rows)  # changed where the batch is drawn
@@ main
                 scores = apply_missing_eos_penalty(raw_scores, has_stop, args.missing_eos_penalty)  # (k*B,)
+                scores = scores + 0.01 * so_far.count
"""


def test_a_stop_while_a_reward_function_runs_saves_every_part_as_the_update_found_it(assets, tmp_path):
    """SIGTERM while update 3's reward function runs (it hangs there) stops the run at once with the checkpoint of
    update 2, every part of it as update 3 found it: a part of the researcher's own that changes where each batch is
    drawn (before the reward call), the adaptive KL controller's state, the sampler, the generators. So the resumed
    run is the uninterrupted one, bit for bit (a part saved as the stop found it would count update 3's draw twice)."""
    edited = edited_rloo(examples()["An adaptive KL controller"] + [OWN_PART], tmp_path)
    script = Path(edited.__file__)
    common = ["--model_name_or_path", assets["policy"], "--dataset_name", assets["train"], "--reward_fn",
              "reward_fns:misbehaving", *TWO_RANKS[2:], "--kl_coef", "0.5", "--kl_target", "0.05", "--kl_horizon", "2",
              "--total_episodes", 3 * 16]  # 3 updates: the stopped run ends in the third, the resumed one runs it
    env = {"PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO)])}
    full, stopped, hanging = tmp_path / "full", tmp_path / "stopped", tmp_path / "hanging"
    result = run_rloo(*common, "--output_dir", full, env=env, script=str(script))
    assert result.returncode == 0, result.stderr[-3000:]
    process = launch([*common, "--output_dir", stopped], script=script, env={
        "REWARD_MISBEHAVES_AT_CALL": "3", "REWARD_MISBEHAVIOUR": "hang", "REWARD_HANGING": str(hanging)})
    try:
        wait_until(hanging.exists, process, "the reward function hanging")
        process.send_signal(signal.SIGTERM)
        stdout, stderr = process.communicate(timeout=600)
    finally:
        process.kill()
    assert "SIGTERM received while a reward function ran: stopped at once; checkpoint of update 2" in stdout, stderr
    saved = torch.load(stopped / "checkpoints" / "step_2" / "rank0.pt", weights_only=True)
    assert saved["parts"]["drawn"] == {"count": 2 * 4}  # 4 prompts an update: update 3's draw is not in it
    result = run_rloo(*common, "--output_dir", stopped, "--resume", env=env, script=str(script))
    assert result.returncode == 0 and "resuming from" in result.stdout, result.stderr[-3000:]
    assert_same_run(full, stopped)


DIVERGING = {
    "epochs stopped on one rank": ("""
     for epoch in range(-(-steps // sizes.minibatches)):
+        if epoch == 1 and dist.get_rank() == 1:  # its own early stop
+            break
""", "the ranks would diverge at an optimizer step: rank 0: takes step 2 (epoch 2): micro-batches 1; rank 1: ends "
     "its update after step 1; every rank must take the same path through an update (decide it from values reduced "
     "over ranks, which every rank holds alike)"),
    "a metric logged on one rank": ("""
             episode = update * sizes.all_ranks
+            metrics.update({"objective/rank_zero": 1.0} if dist.get_rank() == 0 else {})
""", "the metric 'objective/rank_zero' is logged on rank 0 only: every rank must log the same metrics, which are "
     "reduced over ranks together; log it on every rank"),
}


@pytest.mark.parametrize("case", DIVERGING, ids=list(DIVERGING))
def test_ranks_that_would_diverge_stop_at_once_saying_what_differs_on_which_rank(assets, tmp_path, case):
    """Two ranks of a copy that takes another path on one rank: before the collectives that would not match (gloo's
    "Received data size doesn't match", or a wait until --ddp_timeout), every rank stops with one line naming the
    difference and the ranks, on the first update. The copy has a name of its own, which its errors carry."""
    edit, said = DIVERGING[case]
    script = edited_rloo([edit], tmp_path, "my_rloo.py").__file__
    result = run_rloo("--model_name_or_path", assets["policy"], "--dataset_name", assets["train"], *TWO_RANKS,
                      "--output_dir", tmp_path / "out", nproc=2, script=script,
                      env={"PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO)])})
    assert result.returncode != 0 and f"my_rloo.py: error: {said}" in result.stderr.splitlines(), result.stderr[-3000:]
    assert read_metrics(tmp_path / "out") == []  # the first update


def test_a_copy_names_itself_in_the_plumbing_s_warnings_and_stop_lines(assets, tmp_path):
    """Every line a copy (my_rloo.py) prints starts with its own name, the plumbing's too: the warning on positions
    before the run, Ctrl-C's two lines (the first from the signal handler, the last once the update is saved)."""
    script = edited_rloo([], tmp_path, "my_rloo.py").__file__
    flags = [*RUN]
    flags[flags.index("--response_length") + 1] = "60"  # + the 5-token prompts: past the tiny policy's 64 positions
    returncode, stdout, stderr = interrupt_after_first_update(
        ["--model_name_or_path", assets["policy"], "--dataset_name", assets["train"], *flags, "--total_episodes",
         PER_UPDATE * 50, "--output_dir", tmp_path / "out"], signal.SIGINT, script=script)
    assert returncode == 0, stderr[-3000:]
    lines = (stdout + stderr).splitlines()
    for said in ("my_rloo.py: warning: the longest prompt, 5 tokens, + --response_length = 65 tokens exceed",
                 "my_rloo.py: SIGINT received: stopping after this update with a checkpoint",
                 "my_rloo.py: SIGINT received: stopped after update"):
        assert any(line.startswith(said) for line in lines), (said, lines[-20:])
    assert not any(line.startswith("rloo.py") for line in lines), lines


@pytest.mark.parametrize("example,flags", [("A response-length schedule", ()),
                                           (None, ("--kl_estimator", "k3", "--kl_coef", "0.5"))],
                         ids=["a-length-schedule", "k3-in-the-reward"])
def test_the_length_schedule_and_the_k3_reward_resume_bit_identically_on_two_ranks(assets, tmp_path, example, flags):
    """The other two worked examples as the first two are run: two ranks, stopped by SIGTERM after an update and
    resumed, the same metrics and bit-identical weights (a batch's length is chosen from the update: nothing of it
    is state; k3 is a flag)."""
    module = edited_rloo(examples()[example], tmp_path) if example else rloo
    stopped = stopped_and_resumed_on_two_ranks(module, assets, tmp_path, *flags)
    metrics = read_metrics(stopped)
    if example:
        lengths = [3, 4, 4, 5]  # round(6 x (0.5 + 0.5 x progress)): as in the one-process test
        assert len(metrics) == 4 and all(m["completions/max_length"] <= n for m, n in zip(metrics, lengths)), metrics
    else:
        assert all("objective/kl_k3" in m for m in metrics)  # update 1 samples the reference itself: both 0
        assert all(m["objective/kl_k3"] != m["objective/kl"] for m in metrics[1:]), metrics


@pytest.mark.parametrize("epochs", [1, 2])
def test_a_temperature_schedule_scores_each_batch_at_the_temperature_that_sampled_it(assets, tmp_path, epochs):
    """Each update's batch carries its own temperature; the trainer's log-probs of it (a separate pass, or on-policy
    the update's forward) are the sampler's, within rounding, which another temperature would be far from."""
    schedule = edited_rloo(examples()["A temperature schedule"], tmp_path)
    rollouts = run_main(schedule, model_name_or_path=str(assets["policy"]), dataset_name=str(assets["train"]),
                        output_dir=str(tmp_path / "out"), total_episodes=4 * K * PROMPTS, num_ppo_epochs=epochs)
    assert [r.sampling.temperature for r in rollouts] == [1.0, 0.875, 0.75, 0.625]
    metrics = read_metrics(tmp_path / "out")
    differences = [m["mismatch/logprob_diff_max"] for m in metrics]  # the sampler's log-probs against the trainer's
    assert len(differences) == 4 and max(differences) < 1e-4, differences
    last = rollouts[-1]
    policy = tiny_policy(len(policy_tokenizer()), seed=0)  # any weights: another temperature's log-probs differ
    at_one = rloo.forward_logprobs(policy, last, 1.0, True)[0] * last.response_mask
    at_its_own = rloo.forward_logprobs(policy, last, last.sampling.temperature, True)[0] * last.response_mask
    assert (at_one - at_its_own).abs().max() > 1e-2


def test_a_response_length_schedule_samples_each_batch_at_its_length_on_the_local_source(assets, tmp_path):
    """From half of --response_length to the whole: each update's batch is sampled at its own length (its width,
    its SamplingSettings), the sampler's log-probs the trainer's; no trailing padding counts as tokens."""
    schedule = edited_rloo(examples()["A response-length schedule"], tmp_path)
    rollouts = run_main(schedule, model_name_or_path=str(assets["policy"]), dataset_name=str(assets["train"]),
                        output_dir=str(tmp_path / "out"), total_episodes=4 * K * PROMPTS, stop_token=None)
    lengths = [3, 4, 4, 5]  # round(6 x (0.5 + 0.5 x progress)), progress 0, 1/4, 1/2, 3/4
    assert [r.sampling.max_new_tokens for r in rollouts] == [r.responses.shape[1] for r in rollouts] == lengths
    metrics = read_metrics(tmp_path / "out")
    assert [m["completions/max_length"] for m in metrics] == lengths  # without a stop token: every token sampled
    assert max(m["mismatch/logprob_diff_max"] for m in metrics) < 1e-4


@pytest.mark.engines
def test_a_response_length_schedule_through_the_hf_engines_trains_as_the_local_run(assets, tmp_path):
    """The same schedule run by rloo_multinode.py's HF engines (a copy of the repository with the edited rloo.py):
    the engines sample each batch at its length, and the run is the local run's, bit for bit."""
    import shutil

    from conftest import run_rloo

    repo = tmp_path / "repo"
    shutil.copytree(REPO / "plumbing", repo / "plumbing", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "rloo_multinode.py", repo)
    shutil.copy(edited_rloo(examples()["A response-length schedule"], tmp_path).__file__, repo / "rloo.py")
    common = ["--model_name_or_path", assets["policy"], "--dataset_name", assets["train"], *ENGINE_RUN,
              "--total_episodes", 3 * PER_UPDATE, "--stop_token", "None"]
    local = run_rloo(*common, "--output_dir", tmp_path / "local", script=str(repo / "rloo.py"))
    assert local.returncode == 0, local.stderr[-3000:]
    engines = run_rloo(*common, "--output_dir", tmp_path / "engines", "--engine", "hf", "--engine_port", free_port(),
                       script=str(repo / "rloo_multinode.py"))
    assert engines.returncode == 0, engines.stderr[-3000:]
    local_metrics, engine_metrics = read_metrics(tmp_path / "local"), read_metrics(tmp_path / "engines")
    assert [m["completions/max_length"] for m in engine_metrics] == [3, 4, 5]  # no stop token: every token sampled
    for engine, local in zip(engine_comparable(engine_metrics), engine_comparable(local_metrics), strict=True):
        mismatch = [k for k in local if k.startswith("mismatch/")]
        assert [engine.pop(k) for k in mismatch] == pytest.approx([local.pop(k) for k in mismatch], rel=1e-6,
                                                                  abs=1e-7)
        assert engine == local
    trained = [load_file(tmp_path / d / "model.safetensors") for d in ("local", "engines")]
    assert all(torch.equal(trained[0][k], trained[1][k]) for k in trained[0])
