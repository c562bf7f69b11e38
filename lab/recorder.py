"""Recorder: a Keras callback that turns fit()'s lifecycle into Run rows."""

import inspect
import sys
import time
import warnings
import weakref

import keras
import numpy as np
import tensorflow as tf

from lab import modes
from lab.probes import Probe
from lab.run import Run
from lab.status import StatusReporter

_WARNED_OLD_STYLE = weakref.WeakSet()
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


TRACKER_UNUSED_WARNING = (
    "This train_step never updates the loss tracker, so Keras reports no loss (or 0) "
    "for it; the lab records the loss compute_loss returned. Update it in the step, "
    "e.g. `for metric in self.metrics: metric.update_state(loss) if metric.name == "
    "'loss' else metric.update_state(y, y_pred)`."
)


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
            of the gradients the optimizer applied.
        weights: bool, add `weight_norm/<path>` and `update_ratio/<path>`.
        breakpoints: sequence of `lab.Breakpoint`, checked per batch; a hit
            stops `fit()` and adds a `breakpoint` event.
        path: str or None; when set, the run is saved there (HDF5) every epoch,
            every `save_every` seconds and at the end.
        run: `lab.Run` or None, to continue an existing record.
        flush_every: float, seconds between reads of the device buffer while
            training (views refresh from what was read).
        save_every: float, seconds between incremental saves when `path` is set.

    Example:

    ```python
    rec = lab.Recorder(gradients=True)
    model.fit(x, y, epochs=2, callbacks=[rec])
    rec.run.batches()
    ```
    """

    def __init__(self, gradients=False, weights=False, breakpoints=(), path=None,
                 run=None, flush_every=0.25, save_every=30.0):
        super().__init__()
        self.gradients = gradients
        self.weights = weights
        self.breakpoints = list(breakpoints)
        self.path = path
        self.run = run if run is not None else Run()
        self.flush_every = flush_every
        self.save_every = save_every
        self._init_status()
        self._breakpoint_listeners = []
        self._saw_nonfinite = False
        self._probe = None
        self._cached = None  # (signature, train_function) built with our hooks
        self._pending = []  # host-side facts of steps whose device rows are unread
        self._epoch = 0
        self._begin_step = 0
        self._t0 = None
        self._last_flush = 0.0
        self._last_save = 0.0
        self._guarded = None
        self._active = False
        self._mode = None

    # ---- the model's lifecycle --------------------------------------------

    def set_model(self, model):
        # Called by fit() before make_train_function(): install hooks now so the
        # train function is traced with them, once.
        super().set_model(model)
        if self._probe is not None and self._probe.model is not model:
            self._detach()
            self._probe = None
            self._cached = None
        if self._probe is None:
            self._probe = Probe(model, gradients=self.gradients, weights=self.weights,
                                breakpoints=self.breakpoints)
        self._probe.ensure_capacity(model.steps_per_execution)
        self._probe.install()
        self._guard_callbacks(_calling_callback_list())
        cached = self._cached
        if cached is not None and cached[0] == _signature(model):
            model.train_function = cached[1]
        elif not getattr(model.train_function, "_lab_recorder", None) is self:
            model.train_function = None

    def on_train_begin(self, logs=None):
        self._active = True
        self._pending = []
        if self._probe.buffer is not None:
            self._probe.buffer.skip_unread()
        self._probe.release()
        self._fill_metadata()
        self._mode = modes.current_mode(self.model)
        modes.training_began(self.model)
        # set_model dropped the function a mode switch had armed: arm it again.
        modes.guard_first_step(self.model)
        self._guard()
        self._set_status("running")

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        modes.apply_pending_mode(self.model)  # a switch asked for from another thread
        if self.model.train_function is not self._guarded:
            self._guard()
        self._begin_step = batch
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        elapsed = time.perf_counter() - self._t0 if self._t0 is not None else float("nan")
        steps = self._steps_in_execution(batch)
        mode = modes.current_mode(self.model)
        if mode != self._mode:
            self.run.add_event("mode", f"{self._mode} -> {mode}", step=self.run.next_step + len(self._pending))
            self._mode = mode
        for i in range(steps):
            self._pending.append((self._epoch, self._begin_step + i, elapsed / steps, mode))
        now = time.monotonic()
        half_full = len(self._pending) * 2 >= self._probe.capacity
        python_points = any(not getattr(p, "on_device", False) for p in self.breakpoints)
        # Training that pauses on a hit (background) must see it at its batch.
        pausing = bool(self.breakpoints) and bool(self._breakpoint_listeners)
        if python_points or pausing or half_full or now - self._last_flush >= self.flush_every:
            start = len(self.run)
            self.flush()
            self._check_breakpoints(start)
        self._maybe_save(now)

    def _steps_in_execution(self, batch):
        if batch > self._begin_step or not _reports_begin_step_only(self.model):
            return max(1, batch - self._begin_step + 1)
        # Keras before 3.8 reports the first step of an execution at its end.
        steps = int(self.model.steps_per_execution)
        total = (self.params or {}).get("steps")
        if total:
            steps = max(1, min(steps, int(total) - self._begin_step))
        return steps

    def on_epoch_end(self, epoch, logs=None):
        self.flush()
        self.run.append_epoch(epoch, logs)
        if self.path:
            self._save()

    def on_train_end(self, logs=None):
        self.flush()
        # Host-side guesses of steps that never ran (the last, partial
        # execution of data of unknown size on older Keras).
        self._pending = []
        self._finish("stopped" if self.status == "breakpoint" else "finished")

    def on_test_end(self, logs=None):
        if not self._active:
            self._detach()

    def on_predict_end(self, logs=None):
        if not self._active:
            self._detach()

    # ---- reading the device buffer ----------------------------------------

    def flush(self, failing=False):
        """Moves the rows recorded on the device into `run`; returns how many."""
        if self._probe is None:
            return 0
        self._last_flush = time.monotonic()
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
            last_batch = meta[-1][1] if meta else self._begin_step - 1
            meta.append((self._epoch, last_batch + 1, float("nan"), self._mode))
        columns = {
            "epoch": [m[0] for m in meta],
            "batch": [m[1] for m in meta],
            "seconds": [m[2] for m in meta],
            "mode": [m[3] for m in meta],
        }
        columns.update(rows)
        hit_row = self._cut_at_device_hit(columns)
        self.run.append_batches(columns)
        self._check_old_style(rows)
        if hit_row is not None:
            self._on_device_hit(hit_row)
        return count

    def _cut_at_device_hit(self, columns):
        """Keeps rows up to a device breakpoint's hit; later steps of the same
        execution ran without updating (held) and are no steps of training."""
        hits = columns.get("_hit")
        if hits is None or not (hits > 0).any():
            return None
        first = int(np.argmax(hits > 0))
        for name in list(columns):
            columns[name] = columns[name][: first + 1]
        return {name: values[first] for name, values in columns.items()}

    def _on_device_hit(self, row):
        point = self._probe.breakpoints[int(row["_hit"]) - 1]
        step = self.run.next_step - 1
        culprits = [name.split("/", 1)[1] for name, value in row.items()
                    if name.startswith("grad_norm/") and not np.isfinite(value)]
        if "loss" in row and not np.isfinite(row["loss"]):
            culprits.insert(0, "loss")
        detail = f"{point.name} at step {step}; update skipped"
        if culprits:
            detail += "; not finite: " + ", ".join(culprits)
        self.run.add_event("nonfinite" if point.name == "nonfinite" else "breakpoint", detail, step=step)
        self.model.stop_training = True
        self._set_status("breakpoint", detail)
        for fn in list(self._breakpoint_listeners):
            fn(step, detail)

    def _check_old_style(self, rows):
        if "_tracker_loss" not in rows or self.model in _WARNED_OLD_STYLE:
            return
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
                    self.run.add_event("breakpoint", point.describe(row), step=int(row["step"]))
                    self.model.stop_training = True
                    self._set_status("breakpoint", point.describe(row))
                    for fn in list(self._breakpoint_listeners):
                        fn(int(row["step"]), point.describe(row))
                    return

    # ---- failures ----------------------------------------------------------

    def _guard(self):
        """Wraps the train function so a failure inside a step is noticed:
        Keras calls no callback when the step raises."""
        function = self.model.train_function
        if function is None:
            return
        recorder = self

        def guarded(iterator):
            try:
                return function(iterator)
            except _END_OF_DATA:
                raise
            except BaseException as error:
                if recorder._active:
                    recorder._on_failure(error)
                raise

        guarded._lab_recorder = self
        guarded._lab_inner = function
        self._guarded = guarded
        self.model.train_function = guarded

    def _guard_callbacks(self, callbacks):
        """Notices an exception raised by any callback during fit() (a plot that
        fails, an interrupt between batches), which reaches no callback hook."""
        if callbacks is None or getattr(callbacks, "_lab_guarded", None) is self:
            return
        recorder = self
        for name in _CALLBACK_METHODS:
            original = getattr(callbacks, name, None)
            if original is None:
                continue

            def guarded(*args, _original=original, **kwargs):
                try:
                    return _original(*args, **kwargs)
                except BaseException as error:
                    if recorder._active:
                        recorder._on_failure(error)
                    elif recorder._probe is not None and recorder._probe.installed:
                        recorder._detach()  # failed before training began
                    raise

            object.__setattr__(callbacks, name, guarded)
        object.__setattr__(callbacks, "_lab_guarded", self)

    def _on_failure(self, error):
        try:
            self.flush(failing=True)
        except Exception:  # noqa: BLE001 - the user's error is the one to show
            pass
        if isinstance(error, KeyboardInterrupt):
            self.run.add_event("interrupt", "KeyboardInterrupt")
            self._finish("interrupted")
        else:
            message = f"{type(error).__name__}: {error}".strip()
            self.run.add_event("error", message)
            self._finish("failed", message)

    def _finish(self, status, detail=""):
        if status != "stopped" or not self.status_detail:
            self._set_status(status, detail)
        else:
            self._set_status(status, self.status_detail)
        self._active = False
        model = self.model
        function = getattr(model.train_function, "_lab_inner", model.train_function)
        if function is not None and status in ("finished", "stopped"):
            self._cached = (_signature(model), function)
        self._detach()
        modes.training_ended(self.model)
        if self.path:
            self._save()

    def _detach(self):
        """Leaves no trace: restores patched methods and drops hooked functions."""
        if self._probe is not None:
            self._probe.uninstall()
        model = self.model
        if model is not None and getattr(model.train_function, "_lab_recorder", None) is self:
            model.train_function = None
        elif self._cached is not None and model is not None and model.train_function is self._cached[1]:
            model.train_function = None
        elif model is not None and self._probe is not None and self._probe.buffer is not None:
            # A function traced with our hooks (e.g. after a mode switch).
            model.train_function = None

    detach = _detach

    # ---- status, metadata, saving -----------------------------------------

    def add_breakpoint_listener(self, fn):
        """Calls `fn(step, detail)` when a breakpoint hits (the background runner pauses on it)."""
        self._breakpoint_listeners.append(fn)

    def _fill_metadata(self):
        meta = self.run.metadata
        model = self.model
        if "model" in meta:
            return  # filled by an earlier fit(): the first fit describes the run
        meta.setdefault("model", model.name)
        meta.setdefault("model_class", type(model).__name__)
        try:
            meta.setdefault("parameters", int(model.count_params()))
        except ValueError:
            pass
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None:
            meta.setdefault("optimizer", type(optimizer).__name__)
        meta.setdefault("started", time.strftime("%Y-%m-%dT%H:%M:%S%z"))
        meta.setdefault("mode", modes.current_mode(model))
        if optimizer is not None:
            try:
                meta.setdefault("optimizer_config", optimizer.get_config())
            except (NotImplementedError, TypeError, ValueError):
                pass
        # Not model.summary(): in a Jupyter kernel it also emits a display output.
        meta.setdefault("summary", "\n".join(
            f"{layer.name} ({type(layer).__name__}): {layer.count_params() if layer.built else '?'} parameters"
            for layer in model.layers))
        meta.setdefault("devices", [d.name for d in tf.config.list_logical_devices()])
        meta.setdefault("numpy", np.__version__)
        meta.setdefault("steps_per_execution", int(model.steps_per_execution))
        meta.setdefault("strategy", type(model.distribute_strategy).__name__)
        meta.setdefault("tensorflow", tf.__version__)
        meta.setdefault("keras", keras.__version__)

    def _maybe_save(self, now):
        if self.path and now - self._last_save >= self.save_every:
            self._save()

    def _save(self):
        self._last_save = time.monotonic()
        try:
            self.run.save(self.path)
        except Exception as error:  # noqa: BLE001 - saving must not stop training
            warnings.warn(f"Could not save the run to {self.path}: {error}", RuntimeWarning, stacklevel=2)


_CALLBACK_METHODS = (
    "on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end", "on_train_batch_begin", "on_train_batch_end",
    "on_test_begin", "on_test_end", "on_test_batch_begin", "on_test_batch_end",
)


def _calling_callback_list():
    """The keras CallbackList whose set_model is calling ours, if any."""
    frame = sys._getframe(2)
    for _ in range(6):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, keras.callbacks.CallbackList):
            return owner
        frame = frame.f_back
    return None


_BEGIN_STEP_ONLY = {}


def _reports_begin_step_only(model):
    """Whether this Keras passes the execution's first step to on_train_batch_end."""
    trainer = type(model).fit
    if trainer not in _BEGIN_STEP_ONLY:
        try:
            source = inspect.getsource(trainer)
        except (OSError, TypeError):
            source = "end_step"
        _BEGIN_STEP_ONLY[trainer] = "end_step" not in source
    return _BEGIN_STEP_ONLY[trainer]


def _signature(model):
    return (bool(model.run_eagerly), model.jit_compile, int(model.steps_per_execution),
            id(model.distribute_strategy))
