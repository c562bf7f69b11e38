"""Model state on the host: read all the state a training step may change, write it back."""

import weakref

import numpy as np
import tensorflow as tf

from lab.backend.tensorflow import compat
from lab.signals import uninterrupted  # noqa: F401  (the stepper's writes; one copy for every backend)
from lab.variables import find_optimizers


def read_state(model):
    """A host copy of all the state a training step of `model` may change.

    Weights, non-trainable variables (random-seed state too), metric
    variables, the slots and iterations of every optimizer the model
    holds, and any other tf.Variable it holds (see `held_variables`);
    under a tf.distribute strategy, each replica's copy. Costs one copy
    of that state in host memory.

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
    """Puts back a state taken by `read_state` (only variables that differ are
    written), whole: a Ctrl-C meanwhile is raised once all are written."""
    with uninterrupted():
        for variable, array in state.values():
            if not replicated(variable) and not same_array(np.asarray(variable.numpy()), array):
                variable.assign(array)


def training_variables(model, optimizers, created):
    """Every variable a step may change, by id of the tf.Variable behind it.

    `created` holds those outside the model's and optimizers' lists: made
    during a step, or a hand-written step's own metrics. Any other
    tf.Variable the model holds is there too (`held_variables`: a step
    counter, a `tf.random.Generator`, optimizers kept in a list). A
    variable with one copy per replica (`replicated`) comes with each of its
    copies, by their own ids: write those, never it (its value reads one
    replica's, or their sum)."""
    found = list(model.variables) + list(getattr(model, "metrics_variables", []))
    for layer in compat.all_layers(model):
        found += compat.recurrent_state_variables(layer)  # a stateful RNN's, in no variables list
    for optimizer in optimizers:
        found += list(optimizer.variables)
    found += list(created)
    unique = {}
    for variable in found:
        unique.setdefault(id(raw_variable(variable)), raw_variable(variable))
    for key, variable in _held_beyond(model, unique).items():
        unique.setdefault(key, variable)
    for variable in list(unique.values()):
        if replicated(variable):
            for copy in replica_copies(variable):
                unique.setdefault(id(copy), copy)
    return unique


# model -> (how many variables its lists held, the held variables beyond them)
_HELD_BEYOND = weakref.WeakKeyDictionary()


def _held_beyond(model, listed):
    """The variables `held_variables` finds on `model` beyond `listed` (a
    tf.Variable attribute counting steps, a `tf.random.Generator`'s state).
    Walking the object graph costs about 10 ms for 50 layers, so the
    answer is kept while the lists hold as many variables as when it was
    found; a step's new variables are its caller's to add (`created`)."""
    kept = _HELD_BEYOND.get(model)
    if kept is None or kept[0] != len(listed):
        beyond = {key: v for key, v in held_variables(model).items() if key not in listed}
        kept = (len(listed), beyond)
        _HELD_BEYOND[model] = kept
    return kept[1]


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


def held_variables(model):
    """Every tf.Variable `model` holds, wherever it holds it: besides its
    layers' and optimizers' lists, a tf.Variable on the model or a layer (a
    step counter), a `tf.random.Generator`'s state, and the variables of
    optimizers (and any other trackable) kept in a list, tuple or dict
    attribute, which TensorFlow's object graph does not reach through
    Keras' tracked containers. By id of the tf.Variable behind each."""
    roots, seen_roots = [model], {id(model)}
    for layer in compat.all_layers(model):
        for value in vars(layer).values():
            for item in _container_items(value):
                if isinstance(item, tf.__internal__.tracking.Trackable) and id(item) not in seen_roots:
                    seen_roots.add(id(item))
                    roots.append(item)
    found = {}
    for root in roots:
        objects = [root] + list(tf.train.TrackableView(root).descendants())
        for item in objects:
            inner = getattr(item, "inner_optimizer", None)  # a LossScaleOptimizer's, if not reached
            for candidate in [item] + (list(inner.variables) if inner is not None else []):
                variable = raw_variable(candidate)
                if isinstance(variable, tf.Variable):
                    found.setdefault(id(variable), variable)
    return found


def _container_items(value):
    """The items of a list, tuple or dict attribute (nested ones too); nothing for anything else."""
    if isinstance(value, dict):
        value = list(value.values())
    if not isinstance(value, (list, tuple)):
        return []
    items = []
    for item in value:
        items += _container_items(item) if isinstance(item, (list, tuple, dict)) else [item]
    return items


def replica_copies(variable):
    """The per-device copies of a variable: each replica's under a
    tf.distribute strategy (they may differ: a BatchNormalization's moving
    statistics are kept per replica), the variable itself otherwise."""
    copies = getattr(variable, "values", None)
    if isinstance(variable, tf.distribute.DistributedValues) and copies:
        return tuple(copies)
    return (variable,)


def replicated(variable):
    """True for a variable kept as one copy per replica: restore its copies, not it."""
    return len(replica_copies(variable)) > 1
