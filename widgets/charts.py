"""The Dashboard's live plotly figure, drawn once and updated in place.

What it draws comes from `widgets.series` (bounded, downsampled series);
this module only maps that onto plotly traces. Every array assigned is a
1-D float32 numpy array, which plotly's widget serializer sends as a binary
buffer.
"""

import numpy as np

from widgets.series import LOSS_COLOR, Series
from widgets.smoothing import SUFFIX

GHOST_COLOR = "rgba(120,120,120,0.45)"


class LiveFigure:
    """A plotly FigureWidget drawn once and updated in place from `ChartData`.

    Rows, each with its own legend beside it: the per-batch loss with
    validation points and event markers; the per-batch metrics with theirs
    (a loss and an accuracy do not share a scale, so they do not share an
    axis); with gradients, per-layer gradient norms (log scale) and the
    layer x step heatmap; with weights, per-layer update ratios (log
    scale). Lines take the colours `ChartData` gives them (the loss one,
    the metrics others); a raw line under its smoothed companion is drawn
    faint, out of the legend. The per-batch loss is always the first trace.
    A refresh is one plotly update message carrying every array.

    Args:
        gradients: bool, add the gradient rows.
        weights: bool, add the update-ratio row.
        height: int, pixels for the loss row; other rows take about as much.
    """

    def __init__(self, gradients=True, weights=False, height=280):
        import plotly.graph_objects as go
        from plotly.subplots import make_subplots

        rows = ["loss", "metrics"] + (["gradients", "heatmap"] if gradients else []) + \
            (["update_ratios"] if weights else [])
        titles = {
            "loss": "loss per batch (diamonds: validation)",
            "metrics": "metrics per batch (diamonds: validation)",
            "gradients": "gradient norm per layer",
            "heatmap": "log10 gradient norm, layer x step",
            "update_ratios": "update / weight norm per layer",
        }
        self.rows = {name: i + 1 for i, name in enumerate(rows)}
        grid = make_subplots(
            rows=len(rows), cols=1, shared_xaxes=True, vertical_spacing=0.24 / len(rows),
            subplot_titles=[titles[name] for name in rows],
        )
        # Laid out as a plain Figure, then wrapped once: every change made to
        # a FigureWidget after it exists is a message to the frontend.
        self.figure = grid
        # A legend per row, at the top right of its row (the heatmap has its colour bar there).
        self.legends = {name: "legend" if row == 1 else f"legend{row}"
                        for name, row in self.rows.items() if name != "heatmap"}
        legends = {}
        for name, legend in self.legends.items():
            top = self.figure.get_subplot(self.rows[name], 1).yaxis.domain[1]
            legends[legend] = dict(x=1.02, xanchor="left", y=top, yanchor="top", font=dict(size=11),
                                   tracegroupgap=2)
        self.figure.update_layout(
            height=height * len(rows), margin=dict(l=60, r=20, t=40, b=40), showlegend=True,
            template="plotly_white", uirevision="training-lab", **legends,
        )
        self.figure.update_annotations(font_size=13)  # the rows' titles
        for name in ("gradients", "update_ratios"):
            if name in self.rows:
                self.figure.update_yaxes(type="log", row=self.rows[name], col=1)
        self.figure.update_xaxes(title_text="step", row=len(rows), col=1)
        self._traces = {}
        self._sent = {}
        self._faint = {}  # (panel, name) -> whether the trace is drawn faint now
        self._layers = ()
        self._events_panel = "loss"  # the row the event markers are on
        # The loss trace exists from the start, so it is always trace 0.
        empty = np.zeros(0, np.float32)
        self._trace("loss", Series("loss", empty, empty, color=LOSS_COLOR))
        if "heatmap" in self.rows:
            self._add_heatmap()
        self.figure = go.FigureWidget(self.figure)

    def _trace(self, panel, series):
        key = (panel, series.name)
        if key not in self._traces:
            import plotly.graph_objects as go

            empty = np.zeros(0, np.float32)
            self.figure.add_trace(go.Scatter(x=empty, y=empty, **self._trace_options(panel, series)))
            self._traces[key] = len(self.figure.data) - 1
        return self.figure.data[self._traces[key]]

    def _add_traces(self, wanted):
        """Adds the traces of the series in `wanted` ((panel, Series) pairs)
        that have none yet, in one plotly message and with no data (the same
        refresh sends it). One `add_trace` each, with empty arrays, took 52 of
        the 63 ms of a 25-layer model's first refresh: a message per trace,
        each trace built twice, each array validated twice."""
        new = list({(panel, series.name): (panel, series) for panel, series in wanted
                    if (panel, series.name) not in self._traces}.values())
        if not new:
            return
        # As dicts: plotly builds each trace once (from a go.Scatter, twice).
        self.figure.add_traces([dict(type="scatter", **self._trace_options(*item)) for item in new])
        first = len(self.figure.data) - len(new)
        for i, (panel, series) in enumerate(new):
            self._traces[(panel, series.name)] = first + i
            self._faint[(panel, series.name)] = series.faint

    def _trace_options(self, panel, series):
        """A series' trace, but for its data: name, colour, style, axes and legend."""
        name = series.name
        label = f"{name} (update ratio)" if panel == "update_ratios" else name
        options = dict(name=label, legendgroup=f"{panel}/{_line_of(name)}")
        if name == "events":
            options.update(mode="markers", marker=dict(symbol="x", size=11, color="crimson"),
                           hoverinfo="text+x")
        elif series.markers:
            options.update(mode="markers", marker=dict(size=8, symbol="diamond", color=series.color))
        else:
            options.update(mode="lines", line=dict(width=1.6, color=series.color), **_faint(series.faint))
        # Axes and legend named up front: add_trace(row=...) would send a
        # second message to move the new trace onto its subplot.
        options.update(self._axes(self.rows[panel]), legend=self.legends[panel])
        return options

    def _axes(self, row):
        subplot = self.figure.get_subplot(row, 1)
        return dict(xaxis=subplot.xaxis.plotly_name.replace("axis", ""),
                    yaxis=subplot.yaxis.plotly_name.replace("axis", ""))

    def _add_heatmap(self):
        import plotly.graph_objects as go

        empty = np.zeros(0, np.float32)
        axes = self._axes(self.rows["heatmap"])
        low, high = self.figure.get_subplot(self.rows["heatmap"], 1).yaxis.domain
        self.figure.add_trace(go.Heatmap(
            x=empty, y=empty, z=empty, colorscale="Viridis", showscale=True, name="log10 norm",
            colorbar=dict(title="log10", len=high - low, y=(low + high) / 2), **axes))
        self._traces[("heatmap", "heatmap")] = len(self.figure.data) - 1

    def update(self, data):
        """Draws `data` (a `ChartData`): one plotly update message.

        Traces for series seen for the first time are added first (once per
        new column in a run, so not part of a steady refresh); a trace whose
        series is no longer drawn (a smoothed line once smoothing is off) is
        emptied in the same message.
        """
        panels = [("loss", data.loss), ("metrics", data.metrics)]
        if "gradients" in self.rows:
            panels.append(("gradients", data.gradients))
        if "update_ratios" in self.rows:
            panels.append(("update_ratios", data.update_ratios))
        # Sent as one `plotly_update` built here rather than by assigning
        # traces inside `batch_update()`: plotly validates every assigned
        # array (about 0.1 ms each, most of a refresh with 50 layers), and
        # these are float32 arrays this module made (`_values`).
        edits, relayout = {}, {}
        drawn = [(_panel_of(panel, series), series) for panel, items in panels for series in items]
        self._add_traces(drawn)
        for panel, items in panels:
            for series in items:
                key = (_panel_of(panel, series), series.name)
                # Only the series that changed since the last refresh are sent.
                if self._changed(key, series.x, series.y):
                    edit = edits.setdefault(self._traces[key], {})
                    edit["x"], edit["y"] = _values(series.x), _values(series.y)
                    if series.name == "events":
                        edit["hovertext"] = list(series.text)
                if self._faint.get(key, False) != series.faint:
                    self._faint[key] = series.faint
                    edits.setdefault(self._traces[key], {}).update(_faint(series.faint))
                if series.name == "events" and panel != self._events_panel:
                    # Events sit on the loss, or on the first metric of a
                    # run without one: the one trace moves to that row.
                    self._events_panel = panel
                    edit = edits.setdefault(self._traces[key], {})
                    edit["yaxis"] = self._axes(self.rows[panel])["yaxis"]
                    edit["legend"] = self.legends[panel]
        empty = np.zeros(0, np.float32)
        for key in set(self._sent) - {(panel, series.name) for panel, series in drawn} - {("heatmap", "heatmap")}:
            if self._changed(key, empty, empty):
                edit = edits.setdefault(self._traces[key], {})
                edit["x"], edit["y"] = _values(empty), _values(empty)
        heat = data.heatmap
        if "heatmap" in self.rows and self._changed(("heatmap", "heatmap"), heat.x, heat.z):
            index = self._traces[("heatmap", "heatmap")]
            edits[index] = dict(x=_values(heat.x), y=_values(heat.y), z=_values(heat.z))
            if heat.layers != self._layers:
                self._layers = heat.layers
                axis = _axis_name(self.figure, self.figure.data[index])
                relayout[f"{axis}.tickvals"] = list(range(len(self._layers)))
                relayout[f"{axis}.ticktext"] = list(self._layers)
        if edits or relayout:
            restyle, indexes = _update_params(edits, self.figure.data)
            self.figure.plotly_update(restyle_data=restyle, relayout_data=relayout, trace_indexes=indexes)

    def _changed(self, key, x, y):
        last = self._sent.get(key)
        if last is not None and np.array_equal(last[0], x) and np.array_equal(last[1], y, equal_nan=True):
            return False
        self._sent[key] = (x, y)
        return True

    def show_ghost(self, run, max_points=2000):
        """Draws a saved run's loss faintly behind the live one (drawn once)."""
        from widgets.downsampling import downsample

        if "loss" not in run.columns:
            raise ValueError(f"The ghost run {run.name!r} has no loss column to draw.")
        x, y = downsample(run.column("step").astype(np.float32), run.column("loss"), max_points)
        trace = self._trace("loss", Series(f"{run.name} (saved)", x, y, color=GHOST_COLOR))
        with self.figure.batch_update():
            trace.x, trace.y = x, y
            trace.line = dict(color=GHOST_COLOR, width=1, dash="dot")

    def trace(self, name, panel="loss"):
        """The plotly trace drawing series `name` of `panel` (for tests and notebooks)."""
        return self.figure.data[self._traces[(panel, name)]]


