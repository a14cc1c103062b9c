"""The run's log: metrics reduced over ranks, the console, metrics.jsonl, wandb, and curves.png drawn from
metrics.jsonl as the run goes.
"""

import contextlib
import io
import json
import math
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .distributed import all_reduce, global_mean_std
from .errors import (ConfigError, Fault, describe, first_line, inert, new_file, not_a_file, reading,
                     shown, without_credentials)
from .faults import console_lost
from .folders import Folder
from .outputdir import marked_png
from .schedule import RunLength, trl116_arithmetic

__all__ = [  # what this module gives as plumbing.NAME (rloo.py, rloo_multinode.py, the tools, the tests)
    "reduce_metrics", "completion_metrics", "read_metrics", "moving_average", "curve_panels", "plot_curves",
    "CurvesSink", "MetricsWriteError", "run_notes", "RunLogger", "save_png",
]

METRICS = "metrics.jsonl"  # in output_dir: one JSON line per update and per evaluation


SUM_METRICS = ("val/num_eos_tokens", "completions/masked_truncated")


MIN_METRICS = ("completions/min_length", "clip_ratio/low_min")


MAX_METRICS = ("completions/max_length", "mismatch/logprob_diff_max", "clip_ratio/high_max")


MISMATCH_WARNING = 0.05  # mismatch/clipfrac above which the log says so, once a run


def is_optional_metric(key: str, value: float) -> bool:
    """A reward source's mean is NaN on a rank where the source applied to no completion: no data, not a
    failure. Every other NaN is reported as NaN, never hidden."""
    return key.startswith("reward/") and math.isnan(value)


def reduce_metrics(metrics: dict[str, float | tuple[float, float]], device: torch.device,
                   max_metrics: tuple[str, ...] = ()) -> dict[str, float]:
    """Metrics over all ranks: sums for counts, min/max for extremes and peak memory, means for everything else
    (a mean over the ranks that have data, for optional metrics); a (numerator, denominator) pair is a mean over
    every rank's items (tokens, completions): both summed over ranks, then divided (by at least 1, as TRL's); also the
    maximum of `max_metrics` (the rollout source's). Every rank must pass the same keys."""
    keys = sorted(metrics)
    # peak memory: the fullest rank's
    maxima = [k for k in keys if k in MAX_METRICS + max_metrics or k.startswith("memory/")]
    means = [k for k in keys if k not in SUM_METRICS + MIN_METRICS + tuple(maxima)]
    pairs = {k for k in means if isinstance(metrics[k], tuple)}
    has_data = [float(metrics[k][1]) if k in pairs else 0.0 if is_optional_metric(k, metrics[k]) else 1.0
                for k in means]
    values = [metrics[k][0] if k in pairs else metrics[k] if w else 0.0 for k, w in zip(means, has_data)]
    sums = all_reduce(torch.tensor(values + has_data + [metrics[k] for k in SUM_METRICS if k in metrics],
                                   dtype=torch.float64, device=device))
    out = {k: sums[i].item() / max(sums[len(means) + i].item(), k in pairs) for i, k in enumerate(means)
           if sums[len(means) + i] > 0 or k in pairs}
    out.update({k: v.item() for k, v in zip([k for k in SUM_METRICS if k in metrics], sums[2 * len(means):])})
    for op, selected in ((dist.ReduceOp.MIN, [k for k in MIN_METRICS if k in metrics]), (dist.ReduceOp.MAX, maxima)):
        extremes = all_reduce(torch.tensor([metrics[k] for k in selected], dtype=torch.float64, device=device), op)
        out.update(zip(selected, extremes.tolist()))
    return out


