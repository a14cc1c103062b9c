"""A Python for the tests' runs of the project's scripts that starts in milliseconds instead of seconds.

Most of a test's run of rloo.py at tiny shapes is its start-up: torch, transformers and datasets imported again
(3.5 of 5.3 s, measured on 2 idle cores). A server process imports those libraries once per pytest worker; each
run is a fork of it that then runs its script as `python` would, fresh: the script and the project's modules are
imported in the fork, its own stdin/stdout/stderr, environment, working directory, signal dispositions and mask.

    interpreter = forked_python.Interpreter(directory, env)  # the server starts in the background
    subprocess.run([interpreter.path, "rloo.py", ...])        # a path to use where sys.executable was

`interpreter.path` is a small executable (the client, `python -I -S`: milliseconds) that passes its argv,
environment, working directory and file descriptors 0-2 to the server, forwards every signal it gets to the run,
and exits as the run did (its status, or the same signal). torchrun's ranks come from the server too
(PYTHON_EXEC). A client whose server is gone or not up yet, or that asks for what a fork cannot give, becomes a
real interpreter (exec): a run is never refused, only slower:
- an option other than -u, -c CMD, -m MOD or a script;
- an environment variable that the preloaded libraries read as they import (IMPORT_TIME: HF_HUB_OFFLINE, HF_HOME,
  OMP_*, PYTHON*, ...) with another value than the server's;
- a module in a folder that the run's path puts first (its script's, PYTHONPATH's) that the server has imported
  (a stand-in torch) or that site imports at start-up only (usercustomize; a sitecustomize on PYTHONPATH is
  imported by the run as site would).
When the client is killed (SIGKILL), the run gets SIGIO (the kernel's, once its socket to the client closes: its
default ends the process). SIGSTOP cannot be forwarded: a test that stops a run, or reads the pid a run writes (its
lock file), asks `Interpreter.pid_of(process)` for the run's own pid. A run ends as Python ends (threads waited
for, atexit handlers, its modules' objects finalized, stdout flushed) but without tearing down the preloaded
libraries (0.3 s of every run): what only they still hold is not finalized. The other differences from a new
interpreter: the runs share the server's hash seed (PYTHONHASHSEED), and a run's parent process is the server, not
the process that started it (a test whose run reads its launcher's command line, /proc/PPID/cmdline, uses
sys.executable). The server keeps no thread but its own, nor a multiprocessing lock (tqdm's, made by the loading
bars, is unmade): a run would inherit it held, or share it with every other run (check_nothing_shared).
`TESTS_FORK=0 make test` runs every test with real interpreters.
"""

import gc
import importlib.machinery
import io
import json
import os
import runpy
import selectors
import signal
import socket
import struct
import sys
import types

# Read as a library imports (huggingface_hub's constants, OpenMP's settings, Python's own): a run asking for other
# values than the server started with gets a real interpreter. PER_RUN: applied by each run (PYTHONPATH to its path,
# OMP_NUM_THREADS through torch.set_num_threads where the server has none) or read later (torchrun's).
IMPORT_TIME = ("PYTHON", "HF_", "HUGGINGFACE", "TRANSFORMERS", "TOKENIZERS", "DATASETS", "TORCH_", "PYTORCH",
               "OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS", "MPL", "MATPLOTLIB", "LC_", "LANG", "LD_", "XDG_",
               "HOME", "TMPDIR", "TEMP", "TMP")
PER_RUN = ("PYTHONPATH", "PYTHON_EXEC", "OMP_NUM_THREADS", "TORCH_NCCL_ASYNC_ERROR_HANDLING")
# Imported once by the server: what a run of rloo.py imports outside the project (its own modules are imported by
# each run). A library that is not installed is skipped.
PRELOAD = ("torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.fsdp", "numpy",
           "safetensors.torch", "yaml", "tyro", "tyro._backends._tyro_backend", "typeguard", "datasets",
           "transformers", "transformers.models.gpt_neox.modeling_gpt_neox", "peft", "matplotlib.figure",
           "matplotlib.backends.backend_agg", "rich.console", "rich.progress", "rich.table",
           "torch.distributed.launcher.api")  # torchrun's, not it (runpy warns)
PRELOAD_NAMES = ("AutoConfig", "AutoModelForCausalLM", "AutoModelForSequenceClassification", "AutoTokenizer",
                 "PreTrainedTokenizerFast", "GenerationConfig", "PreTrainedModel")  # transformers' lazy ones
