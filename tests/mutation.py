"""Mutation testing of the algorithm: deliberate bugs of the kinds a researcher makes (a sign, a reshape, a dropped
term, a clamp bound, a missed temperature, an off-by-one), applied one at a time to a copy of the repository in a
temporary directory (never the working tree), each then run against the algorithm's fast tests that execute the
mutated lines. A mutant is killed when a test fails; a survivor is a bug the tests would let through.

    python tests/mutation.py            # all mutants (make mutate)
    python tests/mutation.py -k kl      # those whose name contains "kl" (-k repeatable)
    python tests/mutation.py --list     # the mutants, nothing run
    python tests/mutation.py --workers 1 --all_tests   # one at a time, every fast test for each (the slow, old way)

First the fast tests run once on the unmutated code under a line tracer (this file is also that pytest plugin,
`-p mutation`): which test executes which line of the mutated files. Each mutant then runs only the tests that
execute one of its lines (all of them when a line runs outside any test, at import), in `--workers` copies of the
repository at once (one per core, up to 4). A mutant those tests let through is run again against every fast test
before it counts as a survivor, so the selection never hides a kill.

Each mutant is an exact snippet of a file and its replacement. The script refuses to run, naming the mutant, when a
snippet no longer occurs exactly once: after a change to rloo.py, update the snippet (or drop the mutant) here.
Exit status: 0 when every mutant is killed, 1 when some survive, 2 when the list is stale."""

import argparse
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# the algorithm's fast tests: pure functions on hand-computed numbers and naive loops, the update's contract
TESTS = ["tests/test_math.py", "tests/test_oracles.py", "tests/test_update.py",
         "tests/test_mismatch.py::test_mismatch_metrics_by_hand",
         "tests/test_mismatch.py::test_importance_weights_by_hand_in_every_mode",
         "tests/test_mismatch.py::test_the_weights_multiply_each_actions_clipped_loss"]
# test_oracles.py's runs (a training run in process, torchrun, a model load) take 20 s: left out of each mutant's
DESELECT = [f"tests/test_oracles.py::{name}" for name in (
    "test_the_logged_objective_metrics_against_a_naive_loop_over_the_rollouts",
    "test_the_rollouts_log_probs_are_the_models_and_the_kl_to_the_initial_policy_grows_positive",
    "test_the_evaluation_lines_of_a_run_are_its_reward_on_its_test_prompts", "test_metrics_reduced_over_two_ranks",
    "test_sft_model_path_trains_the_sft_weights_with_the_tokenizer_of_model_name_or_path")]
HANG_GUARD_S = 600  # per mutant: a mutant that hangs the tests counts as killed (it would not pass CI)

