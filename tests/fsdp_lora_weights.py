"""Two gloo ranks under torchrun: what rloo_multinode.py sends engines from a LoRA policy sharded by FSDP2 as --fsdp
shards it (plumbing.shard_policy: every block a unit, and the root) is what it sends from the same policy unsharded,
bit for bit: the merged weights (engine_weights: peft's merge of each adapted weight, plain LoRA and DoRA) and the
adapter's files (adapter_files).
Rank 0 prints one line per case: `<case> ok`, or the weights that differ. Used by test_multinode.py."""

import sys

import torch
import torch.distributed as dist
from peft import LoraConfig
from transformers import GPTNeoXForCausalLM

import conftest  # noqa: F401  (puts the repository on the path)
import plumbing
import rloo_multinode as mn
from helpers import neox_config

if __name__ == "__main__":
    dist.init_process_group("gloo")
    for case in ("lora", "dora"):
        torch.manual_seed(0)
        policy = GPTNeoXForCausalLM(neox_config(20))
        policy.add_adapter(LoraConfig(r=2, target_modules="all-linear", lora_dropout=0.0, use_dora=case == "dora"))
        with torch.no_grad():  # trained adapters
            for p in policy.parameters():
                if p.requires_grad:
                    p.normal_(0, 0.1)
        whole = {name: w.value().clone() for name, w in mn.engine_weights(policy).items()}
        files = mn.adapter_files(policy)
        plumbing.distributed.shard_policy(policy, bf16=False)  # as --fsdp shards it: a unit per block, the root
        sharded = {name: mn.unsharded(w.value()) for name, w in mn.engine_weights(policy).items()}
        differ = [name for name in whole if not torch.equal(whole[name], sharded[name])]
        differ += [name for name, data in mn.adapter_files(policy).items() if data != files[name]]
        if dist.get_rank() == 0:
            print(f"{case} {'ok' if not differ else differ}", file=sys.stderr, flush=True)
    dist.destroy_process_group()
