"""inspect_data: what fit() will hand train_step, checked against a model.

`fit()` passes its data through a data adapter that turns arrays, a
`tf.data.Dataset`, a `keras.utils.PyDataset` or a generator into batches, and
hands each batch to `train_step` as `x`, `(x,)`, `(x, y)` or
`(x, y, sample_weight)`. Mistakes in the data surface only later, as a shape
error deep inside the first layer or the loss. `inspect_data` batches the data
the way fit() does (through the Stepper's `Feed`), describes the first batch,
counts the batches of an epoch, and, given a model, runs the model and its
compiled loss on that one batch and names the problem and its fix.
"""

import difflib
import math
import numbers

import keras
import numpy as np
import pandas as pd
import tensorflow as tf

from lab.arguments import check_class_weight, check_number
from lab.data_rules import (FORMAT, Problem, ignore_class_of, is_arrays, labels_out_of_range, list_problem, loss_name,
                             said_at, targets_problem, tuple_problem)
from lab.backend.tensorflow import compat
from lab.backend.tensorflow.compat import error_line, missing_key
from lab.backend.tensorflow.devices import uneven_first_batch
from lab.backend.tensorflow.feed import ClassWeightError, Feed, read_through, reading_copy, row_slice, sample_count


_PARTS = ("x", "y", "sample_weight")