# (name, file, snippet, replacement): each snippet must occur exactly once in its file
MUTANTS = [
    # ----- advantages
    ("kl sign flipped", "rloo.py",
     "return rollout.logprobs - rollout.ref_logprobs", "return rollout.ref_logprobs - rollout.logprobs"),
    ("non-score reward sign", "rloo.py",
     "non_score_reward = -kl_coef * kl.sum(-1)", "non_score_reward = kl_coef * kl.sum(-1)"),
    ("kl_coef dropped from the sequence penalty", "rloo.py",
     "non_score_reward = -kl_coef * kl.sum(-1)", "non_score_reward = -kl.sum(-1)"),
    ("kl term dropped from rlhf_reward", "rloo.py",
     "rlhf_reward = scores + non_score_reward  # (k, g)", "rlhf_reward = scores  # (k, g)"),
    ("kl not masked", "rloo.py",
     "    kl = kl * response_mask\n", "    kl = kl\n"),
    ("kl mean instead of sum over tokens", "rloo.py",
     "non_score_reward = -kl_coef * kl.sum(-1)", "non_score_reward = -kl_coef * kl.mean(-1)"),
    ("baseline over k instead of k - 1", "rloo.py",
     "return (rewards.nansum(0, keepdim=True) - rewards) / (scored - 1)",
     "return (rewards.nansum(0, keepdim=True) - rewards) / scored"),
    ("baseline includes the sample itself", "rloo.py",
     "return (rewards.nansum(0, keepdim=True) - rewards) / (scored - 1)",
     "return rewards.nansum(0, keepdim=True) / scored"),
    ("baseline over the batch, not the prompt", "rloo.py",
     "return (rewards.nansum(0, keepdim=True) - rewards) / (scored - 1)",
     "return (rewards.nansum() - rewards) / (rewards.numel() - 1)"),
    ("an unscored completion counted in its siblings' baselines", "rloo.py",
     "scored = (~rewards.isnan()).sum(0, keepdim=True)  # (1, g)",
     "scored = torch.full((1, rewards.shape[1]), k)  # (1, g)"),
    ("advantages whitened over the unscored completions too", "rloo.py",
     "whiten(advantages, scored if advantages.dim() == 1 else scored & c.response_mask)",
     "whiten(advantages.nan_to_num(0.0), None if advantages.dim() == 1 else c.response_mask)"),
    ("a masked completion's KL kept in its reward", "rloo.py",
     "kl = kl if c.in_loss is None else kl * c.in_loss[:, None]", "kl = kl"),
    ("k1 in the reward sign flipped", "rloo.py", "        return -log_ref_ratio\n", "        return log_ref_ratio\n"),
    ("k2 without its half", "rloo.py",
     "return 0.5 * log_ref_ratio.square()", "return log_ref_ratio.square()"),
    ("the reward's KL estimator ignored", "rloo.py",
     'kl_estimate(c.logprobs, c.ref_logprobs, args.kl_estimator or "k1")',
     'kl_estimate(c.logprobs, c.ref_logprobs, "k1")'),
    ("baseline not subtracted", "rloo.py",
     "return rlhf_reward - baseline, rlhf_reward", "return rlhf_reward, rlhf_reward"),
    ("(B, k) reshape in in_groups", "rloo.py",
     "return x.reshape(k, -1, *x.shape[1:])", "return x.reshape(-1, k, *x.shape[1:]).transpose(0, 1)"),
    ("token-level returns summed forwards", "rloo.py",
     "returns = token_rewards.flip(-1).cumsum(-1).flip(-1)", "returns = token_rewards.cumsum(-1)"),
    # not a mutant: the score added at the last position instead of the last valid token gives the same advantages
    # (returns-to-go are summed from the end and padding is masked), so no test can tell them apart
    ("token-level kl_coef dropped", "rloo.py",
     "token_rewards = -kl_coef * kl  # (k, g, Tr)", "token_rewards = -kl  # (k, g, Tr)"),
    ("token-level advantages not masked", "rloo.py",
     "return (returns - baseline[..., None]) * response_mask, rlhf_reward",
     "return returns - baseline[..., None], rlhf_reward"),
    ("whiten without the mean", "rloo.py",
     "out = (x - mean) / (std + 1e-8)", "out = x / (std + 1e-8)"),
    ("whiten leaves padding unmasked", "rloo.py",
     "return out if mask is None else out * mask", "return out"),
    # ----- rollout and rewards
    ("truncation masks the stop token itself", "rloo.py",
     "after_stop = (is_stop.long().cumsum(1) - is_stop.long()) > 0", "after_stop = is_stop.long().cumsum(1) > 0"),
    ("truncation after the second stop token", "rloo.py",
     "after_stop = (is_stop.long().cumsum(1) - is_stop.long()) > 0",
     "after_stop = (is_stop.long().cumsum(1) - is_stop.long()) > 1"),
    ("sampling ignores the temperature", "rloo.py",
     "scaled = logits / temperature  # (N, V)", "scaled = logits  # (N, V)"),
    ("sampling can draw a zero-probability token", "rloo.py",
     "torch.searchsorted(cdf, u, right=True)", "torch.searchsorted(cdf, u, right=False)"),
    ("(B, k) layout in completion_rows", "rloo.py",
     "return (torch.arange(k, device=prompts.device)[:, None] * num_prompts + prompts[None, :]).flatten()",
     "return (torch.arange(k, device=prompts.device)[None, :] + prompts[:, None] * k).flatten()"),
    ("last real token assumes right padding", "rloo.py",
     "return torch.where(mask.bool(), positions, -1).max(dim=1).values", "return mask.long().sum(1) - 1"),
    ("missing-EOS penalty added", "rloo.py",
     "torch.where(has_stop, scores, scores - penalty)", "torch.where(has_stop, scores, scores + penalty)"),
    ("missing-EOS penalty on the completions that stopped", "rloo.py",
     "torch.where(has_stop, scores, scores - penalty)", "torch.where(has_stop, scores - penalty, scores)"),
    ("reward sources that do not apply counted", "rloo.py",
     "return (values * applies * weights[:, None]).sum(0)", "return (values * weights[:, None]).sum(0)"),
    ("reward sources averaged, not summed", "rloo.py",
     "return (values * applies * weights[:, None]).sum(0)", "return (values * applies * weights[:, None]).mean(0)"),
    # ----- loss
    ("sequence log-ratio not masked", "rloo.py",
     "return ((new_logprobs - old_logprobs) * response_mask).sum(1)", "return (new_logprobs - old_logprobs).sum(1)"),
    ("sequence log-ratio inverted", "rloo.py",
     "return ((new_logprobs - old_logprobs) * response_mask).sum(1)",
     "return ((old_logprobs - new_logprobs) * response_mask).sum(1)"),
    ("importance ratio inverted", "rloo.py",
     "log_ratio = (old_logprobs - sampler_logprobs) * response_mask  # (N, Tr)",
     "log_ratio = (sampler_logprobs - old_logprobs) * response_mask  # (N, Tr)"),
    ("importance truncation clamps from below", "rloo.py",
     "return ratio.clamp(max=cap)", "return ratio.clamp(min=cap)"),
    ("importance mask keeps the cap", "rloo.py",
     "return torch.where(ratio <= cap, ratio, 0.0)", "return torch.where(ratio <= cap, ratio, cap)"),
    ("clip range asymmetric", "rloo.py",
     "torch.clamp(ratio, 1.0 - args.cliprange, 1.0 + args.cliprange_high)",
     "torch.clamp(ratio, 1.0 - args.cliprange, 1.0 + 2 * args.cliprange_high)"),
    ("clipped surrogate takes the min", "rloo.py",
     "per_action = torch.max(losses, losses_clipped)", "per_action = torch.min(losses, losses_clipped)"),
    ("ratio detached", "rloo.py",
     "ratio = torch.exp(log_ratio)\n", "ratio = torch.exp(log_ratio.detach())\n"),
    ("per-token losses not masked", "rloo.py",
     "return per_action * weight if per_token or in_loss is not None else per_action, stats",
     "return per_action, stats"),
    ("approxkl without its half", "rloo.py",
     '"policy/approxkl_avg": 0.5 * masked_mean(log_ratio**2, weight)',
     '"policy/approxkl_avg": masked_mean(log_ratio**2, weight)'),
    ("k3 without its log-ratio term", "rloo.py",
     "return log_ref_ratio.exp() - log_ref_ratio - 1", "return log_ref_ratio.exp() - 1"),
    ("kl in the loss not masked", "rloo.py",
     "kl_estimate(new_logprobs * response_mask, batch.ref_logprobs * response_mask, estimator)",
     "kl_estimate(new_logprobs, batch.ref_logprobs, estimator)"),
    ("kl in the loss and in the reward", "rloo.py",
     "k, g, kl_coef = c.k, c.queries.shape[0], 0.0 if args.kl_in_loss else args.kl_coef",
     "k, g, kl_coef = c.k, c.queries.shape[0], args.kl_coef"),
    ("kl in the loss without its coefficient", "rloo.py",
     "per_action = per_action + args.kl_coef * (kl if per_token else kl.sum(1))",
     "per_action = per_action + (kl if per_token else kl.sum(1))"),
    ("the truncated completions kept in the loss", "rloo.py",
     "return has_stop if args.mask_truncated_completions else None",
     "return ~has_stop if args.mask_truncated_completions else None"),
    ("loss normalizer: a sum instead of a mean", "rloo.py",
     "count = torch.tensor(float(len(rows)), device=rollout.responses.device)",
     "count = torch.tensor(1.0, device=rollout.responses.device)"),
    ("loss normalizer: micro-batches instead of completions", "rloo.py",
     "count = torch.tensor(float(len(rows)), device=rollout.responses.device)",
     "count = torch.tensor(float(len(minibatch[0])), device=rollout.responses.device)"),
    # ----- batch arithmetic and schedule
    ("minibatch without gradient accumulation", "rloo.py",
     "mini = micro * args.gradient_accumulation_steps", "mini = micro"),
    ("minibatch plan splits completions as groups", "rloo.py",
     "for minibatch in order.split(sizes.mini // k):", "for minibatch in order.split(sizes.mini):"),
    ("TRL 1.16's schedule read one step late", "plumbing/schedule.py",
     "return lambda step: args.learning_rate * factor(step - 1)",
     "return lambda step: args.learning_rate * factor(step)"),
    ("the run's last update takes every step of an update", "rloo.py",
     "for minibatch in minibatch_plan(rollout, sizes, k)[: steps - epoch * sizes.minibatches]:",
     "for minibatch in minibatch_plan(rollout, sizes, k):"),
    ("the learning rate of the step before", "rloo.py",
     'group["lr"] = learning_rate(steps_done + 1)', 'group["lr"] = learning_rate(steps_done)'),
    ("learning rate decays one update early", "plumbing/schedule.py",
     "progress = (update - 1 - warmup) / (num_updates - warmup)",
     "progress = (update - warmup) / (num_updates - warmup)"),
    # ----- metrics (plumbing/)
    ("global std without the mean", "plumbing/distributed.py",
     "var = (total_sq - count * mean * mean) / (count - 1).clamp(min=1)", "var = total_sq / (count - 1).clamp(min=1)"),
]


