"""watch(): the lab's probes on a training loop the user wrote.

A hand-written loop has no `train_step` for the lab to bracket, so a step's
values cannot be gathered inside one graph the way the Recorder gathers them.
Instead the optimizer hooks (the Probe's, through `lab.backend.tensorflow.loop_probe.LoopProbe`)
write what they measure into a ring of rows on the device, one row per step,
in whatever graph the user's step runs (eager, `tf.function`, XLA). Once per
step the user calls `run.step(loss=..., **metrics)`, and the next row runs:
each call of a traced step takes its row from the host as an input, so
closing a step is no op on the device. The loss and metrics are kept as the
tensors they are. Nothing waits for the device until the rows are read, in
one block: on a timer, every `capacity` steps, when the run is read and at the end.

While watching, the lab also names the fix for the mistakes hand-written
steps are known for: a loss computed outside the tape (no gradient at all),
`apply_gradients` with `None` gradients, a metric that is never updated, a
`tf.function` that traces again on every call, a step traced before the
lab was watching, and an optimizer watched that the loop never applies. A
first argument that is no model, or a model with no optimizer to watch, is
refused at the `watch(...)` call.
"""

import contextlib
import numbers
import threading
import time
import types

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.framework.ops import EagerTensor

from lab import breakpoints as breakpoints_module
from lab import schema
from lab.arguments import GRADIENTS_EXAMPLE, WEIGHTS_EXAMPLE, check_flag, check_number, check_seconds
from lab.backend.tensorflow import compat
from lab.backend.tensorflow.loop_probe import LoopProbe
from lab.backend.tensorflow.norms import shown_names
from lab.backend.tensorflow.probes import OVERWRITTEN_NOTE, overwritten
from lab.breakpoints import BreakpointHit
from lab.run import Run
from lab.signals import interrupt_detail, is_interrupt
from lab.status import StatusReporter
from lab.variables import find_optimizers

# What run.step keeps for a step given no `epoch=` or `batch=` (read only).
_NO_HOST = types.MappingProxyType({})
_NAN = np.float32(np.nan)
# The dtypes run.step takes as they are, in a step's output (an `EagerTensor`,
# the class named: making a tensor at import would start TensorFlow's runtime).
_NUMBER_DTYPES = frozenset(dtype for dtype in (tf.as_dtype(name) for name in (
    "float16", "bfloat16", "float32", "float64", "int8", "int16", "int32", "int64",
    "uint8", "uint16", "uint32", "uint64", "bool")))
# Steps after which a metric that never changed is reported.
CONSTANT_METRIC_STEPS = 10
# Steps of a block with no apply by any watched optimizer after which the run
# says so (and at the block's end, however few). Applies are counted (see
# `_applies`), not updates: one that only accumulates (Keras'
# `gradient_accumulation_steps`, whatever its k) counts. Only a loop that calls
# `apply_gradients` less often than once in 32 steps (its own accumulation over
# more than 32 batches, past the usual 2 to 16) is told wrongly.
UNAPPLIED_STEPS = 32
_RESERVED = ("step", "seconds", "mode", "updated", "grad_norm", "learning_rate")
_HOST_COLUMNS = ("epoch", "batch")

CONSTANT_METRIC_MESSAGE = (
    "The metric {metric!r} has been {value:g} for all {steps} steps while the loss "
    "changed: it is probably never updated. Call `{metric}.update_state(y, y_pred)` "
    "in the step (inside the @tf.function too), pass `{metric}.result()` (or the "
    "metric) to run.step, and call `{metric}.reset_state()` where an epoch begins."
)
UNSEEN_UPDATE_MESSAGE = (
    "The optimizer {name!r} updated the weights in {count} step(s) without the lab "
    "seeing it: the @tf.function step was traced before `lab.watch` first watched "
    "this model, so its graph has no probes. Enter `with lab.watch(...)` before the "
    "first call of the step, or wrap it anew inside the block: "
    "`train_step = tf.function(train_step.python_function)`."
)
NEVER_UPDATED_MESSAGE = (
    "{variables}: trainable variables of the watched model that no watched optimizer updated in "
    "this block (a target network the loop assigns by hand, variables it hands to no watched "
    "optimizer, or a layer no loss reaches): they have no gradient, weight-norm or update-ratio "
    "values. Watch the optimizer that trains them, lab.watch(model, optimizer_a, optimizer_b), "
    "if one does.")
