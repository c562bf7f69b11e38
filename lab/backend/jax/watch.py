"""watch() on Keras' JAX backend: the lab's probes on a training loop the user wrote.

The loop is the one keras-io's "Writing a training loop from scratch in JAX"
teaches: a `jax.jit` step over `(trainable_variables, non_trainable_variables,
optimizer_variables[, metric_variables])` that calls
`optimizer.stateless_apply`. Inside `with lab.watch(model, optimizer) as
run:` the user calls `run.step(loss=loss)` once per step, and the run gets
one row per call: `step`, `seconds`, `mode`, the loss and metrics given,
`learning_rate`, `updated` and, with `gradients=True`, `grad_norm/<path>` and
`grad_norm` of the gradients the optimizer applied.

How values leave the step (`lab.backend.jax.loop_probe`): the optimizer's
`apply` and `_backend_update_step` are wrapped while the block is open; a
step traced meanwhile carries one host callback per apply, which hands the
gradients' sums of squares to the block. The lab may add no output to the
user's function and no variable to the optimizer (the user built
`optimizer_variables` before the block, and `stateless_apply` checks their
number), so a host callback is the only way out. It costs the step a host
round trip (see `benchmarks/jax_watch_overhead.py`); with `gradients=False`
and no breakpoint nothing is put into the step and watching costs about
nothing. `run.step` waits for the step's callbacks (`jax.effects_barrier`)
so that each row holds its own step's gradients, never a neighbour's.

A step jitted before the block has no callback in its compiled code: the lab
cannot see its gradients, the rows get the loss, metrics and seconds, and
the run says so (an event and `run.metadata["record_errors"]`).

`breakpoints=[lab.breakpoints.nonfinite()]`: a step traced in the block
checks the applied gradients on the device and, on a hit, keeps the update
out of the state it returns (weights, optimizer slots and `iterations` as
before it); `run.step` then raises `lab.BreakpointHit`. A non-finite loss
with finite gradients, or a step the lab cannot see, raises it too, saying
that the update is in the weights.
"""

import contextlib
import numbers
import threading
import time
import types
import warnings

import jax
import keras
import numpy as np

from lab import breakpoints as breakpoints_module
from lab import schema
from lab.arguments import GRADIENTS_EXAMPLE, WEIGHTS_EXAMPLE, check_flag, check_seconds
from lab.backend.jax import loop_probe
from lab.backend.jax.loop_probe import LoopProbe
from lab.breakpoints import BreakpointHit
from lab.run import Run
from lab.signals import interrupt_detail, is_interrupt
from lab.status import StatusReporter
from lab.variables import find_optimizers

_NO_HOST = types.MappingProxyType({})
_HOST_COLUMNS = ("epoch", "batch")
_RESERVED = ("step", "seconds", "mode", "updated", "grad_norm", "learning_rate")
_PREFIXES = ("_", "grad_norm/", "weight_norm/", "update_ratio/", "learning_rate/", "updated/")

