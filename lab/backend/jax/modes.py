"""Execution modes on JAX: `train_step` as Python ("eager") or under `jax.jit` ("xla").

JAX has no counterpart of TensorFlow's graph mode without XLA: `jax.jit`
always compiles with XLA. Switching modes while `fit()` runs is not built
on this backend yet (`lab.set_mode` says so); this module tells the mode a
model trains in, and lets the hooks layer make a clean train function in it.
"""

import contextlib

MODES = ("eager", "xla")


def current_mode(model):
    """The mode the model's next train function is made in: "eager" or "xla"."""
    if model.run_eagerly or not model.jit_compile:
        return "eager"
    return "xla"


def running_mode(model):
    """The mode of the train function the model runs. Keras' JAX trainer
    makes its function from the attributes when it is made; the lab makes
    it again whenever it installs or removes hooks, so the two agree."""
    return current_mode(model)


@contextlib.contextmanager
def made_in(model, mode):
    """Has a train function made in the block be made in `mode`; the
    attributes are put back after it."""
    if mode == current_mode(model):
        yield
        return
    saved = (model.run_eagerly, model.jit_compile)
    if mode == "eager":
        model.jit_compile = False
        model.run_eagerly = True
    else:
        model.run_eagerly = False
        model.jit_compile = True
    try:
        yield
    finally:
        model.run_eagerly = False
        model.jit_compile, model.run_eagerly = saved[1], saved[0]