UNAPPLIED_MESSAGE = (
    "{watched} in {steps} steps, so the run has no gradient norms and `updated` is 0. Pass "
    "the optimizer your loop applies: `lab.watch(model, optimizer)` (`lab.watch(model)` "
    "watches the model's own, such as the default one `model.compile()` makes, also when "
    "the loop applies another). A loop that updates without an optimizer (gradient ascent "
    "by hand, `img += lr * grads`) gives lab.watch nothing to record but what run.step is "
    "given. A loop that applies its gradients less often than once in {steps} steps "
    "(accumulating them by hand) may ignore this."
)
NO_MODEL_MESSAGE = (
    "lab.watch takes the keras.Model (or Layer) your loop trains first, then the optimizers "
    "it applies: `lab.watch(model, optimizer)`; got {got}.{hint}"
)
VARIABLE_HINT = (
    " A loop that trains a variable no model holds (neural style transfer's image) is "
    "watched through the model that computes its loss: `lab.watch(feature_extractor, "
    "optimizer)` records the variable's gradient norm as `grad_norm/<its name>` beside "
    "the optimizer's learning rate and updates."
)
NO_OPTIMIZER_MESSAGE = (
    "lab.watch found no optimizer on the model {model!r} (not compiled with one, no optimizer "
    "attribute): it records what the optimizers of a loop apply, so it needs the one your loop "
    "calls `apply_gradients` on: `lab.watch(model, optimizer)`. A loop that updates by hand, "
    "without an optimizer (deep dream's gradient ascent, `img += lr * grads`), has nothing for "
    "lab.watch to record: make the update an optimizer's (`img` a `tf.Variable`, "
    "`optimizer = keras.optimizers.SGD(lr)`, `optimizer.apply_gradients([(-grads, img)])`, "
    "then watch the model with it), or keep the losses in a `lab.Run` yourself: "
    "`run = lab.Run()`, then `run.append_batches({{'loss': [float(loss)]}})` at each step."
)
UNRECORDED_MESSAGE = (
    "This step updated the weights without its {what} being recorded: the @tf.function step "
    "was traced in an earlier `lab.watch` block {how}, and a graph keeps the settings it was "
    "traced under, so the run's {columns} columns are NaN. Wrap it anew inside this block, "
    "`train_step = tf.function(train_step.python_function)`, so its graph records them."
)
_UNRECORDED = {
    "gradients": ("gradient norms", "with gradients=False", "grad_norm"),
    "weights": ("weight norms", "without weights=True", "weight_norm and update_ratio"),
}
UNGATED_MESSAGE = (
    "This step updated the weights without the device breakpoints being checked: the "
    "@tf.function step was traced in a `lab.watch` block without breakpoints (or before "
    "any). Wrap it anew inside this block, `train_step = tf.function(train_step.python_function)`, "
    "so its graph checks them."
)


