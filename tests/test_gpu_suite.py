"""benchmark/gpu_suite.py (make bench-gpu) in its dry run on CPU: every step starts, writes its JSON and the table,
and a second run skips every step; the budget, with a clock and expected seconds of the tests' own (no test here
depends on this machine's speed): the order, a step that cannot fit not started, the next call continuing, the
expected seconds from the shapes and then from what was measured; the results folder named by the GPU; and the
accounting that sets each phase against the machine's measured limits (benchmark/accounting.py, shared with
throughput.py)."""

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import plumbing

from benchmark import accounting, gpu_suite
from benchmark.throughput import pythia_config, trl_environment_problem
from conftest import REPO, cpu_env
from helpers import python

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


def test_a_measured_runs_weights_are_dropped_its_metrics_kept_and_no_link_followed(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "model.safetensors").write_bytes(b"another's")
    run = tmp_path / "run"
    (run / "checkpoints" / "step_2").mkdir(parents=True)
    (run / "checkpoints" / "step_2" / "rank0.pt").write_bytes(b"x")
    for name in ("model.safetensors", "pytorch_model.bin", "metrics.jsonl", "args.json", "config.json"):
        (run / name).write_text("x")
    (run / "linked.safetensors").symlink_to(outside / "model.safetensors")
    gpu_suite.throughput.drop_weights(run)
    assert sorted(p.name for p in run.iterdir()) == ["args.json", "config.json", "metrics.jsonl"]
    assert (outside / "model.safetensors").read_bytes() == b"another's"


@pytest.mark.bench
def test_the_dry_run_starts_every_step_writes_its_results_and_resumes(tmp_path, monkeypatch, capsys):
    """The first run in this process (its trainers are processes of their own, on the CPU), the second from the
    command line, as make bench-gpu starts it. A budget no CPU reaches: what fits is tested with a clock of the
    test's own (below)."""
    results, runs = tmp_path / "suite", tmp_path / "runs"
    for name, value in cpu_env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as the trainers see it: CUDA_VISIBLE_DEVICES=""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    gpu_suite.main(gpu_suite.Args(dry_run=True, results_dir=str(results), runs_dir=str(runs), rloo_ks=(2,),
                                  budget_s=86_400))  # k=4's: the same code
    first = capsys.readouterr()
    names = list(gpu_suite.steps(gpu_suite.Args(rloo_ks=(2,))))
    assert names[0] == "limits" and "learning" in names and "vllm_colocate_sleep" in names
    records = {}
    for name in names:
        records[name] = json.loads((results / f"{name}.json").read_text())
        assert records[name]["step"] == name and records[name]["status"] and records[name]["finished_at"]
        if records[name]["status"].startswith("skipped"):
            continue
        expected = records[name]["expected"]  # said before it started
        assert f"== {name}: expected ~{expected['seconds']:.0f} s ({expected['from']}), " in first.out
        assert first.out.index(f"== {name}: expected") < first.out.index(f"== {name}: {records[name]['status']}")
    assert first.out.index("== limits: expected") < first.out.index("== throughput_k2_rloo: expected") \
        < first.out.index("== plan_memory_k2: expected") < first.out.index("== learning: expected") \
        < first.out.index("== throughput_k2_rloo_bf16_generation: expected")  # in order of value
    assert records["throughput_k2_rloo"]["expected"]["from"] == "from the shapes"  # the first of its kind
    scaled = records["throughput_k2_rloo_bf16_generation"]["expected"]["from"]  # then from what was measured
    assert scaled.startswith("from the shapes, x") and scaled.endswith(" measured"), scaled
    assert "== every step done (" in first.out

    assert records["limits"]["bf16"]["matmul_tflop_per_s"] > 0 and records["limits"]["fp32"]["copy_gb_per_s"] > 0
    for variant in ("rloo", "rloo_bf16_generation", "rloo_compile_generation"):
        record = records[f"throughput_k2_{variant}"]
        run_dir = runs / f"throughput_k2_{variant}"  # measured, then its weights dropped: the disk holds few
        assert (run_dir / "metrics.jsonl").is_file() and not (run_dir / "checkpoints").exists()
        assert not [p.name for p in run_dir.iterdir() if p.suffix in (".safetensors", ".bin", ".pt")]
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
    assert plumbing.written_by(results / "table.md") == "benchmark/gpu_suite.py"  # its own: the next call rewrites it
    whole, table = table, table.rpartition("\n<!-- written by ")[0]  # without its mark
    assert all(f"| {name} |" in table for name in names if name.startswith(("throughput_", "vllm_")))
    assert f", measured {records['limits']['finished_at'][:10]}" in table.splitlines()[0]
    assert f"({len(names)} of {len(names)} steps done)" in table.splitlines()[0]
    assert table in first.out

    written = {name: (results / f"{name}.json").stat().st_mtime_ns for name in names}
    command = [python(), str(REPO / "benchmark" / "gpu_suite.py"), "--dry_run", "--results_dir", str(results),
               "--runs_dir", str(runs), "--rloo_ks", "2"]
    second = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=cpu_env(), timeout=300)
    assert second.returncode == 0, second.stdout[-4000:] + second.stderr[-4000:]
    for name in names:
        assert f"== {name}: done earlier ({name}.json), skipped" in second.stdout
    assert "\n$ " not in second.stdout  # no trainer started
    assert {name: (results / f"{name}.json").stat().st_mtime_ns for name in names} == written
    assert (results / "table.md").read_text() == whole


