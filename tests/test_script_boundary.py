"""Every script of the repository behind rloo.py's boundary (bad input: one line, exit status 2, no traceback), and no
script writing over one of its inputs: the plotting scripts' inputs of every kind, and the outputs of every script
checked against its inputs as typed, through links and by inode."""

import ast
import importlib
import importlib.util
import json
import os
import shutil
import zlib
from pathlib import Path

import pytest

import plumbing
from benchmark import plot_metrics, plot_runs, sync_cost, throughput
from benchmark.tldr import judge
from conftest import REPO

SCRIPTS = sorted(str(path.relative_to(REPO)) for pattern in ("*.py", "benchmark/*.py", "benchmark/tldr/*.py",
                                                             "docs/*.py") for path in REPO.glob(pattern)
                 if 'if __name__ == "__main__":' in path.read_text())


def main_call(script: str) -> ast.Call:
    """The outermost call of the script's last `if __name__ == "__main__":` block: how it runs."""
    tree = ast.parse((REPO / script).read_text())
    block = [node for node in tree.body if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)][-1]
    return [node for node in ast.walk(block) if isinstance(node, ast.Call)][0]


def test_every_script_runs_behind_the_one_line_boundary():
    assert len(SCRIPTS) >= 14, SCRIPTS  # rloo.py, plan_memory.py, the benchmarks, judge.py, make_flags.py, ...
    unguarded = [script for script in SCRIPTS
                 if ast.unparse(main_call(script).func) not in ("plumbing.run_tool", "plumbing.run_script", "cli")]
    assert not unguarded, unguarded


def script_module(script: str):
    """The script imported as a module (its `__main__` block not run)."""
    name = script.removesuffix(".py").replace("/", ".")
    if name.startswith("benchmark."):
        return importlib.import_module(name)
    spec = importlib.util.spec_from_file_location(Path(script).stem, REPO / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TOOLS = [script for script in SCRIPTS if ast.unparse(main_call(script).func) == "plumbing.run_tool"]


@pytest.mark.parametrize("script", TOOLS)
def test_every_helper_script_says_a_parse_error_in_one_line_with_exit_2(script, capsys):
    call = main_call(script)
    module = script_module(script)
    program, *targets = [ast.literal_eval(a) if isinstance(a, ast.Constant) else getattr(module, a.id)
                         for a in call.args]
    with pytest.raises(SystemExit) as exit_status:
        plumbing.run_tool(program, *targets, argv=["--no_such_flag", "1"], end_process=False)
    err = capsys.readouterr().err
    assert exit_status.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"{program}: error: ") and "Traceback" not in err, err