def completion_metrics(response_mask: torch.Tensor, has_stop: torch.Tensor, rewards: torch.Tensor,
                       grouped: torch.Tensor) -> dict:
    """Length and spread statistics of one rank's (N, Tr) completions, under TRL 1.16's names with TRL 1.16's
    meanings (a collective: reward_std is over every rank's): the lengths; mean_terminated_length over every rank's
    completions that stopped (0 when none did); reward_std, the spread of the sources' combined rewards (N,) over all
    completions; frac_reward_zero_std, the share of prompts whose `grouped` (k, B) rewards (column i prompt i's k, as
    rloo.in_groups gives them: TRL's are the KL-penalized rewards the advantages come from) have a spread of 0. A
    spread is over the scored completions (NaN: no source scored it), unbiased, as TRL's nanstd."""
    lengths = response_mask.sum(1).float()  # (N,)
    scored = ~grouped.isnan()
    mean = grouped.nansum(0) / scored.sum(0)  # (B,)
    per_prompt_std = ((grouped - mean).square().nansum(0) / (scored.sum(0) - 1)).sqrt()  # (B,) unbiased, as std
    return {
        "completions/mean_length": lengths.mean().item(),
        "completions/min_length": lengths.min().item(),
        "completions/max_length": lengths.max().item(),
        "completions/mean_terminated_length": (lengths[has_stop].sum().item(), has_stop.sum().item()),
        "completions/clipped_ratio": (~has_stop).float().mean().item(),
        "val/num_eos_tokens": has_stop.sum().item(),
        "reward_std": global_mean_std(rewards, ~rewards.isnan())[1].item(),
        "frac_reward_zero_std": torch.isclose(per_prompt_std, torch.zeros(())).float().mean().item(),
    }


def read_metrics(path, evals: bool = False) -> list[dict]:
    """The lines of a metrics.jsonl: the per-update lines (they hold `objective/scores`), or with `evals` the
    evaluation lines (they hold `eval/scores`; update 0 is the initial policy's). A last line without its newline is
    one a run is still writing: skipped. Any other line that is not a JSON object, or a file that is not there, is
    a ConfigError naming it."""
    problem = not_a_file(Path(path))  # a device or a pipe (metrics.jsonl made a link to /dev/full) may never end
    if problem:
        raise ConfigError(f"metrics file {path} {problem}: pass the metrics.jsonl a run wrote (or its directory)")
    with reading(f"metrics file {path}", "pass the metrics.jsonl a run wrote"):
        lines = Path(path).read_text(errors="replace").split("\n")
    rows = []
    for number, line in enumerate(lines, 1):
        try:
            row = json.loads(line) if line.strip() else {}
        except ValueError as e:
            if number == len(lines):  # a run is writing it: the rest comes with its newline
                break
            raise ConfigError(f"metrics file {path}: line {number} is not JSON ({describe(e)}): a metrics.jsonl "
                              "holds one JSON object per line") from None
        if not isinstance(row, dict):
            raise ConfigError(f"metrics file {path}: line {number} is a JSON {type(row).__name__}, not an object")
        rows.append(row)
    return [row for row in rows if ("eval/scores" if evals else "objective/scores") in row]


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over the last `window` values (fewer at the start)."""
    chunks = [values[max(0, i - window + 1) : i + 1] for i in range(len(values))]
    return [sum(chunk) / len(chunk) for chunk in chunks]


def score_sources(rows: list[dict]) -> str:
    """What a run's score is: its reward sources, read from their `reward/<source>/mean` metrics."""
    names = dict.fromkeys(key[len("reward/"):-len("/mean")] for row in rows for key in row
                          if key.startswith("reward/") and key.endswith("/mean"))
    return ", ".join(name.replace("_", " ") if name == "reward_model" else f"{name}()" for name in names) or "score"


MISMATCH_SHOWN = 1e-4  # per-token |log-prob difference| above float32's rounding: a sampler that is not the trainer


