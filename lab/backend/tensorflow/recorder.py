"""Recorder: a Keras callback that turns fit()'s lifecycle into Run rows."""

import contextlib
import sys
import threading
import time
import warnings
import weakref

import keras
import numpy as np
import tensorflow as tf

from lab import describe, schema
from lab.arguments import check_recorder_options
from lab.at_exit import settle_at_exit
from lab.backend.tensorflow import compat, modes
from lab.backend.tensorflow.norms import infinite_norms_message, newly_infinite, shown_names
from lab.backend.tensorflow.probes import LOSS_OBJECT, NONFINITE_GRADIENT, Probe, _keras_defines
from lab.metric_names import leaf_metrics
from lab.backend.tensorflow.state import raw_variable
from lab.backend.tensorflow.step_capture import failure_note
from lab.breakpoints import as_breakpoints
from lab.hooks import CompiledState, hooks_for, release_all
from lab.observers import Observers
from lab.run import Run
from lab.signals import interrupt_detail, is_interrupt, notice_interrupts
from lab.status import StatusReporter
from lab.step_logs import add_note

_WARNED_OLD_STYLE = weakref.WeakSet()
_HELD_AFTER = "_held_after"  # in a device hit's row: how many later rows of its read ran held
_NOT_OURS = ("a step another caller ran",)  # in `_pending`: a row that is no batch of this fit()

RECORDING_THIS_FIT = (
    "This Recorder is recording the fit() of {model!r} that runs this callback: a fit() "
    "inside it cannot be recorded by the same Recorder. Leave the Recorder out of the inner "
    "fit()'s callbacks (its steps are left out of this run, which says so), or give it a "
    "Recorder of its own after the outer fit() ends."
)
_END_OF_DATA = (StopIteration, tf.errors.OutOfRangeError)

OLD_STYLE_WARNING = (
    "The loss Keras reports for this model is not its loss: the custom "
    "train_step calls `self.compiled_metrics.update_state(y, y_pred)`, which in "
    "Keras 3 feeds the predictions into the loss tracker. The lab records the "
    "true batch loss (from compute_loss). To fix the step, replace that line with "
    "the Keras 3 form:\n"
    "    for metric in self.metrics:\n"
    "        if metric.name == 'loss':\n"
    "            metric.update_state(loss)\n"
    "        else:\n"
    "            metric.update_state(y, y_pred)\n"
    "(or `return self.compute_metrics(x, y, y_pred, sample_weight)`), and compute "
    "the loss with `self.compute_loss(x=x, y=y, y_pred=y_pred)` instead of "
    "`self.compiled_loss`."
)


SCALED_TRACKER_WARNING = (
    "The loss Keras reports for this model is its loss divided by the {replicas} replicas: "
    "under a distribution strategy compute_loss returns the loss scaled by 1/{replicas} for "
    "the gradients, and the train_step updates the loss tracker with that value, where "
    "Keras' own train_step unscales it first. The lab records the batch's true loss. To "
    "fix the step, update the tracker with "
    "`loss * self.distribute_strategy.num_replicas_in_sync`."
)

LOSS_OBJECT_SCALED_WARNING = (
    "The loss this train_step logs is 1/{replicas} of the batch's loss: under a "
    "distribution strategy of {replicas} replicas a Keras loss object returns its "
    "value scaled by 1/{replicas} (so that the replicas' gradients sum to the "
    "batch's), and the step feeds that value to its loss tracker. Keras' own "
    "train_step unscales it first. Training is not affected; Keras' logs (History, "
    "progress bar) show the scaled value, the lab records the batch's loss. To fix "
    "the step, update the tracker with `loss * self.distribute_strategy.num_replicas_in_sync`."
)
_TOLD_LOSS_OBJECT = "told_loss_object_scaled"

TRACKER_UNUSED_WARNING = (
    "This train_step never updates the loss tracker, so Keras reports no loss (or 0) "
    "for it; the lab records the loss compute_loss returned. Update it in the step, "
    "e.g. `for metric in self.metrics: metric.update_state(loss) if metric.name == "
    "'loss' else metric.update_state(y, y_pred)`."
)

NONFINITE_TRAINING_NOTE = (
    "Training is not finite from step {step} on: {what}. "
    "lab.breakpoints.nonfinite() stops at the first such batch with its update kept out: "
    "`lab.Recorder(breakpoints=[lab.breakpoints.nonfinite()])`.")
WEIGHTLESS_NOTE = (
    "{columns}: from step {step} on, a batch that gave the metric no weight (its sample weights all 0, or a step "
    "that did not update it) has NaN in its row, meaning \"no value\"; Keras' running value stays as it was")
_TOLD_NONFINITE = "told_nonfinite_training"  # run.metadata: the step the run was told of


