"""Stepper on JAX: run a model's own train_step one batch at a time, and step back.

The stepper owns the lab's only training loop. As Keras' JAX `fit()` does,
it reads the training state out of the model's variables (trainable,
non-trainable, optimizer and metric variables, in Keras' order), calls the
model's own `train_step(state, data)` (the built-in one or a stateless
override) under `jax.jit` — or as Python in "eager" mode — with batches
shaped as `fit()` hands them, and assigns the state it returns back to the
variables. Stepped this way the weights are fit()'s bit for bit, also under
a `keras.distribution` (DataParallel), where the batch and the state are
laid out over the devices as fit() lays them out.

What a step did comes out of the same jitted call: the gradients each
optimizer applied are taken where Keras' update runs (its
`_backend_update_step`, after loss-scale unscaling, clipping and gradient
accumulation), through a wrapper the lab's hooks layer puts on the optimizer
for the length of the call only, and returned as extra outputs of the
stepper's own jitted function, never through the model's state. The batch's
own loss and mean-metric values are read off the change of their totals and
counts, as the JAX probe reads them. The predictions are the model's
forward pass on the state the step started from (the same seeds, so the
same dropout masks), in a jitted call of their own.

Snapshots cost no copy: JAX arrays are immutable and the stepper's jitted
step donates nothing, so the arrays a step started from stay valid, and a
rewind assigns them back (bit for bit). A kept step holds the arrays it
replaced: with Adam (weights and two moments) about
`(history + 1) * 3 * parameters * 4 bytes` on the device. Traces hold host (NumPy) copies of the batch, predictions,
gradients and trainable weights.
"""

import collections
import contextlib
import dataclasses
import inspect
import numbers
import re
import threading
import time
import traceback as traceback_module
import warnings

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pandas as pd

from lab import schema
from lab.arguments import check_class_weight, check_flag, check_number, check_stepper_options
from lab.backend.jax import compat
from lab.backend.jax.feed import DATA_TYPES, Feed, to_numpy
from lab.breakpoints import DeviceBreakpoint
from lab.data_rules import arrays_problem, said_at
from lab.hooks import CompiledState, hooks_for
from lab.metric_names import is_mean, leaf_metrics
from lab.signals import record_interrupt, uninterrupted
from lab.step_logs import not_logs, not_logs_message
from lab.step_trace import StepTrace
from lab.variables import find_optimizers, variable_keys

MODES = ("eager", "xla")

DOES_NOT_FIT = (
    "The model's train_step cannot run on the data's first batch ({batch}): {error} "
    "Give lab.Stepper the data as model.fit() takes it for this model (fit() fails on it too): "
    "x shaped as the model's inputs{inputs}, y as its loss expects.")

UNREPEATABLE_MESSAGE = (
    "Step {step}, taken again after a rewind from the same state on the same batch, ended with "
    "other weights ({variables}) than the first time. Keras' random ops draw from seed state the "
    "model holds (rewound with it); a step that draws with a jax.random key kept outside the model "
    "(or reads a Python attribute that changed meanwhile) does not replay exactly. Draw with "
    "keras.random and a keras.random.SeedGenerator held by the model for steps that replay exactly.")

LOSS_SCALED_MESSAGE = (
    "{name} is a LossScaleOptimizer, whose update runs inside a lax.cond (it applies only finite "
    "steps): its gradients cannot leave that branch, so the traces of this stepper hold no gradients "
    "for it. The steps themselves are fit()'s.")

# What tracing an eager step raises where it reads values as Python (`if loss > 0:`), which it may.
_NEEDS_VALUES = (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError,
                 jax.errors.TracerBoolConversionError, jax.errors.TracerIntegerConversionError,
                 jax.errors.UnexpectedTracerError)

_capture = threading.local()  # the applies of the step being traced (or run eagerly) on this thread


@dataclasses.dataclass
class _Snapshot:
    trace: StepTrace
    fed: object  # the Feed item the step consumed
    before: list  # (variable, array) for every variable of the state, before the step
    compiled: object = None  # the model's CompiledState when the step ran
    conditions: dict = None  # run_until's breakpoint state before its check


