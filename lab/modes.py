"""Execution modes: eager, graph (tf.function) and XLA, and switching between them.

Keras caches the compiled train, test and predict functions, and its
`run_eagerly` / `jit_compile` setters do not drop them: flipping an attribute
alone changes nothing until the next `compile()`. `set_mode` sets the
attributes and rebuilds the functions, so the next batch runs in the new mode.
It builds a function rather than leaving `None`, because a running `fit()`
calls `model.train_function(iterator)` on every batch without rebuilding it.

A switch asked for while another thread trains the model (the ModeSwitch
widget with training on a background thread) is not applied from the asking
thread: `request_mode` leaves it pending and the training thread applies it at
the next batch boundary, through `apply_pending_mode`, called at batch begin by
a `ModeSwitcher` callback (or by a Recorder or Dashboard).
"""

import threading
import warnings
import weakref

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.framework import config as tf_config

from lab.hooks import hooks_for


MODES = ("eager", "graph", "xla")
END_OF_DATA = (StopIteration, tf.errors.OutOfRangeError)
XLA_COMPILE_HINT = (
    "XLA cannot compile an op of this model (tf.py_function, tf.numpy_function "
    "and most tf.strings ops have no XLA kernel). Keep 'graph', or move that op "
    "into the input pipeline."
)

_lock = threading.Lock()
_pending = weakref.WeakKeyDictionary()  # model -> mode asked for while it trains
_training = weakref.WeakKeyDictionary()  # model -> the thread running its fit()
_unverified = weakref.WeakKeyDictionary()  # model -> (settings, mode) to revert to, new mode
_listeners = []  # weak references to fn(model, mode), told of every switch and revert


class ModeError(RuntimeError):
    """A mode cannot run this model; the model stays in its previous mode."""


def current_mode(model):
    """The mode the model's next train step runs in: "eager", "graph" or "xla"."""
    if model.run_eagerly:
        return "eager"
    if model.jit_compile is True:
        return "xla"
    return "graph"


# ---- switching -------------------------------------------------------------


def set_mode(model, mode, steps_per_execution=None):
    """Switches how the model's steps run, keeping weights, optimizer and metric state.

    Sets `run_eagerly` / `jit_compile` and rebuilds the train, test and predict
    functions, so the next batch runs in the new mode. Allowed between batches
    of a running `fit()` (from a callback on the training thread). What can be
    known at the switch is checked there (XLA with op determinism on, under a
    multi-replica MirroredStrategy, or with a layer that does not support XLA);
    an op XLA cannot compile shows at the first step, which then raises
    `ModeError` and puts the previous mode back.

    Args:
        model: keras.Model, compiled.
        mode: str, one of "eager", "graph", "xla".
        steps_per_execution: int or None, also change how many steps one call
            of the train function runs (only between `fit()` calls: `fit()`
            cuts its epoch into executions when it starts).

    Returns:
        str, the previous mode.

    Raises:
        ValueError: an unknown mode, an uncompiled model, or a
            `steps_per_execution` change while `fit()` runs.
        ModeError: the mode cannot run this model; nothing was changed.

    Example:

    ```python
    lab.set_mode(model, "eager")   # the next batch runs Python: print() works
    lab.set_mode(model, "graph", steps_per_execution=8)
    ```
    """
    check_mode(mode)
    check_compiled(model)
    if steps_per_execution is not None:
        steps_per_execution = check_steps_per_execution(steps_per_execution)
        if steps_per_execution != model.steps_per_execution and is_training(model):
            raise ValueError(
                "steps_per_execution cannot change while fit() runs: fit() cut "
                "its epoch into executions of "
                f"{model.steps_per_execution} steps when it started. Change it "
                "between fit() calls."
            )
    if mode == "xla":
        check_xla(model)
    previous = current_mode(model)
    saved = Settings(model)
    set_attributes(model, mode, steps_per_execution)
    if current_mode(model) != mode:
        saved.restore(model)
        raise ModeError(f"Keras refused to run this model in {mode!r} mode; it stays in {previous!r}.")
    _rebuild(model)
    with _lock:
        # Reverting goes back to the last mode that ran a step, not to one
        # switched to and away from before any step.
        last_good = _unverified.get(model, (saved, previous))
        _unverified[model] = (last_good[0], last_good[1], mode)
    guard_first_step(model)
    _notify(model, mode)
    return previous


def add_mode_listener(fn):
    """Calls `fn(model, mode)` after every switch and every revert, on the thread that made it.

    Only a weak reference is kept, so a view that goes away stops listening.

    Args:
        fn: callable `(keras.Model, str) -> None`, e.g. a widget's bound method.
    """
    ref = weakref.WeakMethod(fn) if hasattr(fn, "__self__") else weakref.ref(fn)
    with _lock:
        _listeners.append(ref)


