"""The shortcuts' checks against the plain path. Prompt sharing, on a probe before the run: whether a model can take
grouped rows (each prompt computed once for its k completions, rloo.grouped_rows), per model. Computed
apart: whether an algorithm function's values (rloo.compute_advantages's, as the researcher left it, on the first
update's own batch) for a micro-batch's prompt groups are what it gives them in the whole batch, which the on-policy
update's advantages per micro-batch assume.
"""

import inspect
import json
import math
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .data import pad_sequences, startup_step
from .distributed import all_reduce, unwrapped, visiting
from .errors import ConfigError, first_line
from .kernels import attention_implementation, attention_windows

__all__ = [  # given as plumbing.NAME to rloo.py, rloo_multinode.py and the tools; tests import the rest from the module
    "prompt_sharing", "rows_of", "put_rows_of", "apart_difference", "on_policy_notes",
]


def why_not_shared(model) -> Optional[str]:
    """Why prompt groups cannot be fed to the model as one row each (None: they can): its attention must take a 4D
    mask as it is (transformers' sdpa and eager attention do; flash-attention and remote code may not), explicit
    positions, and every layer must be attention."""
    module = unwrapped(model)
    config = getattr(module, "config", None)
    if attention_implementation(model) not in ("sdpa", "eager"):
        return f"its attention ({attention_implementation(model)}) may not take a custom 4D mask"
    if "position_ids" not in inspect.signature(module.forward).parameters:
        return "its forward takes no position_ids"
    if attention_windows(model) is None:
        kinds = sorted(set(config.layer_types) - {"full_attention", "sliding_attention"})
        return f"its {'/'.join(kinds)} layers read the whole row in order, so responses would see each other"
    return None


SHARING_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 5e-2, torch.float16: 5e-2}  # by the weights' dtype


PROBE_TOKENS = (24, 8)  # the probe's longest prompt and response where no sliding window asks for longer rows


def probe_lengths(max_prompt_length: int, response_length: int, *models) -> tuple[int, int]:
    """The probe's longest prompt and response: rows no longer than the check needs, never longer than training's.
    What a grouped row can get wrong that one row per completion gets right is which tokens each token sees (its
    mask) and at which position; the head reads each position on its own. Without a sliding window that shows in
    rows of any length: a prompt of PROBE_TOKENS[0] tokens (left-padded beside one a third as long) and responses of
    PROBE_TOKENS[1] and about half as many, side by side. A window W shows only in rows longer than it: where
    training's rows can pass it, the prompt is W + 1 tokens (at most training's longest) and the responses are
    training's, so that the grouped rows pass it too."""
    windows = [w for model in models if model is not None
               for w in (attention_windows(model) or {}).values() if w is not None]
    if any(w < max_prompt_length + 2 * response_length for w in windows):
        return min(max_prompt_length, max(PROBE_TOKENS[0], max(windows) + 1)), response_length
    return min(max_prompt_length, PROBE_TOKENS[0]), min(response_length, PROBE_TOKENS[1])


