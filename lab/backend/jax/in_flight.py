"""BatchInFlight on JAX: keep each batch of a fit() and the state before it, to step it later.

A Python breakpoint sees a batch's row only after that batch's update, and a
device breakpoint keeps the weights and optimizer state of the batch that hit
but not its metric totals. To open a stepper on that batch with the model as
it was before it, the batch and the state must be kept while breakpoints are
armed. fit()'s jitted step donates the state it is given, so the state
before it is kept as a device copy: the cost, per batch while armed, is one
copy of the training state (weights, optimizer slots, metric totals) on the
device. It needs `steps_per_execution=1` (otherwise nothing is kept).
"""

import jax
import jax.numpy as jnp
import keras

from lab.backend.jax.feed import to_numpy
from lab.backend.jax.state import pair_state, state_variables, write_state
from lab.hooks import hooks_for
from lab.pause import NO_BATCH_KEPT


class BatchInFlight(keras.callbacks.Callback):
    """Keeps the batch in flight and the model's state before it (Keras on JAX).

    Its wrapper goes on the train function at the first batch, after the
    callbacks' `on_train_begin` (a Recorder keeps the function it traced
    through its probe for the next `fit()`: the plain one, not this wrapper).

    Args:
        armed: callable `armed() -> bool`, or a bool; batches are kept only
            while armed (default: always).
        lab_variables: callable `() -> variables` or None: variables the lab
            added to the state (a Recorder's ring), which putting the model
            back to before the batch leaves as they are.

    Example:

    ```python
    keep = lab.in_flight.BatchInFlight()
    rec = lab.Recorder(breakpoints=[lab.Breakpoint(lambda row: row["loss"] > 5)])
    model.fit(x, y, callbacks=[keep, rec])
    stepper = keep.stepper(run=rec.run)  # on the batch that hit, state as before it
    ```
    """

    def __init__(self, armed=True, lab_variables=None):
        super().__init__()
        self.armed = armed
        self.lab_variables = lab_variables
        self.data = None
        self.before = None
        self.position = (0, 0)
        self._epoch = 0
        self._target = None
        self._wrapped = False
        self._variables = None  # the state's variables as this fit() lays them out

    def set_model(self, model):
        super().set_model(model)
        self._target = model  # `self.model` would sync the state into the variables

    def is_armed(self):
        armed = self.armed() if callable(self.armed) else bool(self.armed)
        return armed and int(self._target.steps_per_execution) == 1

    def on_train_begin(self, logs=None):
        self._wrapped = False
        self._variables = None

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        self.data = self.before = None
        self.position = (self._epoch, batch)
        hooks = hooks_for(self._target)
        if not self._wrapped:
            hooks.wrap_train_function(self, self._keeper, role="keep_batch")
            self._wrapped = True
        hooks.sync_train_function()

    def _keeper(self, function):
        keeper = self

        def keep_batch(state, iterator):
            if not keeper.is_armed():
                return function(state, iterator)
            data = next(iterator)
            if keeper._variables is None:  # fixed for the fit(): a Recorder's ring is in from its start
                keeper._variables = state_variables(keeper._target)
            # The step donates `state`: what is kept is a copy.
            keeper.before = pair_state(keeper._variables, _copied(state))
            keeper.data = data
            return function(state, iter([data]))

        return keep_batch

    def on_train_end(self, logs=None):
        self.release_hooks()  # the next fit() gets Keras' own function back

    def release_hooks(self):
        if self._target is not None:
            hooks_for(self._target).release(self)
        self._wrapped = False

    def stepper(self, **kwargs):
        """A `lab.Stepper` on the kept batch, the model (and a `run`'s step count) put back to before it.

        As `lab.backend.tensorflow.in_flight.BatchInFlight.stepper`; here
        called between batches with the state in the variables
        (`lab.backend.jax.state.hold_state`), and the lab's own variables
        (`lab_variables`) stay as they are.

        Args:
            **kwargs: passed to `lab.Stepper` (`run`, `start_step`, `mode`, ...).

        Raises:
            ValueError: when no batch is kept (not armed, or no batch ran).
        """
        from lab.backend.jax.stepper import Stepper

        if self.data is None:
            raise ValueError(NO_BATCH_KEPT)
        skip = list(self.lab_variables()) if self.lab_variables is not None else []
        write_state(self.before, skip=skip)
        if kwargs.get("run") is not None:
            kwargs.setdefault("start_step", kwargs["run"].next_step - 1)
        kwargs.setdefault("start_batch", self.position)
        data = to_numpy(self.data)
        size = len(jax.tree_util.tree_leaves(data)[0])
        # The model is as before the kept batch: the Stepper sets the run's count of steps back too.
        return Stepper(self._target, data, batch_size=size, shuffle=False, **kwargs)


@jax.jit
def _copied(state):
    """A copy of every array of `state`, made on the device in one call (one
    dispatch per batch, not one per array)."""
    return jax.tree_util.tree_map(lambda a: jnp.array(a, copy=True), state)
