"""A server's memory (qarray/tesseract/_memory.py), in fresh processes and
measured by glibc's own accounting (``mallinfo2``): ``keep_freed_memory``
serves a 16 MiB block from the heap instead of a fresh mapping and keeps it
mapped once freed, unless the environment sets malloc's thresholds;
``release_freed_memory`` hands it back; ``freeze_startup_objects`` collects,
then keeps what is left out of the collector's reach. (That a started worker
freezes its start-up: tests/tesseract/test_supervisor.py.)

Covers: qarray/tesseract/_memory.py
"""

import ctypes
import json
import os
import subprocess
import sys

import pytest

if not hasattr(ctypes.CDLL(None), "mallinfo2"):
    pytest.skip("needs glibc's malloc (mallinfo2)", allow_module_level=True)

BLOCK = 16 * 2**20  # over glibc's default mmap threshold, under the server's

MALLINFO = """
import ctypes, json, sys
class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks",
        "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def block(size):
    '''(bytes mapped for it, free heap bytes once it is freed)'''
    before = libc.mallinfo2().hblkhd
    pointer = libc.malloc(size)
    mapped = libc.mallinfo2().hblkhd - before
    libc.free(pointer)
    return mapped, libc.mallinfo2().fordblks
"""


def run(code, **env):
    """Runs ``code`` after MALLINFO in a fresh process (no MALLOC_* variables
    but ``env``'s); its last line printed, as JSON."""
    out = subprocess.run(
        [sys.executable, "-c", MALLINFO + code],
        env={
            **{k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")},
            "JAX_PLATFORMS": "cpu",
            **env,
        },
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.splitlines()[-1])


def test_freed_memory_is_kept_for_the_next_request_and_released_after_loading():
    # glibc alone (nothing imported): the block is a mapping of its own
    mapped, _ = run(f"print(json.dumps(block({BLOCK})))")
    assert mapped >= BLOCK
    tuned, (mapped, free), released = run(
        "from qarray.tesseract._memory import keep_freed_memory, release_freed_memory\n"
        f"tuned = keep_freed_memory(); sizes = block({BLOCK})\n"
        "release_freed_memory()\n"
        "print(json.dumps([tuned, sizes, libc.mallinfo2().fordblks]))"
    )
    assert tuned is True
    assert mapped == 0 and free >= BLOCK  # from the heap, and kept there
    assert released < BLOCK  # handed back


def test_malloc_settings_in_the_environment_win():
    tuned, (mapped, _) = run(
        "from qarray.tesseract._memory import keep_freed_memory\n"
        f"print(json.dumps([keep_freed_memory(), block({BLOCK})]))",
        MALLOC_MMAP_THRESHOLD_="65536",
    )
    assert tuned is False and mapped >= BLOCK


def test_start_up_objects_are_collected_then_frozen():
    garbage_collected, frozen, tracked = run(
        "import gc, weakref\n"
        "from qarray.tesseract._memory import freeze_startup_objects\n"
        "class Node: pass\n"
        "cycle = Node(); cycle.me = cycle; dead = weakref.ref(cycle); del cycle\n"
        "kept = [Node()]\n"
        "gc.disable(); freeze_startup_objects()\n"
        "print(json.dumps([dead() is None, gc.get_freeze_count(),"
        " any(o is kept for o in gc.get_objects())]))"
    )
    assert garbage_collected  # collected before freezing
    assert frozen > 1000 and not tracked  # what was left: out of the collector's reach
