"""Breakpoints: conditions checked per batch that stop or pause training."""

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
                f"Breakpoint needs a callable condition(row) -> bool, got {type(condition).__name__}."
            )
        self.condition = condition
        self.name = name or getattr(condition, "__name__", "condition")

    def hit(self, row):
        return bool(self.condition(row))

    def describe(self, row):
        return f"{self.name} at step {int(row['step'])}"



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

    def reset(self):
        """Forgets state kept across steps (called when the lab releases a hold)."""

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
    def __init__(self, factor, warmup, decay):
        if not factor > 1:
            raise ValueError(f"loss_spike(factor) needs a factor above 1, got {factor!r} (e.g. 3.0: three times the recent loss).")
        super().__init__(f"loss_spike({factor:g})")
        self.factor, self.warmup, self.decay = float(factor), int(warmup), float(decay)
        self._average = self._seen = None

    def check(self, loss, gradients, make_variable):
        import tensorflow as tf

        if loss is None:
            return tf.constant(False)
        if self._average is None:
            self._average = make_variable("lab_loss_average", 0.0)
            self._seen = make_variable("lab_loss_seen", 0.0)
        average = tf.identity(self._average.read_value())
        seen = tf.identity(self._seen.read_value())
        spike = tf.logical_and(seen >= self.warmup, loss > self.factor * average)
        spike = tf.logical_or(spike, tf.logical_not(tf.math.is_finite(loss)))
        first = tf.equal(seen, 0.0)
        updated = tf.where(first, loss, self.decay * average + (1 - self.decay) * loss)
        self._average.assign(tf.where(spike, average, updated))
        self._seen.assign(tf.where(spike, seen, seen + 1.0))
        return spike

    def reset(self):
        if self._seen is not None:
            self._seen.assign(0.0)


def nonfinite():
    """Stops at the first batch whose loss or any applied gradient is NaN or infinite.

    Evaluated on the device inside the step: that batch's update is kept out
    of the weights.

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
        factor: float, how many times the running average counts as a spike.
        warmup: int, steps before spikes are looked for.
        decay: float, the running average's decay per step.
    """
    return _LossSpike(factor, warmup, decay)
