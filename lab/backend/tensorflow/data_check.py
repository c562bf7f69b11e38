"""inspect_data on TensorFlow: what fit() will hand train_step, checked against a model.

The report, its checks and the model's run on the first batch know no
backend (`lab.data_report`, `lab.batch_check`); what is TensorFlow's is
here: the `tf.data.Dataset` form (read through a copy of its pipeline, its
batches counted from its cardinality), tensors and `tf.SparseTensor`s
among the arrays, what fit()'s array adapter refuses, and a first batch the
replicas of a `tf.distribute` strategy cannot share. The Stepper and
`compare_modes` check the data they are given here too (`check_arrays_for`,
`problem_with_batch`).
"""

import keras
import numpy as np
import tensorflow as tf

from lab.backend.tensorflow import compat
from lab.backend.tensorflow.compat import error_line
from lab.backend.tensorflow.devices import uneven_first_batch
from lab.backend.tensorflow.feed import Feed, read_through, reading_copy, row_slice, sample_count
from lab.batch_check import check_against_model, check_inputs
from lab.data_report import DataReport, FitData, batch_size_of, check_structure, inspect
from lab.data_rules import Problem, is_arrays, said_at, targets_problem, tuple_problem


class TensorFlowData(FitData):
    """How fit() takes data on TensorFlow: a `tf.data.Dataset` too, tensors among the arrays."""

    feed = Feed
    not_an_array_fix = "pass numpy arrays (np.asarray(...)), a tf.data.Dataset, a PyDataset or a generator."
    strings_fix = ("give strings as a tf.Tensor (tf.constant(array)) or through a tf.data.Dataset; "
                   "other values as numbers (np.asarray(array, 'float32')).")
    unbatched_fix = "batch it: dataset.batch(32)."
    unbatched_x_fix = "batch the data: dataset.batch(32) (a tf.data.Dataset is not batched by fit())."

    def form(self, x):
        return "tf.data.Dataset" if isinstance(x, tf.data.Dataset) else super().form(x)

    def rank(self, leaf):
        return len(leaf.shape if tf.is_tensor(leaf) else np.shape(leaf))

    def sample_count(self, leaf):
        return sample_count(leaf)

    def head(self, leaf, count):
        return row_slice(leaf if isinstance(leaf, tf.SparseTensor) else np.asarray(leaf), 0, count)

    def refused(self, leaf):
        """What fit()'s array adapter says of an array it cannot take (NumPy
        strings: "Invalid dtype: str160"), tried on its first rows; None if it takes it."""
        if tf.is_tensor(leaf) or isinstance(leaf, tf.SparseTensor) or (
                isinstance(leaf, np.ndarray) and leaf.dtype.kind in "biuf"):
            return None  # taken as they are (asking Keras costs a tenth of a second a leaf)
        try:
            compat.array_batches(row_slice(leaf, 0, 2), batch_size=2)
        except ValueError as error:
            return error_line(error)
        return None

    def reading(self, report, x):
        return _reading_copy(report, x) if report.form == "tf.data.Dataset" else x

    def count_batches(self, report, x, steps_per_epoch):
        return _count_dataset(report, x, steps_per_epoch) if report.form == "tf.data.Dataset" else True

    def check_distribution(self, report, model):
        """A first batch the replicas of the model's strategy cannot share evenly: fit() fails on it."""
        leaves = [leaf for leaf in tf.nest.flatten(report.batch) if leaf is not None and len(leaf.shape)]
        if not leaves:
            return
        uneven = uneven_first_batch(model.distribute_strategy, sample_count(leaves[0]))
        if uneven is not None:
            report.problems.append(Problem("replicas", *uneven))

    def is_tensor(self, value):
        return tf.is_tensor(value)


FIT_DATA = TensorFlowData()


def inspect_data(x, y=None, sample_weight=None, batch_size=None, model=None, validation_split=0.0,
                 steps_per_epoch=None, class_weight=None):
    """Describes the batches fit() would hand train_step, and checks them against a model.

    Takes the arguments as `fit()` takes them. A generator is read once: the
    report takes its first batch, so give fit() a fresh generator. A
    `tf.data.Dataset` that shuffles or caches is read through a copy of its
    pipeline with its own shuffle seeds and caches (`feed.reading_copy`):
    fit() then trains on the order and the batches it would have without
    inspect_data (a file cache is written once, as fit()'s first epoch
    would write it).

    Args:
        x: arrays (or a list/dict of arrays), a `tf.data.Dataset`, a
            `keras.utils.PyDataset` or a generator, as fit()'s `x`.
        y: array or None, targets (arrays only).
        sample_weight: array or None, one weight per example (arrays only).
        batch_size: int or None, for arrays (fit()'s default is 32).
        model: keras.Model or None; when given, the first batch is run through
            the model and its compiled loss in a `keras.StatelessScope`: no
            variable of the model changes (seed generators, moving statistics
            and metrics included), so a later fit() trains exactly as without it.
        validation_split: float in [0, 1), share of the arrays fit() holds out
            (the last examples).
        steps_per_epoch: int or None, as fit()'s.
        class_weight: dict or None, as fit()'s: the batches carry each
            example's class weight as its sample weight, as fit() weighs
            them; for arrays, the report notes the classes of y that the
            dict leaves at weight 1 and the classes it names that y lacks.

    Returns:
        `DataReport`: `print` it, `report.frame()` for the leaves,
        `report.problems`, `report.check()` to raise on any problem.

    Example:

    ```python
    report = lab.inspect_data(x_train, y_train, batch_size=32, model=model)
    print(report)
    ```
    """
    return inspect(FIT_DATA, x, y, sample_weight, batch_size, model, validation_split, steps_per_epoch, class_weight)


