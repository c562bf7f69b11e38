"""Keras' JAX trainer internals the lab reads, fenced in one place.

Each private attribute is read here only, with the fallback and the reason
beside it (as Keras' own `callbacks/tensorboard.py` fences the one it
needs). Checked on Keras 3.5 to 3.15 (`keras/src/backend/jax/trainer.py`).
"""

import contextlib
import sys
import threading


def live_state(model):
    """The arrays `fit()` trains on between batches, or None outside fit().

    During `fit()` the JAX trainer keeps the state outside the Keras
    variables (`_jax_state`, synced back at epoch end). Reading
    `callback.model` would sync it into the variables on every batch (1.1 to
    1.4x slower), so the lab reads this dict instead and never syncs.
    """
    state = getattr(model, "_jax_state", None)
    if not state or getattr(model, "_jax_state_synced", True):
        return None
    return state


def optimizer_values(model, variables=None):
    """The current values of the optimizer part of the state fit() threads
    through the step: the arrays fit() holds while it runs, else the values
    of `variables` (that part's variables in its order, see
    `optimizer_state_variables`; default `model.optimizer.variables`)."""
    state = live_state(model)
    if state is not None and state.get("optimizer_variables") is not None:
        return state["optimizer_variables"]
    if variables is None:
        variables = model.optimizer.variables
    return [variable.value for variable in variables]


def optimizer_state_variables(model, candidates):
    """The variables of `candidates` whose values make up the optimizer part
    of the state `fit()` threads through the step, in that part's order; or
    None where the part holds a value that is none of theirs.

    Keras' trainer carries `model.optimizer.variables` there
    (`_get_jax_state`, Keras 3.5 to 3.15). A model that trains with
    optimizers of its own (a GAN's two) overrides `_get_jax_state` and
    `jax_state_sync` to carry theirs, in an order of its choosing: the
    values it returns are the variables' own arrays, matched here by
    identity. Called between fits, while the variables hold their values.
    """
    by_id = {id(variable.value): variable for variable in candidates}
    values = model._get_jax_state(optimizer_variables=True)[0]
    found = [by_id.get(id(value)) for value in values]
    return None if any(variable is None for variable in found) else found


def update_step_owner(optimizer):
    """The optimizer object whose `_backend_update_step` runs the update:
    a LossScaleOptimizer's inner optimizer, which sees unscaled gradients."""
    return getattr(optimizer, "inner_optimizer", None) or optimizer


# The method every Keras optimizer runs its update through, with the
# gradients it applies (after unscaling, clipping and accumulation).
UPDATE_STEP = "_backend_update_step"


def calling_model_call(depth=3):
    """Which of `fit` / `evaluate` / `predict` of a Keras trainer called
    `set_model` (Keras makes the CallbackList inside them), or None."""
    frame = sys._getframe(depth)
    for _ in range(8):
        if frame is None:
            return None
        name = frame.f_code.co_name
        if name in ("fit", "evaluate", "predict") and "keras" in frame.f_code.co_filename:
            return name
        frame = frame.f_back
    return None


def untrack(optimizer, variables):
    """Takes variables the lab added with `add_variable` out of the
    optimizer again: out of its tracker's store (which is its `_variables`
    list) and its `variables`."""
    tracker = optimizer._tracker
    for variable in variables:
        tracker.untrack(variable)


def track(optimizer, variable):
    """Adds a variable made outside the optimizer to its `variables` (what
    `add_variable` does after making one), so fit() carries it in the
    optimizer's part of the state."""
    optimizer._track_variable(variable)


# Keras' JAX fit() calls this in its `finally`, after syncing the state back
# into the variables, whether training ended or raised (Keras 3.5 to 3.15).
FIT_END = "finalize_variable_values"


def fit_end_hook_owner(model):
    """The object whose `FIT_END` method fit() calls as it ends, or None."""
    import keras

    optimizer = getattr(model, "optimizer", None)
    return optimizer if isinstance(optimizer, keras.optimizers.Optimizer) else None


def applies_inside_cond(optimizer):
    """Whether `optimizer` runs its update inside a `lax.cond` branch, whose
    values cannot leave it but as returned state: a LossScaleOptimizer
    applies only on finite steps (`ops.cond(finite, ...)`)."""
    import keras

    return isinstance(optimizer, keras.optimizers.LossScaleOptimizer)


