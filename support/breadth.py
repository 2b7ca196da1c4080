"""Parameters of the cases that widen the suite on CPU only (the
``cpu_breadth(reason)`` marker: tests/conftest.py deselects them off CPU)."""

import pytest


def breadth_param(*values, reason: str | None = None, id: str | None = None):
    """``pytest.param(*values, id=id)``, marked ``cpu_breadth(reason)`` where
    a reason (the sibling case that runs everywhere) is given."""
    marks = [pytest.mark.cpu_breadth(reason)] if reason else []
    return pytest.param(*values, id=id, marks=marks)