def test_the_order_is_by_value_the_headline_pair_first():
    names = list(gpu_suite.steps(gpu_suite.Args()))
    assert names[:5] == ["limits", "throughput_k2_rloo", "throughput_k2_trl116", "plan_memory_k2", "learning"]
    assert names[5:] == [
        "throughput_k4_rloo", "throughput_k4_trl116", "plan_memory_k4",
        "throughput_k2_rloo_bf16_generation", "throughput_k4_rloo_bf16_generation",
        "throughput_k2_rloo_compile_generation", "throughput_k4_rloo_compile_generation",
        "throughput_k2_trl021", "throughput_k4_trl021", *gpu_suite.VLLM_STEPS]
    assert gpu_suite.steps(gpu_suite.Args())["plan_memory_k2"].needs == ("throughput_k2_rloo",)


class Clock:
    """The test's own time: it moves only when a fake step says it ran for so many seconds."""

    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def fake_suite(monkeypatch, clock: Clock, ran: list, plan: dict):
    """gpu_suite.steps replaced by steps named by `plan` (name -> (expected seconds, seconds it takes, needs)), in
    that order, each of a kind of its own (none scales another's expected seconds): each records its name in `ran`
    and moves the clock on."""
    def step(name, expected_s, takes_s, needs):
        def run(args, results, deadline):
            ran.append(name)
            clock.now += takes_s
            return {"status": "measured"}
        return gpu_suite.Step(run, lambda args, costs: (0.0, expected_s), name, needs=needs)  # a kind each

    monkeypatch.setattr(gpu_suite, "steps", lambda args: {name: step(name, *spec) for name, spec in plan.items()})


def test_a_step_that_cannot_finish_in_what_is_left_is_not_started_a_shorter_one_is_and_the_next_call_continues(
        tmp_path, monkeypatch, capsys):
    clock, ran = Clock(), []
    fake_suite(monkeypatch, clock, ran, {"a": (100, 100, ()), "b": (300, 250, ()), "c": (50, 50, ()),
                                         "d": (10, 10, ("b",))})
    args = gpu_suite.Args(results_dir=str(tmp_path / "suite"), dry_run=True, budget_s=200, started_at=0.0)
    gpu_suite.main(args, clock=clock)
    out = capsys.readouterr().out
    # b did not fit the 95 s left (100, less WRAP_UP_S); c did
    assert ran == ["a", "c"] and clock.now == 150 <= args.budget_s
    assert out.count("== b:") == 1 and \
        "== b: not started: expected ~300 s (from the shapes), 95 s left of the budget: left for the next call" in out
    assert "== d: not started: it reads b, not done yet: left for the next call" in out
    assert "== 2 step(s) left for the next call: b, d (150 s of the 200 s budget used)" in out
    assert sorted(p.name for p in (tmp_path / "suite").iterdir()) == ["a.json", "c.json", "table.md"]
    assert json.loads((tmp_path / "suite" / "a.json").read_text())["expected"]["seconds"] == 100

    clock.now = 1000.0  # the next call, with a fresh budget: it starts at the first step not done
    gpu_suite.main(replace(args, started_at=clock.now, budget_s=400), clock=clock)
    out = capsys.readouterr().out
    assert ran == ["a", "c", "b", "d"] and "== a: done earlier (a.json), skipped" in out
    assert out.index("== b: expected ~300 s") < out.index("== d: expected") and "== every step done (260 s" in out


