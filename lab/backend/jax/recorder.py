"""Recorder on JAX: a Keras callback that turns fit()'s lifecycle into Run rows.

The rows come from the probe's ring (`lab.backend.jax.probes`), read in
blocks every `flush_every` seconds, when the ring is half full, at epoch
ends and at the end; host-side facts (epoch, batch, timing, mode) are kept
per step until their rows are read. The recorder never reads
`callback.model` during `fit()` (on JAX that syncs the whole training state
into the model's variables): it keeps the model it was given.
"""

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

    Example:

    ```python
    rec = lab.Recorder(gradients=True)
    model.fit(x, y, epochs=2, callbacks=[rec])
    rec.run.batches()
    ```
    """

    def __init__(self, gradients=False, weights=False, breakpoints=(), path=None,
                 run=None, flush_every=0.25, save_every=30.0, capacity=1024):
        super().__init__()
        check_recorder_options(gradients, weights, path, run, flush_every, save_every)
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
        self._init_status()
        self._breakpoint_listeners = Observers("a recorder's breakpoints")
        self._python_points = [p for p in self.breakpoints if not getattr(p, "on_device", False)]
        self._probe = None
        self._probe_state = None
        self._cached = None  # (CompiledState, train function) jitted through the probe's wrappers
        self._hooks = None
        self._pending = []  # (epoch, batch, seconds, mode) of steps whose rows are unread
        self._running_logs = {}  # non-mean metrics' logged (running) values, by step
        self._epoch = 0
        self._begin_step = 0
        self._t0 = None
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
                                breakpoints=self.breakpoints, capacity=self.capacity)
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
        self._pending = []
        self._running_logs = {}
        self._mode = modes.running_mode(self._model)
        modes.training_began(self._model)
        self._cached = (self._probe_state, self._model.train_function)
        self._fill_metadata()
        self._set_status("running")

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        modes.apply_pending_mode(self._model)  # a switch asked for from another thread
        self._begin_step = batch
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        elapsed = time.perf_counter() - self._t0 if self._t0 is not None else float("nan")
        steps = max(1, int(batch) - self._begin_step + 1)
        self.last_batch_ended = int(batch)
        share = elapsed / steps
        first = self.run.next_step + len(self._pending)
        # The mode of the function this batch ran: switches are made before a
        # batch (at its begin, by this recorder, a ModeSwitcher or a callback).
        mode = modes.running_mode(self._model)
        if mode != self._mode:
            self.run.add_event("mode", f"{self._mode} -> {mode}", step=first)
            self._mode = mode
        self._pending.extend((self._epoch, self._begin_step + i, share, self._mode) for i in range(steps))
        self._keep_running_values(first + steps - 1, logs)
        now = time.monotonic()
        if (self.breakpoints or len(self._pending) * 2 >= self.capacity
                or now - self._last_flush >= self.flush_every):
            self.flush()
        self._maybe_save(now)

    def on_epoch_end(self, epoch, logs=None):
        self.flush()
        self._pending = []
        self.run.append_epoch(epoch, logs)
        if self.path:
            self._save()

    def on_train_end(self, logs=None):
        self.flush()
        self._pending = []
        self._finish("stopped" if self.status == "breakpoint" else "finished")

    def on_test_end(self, logs=None):
        if not self._active:
            self._release()

    def on_predict_end(self, logs=None):
        if not self._active:
            self._release()

    # ---- reading the device buffer ----------------------------------------

    def flush(self):
        """Moves the rows recorded on the device into `run`; returns how many."""
        if self._probe is None:
            return 0
        self._last_flush = time.monotonic()
        rows, lost = self._probe.read()
        count = len(rows[schema.UPDATED]) if rows else 0
        if lost:
            self.run.add_event("record_error", LOST_ROWS.format(lost=lost, step=self.run.next_step + lost,
                                                                capacity=self._probe.ring.capacity),
                               step=self.run.next_step)
            del self._pending[:lost]
            self.run.next_step = self.run.next_step + lost
        if count == 0:
            return 0
        meta = self._pending[:count]
        del self._pending[:count]
        while len(meta) < count:  # steps that ran but never reached on_train_batch_end
            last = meta[-1][1] if meta else self._begin_step - 1
            meta.append((self._epoch, last + 1, float("nan"), self._mode))
        first = self.run.next_step
        columns = {"epoch": [m[0] for m in meta], "batch": [m[1] for m in meta],
                   "seconds": [m[2] for m in meta], "mode": [m[3] for m in meta]}
        columns.update(rows)
        for name in {n for values in self._running_logs.values() for n in values}:
            columns[name] = np.array([self._running_logs.get(first + i, {}).get(name, np.nan) for i in range(count)],
                                     np.float32)
        self._running_logs = {s: v for s, v in self._running_logs.items() if s >= first + count}
        self.run.append_batches(columns)
        self._check_breakpoints(first, rows)
        return count

    def _keep_running_values(self, step, logs):
        """Non-mean metrics' logged values: Keras' running values, kept for
        the last step of each execution (the only one Keras logs)."""
        if not logs or self._probe is None:
            return
        means = self._probe.metric_parts
        values = {}
        for name, value in logs.items():
            if name in means:
                continue
            for column, number in schema.number_columns(name, value):
                values[column] = number
        if values:
            self._running_logs[step] = values
            fresh = [c for c in values if c not in self.run.metadata.get(schema.RUNNING_VALUES, ())]
            if fresh:
                self.run.note_running_values(fresh, step)

    def _check_breakpoints(self, first, rows):
        held = np.flatnonzero(rows[schema.UPDATED] == 0)
        if len(held) and self.status != "breakpoint":
            step = first + int(held[0])
            names = ", ".join(p.name for p in self.breakpoints if getattr(p, "on_device", False))
            detail = (f"{names} at step {step}: its update was kept out (weights, optimizer state and iterations "
                      "as before the step); fit() stopped")
            self._hit(step, "breakpoint", detail)
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
            self.flush()
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
        self._pending = []
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

    def _fill_metadata(self):
        meta = self.run.metadata
        model = self._model
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

