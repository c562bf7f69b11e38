"""StepperPanel: buttons and views over a `lab.Stepper`, one step at a time."""

import html

import ipywidgets
import numpy as np
import plotly.graph_objects as go

import lab.backend
from widgets import distribution
from widgets.png import png_bytes
from widgets.series import metric_names

MAX_ITEMS = 16  # batch rows or images shown
MAX_HISTOGRAM_VALUES = 5000  # gradient values sent for the histogram


class StepperPanel(ipywidgets.VBox):
    """Step, Step ×N, Rewind, Continue and Run-to-breakpoint over a Stepper.

    Shows the current batch (images as images when the input looks like
    images, a table otherwise) with predictions against targets, the loss,
    a bar chart of per-variable gradient norms with a histogram of the
    gradient values, the weight changes, and a timeline of the kept steps:
    click one to look at it again.

    Args:
        stepper: lab.Stepper.
        breakpoints: sequence of `lab.Breakpoint` or callables `condition(trace)`
            for Run-to-breakpoint.
        on_continue: callable or None; what Continue does (a paused
            background training passes its `resume`). Without one, Continue
            is disabled.
        max_steps: int, the most steps Run-to-breakpoint takes.

    Its buttons step under the `keras.distribution` in effect where the panel
    is made (JAX's data parallelism), as `fit()` trains under it.

    Example:

    ```python
    panel = widgets.StepperPanel(lab.Stepper(model, (x, y)), breakpoints=[lab.Breakpoint(lambda r: r["loss"] > 3)])
    panel
    ```
    """

    def __init__(self, stepper, breakpoints=(), on_continue=None, max_steps=500):
        if not isinstance(stepper, lab.backend.Stepper):
            raise TypeError(f"StepperPanel(stepper): stepper must be a lab.Stepper; got {type(stepper).__name__}. "
                            "E.g. widgets.StepperPanel(lab.Stepper(model, (x, y))).")
        if isinstance(breakpoints, (str, bytes)) or not hasattr(breakpoints, "__iter__"):
            breakpoints = [breakpoints]
        if on_continue is not None and not callable(on_continue):
            raise TypeError(f"StepperPanel(on_continue=...) must be a function or None; got {type(on_continue).__name__}.")
        if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1:
            raise TypeError(f"StepperPanel(max_steps=...) must be a whole number, 1 or more; got {max_steps!r}.")
        self.stepper = stepper
        self.breakpoints = list(breakpoints)
        for point in self.breakpoints:
            trace_condition(point)  # a clear error now for something that is not a condition
        self.max_steps = int(max_steps)
        self.step_button = ipywidgets.Button(description="Step", icon="step-forward")
        self.step_n_button = ipywidgets.Button(description="Step ×N", icon="forward")
        self.n_steps = ipywidgets.BoundedIntText(value=10, min=1, max=10_000, layout={"width": "80px"})
        self.rewind_button = ipywidgets.Button(description="Rewind", icon="step-backward")
        self.continue_button = ipywidgets.Button(description="Continue", icon="play")
        self.run_button = ipywidgets.Button(description="Run to breakpoint", icon="fast-forward",
                                            disabled=not self.breakpoints)
        self.status = ipywidgets.HTML()
        self.batch_view = ipywidgets.HTML()
        self.weights_view = ipywidgets.HTML()
        self.timeline = ipywidgets.ToggleButtons(options=[], description="steps", style={"button_width": "42px"})
        self.gradient_bars = go.FigureWidget(
            data=[go.Bar(x=[], y=[], name="gradient norm")],
            layout=go.Layout(title="gradient norm per variable", height=260, margin=dict(l=40, r=10, t=40, b=80)),
        )
        self.gradient_histogram = go.FigureWidget(
            data=[go.Histogram(x=[], nbinsx=40, name="gradient values")],
            layout=go.Layout(title="gradient values", height=260, margin=dict(l=40, r=10, t=40, b=40)),
        )
        self.shown = None
        self._updating = False
        # Clicks step the model later, outside any `with` block: under the
        # distribution in effect here (Keras keeps it per thread), as fit() trains.
        self.distribution = distribution.current()
        self.step_button.on_click(lambda _: self._act(self.stepper.step))
        self.step_n_button.on_click(lambda _: self._act(lambda: self.stepper.step(self.n_steps.value)))
        self.rewind_button.on_click(lambda _: self._act(self.stepper.rewind))
        self.run_button.on_click(lambda _: self._act(self._run_to_breakpoint))
        self.continue_button.on_click(lambda _: self._continue())
        self.timeline.observe(self._on_timeline, names="value")
        self.set_continue(on_continue)
        buttons = ipywidgets.HBox([self.step_button, self.step_n_button, self.n_steps, self.rewind_button,
                                   self.continue_button, self.run_button])
        charts = ipywidgets.HBox([self.gradient_bars, self.gradient_histogram])
        super().__init__([buttons, self.status, self.timeline, self.batch_view, charts, self.weights_view])
        self.show(stepper.last_trace)

    # ---- actions -------------------------------------------------------------

    def set_continue(self, on_continue):
        """Sets what Continue does (None disables it)."""
        self._on_continue = on_continue
        self.continue_button.disabled = on_continue is None

    def _continue(self):
        on_continue, self._on_continue = self._on_continue, None
        self.continue_button.disabled = True
        self._set_buttons(False)
        if on_continue is not None:
            on_continue()
        self.status.value = "<b>continued</b>: training goes on with the next batch."

    def _set_buttons(self, enabled):
        for button in (self.step_button, self.step_n_button, self.rewind_button):
            button.disabled = not enabled
        self.run_button.disabled = not (enabled and self.breakpoints)

    def _run_to_breakpoint(self):
        return self.stepper.run_until(self.breakpoints, max_steps=self.max_steps)

    def _act(self, action):
        try:
            with distribution.scope(self.distribution):
                trace = action()
        except ValueError as error:  # e.g. rewinding past the kept history
            self.status.value = f"<span style='color:#b00'>{html.escape(str(error))}</span>"
            return
        self.show(trace)

    def _on_timeline(self, change):
        if self._updating or change["new"] is None:
            return
        for trace in self.stepper.traces:
            if trace.index == change["new"]:
                self.show(trace, from_timeline=True)

    # ---- views -----------------------------------------------------------------

    def show(self, trace, from_timeline=False):
        """Shows one step (or, with None, the batch that comes next)."""
        self.shown = trace
        if not from_timeline:
            self._updating = True
            try:
                traces = self.stepper.traces
                self.timeline.options = [(str(t.index), t.index) for t in traces]
                self.timeline.value = trace.index if trace is not None and trace in traces else None
            finally:
                self._updating = False
        if trace is None:
            x, y, _ = self.stepper.peek()
            self.status.value = (f"next: step {self.stepper.next_index} — not stepped yet")
            self.batch_view.value = batch_html(x, y, None)
            self._show_gradients({})
            self.weights_view.value = ""
            return
        self.status.value = status_html(trace)
        self.batch_view.value = batch_html(trace.x, trace.y, trace.y_pred)
        self._show_gradients(trace.gradients if trace.error is None else {})
        self.weights_view.value = weights_html(trace) if trace.error is None else ""

    def _show_gradients(self, gradients):
        names = list(gradients)
        norms = np.array([np.linalg.norm(g) for g in gradients.values()], np.float32)
        values = np.concatenate([g.ravel() for g in gradients.values()]).astype(np.float32) if names else np.zeros(0, np.float32)
        if len(values) > MAX_HISTOGRAM_VALUES:
            values = values[np.linspace(0, len(values) - 1, MAX_HISTOGRAM_VALUES).astype(int)]
        with self.gradient_bars.batch_update():
            self.gradient_bars.data[0].x = names
            self.gradient_bars.data[0].y = norms
        with self.gradient_histogram.batch_update():
            self.gradient_histogram.data[0].x = values