class DataReport:
    """What train_step receives for one data form; returned by `inspect_data`.

    Attributes:
        form: str, the data form ("arrays", "tf.data.Dataset", "PyDataset",
            "generator").
        structure: str or None, the first batch as train_step gets it, e.g.
            "(x, y)" or "x".
        batch: the first batch (tensors) or None.
        batch_size: int or None, examples in the first batch.
        batches_per_epoch: int or None, where knowable.
        last_batch_size: int or None, where knowable.
        notes: list of str, what fit() does with this form that may surprise.
        problems: list of `Problem`.
    """

    def __init__(self, form):
        self.form = form
        self.structure = None
        self.batch = None
        self.batch_size = None
        self.batches_per_epoch = None
        self.last_batch_size = None
        self.notes = []
        self.problems = []

    @property
    def ok(self):
        """bool, True when no problem was found."""
        return not self.problems

    def frame(self):
        """The first batch's leaves: DataFrame with `part`, `path`, `shape`, `dtype`."""
        rows = []
        if self.batch is not None:
            for part, value in _named_parts(self.batch):
                for path, leaf in _leaves(value, part):
                    rows.append({"part": part, "path": path, "shape": tuple(leaf.shape),
                                 "dtype": leaf.dtype.name if hasattr(leaf.dtype, "name") else str(leaf.dtype)})
        return pd.DataFrame(rows, columns=["part", "path", "shape", "dtype"])

    def batch_sizes(self):
        """Examples per batch over one epoch (every batch full but the last), or None."""
        if self.batches_per_epoch is None or self.batch_size is None or self.last_batch_size is None:
            return None
        sizes = np.full(self.batches_per_epoch, self.batch_size, np.int64)
        sizes[-1] = self.last_batch_size
        return sizes

    def check(self):
        """Raises `ValueError` naming every problem and its fix; returns the report if none."""
        if self.problems:
            lines = [f"- {p.message} Fix: {p.fix}" for p in self.problems]
            raise ValueError(f"The {self.form} will not train as given:\n" + "\n".join(lines))
        return self

    def __repr__(self):
        lines = [f"DataReport: {self.form}"]
        if self.structure is not None:
            lines.append(f"  train_step receives {self.structure}")
            for row in self.frame().itertuples():
                lines.append(f"    {row.path:<24} shape {str(row.shape):<14} {row.dtype}")
        count = "?" if self.batches_per_epoch is None else self.batches_per_epoch
        last = "?" if self.last_batch_size is None else self.last_batch_size
        first = "?" if self.batch_size is None else self.batch_size
        lines.append(f"  batches per epoch: {count} (first of {first}, last of {last})")
        lines += [f"  note: {note}" for note in self.notes]
        for problem in self.problems:
            lines += [f"  problem ({problem.kind}): {problem.message}", f"    fix: {problem.fix}"]
        if self.ok:
            lines.append("  no problem found")
        return "\n".join(lines)


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
    for argument, value in (("batch_size", batch_size), ("steps_per_epoch", steps_per_epoch)):
        if value is not None:
            check_number("lab.inspect_data", argument, value, numbers.Integral, lambda v: v >= 1,
                         "a whole number, 1 or more, or None", "32")
    check_number("lab.inspect_data", "validation_split", validation_split, numbers.Real, lambda v: 0 <= v < 1,
                 "a share of the examples in [0, 1)", "0.2: the last 20% are held out")
    check_class_weight("lab.inspect_data", class_weight)
    if model is not None and not isinstance(model, keras.Model):
        raise TypeError(f"lab.inspect_data(model=...) must be a keras.Model or None; got {type(model).__name__} "
                        f"(e.g. lab.inspect_data(x, y, model=model)).")
    report = DataReport(_form(x))
    if report.form != "arrays":
        _check_adapter_arguments(report, y, sample_weight, batch_size, validation_split)
        data = x
    else:
        data = _training_arrays(report, x, y, sample_weight, validation_split)
        if data is None:
            return report
        if class_weight is not None:
            _note_class_weights(report, data, class_weight)
    if report.form == "tf.data.Dataset":
        x = data = _reading_copy(report, x)
        if x is None:
            return report
    try:
        first = Feed(data, batch_size=batch_size, shuffle=False, class_weight=class_weight).next()
    except ClassWeightError as error:
        report.problems.append(Problem("class_weight", str(error),
                                       "give fit() class_weight or sample weights, not both; with several outputs, "
                                       "or a generator, each example's weight as its sample weight."))
        return report
    except ValueError as error:
        report.problems.append(Problem("data", str(error), "give fit() data it can batch."))
        return report
    except TypeError as error:
        report.problems.append(Problem("data form", str(error), "convert the data to one of these forms."))
        return report
    report.batch = first.data
    if report.form == "generator":
        report.notes.append("inspect_data took the generator's first batch: give fit() a fresh generator.")
    if _check_structure(report) and model is not None and report.ok:
        _check_against_model(report, model)
        _check_replicas(report, model)
    if not any(problem.kind in ("structure", "unbatched") for problem in report.problems):
        _count_batches(report, x, data, batch_size, steps_per_epoch)
    return report


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
    if not is_arrays(data) or _form(data) != "arrays":  # the Feed names what is no data (None, a str)
        return
    problem = tuple_problem(data)
    if problem is None:
        x, y, sample_weight = (tuple(data) + (None, None))[:3] if isinstance(data, tuple) else (data, None, None)
        report = inspect_data(x, y, sample_weight, batch_size=batch_size)
        if report.ok and report.batch is not None:
            if _check_inputs(report, model, keras.utils.unpack_x_y_sample_weight(report.batch)[0]):
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
        if _check_structure(report):
            _check_against_model(report, model)
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


def _check_replicas(report, model):
    """A first batch the replicas of the model's strategy cannot share evenly: fit() fails on it."""
    leaves = [leaf for leaf in tf.nest.flatten(report.batch) if leaf is not None and len(leaf.shape)]
    if not leaves:
        return
    uneven = uneven_first_batch(model.distribute_strategy, sample_count(leaves[0]))
    if uneven is not None:
        report.problems.append(Problem("replicas", *uneven))


# ---- data forms and counts --------------------------------------------------


def _form(x):
    if isinstance(x, tf.data.Dataset):
        return "tf.data.Dataset"
    if isinstance(x, keras.utils.PyDataset):
        return "PyDataset"
    if hasattr(x, "__next__"):
        return "generator"
    return "arrays"


