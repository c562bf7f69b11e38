"""Charts of a Run: what to draw (pure functions) and a live plotly figure.

`chart_data(run)` turns a `lab.Run` into bounded, downsampled series: per-batch
loss and metrics, validation points per epoch, events, per-layer gradient
norms, a layer x step heatmap and update ratios. Both the live figure
(`LiveFigure`, a plotly `FigureWidget`) and the static SVG rendering
(`widgets.static`) draw from it, so they always show the same thing.

Every array a refresh sends is a 1-D float32 numpy array: plotly's widget
serializer sends those as binary buffers (2-D arrays and lists go as JSON,
about 5x larger and 400x slower to encode), which is why the heatmap is sent
as three columns (step, layer index, value) rather than a matrix.
"""

import dataclasses

import numpy as np
from tsdownsample import MinMaxLTTBDownsampler

MAX_POINTS = 2000
HEATMAP_BINS = 200
MAX_EVENTS = 200
MARKED_EVENTS = ("nonfinite", "breakpoint", "error", "interrupt")

# Columns of a batch row that are bookkeeping, not values to plot.
_NOT_METRICS = ("step", "epoch", "batch", "seconds", "mode", "loss")
_PREFIXES = ("grad_norm", "weight_norm/", "update_ratio/", "learning_rate", "_", "hist/")

_DOWNSAMPLER = MinMaxLTTBDownsampler()


@dataclasses.dataclass
class Series:
    """One line or set of markers: float32 `x` (steps) and `y`, at most a few thousand points."""

    name: str
    x: np.ndarray
    y: np.ndarray
    markers: bool = False
    text: tuple = ()


@dataclasses.dataclass
class Heatmap:
    """A layer x step grid sent as columns: `x` step, `y` layer index, `z` log10 norm."""

    x: np.ndarray
    y: np.ndarray
    z: np.ndarray
    layers: tuple


@dataclasses.dataclass
class ChartData:
    """Everything a refresh draws; panels that have no data are empty."""

    loss: list
    metrics: list
    gradients: list
    heatmap: Heatmap
    update_ratios: list
    steps: int


def downsample(x, y, n_out=MAX_POINTS):
    """Reduces a series to at most `n_out` points, keeping its minima and maxima.

    Uses tsdownsample's MinMaxLTTB (min/max preselection, then
    largest-triangle-three-buckets), so spikes and dips survive. Non-finite
    values are dropped: a line cannot draw them; events mark those steps.

    Args:
        x: np.ndarray, increasing steps.
        y: np.ndarray, values, same length.
        n_out: int, the most points to return (at least 4).

    Returns:
        (x, y) as float32 arrays of at most `n_out` points.

    Example:

    ```python
    x, y = downsample(np.arange(100_000), loss)  # 2,000 points
    ```
    """
    if n_out < 4:
        raise ValueError(f"n_out must be at least 4 to keep a series' shape; got {n_out}.")
    x = np.asarray(x)
    y = np.asarray(y, dtype=np.float32)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(f"x and y must be 1-D arrays of one length; got shapes {x.shape} and {y.shape}.")
    finite = np.isfinite(y)
    if not finite.all():
        x, y = x[finite], y[finite]
    if len(y) > n_out:
        index = _DOWNSAMPLER.downsample(np.ascontiguousarray(x), np.ascontiguousarray(y), n_out=n_out)
        x, y = x[index], y[index]
    return x.astype(np.float32), y.astype(np.float32)


def metric_names(columns):
    """The per-batch metric columns of a run (accuracy, ...), in their order."""
    return [c for c in columns if c not in _NOT_METRICS and not c.startswith(_PREFIXES)]


def layer_of(path):
    """The layer a variable path belongs to: `seq/dense/kernel` -> `seq/dense`."""
    return path.rsplit("/", 1)[0] if "/" in path else path


