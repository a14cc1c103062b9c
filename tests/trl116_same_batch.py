"""rloo.py's advantages against TRL 1.16's own code on the same batch: --mask_truncated_completions (a masked
completion's KL leaves its reward) and completions no reward source scores (left out of their groups' baselines, zero
advantage). TRL's lines are RLOOTrainer._generate_and_score_completions' own, cut out of its source and run on this
batch. Run with TRL 1.16 first on PYTHONPATH (tests/test_trl_parity.py does); prints one line per case, exits 1 on a
difference.
"""

import inspect
import itertools
import sys
import textwrap
from types import SimpleNamespace

import torch
from trl.trainer.rloo_trainer import RLOOTrainer
from trl.trainer.utils import nanstd

import rloo

K, B, T = 4, 3, 5  # completions per prompt, prompts, response tokens


def trl_lines(first: str, last: str) -> str:
    """TRL 1.16's _generate_and_score_completions from the line starting with `first` to the one starting with
    `last`, dedented."""
    lines = inspect.getsource(RLOOTrainer._generate_and_score_completions).splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith(first))
    end = next(i for i in range(start, len(lines)) if lines[i].strip().startswith(last))
    return textwrap.dedent("\n".join(lines[start:end + 1]))


MASK = trl_lines("if self.mask_truncated_completions:", "completion_mask = completion_mask *")
ADVANTAGES = trl_lines("unscorable_mask = torch.isnan(rewards_per_func)", "advantages = torch.nan_to_num(")


def prompt_major(x: torch.Tensor) -> torch.Tensor:
    """rloo.py's (k, B) rows (row j*B + i: sample j of prompt i) in TRL's order (row i*k + j)."""
    return x.reshape(K, B, *x.shape[1:]).transpose(0, 1).reshape(K * B, *x.shape[1:])


def batch(seed: int, unscored: bool) -> dict:
    """One update's completions in rloo.py's layout: lengths, stops, log-probs, and two reward functions' values
    with None (applies False) where a function does not apply."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (K * B,), generator=g)
    response_mask = torch.arange(T)[None, :] < lengths[:, None]  # (k*B, T)
    has_stop = torch.rand(K * B, generator=g) < 0.6
    has_stop[0], has_stop[1] = True, False  # both kinds
    logprobs = -torch.rand(K * B, T, generator=g) * response_mask
    ref_logprobs = -torch.rand(K * B, T, generator=g) * response_mask
    values = torch.randn(2, K * B, generator=g)
    applies = torch.rand(2, K * B, generator=g) < 0.7
    applies[0, 0] = True
    if unscored:
        applies[:, 1] = False  # prompt 1, sample 0: no source scores it
        applies[:, [2, 2 + B, 2 + 2 * B]] = False  # prompt 2: one scored sample left (sample 3)
        applies[0, 2 + 3 * B] = True
    return dict(response_mask=response_mask, has_stop=has_stop, logprobs=logprobs, ref_logprobs=ref_logprobs,
                values=values, applies=applies, weights=torch.tensor([1.0, 0.5]))


def ours(b: dict, mask_truncated: bool, normalize: bool, kl_coef: float) -> torch.Tensor:
    args = rloo.Args(rloo_k=K, kl_coef=kl_coef, mask_truncated_completions=mask_truncated,
                     normalize_advantage=normalize)
    scores = rloo.combine_rewards(b["values"], b["applies"], b["weights"])  # (k*B,), NaN: unscored
    rollout = rloo.Rollout(torch.ones(B, 1, dtype=torch.long), torch.ones(B, 1, dtype=torch.bool),
                           torch.ones(K * B, T, dtype=torch.long), b["response_mask"], b["logprobs"],
                           b["ref_logprobs"])
    rollout.in_loss = rloo.completions_in_loss(scores, b["has_stop"], args)
    out = rloo.compute_advantages(rollout, scores, args)
    return out.advantages


def trls(b: dict, mask_truncated: bool, normalize: bool, kl_coef: float) -> torch.Tensor:
    eos, pad = 1, 0
    completion_ids_list = [[2] * (int(n) - 1) + ([eos] if stop else [3])
                           for n, stop in zip(prompt_major(b["response_mask"].sum(1)), prompt_major(b["has_stop"]))]
    values = torch.where(b["applies"], b["values"], torch.nan).T  # (N, S), NaN: the function returned None
    self = SimpleNamespace(mask_truncated_completions=mask_truncated, eos_token_ids=[eos],
                           _tokenizer=SimpleNamespace(pad_token_id=pad), reward_weights=b["weights"],
                           reward_clip_range=None, beta=kl_coef, normalize_advantages=normalize)
    scope = dict(self=self, torch=torch, nanstd=nanstd, device="cpu", gather=lambda x: x, num_generations=K,
                 completion_ids_list=completion_ids_list, completion_mask=prompt_major(b["response_mask"]).long(),
                 rewards_per_func=prompt_major(values),
                 old_per_token_logps=prompt_major(b["logprobs"]), ref_per_token_logps=prompt_major(b["ref_logprobs"]))
    exec(MASK, scope)
    exec(ADVANTAGES, scope)
    return scope["advantages"]


if __name__ == "__main__":
    failed = False
    for seed, unscored, mask_truncated, normalize, kl_coef in itertools.product(
            range(3), (False, True), (False, True), (False, True), (0.0, 0.3)):
        mine, theirs = prompt_major(ours(batch(seed, unscored), mask_truncated, normalize, kl_coef)), \
            trls(batch(seed, unscored), mask_truncated, normalize, kl_coef)
        # normalized, TRL divides by std + 1e-4 and rloo.py by std + 1e-8 (TRL <= 0.21's whiten)
        same = torch.allclose(mine, theirs, rtol=1e-3 if normalize else 1e-6, atol=1e-6)
        failed |= not same
        print(f"seed {seed} unscored {unscored} mask_truncated {mask_truncated} normalize {normalize} kl_coef "
              f"{kl_coef}: {'same' if same else f'DIFFERENT {mine.tolist()} {theirs.tolist()}'}")
    sys.exit(1 if failed else 0)
