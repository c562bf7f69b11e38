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

The train function a switch to graph or XLA builds checks its first step:
when that step fails because of the mode (a step that needs eager Python,
an op XLA cannot compile) the previous mode comes back and `ModeError` says
why. The check is not a hook: it is part of the function `set_mode` builds
(Keras' own, with the check in front), replaced like any train function by
the next `compile()` or rebuild, and it takes itself off after the first
step that runs.
"""

import contextlib
import re
import threading
import weakref

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.framework import config as tf_config

from lab.backend.tensorflow import compat
from lab.hooks import hooks_for
from lab.mode_listeners import add_mode_listener  # noqa: F401  (lab.modes.add_mode_listener)
from lab.mode_listeners import notify as _notify


MODES = ("eager", "graph", "xla")
END_OF_DATA = (StopIteration, tf.errors.OutOfRangeError)
XLA_COMPILE_HINT = (
    "XLA cannot compile an op of this model (tf.py_function, tf.numpy_function "
    "and most tf.strings ops have no XLA kernel). Keep 'graph', or move that op "
    "into the input pipeline."
)
GRAPH_TRACE_HINT = (
    "The step uses a tensor as a Python value, which only eager execution has "
    "(.numpy(), bool(), float(), a Python loop over it, NumPy on it). Keep "
    "'eager', or write that part with TensorFlow ops (tf.cond, tf.print)."
)

_lock = threading.Lock()
_pending = weakref.WeakKeyDictionary()  # model -> mode asked for while it trains
_training = weakref.WeakKeyDictionary()  # model -> the thread running its fit()
_unverified = weakref.WeakKeyDictionary()  # model -> (settings, mode) to revert to, new mode


class ModeError(RuntimeError):
    """A mode cannot run this model; the model stays in its previous mode."""


def current_mode(model):
    """The mode the model's next train step runs in: "eager", "graph" or "xla"."""
    if model.run_eagerly:
        return "eager"
    if model.jit_compile is True:
        return "xla"
    return "graph"


def running_mode(model):
    """The mode of the train function the model runs: "eager", "graph" or "xla".

    The function's own mode, not the attributes': Keras keeps a made train
    function when `run_eagerly` or `jit_compile` is set by hand (only
    `compile()` or `set_mode` make a new one). The attributes' mode
    (`current_mode`) when no function is made yet, or it is not Keras' own.
    """
    function = hooks_for(model).train_function_base()
    if isinstance(function, _FirstStepCheck):
        function = function.function
    mode = None
    if function is not None:
        try:
            mode = _function_modes.get(function)
            if mode is None:
                mode = _function_modes[function] = compat.function_mode(function)
        except TypeError:  # a callable that takes no weak reference
            mode = compat.function_mode(function)
    return mode or current_mode(model)


_function_modes = weakref.WeakKeyDictionary()  # train function -> the mode Keras made it in


# ---- switching -------------------------------------------------------------


def set_mode(model, mode, steps_per_execution=None):
    """Switches how the model's steps run, keeping weights, optimizer and metric state.

    Sets `run_eagerly` / `jit_compile` and rebuilds the train, test and predict
    functions, so the next batch runs in the new mode. Allowed between batches
    of a running `fit()` (from a callback on the training thread). What can be
    known at the switch is checked there (XLA with op determinism on, under a
    multi-replica MirroredStrategy, or with a layer that does not support XLA).

    What shows only when a step runs is checked at the first step after a
    switch to "graph" or "xla": when it fails because of the mode, the
    previous mode comes back and `ModeError` says why. The mode is to blame
    for what TensorFlow raises only while it traces a step into a graph (a
    tensor used as a Python value: `.numpy()`, `bool()`, `float()`, iterating
    it, NumPy on it; a variable made at a later trace) and, in "xla", for an
    op or shape XLA cannot compile. Any other error is the step's own (a
    wrong input shape, a failed assertion, a NaN check): it is raised
    unchanged and the new mode stays, so the fixed step runs in the mode
    asked for. Whether a graph step would also fail eagerly cannot be known
    without running it eagerly too, which would run the batch twice; only
    errors that cannot happen eagerly put the previous mode back. "eager"
    never goes back: it runs any step that runs at all, so a step failing
    there is failing on its own (and debugging it is why one switches).

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
        ModeError: the mode cannot run this model; nothing was changed
            (raised by the switch, or by the first step after it).

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
    previous = running_mode(model)
    saved = Settings(model)
    set_attributes(model, mode, steps_per_execution)
    if current_mode(model) != mode:
        saved.restore(model)
        raise ModeError(f"Keras refused to run this model in {mode!r} mode; it stays in {previous!r}.")
    _rebuild(model)
    with _lock:
        if mode == "eager":
            _unverified.pop(model, None)  # eager runs whatever runs: nothing to check
        else:
            # Reverting goes back to the last mode that ran a step (or to
            # eager), not to one switched to and away from before any step.
            last_good = _unverified.get(model, (saved, previous))
            _unverified[model] = (last_good[0], last_good[1], mode)
    guard_first_step(model)
    _notify(model, mode)
    return previous


def _rebuild(model):
    model.make_train_function(force=True)
    model.make_test_function(force=True)
    model.make_predict_function(force=True)
    # The lab's wrappers on a running fit() wrap the new function at once.
    hooks_for(model).sync_train_function()


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


@contextlib.contextmanager
def made_in(model, mode):
    """Has a train function made in the block be made in `mode`, whatever
    the attributes say; they are put back after it. The lab traces the
    function `fit()` runs with its hooks in, in the mode of the function
    Keras would have run, which is not the attributes' when they were set
    by hand after Keras made it."""
    if mode == current_mode(model):
        yield
        return
    saved = Settings(model)
    set_attributes(model, mode)
    try:
        yield
    finally:
        saved.restore(model, functions=False)


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
    """Puts the check of a switch's first step on the model's train function.

    `set_mode` does this itself, and so does `training_began` (a Recorder's
    or ModeSwitcher's `on_train_begin`): a Recorder has `fit()` build a new
    train function, which gets the check again while the switch has not run
    a step. Calling it again, or after that step, does nothing more.

    Args:
        model: keras.Model.
    """
    with _lock:
        entry = _unverified.get(model)
    if entry is not None and running_mode(model) != entry[2]:
        # compile() changed the mode since: nothing to check. (The mode of
        # the function that runs, not the attributes': Keras keeps the
        # switch's function when they are set by hand, and it still needs
        # its check.)
        with _lock:
            _unverified.pop(model, None)
            entry = None
    if entry is None:
        return
    hooks = hooks_for(model)
    function = hooks.train_function_base()  # Keras' function, under any lab wrapper
    if function is None or isinstance(function, _FirstStepCheck):
        return
    model.train_function = _FirstStepCheck(model, function)
    hooks.sync_train_function()


class _FirstStepCheck:
    """A switch's train function: Keras' own, with the check of its first step in front.

    The first call that returns marks the switch as good and puts Keras'
    function back as the model's train function. A call that fails because
    of the mode (see `set_mode`) puts the previous mode back and raises
    `ModeError`; any other error is raised as it is, and the check stays for
    the next call.

    Args:
        model: keras.Model.
        function: callable, Keras' train function for the new mode.
    """

    def __init__(self, model, function):
        self._model = weakref.ref(model)
        self.function = function

    def __call__(self, iterator):
        model = self._model()
        with _lock:
            entry = _unverified.get(model) if model is not None else None
        if entry is None:
            return self.function(iterator)
        saved, previous, mode = entry
        try:
            outputs = self.function(iterator)
        except END_OF_DATA:
            raise
        except Exception as error:
            if not mode_failure(mode, error):
                raise
            _revert(model, saved)
            raise ModeError(_first_step_message(mode, previous, error)) from error
        with _lock:
            _unverified.pop(model, None)
        self._take_off(model)
        return outputs

    def _take_off(self, model):
        """Keras' function back in this check's place (nothing left to check)."""
        hooks = hooks_for(model)
        if hooks.train_function_base() is self:
            model.train_function = self.function
            hooks.sync_train_function()


# Errors TensorFlow raises only while it traces a step into a graph: a
# symbolic tensor used as a Python value (`.numpy()`, `float()`, NumPy on
# it; `bool()` and iterating it raise OperatorNotAllowedInGraphError), or a
# variable made at a later trace. TF 2.16 and 2.21 word them alike.
_SYMBOLIC_VALUE = re.compile(r"SymbolicTensor|symbolic `?tf\.Tensor")
_VARIABLE_AT_LATER_TRACE = "tf.function only supports singleton tf.Variables"
# What TensorFlow's XLA bridge (tf2xla) says when it cannot compile a traced
# step: an op without an XLA kernel, a shape XLA needs at compile time.
_XLA_COMPILE = re.compile(r"tf2xla conversion failed|Detected unsupported operations when trying to compile"
                          r"|XLA compilation requires")


def mode_failure(mode, error):
    """Whether `error`, raised by a step in `mode`, is the mode's failure rather than the step's own.

    Args:
        mode: str, "eager", "graph" or "xla".
        error: Exception, what the step raised.

    Returns:
        bool, True for an error that the step run eagerly cannot raise (see
        `set_mode`); never for "eager".
    """
    if mode == "eager":
        return False
    text = str(error)
    if _uses_tensor_as_python_value(error) or _VARIABLE_AT_LATER_TRACE in text:
        return True
    return mode == "xla" and isinstance(error, tf.errors.OpError) and bool(_XLA_COMPILE.search(text))


def _uses_tensor_as_python_value(error):
    return isinstance(error, tf.errors.OperatorNotAllowedInGraphError) or bool(_SYMBOLIC_VALUE.search(str(error)))


def _revert(model, saved):
    """Back to the settings of the last mode that ran, with freshly built functions."""
    with _lock:
        _unverified.pop(model, None)
    saved.restore(model, functions=False)
    _rebuild(model)
    _notify(model, current_mode(model))


def _first_step_message(mode, previous, error):
    text = f"{type(error).__name__}: {error}".strip()
    first_line = text.splitlines()[0] if text else type(error).__name__
    message = f"The first step in {mode!r} mode failed, so the model is back in {previous!r} mode. {first_line}"
    if mode == "xla" and ("XLA" in text or "unsupported op" in text.lower()):
        message += "\n" + XLA_COMPILE_HINT
    elif _uses_tensor_as_python_value(error):
        message += "\n" + GRAPH_TRACE_HINT
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
    unsupported = [layer.name for layer in compat.all_layers(model) if not layer.supports_jit]
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
    if mode != running_mode(model):  # the function's: a set attribute may not run yet
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
    if mode is None or mode == running_mode(model):
        return None
    set_mode(model, mode)
    return mode


def training_began(model):
    """Marks the calling thread as training `model` (call at on_train_begin),
    and checks the first step of a switch that has not run one yet
    (`guard_first_step`)."""
    with _lock:
        _training[model] = threading.current_thread()
    guard_first_step(model)


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

    def on_train_batch_begin(self, batch, logs=None):
        apply_pending_mode(self.model)
        mode = None
        while self._due and self._due[0] <= self.step:
            mode = self.schedule[self._due.pop(0)]
        if mode is not None and mode != running_mode(self.model):
            set_mode(self.model, mode)
        self._begin = batch

    def on_train_batch_end(self, batch, logs=None):
        # Keras before 3.11 passes an execution's first step here too.
        self.step += compat.steps_in_execution(self._begin, batch, self.model.steps_per_execution,
                                               (self.params or {}).get("steps"))

    def on_train_end(self, logs=None):
        training_ended(self.model)
