"""tesseract_api.py with a slow apply: a test-only shim for graceful shutdown.

Each apply appends its worker's PID (one line) to the file named by
QARRAY_TEST_STARTED as it starts, then sleeps QARRAY_TEST_APPLY_SECONDS before
computing: a test knows when a request is in flight, and how long it stays.
"""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import tesseract_api as base
from tesseract_api import *  # noqa: F403

_STARTED = os.environ["QARRAY_TEST_STARTED"]
_SECONDS = float(os.environ["QARRAY_TEST_APPLY_SECONDS"])


def apply(inputs):
    with open(_STARTED, "a") as f:
        f.write(f"{os.getpid()}\n")
    time.sleep(_SECONDS)
    return base.apply(inputs)
