"""What fit() fails on, or silently gets wrong, in the arrays it is given, checked on any backend.

Keras' own words for these name neither the input nor the fix ("None is not
a valid value for jnp.array", "Invalid dtype: str32", "Received a label
value of 7 which is outside the valid range of [0, 3)"; on a GPU, and on
JAX, labels out of range give NaN or wrong losses with no error at all).
These rules read only arrays, the model's compiled loss and its declared
output: no backend, no call of the model.
"""

import collections

import keras
import numpy as np

FORMAT = "fit() takes x, (x,), (x, y) or (x, y, sample_weight)"


class Problem(collections.namedtuple("Problem", ["kind", "message", "fix"])):
    """One thing fit() would fail on (or silently get wrong): `kind`, `message`, `fix`."""

    def __str__(self):
        return f"{self.message}\nfix: {self.fix}"


class ClassWeightError(ValueError):
    """Data that fit() refuses to weigh by class_weight: sample weights too, several targets, no targets."""


def tuple_problem(data):
    """A tuple that is no batch fit() takes (`(x, y, sample_weight, extra)`); None for any other data."""
    if isinstance(data, tuple) and not 1 <= len(data) <= 3:
        return Problem("structure", f"data is a tuple of {len(data)}; {FORMAT}.",
                       "pass (x, y) or (x, y, sample_weight); put several inputs together as x: "
                       "((x1, x2), y) or ({'name1': x1, 'name2': x2}, y).")
    return None


def string_problem(path, leaf):
    """NumPy strings, which fit()'s array adapter refuses ("Invalid dtype: str32"); None for other leaves."""
    if isinstance(leaf, np.ndarray) and leaf.dtype.kind in "US":
        return Problem("dtype", f"{path} is an array of dtype {leaf.dtype}, which fit() refuses "
                       f"(Keras {keras.__version__}: Invalid dtype).",
                       "give strings as a tensor of the backend (tf.constant(array)) or through a "
                       "tf.data.Dataset; other values as numbers (np.asarray(array, 'float32')).")
    return None


def list_problem(name, part):
    """A Python list of numbers as x or y, which fit() reads as one array per
    input or output ("tuple index out of range"); None otherwise."""
    if isinstance(part, list) and part and np.ndim(part[0]) == 0:
        return Problem(
            "data form", f"{name} is a Python list of {len(part)} numbers: fit() reads a list as one array "
            "per model input or output, not as one value per example (Keras then fails with an IndexError).",
            f"pass {name} as an array: np.asarray({name}).")
    return None


def needs_targets(model):
    """Whether the model's own train_step needs y: Keras' step with a compiled loss."""
    return (getattr(model, "compiled", False) and getattr(model, "loss", None) is not None
            and getattr(type(model), "train_step", None) is getattr(keras.Model, "train_step", None))


def missing_targets(model):
    """The Problem of data without y for a model that `needs_targets`."""
    return Problem(
        "structure", f"The data has no targets y, and {model.name!r} trains with Keras' own train_step, "
        f"whose compiled loss ({loss_name(model.loss)}) compares y with the predictions.",
        "pass the targets with the inputs, as fit(x, y) takes them: (x, y); x alone is for a model whose "
        "train_step needs no y (a VAE, a GAN).")


def labels_out_of_range(name, y, out_shape, ignore_class=None):
    """A sparse loss's integer labels outside the output's classes: TensorFlow
    fails on them on a CPU ("Received a label value of 7 which is outside the
    valid range of [0, 3)"), and gives NaN losses on a GPU and on JAX. None
    if in range or not a sparse loss.

    Args:
        name: str, the loss's name (`loss_name`).
        y: array of labels.
        out_shape: tuple, the model's output shape (its last axis: the classes).
        ignore_class: int or None, the label the loss skips (`ignore_class=-1`).
    """
    classes = out_shape[-1] if out_shape else None
    if "sparse" not in name or not isinstance(classes, int) or classes < 2:
        return None
    labels = np.asarray(y)
    if ignore_class is not None:
        labels = labels[labels != ignore_class]
    if labels.dtype.kind not in "iuf" or not labels.size or (
            labels.dtype.kind == "f" and not np.array_equal(labels, np.round(labels))):
        return None
    low, high = labels.min(), labels.max()
    if low >= 0 and high < classes:
        return None
    return Problem(
        "labels", f"y holds class labels from {low:g} to {high:g}, but the model outputs {classes} classes "
        f"and {name} takes labels 0 to {classes - 1}.",
        f"give the last layer one unit per class (Dense({int(high) + 1}) for labels 0 to {high:g}), or map the "
        f"labels to 0..{classes - 1} (e.g. y - y.min() for labels that start at {low:g}).")


def output_shape(model):
    """The shape of a model's single output, where it has one that is known; else None."""
    try:
        outputs = model.outputs
    except (AttributeError, ValueError):
        return None
    return tuple(outputs[0].shape) if outputs and len(outputs) == 1 else None


def targets_problem(model, y):
    """What the model's compiled loss cannot take in `y` (None: no targets): missing, or labels out of range."""
    if y is None:
        return missing_targets(model) if needs_targets(model) else None
    if keras.tree.is_nested(y) or not getattr(model, "compiled", False):
        return None
    shape = output_shape(model)
    return labels_out_of_range(loss_name(model.loss), y, shape, ignore_class_of(model.loss)) if shape else None


def is_arrays(data):
    """Whether `data` is arrays as fit()'s `x` or a tuple of them, not a list
    (x, a multi-input model's inputs), a dataset, a generator or no data."""
    return isinstance(data, (tuple, dict)) or hasattr(data, "shape") and hasattr(data, "dtype")


def arrays_problem(model, data):
    """The first Problem of these rules in `data`, arrays as fit()'s `x` or a
    tuple `(x, y, sample_weight)`; None if none, and for data that is no
    arrays (a dataset, a generator) or a list (x, a multi-input model's inputs)."""
    if not is_arrays(data):
        return None
    problem = tuple_problem(data)
    if problem is not None:
        return problem
    parts = tuple(data) if isinstance(data, tuple) else (data,)
    for part, value in zip(("x", "y", "sample_weight"), parts):
        problem = list_problem(part, value)
        if problem is not None:
            return problem
        leaves = keras.tree.flatten(value) if keras.tree.is_nested(value) else [value]
        for leaf in leaves:
            problem = string_problem(part, leaf)
            if problem is not None:
                return problem
    return targets_problem(model, parts[1] if len(parts) > 1 else None)


def said_at(call, problem, pointer=""):
    """A problem as the message of the error `call` raises: what, the fix, and where to see more."""
    return f"{call}: {problem.message} Fix: {problem.fix}" + (f" {pointer}" if pointer else "")


def ignore_class_of(loss):
    """The label a sparse loss skips (`SparseCategoricalCrossentropy(ignore_class=-1)`), or None."""
    ignore = getattr(loss, "ignore_class", None)
    if ignore is None:
        ignore = (getattr(loss, "_fn_kwargs", None) or {}).get("ignore_class")
    return ignore


def loss_name(loss):
    """A compiled loss's name as messages show it ("sparse_categorical_crossentropy")."""
    if isinstance(loss, str):
        return loss
    name = getattr(loss, "name", None) or getattr(loss, "__name__", None) or type(loss).__name__
    return str(name)
