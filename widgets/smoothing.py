"""Smoothing of per-batch lines for display: TensorBoard's debiased exponential moving average.

Per-batch loss and metrics are noisy by nature; the charts draw a smoothed
line over the raw one, drawn faint behind it. The smoothing is TensorBoard's
(its scalar dashboard's `smoothingWeight`): for a weight `w` in [0, 1),

    last = w * last + (1 - w) * value        (last starts at 0)
    smoothed = last / (1 - w ** n)            after n finite values

The division debiases the start: without it the line would rise from 0
(TensorBoard's "debiasing at the start"). Non-finite values are skipped (an
event marks those steps). Over the finite values this is pandas'
`Series.ewm(alpha=1 - w, adjust=True).mean()`.

It is display-only: the run's values (`run.batches()`) are never changed.
`Smoother` continues from where the last call stopped, so a refresh smooths
only the rows added since the previous one.
"""

import numbers

import numpy as np
import pandas as pd

from lab.arguments import check_number

DEFAULT_WEIGHT = 0.6  # TensorBoard's default
SUFFIX = " (smoothed)"


def check_weight(call, weight):
    """`weight` if it is a smoothing weight in [0, 1) (0: no smoothing), else an error naming the fix.

    Args:
        call: str, what the weight is given to (`widgets.Dashboard`).
        weight: the weight given.
    """
    check_number(call, "smoothing", weight, numbers.Real, lambda w: 0 <= w < 1,
                 "a weight in [0, 1) (0 turns smoothing off)", "0.6, TensorBoard's default")
    return float(weight)


class Smoother:
    """TensorBoard's debiased exponential moving average of an append-only series, fed in blocks.

    Args:
        weight: float in [0, 1), how much of the smoothed value carries over
            from one step to the next.

    Example:

    ```python
    smoother = Smoother(0.6)
    smoother.extend([1.0, 0.5])  # [1.0, 0.6875]
    smoother.extend([0.25])      # continues the same average
    ```
    """

    def __init__(self, weight):
        self.weight = weight
        self.last = 0.0
        self.count = 0

    def extend(self, values):
        """The smoothed values of the next `values` (float32; NaN where a value is not finite)."""
        values = np.asarray(values, np.float64)
        smoothed = np.full(len(values), np.nan, np.float32)
        finite = np.isfinite(values)
        new = values[finite]
        if not len(new):
            return smoothed
        w = self.weight
        # The block's own average from 0 is the ewm mean times (1 - w**k);
        # what was carried in before decays by w**k.
        mean = pd.Series(new).ewm(alpha=1 - w, adjust=True).mean().to_numpy()
        decay = _powers(w, 0, len(new))
        last = decay * self.last + (1 - decay) * mean
        smoothed[finite] = last / (1 - _powers(w, self.count, len(new)))
        self.last = float(last[-1])
        self.count += len(new)
        return smoothed



def _powers(weight, start, count):
    """`weight ** (start + 1)`, ..., `weight ** (start + count)`, each at least 1e-20 (nothing
    next to 1 in float64): smaller ones are subnormal numbers, on which the CPU is many times
    slower, and the rest need not be raised to a power at all."""
    floor = 1e-20
    if weight == 0:
        return np.zeros(count)
    powers = np.full(count, floor)
    above = max(0, min(count, int(np.log(floor) / np.log(weight)) - start))
    powers[:above] = weight ** np.arange(start + 1, start + above + 1, dtype=np.float64)
    return powers