def _notify(model, mode):
    with _lock:
        _listeners[:] = [ref for ref in _listeners if ref() is not None]
        listeners = [ref() for ref in _listeners]
    for ref, fn in zip(list(_listeners), listeners):
        if fn is None:
            continue
        try:
            fn(model, mode)
        except Exception as error:  # noqa: BLE001 - a view must not stop training
            # The lab's one failure policy (lab.observers): reported once, removed.
            with _lock:
                if ref in _listeners:
                    _listeners.remove(ref)
            warnings.warn(f"A mode listener ({getattr(fn, '__qualname__', fn)!r}) raised {error!r} and was "
                          "removed; training goes on.", RuntimeWarning, stacklevel=2)


def _rebuild(model):
    model.make_train_function(force=True)
    model.make_test_function(force=True)
    model.make_predict_function(force=True)


def set_attributes(model, mode, steps_per_execution=None):
    # Order matters: Keras refuses run_eagerly and jit_compile both True.
    if mode == "eager":
        model.jit_compile = False
        model.run_eagerly = True
    else:
        model.run_eagerly = False
        model.jit_compile = mode == "xla"
    if steps_per_execution is not None:
        model.steps_per_execution = steps_per_execution


class Settings:
    """A model's mode attributes and compiled functions, to put back."""

    def __init__(self, model):
        self.run_eagerly = model.run_eagerly
        self.jit_compile = model.jit_compile
        self.steps_per_execution = model.steps_per_execution
        self.functions = (model.train_function, model.test_function, model.predict_function)

    def restore(self, model, functions=True):
        model.jit_compile = self.jit_compile
        model.run_eagerly = self.run_eagerly
        model.steps_per_execution = self.steps_per_execution
        if functions:
            model.train_function, model.test_function, model.predict_function = self.functions


def guard_first_step(model):
    """Makes the first step after a switch revert the switch if it fails.

    `set_mode` does this itself, through the instrumentation layer: the check
    stays on the train function (also one that `fit()` rebuilds) until the
    new mode has run a step. Calling it again does nothing more.

    Args:
        model: keras.Model.
    """
    with _lock:
        entry = _unverified.get(model)
    if entry is None:
        return
    hooks = hooks_for(model)
    owner = _first_step_owner(model)
    hooks.unwrap_train_function(owner)
    hooks.wrap_train_function(owner, lambda function: _first_step(model, function), role="first_step")


def _first_step(model, function):
    def first_step(iterator):
        with _lock:
            entry = _unverified.get(model)
        if entry is None:
            return function(iterator)
        saved, previous, mode = entry
        try:
            outputs = function(iterator)
        except END_OF_DATA:
            raise
        except Exception as error:
            _revert(model, saved)
            raise ModeError(_first_step_message(mode, previous, error)) from error
        with _lock:
            _unverified.pop(model, None)
        hooks_for(model).release(_first_step_owner(model))  # nothing left to check
        return outputs

    return first_step


class _FirstStepCheck:
    """The owner of one model's first-step check in the instrumentation layer."""


_first_step_owners = weakref.WeakKeyDictionary()


def _first_step_owner(model):
    with _lock:
        owner = _first_step_owners.get(model)
        if owner is None:
            owner = _first_step_owners[model] = _FirstStepCheck()
        return owner


def _revert(model, saved):
    """Back to the settings of the last mode that ran, with freshly built functions."""
    with _lock:
        _unverified.pop(model, None)
    hooks_for(model).release(_first_step_owner(model))
    saved.restore(model, functions=False)
    _rebuild(model)
    _notify(model, current_mode(model))


def _first_step_message(mode, previous, error):
    text = f"{type(error).__name__}: {error}".strip()
    first_line = text.splitlines()[0] if text else type(error).__name__
    message = f"The first step in {mode!r} mode failed, so the model is back in {previous!r} mode. {first_line}"
    if mode == "xla" and ("XLA" in text or "unsupported op" in text.lower()):
        message += "\n" + XLA_COMPILE_HINT
    return message


def check_mode(mode):
    if mode not in MODES:
        raise ValueError(f"Unknown mode {mode!r}; use one of {', '.join(repr(m) for m in MODES)}.")


def check_compiled(model):
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"set_mode(model, mode): model must be a compiled keras.Model; got {type(model).__name__}. "
            "E.g. lab.set_mode(model, \"graph\").")
    if not getattr(model, "compiled", False):
        raise ValueError(
            "The model is not compiled: call model.compile(optimizer=..., loss=...) "
            "first; execution modes apply to compiled steps."
        )


def check_steps_per_execution(value):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"steps_per_execution must be a positive int, got {value!r}.")
    return int(value)


