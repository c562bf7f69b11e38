"""LoopProbe: the optimizer hooks of `lab.watch` for a hand-written JAX loop.

A loop written as keras-io's "Writing a training loop from scratch in JAX"
teaches keeps its whole state outside the Keras variables and runs a
`jax.jit` step that calls `optimizer.stateless_apply`. Values leave a jitted
function only as its outputs or through host callbacks, and the lab may add
neither an output nor an optimizer variable (the user built
`optimizer_variables` before the block: `stateless_apply` checks their
number). So the probe wraps, through `lab.hooks`, two methods of each
watched optimizer (a LossScaleOptimizer's inner one, which sees unscaled
gradients):

- `_backend_update_step`, which Keras calls with the gradients it applies
  (after unscaling, clipping and accumulation) and the learning rate of
  that step: the wrapper keeps, for the `apply` that called it, each
  gradient's sum of squares (float32, as `norms.sum_of_squares`), the
  learning rate and, with a `nonfinite()` breakpoint, whether any gradient
  element is not finite;
- `apply`, which `stateless_apply` runs inside its `StatelessScope`: after
  Keras' own apply, one host callback sends what the update step kept (and,
  with `weights=True`, the weight and update sums of squares). With a
  breakpoint the callback is an `io_callback` whose answer gates the update
  inside the step: on a hit, every variable the apply assigned (weights,
  slots, `iterations`) is put back as it was before the apply, so the state
  the step returns holds no part of the bad update.

The callback carries no reference to the model or to the block: it names
the optimizer by a number and delivers to whichever block watches that
optimizer now, or to none. A step traced inside a block keeps its callback
in its compiled code after the block (JAX caches the trace with the jitted
function): outside a block the callback does nothing and answers "no
skip", so the step trains as without the lab, at the callback's cost, until
it is jitted anew. A step traced before the block has no callback: the
probe sees nothing of it, and the run says so.

An eager step (no `jax.jit`) runs the wrappers with concrete arrays: their
values are delivered at once, without a callback.
"""

import functools
import itertools
import threading
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from lab.backend.jax import compat
from lab.backend.jax.norms import sums_of_squares
from lab.hooks import hooks_for
from lab.variables import variable_keys

# The positions in the vector each apply sends to the host.
RATE, BAD = 0, 1
# `BAD` when the trace checks no gradient (traced without a breakpoint): no gate either.
UNCHECKED = -1.0

ALREADY_WATCHED = (
    "The {what} {name!r} is already watched (another `lab.watch` block or a Recorder is attached). "
    "Leave that block first, or watch the model once with all its optimizers: `lab.watch(model, opt_a, opt_b)`."
)

_lock = threading.Lock()
_numbers = itertools.count(1)
_NUMBERS = weakref.WeakKeyDictionary()  # optimizer -> its number in the callbacks
_RECEIVERS = {}  # number -> the LoopProbe of the block watching it now
_COMPILED = set()  # numbers some trace put a callback in: a step may send to them
_local = threading.local()  # `stash`: what the update steps of the apply being run kept


def number_of(optimizer):
    """The number callbacks name `optimizer` by (made on first use, kept off the optimizer)."""
    with _lock:
        number = _NUMBERS.get(optimizer)
        if number is None:
            number = _NUMBERS[optimizer] = next(_numbers)
        return number


def may_send(numbers):
    """Whether a compiled step may send to any of `numbers` (a callback was traced for one)."""
    return any(n in _COMPILED for n in numbers)


def _deliver(number, keys, has, vector):
    """The host callback: hands one apply's values to the block watching the
    optimizer; returns whether to keep that update out (float32 0 or 1).
    Never raises: an error here would fail the user's step."""
    probe = _RECEIVERS.get(number)
    skip = False
    if probe is not None:
        try:
            skip = probe.arrive(number, keys, has, np.asarray(vector, np.float32), eager=False)
        except Exception as error:  # noqa: BLE001 - the step must not fail for the lab
            probe.note_error(error)
    return np.asarray(1.0 if skip else 0.0, np.float32)


def _deliver_unanswered(number, keys, has, vector):
    _deliver(number, keys, has, vector)


