"""Plot RLOO training curves from one or more `metrics.jsonl` files written by rloo.py (each run draws its own
output_dir/curves.png with the same code, plumbing.plot_curves, as it goes).

    python benchmark/plot_metrics.py --metrics-paths runs/a/metrics.jsonl runs/b/metrics.jsonl --png-path curves.png
"""

import sys
from pathlib import Path

import tyro

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python benchmark/plot_metrics.py` adds benchmark/
from plumbing import moving_average, plot_curves, read_metrics  # noqa: E402

__all__ = ["moving_average", "plot_curves", "read_metrics"]

if __name__ == "__main__":
    tyro.cli(plot_curves)
