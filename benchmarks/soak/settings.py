"""The soak run's constants: endpoints, tolerances, the memory rule, timeouts."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENDPOINTS = ("apply", "vector_jacobian_product", "jacobian_vector_product")
SHORT = {"apply": "apply", "vector_jacobian_product": "vjp"}
SHORT["jacobian_vector_product"] = "jvp"
RTOL = ATOL = 2e-4  # small networks, elementwise (as tests/tesseract/test_http.py)
# mid networks: max |got - want| <= SCALE_TOL x max |want| (the worst seen in
# a 10-minute run: 1.2e-6)
SCALE_TOL = 1e-4
# Where server (float32) and reference (float64) could round apart, in
# quantization steps of the value's row: a dense w is exact float32 (only the
# division's last bit differs): its values this close to a tie are nudged
# away at draw time. An int8 activation carries float32 rounding from the
# layers before it: within TIE_ABS + TIE_REL x (its value in steps) of a tie
# (x itself: X_TIE_REL), its row is "near a tie". Measured on m-nk-int8 (40
# draws, 1280 rows): the 2 rows that disagree are both caught from
# TIE_REL = 1e-6 on; 4e-6 leaves out ~18% of its rows.
W_TIE_MARGIN = 1e-3
TIE_ABS, TIE_REL, X_TIE_REL = 2e-5, 4e-6, 1e-6
# a relu's pre-activation within this share of its row's largest |z| of 0: the
# derivative could be taken on either side
KINK = 1e-5
SAMPLE_EVERY = 0.5  # seconds between RSS samples
# memory rule (memory_verdict)
SETTLE_SHARE, SETTLE_MAX = 0.25, 30.0  # left out: this share, at most SETTLE_MAX s
SLOPE_MIN = 1.5  # MiB per minute: the least slope called growing
RISE_MIN = 15.0  # MiB: ... and at least this much over the judged window
MAX_ERROR_BODY = 4096  # bytes: a 4xx body stays small
RETRIES = 6
WARMUP_TIMEOUT = 900  # seconds: the warm-up compiles every program
TIMEOUT = 120
