"""`vllm serve` of each family that vLLM's CPU build runs exactly when colocated (test_vllm.py's families test: Llama;
tied input and output embeddings, GPT-2 and a tied Llama; Mistral, every layer sliding; Gemma 2, sliding and full;
Falcon-H1, attention and state-space): a run attached to the server trains an update and syncs, and the server then
scores fixed completions as the trained policy does, and its sampler's log-probs are the trainer's; a LoRA run's
adapters (--lora_sync adapters) sample as the trainer's adapters score, served and colocated. One engine per family
and mode, about half a minute each on 2 cores: `make test-vllm-families`, kept out of `make test-vllm` and CI
(GPT-NeoX, served and colocated, is in test_vllm.py)."""

import pytest
import torch
import transformers

from test_vllm import (COLOCATED, COLOCATED_PER_UPDATE, LOGPROB_TOLERANCE, LORA, PER_UPDATE,  # vllm first
                       cpu_vllm_server, on_cpu, server_logprobs)
import plumbing
import rloo_multinode as mn
from colocated_families import FAMILIES, TINY
from conftest import policy_tokenizer, read_metrics
from helpers import (ENGINE_RUN, fixed_sequences, free_port, lora_targets, max_difference, run_script,
                     trainer_logprobs)

CONFIGS = {"llama": transformers.LlamaConfig(**TINY), "tied_llama": transformers.LlamaConfig(**TINY,
                                                                                             tie_word_embeddings=True),
           **{family: FAMILIES[family][0] for family in ("gpt2", "mistral", "gemma2", "falcon_h1")}}
LORA_FAMILIES = [family for family in CONFIGS if family != "gpt2"]  # vLLM 0.32 has no LoRA for GPT-2


def saved_policy(family: str, folder) -> None:
    config = CONFIGS[family]
    torch.manual_seed(0)
    head = "LMHeadModel" if family == "gpt2" else "ForCausalLM"
    policy = getattr(transformers, type(config).__name__.removesuffix("Config") + head)(config)
    policy.save_pretrained(folder)
    policy_tokenizer().save_pretrained(folder)


@on_cpu
@pytest.mark.parametrize("family", CONFIGS)
def test_a_run_attached_to_a_vllm_server_of_each_family_leaves_it_scoring_as_the_trained_policy(family, assets,
                                                                                              tmp_path):
    saved_policy(family, tmp_path / "policy")
    sequences, log = fixed_sequences(), tmp_path / "vllm_serve.log"
    with cpu_vllm_server(tmp_path / "policy", log) as url:
        before = server_logprobs(url, sequences, key=None)
        result = run_script("rloo_multinode.py", "--model_name_or_path", tmp_path / "policy", "--dataset_name",
                            assets["train"], *ENGINE_RUN, "--num_ppo_epochs", 1, "--num_mini_batches", 1,
                            "--total_episodes", PER_UPDATE // 2, "--output_dir", tmp_path / "out", "--engine_urls",
                            url, "--engine_port", free_port())
        assert result.returncode == 0, result.stderr[-3000:] + log.read_text()[-3000:]
        after = server_logprobs(url, sequences, key=None)
    [metrics] = read_metrics(tmp_path / "out")
    trained = trainer_logprobs(plumbing.load_causal_lm(str(tmp_path / "out"), torch.float32, False).eval(), sequences)
    print(f"{family}: max |vLLM server - trained policy| log-prob: before the run "
          f"{max_difference(before, trained):.2e}, after {max_difference(after, trained):.2e}; sampled tokens "
          f"{metrics['mismatch/logprob_diff_max']:.2e}")
    assert abs(metrics["val/ratio"] - 1) < 1e-5 and metrics["mismatch/logprob_diff_max"] < LOGPROB_TOLERANCE
    assert max_difference(after, trained) < LOGPROB_TOLERANCE
    assert max_difference(before, trained) > 100 * LOGPROB_TOLERANCE


@on_cpu
@pytest.mark.parametrize("mode", ["served", "colocated"])
@pytest.mark.parametrize("family", LORA_FAMILIES)
def test_a_lora_run_with_an_engine_of_each_family_samples_with_the_trainer_s_adapters(family, mode, assets, tmp_path):
    """--use_peft --lora_sync adapters on every linear layer the family's adapters reach (lora_targets), with a
    `vllm serve` attached or an engine in the training process (--vllm_mode colocate): the engine loads the adapters
    at each sync, and the second update's completions, sampled with the first update's adapters, have the trainer's
    log-probs."""
    saved_policy(family, tmp_path / "policy")
    command = ["rloo_multinode.py", "--model_name_or_path", tmp_path / "policy", "--dataset_name", assets["train"],
               *ENGINE_RUN, *LORA, "--lora_target_modules", *lora_targets(family), "--lora_sync", "adapters",
               "--total_episodes", 2 * COLOCATED_PER_UPDATE, "--output_dir", tmp_path / "out"]  # 2 updates
    log = tmp_path / "vllm_serve.log"
    if mode == "colocated":
        result = run_script(*command, *COLOCATED)
    else:
        with cpu_vllm_server(tmp_path / "policy", log, "--enable-lora", "--max-lora-rank", "8",
                             env={mn.RUNTIME_LORA: "1"}) as url:
            result = run_script(*command, "--num_ppo_epochs", 1, "--num_mini_batches", 1, "--engine_urls", url,
                                "--engine_port", free_port())
    assert result.returncode == 0, result.stderr[-3000:] + (log.read_text()[-3000:] if log.exists() else "")
    metrics = read_metrics(tmp_path / "out")
    print(f"{family}, {mode}: sampler - trainer log-prob, max per update:",
          [f"{m['mismatch/logprob_diff_max']:.1e}" for m in metrics])
    moved = abs(metrics[1]["objective/kl"])  # the adapters' log-probs apart from the reference's (k1: of any sign)
    assert [m["update"] for m in metrics] == [1, 2] and moved > 100 * LOGPROB_TOLERANCE
    assert all(abs(m["val/ratio"] - 1) < 1e-5 and m["mismatch/logprob_diff_max"] < LOGPROB_TOLERANCE
               for m in metrics)
    if mode == "served":
        assert log.read_text().count("Loaded new LoRA adapter: name 'rloo-") >= 2  # the start's, update 1's