class WatchedRun(StatusReporter, Run):
    """The `lab.Run` a `lab.watch` block yields; `run.step(...)` closes each step's row.

    Like a Recorder, it has a `status` ("running" inside the block, then
    "finished", "stopped" after a breakpoint, "failed" or "interrupted") and
    `add_status_listener(fn)`, so a view can follow a loop as it follows fit().

    Args:
        probe: LoopProbe, installed on the loop's optimizers.
        breakpoints: sequence of `lab.Breakpoint` (device-side and row conditions).
        flush_every: float, seconds between reads of the steps' values.
        name: str, the run's label.
    """

    def __init__(self, probe, breakpoints=(), flush_every=0.25, name="run"):
        super().__init__(name=name)
        self.probe = probe
        self.flush_every = flush_every
        self._row_points = [p for p in breakpoints if not getattr(p, "on_device", False)]
        self._pending = []  # (host columns, seconds, values, ring row) of unread steps
        self._steps = 0
        self._last = time.perf_counter()
        self._last_flush = time.perf_counter()
        self._flush_lock = threading.Lock()
        # Closing a step (its ring row and its entry in _pending) and taking
        # the closed steps are atomic with each other: a reader in another
        # thread never splits a step.
        self._rows_lock = threading.Lock()
        self._given = None
        self._iterations = None
        self._first_applies = None
        self._applied_checked = False
        self._constant_checked = False
        self._closed = False
        self._init_status()

    def _status_kept_in(self):
        return self.metadata

    def step(self, loss=None, **metrics):
        """Closes this step's row: the loss and metrics given, the probes' values.

        Does not wait for the device. With device breakpoints, a traced step
        tells the host when one hits, and only then is its row read; where a
        step cannot (XLA, a replica of a distribution strategy, or a step
        traced before breakpoints were asked for), each step's row is read to
        know whether to raise.

        Args:
            loss: scalar tensor, float or None; a tensor of per-example losses
                is averaged.
            **metrics: name -> scalar tensor, float or `keras.metrics.Metric`
                (its `result()`; a vector result, such as F1Score's per
                class, one column per element, `<name>/<index>`); `epoch=`
                and `batch=` are kept as ints.

        Returns:
            int, this step's index in the run (from 0).

        Raises:
            lab.BreakpointHit: when a breakpoint hits at this step.
        """
        now = time.perf_counter()
        if self._closed:
            raise RuntimeError("This run's `lab.watch` block has ended; call run.step inside it.")
        if not tf.executing_eagerly():
            raise RuntimeError(
                "run.step(...) was called inside a @tf.function: call it in the Python loop, "
                "after the step, with what the step returns: `loss = train_step(x, y)`, "
                "then `run.step(loss=loss)`.")
        try:
            return self._close(now - self._last, now, loss, metrics)
        finally:
            # The next step's time starts here: the lab's own work is not the loop's.
            self._last = time.perf_counter()

    def _close(self, seconds, now, loss, metrics):
        # Called once per step of the user's loop, between two steps, when
        # the step has left the caches cold: kept to few Python operations.
        host = {k: int(metrics.pop(k)) for k in _HOST_COLUMNS if k in metrics} if metrics else _NO_HOST
        if loss is not None:
            metrics = {"loss": loss, **metrics} if metrics else {"loss": loss}
        if self._given is None:
            self._start(metrics)
        values = [_value(name, metrics[name]) if name in metrics else _NAN for name in self._given]
        if metrics.keys() - self._given_set:
            new = [name for name in metrics if name not in self._given_set]
            self.probe.warn_once(("new", tuple(new)), (
                f"run.step got {new} after the first step, which set the columns "
                f"{self._given}: they are not recorded. Pass every value from the first step "
                "on (or a new `lab.watch` block)."), RuntimeWarning)
        with self._rows_lock:
            taken = self.probe.take()
            index = self._steps
            self._steps += 1
            self.probe.steps_seen = self._steps
            self._pending.append((host, seconds, values, taken))
        if self.probe.warnings:
            self._note_warnings()
        if self.probe.breakpoints and (not self.probe.tells_hits() or self.probe.hit_told()):
            # Where every gate tells its hits, the device is read only on one.
            # An update that ran no gate is found when the rows are read.
            hit = self.probe.hit(taken)
            if hit > 0:
                self.flush()
                self._device_hit(index, int(hit))
        if self._row_points:
            start = len(self)
            self.flush()
            self._check_rows(start)
        elif now - self._last_flush >= self.flush_every or len(self._pending) >= self._rows_kept:
            self.flush()
        return index

    def _start(self, metrics):
        for name in metrics:
            if name in _RESERVED or name.startswith(("_", "grad_norm/", "weight_norm/", "update_ratio/",
                                                     "learning_rate/")):
                raise ValueError(
                    f"run.step(... {name}=...) uses a name the lab fills in itself; "
                    f"rename it (e.g. `my_{name.lstrip('_')}`).")
        self._given = list(metrics)
        self._given_set = frozenset(self._given)
        # A keras metric whose result is a vector (F1Score(average=None): one
        # value per class) gets a column per element, as in a Recorder's rows.
        lengths = {name: _vector_length(metrics[name]) for name in self._given}
        self._vectors = {name: length for name, length in lengths.items() if length is not None}
        self._rows_kept = self.probe.rows_kept
        self.probe.freeze()

    # ---- reading the device ------------------------------------------------

    def flush(self):
        """Moves the steps taken since the last flush into the run; returns how many.

        The only wait for the device: the steps' values are read in one block.
        """
        if not self._flush_lock.acquire(blocking=False):
            return 0  # a subscriber reading the run while rows are being moved
        try:
            self._last_flush = time.perf_counter()
            moved = self._move_pending()
            if not moved:
                return 0
            if len(self) >= UNAPPLIED_STEPS:
                self._check_applied()
            self._check_constant_metrics()
            self.probe.note_xla(self, len(self) - 1)
            self.probe.note_trace_facts(self, len(self) - 1)
            return moved
        finally:
            self._flush_lock.release()

    def _move_pending(self):
        """Reads the steps taken and appends their rows; returns how many.

        Until the run has them, nothing is lost: an exception before that (a
        Ctrl-C landing where the host waits for the device, a warning made an
        error) leaves the steps to the next read, their rows on the device as
        they are."""
        pending, appended = None, False
        try:
            with self._rows_lock:
                pending, self._pending = self._pending, []
                if not pending:
                    return 0
                # Read with the steps taken: a step closed after them has its updates in their rows.
                counts = self._update_counts()
            columns = {"seconds": np.array([p[1] for p in pending])}
            for key in _HOST_COLUMNS:
                if any(key in p[0] for p in pending):
                    columns[key] = np.array([p[0].get(key, -1) for p in pending])
            for position, name in enumerate(self._given):
                if name in self._vectors:
                    elements = _elements([p[2][position] for p in pending], self._vectors[name])
                    columns.update((schema.element_column(name, i), column) for i, column in enumerate(elements))
                else:
                    columns[name] = _to_numpy([p[2][position] for p in pending])
            raw = self.probe.read_rows([p[3] for p in pending])
            if self.probe.breakpoints:
                self._check_ungated(raw)
            self._check_unrecorded(raw)
            rows = self.probe.row_columns(raw, first_step=len(self))
            columns.update(rows)
            self._check_unseen_updates(rows, counts)
            self.append_batches(columns)
            appended = True
            return len(pending)
        finally:
            if appended:
                self.probe.reset_rows([p[3] for p in pending])
            elif pending and pending is not self._pending:
                with self._rows_lock:
                    self._pending = pending + self._pending

    def batches(self):
        if not self._closed:
            self.flush()
        return super().batches()

    def column(self, name, start=0, stop=None):
        if not self._closed:
            self.flush()
        return super().column(name, start, stop)

    # ---- breakpoints and checks -------------------------------------------

    def _device_hit(self, index, number):
        point = self.probe.breakpoints[number - 1]
        detail = f"{point.name} at step {index}; update skipped"
        # Read on the hit only: weights the step assigned itself are not the gate's to keep out.
        not_finite = [variable.path for variable in self.probe.model.trainable_variables
                      if "float" in str(variable.dtype)
                      and not np.isfinite(keras.ops.convert_to_numpy(variable)).all()]
        if not_finite:
            detail += f"; not finite, assigned by the step outside the optimizer: {', '.join(not_finite)}"
        self.add_event("nonfinite" if point.name == "nonfinite" else "breakpoint", detail, step=index)
        self.probe.release()
        raise BreakpointHit(index, point.name, detail, skipped=True, not_finite=not_finite)

    def _check_ungated(self, raw):
        first = self.probe.first_ungated(raw)
        if first is not None:
            self.probe.warn_once("ungated", UNGATED_MESSAGE, RuntimeWarning, step=len(self) + first)

    def _check_unrecorded(self, raw):
        for setting, first in self.probe.first_unrecorded(raw).items():
            what, how, columns = _UNRECORDED[setting]
            self.probe.warn_once(("unrecorded", setting), UNRECORDED_MESSAGE.format(
                what=what, how=how, columns=columns), RuntimeWarning, step=len(self) + first)

    def _check_rows(self, start):
        frame = super().batches().iloc[start:]
        for _, row in frame.iterrows():
            for point in self._row_points:
                if point.hit(row):
                    detail = point.describe(row)
                    self.add_event("breakpoint", detail, step=int(row["step"]))
                    raise BreakpointHit(int(row["step"]), point.name, detail, skipped=False)

    def _note_warnings(self):
        while self.probe.warnings:
            message, step = self.probe.warnings.pop(0)
            self.add_event("warning", message, step=step)

    def _update_counts(self):
        """Per optimizer: (its iterations, the updates in the running row).

        In this order: an update landing between the two reads is counted
        as waiting, never as unseen."""
        counts = {}
        for name, optimizer in self.probe.optimizers.items():
            iterations = int(optimizer.iterations.numpy())
            counts[name] = (iterations, int(self.probe.waiting_updates(name)))
        return counts

    def _check_unseen_updates(self, rows, counts):
        for name, (iterations, waiting) in counts.items():
            seen = int(np.nansum(rows[f"_updates/{name}"]))
            # Updates since the last run.step(...) belong to the next rows (waiting).
            # Steps that ran in graphs without hooks advance `iterations` only.
            unseen = iterations - self._iterations[name] - seen - waiting
            self._iterations[name] = iterations - waiting
            if unseen > 0:
                self.probe.warn_once(("unseen", name), UNSEEN_UPDATE_MESSAGE.format(name=name, count=unseen),
                                      RuntimeWarning)
        self._note_warnings()

    def _check_applied(self):
        """Warns once when no watched optimizer applied in the block's steps so far; checked once."""
        if self._applied_checked:
            return
        self._applied_checked = True
        if any(compat.optimizer_applies(o) > self._first_applies[name] for name, o in self.probe.optimizers.items()):
            return
        named = [f"{name!r} ({type(o).__name__})" for name, o in self.probe.optimizers.items()]
        watched = (f"The optimizer {named[0]} that lab.watch watches applied no update" if len(named) == 1
                   else f"None of the optimizers lab.watch watches ({', '.join(named)}) applied an update")
        self.probe.warn_once("unapplied", UNAPPLIED_MESSAGE.format(watched=watched, steps=len(self)), UserWarning,
                             step=len(self) - 1)
        self._note_warnings()

    def _note_never_updated(self):
        """Names once, at the block's end, the trainable variables whose
        gradient no row of the block holds though the watched optimizers
        updated (a `fit()` is told the same at its trace: `NO_UPDATE_NOTE`)."""
        if not self.probe.gradients or "updated" not in self.columns:
            return
        updated = np.asarray(super().column("updated")) > 0
        if not updated.any():
            return  # no update at all: `_check_applied` has said so
        never, set_apart = [], []
        for variable in self.probe.model.trainable_variables:
            column = f"grad_norm/{self.probe._key(variable)}"
            if overwritten(variable):
                set_apart.append(self.probe._key(variable))
            elif column not in self.columns or np.isnan(np.asarray(super().column(column))[updated]).all():
                never.append(self.probe._key(variable))
        if set_apart:
            self.add_event("warning", OVERWRITTEN_NOTE.format(variables=shown_names(set_apart)), step=len(self) - 1)
        if never:
            self.add_event("warning", NEVER_UPDATED_MESSAGE.format(variables=shown_names(never)),
                           step=len(self) - 1)

    def _value_columns(self):
        """The columns of the values run.step is given (a vector's, one per element)."""
        columns = []
        for given in self._given:
            if given in self._vectors:
                columns += [schema.element_column(given, i) for i in range(self._vectors[given])]
            else:
                columns.append(given)
        return columns

    def _check_constant_metrics(self):
        if self._constant_checked or len(self) < CONSTANT_METRIC_STEPS:
            return
        self._constant_checked = True
        loss = super().column("loss") if "loss" in self.columns else None
        if loss is None or np.nanmax(loss) == np.nanmin(loss):
            return
        for name in self._value_columns():
            values = super().column(name)
            if name != "loss" and np.isfinite(values).all() and (values == values[0]).all():
                self.probe.warn_once(("constant", name), CONSTANT_METRIC_MESSAGE.format(
                    metric=name, value=float(values[0]), steps=len(values)), UserWarning)
        self._note_warnings()

    # ---- the block's end ---------------------------------------------------

    def _begin(self):
        self._iterations = {name: int(o.iterations.numpy()) for name, o in self.probe.optimizers.items()}
        self._first_applies = {name: compat.optimizer_applies(o) for name, o in self.probe.optimizers.items()}
        self._last = time.perf_counter()
        self._set_status("running")

    def _end(self, error=None):
        try:
            self.flush()
        finally:
            self.probe.uninstall()
            self.probe.end_block()
            self._closed = True
        if self._steps > 0 and error is None:
            self._check_applied()
            self._note_never_updated()
        updates = self._updates_after_last_step()
        unclosed = ""
        if updates > 0:
            unclosed = (f"the optimizers made {updates:g} update{'s' if updates != 1 else ''} after the last "
                        f"run.step(...), which the weights hold and the run has no row for (step {self._steps})")
        if self._steps == 0 and error is None and updates > 0:
            self.probe.warn_once("no step", (
                f"The optimizers updated {updates:g} times but run.step(...) was never "
                "called: the run has no rows. Call `run.step(loss=loss)` once per step."),
                RuntimeWarning)
            self._note_warnings()
        elif error is None and updates > 0:
            self.probe.warn_once("unclosed", (
                f"{unclosed[0].upper()}{unclosed[1:]}. Call `run.step(...)` after every step's update, "
                "also before leaving the loop early."), RuntimeWarning)
            self._note_warnings()
        if is_interrupt(error):
            self.add_event("interrupt", interrupt_detail(error) + (f"; {unclosed}" if unclosed else ""))
            self._set_status("interrupted")
        elif isinstance(error, BreakpointHit):
            self._set_status("stopped", error.detail)
        elif error is not None:
            message = compat.failure_message(error)
            self.add_event("error", message + (f"; {unclosed}" if unclosed else ""))
            self._set_status("failed", message)
            compat.warn_of_cause(error)
        else:
            self._set_status("finished")

    def _updates_after_last_step(self):
        """Updates the optimizers made since the last run.step (reads the device); 0 where it cannot tell."""
        try:
            return self.probe.updates_waiting()
        except Exception:  # noqa: BLE001 - a device the user's error left unreadable: the error is what to show
            return 0.0


