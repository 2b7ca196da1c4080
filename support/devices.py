"""Where the tests' own JAX programs run when they call a Tesseract served
in this process."""

import jax


def caller_device():
    """A context placing the caller's programs on the host's CPU: for a
    program that calls this process's Tesseract through tesseract-jax.
    tesseract-jax calls the Tesseract from a host callback inside the
    caller's program; on a TPU, where one program runs at a time, a caller's
    program holding the chip would wait on that callback while the
    callback's Tesseract program waits for the chip, for ever. A client of a
    served Tesseract runs on its own host the same way (docs/accelerators.md).
    On CPU this is the default device already."""
    return jax.default_device(jax.devices("cpu")[0])
