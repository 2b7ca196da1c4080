"""Small models the tests and the benchmarks both measure."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np


class Outliers(eqx.Module):
    """Three Linear layers whose every input has outlier channels (a fixed
    gain of 50 on three hidden channels, as a LayerNorm's weight makes
    them in a transformer)."""

    l1: eqx.nn.Linear
    l2: eqx.nn.Linear
    l3: eqx.nn.Linear
    gain: jax.Array

    def __init__(self, key):
        k = jax.random.split(key, 3)
        self.l1 = eqx.nn.Linear(64, 128, key=k[0])
        self.l2 = eqx.nn.Linear(128, 128, key=k[1])
        self.l3 = eqx.nn.Linear(128, 16, key=k[2])
        gain = np.ones(128, np.float32)
        gain[[5, 70, 99]] = 50.0
        self.gain = jnp.asarray(gain)

    def __call__(self, x):
        h = self.gain * jax.nn.relu(self.l1(x))
        h = self.gain * jax.nn.relu(self.l2(h)) / 10
        return self.l3(h)
