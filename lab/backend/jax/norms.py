"""Sums of squares of the tensors a JAX step reads, for their norms.

One function, `sum_of_squares`, used wherever a step computes a norm: the
probe of `fit()`'s step, the loss-scale tally and the probe of a
hand-written loop.
"""

import jax.numpy as jnp


def sum_of_squares(x):
    """The sum of the squares of x's elements, in float32.

    Computed as a matrix-vector product over the last axis: XLA on a CPU runs
    a plain reduction over every element of a tensor about twice as slowly
    as the product (the MLP's six gradients: 100 against 46 microseconds,
    `benchmarks/step_cost_jax.py` shows what it does to a step), which on a
    step of half a millisecond is the difference between a probe that costs
    a fifth of the step and one that costs little. `highest` keeps float32
    where a TPU would multiply in bfloat16.
    """
    squares = jnp.square(jnp.asarray(x).astype(jnp.float32))
    if squares.ndim == 0:
        return squares
    if squares.size == 0:
        return jnp.float32(0.0)
    rows = squares.reshape(-1, squares.shape[-1])
    return jnp.sum(jnp.matmul(rows, jnp.ones((rows.shape[1],), jnp.float32), precision="highest"))
