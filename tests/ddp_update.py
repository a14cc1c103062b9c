"""Two PPO epochs of one minibatch on a fixed global batch of 8 completions (k = 2 of 4 prompts), in one process or
split by prompt over the ranks of a torchrun, with DDP or (argv[2] "fsdp", "fsdp_offload") FSDP2, for each family of
argv[3] (comma-separated: gpt_neox, the tests' tiny policy, or one of helpers.ARCHITECTURES; default gpt_neox); "lora":
LoRA adapters on the family's model (for gpt_neox a tied Llama-like one), in one process, "fsdp_lora" sharded with
them. Rank 0 saves to argv[1], for each family, the parameters before and after, and after each micro-step whether
the sharded trained parameters held a gradient yet (FSDP: whether that micro-step reduce-scattered), and the updated policy's log-probs of the whole batch
(with LoRA, its reference's too: the same module with its adapters off), FSDP's blocks gathered as for a rollout; with
LoRA, the adapter as a run saves it to argv[1].<family>.adapter. Used by test_distributed.py."""

import contextlib
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import policy_tokenizer, tiny_policy
from helpers import ARCHITECTURES, lora_targets, tiny_architecture
import plumbing
from plumbing.distributed import shard_policy
import rloo

GLOBAL_PROMPTS, K = 4, 2  # 8 completions


def lora_policy(vocab_size: int, family: str) -> torch.nn.Module:
    """For gpt_neox, a tied Llama-like model; else the family's tiny model: with adapters on every linear layer
    (lora_targets), their B matrices drawn (peft starts them at 0, which gives A no gradient in a first step)."""
    torch.manual_seed(0)
    policy = tiny_architecture(family) if family != "gpt_neox" else LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True, pad_token_id=0, eos_token_id=1)).eval()
    plumbing.add_adapters(policy, rloo.Args(use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0,
                                            lora_target_modules=lora_targets(family)), None)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if ".lora_B." in name:
                p.normal_(std=0.1)
    return policy


def main(out_path: str, wrapper: str, families: list[str]) -> None:
    dist_info = plumbing.setup_distributed()
    results = {family: update(family, wrapper, dist_info, out_path) for family in families}
    if dist_info.master:
        torch.save(results, out_path)
    plumbing.barrier()  # no rank tears the group down while another still uses it


def update(family: str, wrapper: str, dist_info: plumbing.Dist, out_path: str) -> dict:
    tokenizer = policy_tokenizer()
    if "lora" in wrapper:
        policy = lora_policy(len(tokenizer), family)
    else:
        policy = tiny_policy(len(tokenizer), seed=0) if family == "gpt_neox" else tiny_architecture(family)
    share_prompt = family == "gpt_neox" or ARCHITECTURES[family][2] is None  # state-space layers cannot share
    initial = {name: p.detach().clone() for name, p in policy.state_dict().items()}
    torch.manual_seed(123)  # the same global batch on every rank
    prompts = [tokenizer(p)["input_ids"] for p in ["a b :", "c d e :", "f :", "g h :"]]
    queries, query_mask = plumbing.pad_sequences(prompts, tokenizer.pad_token_id, torch.device("cpu"))  # (4, Tq)
    c = rloo.sample_completions(policy, queries, query_mask, 5, 1.0, tokenizer.eos_token_id, tokenizer.pad_token_id,
                                k=K)  # (k*B, Tr) responses
    with torch.no_grad():
        logprobs, _ = rloo.forward_logprobs(policy, c, 1.0, share_prompt)
    scores = torch.randn(K * GLOBAL_PROMPTS)
    rollout = rloo.Rollout(c.queries, c.query_mask, c.responses, c.response_mask, logprobs * c.response_mask, None)

    per_rank = GLOBAL_PROMPTS // dist_info.world_size  # each rank trains on all k completions of its prompts
    mine = torch.arange(dist_info.rank * per_rank, (dist_info.rank + 1) * per_rank)
    rows = rloo.completion_rows(mine, GLOBAL_PROMPTS, K)
    rollout = rollout.of_prompts(mine)  # cut to this rank's own widths: padding changes no value
    args = rloo.Args(rloo_k=K, per_device_train_batch_size=2, gradient_accumulation_steps=per_rank * K // 2,
                     num_mini_batches=1, num_ppo_epochs=2, temperature=1.0, max_grad_norm=0.0)
    sizes = rloo.compute_batch_sizes(args, dist_info.world_size)
    if wrapper.startswith("fsdp"):
        model = shard_policy(policy, bf16=False, offload=wrapper.endswith("offload"))
    else:
        model = DDP(policy) if dist.is_initialized() else policy
    trainable = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(trainable, lr=0.1)  # plain SGD: the update is a multiple of the gradient
    synced, gradient_sync = [], plumbing.gradient_sync

    @contextlib.contextmanager
    def observed(module, enabled: bool):
        with gradient_sync(module, enabled):
            yield
        synced.append((enabled, all(p.grad is not None for p in trainable)))

    plumbing.gradient_sync = observed  # rloo.ppo_update looks it up there at each micro-step
    try:
        rloo.ppo_update(model, optimizer, rollout, scores[rows], args, sizes, share_prompt,
                        lambda: torch.autocast("cpu", enabled=False))  # whole prompt groups: the same advantages
    finally:
        plumbing.gradient_sync = gradient_sync
    with torch.no_grad(), plumbing.gathered_for_rollout(policy, "unshard"):  # every rank: FSDP's forward gathers
        logprobs = {"policy": rloo.forward_logprobs(policy, c, 1.0, share_prompt)[0]}  # (k*B, Tr)
        if "lora" in wrapper:
            logprobs["reference"] = rloo.forward_logprobs(plumbing.AdaptersOff(policy), c, 1.0, share_prompt)[0]
    if wrapper.startswith("fsdp"):  # every rank sends its shards
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        state = policy.state_dict()
    if "lora" in wrapper:  # with FSDP a collective
        plumbing.checkpoints.save_policy(policy, tokenizer, f"{out_path}.{family}.adapter", dist_info.rank)
    return {"initial": initial, "final": state, "synced": synced, "logprobs": logprobs}


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "ddp",
         (sys.argv[3] if len(sys.argv) > 3 else "gpt_neox").split(","))
    plumbing.end_distributed()  # main's DDP wrapper gone first
