"""Sums of squares of the tensors a JAX step reads, for their norms.

`sum_of_squares` is one tensor's, used wherever a step computes a norm: the
probe of `fit()`'s step, the loss-scale tally and the probe of a
hand-written loop. `sums_of_squares` is many tensors' at once, the way the
probes take every variable's norm in a step: tensors of the same size are
stacked and summed together, so that a model of many small variables does
not pay a kernel per variable.
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


# The largest tensor (in elements) that is stacked with others of its size:
# above it a tensor's own reduction outweighs what a kernel costs to start.
STACKED_AT_MOST = 1 << 16
# The fewest tensors of one size that are stacked: a stack is a kernel too.
STACKED_AT_LEAST = 4
# The most elements one stack holds (a bound on the copy the step makes).
STACK_ELEMENTS = 1 << 22


def sums_of_squares(tensors, minus=None):
    """Each tensor's sum of squares in float32, or with `minus` (tensors of
    the same shapes) each difference's: `[sum((t - m)**2) for t, m in ...]`.

    XLA on a CPU runs every reduction as a kernel of its own, at a few
    microseconds each however small the tensor: the 25 biases of a 25-layer
    MLP, 64 elements each, added a seventh to its step of 0.7 ms. So tensors
    of one size, at least `STACKED_AT_LEAST` of them and up to
    `STACKED_AT_MOST` elements each, are flattened into one stack and
    reduced together (that MLP's gradients: 1.20 of the bare step one by
    one, 1.07 stacked; `benchmarks/step_cost_jax.py --model deep`); the
    others are reduced alone.
    """
    tensors = [jnp.asarray(t).astype(jnp.float32) for t in tensors]
    if minus is not None:
        tensors = [t - jnp.asarray(m).astype(jnp.float32) for t, m in zip(tensors, minus)]
    sums = [None] * len(tensors)
    stacks = {}
    for i, tensor in enumerate(tensors):
        if 0 < tensor.size <= STACKED_AT_MOST:
            stacks.setdefault(tensor.size, []).append(i)
    for size, members in stacks.items():
        if len(members) < STACKED_AT_LEAST:
            continue
        per_stack = max(STACKED_AT_LEAST, STACK_ELEMENTS // size)
        for start in range(0, len(members), per_stack):
            chunk = members[start:start + per_stack]
            found = jnp.sum(jnp.square(jnp.stack([tensors[i].reshape(-1) for i in chunk])), axis=1)
            for j, i in enumerate(chunk):
                sums[i] = found[j]
    # Alone, a tensor keeps its shape: the product runs over its last axis.
    return [sum_of_squares(tensor) if found is None else found for tensor, found in zip(tensors, sums)]