def test_a_trainer_stopped_at_the_budgets_end_is_left_for_the_next_call_not_failed(tmp_path, monkeypatch, capsys):
    clock = Clock()

    def overrun(args, results, deadline):
        clock.now = deadline  # as throughput.run_trainer exits when its timeout ends it
        raise SystemExit("gpu_suite: a trainer still running after 90 s, the time its budget left it, was stopped")

    monkeypatch.setattr(gpu_suite, "steps", lambda args: {
        "slow": gpu_suite.Step(overrun, lambda args, costs: (0.0, 60.0), "fake")})
    gpu_suite.main(gpu_suite.Args(results_dir=str(tmp_path / "suite"), dry_run=True, budget_s=90, started_at=0.0),
                   clock=clock)  # no SystemExit: not a failure
    out = capsys.readouterr().out
    assert "== slow: stopped at the budget's end, nothing written, it runs first next time: gpu_suite: a trainer " \
        "still running after 90 s" in out and "== 1 step(s) left for the next call: slow" in out
    assert not (tmp_path / "suite").exists()


def test_run_trainer_stops_a_trainer_at_its_timeout(tmp_path):
    with pytest.raises(SystemExit, match="a trainer still running after 0 s, the time its budget left it, was stopped"):
        gpu_suite.throughput.run_trainer([sys.executable, "-c", "import signal; signal.pause()"], tmp_path / "log",
                                         "gpu_suite", timeout=0.2)


