"""Every input behind one boundary: generated malformed inputs of each kind (data files, reward values, flags) end in
one line naming the input, or succeed, never in another exception; and the named cases end to end."""

import contextlib
import decimal
import fractions
import gc
import io
import json
import math
import os
import random
import signal
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import plan_memory
import plumbing
import rloo
from conftest import (REPO, policy_tokenizer, run_rloo, script_command, script_env, tiny_policy, tiny_reward_model)
from helpers import python

PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def assert_one_line(error: BaseException, *names: str) -> None:
    """A ConfigError / RewardFunctionError: one line naming the input."""
    message = str(error)
    assert message and "\n" not in message and "\r" not in message, repr(message)
    assert any(name in message for name in names), (names, message)


# ---------------------------------------------------------------- the data loader
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=20))
JSON_VALUES = st.recursive(JSON_SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(["role", "content", "prompt", "x"]), inner,
                                                 max_size=3)), max_leaves=8)
ROWS = st.lists(st.one_of(st.fixed_dictionaries({"prompt": JSON_VALUES}), JSON_VALUES), min_size=0, max_size=6)
ENCODINGS = st.sampled_from(["utf-8", "utf-8-sig", "utf-16", "utf-32", "latin-1", "cp1252"])


@pytest.fixture(scope="module")
def chat_tokenizer():
    tokenizer = policy_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def load_and_tokenize(path: Path, tokenizer) -> None:
    """What rloo.main does with --dataset_name path: load the file, tokenize and filter its prompts."""
    dataset = plumbing.load_split(str(path), "train", None)
    plumbing.prepare_prompts(dataset, tokenizer, "prompt", 16, str(path), len(tokenizer), plumbing.prompt_token_ids)


def loads_or_says_one_line(path: Path, tokenizer) -> None:
    try:
        load_and_tokenize(path, tokenizer)
    except plumbing.ConfigError as e:
        assert_one_line(e, path.name, "chat template")


@PROPERTY
@given(content=st.one_of(
    st.binary(max_size=200),  # any bytes
    st.tuples(ROWS, ENCODINGS).map(lambda r: "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in r[0])
                                   .encode(r[1], errors="replace")),  # JSON lines, in any encoding
    st.tuples(st.text(max_size=40), ENCODINGS).map(lambda t: t[0].encode(t[1], errors="replace"))),
    suffix=st.sampled_from([".jsonl", ".json"]))
def test_a_json_file_of_any_bytes_loads_or_is_one_line(chat_tokenizer, content, suffix):
    with tempfile.TemporaryDirectory() as root:
        path = Path(root) / f"data{suffix}"
        path.write_bytes(content)
        loads_or_says_one_line(path, chat_tokenizer)


PARQUET_COLUMNS = st.one_of(
    st.lists(st.one_of(st.none(), st.text(max_size=20)), min_size=1, max_size=5),
    st.lists(st.integers(-2**63, 2**63 - 1), min_size=1, max_size=5),
    st.lists(st.binary(max_size=10), min_size=1, max_size=5),
    st.lists(st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": st.text(max_size=10)}), max_size=3),
             min_size=1, max_size=5),
    st.lists(st.lists(st.integers(-5, 40), max_size=5), min_size=1, max_size=5),
    st.lists(st.dictionaries(st.sampled_from(["a", "b"]), st.integers(0, 3), min_size=1), min_size=1, max_size=5),
)


@PROPERTY
@given(column=PARQUET_COLUMNS, name=st.sampled_from(["prompt", "query_token", "question"]))
def test_a_parquet_file_of_any_schema_loads_or_is_one_line(chat_tokenizer, column, name):
    with tempfile.TemporaryDirectory() as root:
        path = Path(root) / "data.parquet"
        try:
            table = pa.table({name: column})
        except (pa.ArrowInvalid, pa.ArrowTypeError):  # not a column pyarrow can write
            return
        pq.write_table(table, path)
        loads_or_says_one_line(path, chat_tokenizer)


@pytest.mark.parametrize("content,fragments", [
    ('{"prompt": "caf\xe9 a :"}\n'.encode("latin-1"), ["line 1 is not UTF-8 text", "re-encode it as UTF-8"]),
    ('{"prompt": "a :"}\n{"prompt": "\xe9"}\n'.encode("cp1252"), ["line 2 is not UTF-8 text"]),
    ('{"prompt": "a b :"}\n'.encode("utf-16"), ["line 1 is not UTF-8 text (byte b'\\xff')"]),
    (b'{"prompt": "a \xff :"}\n', ["line 1 is not UTF-8 text"]),
])
@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_bytes_that_are_not_utf8_are_one_line_naming_the_line(tmp_path, content, fragments, suffix):
    path = tmp_path / f"data{suffix}"
    path.write_bytes(content)
    with pytest.raises(plumbing.ConfigError) as error:
        load_and_tokenize(path, policy_tokenizer())
    assert_one_line(error.value, path.name)
    for fragment in fragments:
        assert fragment in str(error.value)


LINES = '{"prompt": "a b :"}\n{"prompt": "c :"}\n'


@pytest.mark.parametrize("suffix,text", [(".jsonl", LINES), (".json", LINES),
                                         (".json", '[{"prompt": "a b :"}, {"prompt": "c :"}]')])
def test_a_utf8_file_with_a_byte_order_mark_loads_as_without_it(tmp_path, suffix, text):
    """Windows editors write UTF-8 with a byte-order mark: the same prompts as without it, none refused."""
    for name, encoding in (("bom", "utf-8-sig"), ("plain", "utf-8")):
        (tmp_path / f"{name}{suffix}").write_bytes(text.encode(encoding))
    rows = [plumbing.load_split(str(tmp_path / f"{name}{suffix}"), "train", None)["prompt"]
            for name in ("bom", "plain")]
    assert rows[0] == rows[1] == ["a b :", "c :"]
    load_and_tokenize(tmp_path / f"bom{suffix}", policy_tokenizer())


def test_a_chat_template_that_raises_is_one_line_naming_it(tmp_path):
    tokenizer = policy_tokenizer()
    tokenizer.chat_template = "{{ raise_exception('system messages are not supported') }}"
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"prompt": [{"role": "user", "content": "a b"}]}) + "\n")
    with pytest.raises(plumbing.ConfigError) as error:
        load_and_tokenize(path, tokenizer)
    assert_one_line(error.value, "the tokenizer's chat template")
    assert "system messages are not supported" in str(error.value) and "fix the template" in str(error.value)


