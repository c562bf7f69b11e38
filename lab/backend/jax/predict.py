"""Streaming prediction on JAX: one batch of inputs and outputs alive at a time."""

import itertools

import jax
import keras
import numpy as np

from lab.arguments import check_predict_stream_options


def predict_stream(model, data, batch_size=32, collect=None, steps=None):
    """Predicts batch by batch, yielding each batch's predictions as numpy.

    Only one batch of inputs and outputs is alive at a time (plus what the
    caller keeps), whatever the size of `data`. Each batch runs the model's
    own `predict_step` on its state, jitted once (as `model.predict` runs
    it); the model's variables are not changed.

    Args:
        model: keras.Model, built or buildable on the data.
        data: a numpy array, or a list / tuple / dict of them for a
            multi-input model (sliced into batches of `batch_size`); or a
            `keras.utils.PyDataset`, a generator or any other iterable
            yielding batches as `model.predict` takes them (`x`, `(x,)` or
            `(x, y)`; `y` is ignored).
        batch_size: int, samples per batch for arrays.
        collect: callable or None. When given, every batch is predicted here
            and `collect(y_pred, batch)` is called per batch; the number of
            samples predicted is returned.
        steps: int or None, stop after this many batches.

    Returns:
        A generator of per-batch predictions, or with `collect` the number of
        samples predicted.

    Example:

    ```python
    total = 0
    for y_pred in lab.predict_stream(model, x_big, batch_size=1024):
        total += (y_pred.argmax(-1) == 3).sum()
    ```
    """
    check_predict_stream_options(model, batch_size, steps, collect)
    batches = _batches(data, batch_size)
    if steps is not None:
        batches = itertools.islice(batches, int(steps))
    stream = _predicted(model, batches)
    if collect is None:
        return (y_pred for y_pred, _ in stream)
    count = 0
    for y_pred, batch in stream:
        collect(y_pred, batch)
        count += len(jax.tree_util.tree_leaves(y_pred)[0])
    return count


def _is_arrays(data):
    leaves = jax.tree_util.tree_leaves(data)
    return bool(leaves) and all(isinstance(leaf, (np.ndarray, jax.Array)) for leaf in leaves) and \
        isinstance(data, (np.ndarray, jax.Array, list, tuple, dict))


def _batches(data, batch_size):
    if _is_arrays(data):
        leaves = jax.tree_util.tree_leaves(data)
        length = len(leaves[0])
        if any(len(leaf) != length for leaf in leaves):
            raise ValueError(f"predict_stream: the input arrays have different lengths "
                             f"({sorted({len(leaf) for leaf in leaves})}); give arrays of one length.")
        sliced = (jax.tree_util.tree_map(lambda leaf, s=start: leaf[s:s + batch_size], data)
                  for start in range(0, length, batch_size))
        return ((x, x) for x in sliced)  # arrays are the inputs themselves, a tuple of them included
    if isinstance(data, keras.utils.PyDataset):
        return ((_inputs(data[i]), data[i]) for i in range(len(data)))
    try:
        return ((_inputs(batch), batch) for batch in iter(data))
    except TypeError:
        raise TypeError(f"predict_stream: data must be arrays, a PyDataset or an iterable of batches; got "
                        f"{type(data).__name__}.") from None


def _inputs(batch):
    """`x` of a yielded batch as `model.predict` reads it (`x`, `(x,)` or `(x, y[, w])`)."""
    if isinstance(batch, tuple) and 1 <= len(batch) <= 3:
        return batch[0]
    return batch


def _predicted(model, batches):
    function = None
    for x, batch in batches:
        if not model.built:
            model(x)
        if function is None:
            variables = ([v.value for v in model.trainable_variables], [v.value for v in model.non_trainable_variables])
            function = jax.jit(lambda state, data: model.predict_step(state, (data,)))
        y_pred, _ = function(variables, x)
        yield jax.tree_util.tree_map(np.asarray, y_pred), batch