UNSEEN_MESSAGE = (
    "The lab could not see the {what} of {count} step(s) from step {first} on: no apply of {watched} "
    "reached it. The jitted step was most likely traced before this `lab.watch` block (jax.jit traces a "
    "function at its first call and reuses that trace; one traced outside a block, or in a block "
    "without gradients and breakpoints, has no probes in its compiled code), so the run's {columns} "
    "columns are NaN and a breakpoint cannot keep an update out; the loss, metrics and seconds are "
    "recorded. Enter `with lab.watch(...)` before the first call of the step, or have it traced anew "
    "inside the block: `train_step.clear_cache()` (jitting the same Python function again is not "
    "enough: JAX keeps its trace). "
    "A loop that applies no watched optimizer gets this note too: pass the optimizer it applies, "
    "`lab.watch(model, optimizer)`."
)
UNRECORDED_MESSAGE = (
    "The {what} of {count} step(s) from step {first} on were not recorded: the jitted step was traced in "
    "an earlier `lab.watch` block {how}, and a trace keeps the probes it was made with, so the run's "
    "{columns} columns are NaN. Have it traced anew inside this block: `train_step.clear_cache()`."
)
_UNRECORDED = {
    "gradients": ("gradient norms", "with gradients=False", "grad_norm"),
    "weights": ("weight norms", "without weights=True", "weight_norm and update_ratio"),
}
UNGATED_MESSAGE = (
    "the jitted step was traced without a breakpoint (before this block, or in one without "
    "breakpoints), so nothing in it could keep the update out: it is in the weights. Have the step "
    "traced anew inside this block, `train_step.clear_cache()`, so that it checks the gradients "
    "before the update"
)
UNGATED_NOTE = (
    "From step {step} on, the nonfinite() breakpoint cannot keep an update out: " + UNGATED_MESSAGE + ". "
    "A non-finite gradient or loss still raises lab.BreakpointHit at its step."
)
NO_MODEL_MESSAGE = (
    "lab.watch takes the keras.Model (or Layer) your loop trains first, then the optimizers "
    "it applies: `lab.watch(model, optimizer)`; got {got}."
)
NO_OPTIMIZER_MESSAGE = (
    "lab.watch found no optimizer on the model {model!r} (not compiled with one, no optimizer "
    "attribute): it records what the optimizers of a loop apply, so pass the one your step calls "
    "`stateless_apply` (or `apply`) on: `lab.watch(model, optimizer)`."
)
NOT_AN_OPTIMIZER_MESSAGE = (
    "lab.watch(model, *optimizers): argument {position} after the model is {got}, not a keras "
    "optimizer. Pass the keras optimizers your step applies (`optimizer.stateless_apply(...)`), e.g. "
    "`lab.watch(model, optimizer)` with `optimizer = keras.optimizers.Adam(1e-3)`.{hint}"
)
OPTAX_HINT = (
    " An optax optimizer updates outside Keras, where the lab has no hook: use the Keras optimizer of "
    "the same name (keras.optimizers.Adam, SGD, ...) to have its gradients recorded, or watch the loop "
    "without gradients by keeping the losses yourself: `run = lab.Run()`, then "
    "`run.append_batches({'loss': [float(loss)]})` at each step."
)
NO_LOSS_MESSAGE = (
    "run.step(...) needs the step's loss: `run.step(loss=loss)`, with `loss` what the step returns "
    "(metrics go beside it as keywords: `run.step(loss=loss, accuracy=acc)`)."
)
CLOSED_MESSAGE = (
    "This run's `lab.watch` block has ended: run.step(...) closes a step of the watched loop, so call it "
    "inside the block, once per step: `with lab.watch(model, optimizer) as run:` then "
    "`loss, state = train_step(state, data)` and `run.step(loss=loss)` in the loop. To record more "
    "steps, open a new block."
)
TRACED_MESSAGE = (
    "run.step(...) was called inside a jitted function (its {name} is a tracer): call it in the Python "
    "loop, after the step, with what the step returns: `loss, state = train_step(state, data)`, then "
    "`run.step(loss=loss)`."
)
UNCLOSED_MESSAGE = (
    "The optimizers made {count} update(s) after the last run.step(...), which the weights hold and the "
    "run has no row for (step {step}). Call `run.step(...)` after every step's update, also before "
    "leaving the loop early."
)


