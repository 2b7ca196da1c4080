"""The server's resident memory, sampled, and the rule that calls it growing."""

from __future__ import annotations

import contextlib
import threading
import time

import numpy as np
import psutil

from .settings import RISE_MIN, SAMPLE_EVERY, SETTLE_MAX, SETTLE_SHARE, SLOPE_MIN


class RSSSampler:
    """The server's resident memory (its processes together) every SAMPLE_EVERY s."""

    def __init__(self, root, t0):
        self.root, self.t0 = root, t0
        self.samples = []  # (seconds since t0, MiB)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def rss(self):
        total = 0
        with contextlib.suppress(psutil.NoSuchProcess):
            for p in [self.root, *self.root.children(recursive=True)]:
                with contextlib.suppress(psutil.NoSuchProcess):
                    total += p.memory_info().rss
        return total / 2**20

    def _run(self):
        while not self._stop.is_set():
            self.samples.append((time.monotonic() - self.t0, self.rss()))
            self._stop.wait(SAMPLE_EVERY)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def memory_verdict(times, mib, start=0.0, end=None):
    """Whether the resident memory keeps growing over [start, end] (seconds).

    The first SETTLE_SHARE of the window (at most SETTLE_MAX seconds) is left
    out: concurrency raises the allocators' high-water marks there. The rest
    is cut in halves and a line fitted to each: growing means both rise faster
    than the limit, max(SLOPE_MIN MiB/min, RISE_MIN MiB over the judged
    window's length). A leak grows all along; a step (an allocator's
    high-water mark, a cache filling up) lifts one half's fit, not both, and
    the slow creep after warm-up stays under the limit. The limit is loose
    for short runs (a 3-minute run tells leaks from ~6 MiB/min, 10 minutes
    from ~1.6 MiB/min) because a short window cannot tell a leak from a step.
    """
    t = np.asarray(times, np.float64)
    m = np.asarray(mib, np.float64)
    end = t[-1] if end is None and len(t) else end
    judged_from = start + min(SETTLE_SHARE * ((end or 0) - start), SETTLE_MAX)
    keep = (t >= judged_from) & (t <= (end or 0))
    t, m = t[keep], m[keep]
    out = {
        "rule": (
            f"growing = linear fits to both halves of the judged window rise "
            f"faster than max({SLOPE_MIN} MiB/min, {RISE_MIN:.0f} MiB over the "
            f"window); judged over the timed phase less its first "
            f"{SETTLE_SHARE:.0%} (at most {SETTLE_MAX:.0f} s)"
        ),
        "judged_from_s": round(judged_from, 2),
        "judged_to_s": round(float(end or 0), 2),
        "judged_samples": len(t),
    }
    if len(t) < 8 or t[-1] <= t[0]:
        return {**out, "growing": False, "note": "too few samples to judge"}
    n = len(t)
    limit = max(SLOPE_MIN, RISE_MIN / ((t[-1] - t[0]) / 60))
    fits = []
    for part in (slice(0, n // 2), slice(n // 2, n)):
        slope, intercept = np.polyfit(t[part], m[part], 1)
        fits.append([float(slope), float(intercept), float(t[part][0])])
        fits[-1].append(float(t[part][-1]))
    slopes = [f[0] * 60 for f in fits]
    return {
        **out,
        "slopes_mib_per_min": [round(x, 3) for x in slopes],
        "limit_mib_per_min": round(limit, 3),
        "fits": fits,  # [slope MiB/s, intercept, from s, to s] per half
        "growth_mib": round(
            float(np.median(m[-(n // 4) :]) - np.median(m[: n // 4])), 2
        ),
        "growing": bool(min(slopes) > limit),
    }
