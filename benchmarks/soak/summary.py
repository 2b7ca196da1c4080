"""The run's summary: percentiles, failures, the JSON file, the plot and
the printed report."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import numpy as np

from .memory import memory_verdict
from .settings import ENDPOINTS, RTOL, SAMPLE_EVERY, SCALE_TOL, SHORT


def percentiles(ms):
    ms = np.asarray(ms, np.float64)
    if not len(ms):
        return {"count": 0}
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    return {
        "count": len(ms),
        "p50": round(float(p50), 2),
        "p90": round(float(p90), 2),
        "p99": round(float(p99), 2),
        "max": round(float(ms.max()), 2),
        "mean": round(float(ms.mean()), 2),
    }


def summarize(run, args, specs, rss, timed_from, timed_to, server_env, healthy):
    timed = [r for r in run.records if r.phase == "timed"]
    answered = [r for r in timed if r.status != 503]
    statuses = {}
    for r in run.records:
        statuses[str(r.status)] = statuses.get(str(r.status), 0) + 1
    latency = {
        kind: percentiles([r.ms for r in answered if r.kind == kind])
        for kind in (*ENDPOINTS, "refused")
    }
    by_network = {
        spec.name: {
            SHORT[kind]: percentiles(
                [r.ms for r in answered if r.kind == kind and r.network == spec.name]
            )
            for kind in ENDPOINTS
        }
        for spec in specs
    }
    times = [t for t, _ in rss.samples]
    mib = [m for _, m in rss.samples]
    memory = memory_verdict(times, mib, timed_from, timed_to)
    memory.update(
        {
            "interval_s": SAMPLE_EVERY,
            "samples": [[round(t, 2), round(m, 2)] for t, m in rss.samples],
            "start_mib": round(mib[0], 2) if mib else None,
            "after_warmup_mib": round(
                next((m for t, m in rss.samples if t >= timed_from), math.nan), 2
            ),
            "end_mib": round(mib[-1], 2) if mib else None,
            "peak_mib": round(max(mib), 2) if mib else None,
        }
    )
    failures = list(run.failures)
    if memory["growing"]:
        failures.append(
            "memory keeps growing: "
            f"{' and '.join(map(str, memory['slopes_mib_per_min']))} MiB/min over "
            "the two halves of the timed phase (after it settled), over the limit "
            f"of {memory['limit_mib_per_min']} MiB/min"
        )
    if not healthy:
        failures.append("the server did not answer /health after the run")
    five = {s: n for s, n in statuses.items() if s.startswith("5") and s != "503"}
    duration = timed_to - timed_from
    return {
        "command": " ".join(sys.argv),
        "config": {
            "seconds": args.seconds,
            "clients": args.clients,
            "workers": args.workers,
            "seed": args.seed,
            "cpus": os.cpu_count(),
            "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
            "bad_share": args.bad_share,
            "networks": {s.name: s.describe() for s in specs},
            "server_env": server_env,
            "tolerances": {
                "small": f"elementwise rtol = atol = {RTOL}; redrawn until no row "
                "is near a tie or a kink",
                "mid": f"max |got - want| <= {SCALE_TOL} x max |want|, rows near a "
                "tie or a kink left out (zero cotangent rows for VJPs)",
            },
        },
        "ok": not failures,
        "failures": failures,
        "warmup_s": round(timed_from, 2),
        "duration_s": round(duration, 2),
        "requests": {
            "timed": len(answered),
            "per_second": round(len(answered) / duration, 2) if duration > 0 else 0,
            "good": sum(r.kind != "refused" for r in answered),
            "bad": sum(r.kind == "refused" for r in answered),
            "all_phases_by_status": dict(sorted(statuses.items())),
            "5xx_not_shedding": sum(five.values()),
        },
        "latency_ms": latency,
        "latency_ms_by_size": {
            size: {
                SHORT[kind]: percentiles(
                    [
                        r.ms
                        for r in answered
                        if r.kind == kind and r.network.startswith(size[0] + "-")
                    ]
                )
                for kind in ENDPOINTS
            }
            for size in ("small", "mid")
        },
        "latency_ms_by_network": by_network,
        "shed_503": dict(run.shed),
        "bad_requests": dict(sorted(run.bad.items())),
        "worst_error_fraction_of_tolerance": {
            f"{n} {SHORT[k]}": round(v, 4) for (n, k), v in sorted(run.worst.items())
        },
        "excused_rows": {
            name: {"rows": n, "excused": k, "share": round(k / n, 4) if n else 0}
            for name, (n, k) in sorted(run.rows.items())
            if k or name.startswith("m-")
        },
        "memory": memory,
    }


def to_json(result):
    """Indented, with the RSS samples on one line."""
    samples = result["memory"]["samples"]
    result = {**result, "memory": {**result["memory"], "samples": "SAMPLES"}}
    text = json.dumps(result, indent=1)
    return text.replace('"SAMPLES"', json.dumps(samples), 1) + "\n"


def plot(result, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(
        1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [1, 1.4]}
    )
    kinds = [k for k, v in result["latency_ms"].items() if v["count"]]
    labels = {**SHORT, "refused": "refused (4xx)"}
    xs = np.arange(len(kinds))
    for offset, key, color in ((-0.2, "p50", "tab:blue"), (0.2, "p99", "tab:orange")):
        values = [result["latency_ms"][k][key] for k in kinds]
        bars = left.bar(xs + offset, values, 0.4, label=key, color=color)
        left.bar_label(bars, fmt="%.0f", fontsize=8)
    left.set_xticks(
        xs, [f"{labels[k]}\nn={result['latency_ms'][k]['count']}" for k in kinds]
    )
    if kinds:
        left.set_yscale("log")
    else:
        left.text(0.5, 0.5, "no timed requests", ha="center", transform=left.transAxes)
    left.set_ylabel("latency (ms)")
    left.set_title(
        f"latency per endpoint, {result['config']['clients']} clients, "
        f"{result['duration_s']:.0f} s"
    )
    left.legend()
    memory = result["memory"]
    samples = np.asarray(memory["samples"]) if memory["samples"] else np.zeros((0, 2))
    right.plot(samples[:, 0], samples[:, 1], lw=1, label="server RSS (all processes)")
    right.axvspan(0, result["warmup_s"], color="0.9", label="start-up + warm-up")
    right.axvline(
        memory["judged_from_s"], color="0.5", ls=":", lw=1, label="judged from here"
    )
    for i, (slope, intercept, a, b) in enumerate(memory.get("fits", [])):
        per_min = memory["slopes_mib_per_min"][i]
        right.plot(
            [a, b],
            [slope * a + intercept, slope * b + intercept],
            "r--" if i else "m--",
            label=f"fit, {('first', 'second')[i]} half: {per_min:+.2f} MiB/min",
        )
    right.set_xlabel("seconds since the server started")
    right.set_ylabel("MiB")
    verdict = "growing" if memory["growing"] else "flat"
    right.set_title(
        f"resident memory: {verdict}; 503s: {result['shed_503']['count']}; "
        f"{'OK' if result['ok'] else 'FAILED'}"
    )
    right.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(result):
    requests_ = result["requests"]
    print(
        f"\nsoak: {result['duration_s']:.0f} s timed, "
        f"{result['config']['clients']} clients, {requests_['timed']} requests "
        f"({requests_['per_second']}/s)"
    )
    print("| endpoint | n | p50 ms | p90 ms | p99 ms | max ms |")
    print("|---|---|---|---|---|---|")
    for kind, s in result["latency_ms"].items():
        if s["count"]:
            row = [kind, s["count"], s["p50"], s["p90"], s["p99"], s["max"]]
            print("| " + " | ".join(map(str, row)) + " |")
    for size, kinds in result["latency_ms_by_size"].items():
        for kind, s in kinds.items():
            if s["count"]:
                row = [f"{kind}, {size} networks", s["count"], s["p50"], s["p90"]]
                row += [s["p99"], s["max"]]
                print("| " + " | ".join(map(str, row)) + " |")
    m = result["memory"]
    print(
        f"statuses {result['requests']['all_phases_by_status']}; 503s "
        f"{result['shed_503']}; RSS {m['start_mib']} -> {m['after_warmup_mib']} "
        f"(after warm-up) -> {m['end_mib']} MiB, peak {m['peak_mib']}; slope "
        f"{m.get('slopes_mib_per_min')} MiB/min (limit {m.get('limit_mib_per_min')}), "
        f"last quarter - first {m.get('growth_mib')} MiB: "
        f"{'growing' if m['growing'] else 'not growing'}"
    )
    worst = result["worst_error_fraction_of_tolerance"]
    if worst:
        key = max(worst, key=worst.get)
        print(f"worst answer: {worst[key]:.3f} of its tolerance ({key})")
