"""A pytest plugin counting the XLA programs each test compiles: what the
accelerator suite's time goes to on a TPU (docs/accelerators.md).

    JAX_COMPILATION_CACHE_DIR=$(mktemp -d) COMPILE_COUNT_OUT=counts.json \\
        scripts/test_accelerator.sh .venv/bin/python cpu -p support.compile_count

(an empty persistent cache: a hit compiles nothing). Prints the total and
writes ``{"count": {test: n}, "seconds": {test: s}}`` to ``COMPILE_COUNT_OUT``.
"""

import collections
import json
import os

import jax.monitoring
import pytest

_current: list[str | None] = [None]
_count: collections.Counter = collections.Counter()
_seconds: collections.Counter = collections.Counter()


def _listen(event: str, duration: float, **_) -> None:
    if "backend_compile" in event and _current[0]:
        _count[_current[0]] += 1
        _seconds[_current[0]] += duration


jax.monitoring.register_event_duration_secs_listener(_listen)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    _current[0] = item.nodeid
    yield
    _current[0] = None


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(
        f"XLA compiles: {sum(_count.values())} in {sum(_seconds.values()):.1f} s "
        f"over {len(_count)} tests"
    )
    out = os.environ.get("COMPILE_COUNT_OUT")
    if out:
        with open(out, "w") as f:
            json.dump({"count": _count, "seconds": _seconds}, f, indent=1)