def curve_panels(runs: list[tuple[list[dict], list[dict]]]) -> list[tuple[str, str, bool]]:
    """(metric, title, from eval lines) of each panel drawn for these runs' (update lines, eval lines), what a
    newcomer reads first first: the score, the eval score where a run evaluated, the KL, the completions' length
    and entropy, the RLHF reward; then the sampler/trainer mismatch, only where a sampler differs from the trainer
    (above MISMATCH_SHOWN: a bf16 copy, autocast's, an engine; the same fp32 weights differ by ~1e-7, which means
    nothing)."""
    sources = score_sources([row for rows, _ in runs for row in rows])
    panels = [("objective/scores", f"score ({sources})", False)]
    if any(evals for _, evals in runs):
        panels.append(("eval/scores", f"eval score ({sources}; test prompts, near-greedy)", True))
    panels += [("objective/kl", "KL(policy || reference)", False),
               ("completions/mean_length", "completion length (tokens)", False),
               ("objective/entropy", "entropy of the sampled tokens (per completion)", False),
               ("objective/rlhf_reward", "RLHF reward (score - KL penalty)", False)]
    if any(row.get("mismatch/logprob_diff_mean", 0.0) > MISMATCH_SHOWN for rows, _ in runs for row in rows):
        panels.append(("mismatch/logprob_diff_mean", "sampler/trainer |log-prob difference| per token", False))
    return panels


def plot_curves(metrics_paths: list[Path] | Path, png_path: Path, smooth: int = 10, writer: str = "rloo.py",
                folder: Optional[Folder] = None) -> None:
    """One panel per metric (curve_panels) against episode, in a grid of rows of 3, one line per metrics.jsonl (its
    directory's name); per-update values faint, a `smooth`-update trailing mean solid; eval scores as points.
    Written by save_png, signed by `writer`."""
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state; Agg draws the file

    metrics_paths = [metrics_paths] if isinstance(metrics_paths, (str, Path)) else list(metrics_paths)
    runs = [(read_metrics(path), read_metrics(path, evals=True)) for path in metrics_paths]
    panels = curve_panels(runs)
    columns, rows = min(3, len(panels)), math.ceil(len(panels) / 3)
    fig = Figure(figsize=(4.6 * columns, 3.4 * rows))
    grid = fig.subplots(rows, columns, squeeze=False).flatten()
    for unused in grid[len(panels):]:
        unused.set_visible(False)
    axes = grid[:len(panels)]
    for path, (rows, evals) in zip(metrics_paths, runs):
        color = None
        for ax, (key, title, from_evals) in zip(axes, panels):
            points = [(row["episode"], row[key]) for row in (evals if from_evals else rows) if key in row]
            if not points:
                continue
            episodes, values = zip(*points)
            if from_evals:
                (line,) = ax.plot(episodes, values, marker="o", color=color, label=Path(path).parent.name)
            else:
                (line,) = ax.plot(episodes, moving_average(list(values), smooth), color=color,
                                  label=Path(path).parent.name)
                ax.plot(episodes, values, color=line.get_color(), alpha=0.25, linewidth=0.8)
            color = line.get_color()
    for ax, (_, title, _) in zip(axes, panels):
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("episode")
        ax.xaxis.get_major_locator().set_params(nbins=4)  # labels of 5-6 digits side by side stay apart
        ax.grid(alpha=0.3)
    if axes[0].get_legend_handles_labels()[0]:  # nothing to name before the first update's line
        axes[0].legend(fontsize=8)
    fig.tight_layout()
    save_png(fig, png_path, writer, dpi=100, folder=folder)


def save_png(fig, png_path: Path, writer: str, dpi: int, folder: Optional[Folder] = None) -> None:
    """A matplotlib figure as a PNG at `png_path` (in `folder`, by its name, where given), written whole (a viewer
    never sees half), never through a link, and signed by `writer` (plumbing.marked_png: a text chunk of this
    project's with a digest of the rest), by which a run or a script tells its own drawing from a file it must not
    write over."""
    buffer = io.BytesIO()
    fig.savefig(buffer, dpi=dpi, format="png")
    if folder is not None:
        return folder.write(Path(png_path).name, marked_png(buffer.getvalue(), writer))
    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    partial = png_path.with_name(f".{png_path.name}.partial")
    with new_file(partial, binary=True) as f:
        f.write(marked_png(buffer.getvalue(), writer))
    os.replace(partial, png_path)