# ---------------------------------------------------------------- the reward-value check
N = 3
NUMBER_LIKE = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-10**400, max_value=10**400),
    st.floats(allow_nan=True, allow_infinity=True), st.decimals(allow_nan=True), st.fractions(),
    st.complex_numbers(max_magnitude=10), st.text(max_size=5), st.binary(max_size=5),
    st.integers(0, 2**64 - 1).map(np.uint64), st.integers(-2**63, 2**63 - 1).map(np.int64),
    st.floats(width=16).map(np.float16), st.floats().map(np.float64), st.floats().map(torch.tensor),
    st.integers(-2**63, 2**63 - 1).map(torch.tensor), st.lists(st.floats(), max_size=2).map(torch.tensor),
    st.floats().map(lambda x: np.array(x)), st.builds(object),
)
VALUES = st.recursive(NUMBER_LIKE, lambda inner: st.lists(inner, max_size=3), max_leaves=6)
RETURNED = st.one_of(
    st.lists(VALUES, min_size=N, max_size=N), st.lists(VALUES, max_size=N + 2), VALUES,
    st.lists(st.floats(), min_size=N, max_size=N).map(tuple),
    st.lists(st.floats(), min_size=N, max_size=N).map(np.array),
    st.lists(st.floats(), min_size=0, max_size=N + 1).map(torch.tensor),
    st.lists(st.floats(), min_size=N, max_size=N).map(lambda v: torch.tensor(v).reshape(N, 1)),
    st.lists(st.floats(), min_size=N, max_size=N).map(lambda v: (x for x in v)),  # a generator
    st.dictionaries(st.text(max_size=3), VALUES, max_size=3),
)


@PROPERTY
@given(returned=RETURNED)
def test_any_reward_return_value_is_n_finite_float32s_or_one_line(returned):
    try:
        values, applies = plumbing.call_reward_function("judge", lambda **kwargs: returned, N, None, completions=[""])
    except plumbing.RewardFunctionError as e:
        assert_one_line(e, "reward function 'judge'")
        return
    assert values.shape == applies.shape == (N,) and values.dtype == torch.float32
    assert torch.isfinite(values).all()


class Unreadable(float):
    def __float__(self):
        raise ArithmeticError("no float of me")


@pytest.mark.parametrize("returned,fragment", [
    ([10**400, 1.0, 1.0], "returned an int of 1329 bits for completion 0"),
    ([np.uint64(2**64 - 1), 1.0, 10**39], "returned an int of 130 bits for completion 2"),
    ([decimal.Decimal(1), 1.0, 1.0], "(Decimal) among its values"),
    (["1.0", 1.0, 1.0], "'1.0' (str)"),
    ([[1.0], 1.0, 1.0], "[1.0] (list)"),
    (torch.ones(N + 1), "returned 4 values for 3 completions"),
    (torch.ones(N, 1), "(Tensor) among its values"),
    ((x for x in [1.0, 1.0, 1.0]), "not a list of 3 numbers"),
    ([Unreadable(1.0), 1.0, 1.0], "cannot be read as numbers (ArithmeticError: no float of me)"),
])
def test_reward_values_that_are_no_float32_are_one_line(returned, fragment):
    with pytest.raises(plumbing.RewardFunctionError) as error:
        plumbing.call_reward_function("judge", lambda **kwargs: returned, N, None)
    assert_one_line(error.value, "reward function 'judge'")
    assert fragment in str(error.value)


def test_bools_and_exact_numbers_of_any_kind_are_rewards():
    values, applies = plumbing.call_reward_function(
        "judge", lambda **kwargs: [True, fractions.Fraction(1, 2), np.int64(-3)], N, None)
    assert values.tolist() == [1.0, 0.5, -3.0] and applies.all()


SETTINGS_CHANGED = {  # what a reward function leaves changed: the start of the line that names it
    "the working directory": (lambda tmp_path: os.chdir(tmp_path), "changed the working directory ("),
    "torch's default dtype": (lambda _: torch.set_default_dtype(torch.float64),
                              "changed torch's default dtype (torch.float32 -> torch.float64)"),
    "torch's float32 matmul precision": (lambda _: torch.set_float32_matmul_precision("medium"),
                                         "changed torch's float32 matmul precision ('highest' -> 'medium')"),
    "torch's deterministic algorithms": (lambda _: torch.use_deterministic_algorithms(True),
                                         "changed torch's deterministic algorithms ((False, False) -> (True, False))"),
    "torch's anomaly detection": (lambda _: torch.set_anomaly_enabled(True), "changed torch's anomaly detection"),
    "cuDNN's flags": (lambda _: setattr(torch.backends.cudnn, "benchmark", True), "changed cuDNN's flags"),
    "torch's attention kernels": (lambda _: torch.backends.cuda.enable_math_sdp(False),
                                  "changed torch's attention kernels ((True, True, True, True) -> (True, True, False, "
                                  "True))"),
    "sys.stdout": (lambda _: setattr(sys, "stdout", io.StringIO()), "changed sys.stdout"),
    "the umask": (lambda _: os.umask(0), "changed the umask ('0o22' -> '0o0')"),
    "two of them": (lambda _: (os.umask(0), torch.set_default_dtype(torch.float16)),
                    "changed torch's default dtype (torch.float32 -> torch.float16) (and the umask)"),
}


SETTINGS_AT_START = {"the umask": "0o22", "torch's default dtype": torch.float32,
                     "torch's float32 matmul precision": "highest", "torch's deterministic algorithms": (False, False),
                     "torch's attention kernels": (True, True, True, True)}


@pytest.mark.parametrize("setting", SETTINGS_CHANGED, ids=list(SETTINGS_CHANGED))
def test_a_reward_function_that_leaves_a_setting_of_the_run_changed_is_a_fault(tmp_path, setting):
    """The run's settings are put back whatever the function did, and a change is one line naming it: putting it back
    silently would change what the function's next calls compute."""
    change, fragment = SETTINGS_CHANGED[setting]
    before = {name: read() for name, (read, _, _) in plumbing.RUN_SETTINGS.items()}
    for name, value in SETTINGS_AT_START.items():  # the values the fragments name, whatever tests ran before
        plumbing.RUN_SETTINGS[name][1](value)
    try:
        start = {name: read() for name, (read, _, _) in plumbing.RUN_SETTINGS.items()}
        with pytest.raises(plumbing.RewardFunctionError) as error:
            plumbing.call_reward_function("judge", lambda **kwargs: change(tmp_path) or [1.0] * N, N, None)
        assert_one_line(error.value, "reward function 'judge' " + fragment)
        assert {name: read() for name, (read, _, _) in plumbing.RUN_SETTINGS.items()} == start
    finally:
        for name in SETTINGS_AT_START:
            plumbing.RUN_SETTINGS[name][1](before[name])


def test_a_reward_function_draws_from_a_copy_of_the_runs_torch_generators_and_changes_no_speed_setting():
    """torch's random generators are the run's (its minibatch order): a function's draws and seeds never move them,
    and a call draws from where the run is. Python's and numpy's, which the run does not draw from, are the
    function's own. Thread count, garbage collector and recursion limit are put back, without a word."""
    def draws(**kwargs):
        torch.manual_seed(0)
        torch.set_num_threads(torch.get_num_threads() + 1)  # another count than the run's, whatever that is
        gc.disable()
        sys.setrecursionlimit(50_000)
        return [torch.rand(()).item(), random.random(), 0.0]

    torch.manual_seed(1)
    run_state, threads, limit = torch.get_rng_state(), torch.get_num_threads(), sys.getrecursionlimit()
    python_state = random.getstate()
    plumbing.call_reward_function("judge", draws, N, None)
    assert torch.equal(torch.get_rng_state(), run_state) and torch.get_num_threads() == threads
    assert gc.isenabled() and sys.getrecursionlimit() == limit
    assert random.getstate() != python_state  # went on from the function's draw: its own
    with pytest.raises(plumbing.RewardFunctionError, match="'judge' raised ValueError: signal only works in main"):
        plumbing.call_reward_function("judge", lambda **kwargs: signal.signal(signal.SIGTERM, signal.SIG_IGN), N, None)


