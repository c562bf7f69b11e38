"""The fit probe on JAX: each step writes its own row into a ring buffer.

Keras' JAX trainer runs `train_step(state, data) -> (logs, state)` under
`jax.jit`, with the state outside the Keras variables; values leave the
compiled step only as outputs or as state it returns. So the probe wraps the
model's `train_step` (through `lab.hooks`, role "probe") and, in the same
trace, after the step it wraps:

- reads the batch's own value of every mean metric (the loss tracker
  included) from the change of its total and count (`state` before and
  after), as the TensorFlow probe does;
- takes the gradients each optimizer applied where Keras' update runs
  (`_backend_update_step`: after loss-scale unscaling, clipping and
  accumulation) with the learning rate that step used;
- measures weights and updates from the trainable state before and after;
- with `norms_every=n`, takes those norms (the gradients' and the
  weights') at one step in n only: fit() then runs two compiled steps, one
  with the norms and one without, chosen on the host before each step
  (`compat.trainer_jit`), so the other steps cost what a step without them
  costs;
- evaluates device breakpoints (`nonfinite`, `loss_spike`) and, on a hit,
  returns the state as it was before the step (weights, optimizer state,
  `iterations`), holding every later step until the host releases it;
- writes the row into a ring buffer (`lab.backend.jax.buffer.Ring`) carried
  in the optimizer's part of the state, which the recorder reads in blocks.

Nothing is read on the host per step.
"""

import threading

import jax.numpy as jnp
import keras
import numpy as np

from lab import schema
from lab.backend.jax import compat
from lab.backend.jax.norms import sums_of_squares
from lab.backend.jax.buffer import Ring, Tally
from lab.breakpoints import DeviceBreakpoint
from lab.hooks import hooks_for
from lab.metric_names import leaf_metrics, mean_parts
from lab.step_logs import not_logs
from lab.variables import find_optimizers, variable_keys

UPDATE_NORM = "_update_norm/"  # a variable's update norm, turned into `update_ratio/` on the host
_capture = threading.local()  # the applies of the step being traced on this thread

ALREADY_WATCHED = (
    "The model {model!r} is already recorded by another lab Recorder or Dashboard (one probe per "
    "model): pass the same Recorder to each fit(), or detach the other one first (`recorder.detach()`)."
)


