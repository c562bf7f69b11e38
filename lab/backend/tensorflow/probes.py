"""Probes: hooks on a model's train_step, compute_loss and optimizers.

A probe makes each training step write its own values (the batch's loss and
metrics, the learning rate it used, and optionally the norms of the gradients
the optimizer applied) into a device-side `StepBuffer`, inside the compiled
step. It works the same in eager, graph and XLA execution and under a
tf.distribute strategy, because it hooks the methods Keras itself calls:

- `model.train_step`: brackets the step; reads metric totals before and after,
  so a mean-type metric's row is the batch's own value, not the epoch mean;
- `model.compute_loss`: the loss of the batch, also when an old-style step
  has corrupted the loss tracker through `compiled_metrics`;
- each optimizer's `_backend_update_step` and `_all_reduce_sum_gradients`:
  the gradients as the update consumes them (after clipping, after the
  cross-replica sum) and the learning rate of that step.

Probes put their wrappers on through the instrumentation layer
(`lab.hooks`), which takes them off on `uninstall()` whatever happened.
Their state (the buffer) lives on the probe, never on the model.

Where the step computes norms itself (`norms_of`: under XLA, and where it
combines values), a finite gradient whose sum of squares overflows float32
still has a finite norm (`scaled_norm`); where the host finishes them, such
a norm is inf and the run says so (`encoded_norms_of`). When one optimizer
applies several times in one step (a critic loop), a variable's
`grad_norm/<key>` covers all of them (the root of the sum of their squares),
and `applies/<optimizer>` says how many there were.

What the host can finish, the host finishes (`Probe._finish`, at `read()`):
the step writes norms as half sums of squares (`encoded_norms_of`) and a
mean metric's totals and counts (`MeanParts`); the host takes the roots,
the update ratios and the batch values, bit for bit as the step would.
"""

import contextlib
import threading
import warnings

import keras
import numpy as np
import tensorflow as tf

from lab import schema
from lab.backend.tensorflow import compat
from lab.backend.tensorflow.buffer import Part, StepBuffer, scalar, vector_of, whole_vector
from lab.backend.tensorflow.compat import SCALES_LOSS_BY_REPLICAS as KERAS_SCALES_LOSS
from lab.backend.tensorflow.compat import (LossScalingSeen, in_xla_trace, isolated, regrouped_through,
                                           slow_xla_cpu_trace, stateful_random_ops, unscale_loss_for_distribution,
                                           watch_loss_scaling)
from lab.backend.tensorflow.norms import (decode_norms, encoded_norms_of, global_norm, hypot, norms_of, shown_names,
                                          summed_rows, total_grad_norm)
from lab.hooks import hooks_for
from lab.metric_names import is_mean, leaf_metrics
from lab.step_logs import not_logs
from lab.variables import find_optimizers, variable_keys

XLA_NOTE = (
    "This step is compiled by XLA with the lab's reads in the same program: XLA may "
    "round the step's own computations differently than without them, so weights can "
    "differ from a fit without the lab by float rounding. Compile with jit_compile=False "
    "for training bit for bit as without the lab.")

REGROUPED_NOTE = (
    "TensorFlow's graph optimizer (Grappler) may compute the update of {variables} differently "
    "once the lab reads their gradients: it regroups the optimizer's arithmetic with the "
    "gradient's own (plain SGD's gradient * learning_rate with BatchNormalization's gamma "
    "gradient, for one) only while the update is the gradient's one reader. Their weights can "
    "then differ from a fit without the lab by float rounding. Record without gradients=True "
    "and without device breakpoints (weights=True reads no gradient) for training bit for bit "
    "as without the lab.")

CHANGED_AFTER_NOTE = (
    "weight_norm and update_ratio of {variables} are read where the optimizer's update step "
    "ends, and {what} changes those weights after it in the same step: on such steps they are "
    "not the values the weights end the step with. Training is not affected.")

RANDOM_NOTE = (
    "The step draws from TensorFlow random ops that keep their stream in the traced graph "
    "({variables}): each new trace of the step starts those streams again. The lab traces "
    "the step anew with its reads in it, and a later fit() without the lab traces it once "
    "more, so from a fit that follows another on this model these draws, and the training "
    "that uses them, differ from fits without the lab (as they do after a recompile). For "
    "draws that go on across traces, use keras.random with a keras.random.SeedGenerator "
    "(or seed=None), or a tf.random.Generator.")

UPDATE_STEP_NOTE = (
    "The update_step of {variables} is not Keras' own, and Keras calls it after the lab "
    "has read the gradients: the gradient columns hold the gradients handed to update_step, and the "
    "update may use others (a gradient centralized in update_step, for one). Change "
    "gradients in apply() or apply_gradients() for columns that hold what is applied.")

UNCALLED_NOTE = (
    "{variables}: Keras 3's optimizers never call these methods of Keras 2's optimizer API "
    "({what}), so what they would do to the gradients or the update does not happen, in training "
    "as in the lab's columns (keras-io's gradient centralization overrides get_gradients, and "
    "trains as plain RMSprop). Change gradients in apply() or apply_gradients(), or the update "
    "in update_step().")

# Methods of Keras 2's optimizer API that Keras 3's optimizers never call.
KERAS2_OPTIMIZER_METHODS = ("get_gradients", "get_updates", "_resource_apply_dense", "_resource_apply_sparse",
                            "_create_slots", "_prepare_local")

NO_LOSS_NOTE = (
    "{variables} watch the loss compute_loss returns, and this train_step computes its loss "
    "without compute_loss (a GAN's two losses, a loss object of its own): they can never hit. "
    "Call self.compute_loss(...) in the step, or stop on a logged value with a Python "
    "breakpoint: lab.Breakpoint(lambda row: row['g_loss'] > 10).")

NO_UPDATE_NOTE = (
    "{variables}: trainable, but no optimizer updates them in this train step (no gradient reaches "
    "them, as Keras' \"Gradients do not exist\" warning says: a layer no loss depends on, an output "
    "compiled with no loss; or the step hands them to no optimizer). They are not trained, and have "
    "no gradient, weight-norm or update-ratio values. Training is not affected.")

OVERWRITTEN_NOTE = (
    "{variables}: set at each step to a value the step computes and hands the optimizer in "
    "place of a gradient (Keras' overwrite_with_gradient: float8 training's scales and amax "
    "histories), not updated from a gradient. They have no gradient, weight-norm or "
    "update-ratio columns, and no part in grad_norm. Training is not affected.")

# The run's warning for each kind of `Probe.trace_notes`.
TRACE_NOTES = {"regrouped": REGROUPED_NOTE, "changed_after": CHANGED_AFTER_NOTE, "random": RANDOM_NOTE,
               "update_step": UPDATE_STEP_NOTE, "no_loss": NO_LOSS_NOTE, "uncalled": UNCALLED_NOTE,
               "no_update": NO_UPDATE_NOTE, "overwritten": OVERWRITTEN_NOTE}

ALREADY_WATCHED = (
    "This model is already watched by another lab Recorder or Dashboard. "
    "Pass one of them to fit(), or call `.detach()` on the other first."
)


def defined_outside_keras(obj, name):
    """The class that defines the method `name` of `obj` where it is not
    Keras' own (a subclass of the user's overrides it), else None."""
    for cls in type(obj).__mro__:
        if name in vars(cls):
            return None if cls.__module__.split(".")[0] in ("keras", "tf_keras") else cls
    return None


def overwritten(variable):
    """Whether Keras' optimizers set `variable` to the value handed to them
    as its gradient, rather than update it from one (`overwrite_with_gradient`:
    float8 training's scales and amax histories; Keras 3.4 on)."""
    return bool(getattr(variable, "overwrite_with_gradient", False))


def read_value(variable):
    """The value of a Keras variable (its `.value`: never cast by a mixed
    precision autocast scope) or of a `tf.Variable` (an optimizer may train
    one that no model holds, the image of a style transfer)."""
    if isinstance(variable, keras.Variable):
        return tf.convert_to_tensor(variable.value)
    return tf.convert_to_tensor(variable)


def _accumulates(optimizer):
    """Whether `optimizer` (or a LossScaleOptimizer's inner one) accumulates
    gradients over steps (Keras' `gradient_accumulation_steps`)."""
    inner = getattr(optimizer, "inner_optimizer", None) or optimizer
    return bool(getattr(inner, "gradient_accumulation_steps", None))


def is_keras_loss_tracker(model, metric):
    """Whether `metric` is the loss tracker Keras' compile() made (fed
    compute_loss's value by Keras' own train_step)."""
    return metric is not None and metric is getattr(model, "_loss_tracker", None)