def _check_adapter_arguments(report, y, sample_weight, batch_size, validation_split):
    for name, value in (("y", y), ("sample_weight", sample_weight)):
        if value is not None:
            report.problems.append(Problem(
                "structure", f"{name} was given separately, but a {report.form} brings its own.",
                f"yield (x, y) or (x, y, sample_weight) from the {report.form} and leave {name}=None."))
    if validation_split:
        report.problems.append(Problem(
            "validation", f"validation_split works only with arrays, not with a {report.form}.",
            "pass validation_data=... with held-out data instead."))
    if batch_size is not None:
        if report.form == "tf.data.Dataset":
            fix = f"batch the dataset yourself: dataset.batch({int(batch_size)})."
        else:
            fix = f"make the {report.form} yield batches of {int(batch_size)}."
        report.notes.append(f"batch_size={int(batch_size)} is not used: a {report.form} yields "
                            f"its own batches; {fix}")


def _training_arrays(report, x, y, sample_weight, validation_split):
    """(x, y, sample_weight) as fit() trains on them: after the validation split."""
    data = tuple(part for part in (x, y, sample_weight) if part is not None)
    if y is None and sample_weight is not None:
        report.problems.append(Problem("structure", "sample_weight was given without y.",
                                       "pass the targets too: fit(x, y, sample_weight=w)."))
        return None
    if _weights_unlike_y(report, y, sample_weight):
        return None
    lengths = {}
    for name, part in zip(_PARTS, data):
        listed = list_problem(name, part)
        if listed is not None:
            report.problems.append(listed)
            return None
        for path, leaf in _leaves(part, name):
            if not hasattr(leaf, "shape") or not len(leaf.shape if tf.is_tensor(leaf) else np.shape(leaf)):
                report.problems.append(Problem(
                    "data form", f"{path} is a {type(leaf).__name__}, not an array with one row per example.",
                    "pass numpy arrays (np.asarray(...)), a tf.data.Dataset, a PyDataset or a generator."))
                return None
            lengths[path] = sample_count(leaf)
            refused = _refused_by_keras(leaf)
            if refused is not None:
                report.problems.append(Problem(
                    "dtype", f"{path} is an array of dtype {getattr(leaf, 'dtype', '?')}, which fit() refuses "
                    f"(Keras {keras.__version__}: {refused}).",
                    "give strings as a tf.Tensor (tf.constant(array)) or through a tf.data.Dataset; "
                    "other values as numbers (np.asarray(array, 'float32'))."))
                return None
    if len(set(lengths.values())) > 1:
        described = ", ".join(f"{path} has {n}" for path, n in lengths.items())
        report.problems.append(Problem(
            "length", f"x and y differ in length ({described} examples).",
            "give every array one row per example, the same number of rows (take x and y from "
            "the same split, and apply any filter or slice to both)."))
        return None
    if validation_split:
        count = next(iter(lengths.values()))
        split_at = int(math.floor(count * (1.0 - validation_split)))
        report.notes.append(f"validation_split={validation_split} holds out the last {count - split_at} "
                            f"of {count} examples (before any shuffle); {split_at} remain for training.")
        data = keras.tree.map_structure(
            lambda a: row_slice(a if isinstance(a, tf.SparseTensor) else np.asarray(a), 0, split_at), data)
    return data


def _refused_by_keras(leaf):
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