class WatchedRun(StatusReporter, Run):
    """The `lab.Run` a `lab.watch` block yields on JAX; `run.step(...)` closes each step's row.

    Like a Recorder, it has a `status` ("running" inside the block, then
    "finished", "stopped" after a breakpoint, "failed" or "interrupted") and
    `add_status_listener(fn)`.

    Args:
        probe: LoopProbe, installed on the loop's optimizers.
        breakpoints: sequence of `lab.Breakpoint`.
        flush_every: float, seconds between moves of the closed steps into the run.
        capacity: int, closed steps kept before they are moved, at most.
        name: str, the run's label.
    """

    def __init__(self, probe, breakpoints=(), flush_every=0.25, capacity=1024, name="run"):
        super().__init__(name=name)
        self.probe = probe
        self.flush_every = flush_every
        self.capacity = capacity
        self._device_points = [p for p in breakpoints if getattr(p, "on_device", False)]
        self._row_points = [p for p in breakpoints if not getattr(p, "on_device", False)]
        self._pending = []  # (host columns, seconds, values, arrivals) of steps not in the run yet
        self._steps = 0
        self._given = None
        self._given_set = frozenset()
        self._last = time.perf_counter()
        self._last_flush = time.perf_counter()
        self._flush_lock = threading.Lock()
        self._closed = False
        self._seen_any = False
        self._told = set()
        # Closing a step and taking the closed steps are atomic with each
        # other: a reader in another thread (a view) never loses a step.
        self._rows_lock = threading.Lock()
        self._init_status()

    # ---- closing a step ------------------------------------------------------

    def _status_kept_in(self):
        return self.metadata

    def step(self, loss=None, **metrics):
        """Closes this step's row: the loss and metrics given, the probes' values.

        Waits for the step's host callbacks (there are some only where a
        step traced in a block sends values); reads the loss at once only
        with a `nonfinite()` breakpoint or a `lab.Breakpoint` condition.

        Args:
            loss: the step's loss: a scalar jax array, float or numpy value;
                an array of per-example losses is averaged.
            **metrics: name -> scalar array, float or `keras.metrics.Metric`
                (its `result()`); `epoch=` and `batch=` are kept as ints.

        Returns:
            int, this step's index in the run (from 0).

        Raises:
            lab.BreakpointHit: when a breakpoint hits at this step.
            TypeError: no loss given, or a value that is no number.
            RuntimeError: the block has ended, or called inside `jax.jit`.
        """
        now = time.perf_counter()
        if self._closed:
            raise RuntimeError(CLOSED_MESSAGE)
        if loss is None:
            raise TypeError(NO_LOSS_MESSAGE)
        try:
            return self._close(now - self._last, now, loss, metrics)
        finally:
            self._last = time.perf_counter()

    def _close(self, seconds, now, loss, metrics):
        host = {k: int(metrics.pop(k)) for k in _HOST_COLUMNS if k in metrics} if metrics else _NO_HOST
        given = {"loss": loss, **metrics} if metrics else {"loss": loss}
        for name, value in given.items():
            if isinstance(value, jax.core.Tracer):
                raise RuntimeError(TRACED_MESSAGE.format(name="loss" if name == "loss" else f"{name}="))
        if self._given is None:
            self._start(given)
        values = [_value(name, given[name]) if name in given else np.float32(np.nan) for name in self._given]
        if given.keys() - self._given_set:
            new = [name for name in given if name not in self._given_set]
            self._warn_once(("new", tuple(new)), (
                f"run.step got {new} after the first step, which set the columns {self._given}: they are "
                "not recorded. Pass every value from the first step on (or open a new `lab.watch` block)."))
        if loop_probe.may_send(self.probe.numbers):
            jax.effects_barrier()  # this step's callbacks have arrived, and no later step's
        with self._rows_lock:
            arrivals = self.probe.take()
            index = self._steps
            self._steps += 1
            self._pending.append((host, seconds, values, arrivals))
        if self._device_points:
            self._check_device_points(index, values[0], arrivals)
        if self._row_points:
            start = len(self)
            self.flush()
            self._check_rows(start)
        elif now - self._last_flush >= self.flush_every or len(self._pending) >= self.capacity:
            self.flush()
        return index

    def _start(self, given):
        for name in given:
            if name in _RESERVED or name.startswith(_PREFIXES):
                raise ValueError(f"run.step(... {name}=...) uses a name the lab fills in itself; rename it "
                                 f"(e.g. `my_{name.lstrip('_')}`).")
        self._given = list(given)
        self._given_set = frozenset(self._given)

    # ---- moving the closed steps into the run --------------------------------

    def flush(self):
        """Moves the closed steps into the run; returns how many.

        The values given as device arrays are read here (the steps are done by then)."""
        if not self._flush_lock.acquire(blocking=False):
            return 0
        try:
            self._last_flush = time.perf_counter()
            with self._rows_lock:
                pending, self._pending = self._pending, []
            if not pending:
                return 0
            try:
                columns = self._rows_of(pending, first=len(self))
            except BaseException:
                with self._rows_lock:
                    self._pending = pending + self._pending
                raise
            self.append_batches(columns)
            self._note_unseen(pending, first=len(self) - len(pending))
            self._note_errors()
            return len(pending)
        finally:
            self._flush_lock.release()

    def _rows_of(self, pending, first):
        count = len(pending)
        columns = {"seconds": np.array([p[1] for p in pending], np.float64)}
        for key in _HOST_COLUMNS:
            if any(key in p[0] for p in pending):
                columns[key] = np.array([p[0].get(key, -1) for p in pending])
        # One by one: `jax.device_get` of the list took 15 us a value here, `np.asarray` 4 us (the
        # steps are done by now); a stack on the device would compile anew for each count of values.
        for position, name in enumerate(self._given):
            columns[name] = np.array([_number(p[2][position]) for p in pending], np.float32)
        columns["mode"] = np.array([_mode(p[3]) for p in pending], dtype=object)
        several = len(self.probe.optimizers) > 1
        seen = np.array([bool(p[3]) for p in pending])
        updated = np.array([any(not a.skipped for a in p[3]) for p in pending], np.float32)
        known = seen | (self._seen_any or bool(seen.any()))
        columns[schema.UPDATED] = np.where(known, updated, np.float32(np.nan)).astype(np.float32)
        for name in self.probe.optimizers if several else ():
            applied = np.array([any(a.name == name and not a.skipped for a in p[3]) for p in pending], np.float32)
            columns[schema.per_optimizer_column(schema.UPDATED_PREFIX, name)] = np.where(
                known, applied, np.float32(np.nan)).astype(np.float32)
        for name in self.probe.optimizers:
            rates = np.full(count, np.nan, np.float32)
            for i, p in enumerate(pending):
                for arrival in p[3]:
                    if arrival.name == name and not arrival.skipped:
                        rates[i] = arrival.rate
            columns[schema.learning_rate_column(name, several)] = rates
        if self.probe.gradients:
            grads = self._per_variable(pending, "grads")
            for key, squares in grads.items():
                columns[schema.variable_column(schema.GRAD_NORM_PREFIX, key)] = np.sqrt(squares)
            total = np.full(count, np.nan, np.float32)
            if grads:
                stacked = np.array(list(grads.values()), np.float64)
                present = ~np.isnan(stacked).all(axis=0)
                with np.errstate(invalid="ignore"):
                    total = np.where(present, np.sqrt(np.nansum(stacked, axis=0)), np.nan).astype(np.float32)
            columns[schema.GRAD_NORM] = total
        if self.probe.weights:
            before = self._per_variable(pending, "weights_before")
            after = self._per_variable(pending, "weights_after")
            updates = self._per_variable(pending, "updates")
            skipped = np.array([any(a.skipped for a in p[3]) for p in pending])
            for key in after:
                weight = np.sqrt(np.where(skipped, before[key], after[key])).astype(np.float32)
                update = np.where(skipped, np.float32(0), np.sqrt(updates[key])).astype(np.float32)
                columns[schema.variable_column(schema.WEIGHT_NORM_PREFIX, key)] = weight
                with np.errstate(divide="ignore", invalid="ignore"):
                    columns[schema.variable_column(schema.UPDATE_RATIO_PREFIX, key)] = np.where(
                        weight == 0, np.float32(0), update / weight).astype(np.float32)
        self._note_unrecorded(pending, first)
        if self.probe.gate:
            ungated = [i for i, p in enumerate(pending) if any(a.bad is None for a in p[3])]
            if ungated:
                self._tell("ungated", UNGATED_NOTE.format(step=first + ungated[0]), step=first + ungated[0])
        return columns

    def _per_variable(self, pending, kind):
        """key -> float32 sums of squares per step (NaN where no apply sent
        one), the applies of one step added in the order they came. Every
        variable of the model has a column; others as they are seen."""
        count = len(pending)
        sums = {key: np.full(count, np.nan, np.float32) for key in self.probe.keys.values()}
        present = {key: np.zeros(count, bool) for key in sums}
        # Applies grouped by their variables, the n-th apply of a step in the n-th pass (a
        # critic applied five times a step), so that each pass adds one vector per step.
        passes = {}
        for i, p in enumerate(pending):
            done = {}
            for arrival in p[3]:
                values = getattr(arrival, kind)
                if values is None:
                    continue
                nth = done[arrival.keys] = done.get(arrival.keys, -1) + 1
                group = passes.setdefault(arrival.keys, [])
                if nth == len(group):
                    group.append(([], []))
                group[nth][0].append(i)
                group[nth][1].append(values)
        for keys, group in passes.items():
            for steps, values in group:
                steps, values = np.asarray(steps), np.asarray(values, np.float32)
                for j, key in enumerate(keys):
                    column = sums.setdefault(key, np.full(count, np.nan, np.float32))
                    seen = present.setdefault(key, np.zeros(count, bool))
                    column[steps] = np.where(seen[steps], column[steps] + values[:, j], values[:, j])
                    seen[steps] = True
        return sums

    def batches(self):
        if not self._closed:
            self.flush()
        return super().batches()

    def column(self, name, start=0, stop=None):
        if not self._closed:
            self.flush()
        return super().column(name, start, stop)

    # ---- what the lab could not see -------------------------------------------

    def _note_unseen(self, pending, first):
        if not self.probe.sends:
            return
        if any(p[3] for p in pending):
            self._seen_any = True
        if self._seen_any or self.probe.traced:
            return
        watched = " or ".join(f"{name!r} ({type(o).__name__})" for name, o in self.probe.optimizers.items())
        what = " and ".join(w for w, asked in (("gradients", self.probe.gradients or self.probe.gate),
                                               ("weights", self.probe.weights)) if asked)
        columns = ", ".join(c for c, asked in (("grad_norm", self.probe.gradients), ("updated", True),
                                               ("learning_rate", True),
                                               ("weight_norm and update_ratio", self.probe.weights)) if asked)
        self._tell("unseen", UNSEEN_MESSAGE.format(what=what, count=len(self), first=0, watched=watched,
                                                   columns=columns), step=0)

    def _note_unrecorded(self, pending, first):
        for setting, kind in (("gradients", "grads"), ("weights", "weights_after")):
            if not getattr(self.probe, setting):
                continue
            for offset, p in enumerate(pending):
                if p[3] and all(getattr(a, kind) is None for a in p[3]):
                    what, how, columns = _UNRECORDED[setting]
                    count = sum(1 for q in pending[offset:] if q[3] and all(getattr(a, kind) is None for a in q[3]))
                    self._tell(("unrecorded", setting), UNRECORDED_MESSAGE.format(
                        what=what, count=count, first=first + offset, how=how, columns=columns),
                        step=first + offset)
                    break

    def _note_errors(self):
        for message in self.probe.errors:
            self._tell(("error", message), f"Steps could not be recorded: {message}.", step=max(len(self) - 1, 0))

    def _tell(self, key, message, step):
        """Says `message` once per `key`: an event, and a note in run.metadata's record_errors."""
        if key in self._told:
            return
        self._told.add(key)
        self.metadata.setdefault(schema.RECORD_ERRORS, []).append(message)
        self.add_event("warning", message, step=step)
        warnings.warn(message, RuntimeWarning, stacklevel=5)

    def _warn_once(self, key, message):
        if key in self._told:
            return
        self._told.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=4)
        self.add_event("warning", message, step=max(self._steps - 1, 0))

    # ---- breakpoints -------------------------------------------------------------

    def _check_device_points(self, index, loss, arrivals):
        """A `nonfinite()` hit at this step: a gradient the step checked, a
        norm sent by a step that checks none, or the loss (read now)."""
        loss_value = _number(loss)
        bad_loss = not np.isfinite(loss_value)
        checked_bad = [a for a in arrivals if a.bad]
        unchecked_bad = [a for a in arrivals if a.bad is None and a.grads is not None
                         and not np.isfinite(a.grads).all()]
        if not (bad_loss or checked_bad or unchecked_bad):
            return
        point = self._device_points[0]
        parts = []
        if bad_loss:
            parts.append(f"the loss is {loss_value}")
        if checked_bad or unchecked_bad:
            names = sorted({a.name for a in checked_bad + unchecked_bad})
            parts.append(f"a gradient {', '.join(repr(n) for n in names)} applied is not finite")
        detail = f"{point.name} at step {index}: {' and '.join(parts)}"
        skipped = bool(arrivals) and all(a.skipped for a in arrivals)
        if skipped:
            detail += ("; update skipped: the state the step returned holds the weights, the optimizer's "
                       "state and iterations as before it")
        elif unchecked_bad:
            detail += "; " + UNGATED_MESSAGE
        elif not arrivals:
            detail += ("; the lab saw no update in this step (a step jitted before the block has no probes): "
                       "any update it made is in the weights")
        elif any(not a.skipped for a in arrivals):
            kept = sorted({a.name for a in arrivals if not a.skipped})
            detail += (f"; the gradients {', '.join(repr(n) for n in kept)} applied were finite, so its update "
                       "went in: it is in the weights")
        self.flush()
        self.add_event("nonfinite", detail, step=index)
        raise BreakpointHit(index, point.name, detail, skipped=skipped)

    def _check_rows(self, start):
        frame = super().batches().iloc[start:]
        for _, row in frame.iterrows():
            for point in self._row_points:
                if point.hit(row):
                    detail = point.describe(row)
                    self.add_event("breakpoint", detail, step=int(row["step"]))
                    raise BreakpointHit(int(row["step"]), point.name, detail, skipped=False)

    # ---- the block --------------------------------------------------------------

    def _begin(self):
        self._last = time.perf_counter()
        self._set_status("running")

    def _end(self, error=None):
        unclosed = []
        try:
            try:
                if loop_probe.may_send(self.probe.numbers) and not isinstance(error, KeyboardInterrupt):
                    jax.effects_barrier()
                unclosed = self.probe.take()
            except Exception:  # noqa: BLE001 - a device the user's error left unreadable: that error is the news
                unclosed = []
            try:
                self.flush()
            except Exception as failure:  # noqa: BLE001 - the loop's own error is the one to raise
                if error is None:
                    raise
                self.add_event("record_error", f"the last steps could not be recorded: {failure}", step=self._steps)
        finally:
            self.probe.release()
            self._closed = True
        updates = sum(1 for a in unclosed if not a.skipped)
        told = ""
        if updates:
            told = UNCLOSED_MESSAGE.format(count=updates, step=self._steps)
            if error is None:
                self.add_event("warning", told, step=self._steps)
        if is_interrupt(error):
            self.add_event("interrupt", interrupt_detail(error) + (f"; {told}" if told else ""), step=self._steps)
            self._set_status("interrupted")
        elif isinstance(error, BreakpointHit):
            self._set_status("stopped", error.detail)
        elif error is not None:
            message = f"{type(error).__name__}: {error}".strip()
            self.add_event("error", message + (f"; {told}" if told else ""), step=self._steps)
            self._set_status("failed", message)
        else:
            self._set_status("finished")