def watched_metrics(model):
    """The metric objects a step may return results of: the model's own
    (trackers a custom step keeps) and the compiled metrics' leaves."""
    found, seen = [], set()
    for metric in list(model.metrics) + list(leaf_metrics(model).values()):
        if id(metric) not in seen and isinstance(metric, keras.metrics.Metric) and not hasattr(metric, "_flat_metrics"):
            seen.add(id(metric))
            found.append(metric)
    return found


def _keras_defines(cls, name):
    """Whether Keras itself (not a subclass of the user's) defines `cls.name`."""
    for klass in cls.__mro__:
        if name in vars(klass):
            return klass.__module__.split(".", 1)[0] == "keras"
    return False


def _replica_context():
    ctx = tf.distribute.get_replica_context()
    if ctx is not None and ctx.num_replicas_in_sync > 1:
        return ctx
    return None


def _all_reduce(value, op):
    ctx = _replica_context()
    if ctx is None:
        return value
    if op == "MAX":  # ReduceOp has SUM and MEAN only; flags are 0 or 1
        return tf.cast(ctx.all_reduce("SUM", value) > 0, value.dtype)
    return ctx.all_reduce(op, value)


def _in_cross_replica_context(create):
    """Calls `create(strategy)` where variables may be made: under a strategy
    and inside a replica, through a merge (every replica must get here)."""
    if not tf.distribute.has_strategy():
        return create(None)
    strategy = tf.distribute.get_strategy()
    if tf.distribute.in_cross_replica_context():
        return create(strategy)
    return tf.distribute.get_replica_context().merge_call(lambda distribution: create(distribution))


def _step_counter(strategy):
    """A step count (int64, 0) that the probe keeps outside the model; made
    at trace time, as the step buffer's variables are."""
    with tf.init_scope():
        with strategy.scope() if strategy is not None else contextlib.nullcontext():
            return tf.Variable(tf.constant(0, tf.int64), trainable=False, name="lab_steps_seen",
                               aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)


def _batch_size(data):
    leaves = [t for t in tf.nest.flatten(data) if t is not None]
    if not leaves:
        return tf.constant(np.nan, tf.float32)
    return tf.cast(tf.shape(leaves[0])[0], tf.float32)


def _batch_loss(loss, batch_size):
    """The batch's loss, from the (per-replica) loss a step computed,
    unscaled as Keras' own step unscales it for its tracker."""
    loss = tf.cast(unscale_loss_for_distribution(isolated([loss])[0]), tf.float32)
    loss = loss if loss.shape.rank == 0 else tf.reduce_mean(loss)
    if _replica_context() is None:
        return loss
    # Each replica's loss weighted by its share of the batch, as Keras' loss
    # tracker weighs it: a last batch split unevenly (one sample on one
    # replica, none on the other) is its samples' loss, not the replicas'
    # plain mean.
    share = tf.cast(batch_size, tf.float32)
    return _all_reduce(tf.where(share > 0, loss * share, 0.0), "SUM") / _all_reduce(share, "SUM")


def _flat_logs(logs, prefix=""):
    """(name, value) pairs of a step's returned logs; nested dicts flattened,
    as a custom step returning `{m.name: m.result() for m in self.metrics}`
    nests the compiled metrics."""
    if not isinstance(logs, dict):
        return []
    pairs = []
    for key, value in logs.items():
        if isinstance(value, dict):
            pairs += _flat_logs(value)
        else:
            pairs.append((prefix + str(key), value))
    return pairs


def _scalar_tensor(value):
    value = getattr(value, "value", value) if isinstance(value, keras.Variable) else value
    try:
        tensor = tf.convert_to_tensor(value)
    except (TypeError, ValueError):
        return None
    if tensor.shape.rank == 0 and (tensor.dtype.is_floating or tensor.dtype.is_integer or tensor.dtype.is_bool):
        return tensor
    return None


def _vector_tensor(value):
    """A logged vector of numbers whose columns the row can hold (a static
    length of at most `schema.MAX_VECTOR_ELEMENTS`), else None."""
    value = getattr(value, "value", value) if isinstance(value, keras.Variable) else value
    try:
        tensor = tf.convert_to_tensor(value)
    except (TypeError, ValueError):
        return None
    size = tensor.shape[0] if tensor.shape.rank == 1 else None
    if size is None or not 0 < size <= schema.MAX_VECTOR_ELEMENTS:
        return None
    return tensor if (tensor.dtype.is_floating or tensor.dtype.is_integer or tensor.dtype.is_bool) else None


class MeanParts:
    """A mean metric's total and count after and before the step, for the
    host to turn into the batch's own value (`Probe._finish`)."""

    FIRST = "_mean_total/"
    PREFIXES = (FIRST, "_mean_count/", "_mean_total_before/", "_mean_count_before/")

    def __init__(self, *tensors):
        self.tensors = tensors

    def float32(self):
        return all(t.dtype == tf.float32 for t in self.tensors)

    def on_device(self):
        """The batch's value computed in the step (summed over replicas)."""
        total, count, total_before, count_before = self.tensors
        total = _all_reduce(tf.cast(total - total_before, tf.float32), "SUM")
        count = _all_reduce(tf.cast(count - count_before, tf.float32), "SUM")
        # A metric the step did not update has no value for this batch (not 0).
        return tf.where(count > 0, tf.math.divide_no_nan(total, count), np.float32(np.nan)), count

    @classmethod
    def names(cls, key):
        return [prefix + key for prefix in cls.PREFIXES]

    def columns(self, key):
        return [(prefix + key, tensor) for prefix, tensor in zip(self.PREFIXES, self.tensors)]


class StepState:
    """What one call of train_step produced, collected while it runs (or traces).

    Values computed in the step's own graph are kept as tensors. Values an
    optimizer hook computes inside a nested graph (a `tf.cond` branch: the loss
    scale optimizer's finite check, gradient accumulation, the breakpoint
    gate) cannot leave that graph as tensors; they go through slot variables.
    """

    def __init__(self):
        self.graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
        self.loss = None
        self.values = {}
        self.slotted = {}
        self.optimizers = []
        self.pending = None
        self.batch_gradients = False
        self.totals = {}  # id(mean metric) -> its (total, count) before the batch
        self.results = {}  # id(tensor a metric's result() returned) -> (metric, tensor)
        self.applies = {}  # optimizer name -> applies traced in this step
        self.decaying = {}  # optimizer name -> its variables' values before its weight decay
        self.forward_state = []  # (variable, value before the step) the forward pass may assign
        self.local_batch_size = None  # this replica's share of the batch
        self.kept_out = []  # per gated apply: whether its update was kept out
        self.kept_out_of = []  # per gated apply: (whether its update was kept out, the weights it updates)
        self.weights_at_start = []  # (trainable variable, its value as the step began), under device breakpoints
        self.updated = set()  # the keys of the variables an optimizer's update step took
        self.loss_scaling = LossScalingSeen()  # what Keras' loss scaling did in the step (replicas only)
        self.measures = None  # with norms_every: whether this step takes its norms (a bool tensor)

    def nested(self):
        return self.graph is not None and tf.compat.v1.get_default_graph() is not self.graph


ENCODED = "_encoded/"  # a row value `read()` finishes: see `encoded_norms_of`
WEIGHTLESS = "_weightless/"  # 1 where a mean metric's batch changed its count by nothing
_UPDATE_NORM = "_update_norm/"  # the norm of a variable's update, for `update_ratio/` on the host
LOSS_OBJECT = "_loss_object"  # the batch's loss from the one Keras loss object a step called, unscaled
NONFINITE_GRADIENT = "_nonfinite_gradient/"  # 1 where nonfinite()'s gate found the gradient of <key> not finite


