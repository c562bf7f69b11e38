"""Stepper: run a model's own train_step one batch at a time, and step back.

The stepper owns the lab's only training loop. It hands the model's
`train_step` (built-in or overridden, never re-implemented) batches shaped as
`fit()` hands them — `(x, y)`, `(x,)` or `(x, y, sample_weight)`, not
`train_on_batch`'s `(x, y, None)` — and records what each step touched in a
`StepTrace`.

Snapshots are copy-on-step: the stepper keeps one host copy of the model's
state (weights, non-trainable variables, optimizer slots and iterations,
metric totals, random-seed state) and, per kept step, the previous arrays of
only the variables that step changed. An optimizer step changes every
trainable weight and its slots, so with Adam the cost is about
`(history + 1) * 4 * parameters * 4 bytes` (16 steps of a 1M-parameter model:
about 270 MB) plus the kept batches. Lower `history` to spend less.
"""

import collections
import contextlib
import dataclasses
import numbers
import time
import traceback as traceback_module
import warnings

import keras
import numpy as np
import pandas as pd
import tensorflow as tf

from lab import schema
from lab.arguments import check_class_weight, check_flag, check_number, check_stepper_options
from lab.backend.tensorflow import compat
from lab.backend.tensorflow.compat import reduce_per_replica, unscale_loss_for_distribution
from lab.backend.tensorflow.data_check import check_arrays_for
from lab.backend.tensorflow.devices import split_over_replicas, splits_batches
from lab.backend.tensorflow.feed import Feed, to_numpy
from lab.backend.tensorflow.norms import shown_names
from lab.backend.tensorflow.probes import is_keras_loss_tracker
from lab.metric_names import is_mean, leaf_metrics
from lab.backend.tensorflow.state import (raw_variable, read_variables, replica_copies, replicated, same_array,
                                          training_variables, uninterrupted)
from lab.backend.tensorflow.step_capture import StepCapture, hint
from lab.hooks import CompiledState, hooks_for
from lab.signals import record_interrupt
from lab.step_logs import not_logs, not_logs_message
from lab.step_trace import StepTrace
from lab.variables import find_optimizers, variable_keys


REGROUPED_MESSAGE = (
    "TensorFlow's graph optimizer (Grappler) may compute the update of {variables} differently "
    "in this graph-mode Stepper than in fit(): the Stepper returns their gradients, and Grappler "
    "regroups the optimizer's arithmetic with the gradient's own (plain SGD's gradient * "
    "learning_rate with a clipped or BatchNormalization gradient) only while the update is the "
    "gradient's one reader. Their weights can then differ from fit()'s by float rounding. "
    "Stepper(mode='eager') steps bit for bit as fit(run_eagerly=True).")

UNREPEATABLE_MESSAGE = (
    "Step {step}, taken again after a rewind from the same weights on the same batch, "
    "ended with other weights ({variables}) than the first time. Unless something that "
    "rewind does not cover changed meanwhile (a Python attribute the step reads), the step "
    "draws random numbers that rewind cannot restore: TensorFlow's own random ops (tf.random.normal, "
    "tf.nn.dropout, tf.image.random_*), whose streams live outside the model. Draw with "
    "keras.random and a keras.random.SeedGenerator held by the model (its state is "
    "rewound) for steps that replay exactly.")

REPLICAS_MESSAGE = (
    "The model is under {strategy} with {replicas} replicas, and the Stepper runs {what} as "
    "one device does: on the whole batch, where fit() splits each batch over the replicas and "
    "sums their gradients. Every replica's copy takes the same update, but it is not fit()'s: "
    "what a layer computes over the batch (BatchNormalization's statistics) differs, and the "
    "sums run in another order, so weights part from a fit()'s by float rounding, and with "
    "BatchNormalization by more. Step a copy of the model built outside the strategy's scope "
    "to compare with a one-device fit().")

STEPPER_MODES = ("eager", "graph")

UNKNOWN_LENGTH_MESSAGE = (
    "The dataset's length is unknown to TensorFlow (from_generator, filter, ...): fit() then ends each "
    "epoch with one more call of its train function, which finds no batch but has already run what the "
    "step does without waiting on one: it adds 1 to the optimizer's iterations and advances the model's "
    "seed generators. The Stepper takes only the steps it is given, so from the second epoch on its "
    "updates (Adam's bias correction, a learning-rate schedule, dropout masks) part from fit()'s. Give "
    "the dataset its length, dataset.apply(tf.data.experimental.assert_cardinality(batches)), or pass "
    "steps_per_epoch to both fit() and the Stepper, and they train alike.")


@dataclasses.dataclass
class _Snapshot:
    trace: StepTrace
    fed: object  # the Feed item the step consumed
    before: dict  # variable id -> array before the step, for variables it changed
    compiled: object = None  # the model's CompiledState when the step ran
    conditions: dict = None  # run_until's breakpoint state (a running loss average) before its check


