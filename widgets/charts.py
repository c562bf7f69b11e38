"""The Dashboard's live plotly figure, drawn once and updated in place.

What it draws comes from `widgets.series` (bounded, downsampled series);
this module only maps that onto plotly traces. Every array assigned is a
1-D float32 numpy array, which plotly's widget serializer sends as a binary
buffer.
"""

import numpy as np


class LiveFigure:
    """A plotly FigureWidget drawn once and updated in place from `ChartData`.

    Rows: loss (metrics on a right-hand axis) with validation points and
    event markers; with gradients, per-layer gradient norms (log scale) and
    the layer x step heatmap; with weights, per-layer update ratios (log
    scale). The per-batch loss is always the first trace. A refresh is one
    `batch_update()`, hence one plotly update message carrying every array.

    Args:
        gradients: bool, add the gradient rows.
        weights: bool, add the update-ratio row.
        height: int, pixels for the loss row; other rows take about as much.
    """

    def __init__(self, gradients=True, weights=False, height=320):
        import plotly.graph_objects as go
        from plotly.subplots import make_subplots

        rows = ["loss"] + (["gradients", "heatmap"] if gradients else []) + (["update_ratios"] if weights else [])
        titles = {
            "loss": "loss and metrics per batch (points: validation)",
            "gradients": "gradient norm per layer",
            "heatmap": "log10 gradient norm, layer x step",
            "update_ratios": "update / weight norm per layer",
        }
        self.rows = {name: i + 1 for i, name in enumerate(rows)}
        specs = [[{"secondary_y": name == "loss"}] for name in rows]
        grid = make_subplots(
            rows=len(rows), cols=1, specs=specs, shared_xaxes=True, vertical_spacing=0.08,
            subplot_titles=[titles[name] for name in rows],
        )
        # Laid out as a plain Figure, then wrapped once: every change made to
        # a FigureWidget after it exists is a message to the frontend.
        self.figure = grid
        self.figure.update_layout(
            height=height * len(rows), margin=dict(l=60, r=60, t=40, b=40),
            legend=dict(orientation="h", y=-0.08 if len(rows) > 1 else -0.2),
            template="plotly_white", uirevision="training-lab",
        )
        for name in ("gradients", "update_ratios"):
            if name in self.rows:
                self.figure.update_yaxes(type="log", row=self.rows[name], col=1)
        self.figure.update_xaxes(title_text="step", row=len(rows), col=1)
        self._traces = {}
        self._sent = {}
        self._layers = ()
        self._events_panel = "loss"  # the axis the event markers are on
        # The loss trace exists from the start, so it is always trace 0.
        self._trace("loss", "loss", markers=False)
        if "heatmap" in self.rows:
            self._add_heatmap()
        self.figure = go.FigureWidget(self.figure)

    def _trace(self, panel, name, markers):
        key = (panel, name)
        if key not in self._traces:
            import plotly.graph_objects as go

            empty = np.zeros(0, np.float32)
            self.figure.add_trace(go.Scatter(x=empty, y=empty, **self._trace_options(panel, name, markers)))
            self._traces[key] = len(self.figure.data) - 1
        return self.figure.data[self._traces[key]]

    def _add_traces(self, wanted):
        """Adds the traces of the series in `wanted` ((panel, name, markers)
        tuples) that have none yet, in one plotly message and with no data
        (the same refresh sends it). One `add_trace` each, with empty arrays,
        took 52 of the 63 ms of a 25-layer model's first refresh: a message
        per trace, each trace built twice, each array validated twice."""
        new = [(panel, name, markers) for panel, name, markers in dict.fromkeys(wanted)
               if (panel, name) not in self._traces]
        if not new:
            return
        # As dicts: plotly builds each trace once (from a go.Scatter, twice).
        self.figure.add_traces([dict(type="scatter", **self._trace_options(*item)) for item in new])
        first = len(self.figure.data) - len(new)
        for i, (panel, name, _) in enumerate(new):
            self._traces[(panel, name)] = first + i

    def _trace_options(self, panel, name, markers):
        """A series' trace, but for its data: name, style and axes."""
        label = f"{name} (update ratio)" if panel == "update_ratios" else name
        options = dict(name=label, legendgroup=panel)
        if name == "events":
            options.update(mode="markers", marker=dict(symbol="x", size=11, color="crimson"),
                           hoverinfo="text+x")
        elif markers:
            options.update(mode="markers", marker=dict(size=8, symbol="diamond"))
        else:
            options.update(mode="lines", line=dict(width=1.3))
        row = self.rows["loss" if panel == "metrics" else panel]
        # Axes named up front: add_trace(row=...) would send a second
        # message to move the new trace onto its subplot.
        options.update(self._axes(row, secondary=panel == "metrics"))
        return options

    def _axes(self, row, secondary=False):
        subplot = self.figure.get_subplot(row, 1, secondary_y=secondary)
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
        new column in a run, so not part of a steady refresh).
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
        self._add_traces([(_panel_of(panel, series), series.name, series.markers)
                          for panel, items in panels for series in items])
        for panel, items in panels:
            for series in items:
                key = (_panel_of(panel, series), series.name)
                # Only the series that changed since the last refresh are sent.
                if self._changed(key, series.x, series.y):
                    edit = edits.setdefault(self._traces[key], {})
                    edit["x"], edit["y"] = _values(series.x), _values(series.y)
                    if series.name == "events":
                        edit["hovertext"] = list(series.text)
                if series.name == "events" and panel != self._events_panel:
                    # Events sit on the loss, or on the first metric of a
                    # run without one: the one trace moves to that axis.
                    self._events_panel = panel
                    edit = edits.setdefault(self._traces[key], {})
                    edit["yaxis"] = self._axes(self.rows["loss"], secondary=panel == "metrics")["yaxis"]
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
            restyle, indexes = _update_params(edits)
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
        trace = self._trace("loss", f"{run.name} (saved)", markers=False)
        with self.figure.batch_update():
            trace.x, trace.y = x, y
            trace.line = dict(color="rgba(120,120,120,0.45)", width=1, dash="dot")

    def trace(self, name, panel="loss"):
        """The plotly trace drawing series `name` of `panel` (for tests and notebooks)."""
        return self.figure.data[self._traces[(panel, name)]]


def _panel_of(panel, series):
    """The panel whose trace draws `series`: event markers have one trace whichever axis they are on."""
    return "loss" if series.name == "events" else panel


def _values(array):
    """A 1-D float32 array that nothing else writes to, as plotly's validation would have made it."""
    array = np.array(array, np.float32).ravel()
    array.flags.writeable = False
    return array


def _update_params(edits):
    """`plotly_update`'s restyle data and trace indexes for {trace index: {property: value}}.

    One list per property, a value per trace; a trace that does not change
    a property gets plotly's `Undefined` there (what `batch_update()` sends).
    """
    from plotly.basedatatypes import Undefined

    indexes = sorted(edits)
    names = sorted({name for edit in edits.values() for name in edit})
    restyle = {name: [edits[i].get(name, Undefined) for i in indexes] for name in names}
    return restyle, indexes


def _axis_name(figure, trace):
    anchor = trace.yaxis or "y"
    return "yaxis" + anchor[1:]
