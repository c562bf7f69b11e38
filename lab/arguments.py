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