def _value(name, value):
    """A value for run.step as it is kept until the rows are read: a jax
    array as it is (no wait for the device), anything else as float32."""
    if isinstance(value, jax.Array):
        return value
    if isinstance(value, keras.metrics.Metric):
        value = value.result()
    if isinstance(value, keras.Variable):
        value = value.value
    if isinstance(value, jax.Array):
        return value
    try:
        return np.float32(_mean(np.asarray(value, np.float32)))
    except (TypeError, ValueError):
        raise TypeError(f"run.step({name}=...) needs a number, an array or a keras metric; got "
                        f"{type(value).__name__}.") from None


def _number(value):
    value = np.asarray(value)
    if not (np.issubdtype(value.dtype, np.number) or value.dtype == bool):
        return np.float32(np.nan)
    return np.float32(value) if value.ndim == 0 else np.float32(_mean(value.astype(np.float32)))


def _mean(values):
    return np.mean(values) if values.size else np.float32(np.nan)


def _mode(arrivals):
    """"eager" where the step's applies ran as Python, else "xla" (a jitted step, seen or not)."""
    return "eager" if any(a.eager for a in arrivals) else "xla"


def _check_model(model):
    if isinstance(model, keras.layers.Layer):
        return
    if isinstance(model, keras.optimizers.Optimizer):
        got = f"a keras optimizer ({type(model).__name__}) first"
    elif isinstance(model, keras.Variable):
        got = f"a keras.Variable ({model.name!r}): pass the model whose loss the loop differentiates"
    elif isinstance(model, (list, tuple)):
        kinds = sorted({type(item).__name__ for item in model})
        got = f"a {type(model).__name__} of {', '.join(kinds)}" if kinds else f"an empty {type(model).__name__}"
        if any(isinstance(item, keras.layers.Layer) for item in model):
            got += (" (to watch several models trained together, pass one model that holds them all, as a "
                    "GAN holds its generator and discriminator, and each optimizer: `lab.watch(gan, g_opt, d_opt)`)")
    elif model is None:
        got = "None"
    else:
        got = f"a {type(model).__name__}"
    raise TypeError(NO_MODEL_MESSAGE.format(got=got))


