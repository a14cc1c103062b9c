"""Compare methods over seeds, openrlbenchmark style: one panel per metric against episode, each method's mean
over its seeds as a line and the min-max over its seeds as a shaded band.

    python benchmark/plot_runs.py --runs ours=runs/s1,runs/s2,runs/s3 trl=exports/trl_s1.csv,exports/trl_s2.csv \
        --png-path runs/tldr_1b.png --smooth 5

A run is a directory holding the metrics.jsonl that rloo.py writes, that file itself, or a CSV exported from
wandb: a column `episode` (or `train/episode`) and metric columns named `objective/scores` or
`train/objective/scores`. Each seed's curve is smoothed (a trailing mean over `smooth` logged points), then
interpolated onto a common episode grid, because runs may log at different episodes; mean, min and max are
taken over seeds on that grid. A run that lacks a metric is left out of that panel, with a note.
"""

import csv
import math
import sys
from pathlib import Path

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python benchmark/plot_runs.py` only adds benchmark/
import plumbing  # noqa: E402
from benchmark.plot_metrics import moving_average, read_metrics  # noqa: E402

WRITER = "benchmark/plot_runs.py"  # the mark its PNGs carry: a path that exists is replaced only if it has it

METRICS = ("objective/rlhf_reward", "objective/scores", "objective/kl", "objective/entropy", "policy/clipfrac_avg",
           "val/ratio", "eps")
Run = dict[str, np.ndarray]  # column name -> one value per logged row, NaN where the row has none
Curve = tuple[np.ndarray, np.ndarray]  # (episodes, values), episodes strictly increasing


def as_float(value) -> float:
    """float(value), or NaN for a missing or non-numeric cell."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def run_file(path: str | Path) -> Path:
    """The file of a run: a run directory's metrics.jsonl, or the path itself."""
    path = Path(path)
    return path / "metrics.jsonl" if path.is_dir() else path


def load_run(path: str | Path) -> Run:
    """The columns of one run (a run directory, its metrics.jsonl, or a wandb CSV), `train/` prefixes dropped; a
    file that is not there or cannot be read is a ConfigError naming it."""
    path = run_file(path)
    if path.suffix == ".csv":
        if plumbing.not_a_file(path):
            raise plumbing.ConfigError(f"--runs: {path} {plumbing.not_a_file(path)}: pass a CSV exported from wandb")
        with plumbing.reading(f"--runs: the wandb CSV {path}", "pass a CSV exported from wandb"), \
                open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    else:
        rows = read_metrics(path)
    rows = [{key.removeprefix("train/"): value for key, value in row.items() if isinstance(key, str)}
            for row in rows]
    columns = dict.fromkeys(key for row in rows for key in row)
    if "episode" not in columns:
        raise plumbing.ConfigError(f"--runs: {path} has no `episode` or `train/episode` column"
                                   + ("" if rows else " (no logged update yet)"))
    return {key: np.array([as_float(row.get(key)) for row in rows]) for key in columns}


def curve(run: Run, metric: str, x: str = "episode") -> Curve | None:
    """The metric against episode (or another column `x`), sorted, rows without a value dropped; where an episode
    was logged twice (a resumed run repeats the updates after its last checkpoint) the later value. None if it was
    never logged."""
    if metric not in run:
        return None
    episodes, values = run[x], run[metric]
    logged = np.isfinite(episodes) & np.isfinite(values)
    if not logged.any():
        return None
    episodes, last = np.unique(episodes[logged][::-1], return_index=True)  # first in reverse = last logged
    return episodes, values[logged][::-1][last]


def smooth_curve(points: Curve, window: int) -> Curve:
    """A trailing mean over `window` logged points (1: unchanged)."""
    episodes, values = points
    return episodes, np.array(moving_average(values.tolist(), window))


def common_grid(curves: list[Curve], num_points: int) -> np.ndarray:
    """`num_points` episodes evenly spread over the range that every curve covers (nothing is extrapolated)."""
    start, end = max(c[0][0] for c in curves), min(c[0][-1] for c in curves)
    if start > end:
        raise plumbing.ConfigError(f"the runs share no episode range: one starts at {start:g}, another ends at "
                                   f"{end:g}; plot runs of the same length together")
    return np.linspace(start, end, num_points)


def align(curves: list[Curve], grid: np.ndarray) -> np.ndarray:
    """(seeds, points): each curve linearly interpolated at the grid's episodes."""
    return np.stack([np.interp(grid, episodes, values) for episodes, values in curves])


def aggregate(curves: list[Curve], num_points: int = 200) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(grid, mean, min, max) over seeds, on a common episode grid."""
    grid = common_grid(curves, num_points)
    aligned = align(curves, grid)
    return grid, aligned.mean(0), aligned.min(0), aligned.max(0)


def parse_methods(specs: tuple[str, ...]) -> dict[str, list[Path]]:
    """`NAME=PATH,PATH,...` -> {NAME: [PATH, ...]}; a name given twice collects both lists."""
    methods: dict[str, list[Path]] = {}
    for spec in specs:
        name, sep, paths = spec.partition("=")
        if not sep or not name or not all(paths.split(",")):
            raise plumbing.ConfigError(f"--runs {spec!r}: expected NAME=PATH[,PATH...], a method's name and its "
                                       "runs (directories, metrics.jsonl files or wandb CSVs)")
        methods.setdefault(name, []).extend(Path(p) for p in paths.split(","))
    if not methods:
        raise plumbing.ConfigError("--runs: no method given; pass NAME=PATH[,PATH...] for each")
    return methods


def method_curves(runs: dict[str, Run], metric: str, x: str = "episode") -> list[Curve]:
    """The metric's curve in each of a method's runs; a note for every run without it."""
    curves = []
    for label, run in runs.items():
        points = curve(run, metric, x)
        if points is None:
            print(f"plot_runs.py: {label} has no {metric}: left out of that panel")
        else:
            curves.append(points)
    return curves


def plot_grid(methods: dict[str, dict[str, Run]], png_path: Path, metrics: tuple[str, ...] = METRICS,
              smooth: int = 1, num_points: int = 200, x: str = "episode", xlabel: str | None = None,
              writer: str = WRITER) -> None:
    """One panel per metric against `x` (a column of every run); per method, the mean over seeds as a line and the
    min-max as a band. The PNG carries `writer`'s mark (plumbing.written_by: the script that checked its path)."""
    cols = min(4, len(metrics))
    rows = math.ceil(len(metrics) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    colors = {name: f"C{i}" for i, name in enumerate(methods)}
    for ax, metric in zip(axes.flat, metrics):
        for name, runs in methods.items():
            curves = method_curves(runs, metric, x)
            if curves:
                grid, mean, low, high = aggregate([smooth_curve(c, smooth) for c in curves], num_points)
                ax.plot(grid, mean, color=colors[name], linewidth=1.5)
                ax.fill_between(grid, low, high, color=colors[name], alpha=0.2, linewidth=0)
        ax.set_title(metric)
        ax.set_xlabel(xlabel or x)
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(metrics):]:
        ax.axis("off")
    handles = [Line2D([], [], color=colors[name], label=f"{name} ({len(runs)} runs)") for name, runs in methods.items()]
    fig.legend(handles=handles, loc="upper center", ncol=len(handles), title="mean over seeds; band: min to max")
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.8 / fig.get_figheight()))  # ~0.8 inch on top for the legend
    plumbing.save_png(fig, png_path, writer, dpi=120)  # never through a link; whole or not at all
    plt.close(fig)


def main(runs: tuple[str, ...], png_path: Path = Path("runs/compare.png"), metrics: tuple[str, ...] = METRICS,
         smooth: int = 1, num_points: int = 200) -> None:
    """Plot methods given as NAME=PATH,PATH,... (run directories, metrics.jsonl files or wandb CSV exports).

    Args:
        runs: one NAME=PATH,PATH,... per method, a path per seed.
        png_path: where the grid is written.
        metrics: the panels, metric names without `train/`.
        smooth: trailing mean over this many logged points of each seed before aggregating (1: none).
        num_points: points of the common episode grid.
    """
    for flag, value in (("--smooth", smooth), ("--num-points", num_points)):
        if value < 1:
            raise plumbing.ConfigError(f"{flag} {value}: must be at least 1")
    methods = parse_methods(runs)
    plumbing.check_outputs([("--png-path", Path(png_path))],
                           [("--runs", run_file(p)) for paths in methods.values() for p in paths], WRITER)
    methods = {name: {str(p): load_run(p) for p in paths} for name, paths in methods.items()}
    plot_grid(methods, png_path, metrics, smooth, num_points)
    print(f"plot_runs.py: wrote {png_path}")


if __name__ == "__main__":
    plumbing.run_tool("plot_runs.py", main)