class Stepper:
    """Runs a model's own `train_step` one batch at a time; rewinds steps.

    Args:
        model: keras.Model, compiled (its `train_step` may be overridden).
        data: what `fit()` takes as `x`: an array, a tuple `(x, y)` or
            `(x, y, sample_weight)` of arrays, a `tf.data.Dataset`, a
            `keras.utils.PyDataset` or a generator of such tuples. Of a
            dataset of unknown length (from_generator, filter), fit()
            counts one more optimizer step per epoch than it trains; the
            stepper says so (`UNKNOWN_LENGTH_MESSAGE`, with the fix).
        batch_size: int or None, for arrays (default 32, as in `fit()`).
        shuffle: bool, reshuffle arrays, and a PyDataset's batch order, every
            epoch; False keeps data order.
        seed: int or None, makes the shuffled order reproducible. A PyDataset
            is shuffled as fit(shuffle=True) shuffles it, with Python's
            `random`: with a seed, in the order fit() trains on after
            `keras.utils.set_random_seed(seed)`; without one, in an order no
            other run repeats, and the stepper says so (a UserWarning).
        mode: str, "eager" (every value inspectable) or "graph" (the step is
            a `tf.function`, compiled with XLA where the model's `jit_compile`
            is on, as `fit()` compiles it: Keras' default on a machine with a
            GPU; values come out of the compiled step). In graph
            mode, variables that only the first trace creates (a model that
            cannot be built symbolically) keep their values when that first
            step is rewound; step it once in eager mode to avoid that.
        history: int, how many steps `rewind` can undo (see the module's memory note).

    Arguments, and arrays fit() would refuse or fail on (no targets for
    Keras' own train_step, NumPy strings, labels outside a sparse loss's
    classes), are refused at construction with the fix; a failed step on a
    dataset names the data's problem in `trace.hint`. A train_step that
    returns no dict of logs fails its step, as fit() fails.
        steps_per_epoch: int or None, batches per epoch (needed for a
            generator to run more than one epoch).
        run: `lab.Run` or None; each step appends its row there.
        start_step: int or None, the index of the first step; None goes on
            from `run.next_step` (0 without a run). With a run, the run's
            `next_step` is set to it.
        start_batch: tuple (epoch, batch) of the first batch (to continue a
            fit() mid-epoch: metrics are reset only at a batch 0).
        class_weight: dict or None, as `fit(class_weight=...)` takes it (class
            index -> weight): each sample of `(x, y)` data, a dataset's or a
            PyDataset's `(x, y)` batches, weighs its class's weight in the
            loss and the weighted metrics, as in `fit()`.

    A model built under a MirroredStrategy with several replicas steps as a
    mirrored fit() does: each batch split over the replicas as tf.distribute
    splits fit()'s, `train_step` run on each share, the gradients summed.
    Under other strategies (TPUs, several workers), with `from_step`, and
    with an optimizer whose update runs in a nested graph (gradient
    accumulation, a LossScaleOptimizer), it steps as one device does, on the
    whole batch, and says so once (`REPLICAS_MESSAGE`).

    Example:

    ```python
    stepper = lab.Stepper(model, (x, y), batch_size=32, seed=0)
    trace = stepper.step()        # one batch through model.train_step
    trace.loss, trace.gradients
    stepper.rewind()              # as if that step never ran
    ```
    """

    def __init__(self, model, data, batch_size=None, shuffle=True, seed=None, *, mode="eager",
                 history=16, steps_per_epoch=None, run=None, start_step=None, start_batch=(0, 0),
                 class_weight=None, _step_fn=None, _optimizers=(), _metrics=()):
        if not isinstance(model, keras.Model):
            raise TypeError(f"Stepper needs a keras.Model, got {type(model).__name__}.")
        if _step_fn is None and not getattr(model, "compiled", False):
            raise ValueError(
                "The model is not compiled. Call model.compile(optimizer=..., loss=...) "
                "before stepping it, as fit() would require."
            )
        check_number("lab.Stepper", "history", history, numbers.Integral, lambda v: v >= 1,
                     "a whole number of steps to keep for rewind, 1 or more", "16")
        for argument, value in (("batch_size", batch_size), ("steps_per_epoch", steps_per_epoch)):
            if value is not None:
                check_number("lab.Stepper", argument, value, numbers.Integral, lambda v: v >= 1,
                             "a whole number, 1 or more, or None", "32")
        check_flag("lab.Stepper", "shuffle", shuffle, "shuffle=False: the batches in the data's order")
        check_class_weight("lab.Stepper", class_weight)
        _check_mode(mode)
        check_stepper_options(seed, run, start_step, start_batch)
        _check_list_data(model, data)
        if _step_fn is None:
            check_arrays_for("lab.Stepper", model, data, batch_size)
        self.model = model
        self.feed = Feed(data, batch_size=batch_size, shuffle=shuffle, seed=seed,
                         steps_per_epoch=steps_per_epoch, position=start_batch, class_weight=class_weight)
        self.history = int(history)
        self.run = run
        self.mode = mode
        if start_step is None:
            start_step = run.next_step if run is not None else 0
        self._index = int(start_step)
        if run is not None:
            run.next_step = self._index  # the run's steps go on from this stepper's
        self._snapshots = collections.deque(maxlen=self.history)
        self._state = {}  # variable id -> (variable, array): the model's state as last seen
        self._created = {}  # variable id -> (variable, initial array), made during steps
        self._graph_step = None
        self._graph_compiled = None  # the CompiledState the graph step was traced for
        self._told_regrouped = False
        self._capture_slots = {}  # variables a graph step's nested values pass through
        self._condition_state = {}  # name -> (tf.Variable, initial value)
        self._step_function = _step_fn  # from_step: the user's step instead of train_step
        self._extra_optimizers = list(_optimizers)
        self._extra_metrics = list(_metrics)  # from_step: metrics the user's step updates
        self._replayed = {}  # step index -> the weights a rewound step ended with
        self._logged_metrics = {}  # logged name -> the metric whose result the step returned
        self._told_unrepeatable = False
        self.last_trace = None
        self._tell_replicas()
        if self.feed.order_note is not None:
            warnings.warn(self.feed.order_note, UserWarning, stacklevel=2)
            if self.run is not None:
                self.run.add_event("warning", self.feed.order_note, step=self._index)
        if _step_fn is None and _ends_epochs_with_an_empty_call(model, data, steps_per_epoch):
            warnings.warn(UNKNOWN_LENGTH_MESSAGE, UserWarning, stacklevel=2)
            if self.run is not None:
                self.run.add_event("warning", UNKNOWN_LENGTH_MESSAGE, step=self._index)

    # ---- public ------------------------------------------------------------

    @classmethod
    def from_step(cls, step_fn, model, data, optimizers=(), metrics=(), **kwargs):
        """A stepper for a step function the user wrote instead of a `train_step`.

        `rewind` restores the model's variables, the optimizers' and the
        metrics' state passed here; any other state the step changes (a
        metric or variable held outside the model and not passed as
        `metrics`, a Python counter) keeps its value.

        Args:
            step_fn: callable, `step_fn(x, y)` runs one training step and
                returns a dict of logs or the loss.
            model: keras.Model whose variables the step changes (need not be compiled).
            data: as for `Stepper`.
            optimizers: sequence of keras optimizers the step applies; their
                state is snapshotted and their gradients recorded.
            metrics: sequence of `keras.metrics.Metric` the step updates that
                are not the model's (a loop's `train_acc_metric`): rewound
                with the model, and reset at each epoch start as the model's
                own metrics are (your loop's `reset_state()` at an epoch end).
            **kwargs: as for `Stepper`.

        Example:

        ```python
        train_acc_metric = keras.metrics.SparseCategoricalAccuracy()

        def step(x, y):
            with tf.GradientTape() as tape:
                logits = model(x, training=True)
                loss = loss_fn(y, logits)
            opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
            train_acc_metric.update_state(y, logits)
            return {"loss": loss}

        stepper = lab.Stepper.from_step(step, model, (x, y), optimizers=[opt], metrics=[train_acc_metric])
        ```
        """
        if not callable(step_fn):
            raise TypeError(f"step_fn must be callable as step_fn(x, y), got {type(step_fn).__name__}.")
        metrics = _check_metrics(metrics)
        optimizers = [optimizers] if isinstance(optimizers, keras.optimizers.Optimizer) else optimizers
        if isinstance(optimizers, (str, dict)) or not isinstance(optimizers, (list, tuple)) or not all(
                isinstance(o, keras.optimizers.Optimizer) for o in optimizers):
            raise TypeError(
                f"Stepper.from_step(optimizers=...) must be a list of the keras optimizers the step applies; got "
                f"{optimizers!r:.80}: pass the optimizer objects, `Stepper.from_step(step, model, data, "
                "optimizers=[opt])` (a name such as 'adam' is for compile()).")
        # A `@tf.function` step runs as the Python it was written as: eagerly
        # in "eager" mode (every value inspectable), inside the stepper's own
        # tf.function in "graph" mode.
        step_fn = getattr(step_fn, "python_function", step_fn)
        return cls(model, data, _step_fn=step_fn, _optimizers=optimizers, _metrics=metrics, **kwargs)

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
            n: int, steps to run.

        Returns:
            StepTrace, the last step's (its `error` is set when it failed; the
            model is then as before that step, and the batch is next again).

        Raises:
            KeyboardInterrupt: (or another BaseException that is not an
                Exception) when the step is interrupted, after the step is
                undone as a failed one is: the batch comes next again, and the
                run gets an `interrupt` event.
        """
        check_number("Stepper.step", "n", n, numbers.Integral, lambda v: v >= 1, "a whole number of steps, 1 or more", "1")
        trace = None
        for _ in range(int(n)):
            trace = self._step_once()
            if trace.error is not None:
                break
        return trace

    def run_until(self, condition, max_steps=1000):
        """Steps until `condition` holds, a step fails, or `max_steps` ran.

        Args:
            condition: callable `condition(trace) -> bool`, a
                `lab.Breakpoint` (or a list of them: the first that holds) (checked against the step's row), or a
                device-side breakpoint (`lab.breakpoints.nonfinite()`,
                `loss_spike(...)`), whose hit is undone: the offending
                update is kept out and its batch comes next again.
            max_steps: int, the most steps to run.

        Returns:
            StepTrace, the last step's; `stepper.hit` says whether the condition held.
        """
        check_number("Stepper.run_until", "max_steps", max_steps, numbers.Integral, lambda v: v >= 1,
                     "a whole number of steps, 1 or more", "1000")
        conditions = list(condition) if isinstance(condition, (list, tuple)) else [condition]
        checks = [(c, trace_condition(c, self._breakpoint_variables)) for c in conditions]
        trace = None
        self.hit = False
        for _ in range(int(max_steps)):
            trace = self._step_once()
            if trace.error is not None:
                break
            # What the checks are about to change, so a rewind puts it back with the step.
            self._snapshots[-1].conditions = {name: v.numpy() for name, (v, _) in self._condition_state.items()}
            hit = next((c for c, check in checks if check(trace)), None)
            if hit is not None:
                self.hit = True
                if self.run is not None:
                    self.run.add_event("breakpoint", f"{getattr(hit, 'name', 'condition')} at step {trace.index}",
                                       step=trace.index)
                if getattr(hit, "on_device", False):
                    # A device-side breakpoint keeps its batch's update out: the
                    # step is undone and its batch comes next again.
                    self.rewind(1)
                    trace.skipped = True
                break
        return trace

    def _breakpoint_variables(self, name, value):
        # State a device-side breakpoint keeps across steps (a running loss
        # average) lives on the stepper, never on the model.
        if name not in self._condition_state:
            self._condition_state[name] = (tf.Variable(value, trainable=False, name=name), value)
        return self._condition_state[name][0]

    def rewind(self, n=1):
        """Restores the model and data position to before the last `n` steps.

        Weights, optimizer slots and iterations, metric state (the model's,
        and for `from_step` the `metrics` passed there), random-seed
        state (Keras' SeedGenerators, a `tf.random.Generator` the model
        holds), any other tf.Variable the model holds (a step counter,
        optimizers kept in a list) and, under a tf.distribute strategy, each
        replica's copy of each variable are restored, and so is what
        `run_until`'s breakpoints keep across steps (a `loss_spike`'s running
        average); the rewound batches come next again; their traces are dropped. TensorFlow's own random ops
        (`tf.random.normal`, ...) keep their streams outside the model: a
        replayed step that draws from them ends otherwise than the first
        time, and the stepper says so (a `warning` event and a RuntimeWarning).

        Args:
            n: int, steps to undo.

        Raises:
            ValueError: when fewer than `n` steps are kept.
        """
        check_number("Stepper.rewind", "n", n, numbers.Integral, lambda v: v >= 1,
                     "a whole number of steps, 1 or more", "1")
        n = int(n)
        if not self._snapshots:
            raise ValueError("There is no step to rewind: step first (the history is kept from the first step).")
        if n > len(self._snapshots):
            raise ValueError(
                f"Cannot rewind {n} steps: only the last {len(self._snapshots)} are kept "
                f"(history={self.history}). Create the Stepper with a larger history=... to go further back."
            )
        if self._refresh_state():
            self._snapshots.clear()
            raise ValueError(
                "The model changed outside the stepper since its last step (a fit(), "
                "set_weights, ...), so its history no longer applies and was dropped. "
                "Step again to start a new history."
            )
        compiled = CompiledState(self.model)
        stale = [s.trace.index for s in list(self._snapshots)[-n:] if s.compiled != compiled]
        missing = [key for s in list(self._snapshots)[-n:] for key in s.before if key not in self._state]
        if stale or missing:
            # Checked before anything is written: a rewind is whole or not at all.
            self._snapshots.clear()
            raise ValueError(
                f"Cannot rewind: the model was compiled again (or its optimizer replaced) after step "
                f"{(stale or [self._index])[0]}, so the optimizer and metric state those steps changed "
                "is gone. Nothing was restored; the history was dropped. Step again to start a new history."
            )
        with uninterrupted():  # a Ctrl-C meanwhile left a model half rewound
            undone = [self._snapshots.pop() for _ in range(n)]
            # The breakpoints' state as before the oldest undone step that was
            # checked (steps between took no check): a loss_spike's running
            # average must not count the rewound losses twice.
            checked = next((s.conditions for s in reversed(undone) if s.conditions is not None), None)
            if checked is not None:
                for name, (variable, initial) in self._condition_state.items():
                    variable.assign(checked.get(name, initial))
            for snapshot in undone:  # newest first: a step rewound twice keeps its first ending
                self._replayed[snapshot.trace.index] = snapshot.trace.weights_after
            restore = {}
            for snapshot in undone:  # newest first, so the oldest value wins
                restore.update(snapshot.before)
            for key, array in restore.items():
                variable = self._state[key][0]
                if not replicated(variable):  # else each replica's copy is written, by its own key
                    variable.assign(array)
                self._state[key] = (variable, array)
            self.feed.push_back([s.fed for s in reversed(undone)])
            self._index = undone[-1].trace.index
            if self.run is not None:
                self.run.next_step = self._index  # the rewound steps' numbers come again
                self.run.add_event("rewind", f"to before step {self._index}", step=self._index)
            self.last_trace = self._snapshots[-1].trace if self._snapshots else None
        return self.last_trace

    def sync(self):
        """Re-reads the model's state after something else changed it; drops the history."""
        self._snapshots.clear()
        self._replayed.clear()
        self._state = {}
        self._refresh_state()

    # ---- one step ----------------------------------------------------------

    def _step_once(self):
        try:
            fed = self.feed.next()
        except BaseException as error:  # a Ctrl-C in the user's generator (or tf.data's UnknownError for one)
            record_interrupt(self.run, error, f"the data, reading step {self._index}'s batch", step=self._index)
            raise
        try:
            changed_outside = self._refresh_state()
            if changed_outside:
                # The model moved (a fit(), set_weights): older snapshots no longer apply.
                self._snapshots.clear()
                self._replayed.clear()
            before_state = dict(self._state)
            x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(to_numpy(fed.data))
            trace = StepTrace(index=self._index, epoch=fed.epoch, batch=fed.batch, x=x, y=y,
                              sample_weight=sample_weight)
            trace.weights_before = self._trainable_arrays(before_state)
            capture = StepCapture(self.model, self._optimizers(), slots=self._capture_slots)
        except BaseException:
            self.feed.push_back([fed])  # nothing ran yet: the batch is still the next one
            raise
        start = time.perf_counter()
        try:
            if fed.batch == 0:
                self.model.reset_metrics()  # fit() does this at every epoch start
                for metric in self._extra_metrics:
                    metric.reset_state()
            outputs = self._run(fed.data, capture)
            trace.seconds = time.perf_counter() - start
            # Reading what the step returned may fail too (a value that cannot
            # leave its graph): the step is then undone like one that raised.
            after = self._read_all()
            self._fill_outputs(trace, outputs, capture, before_state, after)
            # The bookkeeping may fail or be interrupted too (a warning made an
            # error, Ctrl-C): until the run has the step's row, it is undone.
            self._record(trace, fed, capture, before_state, after)
        except Exception as error:  # noqa: BLE001 - the trace carries it
            if self.last_trace is trace:  # the run has its row: the step stands (see `_record`)
                raise
            return self._failed(trace, error, fed, before_state, capture, start)
        except BaseException as error:
            # Ctrl-C mid-step: undone as a failed step is, then it stops the caller too.
            if self.last_trace is not trace:
                self._failed(trace, error, fed, before_state, capture, start)
            elif self.run is not None:
                self.run.add_event("interrupt", f"{type(error).__name__} after step {trace.index}, "
                                   "once the run had its row: the step stands", step=trace.index)
            raise
        if self.run is not None:
            replicas = (self.model.distribute_strategy.num_replicas_in_sync
                        if trace.running and self._steps_on_replicas() else 1)
            self.run.note_running_values(trace.running, trace.index, replicas=replicas)
        return trace

    def _record(self, trace, fed, capture, before_state, after):
        """Keeps a step that ran: its snapshot, the stepper's state and the
        run's row. The stepper's own state changes only once the row is in
        the run (the step is then taken), so a step whose bookkeeping raises
        before is undone whole by `_failed`; one whose run's listeners (a
        view drawing the row) raise after the row is in stands, and the
        error goes on to the caller."""
        created = {**self._created, **{id(v): (v, initial) for v, initial in capture.created}}
        changed = {}
        for key, (variable, array) in after.items():
            old = before_state.get(key) or created.get(key)
            if old is None:
                continue
            if same_array(old[1], array):
                after[key] = (variable, old[1])  # share the array: copy-on-step
            else:
                changed[key] = old[1]
        # Variables built inside this step: their initial values are the "before".
        trace.weights_before = self._trainable_arrays({**created, **before_state})
        trace.weights_after = self._trainable_arrays(after)
        self._note_regrouped(capture, trace)
        self._check_replay(trace)
        snapshot = _Snapshot(trace, fed, changed, CompiledState(self.model))
        rows = None if self.run is None else len(self.run)
        try:
            if self.run is not None:
                self._append_row(trace)
        finally:
            if rows is None or len(self.run) > rows:
                # One statement, then the append (no interrupt lands between
                # them): `last_trace is trace` tells `_step_once` the step stands.
                self._created, self._state, self._index, self.last_trace = created, after, self._index + 1, trace
                self._snapshots.append(snapshot)

    def _note_regrouped(self, capture, trace):
        """Says once which variables' updates Grappler may compute otherwise
        than fit() does, found when the graph step was traced."""
        if not capture.regrouped or self._told_regrouped:
            return
        self._told_regrouped = True
        message = REGROUPED_MESSAGE.format(variables=shown_names(list(dict.fromkeys(capture.regrouped))))
        if self.run is not None:
            self.run.add_event("warning", message, step=trace.index)
        warnings.warn(message, RuntimeWarning, stacklevel=4)

    def _check_replay(self, trace):
        """A step taken again after a rewind, from the same state on the same
        batch, ends as it did the first time unless it draws from random
        numbers that rewind cannot restore: then the stepper says so, once."""
        first = self._replayed.pop(trace.index, None)
        if first is None or self._told_unrepeatable:
            return
        differ = [key for key, array in trace.weights_after.items()
                  if key in first and not same_array(first[key], array)]
        if not differ:
            return
        self._told_unrepeatable = True
        message = UNREPEATABLE_MESSAGE.format(step=trace.index, variables=shown_names(differ))
        if self.run is not None:
            self.run.add_event("warning", message, step=trace.index)
        warnings.warn(message, RuntimeWarning, stacklevel=4)

    def _failed(self, trace, error, fed, before_state, capture, start):
        if not trace.seconds == trace.seconds:  # NaN: failed before the step returned
            trace.seconds = time.perf_counter() - start
        self._restore(before_state, capture)
        self.feed.push_back([fed])
        trace.error = error
        trace.traceback = "".join(traceback_module.format_exception(error))
        trace.no_gradient = capture.no_gradient
        interrupted = not isinstance(error, Exception)
        trace.hint = "" if interrupted else hint(error, trace, capture)
        if self.run is not None and interrupted:
            self.run.add_event("interrupt", f"{type(error).__name__} in step {self._index}; "
                               "the step was undone and its batch comes next again", step=self._index)
        elif self.run is not None:
            self.run.add_event("error", f"{type(error).__name__}: {error}", step=self._index)
        self.last_trace = trace
        return trace

    def _run(self, data, capture):
        with _built_here(self, capture):
            self._build_optimizer_in_scope()
        replicated = self._steps_on_replicas()
        if self.mode == "eager":
            if replicated:
                with _built_here(self, capture):
                    self._build_for_graph(data)
                return self._traced(self._distributed(data)[0], capture)
            return self._traced(data, capture)
        if self.mode != "graph":  # set after construction
            raise ValueError(f"Unknown stepper mode {self.mode!r}; use one of {list(STEPPER_MODES)}.")
        compiled = CompiledState(self.model)
        whole, signature = data, self.feed.signature(data)
        if replicated:
            data, signature = self._distributed(data, signature)
        if self._graph_step is None or self._graph_compiled != compiled:
            # First, or the model was compiled again (fine-tuning: a new
            # optimizer, layers unfrozen): trace its step anew, as fit() does.
            self._graph_capture = capture
            # XLA where fit() compiles its step with it: another program
            # rounds otherwise, and the weights part from fit()'s. (Not on
            # replicas: Keras 3's XLA fails there, and "auto" never picks it;
            # not for from_step, whose loop compiles its step as it says.)
            xla = (compiled.mode == "xla" and not replicated and self._step_function is None
                   and getattr(self.model, "compiled", False))
            self._graph_step = tf.function(lambda d: self._traced(d, self._graph_capture), reduce_retracing=True,
                                           jit_compile=xla)
            with _built_here(self, capture):
                self._build_for_graph(whole)
                # Traced before it runs, so that what the trace builds (the
                # optimizer's slots, on the variables the step applies, as in
                # fit()) is counted at its first values.
                self._graph_step.get_concrete_function(signature)
            self._graph_compiled = compiled
        self._graph_capture = capture
        outputs = self._graph_step(data)
        capture.no_gradient = capture.no_gradient or getattr(self, "_graph_no_gradient", [])
        returned = getattr(self, "_graph_not_logs", None)
        if returned is not None:
            raise TypeError(not_logs_message("train_step", returned) + " The Stepper fails as fit() would.")
        return outputs

    def _steps_on_replicas(self):
        """Whether each step runs on the strategy's replicas, each on its
        share of the batch, as fit() runs it: under a MirroredStrategy with
        several replicas, for the model's own train_step."""
        if not splits_batches(self.model.distribute_strategy) or self._step_function is not None:
            return False  # TPUs, several workers: one device (REPLICAS_MESSAGE)
        # Values made in a nested graph (LossScaleOptimizer's cond, gradient
        # accumulation) cannot leave a replica: those step as one device.
        return not any(getattr(o, "inner_optimizer", None) is not None or getattr(o, "gradient_accumulation_steps", None)
                       for o in self._optimizers().values())

    def _distributed(self, data, signature=None):
        """`data`, a whole batch, split over the replicas as fit() splits it
        (tf.distribute's rebatch of a dataset of fit()'s element spec), and
        that split's spec, for tracing."""
        return split_over_replicas(self.model.distribute_strategy, data,
                                   signature if signature is not None else self.feed.signature(data))

    def _tell_replicas(self):
        """Says, once per Stepper, that a multi-replica model steps as one
        device, where it does not step on the replicas as fit() does."""
        strategy = self.model.distribute_strategy
        if strategy.num_replicas_in_sync == 1 or self._steps_on_replicas():
            return
        if self._step_function is not None:
            what = "the step function"
        elif splits_batches(strategy):
            what = "train_step (its optimizer updates in a nested graph, whose values cannot leave a replica)"
        else:
            what = "train_step"
        message = REPLICAS_MESSAGE.format(strategy=type(strategy).__name__,
                                          replicas=strategy.num_replicas_in_sync, what=what)
        warnings.warn(message, RuntimeWarning, stacklevel=3)
        if self.run is not None:
            self.run.add_event("warning", message, step=self._index)

    def _build_optimizer_in_scope(self):
        """Under a distribution strategy, builds the compiled optimizer in its
        scope before the first step, as fit() does: its slots (Adam's
        moments) cannot be made inside a step."""
        strategy = self.model.distribute_strategy
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is None or optimizer.built or strategy.num_replicas_in_sync == 1 or not self.model.built:
            return
        with strategy.scope():
            optimizer.build(self.model.trainable_variables)

    def _build_for_graph(self, data):
        """Creates the model's and optimizer's variables before tracing where fit()
        does (under a strategy). Elsewhere fit() leaves them to its trace: the
        optimizer is then built on the variables the step applies, not on
        every trainable one (a distiller's teacher that its step leaves alone)."""
        build = getattr(self.model, "_maybe_symbolic_build", None)
        if build is None or self._step_function is not None:
            return
        try:
            build(data_batch=data)
        except Exception:  # noqa: BLE001 - a custom model may not build symbolically
            pass  # its variables are then made in the first trace (see `mode` in the docstring)

    def _traced(self, data, capture):
        capture.begin_trace()
        if isinstance(data, tf.distribute.DistributedValues) or any(
                isinstance(leaf, tf.distribute.DistributedValues) for leaf in tf.nest.flatten(data)):
            with capture:
                outputs = self.model.distribute_strategy.run(self._on_replica, args=(data, capture))
            return self._combined(outputs)
        with capture:
            if self._step_function is not None:
                x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
                logs = self._step_function(x, y)
            else:
                logs = _own_train_step(self.model)(data)
        return self._outputs(logs, capture)

    def _on_replica(self, data, capture):
        """One replica's step on its share of the batch, in `strategy.run`."""
        seen = capture.current()
        logs = _own_train_step(self.model)(data)
        if seen.y_pred is None:
            seen.y_pred = seen.call_output
        outputs = self._outputs(logs, seen)
        if "loss" in outputs:
            # Unscaled here, in the replica, as Keras' step unscales it for its tracker.
            loss = tf.cast(unscale_loss_for_distribution(outputs["loss"]), tf.float32)
            outputs["loss"] = loss if loss.shape.rank == 0 else tf.reduce_mean(loss)
            leaves = [t for t in tf.nest.flatten(data) if t is not None]
            outputs["samples"] = tf.cast(tf.shape(leaves[0])[0], tf.float32)
        return outputs

    def _combined(self, outputs):
        """The replicas' outputs as fit()'s: the logs reduced as Keras reduces
        them, the predictions of each share in batch order, the loss of the
        batch's samples (each replica's weighted by its share, as Keras' loss
        tracker weighs it) and the rest (the summed gradients, the learning
        rate) from the first replica, where every replica has the same."""
        strategy = self.model.distribute_strategy
        combined = {"logs": reduce_per_replica(outputs.pop("logs"), strategy, reduction="auto")}
        if "y_pred" in outputs:
            combined["y_pred"] = reduce_per_replica(outputs.pop("y_pred"), strategy, reduction="concat")
        if "loss" in outputs:
            losses = strategy.experimental_local_results(outputs.pop("loss"))
            shares = strategy.experimental_local_results(outputs.pop("samples"))
            combined["loss"] = (tf.add_n([tf.where(n > 0, loss * n, 0.0) for loss, n in zip(losses, shares)])
                                / tf.add_n(list(shares)))
        first = lambda value: strategy.experimental_local_results(value)[0]  # noqa: E731
        combined.update(tf.nest.map_structure(first, outputs))
        return combined

    def _outputs(self, logs, capture):
        """What a step returns: its logs and what `capture` saw."""
        capture.resolve()
        returned = not_logs(logs)
        if self._step_function is None and not tf.executing_eagerly():
            self._graph_not_logs = returned  # raised after the traced step, out of autograph's wrapping
        elif returned is not None and self._step_function is None:
            raise TypeError(not_logs_message("train_step", returned) + " The Stepper fails as fit() would.")
        if returned is not None and logs is not None and not _is_number(logs):
            raise TypeError(f"The step function returned {returned}: return its loss (a scalar tensor or number) "
                            "or a dict of logs, e.g. `return {\"loss\": loss}`.")
        if not isinstance(logs, dict):
            logs = {} if logs is None else {"loss": logs}
        if not tf.executing_eagerly():
            self._graph_no_gradient = list(capture.no_gradient)
        outputs = {"logs": {k: v for k, v in logs.items() if v is not None and not (isinstance(v, dict) and not v)}}
        # Python values, kept at trace time: the metric behind each logged name.
        found = {name: capture.metric_of(value) for name, value in _log_entries(outputs["logs"])}
        self._logged_metrics = {name: metric for name, metric in found.items() if metric is not None}
        for name in ("y_pred", "loss"):
            value = getattr(capture, name)
            if value is not None:
                outputs[name] = value
        outputs["gradients"] = dict(capture.gradients)
        outputs["applies"] = [grads for _, grads in capture.applies]
        if capture.applies:
            self._apply_names = [name for name, _ in capture.applies]  # Python values: kept at trace time
        outputs["learning_rate"] = {k: tf.convert_to_tensor(v) for k, v in capture.learning_rates.items()}
        outputs["ran"] = capture.ran
        return outputs

    # ---- state ---------------------------------------------------------------

    def _variables(self):
        return training_variables(self.model, self._optimizers().values(),
                                   [v for v, _ in self._created.values()]
                                   + [v for metric in self._extra_metrics for v in metric.variables])

    def _optimizers(self):
        found = dict(find_optimizers(self.model))
        for i, optimizer in enumerate(self._extra_optimizers):
            if all(optimizer is not o for o in found.values()):
                found[f"optimizer_{i}"] = optimizer
        for name, optimizer in list(found.items()):
            inner = getattr(optimizer, "inner_optimizer", None)
            if inner is not None:
                found[f"{name}.inner_optimizer"] = inner
            else:  # a MultiOptimizer's
                found.update((key, part) for key, part in compat.updating_optimizers(name, optimizer)
                             if part is not optimizer)
        return found

    def _read_all(self):
        return read_variables(self._variables())

    def _refresh_state(self):
        """Reads the model's state; True when it differs from the state last seen."""
        current = self._read_all()
        moved = False
        for key, (variable, array) in current.items():
            known = self._state.get(key)
            if known is not None and same_array(known[1], array):
                current[key] = known
            elif known is not None:
                moved = True
        self._state = current
        return moved

    def _restore(self, state, capture):
        for key, (variable, array) in self._read_all().items():
            if key in state and not replicated(variable) and not same_array(state[key][1], array):
                variable.assign(state[key][1])
        for variable, initial in capture.created:
            variable.assign(initial)
        self._absorb_created(capture)

    def _absorb_created(self, capture):
        for variable, initial in capture.created:
            self._created[id(variable)] = (variable, initial)

    def _trainable_arrays(self, state):
        arrays = {}
        for variable, key in zip(self.model.trainable_variables,
                                 variable_keys(self.model.trainable_variables).values()):
            entry = state.get(id(raw_variable(variable)))
            if entry is not None:
                arrays[key] = entry[1]
        return arrays

    # ---- outputs -------------------------------------------------------------

    def _fill_outputs(self, trace, outputs, capture, before, after):
        trace.logs = {name: _scalar_or_array(value) for name, value in _log_entries(outputs["logs"])}
        trace.y_pred = to_numpy(outputs.get("y_pred"))
        # A graph step returns every value its update could make; those of an
        # update that did not run (held by gradient accumulation, skipped by a
        # LossScaleOptimizer) are dropped, as an eager step never makes them.
        ran = outputs.get("ran") or {}
        trace.gradients = _that_ran(outputs["gradients"], ran.get("gradients"))
        trace.no_gradient = list(capture.no_gradient)
        row = {}
        if "loss" in outputs:
            # An unreduced loss (reduction=None) averaged by TensorFlow's kernel,
            # as the Recorder's row and Keras' tracker average it (NumPy's
            # pairwise sum ended an ulp away).
            loss = np.asarray(outputs["loss"])
            row["loss"] = float(loss if loss.ndim == 0 else tf.reduce_mean(tf.cast(loss, tf.float32)))
        # The metric whose result the step returned under a name, else the
        # one of that name: the Recorder's rule (a tracker may be logged
        # under another name than its own).
        metrics = {**leaf_metrics(self.model), **self._logged_metrics}
        trace.running = []
        for name, value in trace.logs.items():
            metric = metrics.get(name)
            if metric is not None and not is_mean(metric):  # its batch value cannot be read off its state
                trace.running += [column for column, _ in schema.number_columns(name, value)]
            if metric is not None and is_mean(metric):
                total = [_metric_state(before, v) for v in (metric.total, metric.count)]
                new = [_metric_state(after, v) for v in (metric.total, metric.count)]
                reset = trace.batch == 0
                if all(t is not None for t in total + new):
                    dt = new[0] - (0.0 if reset else total[0])
                    dc = new[1] - (0.0 if reset else total[1])
                    if dc:  # else the step returned this name without updating the metric
                        value = dt / dc
            if name == "loss" and "loss" in row and not (metric is not None and is_mean(metric)
                                                         and not is_keras_loss_tracker(self.model, metric)):
                continue  # Keras' tracker, fed the loss above; a tracker of the model's own is its to define
            row.update(schema.number_columns(name, value))
        rates = _that_ran(outputs["learning_rate"], ran.get("learning_rates"))
        for name, rate in rates.items():
            row["learning_rate" if len(rates) == 1 else f"learning_rate/{name}"] = float(np.asarray(rate))
        # The probe's rule: a variable's norm covers every apply of the step
        # (in float64 here, so no finite gradient overflows).
        applies = outputs.get("applies", [])
        applies_ran = ran.get("applies") or [None] * len(applies)
        applies = [_that_ran(grads, flags) for grads, flags in zip(applies, applies_ran)]
        squares = {}
        for grads in applies or [trace.gradients]:
            for key, grad in grads.items():
                squares[key] = squares.get(key, 0.0) + float(np.sum(np.square(grad.astype(np.float64))))
        for key, square in squares.items():
            row[schema.variable_column(schema.GRAD_NORM_PREFIX, key)] = square ** 0.5
        if squares:
            row[schema.GRAD_NORM] = sum(squares.values()) ** 0.5
        names = [name for name, grads in zip(getattr(self, "_apply_names", []), applies) if grads]
        for name in set(names):
            if names.count(name) > 1:
                row[schema.per_optimizer_column(schema.APPLIES_PREFIX, name)] = float(names.count(name))
        trace.row = row

    def _append_row(self, trace):
        columns = {"step": [trace.index], "epoch": [trace.epoch], "batch": [trace.batch],
                   "seconds": [trace.seconds], "mode": [self.mode], "source": ["stepper"]}
        columns.update({k: [v] for k, v in trace.row.items()})
        self.run.append_batches(columns)


