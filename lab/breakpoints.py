"""Breakpoints: conditions checked per batch that stop or pause training."""

import numbers
import weakref

import numpy as np

from lab.arguments import check_number


class Breakpoint:
    """A condition over the batch row the Recorder just made.

    A Python condition sees the row after its batch, so it acts after that
    batch's update.

    Args:
        condition: callable, `condition(row) -> bool`; `row` is a pandas Series
            with the run's batch columns (`step`, `loss`, ...).
        name: str, how events name this breakpoint.

    Example:

    ```python
    stop_at_200 = lab.Breakpoint(lambda row: row["step"] >= 200, name="step 200")
    model.fit(x, y, callbacks=[lab.Recorder(breakpoints=[stop_at_200])])
    ```
    """

    def __init__(self, condition, name=None):
        if not callable(condition):
            raise TypeError(
                f"Breakpoint(condition) needs a callable condition(row) -> bool, got "
                f"{type(condition).__name__}: e.g. `lab.Breakpoint(lambda row: row['loss'] > 10)`."
            )
        if name is not None and not isinstance(name, str):
            raise TypeError(f"Breakpoint(name=...) must be a str, got {type(name).__name__}.")
        self.condition = condition
        self.name = name or getattr(condition, "__name__", "condition")

    def hit(self, row):
        """Whether the condition holds for `row`.

        Raises:
            BreakpointError: the condition raised, read a column the row does
                not have, or returned something other than one truth value;
                the message names the breakpoint (and the column).
        """
        try:
            result = self.condition(row)
        except KeyError as error:
            column = error.args[0] if error.args else "?"
            raise BreakpointError(
                f"Breakpoint {self.name!r} reads the column {column!r}, which the run's rows do not "
                f"have (they have {', '.join(repr(str(c)) for c in _columns(row))}). Read a column "
                "that is recorded, or `row.get(name)` for one that may be missing."
            ) from error
        except Exception as error:
            raise BreakpointError(
                f"Breakpoint {self.name!r} raised {type(error).__name__}: {error} (its condition "
                f"was called with the row of step {_step(row)}). Fix the condition; it gets the "
                "row as a pandas Series of the run's batch columns."
            ) from error
        if isinstance(result, (bool, np.bool_)):
            return bool(result)
        if np.ndim(result) != 0:
            raise BreakpointError(
                f"Breakpoint {self.name!r} returned {type(result).__name__} of shape {np.shape(result)}, "
                "not one truth value: a condition sees one row at a time, so compare scalars, "
                "e.g. `row['loss'] > 10`, or reduce with `.any()` / `.all()`."
            )
        try:
            return bool(result)
        except (TypeError, ValueError) as error:
            raise BreakpointError(
                f"Breakpoint {self.name!r} returned {result!r}, which is neither true nor false "
                "(a missing value?); return a bool."
            ) from error

    def describe(self, row):
        return f"{self.name} at step {int(row['step'])}"

    def __repr__(self):
        return f"lab.Breakpoint({self.name!r})"


class BreakpointError(RuntimeError):
    """A breakpoint's condition failed; the message names the breakpoint and the column."""


class BreakpointHit(Exception):
    """Raised by `run.step(...)` of a watched loop when a breakpoint hits.

    A device-side breakpoint (`nonfinite()`) kept this step's update out of
    the weights: they are as before the step. Catch it to stop cleanly or to
    go on (the next step starts from those weights). The run has the event.

    Attributes:
        step: int, the run's step at which it hit.
        breakpoint: str, the breakpoint's name.
        detail: str, what the run's event says.
        skipped: bool, whether the step's update was kept out of the weights.
    """

    def __init__(self, step, breakpoint, detail, skipped, not_finite=()):
        self.step, self.breakpoint, self.detail, self.skipped = step, breakpoint, detail, skipped
        if not skipped:
            then = "this step's update is in the weights"
        elif not_finite:
            # The step assigned them itself, outside the optimizer: the gate
            # keeps out the optimizer's update, which the lab sees, not the
            # step's own assignments, which it does not.
            then = (f"the update was skipped, but the step itself made {', '.join(not_finite)} not finite "
                    "outside the optimizer (as a sharpness-aware step's perturbation does on a NaN batch): "
                    "restore them before going on")
        else:
            then = "the update was skipped, the weights are as before this step"
        super().__init__(f"{breakpoint} at step {step}: {then}. Catch lab.BreakpointHit to stop "
                         "or go on; run.events() has the event.")


def _columns(row):
    try:
        return list(row.keys())
    except Exception:  # noqa: BLE001 - only for the message
        return []


def _step(row):
    try:
        return int(row["step"])
    except Exception:  # noqa: BLE001 - only for the message
        return "?"


def as_breakpoints(value, argument="breakpoints"):
    """The breakpoints a Recorder, Dashboard, watch or panel is given, as a list.

    Accepts a list or tuple of breakpoints, a single breakpoint, or plain
    callables `fn(row) -> bool`, each wrapped as `lab.Breakpoint(fn)`.

    Args:
        value: what the user passed.
        argument: str, the argument's name, for the error message.

    Returns:
        list of `lab.Breakpoint`.

    Raises:
        TypeError: `value` (or one of its items) is neither a breakpoint nor
            a callable; the message names the argument and the fix.

    Example:

    ```python
    as_breakpoints(lambda row: row["loss"] > 10)   # [lab.Breakpoint('<lambda>')]
    ```
    """
    if value is None:
        return []
    if isinstance(value, Breakpoint) or callable(value):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise TypeError(
            f"{argument} must be a list of lab.Breakpoint objects (or of conditions row -> bool); "
            f"got {type(value).__name__}. E.g. {argument}=[lab.breakpoints.nonfinite(), "
            "lab.Breakpoint(lambda row: row['loss'] > 10)]."
        )
    points = []
    for i, item in enumerate(value):
        if isinstance(item, Breakpoint):
            points.append(item)
        elif callable(item):
            points.append(Breakpoint(item))
        else:
            raise TypeError(
                f"{argument}[{i}] is {type(item).__name__}, not a breakpoint: give lab.Breakpoint "
                "objects, lab.breakpoints.nonfinite() / loss_spike(...), or callables row -> bool."
            )
    return points


