"""Execution modes: eager, graph (tf.function) and XLA."""

MODES = ("eager", "graph", "xla")


def current_mode(model):
    """The mode the model's next train step runs in: "eager", "graph" or "xla"."""
    if model.run_eagerly:
        return "eager"
    if model.jit_compile is True:
        return "xla"
    return "graph"


def set_mode(model, mode):
    """Switches how the model's steps run, keeping weights and optimizer state.

    Sets `run_eagerly` / `jit_compile` and drops the cached train, test and
    predict functions (Keras' setters do not), so the next batch runs in the
    new mode. Allowed between batches of a running `fit()`.

    Args:
        model: keras.Model, compiled.
        mode: str, one of "eager", "graph", "xla".

    Returns:
        str, the previous mode.
    """
    if mode not in MODES:
        raise ValueError(f"Unknown mode {mode!r}; use one of {', '.join(MODES)}.")
    previous = current_mode(model)
    model.run_eagerly = mode == "eager"
    model.jit_compile = mode == "xla"
    model.train_function = None
    model.test_function = None
    model.predict_function = None
    return previous
