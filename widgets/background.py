"""Training off the main thread, so clicks reach the kernel while fit() runs.

While a cell runs a blocking `fit()`, ipykernel handles widget clicks only
after the cell ends. `BackgroundFit` runs `model.fit(...)` on a daemon thread
and returns at once; Pause, Continue, Stop and Step act at the next batch
boundary through the backend's `PauseController` (`lab.pause`), which also
pauses at a breakpoint's hit and opens the stepper on it, and so does a mode
switch asked for with `lab.modes.request_mode` (the ModeSwitch widget). This module is the thread and the buttons; what a pause does is
`lab.pause`'s.

Threading rules kept here: widget callbacks only set flags (never run model
ops) while training runs; model ops from the panel happen only while the
training thread is parked; the training thread reports through `state` and
listeners, never `print`. The thread is a daemon and `join(timeout)` bounds
every wait, so nothing here can hang a notebook run.
"""

import threading
import time

import lab.backend
from widgets import distribution

pause = lab.backend.module("pause")

STATES = ("idle", "running", "paused", "stopped", "finished", "failed")


class BackgroundFit:
    """Runs `model.fit(...)` on a daemon thread, controllable between batches.

    While paused, the model's weights and optimizer state are those after
    the last batch that ran (on JAX too, where `fit()` keeps them outside
    the variables between batches), and `fit()` goes on from them.

    With a Recorder or Dashboard among the callbacks whose breakpoints are
    armed, a hit pauses training instead of stopping it: the model is put
    back to its state before that batch and `stepper` (a `lab.Stepper` on the
    batch in flight) lets you step or rewind it; `resume()` continues `fit()`
    with the next batch. Keeping the batch in flight costs, per batch while
    breakpoints are armed, one copy of the model's training state (on the
    host on TensorFlow, on the device on JAX; see
    `lab.in_flight.BatchInFlight`; it needs `steps_per_execution=1`).

    `fit()` runs under the `keras.distribution` in effect where the
    BackgroundFit is made (Keras keeps it per thread).

    Args:
        model: keras.Model, compiled.
        *args: passed to `model.fit` (`x`, `y`, ...).
        **kwargs: passed to `model.fit`; `verbose` defaults to 0 because the
            thread's output belongs in widgets, not in whichever cell runs.

    Example:

    ```python
    training = widgets.BackgroundFit(model, x, y, epochs=5, callbacks=[dash]).start()
    training.controls()          # Pause / Continue / Step / Stop buttons
    training.join(timeout=120)   # in a script or a checked notebook
    ```
    """

    def __init__(self, model, *args, **kwargs):
        kwargs.setdefault("verbose", 0)
        self.model = model
        self.args, self.kwargs = args, kwargs
        self.callbacks = list(kwargs.pop("callbacks", None) or [])
        self.recorder = pause.find_recorder(self.callbacks)
        self.controller = pause.PauseController(self.recorder, on_state=self._set_state)
        self.state = "idle"
        self.detail = ""
        self.error = None
        self.history = None
        self._thread = None
        self._listeners = []
        self._view = None
        # Keras keeps the distribution per thread: fit() runs on the training
        # thread under the one in effect where this training was made.
        self.distribution = distribution.current()

    @property
    def stepper(self):
        """`lab.Stepper` on the batch that hit a breakpoint, or None before any hit."""
        return self.controller.stepper

    @property
    def batches_done(self):
        """int, batches of `fit()` that ended."""
        return self.controller.batches_done

    @property
    def breakpoints_armed(self):
        return self.controller.breakpoints_armed

    # ---- control (safe from any thread) --------------------------------------

    def start(self):
        """Starts `fit()` on a daemon thread; returns self at once."""
        if self._thread is not None:
            raise RuntimeError("This BackgroundFit has started already; create a new one to train again.")
        self._thread = threading.Thread(target=self._train, name="lab-fit", daemon=True)
        self._set_state("running")
        self._thread.start()
        return self

    def pause(self):
        """Parks training at the next batch boundary."""
        self.controller.pause()

    def resume(self):
        """Continues a paused training (after a breakpoint: with the next batch)."""
        self.controller.resume()

    def step(self):
        """Lets one batch of `fit()` run, then parks again."""
        self.controller.step()

    def stop(self):
        """Ends training at the next batch boundary (a paused one at once)."""
        self.model.stop_training = True
        self.controller.stop()

    def join(self, timeout=None):
        """Waits for the thread; True when training has ended.

        Args:
            timeout: float or None, seconds to wait at most.
        """
        if self._thread is not None:
            self._thread.join(timeout)
        return self._thread is not None and not self._thread.is_alive()

    def wait_for(self, *states, timeout=30.0):
        """Waits until `state` is one of `states`; True when it got there in time."""
        deadline = time.monotonic() + timeout
        while self.state not in states:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True

    def add_listener(self, fn):
        """Calls `fn(state, detail)` on the training thread when the state changes."""
        self._listeners.append(fn)

    def controls(self):
        """The Pause / Continue / Step / Stop buttons and a status line (a widget)."""
        if self._view is None:
            self._view = TrainingControls(self)
        return self._view

    # ---- the training thread ---------------------------------------------------

    def _train(self):
        try:
            with distribution.scope(self.distribution):
                self.history = self.model.fit(*self.args, callbacks=self.controller.callbacks(self.callbacks),
                                              **self.kwargs)
        except BaseException as error:  # noqa: BLE001 - reported through state, not print
            self.error = error
            self._set_state("failed", f"{type(error).__name__}: {error}")
            return
        finally:
            self.controller.release()
        self._set_state("stopped" if self.controller.stop_requested else "finished",
                        self.controller.detail or self.detail)

    def _set_state(self, state, detail=""):
        # Views first, then the state: whoever waits for "paused" finds the
        # panel of that pause already built.
        for fn in list(self._listeners):
            try:
                fn(state, detail)
            except Exception:  # noqa: BLE001 - a view must not stop training
                self._listeners.remove(fn)
        self.state, self.detail = state, detail