FORWARDED = [s for s in signal.Signals if s not in (  # what another process sends (not the client's own faults)
    signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD, signal.SIGPIPE, signal.SIGWINCH, signal.SIGURG, signal.SIGTSTP,
    signal.SIGTTIN, signal.SIGTTOU, signal.SIGCONT, signal.SIGIO, signal.SIGSEGV, signal.SIGBUS, signal.SIGILL,
    signal.SIGFPE, signal.SIGTRAP, signal.SIGSYS)]
SERVER_MODULE = "__forked_python_server__"  # this file's module in the server and its forks (no run imports it)
DEFAULTS = {signal.SIGINT: signal.default_int_handler, signal.SIGPIPE: signal.SIG_IGN,
            signal.SIGXFSZ: signal.SIG_IGN}  # what a new interpreter installs; every other signal: SIG_DFL


def effective(env: dict) -> dict:
    """The import-time variables of `env`, OMP_WAIT_POLICY as the project's scripts set it before torch loads."""
    seen = {k: v for k, v in env.items() if k.startswith(IMPORT_TIME) and k not in PER_RUN}
    seen["OMP_WAIT_POLICY"] = seen.get("OMP_WAIT_POLICY") or "PASSIVE"
    threads = env.get("OMP_NUM_THREADS")
    seen["OMP_NUM_THREADS"] = "a count" if threads is None or threads.isdigit() and int(threads) > 0 else threads
    return seen


def parse(argv: list[str]):
    """(mode, target, args, unbuffered) for `python ARGV`, mode one of script, -m, -c; None if a fork cannot run it."""
    unbuffered = False
    for i, arg in enumerate(argv):
        if arg == "-u":
            unbuffered = True
        elif arg in ("-m", "-c") and i + 1 < len(argv):
            return arg, argv[i + 1], argv[i + 2:], unbuffered
        elif arg.startswith("-") or arg == "":
            return None
        else:
            return "script", arg, argv[i + 1:], unbuffered
    return None


def pid_file(directory: str, client_pid: int) -> str:
    """Where the client with pid `client_pid` writes the pid of its run."""
    return os.path.join(directory, "pids", str(client_pid))


# --------------------------------------------------------------------------------------------------- the client
def client(address: str, python: str, argv: list[str]) -> None:
    """Run `python ARGV` as a fork of the server at `address`, or exec `python` itself."""
    def real() -> None:
        os.execv(python, [python, *argv])

    if parse(argv) is None:
        real()
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.connect(address)
    except OSError:  # not up yet, or gone
        real()
    ignored = [int(s) for s in signal.Signals if s not in (signal.SIGKILL, signal.SIGSTOP)
               and signal.getsignal(s) == signal.SIG_IGN]
    body = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "ignored": ignored,
                       "blocked": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, []))}).encode()
    socket.send_fds(sock, [struct.pack("!Q", len(body))], [0, 1, 2])
    sock.sendall(body)
    replies = sock.makefile("r")
    first = replies.readline().split()
    if len(first) != 2 or first[0] != "pid":
        sock.close()
        real()
    pid = int(first[1])

    def forward(signum, frame):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for s in FORWARDED:  # those ignored here too: the run may handle what it inherited as ignored, as a new one may
        signal.signal(s, forward)
    with open(pid_file(os.path.dirname(address), os.getpid()), "w") as f:
        f.write(str(pid))  # Interpreter.pid_of
    end = replies.readline().split()  # "exit CODE" or "signal N", once the run has ended
    if len(end) == 2 and end[0] == "signal":
        if int(end[1]) != signal.SIGKILL:  # its handler cannot be set, nor need be
            signal.signal(int(end[1]), signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [int(end[1])])
        os.kill(os.getpid(), int(end[1]))
    os._exit(int(end[1]) if len(end) == 2 and end[0] == "exit" else 1)


# --------------------------------------------------------------------------------------------------- the server
def preload() -> tuple[bytes, bytes]:
    """Import PRELOAD; what the imports wrote to stdout and stderr, said again by every run as a new one says it."""
    import importlib
    import tempfile

    captured = []
    saved = [os.dup(1), os.dup(2)]
    files = [tempfile.TemporaryFile(), tempfile.TemporaryFile()]
    os.dup2(files[0].fileno(), 1)
    os.dup2(files[1].fileno(), 2)
    try:
        for name in PRELOAD:
            try:
                importlib.import_module(name)
            except ImportError:
                pass
        transformers = sys.modules.get("transformers")
        for name in PRELOAD_NAMES if transformers else ():
            getattr(transformers, name, None)
        if "matplotlib.figure" in sys.modules:  # fonts loaded once: each run's curves.png draws as its second would
            import io

            figure = sys.modules["matplotlib.figure"].Figure()
            figure.subplots().set_title("a")
            figure.tight_layout()
            figure.savefig(io.BytesIO(), format="png")
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)
    for f in files:
        f.seek(0)
        captured.append(f.read())
        f.close()
    return captured[0], captured[1]


