"""The training state on JAX, between batches of a running fit().

During `fit()` Keras' JAX trainer keeps the state (weights, optimizer and
metric variables) in arrays outside the Keras variables, which it empties;
it puts them back at epoch ends and when `fit()` ends. A batch begins by
reading the state from the variables again whenever they were brought up to
date meanwhile (`_jax_state_synced`, set by `jax_state_sync()`), so
whatever the variables hold then is what the next batch trains on.

JAX arrays are immutable: a state read here is the arrays themselves, no
copy, valid until a jitted step that donates them (fit()'s) consumes them.
"""

from lab.signals import uninterrupted


def hold_state(model):
    """Puts the state a running `fit()` holds into the model's variables.

    Afterwards `model.weights` and `optimizer.variables` read as after the
    last batch, a stepper can step them, and `fit()` takes them up again at
    its next batch. It is Keras' own `jax_state_sync()` (what reading a
    callback's `model` does at every read); outside `fit()` it does nothing.

    Args:
        model: keras.Model.
    """
    sync = getattr(model, "jax_state_sync", None)
    if sync is not None:
        sync()


def state_variables(model):
    """The variables of the training state, in the order Keras' JAX trainer
    passes them to `train_step`: trainable, non-trainable, the optimizer's
    (a Recorder's ring too, while one records), the metrics'."""
    optimizer = getattr(model, "optimizer", None)
    return (list(model.trainable_variables), list(model.non_trainable_variables),
            list(optimizer.variables) if optimizer is not None else [], list(model.metrics_variables))


def read_state(model):
    """The model's training state as its variables hold it (call `hold_state` first during fit()).

    Args:
        model: keras.Model.

    Returns:
        list of (variable, array) pairs, an opaque state for `write_state`.
    """
    return [(v, v.value) for variables in state_variables(model) for v in variables]


def pair_state(variable_lists, arrays):
    """A state for `write_state` from a step's input state: arrays in the
    order of `variable_lists` (`state_variables` when the step ran)."""
    pairs = []
    for variables, values in zip(variable_lists, arrays, strict=True):
        pairs += zip(variables, values, strict=True)
    return pairs


def write_state(state, skip=()):
    """Puts back a state (only variables whose array changed are written),
    whole: a Ctrl-C meanwhile is raised once all are written.

    Args:
        state: list of (variable, array) pairs (`read_state`, `pair_state`).
        skip: collection of variables to leave as they are.
    """
    skipped = {id(v) for v in skip}
    with uninterrupted():
        for variable, array in state:
            if id(variable) not in skipped and variable.value is not array:
                variable.assign(array)
