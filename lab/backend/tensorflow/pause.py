"""Pausing fit() on TensorFlow: `lab.pause.PauseController` with the TensorFlow state.

The variables hold the training state all along `fit()`, so parking needs
nothing first; at a breakpoint's hit `lab.in_flight.BatchInFlight` keeps the
batch in flight and a host copy of the state before it (`state.read_state`),
for the `lab.Stepper` the pause opens on that batch. What a pause does is
`lab.pause`'s.
"""

from lab import pause
from lab.backend.tensorflow.in_flight import BatchInFlight
from lab.backend.tensorflow.modes import ModeSwitcher
from lab.backend.tensorflow.state import read_state, write_state
from lab.pause import find_recorder  # noqa: F401  (where widgets and tests look it up)


class PauseController(pause.PauseController):
    """Parks fit() at batch boundaries: on request, after one batch, at a breakpoint.

    Put it last among the callbacks (`controller.callbacks(user_callbacks)`
    builds the whole list) and call `fit()` on a thread of its own: a pause
    blocks the thread that runs `fit()`. `pause()`, `resume()`, `step()` and
    `stop()` only set flags and are safe from any thread; model operations
    happen on the training thread, or while it is parked.

    With a Recorder whose breakpoints are armed, a hit pauses instead of
    stopping: the model goes back to its state before that batch and
    `controller.stepper` is a `lab.Stepper` on it. Keeping the batch in
    flight costs, per batch while breakpoints are armed, one host copy of
    the model's training state (see `lab.in_flight.BatchInFlight`); at
    `steps_per_execution > 1` nothing is kept and the Recorder's stop stands.

    Args:
        recorder: `lab.Recorder` or None, whose breakpoints pause training.
        on_state: callable `on_state(state, detail)` or None, called on the
            training thread when it parks (`"paused"`) and goes on
            (`"running"`).

    Example:

    ```python
    import threading

    recorder = lab.Recorder(breakpoints=[lab.breakpoints.nonfinite()])
    controller = PauseController(recorder)
    thread = threading.Thread(target=model.fit, args=(x, y),
                              kwargs=dict(callbacks=controller.callbacks([recorder]), verbose=0))
    thread.start()
    controller.pause()    # parks at the next batch boundary
    controller.resume()
    ```
    """

    mode_switcher = ModeSwitcher

    def make_keeper(self):
        return BatchInFlight(armed=lambda: self.breakpoints_armed)

    def read_state(self):
        return read_state(self._model)

    def write_state(self, state):
        write_state(state)
