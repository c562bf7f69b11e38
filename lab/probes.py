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

Probes patch instance attributes only and restore them on `uninstall()`.
Their state (the buffer) lives on the probe, never on the model.
"""

import threading
import warnings

import keras
import numpy as np
import tensorflow as tf

from lab.buffer import StepBuffer

try:
    from keras.src.losses.loss import unscale_loss_for_distribution

    KERAS_SCALES_LOSS = True
except ImportError:  # Keras < 3.7 does not scale the loss by the replica count.
    KERAS_SCALES_LOSS = False

    def unscale_loss_for_distribution(value):
        return value

_PATCHED = "_lab_probe"


def variable_keys(variables):
    """Maps each variable (by id) to its path, with `#2`, `#3`, ... for repeats."""
    keys, seen = {}, {}
    for variable in variables:
        path = getattr(variable, "path", None) or variable.name
        seen[path] = seen.get(path, 0) + 1
        keys[id(variable)] = path if seen[path] == 1 else f"{path}#{seen[path]}"
    return keys


def find_optimizers(model):
    """The optimizers that may update `model`, named by the attribute holding them.

    A model whose custom `compile()` keeps its own optimizers (`d_opt`,
    `g_opt`) still gets a default `model.optimizer`; it is listed too, and
    simply never produces a row value when it does not update.
    """
    found = {}
    for name, value in vars(model).items():
        if isinstance(value, keras.optimizers.Optimizer) and name != "_optimizer":
            found[name] = value
    optimizer = getattr(model, "optimizer", None)
    if isinstance(optimizer, keras.optimizers.Optimizer) and all(
        optimizer is not o for o in found.values()
    ):
        found = {"optimizer": optimizer, **found}
    return found


def leaf_metrics(model):
    """Maps the names Keras logs under to metric objects (compiled metrics flattened)."""
    names = {}
    for metric in model.metrics:
        flat = getattr(metric, "_flat_metrics", None)
        if flat is None:
            names.setdefault(metric.name, metric)
            continue
        for group in list(flat) + list(getattr(metric, "_flat_weighted_metrics", []) or []):
            if not group:
                continue
            for leaf in group.metrics:
                name = f"{group.output_name}_{leaf.name}" if group.output_name else leaf.name
                names.setdefault(name, leaf)
    return names


def _is_mean(metric):
    return isinstance(metric, keras.metrics.Mean) and hasattr(metric, "total") and hasattr(metric, "count")


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


def _batch_size(data):
    leaves = [t for t in tf.nest.flatten(data) if t is not None]
    if not leaves:
        return tf.constant(np.nan, tf.float32)
    return tf.cast(tf.shape(leaves[0])[0], tf.float32)


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


class _StepState:
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

    def nested(self):
        return self.graph is not None and tf.compat.v1.get_default_graph() is not self.graph


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
    """

    def __init__(self, model, gradients=False, weights=False, breakpoints=(), capacity=1024):
        self.model = model
        self.gradients = gradients
        self.weights = weights
        self.breakpoints = [b for b in breakpoints if getattr(b, "on_device", False)]
        self.capacity = capacity
        self.columns = None
        self.buffer = None
        self._local = threading.local()
        self._lock = threading.Lock()
        self._patches = []
        self._variable_keys = {}
        self._optimizer_names = []
        self._slots = {}
        self._hold = None

    @property
    def installed(self):
        return bool(self._patches)

    # ---- installing --------------------------------------------------------

    def install(self):
        """Patches the model's and optimizers' methods (instance attributes only)."""
        if self.installed:
            return
        model = self.model
        if getattr(model.train_step, _PATCHED, None) is not None:
            raise RuntimeError(
                "This model is already watched by another lab Recorder or Dashboard. "
                "Pass one of them to fit(), or call `.detach()` on the other first."
            )
        self._variable_keys = variable_keys(model.trainable_variables)
        self._patch(model, "train_step", self._wrap_train_step(model.train_step))
        self._patch(model, "compute_loss", self._wrap_compute_loss(model.compute_loss))
        optimizers = find_optimizers(model)
        self._optimizer_names = list(optimizers)
        for name, optimizer in optimizers.items():
            if self.breakpoints:
                self._patch(optimizer, "apply", self._wrap_apply(optimizer, optimizer.apply))
            inner = getattr(optimizer, "inner_optimizer", None) or optimizer
            if getattr(inner, "gradient_accumulation_steps", None) and self.gradients:
                # Updates happen every k-th step; each row still shows its batch's gradient.
                self._patch(inner, "_backend_apply_gradients",
                            self._wrap_accumulating(inner._backend_apply_gradients))
            self._patch(inner, "_backend_update_step", self._wrap_update_step(name, inner._backend_update_step))
            if hasattr(inner, "_all_reduce_sum_gradients"):
                self._patch(
                    inner,
                    "_all_reduce_sum_gradients",
                    self._wrap_all_reduce(inner._all_reduce_sum_gradients),
                )

    def uninstall(self):
        """Restores every patched method."""
        while self._patches:
            target, name, previous = self._patches.pop()
            if previous is _MISSING:
                try:
                    object.__delattr__(target, name)
                except AttributeError:
                    pass
            else:
                object.__setattr__(target, name, previous)

    def _patch(self, target, name, replacement):
        previous = target.__dict__.get(name, _MISSING)
        setattr(replacement, _PATCHED, self)
        object.__setattr__(target, name, replacement)
        self._patches.append((target, name, previous))

    # ---- wrappers ----------------------------------------------------------

    def _wrap_train_step(self, original):
        probe = self

        def train_step(data):
            state = _StepState()
            probe._local.state = state
            try:
                totals = probe._metric_totals()
                logs = original(data)
                probe._record(state, totals, logs, _batch_size(data))
            finally:
                probe._local.state = None
            return logs

        return train_step

    def _wrap_compute_loss(self, original):
        probe = self

        def compute_loss(*args, **kwargs):
            loss = original(*args, **kwargs)
            state = getattr(probe._local, "state", None)
            if state is not None and loss is not None:
                state.loss = loss
            return loss

        return compute_loss

    def _wrap_update_step(self, name, original):
        probe = self

        def _backend_update_step(grads, trainable_variables, learning_rate):
            state = getattr(probe._local, "state", None)
            if state is None:
                return original(grads, trainable_variables, learning_rate)
            variables = list(trainable_variables)
            state.pending = None
            before = [tf.identity(v.value) for v in variables] if probe.weights else None
            if not state.nested():
                probe._emit_local_square(state, grads)
            result = original(grads, trainable_variables, learning_rate)
            applied = state.pending if state.pending is not None else list(grads)
            state.pending = None
            probe._emit_update(state, name, variables, applied, learning_rate, before)
            return result

        return _backend_update_step

    def _wrap_accumulating(self, original):
        probe = self

        def _backend_apply_gradients(grads, trainable_variables):
            state = getattr(probe._local, "state", None)
            if state is not None:
                state.batch_gradients = True
                squares = []
                for variable, grad in zip(trainable_variables, grads):
                    if grad is not None:
                        square = tf.reduce_sum(tf.square(tf.cast(grad, tf.float32)))
                        squares.append(square)
                        probe._emit(state, f"grad_norm/{probe._key(variable)}", tf.sqrt(square))
                if squares:
                    probe._emit(state, "_batch_grad_square", tf.add_n(squares), reset=0.0, accumulate=True)
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

    def _wrap_apply(self, optimizer, original):
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
            # Here, not in the gated update: a nested graph's slots keep replica 0's value only.
            probe._emit_local_square(state, grads)
            skip = probe._gate(state, grads)

            def update():
                original(grads, trainable_variables)
                return tf.constant(0)

            ctx = _replica_context()
            if ctx is None or tf.__internal__.distribute.strategy_supports_no_merge_call():
                tf.cond(skip, lambda: tf.constant(0), update)
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

        return apply

    def _emit_local_square(self, state, grads):
        """This replica's own squared gradient norm, before the cross-replica sum."""
        if not self.gradients or _replica_context() is None:
            return
        local = [tf.reduce_sum(tf.square(tf.cast(g, tf.float32))) for g in grads if g is not None]
        if local:
            self._emit(state, "_local_grad_square", tf.add_n(local), reset=0.0, accumulate=True)

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

    def _gate(self, state, grads):
        """Evaluates the device breakpoints; returns whether to skip this update."""
        hold = self._hold_variable()
        loss = None
        if state.loss is not None:
            loss = tf.reduce_mean(tf.cast(unscale_loss_for_distribution(tf.convert_to_tensor(state.loss)), tf.float32))
            loss = _all_reduce(loss, "MEAN")
        applied = [g for g in grads if g is not None]
        hit_index = tf.constant(0.0)
        for index in reversed(range(len(self.breakpoints))):
            flag = tf.cast(self.breakpoints[index].check(loss, applied, self._make_variable), tf.float32)
            flag = _all_reduce(flag, "MAX")
            hit_index = tf.where(flag > 0, float(index + 1), hit_index)
        held = tf.identity(hold.read_value())
        new_hit = tf.where(held > 0, 0.0, hit_index)
        self._emit(state, "_hit", new_hit, reset=0.0, accumulate=True)
        skip = tf.logical_or(held > 0, hit_index > 0)
        self._emit(state, "_held", tf.cast(skip, tf.float32), reset=0.0, accumulate=True)
        hold.assign(tf.where(skip, 1.0, 0.0))
        return skip

    def release(self):
        """Lets updates through again after a device breakpoint held them."""
        if self._hold is not None:
            self._hold.assign(0.0)
        for point in self.breakpoints:
            point.reset()

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

    def _emit(self, state, name, value, reset=np.nan, accumulate=False):
        value = tf.cast(value, tf.float32)
        if state.nested():
            slot = self._slots.get(name)
            if slot is None:
                slot = self._slots[name] = (self._make_variable("lab_slot", reset), reset)
            (slot[0].assign_add if accumulate else slot[0].assign)(value)
            state.slotted[name] = slot
        elif accumulate and name in state.values:
            state.values[name] = state.values[name] + value
        else:
            state.values[name] = value

    def _emit_update(self, state, name, variables, grads, learning_rate, before):
        if name not in state.optimizers:
            state.optimizers.append(name)
        self._emit(state, f"_lr/{name}", learning_rate)
        self._emit(state, "_updates", 1.0, reset=0.0, accumulate=True)
        if not (self.gradients or self.weights):
            return
        squares = []
        record_gradients = self.gradients and not state.batch_gradients
        for index, variable in enumerate(variables):
            key = self._key(variable)
            grad = grads[index] if index < len(grads) else None
            if record_gradients and grad is not None:
                square = tf.reduce_sum(tf.square(tf.cast(grad, tf.float32)))
                squares.append(square)
                self._emit(state, f"grad_norm/{key}", tf.sqrt(square))
            if self.weights:
                norm = tf.norm(tf.cast(tf.convert_to_tensor(variable.value), tf.float32))
                self._emit(state, f"weight_norm/{key}", norm)
                if before is not None:
                    delta = tf.cast(tf.convert_to_tensor(variable.value) - before[index], tf.float32)
                    self._emit(state, f"update_ratio/{key}", tf.math.divide_no_nan(tf.norm(delta), norm))
        if squares:
            self._emit(state, "_grad_square", tf.add_n(squares), reset=0.0, accumulate=True)

    def _metric_totals(self):
        totals = {}
        for name, metric in leaf_metrics(self.model).items():
            if _is_mean(metric):
                totals[name] = (tf.identity(metric.total.value), tf.identity(metric.count.value))
        return totals

    def _metric_delta(self, metric, before):
        total = _all_reduce(tf.cast(tf.identity(metric.total.value) - before[0], tf.float32), "SUM")
        count = _all_reduce(tf.cast(tf.identity(metric.count.value) - before[1], tf.float32), "SUM")
        # A metric the step did not update has no value for this batch (not 0).
        return tf.where(count > 0, tf.math.divide_no_nan(total, count), np.float32(np.nan))

    def _record(self, state, totals, logs, batch_size):
        values = {"_batch_size": _all_reduce(batch_size, "SUM")}
        metrics = leaf_metrics(self.model)
        tracker_loss = None
        if "loss" in totals:
            tracker_loss = self._metric_delta(metrics["loss"], totals["loss"])
        if state.loss is not None:
            loss = tf.cast(unscale_loss_for_distribution(tf.convert_to_tensor(state.loss)), tf.float32)
            values["loss"] = _all_reduce(tf.reduce_mean(loss), "MEAN")
            if tracker_loss is not None:
                values["_tracker_loss"] = tracker_loss
        elif tracker_loss is not None:
            values["loss"] = tracker_loss
        for key, value in _flat_logs(logs):
            if key in values:
                continue
            if key in totals:
                values[key] = self._metric_delta(metrics[key], totals[key])
            else:
                tensor = _scalar_tensor(value)
                if tensor is not None:
                    values[key] = _all_reduce(tf.cast(tensor, tf.float32), "MEAN")
        produced = dict(state.values)
        for name, (slot, reset) in state.slotted.items():
            read = tf.identity(slot.read_value())
            with tf.control_dependencies([read]):
                slot.assign(tf.constant(reset, tf.float32))
            produced[name] = produced[name] + read if name in produced else read
        self._finish_row(state, values, produced)
        self._write(values)

    def _finish_row(self, state, values, produced):
        self._replica_values(state, values, produced.pop("_local_grad_square", None))
        several = len(state.optimizers) > 1
        for name in state.optimizers:
            column = f"learning_rate/{name}" if several else "learning_rate"
            values[column] = produced.pop(f"_lr/{name}")
        updates = produced.pop("_updates", None)
        square = produced.pop("_grad_square", None)
        batch_square = produced.pop("_batch_grad_square", None)
        if updates is not None:
            values["updated"] = tf.cast(updates > 0, tf.float32)
        if self.gradients and batch_square is not None:
            values["grad_norm"] = tf.sqrt(batch_square)
        elif self.gradients and square is not None:
            values["grad_norm"] = tf.where(updates > 0, tf.sqrt(square), np.float32(np.nan))
        values.update(produced)

    def _replica_values(self, state, values, local_square):
        """Per-replica loss and gradient norm (each replica on its own share of
        the batch, before the all-reduce), and `replica_skew`: the spread of
        the replicas' losses."""
        ctx = _replica_context()
        if ctx is None:
            return
        replicas = ctx.num_replicas_in_sync
        if state.loss is not None:
            local = tf.reduce_mean(tf.cast(unscale_loss_for_distribution(tf.convert_to_tensor(state.loss)), tf.float32))
            losses = ctx.all_gather(tf.reshape(local, [1]), axis=0)
            for index in range(replicas):
                values[f"loss/replica_{index}"] = losses[index]
            values["replica_skew"] = tf.reduce_max(losses) - tf.reduce_min(losses)
        if local_square is not None:
            # Each replica differentiates its loss scaled by 1/replicas (Keras 3.7+).
            scale = replicas if KERAS_SCALES_LOSS else 1
            norms = ctx.all_gather(tf.reshape(tf.sqrt(local_square) * scale, [1]), axis=0)
            for index in range(replicas):
                values[f"grad_norm/replica_{index}"] = norms[index]

    def _key(self, variable):
        key = self._variable_keys.get(id(variable))
        if key is None:
            # A variable the model did not list when the probe was installed.
            self._variable_keys.update(variable_keys([variable]))
            key = self._variable_keys[id(variable)]
        return key

    def _expected_columns(self, values):
        """The buffer's columns: what this step produced plus every variable key,
        so a variable with no gradient on some step reads as missing (NaN)."""
        columns = list(values)
        if self.gradients:
            columns += [f"grad_norm/{k}" for k in self._variable_keys.values()]
        return list(dict.fromkeys(columns))

    def _write(self, values):
        if self.buffer is None:
            # Every replica reaches this point in the same step, so each takes
            # part in the merge that creates the buffer once.
            columns = self._expected_columns(values)
            buffer = _in_cross_replica_context(lambda strategy: StepBuffer(len(columns), self.capacity, strategy))
            with self._lock:
                if self.buffer is None:
                    self.columns, self.buffer = columns, buffer
        unknown = [name for name in values if name not in self.columns]
        if unknown:
            warnings.warn(
                f"The training step produced new values {unknown} after recording "
                "started; they are not recorded. Use a new Recorder to record them.",
                RuntimeWarning,
                stacklevel=3,
            )
        nan = tf.constant(np.nan, tf.float32)
        row = tf.stack([tf.cast(values[c], tf.float32) if c in values else nan for c in self.columns])
        self.buffer.write(row)

    def ensure_capacity(self, steps_per_execution):
        """Raises the ring's size so one execution never overwrites unread rows."""
        self.capacity = max(self.capacity, 4 * int(steps_per_execution))

    def read(self):
        """Rows written since the last read: a dict column -> float32 array."""
        if self.buffer is None:
            return {}
        block = self.buffer.read_new()
        return {name: block[:, i] for i, name in enumerate(self.columns)}


class _NullScope:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_MISSING = object()