def _note_class_weights(report, data, class_weight):
    """The classes of the training arrays' y that class_weight leaves at 1, and those it names that y lacks."""
    if len(data) != 2 or keras.tree.is_nested(data[1]):
        return  # the Feed refuses these, with fit()'s reason
    y = np.asarray(data[1])
    if y.ndim > 1:
        y = np.argmax(y, axis=-1) if y.shape[-1] != 1 else np.squeeze(y, axis=-1)
    classes, counts = np.unique(np.round(y).astype("int64"), return_counts=True)
    unweighted = [f"{c} ({n} examples)" for c, n in zip(classes, counts) if int(c) not in class_weight]
    if unweighted:
        report.notes.append(f"class_weight gives no weight to class {', '.join(unweighted)}: fit() weighs "
                            "those examples 1.0.")
    present = {int(c) for c in classes}
    absent = sorted(int(key) for key in class_weight if key not in present)
    if absent:
        report.notes.append(f"class_weight weighs class {', '.join(map(str, absent))}, which no training example "
                            "has: check the class indices (y holds {}).".format(
                                ", ".join(map(str, classes[:10])) + (", ..." if len(classes) > 10 else "")))


def _weights_unlike_y(report, y, sample_weight):
    """fit()'s array adapter takes per-output sample weights only in y's structure."""
    if not keras.tree.is_nested(y) or not isinstance(sample_weight, (list, tuple, dict)):
        return False
    try:
        keras.tree.assert_same_structure(y, sample_weight)
        return False
    except ValueError:
        pass
    missing = [key for key in y if key not in sample_weight] if isinstance(y, dict) else []
    if missing and isinstance(sample_weight, dict):
        message = (f"sample_weight has no key {missing[0]!r} (its keys are {sorted(sample_weight, key=str)}), "
                   f"but y has keys {sorted(y, key=str)}")
    else:
        message = f"sample_weight is {_container(sample_weight)}, but y is {_container(y)}"
    like_y = ("{" + ", ".join(f"{key!r}: ..." for key in y) + "}" if isinstance(y, dict) else
              f"a {type(y).__name__} of {len(y)} arrays")
    report.problems.append(Problem(
        "sample_weight", f"{message}: fit() takes one sample-weight array per output, in y's structure.",
        f"give sample_weight the structure of y: {like_y} (or a single array, used for every output)."))
    return True


def _container(value):
    if isinstance(value, dict):
        return f"a dict with keys {sorted(value, key=str)}"
    return f"a {type(value).__name__} of {len(value)}"


