"""benchmark/plot_runs.py: loading runs and wandb exports, aggregation over seeds, the PNG grid."""

import json
from pathlib import Path

import numpy as np
import pytest

import plumbing
from benchmark import plot_runs

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def write_run(directory, episodes, drop=(), **offsets):
    """A metrics.jsonl like rloo.py's: every plotted metric, linear in the update (plus a per-metric offset),
    without the metrics in `drop`, and an evaluation line that the loader must skip."""
    directory.mkdir(parents=True)
    lines = []
    for update, episode in enumerate(episodes, start=1):
        line = {"update": update, "episode": episode}
        line |= {m: update * 0.1 + offsets.get(m.replace("/", "_"), 0.0) for m in plot_runs.METRICS if m not in drop}
        lines.append(line)
    lines.append({"update": len(episodes), "episode": episodes[-1], "eval/scores": 9.0})
    (directory / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return directory


def test_aggregate_three_seeds_on_a_common_grid():
    # seeds log at different episodes; the shared range is [10, 30]
    curves = [
        (np.array([0.0, 20.0, 40.0]), np.array([0.0, 2.0, 4.0])),  # y = x / 10
        (np.array([10.0, 30.0]), np.array([5.0, 7.0])),  # y = x / 10 + 4
        (np.array([0.0, 10.0, 30.0]), np.array([1.0, 1.0, 3.0])),  # 1 up to 10, then x / 10
    ]
    grid, mean, low, high = plot_runs.aggregate(curves, num_points=3)
    np.testing.assert_allclose(grid, [10, 20, 30])
    at_grid = np.array([[1, 2, 3], [5, 6, 7], [1, 2, 3]])  # by hand
    np.testing.assert_allclose(mean, at_grid.mean(0))
    np.testing.assert_allclose(mean, [7 / 3, 10 / 3, 13 / 3])
    np.testing.assert_allclose(low, [1, 2, 3])
    np.testing.assert_allclose(high, [5, 6, 7])


def test_disjoint_runs_are_refused():
    with pytest.raises(plumbing.ConfigError, match="share no episode range"):
        plot_runs.aggregate([(np.array([0.0, 1.0]), np.array([0.0, 1.0])),
                             (np.array([2.0, 3.0]), np.array([0.0, 1.0]))])


def test_curve_keeps_the_last_value_of_a_repeated_episode():
    # a resumed run appends the updates after its checkpoint again
    run = {"episode": np.array([64.0, 128.0, 192.0, 128.0, 192.0]), "objective/kl": np.array([1, 2, 3, 20, np.nan])}
    episodes, values = plot_runs.curve(run, "objective/kl")
    np.testing.assert_array_equal(episodes, [64, 128, 192])
    np.testing.assert_array_equal(values, [1, 20, 3])
    assert plot_runs.curve(run, "val/ratio") is None


def test_wandb_csv_with_train_prefixes(tmp_path):
    path = tmp_path / "trl_seed1.csv"
    path.write_text("Step,train/episode,train/objective/scores,train/objective/kl,Name\n"
                    "1,4096,0.5,0.1,run\n2,8192,,0.2,run\n3,12288,0.9,0.3,run\n")
    run = plot_runs.load_run(path)
    assert {"episode", "objective/scores", "objective/kl"} <= run.keys()
    episodes, scores = plot_runs.curve(run, "objective/scores")
    np.testing.assert_array_equal(episodes, [4096, 12288])  # the empty cell is skipped
    np.testing.assert_array_equal(scores, [0.5, 0.9])


def test_jsonl_run_directory_skips_evaluation_lines(tmp_path):
    run = plot_runs.load_run(write_run(tmp_path / "run", [64, 128, 192]))
    np.testing.assert_array_equal(run["episode"], [64, 128, 192])


def test_parse_methods():
    assert plot_runs.parse_methods(("ours=a,b", "trl=c.csv", "ours=d")) == {
        "ours": [Path(p) for p in "abd"], "trl": [Path("c.csv")]}
    with pytest.raises(plumbing.ConfigError, match="NAME=PATH"):
        plot_runs.parse_methods(("runs/a",))


def test_two_methods_write_a_png_and_a_missing_metric_is_skipped(tmp_path, capsys):
    ours = [write_run(tmp_path / f"ours{s}", [64 * u for u in range(1, 20)], objective_kl=s) for s in range(3)]
    ours.append(write_run(tmp_path / "ours_no_clipfrac", list(range(50, 1300, 70)), drop=("policy/clipfrac_avg",)))
    trl = tmp_path / "trl.csv"
    trl.write_text("train/episode,train/objective/rlhf_reward,train/objective/scores,train/eps\n"
                   + "".join(f"{100 * u},{u / 9},{u / 8},{400 + u}\n" for u in range(1, 13)))
    png = tmp_path / "out" / "grid.png"
    plot_runs.main((f"ours={','.join(map(str, ours))}", f"trl={trl}"), png_path=png, smooth=3)
    assert png.read_bytes()[:8] == PNG_SIGNATURE
    out = capsys.readouterr().out
    assert f"{ours[-1]} has no policy/clipfrac_avg" in out
    assert f"{trl} has no objective/kl" in out
