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
"""

import dataclasses

import numpy as np
from tsdownsample import MinMaxLTTBDownsampler

MAX_POINTS = 2000
HEATMAP_BINS = 200
MAX_EVENTS = 200
MARKED_EVENTS = ("nonfinite", "breakpoint", "error", "interrupt")

# Columns of a batch row that are bookkeeping, not values to plot.
_NOT_METRICS = ("step", "epoch", "batch", "seconds", "mode", "loss", "updated")
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


def downsample(x, y, n_out=MAX_POINTS):
    """Reduces a series to at most `n_out` points, keeping its minima and maxima.

    Uses tsdownsample's MinMaxLTTB (min/max preselection, then
    largest-triangle-three-buckets) and always keeps the global minimum and
    maximum. Non-finite values are dropped: a line
    cannot draw them; events mark those steps.

    Args:
        x: np.ndarray, increasing steps.
        y: np.ndarray, values, same length.
        n_out: int, the most points to return (at least 8).

    Returns:
        (x, y) as float32 arrays of at most `n_out` points.

    Example:

    ```python
    x, y = downsample(np.arange(100_000), loss)  # 2,000 points
    ```
    """
    if n_out < 8:
        raise ValueError(f"n_out must be at least 8 to keep a series' shape; got {n_out}.")
    x = np.asarray(x)
    y = np.asarray(y, dtype=np.float32)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(f"x and y must be 1-D arrays of one length; got shapes {x.shape} and {y.shape}.")
    finite = np.isfinite(y)
    if not finite.all():
        x, y = x[finite], y[finite]
    if len(y) > n_out:
        index = _DOWNSAMPLER.downsample(np.ascontiguousarray(x), np.ascontiguousarray(y), n_out=n_out - 2)
        index = index.astype(np.int64)
        # LTTB keeps one candidate per bucket, not always the extreme one:
        # add the global minimum and maximum so neither is ever lost.
        for extreme in (int(np.argmin(y)), int(np.argmax(y))):
            at = np.searchsorted(index, extreme)
            if at == len(index) or index[at] != extreme:
                index = np.insert(index, at, extreme)
        x, y = x[index], y[index]
    return x.astype(np.float32), y.astype(np.float32)


def metric_names(columns):
    """The per-batch metric columns of a run (accuracy, ...), in their order."""
    return [c for c in columns if c not in _NOT_METRICS and not c.startswith(_PREFIXES)]


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
    # Run.column() copies the whole column; at a million steps that copy
    # alone would dominate a refresh, so read the slice under the run's lock.
    with run._lock:
        return run._columns[name].data[start:stop].copy()


def _starting_width(rows, most):
    """The bucket width (a power of two) that fits `rows` into at most `most` buckets."""
    width = 1
    while rows > most * width:
        width *= 2
    return width


class Envelope:
    """Min and max of step buckets of an append-only series, at bounded size.

    Buckets start one step wide and double (pairs merge) whenever there are
    more than `max_buckets`, so memory and the cost of `points()` stay
    bounded while `extend` costs only the new rows.

    Args:
        max_buckets: int, the most buckets kept.
    """

    def __init__(self, max_buckets):
        self.max_buckets = max_buckets
        self.width = 1
        self.bx = np.zeros((0, 2))  # per bucket: step of its min, step of its max
        self.by = np.zeros((0, 2), np.float32)
        self.tail_x = np.zeros(0)
        self.tail_y = np.zeros(0, np.float32)

    def extend(self, x, y):
        if not len(self.bx) and not len(self.tail_y):
            self.width = _starting_width(len(y), self.max_buckets)
        finite = np.isfinite(y)
        x = np.concatenate([self.tail_x, np.asarray(x, np.float64)[finite]])
        y = np.concatenate([self.tail_y, np.asarray(y, np.float32)[finite]])
        full = len(y) // self.width * self.width
        if full:
            bx, by = x[:full].reshape(-1, self.width), y[:full].reshape(-1, self.width)
            rows = np.arange(len(bx))
            low, high = by.argmin(axis=1), by.argmax(axis=1)
            self.bx = np.concatenate([self.bx, np.stack([bx[rows, low], bx[rows, high]], axis=1)])
            self.by = np.concatenate([self.by, np.stack([by[rows, low], by[rows, high]], axis=1)])
        self.tail_x, self.tail_y = x[full:], y[full:]
        while len(self.bx) > self.max_buckets:
            self._coarsen()

    def _coarsen(self):
        pairs = len(self.bx) // 2 * 2
        px = self.bx[:pairs].reshape(-1, 2, 2)
        py = self.by[:pairs].reshape(-1, 2, 2)
        rows = np.arange(len(px))
        low = py[:, :, 0].argmin(axis=1)
        high = py[:, :, 1].argmax(axis=1)
        merged_x = np.stack([px[rows, low, 0], px[rows, high, 1]], axis=1)
        merged_y = np.stack([py[rows, low, 0], py[rows, high, 1]], axis=1)
        self.bx = np.concatenate([merged_x, self.bx[pairs:]])
        self.by = np.concatenate([merged_y, self.by[pairs:]])
        self.width *= 2

    def points(self, n_out):
        """At most `n_out` points (float32 x, y) drawn from the envelope and the tail."""
        swap = self.bx[:, 0] > self.bx[:, 1]
        bx, by = self.bx.copy(), self.by.copy()
        bx[swap], by[swap] = bx[swap][:, ::-1], by[swap][:, ::-1]
        x, y = bx.ravel(), by.ravel()
        keep = np.ones(len(x), bool)
        keep[1:] = x[1:] != x[:-1]  # a bucket whose min and max are one point
        x = np.concatenate([x[keep], self.tail_x])
        y = np.concatenate([y[keep], self.tail_y])
        return downsample(x, y, n_out)


class StepBins:
    """Mean of log10 values per step bin for several rows (layers), at bounded size.

    Args:
        layers: int, rows of values.
        max_bins: int, the most complete bins kept; bins double in width beyond.
    """

    def __init__(self, layers, max_bins):
        self.max_bins = max_bins
        self.width = 1
        self.sums = np.zeros((layers, 0))
        self.counts = np.zeros((layers, 0))
        self.first = np.zeros(0)
        self.last = np.zeros(0)
        self.tail_steps = np.zeros(0)
        self.tail = np.zeros((layers, 0))

    def extend(self, steps, values):
        if not len(self.first) and not len(self.tail_steps):
            self.width = _starting_width(len(steps), self.max_bins)
        with np.errstate(divide="ignore", invalid="ignore"):
            logs = np.log10(np.asarray(values, np.float64))
        steps = np.concatenate([self.tail_steps, steps])
        logs = np.concatenate([self.tail, logs], axis=1)
        full = len(steps) // self.width * self.width
        if full:
            block = logs[:, :full].reshape(len(logs), -1, self.width)
            finite = np.isfinite(block)
            self.sums = np.concatenate([self.sums, np.where(finite, block, 0).sum(axis=2)], axis=1)
            self.counts = np.concatenate([self.counts, finite.sum(axis=2)], axis=1)
            s = steps[:full].reshape(-1, self.width)
            self.first = np.concatenate([self.first, s[:, 0]])
            self.last = np.concatenate([self.last, s[:, -1]])
        self.tail_steps, self.tail = steps[full:], logs[:, full:]
        while self.sums.shape[1] > self.max_bins:
            pairs = self.sums.shape[1] // 2 * 2
            merge = lambda a: np.concatenate(  # noqa: E731
                [a[:, :pairs].reshape(len(a), -1, 2).sum(axis=2), a[:, pairs:]], axis=1)
            self.sums, self.counts = merge(self.sums), merge(self.counts)
            self.first = np.concatenate([self.first[:pairs:2], self.first[pairs:]])
            self.last = np.concatenate([self.last[1:pairs:2], self.last[pairs:]])
            self.width *= 2

    def heatmap(self, layers):
        sums, counts = self.sums, self.counts
        first, last = self.first, self.last
        if len(self.tail_steps):
            finite = np.isfinite(self.tail)
            sums = np.concatenate([sums, np.where(finite, self.tail, 0).sum(axis=1, keepdims=True)], axis=1)
            counts = np.concatenate([counts, finite.sum(axis=1, keepdims=True)], axis=1)
            first = np.append(first, self.tail_steps[0])
            last = np.append(last, self.tail_steps[-1])
        with np.errstate(invalid="ignore", divide="ignore"):
            means = np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)
        bins = len(first)
        centers = ((first + last) / 2).astype(np.float32)
        return Heatmap(np.tile(centers, len(layers)),
                       np.repeat(np.arange(len(layers), dtype=np.float32), bins),
                       means.astype(np.float32).ravel(), tuple(layers))


class ChartState:
    """The series of a growing run, kept up to date from the rows added since the last call.

    Args:
        run: lab.Run, append-only.
        max_points: int, the most points per line.
        heatmap_bins: int, the most step columns of the heatmap (one more
            while a bin fills).
        follow: bool, subscribe to the run to learn when epochs and events
            change (off for a one-off reading).

    Example:

    ```python
    state = ChartState(recorder.run)
    data = state.update()  # cheap to call again as the run grows
    ```
    """

    def __init__(self, run, max_points=MAX_POINTS, heatmap_bins=HEATMAP_BINS, follow=True):
        if max_points < 8:
            raise ValueError(f"max_points must be at least 8; got {max_points}.")
        self.run = run
        self.max_points = max_points
        self.heatmap_bins = heatmap_bins
        self._read = 0
        self._lines = {}  # (panel, name) -> (columns, combine, Envelope)
        self._bins = None
        self._bin_layers = ()
        # Epoch rows and events change rarely; building their DataFrames
        # on every refresh would cost more than all the lines together.
        self._tables = {}
        if follow:
            run.subscribe(self._on_rows)

    def _on_rows(self, run, table, start, stop):
        if table != "batches":
            self._tables.pop(table, None)

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
        """Reads the new rows and returns the `ChartData` to draw."""
        run = self.run
        stop = len(run)
        if stop < self._read:  # not the run this state followed: start over
            self.__init__(run, self.max_points, self.heatmap_bins, follow=False)
        if self._plan(run.columns):
            # A line or layer appeared: rebuild every summary from row 0 so
            # all of them (and the heatmap's bins) cover the same rows.
            for key, (group, combine, _) in list(self._lines.items()):
                self._lines[key] = (group, combine, Envelope(2 * self.max_points))
            self._bins = StepBins(len(self._bin_layers), self.heatmap_bins)
            self._read = 0
        start = self._read
        if stop > start:
            steps = read_rows(run, "step", start, stop).astype(np.float64)
            layer_values = {}
            for (panel, name), (group, combine, envelope) in self._lines.items():
                values = [read_rows(run, c, start, stop) for c in group]
                values = values[0] if combine is None else combine(values)
                envelope.extend(steps, values)
                if panel == "gradients":
                    layer_values[name] = values
            if self._bin_layers:
                self._bins.extend(steps, np.stack([layer_values[l] for l in self._bin_layers]))
            self._read = stop
        return self._data(stop)

    def _data(self, stop):
        panels = {"loss": [], "metrics": [], "gradients": [], "update_ratios": []}
        for (panel, name), (_, _, envelope) in self._lines.items():
            panels[panel].append(Series(name, *envelope.points(self.max_points)))
        epochs = self._table("epochs")
        if len(epochs):
            epoch_steps = epochs["step"].to_numpy()
            for name in [c for c in epochs.columns if c.startswith("val_")]:
                series = Series(name, *downsample(epoch_steps, epochs[name].to_numpy(), self.max_points),
                                markers=True)
                panels["loss" if name == "val_loss" else "metrics"].append(series)
        panels["loss"].append(self._events(stop))
        heat = (self._bins.heatmap(self._bin_layers) if self._bin_layers
                else Heatmap(*(np.zeros(0, np.float32),) * 3, ()))
        return ChartData(panels["loss"], panels["metrics"], panels["gradients"], heat,
                         panels["update_ratios"], stop)

    def _events(self, stop):
        """Markers for events worth seeing on the loss chart, at the loss of their step."""
        events = self._table("events")
        events = events[events["kind"].isin(MARKED_EVENTS)].tail(MAX_EVENTS)
        x = events["step"].to_numpy().astype(np.float32)
        y = np.full(len(x), np.nan, np.float32)
        if "loss" in self.run.columns:
            for i, step in enumerate(x.astype(np.int64)):
                # The loss of the event's step is often the non-finite value
                # itself: mark the last finite loss at or before it.
                row = min(int(step), stop - 1)
                recent = read_rows(self.run, "loss", max(0, row - 63), row + 1) if row >= 0 else []
                finite = np.asarray(recent)[np.isfinite(recent)]
                if len(finite):
                    y[i] = finite[-1]
        text = tuple(f"{kind}: {detail}" for kind, detail in zip(events["kind"], events["detail"]))
        return Series("events", x, y, markers=True, text=text)


def chart_data(run, max_points=MAX_POINTS, heatmap_bins=HEATMAP_BINS):
    """Every series the Dashboard draws for `run`, each bounded in size (one-off form of `ChartState`).

    Example:

    ```python
    data = chart_data(lab.Run.load("run.h5"))
    data.loss[0].y  # the per-batch loss, downsampled
    ```
    """
    return ChartState(run, max_points, heatmap_bins, follow=False).update()
