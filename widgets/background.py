"""Training off the main thread, so clicks reach the kernel while fit() runs.

While a cell runs a blocking `fit()`, ipykernel handles widget clicks only
after the cell ends. `BackgroundFit` runs `model.fit(...)` on a daemon thread
and returns at once; Pause, Continue, Stop and Step act at the next batch
boundary through a `threading.Event` checked in a callback, and so does a
mode switch asked for with `lab.modes.request_mode` (the ModeSwitch widget).

Threading rules kept here: widget callbacks only set flags (never run model
ops) while training runs; model ops from the panel happen only while the
training thread is parked; the training thread reports through `state` and
listeners, never `print`. The thread is a daemon and `join(timeout)` bounds
every wait, so nothing here can hang a notebook run.
"""

import threading
import time

import keras

from lab.in_flight import BatchInFlight
from lab.modes import ModeSwitcher
from lab.recorder import Recorder
from lab.state import read_state, write_state

STATES = ("idle", "running", "paused", "stopped", "finished", "failed")


class BackgroundFit:
    """Runs `model.fit(...)` on a daemon thread, controllable between batches.

    With a Recorder or Dashboard among the callbacks whose breakpoints are
    armed, a hit pauses training instead of stopping it: the model is put
    back to its state before that batch and `stepper` (a `lab.Stepper` on the
    batch in flight) lets you step or rewind it; `resume()` continues `fit()`
    with the next batch. Keeping the batch in flight costs, per batch while
    breakpoints are armed, one host copy of the model's training state and a
    one-batch call (see `lab.in_flight.BatchInFlight`; it needs
    `steps_per_execution=1`).

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
        self.recorder = next((r for r in (c if isinstance(c, Recorder) else getattr(c, "recorder", None)
                                          for c in self.callbacks) if isinstance(r, Recorder)), None)
        self.state = "idle"
        self.detail = ""
        self.error = None
        self.history = None
        self.stepper = None
        self.batches_done = 0
        self._thread = None
        self._go = threading.Event()
        self._go.set()
        self._pause_requested = False
        self._step_once = False
        self._stop_requested = False
        self._listeners = []
        self._view = None

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
        """Ends training at the next batch boundary (a paused one at once)."""
        self._stop_requested = True
        self.model.stop_training = True
        self._go.set()

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
        self._keeper = BatchInFlight(armed=lambda: self.breakpoints_armed)
        callbacks = [self._keeper] + self.callbacks + [_Control(self)]
        if not any(isinstance(c, ModeSwitcher) for c in self.callbacks):
            # First, so a switch asked for meanwhile (the ModeSwitch widget) is
            # applied before the batch is kept and run.
            callbacks.insert(0, ModeSwitcher())
        try:
            self.history = self.model.fit(*self.args, callbacks=callbacks, **self.kwargs)
        except BaseException as error:  # noqa: BLE001 - reported through state, not print
            self.error = error
            self._set_state("failed", f"{type(error).__name__}: {error}")
            return
        self._set_state("stopped" if self._stop_requested else "finished", self.detail)

    def _set_state(self, state, detail=""):
        # Views first, then the state: whoever waits for "paused" finds the
        # panel of that pause already built.
        for fn in list(self._listeners):
            try:
                fn(state, detail)
            except Exception:  # noqa: BLE001 - a view must not stop training
                self._listeners.remove(fn)
        self.state, self.detail = state, detail

    @property
    def breakpoints_armed(self):
        return bool(self.recorder is not None and self.recorder.breakpoints)

    def _park(self, detail):
        """Blocks the training thread until resume(), step() or stop()."""
        self._go.clear()
        self._set_state("paused", detail)
        while not self._go.wait(0.05):
            pass
        if self._stop_requested:
            self.model.stop_training = True
            return
        self._set_state("running")

    def _paused_at_breakpoint(self):
        detail = self.recorder.status_detail if self.recorder is not None else "breakpoint"
        self.model.stop_training = False  # the Recorder stops on a hit; here we pause
        after = read_state(self.model)
        run = self.recorder.run if self.recorder is not None else None
        step = run.next_step - 1 if run is not None else self.batches_done - 1
        # The stepper puts the model and the run's step count back to before
        # the batch that hit; its steps and rewinds move both on.
        self.stepper = self._keeper.stepper(run=run, start_step=step)
        self._pause_requested = True
        self._park(detail)
        if not self.stepper.traces and self.stepper.last_trace is None:
            # Nothing stepped: continue as if the pause never happened.
            write_state(after)
            if run is not None:
                run.next_step = step + 1
        if self.recorder is not None and self.recorder.status == "breakpoint":
            self.recorder._set_status("running")


class _Control(keras.callbacks.Callback):
    """Last callback: turns flags into pauses and stops at batch ends."""

    def __init__(self, owner):
        super().__init__()
        self.owner = owner

    def on_train_batch_end(self, batch, logs=None):
        owner = self.owner
        owner.batches_done += 1
        recorder = owner.recorder
        if owner._stop_requested:
            self.model.stop_training = True
            return
        hit = recorder is not None and recorder.status == "breakpoint" and self.model.stop_training
        if hit and owner._keeper.data is not None:
            owner._paused_at_breakpoint()
        elif hit:
            owner.detail = recorder.status_detail  # no batch kept: the Recorder's stop stands
        elif owner._pause_requested:
            owner._park("stepped one batch" if owner._step_once else "paused")


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
