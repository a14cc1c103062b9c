"""A researcher's own check of a changed copy of rloo.py, in one command, on the demo's tiny task (CPU, gloo):

    python check_change.py rloo_mine.py [--flags="--my_flag 1"]      (or: make check-change FILE=rloo_mine.py)

One line per check, saying what differs (exit status 1 if anything does):
- neutral settings: the copy without --flags against rloo.py, on 1 and on 2 ranks: the same metrics (those rloo.py
  logs) and the same final weights, bit for bit. A change whose flags default to off must pass.
- stop and resume: the copy with --flags, uninterrupted, against the copy stopped by SIGTERM and resumed with
  --resume, on 1 and on 2 ranks: stopped during the reward call of update 3 (the reward function waits there until the
  signal comes: the run stops at once, with the checkpoint of update 2) and stopped between updates 2 and 3 (the signal
  sent as update 2 ends: the run finishes it and saves it). The same metrics and weights, bit for bit: whatever a
  change carries across updates outside the checkpoint (a local variable of main, a buffer no part saves, a state
  changed during an update and saved as the stop found it) shows here.

The task: the demo's SFT policy, reward model and prompts (benchmark/synthetic_task.py, built once in --cache_dir,
shared with `make demo`), 16 of its prompts so that prompts recur within the run (an epoch every 4 updates on one rank,
every 2 on two), the demo's true score as a reward function beside the reward model, 2 PPO epochs of 2 minibatches.
rloo.py's runs are kept in .cache/rloo_check_change, keyed by the code and flags that made them.
"""

import hashlib
import json
import os
import runpy
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import tyro

REPO = Path(__file__).resolve().parent
STOP_AFTER = "_stop_after"  # check_change.py's own command: run a script, stopped by SIGTERM after update N
PROMPTS = 16
NOT_COMPARED = ("eps", "time/", "run_id")  # wall-clock measurements, and each run's own id
FIRST_SAID = ("objective/scores", "objective/rlhf_reward", "objective/kl", "loss/policy_avg", "policy/grad_norm")
HANG_GUARD_S = 1800  # a run that takes longer is stopped and said to have hung (a guard only: nothing waits for time)


@dataclass
class CheckArgs:
    """A changed copy of rloo.py against rloo.py, and against itself stopped and resumed, on the demo's tiny task."""

    file: tyro.conf.Positional[str]
    """the copy (a .py file beside rloo.py, importing plumbing as rloo.py does)"""
    flags: str = ""
    """the copy's flags that switch its change on, as one string ("--my_flag 1"): every run of the copy but the
    neutral ones gets them"""
    ranks: tuple[int, ...] = (1, 2)
    """the numbers of ranks to check on (torchrun, gloo)"""
    updates: int = 5
    """updates of each uninterrupted run (at least 4: the stops come in update 3)"""
    cache_dir: str = ".cache/rloo_demo"
    """where the demo's task is built, once (make demo's)"""
    keep: bool = False
    """keep every run's output_dir (kept anyway where a check finds a difference)"""


# ---------------------------------------------------------------- inside the runs
def run_stopped_after(update: int, script: str, argv: list[str]) -> None:
    """`script` run as __main__ with `argv`, SIGTERM sent to the run (by rank 0: to torchrun, which sends it to every
    rank; or to itself) as update `update` ends, where its loop asks whether to stop; each rank waits for the signal
    there, so that every rank stops after that update, whatever the machine's speed."""
    sys.path.insert(0, str(Path(script).resolve().parent))
    import plumbing

    asked, requested = [0], plumbing.StopSignal.requested

    def stop_after(self, device):
        asked[0] += 1
        if asked[0] == update:
            if os.environ.get("RANK", "0") == "0":
                os.kill(os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else os.getpid(), signal.SIGTERM)
            while self.name is None:  # the handler runs in this thread, between two sleeps
                time.sleep(0.01)
        return requested(self, device)

    plumbing.StopSignal.requested = stop_after
    sys.argv = [script, *argv]
    runpy.run_path(script, run_name="__main__")


# ---------------------------------------------------------------- the check
@dataclass
class Run:
    """One training run of the check: its output_dir, and why it did not finish (None: it did)."""

    output_dir: Path
    failed: Optional[str] = None


