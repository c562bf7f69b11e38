"""The device buffer on JAX: a ring of rows carried in the optimizer's state.

A jitted JAX step keeps nothing but what it returns, and Keras' `fit()`
passes back only the model's, the optimizer's and the metrics' variables.
The ring is therefore three variables added to the model's optimizer for
the length of a recorded `fit()` (and taken out again after it, so that
`optimizer.variables`, checkpoints and a later `fit()` are as without the
lab): the rows (`capacity x columns`, float32), the number of rows written,
and a few flags (a held update, a loss-spike breakpoint's running average).
The host reads the ring in blocks from the state `fit()` holds, never
syncing the model's variables.
"""

import contextlib

import jax.numpy as jnp
import keras
import numpy as np
from jax import lax

from lab.backend.jax import compat
from lab.backend.jax.norms import sum_of_squares

_HELD, _AVERAGE, _SEEN = 0, 1, 2


class Ring:
    """Rows written inside the step and read on the host in blocks.

    Args:
        width: int, values per row.
        capacity: int, rows kept between two reads (older unread rows are
            overwritten and counted as lost).
        spike: bool, whether a loss-spike breakpoint keeps its state here.
    """

    def __init__(self, width, capacity=1024, spike=False):
        self.width = int(width)
        self.capacity = int(capacity)
        self.spike = spike
        self.variables = ()
        self.optimizer = None
        # The variables of the state's optimizer part, in its order (the
        # optimizer's own where fit() carries model.optimizer alone).
        self.order = None
        self.read_count = 0  # rows read so far

    # ---- in the optimizer, for one fit() ---------------------------------------

    def attach(self, optimizer):
        """Makes the ring's variables (zeros) and adds them to `optimizer`."""
        self.detach()
        self.variables = (
            keras.Variable(np.zeros((self.capacity, max(self.width, 1)), np.float32), trainable=False,
                           name="lab_ring_rows"),
            keras.Variable(np.zeros((), np.int32), dtype="int32", trainable=False, name="lab_ring_count"),
            keras.Variable(np.zeros((4,), np.float32), trainable=False, name="lab_ring_flags"),
        )
        for variable in self.variables:
            compat.track(optimizer, variable)
        self.optimizer = optimizer
        self.read_count = 0

    def detach(self):
        """Takes the ring's variables out of the optimizer again."""
        if self.optimizer is not None and self.variables:
            compat.untrack(self.optimizer, self.variables)
        self.optimizer = None
        self.order = None

    @contextlib.contextmanager
    def hidden_from(self, optimizer):
        """The optimizer without the ring for the length of the block (a
        checkpoint written meanwhile holds only the optimizer's own state)."""
        if self.optimizer is not optimizer or not self.variables:
            yield
            return
        compat.untrack(optimizer, self.variables)
        try:
            yield
        finally:
            for variable in self.variables:
                compat.track(optimizer, variable)

    def _indices(self):
        return [position_in(self.order or self.optimizer.variables, v) for v in self.variables]

    # ---- inside the step ---------------------------------------------------------

    def flags_in(self, optimizer_values):
        return optimizer_values[self._indices()[2]]

    @staticmethod
    def held(flags):
        return flags[_HELD] > 0

    @staticmethod
    def set_held(flags, held):
        return flags.at[_HELD].set(jnp.where(held, 1.0, 0.0))

    @staticmethod
    def spike_state(flags):
        return flags[_AVERAGE], flags[_SEEN]

    @staticmethod
    def set_spike_state(flags, average, seen):
        return flags.at[_AVERAGE].set(average).at[_SEEN].set(seen)

    def written(self, optimizer_values, row, flags):
        """The optimizer's state with `row` written at the next place of the ring."""
        rows_at, count_at, flags_at = self._indices()
        values = list(optimizer_values)
        count = values[count_at]
        place = lax.rem(count, jnp.int32(self.capacity))
        values[rows_at] = lax.dynamic_update_slice(values[rows_at], row.reshape(1, -1),
                                                   (place, jnp.int32(0)))
        values[count_at] = count + 1
        values[flags_at] = flags
        return values

    # ---- on the host -------------------------------------------------------------

    def release_hold(self):
        """Lets updates through again after a device breakpoint's hit: between
        batches, with the state in the variables (a paused fit())."""
        if self.optimizer is not None and self.variables:
            flags = self.variables[2]
            flags.assign(self.set_held(flags.value, False))

    def read(self, optimizer_values):
        """(rows written since the last read as a `rows x width` array, rows lost)."""
        if self.optimizer is None or not self.variables:
            return np.zeros((0, self.width), np.float32), 0
        rows_at, count_at, _ = self._indices()
        count = int(np.asarray(optimizer_values[count_at]))
        unread = count - self.read_count
        if unread <= 0:
            return np.zeros((0, self.width), np.float32), 0
        lost = max(0, unread - self.capacity)
        places = np.arange(self.read_count + lost, count) % self.capacity
        block = np.asarray(optimizer_values[rows_at])[places, :self.width]
        self.read_count = count
        return block, lost


class Tally:
    """What one optimizer applied in a step, kept in its own state: for an
    optimizer whose update runs inside a `lax.cond` branch, out of which
    traced values leave only as the state it returns.

    One float32 vector: the learning rate, the number of applies, and per
    variable the sum of squares of its applied gradients (NaN where none
    was applied). The step starts from `reset`; each apply adds to it.
    """

    def __init__(self, keys):
        self.index = {key: 2 + i for i, key in enumerate(keys)}
        self.width = 2 + len(keys)
        self.variable = None
        self.optimizer = None

    def attach(self, optimizer):
        self.detach()
        self.variable = keras.Variable(np.zeros((self.width,), np.float32), trainable=False, name="lab_tally")
        compat.track(optimizer, self.variable)
        self.optimizer = optimizer

    def detach(self):
        if self.optimizer is not None and self.variable is not None:
            compat.untrack(self.optimizer, [self.variable])
        self.optimizer = None

    def position(self, order):
        """The tally's place in `order`, the variables of the state's optimizer part."""
        return position_in(order, self.variable)

    def reset(self):
        return jnp.full((self.width,), jnp.nan, jnp.float32).at[1].set(0.0)

    def add(self, rate, pairs):
        """Inside the optimizer's stateless scope: adds one apply."""
        tally = self.variable.value.at[0].set(rate).at[1].add(1.0)
        for key, grad in pairs:
            place = self.index.get(key)
            if place is None or grad is None:
                continue
            square = sum_of_squares(grad)
            current = tally[place]
            tally = tally.at[place].set(jnp.where(jnp.isnan(current), square, current + square))
        self.variable.assign(tally)


def position_in(variables, variable):
    """The index of `variable` in `variables`, by identity."""
    ids = [id(v) for v in variables]
    return ids.index(id(variable))
