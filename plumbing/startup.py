"""What a script of this project needs before torch loads, done as plumbing is imported (its first module; rloo.py,
rloo_multinode.py and plan_memory.py import plumbing before torch):
- OpenMP's threads that wait for work sleep instead of spinning: the same results, and on a CPU that other work
  shares, runs several times faster (docs/speed-and-memory.md). OpenMP reads it once, when torch loads it; a value
  of the user's own is kept.
- Ctrl-C during the imports (seconds: torch, transformers) of a top-level script run as __main__: one line (none
  where stderr is gone), no traceback, exit 130; the script's own stop signals take over once its main starts.
"""

import contextlib
import os
import signal
import sys
import threading

__all__: list[str] = []

os.environ["OMP_WAIT_POLICY"] = os.environ.get("OMP_WAIT_POLICY") or "PASSIVE"


def stopped_while_starting(script: str):
    """The SIGINT handler of `script` while it imports."""
    def handler(*_):
        with contextlib.suppress(OSError):
            os.write(2, f"{script}: SIGINT received while starting: stopped, nothing written\n".encode())
        os._exit(130)
    handler.run_only = True  # the script's own process only: a process forked from it gets Python's (plumbing.faults)
    return handler


MAIN = getattr(sys.modules.get("__main__"), "__file__", None)  # the script run, if any (not pytest, not python -c)
if MAIN and os.path.dirname(os.path.abspath(MAIN)) == os.path.dirname(os.path.dirname(os.path.abspath(__file__))) \
        and threading.current_thread() is threading.main_thread():
    signal.signal(signal.SIGINT, stopped_while_starting(os.path.basename(MAIN)))
