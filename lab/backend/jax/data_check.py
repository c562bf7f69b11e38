"""inspect_data on JAX: what fit() will hand train_step, checked against a model.

The report, its checks and the model's run on the first batch know no
backend (`lab.data_report`, `lab.batch_check`). What is JAX's is here: the
batches come from the JAX `Feed` (arrays sliced by Keras' own array
slicing, as the JAX trainer slices them; a PyDataset's and a generator's
batches as they come), an array fit() refuses is named in Keras' words from
that same slicing, and a first or last batch the devices of a
data-parallel `keras.distribution` cannot share evenly is a problem. JAX's fit() takes
no `tf.data.Dataset` here: TensorFlow is not imported on this path.
"""

import keras
import numpy as np

from lab.backend.jax.feed import Feed, slice_arrays, sliceable_arrays
from lab.data_report import DataReport, FitData, inspect
from lab.data_rules import Problem
from lab.error_text import error_line

__all__ = ["DataReport", "inspect_data"]


class JaxData(FitData):
    """How fit() takes data on JAX: NumPy arrays (and lists and dicts of them), a PyDataset, a generator."""

    feed = Feed

    def refused(self, leaf):
        """What Keras' array slicing for JAX says of an array it cannot take
        (NumPy strings: "Invalid dtype: str32"), tried on its first rows; None if it takes it."""
        if isinstance(leaf, np.ndarray) and leaf.dtype.kind in "biuf":
            return None  # taken as they are
        try:
            slice_arrays(sliceable_arrays((leaf[:2],)), slice(0, 2))
        except (ValueError, TypeError) as error:
            return error_line(error)
        return None

    def check_batch_sizes(self, report):
        """The first or last batch of an epoch that the devices of a
        data-parallel distribution cannot share in equal parts: JAX shards
        every batch evenly, and fit() fails on such a batch where it comes."""
        distribution = keras.distribution.distribution()
        if not isinstance(distribution, keras.distribution.DataParallel):
            return
        devices = distribution.device_mesh.devices.size
        for which, size in (("first", report.batch_size), ("last", report.last_batch_size)):
            if size is None or size % devices == 0:
                continue
            lower, over = max(size // devices, 1) * devices, size % devices
            fix = (f"use a batch_size that is a multiple of {devices}: {lower} or {lower + devices}."
                   if which == "first" else
                   f"give fit() {over} example{'s' if over > 1 else ''} fewer, or a batch_size whose last batch "
                   f"is a multiple of {devices}.")
            report.problems.append(Problem(
                "replicas", f"The {which} batch of an epoch holds {size} examples, which "
                f"{type(distribution).__name__} over {devices} devices cannot share in equal parts (JAX shards "
                "each batch evenly): fit() fails on it.", fix))
            return


FIT_DATA = JaxData()


def inspect_data(x, y=None, sample_weight=None, batch_size=None, model=None, validation_split=0.0,
                 steps_per_epoch=None, class_weight=None):
    """Describes the batches Keras' JAX fit() would hand train_step, and checks them against a model.

    Takes the arguments as `fit()` takes them. Arrays are batched by Keras'
    own slicing (float arrays arrive as the backend's float type). A
    generator is read once, for its first batch: give fit() a fresh one.
    A PyDataset is asked for its first and last batches.

    Args:
        x: NumPy arrays (or a list or dict of them), a
            `keras.utils.PyDataset` or a generator of batches, as fit()'s `x`
            on JAX (a `tf.data.Dataset` needs TensorFlow, which this backend
            does not import).
        y: array or None, targets (arrays only).
        sample_weight: array or None, one weight per example (arrays only).
        batch_size: int or None, for arrays (fit()'s default is 32).
        model: keras.Model or None; when given, the first batch runs through
            the model and its compiled loss in a `keras.StatelessScope`, which
            keeps every variable as it was (seed generators, moving
            statistics, metrics): a later fit() trains as it would without it.
        validation_split: float in [0, 1), the share of the arrays fit()
            holds out (its last examples).
        steps_per_epoch: int or None, as fit()'s.
        class_weight: dict or None, as fit()'s: each example of the batches
            carries its class's weight as its sample weight; for arrays, the
            report notes the classes of y the dict leaves at 1 and those it
            names that y lacks.

    Returns:
        `DataReport`: `print` it; `report.frame()` lists the leaves,
        `report.problems` the problems, and `report.check()` raises on any.

    Example:

    ```python
    report = lab.inspect_data(x_train, y_train, batch_size=64, model=model)
    report.check()  # raises ValueError naming each problem and its fix
    ```
    """
    return inspect(FIT_DATA, x, y, sample_weight, batch_size, model, validation_split, steps_per_epoch, class_weight)
