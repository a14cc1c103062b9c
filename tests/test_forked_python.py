"""helpers.python(): the tests' runs start as forks of a process that has imported the libraries
(tests/forked_python.py). A fork must be indistinguishable from `python` for what the tests check: its argv, path,
environment, working directory, standard streams, exit status, signals (sent, ignored, fatal), torchrun's ranks,
a sitecustomize; and where it cannot be (a stand-in for a preloaded library, another import-time setting), the run
gets a real interpreter."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from helpers import (PER_UPDATE, REPO, RUN, comparable, forked_interpreter, pid_of, python, read_metrics, script_env)

pytestmark = pytest.mark.skipif(os.environ.get("TESTS_FORK") == "0", reason="TESTS_FORK=0: no forked interpreters")


@pytest.fixture(autouse=True)
def serving():
    """Until the server forks runs: a client started before runs a real interpreter, which would pass these tests."""
    forked_interpreter().wait_until_serving()

SEEN = """import json, os, signal, sys
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "path": [p for p in sys.path if p.startswith(sys.argv[1])],
                  "path0": sys.path[0], "name": __name__, "env": os.environ.get("ASKED"), "stdin": sys.stdin.read(),
                  "sigint": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
                  "sighup_ignored": signal.getsignal(signal.SIGHUP) == signal.SIG_IGN,
                  "threads": __import__("torch").get_num_threads(), "main": sys.modules["__main__"].__dict__.get("x")}))
x = 1
print("to stderr", file=sys.stderr)
sys.exit(3)
"""


def started(interpreter: str, *args, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([interpreter, *map(str, args)], capture_output=True, text=True, timeout=300, **kwargs)


def fork_served(process_pid: int, run_pid: int) -> bool:
    """Whether a run was a fork of the server (its parent) rather than a real interpreter (the client itself)."""
    return run_pid != process_pid


def wait_for(path: Path, process: subprocess.Popen) -> str:
    deadline = time.monotonic() + 300  # a hang guard only
    while not path.exists() or not path.read_text():
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.02)
    return path.read_text()


def test_a_fork_sees_what_a_new_interpreter_sees(tmp_path):
    (tmp_path / "lib").mkdir()
    env = script_env({"ASKED": "yes", "PYTHONPATH": f"{tmp_path / 'lib'}:{REPO / 'tests'}", "OMP_NUM_THREADS": "1"})
    ignore_hup = lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN)  # noqa: E731  inherited, as by nohup
    seen = [started(interpreter, "-c", SEEN, tmp_path, "b", cwd=tmp_path, env=env, input="from stdin",
                    preexec_fn=ignore_hup) for interpreter in (sys.executable, python())]
    assert [(r.returncode, r.stderr) for r in seen] == [(3, "to stderr\n")] * 2, [r.stderr for r in seen]
    real, forked = (json.loads(r.stdout) for r in seen)
    assert forked == real and real["path"] == [str(tmp_path / "lib")] and real["threads"] == 1, (forked, real)


def test_a_fork_trains_bit_identically_to_a_new_interpreter(assets, tmp_path):
    common = ["--model_name_or_path", assets["policy"], "--dataset_name", assets["train"], *RUN,
              "--total_episodes", PER_UPDATE * 3]
    for interpreter, out in ((sys.executable, tmp_path / "real"), (python(), tmp_path / "forked")):
        result = started(interpreter, REPO / "rloo.py", *common, "--output_dir", out, cwd=REPO, env=script_env())
        assert result.returncode == 0, result.stderr[-3000:]
    assert comparable(read_metrics(tmp_path / "real")) == comparable(read_metrics(tmp_path / "forked"))
    real, forked = load_file(tmp_path / "real" / "model.safetensors"), load_file(tmp_path / "forked" /
                                                                                   "model.safetensors")
    assert real.keys() == forked.keys() and all((real[k] == forked[k]).all() for k in real)


def test_an_uncaught_exception_is_a_traceback_of_the_script_and_exit_1(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text("def f():\n    raise ValueError('no')\nf()\n")
    result = started(python(), script, env=script_env())
    assert result.returncode == 1 and result.stderr.splitlines()[-1] == "ValueError: no"
    assert "forked_python" not in result.stderr and f'File "{script}", line 3' in result.stderr, result.stderr


ENDING = """import atexit, concurrent.futures, os, sys, threading, time
if sys.argv[1] == "stdout unwritable":  # a pipe without a reader: its buffer cannot be flushed at the end
    reader, writer = os.pipe()
    os.close(reader)
    sys.stdout = os.fdopen(writer, "w")
    sys.stdout.write("buffered")
