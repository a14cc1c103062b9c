"""A reward module whose import blocks (a slow start-up): it writes the file named by BLOCKING_IMPORT_READY, then
sleeps, so that a test can signal rloo.py during its start-up. Under torchrun, only rank BLOCKING_IMPORT_RANK blocks
(every rank when it is not set), and the file holds the process id of the one that blocks."""

import os
import time
from pathlib import Path

if os.environ.get("RANK", "0") == os.environ.get("BLOCKING_IMPORT_RANK", os.environ.get("RANK", "0")):
    Path(os.environ["BLOCKING_IMPORT_READY"]).write_text(f"{os.getpid()}\n")
    time.sleep(60)


def count_a(completions, **kwargs):
    return [float(c.split().count("a")) for c in completions]
