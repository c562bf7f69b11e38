"""What one training step touched, caught by hooks that live only for that step.

`StepCapture` wraps, through the instrumentation layer (`lab.hooks`), the
model's `compute_loss` and `call`, its metrics' `result`, and each optimizer's
`apply` and `_backend_update_step` while a step runs, and records the
predictions, the loss, which metric each returned result came from, the
gradients each optimizer applied (where the Probe reads them too) and the
variables the step created.
In a `tf.function` the hooks run while tracing, and what they saw is returned
from the compiled step. Under a strategy with several replicas each replica
sees its own share of the batch: what it saw is kept apart (`current()`).
`hint(...)` names the fix for the usual mistakes.
"""

import inspect
import threading

import keras
import numpy as np
import tensorflow as tf

from lab.backend.tensorflow import compat
from lab.backend.tensorflow.compat import regrouped_through
from lab.backend.tensorflow.data_check import INSPECT_POINTER, problem_with_batch
from lab.backend.tensorflow.probes import watched_metrics
from lab.hooks import hooks_for
from lab.step_logs import step_failure_note
from lab.variables import variable_keys

_LOSS_ARGS = ("x", "y", "y_pred", "sample_weight", "training")


class StepCapture:
    """Hooks installed for one step (a context manager), removed when it ends.

    Args:
        model: keras.Model, whose `compute_loss` and `call` are watched.
        optimizers: dict, name -> optimizer, whose updates are watched.

    Example:

    ```python
    with StepCapture(model, {"optimizer": model.optimizer}) as capture:
        model.train_step((x, y))
    capture.gradients, capture.y_pred
    ```
    """

    def __init__(self, model, optimizers, slots=None):
        self.model = model
        # Values an update makes inside a nested graph (LossScaleOptimizer's
        # finite-gradients cond) cannot leave it as tensors: they go through
        # variables kept by the caller across steps (never on the model).
        self._slots = {} if slots is None else slots
        self._graph = None
        self.optimizers = optimizers
        self.y_pred = None
        self.call_output = None
        self.loss = None
        self.gradients = {}
        self.learning_rates = {}
        self.no_gradient = []
        self._reduced = None  # the gradients the update step reads (after any all-reduce)
        self.regrouped = []  # keys whose update Grappler may regroup once the capture reads the gradient
        self.created = []
        self.applies = []  # (optimizer name, {key: gradient}) per apply, in order
        self.ran = None  # after `resolve`: per value, whether the branch that makes it ran
        self._results = {}  # id(tensor) -> (metric, tensor): what each metric's result() gave
        self._hooks = hooks_for(model)
        self._depth = 0
        self._keys = {}
        self._replica = 0  # the replica whose values this capture keeps
        self._views = {}  # replica index -> the capture of that replica (replica 0: this one)
        self._views_lock = threading.Lock()

    def __enter__(self):
        model = self.model
        self._keys = {id(v): k for v, k in zip(model.trainable_variables,
                                               variable_keys(model.trainable_variables).values())}
        self._graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
        self._creator = tf.variable_creator_scope(self._create)
        self._creator.__enter__()
        try:
            self._patch(model, "compute_loss", self._wrap_compute_loss)
            self._patch(model, "call", self._wrap_call)
            for metric in watched_metrics(model):
                self._patch(metric, "result", lambda inner, m=metric: self._wrap_result(m, inner))
            for name, optimizer in self.optimizers.items():
                self._patch(optimizer, "apply", lambda inner, o=optimizer: self._wrap_apply(o, inner))
                self._patch(optimizer, "_backend_update_step", lambda inner, n=name: self._wrap_update(n, inner))
                if hasattr(optimizer, "_all_reduce_sum_gradients"):  # TensorFlow's: what the update reads
                    self._patch(optimizer, "_all_reduce_sum_gradients", self._wrap_all_reduce)
        except BaseException:
            self._hooks.release(self)
            self._creator.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc):
        self._hooks.release(self)
        self._creator.__exit__(*exc)
        if self.y_pred is None:
            self.y_pred = self.call_output
        return False

    def begin_trace(self):
        """Forgets what an earlier trace of the same step saw: tf.function
        traces a step twice when its first trace creates variables."""
        self.y_pred = self.call_output = self.loss = None
        self.gradients, self.learning_rates = {}, {}
        self.no_gradient, self.applies = [], []
        self._results = {}
        self._views = {}

    def current(self):
        """The capture of the replica running now: this one outside a
        strategy's replicas and on replica 0, else one kept for that replica,
        holding what its share of the batch made (its predictions, its loss,
        and the gradients after the replicas' sum, which every replica applies)."""
        replica = _replica_index()
        if replica == self._replica:
            return self
        with self._views_lock:
            view = self._views.get(replica)
            if view is None:
                view = self._views[replica] = StepCapture(self.model, self.optimizers, slots=self._slots)
                view._keys, view._graph, view._replica = self._keys, self._graph, replica
        return view

    def _patch(self, target, name, factory):
        self._hooks.wrap(self, target, name, factory, role="capture")

    def _create(self, next_creator, **kwargs):
        variable = next_creator(**kwargs)
        if tf.executing_eagerly():
            self.created.append((variable, np.array(variable.numpy(), copy=True)))
        return variable

    def _key(self, variable):
        key = self._keys.get(id(variable))
        if key is None:
            key = getattr(variable, "path", None) or variable.name
        return key

    def _wrap_compute_loss(self, original):
        def compute_loss(*args, **kwargs):
            arguments = dict(zip(_LOSS_ARGS, args), **kwargs)
            loss = original(*args, **kwargs)
            seen = self.current()
            if arguments.get("y_pred") is not None:
                seen.y_pred = arguments["y_pred"]
            if loss is not None:
                seen.loss = loss
            return loss

        return compute_loss

    def _wrap_call(self, original):
        def call(*args, **kwargs):
            seen = self.current()
            seen._depth += 1
            try:
                output = original(*args, **kwargs)
            finally:
                seen._depth -= 1
            if seen._depth == 0:
                seen.call_output = output
            return output

        call.__signature__ = inspect.signature(original)
        return call

    def _wrap_result(self, metric, original):
        def result(*args, **kwargs):
            value = original(*args, **kwargs)
            if not isinstance(value, dict):
                self.current()._results[id(value)] = (metric, value)
            return value

        return result

    def metric_of(self, value):
        """The metric whose `result()` returned `value` in this step, or None:
        the probe's rule, so a tracker logged under another name (a VAE's
        `total_loss` returned as "loss") is still found."""
        found = self._results.get(id(value))
        return found[0] if found is not None and found[1] is value else None

    def _wrap_apply(self, optimizer, original):
        def apply(grads, trainable_variables=None):
            variables = trainable_variables
            if variables is None:
                variables = compat.optimizer_variables_for(optimizer)
            grads = list(grads)
            variables = list(variables)
            self.current().no_gradient += [self._key(v) for g, v in zip(grads, variables) if g is None]
            if trainable_variables is not None and not optimizer.built and tf.executing_eagerly() and grads:
                self._build(optimizer, variables)
            return original(grads, trainable_variables if trainable_variables is None else variables)

        return apply

    def _build(self, optimizer, variables):
        """Builds `optimizer` as its first apply would (in its name scope, on
        the variables applied), and counts the variables it made at their
        values once built, not at creation: a build may set them
        (ScheduleFreeAdamW starts its momentum at the weights), and rewind
        puts them back to these."""
        start = len(self.created)
        with keras.name_scope(optimizer.name, caller=optimizer):
            optimizer.build(variables)
        optimizer.built = True
        self.created[start:] = [(variable, np.array(variable.numpy(), copy=True)) for variable, _ in self.created[start:]]

    def _wrap_update(self, name, original):
        def _backend_update_step(grads, trainable_variables, learning_rate):
            seen = self.current()
            seen._reduced = None
            result = original(grads, trainable_variables, learning_rate)
            read = seen._reduced if seen._reduced is not None and len(seen._reduced) == len(grads) else grads
            # On one replica of several, what is applied is the replicas' sum.
            replicas = _replicas_in_sync() > 1
            applied = {}
            number = len(seen.applies)
            for grad, reduced, variable in zip(grads, read, trainable_variables):
                key = self._key(variable)
                if reduced is not None and regrouped_through(reduced):  # before the capture reads the gradient
                    self.regrouped.append(key)
                applied[key] = seen._out(("gradient", number, key), reduced if replicas else grad)
            seen.gradients.update(applied)  # the last apply's, per variable
            seen.applies.append((name, applied))
            seen.learning_rates[name] = seen._out(("learning_rate", name), learning_rate)
            return result

        return _backend_update_step

    def _wrap_all_reduce(self, original):
        def _all_reduce_sum_gradients(grads_and_vars):
            reduced = list(original(grads_and_vars))
            self.current()._reduced = [g for g, _ in reduced]
            return reduced

        return _all_reduce_sum_gradients

    def _out(self, slot_key, value):
        """`value` as something the step can return: itself, or, made in a
        nested graph, a `_Slotted` to read after the step (`resolve`)."""
        value = tf.convert_to_tensor(value)
        if self._graph is None or tf.compat.v1.get_default_graph() is self._graph:
            return value
        if _replicas_in_sync() > 1:
            raise NotImplementedError(
                "This step makes the values it updates with inside a nested graph on each of several "
                "replicas, which the Stepper cannot return: step a copy of the model built outside the "
                "strategy's scope.")
        slot = self._slots.get(slot_key)
        if slot is None:
            with tf.init_scope():
                slot = self._slots[slot_key] = (
                    tf.Variable(tf.zeros(value.shape, value.dtype), trainable=False, name="lab_capture"),
                    tf.Variable(0.0, trainable=False, name="lab_capture_written"))
        slot[0].assign(value)
        slot[1].assign(1.0)
        return _Slotted(slot)

    def resolve(self):
        """Reads what went through slots, after the step's nested graphs ran
        (NaN where the branch that would have written it did not run).

        `ran` says, per value, whether that branch ran: an update that a
        LossScaleOptimizer skipped, or that gradient accumulation holds to
        every k-th step, applied no gradient, as an eager step shows by
        capturing none.
        """
        def read(value):
            return value.read() if isinstance(value, _Slotted) else value

        def ran(value):
            return value.ran() if isinstance(value, _Slotted) else tf.constant(True)

        self.ran = {"gradients": {k: ran(v) for k, v in self.gradients.items()},
                    "applies": [{k: ran(v) for k, v in grads.items()} for _, grads in self.applies],
                    "learning_rates": {k: ran(v) for k, v in self.learning_rates.items()}}
        self.gradients = {k: read(v) for k, v in self.gradients.items()}
        self.applies = [(name, {k: read(v) for k, v in grads.items()}) for name, grads in self.applies]
        self.learning_rates = {k: read(v) for k, v in self.learning_rates.items()}


