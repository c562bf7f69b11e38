"""Pausing fit() on JAX: `lab.pause.PauseController` with JAX's state.

Before the training thread parks, the state `fit()` holds outside the
variables is put into them (`state.hold_state`): while parked, the model reads
as after the last batch, and `fit()` goes on from what the variables hold,
bit for bit as without the pause. At a breakpoint's hit
`lab.in_flight.BatchInFlight` has kept the batch in flight and a device copy
of the state before it, for the `lab.Stepper` the pause opens on that batch;
the Recorder's ring stays as the batches left it, so its rows go on where
they were. What a pause does is `lab.pause`'s.
"""

from lab import pause
from lab.backend.jax.in_flight import BatchInFlight
from lab.backend.jax.modes import ModeSwitcher
from lab.backend.jax.state import hold_state, read_state, write_state
from lab.pause import find_recorder  # noqa: F401  (where widgets and tests look it up)


class PauseController(pause.PauseController):
    """Parks fit() at batch boundaries: on request, after one batch, at a breakpoint (Keras on JAX).

    Used as `lab.pause.PauseController` says (last among the callbacks, fit()
    on a thread of its own). Parked, the model's variables hold the training
    state. A breakpoint's hit opens `controller.stepper` on the batch that
    hit, at the cost of one device copy of the training state per batch
    while breakpoints are armed (`lab.in_flight.BatchInFlight`; at
    `steps_per_execution > 1` nothing is kept and the Recorder's stop stands).

    Args:
        recorder: `lab.Recorder` or None, whose breakpoints pause training.
        on_state: callable `on_state(state, detail)` or None, called on the
            training thread when it parks and goes on.

    Example:

    ```python
    import threading

    controller = PauseController()
    thread = threading.Thread(target=model.fit, args=(x, y),
                              kwargs=dict(callbacks=controller.callbacks(), verbose=0))
    thread.start()
    controller.pause()    # parks at the next batch boundary; parked, model.weights are the last batch's
    controller.resume()
    ```
    """

    mode_switcher = ModeSwitcher

    def make_keeper(self):
        return BatchInFlight(armed=lambda: self.breakpoints_armed, lab_variables=self._lab_variables)

    def _lab_variables(self):
        return self.recorder.lab_variables() if self.recorder is not None else []

    def hold_state(self):
        hold_state(self._model)

    def read_state(self):
        return read_state(self._model)

    def write_state(self, state):
        write_state(state)