class Arrival:
    """What one apply sent: the optimizer's name, the variables' keys, the
    learning rate, whether a gradient was not finite (None: not checked),
    whether the update was kept out, and sums of squares by kind."""

    __slots__ = ("name", "keys", "rate", "bad", "skipped", "grads", "weights_before", "weights_after",
                 "updates", "eager")

    def __init__(self, name, keys, rate, bad, skipped, eager):
        self.name, self.keys, self.rate, self.bad, self.skipped, self.eager = name, keys, rate, bad, skipped, eager
        self.grads = self.weights_before = self.weights_after = self.updates = None


class LoopProbe:
    """Hooks on the optimizers of a hand-written JAX loop.

    Args:
        model: keras.Model (or Layer), whose `trainable_variables` name the columns.
        optimizers: dict, name -> keras optimizer the loop applies.
        gradients: bool, send the applied gradients' sums of squares.
        weights: bool, send weight and update sums of squares.
        gate: bool, check the applied gradients on the device and keep a
            non-finite update out (a `nonfinite()` breakpoint).
    """

    def __init__(self, model, optimizers, gradients=True, weights=False, gate=False):
        self.model = model
        self.optimizers = dict(optimizers)
        self.gradients = bool(gradients)
        self.weights = bool(weights)
        self.gate = bool(gate)
        self.keys = variable_keys(model.trainable_variables)
        self.owners = {name: compat.update_step_owner(o) for name, o in self.optimizers.items()}
        self.numbers = {number_of(owner): name for name, owner in self.owners.items()}
        self._arrived = []
        self._arrived_lock = threading.Lock()
        self.installed = False
        self.traced = False  # a step was traced through the wrappers in this block
        self.errors = []  # the lab's own failures in a callback, as messages

    @property
    def sends(self):
        """Whether this block asks the steps for values (gradients, weights or a gate)."""
        return self.gradients or self.weights or self.gate

    # ---- installing --------------------------------------------------------

    def install(self):
        """Wraps each optimizer's `apply` and `_backend_update_step` (instance
        attributes, through `lab.hooks`) and takes the values sent to them."""
        if self.installed:
            return
        hooks = hooks_for(self.model)
        hooks.claim("probe", self, ALREADY_WATCHED.format(what="model", name=self.model.name))
        try:
            for number, name in self.numbers.items():
                other = _RECEIVERS.get(number)
                if other is not None and other is not self and other.installed:
                    raise RuntimeError(ALREADY_WATCHED.format(what="optimizer", name=name))
            for number, name in self.numbers.items():
                owner = self.owners[name]
                hooks.wrap(self, owner, compat.UPDATE_STEP, self._wrap_update_step(), role="probe")
                hooks.wrap(self, owner, "apply", self._wrap_apply(name, number, owner), role="probe")
            with _lock:
                for number in self.numbers:
                    _RECEIVERS[number] = self
        except BaseException:
            self.release()
            raise
        self.installed = True

    def is_training(self):
        """Whether the block is open (the hooks layer leaves an open block's hooks alone)."""
        return self.installed

    def release(self):
        """Takes every wrapper off and stops taking values; never raises but a Ctrl-C."""
        try:
            with _lock:
                for number in self.numbers:
                    if _RECEIVERS.get(number) is self:
                        del _RECEIVERS[number]
        finally:
            self.installed = False
            hooks_for(self.model).release(self)

    # ---- the wrappers --------------------------------------------------------

    def _wrap_update_step(self):
        probe = self

        def wrap(inner):
            def update_step(grads, trainable_variables, learning_rate):
                stash = getattr(_local, "stash", None)
                if stash is not None:
                    stash.append(probe._measure_grads(grads, trainable_variables, learning_rate))
                return inner(grads, trainable_variables, learning_rate)
            return update_step
        return wrap

    def _measure_grads(self, grads, variables, learning_rate):
        """(variables, rate, [sum of squares per gradient], bad or None), as arrays of the step."""
        rate = jnp.asarray(getattr(learning_rate, "value", learning_rate), jnp.float32).reshape(())
        squares = sums_of_squares(grads) if self.gradients else []
        bad = None
        if self.gate and grads:
            bad = jnp.logical_not(jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in grads])))
        return list(variables), rate, squares, bad

    def _wrap_apply(self, name, number, owner):
        probe = self

        def wrap(inner):
            def apply(grads, trainable_variables=None):
                outer = getattr(_local, "stash", None)
                stash = _local.stash = []
                try:
                    before = probe._before(owner, trainable_variables)
                    result = inner(grads, trainable_variables)
                finally:
                    _local.stash = outer
                if stash:
                    probe._after_apply(name, number, owner, stash, before)
                return result
            return apply
        return wrap

    def _before(self, owner, trainable_variables):
        """The values an apply may assign, before it: {id(variable): (variable, value)}."""
        if not (self.weights or self.gate) or not owner.built:
            return None
        variables = list(trainable_variables) if trainable_variables is not None else _tracked(owner)
        return {id(v): (v, v.value) for v in variables + list(owner.variables)}

    def _after_apply(self, name, number, owner, stash, before):
        variables, rate, squares, bad = [], stash[-1][1], [], []
        for part_variables, _, part_squares, part_bad in stash:
            variables += part_variables
            squares += part_squares
            if part_bad is not None:
                bad.append(part_bad)
        keys = tuple(self._key(v) for v in variables)
        bad = jnp.any(jnp.stack(bad)) if bad else None
        values = [rate, jnp.float32(UNCHECKED) if bad is None else bad.astype(jnp.float32)]
        has = ("grads",) if squares else ()
        values += squares
        if self.weights and before is not None:
            olds = [before[id(v)][1] if id(v) in before else v.value for v in variables]
            news = [v.value for v in variables]
            values += sums_of_squares(olds) + sums_of_squares(news) + sums_of_squares(news, minus=olds)
            has += ("weights",)
        tracing = _tracing(rate) or any(_tracing(v) for v in values)
        if tracing and not self.sends:
            self.traced = True  # nothing asked of the step: nothing put in its trace
            return
        vector = jnp.stack([jnp.asarray(v, jnp.float32).reshape(()) for v in values])
        if not tracing:
            skip = self.arrive(number, keys, has, np.asarray(vector), eager=True)
            if skip and before is not None:
                for variable, value in before.values():
                    variable.assign(value)
            return
        self.traced = True
        with _lock:
            _COMPILED.add(number)
        if bad is None:
            jax.debug.callback(functools.partial(_deliver_unanswered, number, keys, has), vector)
            return
        skip = io_callback(functools.partial(_deliver, number, keys, has),
                           jax.ShapeDtypeStruct((), jnp.float32), vector, ordered=False) > 0
        if before is not None:
            for variable, value in before.values():
                variable.assign(jnp.where(skip, value, variable.value))

    def _key(self, variable):
        return self.keys.get(id(variable)) or getattr(variable, "path", None) or variable.name

    # ---- what the steps sent --------------------------------------------------

    def arrive(self, number, keys, has, vector, eager):
        """Takes one apply's values (called by the callback, or by an eager
        step directly); returns whether its update is to be kept out."""
        name = self.numbers.get(number)
        if name is None:
            return False
        bad = None if vector[BAD] < 0 else bool(vector[BAD] > 0)
        skip = bool(self.gate and bad)
        arrival = Arrival(name, keys, float(vector[RATE]), bad, skip, eager)
        count, at = len(keys), 2
        if "grads" in has:
            if self.gradients:
                arrival.grads = vector[at:at + count]
            at += count
        if "weights" in has:
            if self.weights:
                arrival.weights_before = vector[at:at + count]
                arrival.weights_after = vector[at + count:at + 2 * count]
                arrival.updates = vector[at + 2 * count:at + 3 * count]
            at += 3 * count
        with self._arrived_lock:
            self._arrived.append(arrival)
        return skip

    def take(self):
        """The arrivals since the last call (the step being closed)."""
        with self._arrived_lock:
            taken, self._arrived = self._arrived, []
        return taken

    def note_error(self, error):
        message = f"the lab's host callback failed: {type(error).__name__}: {error}"
        if message not in self.errors:
            self.errors.append(message)



def _tracing(value):
    return isinstance(value, jax.core.Tracer)


def _tracked(optimizer):
    """The trainable variables the optimizer was built with (what `apply`
    updates when it is given no variables, as `stateless_apply` calls it).
    Keras keeps them in a private list; no public accessor exists."""
    return list(getattr(optimizer, "_trainable_variables", None) or [])
