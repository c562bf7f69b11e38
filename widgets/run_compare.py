"""RunCompare: several runs overlaid on one step axis, one column at a time."""

import html
import numbers

import ipywidgets
import numpy as np
import pandas as pd

import lab
from lab.arguments import check_number
# lab.compare's own naming (`run.name`, `#2` for a repeat), so each run,
# one without rows too, keeps the name lab.compare gives its rows.
from lab.compare import named_runs
from widgets import static
from widgets.html_view import HtmlView
from widgets.series import MAX_POINTS, Series, downsample, is_bookkeeping, metric_names
from widgets.views import check_view, choose_view

_LOG_SCALE = ("grad_norm", "weight_norm/", "update_ratio/")


class RunCompare(ipywidgets.VBox):
    """Overlays runs' loss, metrics and gradient norms; a dropdown picks the column.

    One line per run (the per-batch values, downsampled to at most
    `max_points` with minima and maxima kept), and, where the runs' epoch
    logs have `val_<column>`, that run's validation values as markers at the
    step that ended each epoch. Gradient norms are drawn on a log axis. A run
    without the chosen column keeps its legend entry, marked "(not recorded)";
    a run without any row, marked "(no rows)". Bookkeeping columns (`mode`,
    `updated/<optimizer>`, ...) are not offered.

    Args:
        runs: list of `lab.Run` (or Recorders, or paths of run files), or dict
            name -> run, as `lab.compare` takes them.
        column: str or None, the column shown first; None shows `loss`, or
            where no run has a loss (a GAN's `d_loss` and `g_loss`), the
            first metric the runs logged.
        max_points: int, the most points drawn per run (8 or more).
        height: int, pixels.
        view: str, `"plotly"`, `"html"` (SVG in a core `ipywidgets.HTML`,
            for front ends without the plotly widget) or `"auto"`
            (`widgets.views.choose_view`: `"html"` on Colab and in VS Code).

    Example:

    ```python
    widgets.RunCompare({"lr=0.1": fast.run, "lr=0.01": slow.run})
    ```
    """

    def __init__(self, runs, column=None, max_points=MAX_POINTS, height=360, view="auto"):
        kind = choose_view(check_view(view))
        check_number("widgets.RunCompare", "max_points", max_points, numbers.Integral, lambda v: v >= 8,
                     "a whole number of points per run, 8 or more", f"{MAX_POINTS}")
        named = named_runs(runs)  # files are read once, for both tables
        self.batches = lab.compare(named)
        self.epochs = lab.compare(named, table="epochs")
        self.names = list(named)
        self.note = ipywidgets.HTML(_matched_note(self.batches.attrs["matched_layers"],
                                                  self.batches.attrs["layers_named_as"]))
        if not len(self.batches):
            raise ValueError("RunCompare needs runs with at least one recorded batch; these have none.")
        self.max_points = max_points
        options = [c for c in self.batches.columns
                   if c != "run" and not is_bookkeeping(c) and pd.api.types.is_numeric_dtype(self.batches[c])]
        # Step times last: the values a comparison is usually about come first.
        options = [c for c in options if c != "seconds"] + [c for c in options if c == "seconds"]
        if not options:
            raise ValueError("RunCompare found no numeric value column (loss, metrics, ...) in these runs' batches.")
        if column is None:
            column = _first_value_column(self.batches, options)
        elif column not in options:
            raise ValueError(f"No run has the column {column!r}; choose one of {options}.")
        self.column = ipywidgets.Dropdown(options=options, value=column, description="column")
        self.figure = None
        self.live_view = None
        if kind == "html":
            self.chart_html = ipywidgets.HTML()
            self.live_view = HtmlView(widget=self.chart_html, update_every=0, render=_compare_page)
            self._show(column)
            self.column.observe(lambda change: self._show(change["new"]), names="value")
            super().__init__([self.column, self.chart_html] + ([self.note] if self.note.value else []))
            return
        import plotly.graph_objects as go

        self.figure = go.FigureWidget(layout=go.Layout(
            height=height, margin=dict(l=50, r=10, t=30, b=40), xaxis_title="step",
            legend=dict(orientation="h", y=1.12), template="plotly_white"))
        palette = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
                   "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
        for i, name in enumerate(self.names):
            color = palette[i % len(palette)]
            self.figure.add_scatter(name=name, mode="lines", line=dict(color=color, width=1.5),
                                    legendgroup=name)
        for i, name in enumerate(self.names):
            color = palette[i % len(palette)]
            self.figure.add_scatter(name=f"{name} (validation)", mode="markers", legendgroup=name,
                                    marker=dict(color=color, size=8, symbol="diamond"),
                                    showlegend=False)
        self._show(column)
        self.column.observe(lambda change: self._show(change["new"]), names="value")
        super().__init__([self.column, self.figure] + ([self.note] if self.note.value else []))

    def lines(self):
        """The per-batch traces, one per run, in the order the runs were given."""
        return self.figure.data[: len(self.names)]

    def validation(self):
        """The validation-marker traces, one per run."""
        return self.figure.data[len(self.names):]

    def _series(self, column):
        """Per run, its line of `column` and its validation markers, as `Series`."""
        validation = f"val_{column}"
        lines, markers = [], []
        for name in self.names:
            rows = self.batches[self.batches["run"] == name]
            values = rows[column].to_numpy(np.float32)
            x, y = downsample(rows["step"].to_numpy(), values, self.max_points)
            label = name
            if not len(rows):
                label = f"{name} (no rows)"
            elif not np.isfinite(values).any():
                label = f"{name} (not recorded)"
            lines.append(Series(label, x, y))
            x = y = np.zeros(0, np.float32)
            if validation in self.epochs:
                rows = self.epochs[self.epochs["run"] == name]
                values = rows[validation].to_numpy(np.float32)
                keep = np.isfinite(values)
                x, y = rows["step"].to_numpy(np.float32)[keep], values[keep]
            markers.append(Series(f"{name} (validation)", x, y, markers=True))
        return lines, markers

    def _show(self, column):
        lines, markers = self._series(column)
        if self.live_view is not None:
            self.live_view.send((column, lines + markers), final=True)
            return
        with self.figure.batch_update():
            for trace, series in zip(list(self.lines()) + list(self.validation()), lines + markers):
                trace.x, trace.y = series.x, series.y
            for trace, series in zip(self.lines(), lines):
                trace.name = series.name
            self.figure.layout.yaxis.title = column
            self.figure.layout.yaxis.type = "log" if column.startswith(_LOG_SCALE) else "linear"


