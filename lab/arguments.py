"""Checks of the arguments users give, made where they are given (a constructor, not batch 1)."""

import numbers

import numpy as np

# Examples for the flags of a Recorder, a Dashboard and `lab.watch`.
GRADIENTS_EXAMPLE = "gradients=True: record each variable's gradient norm at every batch"
WEIGHTS_EXAMPLE = "weights=True: record each variable's weight norm and update ratio at every batch"


def check_number(call, argument, value, kind, valid, described, example):
    """Raises unless `value` is a `kind` (never a bool) for which `valid(value)` holds.

    TypeError for the wrong type, ValueError for a wrong value; the message
    names `call(argument=...)`, what it must be and an example of a good one.

    Args:
        call: str, the function or class the argument is given to (`lab.watch`).
        argument: str, the argument's name.
        value: what was given.
        kind: a type or tuple of types (`numbers.Real`).
        valid: callable, `valid(value) -> bool`, called once the type is right.
        described: str, what the value must be ("a positive number of seconds").
        example: str, a good value and what it means.
    """
    if isinstance(value, bool) or not isinstance(value, kind):
        raise TypeError(f"{call}({argument}=...) must be {described}; got {type(value).__name__} "
                        f"{value!r} (e.g. {example}).")
    if not valid(value):
        raise ValueError(f"{call}({argument}=...) must be {described}; got {value!r} (e.g. {example}).")


def check_flag(call, argument, value, example):
    """Raises a TypeError unless `value` is True or False (a NumPy bool too):
    a string such as "no" or a number would otherwise pass as true or false."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{call}({argument}=...) must be True or False; got {type(value).__name__} {value!r} "
                        f"(e.g. {example}).")


def check_seconds(call, argument, value, example):
    """`check_number` for a finite number of seconds, 0 or more (0: at every chance)."""
    check_number(call, argument, value, numbers.Real, lambda v: bool(np.isfinite(v)) and v >= 0,
                 "a number of seconds, 0 or more", example)


CLASS_WEIGHT_EXAMPLE = "class_weight={0: 1.0, 1: 5.0}: each sample of class 1 weighs 5 in the loss"


def check_class_weight(call, value):
    """Raises unless `value` is None or what `fit(class_weight=...)` takes: a
    dict from class indices (whole numbers, 0 or more) to finite weights."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise TypeError(f"{call}(class_weight=...) must be a dict from class index to weight; got "
                        f"{type(value).__name__} {value!r} (e.g. {CLASS_WEIGHT_EXAMPLE}).")
    for key, weight in value.items():
        if isinstance(key, (bool, np.bool_)) or not isinstance(key, numbers.Integral) or key < 0:
            raise ValueError(f"{call}(class_weight=...) has the key {key!r}: its keys must be class indices, "
                             f"whole numbers 0 or more (e.g. {CLASS_WEIGHT_EXAMPLE}).")
        if isinstance(weight, (bool, np.bool_)) or not isinstance(weight, numbers.Real) or not np.isfinite(weight):
            raise ValueError(f"{call}(class_weight=...) gives class {key} the weight {weight!r}: each weight must "
                             f"be a finite number (e.g. {CLASS_WEIGHT_EXAMPLE}).")


def check_recorder_options(gradients, weights, path, run, flush_every, save_every):
    """The checks `lab.Recorder` makes of its arguments, on every backend."""
    import os

    from lab.run import Run

    check_flag("lab.Recorder", "gradients", gradients, GRADIENTS_EXAMPLE)
    check_flag("lab.Recorder", "weights", weights, WEIGHTS_EXAMPLE)
    check_seconds("lab.Recorder", "flush_every", flush_every, "flush_every=0.25: read the device four times a second")
    check_seconds("lab.Recorder", "save_every", save_every, "save_every=30.0: save twice a minute")
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"lab.Recorder(path=...) must be a file path (str or pathlib.Path) or None; got "
                        f"{type(path).__name__} {path!r} (e.g. path='runs/first.h5').")
    if run is not None and not isinstance(run, Run):
        raise TypeError(f"lab.Recorder(run=...) must be a lab.Run to continue (e.g. run=lab.Run.load('runs/first.h5')) "
                        f"or None; got {type(run).__name__}.")