# ---------------------------------------------------------------- outputs are never inputs
def test_an_output_is_refused_when_it_is_an_input_in_any_form(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("{}\n")
    os.link(metrics, tmp_path / "hard.jsonl")
    (tmp_path / "soft.jsonl").symlink_to(metrics)
    (tmp_path / "runs").mkdir()
    os.mkfifo(tmp_path / "fifo")
    same = [Path("metrics.jsonl"), Path("./metrics.jsonl"), tmp_path / "sub" / ".." / "metrics.jsonl",
            tmp_path / "hard.jsonl", tmp_path / "soft.jsonl"]
    for output in same:
        with pytest.raises(plumbing.ConfigError, match="is the input --in .*it would be written over; pass another "
                                                       "--out"):
            plumbing.check_outputs([("--out", output)], [("--in", metrics)], "x.py")
    with pytest.raises(plumbing.ConfigError, match="is inside the input --in"):
        plumbing.check_outputs([("--out", tmp_path / "runs" / "new.png")], [("--in", tmp_path / "runs")], "x.py")
    for output, kind in ((tmp_path / "runs", "is a directory"), (tmp_path / "fifo", r"is a FIFO \(named pipe\)")):
        with pytest.raises(plumbing.ConfigError, match=f"--out {output} {kind}: pass the path of a file to write"):
            plumbing.check_outputs([("--out", output)], [], "x.py")
    plumbing.check_outputs([("--out", tmp_path / "curves.png"), ("--out", tmp_path / "metrics.jsonl.png")],
                           [("--in", metrics), ("--in", Path("trl-lib/tldr"))], "x.py")  # elsewhere, a Hub id: fine


def metrics_lines(*updates: int, tail: str = "") -> str:
    rows = [{"update": u, "episode": 8 * u, "objective/scores": 0.1 * u, "objective/rlhf_reward": 0.1 * u,
             "objective/kl": 0.01} for u in updates]
    return "".join(json.dumps(row) + "\n" for row in rows) + tail


def run_tool(script, program: str, argv: list, capsys) -> tuple[int, str]:
    """A script's run_tool in this process: its exit status (0 when it returned) and stderr."""
    target = (script.Args, script.main) if hasattr(script, "Args") else (script.main,)
    try:
        plumbing.run_tool(program, *target, argv=[str(a) for a in argv], end_process=False)
        code = 0
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


def test_plot_metrics_never_writes_over_its_input_and_takes_a_run_still_writing(tmp_path, capsys):
    metrics = tmp_path / "run" / "metrics.jsonl"
    metrics.parent.mkdir()
    metrics.write_text(metrics_lines(1, 2, tail='{"update": 3, "episode": 2'))  # a run writing its third line
    before = metrics.read_bytes()
    os.link(metrics, tmp_path / "linked.jsonl")
    for png in (metrics, tmp_path / "run" / "." / "metrics.jsonl", tmp_path / "linked.jsonl"):
        code, err = run_tool(plot_metrics, "plot_metrics.py", ["--metrics-paths", metrics, "--png-path", png], capsys)
        assert code == 2 and err.count("\n") == 1 and "is the input --metrics-paths" in err, err
    assert metrics.read_bytes() == before
    code, err = run_tool(plot_metrics, "plot_metrics.py", ["--metrics-paths", metrics.parent, "--png-path",
                                                           tmp_path / "curves.png"], capsys)
    assert code == 0 and (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG", err


@pytest.mark.parametrize("case", ["missing", "fifo", "smooth 0", "bad line", "not an object"])
def test_plot_metrics_answers_bad_input_in_one_line(tmp_path, capsys, case):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(metrics_lines(1, 2))
    argv = ["--metrics-paths", metrics, "--png-path", tmp_path / "curves.png"]
    expected = {"missing": "metrics file .*nope.jsonl does not exist", "fifo": r"is a FIFO \(named pipe\)",
                "smooth 0": "--smooth 0: a trailing mean needs at least 1 update",
                "bad line": "line 2 is not JSON", "not an object": "line 1 is a JSON list, not an object"}[case]
    if case == "missing":
        argv[1] = tmp_path / "nope.jsonl"
    elif case == "fifo":
        os.mkfifo(tmp_path / "pipe.jsonl")  # never opened: a reader would wait for a writer forever
        argv[1] = tmp_path / "pipe.jsonl"
    elif case == "smooth 0":
        argv += ["--smooth", "0"]
    else:
        metrics.write_text("[1]\n" + metrics_lines(1) if case == "not an object" else
                           metrics_lines(1) + "{cut\n" + metrics_lines(3))
    code, err = run_tool(plot_metrics, "plot_metrics.py", argv, capsys)
    assert code == 2 and err.count("\n") == 1 and err.startswith("plot_metrics.py: error: "), err
    assert __import__("re").search(expected, err), err
    assert not (tmp_path / "curves.png").exists()


@pytest.mark.parametrize("runs,expected", [
    (["bad"], "expected NAME=PATH"), (["a="], "expected NAME=PATH"), (["a=run,"], "expected NAME=PATH"),
    (["a=nope"], "metrics file nope/metrics.jsonl does not exist|metrics file nope does not exist"),
    (["a=nope.csv"], "nope.csv does not exist"), (["a=pipe.csv"], r"is a FIFO \(named pipe\)"),
    (["a=empty.csv"], "has no `episode` or `train/episode` column"), (["a=run"], None),
    (["a=run", "--smooth", "0"], "--smooth 0: must be at least 1"), (["a=run", "--png-path", "run/metrics.jsonl"],
                                                                    "is the input --runs"),
    (["a=run.csv", "--png-path", "run.csv"], "is the input --runs"),
])
def test_plot_runs_answers_bad_input_in_one_line_and_draws_a_run_still_writing(tmp_path, capsys, monkeypatch,
                                                                              runs, expected):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text(metrics_lines(1, 2, 3, tail='{"upd'))
    (tmp_path / "run.csv").write_text("episode,train/objective/scores\n8,0.1\n16,0.2\n")
    (tmp_path / "empty.csv").write_text("")
    os.mkfifo(tmp_path / "pipe.csv")
    code, err = run_tool(plot_runs, "plot_runs.py", ["--runs", *runs] + (
        [] if "--png-path" in runs else ["--png-path", "out.png"]), capsys)
    if expected is None:
        assert code == 0 and (tmp_path / "out.png").is_file(), err
    else:
        assert code == 2 and err.count("\n") == 1 and err.startswith("plot_runs.py: error: "), err
        assert __import__("re").search(expected, err), err
    assert (tmp_path / "run.csv").read_text().startswith("episode")
    assert (tmp_path / "run" / "metrics.jsonl").read_text().startswith('{"update": 1')


def test_a_benchmark_replaces_only_an_earlier_runs_directory(tmp_path):
    mine = tmp_path / "runs" / "rloo_py_0"
    mine.mkdir(parents=True)
    (mine / "thesis.tex").write_text("years of work")
    with pytest.raises(plumbing.ConfigError, match="holds thesis.tex and no run's metrics.jsonl"):
        throughput.fresh_run_dir(mine)
    (tmp_path / "runs" / "linked").symlink_to(mine)
    with pytest.raises(plumbing.ConfigError, match=r"is in the way of a benchmark run \(a symbolic link\)"):
        throughput.fresh_run_dir(tmp_path / "runs" / "linked")
    assert (mine / "thesis.tex").read_text() == "years of work"
    earlier = tmp_path / "runs" / "rloo_py_1"
    earlier.mkdir()
    for name in ("metrics.jsonl", "config.json", "model.safetensors"):  # a TRL run's: metrics and its policy
        (earlier / name).write_text("")
    assert throughput.fresh_run_dir(earlier) == earlier and not any(earlier.iterdir())


def test_benchmark_numbers_without_meaning_are_refused_in_one_line():
    for changes, line in (({"updates": 1, "warmup_updates": 1}, "--updates 1: must be more than --warmup_updates"),
                          ({"shapes": ("pythia-13b",)}, r"--shapes: unknown shape\(s\) \['pythia-13b'\]"),
                          ({"per_device_train_batch_size": 0}, "--per_device_train_batch_size 0: must be at least 1"),
                          ({"mean_response_length": 99.0}, r"--mean_response_length 99.0: must be in \(0")):
        with pytest.raises(plumbing.ConfigError, match=line):
            throughput.check_run_config(throughput.Args(**changes))


def test_the_judge_never_writes_over_its_dataset_model_or_cache(assets, tmp_path):
    data = tmp_path / "tldr.jsonl"
    data.write_text('{"prompt": "p", "completion": "c"}\n')
    cache = tmp_path / "cache.jsonl"
    cache.write_text('{"written_by": "benchmark/tldr/judge.py"}\n')  # its own cache: read and appended to
    for flags, line in (({"output_path": str(data)}, "--output_path .* is the input --dataset_name"),
                        ({"output_path": str(cache)}, "--output_path .* is the input --cache_path"),
                        ({"output_path": str(tmp_path / "tldr.json")}, r"--output_path .*tldr\.summaries\.jsonl is"),
                        ({"output_path": str(assets["policy"] / "judge.json")}, "is inside the input "
                                                                                 "--model_name_or_path"),
                        ({"cache_path": str(data)}, "--cache_path .* is the input --dataset_name")):
        if flags.get("output_path", "").endswith("tldr.json"):
            os.link(data, tmp_path / "tldr.summaries.jsonl")  # where its summaries would go: the dataset itself
        args = judge.Args(model_name_or_path=str(assets["policy"]), dataset_name=str(data),
                          cache_path=flags.get("cache_path", str(cache)), output_path=flags.get("output_path"))
        with pytest.raises(plumbing.ConfigError, match=line):
            judge.main(args)
    assert data.read_text() == '{"prompt": "p", "completion": "c"}\n'
    assert cache.read_text() == '{"written_by": "benchmark/tldr/judge.py"}\n'


@pytest.mark.parametrize("output,status,line", [
    ("{tmp}/file/sync_cost.md", 2, "--output {tmp}/file/sync_cost.md passes through {tmp}/file, which is a file: "
                                   "pass another --output"),
    ("/proc/sync_cost.md", 4, "FileNotFoundError: [Errno 2] No such file or directory: '/proc/.sync_cost.md.partial'"),
])
def test_a_script_that_cannot_write_its_output_says_so_in_one_line(tmp_path, capsys, output, status, line):
    (tmp_path / "file").write_text("")
    code, err = run_tool(sync_cost, "sync_cost.py", ["--shapes", "pythia-14m", "--measured_shape", "None", "--output",
                                                     output.format(tmp=tmp_path)], capsys)
    assert code == status and err == f"sync_cost.py: error: {line.format(tmp=tmp_path)}\n", err


def test_the_trl_drivers_write_only_into_a_new_or_empty_directory(assets, tmp_path):
    """benchmark/trl_rloo.py and trl116_rloo.py write metrics.jsonl and a policy with "w": a directory holding an
    earlier run (rloo.py's own default output_dir) or an input is refused before anything loads."""
    (tmp_path / "earlier").mkdir()
    (tmp_path / "earlier" / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "file").write_text("")
    inputs = {"model_name_or_path": (str(assets["policy"]), assets["policy"])}
    for output_dir, line in ((tmp_path / "earlier", "holds metrics.jsonl: this script writes metrics.jsonl and the "
                                                    "policy there, over what is there"),
                             (tmp_path / "file", "is a file: pass a new or empty directory"),
                             (assets["policy"], "is the input --model_name_or_path")):
        with pytest.raises(plumbing.ConfigError, match=line):
            plumbing.check_new_output_dir(str(output_dir), inputs)
    (tmp_path / "empty").mkdir()
    for fresh in (tmp_path / "empty", tmp_path / "new" / "run"):
        plumbing.check_new_output_dir(str(fresh), inputs)
    assert (tmp_path / "earlier" / "metrics.jsonl").read_text() == "{}\n"


# ---------------------------------------------------------------- a script writes only new files or its own
def test_plot_metrics_never_replaces_a_file_it_did_not_write(tmp_path, capsys, monkeypatch):
    """Issue 47: --png-path naming a run's model.safetensors, trainer_state.pt, args.json or a script of the
    repository replaced it with a PNG, exit 0."""
    monkeypatch.chdir(tmp_path)
    metrics = tmp_path / "run" / "metrics.jsonl"
    (tmp_path / "run" / "checkpoints" / "step_1").mkdir(parents=True)
    metrics.write_text(metrics_lines(1, 2))
    theirs = {"run/model.safetensors": b"weights", "run/checkpoints/step_1/trainer_state.pt": b"state",
              "run/args.json": b'{"run_id": "a"}', "rloo.py": b"# the algorithm", "run/curves.png": b"\x89PNG mine",
              "plot.PNG": b"\x89PNG\r\n\x1a\n\x00\x00\x00\x0etEXtSoftware\x00rloo other.py"}
    for name, content in theirs.items():
        (tmp_path / name).write_bytes(content)
    os.link(tmp_path / "rloo.py", tmp_path / "hard.png")
    (tmp_path / "link.png").symlink_to(tmp_path / "run" / "args.json")
    (tmp_path / "dangling.png").symlink_to(tmp_path / "nowhere.png")
    for png in [*theirs, "hard.png", "./rloo.py", Path("run") / ".." / "rloo.py", tmp_path / "link.png",
                "dangling.png"]:
        code, err = run_tool(plot_metrics, "plot_metrics.py", ["--metrics-paths", metrics, "--png-path", png], capsys)
        assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
        assert "did not write it: it would be replaced; pass a new path" in err or "is a symbolic link" in err, err
    assert all((tmp_path / name).read_bytes() == content for name, content in theirs.items())
    assert not (tmp_path / "nowhere.png").exists()
    for _ in range(2):  # its own PNG: drawn again
        code, err = run_tool(plot_metrics, "plot_metrics.py", ["--metrics-paths", metrics, "--png-path", "new.png"],
                             capsys)
        assert code == 0 and plumbing.written_by(tmp_path / "new.png") == "benchmark/plot_metrics.py", err
    code, err = run_tool(plot_runs, "plot_runs.py", ["--runs", f"a={metrics}", "--png-path", "new.png"], capsys)
    assert code == 2 and "benchmark/plot_runs.py did not write it" in err and "Traceback" not in err, err


def test_a_scripts_mark_is_in_the_metadata_it_wrote_never_a_quote_in_a_files_text(tmp_path, capsys):
    """Issue 56: plot_metrics.py --png-path notes.md replaced a user's notes that quoted the `written_by` mark (it was
    searched anywhere in a file's first 64 KiB); a PNG with a forged text chunk too. A mark is what the script wrote
    where it writes it: a PNG's own text chunk, a Markdown report's last line, each with the sha256 of the rest (a
    copied chunk, an edited picture or report, no longer match), a JSON object's first key."""
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(metrics_lines(1, 2))
    plumbing.plot_curves(metrics, tmp_path / "ours.png", writer="benchmark/plot_metrics.py")
    ours = (tmp_path / "ours.png").read_bytes()
    assert plumbing.written_by(tmp_path / "ours.png") == "benchmark/plot_metrics.py"
    mark = next(ours[start:end] for start, end, kind, body in plumbing.outputdir.png_chunks(ours)
                if body.startswith(b"rloo written by\x00"))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return len(data).to_bytes(4, "big") + kind + data + zlib.crc32(kind + data).to_bytes(4, "big")
    theirs = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", bytes([0, 0, 0, 1] * 2 + [8, 0, 0, 0, 0])) + chunk(
        b"IDAT", zlib.compress(b"\x00\x00")) + chunk(b"IEND", b"")  # a picture of one pixel
    report = plumbing.marked_text("| a table |\n", "benchmark/sync_cost.py")
    files = {  # a file of the user's that quotes or copies a mark: no mark
        "notes.md": f"My notes. The scripts sign their files so:\n{report}\nand `\"written_by\": "
                    f"\"benchmark/plot_metrics.py\"` in JSON.\n",
        "edited.md": report.replace("a table", "my table"),
        "late.json": json.dumps({"results": 1, "written_by": "benchmark/plot_metrics.py"}),
        "nested.json": json.dumps({"notes": {"written_by": "benchmark/plot_metrics.py"}}),
        "copied_chunk.png": theirs[:33] + mark + theirs[33:],  # its own picture under another's mark
        "edited.png": ours[:-12] + chunk(b"tEXt", b"Comment\x00mine") + ours[-12:],  # a note added by an editor
        "two_marks.png": ours[:33] + mark + ours[33:],
        "cut.png": ours[: len(ours) // 2],
    }
    for name, content in files.items():
        (tmp_path / name).write_bytes(content.encode() if isinstance(content, str) else content)
        assert plumbing.written_by(tmp_path / name) is None, name
    code, err = run_tool(plot_metrics, "plot_metrics.py", ["--metrics-paths", metrics, "--png-path",
                                                           tmp_path / "notes.md"], capsys)
    assert code == 2 and "benchmark/plot_metrics.py did not write it" in err, err
    assert (tmp_path / "notes.md").read_text() == files["notes.md"]
    (tmp_path / "report.md").write_text(report)
    (tmp_path / "report.json").write_text(json.dumps({"written_by": "benchmark/learning.py", "results": {}}))
    (tmp_path / "cache.jsonl").write_text('{"written_by": "benchmark/tldr/judge.py"}\n{"a": 1}\n')
    assert [plumbing.written_by(tmp_path / n) for n in ("report.md", "report.json", "cache.jsonl")] == [
        "benchmark/sync_cost.py", "benchmark/learning.py", "benchmark/tldr/judge.py"]


def test_plot_runs_refuses_a_file_it_did_not_write_in_one_line_and_redraws_its_own(tmp_path, capsys):
    """Issue 47: plot_runs.py refused with a traceback."""
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(metrics_lines(1, 2, 3))
    (tmp_path / "compare.png").write_bytes(b"a user's picture")
    for png in ("compare.png", "link.png"):
        if png == "link.png":
            (tmp_path / png).symlink_to(tmp_path / "compare.png")
        code, err = run_tool(plot_runs, "plot_runs.py", ["--runs", f"a={metrics}", "--png-path", tmp_path / png],
                             capsys)
        assert code == 2 and err.count("\n") == 1 and err.startswith("plot_runs.py: error: --png-path "), err
    assert (tmp_path / "compare.png").read_bytes() == b"a user's picture"
    for _ in range(2):
        code, err = run_tool(plot_runs, "plot_runs.py", ["--runs", f"a={metrics}", "--png-path", tmp_path / "o.png"],
                             capsys)
        assert code == 0 and plumbing.written_by(tmp_path / "o.png") == "benchmark/plot_runs.py", err
    plot_runs.plot_grid({"a": {"s": plot_runs.load_run(metrics)}}, tmp_path / "o.png", writer="benchmark/learning.py")
    assert plumbing.written_by(tmp_path / "o.png") == "benchmark/learning.py"  # learning.py's PNGs: its mark


def test_sync_cost_and_the_judge_replace_only_their_own_outputs(tmp_path, capsys):
    (tmp_path / "notes.md").write_text("my notes\n")
    code, err = run_tool(sync_cost, "sync_cost.py", ["--output", tmp_path / "notes.md"], capsys)
    assert code == 2 and "benchmark/sync_cost.py did not write it" in err and err.count("\n") == 1, err
    assert (tmp_path / "notes.md").read_text() == "my notes\n"
    for _ in range(2):
        code, err = run_tool(sync_cost, "sync_cost.py", ["--output", tmp_path / "sync.md", "--shapes", "pythia-14m",
                                                         "--measured_shape", "None"], capsys)
        assert code == 0 and plumbing.written_by(tmp_path / "sync.md") == "benchmark/sync_cost.py", err
    assert plumbing.written_by(REPO / "benchmark" / "results" / "sync_cost.md") == "benchmark/sync_cost.py"
    (tmp_path / "result.json").write_text('{"mine": 1}')
    with pytest.raises(plumbing.ConfigError, match="--output_path .*result.json exists and benchmark/tldr/judge.py "
                                                   "did not write it"):
        judge.main(judge.Args(model_name_or_path="m", output_path=str(tmp_path / "result.json"),
                              cache_path=str(tmp_path / "cache.jsonl")))
    with pytest.raises(plumbing.ConfigError, match="--cache_path .*notes.md exists and benchmark/tldr/judge.py"):
        judge.main(judge.Args(model_name_or_path="m", cache_path=str(tmp_path / "notes.md")))


BENCHMARK_REPORTS = {  # script: (the first step after its outputs are checked, its files in --output_dir, flags)
    "throughput": ("trainer_commands", ("throughput_{device}.json", "throughput_{device}.md"), ["--trls", "trl"]),
    "generation_modes": ("ensure_assets", ("generation_modes_{device}.json", "generation_modes_{device}.md"), []),
    "options_cost": ("ensure_shape_assets", ("mine_{device}.json", "mine_{device}.md"), ["--output_name", "mine"]),
    "learning": ("trainer_commands", ("learning.json", "learning.md", "learning_episodes.png", "learning_seconds.png"),
                 []),
}


@pytest.mark.parametrize("name", BENCHMARK_REPORTS)
def test_a_benchmark_replaces_only_its_own_reports_and_refuses_before_any_run(name, tmp_path, capsys, monkeypatch):
    """Its reports (JSON, Markdown, PNGs) in --output_dir: a user's file of the same name or a link there is refused
    in one line before anything runs; what the script wrote itself (its mark) is replaced."""
    import torch

    module = importlib.import_module(f"benchmark.{name}")
    program, writer = f"{name}.py", f"benchmark/{name}.py"
    first_step, files, flags = BENCHMARK_REPORTS[name]
    files = [f.format(device="cuda" if torch.cuda.is_available() else "cpu") for f in files]
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")  # what the scripts set for their runs, kept out of this process
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))

    def reached(*args, **kwargs):
        raise plumbing.ConfigError("reached the runs")
    monkeypatch.setattr(module, first_step, reached)
    argv = [*flags, "--output_dir", tmp_path]
    for index, file in enumerate(files):
        for planted in ("mine", "link"):
            path = tmp_path / file
            if planted == "mine":
                path.write_text("my notes\n")
            else:
                path.unlink()
                (tmp_path / "outside").write_text(f"<!-- written by {writer} -->\n")
                path.symlink_to(tmp_path / "outside")
            code, err = run_tool(module, program, argv, capsys)
            why = f"exists and {writer} did not write it" if planted == "mine" else "is a symbolic link"
            assert code == 2 and f"--output_dir {path} {why}" in err and err.count("\n") == 1, err
        path.unlink()
        assert (tmp_path / "outside").read_text() == f"<!-- written by {writer} -->\n"
    for file in files:  # the script's own files, in the forms it writes them
        if file.endswith(".png"):
            shutil.copy(REPO / "benchmark" / "results" / file, tmp_path / file)
        elif file.endswith(".json"):
            (tmp_path / file).write_text(json.dumps({"written_by": writer, "results": {}}, indent=2) + "\n")
        else:
            (tmp_path / file).write_text(plumbing.marked_text("| table |\n\n", writer))
    if name != "learning":
        args = module.Args(output_dir=str(tmp_path), **({"output_name": "mine"} if name == "options_cost" else {}))
        throughput.write_report(files[0].removesuffix(".json"), args, 4, {}, "| table |", 0.0, writer,
                                report={"hardware": {}} if name == "options_cost" else None)
        assert all(plumbing.written_by(tmp_path / file) == writer for file in files)
    code, err = run_tool(module, program, argv, capsys)
    assert code == 2 and err == f"{program}: error: reached the runs\n", err