def sharing_probe(prompt_ids: list[int], max_prompt_length: int, response_length: int,
                  device: torch.device) -> dict[str, torch.Tensor]:
    """What the start-up check computes both ways, as rloo.Completions' fields: two prompts (max_prompt_length tokens
    and a third as many, left-padded; probe_lengths says how long the check needs) with two responses each
    (response_length tokens and about half as many, side by side in a group), their tokens drawn from a train
    prompt's by a fixed generator."""
    generator = torch.Generator().manual_seed(0)
    pool = torch.tensor(prompt_ids)

    def draw(n: int) -> torch.Tensor:
        return pool[torch.randint(len(pool), (n,), generator=generator)]

    queries, query_mask = pad_sequences([draw(n).tolist() for n in (max_prompt_length, max(1, max_prompt_length // 3))],
                                        0, device)  # (2, Tq) each
    long, short = response_length, response_length // 2 + 1
    lengths = torch.tensor([long, short, short, long])  # (k*g,), k = g = 2: each group one of each
    response_mask = torch.arange(response_length) < lengths[:, None]  # (k*g, Tr)
    responses = draw(4 * response_length).view(4, response_length).masked_fill(~response_mask, 0)
    return {"queries": queries, "query_mask": query_mask, "responses": responses.to(device),
            "response_mask": response_mask.to(device)}


@torch.no_grad()
def sharing_error(model, probe, compute: Callable) -> float:
    """The largest difference between compute(group, share) (the probe's log-probs of its response tokens, or a reward
    model's scores) on grouped rows (share True) and on one row per completion, one prompt group at a time, in the
    weights' dtype, where the model's weights are."""
    device = next(model.parameters()).device
    probe = probe.map_tensors(lambda t: t.to(device), lambda t: t.to(device))
    groups = [probe.of_prompts(torch.tensor([i], device=device)) for i in range(probe.queries.shape[0])]
    return max(float((compute(group, True).float() - compute(group, False).float()).abs().max()) for group in groups)


HEAD_CONFIG_KEYS = {"architectures", "num_labels", "id2label", "label2id", "problem_type", "tie_word_embeddings",
                    "_name_or_path", "transformers_version", "dtype", "torch_dtype"}


def sharing_key(model) -> tuple:
    """What the start-up check's verdict depends on: the backbone's code and config (its head's keys left out: a
    head reads each position's hidden state on its own), attention implementation, adapters, dtype and device. A
    policy and a reward model with one key share one check: the grouped rows pass through the same backbone code."""
    module = unwrapped(model)
    config = {key: value for key, value in module.config.to_dict().items() if key not in HEAD_CONFIG_KEYS}
    parameter = next(module.parameters())
    return (type(getattr(module, module.base_model_prefix, module)).__qualname__, json.dumps(config, sort_keys=True,
            default=str), attention_implementation(model), bool(getattr(module, "_hf_peft_config_loaded", False)),
            parameter.dtype, parameter.device)


def shares_prompts(model, name: str, requested: Optional[bool], probe, compute: Callable, notes: list[str],
                   checked: Optional[dict] = None) -> bool:
    """Whether `model` computes each prompt group as one row (--share_prompt: `requested`, None by default): where
    it can (why_not_shared) and the start-up check (sharing_error: `compute` on the probe's grouped rows against one
    row per completion) is within SHARING_TOLERANCE, so that an architecture nobody tested cannot train on wrong
    gradients. Else a note says why (a ConfigError where --share_prompt asked for it). `checked` ({sharing_key:
    verdict}) carries one model's check to the next where their keys agree (a policy and its reward model of one
    architecture and dtype): the check runs once for both."""
    if requested is False:
        return False
    key = sharing_key(model)
    if checked is not None and key in checked:
        why = checked[key]
    else:
        why = why_not_shared(model)
        if why is None:
            tolerance = SHARING_TOLERANCE.get(next(model.parameters()).dtype, 5e-2)
            try:
                difference = sharing_error(model, probe, compute)
                if not difference <= tolerance:  # NaN fails too
                    why = (f"the start-up check found its grouped rows' results {difference:.2g} away from one row "
                           f"per completion's (tolerance {tolerance:g})")
            except torch.OutOfMemoryError:
                raise
            except Exception as e:  # an attention that cannot take the grouped rows at all
                why = f"its forward fails on grouped rows ({first_line(e)})"
        if checked is not None:
            checked[key] = why
    if why is None:
        return True
    if requested:
        raise ConfigError(f"--share_prompt: the {name} cannot share prompts exactly: {why}; "
                          "leave the flag out (it then computes one row per completion)")
    notes.append(f"prompt sharing is off for the {name}: {why}; it computes one row per completion")
    return False


def prompt_sharing(args, prompt_ids: list[int], policy, sources, device: torch.device, announce: bool,
                   make_completions: Callable, policy_logprobs: Callable,
                   reward_scores: Callable) -> tuple[bool, list[str]]:
    """The start-up step that decides, per model, whether each prompt is computed once for its k completions
    (shares_prompts): for the policy (`policy_logprobs(c, share)`, the policy's log-probs of the probe's real
    tokens) and the reward model (`reward_scores(model, c, share)`; not with a tokenizer of its own), on a probe of
    rloo.Completions (`make_completions`) drawn from a train prompt. Sets sources.share_prompt; returns the
    policy's verdict and the notes to print once the run starts. One check where both models agree (sharing_key)."""
    with startup_step("start-up check of prompt sharing (each prompt computed once for its k completions, checked "
                      "against the plain path)", announce):
        probe = make_completions(**sharing_probe(prompt_ids, *probe_lengths(
            args.max_prompt_length, args.response_length, policy, sources.model), device))
        notes, checked = [], {}
        share_prompt = shares_prompts(policy, "policy", args.share_prompt, probe, policy_logprobs, notes, checked)
        with visiting(sources.model, device):  # --offload: a frozen model's passes are on the GPU
            sources.share_prompt = sources.model is not None and sources.model_tokenizer is None and shares_prompts(
                sources.model, "reward model", args.share_prompt, probe,
                lambda c, share: reward_scores(sources.model, c, share), notes, checked)
    return share_prompt, notes


APART_TOLERANCE = 1e-5  # relative to the largest value: float32 rounding of the same arithmetic on other shapes


def value_difference(mine, full) -> Optional[str]:
    """How `mine` differs from `full` beyond rounding (APART_TOLERANCE), in words; None where it does not."""
    if not torch.is_tensor(full):
        return None if not torch.is_tensor(mine) and mine == full else f"{mine!r} against"
    if not torch.is_tensor(mine) or mine.shape != full.shape:
        return f"of shape {tuple(getattr(mine, 'shape', ()))} against {tuple(full.shape)} in"
    error = (mine.float() - full.float()).abs().nan_to_num(0.0)  # NaN where both are: the same
    error[mine.isnan() != full.isnan()] = math.inf
    scale = 1 + float(full.float().nan_to_num(0.0, 0.0, 0.0).abs().max()) if full.numel() else 1.0
    worst = float(error.max()) if error.numel() else 0.0
    return None if worst <= APART_TOLERANCE * scale else f"{worst:.2g} away from"


def per_completion(value, n: int) -> bool:
    """Whether `value` holds one entry per completion of a batch of n: a tensor whose first dimension is n."""
    return torch.is_tensor(value) and value.dim() > 0 and value.shape[0] == n


def rows_of(values: dict, rows: torch.Tensor, n: int, width: Optional[int] = None) -> dict:
    """`values` (name -> value) of a batch of n completions, for its completions `rows` (indices): each per-completion
    value's rows, cut to `width` columns where it has columns; any other value as it is."""
    return {name: (value[rows] if value.dim() == 1 or width is None else value[rows, :width])
            if per_completion(value, n) else value for name, value in values.items()}


def put_rows_of(whole: dict, rows: torch.Tensor, values: dict, shape: tuple) -> None:
    """A part's `values` (of the whole batch's completions `rows`, each cut to the part's width) put into `whole`
    (name -> value): a per-completion value into the whole's tensor of it, (shape[0],) or (shape[0], shape[1], ..),
    zeros until a part fills its rows; any other value as the part gives it (the same in every part)."""
    for name, value in values.items():
        if not per_completion(value, len(rows)):
            whole[name] = value
            continue
        into = whole.setdefault(name, value.new_zeros(tuple(shape[:min(value.dim(), 2)]) + tuple(value.shape[2:])))
        into[(rows, slice(value.shape[1])) if value.dim() >= 2 else rows] = value


def apart_difference(whole: dict, parts: list[torch.Tensor], compute: Callable) -> Optional[str]:
    """Whether compute(rows), the values (name -> value) an algorithm function gives the completions `rows` (indices
    into the whole batch's) computed apart (rloo.compute_advantages on a micro-batch), are what it gave those rows in
    the whole batch (`whole`): a per-completion value (rows_of) at the part's rows and widths, any other value whole.
    Returns the first difference in words (or compute's error on a part), None where there is none. A collective:
    every rank calls it with as many parts (compute may reduce over ranks), and a difference on any rank is every
    rank's."""
    first = next(iter(whole.values()))  # (N, ..): per completion, as the advantages are
    n, device, why = len(first), first.device, None
    for rows in parts:
        try:
            mine = compute(rows)
        except Exception as e:  # an estimator that cannot take a micro-batch's groups alone
            why = why or f"fails on a micro-batch's prompt groups ({first_line(e)})"
            continue
        for name, full in whole.items():
            value = mine.get(name)
            width = value.shape[1] if getattr(value, "ndim", 0) >= 2 else None
            error = value_difference(value, rows_of({name: full}, rows, n, width)[name])
            if error is not None and why is None:
                why = f"gives {name} of a micro-batch's prompt groups {error} the whole batch's"
    if all_reduce(torch.tensor([float(why is not None)], device=device), dist.ReduceOp.MAX).item() and why is None:
        why = "gives other values to a micro-batch's prompt groups than to the whole batch on another rank"
    return why


def on_policy_notes(update: int, apart: Optional[str], metrics: dict, cliprange: float,
                    cliprange_high: float) -> list[str]:
    """What a run's first update showed, in a line each: whether the on-policy shortcut starts (`apart`: None, or the
    difference rloo.advantages_apart found; "" unchecked), and whether the PPO ratio (the update's reduced val/ratio
    and val/ratio_var) was 1 at every step, so that the clip range [1 - cliprange, 1 + cliprange_high] cannot act."""
    notes = [] if apart == "" else [
        f"on-policy shortcut on from update {update + 1}: compute_advantages gave each micro-batch's prompt groups of "
        f"update {update} what it gave the whole batch, so the update's forward gives the policy's log-probs"
        if apart is None else f"on-policy shortcut off: compute_advantages {apart} (update {update}'s batch), so the "
        "policy's log-probs keep a separate pass and the advantages the whole batch"]
    if abs(metrics["val/ratio"] - 1) < 1e-4 and metrics["val/ratio_var"] < 1e-8:
        notes.append(f"the PPO ratio was 1 at every step of update {update}, so the clip range [1 - {cliprange:g}, "
                     f"1 + {cliprange_high:g}] cannot act (raise --num_ppo_epochs or --num_mini_batches)")
    return notes