def _to_numpy(values):
    """One float32 array from one column's values (tensors averaged, scalars as they are).

    Read one by one: a stack would take a new kernel for each new count of
    tensors, and each read has a new count (about 5 ms per read on a CPU).
    """
    return np.array([_number(v) for v in values], np.float32)


def _number(value):
    if isinstance(value, (tf.Tensor, tf.Variable)):
        value = value.numpy()
        return value if value.ndim == 0 else _mean(value)
    return value


def _vector_length(value):
    """The length of a keras metric's vector result (at most
    `schema.MAX_VECTOR_ELEMENTS`), else None: such a result is one value per
    class or threshold, never per example, so its elements are not averaged."""
    if not isinstance(value, keras.metrics.Metric):
        return None
    shape = tf.convert_to_tensor(value.result()).shape
    if shape.rank == 1 and 1 < (shape[0] or 0) <= schema.MAX_VECTOR_ELEMENTS:
        return int(shape[0])
    return None


def _elements(values, length):
    """The columns of a vector's elements over steps (NaN where a step gave none)."""
    rows = [np.asarray(v.numpy() if isinstance(v, (tf.Tensor, tf.Variable)) else v, np.float32) for v in values]
    return np.array([row if row.shape == (length,) else np.full(length, np.nan, np.float32) for row in rows]).T