EXIT_REFUSED = """import os, sys
from pathlib import Path
import plumbing
sys.path.insert(0, sys.argv[1])
Path(sys.argv[1], "exits_at_import.py").write_text("import os\\nos._exit(0)\\n")
try:
    plumbing.load_reward_functions(("exits_at_import:f",))
except plumbing.ConfigError as e:
    print(e)
try:
    plumbing.call_reward_function("judge", lambda **kwargs: os._exit(0), 1)
except plumbing.RewardFunctionError as e:
    print(e)
sys.exit(7)  # reached: neither os._exit ended the process
"""


def test_os_exit_in_a_reward_module_or_function_is_a_failure_not_the_end_of_the_run(tmp_path):
    """os._exit would end the run at once with the status it names (0 included): refused while user code runs, in
    a process of its own (were it not, it would end this one)."""
    result = subprocess.run([python(), "-c", EXIT_REFUSED, str(tmp_path)], capture_output=True, text=True,
                            env=script_env(), cwd=REPO, timeout=300)
    assert result.returncode == 7, result.stderr[-3000:]
    assert result.stdout.splitlines() == [
        "reward function 'exits_at_import:f': importing 'exits_at_import' failed with ExitRefused: os._exit(0)",
        "reward function 'judge' called os._exit(0), which would end the run at once, nothing saved: return its "
        "values, or raise"]


@pytest.mark.parametrize("module,change,fragment", [
    ("float64_judge", "import torch\ntorch.set_default_dtype(torch.float64)",
     "changed torch's default dtype (torch.float32 -> torch.float64)"),
    ("own_sigterm", "import signal\nsignal.signal(signal.SIGTERM, lambda *args: None)",
     "changed the SIGTERM handler (StopSignal._record -> <lambda>)"),
])
def test_a_reward_module_that_changes_a_setting_of_the_run_at_import_is_refused(tmp_path, monkeypatch, module, change,
                                                                                fragment):
    (tmp_path / f"{module}.py").write_text(f"{change}\ndef f(completions, **kwargs):\n    return [0.0]\n")
    monkeypatch.syspath_prepend(tmp_path)
    plumbing.StopSignal(plumbing.OutputDirLock(str(tmp_path)), announce=False)  # the run's handlers, as main sets them
    before = {name: read() for name, (read, _, _) in plumbing.RUN_SETTINGS.items()}
    with pytest.raises(plumbing.ConfigError) as error:
        plumbing.load_reward_functions((f"{module}:f",))
    assert_one_line(error.value, f"reward function '{module}:f': importing '{module}' {fragment} and did not set it "
                                 "back")
    assert {name: read() for name, (read, _, _) in plumbing.RUN_SETTINGS.items()} == before


def test_a_ctrl_c_while_a_reward_function_runs_is_the_runs_not_a_change_the_function_made(tmp_path):
    """The run's first SIGINT gives its handler back to the default (the second exits at once): landing while user
    code runs (here as its values are checked, after the thread that ran it), it is the run's stop, not a change
    blamed on the code; the code's own changes still are."""
    stop = plumbing.StopSignal(plumbing.OutputDirLock(str(tmp_path)), announce=False)
    stop.training = True
    with plumbing.user_code("reward function 'judge'", plumbing.RewardFunctionError):
        os.kill(os.getpid(), signal.SIGINT)
    assert stop.name == "SIGINT" and signal.getsignal(signal.SIGINT) is signal.SIG_DFL
    for sig, handler in ((signal.SIGTERM, signal.SIG_DFL), (signal.SIGINT, lambda *_: None)):
        with pytest.raises(plumbing.RewardFunctionError, match=f"changed the {sig.name} handler"):
            with plumbing.user_code("reward function 'judge'", plumbing.RewardFunctionError):
                signal.signal(sig, handler)


# ---------------------------------------------------------------- the flags
NUMERIC_FLAGS = ["learning_rate", "rloo_k", "kl_coef", "temperature", "cliprange", "num_train_epochs", "total_episodes",
                 "per_device_train_batch_size", "response_length", "max_prompt_length", "seed", "save_total_limit",
                 "reward_fn_timeout", "ddp_timeout", "reward_weights", "lora_r", "num_mini_batches",
                 "missing_eos_penalty", "stop_token_id", "local_rollout_forward_batch_size", "num_ppo_epochs",
                 "gradient_accumulation_steps", "eval_max_prompts", "fsdp_generation", "num_generations", "beta"]
FLAG_VALUES = st.one_of(
    st.integers(min_value=-10**30, max_value=10**30).map(str), st.floats().map(repr),
    st.sampled_from(["nan", "-nan", "inf", "-inf", "1e3", "1e-400", "1e400", "-0", "0x10", "1_000", "", " ", "None",
                     "none", "True", "½", "٣", "1,5", "\x00", "per_block"]),
    st.text(max_size=10)).filter(lambda v: not v.startswith("-") or v[1:2].isdigit() or v in ("-nan", "-inf", "-0"))
VALID = ["--model_name_or_path", "m", "--reward_fn", "reward_fns:count_a", "--output_dir", "out"]


def parse_and_check(argv: list[str], cls=rloo.Args, prog: str = "rloo.py"):
    """parse_args, then the checks main makes before anything loads; (the exit status, stderr) of a refusal, or
    (None, args)."""
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            args = plumbing.parse_args(cls, argv, prog=prog)
    except SystemExit as e:
        return e.code, stderr.getvalue()
    try:
        plumbing.validate_args(args)
        rloo.compute_batch_sizes(args, 1)
    except plumbing.ConfigError as e:
        return 2, f"{prog}: error: {e}\n"
    return None, args


@settings(PROPERTY, max_examples=25)  # a parse builds tyro's parser: ~1 s
@given(flags=st.lists(st.tuples(st.sampled_from(NUMERIC_FLAGS), FLAG_VALUES), min_size=1, max_size=3),
       equals=st.booleans())
def test_any_flag_value_parses_or_is_one_line_exit_2(flags, equals):
    argv = [*VALID, *(s for flag, value in flags for s in ([f"--{flag}={value}"] if equals else [f"--{flag}", value]))]
    status, said = parse_and_check(argv)
    if status is None:
        return
    assert status == 2, said
    lines = said.splitlines()
    assert len(lines) == 1 and lines[0].startswith("rloo.py: error: "), said


