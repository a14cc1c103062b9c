"""Plot RLOO training curves from one or more `metrics.jsonl` files written by rloo.py (each run draws its own
output_dir/curves.png with the same code, plumbing.plot_curves, as it goes).

    python benchmark/plot_metrics.py --metrics-paths runs/a/metrics.jsonl runs/b/metrics.jsonl --png-path curves.png
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python benchmark/plot_metrics.py` adds benchmark/
import plumbing  # noqa: E402
from plumbing import moving_average, plot_curves, read_metrics  # noqa: E402

__all__ = ["moving_average", "plot_curves", "read_metrics"]

WRITER = "benchmark/plot_metrics.py"  # the mark its PNGs carry: a path that exists is replaced only if it has it


def main(metrics_paths: list[Path], png_path: Path, smooth: int = 10) -> None:
    """Draw the curves of runs into one PNG.

    Args:
        metrics_paths: the metrics.jsonl of each run (or the run's directory); a run still writing is drawn up to
            its last complete line.
        png_path: the PNG to write: a new path, or a PNG this script drew (never a file of another's).
        smooth: trailing mean over this many updates (1: none).
    """
    if smooth < 1:
        raise plumbing.ConfigError(f"--smooth {smooth}: a trailing mean needs at least 1 update (1: no smoothing)")
    metrics_paths = [path / "metrics.jsonl" if path.is_dir() else path for path in metrics_paths]
    plumbing.check_outputs([("--png-path", png_path)], [("--metrics-paths", path) for path in metrics_paths], WRITER)
    plot_curves(metrics_paths, png_path, smooth, writer=WRITER)
    print(f"plot_metrics.py: wrote {png_path}")


if __name__ == "__main__":
    plumbing.run_tool("plot_metrics.py", main)