def _mean(values):
    """The mean of an array; NaN (no value) for an empty one, without numpy's warning."""
    return np.mean(values) if values.size else np.float32(np.nan)


def _value(name, value):
    """A value for run.step as a tensor or float32 array (never a Python float,
    which would make the row function trace again for each new value)."""
    if type(value) is EagerTensor and value.dtype in _NUMBER_DTYPES:
        return value  # the usual loss: a step's output, as it is
    if isinstance(value, keras.metrics.Metric):
        value = value.result()
    if isinstance(value, keras.Variable):
        value = value.value
    if isinstance(value, (tf.Tensor, tf.Variable)):
        if not (value.dtype.is_floating or value.dtype.is_integer or value.dtype.is_bool):
            raise TypeError(f"run.step({name}=...) needs a number; got a {value.dtype.name} tensor.")
        if isinstance(value, tf.Variable):
            value = value.read_value()  # this step's value, not the variable's later one
        return value
    if isinstance(value, tf.distribute.DistributedValues):
        raise TypeError(
            f"run.step({name}=...) got one value per replica (what `strategy.run` returns): give it the "
            f"batch's value, reduced across the replicas: `strategy.reduce(\"SUM\", {name}, axis=None)` for a "
            "loss scaled by the global batch (`tf.nn.compute_average_loss`), `\"MEAN\"` for a value each "
            "replica averaged over its own share.")
    try:
        return float(_mean(np.asarray(value, np.float32)))
    except (TypeError, ValueError):
        raise TypeError(
            f"run.step({name}=...) needs a number, a tensor or a keras metric; got "
            f"{type(value).__name__}.") from None