def warm_up() -> None:
    """What every run would do first, done once here. inspect.stack() (torchrun's agent calls it 18 times a run)
    searches every module for a frame's file it has not seen: this file's frames, below each run's, are found under
    SERVER_MODULE (a run's own __main__ replaces ours), and the search's cache is filled here. A tiny model is saved
    and loaded, what it prints dropped: transformers' loading compiles its patterns and fills its caches (0.05 s of
    each model a run loads); then what warns only once is reset (transformers' warning_once, each module's warnings
    registry), so that a run still says it."""
    import inspect
    import tempfile

    sys.modules[SERVER_MODULE] = sys.modules["__main__"]
    inspect.stack()
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return
    saved = [os.dup(1), os.dup(2)]
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    try:
        config = transformers.GPTNeoXConfig(vocab_size=16, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                            intermediate_size=16, max_position_embeddings=32)
        with tempfile.TemporaryDirectory() as folder:
            transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
            transformers.AutoModelForCausalLM.from_pretrained(folder)
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        for fd, saved_fd in zip((1, 2), saved):
            os.dup2(saved_fd, fd)
            os.close(saved_fd)
        os.close(devnull)
    if "tqdm.std" in sys.modules:
        unmade(sys.modules["tqdm.std"])
    for once in ("warning_once", "info_once"):
        getattr(getattr(transformers.utils.logging, once, None), "cache_clear", lambda: None)()
    for module in list(sys.modules.values()):  # (vars: a lazy module's getattr would import)
        registry = vars(module).get("__warningregistry__") if isinstance(module, types.ModuleType) else None
        if isinstance(registry, dict):
            registry.clear()


def unmade(std: types.ModuleType) -> None:
    """tqdm as a new interpreter has it, once the loading bars are closed: its lock and its monitor thread not made
    yet. Made here, the lock would be a semaphore shared with every run (a run killed while drawing a bar leaves it
    held: every later run's bar waits forever), and the thread could hold it at a fork (held in that run forever)."""
    classes = [std.tqdm]
    for cls in classes:  # get_lock and a bar set _lock and monitor on the class they are called on
        classes.extend(cls.__subclasses__())
        if vars(cls).get("monitor") is not None:
            cls.monitor.exit()  # wakes its thread and waits for it
        for name in ("_lock", "monitor"):
            if name in vars(cls):
                delattr(cls, name)
    std.tqdm.monitor = None  # (tqdm's own default)
    if "mp_lock" in vars(std.TqdmDefaultWriteLock):
        del std.TqdmDefaultWriteLock.mp_lock
    unclosed = list(std.tqdm._instances)
    assert not unclosed, f"a progress bar left open by the server's imports: {unclosed}"


def check_nothing_shared() -> None:
    """What a run would share with the other runs or inherit held, which a new interpreter never does: a thread
    besides this one (a lock it holds as the server forks stays held in that run) or a multiprocessing lock (a
    semaphore of every process forked after it is made). The server stops, named in its log, rather than serve."""
    import threading

    synchronize = sys.modules.get("multiprocessing.synchronize")
    shared = [o for o in gc.get_objects() if synchronize and issubclass(type(o), synchronize.SemLock)]
    threads = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    if shared or threads:
        raise SystemExit(f"the preloaded libraries left threads {threads} and multiprocessing locks {shared}: "
                         "a fork would share or inherit them held; make them in each run instead (see unmade)")


