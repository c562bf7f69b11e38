"""Pausing fit() between batches: when asked, one batch at a time, and at a breakpoint's hit.

A blocking `fit()` can only stop at a breakpoint. Training that runs on a
thread of its own (`widgets.BackgroundFit` starts one) can pause instead:
`PauseController`, the last of fit()'s callbacks, parks the training thread
at a batch boundary until another thread calls `resume()`, `step()` or
`stop()`. While it is parked the model's variables hold the training state
(on a backend that keeps it outside them during `fit()`, JAX, the backend's
part puts it there first), so the model can be read, stepped and saved, and
`fit()` goes on from whatever they hold.

At a breakpoint's hit (the Recorder calls the controller, its breakpoint
listener) a backend that keeps the batch in flight (`keeper`) cancels the
Recorder's stop, puts the model back to its state before the batch that hit
and opens a `lab.Stepper` on that batch; `resume()` goes on with the next
batch, when nothing was stepped from the state after the batch that hit, as
if the pause had never been. Where no batch is kept the Recorder's stop
stands.

This module is the part no backend changes; each backend's `pause.py`
subclasses `PauseController` with its state handling. Headless: Keras and
threading only. The buttons that call it are `widgets`'.
"""

import threading

import keras

# How often a parked training thread looks whether it may go on (seconds).
_POLL = 0.05

NO_BATCH_KEPT = ("No batch is kept: BatchInFlight keeps batches only while armed and at "
                 "steps_per_execution=1. Arm it (armed=True) and train again.")


def find_recorder(callbacks):
    """The `lab.Recorder` among fit()'s callbacks, or the one a view holds (`view.recorder`); None if none.

    Args:
        callbacks: sequence of keras callbacks.
    """
    from lab.backend import Recorder  # the backend's, picked once Keras runs

    for callback in callbacks:
        for candidate in (callback, getattr(callback, "recorder", None)):
            if isinstance(candidate, Recorder):
                return candidate
    return None