def check_snippets(mutants: list) -> list[str]:
    """The mutants whose snippet does not occur exactly once in the working tree."""
    stale = []
    for name, path, snippet, _ in mutants:
        count = (REPO / path).read_text().count(snippet)
        if count != 1:
            stale.append(f"mutant {name!r}: its snippet occurs {count} times in {path} (must be once): {snippet!r}")
    oracles = (REPO / "tests" / "test_oracles.py").read_text()
    stale += [f"{test} is left out of each mutant's tests but no longer exists" for test in DESELECT
              if f"def {test.split('::')[1]}(" not in oracles]
    return stale


def copy_repo(dest: Path) -> None:
    """The files the tests need: the top-level modules, tests/ and benchmark/ (no caches, virtual environments)."""
    dest.mkdir(parents=True)
    ignore = shutil.ignore_patterns(".venv*", "__pycache__", ".git", "runs", ".cache", "results", "*.png")
    for item in REPO.iterdir():
        if item.name.startswith(".") or item.name in ("runs",):
            continue
        if item.is_dir():
            shutil.copytree(item, dest / item.name, ignore=ignore)
        else:
            shutil.copy2(item, dest / item.name)


def run_tests(root: Path, tests: list[str], env: dict | None = None) -> tuple[bool, float, str]:
    """(killed, seconds, the last lines of pytest's output)."""
    env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
           "PYTHONDONTWRITEBYTECODE": "1", **(env or {})}
    start = time.perf_counter()
    with subprocess.Popen([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests,
                           *(f"--deselect={test}" for test in DESELECT)], cwd=root, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, start_new_session=True) as process:
        RUNNING.add(process)
        try:
            output, _ = process.communicate(timeout=HANG_GUARD_S)
        except subprocess.TimeoutExpired:
            stop(process)
            return True, time.perf_counter() - start, f"hung past {HANG_GUARD_S} s"
        finally:
            RUNNING.discard(process)
    return process.returncode != 0, time.perf_counter() - start, output.strip()


