"""DataReport: what fit() will hand train_step, checked against a model, on any backend.

`fit()` passes its data through a data adapter that turns arrays, a
`keras.utils.PyDataset`, a generator (and on TensorFlow a
`tf.data.Dataset`) into batches, and hands each batch to `train_step` as
`x`, `(x,)`, `(x, y)` or `(x, y, sample_weight)`. Mistakes in the data
surface only later, as a shape error deep inside the first layer or the
loss. `inspect` batches the data the way fit() does (through the backend's
`Feed`), describes the first batch, counts the batches of an epoch, and,
given a model, runs the model and its compiled loss on that one batch
(`lab.batch_check`) and names the problem and its fix.

What differs between backends (the data forms, how an array is counted and
sliced, what fit() refuses, the words of a fix) is a `FitData` each
backend's `data_check` module makes; this module imports no backend.
"""

import math
import numbers

import keras
import numpy as np
import pandas as pd

from lab.arguments import check_class_weight, check_number
from lab.batch_check import check_against_model
from lab.data_rules import FORMAT, ClassWeightError, Problem, list_problem

PARTS = ("x", "y", "sample_weight")


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
            for part, value in named_parts(self.batch):
                for path, leaf in leaves(value, part):
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


class FitData:
    """How fit() takes data on one backend, as `inspect` asks it; each
    backend's `data_check` module makes one, overriding what differs there.

    Attributes:
        feed: the backend's `Feed` class, which batches data as its fit() does.
        not_an_array_fix: str, the fix for x or y that is no array.
        strings_fix: str, the fix for arrays of a dtype fit() refuses (strings).
        unbatched_fix: str, the fix for data that yields single examples.
        unbatched_x_fix: str, the same where the model's input shape shows it.
    """

    feed = None
    not_an_array_fix = "pass numpy arrays (np.asarray(...)), a PyDataset or a generator."
    strings_fix = ("map strings to numbers before fit() (e.g. indices into a vocabulary); give other values "
                   "as numbers (np.asarray(array, 'float32')).")
    unbatched_fix = "make the PyDataset or generator yield batches: fit() does not batch them."
    unbatched_x_fix = unbatched_fix

    def form(self, x):
        """The data form of fit()'s `x`: "PyDataset", "generator" or "arrays"."""
        if isinstance(x, keras.utils.PyDataset):
            return "PyDataset"
        if hasattr(x, "__next__"):
            return "generator"
        return "arrays"

    def rank(self, leaf):
        """The number of axes of an array leaf."""
        return len(np.shape(leaf))

    def sample_count(self, leaf):
        """The number of samples (rows) of an array leaf."""
        return len(leaf)

    def head(self, leaf, count):
        """The first `count` samples of an array leaf, as fit()'s validation split keeps them."""
        return np.asarray(leaf)[:count]

    def refused(self, leaf):
        """What fit() says of an array leaf it refuses (its dtype), or None."""
        return None

    def reading(self, report, x):
        """The data to read batches from for `x` (not arrays); None where
        reading it failed (the problem is in the report)."""
        return x

    def count_batches(self, report, x, steps_per_epoch):
        """Counts the batches of a form the shared code does not know; False
        where counting them failed (the problem is in the report)."""
        return True

    def check_distribution(self, report, model):
        """Adds a problem where the devices the model trains on cannot share its first batch."""

    def check_batch_sizes(self, report):
        """Adds a problem where the devices training runs on cannot share a batch of the sizes counted."""

    def is_tensor(self, value):
        """Whether a model's output is one tensor of the backend."""
        return keras.ops.is_tensor(value)


def inspect(fit_data, x, y=None, sample_weight=None, batch_size=None, model=None, validation_split=0.0,
            steps_per_epoch=None, class_weight=None):
    """`inspect_data` on the backend `fit_data` describes: its arguments are
    checked where given, then a `DataReport` of the batches fit() hands
    train_step, checked against `model` where given."""
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
    report = DataReport(fit_data.form(x))
    if report.form != "arrays":
        _check_adapter_arguments(report, y, sample_weight, batch_size, validation_split)
        x = data = fit_data.reading(report, x)
        if x is None:
            return report
    else:
        data = _training_arrays(fit_data, report, x, y, sample_weight, validation_split)
        if data is None:
            return report
        if class_weight is not None:
            _note_class_weights(report, data, class_weight)
    try:
        first = fit_data.feed(data, batch_size=batch_size, shuffle=False, class_weight=class_weight).next()
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
    if check_structure(fit_data, report) and model is not None and report.ok:
        check_against_model(fit_data, report, model)
        fit_data.check_distribution(report, model)
    if not any(problem.kind in ("structure", "unbatched") for problem in report.problems):
        _count_batches(fit_data, report, x, data, batch_size, steps_per_epoch)
        fit_data.check_batch_sizes(report)
    return report