def _not_an_optimizer(position, value, keyword=None):
    module = type(value).__module__ or ""
    is_optax = module.startswith("optax") or (
        hasattr(value, "init") and hasattr(value, "update") and type(value).__name__ == "GradientTransformation")
    got = f"an optax {type(value).__name__}" if is_optax else f"a {type(value).__name__}"
    where = f"the keyword {keyword}=" if keyword else f"argument {position}"
    return TypeError(NOT_AN_OPTIMIZER_MESSAGE.format(position=where if keyword else position, got=got,
                                                     hint=OPTAX_HINT if is_optax else ""))


def _name_optimizers(model, optimizers, named):
    attributes = {id(v): k for k, v in vars(model).items()
                  if isinstance(v, keras.optimizers.Optimizer) and k != "_optimizer"}
    if getattr(model, "optimizer", None) is not None:
        attributes.setdefault(id(model.optimizer), "optimizer")
    result = {}
    for position, optimizer in enumerate(optimizers):
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise _not_an_optimizer(position + 1, optimizer)
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
    """Watches a training loop you wrote (Keras on JAX); yields a `lab.Run`.

    Inside the block, call `run.step(loss=..., **metrics)` once per step,
    after the step. Each call closes that step's row: `step`, `seconds`
    (host time from the end of the previous call), `mode` ("xla" for a
    jitted step, "eager" for one run as Python), the values given,
    `learning_rate` (`learning_rate/<name>` with several optimizers),
    `updated`, and with `gradients=True` `grad_norm` and
    `grad_norm/<variable.path>` of the gradients the optimizers applied;
    with `weights=True` also `weight_norm/<path>` and `update_ratio/<path>`.

    Have the step traced inside the block (its first call, or
    `train_step.clear_cache()` for one called before): a step jitted before
    has no probes in its compiled code, and the run says that its gradients
    could not be seen. A step traced in a block sends its values through a
    host callback, which costs each call a host round trip (with
    `gradients=False`, `weights=False` and no breakpoint nothing is added);
    outside a block that callback does nothing, and the step trains as
    without the lab, at the callback's cost, until it is traced anew
    (`train_step.clear_cache()`). Nothing is added to the
    model, its optimizer's variables or the state the loop carries.

    Args:
        model: keras.Model (or Layer), whose `trainable_variables` name the gradient columns.
        *optimizers: keras optimizers the loop applies (`stateless_apply` or `apply`).
        gradients: bool, record the norms of the applied gradients.
        weights: bool, record weight norms and update/weight ratios.
        breakpoints: sequence; `lab.breakpoints.nonfinite()` is checked in
            the step before each update and keeps a non-finite one out of
            the state the step returns, and on the loss at `run.step`; a
            `lab.Breakpoint(condition)` sees each row after its update. A
            hit raises `lab.BreakpointHit` from that step's `run.step`.
        flush_every: float, seconds between moves of closed steps into the run.
        capacity: int, closed steps kept before they are moved into the run.
        **named_optimizers: name -> keras optimizer.

    Returns:
        A context manager; entering it installs the probes and yields the run.

    Raises:
        TypeError, ValueError: at the call, for a first argument that is no
            keras Model or Layer, an optimizer that is no keras optimizer,
            no optimizer to watch, or a bad setting.

    Example:

    ```python
    with lab.watch(model, optimizer) as run:
        for data in batches:
            loss, state = train_step(state, data)
            run.step(loss=loss)
    run.batches()
    ```
    """
    _check_model(model)
    if isinstance(capacity, bool) or not isinstance(capacity, numbers.Integral) or capacity < 1:
        raise (TypeError if not isinstance(capacity, numbers.Integral) or isinstance(capacity, bool) else ValueError)(
            f"lab.watch(capacity=...) must be a positive whole number of steps; got {capacity!r} "
            "(e.g. capacity=1024: the closed steps kept before they are moved into the run).")
    check_flag("lab.watch", "gradients", gradients, GRADIENTS_EXAMPLE)
    check_flag("lab.watch", "weights", weights, WEIGHTS_EXAMPLE)
    check_seconds("lab.watch", "flush_every", flush_every, "flush_every=0.25: move rows four times a second")
    points = breakpoints_module.as_breakpoints(breakpoints)
    for point in points:
        if isinstance(point, breakpoints_module._LossSpike):
            raise ValueError(
                "loss_spike needs the loss before the update, and a hand-written loop hands "
                "the loss to the lab only at run.step(), after it. Use a condition on the row "
                "instead: `lab.Breakpoint(lambda row: row['loss'] > 10, name='loss above 10')`.")
    chosen = _name_optimizers(model, optimizers, named_optimizers)
    return _watching(model, chosen, points, bool(gradients), bool(weights), flush_every, int(capacity))


@contextlib.contextmanager
def _watching(model, chosen, points, gradients, weights, flush_every, capacity):
    """The block of `watch`, its arguments checked."""
    gate = any(getattr(p, "on_device", False) for p in points)
    probe = LoopProbe(model, chosen, gradients=gradients, weights=weights, gate=gate)
    run = WatchedRun(probe, points, flush_every=flush_every, capacity=capacity)
    run.metadata.update(model=model.name, model_class=type(model).__name__, loop="watch",
                        optimizer=", ".join(f"{k}: {type(o).__name__}" for k, o in chosen.items()),
                        backend="jax", jax=jax.__version__, keras=keras.__version__,
                        devices=[str(d) for d in jax.devices()])
    probe.install()
    run._begin()
    try:
        yield run
    except BaseException as error:
        run._end(error)
        raise
    run._end()