def test_a_trainer_is_stopped_with_the_processes_it_started(tmp_path):
    """A trainer's engines are processes of its own: the budget's end (kill_tree) stops them with it."""
    child = tmp_path / "child.pid"
    trainer = subprocess.Popen([sys.executable, "-c", "import signal, subprocess, sys; p = subprocess.Popen("
                                "[sys.executable, '-c', 'import signal; signal.pause()']); "
                                f"open({str(child)!r}, 'w').write(str(p.pid)); signal.pause()"])
    deadline = time.monotonic() + 120  # a guard against a hang, not a measure of speed
    while not child.exists() or not child.read_text():
        assert trainer.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    gpu_suite.throughput.kill_tree(trainer.pid)
    assert trainer.wait() == -9
    pid = int(child.read_text())
    while True:  # gone, or a zombie waiting for init to reap it
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX":
                break
        except FileNotFoundError:
            break
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_expected_seconds_from_the_shapes_then_from_what_the_run_measured():
    args, costs = gpu_suite.Args(), gpu_suite.Costs()  # an H100's, at the pythia-1b shape
    suite = gpu_suite.steps(args)
    rloo_setup, rloo_s = suite["throughput_k2_rloo"].expected(args, costs)
    parameters = gpu_suite.parameters_of(2048, 16, 50304)
    assert 1.0e9 < parameters < 1.02e9 and rloo_setup in (0.0, costs.build_s_per_gparam * 2 * parameters / 1e9)
    assert costs.process_s + 16 * parameters / 1e9 < rloo_s < 200  # start, 4 checkpoints of 4 GB, 3 updates
    assert suite["throughput_k4_rloo"].expected(args, costs)[1] == rloo_s  # k changes no shape: 64 completions
    compiled = suite["throughput_k2_rloo_compile_generation"].expected(args, costs)[1]
    assert compiled == pytest.approx(rloo_s + costs.compile_s)
    assert suite["throughput_k2_rloo_bf16_generation"].expected(args, costs)[1] < rloo_s  # 2 bytes a weight read
    trl116_s = suite["throughput_k2_trl116"].expected(args, costs)[1]
    assert trl116_s - costs.trl_s < rloo_s  # its 64 completions in one call: 53 decoding steps, not 4 x 53
    assert suite["throughput_k2_rloo"].expected(args, replace(costs, tflop_per_s=800.0))[1] < rloo_s
    assert suite["limits"].expected(args, costs) == (0.0, costs.in_process_s)

    step = suite["throughput_k2_trl116"]
    setup, trainer = step.expected(args, costs)
    assert gpu_suite.expected_seconds(step, args, costs, {}) == (setup + trainer, trainer, "from the shapes")
    records = {"throughput_k2_trl116": {"kind": "throughput trl116", "seconds": 500.0, "wall_seconds": 2 * trainer,
                                        "expected": {"trainer_s": trainer}},
               "learning": {"kind": "learning", "seconds": 1.0, "wall_seconds": 1.0, "expected": {"trainer_s": 100}},
               "throughput_k2_rloo": {"kind": "throughput rloo.py", "seconds": 1.0, "wall_seconds": 1.0,
                                      "expected": {"trainer_s": rloo_s}}}  # another trainer's: not this one's
    k4 = suite["throughput_k4_trl116"]
    assert gpu_suite.expected_seconds(k4, args, costs, records) == pytest.approx(
        (setup + 2 * trainer, trainer, "from the shapes, x2.00 as throughput_k2_trl116 measured"))
    assert gpu_suite.expected_seconds(k4, args, costs, records, built=True)[0] == pytest.approx(2 * trainer)
    assert gpu_suite.expected_seconds(suite["throughput_k2_trl021"], args, costs, records)[2] == "from the shapes"

    limits = {"status": "measured", "bf16": {"matmul_tflop_per_s": 700.0, "copy_gb_per_s": 2600.0}}
    measured = gpu_suite.costs_of(args, {"limits": limits})
    assert measured.tflop_per_s == pytest.approx(0.4 * 700) and measured.gb_per_s == pytest.approx(0.5 * 2600)
    assert gpu_suite.costs_of(replace(args, dry_run=True), {"limits": limits}) == gpu_suite.DRY_COSTS


def test_on_an_h100_the_first_five_steps_fit_one_call_by_the_estimates(tmp_path, monkeypatch, capsys):
    """--estimate_only, as on an H100 with TRL 1.16 installed: 20 s already spent on the install and the suite's
    start, each step as long as expected."""
    monkeypatch.setattr(gpu_suite, "trainer_problem", lambda args, trainer: None)
    args = gpu_suite.Args(estimate_only=True, results_dir=str(tmp_path / "suite"), budget_s=480, started_at=-20.0)
    gpu_suite.main(args, clock=Clock())
    out = capsys.readouterr().out
    for name in ("limits", "throughput_k2_rloo", "throughput_k2_trl116", "plan_memory_k2", "learning"):
        assert f"== {name}: expected ~" in out, out
    assert "== throughput_k2_trl021: not started: expected ~" in out and "as estimated)" in out
    assert not (tmp_path / "suite").exists()  # nothing written


def test_results_are_named_by_the_gpu_and_a_dry_run_writes_none_there(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "NVIDIA H100 80GB HBM3")
    assert gpu_suite.results_dir_of(gpu_suite.Args()) == REPO / "benchmark/results/gpu/nvidia-h100-80gb-hbm3"
    assert gpu_suite.results_dir_of(gpu_suite.Args(dry_run=True)) == REPO / "runs/gpu_suite_dry/nvidia-h100-80gb-hbm3"
    assert gpu_suite.slug("NVIDIA H200") == "nvidia-h200"
    with pytest.raises(plumbing.ConfigError, match="a dry run measures no GPU, and benchmark/results/gpu holds only GPUs'"):
        gpu_suite.main(gpu_suite.Args(dry_run=True, results_dir="benchmark/results/gpu/cpu"))