class Probe:
    """Hooks on one model that write each training step's values to a StepBuffer.

    Args:
        model: keras.Model, compiled.
        gradients: bool, also record per-variable norms of the applied gradients.
        weights: bool, also record weight norms and update/weight ratios.
        breakpoints: sequence of device-side breakpoints (`lab.breakpoints.nonfinite()`,
            `loss_spike(...)`): evaluated inside the step; a hit skips that
            update and holds every later one until `release()`.
        capacity: int, rows of the device buffer (at least 4 executions).
        norms_every: int, take the per-variable norms (gradients, weights,
            updates) only at steps where the optimizer's iteration count is
            a multiple of it, in a `tf.cond` (`_sampled`); the other rows'
            norm columns are NaN. 1: every step.
    """

    # Norms go into the row encoded, finished by `read()` (`encoded_norms_of`).
    FINISHES_ON_HOST = True

    def __init__(self, model, gradients=False, weights=False, breakpoints=(), capacity=1024, norms_every=1):
        self.model = model
        self.gradients = gradients
        self.weights = weights
        self.norms_every = norms_every if (gradients or weights) else 1
        self._steps_seen = None  # with norms_every: the steps this probe saw (a variable, made at the first trace)
        self.breakpoints = [b for b in breakpoints if getattr(b, "on_device", False)]
        self.capacity = capacity
        self.columns = None
        self.buffer = None
        self._buffer_traced = False  # a traced step holds the buffer: its columns are fixed
        self._local = threading.local()
        self._lock = threading.Lock()
        self._patches = []
        self._variable_keys = {}
        self._optimizer_names = []
        self._slots = {}
        self._hold = None
        self.hit_was_told = False  # a traced step told the host its gate hit (`_tell_hits`)
        self.running_columns = set()  # logged values that are Keras' running ones
        self.record_errors = []  # why steps could not be recorded (the lab's own failures)
        self.not_logs = None  # what train_step returned instead of a dict of logs (`lab.step_logs`)
        self.has_targets = True  # whether the last batch train_step was handed held y (for failure notes)
        self.infinite = {}  # of the last read: norm columns the host finished as inf -> first row
        self.weightless = {}  # of the last read: mean metric columns -> first row with no weight
        self.traced_in_xla = False  # a step with these hooks was compiled by XLA (see XLA_NOTE)
        # Columns a traced step gives a value (others, such as the gradient
        # norm of a variable no optimizer updates, are only padding: NaN).
        self.stepped_columns = set()
        self.loss_of_tracker = False  # the loss column is Keras' loss tracker's (the step logs none)
        # Trace-time facts the run is told of once per variable: kind -> {variable key: text}.
        self.trace_notes = {kind: {} for kind in TRACE_NOTES}
        self.busy = lambda: False  # the owner's "training right now", for the layer's claim
        self.gone = lambda: False  # the owner's `abandon_if_gone`, for the layer's claim
        self._hooks = hooks_for(model)
        self._nonfinite_index = next((i for i, b in enumerate(self.breakpoints) if b.name == "nonfinite"), None)

    def reshapes_the_update(self):
        """Whether the hooks make the optimizer's update wait for values of
        the batch that it does not wait for in bare training: device
        breakpoints gate it on the batch's loss and gradients, and under
        gradient accumulation the gradients' norms are read before it."""
        return bool(self.breakpoints) or (self.gradients and any(
            _accumulates(optimizer) for optimizer in find_optimizers(self.model).values()))

    @property
    def installed(self):
        return self._hooks.holder("probe") is self

    def is_training(self):
        return bool(self.busy())

    def abandon_if_gone(self):
        return bool(self.gone())

    # ---- installing --------------------------------------------------------

    def install(self):
        """Patches the model's and optimizers' methods (instance attributes only)."""
        if self.installed:
            return
        model = self.model
        self._hooks.claim("probe", self, ALREADY_WATCHED)
        try:
            self._variable_keys = variable_keys(model.trainable_variables)
            self._patch(model, "train_step", self._wrap_train_step)
            self._patch(model, "compute_loss", self._wrap_compute_loss)
            for metric in watched_metrics(model):
                self._patch(metric, "result", lambda inner, metric=metric: self._wrap_result(metric, inner))
            container = getattr(model, "_compile_metrics", None)
            if container is not None and hasattr(container, "build"):
                self._patch(container, "update_state", lambda inner, c=container: self._wrap_metrics_update(c, inner))
            compiled_loss = getattr(model, "_compile_loss", None)
            if compiled_loss is not None and not getattr(compiled_loss, "built", True):
                self._patch(compiled_loss, "build", self._wrap_loss_build)
            optimizers = find_optimizers(model)
            self._optimizer_names = list(optimizers)
            for name, optimizer in optimizers.items():
                if self.breakpoints:
                    self._patch(optimizer, "apply", lambda inner, o=optimizer, n=name: self._wrap_apply(o, inner, n))
                for part_name, inner in compat.updating_optimizers(name, optimizer):
                    if self.gradients and _accumulates(inner):
                        # Updates happen every k-th step; each row still shows its batch's gradient.
                        self._patch(inner, "_backend_apply_gradients", self._wrap_accumulating)
                    self._patch_update(part_name, inner)
        except BaseException:
            self.uninstall()
            raise

    def _patch_update(self, name, inner):
        """The hooks on the optimizer (`inner`: the one a LossScaleOptimizer
        wraps) that bracket its update: the weight decay before it (with
        weights), the update step and the cross-replica sum of gradients."""
        if self.weights and getattr(inner, "weight_decay", None) is not None:
            self._patch(inner, "_apply_weight_decay", lambda f: self._wrap_weight_decay(name, f))
        overriding = defined_outside_keras(inner, "update_step")
        if overriding is not None and self.gradients:
            self.trace_notes["update_step"].setdefault(overriding.__qualname__, "")
        uncalled = [method for method in KERAS2_OPTIMIZER_METHODS if defined_outside_keras(inner, method) is not None]
        if uncalled:
            owner = defined_outside_keras(inner, uncalled[0])
            self.trace_notes["uncalled"].setdefault(f"{owner.__qualname__}.{uncalled[0]}", ", ".join(uncalled))
        self._patch(inner, "_backend_update_step", lambda f: self._wrap_update_step(name, f, inner))
        if hasattr(inner, "_all_reduce_sum_gradients"):
            self._patch(inner, "_all_reduce_sum_gradients", self._wrap_all_reduce)

    def uninstall(self):
        """Takes every wrapper off again (never raises)."""
        self._hooks.release(self)

    def _patch(self, target, name, factory):
        self._hooks.wrap(self, target, name, factory, role="probe")

    # ---- wrappers ----------------------------------------------------------

    def _wrap_train_step(self, original):
        probe = self

        def train_step(data):
            state = StepState()
            probe._local.state = state
            try:
                state.measures = probe._measures()
                totals = state.totals = probe._metric_totals()
                if probe.breakpoints:
                    state.forward_state = [(v, read_value(v)) for v in probe._forward_state_variables()]
                    # Reads alias the weights' buffers: no copy unless the step assigns them.
                    state.weights_at_start = [(v, read_value(v)) for v in probe.model.trainable_variables]
                probe.has_targets = isinstance(data, (tuple, list)) and len(data) > 1 and data[1] is not None
                if _replica_context() is None:
                    logs = original(data)
                else:
                    with watch_loss_scaling(state.loss_scaling):
                        logs = original(data)
                probe._keep_out_forward_state(state)
                probe.not_logs = not_logs(logs)  # fit() fails on it, in words that name neither it nor the fix
                try:
                    if not tf.executing_eagerly():
                        for name in stateful_random_ops(tf.compat.v1.get_default_graph()):
                            probe.trace_notes["random"].setdefault(name, "")
                        probe._note_not_updated(state)
                    probe._record(state, totals, logs, _batch_size(data))
                except Exception as error:  # noqa: BLE001 - training never dies of the lab
                    probe._could_not_record(error)
            finally:
                probe._local.state = None
            return logs

        return train_step

    def note_xla(self, run, step):
        """Says once in `run` that XLA compiled the lab's reads with the step (`XLA_NOTE`)."""
        if self.traced_in_xla and not run.metadata.get(schema.XLA_TRACED):
            run.metadata[schema.XLA_TRACED] = True
            run.add_event("warning", XLA_NOTE, step=step)

    def note_trace_facts(self, run, step):
        """Says once in `run`, for each variable (or op) not named yet, what a
        trace found: that reading its gradient may change how Grappler
        computes its update (`REGROUPED_NOTE`), that the optimizer changes it
        after the lab's read (`CHANGED_AFTER_NOTE`), or that the step draws
        from a random op that the lab's trace starts again (`RANDOM_NOTE`)."""
        for kind, found in self.trace_notes.items():
            if not found:
                continue
            key = f"{schema.TOLD_PREFIX}{kind}"
            told = [t for t in run.metadata.get(key, "").split("\n") if t]
            new = [name for name in found if name not in told]
            if not new:
                continue
            run.metadata[key] = "\n".join(told + new)
            what = " and ".join(sorted({found[name] for name in new}))
            run.add_event("warning", TRACE_NOTES[kind].format(variables=shown_names(new), what=what), step=step)

    def _note_not_updated(self, state):
        """Notes (at trace time, where every branch of the step is traced: an
        update gradient accumulation or a loss scale holds back is traced too)
        the trainable variables no optimizer's update step took."""
        if not (self.gradients or self.weights):
            return
        variables = self.model.trainable_variables
        for variable, key in zip(variables, self._keys(variables)):
            if key not in state.updated:
                self.trace_notes["overwritten" if overwritten(variable) else "no_update"].setdefault(key, "")

    def _note_regrouped(self, variables, grads):
        """Notes (at trace time, the update built) the variables whose update
        Grappler may compute differently once the lab reads their gradients."""
        if not (self.gradients or self.breakpoints):
            return
        for variable, gradient in zip(variables, grads):
            if gradient is not None and regrouped_through(gradient):
                self.trace_notes["regrouped"].setdefault(self._key(variable), "")

    def _note_changed_after(self, optimizer, variables):
        """Notes (at trace time) the variables Keras changes after its update
        step, in the same apply: an EMA that overwrites the weights, a
        variable's constraint."""
        if not self.weights:
            return
        found = self.trace_notes["changed_after"]
        for variable in variables:
            if getattr(optimizer, "use_ema", False) and getattr(optimizer, "ema_overwrite_frequency", None):
                found.setdefault(self._key(variable), "the optimizer's moving average (use_ema)")
            elif getattr(variable, "constraint", None) is not None:
                found.setdefault(self._key(variable), "its constraint")

    def _could_not_record(self, error):
        """The lab's own code failed on this step: the step runs as Keras
        wrote it, without a row, and the run is told (`record_errors`)."""
        message = f"{type(error).__name__}: {error}".strip().splitlines()[0]
        if message not in self.record_errors:
            self.record_errors.append(message)
            warnings.warn(f"The lab could not record a training step ({message}); training goes on "
                          "unchanged, without rows for these steps.", RuntimeWarning, stacklevel=3)

    def _wrap_result(self, metric, original):
        probe = self

        def result(*args, **kwargs):
            value = original(*args, **kwargs)
            state = getattr(probe._local, "state", None)
            if state is not None and not isinstance(value, dict):
                state.results[id(value)] = (metric, value)
            return value

        return result

    def _wrap_metrics_update(self, container, original):
        """The compiled metrics are built by their first update, inside the
        first traced step: build them just before it (what Keras does first
        anyway), so their totals before this batch can be read."""
        probe = self

        def update_state(y_true, y_pred, sample_weight=None):
            state = getattr(probe._local, "state", None)
            if state is not None and not container.built:
                container.build(y_true, y_pred)
                probe._read_new_means(state)
            return original(y_true, y_pred, sample_weight)

        return update_state

    def _wrap_loss_build(self, original):
        """The compiled loss of a model with several outputs builds a tracker
        per output (`<output>_loss`, Keras' `CompileLoss.build`) in the first
        traced step, just before it updates them: their totals are read as
        they are made, so that their columns hold each batch's own value, as
        the other means' do."""
        probe = self

        def build(*args, **kwargs):
            result = original(*args, **kwargs)
            state = getattr(probe._local, "state", None)
            if state is not None:
                probe._read_new_means(state)
            return result

        return build

    def _read_new_means(self, state):
        """Reads the totals of the mean metrics made inside this step, before their first update."""
        skip = self._unread_tracker()
        for metric in leaf_metrics(self.model).values():
            if is_mean(metric) and id(metric) not in state.totals and metric is not skip:
                state.totals[id(metric)] = (tf.convert_to_tensor(metric.total.value),
                                            tf.convert_to_tensor(metric.count.value))
                self._patch(metric, "result", lambda inner, metric=metric: self._wrap_result(metric, inner))

    def _wrap_compute_loss(self, original):
        probe = self

        def compute_loss(*args, **kwargs):
            loss = original(*args, **kwargs)
            state = getattr(probe._local, "state", None)
            if state is not None and loss is not None:
                state.loss = loss
            return loss

        return compute_loss

    def _wrap_update_step(self, name, original, optimizer=None):
        probe = self

        def _backend_update_step(grads, trainable_variables, learning_rate):
            state = getattr(probe._local, "state", None)
            if state is None:
                return original(grads, trainable_variables, learning_rate)
            variables = list(trainable_variables)
            state.pending = None
            state.applies[name] = state.applies.get(name, 0) + 1
            # A read is a snapshot: the update copies the buffer rather than change it.
            # Taken before the weight decay where the optimizer decays (the update is the whole change).
            before = state.decaying.pop(name, None)
            if probe.weights and (before is None or len(before) != len(variables)):
                before = [read_value(v) for v in variables]
            if not state.nested():
                probe._emit_local_square(state, grads)
            result = original(grads, trainable_variables, learning_rate)
            applied = state.pending if state.pending is not None else list(grads)
            state.pending = None
            probe._note_regrouped(variables, applied)
            probe._note_changed_after(optimizer, variables)
            probe._emit_update(state, name, variables, applied, learning_rate, before)
            return result

        return _backend_update_step

    def _wrap_weight_decay(self, name, original):
        """Keras decays the weights (AdamW, `weight_decay=...`) before its
        update step, in the same apply: the snapshot for `update_ratio` is
        taken before the decay, so that the update is the weights' whole change."""
        probe = self

        def _apply_weight_decay(variables):
            state = getattr(probe._local, "state", None)
            if state is not None:
                variables = list(variables)
                state.decaying[name] = [read_value(v) for v in variables]
            return original(variables)

        return _apply_weight_decay

    def _wrap_accumulating(self, original):
        probe = self

        def _backend_apply_gradients(grads, trainable_variables):
            state = getattr(probe._local, "state", None)
            if state is not None:
                state.batch_gradients = True
                pairs = [(variable, grad) for variable, grad in zip(trainable_variables, grads) if grad is not None]
                if pairs:
                    norms = probe._sampled(state, lambda: norms_of(isolated([summed_rows(grad) for _, grad in pairs])),
                                           len(pairs))
                    probe._emit_vector(state, [f"grad_norm/{probe._key(variable)}" for variable, _ in pairs],
                                       norms, combine=hypot)
                    probe._emit(state, "_batch_grad_norm", global_norm(norms), combine=hypot)
            return original(grads, trainable_variables)

        return _backend_apply_gradients

    def _wrap_all_reduce(self, original):
        probe = self

        def _all_reduce_sum_gradients(grads_and_vars):
            reduced = list(original(grads_and_vars))
            state = getattr(probe._local, "state", None)
            if state is not None:
                state.pending = [g for g, _ in reduced]
            return reduced

        return _all_reduce_sum_gradients

    def _wrap_apply(self, optimizer, original, name="optimizer"):
        probe = self

        def apply(grads, trainable_variables=None):
            state = getattr(probe._local, "state", None)
            if state is None:
                return original(grads, trainable_variables)
            grads = list(grads)
            if trainable_variables is not None:
                trainable_variables = list(trainable_variables)
                if not optimizer.built:
                    # Variables cannot be created inside the gate's branch.
                    optimizer.build(trainable_variables)
            variables = trainable_variables if trainable_variables is not None else \
                compat.optimizer_variables_for(optimizer)
            # Here, not in the gated update: a nested graph's slots keep replica 0's value only.
            probe._emit_local_square(state, grads, variables)
            # A LossScaleOptimizer skips an update whose scaled gradients
            # overflow and lowers its scale: its own business, as in bare
            # training. The gate checks the loss; the update's result is
            # still checked after it.
            gated = [] if isinstance(optimizer, keras.optimizers.LossScaleOptimizer) else grads
            skip = probe._gate(state, gated, probe._keys(variables[:len(gated)]) if gated else ())

            ctx = _replica_context()
            guarded = probe._nonfinite_index is not None and ctx is None
            watched = probe._state_variables(optimizer, trainable_variables) if guarded else []
            # An apply() of the user's own may change some gradients inside
            # the gate's branch and pass others on as they came: give it
            # gradients of the branch's graph, so that all those it hands on
            # are of one graph (Keras' cross-replica sum requires it).
            localized = defined_outside_keras(optimizer, "apply") is not None

            def update():
                nonlocal grads
                if localized:
                    grads = [None if g is None else tf.identity(g) for g in grads]
                if not guarded:
                    original(grads, trainable_variables)
                    return tf.constant(False)
                # nonfinite() keeps weights *and* optimizer state finite: a
                # finite gradient can still overflow a slot (Adam's g*g).
                saved = [read_value(v) for v in watched]  # reads are snapshots
                with tf.control_dependencies(saved):
                    original(grads, trainable_variables)
                finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(v)) for v in isolated(
                    read_value(v) for v in watched if v.dtype in ("float16", "bfloat16", "float32", "float64"))])
                gate_open = probe._gate_open()
                if gate_open is not None:  # a closed gate puts nothing back
                    finite = tf.logical_or(finite, tf.logical_not(gate_open))

                def put_back():
                    for variable, value in zip(watched, saved):
                        variable.assign(value)
                    return tf.constant(True)

                return tf.cond(finite, lambda: tf.constant(False), put_back)

            if ctx is None or tf.__internal__.distribute.strategy_supports_no_merge_call():
                overflowed = tf.cond(skip, lambda: tf.constant(False), update)
                if guarded:
                    probe._note_overflow(state, overflowed)
                if not state.nested():
                    state.kept_out.append(tf.logical_or(skip, overflowed))
                    state.kept_out_of.append((state.kept_out[-1], variables))
                probe._emit(state, f"_applied/{name}", 1.0 - tf.cast(tf.logical_or(skip, overflowed), tf.float32),
                            reset=0.0, accumulate=True)
            else:
                # A cond whose branch calls merge_call (the update does) must
                # run in cross-replica context, as Keras' LossScaleOptimizer does.
                def merged(distribution, skip, grads, trainable_variables, states):
                    def update_each():
                        distribution.extended.call_for_each_replica(
                            probe._with_state, args=(states, original, grads, trainable_variables)
                        )
                        return tf.constant(0)

                    skip = distribution.experimental_local_results(skip)[0]
                    tf.cond(skip, lambda: tf.constant(0), update_each)

                # Each replica's state travels with it: call_for_each_replica runs
                # the update on other threads, where the thread-local state is unset.
                ctx.merge_call(merged, args=(skip, grads, trainable_variables, state))
                if not state.nested():
                    state.kept_out.append(skip)
                    state.kept_out_of.append((skip, variables))
                probe._emit(state, f"_applied/{name}", 1.0 - tf.cast(skip, tf.float32), reset=0.0, accumulate=True)

        return apply

    def _forward_state_variables(self):
        """The variables the forward pass may assign (`compat.forward_state_variables`:
        moving statistics, a stateful RNN's state, seed generators' states).
        A frozen layer's weights are not among them."""
        found, seen = [], set()
        for layer in compat.all_layers(self.model):
            for variable in compat.forward_state_variables(layer):
                if id(variable) not in seen:
                    seen.add(id(variable))
                    found.append(variable)
        return found

    def _keep_out_forward_state(self, state):
        """Where a device breakpoint kept the step's update out, puts back
        what its forward pass assigned too (moving statistics that a NaN
        batch made NaN), after anything the step did with them (an EMA copy);
        and the weights whose every update in the step was kept out, as the
        step began: a step may assign weights itself, outside the optimizer
        (SpectralNormalization renormalizes its kernel in the forward pass;
        sharpness-aware minimization adds a NaN batch's perturbation to every
        weight and takes it off again, leaving NaN)."""
        if not state.kept_out:
            return
        kept_out = tf.reduce_any(tf.stack(state.kept_out))
        groups = {}  # the applies that update a weight -> [(weight, value at the step's start)]
        for variable, value in state.weights_at_start:
            covering = tuple(i for i, (_, updated) in enumerate(state.kept_out_of)
                             if any(v is variable for v in updated))
            if covering:
                groups.setdefault(covering, []).append((variable, value))

        def put_back():
            for variable, value in state.forward_state:
                variable.assign(value)
            for covering, pairs in groups.items():
                def restore(pairs=pairs):
                    for variable, value in pairs:
                        variable.assign(value)
                    return tf.constant(True)

                every = tf.reduce_all(tf.stack([state.kept_out_of[i][0] for i in covering]))
                tf.cond(every, restore, lambda: tf.constant(False))
            return tf.constant(True)

        if state.forward_state or groups:
            tf.cond(kept_out, put_back, lambda: tf.constant(False))

    def _state_variables(self, optimizer, trainable_variables):
        """The variables one update may change: the weights it updates and
        the optimizer's slots and `iterations`."""
        if trainable_variables is None:
            trainable_variables = compat.optimizer_variables_for(optimizer)
        found, seen = [], set()
        for variable in list(trainable_variables) + list(optimizer.variables):
            if id(variable) not in seen:
                seen.add(id(variable))
                found.append(variable)
        return found

    def _note_overflow(self, state, overflowed):
        """An update put back because it left a variable non-finite: a nonfinite hit, held."""
        hold = self._hold_variable()
        number = float(self._nonfinite_index + 1)
        self._emit_hit(state, tf.where(overflowed, number, 0.0))
        self._emit(state, "_held", tf.cast(overflowed, tf.float32), reset=0.0, accumulate=True)
        self._emit(state, "_overflow", tf.cast(overflowed, tf.float32), reset=0.0, accumulate=True)
        hold.assign(tf.where(overflowed, 1.0, hold.read_value()))

    def _emit_local_square(self, state, grads, variables=()):
        """This replica's own squared gradient norm, before the cross-replica sum:
        of the gradients alone, not of the values Keras overwrites `variables`
        with (those handed in `grads` where a variable is `overwritten`)."""
        if not self.gradients or _replica_context() is None:
            return
        local = [summed_rows(g) for i, g in enumerate(grads)
                 if g is not None and not (i < len(variables) and overwritten(variables[i]))]
        if local:
            norm = self._sampled(state, lambda: tf.reshape(global_norm(norms_of(isolated(local))), [1]), 1)
            self._emit(state, "_local_grad_norm", norm[0], combine=hypot)

    def _with_state(self, state, function, *args):
        self._local.state = state
        try:
            return function(*args)
        finally:
            self._local.state = None

    # ---- breakpoints on the device ---------------------------------------

    def _hold_variable(self):
        if self._hold is None:
            self._hold = self._make_variable("lab_hold", 0.0)
        return self._hold

    def _gate(self, state, grads, keys=()):
        """Evaluates the device breakpoints; returns whether to skip this update.
        With `nonfinite()`, puts in the row which gradients (by `keys`) were
        not finite: a hit keeps the update out, and with it the gradients'
        norms, so the host names the culprits from these."""
        hold = self._hold_variable()
        loss = None
        present = [i for i, g in enumerate(grads) if g is not None]
        read = isolated([state.loss] + [summed_rows(grads[i]) for i in present])
        applied = read[1:]
        if self._nonfinite_index is not None and len(keys) == len(grads) and present:
            flags = tf.stack([tf.logical_not(tf.reduce_all(tf.math.is_finite(a))) for a in applied])
            self._emit_vector(state, [f"{NONFINITE_GRADIENT}{keys[i]}" for i in present],
                              _all_reduce(tf.cast(flags, tf.float32), "MAX"), reset=0.0,
                              combine=tf.maximum)
        if read[0] is not None:
            loss = tf.reduce_mean(tf.cast(unscale_loss_for_distribution(read[0]), tf.float32))
            loss = _all_reduce(loss, "MEAN")
        else:
            for point in self.breakpoints:
                if getattr(point, "reads_loss", False):
                    self.trace_notes["no_loss"].setdefault(point.name, "")
        hit_index = tf.constant(0.0)
        for index in reversed(range(len(self.breakpoints))):
            flag = tf.cast(self.breakpoints[index].check(loss, applied, self._make_variable), tf.float32)
            flag = _all_reduce(flag, "MAX")
            hit_index = tf.where(flag > 0, float(index + 1), hit_index)
        held = tf.identity(hold.read_value())
        gate_open = self._gate_open()
        if gate_open is not None:  # closed: no hit, nothing held, and the hold let go
            hit_index = tf.where(gate_open, hit_index, 0.0)
            held = tf.where(gate_open, held, 0.0)
        new_hit = tf.where(held > 0, 0.0, hit_index)
        self._emit_hit(state, new_hit)
        skip = tf.logical_or(held > 0, hit_index > 0)
        self._emit(state, "_held", tf.cast(skip, tf.float32), reset=0.0, accumulate=True)
        hold.assign(tf.where(skip, 1.0, 0.0))
        return skip

    def _gate_open(self):
        """A boolean tensor, False where a traced gate must let every update
        through as if it were not there; None: always open (a Recorder's
        step is dropped with its hooks, see `lab.hooks`)."""
        return None

    def _emit_hit(self, state, number):
        """Puts the number of the device breakpoint that hit this update (0:
        none), and has the step tell the host on a hit (`_tell_hits`)."""
        self._emit(state, "_hit", number, reset=0.0, accumulate=True)
        self._tell_hits(tf.cast(number, tf.float32))

    def _tell_hits(self, value):
        """Has the step tell the host when a device breakpoint hits (`value`
        > 0): a `tf.cond` runs a host call on a hit only. The recorder then
        reads the rows at that batch's end, and fit() stops there, where
        otherwise it learned of the hit at its next read (`flush_every`)
        and the batches in between ran with their updates held, counted by
        Keras' logs and seen by other callbacks. Where a host call cannot
        run (inside XLA, in a replica of a distribution strategy) the step
        tells nothing, and the hit's event counts those batches."""
        if in_xla_trace() or _replica_context() is not None:
            return

        def tell():
            return tf.numpy_function(self._told_hit, [value], tf.float32, stateful=True, name="lab_tell_hit")

        tf.cond(value > 0, tell, lambda: value)

    def _told_hit(self, value):
        self.hit_was_told = True
        return np.float32(value)

    def release(self):
        """Lets updates through again after a device breakpoint held them."""
        if self._hold is not None:
            self._hold.assign(0.0)
        for point in self.breakpoints:
            point.reset(self)

    # ---- the row -------------------------------------------------------------

    def _make_variable(self, name, initial):
        def create(strategy):
            with tf.init_scope():
                scope = strategy.scope() if strategy is not None else _NullScope()
                with scope:
                    return tf.Variable(
                        initial,
                        dtype=tf.float32,
                        trainable=False,
                        name=name,
                        aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
                    )

        return _in_cross_replica_context(create)

    def _emit(self, state, name, value, reset=np.nan, accumulate=False, combine=None):
        """Puts one value of the step: `accumulate` adds to what the step
        put before, `combine(old, new)` merges with it (reset: NaN)."""
        value = tf.cast(value, tf.float32)
        if state.nested():
            slot = self._slots.get(name)
            if slot is None:
                slot = self._slots[name] = (self._make_variable("lab_slot", reset), reset)
            if combine is not None:
                slot[0].assign(combine(slot[0].read_value(), value))
            else:
                (slot[0].assign_add if accumulate else slot[0].assign)(value)
            state.slotted[name] = (slot[0], slot[1], combine)
        elif combine is not None and name in state.values:
            state.values[name] = combine(scalar(state.values[name]), value)
        elif accumulate and name in state.values:
            state.values[name] = scalar(state.values[name]) + value
        else:
            state.values[name] = value

    def _emit_vector(self, state, names, vector, reset=np.nan, combine=None):
        """Puts the values `names` of the step, computed together as
        `vector` (one per name), as `_emit` puts each; kept whole."""
        names = tuple(names)
        vector = tf.cast(vector, tf.float32)
        if state.nested():
            slot = self._slots.get(names)
            if slot is None:
                slot = self._slots[names] = (self._make_variable("lab_slots", np.full(len(names), reset, np.float32)),
                                             reset)
            slot[0].assign(combine(slot[0].read_value(), vector) if combine is not None else vector)
            state.slotted[names] = (slot[0], slot[1], combine)
            return
        old = [state.values.get(name) for name in names]
        if combine is not None and any(v is not None for v in old):
            whole = whole_vector(old)
            if whole is not None:
                vector = combine(whole, vector)  # an optimizer applied again: one op for all
            else:
                for i, name in enumerate(names):
                    self._emit(state, name, vector[i], reset=reset, combine=combine)
                return
        for i, name in enumerate(names):
            state.values[name] = Part(vector, i)

    def _emit_update(self, state, name, variables, grads, learning_rate, before):
        self.traced_in_xla = self.traced_in_xla or in_xla_trace()
        if name not in state.optimizers:
            state.optimizers.append(name)
        self._emit(state, f"_lr/{name}", learning_rate)
        self._emit(state, "_updates", 1.0, reset=0.0, accumulate=True)
        self._emit(state, f"_updates/{name}", 1.0, reset=0.0, accumulate=True)
        if not (self.gradients or self.weights):
            return
        record_gradients = self.gradients and not state.batch_gradients
        keys = self._keys(variables)
        state.updated.update(keys)
        present = []
        if record_gradients:
            present = [i for i in range(min(len(grads), len(variables))) if grads[i] is not None]
        # Every norm of the update in one norms_of: one overflow check for all.
        size = len(present) + (len(variables) * (1 if before is None else 2) if self.weights and variables else 0)
        if not size:
            return
        on_host = self._finishes_on_host(state)
        taken = self._sampled(state, lambda: (encoded_norms_of if on_host else norms_of)(
            self._update_tensors(present, grads, variables, before)), size)
        if on_host:
            self._emit_encoded_update(state, keys, present, variables, before, taken)
            return
        norms = taken
        if present:
            # Several applies of one optimizer in a step: the norm covers them all.
            grad_norms = norms[:len(present)] if size > len(present) else norms
            self._emit_vector(state, [f"grad_norm/{keys[i]}" for i in present], grad_norms, combine=hypot)
        if self.weights and variables:
            start, count = len(present), len(variables)
            weight_norms = norms[start:start + count] if size > count else norms
            self._emit_vector(state, [f"weight_norm/{key}" for key in keys], weight_norms)
            if before is not None:
                if self.FINISHES_ON_HOST:  # the host divides (`_finish`), whatever the trace
                    self._emit_vector(state, [f"{_UPDATE_NORM}{key}" for key in keys], norms[start + count:])
                else:
                    self._emit_vector(state, [f"update_ratio/{key}" for key in keys],
                                      tf.math.divide_no_nan(norms[start + count:], weight_norms))

    def _measures(self):
        """With `norms_every`, whether the step traced now takes its norms:
        a bool tensor, from the probe's own count of the steps it saw (the
        first, then every `norms_every`-th), read at the step's start and
        advanced once its row is written; None: every step does. The count
        is one variable for every replica, so all replicas take the same
        branch."""
        if self.norms_every == 1:
            return None
        if self._steps_seen is None:
            self._steps_seen = _in_cross_replica_context(_step_counter)
        return tf.equal(tf.math.floormod(self._steps_seen.read_value(), self.norms_every), 0)

    def _sampled(self, state, take, size):
        """`take()` (a 1-D float32 tensor of `size` norms), computed only in
        a step that takes its norms (`_measures`); NaN in the others. The
        reads and reductions are inside the branch, so the other steps
        run none of them."""
        if state.measures is None:
            return take()
        return tf.cond(state.measures, take, lambda: tf.fill([size], tf.constant(np.nan, tf.float32)))

    def _update_tensors(self, present, grads, variables, before):
        """The tensors an update's norms are taken of, in order: the gradients
        at `present`, then with weights each variable's value and, when
        `before` (their values before the update) is given, its update;
        each read as the lab's own computations must read it (`isolated`)."""
        tensors = [summed_rows(grads[i]) for i in present]
        if not (self.weights and variables):
            return isolated(tensors)
        values = [read_value(v) for v in variables]
        read = isolated(tensors + values + list(before or []))
        tensors = read[:len(present) + len(values)]
        if before is not None:
            after, earlier = read[len(present):len(tensors)], read[len(tensors):]
            tensors += [tf.cast(v, tf.float32) - tf.cast(b, tf.float32) for v, b in zip(after, earlier)]
        return tensors

    # ---- values the host finishes ------------------------------------------

    def _finishes_on_host(self, state):
        """Whether this step's norms go into the row encoded (`encoded_norms_of`),
        for `read()` to finish: in the step's own graph, outside XLA (whose
        program is kept as it was: a changed one can fuse the step's own ops
        differently), or under an XLA that compiles the norms' overflow
        check slowly (`lab.compat.slow_xla_cpu_trace`: about 100 us a step
        of the benchmark MLP at spe=32, 15% of it). The step's reads are
        isolated (`lab.compat.isolated`) either way."""
        return self.FINISHES_ON_HOST and not state.nested() and (not in_xla_trace() or slow_xla_cpu_trace())

    def _emit_encoded_update(self, state, keys, present, variables, before, encoded):
        """Puts an update's norms as they came from `encoded_norms_of`: one
        vector, whole, in the row (no slice, no square root, no divide in
        the step). A second apply of the optimizer in the step decodes what
        the first put, on the device, to combine the two."""
        names = [f"grad_norm/{keys[i]}" for i in present]
        if self.weights and variables:
            names += [f"weight_norm/{key}" for key in keys]
            if before is not None:
                names += [f"{_UPDATE_NORM}{key}" for key in keys]
        count = len(present)
        earlier = [state.values.pop(ENCODED + name, None) for name in names[:count]]
        if any(value is not None for value in earlier) or any(name in state.values for name in names[:count]):
            # The optimizer applied before in this step: its norms, decoded
            # (one vector when they are one), combine with these.
            first = earlier[0]
            if all(isinstance(v, Part) and v.vector is first.vector and v.index == i for i, v in enumerate(earlier)):
                decoded = decode_norms(first.vector[:count])
                earlier = [Part(decoded, i) for i in range(count)]
            else:
                earlier = [None if v is None else decode_norms(scalar(v)) for v in earlier]
            for name, value in zip(names, earlier):
                if value is not None:
                    state.values[name] = value
            self._emit_vector(state, names[:count], decode_norms(encoded[:count]), combine=hypot)
            start = count
        else:
            start = 0
        for i in range(start, len(names)):
            state.values.pop(names[i], None)
            state.values[ENCODED + names[i]] = Part(encoded, i)

    def _finish(self, rows):
        """Turns the row's encoded norms into norms and update ratios (what
        the step would have computed itself, bit for bit), on the host.
        Notes in `infinite` (column -> first row) the columns it finished
        that came out inf (`encoded_norms_of`)."""
        self.infinite = {}
        self.weightless = {}
        for name in [n for n in rows if n.startswith(WEIGHTLESS)]:
            self._note_weightless(name[len(WEIGHTLESS):], rows.pop(name) > 0)
        for name in [n for n in rows if n.startswith(ENCODED)]:
            plain = name[len(ENCODED):]
            norms = decode_norms(rows.pop(name))
            finished = np.isinf(norms)
            if plain in rows:  # written plain where this trace combined applies
                finished &= np.isnan(rows[plain])
                norms = np.where(np.isnan(rows[plain]), norms, rows[plain])
            if finished.any():
                column = f"update_ratio/{plain[len(_UPDATE_NORM):]}" if plain.startswith(_UPDATE_NORM) else plain
                self.infinite[column] = int(np.flatnonzero(finished)[0])
            rows[plain] = norms
        for name in [n for n in rows if n.startswith(MeanParts.FIRST)]:
            key = name[len(MeanParts.FIRST):]
            total, count, total_before, count_before = (rows.pop(n) for n in MeanParts.names(key))
            total, count = total - total_before, count - count_before
            self._note_weightless(key, count <= 0)
            with np.errstate(divide="ignore", invalid="ignore"):
                rows[key] = np.where(count > 0, total / np.where(count > 0, count, 1), np.nan).astype(np.float32)
        for name in [n for n in rows if n.startswith(_UPDATE_NORM)]:
            key = name[len(_UPDATE_NORM):]
            update, weight = rows.pop(name), rows.get(f"weight_norm/{key}")
            if weight is not None:
                with np.errstate(divide="ignore", invalid="ignore"):
                    ratio = np.where(weight == 0, np.float32(0.0), update / weight).astype(np.float32)
                rows[f"update_ratio/{key}"] = ratio
        return rows

    def _note_weightless(self, key, none):
        """Notes in `weightless` (column -> first row) a mean metric's first
        row whose batch changed its count by nothing (`none`, a bool per row)."""
        if none.any():
            self.weightless[key] = int(np.flatnonzero(none)[0])

    def _metric_totals(self):
        totals = {}
        # Keras' own train_step feeds its loss tracker the loss compute_loss
        # returned: the tracker's batch value is that loss, nothing to check.
        skip = self._unread_tracker()
        for metric in watched_metrics(self.model):
            if is_mean(metric) and metric is not skip:
                totals[id(metric)] = (tf.convert_to_tensor(metric.total.value), tf.convert_to_tensor(metric.count.value))
        return totals

    def _unread_tracker(self):
        """Keras' loss tracker when its batch value needs no reading (Keras'
        own step feeds it compute_loss's value), else None. A tracker of the
        model's own named "loss" is read: its value is the model's to define."""
        tracker = leaf_metrics(self.model).get("loss")
        if _keras_defines(type(self.model), "train_step") and is_keras_loss_tracker(self.model, tracker):
            return tracker
        return None

    def _metric_delta(self, metric, before, state, column=None):
        """The batch's own value of a mean metric: the change of its total
        over the change of its count. In the step's own graph, outside XLA
        and on one replica, the four values go into the row as they are
        (`MeanParts`) and `read()` divides, bit for bit as the step would."""
        total, count, total_before, count_before = isolated([metric.total.value, metric.count.value, *before])
        parts = MeanParts(total, count, total_before, count_before)
        if self._finishes_on_host(state) and _replica_context() is None and parts.float32():
            return parts
        value, count = parts.on_device()
        if column is not None:
            state.values[WEIGHTLESS + column] = tf.cast(count <= 0, tf.float32)
        return value

    def _logged_metric(self, state, key, value, by_name):
        """The metric whose `result()` the step returned under `key`: found
        by the tensor itself (a VAE returns its `total_loss` tracker under
        "loss"), else by name."""
        found = state.results.get(id(value))
        if found is not None and found[1] is value:
            return found[0]
        return by_name.get(key)

    def _record(self, state, totals, logs, batch_size):
        self.traced_in_xla = self.traced_in_xla or in_xla_trace()
        values = {"_batch_size": _all_reduce(batch_size, "SUM")}
        by_name = leaf_metrics(self.model)
        tracker = by_name.get("loss")
        tracker_loss = None
        if tracker is not None and id(tracker) in totals:
            tracker_loss = self._metric_delta(tracker, totals[id(tracker)], state)
        logged = dict(_flat_logs(logs))
        state.local_batch_size = batch_size
        if (state.loss is not None and "loss" in logged and tracker_loss is not None
                and not is_keras_loss_tracker(self.model, tracker)
                and self._logged_metric(state, "loss", logged["loss"], by_name) is tracker):
            # compute_loss ran, and the model logs a tracker of its own as
            # its loss (keras-io's masked language model: compute_loss
            # returns the sum of the tokens' losses and feeds their mean to
            # that tracker): the column holds the tracker's batch value, as
            # Keras logs it.
            values["loss"] = tracker_loss
        elif state.loss is not None:
            values["loss"] = _batch_loss(state.loss, batch_size)
            if tracker_loss is not None:
                values["_tracker_loss"] = tracker_loss
        elif len(state.loss_scaling.scaled) == 1 and not state.loss_scaling.unscaled:
            # One Keras loss object called by the step itself, its value
            # scaled by 1/replicas: if the step logs that value as its loss,
            # the recorder records this one instead (`LOSS_OBJECT_SCALED_WARNING`).
            values[LOSS_OBJECT] = _batch_loss(state.loss_scaling.scaled[0], batch_size)
        elif "loss" not in logged and tracker_loss is not None:
            values["loss"] = tracker_loss
            self.loss_of_tracker = True
        for key, value in logged.items():
            if key in values:
                continue
            metric = self._logged_metric(state, key, value, by_name)
            if metric is not None and id(metric) in totals:
                values[key] = self._metric_delta(metric, totals[id(metric)], state, column=key)
                continue
            tensor = _scalar_tensor(value)
            if tensor is None:
                vector = _vector_tensor(value)
                if vector is None:
                    continue
                # A vector (F1Score(average=None)): one column per element.
                vector = _all_reduce(tf.cast(isolated([vector])[0], tf.float32), "MEAN")
                for i in range(vector.shape[0]):
                    column = schema.element_column(key, i)
                    values[column] = vector[i]
                    if metric is not None:
                        self.running_columns.add(column)
                continue
            if metric is not None:
                # Not a mean: its batch value cannot be read off its state.
                self.running_columns.add(key)
            values[key] = _all_reduce(tf.cast(isolated([tensor])[0], tf.float32), "MEAN")
        for key in [k for k, v in values.items() if isinstance(v, MeanParts)]:
            for name, part in values.pop(key).columns(key):
                values[name] = part
        produced = dict(state.values)
        for key, (slot, reset, combine) in state.slotted.items():
            read = tf.identity(slot.read_value())
            with tf.control_dependencies([read]):
                slot.assign(tf.fill(tf.shape(read), np.float32(reset)))
            if isinstance(key, tuple):
                pairs = [(name, Part(read, i)) for i, name in enumerate(key)]
            else:
                pairs = [(key, read)]
            for name, value in pairs:
                if name not in produced:
                    produced[name] = value
                elif combine is not None:
                    produced[name] = combine(scalar(produced[name]), scalar(value))
                else:
                    produced[name] = scalar(produced[name]) + scalar(value)
        self._finish_row(state, values, produced)
        self.stepped_columns.update(name[len(ENCODED):] if name.startswith(ENCODED) else name for name in values)
        self._write(values)

    def _finish_row(self, state, values, produced):
        self._replica_values(state, values, produced.pop("_local_grad_norm", None))
        several = len(state.optimizers) > 1
        for name in state.optimizers:
            values[schema.learning_rate_column(name, several)] = produced.pop(f"_lr/{name}")
            if state.applies.get(name, 0) > 1:
                values[schema.per_optimizer_column(schema.APPLIES_PREFIX, name)] = float(state.applies[name])
        # An update went in where the optimizer updated (not on a step that
        # only accumulates, nor on a LossScaleOptimizer's skipped overflow)
        # and no device breakpoint kept it out.
        applied = {name[len("_applied/"):]: produced.pop(name) for name in list(produced) if name.startswith("_applied/")}
        own = {name[len("_updates/"):]: produced.pop(name) for name in list(produced) if name.startswith("_updates/")}
        if several:
            for name, value in applied.items():
                # A MultiOptimizer applied under `name` updates through its parts (`name/<part>`).
                parts = [own[key] for key in own if key == name or key.startswith(f"{name}/")]
                went = tf.minimum(value, tf.reduce_max(tf.stack(parts))) if parts else tf.zeros_like(value)
                values[schema.per_optimizer_column(schema.UPDATED_PREFIX, name)] = tf.cast(went > 0, tf.float32)
        updates = produced.get("_updates")  # stays in the row: the host's grad_norm needs it
        if updates is None and tf.executing_eagerly() and getattr(self, "_optimizer_names", None):
            # Run eagerly, a step with no update made no update's values: none went in.
            produced["_updates"] = updates = tf.constant(0.0)
        batch_norm = produced.pop("_batch_grad_norm", None)
        if updates is not None:
            went_in = updates if not applied else tf.minimum(updates, tf.add_n(list(applied.values())))
            values["updated"] = tf.cast(went_in > 0, tf.float32)
        if self.gradients and batch_norm is not None:
            values["grad_norm"] = batch_norm
        # Otherwise `read()` computes grad_norm from the per-variable norms, on the host.
        values.update(produced)

    def _replica_values(self, state, values, local_norm):
        """Per-replica loss and gradient norm (each replica on its own share of
        the batch, before the all-reduce), and `replica_skew`: the spread of
        the replicas' losses."""
        ctx = _replica_context()
        if ctx is None:
            return
        replicas = ctx.num_replicas_in_sync
        if state.loss is not None:
            local = tf.reduce_mean(tf.cast(unscale_loss_for_distribution(isolated([state.loss])[0]), tf.float32))
            share = tf.cast(getattr(state, "local_batch_size", 1), tf.float32)
            local = tf.where(share > 0, local, np.nan)  # a replica with no samples has no loss
            losses = ctx.all_gather(tf.reshape(local, [1]), axis=0)
            held = ctx.all_gather(tf.reshape(share, [1]), axis=0) > 0
            for index in range(replicas):
                values[f"loss/replica_{index}"] = losses[index]
            spread = (tf.reduce_max(tf.where(held, losses, -np.inf))
                      - tf.reduce_min(tf.where(held, losses, np.inf)))
            values["replica_skew"] = tf.where(tf.reduce_any(held), spread, np.nan)
        if local_norm is not None:
            # Each replica differentiates its loss scaled by 1/replicas (Keras 3.8+).
            scale = replicas if KERAS_SCALES_LOSS else 1
            norms = ctx.all_gather(tf.reshape(local_norm * scale, [1]), axis=0)
            for index in range(replicas):
                values[f"grad_norm/replica_{index}"] = norms[index]

    def _keys(self, variables):
        """Column keys of `variables`: paths, with `#2`, `#3`, ... for repeats
        in `model.trainable_variables` order (also for a model that `fit()`
        builds, whose variables did not exist when the probe was installed)."""
        if any(id(v) not in self._variable_keys for v in variables):
            known = list(self.model.trainable_variables)
            listed = {id(v) for v in known}
            self._variable_keys = variable_keys(known + [v for v in variables if id(v) not in listed])
        return [self._variable_keys[id(v)] for v in variables]

    def _key(self, variable):
        return self._keys([variable])[0]

    def _expected_columns(self, values):
        """The buffer's columns: what this step produced plus every variable key,
        so a variable with no gradient on some step reads as missing (NaN)."""
        columns = list(values)
        if self.gradients:
            # Encoded like the step's own where the step encodes any (the host
            # finishes a missing one as NaN either way).
            prefix = ENCODED if any(name.startswith(ENCODED) for name in values) else ""
            variables = self.model.trainable_variables
            set_apart = {key for variable, key in zip(variables, self._keys(variables)) if overwritten(variable)}
            columns += [f"{prefix}grad_norm/{k}" for k in self._variable_keys.values()
                        if f"grad_norm/{k}" not in values and f"{ENCODED}grad_norm/{k}" not in values
                        and k not in set_apart]
        return _row_order(list(dict.fromkeys(columns)), values)

    def _write(self, values):
        if self.buffer is None:
            # Every replica reaches this point in the same step, so each takes
            # part in the merge that creates the buffer once.
            columns = self._expected_columns(values)
            buffer = _in_cross_replica_context(lambda strategy: StepBuffer(len(columns), self.capacity, strategy))
            with self._lock:
                if self.buffer is None:
                    self.columns, self.buffer = columns, buffer
        if not tf.executing_eagerly():
            self._buffer_traced = True
        unknown = [name for name in values if name not in self.columns]
        values, converted = self._reconciled(values)
        # A later trace's note of weightless batches the first did not make: no value to keep.
        unknown = [name for name in unknown if name not in converted and not name.startswith(WEIGHTLESS)]
        if unknown and tf.executing_eagerly() and not self._buffer_traced and _replica_context() is None:
            # A step run eagerly makes only the branches it takes: a first
            # step that did not update (gradient accumulation, a
            # LossScaleOptimizer's skipped overflow) has no update's values.
            # No traced step holds the buffer yet: widen it, rows kept.
            self._widen(unknown)
            unknown = []
        if unknown:
            warnings.warn(
                f"The training step produced new values {unknown} after recording "
                "started; they are not recorded. Use a new Recorder to record them.",
                RuntimeWarning,
                stacklevel=3,
            )
        nan = tf.constant(np.nan, tf.float32)
        row = vector_of([values.get(c, nan) for c in self.columns])
        self.buffer.write(row)
        if self._steps_seen is not None:
            # After the row, not at the step's start: a step that never got
            # its batch (the end of the data inside an execution) counts none.
            with tf.control_dependencies([row]):
                self._steps_seen.assign_add(1)

    def _widen(self, names):
        """A buffer with `names` as more columns, holding the unread rows of
        the old one (NaN in the new columns); only where no traced step
        captured the old one."""
        old, columns = self.buffer, self.columns + list(names)
        try:
            rows = old.read_new()
        except RuntimeError:  # rows overwritten before a read: the ring keeps the newest
            rows = old.values.numpy()[np.arange(old.count.numpy() - old.capacity, old.count.numpy()) % old.capacity]
        buffer = StepBuffer(len(columns), self.capacity)
        for row in rows:
            buffer.write(np.concatenate([row, np.full(len(names), np.nan, np.float32)]))
        with self._lock:
            self.columns, self.buffer = columns, buffer

    def _reconciled(self, values):
        """`values` in the form of the row's columns, which the first trace
        fixed: a later trace (under XLA after a mode switch, or one that
        found a metric's totals the first did not) may give a norm plain
        where the row holds it encoded, or the other way, and a mean
        metric's value where the row holds its total and count, or the
        other way. Each converts exactly: a plain norm n is encoded as -n
        (`decode_norms` gives n back), a value v as total v over count 1.
        Returns the values and the names that went in converted."""
        converted = set()
        missing = [c for c in self.columns if c not in values]
        if not missing:
            return values, converted
        values = dict(values)
        for column in missing:
            if column.startswith(ENCODED) and column[len(ENCODED):] in values:
                source = column[len(ENCODED):]
                values[column] = tf.negative(tf.cast(scalar(values[source]), tf.float32))
            elif ENCODED + column in values:
                source = ENCODED + column
                values[column] = decode_norms(tf.cast(scalar(values[source]), tf.float32))
            elif column.startswith(MeanParts.FIRST) and column[len(MeanParts.FIRST):] in values:
                source = column[len(MeanParts.FIRST):]
                value = tf.cast(scalar(values[source]), tf.float32)
                for name, part in zip(MeanParts.names(source), (value, 1.0, 0.0, 0.0)):
                    values[name] = tf.constant(part, tf.float32) if isinstance(part, float) else part
            elif MeanParts.FIRST + column in values:
                source = MeanParts.FIRST + column
                values[column] = MeanParts(*(values[name] for name in MeanParts.names(column))).on_device()[0]
                converted.update(MeanParts.names(column))
            else:
                continue
            converted.add(source)
        return values, converted

    def ensure_capacity(self, steps_per_execution):
        """Raises the ring's size so one execution never overwrites unread rows."""
        self.capacity = max(self.capacity, 4 * int(steps_per_execution))

    def read(self):
        """Rows written since the last read: a dict column -> float32 array."""
        if self.buffer is None:
            return {}
        block = self.buffer.read_new()
        rows = self._finish({name: block[:, i] for i, name in enumerate(self.columns)})
        if self.gradients and "grad_norm" not in rows and "_updates" in rows:
            total = total_grad_norm(rows, rows["_updates"], self.stepped_columns)
            if total is not None:
                rows["grad_norm"] = total
        return rows


def _row_order(columns, values):
    """`columns` with the step's scalars first and then each vector of
    `Part`s in its own order, so that `vector_of` writes the row with one
    stack and one concat (no gather)."""
    scalars = [c for c in columns if not isinstance(values.get(c), Part)]
    parts = sorted((c for c in columns if isinstance(values.get(c), Part)),
                   key=lambda c: (_first_seen(values, values[c].vector), values[c].index))
    return scalars + parts


def _first_seen(values, vector):
    return next(i for i, value in enumerate(values.values()) if isinstance(value, Part) and value.vector is vector)


class _NullScope:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