def trace_condition(condition):
    """`condition` as a callable on a StepTrace, as the stepper of the backend
    Keras runs on reads it (a TypeError for something that is not a condition)."""
    return lab.backend.module("stepper").trace_condition(condition)


# ---- what is shown (pure functions) --------------------------------------------


def status_html(trace):
    """One line: step, epoch, batch, loss and metrics, time; or the error, its hint and traceback."""
    head = f"<b>step {trace.index}</b> · epoch {trace.epoch} · batch {trace.batch}"
    if trace.error is not None:
        message = html.escape(f"{type(trace.error).__name__}: {trace.error}")
        hint = f"<br><i>hint:</i> {html.escape(trace.hint)}" if trace.hint else ""
        return (f"{head} · <span style='color:#b00'>{message}</span>{hint}"
                f"<details><summary>traceback</summary><pre>{html.escape(trace.traceback)}</pre></details>"
                "<br>The model is as before this step; fix the step and press Step to run this batch again.")
    # A step that logs no loss (a GAN's d_loss and g_loss) shows none: "loss nan" would read as divergence.
    values = [f"loss <b>{trace.loss:.4g}</b>"] if "loss" in trace.row else []
    values += [f"{name} {trace.row[name]:.4g}" for name in metric_names(trace.row)]
    return " · ".join([head, *values, f"{trace.seconds * 1000:.1f} ms"])


def looks_like_images(x):
    """True for (n, h, w), (n, h, w, 1|3) or flat square inputs of 8x8 pixels or more."""
    x = np.asarray(x) if not isinstance(x, (list, tuple, dict)) else None
    if x is None or x.dtype.kind not in "fiu" or x.ndim < 2:
        return False
    if x.ndim == 4 and x.shape[-1] in (1, 3):
        return min(x.shape[1:3]) >= 5
    if x.ndim == 3:
        return min(x.shape[1:3]) >= 5
    side = int(round(np.sqrt(x.shape[1])))
    return x.ndim == 2 and side * side == x.shape[1] and side >= 8 and float(np.min(x)) >= 0