def _check_model(model):
    """Refuses a first argument that is no keras Layer, naming what to pass instead."""
    if isinstance(model, keras.layers.Layer):
        return
    hint = ""
    if isinstance(model, keras.optimizers.Optimizer):
        got = f"a keras optimizer ({type(model).__name__}) first"
    elif isinstance(model, (tf.Variable, keras.Variable)):
        got, hint = f"a {_kind(model)} ({model.name!r})", VARIABLE_HINT
    elif isinstance(model, (list, tuple)):
        kinds = sorted({_kind(item) for item in model})
        got = f"a {type(model).__name__} of {', '.join(kinds)}" if kinds else f"an empty {type(model).__name__}"
        if any(isinstance(item, (tf.Variable, keras.Variable)) for item in model):
            hint = VARIABLE_HINT
        elif any(isinstance(item, keras.layers.Layer) for item in model):
            hint = (" To watch several models trained together, pass one model that holds them all (a GAN "
                    "with its generator and discriminator as attributes) and each optimizer: "
                    "`lab.watch(gan, g_opt, d_opt)`.")
    elif model is None:
        got, hint = "None", VARIABLE_HINT
    else:
        got = f"a {_kind(model)}"
    raise TypeError(NO_MODEL_MESSAGE.format(got=got, hint=hint))