def batches_on_device():
    """Whether Keras' JAX `fit()` puts each batch on the device before
    `train_step` gets it, which turns its leaves' dtypes into JAX's own
    (float64 into float32, int64 into int32, where 64-bit values are off).

    Keras 3.15 hands a CPU's batches on as the data gave them, and puts
    them on the device elsewhere (`JAXEpochIterator._get_iterator`, which
    then has `_one_batch_ahead_iterator`); earlier releases put every batch
    on the device (they have `_prefetch_numpy_iterator` instead). Under a
    `keras.distribution`, every release does."""
    import jax
    import keras
    from keras.src.backend.jax.trainer import JAXEpochIterator

    if keras.distribution.distribution() is not None:
        return True
    if hasattr(JAXEpochIterator, "_one_batch_ahead_iterator"):
        return jax.default_backend() != "cpu"
    return True


def jax_started():
    """Whether JAX has started its backends (after which the number of CPU
    devices is fixed)."""
    from jax._src import xla_bridge

    started = getattr(xla_bridge, "backends_are_initialized", None)
    if started is not None:
        return started()
    return bool(getattr(xla_bridge, "_backends", None))


def set_cpu_device_count(n):
    """Asks JAX for `n` CPU devices when it starts: the `jax_num_cpu_devices`
    option where this JAX has it, else XLA's host platform flag."""
    import os

    import jax

    try:
        jax.config.update("jax_num_cpu_devices", n)
        return
    except AttributeError:  # an older JAX without the option
        pass
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(
        "--xla_force_host_platform_device_count")]
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={n}"])


def build_for(model, batch):
    """Builds what `fit()` builds before its first step (compiled metrics and
    loss, the optimizer) from one batch, so a step run outside `fit()` sees
    the state it will have (Keras' `_symbolic_build`, 3.11 to 3.15)."""
    model._symbolic_build(data_batch=batch)


@contextlib.contextmanager
def state_shardings_recorded(model):
    """For a `train_step(state, data)` traced or run outside `fit()`: the JAX
    `train_step` of Keras 3.11 (not of 3.15) lays its state out by the shardings
    `fit()` records before its first step (`_record_training_state_sharding_spec`,
    cleared after it by `_clear_jax_state_sharding`); later releases need
    nothing. A no-op where the trainer has no such record."""
    record = getattr(model, "_record_training_state_sharding_spec", None)
    if record is None or getattr(model, "_trainable_variable_shardings", None) is not None:
        yield  # none to make, or fit() (or an outer block) made it
        return
    absent = [name for name in _SHARDING_RECORDS if name not in vars(model)]
    record()
    try:
        yield
    finally:
        for name in _SHARDING_RECORDS:
            if name in absent:
                vars(model).pop(name, None)  # leaves the model as it was: no attribute fit() did not make
            else:
                setattr(model, name, None)  # as `_clear_jax_state_sharding` leaves them


_SHARDING_RECORDS = ("_trainable_variable_shardings", "_non_trainable_variable_shardings",
                     "_optimizer_variable_shardings", "_metrics_variable_shardings")


@contextlib.contextmanager
def trainer_jit(replace):
    """Within the block, the JAX trainer jits its step functions through
    `replace(jit)`, where `jit` is its own (`jax.jit`, or `nnx.jit`): the
    trainer's `make_train_function` calls `jit(step_fn, donate_argnums=0,
    out_shardings=...)` through the module's name `jit` (3.11 to 3.15), so
    the lab can make two compiled steps from the one `train_step` and keep
    whatever Keras passes. Yields whether it could: a trainer without that
    name (an other release) jits as it always does. One block at a time
    (`_TRAINER_JIT`): two threads making train functions at once would
    otherwise put back each other's replacement, and leave one in place."""
    from keras.src.backend.jax import trainer

    with _TRAINER_JIT:
        own = getattr(trainer, "jit", None)
        if own is None or not callable(own):
            yield False
            return
        trainer.jit = replace(own)
        try:
            yield True
        finally:
            trainer.jit = own


_TRAINER_JIT = threading.RLock()


def is_traced(value):
    """Whether `value` is a tracer: the step is being traced, not run."""
    import jax

    return isinstance(value, jax.core.Tracer)
