"""What the charts of a Run draw: bounded series, updated from new rows only.

`ChartState(run)` keeps, for every series the Dashboard draws (per-batch loss
and metrics, per-layer gradient norms and update ratios, the layer x step
heatmap), a summary that grows with the number of points drawn, not with
the run: each refresh reads only the rows added since the last one. A line
is summarised by the minimum and maximum of buckets of steps (buckets double
in width as the run grows), then reduced to at most `max_points` by
tsdownsample's MinMaxLTTB, so spikes and dips survive at any run length.
`chart_data(run)` is the one-off form (reports, static rendering).

Every array is 1-D float32: plotly's widget serializer sends those as binary
buffers (2-D arrays and lists go as JSON, about 5x larger and far slower to
encode), which is why the heatmap is three columns (step, layer index,
value) rather than a matrix.

With a smoothing weight (`widgets.smoothing`, TensorBoard's debiased
exponential moving average), each per-batch loss and metric line gets a
smoothed companion, `<name> (smoothed)`, folded in from the new rows only
like the line itself; the raw line is then marked faint. Every line carries
its colour: the loss one, the metrics others, a validation series its
line's, so both views draw a run in the same colours.
"""

import dataclasses

import numpy as np

from lab import schema
from widgets import smoothing as smoothing_module
from widgets.downsampling import MAX_POINTS, Envelope, StepBins, downsample
from widgets.static import PALETTE

HEATMAP_BINS = 200
MAX_EVENTS = 200
MARKED_EVENTS = ("nonfinite", "breakpoint", "error", "interrupt")
LOSS_COLOR = PALETTE[0]
METRIC_COLORS = PALETTE[1:]  # never the loss's colour
# The panels whose per-batch lines get a smoothed companion.
SMOOTHED_PANELS = ("loss", "metrics")

# Columns of a batch row that say how a step ran, not what it measured:
# never charted nor compared (`updated/<optimizer>` is 1.0 at every step
# that applied its update).
_BOOKKEEPING = (schema.STEP, schema.EPOCH, schema.BATCH_INDEX, schema.MODE, schema.SOURCE, schema.UPDATED)
_BOOKKEEPING_PREFIXES = (schema.UPDATED_PREFIX, schema.APPLIES_PREFIX, schema.INTERNAL, "hist/")
# Values with a chart of their own, or none: not drawn on the metrics axis.
_NOT_METRICS = (schema.LOSS, schema.SECONDS)
_NOT_METRIC_PREFIXES = (schema.GRAD_NORM, schema.WEIGHT_NORM_PREFIX, schema.UPDATE_RATIO_PREFIX, schema.LEARNING_RATE)


@dataclasses.dataclass
class Series:
    """One line or set of markers: float32 `x` (steps) and `y`, at most a few thousand points.

    `color` is the series' colour (None: the view picks one); `faint`
    marks a raw line drawn faintly behind its smoothed companion, which
    carries the legend entry.
    """

    name: str
    x: np.ndarray
    y: np.ndarray
    markers: bool = False
    text: tuple = ()
    color: str = None
    faint: bool = False


@dataclasses.dataclass
class Heatmap:
    """A layer x step grid sent as columns: `x` step, `y` layer index, `z` mean log10 norm."""

    x: np.ndarray
    y: np.ndarray
    z: np.ndarray
    layers: tuple


@dataclasses.dataclass
class ChartData:
    """Everything a refresh draws; panels without data are empty lists."""

    loss: list
    metrics: list
    gradients: list
    heatmap: Heatmap
    update_ratios: list
    steps: int


def is_bookkeeping(name):
    """Whether a batch column records how the step ran (step, mode, `updated/...`) rather than a value."""
    return name in _BOOKKEEPING or name.startswith(_BOOKKEEPING_PREFIXES)


def metric_names(columns):
    """The per-batch metric columns of a run (accuracy, d_loss, ...), in their order."""
    return [c for c in columns
            if not is_bookkeeping(c) and c not in _NOT_METRICS and not c.startswith(_NOT_METRIC_PREFIXES)]


def layer_of(path):
    """The layer a variable path belongs to: `seq/dense/kernel` -> `seq/dense`."""
    return path.rsplit("/", 1)[0] if "/" in path else path


