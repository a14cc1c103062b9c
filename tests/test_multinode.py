"""rloo_multinode.py on CPU: hf engines in separate processes, weights over gloo, no vLLM."""

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
import typing

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import rloo
import rloo_multinode as mn
from conftest import REPO, policy_tokenizer, read_metrics, run_rloo, script_command, script_env, tiny_policy

RUN = ("--reward_fn", "reward_fns:count_a", "--rloo_k", "4", "--per_device_train_batch_size", "16",
       "--response_length", "6", "--temperature", "1.0", "--max_prompt_length", "16",
       "--local_rollout_forward_batch_size", "12", "--num_ppo_epochs", "2", "--num_mini_batches", "2",
       "--learning_rate", "3e-3", "--num_sample_generations", "0", "--num_evals", "0")
PER_UPDATE = 32  # completions per update and rank
ENGINE_ONLY = ("time/", "eps", "rollout/staleness")  # wall-clock, and what only the engines' run measures


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(script: str, *args, nproc: int = 0, wait: bool = True):
    """The script run to the end, or with wait=False started and returned running."""
    if wait:
        return run_rloo(*args, nproc=nproc, script=script)
    return subprocess.Popen(script_command(script, *args, nproc=nproc), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=script_env(), cwd=REPO)


def comparable(metrics: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if not k.startswith(ENGINE_ONLY)} for m in metrics]


def test_buckets_pack_in_order_and_unpack_to_the_same_tensors():
    tensors = {"a": torch.randn(3, 4), "b": torch.randn(10), "c": torch.randn(2, 2, 2), "d": torch.randn(1)}
    buckets = mn.plan_buckets([(k, v.shape) for k, v in tensors.items()], torch.float32, bucket_bytes=64)
    assert buckets == [[("a", (3, 4))], [("b", (10,))], [("c", (2, 2, 2)), ("d", (1,))]]  # 48 + 40 > 64: split
    for bucket in buckets:
        flat = torch.cat([tensors[name].reshape(-1) for name, _ in bucket])
        for name, tensor in mn.unpack_bucket(flat, bucket):
            assert torch.equal(tensor, tensors[name])
    assert len(mn.plan_buckets([(k, v.shape) for k, v in tensors.items()], torch.bfloat16, 2**20)) == 1


def tied_llama(vocab_size: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))


@pytest.mark.parametrize("architecture", ["gpt_neox", "tied_llama"])
def test_after_a_sync_every_engine_holds_the_trainers_weights_bit_for_bit(architecture, tmp_path):
    tokenizer = policy_tokenizer()
    policy = tiny_policy(len(tokenizer)) if architecture == "gpt_neox" else tied_llama(len(tokenizer))
    policy.save_pretrained(tmp_path / "policy")
    args = mn.Args(model_name_or_path=str(tmp_path / "policy"), engine="hf", output_dir=str(tmp_path / "out"),
                   engine_port=free_port(), sync_bucket_mb=0, engine_timeout=120)  # 0 MB: one bucket per tensor
    dist_info = rloo.Dist(0, 0, 1, torch.device("cpu"))
    store, address = mn.control_store(args, dist_info, torch.device("cpu"))
    engines = mn.ServedEngines(args, dist_info, store, mn.launch_engines(args, dist_info, address))
    rollouts = mn.EngineRollouts(policy, args, None, 0, torch.Generator(), dist_info, engines)
    try:
        with torch.no_grad():  # a trained policy: every weight moved away from what the engine loaded
            for p in policy.parameters():
                p.add_(torch.randn_like(p))
        rollouts.policy_updated(1, policy)
        engine = engines.engine_state_dict(0, 1)
        for name, tensor in policy.state_dict().items():
            assert torch.equal(engine[name], tensor), name
        if architecture == "tied_llama":  # one tensor sent, both ends of the tie updated
            assert torch.equal(engine["lm_head.weight"], policy.model.embed_tokens.weight)
    finally:
        rollouts.close()


