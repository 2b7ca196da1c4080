"""Soak test: a real `qarray-serve` under mixed traffic for minutes (`make soak`).

    .venv/bin/python -m benchmarks.soak [--seconds 180] [--clients 6] [--workers 1]
        [--networks all|small|mid] [--out docs/soak.json] [--plot docs/soak.png]

Starts `qarray-serve serve` on a free loopback port (`--workers` processes)
and warms it up (every network x endpoint x gradient variant once, so XLA
compiles before the clock starts). Then `--clients` processes, each with its
own keep-alive connection, send `apply`, `vector_jacobian_product` and
`jacobian_vector_product` requests for `--seconds`: eight networks from tiny
to mid-sized (up to 1024 x 1024 weights, both layouts, dense `w` and `w_q`,
int8 activations on three, batch axes on three), fresh random arrays on every
request, gradients with respect to every path or to x alone; some VJPs reuse
the client's previous `apply` inputs (the residual cache's path). A share of
the requests (`--bad-share`) is one of 14 malformed ones: each must get a 4xx
whose small body names the field; never a 5xx.

Every good answer is checked against the NumPy reference network
(support/network.py; the JVP reference is here), in float64:
- small networks elementwise at rtol = atol = 2e-4, as the tests do; draws are
  redrawn until no row is near a rounding tie or a relu kink (below);
- mid networks relative to the answer's scale: max |got - want| <=
  SCALE_TOL x max |want| over the rows not near a tie or a kink. Near a tie
  (an int8 activation within a few float32 roundings of k + 1/2) server and
  reference can round one value apart, and with int8 activations that step is
  quantized again by every later layer: the whole row moves. So such rows are
  left out of apply and JVP checks, and get a zero cotangent in VJPs (so
  every cotangent is checked whole). Dense weights are drawn away from ties.

The server runs with the residual cache on for every nonlinear network
(QARRAY_VJP_CACHE_MIN_FLOPS=0) and tight load-shedding bounds
(QARRAY_MAX_REQUEST_BYTES = QARRAY_MAX_INFLIGHT_BYTES = 4 MiB by default; 0
keeps the server's defaults), so the 503 path is exercised too: a shed request
is retried after its Retry-After seconds with exponential backoff, as the
README tells clients to.

Records each request's latency (p50 / p90 / p99 per endpoint), the server's
resident memory (all its processes) every 0.5 s, status counts and 503s;
writes a JSON file and a PNG. Exits 1, saying why, on a wrong answer, a 5xx
other than a load-shedding 503 (one with Retry-After naming
QARRAY_MAX_INFLIGHT_BYTES), a malformed request answered otherwise than by a
small 4xx naming its field, a lost connection, a server that does not answer
/health at the end, or memory that keeps growing (`memory_verdict`: the
timed phase less its first 25% (at most 30 s) is cut in halves, a line fitted
to each; growing means both rise faster than max(1.5 MiB/min, 15 MiB over the
judged window): a leak grows all along, an allocator's step lifts one half.
A default 3-minute run tells leaks from ~6 MiB/min, a 10-minute one from
~1.6 MiB/min).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import requests

from support.server import (
    serve,
    server_processes,
)

from .clients import drive
from .memory import RSSSampler
from .networks import SPECS
from .settings import ROOT
from .summary import plot, report, summarize, to_json


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=180.0, help="timed phase")
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--workers", type=int, default=1, help="--num-workers")
    parser.add_argument("--networks", choices=("all", "small", "mid"), default="all")
    parser.add_argument("--bad-share", type=float, default=0.15)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-request-bytes", type=int, default=4 * 2**20)
    parser.add_argument("--max-inflight-bytes", type=int, default=4 * 2**20)
    parser.add_argument("--out", default=str(ROOT / "docs" / "soak.json"))
    parser.add_argument("--plot", default=str(ROOT / "docs" / "soak.png"))
    parser.add_argument(
        "--inject-fault",
        choices=("wrong-answer",),
        help="tests only: make the reference disagree with the first answer",
    )
    args = parser.parse_args(argv)
    specs = [s for s in SPECS if args.networks in ("all", s.size)]
    server_env = {"QARRAY_VJP_CACHE_MIN_FLOPS": "0"}
    for name, value in (
        ("QARRAY_MAX_REQUEST_BYTES", args.max_request_bytes),
        ("QARRAY_MAX_INFLIGHT_BYTES", args.max_inflight_bytes),
    ):
        if value:
            server_env[name] = str(value)

    with tempfile.TemporaryDirectory(prefix="qarray-soak-") as tmp:
        t0 = time.monotonic()
        with serve(Path(tmp), env=server_env, workers=args.workers) as url:
            with RSSSampler(server_processes(url)[0], t0) as rss:
                run, timed_from, timed_to = drive(url, t0, specs, args)
            try:
                healthy = requests.get(f"{url}/health", timeout=30).status_code == 200
            except requests.RequestException:
                healthy = False
            if run.failures or not healthy:
                logs = sorted(Path(tmp).glob("server-*.log"))
                if logs:
                    print(logs[0].read_text()[-3000:], file=sys.stderr)
    result = summarize(run, args, specs, rss, timed_from, timed_to, server_env, healthy)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(to_json(result))
    for i, (payload, answer) in enumerate(run.wrong[:3]):
        dump = Path(args.out).with_name(f"{Path(args.out).stem}-wrong-{i}.json")
        dump.write_text(json.dumps({"request": payload, "answer": answer}))
        print(f"the request and its wrong answer: {dump}", file=sys.stderr)
    plot(result, args.plot)
    report(result)
    print(f"wrote {args.out} and {args.plot}")
    if not result["ok"]:
        print("SOAK FAILED:", file=sys.stderr)
        for failure in result["failures"]:
            print(f"  - {failure}", file=sys.stderr)
        return 1
    print("soak passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
