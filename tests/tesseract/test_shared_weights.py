"""One copy of the resident weights for every worker
(qarray.tesseract._shared_weights): the first worker loads and writes the
segment, every worker maps it read-only; a worker killed leaves the others
serving."""

import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import requests

from qarray.checkpoint import save_model
from qarray.tesseract import _shared_weights as shared
from support import network as net
from support.server import b64, decode, serve, server_processes


def _tree(rng):
    return {
        "qvalue": rng.integers(-127, 128, (33, 17), dtype=np.int8),
        "scale": rng.random(33).astype(np.float32),
        "layout": "nk",
        "bias": None,
    }


def test_the_first_worker_loads_the_others_map(tmp_path):
    rng = np.random.default_rng(0)
    model = tmp_path / "model.bin"
    model.write_bytes(b"stands for a model file")
    tree = _tree(rng)
    loads = []

    def load():
        loads.append(1)
        return dict(tree)

    first = shared.load_shared(str(model), load, tmp_path)
    second = shared.load_shared(str(model), load, tmp_path)
    assert loads == [1]  # the second found the segment
    for got in (first, second):
        assert got["layout"] == "nk" and got["bias"] is None
        np.testing.assert_array_equal(got["qvalue"], tree["qvalue"])
        np.testing.assert_array_equal(got["scale"], tree["scale"])
    # a new model file (its time of change) is a new segment
    os.utime(model, ns=(1, 1))
    shared.load_shared(str(model), load, tmp_path)
    assert loads == [1, 1]


def test_shared_weights_are_read_only(tmp_path):
    rng = np.random.default_rng(1)
    tree = _tree(rng)
    segment = tmp_path / "s.weights"
    shared._write(segment, tree)
    mapped = shared.map_segment(segment)
    # JAX aliases the mapping (no private copy) ...
    view = np.asarray(mapped["qvalue"])
    assert not view.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        view[0, 0] = 1
    # ... and the mapping itself refuses writes: the kernel's page
    # protection, not a flag another worker could clear
    maps = Path("/proc/self/maps").read_text().splitlines()
    lines = [line for line in maps if line.endswith(str(segment))]
    assert lines and all(line.split()[1] == "r--s" for line in lines)
    address = view.__array_interface__["data"][0]
    assert any(
        int(line.split()[0].split("-")[0], 16)
        <= address
        < int(line.split()[0].split("-")[1], 16)
        for line in lines
    )


def test_workers_share_one_copy_and_survive_a_killed_worker(tmp_path):
    rng = np.random.default_rng(2)
    layers = [
        net.make_layer(rng, 64, 48, "nk", "w_q", True, "relu"),
        net.make_layer(rng, 48, 8, "nk", "w", False, "none"),
    ]
    model = tmp_path / "model.safetensors"
    save_model(model, layers)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    want = np.stack([net.forward_one(row, layers)[0] for row in x])
    with serve(tmp_path, env={"QARRAY_MODEL": str(model)}, workers=2) as url:

        def answer():
            r = requests.post(
                f"{url}/apply", json={"inputs": {"x": b64(x)}}, timeout=60
            )
            assert r.status_code == 200, r.text
            return decode(r.json())["y"]

        for _ in range(6):  # new connections: both workers answer
            np.testing.assert_allclose(answer(), want, rtol=2e-4, atol=2e-4)
        workers = server_processes(url)[1:]
        segments = [
            {
                line.split()[-1]
                for line in Path(f"/proc/{w.pid}/maps").read_text().splitlines()
                if line.endswith(".weights")
            }
            for w in workers
            if any("qarray" in part or "python" in part for part in w.cmdline())
            and Path(f"/proc/{w.pid}/maps").read_text().count(".weights")
        ]
        # both workers map the same segment
        assert len(segments) == 2 and segments[0] == segments[1], segments
        # a worker killed (mid-request or not) leaves the other serving
        victim = next(
            w for w in workers if ".weights" in Path(f"/proc/{w.pid}/maps").read_text()
        )
        os.kill(victim.pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        served = 0
        while served < 4 and time.monotonic() < deadline:
            try:
                np.testing.assert_allclose(answer(), want, rtol=2e-4, atol=2e-4)
                served += 1
            except requests.ConnectionError:  # the dead worker's socket
                time.sleep(0.2)
        assert served == 4
