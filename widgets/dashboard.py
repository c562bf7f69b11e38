"""Dashboard: a live view over a Recorder (it holds one; it is no Recorder itself).

The callback only turns lifecycle events into calls: recording is its
`lab.Recorder`'s (`dashboard.recorder`, to which every fit() callback is
forwarded), drawing is a view's. Two views sit behind one `send(...)`
(`widgets.views`): the plotly `FigureWidget` (`widgets.charts.LiveFigure`)
and the HTML view (`widgets.html_view`: SVG in one output updated in place,
for Colab, VS Code and anywhere the plotly widget cannot render), chosen when
training begins by `widgets.views.choose_view` (`view="auto"`), or by name.
Refreshes are rate-limited (a refresh reads the run, downsamples every series
and sends one update), never per batch, and the view is drawn once and
updated in place: no `clear_output`.

In notebooks checked by nbval: the cell that runs `fit()` shows the
Dashboard as it was when training began (nbval ignores display updates,
which Jupyter and nbconvert apply), so that cell's output is truly variable
and carries `# NBVAL_IGNORE_OUTPUT`. A later cell that shows `dashboard`
is checkable: its text/plain holds no timings, and its text/html differs
from run to run only inside `<svg>` elements, which
`widgets.static.SANITIZE_SVG` (a regex for `--nbval-sanitize-with`) blanks.
"""

import collections
import dataclasses
import html
import numbers
import threading
import time
import warnings

import ipywidgets
import keras
import numpy as np

import lab

from lab.arguments import GRADIENTS_EXAMPLE, WEIGHTS_EXAMPLE, check_flag, check_no_model, check_number, check_seconds
from lab.backend import Recorder
from widgets import static
from widgets.charts import GHOST_COLOR, LiveFigure
from widgets.display import show, view_bundle
from widgets.downsampling import downsample
from widgets.html_view import HtmlView
from widgets.series import ChartState, Series, metric_names
from widgets.smoothing import DEFAULT_WEIGHT, check_weight
from widgets.views import PlotlyView, check_view, choose_view

_TERMINAL = ("finished", "stopped", "failed", "interrupted")
# Seconds of training whose share of refresh time (`refresh_budget`) a
# Dashboard may spend ahead: its first refreshes are its slowest (they add the
# chart's traces, with Python's caches cold: 5-11 ms against 3 ms later for a
# 3-layer model), and paced by each refresh alone, one 11 ms refresh held the
# chart back for 1.1 s, a third of the quickstart's training.
REFRESH_AHEAD_SECONDS = 3.0
_STATUS_COLORS = {
    "idle": "#666", "running": "#1f77b4", "finished": "#2ca02c", "stopped": "#ff7f0e",
    "breakpoint": "#ff7f0e", "failed": "#d62728", "interrupted": "#d62728",
}


def _frontend_available():
    """True inside a Jupyter kernel, where a displayed widget has a frontend.

    Decided when asked (not at import) so tests and scripts can change it.
    """
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


