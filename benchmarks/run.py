"""Run every benchmark side by side and report ratios: `make bench`.

    .venv/bin/python -m benchmarks.run [--quick] [--only kernels,int4,conv,...]
    .venv/bin/python -m benchmarks.run --docs-only   # docs/performance.md again

With --only, the suites run replace their own rows in results.json and keep
the other suites' rows from earlier runs.

Prints a table (markdown), writes benchmarks/results.json,
benchmarks/results.png and the docs' performance page (docs/performance.md,
from the results: never edited by hand). Never part of `make test`.
"""

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import jax

HERE = Path(__file__).resolve().parent
DOCS = HERE.parent / "docs"


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (
        f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.machine()}, "
        f"Python {platform.python_version()}, jax {jax.__version__} "
        f"({jax.default_backend()})"
    )


def met(row) -> bool | None:
    target = row.get("target")
    if target is None:
        return None
    if row.get("lower_is_better"):
        return bool(row["ratio"] <= target)
    return bool(row["ratio"] >= target)


def fmt(value) -> str:
    if value is None:
        return "-"
    if abs(value) < 0.1 and value != 0:
        return f"{value:.2e}"
    return f"{value:.2f}"


def table(rows) -> str:
    lines = [
        "| row | shape (M, K, N) | result | target | met | baseline | isa |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        ok = met(row)
        mark = "-" if ok is None else ("yes" if ok else "**MISSED**")
        comparison = "<=" if row.get("lower_is_better") else ">="
        target = (
            "-" if row.get("target") is None else f"{comparison} {fmt(row['target'])}"
        )
        lines.append(
            f"| {row['row']} | {tuple(row['shape'])} | {fmt(row['ratio'])} "
            f"{row['unit']} | {target} | {mark} | {row['baseline']} "
            # where the kernel suites' product ran (bench_kernels.isa_of)
            f"| {row.get('isa', '-')} |"
        )
    return "\n".join(lines)


def _bars(ax, rows, xlabel):
    labels = [f"{r['row']} {tuple(r['shape'])}" for r in rows]
    colors = [
        {True: "tab:green", False: "tab:red", None: "tab:gray"}[met(r)] for r in rows
    ]
    ax.barh(range(len(rows)), [r["ratio"] for r in rows], color=colors)
    for i, r in enumerate(rows):
        if r.get("target") is not None:
            ax.plot([r["target"]] * 2, [i - 0.4, i + 0.4], color="black", lw=2)
    ax.axvline(1.0, color="gray", ls="--", lw=1)
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    speed = [r for r in rows if r["unit"] == "x faster"]
    # end-to-end rows: ours / the dense Tesseract, lower is better
    e2e = [r for r in rows if r["row"].startswith(("end to end:", "served"))]
    panels = [(p, x) for p, x in ((speed, "speed"), (e2e, "e2e")) if p]
    fig, axes = plt.subplots(
        len(panels),
        1,
        figsize=(10, sum(0.42 * len(p) + 1.2 for p, _ in panels)),
        height_ratios=[0.42 * len(p) + 1.2 for p, _ in panels],
        squeeze=False,
    )
    for ax, (panel, kind) in zip(axes[:, 0], panels, strict=True):
        if kind == "speed":
            _bars(
                ax,
                panel,
                "speed-up over the dense float32 baseline (black tick: target)",
            )
        else:
            _bars(
                ax,
                panel,
                "ours / dense float32 Tesseract (lower is better; tick: target)",
            )
    axes[0, 0].set_title("qarray on XLA:CPU, measured side by side")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_docs(report: dict, path: Path) -> None:
    """The docs' performance page, from a run's report (results.json)."""
    rows = report["rows"]
    lines = [
        "# Performance",
        "",
        "<!-- written by `make bench` (benchmarks/run.py) from "
        "benchmarks/results.json: do not edit by hand -->",
        "",
        "`make bench` runs `benchmarks/` (never part of `make test`): every row is "
        "measured side by side with its baseline in the same run (interleaved "
        "repetitions, medians, warm-up excluded), printed as this table and written "
        "to `benchmarks/results.json` and `benchmarks/results.png`. Ratios are to "
        "the baseline named in the row; on a shared machine they move by up to "
        "about 10% between runs.",
        "",
        f"Machine: {report['machine']}; `{report['command']}` took "
        f"{report['seconds']:.0f} s.",
        "",
        table(rows),
        "",
        "![Every row against its target](results.png)",
    ]
    if any("breakdown" in row for row in rows):
        from benchmarks import bench_e2e

        lines += ["", "## Where the time goes", "", "ms per request, ours / dense:"]
        lines += ["", bench_e2e.table(rows)]
    load = [row for row in rows if row.get("suite") == "load"]
    if load:
        from benchmarks import bench_load

        bench_load.plot(load, DOCS / "load.png")
        lines += [
            "",
            "## Serving under load",
            "",
            "Suite `load`: one worker each, the clients `wrk`'s keep-alive "
            "connections (benchmarks/wrk.py), medians of the runs (ratio spread "
            "in brackets); ours' rows a call from its `GET /metrics`. Ours "
            "batches concurrent requests (`QARRAY_MAX_BATCH_ROWS`, "
            "`QARRAY_BATCH_WAIT_MS`); the stock server computes one request at a "
            "time.",
            "",
            bench_load.table(load),
            "",
            "![Throughput against concurrent clients](load.png)",
        ]
    peers = HERE / "peers_results.json"
    if peers.is_file():  # make bench-peers
        report_peers = json.loads(peers.read_text())
        lines += [
            "",
            "## Against torchao",
            "",
            f"`make bench-peers`: torch {report_peers['torch']}, torchao "
            f"{report_peers['torchao']}, {report_peers['threads']} threads; ours "
            f"with its CPU kernels {report_peers['kernels']}. Microseconds per "
            "call, weights hot / cold (a buffer of twice the last-level cache "
            "read between calls); the last column above 1 means ours is faster.",
            "",
            report_peers["table"],
        ]
    lines += [
        "",
        "[Performance notes](performance-notes.md) record what was profiled, "
        "optimised and tried for the rows above.",
    ]
    path.write_text("\n".join(lines) + "\n")


def _kept_rows(path: Path, ran: list[str]) -> list[dict]:
    """The rows of an earlier results.json from suites not run now."""
    if not path.is_file():
        return []
    # a row without a suite predates the tags: no suite would replace it
    rows = json.loads(path.read_text())["rows"]
    return [row for row in rows if row.get("suite", ran[0]) not in ran]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    # e2e runs last: it tunes this process's malloc like the servers' (see
    # bench_e2e.run), which the other suites should not measure under
    parser.add_argument(
        "--only",
        default="kernels,int4,matmul,conv,cache,http,scaling,e2e,served,calibration,"
        "lora,load",
    )
    parser.add_argument("--out", default=str(HERE / "results.json"))
    parser.add_argument("--plot", default=str(HERE / "results.png"))
    parser.add_argument(
        "--docs-only",
        action="store_true",
        help="write docs/performance.md from the results in --out, run nothing",
    )
    args = parser.parse_args()
    sys.path.insert(0, str(HERE.parent))
    if args.docs_only:
        report = json.loads(Path(args.out).read_text())
        plot(report["rows"], DOCS / "results.png")
        write_docs(report, DOCS / "performance.md")
        return
    from benchmarks import (
        bench_cache,
        bench_calibration,
        bench_conv,
        bench_e2e,
        bench_http,
        bench_int4,
        bench_kernels,
        bench_load,
        bench_lora,
        bench_matmul,
        bench_scaling,
        bench_served,
    )

    reps = 5 if args.quick else 41
    suites = {
        "kernels": lambda: bench_kernels.run(reps=5 if args.quick else 21),
        "matmul": lambda: bench_matmul.run(reps=reps),
        "conv": lambda: bench_conv.run(reps=5 if args.quick else 21),
        "int4": lambda: bench_int4.run(reps=5 if args.quick else 21),
        "cache": lambda: bench_cache.run(reps=reps),
        "http": lambda: bench_http.run(reps=50 if args.quick else 600),
        "scaling": lambda: bench_scaling.run(seconds=3.0 if args.quick else 8.0),
        "e2e": lambda: bench_e2e.run(reps=5 if args.quick else 31),
        "served": lambda: bench_served.run(reps=5 if args.quick else 21),
        "calibration": bench_calibration.run,
        "lora": lambda: bench_lora.run(reps=5 if args.quick else 11),
        "load": lambda: bench_load.run(
            runs=1 if args.quick else 3, seconds=2.0 if args.quick else 4.0
        ),
    }
    rows = []
    started = time.time()
    names = args.only.split(",")
    for name in names:
        print(f"running {name} ...", file=sys.stderr, flush=True)
        rows += [{**row, "suite": name} for row in suites[name]()]
    rows = _kept_rows(Path(args.out), names) + rows
    report = {
        "machine": machine(),
        "command": "make bench",
        "seconds": round(time.time() - started, 1),
        "rows": [{**r, "shape": list(r["shape"]), "met": met(r)} for r in rows],
    }
    # NumPy scalars (ratios, shapes) as plain JSON numbers
    as_json = json.dumps(report, indent=2, default=lambda v: v.item())
    Path(args.out).write_text(as_json + "\n")
    plot(rows, args.plot)
    plot(rows, DOCS / "results.png")
    write_docs(report, DOCS / "performance.md")
    print(f"Machine: {report['machine']}\n")
    print(table(rows))
    if any("breakdown" in row for row in rows):
        print("\nWhere the time goes, ms per request, ours / dense:\n")
        print(bench_e2e.table(rows))
    print(f"\nwrote {args.out} and {args.plot} in {report['seconds']} s")


if __name__ == "__main__":
    main()
