"""Two gloo ranks under torchrun: what rloo_multinode.py sends engines from a policy sharded by FSDP2 as --fsdp shards
it (plumbing.shard_policy: every block a unit, and the root) is what it sends from the same policy unsharded, bit for
bit, for the tests' GPT-NeoX and every family of helpers.ARCHITECTURES: the weights by their names (engine_weights;
"full"), and with LoRA adapters on every linear layer the merged weights (peft's merge of each adapted weight, which
is also merge_and_unload's) and the adapter's files (adapter_files; "lora", and on GPT-NeoX "dora").
Rank 0 prints one line per case: `<family> <case> ok`, or what differs. Used by test_multinode.py."""

import copy
import sys

import torch
import torch.distributed as dist
from peft.tuners.tuners_utils import BaseTunerLayer

import conftest  # noqa: F401  (puts the repository on the path)
import plumbing
import rloo
import rloo_multinode as mn
from helpers import ARCHITECTURES, lora_targets, policy_tokenizer, tiny_architecture, tiny_policy

CASES = {"gpt_neox": ("full", "lora", "dora"), **{family: ("full", "lora") for family in ARCHITECTURES}}


def policy_of(family: str, case: str) -> torch.nn.Module:
    """The family's tiny model; with LoRA, trained adapters (peft starts B at 0, which merges to the base)."""
    torch.manual_seed(0)
    policy = tiny_policy(len(policy_tokenizer())) if family == "gpt_neox" else tiny_architecture(family)
    if case != "full":
        plumbing.add_adapters(policy, rloo.Args(use_peft=True, lora_r=2, lora_dropout=0.0, use_dora=case == "dora",
                                                lora_target_modules=lora_targets(family)), None)
        with torch.no_grad():
            for p in policy.parameters():
                if p.requires_grad:
                    p.normal_(0, 0.1)
    return policy


def differences(family: str, case: str) -> list[str]:
    policy = policy_of(family, case)
    whole = {name: w.value().clone() for name, w in mn.engine_weights(policy).items()}
    differ = []
    if case != "full":  # the merged weights are peft's merge_and_unload's, by the base's names
        merged = copy.deepcopy(policy)
        for module in merged.modules():
            if isinstance(module, BaseTunerLayer):
                module.merge()
        merged = {name.replace(".base_layer", ""): p for name, p in merged.named_parameters() if "lora_" not in name}
        differ += [f"merge {name}" for name, value in whole.items() if not torch.equal(value, merged[name])]
    files = mn.adapter_files(policy) if case != "full" else {}
    plumbing.distributed.shard_policy(policy, bf16=False)  # as --fsdp shards it: a unit per block, the root
    sharded = {name: mn.unsharded(w.value()) for name, w in mn.engine_weights(policy).items()}
    differ += [name for name in whole if not torch.equal(whole[name], sharded[name])]
    if case != "full":
        differ += [name for name, data in mn.adapter_files(policy).items() if data != files[name]]
    return differ


if __name__ == "__main__":
    dist.init_process_group("gloo")
    for family, cases in CASES.items():
        for case in cases:
            differ = differences(family, case)
            if dist.get_rank() == 0:
                print(f"{family} {case} {'ok' if not differ else differ[:5]}", file=sys.stderr, flush=True)
    dist.destroy_process_group()