def _replica_index():
    """The index of the strategy replica running now (0 outside replicas)."""
    context = tf.distribute.get_replica_context()
    index = getattr(context, "_replica_id_in_sync_group", 0)
    return index if isinstance(index, int) else 0


def _replicas_in_sync():
    context = tf.distribute.get_replica_context()
    return 1 if context is None else context.num_replicas_in_sync


class _Slotted:
    """A value written to a slot inside a nested graph, read after the step."""

    def __init__(self, slot):
        self.slot = slot
        self._read = None

    def read(self):
        if self._read is None:
            value, written = self.slot
            current = tf.identity(value.read_value())
            nan = tf.fill(tf.shape(current), tf.constant(float("nan"), current.dtype))
            ok = written.read_value() > 0
            with tf.control_dependencies([current, ok]):
                written.assign(0.0)
            self._ran = ok
            self._read = tf.where(ok, current, nan) if current.dtype.is_floating else current
        return self._read

    def ran(self):
        """bool tensor, whether the branch that writes the value ran in this step."""
        self.read()
        return self._ran


def hint(error, trace, capture):
    """A line naming the usual fix for the common mistakes in a train_step."""
    message = str(error)
    if _raised_reading_a_metric(error):
        return (
            "No metric was updated in train_step: it returned metric results "
            "(`self.get_metrics_result()`, `metric.result()`) that no `update_state` fed. "
            "Before returning, call `update_state` for each metric in `self.metrics`: "
            "`metric.update_state(loss)` for the loss tracker (named 'loss'), "
            "`metric.update_state(y, y_pred)` for the others; or return "
            "`self.compute_metrics(x, y, y_pred, sample_weight)`."
        )
    if "No gradients provided" in message or (capture.no_gradient and isinstance(error, ValueError)):
        missing = ", ".join(capture.no_gradient) or "all variables"
        return (
            f"No gradient reached: {missing}. Compute the forward pass and the loss inside "
            "`with tf.GradientTape() as tape:`, then call `tape.gradient(loss, variables)` "
            "for variables that the loss depends on (a `.numpy()` or `tf.stop_gradient` "
            "on the way cuts the gradient)."
        )
    if _is_shape_error(error, message) or any(phrase in message for phrase in _DATA_PHRASES):
        problem = problem_with_batch(capture.model, trace.x, trace.y, getattr(trace, "sample_weight", None))
        if problem is not None:
            return f"{problem.message} Fix: {problem.fix} {INSPECT_POINTER}"
    if "unpack" in message and isinstance(error, (ValueError, TypeError)):
        return (
            "fit() hands train_step `(x, y)`, `(x,)` when there are no targets, or "
            "`(x, y, sample_weight)`; unpack it with "
            "`x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)`."
        )
    if _is_shape_error(error, message):
        shapes = f"x {np.shape(trace.x)}"
        if trace.y is not None:
            shapes += f", y {np.shape(trace.y)}"
        return (
            f"A shape mismatch with this batch ({shapes}): check the model's input shape "
            "against x, and the loss against y (sparse_categorical_crossentropy takes "
            "integer labels, categorical_crossentropy one-hot rows). "
            "`lab.inspect_data(x, y, model=model)` checks a batch against the model and names the fix."
        )
    if "GradientTape" in message or "tape" in message.lower():
        return "Open the tape with `with tf.GradientTape() as tape:` around the forward pass and loss."
    if "outside the replica context" in message and tf.distribute.has_strategy():
        return (
            "The Stepper runs train_step as one device does, outside the strategy's replicas: "
            "step outside `with strategy.scope():` (build and compile the model inside it, "
            "then call `stepper.step()` after the block).")
    return ""