@pytest.mark.parametrize("argv,line", [
    (["--rloo_kk", "4"], "rloo.py: error: unrecognized argument '--rloo_kk': did you mean --rloo_k?"),
    (["--learning-rat", "1e-5"], "did you mean --learning_rate?"),
    (["--rloo_k", "1e3"], "rloo.py: error: --rloo_k: invalid literal for int() with base 10: '1e3'; see --help"),
    (["--learning_rate"], "rloo.py: error: --learning_rate needs a value; see --help"),
    (["--fsdp_generation", "all"], "rloo.py: error: --fsdp_generation 'all' is not one of unshard, per_block"),
    (["--learning_rate=-0"], None),  # -0.0: a learning rate of 0 is allowed
])
def test_parse_errors_are_one_line_naming_the_flag(argv, line):
    status, said = parse_and_check([*VALID, *argv])
    if line is None:
        assert status is None, said
        return
    assert status == 2 and said.count("\n") == 1 and line in said, said


@pytest.mark.parametrize("script", ["rloo.py", "rloo_multinode.py", "plan_memory.py"])
def test_every_script_says_a_parse_error_in_one_line(script):
    result = subprocess.run(script_command(script, "--rloo-kk", "4"), capture_output=True, text=True,
                            env=script_env(), cwd=REPO, timeout=120)
    assert result.returncode == 2 and result.stdout == "", result.stderr
    assert result.stderr == f"{script}: error: unrecognized argument '--rloo-kk': did you mean --rloo_k?\n"


@pytest.mark.parametrize("flags,line", [
    (["--world_size", "0"], "world_size = 0 must be at least 1"),
    (["--world_size", "-3"], "world_size = -3 must be at least 1"),
    (["--gpu_gib", "-5"], "gpu_gib = -5.0 must be a finite number of GiB > 0"),
    (["--gpu_gib", "nan"], "gpu_gib = nan must be"),
    (["--gpu_gib", "inf"], "gpu_gib = inf must be"),
    (["--gpu_gib", "0"], "gpu_gib = 0.0 must be"),
    (["--max_prompt_length", "-1"], "max_prompt_length = -1 must be at least 1"),
])
def test_plan_memory_refuses_numbers_without_meaning_in_one_line(flags, line, capsys):
    argv = ["--model_name_or_path", "unused", "--reward_fn", "a:b", *flags]
    with pytest.raises(SystemExit) as status:
        plumbing.run_script(plan_memory.main, plumbing.parse_args(plan_memory.PlanArgs, argv, prog="plan_memory.py"),
                            "plan_memory.py")
    captured = capsys.readouterr()
    assert status.value.code == 2 and captured.out == "", captured.out
    assert captured.err.startswith("plan_memory.py: error: ") and line in captured.err, captured.err
    assert captured.err.count("\n") == 1, captured.err


# ---------------------------------------------------------------- models
def test_a_reward_model_without_its_score_head_is_refused(tmp_path):
    tokenizer = policy_tokenizer()
    path = tmp_path / "headless"
    model = tiny_reward_model(len(tokenizer))
    model.save_pretrained(path)
    from safetensors.torch import load_file, save_file
    weights = load_file(path / "model.safetensors")
    save_file({k: v for k, v in weights.items() if not k.startswith("score.")}, path / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(plumbing.ConfigError) as error:
        plumbing.load_reward_model(str(path), torch.float32, False)
    assert_one_line(error.value, str(path))
    assert "score.weight" in str(error.value) and "newly initialized" in str(error.value)


def test_a_causal_lm_as_reward_model_is_refused_from_its_config(tmp_path):
    path = tmp_path / "policy"
    tiny_policy(15).save_pretrained(path)
    with pytest.raises(plumbing.ConfigError, match="is a GPTNeoXForCausalLM, not a reward model: its score head would "
                                                   "be newly initialized"):
        plumbing.check_reward_model_config(str(path), False)


def test_a_policy_without_its_lm_head_is_refused(tmp_path):
    path = tmp_path / "reward_model"
    tiny_reward_model(15).save_pretrained(path)
    with pytest.raises(plumbing.ConfigError) as error:
        plumbing.load_causal_lm(str(path), torch.float32, False)
    assert_one_line(error.value, str(path))
    assert "(lm_head.weight): they would be newly initialized" in str(error.value)


@pytest.mark.parametrize("corruption", ["{not json", "", '{"model": {"type": "Nope"}}', "\xff\xfe"])
def test_a_corrupt_tokenizer_file_is_one_line(tmp_path, corruption):
    path = tmp_path / "tok"
    policy_tokenizer().save_pretrained(path)
    (path / "tokenizer.json").write_bytes(corruption.encode("latin-1"))
    with pytest.raises(plumbing.ConfigError) as error:
        plumbing.load_tokenizer(str(path), False)
    assert_one_line(error.value, str(path))


def test_merged_lora_weights_are_as_readable_as_the_other_files(tmp_path):
    from peft import LoraConfig, get_peft_model

    tokenizer, out = policy_tokenizer(), tmp_path / "out"
    base = tmp_path / "base"
    tiny_policy(len(tokenizer)).save_pretrained(base)
    get_peft_model(tiny_policy(len(tokenizer)), LoraConfig(r=2, target_modules=["query_key_value"])).save_pretrained(out)
    args = rloo.Args(model_name_or_path=str(base), output_dir=str(out), use_peft=True, merge_lora=True)
    plumbing.save_merged_policy(args, tiny_policy(len(tokenizer)).config, tokenizer)
    merged = out / plumbing.MERGED
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in merged.iterdir()}
    assert modes["model.safetensors"] == modes["config.json"], modes


# ---------------------------------------------------------------- end to end: exit status and the one line
def test_a_reward_function_returning_an_int_beyond_any_float_stops_in_one_line(assets, tmp_path):
    result = run_rloo("--model_name_or_path", assets["policy"], "--dataset_name", assets["train"], "--output_dir",
                      tmp_path / "out", "--reward_fn", "reward_fns:huge_int", "--max_prompt_length", "16",
                      "--response_length", "4", "--total_episodes", "16", "--num_sample_generations", "0")
    assert result.returncode == 4 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1].startswith(
        "rloo.py: error: reward function 'huge_int' returned an int of 1329 bits for completion 0")


def test_a_keyboard_interrupt_while_a_reward_module_imports_is_one_line_and_exit_130(assets, tmp_path):
    """What Ctrl-C gives inside a reward module's slow import (a model it loads), raised by the module itself."""
    (tmp_path / "interrupted_reward.py").write_text("raise KeyboardInterrupt\n")
    result = run_rloo("--model_name_or_path", assets["policy"], "--dataset_name", assets["train"], "--output_dir",
                      tmp_path / "out", "--reward_fn", "interrupted_reward:score", "--max_prompt_length", "16",
                      "--response_length", "4", "--total_episodes", "16", env={"PYTHONPATH": str(tmp_path)})
    assert result.returncode == 130 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1].startswith("rloo.py: SIGINT received while starting: stopped")
    assert not (tmp_path / "out" / "checkpoints").exists()


