"""Plot RLOO training curves from one or more `metrics.jsonl` files written by rloo.py.

    python benchmark/plot_metrics.py --metrics-paths runs/a/metrics.jsonl runs/b/metrics.jsonl --png-path curves.png
"""

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import tyro  # noqa: E402

PANELS = (
    ("objective/scores", "score (reward model)"),
    ("objective/rlhf_reward", "RLHF reward (score - KL penalty)"),
    ("objective/kl", "KL(policy || reference)"),
)


def read_metrics(path: str | Path) -> list[dict]:
    """The per-update lines of a metrics.jsonl (eval-only lines skipped)."""
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [row for row in rows if "objective/scores" in row]


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over the last `window` values (fewer at the start)."""
    chunks = [values[max(0, i - window + 1) : i + 1] for i in range(len(values))]
    return [sum(chunk) / len(chunk) for chunk in chunks]


def plot_curves(metrics_paths: list[Path] | Path, png_path: Path, smooth: int = 10) -> None:
    """One subplot per metric against episode; raw values faint, a `smooth`-update moving average solid."""
    metrics_paths = [metrics_paths] if isinstance(metrics_paths, (str, Path)) else metrics_paths
    fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 3.6))
    for path in metrics_paths:
        rows = read_metrics(path)
        episodes = [row["episode"] for row in rows]
        for ax, (key, title) in zip(axes, PANELS):
            values = [row[key] for row in rows]
            (line,) = ax.plot(episodes, moving_average(values, smooth), label=Path(path).parent.name)
            ax.plot(episodes, values, color=line.get_color(), alpha=0.25, linewidth=0.8)
    for ax, (_, title) in zip(axes, PANELS):
        ax.set_title(title)
        ax.set_xlabel("episode")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    Path(png_path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    tyro.cli(plot_curves)