class Noisy:
    def __del__(self):
        print("finalized", file=sys.__stdout__, flush=True)
held = Noisy()  # finalized once the interpreter clears __main__
atexit.register(lambda: print("atexit", file=sys.__stdout__, flush=True))
late = lambda what: (time.sleep(0.2), os.write(1, f"{what}\\n".encode()))  # one write: lines whole
threading.Thread(target=late, args=("thread",)).start()
concurrent.futures.ThreadPoolExecutor(1).submit(late, "executor")
print("main", file=sys.__stdout__, flush=True)
if sys.argv[1] == "sys.exit with a message":
    sys.exit("a message")
if sys.argv[1] == "KeyboardInterrupt":
    raise KeyboardInterrupt
"""


@pytest.mark.parametrize("case", ["returns", "sys.exit with a message", "KeyboardInterrupt", "stdout unwritable"])
def test_a_run_ends_as_an_interpreter_ends(tmp_path, case):
    """Threads and executors waited for, then atexit handlers, then __main__'s objects finalized; the exit status
    (a message: 1; stdout that cannot be flushed: 120; an uncaught KeyboardInterrupt: SIGINT) and what is said."""
    script = tmp_path / "ending.py"
    script.write_text(ENDING)
    ended = [started(interpreter, script, case, env=script_env()) for interpreter in (sys.executable, python())]
    # the thread and the executor's worker, both waited for, end in either order
    real, forked = ((r.returncode, [*r.stdout.split()[:1], *sorted(r.stdout.split()[1:3]), *r.stdout.split()[3:]],
                     r.stderr) for r in ended)
    assert forked == real and real[1] == ["main", "executor", "thread", "atexit", "finalized"], (real, forked)
    assert real[0] == {"returns": 0, "sys.exit with a message": 1, "KeyboardInterrupt": -signal.SIGINT,
                       "stdout unwritable": 120}[case]


@pytest.mark.parametrize("argv", [["-c", "import sys; print('x'); sys.stdout.close()"], ["-m", "json.tool"],
                                  ["-m", "json"], ["-m", "no_such_module_here"]])
def test_a_module_run_with_m_or_a_script_closing_stdout_ends_as_with_python(argv):
    """`python -m` of a module (json.tool reads stdin, writes stdout and closes it), of a package without __main__,
    of no module: what is said and the exit status."""
    ended = [started(interpreter, *argv, input='{"a": 1}', env=script_env(), cwd=REPO)
             for interpreter in (sys.executable, python())]
    assert [(r.returncode, r.stdout, r.stderr) for r in ended[1:]] == [(r.returncode, r.stdout, r.stderr)
                                                                      for r in ended[:1]], ended


@pytest.mark.parametrize("handled", [True, False], ids=["a handler", "fatal"])
def test_a_signal_to_the_client_reaches_the_run_and_its_end_is_the_clients(tmp_path, handled):
    ready = tmp_path / "ready"
    code = ("import os, signal, sys, time\n" + (
        "signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))\n" if handled else "") +
        f"open({str(ready)!r}, 'w').write(str(os.getpid()))\ntime.sleep(300)\n")
    default = lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL)  # noqa: E731  whatever this process inherited
    process = subprocess.Popen([python(), "-c", code], env=script_env(), preexec_fn=default)
    run = int(wait_for(ready, process))
    assert fork_served(process.pid, run) and pid_of(process) == run
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=300) == (7 if handled else -signal.SIGTERM)


def test_the_client_killed_ends_the_run(tmp_path):
    ready = tmp_path / "ready"
    process = subprocess.Popen([python(), "-c", f"import os, time; open({str(ready)!r}, 'w').write(str(os.getpid()))"
                                "; time.sleep(300)"], env=script_env())
    run = int(wait_for(ready, process))
    process.kill()
    process.wait()
    deadline = time.monotonic() + 300  # a hang guard only: the kernel's SIGIO ends it
    while Path(f"/proc/{run}").exists() and Path(f"/proc/{run}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_a_run_killed_inside_a_progress_bar_never_stops_a_later_runs_bar():
    """A run killed while it holds tqdm's lock (drawing a bar: datasets' and transformers' loading bars) leaves it
    held: the lock is a semaphore shared with every process forked after it is made. Each run makes its own, as a new
    interpreter does, so the next run's bar is drawn (it hung, in load_prompts, for the rest of a pytest worker)."""
    take = ("import os, signal\nfrom tqdm.auto import tqdm\ntqdm.get_lock().acquire()\nprint(os.getpid(), flush=True)"
            "\nos.kill(os.getpid(), signal.SIGKILL)")
    killed = subprocess.Popen([python(), "-c", take], env=script_env(), stdout=subprocess.PIPE, text=True)
    run = int(killed.communicate(timeout=300)[0])
    assert killed.returncode == -signal.SIGKILL and fork_served(killed.pid, run)
    bar = started(python(), "-c", "from tqdm.auto import tqdm\nfor _ in tqdm(range(2)): pass\nprint('drawn')",
                  env=script_env())  # (its timeout: a hang guard only)
    assert bar.returncode == 0 and bar.stdout == "drawn\n", bar.stderr[-2000:]