def _check_mode(mode):
    if mode not in STEPPER_MODES:
        also = (" The Stepper's 'graph' mode compiles the step with XLA where the model's jit_compile is on, as "
                "fit() does: lab.set_mode(model, 'xla'), then mode='graph'." if mode == "xla" else "")
        raise ValueError(f"lab.Stepper(mode=...) must be one of {list(STEPPER_MODES)}; got {mode!r} "
                         f"(e.g. mode='graph': the step as a tf.function).{also}")


def _check_list_data(model, data):
    """A list is what fit() takes as the inputs `x` of a model with several
    inputs, never as `(x, y)`: said at construction for a model with one."""
    if not isinstance(data, list) or len(data) < 2:
        return
    try:
        inputs = len(model.inputs)
    except (AttributeError, TypeError, ValueError):  # a subclassed model has no fixed inputs
        return
    if inputs == 1:
        raise ValueError(
            f"data is a list of {len(data)} arrays, which fit() reads as the inputs x of a model "
            f"with several inputs; {model.name!r} has one input. Pass the arrays as a tuple: "
            "`lab.Stepper(model, (x, y))`, as `model.fit(x, y)` takes them.")


def _check_metrics(metrics):
    """from_step's `metrics` as a list of Keras metrics, or a TypeError that names the fix."""
    if isinstance(metrics, keras.metrics.Metric):
        metrics = [metrics]
    if isinstance(metrics, (str, dict)) or not isinstance(metrics, (list, tuple)):
        raise TypeError(
            f"metrics must be a list of the keras.metrics.Metric objects the step updates, "
            f"got {type(metrics).__name__}: `Stepper.from_step(step, model, data, metrics=[train_acc_metric])`.")
    wrong = [m for m in metrics if not isinstance(m, keras.metrics.Metric)]
    if wrong:
        raise TypeError(
            f"metrics must hold keras.metrics.Metric objects (the ones the step updates), got "
            f"{', '.join(repr(m) if isinstance(m, str) else type(m).__name__ for m in wrong[:3])}: a name "
            "such as 'accuracy' is for compile(); pass the metric your step calls update_state on.")
    return list(metrics)