@pytest.mark.parametrize("nproc,flags", [(0, []), (2, ["--fsdp", "--num_engines", 2, "--sync_bucket_mb", 1])],
                         ids=["one_process", "fsdp_two_ranks_two_engines"])
def test_hf_engine_run_equals_rloo_run_with_the_same_seed(assets, tmp_path, nproc, flags):
    common = ["--model_name_or_path", assets["policy"], "--dataset_name", assets["train"], *RUN,
              "--total_episodes", 3 * PER_UPDATE * max(nproc, 1), "--kl_coef", 0.05, *flags[:1]]
    local = run("rloo.py", *common, "--output_dir", tmp_path / "local", nproc=nproc)
    assert local.returncode == 0, local.stderr[-3000:]
    engines = run("rloo_multinode.py", *common, *flags[1:], "--output_dir", tmp_path / "engines", "--engine", "hf",
                  "--engine_port", free_port(), nproc=nproc)
    assert engines.returncode == 0, engines.stderr[-3000:]
    local_metrics, engine_metrics = read_metrics(tmp_path / "local"), read_metrics(tmp_path / "engines")
    assert comparable(engine_metrics) == comparable(local_metrics)
    assert [m["rollout/staleness"] for m in engine_metrics] == [0, 0, 0]
    assert all(m["time/weight_sync"] >= 0 for m in engine_metrics)
    assert all(abs(m["val/ratio"] - 1) < 0.05 for m in engine_metrics)
    trained = [AutoModelForCausalLM.from_pretrained(tmp_path / d).state_dict() for d in ("local", "engines")]
    assert all(torch.equal(trained[0][k], trained[1][k]) for k in trained[0])


def test_engines_of_ranks_split_each_batch_by_prompt():
    assert mn.engines_of_ranks(4, 2) == [[0], [1], [0], [1]] and mn.engines_of_ranks(2, 6) == [[0, 2, 4], [1, 3, 5]]
    assert mn.duties(0, 4, 2) == [(0, 0), (2, 0)] and mn.duties(4, 2, 6) == [(0, 2)]
    parts = mn.split_by_prompt(rows=4 * 5, k=4, parts=2)  # 5 prompts x k=4, row j*5 + b: sample j of prompt b
    assert [p.tolist() for p in parts] == [[0, 1, 2, 5, 6, 7, 10, 11, 12, 15, 16, 17], [3, 4, 8, 9, 13, 14, 18, 19]]


def test_async_generation_with_two_engines_trains_one_step_off_policy_with_and_without_fsdp(assets, tmp_path):
    """One rank whose batches are split over 2 engines; without FSDP, and with FSDP (one rank: still shards, and
    the units gathered by a forward), whose sampling weights are put in place and back shard by shard."""
    metrics = {}
    for fsdp in (False, True):
        out = tmp_path / f"async_fsdp{fsdp}"
        result = run("rloo_multinode.py", "--model_name_or_path", assets["policy"], "--dataset_name", assets["train"],
                     *RUN, "--num_ppo_epochs", 1, "--num_mini_batches", 1,  # one step per batch: 16 per update
                     "--total_episodes", 3 * PER_UPDATE // 2, "--output_dir", out, "--engine", "hf",
                     "--num_engines", 2, "--async_generation", "--engine_port", free_port(),
                     *(["--fsdp"] if fsdp else []), nproc=1 if fsdp else 0)
        assert result.returncode == 0, result.stderr[-3000:]
        metrics[fsdp] = read_metrics(out)
        assert [m["rollout/staleness"] for m in metrics[fsdp]] == [0, 1, 1]  # the first batch waits for nothing
        # the ratio is taken against the weights that sampled: the current ones for the first batch (exactly 1),
        # the previous update's for the others (off 1)
        assert abs(metrics[fsdp][0]["val/ratio"] - 1) < 1e-5
        assert all(abs(m["val/ratio"] - 1) > 1e-4 for m in metrics[fsdp][1:])
        assert json.loads((out / "engines.json").read_text()).keys() == {"0", "1"}
    for plain, sharded in zip(metrics[False], metrics[True]):  # the same run, to float tolerance
        for key in ("val/ratio", "loss/policy_avg", "objective/scores", "objective/kl", "policy/entropy_avg"):
            assert sharded[key] == pytest.approx(plain[key], rel=1e-4, abs=1e-6), key


