"""Work in a thread of its own while the main thread waits for it, so that a stop signal acts at once: Python runs
signal handlers in the main thread only, between bytecodes, and a call into C code there (a collective's rendezvous,
tokenizers' Rust, a reward function's sleep) would keep the handler from running for as long as it lasts. It imports
no other module of this package.
"""

import threading
from typing import Callable, Optional

__all__: list[str] = []  # used by the modules of this package, not by rloo.py


def in_a_thread(work: Callable[[], object], name: str, timeout: Optional[float] = None,
                meanwhile: Optional[tuple[float, Callable[[], None]]] = None) -> dict:
    """work() in a daemon thread of its own while this thread waits for it, at most `timeout` seconds: {"out": what
    it returned} or {"error": what it raised, of any type}, or {} while it still runs (it is left running). Python
    runs signal handlers in the main thread only, between bytecodes: a call into C code there (tokenizers' Rust, a
    reward function's sleep) keeps a stop signal from acting for as long as it runs; waiting for a thread, the main
    thread takes it at once. `meanwhile` (seconds, say): say() once the work has taken that long, then wait on."""
    outcome = {}

    def call() -> None:
        try:
            outcome["out"] = work()
        except BaseException as e:  # noqa: BLE001: any type, sys.exit included, goes to the waiting thread
            outcome["error"] = e

    thread = threading.Thread(target=call, name=name, daemon=True)  # abandoned if the process stops meanwhile
    thread.start()
    if meanwhile is not None:
        thread.join(meanwhile[0])
        if thread.is_alive():
            meanwhile[1]()
    thread.join(timeout)
    return dict(outcome) if not thread.is_alive() else {}


def interruptible(work: Callable[[], object], name: str, meanwhile: Optional[tuple[float, Callable]] = None):
    """work(), done in a thread (in_a_thread, with `meanwhile`) so that a stop signal during it ends the start-up at
    once: what it returns or raises."""
    outcome = in_a_thread(work, name, meanwhile=meanwhile)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["out"]
