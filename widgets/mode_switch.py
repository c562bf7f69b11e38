"""ModeSwitch: an eager / graph / XLA toggle and a chart of what each mode costs.

The toggle never runs model ops from a widget callback while another thread
trains the model: it calls `lab.modes.request_mode`, which switches at once
when the model is idle and otherwise leaves the switch pending for the
training thread to apply at the next batch boundary (a `lab.ModeSwitcher`
among the fit() callbacks does it). During a blocking
`fit()` in a cell, the kernel delivers the click only after the cell ends, so
live switching needs training off the main thread (`widgets.BackgroundFit`).
"""

import html
import numbers

import ipywidgets
import keras
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from lab.backend import MODES, ModeError, compare_modes, modes

add_mode_listener, pending_mode, request_mode, running_mode = (
    modes.add_mode_listener, modes.pending_mode, modes.request_mode, modes.running_mode)

_LABELS = {"eager": "eager", "graph": "graph", "xla": "XLA"}
_TOOLTIPS = {
    "eager": "run_eagerly=True: train_step runs as Python every step (print and pdb work)",
    "graph": "tf.function: traced once, then runs as a TensorFlow graph",
    "xla": "jit_compile=True: compiled by XLA (slow first step, often faster after)",
}


class ModeSwitch(ipywidgets.VBox):
    """Eager / graph / XLA toggle for a model, and a Compare button that charts `lab.compare_modes`.

    Args:
        model: keras.Model, compiled.
        data: tuple `(x, y)` of arrays or a `tf.data.Dataset`, for Compare;
            without it the button is disabled.
        steps: int, training steps per compared run.
        batch_size: int or None, for array data.
        modes: sequence of str, the modes Compare times.
        steps_per_execution: sequence of int, the second axis of Compare.

    Example:

    ```python
    switch = widgets.ModeSwitch(model, data=(x, y))
    switch            # click XLA, or Compare
    widgets.BackgroundFit(model, x, y, epochs=5, callbacks=[lab.ModeSwitcher()]).start()
    switch.comparison # the last compare_modes DataFrame
    ```
    """

    def __init__(self, model, data=None, steps=32, batch_size=None, modes=MODES, steps_per_execution=(1, 8)):
        if not isinstance(model, keras.Model):
            raise TypeError(f"ModeSwitch(model): model must be a compiled keras.Model; got {type(model).__name__}. "
                            "E.g. widgets.ModeSwitch(model, data=(x, y)).")
        if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 1:
            raise TypeError(f"ModeSwitch(steps=...) must be a whole number of training steps; got {steps!r}.")
        self.model = model
        self.data = data
        self.compare_options = dict(steps=steps, batch_size=batch_size, modes=tuple(modes),
                                    steps_per_execution=tuple(steps_per_execution))
        self.comparison = None
        self._syncing = False
        self.toggle = ipywidgets.ToggleButtons(
            options=[(_LABELS[m], m) for m in MODES], value=_current(model), tooltips=[_TOOLTIPS[m] for m in MODES],
            style={"button_width": "80px"},
        )
        self.compare_button = ipywidgets.Button(
            description="Compare", icon="bar-chart", disabled=data is None,
            tooltip="Time the same steps in each mode" if data is not None else "Pass data= to compare modes",
        )
        self.status = ipywidgets.HTML()
        self.figure = _empty_figure()
        self.toggle.observe(self._on_toggle, names="value")
        add_mode_listener(self._on_mode_changed)
        self.compare_button.on_click(lambda _button: self.compare())
        super().__init__([ipywidgets.HBox([self.toggle, self.compare_button]), self.status])
        self._say(f"{_LABELS[self.toggle.value]}: the model's current mode.")

    # ---- the toggle --------------------------------------------------------

    def _on_toggle(self, change):
        if self._syncing:
            return
        mode = change["new"]
        try:
            outcome = request_mode(self.model, mode)
        except (ModeError, ValueError) as error:
            self._say(str(error), error=True)
            self.refresh()
            return
        if outcome == "pending":
            self._say(f"{_LABELS[mode]} requested: training switches at the next batch.")
        else:
            self._say(f"{_LABELS[mode]}: the next batch runs in this mode.")

    def _on_mode_changed(self, model, mode):
        # Switches made elsewhere (a schedule, a revert after a failed first
        # step, a pending click applied by the training thread) show here too.
        if model is self.model and pending_mode(model) is None:
            self.refresh()

    def refresh(self):
        """Shows the model's mode (or the pending one) on the toggle, e.g. after a reverted switch."""
        self._syncing = True
        try:
            self.toggle.value = _current(self.model)
        finally:
            self._syncing = False

    # ---- the comparison ----------------------------------------------------

    def compare(self):
        """Runs `lab.compare_modes` on `data` and draws it; returns the DataFrame (or None on error)."""
        if self.data is None:
            self._say("Pass data= to ModeSwitch to compare modes.", error=True)
            return None
        self.compare_button.disabled = True
        self._say("Comparing: each mode trains the same steps from the same state…")
        try:
            frame = compare_modes(self.model, self.data, **self.compare_options)
        except (RuntimeError, ValueError) as error:
            self._say(str(error), error=True)
            return None
        finally:
            self.compare_button.disabled = False
        self.comparison = frame
        self._draw(frame)
        if not any(child is self.figure for child in self.children):
            self.children = (*self.children, self.figure)
        failed = frame[frame["error"].notna()]
        notes = "".join(f"<br>{html.escape(r['mode'])}: {html.escape(r['error'])}" for _, r in failed.iterrows())
        self.status.value = f"Bottleneck: {html.escape(frame.attrs['bottleneck'])}{notes}"
        return frame

    def _draw(self, frame):
        labels = [_bar_label(row) for _, row in frame.iterrows()]
        with self.figure.batch_update():
            self.figure.data[0].x = labels
            self.figure.data[0].y = frame["trace_seconds"].to_numpy("float64")
            self.figure.data[1].x = labels
            self.figure.data[1].y = frame["step_ms"].to_numpy("float64")

    def _say(self, text, error=False):
        color = "#b00020" if error else "inherit"
        self.status.value = f"<span style='color:{color}'>{html.escape(text)}</span>"


def _current(model):
    # The mode of the function that runs: Keras keeps a made one when
    # `run_eagerly` or `jit_compile` is set by hand.
    return pending_mode(model) or running_mode(model)


def _bar_label(row):
    label = f"{_LABELS[row['mode']]} ×{row['steps_per_execution']}"
    return label + " (failed)" if row["error"] is not None else label


def _empty_figure():
    """Trace cost and per-step cost side by side: they differ by orders of magnitude."""
    figure = make_subplots(rows=1, cols=2, subplot_titles=("first call: trace + compile (s)", "per step (ms)"))
    figure.add_bar(x=[], y=[], name="trace + compile", row=1, col=1)
    figure.add_bar(x=[], y=[], name="per step", row=1, col=2)
    figure.update_layout(height=300, width=700, showlegend=False, margin=dict(l=40, r=10, t=40, b=40))
    return go.FigureWidget(figure)