def test_the_committed_benchmark_reports_carry_their_scripts_mark():
    """So that `make bench-results` (and a rerun into the folders of benchmark/results) replaces them."""
    results = REPO / "benchmark" / "results"
    marks = {path.relative_to(results): plumbing.written_by(path) for path in results.rglob("*")
             if path.name.startswith(("throughput_", "generation_modes_", "options_cost_", "learning", "sync_cost"))
             and "gpu" not in path.relative_to(results).parts}  # gpu/: the suite's step records, and its table
    assert len(marks) >= 23, marks
    assert {plumbing.written_by(table) for table in results.glob("gpu/*/table.md")} == {"benchmark/gpu_suite.py"}
    script = {"throughput": "throughput", "generation": "generation_modes", "options": "options_cost",
              "learning": "learning", "sync": "sync_cost"}
    wrong = {path: mark for path, mark in marks.items()
             if mark != f"benchmark/{script[path.name.split('_')[0].split('.')[0]]}.py"}
    assert not wrong, wrong


def test_a_generated_file_is_never_written_through_a_link_or_over_another_kind_of_file(tmp_path, capsys):
    """docs/make_flags.py and benchmark/trl116_defaults.py (plumbing.write_generated): their fixed paths."""
    (tmp_path / "outside").write_text("someone else's\n")
    (tmp_path / "flags.md").symlink_to(tmp_path / "outside")
    (tmp_path / "table.json").mkdir()
    for name, why in (("flags.md", "is a symbolic link"), ("table.json", "is a directory")):
        with pytest.raises(plumbing.ConfigError, match=f"{tmp_path / name} {why}, which is never written through"):
            plumbing.write_generated(tmp_path / name, "text\n", False, "wrote")
    assert (tmp_path / "outside").read_text() == "someone else's\n" and (tmp_path / "flags.md").is_symlink()
    (tmp_path / "flags.md").unlink()
    for _ in range(2):  # new, then its own replaced
        plumbing.write_generated(tmp_path / "flags.md", "text\n", False, "wrote")
        assert (tmp_path / "flags.md").read_text() == "text\n" and capsys.readouterr().out == "wrote\n"