# ---- arrays -----------------------------------------------------------------


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


def _training_arrays(fit_data, report, x, y, sample_weight, validation_split):
    """(x, y, sample_weight) as fit() trains on them: after the validation split."""
    data = tuple(part for part in (x, y, sample_weight) if part is not None)
    if y is None and sample_weight is not None:
        report.problems.append(Problem("structure", "sample_weight was given without y.",
                                       "pass the targets too: fit(x, y, sample_weight=w)."))
        return None
    if _weights_unlike_y(report, y, sample_weight):
        return None
    lengths = {}
    for name, part in zip(PARTS, data):
        listed = list_problem(name, part)
        if listed is not None:
            report.problems.append(listed)
            return None
        for path, leaf in leaves(part, name):
            if not hasattr(leaf, "shape") or not fit_data.rank(leaf):
                report.problems.append(Problem(
                    "data form", f"{path} is a {type(leaf).__name__}, not an array with one row per example.",
                    fit_data.not_an_array_fix))
                return None
            lengths[path] = fit_data.sample_count(leaf)
            refused = fit_data.refused(leaf)
            if refused is not None:
                report.problems.append(Problem(
                    "dtype", f"{path} is an array of dtype {getattr(leaf, 'dtype', '?')}, which fit() refuses "
                    f"(Keras {keras.__version__}: {refused}).", fit_data.strings_fix))
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
        data = keras.tree.map_structure(lambda a: fit_data.head(a, split_at), data)
    return data


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


# ---- counts -----------------------------------------------------------------


def _count_batches(fit_data, report, x, data, batch_size, steps_per_epoch):
    report.batch_size = batch_size_of(report.batch)
    if report.form == "arrays":
        count = fit_data.sample_count(leaves(data[0], "x")[0][1])
        size = 32 if batch_size is None else int(batch_size)
        report.batches_per_epoch = -(-count // size)
        report.last_batch_size = count - size * (report.batches_per_epoch - 1)
    elif report.form == "PyDataset":
        report.batches_per_epoch = x.num_batches
        if report.batches_per_epoch:
            last = x[report.batches_per_epoch - 1]
            report.last_batch_size = batch_size_of(tuple(last) if isinstance(last, list) else last)
    elif not fit_data.count_batches(report, x, steps_per_epoch):
        return
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


def batch_size_of(batch):
    """The number of examples in a batch (its first leaf of x), or None where unknown."""
    x = batch[0] if isinstance(batch, tuple) else batch
    found = leaves(x, "x")
    shape = found[0][1].shape if found else ()
    return int(shape[0]) if len(shape) and shape[0] is not None else None



# ---- structure --------------------------------------------------------------


def check_structure(fit_data, report):
    """Names the structure of `report.batch` in the report; False (with a
    problem) where it is no batch fit() takes."""
    batch = report.batch
    if isinstance(batch, tuple) and not 1 <= len(batch) <= 3:
        report.problems.append(Problem(
            "structure", f"Each batch is a {len(batch)}-tuple; {FORMAT}.",
            "yield (x, y) or (x, y, sample_weight); put several inputs together as x: "
            "((x1, x2), y) or ({'name1': x1, 'name2': x2}, y)."))
        report.batch = None
        return False
    report.structure = ("x" if not isinstance(batch, tuple) else
                        "(" + ", ".join(PARTS[:len(batch)]) + ("," if len(batch) == 1 else "") + ")")
    y = batch[1] if isinstance(batch, tuple) and len(batch) > 1 else None
    if y is not None and report.form != "arrays" and any(len(leaf.shape) == 0 for _, leaf in leaves(y, "y")):
        report.problems.append(Problem(
            "unbatched", "The data yields single examples (y is a scalar), not batches.", fit_data.unbatched_fix))
    return True


def named_parts(batch):
    """(part, value) pairs of a batch: ("x", x), ("y", y), ("sample_weight", w)."""
    if isinstance(batch, tuple):
        return list(zip(PARTS, batch))
    return [("x", batch)]


def leaves(value, path):
    """(path, leaf) pairs of a nested structure, e.g. ("x['pixels']", array)."""
    if value is None:
        return []
    if isinstance(value, dict):
        return [pair for key in value for pair in leaves(value[key], f"{path}[{key!r}]")]
    if isinstance(value, (list, tuple)):
        return [pair for i, item in enumerate(value) for pair in leaves(item, f"{path}[{i}]")]
    return [(path, value)]
