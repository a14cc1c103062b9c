"""rloo_multinode.py's command line with its colocated rollout source watched, for test_vllm.py. On every rank,
output_dir/sync_check_rank<r>.jsonl gets, after each optimizer step and after the engine's next weight load, the
largest |engine - trainer| log-prob of fixed completions (vLLM's prompt log-probs against a plain forward of the
policy; not with --lora_sync adapters, whose LoRA-enabled engine vLLM 0.32's CPU build cannot ask for prompt
log-probs), and after the load the largest |sampler - trainer| log-prob of the tokens drawn and whether the
completions carry the rows of the prompts submitted (prompt_index). With FAIL_AT_BATCH=n, rank FAIL_RANK's (default
0) vLLM engine raises when it samples its n-th batch; with BAD_ANSWER=case too, it answers that batch wrongly instead,
as vllm_standin.BAD_ANSWERS' case makes an answer wrong. With a --reward_model_path, output_dir/models_rank<r>.json
gets, once the engine has started, how far the losses and gradients of a forward and backward of a reference and a
reward model, both loaded before the engine started (as rloo.py loads them), moved from what they were before the
start."""

import json
import os
from pathlib import Path

import torch

import conftest  # noqa: F401  (puts the repository on the path)
import plumbing
import rloo
import rloo_multinode as mn
from helpers import fixed_sequences, max_difference, trainer_logprobs
from vllm_standin import BAD_ANSWERS


def loss_and_gradients(model) -> list[torch.Tensor]:
    """A forward and backward of a model of the trainer's (a causal LM or a reward model) on fixed token ids."""
    model.zero_grad()
    ids = torch.tensor(fixed_sequences()[2])[None]  # (1, T)
    loss = model(ids).logits.float().square().mean()
    loss.backward()
    return [loss.detach()] + [p.grad.clone() for p in model.parameters()]


class WatchedRollouts(mn.ColocatedRollouts):
    batches = 0

    def __init__(self, policy, args, *rest):
        models = {"reference": plumbing.load_causal_lm(args.model_name_or_path, torch.float32, False)}  # as resumed
        if args.reward_model_path:
            models["reward model"] = plumbing.load_reward_model(args.reward_model_path, torch.float32, False)
        before = {name: loss_and_gradients(model) for name, model in models.items()}
        super().__init__(policy, args, *rest)
        if args.reward_model_path:
            moved = {name: max((a - b).abs().max().item() for a, b in zip(loss_and_gradients(model), before[name]))
                     for name, model in models.items()}
            (Path(args.output_dir) / f"models_rank{self.dist_info.rank}.json").write_text(json.dumps(moved))

    def record(self, when: str, **more) -> None:
        sequences, difference = fixed_sequences(), None
        if not mn.sends_adapter_files(self.args):  # vLLM 0.32's CPU build fails prompt log-probs with LoRA enabled
            difference = max_difference(self.engine.logprobs(sequences), trainer_logprobs(self.policy, sequences))
            plumbing.reshard(self.policy)  # with FSDP, the parameters the optimizer holds (a forward leaves the root's)
        with open(Path(self.args.output_dir) / f"sync_check_rank{self.dist_info.rank}.jsonl", "a") as f:
            f.write(json.dumps({"version": self.version, "when": when, "difference": difference, **more}) + "\n")

    def submit(self, queries, query_mask, sampling, prompt_index):
        self.submitted = prompt_index
        super().submit(queries, query_mask, sampling, prompt_index)

    def take(self):
        self.batches += 1
        if self.batches == int(os.environ.get("FAIL_AT_BATCH", 0)) and \
                self.dist_info.rank == int(os.environ.get("FAIL_RANK", 0)):
            def fail(*args, **kwargs):
                raise RuntimeError("the test's failure")

            def answer_badly(request, generate=self.engine.generate):
                answer = generate(request)
                BAD_ANSWERS[os.environ["BAD_ANSWER"]](answer, request["stop_token_id"], self.policy.config.vocab_size)
                return answer

            if "BAD_ANSWER" in os.environ:
                self.engine.generate = answer_badly
            else:
                self.engine.llm.generate = fail
        loads = self.engine_version != self.version
        completions, metrics = super().take()
        if loads:  # and the sampler's own log-probs of the tokens it drew against the trainer's, at its temperature
            with torch.no_grad():
                trainer, _ = rloo.forward_logprobs(self.policy, completions, self.args.temperature, False)  # (k*B, Tr)
            plumbing.reshard(self.policy)
            sampled = (completions.sampler_logprobs - trainer).abs().masked_fill(~completions.response_mask, 0)
            sampled = sampled.max().item()
            self.record("after the load", sampled_difference=sampled,
                        carried=torch.equal(completions.prompt_index.cpu(), self.submitted.cpu()))
        return completions, metrics

    def policy_updated(self, update: int, policy):
        out = super().policy_updated(update, policy)
        self.record("before the load")
        return out


if __name__ == "__main__":
    mn.ColocatedRollouts = WatchedRollouts
    mn.cli()