class Probe:
    """Hooks that make each training step of `model` write its own row.

    Args:
        model: keras.Model, compiled and built.
        gradients: bool, per-variable norms of the applied gradients.
        weights: bool, per-variable weight norms and update norms.
        breakpoints: sequence of `lab.Breakpoint`; the device ones
            (`nonfinite`, `loss_spike`) are evaluated inside the step.
        capacity: int, rows the ring holds between reads.
        norms_every: int, the steps between two steps whose norms are
            taken (the others' norm columns are NaN); 1: every step.
    """

    def __init__(self, model, gradients=False, weights=False, breakpoints=(), capacity=1024, norms_every=1):
        self.model = model
        self.gradients = gradients
        self.weights = weights
        self.norms_every = norms_every if (gradients or weights) else 1
        self.steps_begun = 0  # steps begun since this probe was made, counted on the host where norms are sampled
        self.sampled = None  # whether the train function took norms at one step in norms_every (None: not traced)
        self.device_points = [p for p in breakpoints if isinstance(p, DeviceBreakpoint)]
        for point in self.device_points:
            if point.name != "nonfinite" and not point.name.startswith("loss_spike"):
                raise TypeError(f"{point!r} is a device breakpoint the lab cannot evaluate on JAX.")
        self.optimizers = find_optimizers(model)
        self.several = len(self.optimizers) > 1
        self.keys = variable_keys(model.trainable_variables)
        self.metric_parts = self._metric_parts()
        self.columns = self._columns()
        self.ring = Ring(len(self.columns), capacity, spike=any(p.name != "nonfinite" for p in self.device_points))
        keys = list(self.keys.values())
        self.tallies = {name: Tally(keys) for name, optimizer in self.optimizers.items()
                        if compat.applies_inside_cond(optimizer)}
        self.order = None  # the variables of the state's optimizer part, in its order
        self.not_logs = None  # what train_step returned instead of a dict of logs (`lab.step_logs`)
        self.has_targets = True  # whether the batches train_step was handed held y (for failure notes)
        self.installed = False
        self.traced = False

    # ---- what a row holds ------------------------------------------------------

    def _metric_parts(self):
        """Each mean metric's name -> (index of its total, of its count) in
        `model.metrics_variables`, the order of the state's metric part."""
        index = {id(v): i for i, v in enumerate(self.model.metrics_variables)}
        parts = {}
        for name, metric in leaf_metrics(self.model).items():
            found = mean_parts(metric)
            if found is not None and id(found[0]) in index and id(found[1]) in index:
                parts[name] = (index[id(found[0])], index[id(found[1])])
        return parts

    def _columns(self):
        columns = [schema.UPDATED, *self.metric_parts]
        columns += [schema.learning_rate_column(name, self.several) for name in self.optimizers]
        if self.several:
            columns += [schema.per_optimizer_column(schema.UPDATED_PREFIX, name) for name in self.optimizers]
        keys = list(self.keys.values())
        if self.gradients:
            columns += [schema.variable_column(schema.GRAD_NORM_PREFIX, key) for key in keys]
        if self.weights:
            columns += [schema.variable_column(schema.WEIGHT_NORM_PREFIX, key) for key in keys]
            columns += [UPDATE_NORM + key for key in keys]
        return columns

    # ---- installing ------------------------------------------------------------

    def install(self):
        """Puts the ring into the optimizer and the wrappers on; the train
        function is made again through them by the next fit()."""
        if self.installed:
            return
        hooks = hooks_for(self.model)
        hooks.claim("probe", self, ALREADY_WATCHED.format(model=self.model.name))
        try:
            optimizer = self.model.optimizer
            if not optimizer.built:
                optimizer.build(self.model.trainable_variables)
            for name, tally in self.tallies.items():
                tally.attach(compat.update_step_owner(self.optimizers[name]))
            self._attach_ring()
            hooks.wrap(self, self.model, "train_step", self._wrap_train_step, role="probe")
            if self.norms_every > 1:
                hooks.wrap(self, self.model, "make_train_function", self._wrap_make_train_function, role="probe")
            for name, optimizer in self.optimizers.items():
                hooks.wrap(self, compat.update_step_owner(optimizer), compat.UPDATE_STEP,
                           self._wrap_update_step(name), role="probe")
            for optimizer in {id(o): o for o in self.optimizers.values()}.values():
                hooks.wrap(self, optimizer, "save_own_variables", self._wrap_save(optimizer), role="probe")
        except BaseException:
            self.release()
            raise
        self.installed = True
        self.model.train_function = None  # traced again, through the wrappers

    def _attach_ring(self):
        """Puts the ring into an optimizer whose variables fit() carries in
        the state: `model.optimizer`, or for a model that carries optimizers
        of its own instead (a GAN's, see `compat.optimizer_state_variables`)
        the first of those; and learns that part of the state's order."""
        hosts = {id(o): o for o in [self.model.optimizer, *self.optimizers.values()] if o.built}
        candidates = {id(v): v for o in hosts.values() for v in o.variables}
        mine = [t.variable for t in self.tallies.values()]
        for host in hosts.values():
            self.ring.attach(host)
            order = compat.optimizer_state_variables(
                self.model, [*candidates.values(), *self.ring.variables, *mine])
            if order is not None and all(any(v is o for o in order) for v in [*self.ring.variables, *mine]):
                self.ring.order = self.order = order
                return
            self.ring.detach()
        raise TypeError(
            f"The lab cannot record {self.model.name!r} on JAX: the state its fit() carries through the step "
            f"holds optimizer values that belong to none of its optimizers ({', '.join(self.optimizers)}), so "
            "the lab has nowhere to keep each step's row. A model that trains with optimizers of its own "
            "carries their variables in that state by overriding `_get_jax_state` and `jax_state_sync`; "
            "`lab.watch` records a hand-written loop instead.")

    def release(self):
        """Takes every wrapper off and the ring out of the optimizer; never raises but a Ctrl-C."""
        try:
            for tally in self.tallies.values():
                tally.detach()
            self.ring.detach()
        finally:
            self.installed = False
            self.traced = False
            hooks_for(self.model).release(self)

    # ---- the wrappers ----------------------------------------------------------

    def _wrap_save(self, optimizer):
        ring = self.ring

        def wrap(inner):
            def save_own_variables(store):
                # A checkpoint written during fit() (ModelCheckpoint) holds
                # the optimizer as it is without the lab.
                with ring.hidden_from(optimizer):
                    return inner(store)
            return save_own_variables
        return wrap

    def _wrap_make_train_function(self, inner):
        probe = self

        def make_train_function(*args, **kwargs):
            with compat.trainer_jit(probe._sampling_jit):
                return inner(*args, **kwargs)
        return make_train_function

    def _sampling_jit(self, jit):
        """The trainer's `jit`, which for the model's `train_step` makes two
        compiled steps, with the norms and without, and returns a function
        that runs one or the other by the step's number."""
        probe = self

        def sampling_jit(fn, *args, **kwargs):
            if fn != probe.model.train_step:  # another function the trainer jits
                return jit(fn, *args, **kwargs)
            with_norms = jit(_measuring(fn, True), *args, **kwargs)
            without = jit(_measuring(fn, False), *args, **kwargs)

            def train_step(state, data):
                begun = probe.steps_begun
                probe.steps_begun = begun + 1
                return (with_norms if begun % probe.norms_every == 0 else without)(state, data)
            return train_step
        return sampling_jit

    def _measures(self, state):
        """Whether the step being traced or run takes the norms."""
        if self.norms_every == 1:
            return True
        chosen = getattr(_capture, "measure", None)
        if chosen is not None:
            self.sampled = True
            return chosen
        if any(compat.is_traced(leaf) for leaf in state[0][:1]):
            # Jitted without the two steps (a trainer that jits otherwise):
            # every step takes the norms; the recorder says so.
            self.sampled = False
            return True
        begun = self.steps_begun  # run eagerly: Python runs every step
        self.steps_begun = begun + 1
        self.sampled = True
        return begun % self.norms_every == 0

    def _wrap_update_step(self, name):
        keys = self.keys
        tally = self.tallies.get(name)

        def wrap(inner):
            def update_step(grads, trainable_variables, learning_rate):
                applies = getattr(_capture, "applies", None)
                if applies is not None:
                    # Read inside Keras' stateless scope: a schedule's or a
                    # variable's value as this step uses it.
                    rate = jnp.asarray(getattr(learning_rate, "value", learning_rate), jnp.float32)
                    pairs = [(keys.get(id(v)), g) for g, v in zip(grads, trainable_variables)]
                    if tally is not None:
                        tally.add(rate, pairs)  # inside a cond branch: only returned state leaves it
                    else:
                        applies.append((name, pairs, rate))
                return inner(grads, trainable_variables, learning_rate)
            return update_step
        return wrap

    def _wrap_train_step(self, inner):
        probe = self

        def train_step(state, data):
            outer = getattr(_capture, "applies", None)
            _capture.applies = []
            try:
                state = probe._tallies_reset(state)
                probe.has_targets = keras.utils.unpack_x_y_sample_weight(data)[1] is not None
                logs, new_state = inner(state, data)
                probe.not_logs = not_logs(logs)  # fit() fails on it, in words that name neither it nor the fix
                applies = _capture.applies
            finally:
                _capture.applies = outer
            probe.traced = True
            return logs, probe._written(state, new_state, applies + probe._tallied(new_state))
        return train_step

    def _tallies_reset(self, state):
        if not self.tallies:
            return state
        trainable, non_trainable, optimizer_vars, metric_vars = state
        optimizer_vars = list(optimizer_vars)
        for tally in self.tallies.values():
            optimizer_vars[tally.position(self.order)] = tally.reset()
        return (trainable, non_trainable, optimizer_vars, metric_vars)

    def _tallied(self, new_state):
        """The applies of optimizers that tally in their state, read from it:
        (name, [(key, sum of squares as a 1-element gradient)], rate), or
        nothing for an optimizer that applied nothing this step."""
        found = []
        for name, tally in self.tallies.items():
            values = new_state[2][tally.position(self.order)]
            pairs = [(key, jnp.sqrt(values[place]).reshape(1)) for key, place in tally.index.items()]
            found.append((name, pairs, values[0], values[1] > 0))
        return found

    # ---- the row, in the step --------------------------------------------------

    def _written(self, state, new_state, applies):
        trainable, non_trainable, optimizer_vars, metric_vars = state
        new_trainable, new_non_trainable, new_optimizer_vars, new_metric_vars = new_state
        values = {}
        for name, (total, count) in self.metric_parts.items():
            d_total = (new_metric_vars[total] - metric_vars[total]).astype(jnp.float32)
            d_count = (new_metric_vars[count] - metric_vars[count]).astype(jnp.float32)
            values[name] = jnp.where(d_count > 0, d_total / jnp.where(d_count > 0, d_count, 1.0), jnp.nan)
        grads = {}
        checked = {}  # the gradients a nonfinite() breakpoint looks at
        for name, pairs, learning_rate, *applied in applies:
            applied = applied[0] if applied else jnp.asarray(True)
            values[schema.learning_rate_column(name, self.several)] = jnp.where(
                applied, jnp.asarray(learning_rate, jnp.float32), jnp.nan)
            if self.several:
                values[schema.per_optimizer_column(schema.UPDATED_PREFIX, name)] = jnp.where(applied, 1.0, 0.0)
            for key, grad in pairs:
                if key is not None and grad is not None:
                    grads.setdefault(key, []).append(grad)
                    if name not in self.tallies:
                        # A tallying optimizer (a LossScaleOptimizer) skips
                        # non-finite steps itself: they are no hit.
                        checked.setdefault(key, []).append(grad)
        ring = self.ring
        flags = ring.flags_in(optimizer_vars)
        hit = jnp.asarray(False)
        if self.device_points:
            loss = values.get(schema.LOSS)
            hit, flags = self._check(loss, checked, flags)
        held = jnp.logical_or(hit, ring.held(flags))
        values[schema.UPDATED] = jnp.where(held, jnp.float32(0.0), jnp.float32(1.0))
        measures = self._measures(state)
        if self.gradients and measures:
            flat = [(key, g) for key, parts in grads.items() for g in parts]
            squares = {}
            for (key, _), square in zip(flat, sums_of_squares([g for _, g in flat])):
                squares[key] = squares[key] + square if key in squares else square
            for key, square in squares.items():
                values[schema.variable_column(schema.GRAD_NORM_PREFIX, key)] = jnp.sqrt(square)
        if self.device_points:
            new_trainable = _kept(held, trainable, new_trainable)
            new_non_trainable = _kept(held, non_trainable, new_non_trainable)
            new_optimizer_vars = _kept(held, optimizer_vars, new_optimizer_vars)
        if self.weights and measures:
            keys = list(self.keys.values())
            for key, square in zip(keys, sums_of_squares(new_trainable)):
                values[schema.variable_column(schema.WEIGHT_NORM_PREFIX, key)] = jnp.sqrt(square)
            for key, square in zip(keys, sums_of_squares(new_trainable, minus=trainable)):
                values[UPDATE_NORM + key] = jnp.sqrt(square)
        row = jnp.stack([jnp.asarray(values.get(c, jnp.nan), jnp.float32).reshape(()) for c in self.columns])
        new_optimizer_vars = ring.written(new_optimizer_vars, row, ring.set_held(flags, held))
        return (new_trainable, new_non_trainable, new_optimizer_vars, new_metric_vars)

    def _check(self, loss, grads, flags):
        hit = jnp.asarray(False)
        for point in self.device_points:
            if point.name == "nonfinite":
                bad = [~jnp.all(jnp.isfinite(g)) for parts in grads.values() for g in parts]
                if loss is not None:
                    bad.append(~jnp.isfinite(loss))
                if bad:
                    hit = jnp.logical_or(hit, jnp.any(jnp.stack(bad)))
            elif loss is not None:
                average, seen = self.ring.spike_state(flags)
                spike = jnp.logical_and(seen >= point.warmup, loss > point.factor * average)
                spike = jnp.logical_or(spike, ~jnp.isfinite(loss))
                updated = jnp.where(seen == 0, loss, point.decay * average + (1 - point.decay) * loss)
                flags = self.ring.set_spike_state(flags, jnp.where(spike, average, updated),
                                                  jnp.where(spike, seen, seen + 1.0))
                hit = jnp.logical_or(hit, spike)
        return hit, flags

    # ---- reading, on the host --------------------------------------------------

    def read(self):
        """The rows written since the last read, as columns (numpy arrays),
        and how many rows were lost to an overfull ring."""
        block, lost = self.ring.read(compat.optimizer_values(self.model, self.order))
        rows = {name: block[:, i] for i, name in enumerate(self.columns)}
        for name in [n for n in rows if n.startswith(UPDATE_NORM)]:
            key = name[len(UPDATE_NORM):]
            update, weight = rows.pop(name), rows[schema.variable_column(schema.WEIGHT_NORM_PREFIX, key)]
            with np.errstate(divide="ignore", invalid="ignore"):
                rows[schema.variable_column(schema.UPDATE_RATIO_PREFIX, key)] = np.where(
                    weight == 0, np.float32(0.0), update / weight).astype(np.float32)
        if self.gradients and len(block):
            norms = np.asarray([rows[n] for n in rows if n.startswith(schema.GRAD_NORM_PREFIX)], np.float64)
            total = np.sqrt(np.nansum(norms ** 2, axis=0)) if len(norms) else np.full(len(block), np.nan)
            present = ~np.isnan(norms).all(axis=0) if len(norms) else np.zeros(len(block), bool)
            rows[schema.GRAD_NORM] = np.where(present & (rows[schema.UPDATED] > 0), total, np.nan).astype(np.float32)
        return rows, lost


def _measuring(train_step, measure):
    """`train_step` traced with (or without) the norms: the probe's
    wrapper inside it reads the choice while jax traces it."""
    def step(state, data):
        outer = getattr(_capture, "measure", None)
        _capture.measure = measure
        try:
            return train_step(state, data)
        finally:
            _capture.measure = outer
    return step


def _kept(held, before, after):
    """`before` where the step is held, `after` otherwise, leaf by leaf."""
    return [jnp.where(held, b, a) for b, a in zip(before, after)]