def batch_html(x, y, y_pred, max_items=MAX_ITEMS):
    """The batch: images with targets and predictions under each, or a table.

    A model with several outputs (y and y_pred dicts or lists) gets each
    output's target and prediction side by side: `y[cls]`, `ŷ[cls]`, ...
    """
    if looks_like_images(x):
        images = _as_images(np.asarray(x)[:max_items])
        outputs = _outputs(y, y_pred, len(images))
        cells = []
        for i, image in enumerate(images):
            caption = " ".join(f"{name}={html.escape(values[i])}" for name, values in outputs.items())
            src = "data:image/png;base64," + _b64(png_bytes(image))
            cells.append(
                f"<figure style='display:inline-block;margin:2px;text-align:center'>"
                f"<img src='{src}' style='width:48px;image-rendering:pixelated'>"
                f"<figcaption style='font-size:10px'>{caption}</figcaption></figure>"
            )
        return "<div>" + "".join(cells) + "</div>"
    return _table_html(x, y, y_pred, max_items)


def weights_html(trace):
    """Per variable: gradient norm, weight norm, change norm and change/weight ratio."""
    rows = []
    for key, before in trace.weights_before.items():
        after = trace.weights_after.get(key, before)
        grad = trace.gradients.get(key)
        weight = float(np.linalg.norm(after))
        delta = float(np.linalg.norm(after - before))
        ratio = delta / weight if weight else float("nan")
        grad_text = f"{np.linalg.norm(grad):.3g}" if grad is not None else "none"
        rows.append(f"<tr><td>{html.escape(key)}</td><td>{grad_text}</td><td>{weight:.3g}</td>"
                    f"<td>{delta:.3g}</td><td>{ratio:.2e}</td></tr>")
    head = "<tr><th>variable</th><th>|gradient|</th><th>|weight|</th><th>|change|</th><th>change/weight</th></tr>"
    return f"<table>{head}{''.join(rows)}</table>"


def _as_images(x):
    if x.ndim == 2:
        side = int(round(np.sqrt(x.shape[1])))
        x = x.reshape(-1, side, side)
    if x.ndim == 4 and x.shape[-1] == 1:
        x = x[..., 0]
    x = x.astype(np.float64)
    low = x.min(axis=tuple(range(1, x.ndim)), keepdims=True)
    high = x.max(axis=tuple(range(1, x.ndim)), keepdims=True)
    return (255 * (x - low) / np.where(high > low, high - low, 1)).astype(np.uint8)


def _parts(value):
    """{suffix: array} of targets or predictions: `""` for one output, `[name]` or `[i]` for several."""
    if value is None:
        return {}
    if isinstance(value, dict):
        items = [(f"[{key}]", part) for key, part in value.items()]
    elif isinstance(value, (list, tuple)):
        items = [(f"[{i}]", part) for i, part in enumerate(value)]
    else:
        items = [("", value)]
    return {suffix: part for suffix, part in items if part is not None and not isinstance(part, (dict, list, tuple))}


def _outputs(y, y_pred, rows):
    """{column name: `rows` texts}: each output's target (`y`) next to its prediction (`ŷ`)."""
    targets, predictions = _parts(y), _parts(y_pred)
    columns = {}
    for suffix in dict.fromkeys([*targets, *predictions]):
        for label, parts in (("y", targets), ("ŷ", predictions)):
            values = np.asarray(parts[suffix]) if suffix in parts else None
            if values is not None and values.ndim and len(values) >= rows:
                columns[label + suffix] = [_value(v) for v in values[:rows]]
    return columns


def _value(value):
    value = np.asarray(value)
    if value.ndim == 0:
        return f"{value.item():.3g}" if value.dtype.kind == "f" else str(value.item())
    if value.size == 1:
        return f"{value.ravel()[0]:.3g}"
    return str(int(np.argmax(value)))  # a class: the arg max of scores or of one-hot


def _table_html(x, y, y_pred, max_items):
    import pandas as pd

    columns = {}
    if isinstance(x, dict):
        x = next(iter(x.values()))
    elif isinstance(x, (list, tuple)):
        x = x[0]
    x = np.asarray(x)[:max_items]
    flat = x.reshape(len(x), -1)
    for j in range(min(flat.shape[1], 8)):
        columns[f"x[{j}]"] = flat[:, j]
    if flat.shape[1] > 8:
        columns["…"] = ["…"] * len(flat)
    columns.update(_outputs(y, y_pred, len(flat)))
    return pd.DataFrame(columns).to_html(float_format=lambda v: f"{v:.3g}", index=False)


def _b64(data):
    import base64

    return base64.b64encode(data).decode("ascii")
