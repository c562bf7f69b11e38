"""Lab: the Dashboard, ModeSwitch, StepperPanel and DevicePicker in one panel.

Training runs on the lab's background thread (`widgets.BackgroundFit`), so
Pause, Continue, Stop, a mode switch and the stepper act while `fit()` runs:
a blocking `fit()` in a cell would hold every click until the cell ends.
The panel holds no training logic of its own; each Run starts one
`BackgroundFit` that records into the one Dashboard, so several runs make
one chart.
"""

import html
import numbers
import sys
import threading
import time

import ipywidgets
import keras

from lab.arguments import GRADIENTS_EXAMPLE, check_class_weight, check_flag
from lab.backend import Stepper, devices
from lab.breakpoints import as_breakpoints, nonfinite
from widgets.background import BackgroundFit
from widgets.dashboard import Dashboard
from widgets import distribution
from widgets.device_picker import DevicePicker
from widgets.display import show, view_bundle
from widgets.mode_switch import ModeSwitch
from widgets.stepper_panel import StepperPanel

TABS = ("Training", "Modes", "Stepper", "Devices")
_ACTIVE = ("running", "paused")
START_TIMEOUT = 60.0  # seconds start() waits for fit() to begin


class Lab(ipywidgets.VBox):
    """One panel to train a model and look inside: charts, modes, stepping, devices.

    Run / Pause / Continue / Stop above four tabs: **Training** (the live
    Dashboard: its plotly chart, or on Colab and in VS Code its HTML view as
    SVG in a core widget), **Modes** (the backend's modes: eager / graph / XLA
    on TensorFlow, eager / XLA on JAX; and Compare), **Stepper** (step
    `train_step` by hand while no training runs; when a breakpoint pauses
    training it opens here on the batch that hit, with the model as before
    that batch, and its Continue resumes `fit()`), **Devices** (the
    DevicePicker when `build_model` is given, otherwise the device list).

    Args:
        model: keras.Model, compiled; None when `build_model` builds it.
        data: tuple `(x, y)` or `(x, y, sample_weight)` of arrays, the inputs
            `x` alone (as `fit(x)` takes them: a GAN, an autoencoder), or a
            batched `tf.data.Dataset` or a `keras.utils.PyDataset`: what each
            Run trains on.
        batch_size: int, for array data.
        epochs: int, epochs per Run.
        validation_data: as `fit()` takes it, or None.
        gradients: bool, record and chart per-layer gradient norms.
        breakpoints: sequence of `lab.Breakpoint`, or None for
            `lab.breakpoints.nonfinite()` alone; `()` arms none (arming keeps
            each batch in flight: one copy of the model's state per batch, on
            the host on TensorFlow, on the device on JAX).
        build_model: callable or None, a factory returning a compiled model,
            for the DevicePicker (it builds under the chosen strategy's scope;
            the panel then trains that model).
        view: str, where the Training tab's charts render: `"auto"`,
            `"plotly"` or `"html"`, as `widgets.Dashboard(view=...)` takes it.
        **fit_options: passed to every `fit()` (`shuffle`, `class_weight`, ...).

    Example:

    ```python
    panel = widgets.Lab(model, (x_train, y_train), epochs=5, validation_data=(x_test, y_test))
    panel.start()     # or click Run
    panel             # show it
    panel.wait(120)   # in a script or a checked notebook
    ```
    """

    def __init__(self, model, data, batch_size=32, epochs=1, validation_data=None, gradients=True,
                 breakpoints=None, build_model=None, view="auto", **fit_options):
        if model is None and build_model is None:
            raise ValueError("Lab needs a compiled model, or build_model= (a function that builds one).")
        if model is not None and not isinstance(model, keras.Model):
            raise TypeError(f"Lab(model, data): model must be a compiled keras.Model (or None with "
                            f"build_model=...); got {type(model).__name__}.")
        if build_model is not None and not callable(build_model):
            raise TypeError(f"Lab(build_model=...) must be a function that returns a compiled model; "
                            f"got {type(build_model).__name__}.")
        self.data = _checked_data(data)
        self.batch_size = _positive_int("batch_size", batch_size, optional=True)
        self.epochs = _positive_int("epochs", epochs)
        check_flag("widgets.Lab", "gradients", gradients, GRADIENTS_EXAMPLE)
        check_class_weight("widgets.Lab", fit_options.get("class_weight"))
        self.validation_data = validation_data
        self.fit_options = fit_options
        self.breakpoints = [nonfinite()] if breakpoints is None else as_breakpoints(breakpoints)
        # With breakpoints armed the training thread keeps each batch in flight
        # (a host copy per batch anyway); reading the device rows after every
        # batch too makes a device breakpoint's hit pause on its own batch,
        # not on whichever later batch the next block read happens at.
        self._dashboard_options = dict(gradients=gradients, breakpoints=self.breakpoints,
                                       flush_every=0.0 if self.breakpoints else 0.25, view=view)
        self.dashboard = self._make_dashboard()
        self.training = None
        self.stepper_panel = None
        self._handles = []

        self.run_button = ipywidgets.Button(description="Run", icon="play", tooltip=f"fit() for {self.epochs} epochs")
        self.pause_button = ipywidgets.Button(description="Pause", icon="pause")
        self.continue_button = ipywidgets.Button(description="Continue", icon="forward")
        self.stop_button = ipywidgets.Button(description="Stop", icon="stop")
        self.status = ipywidgets.HTML()
        self.run_button.on_click(lambda _: self.start())
        self.pause_button.on_click(lambda _: self.pause())
        self.continue_button.on_click(lambda _: self.resume())
        self.stop_button.on_click(lambda _: self.stop())

        self.picker = None
        if build_model is not None:
            self.picker = DevicePicker(build_model, batch_size=batch_size if _is_arrays(self.data) else None)
            self.picker.on_build(self._adopt)
            devices_view = self.picker
        else:
            devices_view = ipywidgets.HTML(
                devices().to_html(index=False, na_rep="")
                + "<p>Pass <code>build_model=</code> to pick a strategy and build the model under it.</p>")
        self.model = model
        self.strategy = None  # the DevicePicker's, which the model was built under
        self.mode_switch = None
        self.step_here_button = ipywidgets.Button(description="Step here", icon="step-forward",
                                                  tooltip="step train_step one batch at a time")
        self.step_here_button.on_click(lambda _: self.open_stepper())
        self.tabs = ipywidgets.Tab(children=[self.dashboard.widget, ipywidgets.VBox(), self._stepper_intro(),
                                             devices_view], titles=TABS)
        if model is None:
            self.picker.build()  # calls _adopt
        else:
            self._adopt(model)
        buttons = ipywidgets.HBox([self.run_button, self.pause_button, self.continue_button, self.stop_button,
                                   self.status])
        super().__init__([buttons, self.tabs])
        self._show_state("idle", "")

    # ---- training ----------------------------------------------------------

    @property
    def run(self):
        """lab.Run, the record of every Run of this panel (the Dashboard's)."""
        return self.dashboard.run

    @property
    def state(self):
        """str, `idle` before the first Run, else the training's state (`running`, `paused`, ...)."""
        return "idle" if self.training is None else self.training.state

    def start(self):
        """Starts `fit()` for `epochs` epochs on the background thread (the Run button); returns self.

        Raises:
            RuntimeError: a training of this panel is running or paused.
        """
        if self.state in _ACTIVE:
            raise RuntimeError("This panel is training already: Stop it (or wait) before running again.")
        self._close_stepper()  # fit() changes the weights under a stepper opened by hand
        args, kwargs = _fit_arguments(self.data, self.batch_size)
        began = threading.Event()
        kwargs.update(self.fit_options, epochs=self.epochs, validation_data=self.validation_data,
                      callbacks=[self.dashboard, _TrainingBegan(began)])
        # fit() runs under the strategy the model was built under: on JAX a
        # keras.distribution, which the training thread takes from here.
        with distribution.scope(self.strategy):
            self.training = BackgroundFit(self.model, *args, **kwargs)
        self.training.add_listener(self._show_state)
        self.training.start()
        # Returns once fit() has begun: whatever its start displays (Keras'
        # summary, which the Recorder reads, emits an empty rich output in a
        # kernel) lands in the cell that started it, not in a later one.
        deadline = time.monotonic() + START_TIMEOUT
        while not began.wait(0.02) and not self.training.join(0) and time.monotonic() < deadline:
            pass
        return self

    def pause(self):
        """Parks training at the next batch boundary."""
        if self.training is not None:
            self.training.pause()

    def resume(self):
        """Continues a paused training (after a breakpoint: with the next batch)."""
        if self.training is None or self.training.state != "paused":
            return
        self.training.resume()
        # Until the thread wakes, the state still says paused; wait() called
        # right after must not take that for a pause.
        self.training.wait_for("running", "finished", "stopped", "failed", timeout=5.0)

    def stop(self):
        """Ends training at the next batch boundary (a paused one at once)."""
        if self.training is not None:
            self.training.stop()

    def wait(self, timeout=None):
        """Waits until training is not running: ended, or paused for you.

        A paused training waits for a click (or `resume()`), so waiting on it
        any longer could only time out.

        Args:
            timeout: float or None, seconds to wait at most.

        Returns:
            bool, True when training is not running (or never started).
        """
        if self.training is None:
            return True
        if timeout is None:
            while not self.training.wait_for("paused", "finished", "stopped", "failed", timeout=60.0):
                pass
            return True
        return self.training.wait_for("paused", "finished", "stopped", "failed", timeout=timeout)

    def summary(self):
        """A deterministic text summary (no timings): the state, the mode and the Dashboard's summary."""
        detail = self.training.detail if self.training is not None else ""
        line = f"Lab ({self.state}{': ' + detail if detail else ''}), model {self.model.name!r}"
        return line + "\n" + self.dashboard.summary()

    # ---- the tabs ------------------------------------------------------------

    def open_stepper(self):
        """Opens a `lab.Stepper` on the data in the Stepper tab (not while training runs); returns its panel."""
        if self.state in _ACTIVE:
            self._say("The stepper opens by hand only while no training runs; a breakpoint opens it on its batch.")
            return None
        # The batches fit() trains on: its class weights too, where the panel's fit() is given them;
        # stepped under the strategy the model was built under, as fit() trains it.
        with distribution.scope(self.strategy):
            stepper = Stepper(self.model, self.data, batch_size=self.batch_size, shuffle=False,
                              class_weight=self.fit_options.get("class_weight"))
            self._set_stepper(StepperPanel(stepper, breakpoints=self.breakpoints))
        return self.stepper_panel

    def _adopt(self, model, strategy=None):
        """Trains `model` from now on (a DevicePicker build, under `strategy`); refused while training runs."""
        if self.state in _ACTIVE:
            self._say("Stop training before switching to the model just built.")
            return
        self.model = model
        self.strategy = strategy
        if len(self.dashboard.run):
            # One run records one model: the model just built gets a run and chart of its own.
            self.dashboard = self._make_dashboard()
        self.mode_switch = ModeSwitch(model, data=self.data, batch_size=self.batch_size)
        self.tabs.children = (self.dashboard.widget, self.mode_switch, *self.tabs.children[2:])
        self._close_stepper()
        if self.picker is not None and self.training is not None:
            self._say(f"The next Run trains {html.escape(model.name)}.")

    def _make_dashboard(self):
        dashboard = Dashboard(**self._dashboard_options)
        # Shown inside this panel: the Dashboard's final view redraws the
        # panel's output instead of making a second one.
        dashboard.show_inside(self._show_final_view)
        return dashboard

    def _stepper_intro(self):
        note = ipywidgets.HTML(
            "<p>When a breakpoint pauses training, the stepper opens here on the batch that hit, "
            "with the model as before it. While no training runs, <b>Step here</b> steps "
            "<code>train_step</code> on the data one batch at a time.</p>")
        return ipywidgets.VBox([note, self.step_here_button])

    def _set_stepper(self, panel):
        self.stepper_panel = panel
        self.tabs.children = (*self.tabs.children[:2], panel, *self.tabs.children[3:])
        self.tabs.selected_index = TABS.index("Stepper")

    def _close_stepper(self):
        if self.stepper_panel is not None:
            self.stepper_panel = None
            self.tabs.children = (*self.tabs.children[:2], self._stepper_intro(), *self.tabs.children[3:])

    # ---- state (called on the training thread) ---------------------------------

    def _show_state(self, state, detail):
        running, paused = state == "running", state == "paused"
        self.run_button.disabled = state in _ACTIVE
        self.pause_button.disabled = not running
        self.continue_button.disabled = not paused
        self.stop_button.disabled = not (running or paused)
        self.step_here_button.disabled = state in _ACTIVE
        if self.mode_switch is not None:
            # Compare trains copies of the model's state: not while fit() owns it.
            self.mode_switch.compare_button.disabled = state in _ACTIVE or self.data is None
        stepper = self.training.stepper if self.training is not None else None
        if paused and stepper is not None and (self.stepper_panel is None or self.stepper_panel.stepper is not stepper):
            self._set_stepper(StepperPanel(stepper, breakpoints=self.breakpoints, on_continue=self.resume))
        elif not paused and self.stepper_panel is not None and self.stepper_panel.stepper is stepper:
            self.stepper_panel.set_continue(None)
        text = f"<b>{html.escape(state)}</b>" + (f" — {html.escape(detail)}" if detail else "")
        self.status.value = text

    def _say(self, text):
        self.status.value = f"<b>{html.escape(self.state)}</b> — {text}"

    # ---- display -------------------------------------------------------------

    def _repr_mimebundle_(self, include=None, exclude=None, **kwargs):
        return view_bundle(self.model_id, self.summary(), self.dashboard.static_html(), include, exclude)

    def _ipython_display_(self):
        show(self, self._handles)

    def _show_final_view(self, _dashboard_bundle):
        """Redraws the panel's output when training ends: the final static charts."""
        bundle = self._repr_mimebundle_()
        for handle in self._handles:
            handle.update(bundle, raw=True)

    def __repr__(self):
        return f"<widgets.Lab {self.state}: {len(self.run)} steps>"


