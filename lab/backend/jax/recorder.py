"""Recorder on JAX: a Keras callback that turns fit()'s lifecycle into Run rows.

The rows come from the probe's ring (`lab.backend.jax.probes`), read in
blocks every `flush_every` seconds, when the ring is half full, at epoch
ends and at the end; host-side facts (epoch, batch, timing, mode) are kept
per execution until their rows are read. The recorder never reads
`callback.model` during `fit()` (on JAX that syncs the whole training state
into the model's variables): it keeps the model it was given.

Keras on JAX runs batch-end callbacks on a thread pool, without waiting for
the step's logs, unless a callback needs them at once; a recorder without
breakpoints is `async_safe`, so it keeps that pipeline (with a callback that
waits, `fit(steps_per_execution=32)` ran 1.2 times as long on two CPUs).
Its work at a batch's end is only to note when the execution's logs were
ready and Keras' running values; the ring is read at a batch's begin, on
fit()'s thread, and a row is added once its execution's end was heard of.
With breakpoints the recorder reads the ring at each batch's end, and so
needs Keras to wait for it.
"""

import collections
import itertools
import sys
import threading
import time

import keras
import numpy as np
import pandas as pd

from lab import describe, schema
from lab.arguments import check_recorder_options
from lab.backend.jax import compat, modes
from lab.backend.jax.probes import Probe
from lab.breakpoints import as_breakpoints
from lab.hooks import CompiledState, hooks_for
from lab.observers import Observers
from lab.run import Run
from lab.signals import interrupt_detail, is_interrupt
from lab.status import StatusReporter
from lab.step_logs import add_note, step_failure_note

RECORDING_THIS_FIT = (
    "This Recorder is recording the fit() of {model!r} that runs this callback: a fit() "
    "inside it cannot be recorded by the same Recorder. Leave the Recorder out of the inner "
    "fit()'s callbacks, or give it a Recorder of its own after the outer fit() ends."
)
LOST_ROWS = (
    "{lost} step(s) before step {step} were not recorded: more steps ran between two reads than the "
    "ring holds ({capacity} rows). Read more often (`flush_every`) or keep more rows (`capacity`)."
)


class _Execution:
    """What the host knows of one execution (`steps_per_execution` steps):
    its epoch, first batch and mode at its begin; its last batch, when its
    logs were ready and Keras' running values at its end."""

    __slots__ = ("epoch", "first", "mode", "began", "last", "ready", "running")

    def __init__(self, epoch, first, mode, began):
        self.epoch, self.first, self.mode, self.began = epoch, first, mode, began
        self.last = self.ready = self.running = None

    def steps(self):
        return max(1, self.last - self.first + 1)


UNSAMPLED = (
    "norms_every={every} was not applied: this Keras jits fit()'s step in a way the lab does not know, so "
    "the gradient and weight norms were taken at every step (the run's norm columns have every row; "
    "run.metadata['norms_every'] is 1). Training is not affected.")