class Stepper:
    """Runs a model's own `train_step` one batch at a time; rewinds steps (Keras on JAX).

    Args:
        model: keras.Model, compiled (its `train_step(state, data)` may be
            overridden, stateless as Keras' JAX backend asks).
        data: what `fit()` takes as `x`: an array, a tuple `(x, y)` or
            `(x, y, sample_weight)` of arrays, a `keras.utils.PyDataset` or a
            generator of such tuples. The first batch is checked against the
            model when the stepper is made (a `ValueError` names what does not fit).
        batch_size: int or None, for arrays (default 32, as in `fit()`).
        shuffle: bool, reshuffle arrays, and a PyDataset's batch order, every
            epoch; False keeps data order.
        seed: int or None, makes the shuffled order reproducible.
        mode: str or None, "xla" (the step under `jax.jit`, as fit() runs it
            by default) or "eager" (train_step as Python, every value
            concrete); None follows the model (`run_eagerly`, `jit_compile`),
            as fit() does.
        history: int, how many steps `rewind` can undo.
        steps_per_epoch: int or None, batches per epoch (needed for a
            generator to run more than one epoch).
        run: `lab.Run` or None; each step appends its row there.
        start_step: int or None, the index of the first step; None goes on
            from `run.next_step` (0 without a run).
        start_batch: tuple (epoch, batch) of the first batch (metrics are
            reset only at a batch 0, as fit() resets them at an epoch start).
        class_weight: dict or None, as `fit(class_weight=...)` takes it.

    Example:

    ```python
    stepper = lab.Stepper(model, (x, y), batch_size=32, seed=0)
    trace = stepper.step()        # one batch through model.train_step
    trace.loss, trace.gradients
    stepper.rewind()              # as if that step never ran
    ```
    """

    def __init__(self, model, data, batch_size=None, shuffle=True, seed=None, *, mode=None, history=16,
                 steps_per_epoch=None, run=None, start_step=None, start_batch=(0, 0), class_weight=None):
        if not isinstance(model, keras.Model):
            raise TypeError(f"Stepper needs a keras.Model, got {type(model).__name__}: "
                            "lab.Stepper(model, (x, y)).")
        if not getattr(model, "compiled", False):
            raise ValueError("The model is not compiled. Call model.compile(optimizer=..., loss=...) "
                             "before stepping it, as fit() would require.")
        if mode is not None and mode not in MODES:
            raise ValueError(
                f"lab.Stepper(mode=...) must be None (the model's mode, as fit() runs it), 'xla' (jax.jit) "
                f"or 'eager' (train_step as Python) on Keras' JAX backend; got {mode!r}"
                + (" ('graph' is TensorFlow's tf.function, which JAX does not have)." if mode == "graph" else "."))
        check_number("lab.Stepper", "history", history, numbers.Integral, lambda v: v >= 1,
                     "a whole number of steps to keep for rewind, 1 or more", "16")
        for argument, value in (("batch_size", batch_size), ("steps_per_epoch", steps_per_epoch)):
            if value is not None:
                check_number("lab.Stepper", argument, value, numbers.Integral, lambda v: v >= 1,
                             "a whole number, 1 or more, or None", "32")
        check_flag("lab.Stepper", "shuffle", shuffle, "shuffle=False: the batches in the data's order")
        check_class_weight("lab.Stepper", class_weight)
        _check_list_data(model, data)
        problem = arrays_problem(model, data)  # said before the step's trace fails on it in JAX's words
        if problem is not None:
            raise ValueError(said_at("lab.Stepper", problem))
        self._start(model, data, batch_size, shuffle, seed, steps_per_epoch, start_batch, class_weight, history,
                    run, mode, start_step, stacklevel=3)

    def _start(self, model, data, batch_size, shuffle, seed, steps_per_epoch, start_batch, class_weight, history,
               run, mode, start_step, stacklevel):
        """What every stepper sets up once its arguments are checked: the feed,
        the history, the run's numbering; then the first batch is checked
        against the model."""
        check_stepper_options(seed, run, start_step, start_batch)
        self.model = model
        self.feed = Feed(data, batch_size=batch_size, shuffle=shuffle, seed=seed,
                         steps_per_epoch=steps_per_epoch, position=start_batch, class_weight=class_weight)
        self.history = int(history)
        self.run = run
        self._mode = mode
        if start_step is None:
            start_step = run.next_step if run is not None else 0
        self._index = int(start_step)
        if run is not None:
            run.next_step = self._index
        self._snapshots = collections.deque(maxlen=self.history)
        self._seen = None  # the state's arrays as the stepper left them: a change means someone else moved it
        self._built_for = None  # the CompiledState the model was last built for (as fit() builds it)
        self._function = None  # the stepper's jitted step, for `_function_for`
        self._function_for = None
        self._forward = None  # the jitted forward pass for the predictions, None where it cannot run
        self._forward_for = None
        self._condition_state = {}  # id(breakpoint) -> what a loss_spike keeps across steps
        self._replayed = {}  # step index -> the weights a rewound step ended with
        self._told = set()
        self.hit = False
        self.last_trace = None
        if self.feed.order_note is not None:
            warnings.warn(self.feed.order_note, UserWarning, stacklevel=stacklevel)
            if self.run is not None:
                self.run.add_event("warning", self.feed.order_note, step=self._index)
        first = self.feed.next()
        self.feed.push_back([first])
        self._check_fits(first.data)
        self._seen = self._read_state()

    # ---- public ------------------------------------------------------------

    @classmethod
    def from_step(cls, step_fn, model, data, optimizers=(), metrics=(), **kwargs):
        """A stepper for a stateless step function the user wrote (Keras on JAX).

        On JAX the step is the one keras-io's "Writing a training loop from
        scratch in JAX" writes: `step_fn(state, data) -> (loss, state)` (or
        `((loss, aux), state)`, `aux` a dict of values to log), where
        `state = (trainable_variables, non_trainable_variables,
        optimizer_variables[, metric_variables])` are lists of arrays in the
        order of `model.trainable_variables`, `model.non_trainable_variables`,
        `optimizer.variables` and the `metrics`' variables one after another,
        and `data` is the batch as `fit()` hands it (`(x, y)`). The step
        applies its gradients with `optimizer.stateless_apply`. (TensorFlow's
        `from_step` takes a stateful `step_fn(x, y)`; a JAX step cannot change
        variables, so here the stepper threads the state: it reads it from the
        variables, calls the step and assigns the state it returns back.)

        A `jax.jit`-ed step runs as the Python it wraps inside the stepper's own
        `jax.jit` ("xla" mode, the default for it; the gradients the optimizer
        applied are taken as extra outputs), so the weights are those of the
        user's own loop, bit for bit; a plain Python step runs as it is
        ("eager" mode). After each step, and after a rewind, the model's,
        optimizer's and metrics' variables hold the stepped state (the user's
        own loop leaves them as they were until it assigns them). `rewind`
        restores those variables; anything else the step changes (a Python
        counter, a jax.random key held outside the model) keeps its value.
        Not under a `keras.distribution`.

        Args:
            step_fn: callable, `step_fn(state, data) -> (loss, state)`, jitted or not.
            model: keras.Model whose variables the step threads (built; need not be compiled).
            data: as for `Stepper`.
            optimizers: the keras optimizer the step applies (one, or a sequence
                of one); empty takes `model.optimizer`. Built on the model's
                trainable variables if it is not yet.
            metrics: sequence of `keras.metrics.Metric` whose variables are the
                state's fourth element (empty: the state has three); reset at
                each epoch start, rewound with the model.
            **kwargs: as for `Stepper` (`mode` "xla" or "eager").

        Raises:
            TypeError: `step_fn` does not take `(state, data)`, or its first
                call does not return `(loss, state)` with the state it was given.

        Example:

        ```python
        @jax.jit
        def train_step(state, data):
            trainable, non_trainable, optimizer_variables = state
            x, y = data
            (loss, non_trainable), grads = grad_fn(trainable, non_trainable, x, y)
            trainable, optimizer_variables = optimizer.stateless_apply(optimizer_variables, grads, trainable)
            return loss, (trainable, non_trainable, optimizer_variables)

        stepper = lab.Stepper.from_step(train_step, model, (x, y), optimizers=[optimizer])
        trace = stepper.step()
        ```
        """
        return _StepFnStepper(step_fn, model, data, optimizers, metrics, **kwargs)

    @property
    def mode(self):
        """str, "xla" or "eager": how the next step runs."""
        if self._mode is not None:
            return self._mode
        return "eager" if self.model.run_eagerly or not self.model.jit_compile else "xla"

    @property
    def traces(self):
        """list of StepTrace, the kept steps (at most `history`), oldest first."""
        return [s.trace for s in self._snapshots]

    @property
    def next_index(self):
        """int, the index the next step will get."""
        return self._index

    def peek(self):
        """The next batch, without stepping: `(x, y, sample_weight)` as arrays."""
        item = self.feed.next()
        self.feed.push_back([item])
        return keras.utils.unpack_x_y_sample_weight(to_numpy(item.data))

    def step(self, n=1):
        """Runs `n` training steps; stops early at a step that raises.

        Args:
            n: int, steps to run, 1 or more.

        Returns:
            StepTrace, the last step's (its `error` is set when it failed; the
            model is then as before that step, and the batch is next again).
        """
        check_number("Stepper.step", "n", n, numbers.Integral, lambda v: v >= 1,
                     "a whole number of steps, 1 or more", "1")
        trace = None
        for _ in range(int(n)):
            trace = self._step_once()
            if trace.error is not None:
                break
        return trace

    def run_until(self, condition, max_steps=1000):
        """Steps until `condition` holds, a step fails, or `max_steps` ran.

        Args:
            condition: callable `condition(trace) -> bool`, a `lab.Breakpoint`
                (checked against the step's row), a list of them (the first
                that holds), or `lab.breakpoints.nonfinite()` /
                `loss_spike(...)`, evaluated here on the step's loss and
                applied gradients on the host: their hit is rewound, so the
                offending update stays out of the weights and its batch comes
                next again (`trace.skipped` is True; the run gets an event).
            max_steps: int, the most steps to run.

        Returns:
            StepTrace, the last step's; `stepper.hit` says whether the condition held.
        """
        check_number("Stepper.run_until", "max_steps", max_steps, numbers.Integral, lambda v: v >= 1,
                     "a whole number of steps, 1 or more", "1000")
        conditions = list(condition) if isinstance(condition, (list, tuple)) else [condition]
        checks = [(c, trace_condition(c, self._condition_state)) for c in conditions]
        trace = None
        self.hit = False
        for _ in range(int(max_steps)):
            trace = self._step_once()
            if trace.error is not None:
                break
            # What the checks are about to change, so a rewind puts it back with the step.
            self._snapshots[-1].conditions = dict(self._condition_state)
            hit = next((c for c, check in checks if check(trace)), None)
            if hit is None:
                continue
            self.hit = True
            name = getattr(hit, "name", None) or getattr(hit, "__name__", "condition")
            if getattr(hit, "on_device", False):
                # The offending update is kept out: the step is undone and its batch comes next again.
                self.rewind(1)
                trace.skipped = True
                detail = (f"{name} at step {trace.index}: the update was kept out of the weights (the step "
                          "was rewound; its batch comes next again)")
            else:
                detail = f"{name} at step {trace.index}"
            if self.run is not None:
                self.run.add_event("breakpoint", detail, step=trace.index)
            break
        return trace

    def rewind(self, n=1):
        """Restores the model and data position to before the last `n` steps.

        Weights, non-trainable variables (Keras' seed generators included,
        so a replayed step draws the same dropout masks), the optimizer's
        variables and iterations and the metrics' state are put back bit for
        bit; so is what `run_until`'s breakpoints keep across steps (a
        `loss_spike`'s running average). The rewound batches come next
        again; their traces are dropped.

        Args:
            n: int, steps to undo, 1 or more.

        Returns:
            StepTrace or None, the last kept step's.

        Raises:
            ValueError: when fewer than `n` steps are kept, or the model
                changed outside the stepper (a fit(), set_weights, a
                recompile) since they ran.
        """
        check_number("Stepper.rewind", "n", n, numbers.Integral, lambda v: v >= 1,
                     "a whole number of steps, 1 or more", "1")
        n = int(n)
        if not self._snapshots:
            raise ValueError("There is no step to rewind: step first (the history is kept from the first step).")
        if n > len(self._snapshots):
            raise ValueError(
                f"Cannot rewind {n} steps: only the last {len(self._snapshots)} can be rewound "
                f"(history={self.history}). Rewind {len(self._snapshots)} or fewer, or create the Stepper "
                "with a larger history=... to go further back.")
        if self._moved():
            self._snapshots.clear()
            self._replayed.clear()
            raise ValueError(
                "The model changed outside the stepper since its last step (a fit(), set_weights, "
                "load_weights, compile(), ...), so its history no longer applies and was dropped. "
                "Step again to start a new history.")
        compiled = CompiledState(self.model)
        stale = [s.trace.index for s in list(self._snapshots)[-n:] if not s.compiled.same_compile(compiled)]
        if stale:
            self._snapshots.clear()
            raise ValueError(
                f"Cannot rewind: the model was compiled again (or its optimizer replaced) after step "
                f"{stale[0]}, so the optimizer and metric state those steps changed is gone. Nothing "
                "was restored; the history was dropped. Step again to start a new history.")
        with uninterrupted():
            undone = [self._snapshots.pop() for _ in range(n)]
            checked = next((s.conditions for s in reversed(undone) if s.conditions is not None), None)
            if checked is not None:
                self._condition_state.clear()
                self._condition_state.update(checked)
            for snapshot in undone:  # newest first: a step rewound twice keeps its first ending
                self._replayed[snapshot.trace.index] = snapshot.trace.weights_after
            _assign(undone[-1].before)
            self._seen = self._read_state()
            self.feed.push_back([s.fed for s in reversed(undone)])
            self._index = undone[-1].trace.index
            if self.run is not None:
                self.run.next_step = self._index
                self.run.add_event("rewind", f"to before step {self._index}", step=self._index)
            self.last_trace = self._snapshots[-1].trace if self._snapshots else None
        return self.last_trace

    def sync(self):
        """Takes the model as it is now after something else changed it; drops the history."""
        self._snapshots.clear()
        self._replayed.clear()
        self._seen = self._read_state()

    # ---- one step ----------------------------------------------------------

    def _step_once(self):
        try:
            fed = self.feed.next()
        except BaseException as error:  # a Ctrl-C in the user's generator: no step ran, the run says why
            record_interrupt(self.run, error, f"the data, reading step {self._index}'s batch", step=self._index)
            raise
        try:
            if self._moved():
                # The model moved (a fit(), set_weights): older snapshots no longer apply.
                self._snapshots.clear()
                self._replayed.clear()
            if not CompiledState(self.model).same_compile(self._built_for):
                # Compiled again since (a new optimizer, loss or metrics): built
                # from the batch as the next fit() builds them.
                build_as_fit_does(self.model, fed.data)
                self._built_for = CompiledState(self.model)
            before = _pairs(self._variable_lists())
            x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(to_numpy(fed.data))
            trace = StepTrace(index=self._index, epoch=fed.epoch, batch=fed.batch, x=_copy(x), y=_copy(y),
                              sample_weight=_copy(sample_weight))
            keys = variable_keys(self.model.trainable_variables)
            trace.weights_before = {keys[id(v)]: np.array(v.value, copy=True) for v in self.model.trainable_variables}
        except BaseException:
            self.feed.push_back([fed])  # nothing ran yet: the batch is still the next one
            raise
        start = time.perf_counter()
        try:
            if fed.batch == 0:
                self.model.reset_metrics()  # fit() does this at every epoch start
            state = self._read_state()
            with self._capturing():
                logs, new_state, applies = self._call(state, fed.data)
                jax.block_until_ready((logs, new_state, applies))
            trace.seconds = time.perf_counter() - start
            self._fill(trace, state, logs, new_state, applies, fed.data)
            self._record(trace, fed, before, new_state)
        except Exception as error:  # noqa: BLE001 - the trace carries it
            if self.last_trace is trace:  # the step stands (its row is in the run)
                raise
            return self._failed(trace, error, fed, before, start)
        except BaseException as error:
            if self.last_trace is not trace:
                self._failed(trace, error, fed, before, start)
            raise
        return trace

    def _record(self, trace, fed, before, new_state):
        """Puts the step's state into the model and keeps the step."""
        with uninterrupted():
            for variables, arrays in zip(self._variable_lists(), new_state):
                for variable, array in zip(variables, arrays):
                    variable.assign(array)
            keys = variable_keys(self.model.trainable_variables)
            trace.weights_after = {keys[id(v)]: np.array(v.value, copy=True) for v in self.model.trainable_variables}
            self._check_replay(trace)
            self._snapshots.append(_Snapshot(trace, fed, before, CompiledState(self.model)))
            self._seen = self._read_state()
            self._index += 1
            self.last_trace = trace
            if self.run is not None:
                self._append_row(trace)
                self.run.note_running_values(trace.running, trace.index)

    def _failed(self, trace, error, fed, before, start):
        if not trace.seconds == trace.seconds:  # NaN: failed before the step returned
            trace.seconds = time.perf_counter() - start
        with uninterrupted():
            _assign(before)  # only the metrics' reset at an epoch start can have changed
            self._seen = self._read_state()
            self.feed.push_back([fed])
        trace.error = error
        trace.traceback = "".join(traceback_module.format_exception(error))
        interrupted = not isinstance(error, Exception)
        trace.hint = "" if interrupted else _hint(error)
        if self.run is not None:
            if interrupted:
                self.run.add_event("interrupt", f"{type(error).__name__} in step {self._index}; the step was "
                                   "undone and its batch comes next again", step=self._index)
            else:
                self.run.add_event("error", f"{type(error).__name__}: {error}", step=self._index)
        self.last_trace = trace
        return trace

    def _check_replay(self, trace):
        first = self._replayed.pop(trace.index, None)
        if first is None or "unrepeatable" in self._told:
            return
        differ = [k for k, a in trace.weights_after.items() if k in first and not _same_array(first[k], a)]
        if not differ:
            return
        self._told.add("unrepeatable")
        message = UNREPEATABLE_MESSAGE.format(step=trace.index, variables=", ".join(differ[:4]))
        if self.run is not None:
            self.run.add_event("warning", message, step=trace.index)
        warnings.warn(message, RuntimeWarning, stacklevel=4)

    # ---- the step itself ---------------------------------------------------

    def _variable_lists(self):
        """The variables of the state, in the order Keras' JAX trainer passes them to train_step."""
        model = self.model
        optimizer = getattr(model, "optimizer", None)
        return (list(model.trainable_variables), list(model.non_trainable_variables),
                list(optimizer.variables) if optimizer is not None else [], list(model.metrics_variables))

    def _read_state(self):
        return tuple([v.value for v in variables] for variables in self._variable_lists())

    def _moved(self):
        """Whether the model's state is other than the stepper left it (a fit(), set_weights, ...).

        Cheap: JAX arrays are immutable, so a variable that still holds the
        very array the stepper left in it holds the same values."""
        if self._seen is None:
            return False
        current = self._read_state()
        return any(len(a) != len(b) or any(x is not y for x, y in zip(a, b)) for a, b in zip(current, self._seen))

    def _train_step(self):
        """The model's train_step, without a Recorder's probe around it: a step
        taken here must not become a row of a recorded fit()."""
        return hooks_for(self.model).original(self.model, "train_step")

    def _traced(self, state, data):
        """One train_step, with what the optimizers applied as extra outputs
        (Python: runs when traced under jax.jit, or at each eager step)."""
        outer = getattr(_capture, "applies", None)
        _capture.applies = []
        try:
            with compat.state_shardings_recorded(self.model):
                logs, new_state = self._train_step()(state, data)
            applies = _capture.applies
        finally:
            _capture.applies = outer
        # Each apply as {optimizer name: {...}}: the names travel in the outputs' structure.
        captured = [{name: {"gradients": grads, "learning_rate": rate}} for name, grads, rate in applies]
        return logs, new_state, captured

    def _call(self, state, data):
        data = distributed_as_fit_does(data)
        if self.mode == "eager":
            return self._traced(state, data)
        return self._jitted()(state, data)

    def _jitted(self):
        """The stepper's jitted step for the model as compiled now."""
        compiled = (CompiledState(self.model, mode="xla"), keras.distribution.distribution())
        if self._function is None or self._function_for is None or not (
                self._function_for[0] == compiled[0] and self._function_for[1] is compiled[1]):
            # First, or the model was compiled again (a new optimizer, loss or
            # metrics) or is stepped under another keras.distribution: traced
            # anew, as fit() makes its function anew. No donation: the arrays
            # the step starts from are the rewind's.
            shardings = state_shardings_as_fit_does(self.model)
            self._function = jax.jit(self._traced, out_shardings=None if shardings is None else (None, shardings, None))
            self._function_for = compiled
        return self._function

    def _check_fits(self, data):
        """Builds what fit() builds before its first step and traces the step
        on the first batch (in "xla" mode the trace the first step then
        reuses), so that data the model cannot take is refused here, with
        what to change."""
        try:
            build_as_fit_does(self.model, data)
            self._built_for = CompiledState(self.model)
            state = self._read_state()
            with self._capturing():
                if self.mode == "xla":
                    self._jitted().trace(state, distributed_as_fit_does(data))
                else:
                    try:
                        jax.eval_shape(self._traced, state, distributed_as_fit_does(data))
                    except _NEEDS_VALUES:
                        pass  # a step that reads values as Python runs eagerly only: checked as it runs
        except Exception as error:  # noqa: BLE001 - said with the batch and the fix
            raise ValueError(DOES_NOT_FIT.format(batch=_describe(data), error=_one_line(error),
                                                 inputs=_input_shapes(self.model))) from error

    @contextlib.contextmanager
    def _capturing(self):
        """The wrappers that see what each optimizer applies, on for the call only."""
        hooks = hooks_for(self.model)
        keys = variable_keys(self.model.trainable_variables)
        try:
            wrapped = set()
            for name, optimizer in find_optimizers(self.model).items():
                if compat.applies_inside_cond(optimizer):
                    self._tell_once(name, LOSS_SCALED_MESSAGE.format(name=name))
                    continue
                owner = compat.update_step_owner(optimizer)
                if id(owner) in wrapped:
                    continue
                wrapped.add(id(owner))
                hooks.wrap(self, owner, compat.UPDATE_STEP, _update_step_wrapper(name, keys), role="capture")
            yield
        finally:
            hooks.release(self)

    def _tell_once(self, key, message):
        if key in self._told:
            return
        self._told.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=5)
        if self.run is not None:
            self.run.add_event("warning", message, step=self._index)

    def _predictions(self, state, data):
        """The model's forward pass on the state the step started from, or None
        where the model has no forward pass on this batch's x (a GAN's)."""
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        compiled = CompiledState(self.model, mode=self.mode)
        if self._forward_for != compiled:
            model, kwargs = self.model, call_kwargs(self.model)

            def forward(trainable, non_trainable, x):
                return model.stateless_call(trainable, non_trainable, x, **kwargs)[0]

            self._forward = jax.jit(forward) if self.mode == "xla" else forward
            self._forward_for = compiled
        if self._forward is None:
            return None
        try:
            return to_numpy(self._forward(state[0], state[1], x))
        except Exception:  # noqa: BLE001 - a model without call() on x: no predictions
            self._forward = None
            return None

    # ---- what the step did -------------------------------------------------

    def _fill(self, trace, state, logs, new_state, applies, data):
        returned = not_logs(logs)
        if returned is not None:  # fit() fails on it, in words that name neither it nor the fix
            raise TypeError(not_logs_message("train_step", returned) + " The Stepper fails as fit() would.")
        trace.logs = {name: _scalar_or_array(value) for name, value in _log_entries(logs)}
        trace.y_pred = self._predictions(state, data)
        gradients, per_apply, rates, names = {}, [], {}, []
        for entry in applies:
            (name, applied), = entry.items()
            grads = {key: np.asarray(g) for key, g in applied["gradients"].items()}
            gradients.update(grads)  # the last apply's, per variable
            per_apply.append(grads)
            rates[name] = float(np.asarray(applied["learning_rate"]))
            names.append(name)
        order = list(variable_keys(self.model.trainable_variables).values())  # the model's order, not the update's
        trace.gradients = {**{k: gradients[k] for k in order if k in gradients}, **gradients}
        row, running = {}, []
        index = {id(v): i for i, v in enumerate(self.model.metrics_variables)}
        metrics = leaf_metrics(self.model)
        before, after = state[3], new_state[3]
        for name, value in trace.logs.items():
            metric = metrics.get(name)
            if metric is not None and is_mean(metric):
                places = [index.get(id(metric.total)), index.get(id(metric.count))]
                if None not in places and len(after) == len(before) == len(index):
                    d_total, d_count = (float(np.asarray(after[i], np.float64) - np.asarray(before[i], np.float64))
                                        for i in places)
                    if d_count:  # else the step returned this name without updating the metric
                        value = d_total / d_count
            elif metric is not None:  # its batch value cannot be read off its state
                running += [column for column, _ in schema.number_columns(name, value)]
            row.update(schema.number_columns(name, value))
        for name, rate in rates.items():
            row[schema.LEARNING_RATE if len(rates) == 1 else schema.per_optimizer_column(
                schema.LEARNING_RATE_PREFIX, name)] = rate
        squares = {}
        for grads in per_apply:
            for key, grad in grads.items():
                squares[key] = squares.get(key, 0.0) + float(np.sum(np.square(grad.astype(np.float64))))
        for key, square in squares.items():
            row[schema.variable_column(schema.GRAD_NORM_PREFIX, key)] = square ** 0.5
        if squares:
            row[schema.GRAD_NORM] = sum(squares.values()) ** 0.5
        for name in set(names):
            if names.count(name) > 1:
                row[schema.per_optimizer_column(schema.APPLIES_PREFIX, name)] = float(names.count(name))
        trace.row = row
        trace.running = running

    def _append_row(self, trace):
        columns = {"step": [trace.index], "epoch": [trace.epoch], "batch": [trace.batch],
                   "seconds": [trace.seconds], "mode": [self.mode], "source": ["stepper"]}
        columns.update({k: [v] for k, v in trace.row.items()})
        self.run.append_batches(columns)