def layer_norms(run, prefix):
    """Per-layer norms from per-variable columns `<prefix><variable.path>`.

    A layer's norm is the root of the sum of its variables' squared norms
    (the norm of all its variables together); a step where none of them has
    a value stays NaN (missing, not zero).

    Returns:
        dict, layer name -> float32 array, one value per batch row.
    """
    groups = {}
    for column in run.columns:
        if column.startswith(prefix):
            groups.setdefault(layer_of(column[len(prefix):]), []).append(column)
    norms = {}
    for layer, columns in groups.items():
        values = np.stack([run.column(c) for c in columns]).astype(np.float32)
        missing = np.isnan(values).all(axis=0)
        total = np.sqrt(np.nansum(np.square(values), axis=0))
        total[missing] = np.nan
        norms[layer] = total
    return norms


def heatmap(norms, steps, bins=HEATMAP_BINS):
    """Bins per-layer norms along the steps into a layer x step grid of log10 values.

    Each cell is the mean of log10(norm) over the finite values of its bin,
    so a layer whose gradients vanish reads as a dark row and one that
    explodes as a bright one whatever the run's length.

    Args:
        norms: dict, layer -> array of per-step norms (as `layer_norms`).
        steps: np.ndarray, the step of each row.
        bins: int, the most columns.

    Returns:
        `Heatmap` with 1-D float32 columns.
    """
    layers = tuple(norms)
    count = len(steps)
    if not layers or count == 0:
        empty = np.zeros(0, np.float32)
        return Heatmap(empty, empty, empty, layers)
    bins = min(bins, count)
    edges = np.linspace(0, count, bins + 1).astype(np.int64)
    starts = edges[:-1]
    centers = ((steps[starts] + steps[edges[1:] - 1]) / 2).astype(np.float32)
    xs, ys, zs = [], [], []
    for i, layer in enumerate(layers):
        with np.errstate(divide="ignore", invalid="ignore"):
            logs = np.log10(norms[layer].astype(np.float64))
        finite = np.isfinite(logs)
        sums = np.add.reduceat(np.where(finite, logs, 0.0), starts)
        counts = np.add.reduceat(finite.astype(np.int64), starts)
        with np.errstate(invalid="ignore"):
            means = np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)
        xs.append(centers)
        ys.append(np.full(bins, i, np.float32))
        zs.append(means.astype(np.float32))
    return Heatmap(np.concatenate(xs), np.concatenate(ys), np.concatenate(zs), layers)


def chart_data(run, max_points=MAX_POINTS, heatmap_bins=HEATMAP_BINS):
    """Computes every series the Dashboard draws, each bounded in size.

    Args:
        run: lab.Run.
        max_points: int, the most points per line.
        heatmap_bins: int, the most step columns of the heatmap.

    Returns:
        `ChartData`.

    Example:

    ```python
    data = chart_data(recorder.run)
    data.loss[0].y  # the per-batch loss, downsampled
    ```
    """
    steps = run.column("step") if len(run) else np.zeros(0, np.int64)
    columns = run.columns
    loss, metrics = [], []
    if "loss" in columns and len(run):
        loss.append(Series("loss", *downsample(steps, run.column("loss"), max_points)))
    for name in metric_names(columns):
        metrics.append(Series(name, *downsample(steps, run.column(name), max_points)))
    epochs = run.epochs()
    if len(epochs):
        epoch_steps = epochs["step"].to_numpy()
        for name in [c for c in epochs.columns if c.startswith("val_")]:
            x, y = downsample(epoch_steps, epochs[name].to_numpy(), max_points)
            series = Series(name, x, y, markers=True)
            (loss if name == "val_loss" else metrics).append(series)
    loss.append(_events(run, steps))

    gradients, update_ratios = [], []
    grad = layer_norms(run, "grad_norm/")
    for layer, values in grad.items():
        gradients.append(Series(layer, *downsample(steps, values, max_points)))
    for layer, values in layer_ratios(run).items():
        update_ratios.append(Series(layer, *downsample(steps, values, max_points)))
    return ChartData(loss, metrics, gradients, heatmap(grad, steps, heatmap_bins), update_ratios, len(run))