def _kind(value):
    if isinstance(value, keras.Variable):
        return "keras.Variable"
    if isinstance(value, tf.Variable):
        return "tf.Variable"
    return type(value).__name__


def _name_optimizers(model, optimizers, named):
    attributes = {id(v): k for k, v in vars(model).items()
                  if isinstance(v, keras.optimizers.Optimizer) and k != "_optimizer"}
    if getattr(model, "optimizer", None) is not None:
        attributes.setdefault(id(model.optimizer), "optimizer")
    result = {}
    for position, optimizer in enumerate(optimizers):
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise TypeError(
                f"lab.watch(model, *optimizers): argument {position + 1} after the model is a "
                f"{type(optimizer).__name__}, not a keras optimizer. Pass the optimizers your "
                "loop calls `apply_gradients` on.")
        name = attributes.get(id(optimizer))
        if name is None:
            name = "optimizer" if len(optimizers) == 1 else f"optimizer_{position}"
        result[name] = optimizer
    for name, optimizer in named.items():
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise TypeError(
                f"lab.watch() got an unexpected keyword {name}={type(optimizer).__name__}: keywords "
                "other than gradients, weights, breakpoints, flush_every and capacity name "
                "optimizers (e.g. `lab.watch(model, generator=g_opt, discriminator=d_opt)`).")
        result[name] = optimizer
    if not result:
        result = find_optimizers(model)
    if not result:
        raise ValueError(NO_OPTIMIZER_MESSAGE.format(model=model.name))
    if len({id(o) for o in result.values()}) < len(result):
        raise ValueError("lab.watch got the same optimizer twice; pass each one once.")
    return result