# ---- from_step: the user's stateless step_fn(state, data) -------------------------

STEP_SHAPE = (
    "lab.Stepper.from_step on Keras' JAX backend takes the stateless step of keras-io's 'Writing a training "
    "loop from scratch in JAX': step_fn(state, data) -> (loss, state) (or ((loss, aux), state)), where state = "
    "(trainable_variables, non_trainable_variables, optimizer_variables{metrics}) as lists of arrays and data "
    "is the batch (x, y). ")

STEP_FAILS = (
    "The step function cannot run on the data's first batch ({batch}): {error} " + STEP_SHAPE.replace("{", "{{")
    .replace("}", "}}").replace("{{metrics}}", "{metrics}")
    + "Check that the data is what the step unpacks and the state what it unpacks{hint}.")


class _StepShapeError(TypeError):
    """A step that does not return `(loss, state)` with the state it was given."""


class _StepFnStepper(Stepper):
    """`lab.Stepper.from_step` on JAX: steps the user's stateless `step_fn(state, data)`
    on the state read from the model's, optimizer's and metrics' variables, and
    assigns the state it returns back (see `Stepper.from_step`)."""

    def __init__(self, step_fn, model, data, optimizers=(), metrics=(), batch_size=None, shuffle=True, seed=None, *,
                 mode=None, history=16, steps_per_epoch=None, run=None, start_step=None, start_batch=(0, 0),
                 class_weight=None):
        if not isinstance(model, keras.Model):
            raise TypeError(f"Stepper.from_step needs a keras.Model, got {type(model).__name__}: "
                            "lab.Stepper.from_step(train_step, model, (x, y), optimizers=[optimizer]).")
        python_fn, jitted = _python_step(step_fn)
        self._optimizer = _the_optimizer(optimizers, model)
        self._user_metrics = _the_metrics(metrics)
        if mode is not None and mode not in MODES:
            raise ValueError(f"lab.Stepper.from_step(mode=...) must be None (as the step is: 'xla' for a jax.jit-ed "
                             f"step, else 'eager'), 'xla' or 'eager' on Keras' JAX backend; got {mode!r}.")
        check_number("lab.Stepper.from_step", "history", history, numbers.Integral, lambda v: v >= 1,
                     "a whole number of steps to keep for rewind, 1 or more", "16")
        for argument, value in (("batch_size", batch_size), ("steps_per_epoch", steps_per_epoch)):
            if value is not None:
                check_number("lab.Stepper.from_step", argument, value, numbers.Integral, lambda v: v >= 1,
                             "a whole number, 1 or more, or None", "32")
        check_flag("lab.Stepper.from_step", "shuffle", shuffle, "shuffle=False: the batches in the data's order")
        check_class_weight("lab.Stepper.from_step", class_weight)
        if keras.distribution.distribution() is not None:
            raise ValueError("lab.Stepper.from_step does not step under a keras.distribution: the step's state "
                             "is laid out as the step lays it out. Step it without one, or write the step as the "
                             "model's train_step and use lab.Stepper(model, data).")
        if not model.built:
            raise ValueError(f"The model {model.name!r} is not built: its variables are the step's state. Build it "
                             "first (call it on a batch, or give it an Input), as the loop's state needs it too.")
        _check_list_data(model, data)
        self._step_fn = python_fn
        self._default_mode = "xla" if jitted else "eager"
        if not self._optimizer.built:
            self._optimizer.build(model.trainable_variables)
        self._start(model, data, batch_size, shuffle, seed, steps_per_epoch, start_batch, class_weight, history,
                    run, mode, start_step, stacklevel=4)

    @property
    def mode(self):
        """str, "xla" (the step as Python inside the stepper's jax.jit) or "eager" (as Python)."""
        return self._mode if self._mode is not None else self._default_mode

    def _variable_lists(self):
        """The variables of the step's state, in its order (the metrics' after one another)."""
        return (list(self.model.trainable_variables), list(self.model.non_trainable_variables),
                list(self._optimizer.variables), [v for m in self._user_metrics for v in m.variables])

    def _step_once(self):
        # The metrics passed are reset at each epoch start, as Stepper resets the model's;
        # a rewind of that step restores them as they were before the reset.
        item = self.feed.next()
        self.feed.push_back([item])
        reset = item.batch == 0 and bool(self._user_metrics)
        if reset:
            moved = self._moved()
            held = _pairs([self._variable_lists()[3]])
            for metric in self._user_metrics:
                metric.reset_state()
            if not moved:
                self._seen = self._read_state()
        try:
            trace = super()._step_once()
        except BaseException:
            if reset:
                _assign(held)
                self._seen = self._read_state()
            raise
        if reset:
            if trace.error is not None:
                _assign(held)
                self._seen = self._read_state()
            elif self._snapshots and self._snapshots[-1].trace is trace:
                earlier = {id(v): a for v, a in held}
                snapshot = self._snapshots[-1]
                snapshot.before = [(v, earlier.get(id(v), a)) for v, a in snapshot.before]
        return trace

    def _traced(self, state, data):
        """One call of the user's step, with what the optimizer applied as extra outputs."""
        given = tuple(state) if self._user_metrics else tuple(state[:3])
        outer, outer_marks = getattr(_capture, "applies", None), getattr(_capture, "marks", None)
        _capture.applies, _capture.marks = [], []
        here = _trace_mark()
        try:
            out = self._step_fn(given, data)
            applies, marks = _capture.applies, _capture.marks
        finally:
            _capture.applies, _capture.marks = outer, outer_marks
        # An update inside a jax.jit the step calls ran in that function's own trace: its
        # gradients cannot come out here (they would be leaked tracers), so they are left out.
        kept = [a for a, mark in zip(applies, marks) if mark == here]
        if len(kept) < len(applies):
            self._tell_once("nested", NESTED_JIT_MESSAGE)
        applies = kept
        loss, aux, new_state = _unpack_step_output(out, given, self._variable_lists())
        logs = {"loss": loss}
        if isinstance(aux, dict):
            logs.update(aux)
        new_state = tuple(list(part) for part in new_state) + ((list(state[3]),) if not self._user_metrics else ())
        captured = [{name: {"gradients": grads, "learning_rate": rate}} for name, grads, rate in applies]
        return logs, new_state, captured

    def _jitted(self):
        if self._function is None:
            self._function = jax.jit(self._traced)  # no donation: the arrays the step starts from are the rewind's
        return self._function

    def _check_fits(self, data):
        self._built_for = CompiledState(self.model)
        state = self._read_state()
        try:
            with self._capturing():
                if self.mode == "xla":
                    self._jitted().trace(state, data)
                else:
                    try:
                        jax.eval_shape(self._traced, state, data)
                    except _NEEDS_VALUES:
                        pass  # a step that reads values as Python: checked as it runs
        except _StepShapeError:
            raise
        except Exception as error:  # noqa: BLE001 - said with the batch and the expected step
            text = str(error)
            hint = ""
            if "unpack" in text and not self._user_metrics and "expected 4" in text:
                hint = " (a step whose state has metric_variables needs metrics=[...], the metrics they are of)"
            elif "unpack" in text and self._user_metrics and "expected 3" in text:
                hint = " (metrics=[...] adds their variables to the state as its fourth element)"
            raise ValueError(STEP_FAILS.format(batch=_describe(data), error=_one_line(error),
                                               metrics=_metrics_note(self._user_metrics), hint=hint)) from error

    @contextlib.contextmanager
    def _capturing(self):
        """The wrapper that sees what the optimizer applies, on for the call only."""
        hooks = hooks_for(self.model)
        keys = variable_keys(self.model.trainable_variables)
        try:
            if compat.applies_inside_cond(self._optimizer):
                self._tell_once("optimizer", LOSS_SCALED_MESSAGE.format(name="optimizer"))
            else:
                hooks.wrap(self, compat.update_step_owner(self._optimizer), compat.UPDATE_STEP,
                           _marked(_update_step_wrapper("optimizer", keys)), role="capture")
            yield
        finally:
            hooks.release(self)

    def _predictions(self, state, data):
        """The model's forward pass (`stateless_call` as the guide calls it, without
        `training`) on the state the step started from, or None where it cannot run."""
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        if self._forward_for != self.mode:
            model = self.model

            def forward(trainable, non_trainable, x):
                return model.stateless_call(trainable, non_trainable, x)[0]

            self._forward = jax.jit(forward) if self.mode == "xla" else forward
            self._forward_for = self.mode
        if self._forward is None:
            return None
        try:
            return to_numpy(self._forward(state[0], state[1], x))
        except Exception:  # noqa: BLE001 - a model without call() on x: no predictions
            self._forward = None
            return None

    def _fill(self, trace, state, logs, new_state, applies, data):
        logs = dict(logs)
        batch_values, running, offset = {}, [], 0
        for metric in self._user_metrics:
            count = len(metric.variables)
            before, after = state[3][offset:offset + count], new_state[3][offset:offset + count]
            offset += count
            logs[metric.name] = metric.stateless_result(after)  # the running value, as metric.result() reads
            if is_mean(metric):
                places = [next(i for i, v in enumerate(metric.variables) if v is part)
                          for part in (metric.total, metric.count)]
                d_total, d_count = (float(np.asarray(after[i], np.float64) - np.asarray(before[i], np.float64))
                                    for i in places)
                if d_count:
                    batch_values[metric.name] = d_total / d_count
                    continue
            running.append(metric.name)
        super()._fill(trace, state, logs, new_state, applies, data)
        for name, value in batch_values.items():
            trace.row[name] = value
        trace.running = list(trace.running) + [c for name in running
                                               for c, _ in schema.number_columns(name, trace.logs[name])]