# Keras' and TensorFlow's words for data a model cannot take, which name neither the input nor the fix.
_DATA_PHRASES = ("doesn't match the expected structure", "Attempt to convert a value (None)",
                 "None values not supported", "label value", "Invalid dtype")
FIT_DATA_NOTE = ("If the data is at fault, `lab.inspect_data(x, y, model=model)`, given fit()'s x and y, "
                 "shows what fit() hands train_step and names the problem and its fix.")


def failure_note(error, model, returned=None, has_targets=True):
    """The lab's words for an error that ended a watched fit(), where Keras'
    name neither the input nor the fix; "" where the lab has none.

    Args:
        error: the exception.
        model: keras.Model being fit.
        returned: str or None, what train_step returned instead of a dict of
            logs (`lab.step_logs.not_logs`).
        has_targets: bool, whether the batches held targets y.
    """
    note = step_failure_note(error, model, returned, has_targets, INSPECT_POINTER)
    if note or not isinstance(error, Exception):
        return note
    message = str(error)
    if _is_shape_error(error, message) or any(phrase in message for phrase in _DATA_PHRASES):
        return FIT_DATA_NOTE
    return ""


_SHAPE_PHRASES = ("incompatible shapes", "shapes are incompatible", "is incompatible with", "shape mismatch",
                  "dimensions must be equal", "expected shape", "expected ndim", "expected min_ndim",
                  "expected axis", "must have rank", "must be rank", "incompatible with the layer",
                  "cannot reshape", "cannot be broadcast", "shapes must be equal", "matrix size-incompatible",
                  "arguments `target` and `output` must have the same")
# Errors about graphs, tensors leaving them and a strategy's all-reduces ("Shape mismatch in the
# collective instance": strategies whose collective keys meet) also mention shapes; they are no
# shape mismatch of the data.
_GRAPH_PHRASES = ("funcgraph", "out of scope", "inaccessible", "symbolic tensor", "defined in another function",
                  "tf.function", "graph tensor", "non-eager", "collective instance")


def _is_shape_error(error, message):
    text = message.lower()
    if any(phrase in text for phrase in _GRAPH_PHRASES):
        return False
    return isinstance(error, (ValueError, TypeError, tf.errors.InvalidArgumentError)) and any(
        phrase in text for phrase in _SHAPE_PHRASES)


def _raised_reading_a_metric(error):
    """Whether `error` came from a metric's `result()`: a compiled metric read
    before any `update_state` has not even built its variables."""
    if "result()" in str(error) and "not yet been built" in str(error):
        return True
    frames = error.__traceback__
    while frames is not None:
        frame = frames.tb_frame
        if frame.f_code.co_name == "result" and isinstance(frame.f_locals.get("self"), keras.metrics.Metric):
            return True
        frames = frames.tb_next
    return False