class _TrainingBegan(keras.callbacks.Callback):
    """Sets an event when fit() has begun (after the Dashboard's on_train_begin)."""

    def __init__(self, event):
        super().__init__()
        self.event = event

    def on_train_begin(self, logs=None):
        self.event.set()


def _is_arrays(data):
    return isinstance(data, tuple)


def _checked_data(data):
    """`data` as `(x, y)`, `(x, y, sample_weight)` or a dataset; x alone, as fit(x) takes it, is `(x, None)`."""
    if isinstance(data, list):
        data = tuple(data)
    if isinstance(data, keras.utils.PyDataset) or _is_tf_dataset(data):
        return data
    if isinstance(data, dict) or hasattr(data, "shape"):
        data = (data,)  # inputs alone: a model whose train_step needs no targets (a GAN, an autoencoder)
    if not isinstance(data, tuple):
        raise TypeError(
            f"Lab(model, data): data must be a tuple (x, y) or (x, y, sample_weight) of arrays, the inputs x "
            f"alone, or a batched tf.data.Dataset; got {type(data).__name__}. E.g. widgets.Lab(model, (x_train, "
            "y_train)), or widgets.Lab(gan, x_train) for a model trained on x alone.")
    if len(data) == 1:
        data = (data[0], None)
    if len(data) not in (2, 3):
        raise ValueError(f"Lab(model, data): data must be x, (x, y) or (x, y, sample_weight); "
                         f"got a tuple of {len(data)}.")
    if data[0] is None:
        raise ValueError("Lab(model, data): data's x is None; pass the training inputs as data=(x, y), "
                         "or data=x for a model trained on x alone.")
    return data


def _is_tf_dataset(data):
    """Whether `data` is a `tf.data.Dataset`; asked without importing
    TensorFlow, which holds no dataset unless something imported it."""
    tensorflow = sys.modules.get("tensorflow")
    return tensorflow is not None and isinstance(data, tensorflow.data.Dataset)


def _positive_int(argument, value, optional=False):
    if value is None and optional:
        return None
    message = f"Lab({argument}=...) must be a whole number, 1 or more; got {value!r}."
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(message)
    if value < 1:
        raise ValueError(message)
    return int(value)


def _fit_arguments(data, batch_size):
    """`fit()`'s positional and keyword arguments for `data`."""
    if _is_arrays(data):
        kwargs = dict(batch_size=batch_size)
        if len(data) == 3:
            kwargs["sample_weight"] = data[2]
        return data[:2], kwargs
    return (data,), {}