class PauseController(keras.callbacks.Callback):
    """Parks fit() at batch boundaries: on request, after one batch, at a breakpoint.

    The backend's part, in a subclass: `mode_switcher` (the backend's
    `lab.ModeSwitcher`), `make_keeper()` (the callback that keeps the batch
    in flight, or None), `read_state()` / `write_state(state)` (the model's
    training state on the host and back) and `hold_state()` (puts the state
    `fit()` holds into the model's variables before the thread parks).

    The model is reached as `self._model`: on JAX, reading a callback's
    `model` syncs the whole training state into the variables, which the
    controller does only when it parks.

    Args:
        recorder: `lab.Recorder` or None, whose breakpoints pause training.
        on_state: callable `on_state(state, detail)` or None, called on the
            training thread when it parks (`"paused"`) and goes on
            (`"running"`).
    """

    mode_switcher = None

    def __init__(self, recorder=None, on_state=None):
        super().__init__()
        self.recorder = recorder
        self.on_state = on_state
        self.stepper = None
        self.last_hit = None  # (step, detail) of the latest breakpoint hit
        self.batches_done = 0
        self.detail = ""
        self.stop_requested = False
        self.keeper = self.make_keeper()
        self._go = threading.Event()
        self._go.set()
        self._pause_requested = False
        self._step_once = False
        self._hit = None

    # ---- the backend's part -------------------------------------------------

    def make_keeper(self):
        """The callback that keeps the batch in flight and the state before it, or None."""
        return None

    def read_state(self):
        """An opaque copy of the model's training state (while parked)."""
        raise NotImplementedError

    def write_state(self, state):
        """Puts back a state `read_state` took."""
        raise NotImplementedError

    def hold_state(self):
        """Makes the model's variables hold the training state, before the thread parks."""

    # ---- set-up ---------------------------------------------------------------

    @property
    def breakpoints_armed(self):
        """bool, whether a breakpoint hit would pause (the recorder has breakpoints)."""
        return bool(self.recorder is not None and self.recorder.breakpoints)

    def callbacks(self, callbacks=()):
        """fit()'s callbacks around `callbacks`: a mode switcher, the batch keeper, them, this controller.

        A `lab.ModeSwitcher` comes first (unless `callbacks` has one), so a
        switch asked for meanwhile is applied before the batch is kept and run.
        """
        callbacks = list(callbacks)
        switcher = [] if any(isinstance(c, self.mode_switcher) for c in callbacks) else [self.mode_switcher()]
        keeper = [] if self.keeper is None else [self.keeper]
        return switcher + keeper + callbacks + [self]

    # ---- control (safe from any thread) --------------------------------------

    def pause(self):
        """Parks training at the next batch boundary."""
        self._pause_requested = True

    def resume(self):
        """Continues a paused training (after a breakpoint: with the next batch)."""
        self._pause_requested = False
        self._step_once = False
        self._go.set()

    def step(self):
        """Lets one batch of `fit()` run, then parks again."""
        self._pause_requested = True
        self._step_once = True
        self._go.set()

    def stop(self):
        """Ends training at the next batch boundary (a parked one at once)."""
        self.stop_requested = True
        if self._model is not None:
            self._model.stop_training = True
        self._go.set()

    # ---- the training thread ---------------------------------------------------

    def on_train_begin(self, logs=None):
        self._hit = None
        if self.recorder is not None:
            self.recorder.add_breakpoint_listener(self._on_breakpoint)

    def on_train_end(self, logs=None):
        self.release()

    def release(self):
        """Stops listening to the recorder's breakpoints and takes the keeper's
        hooks off; call it when fit() ends by an exception.

        Keras calls no `on_train_end` when `fit()` raises, so whoever runs
        `fit()` calls this in a `finally`. A later `fit()` of the same
        recorder without this controller then stops on a hit as usual.
        """
        self._hit = None
        if self.recorder is not None:
            self.recorder.remove_breakpoint_listener(self._on_breakpoint)
        if self.keeper is not None:
            self.keeper.release_hooks()  # its wrapper on the train function, left on by a fit() that raised

    def _on_breakpoint(self, step, detail):
        # Called by the Recorder inside its own batch end: act once every
        # callback has seen the batch, at this controller's batch end.
        self._hit = self.last_hit = (step, detail)

    def on_train_batch_end(self, batch, logs=None):
        self.batches_done += 1
        hit, self._hit = self._hit, None
        if self.stop_requested:
            self._model.stop_training = True
            return
        if hit is not None and self.keeper is not None and self.keeper.data is not None:
            self._pause_at_breakpoint(hit[1])
        elif hit is not None:
            self.detail = hit[1]  # no batch kept: the Recorder's stop stands
        elif self._pause_requested:
            self._park("stepped one batch" if self._step_once else "paused")

    def _pause_at_breakpoint(self, detail):
        model, run = self._model, self.recorder.run
        model.stop_training = False  # the Recorder stops on a hit; here we pause
        self.hold_state()
        after = self.read_state()
        step = run.next_step - 1
        # The stepper puts the model and the run's step count back to before
        # the batch that hit; its steps and rewinds move both on.
        self.stepper = self.keeper.stepper(run=run, start_step=step)
        self._pause_requested = True
        self._park(detail)
        if not self.stepper.traces and self.stepper.last_trace is None:
            # Nothing stepped: continue as if the pause never happened.
            self.write_state(after)
            run.next_step = step + 1
        self.recorder.resume_after_breakpoint()

    def _park(self, detail):
        """Blocks the training thread until resume(), step() or stop()."""
        self.hold_state()
        self._go.clear()
        self._report("paused", detail)
        while not self._go.wait(_POLL):
            pass
        if self.stop_requested:
            self._model.stop_training = True
            return
        self._report("running", "")

    def _report(self, state, detail):
        if self.on_state is not None:
            self.on_state(state, detail)