NESTED_JIT_MESSAGE = (
    "The step applies the optimizer inside a jax.jit-ed function it calls (a jit within the step): that update "
    "runs in the inner function's own trace, so its gradients cannot be read out and the traces hold none. The "
    "steps themselves are the step's. Call the inner function's Python (its __wrapped__) in the step to see them.")


def _trace_mark():
    """What identifies the JAX trace running now (jit, or none), to tell an update the
    step's own trace ran from one inside a jax.jit the step calls."""
    try:
        from jax._src import core as jax_core

        return jax_core.get_opaque_trace_state(convention="flax")
    except (ImportError, AttributeError, TypeError):  # another jax: every update taken as the step's own
        return None


def _marked(factory):
    """`_update_step_wrapper`'s factory, noting the trace each captured update ran in."""
    def wrap(inner):
        wrapped = factory(inner)

        def update_step(grads, trainable_variables, learning_rate):
            marks = getattr(_capture, "marks", None)
            if marks is not None and getattr(_capture, "applies", None) is not None:
                marks.append(_trace_mark())
            return wrapped(grads, trainable_variables, learning_rate)
        return update_step
    return wrap


def _python_step(step_fn):
    """The Python function of a step (a jax.jit-ed one's wrapped function) and
    whether it was jitted; a TypeError for one that cannot take (state, data)."""
    if not callable(step_fn):
        raise TypeError(STEP_SHAPE.format(metrics="[, metric_variables]")
                        + f"Got a {type(step_fn).__name__}, which is not callable.")
    jitted = hasattr(step_fn, "lower") and hasattr(step_fn, "__wrapped__")
    python_fn = step_fn.__wrapped__ if jitted else step_fn
    try:
        signature = inspect.signature(python_fn)
    except (TypeError, ValueError):  # a builtin or C callable: checked by its first call
        return python_fn, jitted
    names = [p.name for p in signature.parameters.values()]
    name = getattr(python_fn, "__name__", type(python_fn).__name__)
    try:
        signature.bind(None, None)
    except TypeError:
        raise TypeError(STEP_SHAPE.format(metrics="[, metric_variables]")
                        + f"{name}({', '.join(names)}) cannot be called with (state, data).") from None
    if names[:2] == ["x", "y"]:
        raise TypeError(STEP_SHAPE.format(metrics="[, metric_variables]")
                        + f"{name}(x, y) is TensorFlow's from_step shape (a stateful step on the batch); on JAX "
                        "the step threads the state: write it as train_step(state, data) returning (loss, state).")
    return python_fn, jitted