def _count_batches(report, x, data, batch_size, steps_per_epoch):
    report.batch_size = _size(report.batch)
    if report.form == "arrays":
        count = sample_count(_leaves(data[0], "x")[0][1])
        size = 32 if batch_size is None else int(batch_size)
        report.batches_per_epoch = -(-count // size)
        report.last_batch_size = count - size * (report.batches_per_epoch - 1)
    elif report.form == "PyDataset":
        report.batches_per_epoch = x.num_batches
        if report.batches_per_epoch:
            last = x[report.batches_per_epoch - 1]
            report.last_batch_size = _size(tuple(last) if isinstance(last, list) else last)
    elif report.form == "tf.data.Dataset":
        cardinality = int(x.cardinality())
        if cardinality == tf.data.INFINITE_CARDINALITY and steps_per_epoch is None:
            report.problems.append(Problem(
                "epoch length", "The dataset repeats forever, so an epoch would never end.",
                "pass steps_per_epoch=... to fit(), or drop the .repeat()."))
        elif cardinality >= 0:
            report.batches_per_epoch = cardinality
            try:
                last = next(iter(x.skip(cardinality - 1).take(1)), None)
            except tf.errors.OpError as error:  # a length asserted wrong (assert_cardinality)
                report.problems.append(Problem("data", f"reading the last batch failed: {error_line(error)}",
                                               "fix the pipeline: fit() stops with the same error."))
                return
            if last is not None:
                report.last_batch_size = _size(last)
        elif cardinality == tf.data.UNKNOWN_CARDINALITY and steps_per_epoch is None:
            report.notes.append("the dataset's length is unknown to TensorFlow (from_generator, filter, ...): "
                                "fit() ends each epoch with a call that finds no batch, yet counts an optimizer "
                                "step (iterations, seed generators) there; give it its length with "
                                "dataset.apply(tf.data.experimental.assert_cardinality(batches)).")
    if steps_per_epoch is not None:
        steps = int(steps_per_epoch)
        known = report.batches_per_epoch
        if known is not None and steps > known:
            report.notes.append(f"steps_per_epoch={steps} asks for more batches than the {known} the data "
                                "holds: fit() stops with 'Your input ran out of data'.")
            return
        if known is None or steps < known:
            report.last_batch_size = report.batch_size
        report.batches_per_epoch = steps
    elif report.form == "generator":
        report.notes.append("a generator's length is unknown: one epoch runs until it is exhausted, "
                            "and the next finds little or nothing left; pass steps_per_epoch=... and make it "
                            "yield forever (or use a PyDataset).")


def _size(batch):
    x = batch[0] if isinstance(batch, tuple) else batch
    leaves = _leaves(x, "x")
    shape = leaves[0][1].shape if leaves else ()
    return int(shape[0]) if len(shape) and shape[0] is not None else None


# ---- structure --------------------------------------------------------------


def _check_structure(report):
    batch = report.batch
    if isinstance(batch, tuple) and not 1 <= len(batch) <= 3:
        report.problems.append(Problem(
            "structure", f"Each batch is a {len(batch)}-tuple; {FORMAT}.",
            "yield (x, y) or (x, y, sample_weight); put several inputs together as x: "
            "((x1, x2), y) or ({'name1': x1, 'name2': x2}, y)."))
        report.batch = None
        return False
    report.structure = ("x" if not isinstance(batch, tuple) else
                        "(" + ", ".join(_PARTS[:len(batch)]) + ("," if len(batch) == 1 else "") + ")")
    y = batch[1] if isinstance(batch, tuple) and len(batch) > 1 else None
    if y is not None and report.form != "arrays" and any(len(leaf.shape) == 0 for _, leaf in _leaves(y, "y")):
        report.problems.append(Problem(
            "unbatched", "The data yields single examples (y is a scalar), not batches.",
            "batch it: dataset.batch(32)."))
    return True


def _named_parts(batch):
    if isinstance(batch, tuple):
        return list(zip(_PARTS, batch))
    return [("x", batch)]


def _leaves(value, path):
    """(path, leaf) pairs of a nested structure, e.g. ("x['pixels']", array)."""
    if value is None:
        return []
    if isinstance(value, dict):
        return [pair for key in value for pair in _leaves(value[key], f"{path}[{key!r}]")]
    if isinstance(value, (list, tuple)):
        return [pair for i, item in enumerate(value) for pair in _leaves(item, f"{path}[{i}]")]
    return [(path, value)]


# ---- against a model --------------------------------------------------------


def _check_against_model(report, model):
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(report.batch)
    if not _check_inputs(report, model, x):
        return
    # Inside a StatelessScope Keras keeps every variable update (seed generators,
    # moving statistics, loss trackers) in the scope, even when the call raises,
    # and gives variables the call creates (an unbuilt model's) their initial
    # values on the way out: fit() later starts from exactly the state it would
    # have had without inspect_data. The scope also collects the losses layers
    # add, which compute_loss reads.
    with keras.StatelessScope(collect_losses=True):
        try:
            y_pred = model(x, training=False)
        except Exception as error:  # the model's own message, whatever its type
            report.problems.append(_call_problem(error, x))
            return
        if y is None or not getattr(model, "compiled", False) or getattr(model, "loss", None) is None:
            return
        _check_loss(report, model, x, y, y_pred, sample_weight)


def _call_problem(error, x):
    found, key = missing_key(error)
    if found and isinstance(x, dict) and key not in x:
        keys = sorted(x, key=str)
        close = difflib.get_close_matches(str(key), [str(k) for k in keys], n=1)
        fix = (f"rename x[{close[0]!r}] to x[{key!r}], or make call() read the keys x has." if close else
               f"give x the key {key!r} that call() reads, or make call() read the keys x has.")
        return Problem("input names", f"The model's call() reads x[{key!r}], but x has no key {key!r} "
                       f"(its keys are {keys}).", fix)
    return Problem("input", f"The model cannot take x: {error_line(error)}",
                   "give x the structure and shapes the model's call() expects, or change the model.")


def _check_inputs(report, model, x):
    names, inputs = _model_inputs(model)
    if not inputs:
        return True
    if isinstance(x, dict):
        missing = [name for name in names if name not in x]
        if missing:
            keys = ", ".join(f"{name!r}: ..." for name in names)
            report.problems.append(Problem(
                "input names", f"x is a dict with keys {sorted(x)}, but the model's inputs are named {names}.",
                f"name the keys after the model's inputs (keras.Input(name=...)): {{{keys}}}."))
            return False
        leaves = [x[name] for name in names]
    else:
        leaves = keras.tree.flatten(x)
        if len(leaves) != len(inputs):
            report.problems.append(Problem(
                "inputs", f"x holds {len(leaves)} arrays, but the model has {len(inputs)} inputs {names}.",
                "give x one array per model input, as a tuple in input order or a dict by input name."))
            return False
    for name, tensor, leaf in zip(names, inputs, leaves):
        # Keras numbers unnamed inputs ("keras_tensor_7"): name only what the user named.
        name = "" if name.startswith("keras_tensor") else f" {name!r}"
        expected, got = tuple(tensor.shape), tuple(leaf.shape)
        if _takes(expected, got):
            continue
        if len(got) == len(expected) - 1 and _fits(expected[1:], got):
            report.problems.append(Problem(
                "unbatched", f"x is one example of shape {got}, but the model's input{name} takes "
                f"batches of shape {expected}.",
                "batch the data: dataset.batch(32) (a tf.data.Dataset is not batched by fit())."))
        else:
            report.problems.append(Problem(
                "input shape", f"x has shape {got} per batch, but the model's input{name} takes {expected}.",
                f"reshape x to {_without_batch(expected)} per example (x.reshape(len(x), ...)), or build "
                f"the model with keras.Input(shape={got[1:]})."))
        return False
    return True


def _model_inputs(model):
    """(names, input tensors) the way a functional model matches a dict x to its inputs."""
    try:
        inputs = list(model.inputs or [])
        structure = model.input
    except (AttributeError, ValueError):
        return [], []
    if isinstance(structure, dict) and all(isinstance(v, keras.KerasTensor) for v in structure.values()):
        # A model built on a dict of Inputs takes x by the dict's keys, not the Inputs' names.
        names = sorted(structure)
        return names, [structure[name] for name in names]
    return [tensor.name for tensor in inputs], inputs


def _takes(expected, got):
    """Keras' own rule for a functional model's input shape (3.5 to 3.15 alike).

    From keras/src/models/functional.py, `input_spec` (with
    `allow_last_axis_squeeze`) then `_adjust_input_rank`: the spec compares
    the shapes after dropping one trailing 1 from each; then, where the ranks
    differ by one, the model squeezes a trailing 1 from x or adds one where
    its input ends in 1.
    """
    spec = expected[:-1] if expected and expected[-1] == 1 else expected
    shape = got[:-1] if got and got[-1] == 1 else got
    if any(e is not None and g is not None and e != g for e, g in zip(spec, shape)):
        return False
    return (len(got) == len(expected) or (len(got) == len(expected) + 1 and got[-1] == 1)
            or (len(got) == len(expected) - 1 and expected[-1] == 1))


def _fits(expected, got):
    return len(expected) == len(got) and all(e is None or e == g for e, g in zip(expected, got))


def _without_batch(shape):
    return tuple(shape[1:])


def _check_loss(report, model, x, y, y_pred, sample_weight):
    name = loss_name(model.loss)
    if not tf.is_tensor(y_pred) or isinstance(y, (dict, list, tuple)):
        single = None
    else:
        single = (tuple(y.shape), tuple(y_pred.shape))
    try:
        model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=False)
        error = None
    except Exception as caught:  # the loss's own message, whatever its type
        error = caught
    if single is None or (error is not None and missing_key(error)[0]):
        if error is not None:
            report.problems.append(_loss_problem(error, model, y, y_pred, sample_weight))
        return
    y_shape, out_shape = single
    sparse = "sparse" in name
    categorical = "categorical" in name and not sparse
    labels = labels_out_of_range(name, y, out_shape, ignore_class_of(model.loss))
    if labels is not None:
        report.problems.append(labels)
    elif sparse and len(y_shape) == len(out_shape) and y_shape[-1] == out_shape[-1] and y_shape[-1] != 1:
        report.problems.append(Problem(
            "labels", f"y is one-hot (shape {y_shape}), but {name} takes integer labels.",
            "use loss='categorical_crossentropy' for one-hot rows, or pass integer labels: y.argmax(-1)."))
    elif categorical and len(y_shape) == len(out_shape) - 1:
        report.problems.append(Problem(
            "labels", f"y holds integer labels (shape {y_shape}), but {name} takes one-hot rows "
            f"like the output {out_shape}.",
            "use loss='sparse_categorical_crossentropy' for integer labels, or one-hot them: "
            f"keras.utils.to_categorical(y, {out_shape[-1]})."))
    elif error is not None or (not sparse and _broadcasts(y_shape, out_shape)):
        why = f": {error_line(error)}" if error is not None else " (the loss would broadcast them)"
        report.problems.append(Problem(
            "target shape", f"y has shape {y_shape} per batch, the model outputs {out_shape}, and "
            f"{name} cannot compare them{why}.",
            f"give y the output's shape {_without_batch(out_shape)} per example, or change the model's "
            "last layer or the loss."))