def test_ctrl_c_while_torch_imports_is_one_line_and_exit_130(tmp_path):
    """A stand-in `torch` first on the path says it is being imported, then waits: the signal lands inside the
    imports, whatever the machine's speed."""
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("print('importing torch', flush=True)\nimport time\n"
                                                    "time.sleep(600)\n")
    for script in ("rloo.py", "plan_memory.py", "rloo_multinode.py"):
        process = subprocess.Popen(script_command(script, "--help"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True, env=script_env({"PYTHONPATH": str(tmp_path)}), cwd=REPO)
        try:
            assert process.stdout.readline() == "importing torch\n"
            process.send_signal(signal.SIGINT)
            stdout, stderr = process.communicate(timeout=60)
        finally:
            process.kill()
        assert process.returncode == 130, stderr
        assert stderr == f"{script}: SIGINT received while starting: stopped, nothing written\n", stderr
    for script in ("rloo.py", "rloo_multinode.py"):  # `2>&1 | tee log`, Ctrl-C reaching tee too: stderr is gone
        process = subprocess.Popen(script_command(script, "--help"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   env=script_env({"PYTHONPATH": str(tmp_path)}), cwd=REPO)
        try:
            assert process.stdout.readline() == b"importing torch\n"
            process.stdout.close()
            process.send_signal(signal.SIGINT)
            assert process.wait(timeout=60) == 130, script
        finally:
            process.kill()


# ---------------------------------------------------------------- the recipe file (--config) as data
def parsed(*argv):
    return plumbing.parse_args(rloo.Args, argv=[str(a) for a in argv], prog="rloo.py")


def config_refusal(capsys, path, *fragments: str) -> str:
    """The one line naming the file that `--config path` is refused with (exit status 2)."""
    with pytest.raises(SystemExit) as exit_info:
        parsed("--config", path)
    error = capsys.readouterr().err
    assert exit_info.value.code == 2 and error.count("\n") == 1 and error.startswith("rloo.py: error: "), error
    assert str(path) in error and all(fragment in error for fragment in fragments), error
    return error


BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{n}: &{n} [{', '.join([f'*{p}'] * 9)}]\n" for p, n in zip("abcdefgh", "bcdefghi"))  # 9^9 values, 444 bytes


@pytest.mark.parametrize("text,fragments", [
    (BOMB, ["more than 10,000 values, aliases expanded"]),  # the 444-byte alias bomb
    ("reward_fn: [&r0 x]\n" + "".join(f"k{i}: &r{i + 1} {{a: [{', '.join([f'*r{i}'] * 4)}], <<: {{b: *r{i}}}}}\n"
                                     for i in range(12)), ["aliases expanded"]),  # mappings, merge keys: 4^12
    ("[" * 50 + "]" * 50 + "\n", ["nesting deeper than 32 levels"]),
    ("[" * 100_000 + "\n", ["nests deeper than 32 levels"]),  # PyYAML's own recursion
    ("seed: " + "9" * 5000 + "\n", ["seed: a number of 5,000 digits"]),
    ("seed: 0x" + "f" * 5000 + "\n", ["seed: a number of"]),
    ("reward_fn: ['--overwrite_output_dir']\n", ["reward_fn: the value '--overwrite_output_dir' would be read as a flag"]),
    ("reward_fn:\n  - mine:f\n  - --resume\n", ["would be read as a flag"]),
    ("exp_name: --overwrite_output_dir\n", ["exp_name: the value"]),  # a scalar too
    ("exp_name: -h\n", ["would be read as a flag"]),
    ("reward_fn: [[a:b], c:d]\n", ["a list of lists or mappings"]),
    ("seed: 2\nseed: 3\n", ["the key 'seed' is given twice"]),
    ("exp_name: !!python/object/apply:os.system [true]\n", ["is not read here"]),
    ("exp_name: !custom x\n", ["the tag !custom is not read here"]),
    ("exp_name: !!binary aGVsbG8=\n", ["is not read here"]),
    ("? [a, b]\n: 1\n", ["a key that is a sequence"]),
    ("\tseed: 3\n", ["is not valid YAML (line 1)", "'\\t'"]),  # a tab before a key
    ("seed: 1\n---\nseed: 2\n", ["is not valid YAML"]),  # two documents
    ("seed: 1\x00\n", ["is not valid YAML"]),  # a NUL byte
    ("output_dir: ~\n", ["output_dir: ~ unquoted is YAML's null: quote it ('~')"]),
    ("sft_model_path: ~\n", ["sft_model_path: ~ unquoted"]),
    ("<<: 3\n", ["a merge key (<<) takes mappings"]),
])
def test_a_recipe_is_read_as_data_within_limits_or_refused_in_one_line(capsys, tmp_path, text, fragments):
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    assert len(BOMB) <= 444
    config_refusal(capsys, path, *fragments)


@pytest.mark.parametrize("text,keys,flag", [
    ("response_length: 5\nmax_completion_length: 6\n", ("response_length", "max_completion_length"), "response_length"),
    ("learning_rate: 1.0e-5\nlearning-rate: 2.0e-5\n", ("learning_rate", "learning-rate"), "learning_rate"),
    ("beta: 0.2\nkl_coef: 0.1\n", ("beta", "kl_coef"), "kl_coef"),  # TRL's name first
    ("num_generations: 4\nrloo-k: 2\n", ("num_generations", "rloo-k"), "rloo_k"),
    ("reward_fn: [a:b]\nreward_funcs: [a.b]\n", ("reward_fn", "reward_funcs"), "reward_fn"),  # TRL's form
    ("report_to: wandb\ntensorboard: true\n", ("report_to", "tensorboard"), "tensorboard"),
    ("resume_from: x\nresume_from_checkpoint: y\n", ("resume_from", "resume_from_checkpoint"), "resume_from"),
    ("num_mini_batches: 2\nsteps_per_generation: 2\n", ("num_mini_batches", "steps_per_generation"),
     "num_mini_batches"),
    ("lora_rank: 8\nr: 16\n", ("lora_rank", "r"), "lora_r"),  # two other codebases' names
    ("vllm_server_host: h\nvllm_server_port: 1\nreward_model_path: null\nreward_model_name_or_path: rm\n"
     "learning_rate: 1.0e-6\nlearning-rate: 2.0e-5\n", ("learning_rate", "learning-rate"), "learning_rate"),  # the
    # server's host and port are one flag's two parts, and a key at null (TRL's "not set") names no value
    ("<<: {learning_rate: 1.0e-5}\nlearning-rate: 2.0e-5\n", ("learning_rate", "learning-rate"), "learning_rate"),
])
def test_a_recipe_naming_one_flag_twice_under_any_of_its_names_is_refused(capsys, tmp_path, text, keys, flag):
    """Which of the two would win is nowhere to be seen in the file: refused, naming both keys, the flag and the
    file (the same key twice is refused by the YAML reader)."""
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    config_refusal(capsys, path, f"the keys {keys[0]!r} and {keys[1]!r} both set --{flag}: keep one")


def test_a_recipe_that_is_no_regular_file_is_refused_at_once(capsys, tmp_path):
    """A FIFO without a writer (opened non-blocking, never waited on), a character device, a directory, a file over
    1 MiB: one line each."""
    fifo = tmp_path / "recipe.yaml"
    os.mkfifo(fifo)
    config_refusal(capsys, fifo, "is a FIFO (named pipe), not a regular file")
    config_refusal(capsys, "/dev/zero", "is a character device, not a regular file")
    config_refusal(capsys, tmp_path, "is a directory, not a regular file")
    big = tmp_path / "big.yaml"
    big.write_text("exp_name: " + "x" * (1 << 20) + "\n")
    config_refusal(capsys, big, "is 1,048,587 bytes, over the limit of 1 MiB for this input")
    link = tmp_path / "link.yaml"  # a symlink to a recipe is read as the recipe
    (tmp_path / "real.yaml").write_text("seed: 5\n")
    link.symlink_to(tmp_path / "real.yaml")
    assert parsed("--config", link).seed == 5


@pytest.mark.parametrize("text,expected", [
    # a str flag keeps its text (YAML 1.1 read 010 as 8, on as True, 1:20 as 80, a date as a date)
    ("exp_name: 010\nrun_name: on\n", {"exp_name": "010", "run_name": "on"}),
    ("exp_name: 1:20\nrun_name: 2024-01-01\n", {"exp_name": "1:20", "run_name": "2024-01-01"}),
    ("exp_name: 1_000\nrun_name: .inf\n", {"exp_name": "1_000", "run_name": ".inf"}),
    ("exp_name: 'yes'\nrun_name: \"0x10\"\n", {"exp_name": "yes", "run_name": "0x10"}),  # quoted: text
    ("exp_name: =\nrun_name: 0o17\n", {"exp_name": "=", "run_name": "0o17"}),
    # a number flag reads YAML 1.2's core schema
    ("seed: 010\n", {"seed": 10}), ("seed: 0x1f\n", {"seed": 31}), ("seed: 0o17\n", {"seed": 15}),
    ("learning_rate: 5e-7\n", {"learning_rate": 5e-7}), ("learning_rate: 1.0e-6\n", {"learning_rate": 1e-6}),
    ("reward_weights: [-1, .5, 0x2]\nreward_fn: [a:b, c:d, e:f]\n", {"reward_weights": (-1.0, 0.5, 2.0)}),
    # YAML's null: TRL's "not set", the default; a quoted ~ is the home directory, as on the command line
    ("output_dir: null\n", {"output_dir": "models/rloo"}), ("output_dir:\n", {"output_dir": "models/rloo"}),
    ("output_dir: none\n", {"output_dir": "models/rloo"}), ("max_steps: ~\n", {"max_steps": None}),
    ("output_dir: '~'\n", {"output_dir": os.path.expanduser("~")}),
    ("output_dir: \"~/runs/a\"\n", {"output_dir": os.path.expanduser("~/runs/a")}),
    # anchors and merge keys, own keys winning; an anchored mapping under a key that is no flag is refused, not read
    ("base: &b {seed: 3}\n", None),
    ("<<: {seed: 3, exp_name: x}\nseed: 4\n", {"seed": 4, "exp_name": "x"}),
    ("<<: [{seed: 3}, {exp_name: '010'}]\n", {"seed": 3, "exp_name": "010"}),
    ("save_strategy: no\nbf16: true\ngradient_checkpointing: False\n",
     {"save_strategy": "no", "bf16": True, "gradient_checkpointing": False}),
])
def test_a_recipes_values_are_read_by_the_flags_type(capsys, tmp_path, text, expected):
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    if expected is None:
        config_refusal(capsys, path, "unknown key 'base'")
        return
    args = parsed("--config", path)
    assert {name: getattr(args, name) for name in expected} == expected


@pytest.mark.parametrize("encoding", ["utf-8-sig", "utf-16", "utf-32", "utf-16-be"])
def test_a_recipe_in_utf_16_or_with_a_bom_is_read_or_named(capsys, tmp_path, encoding):
    path = tmp_path / "recipe.yaml"
    bom = "\ufeff" if encoding == "utf-16-be" else ""  # the others write their own
    path.write_bytes(f"{bom}seed: 7\nexp_name: café\n".encode(encoding))
    args = parsed("--config", path)
    assert (args.seed, args.exp_name) == (7, "café")


def test_the_command_lines_quoted_tilde_is_the_home_directory():
    """`--output_dir '~'` (the shell left the ~) is the home directory, as the README says, not TRL's None; `None`
    and `null` are TRL's "not set": the default."""
    assert parsed("--output_dir", "~").output_dir == os.path.expanduser("~")
    assert parsed("--output_dir", "None").output_dir == parsed("--output_dir", "null").output_dir == "models/rloo"


# ---------------------------------------------------------------- start-up work bounded
@pytest.mark.parametrize("schedule", ["linear", "cosine", "constant_with_warmup"])
def test_the_learning_rates_sum_is_exact_for_a_short_run_and_bounded_for_a_long_one(schedule):
    """The start-up note's sum over every update's learning rate (it was a Python sum over 10^17 updates for
    --num_train_epochs 1e15): exact up to 10,000 updates, from 10,000 of them beyond, within 1e-6 of the exact."""
    args = rloo.Args(lr_scheduler_type=schedule, warmup_ratio=0.1, learning_rate=1.0)
    calls = []

    def rate(num_updates):
        schedule = plumbing.learning_rates(args, plumbing.RunLength(num_updates, 1))

        def at(update):
            calls.append(update)
            return schedule(update)
        return at

    short = plumbing.learning_rates(args, plumbing.RunLength(10_000, 1))
    assert plumbing.sum_over_updates(rate(10_000), 10_000) == sum(short(u) for u in range(1, 10_001))
    calls.clear()
    n = plumbing.MAX_UPDATES
    estimate = plumbing.sum_over_updates(rate(n), n)
    assert len(calls) == 10_000 and all(1 <= u <= n for u in calls)
    long = plumbing.learning_rates(args, plumbing.RunLength(n, 1))
    exact = math.fsum(long(u) for u in range(1, n + 1))
    assert abs(estimate - exact) <= 1e-6 * exact


def test_a_run_of_more_updates_than_it_can_count_is_refused_with_what_fits():
    args = rloo.Args(num_train_epochs=2.0)
    assert plumbing.update_intervals(args, plumbing.RunLength(plumbing.MAX_UPDATES, 4)) == (0, 1)  # the most
    with pytest.raises(plumbing.ConfigError, match=r"--num_train_epochs 2 is 1,000,001 updates, more than the "
                                                   r"1,000,000 a run takes: pass --num_train_epochs 1.99 or less"):
        plumbing.update_intervals(args, plumbing.RunLength(plumbing.MAX_UPDATES + 1, 4))


# ---------------------------------------------------------------- user code cannot end or hold the run
@pytest.mark.parametrize("which,call", [
    ("ITIMER_REAL", "signal.alarm(1)"),  # SIGALRM while it runs: exit 142 without a checkpoint, before
    ("ITIMER_REAL", "signal.setitimer(signal.ITIMER_REAL, 0.05)"),
    ("ITIMER_VIRTUAL", "signal.setitimer(signal.ITIMER_VIRTUAL, 0.01)"),  # SIGVTALRM, after CPU time
    ("ITIMER_PROF", "signal.setitimer(signal.ITIMER_PROF, 0.01)"),
])
def test_a_timer_that_fires_while_a_reward_function_runs_is_a_fault_not_the_end_of_the_run(tmp_path, which, call):
    """The timer's signal is caught while user code runs (the function returns once its timer has run out, busy for
    the CPU-time ones) and is one line; the timer and the handler are as before."""
    module = tmp_path / f"{tmp_path.name}.py"  # a name of its own: an imported module stays in sys.modules
    module.write_text(f"import signal\ndef f(**kwargs):\n    {call}\n    while signal.getitimer(signal.{which})[0] > 0:"
                      "\n        pass\n    return [1.0]\n")
    sys.path.insert(0, str(tmp_path))
    try:
        [(name, fn)] = plumbing.load_reward_functions((f"{module.stem}:f",))
    finally:
        sys.path.remove(str(tmp_path))
    with pytest.raises(plumbing.RewardFunctionError) as error:
        plumbing.call_reward_function(name, fn, 1, None)
    assert_one_line(error.value, "reward function 'f' set a timer whose SIG")
    assert [signal.getitimer(which) for which in plumbing.TIMER_SIGNALS] == [(0.0, 0.0)] * 3
    assert [signal.getsignal(sig) for sig in plumbing.TIMER_SIGNALS.values()] == [signal.SIG_DFL] * 3


def test_a_timer_left_armed_or_a_timer_handler_set_by_user_code_is_put_back_and_named(tmp_path, monkeypatch):
    with pytest.raises(plumbing.RewardFunctionError) as error:
        plumbing.call_reward_function("judge", lambda **kwargs: signal.alarm(3600) and None or [1.0], 1, None)
    assert_one_line(error.value, "changed the real (signal.alarm's) interval timer (off -> ")
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    with pytest.raises(plumbing.RewardFunctionError) as error:
        plumbing.call_reward_function("judge", lambda **kwargs: signal.setitimer(signal.ITIMER_PROF, 600, 5)
                                      and None or [1.0], 1, None)
    assert_one_line(error.value, "changed the profiling interval timer (off -> 600 s, then every 5 s)")
    assert signal.getitimer(signal.ITIMER_PROF) == (0.0, 0.0)
    (tmp_path / "own_alarm.py").write_text("import signal\nsignal.signal(signal.SIGALRM, lambda *a: None)\n"
                                           "def f(**kwargs):\n    return [0.0]\n")
    monkeypatch.syspath_prepend(tmp_path)
    with pytest.raises(plumbing.ConfigError) as error:  # a module's own handler, set at import (the main thread)
        plumbing.load_reward_functions(("own_alarm:f",))
    assert_one_line(error.value, "importing 'own_alarm' changed the SIGALRM handler (<Handlers.SIG_DFL: 0> -> <lambda>)")
    assert signal.getsignal(signal.SIGALRM) == signal.SIG_DFL


LEAVES_RUNNING = """import atexit, os, subprocess, sys, threading, time
from pathlib import Path
atexit.register(threading.Event().wait)  # at import: waits forever as the process exits
pids = Path(sys.argv[1], "pids")

def f(completions, **kwargs):
    from atexit import register
    register(lambda: time.sleep(3600))  # at a call
    children = [subprocess.Popen(["sleep", "3600"]),  # holds the console's pipe
                subprocess.Popen(["sleep", "3600"], start_new_session=True),  # a session of its own
                subprocess.Popen(["sh", "-c", f"sleep 3600 & echo $! > {pids}.sh; wait"])]  # with a child of its own
    while not (pids.with_suffix(".sh").exists() and pids.with_suffix(".sh").read_text().endswith("\\n")):
        time.sleep(0.01)  # the shell's child started
    child = os.fork()
    if child == 0:  # a forked child of the run
        time.sleep(3600)
        os._exit(0)
    pids.write_text(" ".join(str(p) for p in [c.pid for c in children] + [child]) + " "
                    + pids.with_suffix(".sh").read_text())
    return [1.0] * len(completions)
"""
RUN_THAT_LEAVES = """import sys
from pathlib import Path
import plumbing
plumbing.rewards.EXIT_HANDLER_TIMEOUT = 0.2
sys.path.insert(0, sys.argv[1])
Path(sys.argv[1], "leaves.py").write_text(sys.argv[2])

def main(args):
    [(name, fn)] = plumbing.load_reward_functions(("leaves:f",))
    plumbing.call_reward_function(name, fn, 2, None, completions=["a", "b"])
    print("finished", flush=True)

plumbing.run_script(main, None, "rloo.py")
"""


def test_the_run_exits_whatever_exit_handlers_and_processes_user_code_left(tmp_path):
    """`rloo.py | cat` ends when the run does: the processes a reward function started (a Popen, one in a session of
    its own, a shell's child, a forked child) are ended and named in one line; its atexit handlers that wait run for
    at most EXIT_HANDLER_TIMEOUT, each named. Without it, communicate() here would wait for an hour."""
    result = subprocess.run([python(), "-c", RUN_THAT_LEAVES, str(tmp_path), LEAVES_RUNNING],
                            capture_output=True, text=True, env=script_env(), cwd=REPO, timeout=300)
    assert result.returncode == 0 and result.stdout == "finished\n", result.stderr[-3000:]
    lines = result.stderr.splitlines()
    assert lines[0].startswith("rloo.py: ending 5 process(es) that user code started and left running: pid "), lines
    assert "(reward function 'f')" in lines[0]
    assert sorted(lines[1:]) == sorted([
        "-c: an exit handler of user code (f.<locals>.<lambda>) did not return within 0.2 s: exiting without it",
        "-c: an exit handler of user code (Event.wait) did not return within 0.2 s: exiting without it"]), lines
    for pid in (tmp_path / "pids").read_text().split():
        with contextlib.suppress(FileNotFoundError):  # gone, or a zombie its new parent has not reaped
            assert Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] in "ZX", pid


POOLS = """import multiprocessing, signal, time
from concurrent.futures import ProcessPoolExecutor
pools = []

def f(completions, **kwargs):  # pools kept across calls, as a reward service's client keeps them
    if DEAF:  # a pool whose workers ignore SIGTERM (their own choice), one busy for good: its end waits for it
        if not pools:
            pools.append(multiprocessing.get_context("fork").Pool(1, signal.signal, (signal.SIGTERM, signal.SIG_IGN)))
            pools[0].apply_async(time.sleep, (3600,))
        return [1.0] * len(completions)
    if not pools:
        pools.extend([multiprocessing.get_context("fork").Pool(2),
                      ProcessPoolExecutor(1, multiprocessing.get_context("fork"))])
    return [float(sum(sum(pool.map(len, completions)) for pool in pools))] * len(completions)
"""
RUN_WITH_POOLS = """import multiprocessing, sys, types
from pathlib import Path
import plumbing
plumbing.rewards.EXIT_HANDLER_TIMEOUT = 0.2 if sys.argv[3] == "True" else 10  # the deaf worker's wait: cut short
sys.path.insert(0, sys.argv[1])
Path(sys.argv[1], "pools.py").write_text(f"DEAF = {sys.argv[3]}\\n" + sys.argv[2])

def main(args):
    stop = plumbing.StopSignal(types.SimpleNamespace(held=False), announce=True)  # the run's handlers
    stop.training = True
    [(name, fn)] = plumbing.load_reward_functions(("pools:f",))
    for _ in range(2):
        plumbing.call_reward_function(name, fn, 2, None, completions=["a", "bb"])
    for child in multiprocessing.active_children():  # SIGTERM caught in none: the run's handler given back
        status = Path(f"/proc/{child.pid}/status").read_text()
        masks = {line.split(":")[0]: int(line.split()[1], 16) for line in status.splitlines()
                 if line.startswith(("SigCgt", "SigBlk"))}
        print(child.name, masks["SigCgt"] >> (signal.SIGTERM - 1) & 1, masks["SigBlk"] >> (signal.SIGTERM - 1) & 1)
    print("finished", flush=True)

import signal
plumbing.run_script(main, None, "rloo.py")
"""


@pytest.mark.parametrize("deaf", [False, True])
def test_a_finished_run_exits_whatever_pools_its_reward_function_keeps(tmp_path, deaf):
    """A reward function's multiprocessing pools kept across calls (a fork Pool, a ProcessPoolExecutor): their workers
    start with SIGTERM's default action, not the run's handler that only records it, and the finished
    run exits, its console's pipe closed (communicate() here returns). Ended from outside before multiprocessing's
    own end, a fork pool's worker holding its queue's lock left that end waiting forever; a worker that ignores
    SIGTERM itself, busy for good, is named and killed once the exit handlers' time has passed."""
    result = subprocess.run([python(), "-c", RUN_WITH_POOLS, str(tmp_path), POOLS, str(deaf)], capture_output=True,
                            text=True, env=script_env(), cwd=REPO, timeout=300)
    assert result.returncode == 0 and result.stdout.endswith("finished\n"), result.stderr[-3000:]
    workers = result.stdout.splitlines()[:-1]
    assert len(workers) == (1 if deaf else 3) and all(line.endswith(" 0 0") for line in workers), workers
    watchdog = "rloo.py: processes of user code's multiprocessing still ran 0.2 s after the run's end"
    assert (watchdog in result.stderr) == deaf and "Traceback" not in result.stderr, result.stderr[-3000:]


FORKED_IN_C = """import os, signal, sys, threading, types
import plumbing
stop = plumbing.StopSignal(types.SimpleNamespace(held=False), announce=True)
stop.training = True
stop.pid = -1  # as in a child forked where Python's fork hooks do not run (a fork in C code): not the run's process
os.kill(os.getpid(), getattr(signal, sys.argv[1]))
threading.Event().wait(600)  # a hang guard only: the signal ends the process before
"""


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_the_runs_stop_signal_handler_does_nothing_outside_the_runs_own_process(sig):
    """In a process that is not the run's own, the run's handler gives the signal its default back and delivers it
    again: SIGTERM ends the process, SIGINT raises KeyboardInterrupt (which ends it by SIGINT)."""
    result = subprocess.run([python(), "-c", FORKED_IN_C, sig], capture_output=True, text=True, env=script_env(),
                            cwd=REPO, timeout=300)
    assert result.returncode == -getattr(signal, sig), result.stderr[-2000:]  # Python ends by the signal itself
    assert ("KeyboardInterrupt" in result.stderr) == (sig == "SIGINT"), result.stderr[-2000:]


@pytest.mark.parametrize("module,kind,line", [
    ("fifo_rewards", "fifo", r"fifo_rewards.py is a FIFO \(named pipe\), not a regular file: put the module's "
                             r"source there \(Python's import skips a file that is not regular\)"),
    ("zero_rewards", "/dev/zero", "zero_rewards.py is a character device, not a regular file"),
    ("pkg.sub", "fifo", r"pkg/sub.py is a FIFO \(named pipe\)"),  # a package's module
    ("pkg", "init fifo", r"pkg/__init__.py is a FIFO \(named pipe\)"),  # else a namespace package, without f
    ("big_rewards", "big", "big_rewards.py is 1,100 bytes, over the limit of 1 KiB for this input"),
])
def test_a_reward_modules_file_is_a_regular_file_within_limits(tmp_path, monkeypatch, module, kind, line):
    """A reward module's file that is no regular file (the import system skips it: it was "no module named") or is
    over SOURCE_LIMIT is one line naming the file, before any import."""
    monkeypatch.setattr(plumbing.rewards, "SOURCE_LIMIT", 1024)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    path = tmp_path.joinpath(*module.split(".")).with_suffix(".py") if kind != "init fifo" else \
        tmp_path / "pkg" / "__init__.py"
    path.unlink(missing_ok=True)
    if kind.endswith("fifo"):
        os.mkfifo(path)
    elif kind == "big":
        path.write_text("def f(**kwargs):\n    return []\n" + "#" * 1068 + "\n")
    else:
        path.symlink_to(kind)
    with pytest.raises(plumbing.ConfigError, match=line):
        plumbing.load_reward_functions((f"{module}:f",))
    assert module not in sys.modules


# ---------------------------------------------------------------- odd values: one line, or working
@pytest.mark.parametrize("argv,fragment", [
    (["--pad_token", ""], "--pad_token '' is empty"),  # a TypeError in the tokenizer, before
    (["--eval_strategy", "no", "--num_evals", "3"], "--num_evals 3 spreads the evaluations over the run without "
                                                    "--eval_strategy, and --eval_strategy no evaluates nowhere"),
    (["--eval_strategy", "epoch", "--dataset_test_split", "test", "--num_evals", "0"], "places them itself"),
])
def test_odd_values_are_one_line(argv, fragment):
    status, error = parse_and_check([*VALID, *argv])
    assert status == 2 and error.count("\n") == 1 and fragment in error, error


def test_eval_strategy_epoch_on_a_run_shorter_than_an_epoch_evaluates_at_its_end():
    """TRL's Trainer evaluates at the end of the last pass, whole or not: before, a run of 3 updates in an epoch of 4
    never evaluated."""
    args = rloo.Args(eval_strategy="epoch", dataset_test_split="test")
    assert plumbing.evaluation_updates(args, plumbing.RunLength(3, 1), 4) == {3}
    assert plumbing.evaluation_updates(args, plumbing.RunLength(9, 1), 4) == {4, 8, 9}
    assert plumbing.evaluation_updates(args, plumbing.RunLength(3, 1), 0) == {1, 2, 3}  # an epoch shorter than an update: each update