RUNNING: set = set()  # the pytest processes running now: stopped with their children when this script is stopped
TEMPORARY: list = []  # the copies of the repository: removed then too


def stop(process: subprocess.Popen) -> None:
    """A pytest process and whatever it started (its own session)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def stop_all_and_exit(signum, frame) -> None:
    for process in list(RUNNING):
        stop(process)
    for folder in TEMPORARY:
        shutil.rmtree(folder, ignore_errors=True)
    os._exit(128 + signum)  # the worker threads too


# ---------------------------------------------------------------- the line tracer, as a pytest plugin (-p mutation)
COVERAGE_OUT = "MUTATION_COVERAGE_OUT"  # where the plugin writes {test: [[file, line], ...]}; unset: the plugin idles
OUTSIDE_TESTS = "<outside any test>"  # lines run at import or collection: every test counts as executing them


class _LineTracer:
    """Which test executes which line of the files mutants change (sys.settrace: 3.11 has no sys.monitoring)."""

    def __init__(self, root: Path):
        paths = {path for _, path, _, _ in MUTANTS}
        self.files = {str(root / path) for path in paths} | {os.path.realpath(root / path) for path in paths}
        self.lines: dict[str, set] = {}
        self.current = OUTSIDE_TESTS

    def _global(self, frame, event, arg):
        return self._local if frame.f_code.co_filename in self.files else None

    def _local(self, frame, event, arg):
        if event == "line":
            self.lines.setdefault(self.current, set()).add((frame.f_code.co_filename, frame.f_lineno))
        return self._local


_TRACER: _LineTracer | None = None


def pytest_configure(config):
    global _TRACER
    if os.environ.get(COVERAGE_OUT):
        _TRACER = _LineTracer(Path(str(config.rootpath)))
        sys.settrace(_TRACER._global)
        threading.settrace(_TRACER._global)


def pytest_runtest_protocol(item, nextitem):
    if _TRACER is not None:
        _TRACER.current = item.nodeid
    # None: pytest's own protocol runs the test


def pytest_runtest_logfinish(nodeid, location):
    if _TRACER is not None:
        _TRACER.current = OUTSIDE_TESTS


def pytest_unconfigure(config):
    if _TRACER is not None:
        sys.settrace(None)
        threading.settrace(None)
        roots = (str(config.rootpath) + os.sep, os.path.realpath(config.rootpath) + os.sep)
        Path(os.environ[COVERAGE_OUT]).write_text(json.dumps(
            {test: sorted([path.removeprefix(roots[0]).removeprefix(roots[1]), line] for path, line in lines)
             for test, lines in _TRACER.lines.items()}))


def covering_tests(coverage: dict[str, list], path: str, lines: range) -> list[str] | None:
    """The tests that execute one of LINES of PATH, in the order they ran; None: lines run outside tests (all)."""
    def executes(test):
        return any(p == path and line in lines for p, line in coverage[test])
    if OUTSIDE_TESTS in coverage and executes(OUTSIDE_TESTS):
        return None
    return [test for test in coverage if test != OUTSIDE_TESTS and executes(test)]


def snippet_lines(text: str, snippet: str) -> range:
    """The 1-based line numbers the snippet spans in TEXT (its leading and trailing newlines not counted)."""
    at = text.index(snippet) + (len(snippet) - len(snippet.lstrip("\n")))
    first = text.count("\n", 0, at) + 1
    return range(first, first + snippet.strip("\n").count("\n") + 1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-k", action="append", default=[], help="only the mutants whose name contains this "
                        "(repeatable: any of them)")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--workers", type=int, default=min(os.cpu_count() or 1, 4),
                        help="mutants tested at once, each in its own copy of the repository (default: one per "
                        "core, up to 4)")
    parser.add_argument("--all_tests", action="store_true", help="every fast test for each mutant, not only those "
                        "executing its lines (no tracing run)")
    options = parser.parse_args()
    if options.workers < 1:
        parser.error(f"--workers {options.workers}: must be at least 1")
    stale = check_snippets(MUTANTS)
    if stale:
        print("\n".join(stale) + "\nupdate tests/mutation.py's MUTANTS to the code", file=sys.stderr)
        return 2
    mutants = [m for m in MUTANTS if not options.k or any(part in m[0] for part in options.k)]
    if options.list:
        for name, path, _, _ in mutants:
            print(f"{path}: {name}")
        return 0
    survivors, start = [], time.perf_counter()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop_all_and_exit)
    workers = max(1, min(options.workers, len(mutants)))
    # each pytest process its share of the cores: OpenMP threads of several processes on one core only wait
    threads = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers)))}
    with tempfile.TemporaryDirectory(prefix="rloo-mutants-") as tmp:
        TEMPORARY.append(tmp)
        roots = [Path(tmp) / f"repo{i}" for i in range(workers)]
        for root in roots:
            copy_repo(root)
        tests = [t for t in TESTS if (roots[0] / t.split("::")[0]).exists()]
        coverage_path = Path(tmp) / "coverage.json"
        trace = {} if options.all_tests else {COVERAGE_OUT: str(coverage_path), "PYTHONPATH": str(roots[0] / "tests"),
                                              "PYTEST_ADDOPTS": "-p mutation"}
        killed, seconds, output = run_tests(roots[0], tests, {**threads, **trace})
        if killed:  # the unmutated code must pass, or every mutant would count as killed
            print(f"the tests fail on the unmutated code:\n{output[-3000:]}", file=sys.stderr)
            return 2
        coverage = None if options.all_tests else json.loads(coverage_path.read_text())
        print(f"unmutated: tests pass in {seconds:.0f} s{'' if coverage is None else ' (traced)'}; {len(mutants)} "
              f"mutants, {workers} at a time", flush=True)

        free: queue.Queue[Path] = queue.Queue()
        for root in roots:
            free.put(root)

        def attempt(mutant) -> tuple[bool, float, str, int]:
            """(killed, seconds, the first failure line, how many tests ran)."""
            name, path, snippet, replacement = mutant
            root = free.get()
            original = (root / path).read_text()
            selected = tests if coverage is None else covering_tests(coverage, path,
                                                                     snippet_lines(original, snippet))
            (root / path).write_text(original.replace(snippet, replacement))
            try:
                # a mutant's few tests: no server of forked interpreters (its imports would cost more than it saves)
                killed, seconds, output = (False, 0.0, "") if selected == [] else \
                    run_tests(root, tests if selected is None else selected,
                              {**threads, "TESTS_FORK": "0"} if selected is not None else threads)
                if not killed and selected is not None and selected != tests:  # never a survivor by selection
                    killed, more, output = run_tests(root, tests, threads)
                    seconds += more
            finally:
                (root / path).write_text(original)
                free.put(root)
            failed = next((line for line in output.splitlines() if line.startswith(("FAILED", "ERROR"))), "")
            return killed, seconds, failed, len(tests if selected is None else selected)

        with ThreadPoolExecutor(workers) as pool:
            futures = {pool.submit(attempt, mutant): mutant for mutant in mutants}
            for i, future in enumerate(as_completed(futures), 1):
                (name, path, _, _), (killed, seconds, failed, ran) = futures[future], future.result()
                print(f"[{i}/{len(mutants)}] {'killed  ' if killed else 'SURVIVED'} {seconds:5.0f} s {ran:3d} tests"
                      f"  {name}{'  (' + failed[:100] + ')' if failed else ''}", flush=True)
                if not killed:
                    survivors.append(f"{path}: {name}")
    total = len(mutants)
    print(f"\nmutation score: {total - len(survivors)}/{total} killed in {time.perf_counter() - start:.0f} s")
    for survivor in survivors:
        print(f"  survived: {survivor}")
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