@pytest.mark.parametrize("budget", [0.0, -5.0, float("nan"), float("inf")])
def test_a_budget_not_a_positive_number_is_refused_in_one_line(tmp_path, budget):
    with pytest.raises(plumbing.ConfigError, match=r"^--budget_s \S+ is not a positive number of seconds: pass e.g. "
                                                   r"480$"):
        gpu_suite.main(gpu_suite.Args(dry_run=True, results_dir=str(tmp_path / "suite"), budget_s=budget))
    assert not (tmp_path / "suite").exists()


def test_make_bench_gpu_refuses_a_budget_not_a_positive_number_before_installing():
    for budget in ("abc", "0", "-3", "1e3"):
        made = subprocess.run(["make", "-s", "bench-gpu", f"BUDGET={budget}", "GPU_WHEELS=/nonexistent"], cwd=REPO,
                              capture_output=True, text=True)
        assert made.returncode != 0 and made.stdout == "", made.stdout
        assert made.stderr.splitlines()[0] == (f"bench-gpu: BUDGET={budget} is not a positive number of seconds: pass "
                                              "e.g. BUDGET=480"), made.stderr


def test_without_cuda_and_without_the_flag_the_suite_refuses_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(plumbing.ConfigError, match="no CUDA device; --dry_run runs the suite at tiny shapes"):
        gpu_suite.main(gpu_suite.Args(results_dir=str(tmp_path / "suite")))
    assert not (tmp_path / "suite").exists()  # refused before anything is written


def test_a_failing_step_leaves_no_result_the_others_run_and_the_next_start_retries_it(tmp_path, monkeypatch,
                                                                                       capsys):
    ran, broken = [], {"b": True}

    def step(name):
        def run(args, results, deadline):
            ran.append(name)
            if broken.get(name):
                raise RuntimeError("CUDA out of memory")
            return {"status": "measured"}
        return gpu_suite.Step(run, lambda args, costs: (0.0, 1.0), "fake")

    monkeypatch.setattr(gpu_suite, "steps", lambda args: {name: step(name) for name in "abc"})
    args = gpu_suite.Args(results_dir=str(tmp_path / "suite"), dry_run=True, started_at=0.0)
    with pytest.raises(SystemExit, match=r"1 step\(s\) failed: b "):
        gpu_suite.main(args, clock=Clock())
    assert ran == ["a", "b", "c"] and "== b: FAILED, nothing written, it runs again next time: CUDA out of memory" \
        in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "suite").iterdir()) == ["a.json", "c.json", "table.md"]
    broken["b"], ran[:] = False, []
    gpu_suite.main(args, clock=Clock())
    assert ran == ["b"] and (tmp_path / "suite" / "b.json").exists()


def test_where_vllm_imports_the_colocated_steps_build_their_run(tmp_path, monkeypatch):
    """The project's environment has no vLLM: the vLLM steps' set-up up to the run, with vLLM pretended importable."""
    find_spec, commands = gpu_suite.importlib.util.find_spec, []
    monkeypatch.setattr(gpu_suite.importlib.util, "find_spec",
                        lambda name, *a: object() if name == "vllm" else find_spec(name, *a))

    def run_trainer(command, log, program, timeout=None):
        commands.append(command)
        raise SystemExit("the run itself needs vLLM")

    monkeypatch.setattr(gpu_suite.throughput, "run_trainer", run_trainer)
    args = gpu_suite.Args(results_dir=str(tmp_path), runs_dir=str(tmp_path / "runs"), dry_run=True)
    assert gpu_suite.vllm_problem("vllm_colocate", args) is None
    with pytest.raises(SystemExit, match="needs vLLM"):
        gpu_suite.vllm_step("vllm_colocate").run(args, tmp_path, time.time() + 60)
    command = commands[0]
    assert command[1:4] == ["rloo_multinode.py", "--vllm_mode", "colocate"] and "--bf16" in command
    policy = Path(command[command.index("--model_name_or_path") + 1])
    assert "LlamaForCausalLM" in (policy / "config.json").read_text()  # a colocated engine refuses GPT-NeoX
    trl116 = gpu_suite.throughput.trl116_command(args.trl116_site)
    if trl116[1] is None:  # TRL 1.16 with its colocated engine, on the same Llama, where its vLLM range allows
        monkeypatch.setattr(gpu_suite, "vllm_version", lambda: "0.32.0")
        assert gpu_suite.vllm_problem("vllm_colocate_trl116", args) == \
            "TRL 1.16 supports vLLM 0.22.0 to 0.31.0; this machine has vLLM 0.32.0"
        monkeypatch.setattr(gpu_suite, "vllm_version", lambda: "0.31.0+cu129")
        assert gpu_suite.vllm_problem("vllm_colocate_trl116", args) is None
        with pytest.raises(SystemExit, match="needs vLLM"):
            gpu_suite.vllm_step("vllm_colocate_trl116").run(args, tmp_path, time.time() + 60)
        assert commands[1][:4] == trl116[0] and commands[1][4] == "--use_vllm"
        assert commands[1][commands[1].index("--model_name_or_path") + 1] == str(policy)
    if not torch.cuda.is_available():
        assert gpu_suite.vllm_problem("vllm_colocate_sleep", args) == "sleep mode needs CUDA"
    if torch.cuda.device_count() < 2:  # one GPU has no NCCL weight sync: the step says so
        problem = gpu_suite.vllm_problem("vllm_engine_nccl", args)
        assert problem.startswith("a weight sync over NCCL needs 2 GPUs"), problem