def task_flags(assets: dict[str, str], prompts: Path, nproc: int, updates: int) -> list[str]:
    """The check's flags: the demo's task and settings, 16 completions per rank and update."""
    flags = {"model_name_or_path": assets["policy"], "reward_model_path": assets["reward_model"],
             "dataset_name": str(prompts), "reward_fn": "benchmark.synthetic_task:stoppable_true_reward", "rloo_k": 4,
             "per_device_train_batch_size": 8, "num_mini_batches": 2, "num_ppo_epochs": 2, "learning_rate": 3e-4,
             "kl_coef": 0.05, "response_length": 8, "max_prompt_length": 16, "temperature": 1.0,
             "missing_eos_penalty": 1.0, "total_episodes": updates * 16 * nproc, "num_sample_generations": 0,
             "logging_steps": 1, "seed": 1}
    return [word for key, value in flags.items() for word in (f"--{key}", str(value))]


def launch(script: Path, args: list[str], nproc: int, env: dict, log: Path,
           stop_after: Optional[int] = None) -> subprocess.Popen:
    """`script` (under torchrun with nproc > 1), its output in `log`; with `stop_after`, stopped after that update."""
    program = [str(REPO / "check_change.py"), STOP_AFTER, str(stop_after), str(script)] if stop_after else [str(script)]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
                "--signals_to_handle", "SIGTERM,SIGINT,SIGUSR1"] if nproc > 1 else [sys.executable]
    with open(log, "w") as out:
        return subprocess.Popen([*launcher, *program, *args], stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                env={**os.environ, **env}, start_new_session=True)


