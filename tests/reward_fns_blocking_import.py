"""A reward module whose import blocks (a slow start-up): it writes the file named by BLOCKING_IMPORT_READY, then
sleeps, so that a test can signal rloo.py during its start-up."""

import os
import time
from pathlib import Path

Path(os.environ["BLOCKING_IMPORT_READY"]).write_text("importing\n")
time.sleep(60)


def count_a(completions, **kwargs):
    return [float(c.split().count("a")) for c in completions]
