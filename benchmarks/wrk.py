"""Drive a server with ``wrk`` (Debian's C HTTP load generator).

A load generator must cost the machine little next to the server it loads:
a Python client of threads on the same two cores measures itself (issue 43:
a flat 97-149 req/s at every level). ``wrk`` posts prepared bodies from C,
one keep-alive connection per client, and a Lua script reports what it saw
as one JSON line: requests, non-2xx answers, socket errors, latency
percentiles.

    from benchmarks.wrk import run_wrk
    stats = run_wrk(url, "/apply", [body, ...], clients=16, seconds=5)
    stats["rps"], stats["p50_ms"], stats["p99_ms"], stats["non_2xx"]

The bodies are sent in turn (each connection starts at its own), so a level
of many clients is not the same request repeated. ``ensure_wrk()`` installs
it with apt-get where it is missing and this process may (root on Debian).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

# wrk's Lua: the bodies as prepared requests, taken in turn per connection,
# and a summary line at the end (latency in microseconds)
_SCRIPT = """
local counter = 0

function setup(thread)
  thread:set("first", counter)
  counter = counter + 1
end

-- the requests are formatted here, not at load: wrk sets the Host header
-- between the two
function init(args)
  bodies = {}
  n = 0
  for path in io.lines(INDEX) do
    local f = assert(io.open(path, "rb"))
    n = n + 1
    bodies[n] = wrk.format("POST", PATH,
      {["Content-Type"] = "application/json"}, f:read("*a"))
    f:close()
  end
  turn = first
end

function request()
  turn = turn + 1
  return bodies[(turn % n) + 1]
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRK_JSON {"requests": %d, "duration_us": %d, "bytes": %d, ' ..
    '"non_2xx": %d, "connect": %d, "read": %d, "write": %d, ' ..
    '"timeout": %d, "p50_us": %d, "p90_us": %d, "p99_us": %d, ' ..
    '"max_us": %d, "mean_us": %f}\\n',
    summary.requests, summary.duration, summary.bytes, e.status, e.connect,
    e.read, e.write, e.timeout, latency:percentile(50),
    latency:percentile(90), latency:percentile(99), latency.max,
    latency.mean))
end
"""


def ensure_wrk() -> str:
    """The path of ``wrk``; installed with apt-get (root on Debian) where
    missing, else a RuntimeError saying what to install."""
    found = shutil.which("wrk")
    if found:
        return found
    if os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run(["apt-get", "update", "-qq"], check=False)
        subprocess.run(
            ["apt-get", "install", "-y", "-qq", "wrk"],
            check=False,
            env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
        )
        found = shutil.which("wrk")
        if found:
            return found
    raise RuntimeError("the load benchmark needs wrk: apt-get install wrk")


def run_wrk(
    url: str,
    path: str,
    bodies: list[bytes],
    clients: int,
    seconds: float,
    threads: int = 1,
    timeout_s: float = 30.0,
) -> dict:
    """``clients`` keep-alive connections posting ``bodies`` to ``url +
    path`` for ``seconds``; one ``wrk`` thread by default (it drives
    thousands of requests a second on one core, and leaves the other to the
    server). Returns req/s, p50 / p90 / p99 / max in ms, non-2xx answers
    and socket errors."""
    wrk = ensure_wrk()
    with tempfile.TemporaryDirectory(prefix="qarray-wrk-") as folder:
        files = []
        for i, body in enumerate(bodies):
            file = Path(folder, f"body-{i}.json")
            file.write_bytes(body)
            files.append(str(file))
        index = Path(folder, "bodies.txt")
        index.write_text("\n".join(files) + "\n")
        script = Path(folder, "post.lua")
        script.write_text(
            _SCRIPT.replace("INDEX", json.dumps(str(index))).replace(
                "PATH", json.dumps(path)
            )
        )
        done = subprocess.run(
            [
                wrk,
                f"-t{min(threads, clients)}",
                f"-c{clients}",
                f"-d{max(1, round(seconds))}s",
                f"--timeout={max(1, round(timeout_s))}s",
                "-s",
                str(script),
                url,
            ],
            capture_output=True,
            text=True,
            timeout=seconds + timeout_s + 30,
        )
    for line in done.stdout.splitlines():
        if line.startswith("WRK_JSON "):
            raw = json.loads(line.removeprefix("WRK_JSON "))
            break
    else:
        raise RuntimeError(f"wrk gave no summary:\n{done.stdout}\n{done.stderr}")
    duration = raw["duration_us"] / 1e6
    return {
        "rps": raw["requests"] / duration,
        "requests": raw["requests"],
        "non_2xx": raw["non_2xx"],
        "socket_errors": raw["connect"] + raw["read"] + raw["write"] + raw["timeout"],
        "p50_ms": raw["p50_us"] / 1e3,
        "p90_ms": raw["p90_us"] / 1e3,
        "p99_ms": raw["p99_us"] / 1e3,
        "max_ms": raw["max_us"] / 1e3,
        "mean_ms": raw["mean_us"] / 1e3,
    }