def _loss_problem(error, model, y, y_pred, sample_weight):
    found, key = missing_key(error)
    for part, value in (("sample_weight", sample_weight), ("y", y)):
        if found and _lacks(value, key):
            return _key_problem(part, value, key, model, y, y_pred)
    return Problem("loss", f"The loss fails on this batch: {error_line(error)}",
                   "give y the structure and shapes of the model's outputs.")


def _lacks(value, key):
    if isinstance(value, dict):
        return key not in value
    if isinstance(value, (list, tuple)):
        return not isinstance(key, int) or not -len(value) <= key < len(value)
    return False


def _key_problem(part, value, key, model, y, y_pred):
    """The loss looks up y or sample_weight by the model's outputs: by name or by position."""
    have = f"its keys are {sorted(value, key=str)}" if isinstance(value, dict) else f"it is a list of {len(value)}"
    if isinstance(y_pred, dict):
        names = list(y_pred)
        keys = ", ".join(f"{name!r}: ..." for name in names)
        return Problem("loss", f"{part} has no key {key!r} ({have}), and the loss looks {part} up by the "
                       f"model's output names {names}.",
                       f"key {part} by the model's output names: {{{keys}}}.")
    names = list(getattr(model, "output_names", None) or range(len(keras.tree.flatten(y_pred))))
    keys = ", ".join(f"{name!r}: ..." for name in names)
    both = " (and y too: fit() takes y and sample_weight in one structure)" if isinstance(y, dict) else ""
    return Problem("loss", f"{part} has no entry {key!r} ({have}): the model's outputs are a list "
                   f"({names}), and the loss looks {part} up by position.",
                   f"give {part} as a list in the order of the model's outputs{both}, or build the model "
                   f"with named outputs: keras.Model(inputs, {{{keys}}}).")


def _broadcasts(y_shape, out_shape):
    """True when y and the output differ in shape beyond a trailing 1 that Keras squeezes."""
    squeeze = lambda shape: shape[:-1] if len(shape) > 1 and shape[-1] == 1 else shape  # noqa: E731
    return squeeze(y_shape) != squeeze(out_shape)