class TrainingControls:
    """Pause / Continue / Step / Stop buttons and a status line for a BackgroundFit.

    When a breakpoint pauses training, a `StepperPanel` on the batch in flight
    opens below the buttons; its Continue resumes `fit()`.

    Args:
        training: BackgroundFit.
    """

    def __init__(self, training):
        import ipywidgets

        self.training = training
        self.pause_button = ipywidgets.Button(description="Pause", icon="pause")
        self.continue_button = ipywidgets.Button(description="Continue", icon="play")
        self.step_button = ipywidgets.Button(description="Step", icon="step-forward",
                                             tooltip="run one batch of fit(), then pause")
        self.stop_button = ipywidgets.Button(description="Stop", icon="stop")
        self.status = ipywidgets.HTML()
        self.panel_slot = ipywidgets.VBox()
        # Clicks only set flags: the training thread acts on them between batches.
        self.pause_button.on_click(lambda _: training.pause())
        self.continue_button.on_click(lambda _: training.resume())
        self.step_button.on_click(lambda _: training.step())
        self.stop_button.on_click(lambda _: training.stop())
        buttons = [self.pause_button, self.continue_button, self.step_button, self.stop_button]
        self.widget = ipywidgets.VBox([ipywidgets.HBox(buttons + [self.status]), self.panel_slot])
        self.panel = None
        training.add_listener(self._on_state)
        self._on_state(training.state, training.detail)

    def _on_state(self, state, detail):
        running = state == "running"
        paused = state == "paused"
        self.pause_button.disabled = not running
        self.continue_button.disabled = not paused
        self.step_button.disabled = not paused
        self.stop_button.disabled = not (running or paused)
        text = f"<b>{state}</b>" + (f" — {_escape(detail)}" if detail else "")
        self.status.value = text + f" · {self.training.batches_done} batches"
        stepper = self.training.stepper
        if paused and stepper is not None and (self.panel is None or self.panel.stepper is not stepper):
            from widgets.stepper_panel import StepperPanel

            self.panel = StepperPanel(stepper, on_continue=self.training.resume)
            self.panel_slot.children = [self.panel]
        elif not paused and self.panel is not None:
            self.panel.set_continue(None)

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)


def _escape(text):
    import html

    return html.escape(str(text))