def test_torchruns_ranks_are_forks_too_and_a_sitecustomize_runs_in_them(tmp_path):
    (tmp_path / "hook").mkdir()
    (tmp_path / "hook" / "sitecustomize.py").write_text("import os\nos.environ['CUSTOMIZED'] = 'yes'\n")
    script = tmp_path / "rank.py"
    script.write_text("import json, os, sys\nopen(os.path.join(sys.argv[1], os.environ['RANK']), 'w').write("
                      "json.dumps([os.getppid(), os.environ.get('CUSTOMIZED')]))\n")
    env = script_env({"PYTHONPATH": str(tmp_path / "hook")})
    result = started(python(), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", 2, script, tmp_path,
                     env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    server = forked_interpreter().server.pid
    assert [json.loads((tmp_path / rank).read_text()) for rank in "01"] == [[server, "yes"]] * 2


@pytest.mark.parametrize("case", ["a stand-in for a preloaded library", "another import-time setting",
                                  "an option a fork cannot give"])
def test_what_a_fork_cannot_give_gets_a_real_interpreter(tmp_path, case):
    (tmp_path / "numpy").mkdir()
    (tmp_path / "numpy" / "__init__.py").write_text("STAND_IN = True\n")
    env = script_env({"PYTHONPATH": str(tmp_path)} if case.startswith("a stand-in") else
                     {"HF_HOME": str(tmp_path)} if case.startswith("another") else {})
    options = ["-B"] if case.startswith("an option") else []
    process = subprocess.Popen([python(), *options, "-c", "import os, numpy; print(os.getpid(), "
                                "getattr(numpy, 'STAND_IN', False))"], env=env, stdout=subprocess.PIPE, text=True)
    pid, stand_in = process.communicate(timeout=300)[0].split()
    assert int(pid) == process.pid and stand_in == str(case.startswith("a stand-in"))