def watch(model, *optimizers, gradients=True, weights=False, breakpoints=(), flush_every=0.25,
          capacity=1024, **named_optimizers):
    """Watches a training loop you wrote; yields a `lab.Run`.

    Inside the block, call `run.step(loss=..., **metrics)` once per step,
    after the optimizer's update. Each call closes that step's row: `step`,
    `seconds` (host time from the end of the previous call), the values given,
    `learning_rate` (`learning_rate/<name>` with several optimizers),
    `updated`, and with `gradients=True` `grad_norm` and
    `grad_norm/<variable.path>` of the gradients the optimizers applied; with
    `weights=True` also `weight_norm/<path>` and `update_ratio/<path>`. The
    step may be eager, a `tf.function` or `tf.function(jit_compile=True)`;
    trace it inside a block (a graph traced before the model's first block
    has no probes; one traced in a block is watched again in later blocks,
    with the settings it was traced under). Rows
    reach the run in blocks (every `flush_every` seconds and when it is read).
    `run.step` does not wait for the device: with device breakpoints, a
    traced step tells the host when one hits and only then is its row read
    (under XLA or a strategy's replicas, one small vector is read per step).
    The probes are removed when the block ends, also when the loop raises.

    Optimizers are named by the model attribute that holds them
    (`optimizer`, `d_opt`), else `optimizer` for a single one and
    `optimizer_0`, `optimizer_1`, ... by position; or name them with
    keywords: `lab.watch(model, generator=g_opt, discriminator=d_opt)`.
    With none given, the model's own optimizers are watched.

    Args:
        model: keras.Model, whose `trainable_variables` name the gradient columns.
        *optimizers: keras optimizers the loop applies gradients with.
        gradients: bool, record the norms of the applied gradients.
        weights: bool, record weight norms and update/weight ratios.
        breakpoints: sequence; `lab.breakpoints.nonfinite()` is checked on the
            device before each update and keeps a bad update out of the weights
            (under a LossScaleOptimizer: the loss the step hands its
            `scale_loss`, in the graph of the update); a
            `lab.Breakpoint(condition)` sees each row after its update. A hit
            raises `lab.BreakpointHit` from that step's `run.step`.
        flush_every: float, seconds between reads of the steps' values.
        capacity: int, steps kept on the device between reads.
        **named_optimizers: name -> keras optimizer.

    Returns:
        A context manager; entering it installs the probes and yields the run.

    Raises:
        TypeError, ValueError: at the call, for a first argument that is no
            keras Model or Layer, no optimizer to watch, or a bad setting.

    Example:

    ```python
    with lab.watch(model, optimizer) as run:
        for x, y in dataset:
            loss = train_step(x, y)
            run.step(loss=loss)
    run.batches()
    ```
    """
    _check_model(model)
    check_number("lab.watch", "capacity", capacity, numbers.Integral, lambda v: v >= 1,
                 "a positive whole number of steps", "capacity=1024: the steps kept on the device between reads")
    check_flag("lab.watch", "gradients", gradients, GRADIENTS_EXAMPLE)
    check_flag("lab.watch", "weights", weights, WEIGHTS_EXAMPLE)
    check_seconds("lab.watch", "flush_every", flush_every, "flush_every=0.25: read the device four times a second")
    points = breakpoints_module.as_breakpoints(breakpoints)
    for point in points:
        if isinstance(point, breakpoints_module._LossSpike):
            raise ValueError(
                "loss_spike needs the loss before the update, and a hand-written loop hands "
                "the loss to the lab only at run.step(), after it. Use a condition on the row "
                "instead: `lab.Breakpoint(lambda row: row['loss'] > 10, name='loss above 10')`.")
        if not isinstance(point, breakpoints_module.Breakpoint):
            raise TypeError(
                f"breakpoints must be lab.Breakpoint objects (or lab.breakpoints.nonfinite()); "
                f"got {type(point).__name__}.")
    chosen = _name_optimizers(model, optimizers, named_optimizers)
    return _watching(model, chosen, points, gradients, weights, flush_every, int(capacity))


@contextlib.contextmanager
def _watching(model, chosen, points, gradients, weights, flush_every, capacity):
    """The block of `watch`, its arguments checked."""
    probe = LoopProbe(model, chosen, gradients=gradients, weights=weights,
                      breakpoints=[p for p in points if getattr(p, "on_device", False)], capacity=capacity)
    run = WatchedRun(probe, points, flush_every=flush_every)
    run.metadata.update(model=model.name, model_class=type(model).__name__, loop="watch",
                        optimizer=", ".join(f"{k}: {type(o).__name__}" for k, o in chosen.items()),
                        tensorflow=tf.__version__, keras=keras.__version__)
    run._begin()
    probe.install()
    try:
        yield run
    except BaseException as error:
        run._end(error)
        raise
    run._end()