def _the_optimizer(optimizers, model):
    if isinstance(optimizers, keras.optimizers.Optimizer):
        optimizers = [optimizers]
    optimizers = [] if optimizers is None else list(optimizers)
    if not optimizers:
        optimizer = getattr(model, "optimizer", None)
        if isinstance(optimizer, keras.optimizers.Optimizer):
            return optimizer
        raise ValueError("lab.Stepper.from_step needs the optimizer the step applies (its variables are the "
                         "state's third element): optimizers=[optimizer].")
    if len(optimizers) > 1:
        raise ValueError(f"lab.Stepper.from_step on JAX takes one optimizer, got {len(optimizers)}: the step's "
                         "state holds one optimizer_variables list. Write a step with several as the model's "
                         "train_step and use lab.Stepper(model, data).")
    optimizer = optimizers[0]
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"optimizers must hold a keras optimizer, got {type(optimizer).__name__}.")
    return optimizer


def _the_metrics(metrics):
    if isinstance(metrics, keras.metrics.Metric):
        metrics = [metrics]
    metrics = [] if metrics is None else list(metrics)
    for metric in metrics:
        if not isinstance(metric, keras.metrics.Metric):
            raise TypeError(f"metrics must hold keras.metrics.Metric objects, got {type(metric).__name__}.")
    return metrics


