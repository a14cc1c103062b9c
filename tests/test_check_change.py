"""check_change.py, a researcher's own check of a changed copy of rloo.py: what it says of two runs that differ, what
it refuses before any run, and (make test-bench: minutes) the whole check finding a replay buffer kept in a local
variable of main, which no checkpoint saves, and passing a copy that changes nothing."""

import json
import re
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

import check_change
import plumbing
from conftest import REPO
from helpers import stock_text_differs


def fake_run(root, name: str, metrics: list[dict], weight: float = 1.0):
    out = root / name
    out.mkdir()
    (out / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    save_file({"w": torch.full((2,), weight), "b": torch.zeros(1)}, str(out / "model.safetensors"))
    return out


def test_a_difference_is_said_at_its_first_update_with_the_telling_metric_first(tmp_path):
    metrics = [{"update": u, "objective/scores": 0.5 * u, "clip_ratio/low_mean": 0.0, "time/update": u, "eps": 3.0,
                "run_id": "a"} for u in (1, 2, 3)]
    expected = fake_run(tmp_path, "expected", metrics)
    assert check_change.difference(expected, fake_run(tmp_path, "same", [m | {"time/update": 9.0, "run_id": "b"}
                                                                          for m in metrics]), "rloo.py") is None
    later = [dict(m) for m in metrics]
    later[1].update({"objective/scores": 0.75, "clip_ratio/low_mean": 0.5})
    assert check_change.difference(expected, fake_run(tmp_path, "later", later), "rloo.py") == (
        "from update 2: objective/scores 0.75 against rloo.py's 1.0 (and 1 other metrics)")
    assert check_change.difference(expected, fake_run(tmp_path, "weights", metrics, 1.5), "the run") == (
        "the same metrics, but 1 of 2 final weight tensors differ from the run's (the largest by 0.5)")
    assert check_change.difference(expected, fake_run(tmp_path, "short", metrics[:2]), "the run") == (
        "its metrics are of updates [1, 2], the run's of [1, 2, 3]")
    extra = fake_run(tmp_path, "extra", [m | {"objective/mine": 1.0} for m in metrics])  # a metric of the copy's own
    assert check_change.difference(expected, extra, "rloo.py", keys={k for m in metrics for k in m}) is None
    nan = [m | {"objective/kl": float("nan")} for m in metrics]
    assert check_change.difference(fake_run(tmp_path, "nan_a", nan), fake_run(tmp_path, "nan_b", nan), "x") is None


def test_two_checks_at_once_keep_rloo_py_s_run_once(tmp_path, monkeypatch):
    """Two checks (of two copies, at once) that both ran rloo.py with the same code and flags: the one that finishes
    second finds the run kept by the other, uses it, and leaves no folder of its own behind."""
    monkeypatch.setattr(check_change, "REPO", tmp_path)
    args, kept = ["--seed", "1"], tmp_path / ".cache" / "rloo_check_change"
    metrics = [{"update": 1, "objective/scores": 0.5}]

    def train(script, run_args, nproc, output_dir, env):  # the other check keeps its run while this one trains
        other = fake_run(tmp_path, "other", metrics)
        kept.mkdir(parents=True)
        other.rename(kept / f"{check_change.code_key(run_args)}-{nproc}")
        return check_change.Run(fake_run(tmp_path, output_dir.name, metrics))

    (tmp_path / "plumbing").mkdir()
    (tmp_path / "rloo.py").write_text("# rloo.py\n")
    monkeypatch.setattr(check_change, "train", train)
    run = check_change.stock_run(args, 2, tmp_path, {})
    assert run.failed is None and (run.output_dir / "model.safetensors").exists()
    assert [p.name for p in kept.iterdir()] == [run.output_dir.name]  # no half-kept copy of its own
    assert check_change.stock_run(args, 2, tmp_path, {}).output_dir == run.output_dir  # kept: not run again


@pytest.mark.parametrize("argv,said", [
    (["nothing.py"], "check_change.py: error: nothing.py: no such file: pass your copy of rloo.py (make check-change "
                     "FILE=rloo_mine.py)"),
    (["README.md"], "check_change.py: error: README.md: not a .py file: pass your copy of rloo.py (make check-change "
                    "FILE=rloo_mine.py)"),
    (["rloo.py", "--updates", "3"], "check_change.py: error: --updates 3 --ranks 1 2: at least 4 updates (the stops "
                                    "come in update 3), on 1 rank or more"),
    (["rloo.py", "--flags=--kl_coef -1"], "check_change.py: error: kl_coef = -1.0 must be in [0, 1e+06] (beyond, the "
                                          "first updates' gradients overflow float32)"),
    (["rloo.py", "--flags=--no_such 1"], "rloo.py (its --flags): error: unrecognized argument '--no_such': see --help"),
])
def test_what_cannot_be_checked_is_one_line_before_any_run(argv, said, tmp_path, capsys, monkeypatch):
    """check_change.py's command line as it runs it (plumbing.run_tool), in this process."""
    monkeypatch.chdir(REPO)
    with pytest.raises(SystemExit) as exited:
        plumbing.run_tool("check_change.py", check_change.CheckArgs, check_change.main,
                          argv=[*argv, "--cache_dir", str(tmp_path)], end_process=False)
    assert exited.value.code == 2 and capsys.readouterr().err.strip() == said
    assert not any(tmp_path.iterdir())  # the task was not built


LOCAL_BUFFER = [
    ("                    sampler_state, rows = sampler.state_dict(), sampler.next_indices()  # B rows of the split\n",
     "                    rows = rows[:-1] + replay[-1:] if replay else rows  # one prompt of the last batch again\n"
     "                    replay.append(rows[0])\n"),
    ("    queued: list[plumbing.PromptBatch] = []  # drawn, sampled or being sampled, not yet trained on\n",
     "    replay: list[int] = []  # a replay buffer in a local variable of main, which no checkpoint saves\n"),
]


@pytest.mark.bench
def test_the_check_finds_a_buffer_no_checkpoint_saves_and_passes_a_copy_that_changes_nothing(tmp_path):
    """The whole check on 2 ranks (torchrun, gloo): a copy of rloo.py passes every check; a copy whose main keeps a
    replay buffer in a local variable is found by each stop-and-resume check (the resumed run starts with an empty
    buffer), the neutral check saying it differs from rloo.py too (the buffer has no flag to turn it off)."""
    source = (REPO / "rloo.py").read_text()
    (tmp_path / "rloo_same.py").write_text(source)
    for line, added in LOCAL_BUFFER:
        if source.count(line) != 1:
            stock_text_differs(f"the buffer's lines go after {line.strip()!r}, which is not in rloo.py once")
        source = source.replace(line, line + added)
    (tmp_path / "rloo_buffer.py").write_text(source)
    for name, status in (("rloo_same.py", 0), ("rloo_buffer.py", 1)):
        result = subprocess.run([sys.executable, str(REPO / "check_change.py"), str(tmp_path / name), "--ranks", "2"],
                                capture_output=True, text=True, cwd=REPO, timeout=3600)
        lines = [line.strip() for line in result.stdout.splitlines() if line.startswith("  ")]
        assert result.returncode == status and len(lines) == 3, result.stdout + result.stderr[-3000:]
        if status == 0:
            assert all(line.endswith("s]") and ": the same as " in line for line in lines), lines
            continue
        assert re.match(r"neutral settings, 2 ranks: from update \d: ", lines[0]), lines
        for line, stop in zip(lines[1:], ("during update 3's reward call", "between updates 2 and 3")):
            assert re.match(rf"2 ranks, stopped by SIGTERM {stop}, then resumed: from update 3: \S+ \S+ against the "
                            r"uninterrupted run's ", line), line
