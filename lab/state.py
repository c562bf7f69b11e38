"""Model state on the host: read all the state a training step may change, write it back."""

import numpy as np
import tensorflow as tf

from lab import compat
from lab.probes import find_optimizers


def read_state(model):
    """A host copy of all the state a training step of `model` may change.

    Weights, non-trainable variables (random-seed state too), metric
    variables, and the slots and iterations of every optimizer the model
    holds. Costs one copy of that state in host memory.

    Args:
        model: keras.Model.

    Returns:
        dict, an opaque state for `write_state`.

    Example:

    ```python
    before = read_state(model)
    model.train_step((x, y))
    write_state(before)  # as if that step never ran
    ```
    """
    optimizers = list(find_optimizers(model).values())
    optimizers += [o.inner_optimizer for o in optimizers if getattr(o, "inner_optimizer", None) is not None]
    return read_variables(training_variables(model, optimizers, []))


def write_state(state):
    """Puts back a state taken by `read_state` (only variables that differ are written)."""
    for variable, array in state.values():
        if not same_array(np.asarray(variable.numpy()), array):
            variable.assign(array)


def training_variables(model, optimizers, created):
    """Every variable a step may change, by id of the tf.Variable behind it.

    `created` holds those outside the model's and optimizers' lists: made
    during a step, or a hand-written step's own metrics."""
    found = list(model.variables) + list(getattr(model, "metrics_variables", []))
    for layer in compat.all_layers(model):
        found += compat.recurrent_state_variables(layer)  # a stateful RNN's, in no variables list
    for optimizer in optimizers:
        found += list(optimizer.variables)
    found += list(created)
    unique = {}
    for variable in found:
        unique.setdefault(id(raw_variable(variable)), raw_variable(variable))
    return unique


def read_variables(variables):
    """dict id -> (variable, host copy of its value)."""
    # A copy: an in-place optimizer update may reuse a buffer numpy() still shares.
    return {key: (v, np.array(v.numpy(), copy=True)) for key, v in variables.items()}


def raw_variable(variable):
    """The tf.Variable behind a Keras variable (one identity for both)."""
    inner = getattr(variable, "_value", None)
    return inner if isinstance(inner, tf.Variable) else variable


def same_array(a, b):
    """Bit-for-bit equality (NaN equals NaN): what decides whether a step changed a variable."""
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()