def serve(address: str, client_path: str) -> None:
    """Preload, listen at `address`, fork a run per client; end when stdin (the pytest worker's pipe) closes. A run's
    torchrun starts its ranks through `client_path` too (PYTHON_EXEC), unless the run names its own."""
    said = preload()
    warm_up()
    check_nothing_shared()
    preloaded = {name.partition(".")[0] for name in sys.modules} | {"usercustomize"}  # sitecustomize: site_customizes
    gc.freeze()  # the collector of each run leaves the preloaded objects alone: no copy-on-write of all their pages
    env = effective(dict(os.environ))
    base_path = [p for p in sys.path[1:] if p]  # the interpreter's own folders, without this file's and PYTHONPATH's
    base_path = [p for p in base_path if p not in os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(address)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    selector.register(0, selectors.EVENT_READ)
    runs: dict[int, socket.socket] = {}  # pid -> its client's connection, for its exit status
    print("ready", flush=True)
    while True:
        for key, _ in selector.select():
            if key.fileobj == 0:
                if not os.read(0, 4096):  # the pytest worker has ended
                    listener.close()
                    os.unlink(address)
                    return
            elif key.fileobj == wake_r:
                os.read(wake_r, 4096)
                reap(runs)
            else:
                conn, _ = listener.accept()
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()  # at once: the request is read by the fork, so no client can hold up this loop
                if pid == 0:  # never returns to this loop
                    for other in runs.values():
                        other.close()
                    selector.close()
                    listener.close()
                    signal.set_wakeup_fd(-1)
                    os.close(wake_r)
                    os.close(wake_w)
                    become(conn, env, preloaded, said, base_path, client_path)
                runs[pid] = conn
                reap(runs)


def become(conn: socket.socket, env: dict, preloaded: set, said: tuple, base_path: list[str], client_path: str):
    """In a fork of the server: the run the client asks for, or (exec) its refusal, logged."""
    request = receive(conn)
    if request is None:
        os._exit(0)
    fds, asked = request
    how = parse(asked["argv"])
    refused = why_not(asked, how, env, preloaded)
    if refused:
        print(f"exec {asked['argv'][:3]}: {refused}", flush=True)  # server.log
        conn.sendall(b"exec\n")
        os._exit(0)
    asked["env"].setdefault("PYTHON_EXEC", client_path)
    conn.sendall(f"pid {os.getpid()}\n".encode())
    run(conn, fds, asked, how, said, base_path)


def receive(conn: socket.socket):
    """The client's descriptors 0-2 and its request, or None if it went away."""
    try:
        header, fds, _, _ = socket.recv_fds(conn, 8, 3)
        while len(header) < 8:
            more = conn.recv(8 - len(header))
            if not more:
                raise OSError("closed")
            header += more
        size, body = struct.unpack("!Q", header)[0], b""
        while len(body) < size:
            more = conn.recv(size - len(body))
            if not more:
                raise OSError("closed")
            body += more
        return fds, json.loads(body)
    except (OSError, ValueError):
        return None


def why_not(asked: dict, how, env: dict, preloaded: set) -> str:
    """Why a fork cannot run what the client asked for ('' if it can)."""
    if how is None:
        return "an option a fork cannot give"
    ours, theirs = os.environ.get("OMP_NUM_THREADS"), effective(asked["env"])  # ours set: a run must ask for it
    if theirs != env or ours is not None and asked["env"].get("OMP_NUM_THREADS") != ours:
        return "import-time variables differ: " + ", ".join(sorted(k for k in {*env, *theirs}
                                                                   if env.get(k) != theirs.get(k)))
    module = shadowed(asked, how, preloaded)
    return f"{module} is first on its path" if module else ""


def shadowed(asked: dict, how: tuple, preloaded: set) -> str:
    """A module that a folder the run's path puts before the libraries (its script's, PYTHONPATH's) holds and the
    server has imported (a stand-in torch, say: the run must import that one) or that site imports at start-up only
    (usercustomize); '' if none."""
    mode, target = how[:2]
    first = os.path.dirname(os.path.join(asked["cwd"], target)) if mode == "script" else asked["cwd"]
    folders = [first, *(os.path.join(asked["cwd"], p) for p in asked["env"].get("PYTHONPATH", "").split(os.pathsep)
                        if p)]
    for folder in folders:
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        for name in names:
            if name.partition(".")[0] in preloaded:
                return name
    return ""


def reap(runs: dict) -> None:
    """Each run that has ended: its status to its client."""
    while runs:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = runs.pop(pid, None)
        if conn is None:
            continue
        said = (f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status)
                else f"exit {os.waitstatus_to_exitcode(status)}")
        try:
            conn.sendall(f"{said}\n".encode())
        except OSError:
            pass
        conn.close()