class Recorder(StatusReporter, keras.callbacks.Callback):
    """Records one row per training batch into `recorder.run`.

    The row holds the batch's own loss and metric values (not Keras' running
    epoch mean), also at `steps_per_execution > 1`: values are written on the
    device inside the compiled step and read in blocks.

    Rows are numbered from `run.next_step`, one step per training batch
    (one per step at `steps_per_execution > 1`; a step whose update was
    skipped counts, with `updated` 0), so a `fit()` after batches stepped
    into the same run goes on from them.

    Args:
        gradients: bool, add `grad_norm` and `grad_norm/<variable.path>`: norms
            of the gradients the optimizer applied (clipped, where it clips);
            with gradient accumulation, of each batch's own gradient, the one
            accumulated (the Stepper and `lab.watch` show the mean applied).
        weights: bool, add `weight_norm/<path>` and `update_ratio/<path>`.
        breakpoints: sequence of `lab.Breakpoint`, checked per batch; a hit
            stops `fit()` and adds a `breakpoint` event.
        path: str or None; when set, the run is saved there (HDF5) every epoch,
            every `save_every` seconds and at the end.
        run: `lab.Run` or None, to continue an existing record.
        flush_every: float, seconds between reads of the device buffer while
            training (views refresh from what was read).
        save_every: float, seconds between incremental saves when `path` is set.
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
                 run=None, flush_every=0.25, save_every=30.0, norms_every=1):
        super().__init__()
        check_recorder_options(gradients, weights, path, run, flush_every, save_every, norms_every)
        self.gradients = gradients
        self.weights = weights
        self.norms_every = norms_every
        self.breakpoints = as_breakpoints(breakpoints)
        self.path = path
        self.run = run if run is not None else Run()
        self.flush_every = flush_every
        self.save_every = save_every
        self._init_status()
        self._breakpoint_listeners = Observers("a recorder's breakpoints")
        self._saw_nonfinite = False
        self._infinite_told = set()  # norm columns whose inf the run was told of
        self._weightless_told = set()  # metric columns whose weightless batch the run was told of
        self._python_points = any(not getattr(p, "on_device", False) for p in self.breakpoints)
        self._probe = None
        self._probe_state = None  # the CompiledState the probe was made for
        self._cached = None  # (CompiledState, train_function) traced with the probe's hooks
        self._pending = []  # host-side facts of steps whose device rows are unread
        self._callback_list = None  # the CallbackList of the fit() being recorded
        self._epoch_began = False  # no batch of the epoch has begun yet
        self._numbered_by_last = False  # Keras numbers this epoch's executions by their last step
        self.last_batch_ended = -1  # the epoch's last batch whose execution has ended
        self._calls_unlabelled = 0  # this fit()'s step calls whose on_train_batch_end has not come
        self._not_ours_after = 0  # rows of other callers' steps that follow the unlabelled calls
        self._epoch = 0
        self._epoch_start = 0  # the step of the epoch's first row
        self._begin_step = 0
        self._t0 = None
        self._last_flush = 0.0
        self._last_save = 0.0
        self._active = False
        self._mode = None
        self._step_mode = None  # the mode of the execution running now, read as it was called
        self._make_in = None  # the mode fit() makes its train function in, when not the attributes'
        self._hooks = None
        self._fit_frame = None  # the frame of the fit() this recorder records, while it runs
        self._failure = None  # the exception that ended the last fit(), once recorded
        self._epoch_logs = None  # the last epoch's logs, which callbacks after this one may add to
        self._fit_thread = None
        self._weights_put = []  # (method, step after which) of weights a callback put in the model
        self._guarded = 0  # guards of this fit() running now (an exception raised inside passes one)
        self._stop_noticing = None  # puts back the SIGINT handler that was there before this fit()

    # ---- the model's lifecycle --------------------------------------------

    def set_model(self, model):
        # Called by fit() before make_train_function(): install hooks now so the
        # train function is traced with them, once.
        called, frame = compat.calling_model_call(model)
        if called == "fit" and self.is_training():
            raise RuntimeError(RECORDING_THIS_FIT.format(model=model.name))
        self.run.claim_model(model)  # one run records one model
        super().set_model(model)
        if called in ("evaluate", "predict"):
            return  # nothing to record, and Keras' own train function stays as it is
        self._fit_frame = frame
        self._fit_thread = threading.get_ident() if frame is not None else None
        try:
            self._attach(model, compat.calling_callback_list(depth=2))
        except BaseException:
            self._fit_frame = self._fit_thread = None  # keeps nothing of a fit it does not record
            self._release()
            raise

    def _attach(self, model, callbacks):
        if self._fit_frame is not None:  # fit(), not evaluate() or predict(), which train nothing
            _check_trainable_since_built(model, self.run)
        state = CompiledState(model, self._mode_kept(model))
        if self._probe is not None and (self._probe.model is not model or self._probe_state != state):
            # Another model, or this one recompiled: the old probe's hooks and
            # its traced function belong to the old compiled state.
            self._release()
            if self._probe.model is model and self._probe.columns is not None:
                self.run.add_event("recompile", "the model was compiled again; recording goes on with the new compile",
                                   step=self.run.next_step)
            self._probe = None
            self._cached = None
        self._hooks = hooks_for(model)
        if self._probe is None:
            self._probe = Probe(model, gradients=self.gradients, weights=self.weights,
                                breakpoints=self.breakpoints, norms_every=self.norms_every)
            self._probe.busy = self.is_training
            self._probe.gone = self.abandon_if_gone
            self._probe.release_hooks = self._release  # a claim that frees the probe frees all of ours
            self._probe_state = state
        self._probe.ensure_capacity(model.steps_per_execution)
        self._probe.install()
        self._callback_list = callbacks
        self._guard_callbacks(callbacks)
        self._guard_fit(model)
        if self._fit_frame is not None:
            self._guard_between_steps(model, compat.fits_epoch_iterator(self._fit_frame))
        cached = self._cached
        if cached is not None and cached[0] == state:
            model.train_function = cached[1]
        else:
            model.train_function = None  # fit() traces a new one, through the hooks
            # in the mode of the function Keras would have run, not the
            # attributes' when they were set by hand since it was made
            self._make_in = state.mode

    def _mode_kept(self, model):
        """The mode of the train function this fit() runs without the lab:
        the one on the model; or, where the lab dropped it at the end of its
        last fit() and nothing was compiled since, the one the lab traced."""
        if hooks_for(model).train_function_base() is not None:
            return modes.running_mode(model)
        cached = self._cached
        if cached is not None and cached[0].same_compile(CompiledState(model)):
            return cached[0].mode
        return modes.current_mode(model)

    def is_training(self):
        """Whether this recorder is inside a running fit()."""
        return self._active and not self._fit_gone()

    def _fit_gone(self):
        """Whether the fit() this recorder records ended without telling it
        (an exception raised by fit()'s own code reaches no callback)."""
        frame = self._fit_frame
        return self._active and frame is not None and not compat.frame_on_stack(frame, self._fit_thread)

    def abandon_if_gone(self, error=None):
        """When the fit() this recorder was recording has ended by an
        exception that reached none of the lab's guards, records what it can
        (the rows on the device, an `error` or `interrupt` event naming
        `error` where known) and takes every hook off. Returns whether it did.
        Called at the next use of the model (a `fit()`, `evaluate()`,
        `predict()`, another recorder), after each notebook cell and, for a
        run saving as it grows, when the process ends (`lab.at_exit`)."""
        if not self._fit_gone():
            return False
        if error is None:
            error = RuntimeError("fit() ended by an exception raised in Keras' own code between its steps and "
                                 "its callbacks, which reached no callback")
        self._on_failure(error, where="fit()")
        return True

    def on_train_begin(self, logs=None):
        self._active = True
        self._failure = None
        self._stop_noticing = notice_interrupts(self._interrupt_landed)
        _watch_cells(self)
        if self.path:
            settle_at_exit(self)
        self._pending = []
        self._calls_unlabelled = self._not_ours_after = 0
        self._make_in = None  # fit() made its function
        if self._probe.buffer is not None:
            self._probe.buffer.skip_unread()
        self._probe.release()
        self._fill_metadata()
        self._mode = modes.running_mode(self.model)
        modes.training_began(self.model)
        self._hooks.wrap_train_function(self, self._guard_factory, role="guard")
        self._hooks.sync_train_function()
        self._set_status("running")

    def on_epoch_begin(self, epoch, logs=None):
        self._complete_epoch()
        self._epoch = epoch
        self._epoch_began = True
        self._epoch_start = self.run.next_step + len(self._pending)

    def on_train_batch_begin(self, batch, logs=None):
        self._note_weights_put()
        modes.apply_pending_mode(self.model)  # a switch asked for from another thread
        self._hooks.sync_train_function()
        if not compat.BATCH_END_REPORTS_LAST_STEP:
            batch = self._first_step_of(batch)
        self._begin_step = batch
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        elapsed = time.perf_counter() - self._t0 if self._t0 is not None else float("nan")
        steps = self._steps_in_execution(batch)
        self.last_batch_ended = self._begin_step + steps - 1  # steps is cut at the epoch's end
        mode = self._step_mode or modes.running_mode(self.model)
        self._step_mode = None
        if mode != self._mode:
            self.run.add_event("mode", f"{self._mode} -> {mode}", step=self.run.next_step + len(self._pending))
            self._mode = mode
        if steps == 1:
            self._pending.append((self._epoch, self._begin_step, elapsed, mode))
        else:
            share = elapsed / steps
            self._pending.extend([(self._epoch, self._begin_step + i, share, mode) for i in range(steps)])
        self._pending.extend([_NOT_OURS] * self._not_ours_after)
        self._calls_unlabelled = self._not_ours_after = 0
        now = time.monotonic()
        half_full = len(self._pending) * 2 >= self._probe.capacity
        # Training that pauses on a hit (background) must see it at its batch.
        pausing = bool(self.breakpoints) and bool(self._breakpoint_listeners)
        told = self._probe.hit_was_told  # a device breakpoint hit in this execution
        if self._python_points or pausing or half_full or told or now - self._last_flush >= self.flush_every:
            start = len(self.run)
            self.flush()
            self._check_breakpoints(start)
        self._maybe_save(now)

    def _first_step_of(self, batch):
        """The first step of the execution Keras before 3.11 numbers `batch`.
        Those releases number each execution by its first step, except on
        the first epoch over data of unknown size, where Keras 3.5 numbers it
        by its last (`step = -1; step += steps_per_execution`): told apart
        by the epoch's first number, `steps_per_execution - 1` and not 0."""
        steps = int(self.model.steps_per_execution or 1)
        if self._epoch_began:
            self._epoch_began = False
            self._numbered_by_last = steps > 1 and batch == steps - 1
        return batch - steps + 1 if self._numbered_by_last else batch

    def _steps_in_execution(self, batch):
        return compat.steps_in_execution(self._begin_step, batch, self.model.steps_per_execution,
                                         (self.params or {}).get("steps"))

    def on_epoch_end(self, epoch, logs=None):
        self.flush()
        self._note_short_execution()
        # Every step of the epoch has run and been read: host-side guesses
        # left are steps that never ran. Keras 3.11+ reports a last, partial
        # execution (10 batches at steps_per_execution=4: 4, 4 and 2 steps)
        # by its full span, and those guesses would label the next epoch's rows.
        self._pending = []
        self.run.append_epoch(epoch, logs)
        self._epoch_logs = logs  # later callbacks may add to them: completed at the next epoch or the end
        if self.path:
            self._save()

    def _complete_epoch(self):
        if self._epoch_logs is not None:
            logs, self._epoch_logs = self._epoch_logs, None
            self.run.complete_epoch(logs)

    def on_train_end(self, logs=None):
        self._complete_epoch()
        self.flush()
        self._note_record_errors()
        self._note_ema_swap()
        if self._note_best_weights_restored():
            self._weights_put = [put for put in self._weights_put if put[0] != "set_weights"]  # told there
        self._note_weights_put()
        # Host-side guesses of steps that never ran (the last, partial
        # execution of data of unknown size on older Keras).
        self._pending = []
        self._finish("stopped" if self.status == "breakpoint" else "finished")

    def on_test_end(self, logs=None):
        if not self._active:
            self._release()  # an evaluate() with this recorder: nothing to record

    def on_predict_end(self, logs=None):
        if not self._active:
            self._release()

    # ---- reading the device buffer ----------------------------------------

    def flush(self, failing=False):
        """Moves the rows recorded on the device into `run`; returns how many."""
        if self._probe is None:
            return 0
        self._last_flush = time.monotonic()
        self._probe.hit_was_told = False
        rows = self._probe.read()
        count = len(next(iter(rows.values()))) if rows else 0
        if count == 0:
            return 0
        sizes = rows.get("_batch_size")
        if sizes is not None and count > len(self._pending) and (sizes[len(self._pending):] == 0).any():
            # At the end of a generator of unknown length Keras runs one step
            # on an empty batch that no callback sees (the optimizer counts
            # it). It is no batch of the data: note it, keep it out.
            keep = np.ones(count, bool)
            keep[len(self._pending):] = sizes[len(self._pending):] > 0
            self.run.add_event(
                "empty_step",
                f"Keras ran {int((~keep).sum())} train step(s) on an empty batch at the end "
                "of the data; no callback saw them and optimizer.iterations counts them",
                step=self.run.next_step + len(self._pending) - 1,
            )
            rows = {name: values[keep] for name, values in rows.items()}
            count = int(keep.sum())
            if count == 0:
                return 0
        meta = self._pending[:count]
        del self._pending[:count]
        while len(meta) < count:
            # Steps that ran but never reached on_train_batch_end (a failure
            # inside a multi-step execution): keep them, with unknown timing.
            ours = [m for m in meta if m is not _NOT_OURS]
            last_batch = ours[-1][1] if ours else self._begin_step - 1
            meta.append((self._epoch, last_batch + 1, float("nan"), self._mode))
        not_ours = np.array([m is _NOT_OURS for m in meta])
        if not_ours.any():
            self.run.add_event(
                "not_ours",
                f"{int(not_ours.sum())} step(s) run by a fit() or train_on_batch() called inside a callback trained "
                "the model here; their rows are left out: they are no batches of this fit()",
                step=self.run.next_step - 1)
            rows = {name: values[~not_ours] for name, values in rows.items()}
            meta = [m for m in meta if m is not _NOT_OURS]
            count = len(meta)
            if count == 0:
                return 0
        columns = {
            "epoch": [m[0] for m in meta],
            "batch": [m[1] for m in meta],
            "seconds": [m[2] for m in meta],
            "mode": [m[3] for m in meta],
        }
        columns.update(rows)
        self._unscale_logged_loss(columns)
        if self._loss_tracker_unfed(columns.get("loss")):
            del columns["loss"]
        hit_row = self._cut_at_device_hit(columns)
        for name in [name for name in columns if name.startswith(NONFINITE_GRADIENT)]:
            del columns[name]  # read for a hit's culprits, not a column of the run
        self._note_infinite_norms(len(columns["epoch"]))
        self._note_weightless(columns)
        self.run.append_batches(columns)
        self._note_running_values()
        self._probe.note_xla(self.run, self.run.next_step - 1)
        self._probe.note_trace_facts(self.run, self.run.next_step - 1)
        self._check_old_style(rows)
        if hit_row is not None:
            self._on_device_hit(hit_row)
        else:
            self._note_nonfinite_training(columns, self.run.next_step - len(columns["epoch"]))
        return count

    def _unscale_logged_loss(self, columns):
        """Puts the batch's loss in the `loss` column where the step logs its
        Keras loss object's value scaled by 1/replicas (`LOSS_OBJECT`), and
        says so once in the run: the logged loss times the replicas is that
        loss object's, within float32 rounding, in every row where both are
        finite. A step that logs anything else keeps its own loss."""
        held = columns.pop(LOSS_OBJECT, None)
        if held is None or "loss" not in columns:
            return
        if _TOLD_LOSS_OBJECT not in self.run.metadata:
            replicas = self.model.distribute_strategy.num_replicas_in_sync
            logged, held64 = np.asarray(columns["loss"], np.float64), np.asarray(held, np.float64)
            both = np.isfinite(logged) & np.isfinite(held64)
            if replicas < 2 or not both.any():
                return
            scale = max(1e-6, float(abs(held64[both]).max()))
            if float(abs(logged[both] * replicas - held64[both]).max()) > 1e-3 * scale:
                return
            self.run.metadata[_TOLD_LOSS_OBJECT] = True
            self.run.add_event("warning", f"the step logs its loss object's value scaled by 1/{replicas}; "
                                          "the loss column holds the batch's loss", step=self.run.next_step)
            warnings.warn(LOSS_OBJECT_SCALED_WARNING.format(replicas=replicas), UserWarning, stacklevel=2)
        columns["loss"] = np.asarray(held, np.float32)

    def _loss_tracker_unfed(self, loss):
        """True when the `loss` column would hold Keras' loss tracker's batch
        values (the step logs no "loss" of its own: a GAN's `d_loss` and
        `g_loss`) and the step never feeds that tracker: NaN in every row,
        meaning "none". The run then has no `loss` column, as the step's logs
        have none; should the tracker be fed later, the column starts there.
        A tracker fed a NaN loss counts its batches, and its NaN stays."""
        if loss is None or not self._probe.loss_of_tracker or "loss" in self.run.columns:
            return False
        if np.isfinite(np.asarray(loss, np.float64)).any():
            return False
        tracker = leaf_metrics(self.model).get("loss")
        return tracker is not None and float(tracker.count.numpy()) == 0

    def _note_nonfinite_training(self, columns, start):
        """Says once in the run where training first stopped being finite
        (with no breakpoint to stop it): a non-finite loss, or an update
        that took in a non-finite gradient. A LossScaleOptimizer's skipped
        overflow is no such step (no update went in)."""
        if _TOLD_NONFINITE in self.run.metadata:
            return
        stepped = self._probe.stepped_columns
        count = len(columns["epoch"])
        bad, why = np.zeros(count, bool), []
        loss = columns.get("loss")
        if "loss" not in stepped or self._probe.loss_of_tracker:
            loss = None  # no loss of the step's own: NaN there means none
        if loss is not None:
            bad |= ~np.isfinite(loss)
        updated = np.asarray(columns.get("updated", np.zeros(count))) > 0
        # A norm the host finished as inf may be a finite gradient's whose
        # squares overflowed (told apart by `_note_infinite_norms`): only its NaN counts.
        finished_inf = self._probe.infinite
        grads = {name: (np.isnan(values) if name in finished_inf else ~np.isfinite(values)) & updated
                 for name, values in columns.items() if name.startswith("grad_norm/") and name in stepped}
        for hits in grads.values():
            bad |= hits
        if not bad.any():
            return
        first = int(np.argmax(bad))
        if loss is not None and not np.isfinite(loss[first]):
            why.append(f"the loss is {loss[first]}")
        names = [name.split("/", 1)[1] for name, hits in grads.items() if hits[first]]
        if names:
            why.append(f"the update took in non-finite gradients of {shown_names(names)}")
        step = start + first
        self.run.metadata[_TOLD_NONFINITE] = step
        self.run.add_event("warning", NONFINITE_TRAINING_NOTE.format(step=step, what="; ".join(why)), step=step)

    def _note_infinite_norms(self, count):
        """Warns once per column of a norm the host finished as inf (among
        this read's first `count` rows, the next to go into the run): it may
        be a finite norm whose sum of squares overflowed."""
        infinite = {column: row for column, row in self._probe.infinite.items() if row < count}
        columns = newly_infinite(infinite, self._infinite_told)
        if not columns:
            return
        step = self.run.next_step + infinite[columns[0]]
        also = ""
        if compat.xla_keeps_overflowing_norms():
            also = " With `jit_compile=True` the step computes such a norm exactly."
        message = infinite_norms_message(columns, step, also=also)
        self.run.add_event("warning", message, step=step)
        warnings.warn(message, RuntimeWarning, stacklevel=2)

    def _note_weightless(self, columns):
        """Says once per metric column of the rows about to go in (`columns`)
        where a batch first gave it no weight (its sample weights all 0, or
        a step that did not update it): the row holds NaN, meaning "no
        value", where Keras' running value stays as it was."""
        count = len(columns["epoch"])
        weightless = {column: row for column, row in self._probe.weightless.items()
                      if row < count and column in columns and not schema.is_internal(column)
                      and column not in self._weightless_told}
        if not weightless:
            return
        self._weightless_told.update(weightless)
        columns = sorted(weightless, key=weightless.get)
        step = self.run.next_step + weightless[columns[0]]
        self.run.add_event("warning", WEIGHTLESS_NOTE.format(columns=shown_names(columns), step=step), step=step)

    def _note_ema_swap(self):
        """Says once that Keras put the optimizer's moving averages in place
        of the weights at fit()'s end (`use_ema=True`), after the last row."""
        optimizer = getattr(self.model, "optimizer", None)
        if not (self.weights and len(self.run) and isinstance(optimizer, keras.optimizers.Optimizer)
                and getattr(optimizer, "use_ema", False)) or self.run.metadata.get(_TOLD_EMA_SWAP):
            return
        self.run.metadata[_TOLD_EMA_SWAP] = True
        self.run.add_event("warning", EMA_SWAP_NOTE, step=self.run.next_step - 1)

    def _note_best_weights_restored(self):
        """Says that an `EarlyStopping(restore_best_weights=True)` of this
        fit() puts back, at its end, the weights of an earlier epoch than
        the last row's (before or after this recorder's own end)."""
        callbacks = getattr(self._callback_list, "callbacks", ())
        for callback in callbacks:
            if (isinstance(callback, keras.callbacks.EarlyStopping) and callback.restore_best_weights
                    and callback.best_weights is not None and len(self.run)
                    and callback.best_epoch != self._epoch):
                self.run.add_event("warning", BEST_WEIGHTS_NOTE.format(epoch=callback.best_epoch + 1),
                                   step=self.run.next_step - 1)
                return True
        return False

    def _note_weights_put(self):
        """Says where a callback put weights in the model during fit()
        (`model.set_weights`, `model.load_weights`: keras-io's early stopping
        that restores its best weights, BackupAndRestore resuming)."""
        if not self._weights_put:  # called every batch: nothing put is the common case
            return
        for name, step in self._weights_put:
            if step < 0:  # put before the run's first step (BackupAndRestore resuming): its rows start there
                continue
            self.run.add_event("warning", WEIGHTS_PUT_NOTE.format(method=name, step=step, next=step + 1),
                               step=step)
        self._weights_put = []

    def _note_short_execution(self):
        """Says once that this epoch's last execution ran short of
        steps_per_execution, where Keras before 3.7 then runs the part of
        one more step that needs no batch, and the lab's hooks make the
        update wait for one (`compat.SHORT_EXECUTION_RUNS_PART_OF_A_STEP`)."""
        steps = int(self.model.steps_per_execution or 1)
        # The epoch's steps where known: the last one's row may be lost too.
        ran = (self.params or {}).get("steps") or self.run.next_step - self._epoch_start
        if not (compat.SHORT_EXECUTION_RUNS_PART_OF_A_STEP and steps > 1 and ran % steps and self._mode == "graph"
                and self.status != "breakpoint" and not self.model.stop_training
                and self._probe.reshapes_the_update()) \
                or self.run.metadata.get(_TOLD_SHORT_EXECUTION):
            return
        self.run.metadata[_TOLD_SHORT_EXECUTION] = True
        what = ("device breakpoints (nonfinite(), loss_spike()) gate the update on the batch"
                if self._probe.breakpoints else "the gradients' norms are read before the accumulating update")
        self.run.add_event("warning", SHORT_EXECUTION_NOTE.format(
            version=keras.__version__, steps=steps, ran=ran % steps, what=what), step=self.run.next_step - 1)

    def _note_record_errors(self):
        told = self.run.metadata.setdefault(schema.RECORD_ERRORS, [])
        for message in self._probe.record_errors:
            if message not in told:
                told.append(message)
                self.run.add_event("error", f"the lab could not record steps: {message}", step=self.run.next_step)

    def _note_running_values(self):
        """Says which columns hold Keras' running values, not the batch's own."""
        self.run.note_running_values(self._probe.running_columns, self.run.next_step - 1,
                                     replicas=self.model.distribute_strategy.num_replicas_in_sync)

    def _cut_at_device_hit(self, columns):
        """Keeps rows up to a device breakpoint's hit; later steps of the same
        execution ran without updating (held) and are no steps of training."""
        hits = columns.get("_hit")
        if hits is None or not (hits > 0).any():
            return None
        first = int(np.argmax(hits > 0))
        row = {name: values[first] for name, values in columns.items()}
        row[_HELD_AFTER] = len(hits) - first - 1  # batches that ran held before fit() could stop
        for name in list(columns):
            columns[name] = columns[name][: first + 1]
        return row

    def _on_device_hit(self, row):
        point = self._probe.breakpoints[int(row["_hit"]) - 1]
        step = self.run.next_step - 1
        # The hit kept the update out, and with it the norms of the gradients
        # it would have applied (NaN: "none"): nonfinite()'s gate put in the
        # row which gradients it found not finite. Other device breakpoints
        # read the loss only. A loss tracker that the step never updates
        # (its loss is NaN in every row) names no culprit either.
        culprits = [name[len(NONFINITE_GRADIENT):] for name, value in row.items()
                    if name.startswith(NONFINITE_GRADIENT) and value > 0]
        if "loss" in row and not np.isfinite(row["loss"]) and not (
                self._probe.loss_of_tracker and not np.isfinite(self.run.batches()["loss"]).any()):
            culprits.insert(0, "loss")
        detail = f"{point.name} at step {step}; " + _updates_detail(row)
        if culprits:
            detail += "; not finite: " + ", ".join(culprits)
        held = row[_HELD_AFTER]
        if held:
            detail += (f"; {held} later batch(es) ran with their updates held before fit() stopped "
                       "(Keras' logs, History and other callbacks count them)")
        self.run.add_event("nonfinite" if point.name == "nonfinite" else "breakpoint", detail, step=step)
        self.model.stop_training = True
        self._set_status("breakpoint", detail)
        self._breakpoint_listeners.notify(step, detail)

    def _check_old_style(self, rows):
        if "_tracker_loss" not in rows or self.model in _WARNED_OLD_STYLE or getattr(self._probe, "not_logs", None):
            return  # (a step that returns no logs fails in fit(), and the failure says why)
        true, tracked = rows["loss"], rows["_tracker_loss"]
        if not np.isfinite(true).all():
            # A non-finite loss poisons the tracker for the rest of the epoch.
            self._saw_nonfinite = True
        if self._saw_nonfinite:
            return
        if len(tracked) and np.isnan(tracked).all() and np.isfinite(true).any():
            _WARNED_OLD_STYLE.add(self.model)
            self.run.add_event("warning", "loss tracker never updated")
            warnings.warn(TRACKER_UNUSED_WARNING, UserWarning, stacklevel=2)
            return
        true, tracked = true[np.isfinite(tracked)], tracked[np.isfinite(tracked)]
        scale = max(1e-6, float(abs(true).max()) if len(true) else 1.0)
        replicas = self.model.distribute_strategy.num_replicas_in_sync
        if (compat.SCALES_LOSS_BY_REPLICAS and replicas > 1 and len(true)
                and float(abs(true / replicas - tracked).max()) <= 1e-3 * scale):
            _WARNED_OLD_STYLE.add(self.model)
            self.run.add_event("warning", f"loss tracker fed with the loss scaled by 1/{replicas} (compute_loss)")
            warnings.warn(SCALED_TRACKER_WARNING.format(replicas=replicas), UserWarning, stacklevel=2)
            return
        if len(true) and float(abs(true - tracked).max()) > 1e-3 * scale:
            _WARNED_OLD_STYLE.add(self.model)
            self.run.add_event("warning", "loss tracker fed with predictions (compiled_metrics)")
            warnings.warn(OLD_STYLE_WARNING, UserWarning, stacklevel=2)

    # ---- breakpoints -------------------------------------------------------

    def _check_breakpoints(self, start):
        if not self.breakpoints or len(self.run) <= start:
            return
        points = [p for p in self.breakpoints if not getattr(p, "on_device", False)]
        frame = self.run.batches().iloc[start:]
        for _, row in frame.iterrows():
            for point in points:
                if point.hit(row):
                    step, last = int(row["step"]), self.run.next_step - 1
                    detail = point.describe(row)
                    if step < last:
                        # The rows of one execution are read after all its steps ran.
                        detail += (f"; steps {step + 1} to {last} of the same execution (steps_per_execution="
                                   f"{int(self.model.steps_per_execution)}) ran too, their updates in: a Python "
                                   "condition is checked after each execution (stop at the step itself with "
                                   "steps_per_execution=1, or with a device breakpoint)")
                    self.run.add_event("breakpoint", detail, step=step)
                    self.model.stop_training = True
                    self._set_status("breakpoint", detail)
                    self._breakpoint_listeners.notify(step, detail)
                    return

    # ---- failures ----------------------------------------------------------

    def _guard_factory(self, function):
        """Wraps the train function so a failure inside a step is noticed:
        Keras calls no callback when the step raises."""
        recorder = self

        def guarded(iterator):
            frame = recorder._fit_frame
            if frame is not None and not compat.called_from(frame):
                return recorder._not_ours(function, iterator)
            recorder._calls_unlabelled += 1
            # The mode the step runs in, read as it is called: a callback
            # ahead of this recorder may switch at batch end for the next.
            # The function's own: Keras keeps running a function made before
            # `run_eagerly` or `jit_compile` was set by hand.
            recorder._step_mode = modes.running_mode(recorder.model)
            recorder._guarded += 1
            try:
                return function(iterator)
            except _END_OF_DATA:
                raise
            except BaseException as error:
                recorder._on_failure(error)
                raise
            finally:
                recorder._guarded -= 1

        return guarded

    def _not_ours(self, function, iterator):
        """Runs a step another caller asked for while this fit() runs (a
        `fit()` or `train_on_batch()` inside a callback): it trains the
        model, and the probe writes its rows, but they are no batches of
        this fit(). They are marked so that `flush` leaves them out and
        says so."""
        buffer = self._probe.buffer if self._probe is not None else None
        before = int(buffer.count.numpy()) if buffer is not None else 0
        try:
            return function(iterator)
        finally:
            buffer = self._probe.buffer if self._probe is not None else None
            written = (int(buffer.count.numpy()) if buffer is not None else 0) - before
            if self._calls_unlabelled:  # a step of this fit() ran first, unlabelled yet
                self._not_ours_after += written
            else:
                self._pending.extend([_NOT_OURS] * written)

    def _guard_fit(self, model):
        """Guards the rest of what fit() runs: its validation (`evaluate()`
        called by fit() itself) fails into `_on_failure` like a step; and
        the next fit(), evaluate() or predict() on the model first takes off
        the hooks of a fit() that ended by an exception no guard saw."""
        recorder = self

        def evaluate_factory(inner):
            def evaluate(*args, **kwargs):
                if not (recorder._active and compat.is_fits_validation(kwargs)):
                    return inner(*args, **kwargs)  # a callback's own evaluate(): its errors are its own
                recorder._guarded += 1
                try:
                    return inner(*args, **kwargs)
                except BaseException as error:
                    recorder._on_failure(error, where="validation")
                    raise
                finally:
                    recorder._guarded -= 1

            return evaluate

        def heal_factory(inner):
            def make_function(*args, **kwargs):
                recorder.abandon_if_gone()
                return inner(*args, **kwargs)

            return make_function

        def make_train_factory(inner):
            def make_train_function(*args, **kwargs):
                recorder.abandon_if_gone()
                mode, recorder._make_in = recorder._make_in, None
                frame = recorder._fit_frame
                try:
                    if mode is None or model.train_function is not None:
                        return inner(*args, **kwargs)
                    with modes.made_in(model, mode):
                        return inner(*args, **kwargs)
                except BaseException as error:
                    # Before on_train_begin: no other guard is on yet, and the
                    # hooks put on for this fit() must not outlive it.
                    if frame is not None and compat.called_from(frame):
                        recorder._on_failure(error, where="fit()'s make_train_function()")
                    raise

            return make_train_function

        def put_weights_factory(inner, name):
            def put_weights(*args, **kwargs):
                if recorder._fit_frame is None:
                    return inner(*args, **kwargs)
                before = _weight_bytes(model)
                result = inner(*args, **kwargs)
                if _weight_bytes(model) != before:  # the same weights put back change nothing to tell
                    recorder._weights_put.append((name, recorder.run.next_step + len(recorder._pending) - 1))
                return result

            return put_weights

        self._hooks.wrap(self, model, "evaluate", evaluate_factory, role="guard")
        for name in ("set_weights", "load_weights"):
            self._hooks.wrap(self, model, name, lambda inner, name=name: put_weights_factory(inner, name),
                             role="guard")
        self._hooks.wrap(self, model, "make_train_function", make_train_factory, role="guard")
        for name in ("make_test_function", "make_predict_function"):
            self._hooks.wrap(self, model, name, heal_factory, role="guard")

    def _guard_callbacks(self, callbacks):
        """Notices an exception raised by any callback during fit() (a plot that
        fails, an interrupt between batches), which reaches no callback hook."""
        if callbacks is None:
            return
        for name in _CALLBACK_METHODS:
            if getattr(callbacks, name, None) is None:
                continue

            self._hooks.wrap(self, callbacks, name, self._failing_into(name), role="guard")

    def _failing_into(self, where, only_from_fit=False):
        """A hook factory: the wrapper it makes records an exception raised
        through it (`_on_failure`) and raises it on. With `only_from_fit`, only
        when this fit() itself made the call (a callback's own call of the
        same method keeps its errors to itself)."""
        recorder = self

        def factory(inner):
            def guarded(*args, **kwargs):
                recorder._guarded += 1
                try:
                    return inner(*args, **kwargs)
                except _END_OF_DATA:
                    raise
                except BaseException as error:
                    frame = recorder._fit_frame
                    if not only_from_fit or (frame is not None and compat.called_from(frame)):
                        recorder._on_failure(error, where=where)
                    raise
                finally:
                    recorder._guarded -= 1

            return guarded

        return factory

    def _guard_between_steps(self, model, epoch_iterator):
        """Notices an exception raised by fit()'s own code between its steps,
        which reaches no callback: in the loop over an epoch's batches
        (making the data's iterator at the epoch's start, reading a batch,
        a line of fit() between two calls) and in the calls fit() makes at
        an epoch's edges and its end (the metrics' reset and results, the
        optimizer's finalize). An interrupt there is recorded as one, and
        the hooks come off before fit() has ended."""
        if epoch_iterator is not None:
            recorder = self

            def loop_factory(inner):
                @contextlib.contextmanager
                def catch_stop_iteration(*args, **kwargs):
                    recorder._guarded += 1
                    try:
                        with inner(*args, **kwargs):
                            yield
                    except _END_OF_DATA:
                        raise
                    except BaseException as error:
                        recorder._on_failure(error, where="fit()'s loop over the epoch's batches")
                        raise
                    finally:
                        recorder._guarded -= 1

                return catch_stop_iteration

            self._hooks.wrap(self, epoch_iterator, "catch_stop_iteration", loop_factory, role="guard")
        for target, name in compat.fits_calls_between_steps(model):
            self._hooks.wrap(self, target, name, self._failing_into(f"fit()'s {name}()", only_from_fit=True),
                             role="guard")

    def _interrupt_landed(self, error):
        """A Ctrl-C arrived during this fit(): where it lands outside every
        guard (a line of fit() between two calls), it ends fit() unseen, so
        it is recorded now, before it is raised."""
        if self._active and self._guarded == 0 and not self._fit_gone():
            self._on_failure(error, where="fit()")

    def _on_failure(self, error, where=None):
        """Records what stopped training and takes every hook off; never raises.
        An error two guards see (a callback's, inside fit()'s validation) is recorded once."""
        if error is self._failure:
            return
        self._failure = error
        try:
            self._complete_epoch()
            if self._active:
                try:
                    self.flush(failing=True)
                except BaseException:  # noqa: BLE001 - the user's error is the one to show
                    pass
            if is_interrupt(error):
                self.run.add_event("interrupt", interrupt_detail(error, where))
                self._finish("interrupted")
            else:
                message = compat.failure_message(error)
                # Keras' error names neither the input (or the step's return value) nor the fix.
                note = failure_note(error, self.model, getattr(self._probe, "not_logs", None),
                                    getattr(self._probe, "has_targets", True))
                if note:
                    message = f"{message}\n{note}"
                    add_note(error, note)
                self.run.add_event("error", message)
                self._finish("failed", message)
                compat.warn_of_cause(error)
        except BaseException:  # noqa: BLE001 - cleanup below must run, the user's error propagates
            pass
        finally:
            self._active = False
            self._fit_frame = None
            self._release()
            self._put_back_interrupt_handler()
            if self.model is not None:
                release_all(self.model)  # fit() is over: no wrapper of the lab stays on

    def _finish(self, status, detail=""):
        try:
            if status != "stopped" or not self.status_detail:
                self._set_status(status, detail)
            else:
                self._set_status(status, self.status_detail)
            self._active = False
            self._fit_frame = None
            if status in ("finished", "stopped") and self._hooks is not None:
                function = self._hooks.train_function_base()
                if function is not None:
                    self._cached = (CompiledState(self.model, modes.running_mode(self.model)), function)
        finally:
            self._active = False
            self._weights_put = []
            self._release()
            self._put_back_interrupt_handler()
            if self.model is not None:
                modes.training_ended(self.model)
        if self.path:
            self._save()

    def _put_back_interrupt_handler(self):
        stop, self._stop_noticing = self._stop_noticing, None
        if stop is not None:
            stop()

    def _release(self):
        """Leaves no trace: every hook this recorder and its probe put on comes
        off, and a train function traced with them is dropped (never raises)."""
        if self._hooks is not None:
            self._hooks.release(self)
        if self._probe is not None:
            self._probe.uninstall()

    def release_hooks(self):
        self._release()

    def detach(self):
        """Takes the recorder's hooks off the model now (another recorder may then attach)."""
        self._active = False
        self._release()

    _detach = detach

    # ---- status, metadata, saving -----------------------------------------

    def _status_kept_in(self):
        return self.run.metadata

    def add_breakpoint_listener(self, fn):
        """Calls `fn(step, detail)` when a breakpoint hits (the background runner pauses on it)."""
        self._breakpoint_listeners.add(fn)

    def _fill_metadata(self):
        meta = self.run.metadata
        model = self.model
        if self._probe.norms_every > 1:
            meta[schema.NORMS_EVERY] = self._probe.norms_every
        if "model" in meta:
            return  # filled by an earlier fit(): the first fit describes the run
        for key, value in describe.model_metadata(model).items():
            meta.setdefault(key, value)
        meta.setdefault("mode", modes.running_mode(model))
        meta.setdefault("devices", [d.name for d in tf.config.list_logical_devices()])
        meta.setdefault("strategy", type(model.distribute_strategy).__name__)
        meta.setdefault("tensorflow", tf.__version__)

    def _maybe_save(self, now):
        if self.path and now - self._last_save >= self.save_every:
            self._save()

    def _save(self):
        self._last_save = time.monotonic()
        try:
            self.run.save(self.path)
        except Exception as error:  # noqa: BLE001 - saving must not stop training
            warnings.warn(f"Could not save the run to {self.path}: {error}", RuntimeWarning, stacklevel=2)

    # ---- pausing at a breakpoint (lab.backend.tensorflow.pause) ------------

    def remove_breakpoint_listener(self, fn):
        """Stops calling `fn` on breakpoint hits (nothing happens if it was not added)."""
        self._breakpoint_listeners.remove(fn)

    def resume_after_breakpoint(self):
        """When training paused at a hit goes on: lets updates through again
        (a device breakpoint holds every update after its hit until then) and
        sets the status back to "running"."""
        if self._probe is not None:
            self._probe.release()
        if self.status == "breakpoint":
            self._set_status("running")


STALE_TRAINABLE_MESSAGE = (
    "The model's trainable variables changed since Keras traced its train function, and the model was "
    "not compiled again ({now} now, {then} when it was traced{changes}). Keras' own fit() goes on "
    "training the variables it was traced with (a change of `trainable` takes effect at the next "
    "compile()); the lab must trace the step anew and would train the new set, so it does not watch "
    "this fit(). Call model.compile(...) again after setting `trainable`, as Keras' transfer-learning "
    "guide does, then fit()."
)

EMA_SWAP_NOTE = (
    "At the end of fit() Keras put the optimizer's moving averages of the weights in their place "
    "(use_ema=True): the model now holds the averages, and the last rows' weight_norm and "
    "update_ratio are of the weights the updates made, before that swap.")
_TOLD_EMA_SWAP = "told_ema_swap"

BEST_WEIGHTS_NOTE = (
    "At the end of fit() EarlyStopping(restore_best_weights=True) put back the weights of the end of "
    "epoch {epoch}: the model now holds those, and the last rows' weight_norm and update_ratio are of "
    "the weights the last updates made.")

def _weight_bytes(model):
    """The model's weights, bit for bit: read only when a callback puts
    weights in the model during fit(), which is rare."""
    return [(variable.path, np.asarray(keras.ops.convert_to_numpy(variable)).tobytes())
            for variable in model.weights]


WEIGHTS_PUT_NOTE = (
    "model.{method}() put weights in the model during fit(), after step {step}: the rows up to it show the "
    "weights the updates made; the update of step {next} on starts from the weights put in (the model ends "
    "with those where no step came after).")

SHORT_EXECUTION_NOTE = (
    "The data ended inside an execution: its last ran {ran} of steps_per_execution={steps} steps. Keras "
    "{version} (before 3.7) then runs, in graph mode, the part of one more train step that needs no batch (bare "
    "fit() counts one more optimizer iteration there) and ends the execution as soon as that step finds no "
    "batch; here {what}, which changes what of those steps runs: from this step on the optimizer's state, and "
    "the updates that read it (Adam's), may differ from bare fit(), and the last step's row may be missing. A "
    "number of batches per epoch that steps_per_execution divides, or Keras 3.7 or later, trains as bare fit().")
_TOLD_SHORT_EXECUTION = "told_short_execution"

FROZEN_SINCE_BUILT_NOTE = (
    "{variables} are not trainable now, but the optimizer was built for them. Where `trainable` was "
    "set after the last compile(), Keras' own fit() goes on training them (its traced function keeps "
    "the old set) and this fit(), which the lab traces anew, leaves them as they are: call "
    "model.compile(...) after setting `trainable`. Where compile() came after it (keeping the same "
    "optimizer), both train the new set, and this does not apply."
)
_TOLD_FROZEN = "told_frozen_since_built"


def _trainable_since_built(model):
    """`(now, then, added, removed)`: the model's trainable variables now and
    those its optimizer was built for, where they differ and Keras has a
    traced train function that a fit() would reuse; else None. Only for
    Keras' own train_step, whose optimizer applies to `model.trainable_variables`."""
    optimizer = getattr(model, "optimizer", None)
    if model.train_function is None or optimizer is None or not optimizer.built:
        return None
    if not _keras_defines(type(model), "train_step"):
        return None
    then = compat.optimizer_variables_for(optimizer)
    now = list(model.trainable_variables)
    then_ids, now_ids = {id(raw_variable(v)) for v in then}, {id(raw_variable(v)) for v in now}
    if not then or then_ids == now_ids:
        return None
    added = [v.path for v in now if id(raw_variable(v)) not in then_ids]
    removed = [v.path for v in then if id(raw_variable(v)) not in now_ids]
    return now, then, added, removed


def _check_trainable_since_built(model, run):
    """Refuses (before any step) a fit() whose model has trainable variables
    its optimizer was not built for: Keras' own fit() trains the set its
    traced function was made for (`trainable` set without compile()), and
    the lab's new trace would train the new one or fail on the optimizer's
    unknown variable. Variables only frozen since may be either that or a
    compile() that kept the optimizer: the run is told, once."""
    found = _trainable_since_built(model)
    if found is None:
        return
    now, then, added, removed = found
    if added:
        changes = "".join(f"; {label}: {shown_names(paths)}" for label, paths in
                          (("made trainable", added), ("frozen", removed)) if paths)
        raise ValueError(STALE_TRAINABLE_MESSAGE.format(now=len(now), then=len(then), changes=changes))
    if not run.metadata.get(_TOLD_FROZEN):
        run.metadata[_TOLD_FROZEN] = True
        message = FROZEN_SINCE_BUILT_NOTE.format(variables=shown_names(removed))
        run.add_event("warning", message, step=run.next_step)
        warnings.warn(message, RuntimeWarning, stacklevel=4)


_RECORDING = weakref.WeakSet()  # recorders inside a fit(), for the notebook's after-cell check
_CELL_HOOK = []


def _watch_cells(recorder):
    """In IPython, checks after each cell that every recording fit() is
    still running: a fit() ended by an exception no guard saw (`abandon_if_gone`)
    is told in its run and leaves no hook as soon as its cell ends."""
    _RECORDING.add(recorder)
    if _CELL_HOOK:
        return
    shell = getattr(sys.modules.get("IPython"), "get_ipython", lambda: None)()
    if shell is None:
        return

    def after_cell(result=None):
        error = getattr(result, "error_in_exec", None)
        for waiting in list(_RECORDING):
            try:
                if waiting.abandon_if_gone(error):
                    _RECORDING.discard(waiting)
            except Exception:  # noqa: BLE001 - a cell hook must never fail the user's cell
                pass
        for done in [r for r in _RECORDING if not r._active]:
            _RECORDING.discard(done)

    shell.events.register("post_run_cell", after_cell)
    _CELL_HOOK.append(after_cell)


_CALLBACK_METHODS = (
    "on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end", "on_train_batch_begin", "on_train_batch_end",
    "on_test_begin", "on_test_end", "on_test_batch_begin", "on_test_batch_end",
)


def _updates_detail(row):
    """Which optimizer updates of the hit step went in, from the row."""
    per_optimizer = {name[len(schema.UPDATED_PREFIX):]: value for name, value in row.items()
                     if name.startswith(schema.UPDATED_PREFIX)}
    overflow = row.get("_overflow", 0) > 0
    reason = " (it left a weight or optimizer slot non-finite; put back)" if overflow else ""
    if not per_optimizer:
        return "update skipped" + reason
    applied = [name for name, value in per_optimizer.items() if value > 0]
    skipped = [name for name, value in per_optimizer.items() if not value > 0]
    text = "update skipped: " + ", ".join(skipped) + reason
    if applied:
        text += "; applied before the hit: " + ", ".join(applied)
    return text
