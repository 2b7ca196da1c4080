"""benchmarks/soak (`make soak`), kept honest in `make test`: a short run on
the small networks passes and writes its report; a wrong answer fails it; the
memory rule tells a leak from a plateau on synthetic curves; its JVP
reference is the transpose of the NumPy reference VJP."""

import json
import subprocess
import sys

import numpy as np
import pytest

from benchmarks.soak import memory, networks, references, settings, traffic
from support import network as net
from support.server import ROOT


def run_soak(tmp_path, *args, timeout=300):
    out, plot = tmp_path / "soak.json", tmp_path / "soak.png"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.soak",
            "--out",
            str(out),
            "--plot",
            str(plot),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
    report = json.loads(out.read_text()) if out.exists() else None
    return proc, report, plot


def test_a_short_soak_passes_and_writes_its_report(tmp_path):
    proc, report, plot = run_soak(
        tmp_path, "--seconds", "10", "--clients", "2", "--networks", "small"
    )
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    assert "soak passed" in proc.stdout
    assert report["ok"] is True and report["failures"] == []
    assert 9 < report["duration_s"] < 60
    for endpoint in settings.ENDPOINTS:
        stats = report["latency_ms"][endpoint]
        assert stats["count"] > 0
        assert 0 < stats["p50"] <= stats["p99"] <= stats["max"]
    # every malformed request of the catalogue was sent (in the warm-up at
    # least) and got a 4xx naming its field
    cases = traffic.bad_requests(np.random.default_rng(0))
    assert set(report["bad_requests"]) == {c[0] for c in cases}
    for statuses in report["bad_requests"].values():
        assert all(400 <= int(status) < 500 for status in statuses)
    assert report["requests"]["5xx_not_shedding"] == 0
    assert set(report["shed_503"]) == {"count", "gave_up"}
    memory = report["memory"]
    assert memory["growing"] is False
    samples = np.asarray(memory["samples"])
    assert len(samples) > 10
    assert np.all(samples[:, 1] > 0)
    assert np.median(np.diff(samples[:, 0])) == pytest.approx(0.5, abs=0.2)
    assert {"slopes_mib_per_min", "limit_mib_per_min", "rule"} <= set(memory)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_wrong_answer_fails_the_soak(tmp_path):
    proc, report, _ = run_soak(
        tmp_path, "--seconds", "10", "--networks", "small",
        "--inject-fault", "wrong-answer",
    )  # fmt: skip
    assert proc.returncode == 1, (proc.stdout[-3000:], proc.stderr[-3000:])
    assert "SOAK FAILED" in proc.stderr
    assert "wrong answer: s-kn apply: y: max |got - want| =" in proc.stderr
    assert report["ok"] is False
    assert report["failures"][0].startswith("wrong answer: s-kn apply")
    assert (tmp_path / "soak-wrong-0.json").exists()  # the request, to replay


# --- the memory rule on synthetic curves: 0.5 s samples over a 5-minute run

T = np.arange(0, 300, 0.5)


def noisy(curve, seed=0, sigma=3.0):
    return curve + np.random.default_rng(seed).normal(0, sigma, curve.shape)


@pytest.mark.parametrize(
    ("name", "mib", "growing"),
    [
        ("flat", noisy(np.full_like(T, 600.0)), False),
        ("leak-10-mib-per-min", noisy(600 + 10 * T / 60), True),
        ("leak-6-mib-per-min", noisy(600 + 6 * T / 60), True),
        ("slow-creep-1-mib-per-min", noisy(600 + T / 60), False),
        ("step-then-flat", noisy(np.where(T < 120, 600.0, 650.0)), False),
        ("cache-filling-up", noisy(650 - 50 * np.exp(-T / 40)), False),
        ("sawtooth", 600 + 30 * ((T % 20) / 20), False),
        ("leak-under-sawtooth", 600 + 30 * ((T % 20) / 20) + 8 * T / 60, True),
        ("leak-in-steps", noisy(600 + 10 * (T // 30)), True),  # 20 MiB/min
    ],
)
def test_memory_rule(name, mib, growing):
    verdict = memory.memory_verdict(T, mib, start=0.0, end=T[-1])
    assert verdict["growing"] is growing, verdict


def test_memory_rule_needs_samples():
    verdict = memory.memory_verdict([0.0, 0.5, 1.0], [1.0, 100.0, 1000.0])
    assert verdict["growing"] is False
    assert "too few samples" in verdict["note"]


# --- the soak's reference checks


@pytest.mark.parametrize("spec", networks.SPECS, ids=[s.name for s in networks.SPECS])
def test_reference_jvp_is_the_transpose_of_the_vjp(spec, rng):
    inputs, excused = spec.draw(rng)
    assert excused.shape == net.forward(inputs).shape[:-1]
    if spec.size == "small":
        assert not excused.any()  # small networks are redrawn until tie-free
    paths = net.diff_paths(inputs)
    tangents = {p: net.normal(rng, np.shape(net.at(inputs, p))) for p in paths}
    g = net.normal(rng, net.forward(inputs).shape)
    cotangents = net.vjp(inputs, g)
    lhs = np.sum(references.jvp(inputs, tangents) * g)
    rhs = sum(np.sum(tangents[p] * cotangents[p]) for p in paths)
    np.testing.assert_allclose(lhs, rhs, rtol=1e-10)


def test_nudged_weights_sit_away_from_rounding_ties(rng):
    w = net.normal(rng, (256, 512))
    near = networks._tie_gap(networks._steps(w)) < settings.W_TIE_MARGIN
    assert near.any()  # ties, before
    nudged = networks.nudge_ties(w)
    gap = networks._tie_gap(networks._steps(nudged))
    assert (gap >= settings.W_TIE_MARGIN).all()
    assert (gap[near] > 0.009).all()  # moved to 0.01 steps from the tie
    np.testing.assert_array_equal(nudged[~near], w[~near])
    np.testing.assert_array_equal(
        np.max(np.abs(nudged), axis=-1), np.max(np.abs(w), axis=-1)
    )
    assert np.max(np.abs(nudged - w)) < 0.02 * np.max(np.abs(w)) / 127