class DeviceBreakpoint(Breakpoint):
    """A condition evaluated on the device inside the step, before the update.

    A hit keeps that update out of the weights (weights and the optimizer's
    `iterations` stay as before the batch) and holds every later update until
    the lab releases it, so it also works at `steps_per_execution > 1`.
    """

    on_device = True

    def __init__(self, name):
        self.name = name
        self.condition = None

    def check(self, loss, gradients, make_variable):
        """Returns a boolean tensor: whether this step must not update."""
        raise NotImplementedError

    def reset(self, owner=None):
        """Forgets the state `owner` keeps across steps (every owner's when
        None); called when the lab releases a hold."""

    def hit(self, row):
        return False

    def describe(self, row):
        return f"{self.name} at step {int(row['step'])}"


class _NonFinite(DeviceBreakpoint):
    def __init__(self):
        super().__init__("nonfinite")

    def check(self, loss, gradients, make_variable):
        import tensorflow as tf

        flags = [tf.logical_not(tf.reduce_all(tf.math.is_finite(tf.cast(g, tf.float32)))) for g in gradients]
        if loss is not None:
            flags.append(tf.logical_not(tf.math.is_finite(loss)))
        if not flags:
            return tf.constant(False)
        return tf.reduce_any(tf.stack(flags))


class _LossSpike(DeviceBreakpoint):
    reads_loss = True  # the loss compute_loss returns: a step without it cannot hit

    def __init__(self, factor, warmup, decay):
        check_number("loss_spike", "factor", factor, numbers.Real, lambda v: bool(np.isfinite(v)) and v > 1,
                     "a number above 1", "loss_spike(3.0): three times the recent average loss")
        check_number("loss_spike", "warmup", warmup, numbers.Integral, lambda v: v >= 0,
                     "a whole number of steps, 0 or more", "warmup=10: look for spikes from the 11th step on")
        check_number("loss_spike", "decay", decay, numbers.Real, lambda v: 0 <= v < 1,
                     "a number from 0 up to (not including) 1",
                     "decay=0.9: each step moves the recent average 10% towards the new loss")
        super().__init__(f"loss_spike({float(factor):g})")
        self.factor, self.warmup, self.decay = float(factor), int(warmup), float(decay)
        # The running average and its count, per owner (the Recorder, watch
        # block or Stepper whose `make_variable` made them): one breakpoint
        # given to several owners watches each loss on its own.
        self._state = weakref.WeakKeyDictionary()

    def check(self, loss, gradients, make_variable):
        import tensorflow as tf

        if loss is None:
            return tf.constant(False)
        owner = getattr(make_variable, "__self__", make_variable)
        if owner not in self._state:
            self._state[owner] = (make_variable("lab_loss_average", 0.0), make_variable("lab_loss_seen", 0.0))
        average_variable, seen_variable = self._state[owner]
        average = tf.identity(average_variable.read_value())
        seen = tf.identity(seen_variable.read_value())
        spike = tf.logical_and(seen >= self.warmup, loss > self.factor * average)
        spike = tf.logical_or(spike, tf.logical_not(tf.math.is_finite(loss)))
        first = tf.equal(seen, 0.0)
        updated = tf.where(first, loss, self.decay * average + (1 - self.decay) * loss)
        average_variable.assign(tf.where(spike, average, updated))
        seen_variable.assign(tf.where(spike, seen, seen + 1.0))
        return spike

    def reset(self, owner=None):
        for key, (_, seen) in list(self._state.items()):
            if owner is None or key is owner:
                seen.assign(0.0)


def nonfinite():
    """Stops at the first batch whose loss or any applied gradient is NaN or infinite.

    Evaluated on the device inside the step: that batch's update is kept out
    of the weights and the optimizer's state. In `fit()`, what the batch's
    forward pass assigned is put back too (BatchNormalization's moving
    statistics, which a NaN batch makes NaN); in a `lab.watch` loop, only
    the update is kept out. With several optimizers in one step, those
    applied before the hit keep their update (the event names them). Under
    a LossScaleOptimizer (mixed precision), scaled gradients that overflow
    are its own business, as without the lab (it skips that update and
    lowers its scale): the breakpoint checks the loss, and the update's
    result.

    Example:

    ```python
    rec = lab.Recorder(breakpoints=[lab.breakpoints.nonfinite()])
    model.fit(x, y, callbacks=[rec])   # stops cleanly; weights stay finite
    ```
    """
    return _NonFinite()


def loss_spike(factor=3.0, warmup=10, decay=0.9):
    """Stops at a batch whose loss exceeds `factor` times its recent average.

    Args:
        factor: float above 1, how many times the running average counts as a spike.
        warmup: int, 0 or more, steps before spikes are looked for.
        decay: float in [0, 1), the running average's decay per step.

    Raises:
        ValueError: an argument out of its range or of the wrong type.
    """
    return _LossSpike(factor, warmup, decay)