def _matched_note(matched, reference):
    """A line saying which runs' layers are shown under the `reference` run's names ("" for none)."""
    if not matched:
        return ""
    shown = ", ".join(f"<b>{html.escape(name)}</b>" for name in matched)
    return (f"<small>The layers of {shown} are shown under <b>{html.escape(reference)}</b>'s names, matched in "
            "the order they were made: the same model built again, which Keras numbered otherwise "
            "(<code>lab.compare(..., match_layers=False)</code> keeps each run's own).</small>")


def _first_value_column(batches, options):
    """The column a comparison shows first: `loss`, else the first metric, with a value in some run."""
    metrics = metric_names(options)
    for column in ["loss", *metrics, *options]:
        if column in options and np.isfinite(batches[column].to_numpy(np.float64)).any():
            return column
    return options[0]


def _compare_page(data, status="", width=640):
    """The HTML view's page of a comparison: one SVG chart of every run's line and markers.

    The chart's legend holds only what it draws: runs with nothing to draw
    ("(no rows)", "(not recorded)") are named under it.
    """
    column, series = data
    chart = static.line_chart(series, column, width=width, height=320, log_y=column.startswith(_LOG_SCALE))
    missing = [s.name for s in series if not len(s.x) and not s.markers]
    note = (f'<p style="font-family:sans-serif;font-size:12px">Not drawn: {html.escape(", ".join(missing))}</p>'
            if missing else "")
    return f'<div class="training-lab-run-compare">{status}{chart}{note}</div>'