def _metrics_note(metrics):
    if not metrics:
        return ""
    names = ", ".join(m.name for m in metrics)
    return f", metric_variables (the variables of {names}, one metric after another)"


def _unpack_step_output(out, given, variable_lists):
    """(loss, aux or None, state) of what the step returned; a TypeError naming
    what differs from `(loss, state)` with the state it was given."""
    parts = ("trainable_variables", "non_trainable_variables", "optimizer_variables", "metric_variables")
    prefix = STEP_SHAPE.format(metrics="[, metric_variables]")
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        kind = f"a {type(out).__name__}" + (f" of {len(out)}" if isinstance(out, (tuple, list)) else "")
        raise _StepShapeError(prefix + f"The step returned {kind}, not (loss, state).")
    head, state = out
    loss, aux = (head[0], head[1]) if isinstance(head, (tuple, list)) and len(head) == 2 else (head, None)
    if isinstance(head, (tuple, list)) and len(head) != 2:
        raise _StepShapeError(prefix + f"The step's loss is a {type(head).__name__} of {len(head)}, "
                              "not a loss or (loss, aux).")
    if not (isinstance(state, (tuple, list)) and len(state) == len(given)):
        kind = f"a {type(state).__name__}" + (f" of {len(state)}" if isinstance(state, (tuple, list)) else "")
        raise _StepShapeError(prefix + f"The step was given a state of {len(given)} "
                              f"({', '.join(parts[:len(given)])}) and returned {kind} as the state.")
    for index, (new, old, variables) in enumerate(zip(state, given, variable_lists)):
        if not isinstance(new, (tuple, list)) or len(new) != len(old):
            length = f" of {len(new)}" if isinstance(new, (tuple, list)) else ""
            raise _StepShapeError(prefix + f"The state's {parts[index]} went in as a list of {len(old)} arrays and "
                                  f"came back as a {type(new).__name__}{length}.")
        for variable, a, b in zip(variables, new, old):
            if jnp.shape(a) != jnp.shape(b):
                raise _StepShapeError(prefix + f"The state's {parts[index]} came back with shape {jnp.shape(a)} for "
                                      f"{getattr(variable, 'path', variable.name)}, shaped {jnp.shape(b)}: return "
                                      "the state in the order it went in.")
    return loss, aux, state