def finished(process: subprocess.Popen, log: Path, output_dir: Path, wanted: str, stopped: bool = False) -> Run:
    """The run once its process ends: failed, with its last words, unless `wanted` is in its log and it exited 0 (a
    run `stopped` by a signal under torchrun: whatever torchrun's own status after it forwarded the signal)."""
    try:
        status = process.wait(timeout=HANG_GUARD_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        return Run(output_dir, f"it hung for {HANG_GUARD_S} s (log: {log})")
    text = log.read_text(errors="replace")
    if (status != 0 and not stopped) or wanted not in text:
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        said = [line for line in lines if ": error: " in line] or lines[-1:] or ["no output"]  # the run's own line
        return Run(output_dir, f"exit status {status}: {said[-1][:300]} (log: {log})")
    return Run(output_dir)


def train(script: Path, args: list[str], nproc: int, output_dir: Path, env: dict, resume: bool = False,
          stop_after: Optional[int] = None) -> Run:
    log = output_dir.with_name(output_dir.name + (".resume" if resume else "") + ".log")
    process = launch(script, [*args, "--output_dir", str(output_dir), *(["--resume"] if resume else [])], nproc, env,
                     log, stop_after)
    return finished(process, log, output_dir, "received: stopped after update" if stop_after else "saved the policy",
                    stopped=stop_after is not None)


def stopped_in_reward_call(script: Path, args: list[str], nproc: int, output_dir: Path, env: dict, call: int) -> Run:
    """The run whose reward function waits at its `call`-th call on every rank, sent SIGTERM once every rank waits."""
    markers = output_dir.with_name(output_dir.name + ".waiting")
    markers.mkdir(parents=True)
    log = output_dir.with_name(output_dir.name + ".log")
    from benchmark.synthetic_task import WAIT_AT_CALL, WAITING_IN

    process = launch(script, [*args, "--output_dir", str(output_dir)], nproc, {**env, WAIT_AT_CALL: str(call),
                                                                               WAITING_IN: str(markers)}, log)
    deadline = time.time() + HANG_GUARD_S  # a hang guard only
    while len(list(markers.iterdir())) < nproc and process.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    return finished(process, log, output_dir, "received while a reward function ran: stopped at once", stopped=True)


def read_metrics(output_dir: Path) -> list[dict]:
    path = output_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def difference(expected: Path, got: Path, what: str, keys: Optional[set] = None) -> Optional[str]:
    """Where the run in `got` first differs from the one in `expected` (metrics update by update, in `keys` or all of
    them, then the final weights bit for bit), in words; None if nowhere."""
    import torch
    from safetensors.torch import load_file

    a, b = read_metrics(expected), read_metrics(got)
    if [m.get("update") for m in a] != [m.get("update") for m in b]:
        return f"its metrics are of updates {[m.get('update') for m in b]}, {what}'s of {[m.get('update') for m in a]}"
    for x, y in zip(a, b):
        names = sorted(k for k in (keys if keys is not None else x.keys() | y.keys()) if not k.startswith(NOT_COMPARED))
        apart = [k for k in names if x.get(k) != y.get(k) and not (x.get(k) != x.get(k) and y.get(k) != y.get(k))]
        apart.sort(key=lambda k: FIRST_SAID.index(k) if k in FIRST_SAID else len(FIRST_SAID))  # the telling ones first
        if apart:
            more = f" (and {len(apart) - 1} other metrics)" if len(apart) > 1 else ""
            first = apart[0]
            return f"from update {x['update']}: {first} {y.get(first)!r} against {what}'s {x.get(first)!r}{more}"
    weights = [load_file(d / "model.safetensors") for d in (expected, got)]
    if weights[0].keys() != weights[1].keys():
        return f"its final weights have other tensors than {what}'s"
    apart = [k for k in weights[0] if not torch.equal(weights[0][k], weights[1][k])]
    if apart:
        gap = max((weights[0][k].double() - weights[1][k].double()).abs().max().item() for k in apart)
        return f"the same metrics, but {len(apart)} of {len(weights[0])} final weight tensors differ from {what}'s " \
               f"(the largest by {gap:.3g})"
    return None


def code_key(flags: list[str]) -> str:
    """What a run of rloo.py is made of: its code (rloo.py, plumbing/), torch's version and the flags."""
    import torch

    digest = hashlib.sha256(json.dumps([flags, torch.__version__]).encode())
    for path in [REPO / "rloo.py", *sorted((REPO / "plumbing").glob("*.py"))]:
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def stock_run(args: list[str], nproc: int, work: Path, env: dict) -> Run:
    """rloo.py's run with `args` on `nproc` ranks, from .cache/rloo_check_change when it ran before as it is now."""
    kept = REPO / ".cache" / "rloo_check_change" / f"{code_key(args)}-{nproc}"
    if not (kept / "model.safetensors").exists():
        run = train(REPO / "rloo.py", args, nproc, work / f"stock-{nproc}", env)
        if run.failed:
            return run
        kept.parent.mkdir(parents=True, exist_ok=True)
        fresh = Path(tempfile.mkdtemp(prefix=f"{kept.name}.", dir=kept.parent))  # this check's own: another check
        for name in ("metrics.jsonl", "model.safetensors"):  # of a copy, running now, may be keeping the same run
            shutil.copy(run.output_dir / name, fresh / name)
        try:
            os.replace(fresh, kept)
        except OSError:  # the other check kept it first: the same code and flags, so the same run, bit for bit
            shutil.rmtree(fresh)
            if not (kept / "model.safetensors").exists():
                raise
    return Run(kept)


def load_copy(script: Path):
    """The copy, imported as a module (its main not run), for its Args: its --flags are checked before any run."""
    import importlib.util

    sys.path.insert(0, str(script.parent))
    spec = importlib.util.spec_from_file_location(f"checked_{script.stem}", script)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # inspect finds its source through it
    spec.loader.exec_module(module)
    return module


def check(args: CheckArgs) -> int:
    """Every check, one line each; 0 if none finds a difference."""
    import plumbing
    from benchmark.synthetic_task import ensure_assets

    script = Path(args.file).resolve()
    if not script.is_file() or script.suffix != ".py":
        raise plumbing.ConfigError(f"{args.file}: " + ("not a .py file" if script.is_file() else "no such file") +
                                   ": pass your copy of rloo.py (make check-change FILE=rloo_mine.py)")
    if args.updates < 4 or not args.ranks or min(args.ranks) < 1:
        raise plumbing.ConfigError(f"--updates {args.updates} --ranks {' '.join(map(str, args.ranks))}: at least 4 "
                                   "updates (the stops come in update 3), on 1 rank or more")
    own = shlex.split(args.flags)
    copy = load_copy(script)
    plumbing.validate_args(plumbing.parse_args(copy.Args, argv=own + ["--model_name_or_path", ".", "--dataset_name",
                                                                      ".", "--reward_fn",
                                                                      "benchmark.synthetic_task:true_reward"],
                                               prog=f"{script.name} (its --flags)"))
    assets = ensure_assets(args.cache_dir)
    runs_root = REPO / "runs" / "check-change"
    runs_root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"{script.stem}-", dir=runs_root))
    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(Path(assets["train"]).read_text().splitlines(keepends=True)[:PROMPTS]))
    env = {"PYTHONPATH": os.pathsep.join([str(script.parent), str(REPO), os.environ.get("PYTHONPATH", "")]),
           "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    print(f"check_change.py: {args.file} on the demo's tiny task ({PROMPTS} prompts, {args.updates} updates, "
          f"ranks {', '.join(map(str, args.ranks))}); its flags: {args.flags or 'none'}; runs in {work}", flush=True)
    found = []

    def say(name: str, start: float, problem: Optional[str], same: str) -> None:
        found.append(problem is not None)
        print(f"  {name}: {problem or same} [{time.time() - start:.0f} s]", flush=True)

    for nproc in args.ranks:
        ranks = f"{nproc} rank{'s' * (nproc > 1)}"
        common = task_flags(assets, prompts, nproc, args.updates)
        start = time.time()
        stock = stock_run(common, nproc, work, env)
        copy = train(script, common, nproc, work / f"neutral-{nproc}", env)
        failed = stock.failed and f"rloo.py's run failed: {stock.failed}" or \
            copy.failed and f"the copy's run failed: {copy.failed}"
        keys = {k for m in read_metrics(stock.output_dir) for k in m}
        extra = sorted({k for m in read_metrics(copy.output_dir) for k in m} - keys)
        problem = failed or difference(stock.output_dir, copy.output_dir, "rloo.py", keys)
        say(f"neutral settings, {ranks}", start, problem,
            "the same as rloo.py, bit for bit (metrics and final weights)" + (
                f"; its own metrics, not compared: {', '.join(extra)}" if extra else ""))
        start = time.time()
        full = copy if not own else train(script, common + own, nproc, work / f"full-{nproc}", env)
        for name, stopped in (
                ("stopped by SIGTERM during update 3's reward call",
                 lambda out: stopped_in_reward_call(script, common + own, nproc, out, env, call=3)),
                ("stopped by SIGTERM between updates 2 and 3",
                 lambda out: train(script, common + own, nproc, out, env, stop_after=2))):
            out = work / f"{'reward' if 'reward' in name else 'between'}-{nproc}"
            run = stopped(out)
            if not run.failed:
                run = train(script, common + own, nproc, out, env, resume=True)
            problem = full.failed and f"the uninterrupted run failed: {full.failed}" or \
                run.failed and f"the stopped or resumed run failed: {run.failed}" or \
                difference(full.output_dir, out, "the uninterrupted run")
            say(f"{ranks}, {name}, then resumed", start, problem, "the same as the uninterrupted run, bit for bit "
                "(metrics and final weights)")
            start = time.time()
    if any(found) or args.keep:
        print(f"check_change.py: {sum(found)} of {len(found)} checks found a difference; the runs are in {work}")
    else:
        shutil.rmtree(work)
        print(f"check_change.py: all {len(found)} checks the same")
    return 1 if any(found) else 0


def main(args: CheckArgs) -> None:
    status = check(args)
    if status:
        sys.exit(status)


if __name__ == "__main__" and sys.argv[1:2] == [STOP_AFTER]:  # one of the check's runs: its script's own boundary
    run_stopped_after(int(sys.argv[2]), sys.argv[3], sys.argv[4:])
if __name__ == "__main__" and sys.argv[1:2] != [STOP_AFTER]:
    import plumbing  # here, not above: a stopped run imports its copy's plumbing, beside the copy

    plumbing.run_tool("check_change.py", CheckArgs, main)