def check_xla(model):
    """Raises ModeError for what is known to stop XLA before any step runs."""
    if tf_config.is_op_determinism_enabled():
        raise ModeError(
            "XLA is unavailable while op determinism is on "
            "(tf.config.experimental.enable_op_determinism()): Keras turns "
            "jit_compile off with only a warning, because not every XLA op is "
            "deterministic. Use 'graph' here, or run XLA in a process that does "
            "not enable op determinism."
        )
    strategy = model.distribute_strategy
    if strategy.num_replicas_in_sync > 1 and not isinstance(strategy, tf.distribute.TPUStrategy):
        raise ModeError(
            f"XLA under {type(strategy).__name__} with {strategy.num_replicas_in_sync} "
            "replicas fails in Keras 3 on TensorFlow at the first step (a replica's "
            "variables are read from another device). Use 'graph' under this "
            "strategy, or train on one device to use XLA."
        )
    unsupported = [layer.name for layer in model._flatten_layers() if not layer.supports_jit]
    if unsupported:
        raise ModeError(
            f"These layers do not support XLA: {', '.join(unsupported)}. Use 'graph', "
            "or move them out of the model (e.g. into the input pipeline)."
        )


# ---- switching while another thread trains ---------------------------------


def request_mode(model, mode):
    """Asks for a mode switch that is safe to ask for from any thread.

    When no other thread is training the model, the switch happens now. When
    one is (the ModeSwitch widget while training runs on a background thread),
    it stays pending until the training thread reaches the next batch boundary
    and calls `apply_pending_mode`: no model op runs on the asking thread.

    Args:
        model: keras.Model, compiled.
        mode: str, one of "eager", "graph", "xla".

    Returns:
        str, "applied" or "pending".

    Raises:
        ValueError: an unknown mode or an uncompiled model.
        ModeError: the mode cannot run this model (checked now, on any thread).

    Example:

    ```python
    lab.modes.request_mode(model, "eager")  # "pending" while fit() trains it
    ```
    """
    check_mode(mode)
    check_compiled(model)
    if mode == "xla":
        check_xla(model)
    with _lock:
        thread = _training.get(model)
        elsewhere = thread is not None and thread is not threading.current_thread() and thread.is_alive()
        if elsewhere:
            _pending[model] = mode
            return "pending"
        _pending.pop(model, None)
    if mode != current_mode(model):
        set_mode(model, mode)
    return "applied"


def pending_mode(model):
    """The mode asked for and not applied yet, or None."""
    with _lock:
        return _pending.get(model)


def apply_pending_mode(model):
    """Applies a pending switch; call it on the training thread at batch begin.

    Args:
        model: keras.Model.

    Returns:
        str or None, the mode switched to, or None when nothing was pending.
    """
    if not _pending:  # called every batch: nothing asked for is the common case
        return None
    with _lock:
        mode = _pending.pop(model, None)
    if mode is None or mode == current_mode(model):
        return None
    set_mode(model, mode)
    return mode


def training_began(model):
    """Marks the calling thread as training `model` (call at on_train_begin)."""
    with _lock:
        _training[model] = threading.current_thread()


def training_ended(model):
    """Unmarks `model` as training and applies a switch asked for too late to
    reach a batch (call at on_train_end)."""
    with _lock:
        _training.pop(model, None)
    apply_pending_mode(model)


def is_training(model):
    """Whether a thread marked by `training_began` is still training `model`."""
    with _lock:
        thread = _training.get(model)
    return thread is not None and thread.is_alive()


class ModeSwitcher(keras.callbacks.Callback):
    """Keras callback that switches modes between batches of `fit()`.

    It applies the switches asked for with `lab.modes.request_mode` (the
    ModeSwitch widget) at the next batch, and, with `schedule`, switches at
    fixed steps. A Recorder or Dashboard sees each switch in its rows' `mode`.

    Args:
        schedule: dict or None, step -> mode; step counts the batches this
            callback has seen, from 0, across the `fit()` calls it serves. At
            `steps_per_execution > 1` a switch lands at the first execution
            that starts at or after its step.

    Example:

    ```python
    model.fit(x, y, callbacks=[lab.Recorder(), lab.ModeSwitcher({100: "eager", 101: "graph"})])
    ```
    """

    def __init__(self, schedule=None):
        super().__init__()
        self.schedule = dict(schedule or {})
        for step, mode in self.schedule.items():
            check_mode(mode)
            if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
                raise ValueError(f"Schedule steps must be ints >= 0, got {step!r}.")
        self.step = 0
        self._due = sorted(self.schedule)

    def on_train_begin(self, logs=None):
        training_began(self.model)
        guard_first_step(self.model)

    def on_train_batch_begin(self, batch, logs=None):
        apply_pending_mode(self.model)
        mode = None
        while self._due and self._due[0] <= self.step:
            mode = self.schedule[self._due.pop(0)]
        if mode is not None and mode != current_mode(self.model):
            set_mode(self.model, mode)
        self._begin = batch

    def on_train_batch_end(self, batch, logs=None):
        self.step += batch - self._begin + 1

    def on_train_end(self, logs=None):
        training_ended(self.model)