@contextlib.contextmanager
def _built_here(stepper, capture):
    """Counts the variables made in the block (the optimizer's slots, built
    before a graph step is traced) among those the step created, at their
    first values: the state read before the step did not hold them, and
    rewind puts them back to these (Adam's moments to zero)."""
    known = set(stepper._variables())
    yield
    for key, variable in stepper._variables().items():
        if key not in known:
            capture.created.append((variable, np.array(variable.numpy(), copy=True)))


def _own_train_step(model):
    """The model's train_step, without a Recorder's probe around it: a step
    taken here must not become a row of the fit() that is paused meanwhile."""
    return hooks_for(model).original(model, "train_step")


def _log_entries(logs):
    """(name, value) pairs of a step's logs: a metrics container's result is
    a dict, whose entries are the logs."""
    for name, value in logs.items():
        yield from (value.items() if isinstance(value, dict) else [(name, value)])


def _metric_state(state, variable):
    """A metric variable's value in `state` (id -> (variable, array)), summed
    over the replicas' copies where each replica adds its own share (Keras'
    sync-on-read sums; Keras before 3.7 makes them mirrored with no
    aggregation, whose copies part and whose value reads the first replica's)."""
    variable = raw_variable(variable)
    copies = replica_copies(variable)
    summed = len(copies) > 1 and (variable.synchronization == tf.VariableSynchronization.ON_READ
                                  or variable.aggregation == tf.VariableAggregation.NONE)
    entries = [state.get(id(c)) for c in (copies if summed else (variable,))]
    if any(entry is None for entry in entries):
        return None
    return float(sum(np.asarray(entry[1], np.float64) for entry in entries))