@pytest.mark.parametrize("flags,fragment", [
    (["--budget_s", "0"], "--budget_s 0.0 is not a positive number of seconds"),  # exit 1, before
    (["--budget_s", "nan"], "--budget_s nan is not a positive number of seconds"),
    (["--started_at", "nan"], "--started_at nan is not a time in Unix seconds before now"),  # ignored the budget
    (["--started_at", "inf"], "--started_at inf is not a time"),
    (["--started_at", "1e12"], "--started_at 1000000000000.0 is not a time in Unix seconds before now"),  # the future
])
def test_the_suites_numbers_are_refused_in_one_line_with_exit_2(tmp_path, flags, fragment):
    result = subprocess.run([python(), "benchmark/gpu_suite.py", "--estimate_only", "--results_dir",
                             str(tmp_path / "suite"), *flags], capture_output=True, text=True, cwd=REPO, env=cpu_env())
    assert result.returncode == 2 and result.stdout == "", result.stdout
    assert result.stderr.startswith("gpu_suite.py: error: ") and result.stderr.count("\n") == 1, result.stderr
    assert fragment in result.stderr, result.stderr
    assert not (tmp_path / "suite").exists()


@pytest.mark.parametrize("content,fragment", [
    (b"{not json", "is not JSON (Expecting property name"),
    (b"", "is not JSON"),  # cut short by a kill
    (b"\xff\xfe{}", "is not JSON"),
    (b"[1, 2]", "is a JSON list, not a step's object"),
    (b'"done"', "is a JSON str, not a step's object"),
])
def test_a_step_file_that_is_not_a_steps_json_is_one_line_naming_it(tmp_path, content, fragment):
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "throughput_k2_rloo.json").write_bytes(content)
    with pytest.raises(plumbing.ConfigError, match="throughput_k2_rloo.json " + re.escape(fragment)):
        gpu_suite.main(gpu_suite.Args(estimate_only=True, results_dir=str(suite)))
    assert (suite / "throughput_k2_rloo.json").read_bytes() == content


@pytest.mark.parametrize("kind", ["a user's table", "a link"])
def test_a_table_md_the_suite_did_not_write_is_never_replaced(tmp_path, kind):
    """Issue 47: gpu_suite.py overwrote a user's table.md."""
    suite = tmp_path / "suite"
    suite.mkdir()
    (tmp_path / "mine.md").write_text("| my | table |\n")
    if kind == "a link":
        (suite / "table.md").symlink_to(tmp_path / "mine.md")
    else:
        (suite / "table.md").write_text("| my | table |\n")
    with pytest.raises(plumbing.ConfigError, match=r"^\S+/suite/table.md exists and the suite did not write it: it "
                                         r"would be replaced; move it, or pass another --results_dir$"):
        gpu_suite.main(gpu_suite.Args(dry_run=True, results_dir=str(suite)))
    assert sorted(p.name for p in suite.iterdir()) == ["table.md"] and (tmp_path / "mine.md").read_text() == \
        "| my | table |\n"
