"""A tiny offline RLHF task, built entirely from code.

A prompt is 3-6 distinct letters from `a`..`l` followed by `:` (e.g. ``"c a f :"``).
A good completion repeats letters from the prompt, 3-6 of them, then stops with `<eos>`.

The module builds everything an RLOO run needs, with no network access:
a word-level tokenizer, an imperfect "SFT" policy (a tiny GPT-NeoX trained on noisy
demonstrations), a reward model regressed on the true score, and prompt datasets.
"""

import json
import os
import random
import threading
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import (
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    GPTNeoXForSequenceClassification,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

ASSETS_VERSION = "v2"  # bump to force `ensure_assets` to rebuild
LETTERS = "abcdefghijkl"
SEP = ":"
PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
MIN_PROMPT_LETTERS, MAX_PROMPT_LETTERS = 3, 6
MIN_GOOD_LENGTH, MAX_GOOD_LENGTH = 3, 6
SFT_P_IN_PROMPT = 0.7  # chance that a demonstration letter is copied from the prompt
MAX_DEMO_LENGTH = 7  # completion letters; 7 letters + <eos> fit in a response length of 8


# ---------------------------------------------------------------- tokenizer and task


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Word-level tokenizer: `<pad>`=0, `<eos>`=1, letters `a`..`l`=2..13, `:`=14, `<unk>`=15."""
    vocab = {tok: i for i, tok in enumerate([PAD, EOS, *LETTERS, SEP, UNK])}
    backend = Tokenizer(WordLevel(vocab, unk_token=UNK))
    backend.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token=PAD, eos_token=EOS, unk_token=UNK, padding_side="left"
    )


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, save_dir: str | Path) -> None:
    """`save_pretrained`, readable by transformers 4.x as well (the benchmark's TRL environment): 5.x names the
    class `TokenizersBackend`, which 4.x does not know; both load a `PreTrainedTokenizerFast` the same way."""
    tokenizer.save_pretrained(save_dir)
    config_path = Path(save_dir) / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2) + "\n")


def format_prompt(letters: list[str]) -> str:
    """`["c", "a", "f"]` -> `"c a f :"`."""
    return " ".join(letters) + f" {SEP}"


def prompt_letters(prompt: str) -> set[str]:
    """The set of letters shown in a prompt."""
    return set(prompt.split()) - {SEP}


def sample_prompt(rng: random.Random) -> str:
    """A prompt of 3-6 distinct random letters followed by `:`."""
    return format_prompt(rng.sample(LETTERS, rng.randint(MIN_PROMPT_LETTERS, MAX_PROMPT_LETTERS)))


def sample_completion(rng: random.Random, prompt: str, p_in_prompt: float, length: int) -> str:
    """`length` letters, each copied from the prompt with prob. `p_in_prompt`, else another letter."""
    inside = sorted(prompt_letters(prompt))
    outside = [c for c in LETTERS if c not in inside]
    return " ".join(rng.choice(inside if rng.random() < p_in_prompt else outside) for _ in range(length))


def length_factor(n: int) -> float:
    """1 for 3-6 letters, n/3 below, minus 1/3 per letter above 6 (0 from 9 letters on)."""
    if n < MIN_GOOD_LENGTH:
        return n / MIN_GOOD_LENGTH
    return max(0.0, 1.0 - max(0, n - MAX_GOOD_LENGTH) / 3)


def true_score(prompt: str, completion: str) -> float:
    """Fraction of completion letters that appear in the prompt, times `length_factor`. In [0, 1]."""
    words = completion.split()
    if not words:
        return 0.0
    allowed = prompt_letters(prompt)
    return sum(w in allowed for w in words) / len(words) * length_factor(len(words))


def true_reward(prompts: list[str], completions: list[str], **kwargs) -> list[float]:
    """Reward function for `rloo.py --reward_fn benchmark.synthetic_task:true_reward`."""
    return [true_score(p, c) for p, c in zip(prompts, completions)]


WAIT_AT_CALL = "TRUE_REWARD_WAITS_AT_CALL"  # stoppable_true_reward's call (each rank counts its own) that waits
WAITING_IN = "TRUE_REWARD_WAITING_IN"  # the folder where each rank's waiting call says so


def stoppable_true_reward(prompts: list[str], completions: list[str], **kwargs) -> list[float]:
    """true_reward, for check_change.py's runs: at the call numbered $TRUE_REWARD_WAITS_AT_CALL (each rank counts
    its own) it writes $TRUE_REWARD_WAITING_IN/rank<r> and waits for good, for the signal that stops the run at once
    (the stop while a reward function runs)."""
    stoppable_true_reward.calls = getattr(stoppable_true_reward, "calls", 0) + 1
    if str(stoppable_true_reward.calls) == os.environ.get(WAIT_AT_CALL):
        Path(os.environ[WAITING_IN], f"rank{os.environ.get('RANK', '0')}").write_text("waiting\n")
        threading.Event().wait()
    return true_reward(prompts, completions)


def make_prompt_rows(n: int, seed: int) -> list[dict]:
    """`n` dataset rows like `{"prompt": "c a f :", "letters": "acf"}`."""
    rng = random.Random(seed)
    prompts = [sample_prompt(rng) for _ in range(n)]
    return [{"prompt": p, "letters": "".join(sorted(prompt_letters(p)))} for p in prompts]


def write_prompts_jsonl(path: str | Path, n: int, seed: int) -> None:
    """Write `make_prompt_rows(n, seed)` as JSON lines."""
    with open(path, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in make_prompt_rows(n, seed))


# ---------------------------------------------------------------- models


def tiny_config(tokenizer: PreTrainedTokenizerFast, **overrides) -> GPTNeoXConfig:
    """A ~0.1M-parameter GPT-NeoX config matching `tokenizer`; `overrides` replace any field."""
    fields = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=256,
        max_position_embeddings=64,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        classifier_dropout=0.0,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
    )
    return GPTNeoXConfig(**(fields | overrides))


def encode_pairs(
    tokenizer: PreTrainedTokenizerFast, prompts: list[str], completions: list[str]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded `prompt + completion + <eos>` ids and a mask of the completion (+ eos) tokens."""
    seqs, masks = [], []
    for prompt, completion in zip(prompts, completions):
        p = tokenizer.convert_tokens_to_ids(prompt.split())
        c = tokenizer.convert_tokens_to_ids(completion.split()) + [tokenizer.eos_token_id]
        seqs.append(p + c)
        masks.append([False] * len(p) + [True] * len(c))
    width = max(map(len, seqs))
    input_ids = torch.tensor([s + [tokenizer.pad_token_id] * (width - len(s)) for s in seqs])  # (B, T)
    completion_mask = torch.tensor([m + [False] * (width - len(m)) for m in masks])  # (B, T)
    return input_ids, completion_mask


def sample_sft_batch(rng: random.Random, batch_size: int) -> tuple[list[str], list[str]]:
    """Imperfect demonstrations: 1-7 letters, each from the prompt with prob. `SFT_P_IN_PROMPT`."""
    prompts = [sample_prompt(rng) for _ in range(batch_size)]
    completions = [sample_completion(rng, p, SFT_P_IN_PROMPT, rng.randint(1, MAX_DEMO_LENGTH)) for p in prompts]
    return prompts, completions


def sample_rm_batch(rng: random.Random, batch_size: int) -> tuple[list[str], list[str]]:
    """(prompt, completion) pairs with a wide spread of quality: 0-8 letters, any in-prompt rate."""
    prompts = [sample_prompt(rng) for _ in range(batch_size)]
    completions = [sample_completion(rng, p, rng.random(), rng.randint(0, MAX_DEMO_LENGTH + 1)) for p in prompts]
    return prompts, completions


def fit(model: PreTrainedModel, batch_loss: Callable[[], torch.Tensor], steps: int, lr: float, name: str) -> None:
    """AdamW on `batch_loss()` (a fresh batch each step) with the learning rate decayed linearly to 0. Prints
    `name`'s step, loss and seconds five times along the way, so that a first build is never silent for long."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / steps)
    model.train()
    start, every = time.time(), max(1, steps // 5)
    for step in range(1, steps + 1):
        loss = batch_loss()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        if step % every == 0 or step == steps:
            print(f"  {name}: step {step}/{steps}, loss {loss.item():.4f} ({time.time() - start:.0f} s)", flush=True)
    model.eval()


def build_policy(
    tokenizer: PreTrainedTokenizerFast, save_dir: str | Path, steps: int = 500, seed: int = 0, batch_size: int = 64
) -> GPTNeoXForCausalLM:
    """Train a tiny causal LM on noisy demonstrations (loss on completion tokens only) and save it."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    model = GPTNeoXForCausalLM(tiny_config(tokenizer))

    def batch_loss() -> torch.Tensor:
        input_ids, completion_mask = encode_pairs(tokenizer, *sample_sft_batch(rng, batch_size))
        labels = input_ids.masked_fill(~completion_mask, -100)  # (B, T)
        return model(input_ids=input_ids, attention_mask=input_ids != tokenizer.pad_token_id, labels=labels).loss

    fit(model, batch_loss, steps, lr=3e-3, name="SFT policy")
    model.save_pretrained(save_dir)
    save_tokenizer(tokenizer, save_dir)
    return model


def score_pairs(
    model: GPTNeoXForSequenceClassification,
    tokenizer: PreTrainedTokenizerFast,
    prompts: list[str],
    completions: list[str],
) -> torch.Tensor:
    """Reward-model scores of `prompt + completion + <eos>`, read at the last non-pad token. (B,)"""
    input_ids, _ = encode_pairs(tokenizer, prompts, completions)
    return model(input_ids=input_ids, attention_mask=input_ids != tokenizer.pad_token_id).logits.squeeze(-1)


def build_reward_model(
    tokenizer: PreTrainedTokenizerFast,
    save_dir: str | Path,
    steps: int = 1000,
    seed: int = 0,
    batch_size: int = 64,
    init_from: GPTNeoXForCausalLM | None = None,
) -> GPTNeoXForSequenceClassification:
    """Regress a tiny sequence classifier on `true_score` (MSE), print its held-out correlation, save it.

    As in InstructGPT, the backbone can start from the SFT policy (`init_from`): it already attends from
    completion to prompt letters, so the reward model learns several times faster than from scratch."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    model = GPTNeoXForSequenceClassification(tiny_config(tokenizer, num_labels=1))
    if init_from is not None:
        model.gpt_neox.load_state_dict(init_from.gpt_neox.state_dict())

    def batch_loss() -> torch.Tensor:
        prompts, completions = sample_rm_batch(rng, batch_size)
        target = torch.tensor(true_reward(prompts, completions))  # (B,)
        return F.mse_loss(score_pairs(model, tokenizer, prompts, completions), target)

    fit(model, batch_loss, steps, lr=1e-3, name="reward model")
    print(f"  reward model: correlation with the true score on held-out pairs {rm_correlation(model, tokenizer):.3f}",
          flush=True)
    model.save_pretrained(save_dir)
    save_tokenizer(tokenizer, save_dir)
    return model


@torch.no_grad()
def rm_correlation(
    model: GPTNeoXForSequenceClassification, tokenizer: PreTrainedTokenizerFast, n: int = 1024, seed: int = 12345
) -> float:
    """Pearson correlation between reward-model scores and `true_score` on fresh pairs."""
    prompts, completions = sample_rm_batch(random.Random(seed), n)
    scores = score_pairs(model, tokenizer, prompts, completions)
    target = torch.tensor(true_reward(prompts, completions))
    return torch.corrcoef(torch.stack([scores, target]))[0, 1].item()


@torch.no_grad()
def sample_completions(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    prompts: list[str],
    max_new_tokens: int = 8,
    temperature: float = 1.0,
    seed: int = 0,
) -> list[str]:
    """One completion per prompt, sampled exactly as rloo.py samples; the text before `<eos>`."""
    import plumbing  # here, not at the top: rloo.py imports this module for --reward_fn as its __main__
    import rloo

    torch.manual_seed(seed)
    queries, query_mask = plumbing.pad_sequences([tokenizer(p)["input_ids"] for p in prompts], tokenizer.pad_token_id,
                                                 torch.device("cpu"))  # (B, P) each
    sampled = rloo.sample_completions(model, queries, query_mask, max_new_tokens, temperature,
                                      tokenizer.eos_token_id, tokenizer.pad_token_id)
    return [tokenizer.decode(r[m], skip_special_tokens=True) for r, m in zip(sampled.responses, sampled.response_mask)]


def mean_true_score(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    prompts: list[str],
    samples_per_prompt: int = 4,
    seed: int = 0,
) -> float:
    """Average `true_score` of temperature-1 samples, `samples_per_prompt` per prompt."""
    prompts = [p for p in prompts for _ in range(samples_per_prompt)]
    completions = sample_completions(model, tokenizer, prompts, seed=seed)
    return sum(true_reward(prompts, completions)) / len(prompts)


# ---------------------------------------------------------------- assets


def asset_paths(cache_dir: str | Path, seed: int = 0) -> dict[str, Path]:
    """Where `ensure_assets` keeps the task's files; `done` marks a finished build."""
    root = Path(cache_dir) / f"{ASSETS_VERSION}-seed{seed}"
    names = {"tokenizer": "tokenizer", "policy": "sft_policy", "reward_model": "reward_model", "train": "train.jsonl",
             "test": "test.jsonl", "done": "COMPLETE"}
    return {key: root / name for key, name in names.items()}


def build_assets(paths: dict[str, Path], seed: int = 0, policy_steps: int = 500, reward_steps: int = 1000) -> None:
    """Tokenizer, prompt files, SFT policy and reward model at `paths` (fewer steps: a weaker, faster task)."""
    start = time.time()
    paths["done"].parent.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    save_tokenizer(tokenizer, paths["tokenizer"])
    write_prompts_jsonl(paths["train"], n=2000, seed=seed)
    write_prompts_jsonl(paths["test"], n=64, seed=seed + 1)
    print(f"the SFT policy: {policy_steps} steps of next-token loss on noisy demonstrations", flush=True)
    policy = build_policy(tokenizer, paths["policy"], steps=policy_steps, seed=seed)
    print(f"the reward model: {reward_steps} steps of regression on the true score, from the SFT policy's weights",
          flush=True)
    build_reward_model(tokenizer, paths["reward_model"], steps=reward_steps, seed=seed, init_from=policy)
    paths["done"].write_text(ASSETS_VERSION + "\n")
    print(f"built the synthetic task in {paths['done'].parent} ({time.time() - start:.0f} s)", flush=True)


def ensure_assets(cache_dir: str | Path = ".cache/rloo_demo", seed: int = 0) -> dict[str, str]:
    """Build (or reuse) tokenizer, SFT policy, reward model and prompt files under `cache_dir`."""
    paths = asset_paths(cache_dir, seed)
    if not paths["done"].exists():
        build_assets(paths, seed)
    return {name: str(path) for name, path in paths.items() if name != "done"}
