"""Execution modes on JAX: `train_step` as Python ("eager") or under `jax.jit` ("xla").

JAX has no counterpart of TensorFlow's graph mode without XLA: `jax.jit`
always compiles with XLA, so "graph" is refused with the modes this backend
has. Keras' JAX trainer makes its train function from `run_eagerly` /
`jit_compile` when it is made and does not drop it when they change;
`set_mode` sets them and puts the function for the new mode in place, and
keeps the jitted one, so switching back does not compile again. `fit()` looks
`model.train_function` up at every batch, so a switch between batches of a
running `fit()` takes effect at the next one.

A switch asked for while another thread trains the model (the ModeSwitch
widget over background training) stays pending until the training thread
applies it at the next batch boundary (`apply_pending_mode`, called by the
Recorder or a `ModeSwitcher`).
"""

import contextlib
import threading
import weakref

import keras

from lab.mode_listeners import add_mode_listener  # noqa: F401  (lab.modes.add_mode_listener)
from lab.mode_listeners import notify as _notify

MODES = ("eager", "xla")
GRAPH_ON_JAX = (
    "'graph' is TensorFlow's tf.function without XLA, which Keras' JAX backend does not have: "
    "jax.jit always compiles with XLA. On JAX use 'eager' (train_step as Python) or 'xla' (jax.jit)."
)

_lock = threading.Lock()
_pending = weakref.WeakKeyDictionary()  # model -> mode asked for while it trains
_training = weakref.WeakKeyDictionary()  # model -> the thread running its fit()
_made = weakref.WeakKeyDictionary()  # model -> {mode: (train_step it was made from, train function)}


class ModeError(RuntimeError):
    """A mode cannot run this model; the model stays in its previous mode."""


def current_mode(model):
    """The mode the model's next train function is made in: "eager" or "xla"."""
    if model.run_eagerly or not model.jit_compile:
        return "eager"
    return "xla"


def running_mode(model):
    """The mode of the train function the model runs: the one `set_mode`
    put in place, else the attributes' (Keras makes its function from them)."""
    made = _made.get(model)
    if made:
        function = model.__dict__.get("train_function")
        for mode, (_, kept) in made.items():
            if kept is function and function is not None:
                return mode
    return current_mode(model)


def check_mode(mode):
    if mode == "graph":
        raise ValueError(GRAPH_ON_JAX)
    if mode not in MODES:
        raise ValueError(f"Unknown mode {mode!r}; on Keras' JAX backend use one of "
                         f"{', '.join(repr(m) for m in MODES)}.")


def check_compiled(model):
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"set_mode(model, mode): model must be a compiled keras.Model; got {type(model).__name__}. "
            "E.g. lab.set_mode(model, \"xla\").")
    if not getattr(model, "compiled", False):
        raise ValueError("The model is not compiled: call model.compile(optimizer=..., loss=...) first; "
                         "execution modes apply to compiled steps.")


def set_attributes(model, mode):
    # Order matters: Keras refuses run_eagerly and jit_compile both True.
    if mode == "eager":
        model.jit_compile = False
        model.run_eagerly = True
    else:
        model.run_eagerly = False
        model.jit_compile = True


def set_mode(model, mode):
    """Switches how the model's steps run, keeping weights, optimizer and metric state.

    Allowed between batches of a running `fit()` (from a callback on the
    training thread): the next batch runs in the new mode. The jitted
    function is kept, so switching back to "xla" does not compile again.

    Args:
        model: keras.Model, compiled.
        mode: str, "eager" or "xla" ("graph" is TensorFlow's).

    Returns:
        str, the previous mode.

    Raises:
        ValueError: "graph", an unknown mode, or an uncompiled model.

    Example:

    ```python
    lab.set_mode(model, "eager")   # the next batch runs train_step as Python: print() works
    lab.set_mode(model, "xla")     # back to the jitted step, compiled once
    ```
    """
    check_mode(mode)
    check_compiled(model)
    previous = running_mode(model)
    made = _made.setdefault(model, {})
    current = model.__dict__.get("train_function")
    step = model.__dict__.get("train_step")  # a lab wrapper, when one is on
    if current is not None:
        made[previous] = (step, current)
    set_attributes(model, mode)
    kept = made.get(mode)
    if kept is not None and kept[0] is step:
        model.train_function = kept[1]
    else:
        model.make_train_function(force=True)
        made[mode] = (step, model.train_function)
    model.test_function = None
    model.predict_function = None
    _notify(model, mode)
    return previous


def forget(model):
    """Drops the functions kept for switching back (the hooks under them changed)."""
    _made.pop(model, None)


@contextlib.contextmanager
def made_in(model, mode):
    """Has a train function made in the block be made in `mode`; the
    attributes are put back after it."""
    if mode == current_mode(model):
        yield
        return
    saved = (model.run_eagerly, model.jit_compile)
    set_attributes(model, mode)
    try:
        yield
    finally:
        model.run_eagerly = False
        model.jit_compile, model.run_eagerly = saved[1], saved[0]


# ---- listeners and switching while another thread trains --------------------


def request_mode(model, mode):
    """A switch safe to ask for from any thread: applied now, or "pending"
    until the thread training the model reaches its next batch.

    Returns:
        str, "applied" or "pending".
    """
    check_mode(mode)
    check_compiled(model)
    with _lock:
        thread = _training.get(model)
        if thread is not None and thread is not threading.current_thread() and thread.is_alive():
            _pending[model] = mode
            return "pending"
        _pending.pop(model, None)
    if mode != running_mode(model):
        set_mode(model, mode)
    return "applied"


def pending_mode(model):
    """The mode asked for and not applied yet, or None."""
    with _lock:
        return _pending.get(model)


def apply_pending_mode(model):
    """Applies a pending switch; call it on the training thread at batch begin."""
    if not _pending:
        return None
    with _lock:
        mode = _pending.pop(model, None)
    if mode is None or mode == running_mode(model):
        return None
    set_mode(model, mode)
    return mode


def training_began(model):
    with _lock:
        _training[model] = threading.current_thread()


def training_ended(model):
    with _lock:
        _training.pop(model, None)
    apply_pending_mode(model)


def is_training(model):
    with _lock:
        thread = _training.get(model)
    return thread is not None and thread.is_alive()


class ModeSwitcher(keras.callbacks.Callback):
    """Switches modes at given steps of `fit()`, and applies switches asked
    for from other threads at batch boundaries.

    Args:
        schedule: dict or None, global step -> mode, e.g. `{0: "eager", 3: "xla"}`.

    Example:

    ```python
    model.fit(x, y, callbacks=[lab.ModeSwitcher({0: "eager", 2: "xla"})])
    ```
    """

    def __init__(self, schedule=None):
        super().__init__()
        schedule = dict(schedule or {})
        for mode in schedule.values():
            check_mode(mode)
        self.schedule = schedule
        self._step = 0
        self._target = None

    def set_model(self, model):
        super().set_model(model)
        self._target = model  # `self.model` would sync the state into the variables on JAX

    def on_train_begin(self, logs=None):
        training_began(self._target)

    def on_train_batch_begin(self, batch, logs=None):
        apply_pending_mode(self._target)
        mode = self.schedule.get(self._step)
        if mode is not None and mode != running_mode(self._target):
            set_mode(self._target, mode)

    def on_train_batch_end(self, batch, logs=None):
        self._step += 1

    def on_train_end(self, logs=None):
        training_ended(self._target)