def _that_ran(values, ran):
    """{key: ndarray} of the values whose making branch ran (`ran`: key -> bool, None for all)."""
    return {k: np.asarray(v) for k, v in values.items() if ran is None or bool(np.asarray(ran[k]))}


def _is_number(value):
    """Whether a step function's return value is a loss: a number or a numeric tensor."""
    if isinstance(value, bool):
        return False
    try:
        return np.asarray(value).dtype.kind in "iuf" if not tf.is_tensor(value) else value.dtype.is_floating or \
            value.dtype.is_integer
    except (TypeError, ValueError):
        return False


def _scalar_or_array(value):
    array = np.asarray(value)
    return float(array) if array.ndim == 0 and array.dtype.kind in "fiub" else array


def trace_condition(condition, make_variable=None):
    """`condition` as a callable on a StepTrace.

    Args:
        condition: callable `condition(trace)`, a `lab.Breakpoint` (checked
            against the step's row), or a device-side breakpoint
            (`lab.breakpoints.nonfinite()`, `loss_spike(...)`), checked on the
            step's loss and applied gradients.
        make_variable: callable `(name, value) -> tf.Variable` for the state of
            a device-side breakpoint.
    """
    if getattr(condition, "on_device", False):
        variables = {}

        def keep(name, value):
            if make_variable is not None:
                return make_variable(f"{name}_{id(condition)}", value)
            if name not in variables:
                variables[name] = tf.Variable(value, trainable=False)
            return variables[name]

        told = []

        def check_on_device(trace):
            loss = trace.row.get("loss")
            if loss is None and getattr(condition, "reads_loss", False) and not told:
                told.append(True)
                warnings.warn(f"{condition.name} watches the step's loss, and this step logs no 'loss' "
                              f"(its values: {', '.join(sorted(trace.row)) or 'none'}): it can never hit. "
                              "Stop on a logged value with a condition instead: "
                              "stepper.run_until(lambda trace: trace.row['g_loss'] > 10).",
                              UserWarning, stacklevel=3)
            loss = None if loss is None else tf.constant(loss, tf.float32)
            gradients = [tf.constant(g) for g in trace.gradients.values()]
            return bool(condition.check(loss, gradients, keep))

        return check_on_device
    if hasattr(condition, "hit") and callable(condition.hit):
        return lambda trace: condition.hit(pd.Series({"step": trace.index, "epoch": trace.epoch,
                                                       "batch": trace.batch, **trace.row}))
    if callable(condition):
        return lambda trace: bool(condition(trace))
    raise TypeError(
        f"run_until needs a callable condition(trace) -> bool or a lab.Breakpoint, got {type(condition).__name__}."
    )


def _ends_epochs_with_an_empty_call(model, data, steps_per_epoch):
    """Whether fit() (in graph mode) ends each epoch of `data` with a train
    function call that finds no batch (`UNKNOWN_LENGTH_MESSAGE`): a dataset
    of unknown cardinality without steps_per_epoch (Keras 3.5 to 3.15)."""
    return (isinstance(data, tf.data.Dataset) and steps_per_epoch is None and not model.run_eagerly
            and int(data.cardinality()) == tf.data.UNKNOWN_CARDINALITY)
