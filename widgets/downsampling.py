"""Bounded summaries of long, growing series: downsampling, min/max envelopes, step bins.

`downsample` reduces a series with tsdownsample's MinMaxLTTB. `Envelope` and
`StepBins` summarise an append-only series in bounded memory, folding in
only the rows added since the last call, so a refresh costs the same at a
thousand steps and at a million.
"""

import numpy as np
from tsdownsample import MinMaxLTTBDownsampler

MAX_POINTS = 2000

_DOWNSAMPLER = MinMaxLTTBDownsampler()


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
    bounded while `extend` costs only the new rows. The first and the last
    finite point are kept too: a line starts at the run's first value and
    ends at its latest one, which a bucket's min and max need not be.

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
        self.first = None  # (step, value) of the first finite point
        self.last = None  # and of the latest

    def extend(self, x, y):
        if not len(self.bx) and not len(self.tail_y):
            self.width = _starting_width(len(y), self.max_buckets)
        finite = np.isfinite(y)
        new_x, new_y = np.asarray(x, np.float64)[finite], np.asarray(y, np.float32)[finite]
        if len(new_y):
            if self.first is None:
                self.first = (new_x[0], new_y[0])
            self.last = (new_x[-1], new_y[-1])
        x = np.concatenate([self.tail_x, new_x])
        y = np.concatenate([self.tail_y, new_y])
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
        # MinMaxLTTB keeps the first and last points it is given: give it the series' own.
        if self.first is not None and x[0] != self.first[0]:
            x, y = np.insert(x, 0, self.first[0]), np.insert(y, 0, self.first[1])
        if self.last is not None and x[-1] != self.last[0]:
            x, y = np.append(x, self.last[0]), np.append(y, self.last[1])
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

            def merge(a):
                return np.concatenate([a[:, :pairs].reshape(len(a), -1, 2).sum(axis=2), a[:, pairs:]], axis=1)

            self.sums, self.counts = merge(self.sums), merge(self.counts)
            self.first = np.concatenate([self.first[:pairs:2], self.first[pairs:]])
            self.last = np.concatenate([self.last[1:pairs:2], self.last[pairs:]])
            self.width *= 2

    def columns(self):
        """The bins as 1-D float32 columns (step, row index, mean log10 value)."""
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
        return (np.tile(centers, len(means)),
                np.repeat(np.arange(len(means), dtype=np.float32), bins),
                means.astype(np.float32).ravel())