def _update_step_wrapper(name, keys):
    """The capture's wrapper of an optimizer's update step: notes the
    gradients it applies, by variable key, and the learning rate it uses."""
    def wrap(inner):
        def update_step(grads, trainable_variables, learning_rate):
            applies = getattr(_capture, "applies", None)
            if applies is not None:
                # Read inside Keras' stateless scope: a schedule's or a variable's value as this step uses it.
                rate = jnp.asarray(getattr(learning_rate, "value", learning_rate), jnp.float32)
                grads = list(grads)
                pairs = {keys[id(v)]: g for g, v in zip(grads, trainable_variables) if g is not None and id(v) in keys}
                applies.append((name, pairs, rate))
            return inner(grads, trainable_variables, learning_rate)
        return update_step
    return wrap


# ---- breakpoints, on the host ----------------------------------------------------


def trace_condition(condition, state=None):
    """`condition` as a callable on a StepTrace (Keras on JAX).

    Args:
        condition: callable `condition(trace)`, a `lab.Breakpoint` (checked
            against the step's row), or a device-side breakpoint
            (`lab.breakpoints.nonfinite()`, `loss_spike(...)`), evaluated here
            on the host on the step's loss and applied gradients.
        state: dict or None, where a `loss_spike` keeps its running average
            (the stepper's, so that a rewind puts it back); None keeps it here.

    Raises:
        TypeError: `condition` is none of these.
    """
    if isinstance(condition, DeviceBreakpoint) or getattr(condition, "on_device", False):
        name = getattr(condition, "name", "")
        if name == "nonfinite":
            return _nonfinite
        if name.startswith("loss_spike"):
            return _loss_spike(condition, {} if state is None else state)
        raise TypeError(f"{condition!r} is a device breakpoint the lab cannot evaluate on JAX: use "
                        "lab.breakpoints.nonfinite(), loss_spike(...) or a condition(trace) -> bool.")
    if hasattr(condition, "hit") and callable(condition.hit):
        return lambda trace: condition.hit(pd.Series({"step": trace.index, "epoch": trace.epoch,
                                                       "batch": trace.batch, **trace.row}))
    if callable(condition):
        return lambda trace: bool(condition(trace))
    raise TypeError(
        f"run_until needs a callable condition(trace) -> bool or a lab.Breakpoint, got {type(condition).__name__}: "
        "e.g. stepper.run_until(lab.breakpoints.nonfinite()) or stepper.run_until(lambda t: t.loss > 3).")