class Recorder(StatusReporter, keras.callbacks.Callback):
    """Records one row per training batch into `recorder.run` (Keras on JAX).

    The row holds the batch's own loss and mean-type metric values (not
    Keras' running epoch mean), also at `steps_per_execution > 1`: values
    are written inside the jitted step and read in blocks.

    Args:
        gradients: bool, add `grad_norm` and `grad_norm/<variable.path>`:
            norms of the gradients the optimizer applied (after loss-scale
            unscaling and clipping).
        weights: bool, add `weight_norm/<path>` and `update_ratio/<path>`.
        breakpoints: sequence of `lab.Breakpoint`, checked per batch;
            `nonfinite()` and `loss_spike()` inside the step, before its
            update. A hit stops `fit()` and adds an event.
        path: str or None; when set, the run is saved there (HDF5) every
            epoch, every `save_every` seconds and at the end.
        run: `lab.Run` or None, to continue an existing record.
        flush_every: float, seconds between reads of the device buffer.
        save_every: float, seconds between incremental saves when `path` is set.
        capacity: int, rows the device buffer holds between reads.
        norms_every: int, the gradient and weight norms of one step in
            this many: the first this recorder records, then every n-th;
            the other rows' norm columns are NaN. For small models on a CPU,
            where the norms cost (docs/recording.md, "Norms of one step in
            n"). 1: every step.

    Example:

    ```python
    rec = lab.Recorder(gradients=True)
    model.fit(x, y, epochs=2, callbacks=[rec])
    rec.run.batches()
    ```
    """

    def __init__(self, gradients=False, weights=False, breakpoints=(), path=None,
                 run=None, flush_every=0.25, save_every=30.0, capacity=1024, norms_every=1):
        super().__init__()
        check_recorder_options(gradients, weights, path, run, flush_every, save_every, norms_every)
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 2:
            raise ValueError(f"lab.Recorder(capacity=...) must be a whole number of rows, 2 or more; got {capacity!r} "
                             "(e.g. capacity=1024).")
        self.gradients = gradients
        self.weights = weights
        self.breakpoints = as_breakpoints(breakpoints)
        self.path = path
        self.run = run if run is not None else Run()
        self.flush_every = flush_every
        self.save_every = save_every
        self.capacity = capacity
        self.norms_every = norms_every
        self._init_status()
        self._breakpoint_listeners = Observers("a recorder's breakpoints")
        self._python_points = [p for p in self.breakpoints if not getattr(p, "on_device", False)]
        # Read by Keras' CallbackList: without breakpoints nothing here needs
        # a batch's logs before the next batch runs.
        self.async_safe = not self.breakpoints
        self._lock = threading.Lock()  # the executions: ended on Keras' pool threads
        self._probe = None
        self._probe_state = None
        self._cached = None  # (CompiledState, train function) jitted through the probe's wrappers
        self._hooks = None
        self._executions = collections.deque()  # _Execution of the steps whose rows are not in the run
        self._held = None  # rows read from the ring whose execution's end is not heard of yet
        self._last_ready = None  # when the last execution in the run was ready
        self._unread = 0  # steps begun since the ring was read (an upper bound)
        self._steps_per_execution = 1  # the model's, read once a fit()
        self._epoch = 0
        self._last_flush = 0.0
        self._last_save = 0.0
        self._active = False
        self._mode = None
        self._fit_thread = None
        self.last_batch_ended = -1

    # ---- the model's lifecycle --------------------------------------------

    def set_model(self, model):
        called = compat.calling_model_call()
        if called == "fit" and self.is_training():
            raise RuntimeError(RECORDING_THIS_FIT.format(model=model.name))
        self.run.claim_model(model)
        super().set_model(model)
        if called in ("evaluate", "predict"):
            return
        try:
            self._attach(model)
        except BaseException:
            self._release()
            raise

    def _attach(self, model):
        state = CompiledState(model)
        if self._probe is not None and (self._probe.model is not model or not self._probe_state.same_compile(state)):
            self._release()
            if self._probe.model is model:
                self.run.add_event("recompile", "the model was compiled again; recording goes on with the new compile",
                                   step=self.run.next_step)
            self._probe = None
            self._cached = None
        self._hooks = hooks_for(model)
        if self._probe is None:
            self._probe = Probe(model, gradients=self.gradients, weights=self.weights,
                                breakpoints=self.breakpoints, capacity=self.capacity, norms_every=self.norms_every)
        self._probe_state = state
        self._probe.install()
        cached = self._cached
        if cached is not None and cached[0] == state:
            # The function jitted through the probe in an earlier fit(): its
            # trace reads the ring by position, which attaching keeps, so
            # the next fit() runs it without compiling again.
            model.train_function = cached[1]
        optimizer = compat.fit_end_hook_owner(model)
        if optimizer is not None:
            self._hooks.wrap(self, optimizer, compat.FIT_END, self._guard_factory, role="guard")

    def is_training(self):
        """Whether this recorder is inside a running fit()."""
        return self._active

    def on_train_begin(self, logs=None):
        self._active = True
        self._fit_thread = threading.get_ident()
        self._steps_per_execution = max(1, int(getattr(self._model, "steps_per_execution", 1) or 1))
        self._reset_executions()
        self._mode = modes.running_mode(self._model)
        modes.training_began(self._model)
        self._cached = (self._probe_state, self._model.train_function)
        self._fill_metadata()
        self._set_status("running")

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self.last_batch_ended = -1

    def on_train_batch_begin(self, batch, logs=None):
        modes.apply_pending_mode(self._model)  # a switch asked for from another thread
        execution = _Execution(self._epoch, int(batch), modes.running_mode(self._model), time.perf_counter())
        with self._lock:
            self._executions.append(execution)
        self._unread += self._steps_per_execution
        now = time.monotonic()
        if self._unread * 2 >= self.capacity or now - self._last_flush >= self.flush_every:
            self.flush()  # the state after the last batch is still the model's here
        self._maybe_save(now)

    def on_train_batch_end(self, batch, logs=None):
        ready = time.perf_counter()  # on a pool thread: after Keras waited for the logs
        batch = int(batch)
        running = self._running_values(logs)
        on_fit_thread = threading.get_ident() == self._fit_thread
        with self._lock:
            if not self._active:
                return
            # The execution this end closes: the latest begun at or before it.
            execution = next((e for e in reversed(self._executions) if e.last is None and e.first <= batch), None)
            if execution is None:
                return
            execution.last, execution.ready, execution.running = batch, ready, running
            if on_fit_thread:
                # The mode of the function this batch ran: switches are made
                # before a batch (at its begin, by this recorder, a
                # ModeSwitcher or a callback).
                execution.mode = modes.running_mode(self._model)
            self.last_batch_ended = max(self.last_batch_ended, batch)
        if on_fit_thread:  # Keras waits for this callback: the rows and the file as after this batch
            now = time.monotonic()
            if self.breakpoints or now - self._last_flush >= self.flush_every:
                self.flush()
            self._maybe_save(now)

    def on_epoch_end(self, epoch, logs=None):
        # Keras has waited for every batch end of the epoch before this one.
        self.flush(final=True)
        self._note_unsampled()
        self._reset_executions()
        self.run.append_epoch(epoch, logs)
        if self.path:
            self._save()

    def on_train_end(self, logs=None):
        self.flush(final=True)
        self._reset_executions()
        self._finish("stopped" if self.status == "breakpoint" else "finished")

    def on_test_end(self, logs=None):
        if not self._active:
            self._release()

    def on_predict_end(self, logs=None):
        if not self._active:
            self._release()

    # ---- reading the device buffer ----------------------------------------

    def flush(self, final=False):
        """Moves the rows recorded on the device into `run`; returns how many.

        A row waits for its execution's end (its timing and Keras' running
        values), unless `final`: at an epoch's end, the end of fit() or a
        failure, where every row read is added.
        """
        if self._probe is None:
            return 0
        self._last_flush = time.monotonic()
        self._unread = 0
        rows, lost = self._probe.read()
        with self._lock:
            if lost:
                self._drop_lost(lost)
            self._hold(rows)
            columns, executions = self._settled(final)
        if columns is None:
            return 0
        count = len(columns[schema.UPDATED])
        first = self.run.next_step
        for execution, first_row, last_row in executions:
            if self._mode != execution.mode:
                self.run.add_event("mode", f"{self._mode} -> {execution.mode}", step=first + first_row)
                self._mode = execution.mode
            if execution.running:
                self._note_running(columns, count, first + last_row, last_row, execution.running)
        self.run.append_batches(columns)
        self._check_breakpoints(first, columns)
        return count

    def _drop_lost(self, lost):
        """Rows the ring lost (more steps between two reads than it holds):
        an event, and their steps' host facts dropped."""
        self.run.add_event("record_error", LOST_ROWS.format(lost=lost, step=self.run.next_step + lost,
                                                            capacity=self._probe.ring.capacity),
                           step=self.run.next_step)
        self.run.next_step = self.run.next_step + lost
        while lost > 0 and self._executions:
            execution = self._executions[0]
            steps = execution.steps() if execution.last is not None else 1
            if steps > lost:
                execution.first += lost
                break
            lost -= steps
            self._executions.popleft()

    def _hold(self, rows):
        if not rows or not len(rows[schema.UPDATED]):
            return
        if self._held is None:
            self._held = rows
        else:
            self._held = {name: np.concatenate([self._held[name], values]) for name, values in rows.items()}

    def _settled(self, final):
        """The held rows whose executions ended (all of them if `final`), as
        the run's columns, and [(execution, index of its first row, of its
        last)]; the rest stay held."""
        held = self._held
        if held is None:
            return None, []
        available = len(held[schema.UPDATED])
        taken, left = [], available  # (execution, its rows)
        while self._executions and left > 0:
            execution = self._executions[0]
            if execution.last is None and not final:
                break
            steps = min(execution.steps() if execution.last is not None else left, left)
            taken.append((execution, steps))
            self._executions.popleft()
            left -= steps
            if execution.last is not None and execution.last - execution.first + 1 > steps:
                break  # a last, partial execution, numbered by its full span (Keras 3.11+)
        meta, executions = [], []
        for group in self._timed(taken):
            for execution, steps, seconds in group:
                executions.append((execution, len(meta), len(meta) + steps - 1))
                meta.extend((execution.epoch, execution.first + i, seconds, execution.mode) for i in range(steps))
        if final:
            while len(meta) < available:  # steps that ran but never reached on_train_batch_end
                last = meta[-1][1] if meta else -1
                meta.append((self._epoch, last + 1, float("nan"), self._mode))
        count = len(meta)
        if count == 0:
            return None, []
        columns = {name: values[:count] for name, values in held.items()}
        self._held = {name: values[count:] for name, values in held.items()} if count < available else None
        columns.update({"epoch": [m[0] for m in meta], "batch": [m[1] for m in meta],
                        "seconds": [m[2] for m in meta], "mode": [m[3] for m in meta]})
        return columns, executions

    def _timed(self, taken):
        """`taken` [(execution, rows)] in groups [(execution, rows, seconds a
        step)]: an execution's time runs from its begin (or the end of the one
        before, when they overlapped) to when its logs were ready. Steps end
        in order, but Keras' pool threads may hear of them out of order: an
        execution was ready no later than any after it, and executions whose
        ends that leaves the same share the time between them."""
        done, later = {}, None
        ended_after = itertools.takewhile(lambda e: e.ready is not None, self._executions)
        for execution in reversed([e for e, _ in taken if e.ready is not None] + list(ended_after)):
            later = execution.ready if later is None else min(later, execution.ready)
            done[id(execution)] = later
        groups, i = [], 0
        while i < len(taken):
            first = taken[i][0]
            end = done.get(id(first))
            j = i + 1
            while end is not None and j < len(taken) and done.get(id(taken[j][0])) == end:
                j += 1
            if end is None:
                seconds = float("nan")
            else:
                began = max(first.began, self._last_ready or first.began)
                seconds = (end - began) / sum(steps for _, steps in taken[i:j])
                self._last_ready = end
            groups.append([(execution, steps, seconds) for execution, steps in taken[i:j]])
            i = j
        return groups

    def _reset_executions(self):
        with self._lock:
            self._executions.clear()
            self._held = None
            self._last_ready = None
        self._unread = 0

    def _running_values(self, logs):
        """Keras' logged values of what the rows cannot hold as each batch's own
        (non-mean metrics, other logs): running values, of the execution's last step."""
        if not logs or self._probe is None:
            return None
        means = self._probe.metric_parts
        values = {}
        for name, value in logs.items():
            if name in means:
                continue
            for column, number in schema.number_columns(name, value):
                values[column] = number
        return values or None

    def _note_running(self, columns, count, step, row, values):
        for name, number in values.items():
            column = columns.get(name)
            if column is None:
                column = columns[name] = np.full(count, np.nan, np.float32)
            column[row] = number
        fresh = [c for c in values if c not in self.run.metadata.get(schema.RUNNING_VALUES, ())]
        if fresh:
            self.run.note_running_values(fresh, step)

    def _check_breakpoints(self, first, rows):
        held = np.flatnonzero(rows[schema.UPDATED] == 0)
        if len(held) and self.status != "breakpoint":
            step = first + int(held[0])
            points = [p.name for p in self.breakpoints if getattr(p, "on_device", False)]
            detail = (f"{', '.join(points)} at step {step}: its update was kept out (weights, optimizer state and "
                      "iterations as before the step); fit() stopped")
            # The kind TensorFlow's recorder gives the same hit: "nonfinite"
            # for nonfinite(), "breakpoint" for the others (a loss_spike()
            # beside a nonfinite() is told apart by the step's loss).
            loss = rows.get(schema.LOSS)
            nonfinite = "nonfinite" in points and (
                len(points) == 1 or loss is None or not np.isfinite(loss[int(held[0])]))
            self._hit(step, "nonfinite" if nonfinite else "breakpoint", detail)
            return
        if not self._python_points or self.status == "breakpoint":
            return
        count = len(rows[schema.UPDATED])
        start = len(self.run) - count  # the new rows' positions (a continued run starts past step 0)
        names = self.run.columns
        for offset in range(count):
            position = start + offset
            row = pd.Series({name: self.run.column(name, position, position + 1)[0] for name in names})
            for point in self._python_points:
                if point.hit(row):
                    self._hit(first + offset, "breakpoint", point.describe(row) + "; fit() stopped after its update")
                    return

    def _hit(self, step, kind, detail):
        self.run.add_event(kind, detail, step=step)
        self._model.stop_training = True
        self._set_status("breakpoint", detail)
        self._breakpoint_listeners.notify(step, detail)

    # ---- failures and the end ---------------------------------------------

    def _guard_factory(self, finalize):
        recorder = self

        def finalize_variable_values(*args, **kwargs):
            # fit()'s `finally`: the state is back in the variables. Raised
            # through (an error or Ctrl-C anywhere in fit()), no callback
            # hears of it: record what the steps left and take every hook
            # off now, before anything else uses the model.
            try:
                return finalize(*args, **kwargs)
            finally:
                error = sys.exc_info()[1]
                if error is not None:
                    recorder._on_failure(error)
        return finalize_variable_values

    def _on_failure(self, error):
        """Records what the failed fit() left (the rows of the steps that
        ran) and takes every hook off, before fit() syncs its state back."""
        if not self._active:
            return
        try:
            self.flush(final=True)
        except Exception:  # noqa: BLE001 - the state may be gone with the step that failed
            pass
        kind = "interrupt" if is_interrupt(error) else "error"
        detail = interrupt_detail(error) if kind == "interrupt" else f"{type(error).__name__}: {error}".strip()
        if kind == "error" and self._probe is not None:
            # Keras' error names neither what train_step returned or was handed nor the fix.
            note = step_failure_note(error, self._model, self._probe.not_logs, self._probe.has_targets)
            if note:
                detail = f"{detail}\n{note}"
                add_note(error, note)
        self.run.add_event(kind, detail, step=self.run.next_step)
        self._reset_executions()
        self._finish("interrupted" if kind == "interrupt" else "failed",
                     detail if kind == "error" else f"{type(error).__name__}: {error}")

    def _finish(self, status, detail=""):
        self._active = False
        modes.training_ended(self._model)
        try:
            self._release()
        finally:
            try:
                self._set_status(status, detail)  # first: the file keeps it
            finally:
                if self.path:
                    self._save()

    def _release(self):
        if self._probe is not None:
            self._probe.release()
        if self._hooks is not None:
            self._hooks.release(self)

    def release_hooks(self):
        self._release()

    def _status_kept_in(self):
        return self.run.metadata

    def detach(self):
        """Takes the recorder's hooks off the model (a later fit() without it
        runs as without the lab)."""
        self._release()

    def resume_after_breakpoint(self):
        """When training paused at a hit goes on (between batches, the state in
        the model's variables): lets updates through again (a device breakpoint
        holds every update after its hit until then) and sets the status back
        to "running"."""
        if self._probe is not None:
            self._probe.ring.release_hold()
        if self.status == "breakpoint":
            self._set_status("running")

    def lab_variables(self):
        """The variables the probe added to the optimizer's state for this
        fit() (its ring and tallies): the lab's, not the model's."""
        if self._probe is None:
            return []
        ring = list(self._probe.ring.variables)
        return ring + [t.variable for t in self._probe.tallies.values() if t.variable is not None]

    def add_breakpoint_listener(self, fn):
        """Calls `fn(step, detail)` when a breakpoint hits."""
        self._breakpoint_listeners.add(fn)

    def remove_breakpoint_listener(self, fn):
        self._breakpoint_listeners.remove(fn)

    def _note_unsampled(self):
        """Says once when the train function took the norms at every step
        although `norms_every` asked for fewer (`Probe._measures`: a trainer
        that jits its step otherwise than the lab knows)."""
        if self._probe is None or self._probe.sampled is not False or self.run.metadata.get(schema.NORMS_EVERY) == 1:
            return
        self.run.metadata[schema.NORMS_EVERY] = 1
        self.run.add_event("warning", UNSAMPLED.format(every=self._probe.norms_every), step=self.run.next_step)

    def _fill_metadata(self):
        meta = self.run.metadata
        model = self._model
        if self._probe.norms_every > 1:
            meta[schema.NORMS_EVERY] = self._probe.norms_every
        if "model" in meta:
            return  # filled by an earlier fit(): the first fit describes the run
        import jax

        for key, value in describe.model_metadata(model).items():
            meta.setdefault(key, value)
        meta.setdefault("mode", self._mode)
        meta.setdefault("devices", [str(d) for d in jax.devices()])
        meta.setdefault("jax", jax.__version__)

    def _maybe_save(self, now):
        if self.path and now - self._last_save >= self.save_every:
            self._save()

    def _save(self):
        self._last_save = time.monotonic()
        self.run.save(self.path)