INSPECT_POINTER = "`lab.inspect_data(x, y, model=model)` shows what fit() hands train_step and checks it."


def check_arrays_for(call, model, data, batch_size=None):
    """Raises a ValueError, at the call that is given `data`, for what fit()
    would refuse or fail on in arrays, found without running the model.

    Checked: the form `(x, y)`, `(x,)`, `(x, y, sample_weight)`; dtypes
    fit() refuses (NumPy strings); lengths; x against a functional model's
    inputs; targets missing where the model's own train_step needs them
    for its compiled loss; integer labels outside a sparse loss's classes
    (`lab.data_rules`). A `tf.data.Dataset`, a PyDataset or a generator is
    checked when a step fails on it (`problem_with_batch`).

    Args:
        call: str, the function given the data ("lab.Stepper").
        model: keras.Model.
        data: what was given: arrays as fit()'s `x`, or a tuple of them.
        batch_size: int or None.
    """
    if not is_arrays(data) or FIT_DATA.form(data) != "arrays":  # the Feed names what is no data (None, a str)
        return
    problem = tuple_problem(data)
    if problem is None:
        x, y, sample_weight = (tuple(data) + (None, None))[:3] if isinstance(data, tuple) else (data, None, None)
        report = inspect_data(x, y, sample_weight, batch_size=batch_size)
        if report.ok and report.batch is not None:
            if check_inputs(FIT_DATA, report, model, keras.utils.unpack_x_y_sample_weight(report.batch)[0]):
                found = targets_problem(model, y)
                report.problems += [found] if found is not None else []
        problem = report.problems[0] if report.problems else None
    if problem is not None:
        raise ValueError(said_at(call, problem, INSPECT_POINTER))


def problem_with_batch(model, x, y=None, sample_weight=None):
    """The first `Problem` fit() would meet in one batch, checked against
    `model` as `inspect_data` checks it (the model run in a
    `keras.StatelessScope`, its state left as it was); None if none is found."""
    try:
        data = tuple(part for part in (x, y, sample_weight) if part is not None)
        if y is None and targets_problem(model, None) is not None:
            return targets_problem(model, None)
        report = DataReport("arrays")
        report.batch = data if len(data) > 1 else data[0]
        if check_structure(FIT_DATA, report):
            check_against_model(FIT_DATA, report, model)
        return report.problems[0] if report.problems else None
    except Exception:  # noqa: BLE001 - a check that fails itself names nothing
        return None


def _reading_copy(report, dataset):
    """`feed.reading_copy(dataset)`, its notes in the report, a file cache
    written through. None where reading it through failed (a problem in the report)."""
    copy, notes, caches = reading_copy(dataset)
    report.notes.extend(notes)
    try:
        if read_through(copy, caches):
            report.notes.append("the dataset caches its elements: inspect_data read it through once, filling the "
                                "cache as fit()'s first epoch would (a first batch alone would leave it half written).")
    except tf.errors.OpError as error:
        report.problems.append(Problem("data", f"reading the dataset through failed: {error_line(error)}",
                                       "fix the pipeline: fit() stops with the same error in its first epoch."))
        return None
    return copy


def _count_dataset(report, dataset, steps_per_epoch):
    """A dataset's batches per epoch and its last batch's size, from its
    cardinality; False where reading its last batch failed (a problem in the report)."""
    cardinality = int(dataset.cardinality())
    if cardinality == tf.data.INFINITE_CARDINALITY and steps_per_epoch is None:
        report.problems.append(Problem(
            "epoch length", "The dataset repeats forever, so an epoch would never end.",
            "pass steps_per_epoch=... to fit(), or drop the .repeat()."))
    elif cardinality >= 0:
        report.batches_per_epoch = cardinality
        try:
            last = next(iter(dataset.skip(cardinality - 1).take(1)), None)
        except tf.errors.OpError as error:  # a length asserted wrong (assert_cardinality)
            report.problems.append(Problem("data", f"reading the last batch failed: {error_line(error)}",
                                           "fix the pipeline: fit() stops with the same error."))
            return False
        if last is not None:
            report.last_batch_size = batch_size_of(last)
    elif cardinality == tf.data.UNKNOWN_CARDINALITY and steps_per_epoch is None:
        report.notes.append("the dataset's length is unknown to TensorFlow (from_generator, filter, ...): "
                            "fit() ends each epoch with a call that finds no batch, yet counts an optimizer "
                            "step (iterations, seed generators) there; give it its length with "
                            "dataset.apply(tf.data.experimental.assert_cardinality(batches)).")
    return True