def run(conn: socket.socket, fds: list[int], asked: dict, how: tuple, said: tuple, base_path: list[str]):
    """In the fork: become `python ARGV` as the client was asked to run it, then end as an interpreter ends."""
    import fcntl

    mode, target, args, unbuffered = how
    for i, fd in enumerate(fds):
        os.dup2(fd, i)
        os.close(fd)
    for s in signal.Signals:
        if s not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(s, signal.SIG_IGN if int(s) in asked["ignored"] else DEFAULTS.get(s, signal.SIG_DFL))
    signal.pthread_sigmask(signal.SIG_SETMASK, asked["blocked"])
    # the client gone (SIGKILL) closes the socket: the kernel sends SIGIO, whose default ends this process
    fcntl.fcntl(conn.fileno(), fcntl.F_SETOWN, os.getpid())
    fcntl.fcntl(conn.fileno(), fcntl.F_SETFL, fcntl.fcntl(conn.fileno(), fcntl.F_GETFL) | os.O_ASYNC)
    if _closed(conn):
        os.kill(os.getpid(), signal.SIGIO)
    os.environ.clear()
    os.environ.update(asked["env"])
    os.chdir(asked["cwd"])
    unbuffered = unbuffered or bool(asked["env"].get("PYTHONUNBUFFERED"))  # as -u
    sys.stdout.reconfigure(line_buffering=os.isatty(1) or unbuffered, write_through=unbuffered)
    sys.stderr.reconfigure(line_buffering=True, write_through=unbuffered)
    os.write(1, said[0])
    os.write(2, said[1])
    if "OMP_NUM_THREADS" in asked["env"] and "torch" in sys.modules:  # OpenMP read it as torch loaded
        sys.modules["torch"].set_num_threads(int(asked["env"]["OMP_NUM_THREADS"]))
    if "numpy" in sys.modules:  # seeded from the OS at import in a new interpreter
        sys.modules["numpy"].random.seed()
    extra = [os.path.abspath(p) for p in asked["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [*extra, *base_path]
    sys.argv = ["-c" if mode == "-c" else target, *args]  # -m: runpy puts the module's file in argv[0]
    libraries = set(sys.modules) - {"__main__"}  # the server's: not torn down at the end (end)
    if any(os.path.exists(os.path.join(folder, "sitecustomize.py")) for folder in extra):
        site_customizes()
    sys.path.insert(0, {"script": os.path.dirname(os.path.realpath(target)), "-m": os.getcwd(), "-c": ""}[mode])
    interrupted = False
    main = sys.modules["__main__"] = types.ModuleType("__main__")  # the run's own; this file's module stays as it is
    try:
        if mode == "script":  # as `python SCRIPT` runs it: in __main__, with its file and a source loader
            main.__file__, main.__cached__ = target, None
            main.__loader__ = importlib.machinery.SourceFileLoader("__main__", target)
            with io.open_code(target) as f:
                code = compile(f.read(), target, "exec")
            exec(code, main.__dict__)
        elif mode == "-m":
            try:
                _, spec, code = runpy._get_module_details(target, runpy._Error)
            except runpy._Error as e:
                sys.exit(f"{sys.executable}: {e}")
            sys.argv[0] = spec.origin
            main.__dict__.update(__name__="__main__", __file__=spec.origin if spec.has_location else None,
                                 __cached__=spec.cached if spec.has_location else None, __doc__=None,
                                 __loader__=spec.loader, __package__=spec.parent, __spec__=spec)
            exec(code, main.__dict__)
        else:
            exec(compile(target, "<string>", "exec"), main.__dict__)
    except SystemExit as e:
        status = exit_status(e.code)
    except BaseException as e:  # as an interpreter does: the traceback of the script's frames, not this file's
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
            tb = tb.tb_next
        sys.excepthook(type(e), e.with_traceback(tb), tb)
        status, interrupted = 1, isinstance(e, KeyboardInterrupt)
        del e, tb
    else:
        status = 0
    del main
    end(status, libraries, interrupted)


def exit_status(code) -> int:
    """The exit status of SystemExit(code), as Python reports it (a message: printed, status 1)."""
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=sys.stderr)
    return 1


def end(status: int, libraries: set, interrupted: bool) -> None:
    """Python's end, for what the run did: non-daemon threads waited for (threading's own shutdown, which also stops
    concurrent.futures' executors), the atexit handlers, the run's modules (its __main__, what it imported) taken
    out and their objects finalized as an interpreter clears them, stdout and stderr flushed before and after that
    (status 120 when that fails). Then os._exit: the server's preloaded libraries are not torn down, nor what only
    they still hold finalized (their teardown, which copies most of the server's pages, took 0.3 s of every run).
    `interrupted` (an uncaught KeyboardInterrupt): after all that, the process ends by SIGINT, as Python's does."""
    import atexit
    import threading
    import weakref

    threading._shutdown()
    atexit._run_exitfuncs()
    status = flushed(status)
    sys.stdin, sys.stdout, sys.stderr = sys.__stdin__, sys.__stdout__, sys.__stderr__  # as Python's finalization
    own = [sys.modules.pop(name) for name in list(sys.modules) if name not in libraries]
    alive = [weakref.ref(module) for module in own if isinstance(module, types.ModuleType)]
    del own
    gc.collect()  # the modules nothing else holds, and their objects, with their globals still set
    for module in reversed(alive):  # the globals of those left alive cleared, the last imported first
        cleared(module())
    gc.collect()
    status = flushed(status)
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(status)


def flushed(status: int) -> int:
    """sys.stdout and sys.stderr flushed as Python's end flushes them: `status`, or 120 where that failed (stdout's
    failure said)."""
    for stream in (sys.stdout, sys.stderr):
        if stream is None or stream.closed:  # closed by the script (json.tool's): nothing to flush
            continue
        try:
            stream.flush()
        except Exception as e:  # noqa: BLE001: any failure, as Python's
            if stream is sys.stdout:
                print(f"Exception ignored in: {stream!r}\n{type(e).__name__}: {e}", file=sys.stderr)
            status = 120
    return status


def cleared(module) -> None:
    """As CPython clears a module left alive at exit: its _names to None first, then the rest."""
    if module is None:  # collected already
        return
    names = module.__dict__
    for first in (True, False):
        for key in list(names):
            if key != "__builtins__" and (key.startswith("_") and not key.startswith("__")) == first:
                names[key] = None


def site_customizes() -> None:
    """What site does at start-up with a sitecustomize on the path (before the script's folder joins it)."""
    try:
        import sitecustomize  # noqa: F401
    except ImportError as e:
        if e.name != "sitecustomize":
            raise
    except Exception as e:  # noqa: BLE001: site's own words, and the run goes on
        sys.stderr.write(f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n{type(e).__name__}: {e}\n")


def _closed(conn: socket.socket) -> bool:
    """Whether the client has already gone (its end closed before SIGIO was armed)."""
    conn.setblocking(False)
    try:
        return conn.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    finally:
        conn.setblocking(True)


# --------------------------------------------------------------------------------------------------- the tests' side
class Interpreter:
    """The server for this pytest worker, started in the background, and the client's executable (`path`)."""

    def __init__(self, directory: str, env: dict):
        import shlex
        import subprocess

        self.directory = directory
        self.address, self.path, self.log = (os.path.join(directory, name) for name in ("server", "python",
                                                                                        "server.log"))
        client_command = [sys.executable, "-I", "-S", __file__, "client", self.address, sys.executable]
        with open(self.path, "w") as f:
            f.write(f"#!/bin/sh\nexec {shlex.join(client_command)} \"$@\"\n")
        os.chmod(self.path, 0o755)
        os.mkdir(os.path.join(directory, "pids"))
        env = {k: v for k, v in env.items() if k != "PYTHONPATH"}
        with open(self.log, "wb") as log:
            self.server = subprocess.Popen([sys.executable, __file__, "serve", self.address, self.path],
                                           stdin=subprocess.PIPE, stdout=log, stderr=log, env=env, cwd=directory)

    def wait_until_serving(self) -> None:
        """Until the server forks runs (before, a client runs a real interpreter): for the tests of the forks."""
        import time

        deadline = time.monotonic() + 600  # a hang guard only
        while "ready" not in open(self.log).read().splitlines():  # (after what the imports may warn)
            if self.server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server of forked interpreters did not start: {open(self.log).read()[-2000:]}")
            time.sleep(0.05)

    def pid_of(self, process) -> int:
        """The pid of the run that `process` (a Popen of `path`) stands for: its fork's, once the server has made it,
        else the process's own (a real interpreter)."""
        try:
            with open(pid_file(self.directory, process.pid)) as f:
                return int(f.read())
        except (OSError, ValueError):
            return process.pid

    def close(self) -> None:
        self.server.stdin.close()
        self.server.wait()


if __name__ == "__main__":
    if sys.argv[1] == "client":
        client(sys.argv[2], sys.argv[3], sys.argv[4:])
    else:
        serve(sys.argv[2], sys.argv[3])
