"""A colocated vLLM engine (rloo_multinode.ColocatedRollouts, one rank) for each family of FAMILIES in turn, in one
process (vLLM's start-up paid once), for test_vllm.py. For each: a tiny policy saved with the tests' tokenizer and
loaded as rloo.py loads it, and a reward model of the same family (where transformers has one); the engine started;
the forward and backward of a copy of the policy and of the reward model, both made before the start, compared with
what they gave before it; the engine's log-probs of fixed completions against the trainer's as loaded; every weight
moved, then loaded into the engine as before a batch, and a batch sampled: the engine's log-probs of the fixed
completions and the sampler's of the tokens it drew against the trainer's. With the family given as --refused, the
engine is built from transformers' own classes (decoder_class_of_its_own does nothing), and the start-up check's
refusal is recorded instead.

    python tests/colocated_families.py OUT.json FAMILY[,FAMILY...] [--refused FAMILY]
"""

import contextlib
import copy
import gc
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

import conftest  # noqa: F401  (puts the repository on the path)
import plumbing
import rloo
import rloo_multinode as mn
from helpers import fixed_sequences, max_difference, policy_tokenizer, trainer_logprobs

# 2 layers, heads of 64 (vLLM's CPU attention takes 32, 64, 80, ...); a window of 4 is shorter than the fixed
# completions, so a sliding window that were dropped would show
TINY = {"vocab_size": len(policy_tokenizer()), "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 2, "intermediate_size": 256, "max_position_embeddings": 64, "pad_token_id": 0,
        "eos_token_id": 1, "bos_token_id": 1}
FAMILIES = {  # family: (config; what vLLM 0.32 runs it with)
    "gpt2": (transformers.GPT2Config(**TINY, n_embd=128, n_layer=2, n_head=2, n_positions=64), "its own, tied"),
    "mistral": (transformers.MistralConfig(**TINY, sliding_window=4), "its own: every layer sliding"),
    "gemma2": (transformers.Gemma2Config(**TINY, head_dim=64, sliding_window=4), "its own: sliding and full"),
    "qwen3_moe": (transformers.Qwen3MoeConfig(**TINY, head_dim=64, num_experts=4, num_experts_per_tok=2,
                                              moe_intermediate_size=32), "its own: mixture of experts"),
    "falcon_h1": (transformers.FalconH1Config(**TINY, head_dim=64, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16,
                                              mamba_n_groups=1, mamba_d_state=16, mamba_chunk_size=8),
                  "its own: attention and state-space"),
    "phi": (transformers.PhiConfig(**TINY), "the Transformers backend"),
    "olmo2": (transformers.Olmo2Config(**TINY), "the Transformers backend"),
    "starcoder2": (transformers.Starcoder2Config(**TINY, tie_word_embeddings=False), "the Transformers backend"),
}


def model_of(family: str, head: str, seed: int):
    config = FAMILIES[family][0]
    name = type(config).__name__.removesuffix("Config") + head
    if not hasattr(transformers, name):
        return None
    torch.manual_seed(seed)
    return getattr(transformers, name)(type(config)(**config.to_dict(), num_labels=1)).eval()  # GPT-2's dropout off


def loss_and_gradients(model) -> list[torch.Tensor]:
    model.zero_grad()
    loss = model(torch.tensor(fixed_sequences()[2])[None]).logits.float().square().mean()  # (1, T) ids
    loss.backward()
    return [loss.detach()] + [p.grad.clone() for p in model.parameters() if p.grad is not None]


def check(family: str, root: Path, refused: bool) -> dict:
    path = root / family
    lm_head = "LMHeadModel" if family == "gpt2" else "ForCausalLM"
    model_of(family, lm_head, 0).save_pretrained(path)
    policy_tokenizer().save_pretrained(path)
    policy = plumbing.load_causal_lm(str(path), torch.float32, False)
    models = {"reference": copy.deepcopy(policy).eval(), "reward model": model_of(family, "ForSequenceClassification",
                                                                                  1)}
    models = {name: model for name, model in models.items() if model is not None}
    before = {name: loss_and_gradients(model) for name, model in models.items()}
    args = mn.Args(model_name_or_path=str(path), vllm_mode="colocate", vllm_gpu_memory_utilization=0.2,
                   vllm_enforce_eager=True, max_prompt_length=16, response_length=6, rloo_k=2)
    own_class = mn.decoder_class_of_its_own
    if refused:
        mn.decoder_class_of_its_own = lambda config: contextlib.nullcontext()
    try:
        rollouts = mn.ColocatedRollouts(policy, args, None, 0, torch.Generator().manual_seed(0),
                                        plumbing.Dist(0, 0, 1, torch.device("cpu")))
    except plumbing.ConfigError as e:
        return {"refused": str(e)}
    finally:
        mn.decoder_class_of_its_own = own_class
    out = {"moved": {name: max((a - b).abs().max().item() for a, b in zip(loss_and_gradients(model), before[name]))
                     for name, model in models.items()},
           "as_loaded": max_difference(rollouts.engine.logprobs(fixed_sequences()),
                                       trainer_logprobs(policy, fixed_sequences()))}
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    rollouts.policy_updated(1, policy)
    queries = torch.tensor([[0, 2, 3, 4, 14], [5, 6, 7, 8, 14]])  # (2, 5): "a b c :", "d e f g :", left-padded
    rollouts.submit(queries, queries != 0, rloo.SamplingSettings.of(args), torch.arange(queries.shape[0]))  # rows
    c, _ = rollouts.take()  # the load, then the batch
    out["after_the_load"] = max_difference(rollouts.engine.logprobs(fixed_sequences()),
                                           trainer_logprobs(policy, fixed_sequences()))
    with torch.no_grad():
        trainer, _ = rloo.forward_logprobs(policy, c, args.temperature, False)  # (k*B, Tr)
    out["sampled"] = (c.sampler_logprobs - trainer).abs().masked_fill(~c.response_mask, 0).max().item()
    return out


def main(out_path: str, families: list[str], refused: str) -> None:
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    root, results = Path(out_path).parent, {}
    for family in families + ([refused] if refused else []):
        try:
            results[family] = check(family, root, family == refused)
        except Exception as e:
            results[family] = {"error": plumbing.describe(e)}
        print(family, json.dumps(results[family]), flush=True)
        gc.collect()
        cleanup_dist_env_and_memory()  # vLLM's groups and the process group ColocatedRollouts made (the next its own)
    Path(out_path).write_text(json.dumps(results))
    assert not dist.is_initialized()


if __name__ == "__main__":
    argv = sys.argv[1:]
    refused_family = argv[argv.index("--refused") + 1] if "--refused" in argv else ""
    main(argv[0], argv[1].split(","), refused_family)
