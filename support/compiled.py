"""Models called as one compiled program each, shared by the tests.

Called eagerly, an equinox model runs op by op, one XLA program per op and
shape (~0.1-0.2 s of compile each on a TPU: most of the accelerator suite's
time). Through these, a model compiles once per structure and shape, and
every test file that calls the same kind of model reuses the program. Tests
keep their eager calls where eager execution is the point.
"""

import equinox as eqx
import jax


@eqx.filter_jit
def call(model, *args, **kwargs):
    """``model(*args, **kwargs)``."""
    return model(*args, **kwargs)


@eqx.filter_jit
def vcall(model, xs):
    """``model`` on each example of ``xs`` (its leading axis)."""
    return jax.vmap(model)(xs)


@eqx.filter_jit
def filter_vcall(model, xs):
    """``vcall`` by ``eqx.filter_vmap`` (a model with non-array leaves)."""
    return eqx.filter_vmap(model)(xs)