class CurvesSink:
    """Draws output_dir/curves.png from metrics.jsonl as the run goes: after an update or an evaluation when drawing
    has taken under SHARE of the run's time so far, counting the next drawing at the last one's cost (a run of
    minutes is redrawn every few seconds' worth of drawing, a test's run of seconds only at its end), and at the
    end always. Plumbing that must never stop a run: without matplotlib, or when a drawing fails, one line, once,
    and no more drawing."""

    SHARE = 0.05
    FIRST_COST = 2.0  # seconds, measured on 2 busy CPU cores: matplotlib's import and a first grid; later ones ~1 s

    def __init__(self, metrics_path: Path, say: Callable[[str], None], identity: Optional[tuple] = None):
        self.metrics_path, self.png_path, self.say = metrics_path, metrics_path.with_name("curves.png"), say
        self.identity = identity  # output_dir's: drawn only into the folder the run started in
        self.enabled, self.started, self.spent, self.cost = True, time.perf_counter(), 0.0, self.FIRST_COST

    def draw(self, force: bool = False) -> None:
        start = time.perf_counter()
        if not self.enabled or (not force and self.spent + self.cost > self.SHARE * (start - self.started)):
            return
        try:
            with Folder.at(self.png_path.parent, self.identity) as folder:
                plot_curves(self.metrics_path, self.png_path, folder=folder)
        except ImportError as e:
            self.enabled = False
            self.say(f"no curves.png: matplotlib cannot be imported ({first_line(e)}); pip install matplotlib")
        except Exception as e:  # noqa: BLE001: a drawing is never worth a run
            self.enabled = False
            self.say(f"warning: drawing {self.png_path} failed ({type(e).__name__}: {first_line(e)}); no more curves "
                     "this run (benchmark/plot_metrics.py draws them from metrics.jsonl)")
        self.cost = time.perf_counter() - start
        self.spent += self.cost


SAMPLE_CHARACTERS = 2000  # of a prompt or a completion in the console's sample table


class MetricsWriteError(Fault):
    """metrics.jsonl could not be written (a full disk, a quota): the run stops, with a checkpoint where it can."""


def run_notes(run_name: str, num_updates: int, prompts: int, k: int, world_size: int, dataset_prompts: int,
              source_names, policy, trainable: list, args, run: Optional[RunLength] = None) -> list[str]:
    """Start-up lines: with --use_peft the adapters' size, then the run's shape: its updates of `prompts` x k
    completions per rank, its optimizer steps (`run`), an epoch's prompts (their counts: the start-up line that loaded
    them) and reward sources."""
    per_update, epoch = prompts * k * world_size, dataset_prompts * k
    run = run or RunLength(num_updates, 1)
    last = run.steps_in(run.updates)
    steps = f"{run.steps} optimizer steps ({run.steps_per_update} an update" + (
        f", {last} in the last" if last < run.steps_per_update else "") + ")"
    lora = [f"LoRA: {sum(p.numel() for p in trainable):,} trainable parameters of "
            f"{sum(p.numel() for p in policy.parameters()):,}; adapted modules "
            f"{sorted(policy.peft_config['default'].target_modules)}"] if args.use_peft else []
    whole, left = divmod(dataset_prompts, prompts * world_size)  # TRL 1.16's epoch: the batches its prompts fill
    length = f"{whole} updates ({left} prompts left out, as TRL 1.16's sampler)" if trl116_arithmetic(args) else \
        f"{epoch / per_update:.3g} updates"
    return lora + [f"{run_name}: {num_updates} updates x {per_update} completions ({prompts} prompts x k={k} per rank "
                   f"x {world_size} ranks), {steps}; an epoch: {dataset_prompts} prompts x k={k} = {epoch} "
                   f"completions = {length}; reward sources {source_names}"]