def _nonfinite(trace):
    loss = trace.row.get(schema.LOSS)
    if loss is not None and not np.isfinite(loss):
        return True
    return any(not np.all(np.isfinite(g)) for g in trace.gradients.values())


def _loss_spike(point, state):
    told = []

    def check(trace):
        loss = trace.row.get(schema.LOSS)
        if loss is None:
            if not told:
                told.append(True)
                warnings.warn(f"{point.name} watches the step's loss, and this step logs no 'loss' "
                              f"(its values: {', '.join(sorted(trace.row)) or 'none'}): it can never hit. "
                              "Stop on a logged value with a condition instead: "
                              "stepper.run_until(lambda trace: trace.row['g_loss'] > 10).",
                              UserWarning, stacklevel=3)
            return False
        # As the device check computes it (lab.breakpoints._LossSpike), in float32.
        loss = np.float32(loss)
        average, seen = state.get(id(point), (np.float32(0.0), np.float32(0.0)))
        spike = bool((seen >= point.warmup and loss > np.float32(point.factor) * average) or not np.isfinite(loss))
        if not spike:
            decay = np.float32(point.decay)
            updated = loss if seen == 0 else decay * average + (np.float32(1) - decay) * loss
            state[id(point)] = (np.float32(updated), np.float32(seen + 1))
        return spike

    return check


# ---- helpers -------------------------------------------------------------------


def _pairs(variable_lists):
    return [(variable, variable.value) for variables in variable_lists for variable in variables]


def _assign(pairs):
    for variable, array in pairs:
        if variable.value is not array:
            variable.assign(array)


def _copy(value):
    if value is None:
        return None
    return keras.tree.map_structure(lambda leaf: None if leaf is None else np.array(leaf, copy=True), value)


def _same_array(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def _log_entries(logs):
    for name, value in logs.items():
        yield from (value.items() if isinstance(value, dict) else [(name, value)])


def _scalar_or_array(value):
    array = np.asarray(value)
    return float(array) if array.ndim == 0 and array.dtype.kind in "fiub" else array


def _describe(data):
    def leaf(value):
        return None if value is None else f"{np.asarray(value).dtype} {tuple(np.shape(value))}"

    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    parts = [f"x: {keras.tree.map_structure(leaf, x)}"]
    if y is not None:
        parts.append(f"y: {keras.tree.map_structure(leaf, y)}")
    if sample_weight is not None:
        parts.append(f"sample_weight: {keras.tree.map_structure(leaf, sample_weight)}")
    return ", ".join(parts)


def _input_shapes(model):
    try:
        shapes = [tuple(t.shape) for t in model.inputs]
    except (AttributeError, TypeError, ValueError):  # a subclassed model has no fixed inputs
        return ""
    return " (" + ", ".join(str(s) for s in shapes) + ")" if shapes else ""


def _one_line(error):
    """The error's message on one line, without Keras' terminal bold and its list of the call's arguments."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(error)).split("Arguments received by")[0]
    text = " ".join(text.split())
    if len(text) > 600:
        text = text[:600] + " ..."
    return f"{type(error).__name__}: {text}" + ("" if text.endswith(".") else ".")


def _hint(error):
    text = str(error)
    if text.startswith("train_step returned"):  # `not_logs_message`: it names its fix
        return ""
    if "incompatible" in text.lower() or "shape" in text.lower():
        return ("The batch does not fit the model: check that x has the model's input shape and y the shape "
                "its loss expects (fit() fails on it too).")
    return ""


def _check_list_data(model, data):
    """A list is what fit() takes as the inputs `x` of a model with several
    inputs, never as `(x, y)`: said at construction for a model with one."""
    if not isinstance(data, list) or len(data) < 2:
        return
    try:
        inputs = len(model.inputs)
    except (AttributeError, TypeError, ValueError):
        return
    if inputs == 1:
        raise ValueError(
            f"data is a list of {len(data)} arrays, which fit() reads as the inputs x of a model "
            f"with several inputs; {model.name!r} has one input. Pass the arrays as a tuple: "
            "`lab.Stepper(model, (x, y))`, as `model.fit(x, y)` takes them.")
    if data and not all(hasattr(leaf, "shape") for leaf in keras.tree.flatten(data)):
        raise TypeError(f"Cannot step through this list. Pass what fit() takes: {DATA_TYPES}.")


# ---- Keras internals -------------------------------------------------------------
# Private attributes of Keras' trainer the stepper needs, read here only, each
# with why (checked on Keras 3.11 to 3.15, `keras/src/trainers/trainer.py`,
# `keras/src/backend/jax/trainer.py`).


def build_as_fit_does(model, data):
    """Builds what `fit()` builds before its first step from a batch: the
    model's layers, the compiled loss and metrics (their variables are part
    of the state train_step takes) and the optimizer (its slots). fit()
    calls `Trainer._symbolic_build` for this; there is no public equivalent
    that builds the compiled metrics."""
    build = getattr(model, "_symbolic_build", None)
    if build is not None:
        build(data_batch=data)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and not optimizer.built:
        optimizer.build(model.trainable_variables)


def call_kwargs(model):
    """What the trainer passes the model's `call` besides its inputs:
    `training=True` only where `call` takes a `training` argument
    (`Layer._call_has_training_arg`, which the JAX trainer reads too);
    `stateless_call` hands keyword arguments on to `call` as they are."""
    return {"training": True} if getattr(model, "_call_has_training_arg", True) else {}


def distributed_as_fit_does(data):
    """A batch laid out over the devices as fit() lays it out under a
    `keras.distribution` (DataParallel: split along the batch), so that a
    step sums its gradients in fit()'s order; as it is without one. fit()
    calls the JAX trainer's module function `_distribute_data` for this."""
    if keras.distribution.distribution() is None:
        return data
    from keras.src.backend.jax import trainer as jax_trainer

    return jax_trainer._distribute_data(data)


def state_shardings_as_fit_does(model):
    """The shardings fit()'s jitted step gives the state it returns under a
    `keras.distribution` (`JAXTrainer._get_state_sharding_spec`), or None
    without one: the stepper's step keeps the variables laid out as fit() does."""
    if keras.distribution.distribution() is None:
        return None
    spec = getattr(model, "_get_state_sharding_spec", None)
    # Before Keras 3.13 fit() jits its step without out_shardings; the step
    # lays its state out itself (`_enforce_jax_state_sharding`).
    return None if spec is None else spec()