def layer_groups(columns, prefix):
    """Per-variable columns `<prefix><variable.path>` grouped by layer, in column order."""
    groups = {}
    for column in columns:
        if column.startswith(prefix):
            groups.setdefault(layer_of(column[len(prefix):]), []).append(column)
    return groups


def combine_norms(values):
    """The norm of several variables together from their norms (rows: variables).

    A step where none has a value stays NaN: missing, not zero.
    """
    values = np.asarray(values, np.float32)
    total = np.sqrt(np.nansum(np.square(values), axis=0))
    total[np.isnan(values).all(axis=0)] = np.nan
    return total


def largest(values):
    """The largest value per step across rows, NaN where every row is NaN."""
    values = np.asarray(values, np.float32)
    missing = np.isnan(values).all(axis=0)
    total = np.where(np.isnan(values), -np.inf, values).max(axis=0)
    total[missing] = np.nan
    return total


def read_rows(run, name, start, stop):
    """Rows `start:stop` of a batch column, copying only those rows."""
    return run.column(name, start, stop)  # copies only those rows


class ChartState:
    """The series of a growing run, kept up to date from the rows added since the last call.

    Args:
        run: lab.Run, append-only.
        max_points: int, the most points per line.
        heatmap_bins: int, the most step columns of the heatmap (one more
            while a bin fills).
        follow: bool, subscribe to the run to learn when epochs and events
            change (off for a one-off reading).
        smoothing: float in [0, 1), the weight of the smoothed companions
            of the loss and metric lines (`widgets.smoothing`); 0: none.

    Example:

    ```python
    state = ChartState(recorder.run)
    data = state.update()  # cheap to call again as the run grows
    ```
    """

    def __init__(self, run, max_points=MAX_POINTS, heatmap_bins=HEATMAP_BINS, follow=True, smoothing=0.0):
        if max_points < 8:
            raise ValueError(f"max_points must be at least 8; got {max_points}.")
        self.run = run
        self.max_points = max_points
        self.heatmap_bins = heatmap_bins
        self._smoothing = smoothing_module.check_weight("ChartState", smoothing)
        self._read = 0
        self._lines = {}  # (panel, name) -> (columns, combine, Envelope)
        self._smoothed = {}  # (panel, name) -> (Smoother, Envelope) of a line's smoothed companion
        self._bins = None
        self._bin_layers = ()
        # Epoch rows and events change rarely; building their DataFrames
        # on every refresh would cost more than all the lines together.
        self._tables = {}
        if follow:
            run.subscribe(self._on_rows)

    @property
    def smoothing(self):
        """float, the smoothing weight (0: none); set it to redraw the smoothed lines at the next update."""
        return self._smoothing

    @smoothing.setter
    def smoothing(self, weight):
        weight = smoothing_module.check_weight("ChartState", weight)
        if weight != self._smoothing:
            self._smoothing = weight
            self._smoothed = {}  # rebuilt from the first row at the next update
            self._tables.pop("data", None)

    def _on_rows(self, run, table, start, stop):
        # What is built from a table goes with it: "validation" from the
        # epochs, "marked" (the events drawn) from the events, and the
        # last ChartData ("data") from any of them.
        self._tables.pop("data", None)
        if table == "epochs":
            self._tables.pop("epochs", None)
            self._tables.pop("validation", None)
        elif table == "events":
            self._tables.pop("events", None)
            self._tables.pop("marked", None)

    def _table(self, table):
        if table not in self._tables:
            frame = self.run.epochs() if table == "epochs" else self.run.events()
            self._tables[table] = frame
        return self._tables[table]

    def _plan(self, columns):
        """The lines the run's columns call for; new ones start from the first row."""
        wanted = {}
        if "loss" in columns:
            wanted[("loss", "loss")] = (["loss"], None)
        for name in metric_names(columns):
            wanted[("metrics", name)] = ([name], None)
        for layer, group in layer_groups(columns, "grad_norm/").items():
            wanted[("gradients", layer)] = (group, combine_norms)
        for layer, group in layer_groups(columns, "update_ratio/").items():
            wanted[("update_ratios", layer)] = (group, largest)
        restart = False
        for key, (group, combine) in wanted.items():
            known = self._lines.get(key)
            if known is None or known[0] != group:
                self._lines[key] = (group, combine, Envelope(2 * self.max_points))
                restart = True
        grad_layers = tuple(layer for panel, layer in self._lines if panel == "gradients")
        if grad_layers != self._bin_layers:
            self._bin_layers = grad_layers
            self._bins = StepBins(len(grad_layers), self.heatmap_bins)
            restart = True
        return restart

    def update(self):
        """Reads the new rows and returns the `ChartData` to draw.

        When no rows, epochs or events came since the last call it returns
        the same `ChartData` again: a caller treats it as read-only.
        """
        run = self.run
        stop = len(run)
        if stop < self._read:  # not the run this state followed: start over
            self.__init__(run, self.max_points, self.heatmap_bins, follow=False, smoothing=self._smoothing)
        if self._plan(run.columns):
            # A line or layer appeared: rebuild every summary from row 0 so
            # all of them (and the heatmap's bins) cover the same rows.
            for key, (group, combine, _) in list(self._lines.items()):
                self._lines[key] = (group, combine, Envelope(2 * self.max_points))
            self._smoothed = {}
            self._bins = StepBins(len(self._bin_layers), self.heatmap_bins)
            self._read = 0
            self._tables.pop("data", None)
        self._smooth_rows_read()
        start = self._read
        if stop > start:
            steps = read_rows(run, "step", start, stop).astype(np.float64)
            layer_values = {}
            for (panel, name), (group, combine, envelope) in self._lines.items():
                values = [read_rows(run, c, start, stop) for c in group]
                values = values[0] if combine is None else combine(values)
                envelope.extend(steps, values)
                if (panel, name) in self._smoothed:
                    smoother, smoothed = self._smoothed[(panel, name)]
                    smoothed.extend(steps, smoother.extend(values))
                if panel == "gradients":
                    layer_values[name] = values
            if self._bin_layers:
                grid = np.stack([layer_values[l] for l in self._bin_layers])
                if run.metadata.get(schema.NORMS_EVERY, 1) > 1:
                    # Norms of one step in n: the heatmap's columns are the
                    # steps that have them, not n-1 blank columns between.
                    taken = ~np.isnan(grid).all(axis=0)
                    steps, grid = steps[taken], grid[:, taken]
                self._bins.extend(steps, grid)
            self._read = stop
        elif self._tables.get("data") is not None:
            return self._tables["data"]  # no new rows, epochs or events: what the last call drew
        data = self._tables["data"] = self._data(stop)
        return data

    def _smooth_rows_read(self):
        """Starts the smoothed companions that are missing (a new line, a new weight) from the first row.

        The one step whose cost grows with the run, taken once per change of
        the weight, not per refresh; only the loss and metric columns are read.
        """
        if not self._smoothing:
            return
        for key, (group, _, _) in self._lines.items():
            if key[0] not in SMOOTHED_PANELS or key in self._smoothed:
                continue
            smoother, envelope = smoothing_module.Smoother(self._smoothing), Envelope(2 * self.max_points)
            if self._read:
                steps = read_rows(self.run, "step", 0, self._read).astype(np.float64)
                envelope.extend(steps, smoother.extend(read_rows(self.run, group[0], 0, self._read)))
            self._smoothed[key] = (smoother, envelope)

    def _colors(self):
        """The colour of each line by (panel, name): the loss its own, metrics and layers from the palette."""
        colors = {("loss", "loss"): LOSS_COLOR}
        metrics = [name for panel, name in self._lines if panel == "metrics"]
        colors.update({("metrics", name): METRIC_COLORS[i % len(METRIC_COLORS)] for i, name in enumerate(metrics)})
        # Layers start past the loss's and the first metric's colours, so a
        # glance down the charts does not pair a layer with the loss.
        layer_colors = PALETTE[2:] + PALETTE[:2]
        for panel in ("gradients", "update_ratios"):
            layers = [name for p, name in self._lines if p == panel]
            colors.update({(panel, name): layer_colors[i % len(layer_colors)] for i, name in enumerate(layers)})
        return colors

    def _data(self, stop):
        panels = {"loss": [], "metrics": [], "gradients": [], "update_ratios": []}
        colors = self._colors()
        for (panel, name), (_, _, envelope) in self._lines.items():
            color = colors.get((panel, name))
            smoothed = self._smoothed.get((panel, name))
            panels[panel].append(Series(name, *envelope.points(self.max_points), color=color,
                                        faint=smoothed is not None))
            if smoothed is not None:
                panels[panel].append(Series(name + smoothing_module.SUFFIX, *smoothed[1].points(self.max_points),
                                            color=color))
        for panel, series in self._validation():
            line = (panel, series.name[len("val_"):])
            series = dataclasses.replace(series, color=colors.get(line) or _unused_color(colors, panel))
            panels[panel].append(series)
        anchor = self._anchor()
        panels[anchor[0] if anchor else "loss"].append(self._events(stop, anchor))
        columns = self._bins.columns() if self._bin_layers else (np.zeros(0, np.float32),) * 3
        heat = Heatmap(*columns, self._bin_layers)
        return ChartData(panels["loss"], panels["metrics"], panels["gradients"], heat,
                         panels["update_ratios"], stop)

    def _validation(self):
        """(panel, Series) of each validation metric, rebuilt only when epoch rows change."""
        if "validation" not in self._tables:
            epochs = self._table("epochs")
            found = []
            if len(epochs):
                epoch_steps = epochs["step"].to_numpy()
                for name in [c for c in epochs.columns if c.startswith("val_")]:
                    series = Series(name, *downsample(epoch_steps, epochs[name].to_numpy(), self.max_points),
                                    markers=True)
                    found.append(("loss" if name == "val_loss" else "metrics", series))
            self._tables["validation"] = found
        return self._tables["validation"]

    def _anchor(self):
        """The (panel, name) of the line events sit on: the loss, else the first metric, with a finite value."""
        for key in [("loss", "loss")] + [key for key in self._lines if key[0] == "metrics"]:
            if key in self._lines and self._lines[key][2].first is not None:
                return key
        return None

    def _events(self, stop, anchor):
        """Markers for events worth seeing, on the line `anchor` ((panel, name)) or, with none, at 0.

        An event is marked at the last finite value of `anchor` at or before
        its step (that step's value is often the non-finite one itself), or
        at the line's first value when none comes before. A GAN logging only
        `d_loss` and `g_loss` gets its markers on `d_loss`. Kept until the
        events or the anchor change, once every marked step has its row.
        """
        kept = self._tables.get("marked")
        if kept is not None and kept[1] in (None, stop) and kept[2] == anchor:
            return kept[0]
        events = self._table("events")
        events = events[events["kind"].isin(MARKED_EVENTS)].tail(MAX_EVENTS)
        x = events["step"].to_numpy().astype(np.float32)
        y = np.zeros(len(x), np.float32)
        if anchor is not None:
            y[:] = self._lines[anchor][2].first[1]
            for i, step in enumerate(x.astype(np.int64)):
                row = min(int(step), stop - 1)
                recent = read_rows(self.run, anchor[1], max(0, row - 63), row + 1) if row >= 0 else []
                finite = np.asarray(recent)[np.isfinite(recent)]
                if len(finite):
                    y[i] = finite[-1]
        text = tuple(f"{kind}: {detail}" for kind, detail in zip(events["kind"], events["detail"]))
        marked = Series("events", x, y, markers=True, text=text)
        # It reads the rows up to the last marked step: once they are all
        # there it cannot change, until they are it changes with each row.
        complete = not len(x) or int(x.max()) < stop
        self._tables["marked"] = (marked, None if complete else stop, anchor)
        return marked


def _unused_color(colors, panel):
    """A colour for a validation series without a per-batch line: one no line of its panel has."""
    palette = (LOSS_COLOR,) if panel == "loss" else METRIC_COLORS
    taken = {color for (p, _), color in colors.items() if p == panel}
    return next((c for c in palette if c not in taken), palette[len(taken) % len(palette)])


def chart_data(run, max_points=MAX_POINTS, heatmap_bins=HEATMAP_BINS, smoothing=0.0):
    """Every series the Dashboard draws for `run`, each bounded in size (one-off form of `ChartState`).

    With `smoothing` (a weight in [0, 1)), the loss and metric lines get
    their smoothed companions (`widgets.smoothing`).

    Example:

    ```python
    data = chart_data(lab.Run.load("run.h5"))
    data.loss[0].y  # the per-batch loss, downsampled
    ```
    """
    return ChartState(run, max_points, heatmap_bins, follow=False, smoothing=smoothing).update()
