"""``GET /metrics``: a worker's own counters, in Prometheus' text format.

What a load test (``make bench``, suite load) and an operator need to see
that batching works: how many rows each computed call had (a histogram:
merged batches and requests that ran alone), how many merged calls fell back
to computing each request alone, and where the products ran (the CPU
kernels' instruction set). Each worker process answers for itself (its pid
is a label): with ``--num-workers N`` a scrape sees one worker per
connection.
"""

from __future__ import annotations

import os

from ._batcher import Batcher

# histogram buckets of rows per computed call (QARRAY_MAX_BATCH_ROWS is 64 by
# default; larger settings land in +Inf)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def render(batcher: Batcher, isa: str) -> str:
    """The text exposition of ``batcher``'s counters."""
    seen = dict(batcher.rows_seen)  # a copy: workers' threads add to it
    pid = f'pid="{os.getpid()}"'
    lines = [
        "# HELP qarray_batch_rows Rows of x per computed call (a merged batch "
        "of requests, or one request alone).",
        "# TYPE qarray_batch_rows histogram",
    ]
    for bound in ROW_BUCKETS:
        count = sum(n for rows, n in seen.items() if rows <= bound)
        lines.append(f'qarray_batch_rows_bucket{{{pid},le="{bound}"}} {count}')
    lines += [
        f'qarray_batch_rows_bucket{{{pid},le="+Inf"}} {sum(seen.values())}',
        f"qarray_batch_rows_sum{{{pid}}} {sum(r * n for r, n in seen.items())}",
        f"qarray_batch_rows_count{{{pid}}} {sum(seen.values())}",
        "# HELP qarray_merged_requests_total Requests answered by merged calls.",
        "# TYPE qarray_merged_requests_total counter",
        f"qarray_merged_requests_total{{{pid}}} {batcher.merged_jobs}",
        "# HELP qarray_merge_fallbacks_total Merged calls that failed and "
        "computed each request alone.",
        "# TYPE qarray_merge_fallbacks_total counter",
        f"qarray_merge_fallbacks_total{{{pid}}} {batcher.fallbacks}",
        "# HELP qarray_kernels Where qarray's products run (qarray._ffi.status()).",
        "# TYPE qarray_kernels gauge",
        f'qarray_kernels{{{pid},status="{_label(isa)}"}} 1',
    ]
    return "\n".join(lines) + "\n"


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ")


def parse(text: str) -> dict:
    """``render``'s text back to numbers (benchmarks, tests): ``{"rows":
    {rows bound: calls at most that big}, "calls", "rows_total",
    "merged_requests", "fallbacks", "kernels", "pid"}``."""
    out: dict = {"rows": {}}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, value = line.rsplit(" ", 1)
        name, _, labels = name_labels.partition("{")
        fields = dict(
            part.split("=", 1) for part in labels.rstrip("}").split(",") if part
        )
        fields = {k: v.strip('"') for k, v in fields.items()}
        out["pid"] = int(fields["pid"])
        if name == "qarray_batch_rows_bucket":
            out["rows"][fields["le"]] = int(value)
        elif name == "qarray_batch_rows_count":
            out["calls"] = int(value)
        elif name == "qarray_batch_rows_sum":
            out["rows_total"] = int(value)
        elif name == "qarray_merged_requests_total":
            out["merged_requests"] = int(value)
        elif name == "qarray_merge_fallbacks_total":
            out["fallbacks"] = int(value)
        elif name == "qarray_kernels":
            out["kernels"] = fields["status"]
    return out


class MetricsRoute:
    """ASGI middleware answering ``GET /metrics`` with ``render``; every
    other request goes on to ``app``."""

    def __init__(self, app, batcher: Batcher | None):
        self.app = app
        self.batcher = batcher

    async def __call__(self, scope, receive, send):
        if (
            scope["type"] != "http"
            or scope.get("path") != "/metrics"
            or self.batcher is None
        ):
            return await self.app(scope, receive, send)
        from .._ffi import status

        if scope.get("method") in ("GET", "HEAD"):
            status_code, kind = 200, b"text/plain; version=0.0.4; charset=utf-8"
            body = render(self.batcher, status()).encode()
        else:
            status_code, kind = 405, b"application/json"
            body = b'{"detail": "/metrics answers GET"}'
        await send(
            {
                "type": "http.response.start",
                "status": status_code,
                "headers": [
                    (b"content-type", kind),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