class Dashboard(keras.callbacks.Callback):
    """A Keras callback and a notebook view: live loss, metrics, gradients, status.

    A view over a `lab.Recorder` (composition: `dashboard.recorder` records,
    its record is `dashboard.run`) that shows, while `fit()` runs: a status
    line (with the exception's message when a step fails), epoch/batch
    progress with an estimate of the time left, steps per second, per-batch
    loss and metrics with validation points per epoch, events (`nonfinite`,
    `breakpoint`, `error`) marked on the loss, and with `gradients=True`
    per-layer gradient norms (log scale) and a layer x step heatmap; with
    `weights=True` update/weight ratios.

    It shows itself when training begins if it is not displayed already.
    Where no widget frontend exists (nbconvert, nbval, HTML export) its output
    still shows the final charts as static SVG. A container that shows it
    inside its own output calls `show_inside(...)` to get that final view.

    Args:
        gradients: bool, record and show per-layer gradient norms.
        weights: bool, record weight norms and show update/weight ratios.
        breakpoints: sequence of `lab.Breakpoint`, checked per batch.
        path: str or None, save the run there (HDF5) as it grows.
        run: `lab.Run` or None, to continue an existing record.
        refresh_every: float, the fewest seconds between two refreshes of
            the view while training (0.25: at most four per second).
        refresh_budget: float, the largest share of training time refreshes
            may take, so a slow machine refreshes less often instead of
            training slower (0.01: 1%; in a kernel a refresh of a 3-layer
            model takes 3-6 ms, so that is every 0.3-0.6 s, and of a
            25-layer one 7-10 ms, every 0.7-1 s; slower where the browser
            shares the machine's cores). Refreshes may spend ahead up to
            what 3 s of training allow them (30 ms at 1%), so that the
            first, slowest ones do not hold the chart back; past that, a
            refresh that overdraws waits until training time has paid it
            back.
        max_points: int, the most points a line sends per refresh.
        smoothing: float in [0, 1), the weight of the exponential moving
            average drawn over the per-batch loss and metric lines (the raw
            line stays, faint, behind it), TensorBoard's debiased smoothing
            (`widgets.smoothing`); 0 turns it off. The Dashboard's "smooth"
            checkbox and weight slider change it, as does setting
            `dashboard.smoothing`; the run's values are never changed.
        ghost: `lab.Run`, or the path of a saved one, drawn faintly behind the
            live loss for comparison (a baseline, yesterday's run).
        view: str, where the charts render: `"plotly"` (a plotly
            FigureWidget), `"html"` (SVG in one output updated in place, for
            front ends without the plotly widget: `widgets.html_view`) or
            `"auto"`, which picks `"html"` on Colab and in VS Code and
            `"plotly"` elsewhere when training begins
            (`widgets.views.choose_view`).
        **recorder_options: passed to `lab.Recorder` (`flush_every`, ...).

    Example:

    ```python
    dashboard = widgets.Dashboard(gradients=True)
    model.fit(x, y, epochs=5, callbacks=[dashboard])
    dashboard.run.batches()
    ```
    """

    def __init__(self, gradients=True, weights=False, breakpoints=(), path=None, run=None,
                 refresh_every=0.25, refresh_budget=0.01, max_points=2000, ghost=None, view="auto",
                 smoothing=DEFAULT_WEIGHT, **recorder_options):
        self.requested_view = check_view(view)
        weight = check_weight("widgets.Dashboard", smoothing)
        check_no_model("widgets.Dashboard", gradients)
        check_flag("widgets.Dashboard", "gradients", gradients, GRADIENTS_EXAMPLE)
        check_flag("widgets.Dashboard", "weights", weights, WEIGHTS_EXAMPLE)
        check_seconds("widgets.Dashboard", "refresh_every", refresh_every, "0.25: at most four refreshes a second")
        check_number("widgets.Dashboard", "refresh_budget", refresh_budget, numbers.Real, lambda v: 0 < v <= 1,
                     "a share of training time in (0, 1]", "0.01: refreshes take at most 1% of it")
        check_number("widgets.Dashboard", "max_points", max_points, numbers.Integral, lambda v: v >= 8,
                     "a whole number of points, 8 or more", "2000")
        super().__init__()
        self.recorder = Recorder(gradients=gradients, weights=weights, breakpoints=breakpoints,
                                 path=path, run=run, **recorder_options)
        _forward_batch_hooks(self, self.recorder)
        self._followed = None  # a watched loop's run, when following one
        self.refresh_every = refresh_every
        self.refresh_budget = refresh_budget
        self.max_points = max_points
        self.refreshes = 0
        self._progress = dict(epoch=0, batch=-1, done=0)
        self._progress_lock = threading.Lock()  # batch ends may come from Keras' pool threads
        self._fit_thread = None
        self._rows_before_epoch = 0
        self._rate_samples = collections.deque(maxlen=20)
        self._predicting = None
        self.header = ipywidgets.HTML(value=self._header_html())
        # The HTML view's page when the Dashboard is shown inside a container.
        self.chart_html = ipywidgets.HTML()
        # The plotly figure is built unless only the HTML view was asked for.
        self.chart = LiveFigure(gradients=gradients, weights=weights) if view != "html" else None
        self.live_view = None  # the view drawing, chosen when training begins
        self._series = ChartState(self.run, max_points, smoothing=weight)
        self.smoothing_controls = _smoothing_controls(weight)
        self._syncing_controls = False
        self._drawing = threading.RLock()  # the chart state and the view, changed by one thread at a time
        for control in self.smoothing_controls.children:
            control.observe(self._on_smoothing_control, names="value")
        self._ghost = None
        if ghost is not None:
            saved = ghost if isinstance(ghost, lab.Run) else lab.Run.load(ghost)
            if self.chart is not None:
                self.chart.show_ghost(saved, max_points)
            self._ghost = _ghost_series(saved, max_points)
        self.widget = ipywidgets.VBox([self.header, self.smoothing_controls, self.chart.figure]
                                      if self.chart is not None else [self.smoothing_controls, self.chart_html])
        self._handles = []
        self._final_views = []
        self._next_refresh = 0.0
        # Refresh time in hand (seconds), and when it last grew (None: not
        # training, so it does not grow; see `_pace`).
        self._allowance = refresh_budget * REFRESH_AHEAD_SECONDS
        self._allowance_since = None
        self._view_failed = False
        self.recorder.add_status_listener(self._on_status)

    # ---- what it shows: the recorder's (or a followed loop's) record and status

    @property
    def run(self):
        """lab.Run, the record shown: the recorder's, or the watched loop's after `follow`."""
        return self._followed if self._followed is not None else self.recorder.run

    @property
    def status(self):
        """str, the recording's status: `idle`, `running`, `breakpoint`, `finished`, `failed`, ..."""
        source = self._followed if self._followed is not None else self.recorder
        return getattr(source, "status", "running")

    @property
    def status_detail(self):
        """str, what the status says more (the exception's message when a step failed)."""
        source = self._followed if self._followed is not None else self.recorder
        return getattr(source, "status_detail", "")

    @property
    def smoothing(self):
        """float, the smoothing weight of the per-batch lines (0: off); setting it redraws the charts."""
        return self._series.smoothing

    @smoothing.setter
    def smoothing(self, weight):
        weight = check_weight("widgets.Dashboard", weight)
        on, slider = self.smoothing_controls.children
        self._syncing_controls = True
        try:
            on.value, slider.disabled = bool(weight), not weight
            if weight:  # off, the slider keeps the last weight, to turn it back on with
                slider.value = weight
        finally:
            self._syncing_controls = False
        self._apply_smoothing(weight)

    def _on_smoothing_control(self, change):
        if self._syncing_controls:
            return
        on, slider = self.smoothing_controls.children
        slider.disabled = not on.value
        self._apply_smoothing(slider.value if on.value else 0.0)

    def _apply_smoothing(self, weight):
        # A click lands on the kernel's thread while training may refresh from
        # its own (`widgets.BackgroundFit`): one draws at a time.
        with self._drawing:
            if weight == self._series.smoothing:
                return
            self._series.smoothing = weight
        self.refresh(final=True)

    @property
    def gradients(self):
        return self.recorder.gradients

    @property
    def weights(self):
        return self.recorder.weights

    @property
    def breakpoints(self):
        return self.recorder.breakpoints

    # ---- the fit() lifecycle: forwarded to the recorder, then drawn ---------

    def set_model(self, model):
        super().set_model(model)
        self.recorder.set_model(model)

    def set_params(self, params):
        super().set_params(params)
        self.recorder.set_params(params)

    def on_train_begin(self, logs=None):
        self.recorder.on_train_begin(logs)
        self._fit_thread = threading.get_ident()
        self._progress = dict(epoch=0, batch=-1, done=0)
        self._rate_samples.clear()
        self._rate_samples.append((time.monotonic(), 0))
        self._choose_view()
        if self._should_show_itself():
            self._ipython_display_()
        self.refresh()

    def on_epoch_begin(self, epoch, logs=None):
        self.recorder.on_epoch_begin(epoch, logs)
        self._progress["epoch"] = epoch
        self._progress["batch"] = -1
        self._rows_before_epoch = len(self.run)

    @property
    def async_safe(self):
        """Read by Keras' CallbackList: whether this Dashboard's batch end may
        run on Keras' thread pool (Keras on JAX), as its recorder's may."""
        return getattr(self.recorder, "async_safe", False)

    def on_train_batch_begin(self, batch, logs=None):
        self.recorder.on_train_batch_begin(batch, logs)
        # Where Keras ends batches on its pool (JAX), the Dashboard draws here,
        # on fit()'s thread, once a batch of the epoch has ended (before that
        # the progress line would be blank).
        if self.async_safe and self._progress["batch"] >= 0 and time.monotonic() >= self._next_refresh:
            self.refresh()

    def on_train_batch_end(self, batch, logs=None):
        self.recorder.on_train_batch_end(batch, logs)
        with self._progress_lock:
            # The steps the execution ran, as the recorder counts them: Keras
            # numbers a last, partial execution by its full span (3.11+), and
            # before 3.11 each execution by one step.
            last = self.recorder.last_batch_ended
            if last > self._progress["batch"]:  # pool threads may end batches out of order
                self._progress["done"] += max(1, last - self._progress["batch"])
                self._progress["batch"] = last
        if threading.get_ident() == self._fit_thread and time.monotonic() >= self._next_refresh:
            self.refresh()

    def on_epoch_end(self, epoch, logs=None):
        self.recorder.on_epoch_end(epoch, logs)
        # Keras before 3.11 calls no batch end for a last, partial execution:
        # the epoch's rows, all read now, say how many steps it ran.
        ran = len(self.run) - self._rows_before_epoch
        if ran - 1 > self._progress["batch"]:
            self._progress["done"] += ran - 1 - self._progress["batch"]
            self._progress["batch"] = ran - 1

    def on_train_end(self, logs=None):
        self.recorder.on_train_end(logs)

    def on_test_begin(self, logs=None):
        self.recorder.on_test_begin(logs)

    def on_test_end(self, logs=None):
        self.recorder.on_test_end(logs)

    def on_predict_begin(self, logs=None):
        self.recorder.on_predict_begin(logs)

    def on_predict_end(self, logs=None):
        self.recorder.on_predict_end(logs)

    # ---- prediction ------------------------------------------------------------

    def predict_stream(self, model, data, batch_size=32, steps=None):
        """`lab.predict_stream` with its progress shown in the Dashboard's header.

        Args:
            model: keras.Model.
            data: what `lab.predict_stream` takes.
            batch_size: int, samples per batch for arrays.
            steps: int or None, stop after this many batches.

        Returns:
            A generator of each batch's predictions, as `lab.predict_stream`
            returns; bad arguments raise here, not at the first batch.
        """
        # Checked here, when called, not at the first batch.
        stream = lab.predict_stream(model, data, batch_size=batch_size, steps=steps)
        total = steps
        if total is None and hasattr(data, "__len__") and not isinstance(data, (dict, list, tuple)):
            total = -(-len(data) // batch_size)
        return self._with_progress(stream, total)

    def _with_progress(self, stream, total):
        self._predicting = (0, total)
        last = 0.0
        try:
            for done, predictions in enumerate(stream, 1):
                self._predicting = (done, total)
                now = time.monotonic()
                if now - last >= self.refresh_every:
                    last = now
                    self._show_header()
                yield predictions
        finally:
            self._show_header(final=True)

    def prediction_text(self):
        """Prediction progress as text ("" when nothing was predicted)."""
        if self._predicting is None:
            return ""
        done, total = self._predicting
        return f"predicted {done:,}/{total:,} batches" if total else f"predicted {done:,} batches"

    # ---- a hand-written loop ---------------------------------------------------

    def follow(self, run):
        """Shows a watched loop's run live, as during fit().

        Args:
            run: lab.Run, the one `lab.watch(...)` yields.

        Returns:
            This Dashboard.

        Example:

        ```python
        with lab.watch(model, optimizer) as run:
            widgets.Dashboard().follow(run)
            for x, y in data:
                run.step(loss=train_step(x, y))
        ```
        """
        self._followed = run
        self._series = ChartState(run, self.max_points, smoothing=self.smoothing)
        self._progress = dict(epoch=0, batch=-1, done=0)
        self._rate_samples.clear()
        self._rate_samples.append((time.monotonic(), 0))

        def on_rows(run, table, start, stop):
            if table == "batches":
                self._progress.update(batch=stop - 1, done=stop)
            if time.monotonic() >= self._next_refresh:
                self.refresh()

        run.subscribe(on_rows)
        if hasattr(run, "add_status_listener"):
            run.add_status_listener(self._on_status)
        self._on_status(self.status, self.status_detail)
        self._choose_view()
        if self._should_show_itself():
            self._ipython_display_()
        self.refresh()
        return self

    # ---- drawing -------------------------------------------------------------

    def show_inside(self, on_final_view):
        """Hands this Dashboard's display to a container that shows it inside its own output.

        The Dashboard then no longer shows itself when training begins, and
        when training ends it calls `on_final_view(bundle)` with its final
        output bundle (the widget, the text summary and the static charts), so
        the container can redraw its output: where no widget frontend exists,
        that output is what shows the finished run.

        Args:
            on_final_view: callable `on_final_view(bundle)`, bundle a dict
                mime type -> data, as `_repr_mimebundle_()` returns it.

        Returns:
            This Dashboard.

        Example:

        ```python
        dashboard = widgets.Dashboard()
        handle = IPython.display.display(ipywidgets.VBox([dashboard.widget, controls]), display_id=True)
        dashboard.show_inside(lambda bundle: handle.update(bundle, raw=True))
        ```
        """
        if not callable(on_final_view):
            raise TypeError(f"show_inside needs a callable on_final_view(bundle), got {type(on_final_view).__name__}.")
        self._final_views.append(on_final_view)
        return self

    def _should_show_itself(self):
        # From a background thread a display would land in whatever cell runs then.
        return (not self._handles and not self._final_views and _frontend_available()
                and threading.current_thread() is threading.main_thread())

    def _choose_view(self):
        """The view to draw with (`widgets.views.choose_view`), built on first use."""
        kind = choose_view(self.requested_view)
        if self.live_view is not None and self.live_view.kind == kind:
            return self.live_view
        if kind == "plotly":
            self.live_view = PlotlyView(self.chart, self.header)
            self.widget.children = (self.header, self.smoothing_controls, self.chart.figure)
        else:
            # Into the Dashboard's own output when it has one, else into
            # chart_html (inside a container such as the Lab panel).
            self.live_view = HtmlView(handles=self._handles, widget=self.chart_html, text=self.summary,
                                      update_every=self.refresh_every)
            self.widget.children = (self.smoothing_controls, self.chart_html)
        return self.live_view

    def refresh(self, final=False):
        """Redraws the view from the run: one plotly update, or one HTML update, and the header line.

        Args:
            final: bool, a refresh that must show (a status change, the end
                of training): the HTML view sends it whatever its throttle
                says; once training has ended its status line holds no
                timings.
        """
        if self._view_failed:
            return
        started = time.monotonic()
        self._rate_samples.append((started, self._progress["done"]))
        try:
            with self._drawing:
                view = self.live_view or self._choose_view()
                data = self._series.update()
                status = self._header_html()
                if view.kind == "html":
                    if self._ghost is not None:  # a new ChartData: the state hands the same one out again
                        data = dataclasses.replace(data, loss=[*data.loss[:1], self._ghost, *data.loss[1:]])
                    if self.status in _TERMINAL:
                        status = self._static_status_html()
                view.send(data, status, final=final)
                self.header.value = self._header_html()
                self.refreshes += 1
        except Exception as error:  # noqa: BLE001 - a view must never stop training
            self._view_failed = True
            warnings.warn(f"The Dashboard could not draw ({error!r}); recording goes on, "
                          "the run is at `dashboard.run`.", RuntimeWarning, stacklevel=2)
        self._pace(started, time.monotonic())

    def _pace(self, started, now):
        """Sets when the next refresh may come, after one that ran from `started` to `now`.

        Refresh time is kept like a budget in hand: training time adds
        `refresh_budget` of itself to it, up to what
        `REFRESH_AHEAD_SECONDS` of training add; each refresh takes its
        own duration from it. The next refresh comes `refresh_every`
        later while the budget is not overdrawn, else once training has
        paid it back. Time between two fits adds nothing.
        """
        if self._allowance_since is not None:
            grown = self.refresh_budget * (started - self._allowance_since)
            self._allowance = min(self._allowance + grown, self.refresh_budget * REFRESH_AHEAD_SECONDS)
        self._allowance -= now - started
        self._allowance_since = now
        owed = max(0.0, -self._allowance) / self.refresh_budget
        self._next_refresh = now + max(self.refresh_every, owed)

    def _on_status(self, status, detail):
        self.header.value = self._header_html()
        if status not in _TERMINAL and self._html_view():
            self.refresh(final=True)  # the page holds the status line: show the change now
        if status in _TERMINAL:
            self.refresh(final=True)
            self._allowance_since = None  # until training starts again
            if self._handles or self._final_views:
                bundle = self._repr_mimebundle_()
                if not self._html_view():  # the HTML view's final refresh updated the handles
                    for handle in self._handles:
                        handle.update(bundle, raw=True)
                for on_final_view in list(self._final_views):
                    on_final_view(bundle)

    def _show_header(self, final=False):
        """The header line now (prediction progress), in the header widget or the HTML view."""
        self.header.value = self._header_html()
        if self._html_view() and not self._view_failed:
            with self._drawing:
                self.live_view.send(self._series.update(), self._header_html(), final=final)

    def _html_view(self):
        return self.live_view is not None and self.live_view.kind == "html"

    def _header_html(self):
        status = self.status
        color = _STATUS_COLORS.get(status, "#666")
        line = f'<b style="color:{color}">{html.escape(status)}</b>'
        if self.status_detail:
            line += f': <span style="color:{color}">{html.escape(self.status_detail)}</span>'
        progress = self.progress_text()
        if progress:
            line += f" &middot; {html.escape(progress)}"
        predicted = self.prediction_text()
        if predicted:
            line += f" &middot; {html.escape(predicted)}"
        return f'<div class="training-lab-status" style="font-family:sans-serif">{line}</div>'

    def progress_text(self):
        """Epoch/batch progress, steps per second and the time left, as one line of text."""
        params = self.params or {}
        if not self._rate_samples or self._progress["batch"] < 0:
            return ""
        epochs, steps = params.get("epochs"), params.get("steps")
        epoch, batch = self._progress["epoch"], self._progress["batch"]
        parts = [f"epoch {epoch + 1}/{epochs}" if epochs else f"epoch {epoch + 1}",
                 f"batch {batch + 1}/{steps}" if steps else f"batch {batch + 1}"]
        rate = self.steps_per_second()
        if rate:
            parts.append(f"{rate:,.1f} steps/s")
            if epochs and steps and self.status in ("running", "breakpoint"):
                left = (epochs - epoch - 1) * steps + (steps - batch - 1)
                parts.append(f"about {_duration(left / rate)} left")
        return " · ".join(parts)

    def steps_per_second(self):
        """Training steps per second over the last few refreshes (None until steps were timed)."""
        if not self._rate_samples:
            return None
        now = time.monotonic()
        t0, n0 = self._rate_samples[0]
        if now - t0 <= 0 or self._progress["done"] <= n0:
            return None
        return (self._progress["done"] - n0) / (now - t0)

    # ---- display -------------------------------------------------------------

    def summary(self):
        """A deterministic text summary of the run (no timings): what text/plain shows."""
        run = self.run
        status = self.status + (f": {self.status_detail}" if self.status_detail else "")
        data_names = _series_names(run)
        lines = [f"Dashboard ({status})",
                 f"{len(run)} steps, {len(run.epochs())} epochs"]
        if data_names:
            lines.append("series: " + ", ".join(data_names))
        layers = sorted({c[len("grad_norm/"):].rsplit("/", 1)[0] for c in run.columns if c.startswith("grad_norm/")})
        if layers:
            lines.append(f"gradient norms: {len(layers)} layers")
        kinds = run.events()["kind"].value_counts()
        if len(kinds):
            lines.append("events: " + ", ".join(f"{k} x{n}" for k, n in sorted(kinds.items())))
        return "\n".join(lines)

    def static_html(self):
        """The status and the charts as HTML with inline SVG (no JavaScript)."""
        charts = static.charts_html(self._series.update())
        return f'<div class="training-lab-dashboard">{self._static_status_html()}{charts}</div>'

    def _static_status_html(self):
        # No timings: a checked notebook compares it (the SVG is sanitized).
        status = html.escape(self.status + (f": {self.status_detail}" if self.status_detail else ""))
        return (f'<p style="font-family:sans-serif"><b>Training Lab dashboard</b> ({status}), '
                f"{len(self.run)} steps</p>")

    def _repr_mimebundle_(self, include=None, exclude=None, **kwargs):
        bundle = view_bundle(self.widget.model_id, self.summary(), self.static_html(), include, exclude)
        if self._html_view():
            # The HTML view needs no widget front end: its output carries none.
            bundle.pop("application/vnd.jupyter.widget-view+json", None)
        return bundle

    def _ipython_display_(self):
        if self._html_view():
            # The HTML view's output is replaced at every refresh: its control
            # is an output of its own, just above (a core widget, which renders
            # where plotly's does not).
            from IPython.display import display

            weight = self.smoothing
            text = f"smoothing: {weight:g}" if weight else "smoothing: off"
            display(view_bundle(self.smoothing_controls.model_id, text, html.escape(text)), raw=True, display_id=True)
        show(self, self._handles)

    def __repr__(self):
        return f"<widgets.Dashboard {self.status}: {len(self.run)} steps>"


# Batch-level hooks of evaluate() and predict(): forwarded only where the
# recorder has its own, so Keras (which dispatches batch callbacks
# asynchronously when none overrides them) treats a Dashboard as its Recorder.
_BATCH_HOOKS = ("on_test_batch_begin", "on_test_batch_end", "on_predict_batch_begin", "on_predict_batch_end")


def _forward_batch_hooks(dashboard, recorder):
    for name in _BATCH_HOOKS:
        hook = getattr(recorder, name)
        if not getattr(hook, "_is_default", False):
            setattr(dashboard, name, hook)


def _smoothing_controls(weight):
    """The "smooth" checkbox and weight slider of the per-batch lines, in one row."""
    on = ipywidgets.Checkbox(value=bool(weight), description="smooth per-batch lines", indent=False,
                             layout=ipywidgets.Layout(width="auto"))
    slider = ipywidgets.FloatSlider(
        value=weight or DEFAULT_WEIGHT, min=0.0, max=0.99, step=0.01, description="weight",
        disabled=not weight, readout_format=".2f", continuous_update=False,
        tooltip="exponential moving average of the per-batch loss and metrics "
                            "(TensorBoard's smoothing); the raw line stays, faint",
        style={"description_width": "initial"})
    row = ipywidgets.HBox([on, slider])
    row.add_class("training-lab-smoothing")
    return row


def _ghost_series(run, max_points):
    """A saved run's loss as a line for the HTML view (the plotly view draws its own)."""
    if "loss" not in run.columns:
        raise ValueError(f"The ghost run {run.name!r} has no loss column to draw.")
    x, y = downsample(run.column("step"), run.column("loss"), max_points)
    return Series(f"{run.name} (saved)", x, y, color=GHOST_COLOR)


def _series_names(run):
    """The loss, metrics and validation metrics the charts draw: batch columns with a finite value."""
    names = [c for c in ("loss", *metric_names(run.columns))
             if c in run.columns and np.isfinite(run.column(c)).any()]
    epochs = run.epochs()
    names += [c for c in epochs.columns if c.startswith("val_")]
    return names


def _duration(seconds):
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