def test_an_engine_that_dies_stops_the_run_with_a_checkpoint_and_names_it(assets, tmp_path):
    out = tmp_path / "dies"
    trainer = run("rloo_multinode.py", "--model_name_or_path", assets["policy"], "--dataset_name", assets["train"],
                  *RUN, "--total_episodes", 1000 * PER_UPDATE, "--output_dir", out, "--engine", "hf",
                  "--engine_port", free_port(), wait=False)
    deadline = time.time() + 120
    while not ((out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").read_text().strip()):
        assert time.time() < deadline and trainer.poll() is None, trainer.communicate()[1][-3000:]
        time.sleep(0.1)
    os.kill(json.loads((out / "engines.json").read_text())["0"]["pid"], signal.SIGKILL)
    stdout, stderr = trainer.communicate(timeout=60)  # never a hang
    assert trainer.returncode == 4, stderr[-3000:]
    assert "engine 0" in stderr and "checkpoint of update" in stderr and "Traceback" not in stderr
    checkpoint = rloo.latest_checkpoint(str(out))
    saved = torch.load(checkpoint / rloo.TRAINER_STATE, weights_only=False)["update"] if checkpoint else 0
    assert saved >= 1
    # the same command with --resume continues with fresh engines, which start from the checkpoint's weights
    resumed = run("rloo_multinode.py", "--model_name_or_path", assets["policy"], "--dataset_name", assets["train"],
                  *RUN, "--total_episodes", (saved + 1) * PER_UPDATE, "--output_dir", out, "--engine", "hf",
                  "--engine_port", free_port(), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {checkpoint}" in resumed.stdout and read_metrics(out)[-1]["update"] == saved + 1


def vllm_standin(tmp_path, name: str, policy, *flags) -> tuple[subprocess.Popen, str, object]:
    """A stand-in `vllm serve` (tests/vllm_standin.py) started on a free port: the process, its URL, its log."""
    port, log = free_port(), tmp_path / f"{name}.jsonl"
    process = subprocess.Popen([sys.executable, str(REPO / "tests" / "vllm_standin.py"), "--model", str(policy),
                                "--port", str(port), "--log", str(log), *map(str, flags)], env=script_env(), cwd=REPO)
    return process, f"http://127.0.0.1:{port}", log


def logged_requests(log) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_attached_vllm_servers_serve_two_ranks_and_hold_the_trainers_weights(assets, tmp_path):
    out = tmp_path / "attached"
    servers = [vllm_standin(tmp_path, "a", assets["policy"], "--workers", 2),
               vllm_standin(tmp_path, "b", assets["policy"])]
    try:
        result = run("rloo_multinode.py", "--model_name_or_path", assets["policy"], "--dataset_name", assets["train"],
                     *RUN, "--output_dir", out, "--num_ppo_epochs", 1, "--num_mini_batches", 1,  # one step per batch,
                     "--total_episodes", 2 * 2 * PER_UPDATE // 2,  # at the sampling weights; 16 per update and rank
                     "--engine_urls", ",".join(url for _, url, _ in servers), "--engine_port", free_port(), nproc=2)
    finally:
        for process, _, _ in servers:
            process.kill()
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = read_metrics(out)
    assert [m["rollout/staleness"] for m in metrics] == [0, 0]
    # the ratio against log-probs the trainer recomputed with the weights the servers sampled with: exactly 1
    assert all(abs(m["val/ratio"] - 1) < 1e-5 and m["time/weight_sync"] > 0 for m in metrics)
    trained = AutoModelForCausalLM.from_pretrained(out).state_dict()
    for (_, _, log), workers in zip(servers, (2, 1)):
        held = torch.load(log.with_suffix(".pt"))  # every worker's weights after the last sync
        assert len(held) == workers
        assert all(torch.equal(worker[name], trained[name]) for worker in held for name in trained)
        requests = logged_requests(log)
        assert [r["path"] for r in requests].count("/reset_prefix_cache") == 3  # the start's weights, each update's
        completions = [r["body"] for r in requests if r["path"] == "/v1/completions"]
        assert len(completions) == 2  # one per update from the one rank this server serves
        assert all(c["max_tokens"] == 6 and c["temperature"] == 1.0 and c["stop_token_ids"] == [1] for c in completions)


def test_one_rank_over_two_vllm_servers_splits_by_prompt_and_stops_with_a_checkpoint_when_one_dies(assets, tmp_path):
    out = tmp_path / "dies"
    servers = [vllm_standin(tmp_path, name, assets["policy"]) for name in "ab"]
    trainer = run("rloo_multinode.py", "--model_name_or_path", assets["policy"], "--dataset_name", assets["train"],
                  *RUN, "--total_episodes", 1000 * PER_UPDATE, "--output_dir", out,
                  "--engine_urls", ",".join(url for _, url, _ in servers), "--async_generation",
                  "--engine_port", free_port(), wait=False)
    try:
        deadline = time.time() + 120
        while not ((out / "metrics.jsonl").is_file() and len(read_metrics(out)) >= 2):
            assert time.time() < deadline and trainer.poll() is None, trainer.communicate()[1][-3000:]
            time.sleep(0.1)
    finally:
        servers[1][0].kill()
    assert [m["rollout/staleness"] for m in read_metrics(out)[:2]] == [0, 1]
    _, stderr = trainer.communicate(timeout=60)  # never a hang
    servers[0][0].kill()
    assert trainer.returncode == 4, stderr[-3000:]
    assert f"vLLM server {servers[1][1]}" in stderr and "checkpoint of update" in stderr, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    # each batch: 8 prompts x k=4, 4 prompts to each server with all their k samples
    batches = [[r["body"]["prompt"] for r in logged_requests(log) if r["path"] == "/v1/completions"][:2]
               for _, _, log in servers]
    for a, b in zip(*batches):
        assert len(a) == len(b) == PER_UPDATE // 2
        assert all(a.count(p) == 4 for p in a) and all(b.count(p) == 4 for p in b)
        assert not {tuple(p) for p in a} & {tuple(p) for p in b}


def test_a_vllm_server_without_development_mode_is_refused_with_the_fix(assets, tmp_path):
    server, url, _ = vllm_standin(tmp_path, "a", assets["policy"], "--no-dev_mode")
    try:
        result = run("rloo_multinode.py", "--model_name_or_path", assets["policy"], "--dataset_name", assets["train"],
                     *RUN, "--total_episodes", PER_UPDATE, "--output_dir", tmp_path / "out", "--engine_urls", url,
                     "--engine_port", free_port())
    finally:
        server.kill()
    assert result.returncode == 4 and "VLLM_SERVER_DEV_MODE=1" in result.stderr, result.stderr[-3000:]
    assert "Traceback" not in result.stderr


def test_engine_flags_that_clash_are_refused_in_one_line(assets, tmp_path):
    common = ["--model_name_or_path", assets["policy"], "--dataset_name", assets["train"], *RUN,
              "--output_dir", tmp_path]
    tensor_parallel = run("rloo_multinode.py", *common, "--engine", "hf", "--vllm_tensor_parallel_size", 2)
    assert tensor_parallel.returncode == 2 and "the hf engine is one device" in tensor_parallel.stderr
    # the same check, in process (rloo.run_script turns a ConfigError into the one line and exit 2 shown above)
    with pytest.raises(rloo.ConfigError, match="drop --engine hf"):
        mn.validate_engine_args(mn.Args(model_name_or_path="m", engine="hf", engine_urls="http://a:8000"), 1)
    with pytest.raises(rloo.ConfigError, match="--num_engines 3 but 2 --engine_urls"):
        mn.validate_engine_args(mn.Args(model_name_or_path="m", engine_urls="http://a:8000,http://b:8000",
                                        num_engines=3), 2)
    with pytest.raises(rloo.ConfigError, match="--num_engines 3 for 2 training rank.*must be a multiple"):
        mn.validate_engine_args(mn.Args(model_name_or_path="m", engine="hf", num_engines=3), 2)
    with pytest.raises(rloo.ConfigError, match="engines: 3 for 2 training rank"):
        mn.validate_engine_args(mn.Args(model_name_or_path="m", engine_urls="http://a,http://b,http://c"), 2)
    mn.validate_engine_args(mn.Args(model_name_or_path="m", engine="hf", num_engines=4), 2)  # 2 engines per rank
    try:
        import vllm  # noqa: F401
    except ImportError:
        no_vllm = run("rloo_multinode.py", *common)
        assert no_vllm.returncode == 2 and "--engine vllm needs vLLM" in no_vllm.stderr
        assert len(no_vllm.stderr.strip().splitlines()) == 1


def test_vllm_api_of_the_pinned_release(monkeypatch):
    """The vLLM symbols and signatures rloo_multinode.py relies on, checked against the installed release."""
    vllm = pytest.importorskip("vllm", reason="vLLM is not installed (pip install -r requirements-vllm.txt)")
    import inspect

    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.utils import StatelessProcessGroup

    assert vllm.__version__ == mn.VLLM_VERSION
    assert {"host", "port", "rank", "world_size"} <= set(inspect.signature(StatelessProcessGroup.create).parameters)
    assert {"src", "stream"} <= set(inspect.signature(PyNcclCommunicator.broadcast).parameters)
    assert hasattr(vllm.LLM, "collective_rpc") and hasattr(vllm.LLM, "reset_prefix_cache")
    params = vllm.SamplingParams(n=1, detokenize=False, **mn.vllm_sampling(mn.Args(model_name_or_path="m"), None))
    assert params.ignore_eos and params.top_k == 0 and params.stop_token_ids == []
    assert vllm.TokensPrompt(prompt_token_ids=[1, 2]) == {"prompt_token_ids": [1, 2]}
    from vllm.engine.arg_utils import EngineArgs

    engine_args = {f.name: f.type for f in dataclasses.fields(EngineArgs)}
    for bf16 in (False, True):  # every LLM(...) argument the engine passes is one of vLLM's, with a valid dtype
        kwargs = mn.vllm_engine_kwargs(mn.Args(model_name_or_path="m", bf16=bf16), 0)
        assert set(kwargs) <= set(engine_args), set(kwargs) - set(engine_args)
        assert kwargs["dtype"] in typing.get_args(engine_args["dtype"])

    # the worker extension's attributes: its rank and the model runner's device and model
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.worker_base import WorkerBase

    assert "self.rank = rank" in inspect.getsource(WorkerBase.__init__)
    assert "self.device = device" in inspect.getsource(GPUModelRunner.__init__)

    # `vllm serve`: the routes the trainer calls exist in development mode, and a completions request as the trainer
    # builds it (the fields the stand-in server accepts) samples as rloo.py does, whatever the generation config says
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    from vllm.entrypoints.openai.api_server import router
    from vllm.entrypoints.openai.protocol import CompletionRequest

    from vllm_standin import COMPLETIONS_FIELDS

    assert {"/health", "/v1/models", "/v1/completions", "/collective_rpc", "/reset_prefix_cache"} <= {
        route.path for route in router.routes}
    body = mn.completions_body("m", torch.tensor([[0, 5, 6], [7, 8, 9]]), torch.tensor([[0, 1, 1], [1, 1, 1]]),
                               mn.Args(model_name_or_path="m", response_length=6, temperature=0.7), 1)
    assert set(body) == COMPLETIONS_FIELDS and COMPLETIONS_FIELDS <= set(CompletionRequest.model_fields)
    request = CompletionRequest(**body)
    assert request.prompt == [[5, 6], [7, 8, 9]] and request.return_token_ids
    params = request.to_sampling_params(6, None, {"top_k": 50, "top_p": 0.9, "repetition_penalty": 1.3})
    assert (params.temperature, params.top_k, params.top_p, params.min_p, params.repetition_penalty) == (
        0.7, 0, 1.0, 0.0, 1.0)
    assert params.ignore_eos and params.stop_token_ids == [1] and params.max_tokens == 6


@pytest.mark.skipif(not torch.cuda.is_available(), reason="vLLM engines need a GPU")
def test_vllm_engine_trains_the_tiny_policy(assets, tmp_path):
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install -r requirements-vllm.txt)")
    if torch.cuda.device_count() < 2:
        pytest.skip("the trainer and a vLLM engine need two GPUs")
    result = run("rloo_multinode.py", "--model_name_or_path", assets["policy"], "--dataset_name", assets["train"],
                 *RUN, "--total_episodes", 2 * PER_UPDATE, "--output_dir", tmp_path, "--engine", "vllm",
                 "--engine_port", free_port(), "--vllm_gpu_memory_utilization", 0.2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert all(abs(m["val/ratio"] - 1) < 0.05 for m in read_metrics(tmp_path))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="vLLM engines need a GPU")
def test_trainer_attached_to_a_real_vllm_serve_trains_the_tiny_policy(assets, tmp_path):
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install -r requirements-vllm.txt)")
    if torch.cuda.device_count() < 2:
        pytest.skip("the trainer and a vLLM server need two GPUs")
    port, log = free_port(), open(tmp_path / "vllm_serve.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(assets["policy"]), "--port", str(port),
         "--dtype", "float32", "--max-model-len", "64", "--gpu-memory-utilization", "0.2", "--enforce-eager",
         "--worker-extension-cls", "rloo_multinode.VLLMWorkerExtension"], stdout=log, stderr=subprocess.STDOUT,
        env=script_env({"CUDA_VISIBLE_DEVICES": "1", "VLLM_SERVER_DEV_MODE": "1",
                        "PYTHONPATH": f"{REPO}:{REPO / 'tests'}"}), cwd=REPO)
    try:
        result = run("rloo_multinode.py", "--model_name_or_path", assets["policy"], "--dataset_name", assets["train"],
                     *RUN, "--num_ppo_epochs", 1, "--num_mini_batches", 1, "--total_episodes", PER_UPDATE,
                     "--output_dir", tmp_path / "out", "--engine_urls", f"http://127.0.0.1:{port}",
                     "--engine_port", free_port())
    finally:
        server.kill()
    assert result.returncode == 0, result.stderr[-3000:] + (tmp_path / "vllm_serve.log").read_text()[-3000:]
    assert all(abs(m["val/ratio"] - 1) < 1e-5 for m in read_metrics(tmp_path / "out"))


def test_an_engine_timeout_of_zero_and_a_port_in_use_are_refused_before_anything_loads():
    for timeout in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(rloo.ConfigError, match="engine_timeout = .* must be a finite number of seconds > 0"):
            mn.validate_engine_args(mn.Args(model_name_or_path="m", engine="hf", engine_timeout=timeout), 1)
    with socket.socket() as taken:  # what an earlier run, or anything else, listening there looks like
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for engine_port in (port, port - 1):  # the control store's port, or the weight group's after it
            with pytest.raises(rloo.ConfigError, match=rf"--engine_port {engine_port}: port \d+ is in use.* another"):
                mn.validate_engine_args(mn.Args(model_name_or_path="m", engine="hf", engine_port=engine_port), 1)
