"""benchmark/gpu_suite.py (make bench-gpu) in its dry run on CPU: every step starts, writes its JSON and the table,
and a second run skips every step; and the accounting that sets each phase against the machine's measured limits
(benchmark/accounting.py, shared with throughput.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmark import accounting, gpu_suite
from benchmark.throughput import pythia_config, trl_environment_problem
from conftest import REPO, cpu_env

TRL_PYTHON = REPO / "benchmark" / ".venv-trl" / "bin" / "python"


def test_block_parameters_and_the_flop_rule_from_the_config():
    hidden, layers = 128, 6  # pythia-14m: 4 h^2 + 2 * 4 h^2 weights per block, biases and two LayerNorms
    per_block = 12 * hidden**2 + (3 * hidden + hidden + 4 * hidden + hidden) + 4 * hidden
    parameters = accounting.block_parameters(pythia_config("pythia-14m"))
    assert parameters == layers * per_block + 2 * hidden  # and the final LayerNorm
    assert accounting.phase_flops("generation", 10, parameters) == 2 * 10 * parameters
    assert accounting.phase_flops("training", 10, parameters) == 6 * 10 * parameters
    peaks = {"matmul_tflop_per_s": 2.0, "copy_gb_per_s": 100.0}
    rates = accounting.achieved({"training_s": 3.0, "training_tokens": 1e6, "generation_s": 0.0,
                                 "generation_gb_per_s": 25.0}, parameters, peaks)
    assert rates["training_tflop_per_s"] == pytest.approx(6 * 1e6 * parameters / 3.0 / 1e12)
    assert rates["training_of_matmul"] == pytest.approx(rates["training_tflop_per_s"] / 2.0)
    assert rates["decoding_of_copy"] == 0.25 and "generation_tflop_per_s" not in rates  # no time: no rate


def test_measured_limits_are_positive_and_sized():
    peaks = accounting.measure_peaks(torch.device("cpu"), torch.float32, matmul_size=64, copy_bytes=2**20, repeats=2)
    assert peaks["matmul_tflop_per_s"] > 0 and peaks["copy_gb_per_s"] > 0
    assert (peaks["matmul_size"], peaks["copy_bytes"], peaks["matmul_dtype"]) == (64, 2**20, "float32")
    table = accounting.limits_table({"run": {"generation_gb_per_s": 1.0, "decoding_of_copy": 0.5,
                                             "training_tflop_per_s": 0.1, "training_of_matmul": 0.25}}, peaks)
    assert "| run | 1.0 (50%) | - | - | - | - | 0.1 (25.0%) |" in table


def test_the_dry_run_starts_every_step_writes_its_results_and_resumes(tmp_path, monkeypatch, capsys):
    """The first run in this process (its trainers are processes of their own, on the CPU), the second from the
    command line, as make bench-gpu starts it."""
    results = tmp_path / "suite"
    for name, value in cpu_env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as the trainers see it: CUDA_VISIBLE_DEVICES=""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    gpu_suite.main(gpu_suite.Args(dry_run=True, results_dir=str(results), rloo_ks=(2,)))  # k=4's: the same code
    first = capsys.readouterr()
    names = list(gpu_suite.steps(gpu_suite.Args(rloo_ks=(2,))))
    assert names[0] == "limits" and "learning" in names and "vllm_colocate_sleep" in names
    records = {}
    for name in names:
        assert f"== {name}\n" in first.out  # it started
        records[name] = json.loads((results / f"{name}.json").read_text())
        assert records[name]["step"] == name and records[name]["status"]

    assert records["limits"]["bf16"]["matmul_tflop_per_s"] > 0 and records["limits"]["fp32"]["copy_gb_per_s"] > 0
    for variant in ("rloo", "rloo_bf16_generation", "rloo_compile_generation"):
        record = records[f"throughput_k2_{variant}"]
        run = record["result"]
        assert record["status"] == "measured" and run["seconds_per_update"] > 0 and run["training_tflop_per_s"] > 0
        assert 0 < run["training_of_matmul"] and run["training_tokens"] > 0
    assert "--bf16_generation" in records["throughput_k2_rloo_bf16_generation"]["command"]
    assert records["throughput_k2_rloo_bf16_generation"]["mismatch"]  # the bf16 copy's mismatch metrics
    trl = records["throughput_k2_trl021"]
    if trl_environment_problem(TRL_PYTHON) is None:
        assert trl["status"] == "measured" and trl["result"]["seconds_per_update"] > 0, trl["status"]
    else:
        assert os.environ.get("REQUIRE_BENCH_ENV") != "1", trl["status"]
        assert trl["status"].startswith("skipped: TRL not importable"), trl["status"]
    trl116 = records["throughput_k2_trl116"]
    if gpu_suite.throughput.trl116_command(gpu_suite.Args().trl116_site)[1] is None:  # make bench-env's TRL 1.16
        run = trl116["result"]
        assert trl116["status"] == "measured" and trl116["command"][2:4] == [sys.executable, "benchmark/trl116_rloo.py"]
        assert run["seconds_per_update"] > 0 and run["training_tflop_per_s"] > 0 and run["policy_forward_s"] > 0
        assert run["minimum_tokens"] > 0 and run["mean_response_length"] == 8  # --stop_token None: every token
        assert "k=2: rloo.py / TRL 1.16 episodes/s: **" in (results / "table.md").read_text()
    else:
        assert os.environ.get("REQUIRE_BENCH_ENV") != "1", trl116["status"]
        assert trl116["status"].startswith("skipped: TRL 1.16.0 not importable"), trl116["status"]
    plan = records["plan_memory_k2"]
    assert plan["status"] == "predicted only: no CUDA peaks on this device"
    assert plan["phases"]["training"]["predicted_gib"] > plan["groups_gib"]["resident"] > 0
    for name in gpu_suite.VLLM_STEPS:  # the project's environment has no vLLM
        assert records[name]["status"] == "skipped: vLLM not importable"
    assert records["learning"]["status"] == "measured" and records["learning"]["updates"] == 2
    table = (results / "table.md").read_text()
    assert all(f"| {name} |" in table for name in names if name.startswith(("throughput_", "vllm_")))
    assert table in first.out

    written = {name: (results / f"{name}.json").stat().st_mtime_ns for name in names}
    command = [sys.executable, str(REPO / "benchmark" / "gpu_suite.py"), "--dry_run", "--results_dir", str(results),
               "--rloo_ks", "2"]
    second = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=cpu_env(), timeout=300)
    assert second.returncode == 0, second.stdout[-4000:] + second.stderr[-4000:]
    for name in names:
        assert f"== {name}: done earlier ({name}.json), skipped" in second.stdout
    assert "\n$ " not in second.stdout  # no trainer started
    assert {name: (results / f"{name}.json").stat().st_mtime_ns for name in names} == written
    assert (results / "table.md").read_text() == table


def test_without_cuda_and_without_the_flag_the_suite_refuses_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="no CUDA device; --dry_run runs the suite at tiny shapes"):
        gpu_suite.main(gpu_suite.Args(results_dir=str(tmp_path / "suite")))
    assert not (tmp_path / "suite").exists()  # refused before anything is written


def test_a_failing_step_leaves_no_result_the_others_run_and_the_next_start_retries_it(tmp_path, monkeypatch,
                                                                                       capsys):
    ran, broken = [], {"b": True}

    def step(name):
        def run(args, results):
            ran.append(name)
            if broken.get(name):
                raise RuntimeError("CUDA out of memory")
            return {"status": "measured"}
        return run

    monkeypatch.setattr(gpu_suite, "steps", lambda args: {name: step(name) for name in "abc"})
    args = gpu_suite.Args(results_dir=str(tmp_path / "suite"), dry_run=True)
    with pytest.raises(SystemExit, match=r"1 step\(s\) failed: b "):
        gpu_suite.main(args)
    assert ran == ["a", "b", "c"] and "== b: FAILED, nothing written, it runs again next time: CUDA out of memory" \
        in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "suite").iterdir()) == ["a.json", "c.json", "table.md"]
    broken["b"], ran[:] = False, []
    gpu_suite.main(args)
    assert ran == ["b"] and (tmp_path / "suite" / "b.json").exists()


def test_where_vllm_imports_the_colocated_steps_build_their_run(tmp_path, monkeypatch):
    """The project's environment has no vLLM: the vLLM steps' set-up up to the run, with vLLM pretended importable."""
    find_spec, commands = gpu_suite.importlib.util.find_spec, []
    monkeypatch.setattr(gpu_suite.importlib.util, "find_spec",
                        lambda name, *a: object() if name == "vllm" else find_spec(name, *a))

    def run_trainer(command, log, program):
        commands.append(command)
        raise SystemExit("the run itself needs vLLM")

    monkeypatch.setattr(gpu_suite.throughput, "run_trainer", run_trainer)
    args = gpu_suite.Args(results_dir=str(tmp_path), dry_run=True)
    with pytest.raises(SystemExit, match="needs vLLM"):
        gpu_suite.vllm_step("vllm_colocate")(args, tmp_path)
    command = commands[0]
    assert command[1:4] == ["rloo_multinode.py", "--vllm_mode", "colocate"] and "--bf16" in command
    policy = Path(command[command.index("--model_name_or_path") + 1])
    assert "LlamaForCausalLM" in (policy / "config.json").read_text()  # a colocated engine refuses GPT-NeoX
    trl116 = gpu_suite.throughput.trl116_command(args.trl116_site)
    if trl116[1] is None:  # TRL 1.16 with its colocated engine, on the same Llama, where its vLLM range allows
        monkeypatch.setattr(gpu_suite, "vllm_version", lambda: "0.32.0")
        assert gpu_suite.vllm_step("vllm_colocate_trl116")(args, tmp_path) == {
            "status": "skipped: TRL 1.16 supports vLLM 0.22.0 to 0.31.0; this machine has vLLM 0.32.0"}
        monkeypatch.setattr(gpu_suite, "vllm_version", lambda: "0.31.0+cu129")
        with pytest.raises(SystemExit, match="needs vLLM"):
            gpu_suite.vllm_step("vllm_colocate_trl116")(args, tmp_path)
        assert commands[1][:4] == trl116[0] and commands[1][4] == "--use_vllm"
        assert commands[1][commands[1].index("--model_name_or_path") + 1] == str(policy)
    if not torch.cuda.is_available():
        assert gpu_suite.vllm_step("vllm_colocate_sleep")(args, tmp_path) == {
            "status": "skipped: sleep mode needs CUDA"}
    if torch.cuda.device_count() < 2:  # one GPU has no NCCL weight sync: the step says so
        status = gpu_suite.vllm_step("vllm_engine_nccl")(args, tmp_path)["status"]
        assert status.startswith("skipped: a weight sync over NCCL needs 2 GPUs"), status
