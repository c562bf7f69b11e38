"""One batch checked against a model, on any backend: what `inspect_data` names of the model.

The batch's x is held against a functional model's declared inputs (names,
count, shapes, by Keras' own rule for a trailing 1); then the model and its
compiled loss run on the batch in a `keras.StatelessScope`, so no variable
of the model changes, and what fails, or would train wrong (no targets for
Keras' own train_step, labels out of range, one-hot rows for a sparse loss,
targets the loss broadcasts), is named with its fix. Imports no backend: what differs (the fix for
unbatched data, what a backend's tensor is) comes from the backend's
`FitData` (`lab.data_report`).
"""

import difflib

import keras

from lab.data_rules import Problem, ignore_class_of, labels_out_of_range, loss_name, targets_problem
from lab.error_text import error_line, missing_key


def check_against_model(fit_data, report, model):
    """Adds to `report.problems` what `model` makes of `report.batch`; the model is left as it was."""
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(report.batch)
    if not check_inputs(fit_data, report, model, x):
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
        if y is None:
            missing = targets_problem(model, None)
            if missing is not None:
                # Named apart from a malformed batch ("structure"), whose batches are not counted.
                report.problems.append(missing._replace(kind="targets"))
            return
        if not getattr(model, "compiled", False) or getattr(model, "loss", None) is None:
            return
        _check_loss(fit_data, report, model, x, y, y_pred, sample_weight)


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


def check_inputs(fit_data, report, model, x):
    """Holds x against a functional model's inputs; False (with a problem in the report) where it does not fit."""
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
                f"batches of shape {expected}.", fit_data.unbatched_x_fix))
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


def _check_loss(fit_data, report, model, x, y, y_pred, sample_weight):
    name = loss_name(model.loss)
    if not fit_data.is_tensor(y_pred) or isinstance(y, (dict, list, tuple)):
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