class RunLogger:
    """Rank 0's outputs: a compact line per update, metrics.jsonl (appended), wandb, TensorBoard, a progress bar,
    tables."""

    LINE_KEYS = (("objective/scores", "score"), ("objective/rlhf_reward", "rlhf"), ("objective/kl", "kl"),
                 ("objective/entropy", "ent"), ("policy/clipfrac_avg", "clip"), ("completions/mean_length", "len"),
                 ("eps", "eps"))

    def __init__(self, args, run_name: str, num_updates: int, start_update: int, wandb_run_id: Optional[str],
                 run_id: Optional[str] = None, logging_steps: Optional[int | set[int]] = None):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.output_dir, self.metrics_path = args.output_dir, Path(args.output_dir) / METRICS
        with Folder.at(args.output_dir, create=True) as root:  # the folder it writes in, to its end
            self.identity = root.identity
            root.append(METRICS).close()  # never through a link: take_output_dir refused a foreign one
        self.wandb = None
        if args.track:
            import wandb

            self.wandb = wandb
            wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, name=run_name,
                       config={k: without_credentials(v) if isinstance(v, str) else v
                               for k, v in asdict(args).items()}, dir=args.output_dir, id=wandb_run_id, resume="allow")
        self.to_tensorboard, self.tensorboard_folder = args.tensorboard, None  # output_dir/tensorboard, held
        self.tensorboard, self.resumed = None, start_update > 0  # the writer, opened by publish
        self.console = Console(markup=False)  # a path, a prompt or a completion holding `[/]` is text, not markup
        self.progress = Progress(TextColumn("update"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                                 console=self.console, transient=True)
        self.task = self.progress.add_task("updates", total=num_updates, completed=start_update)
        self.progress.start()
        # the updates with a console line: every this many, or these (plumbing.update_intervals), and the last
        self.num_updates, self.logging_steps = num_updates, logging_steps or args.logging_steps
        self.run_id = run_id  # on every metrics.jsonl line: a line of another run is never taken for this one's
        self.mismatch_warned = False
        self.curves = CurvesSink(self.metrics_path, self.say, self.identity)

    def say(self, line: str) -> None:
        """A line of the run's own (a note, a warning) on the console, as inert text (shown): a path in it holding
        ESC or an RLO shows as escapes."""
        self.console.print(shown(line), highlight=False, soft_wrap=True)

    def log(self, update: int, metrics: dict[str, float]) -> None:
        self.write_metrics({"update": update, **metrics})
        self.publish(metrics, int(metrics["episode"]))
        if (update not in self.logging_steps if isinstance(self.logging_steps, set) else update % self.logging_steps) \
                and update != self.num_updates:
            self.progress.advance(self.task)
            return
        parts = " ".join(f"{short} {metrics[key]:.0f}" if abs(metrics[key]) >= 100 else f"{short} {metrics[key]:.3g}"
                         for key, short in self.LINE_KEYS if key in metrics)
        phases = sorted(((v, k[5:]) for k, v in metrics.items() if k.startswith("time/") and k != "time/update"),
                        reverse=True)[:2]  # the update's two longest phases: metrics.jsonl has them all
        times = f" | {metrics['time/update']:.2f} s: " if "time/update" in metrics else " | "
        self.console.print(f"update {update}/{self.num_updates}, episode {int(metrics['episode'])}: {parts}{times}"
                           + ", ".join(f"{name} {v:.2f}" for v, name in phases), highlight=False, soft_wrap=True)
        if metrics.get("mismatch/clipfrac", 0.0) > MISMATCH_WARNING and not self.mismatch_warned:
            self.mismatch_warned = True
            self.console.print(
                f"warning: the sampler and the trainer disagree: {metrics['mismatch/clipfrac']:.0%} of completions "
                f"have p_trainer / p_sampler outside the clip band (per-token |log-prob difference| mean "
                f"{metrics['mismatch/logprob_diff_mean']:.2g}, max {metrics['mismatch/logprob_diff_max']:.2g}); see "
                "--vllm_importance_sampling_correction (said once a run)", highlight=False, soft_wrap=True)
        self.progress.advance(self.task)
        self.curves.draw()

    def log_eval(self, update: int, metrics: dict[str, float], episode: int) -> None:
        self.write_metrics({"update": update, "episode": episode, **metrics})
        self.publish(metrics, episode)
        self.console.print(f"eval after update {update}: " + " ".join(f"{k.removeprefix('eval/')} {v:.4g}"
                                                                         for k, v in metrics.items()),
                           highlight=False, soft_wrap=True)
        self.curves.draw()

    def publish(self, metrics: dict[str, float], step: int) -> None:
        """An update's or an evaluation's metrics to wandb and TensorBoard, at its episode. TensorBoard's writer opens
        at the first: a resumed run's drops the events its earlier timeline wrote from that step on (purge_step)."""
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)
        if self.to_tensorboard:
            if self.tensorboard is None:  # written into the folder it was opened in, through its handle
                try:
                    with Folder.at(self.output_dir, self.identity) as root:
                        self.tensorboard_folder = root.folder("tensorboard", create=True)
                except OSError as e:  # a link planted there, output_dir moved away
                    raise MetricsWriteError(f"could not write {Path(self.output_dir) / 'tensorboard'} "
                                            f"({e.strerror or e})") from None
                from torch.utils.tensorboard import SummaryWriter

                self.tensorboard = SummaryWriter(self.tensorboard_folder.os_path, flush_secs=30,
                                                 purge_step=step if self.resumed else None)
            for key, value in metrics.items():
                self.tensorboard.add_scalar(key, value, step)

    def write_metrics(self, record: dict) -> None:
        """One line of metrics.jsonl, whole or not at all: a write that fails (a full disk, a quota) is cut off again
        and stops the run (MetricsWriteError). Once the console went away, each line says so (`console_lost`)."""
        lost = console_lost()  # the console went away: the run went on, its lines unseen
        line = json.dumps({**record, "run_id": self.run_id, **({"console_lost": lost} if lost else {})}) + "\n"
        try:
            with Folder.at(self.output_dir, self.identity) as root, root.append(METRICS) as f:
                size, data = os.fstat(f.fileno()).st_size, memoryview(line.encode())
                try:
                    while data:
                        data = data[os.write(f.fileno(), data):]
                except OSError:
                    with contextlib.suppress(OSError):
                        os.ftruncate(f.fileno(), size)
                    raise
        except OSError as e:
            raise MetricsWriteError(f"could not write {self.metrics_path} ({e.strerror or e})") from None

    def sample_table(self, rows: list[tuple[str, str, float]], episode: int) -> None:
        """The first completions of an update with their prompts and scores: the data's and the policy's words, as
        inert text (Text: no markup either), a line each."""
        from rich.table import Table
        from rich.text import Text

        table = Table(title=f"samples at episode {episode}", show_lines=True)
        for column in ("query", "response", "score"):
            table.add_column(column)
        for query, response, score in rows:
            table.add_row(Text(inert(query, SAMPLE_CHARACTERS)), Text(inert(response, SAMPLE_CHARACTERS)),
                          f"{score:.4f}")
        self.console.print(table)
        if self.wandb is not None:
            self.wandb.log({"samples": self.wandb.Table(columns=["query", "response", "score"],
                                                        data=[list(r) for r in rows])}, step=episode)

    def print_notes(self, notes: list[str]) -> None:
        """Start-up notes and what the first update showed: a line each, as written (no markup, no wrapping)."""
        for note in notes:
            self.say(note)

    @property
    def wandb_run_id(self) -> Optional[str]:
        return self.wandb.run.id if self.wandb is not None else None

    def close(self) -> None:
        self.progress.stop()
        self.curves.draw(force=True)
        if self.wandb is not None:
            self.wandb.finish()
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard_folder.close()