def _faint(faint):
    """A line trace's style as a raw line under its smoothed one (faint, no legend entry) or on its own."""
    return dict(opacity=0.3, showlegend=False) if faint else dict(opacity=1.0, showlegend=True)


def _line_of(name):
    """The line a series belongs to, for its legend group: `loss (smoothed)` and `loss` are one."""
    return name[:-len(SUFFIX)] if name.endswith(SUFFIX) else name


def _panel_of(panel, series):
    """The panel whose trace draws `series`: event markers have one trace whichever axis they are on."""
    return "loss" if series.name == "events" else panel


def _values(array):
    """A 1-D float32 array that nothing else writes to, as plotly's validation would have made it."""
    array = np.array(array, np.float32).ravel()
    array.flags.writeable = False
    return array


def _update_params(edits, traces):
    """`plotly_update`'s restyle data and trace indexes for {trace index: {property: value}}.

    One list per property, a value per trace. A trace that does not change
    a property is sent the value it has: plotly's front end resets a
    property sent as `Undefined` (what `batch_update()` sends) to its
    default, which showed a faint line in full and put it back in the
    legend. A property its type has not (`z` of a line) stays `Undefined`.
    """
    indexes = sorted(edits)
    names = sorted({name for edit in edits.values() for name in edit})
    restyle = {name: [edits[i][name] if name in edits[i] else _own(traces[i], name) for i in indexes]
               for name in names}
    return restyle, indexes


def _own(trace, name):
    """The value `trace` has for property `name`, or plotly's `Undefined` where its type has no such property."""
    from plotly.basedatatypes import Undefined

    return trace[name] if name in trace else Undefined


def _axis_name(figure, trace):
    anchor = trace.yaxis or "y"
    return "yaxis" + anchor[1:]
