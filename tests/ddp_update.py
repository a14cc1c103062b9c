"""Two PPO epochs of one minibatch on a fixed global batch of 8 completions (k = 2 of 4 prompts), in one process or
split by prompt over the ranks of a torchrun, with DDP or (argv[2] == "fsdp", "fsdp_offload") FSDP2; rank 0 saves the updated parameters to argv[1].
Used by test_distributed.py."""

import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from conftest import policy_tokenizer, tiny_policy
import plumbing
from plumbing.distributed import shard_policy
import rloo

GLOBAL_PROMPTS, K = 4, 2  # 8 completions


def main(out_path: str, wrapper: str) -> None:
    dist_info = plumbing.setup_distributed()
    tokenizer = policy_tokenizer()
    policy = tiny_policy(len(tokenizer), seed=0)
    torch.manual_seed(123)  # the same global batch on every rank
    prompts = [tokenizer(p)["input_ids"] for p in ["a b :", "c d e :", "f :", "g h :"]]
    queries, query_mask = plumbing.pad_sequences(prompts, tokenizer.pad_token_id, torch.device("cpu"))  # (4, Tq)
    c = rloo.sample_completions(policy, queries, query_mask, 5, 1.0, tokenizer.eos_token_id, tokenizer.pad_token_id,
                                k=K)  # (k*B, Tr) responses
    with torch.no_grad():
        logprobs, _ = rloo.forward_logprobs(policy, c, 1.0, share_prompt=True)
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
        model = shard_policy(policy, bf16=False, offload=wrapper == "fsdp_offload")
    else:
        model = DDP(policy) if dist.is_initialized() else policy
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.1)  # plain SGD: the update is a multiple of the gradient
    rloo.ppo_update(model, optimizer, rollout, scores[rows], args, sizes, True,
                    lambda: torch.autocast("cpu", enabled=False))  # whole prompt groups: the same advantages
    if wrapper.startswith("fsdp"):  # every rank sends its shards
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        state = policy.state_dict()
    if dist_info.master:
        torch.save(state, out_path)
    plumbing.barrier()  # no rank tears the group down while another still uses it


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "ddp")
    plumbing.end_distributed()  # main's DDP wrapper gone first