def layer_ratios(run):
    """Per-layer update ratios: the largest `update_ratio/<path>` of the layer's variables."""
    groups = {}
    for column in run.columns:
        if column.startswith("update_ratio/"):
            groups.setdefault(layer_of(column[len("update_ratio/"):]), []).append(column)
    ratios = {}
    for layer, columns in groups.items():
        values = np.stack([run.column(c) for c in columns])
        with np.errstate(invalid="ignore"):
            all_missing = np.isnan(values).all(axis=0)
            values = np.where(all_missing, np.nan, np.nanmax(np.where(np.isnan(values), -np.inf, values), axis=0))
        ratios[layer] = values.astype(np.float32)
    return ratios


def _events(run, steps):
    """Markers for events worth seeing on the loss chart, at the loss of their step."""
    events = run.events()
    events = events[events["kind"].isin(MARKED_EVENTS)].tail(MAX_EVENTS)
    x = events["step"].to_numpy().astype(np.float32)
    y = np.full(len(x), np.nan, np.float32)
    if len(x) and "loss" in run.columns and len(steps):
        loss = run.column("loss")
        finite = np.isfinite(loss)
        for i, step in enumerate(x):
            # The loss of the event's step is often the non-finite value
            # itself: mark the last finite loss at or before it instead.
            upto = finite & (steps <= step)
            if upto.any():
                y[i] = loss[np.flatnonzero(upto)[-1]]
    text = tuple(f"{kind}: {detail}" for kind, detail in zip(events["kind"], events["detail"]))
    return Series("events", x, y, markers=True, text=text)


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
        self.figure = go.FigureWidget(grid)
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
        self._layers = ()
        # The loss trace exists from the start, so it is always trace 0.
        self._trace("loss", "loss", markers=False)
        if "heatmap" in self.rows:
            self._add_heatmap()

    def _trace(self, panel, name, markers):
        key = (panel, name)
        if key not in self._traces:
            import plotly.graph_objects as go

            empty = np.zeros(0, np.float32)
            label = f"{name} (update ratio)" if panel == "update_ratios" else name
            kwargs = dict(name=label, x=empty, y=empty, legendgroup=panel)
            if name == "events":
                kwargs.update(mode="markers", marker=dict(symbol="x", size=11, color="crimson"),
                              hoverinfo="text+x")
            elif markers:
                kwargs.update(mode="markers", marker=dict(size=8, symbol="diamond"))
            else:
                kwargs.update(mode="lines", line=dict(width=1.3))
            row = self.rows["loss" if panel == "metrics" else panel]
            secondary = True if panel == "metrics" else (False if panel == "loss" else None)
            self.figure.add_trace(go.Scatter(**kwargs), row=row, col=1, secondary_y=secondary)
            self._traces[key] = len(self.figure.data) - 1
        return self.figure.data[self._traces[key]]

    def _add_heatmap(self):
        import plotly.graph_objects as go

        empty = np.zeros(0, np.float32)
        self.figure.add_trace(
            go.Heatmap(x=empty, y=empty, z=empty, colorscale="Viridis", showscale=True,
                       name="log10 norm", colorbar=dict(title="log10", len=0.25, y=0.4)),
            row=self.rows["heatmap"], col=1,
        )
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
        targets = [(self._trace(panel, s.name, s.markers), s) for panel, items in panels for s in items]
        with self.figure.batch_update():
            for trace, series in targets:
                trace.x, trace.y = series.x, series.y
                if series.name == "events":
                    trace.hovertext = list(series.text)
            if "heatmap" in self.rows:
                trace = self.figure.data[self._traces[("heatmap", "heatmap")]]
                trace.x, trace.y, trace.z = data.heatmap.x, data.heatmap.y, data.heatmap.z
                if data.heatmap.layers != self._layers:
                    self._layers = data.heatmap.layers
                    axis = self.figure.layout[_axis_name(self.figure, trace)]
                    axis.tickvals = list(range(len(self._layers)))
                    axis.ticktext = list(self._layers)

    def trace(self, name, panel="loss"):
        """The plotly trace drawing series `name` of `panel` (for tests and notebooks)."""
        return self.figure.data[self._traces[(panel, name)]]


def _axis_name(figure, trace):
    anchor = trace.yaxis or "y"
    return "yaxis" + anchor[1:]
