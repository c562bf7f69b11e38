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


def check_no_model(call, first):
    """Raises a TypeError where a callback's first argument is a model:
    Keras hands a callback the model it is given to in fit()."""
    if hasattr(first, "fit") and hasattr(first, "trainable_variables"):
        raise TypeError(f"{call}() takes no model: Keras hands it the model it is given to. Pass it to fit: "
                        f"model.fit(x, y, callbacks=[{call}()]).")


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


def check_recorder_options(gradients, weights, path, run, flush_every, save_every, norms_every=1):
    """The checks `lab.Recorder` makes of its arguments, on every backend."""
    import os

    from lab.run import Run

    check_no_model("lab.Recorder", gradients)
    check_flag("lab.Recorder", "gradients", gradients, GRADIENTS_EXAMPLE)
    check_flag("lab.Recorder", "weights", weights, WEIGHTS_EXAMPLE)
    check_norms_every("lab.Recorder", norms_every, gradients, weights)
    check_seconds("lab.Recorder", "flush_every", flush_every, "flush_every=0.25: read the device four times a second")
    check_seconds("lab.Recorder", "save_every", save_every, "save_every=30.0: save twice a minute")
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"lab.Recorder(path=...) must be a file path (str or pathlib.Path) or None; got "
                        f"{type(path).__name__} {path!r} (e.g. path='runs/first.h5').")
    if path is not None and os.path.isdir(path):
        raise ValueError(f"lab.Recorder(path=...) is the folder {os.fspath(path)!r}: give the file to save the run "
                         f"to, in it (e.g. path={os.path.join(path, 'run.h5')!r}).")
    if run is not None and not isinstance(run, Run):
        raise TypeError(f"lab.Recorder(run=...) must be a lab.Run to continue (e.g. run=lab.Run.load('runs/first.h5')) "
                        f"or None; got {type(run).__name__}.")


def check_norms_every(owner, norms_every, gradients, weights):
    """`norms_every`: a whole number of steps, 1 or more, that samples norms
    the recorder takes (gradients or weights)."""
    check_number(owner, "norms_every", norms_every, numbers.Integral, lambda v: v >= 1,
                 "a whole number of steps, 1 or more", "norms_every=10: the norms of one step in ten")
    if norms_every > 1 and not (gradients or weights):
        raise ValueError(
            f"{owner}(norms_every={norms_every}) takes the gradient and weight norms at one step in "
            f"{norms_every}, but this {owner.split('.')[-1]} records neither: pass gradients=True or "
            f"weights=True with it, or leave norms_every out.")


def check_stepper_options(seed, run, start_step, start_batch):
    """The checks `lab.Stepper` makes of its seed, run and start on every
    backend, at construction (not at the first step)."""
    from lab.run import Run

    if seed is not None:
        check_number("lab.Stepper", "seed", seed, numbers.Integral, lambda v: v >= 0,
                     "a whole number, 0 or more, or None", "seed=0: the same shuffled order every time")
    if run is not None and not isinstance(run, Run):
        raise TypeError(f"lab.Stepper(run=...) must be a lab.Run to append the steps' rows to, or None; got "
                        f"{type(run).__name__} (e.g. run=recorder.run, to go on from a fit()).")
    if start_step is not None:
        check_number("lab.Stepper", "start_step", start_step, numbers.Integral, lambda v: v >= 0,
                     "a whole number, 0 or more, or None", "start_step=run.next_step")
    if (not isinstance(start_batch, (tuple, list)) or len(start_batch) != 2
            or any(isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Integral) or v < 0
                   for v in start_batch)):
        raise TypeError(f"lab.Stepper(start_batch=...) must be a pair (epoch, batch) of whole numbers, 0 or more; "
                        f"got {start_batch!r} (e.g. start_batch=(2, 5): epoch 2's sixth batch comes first).")


def check_predict_stream_options(model, batch_size, steps, collect):
    """`lab.predict_stream`'s arguments, checked at the call on every backend."""
    import keras

    if not isinstance(model, keras.Model):
        raise TypeError(f"predict_stream() needs a keras.Model; got {type(model).__name__}.")
    check_number("lab.predict_stream", "batch_size", batch_size, numbers.Integral, lambda v: v >= 1,
                 "a whole number of samples, 1 or more", "batch_size=1024")
    if steps is not None:
        check_number("lab.predict_stream", "steps", steps, numbers.Integral, lambda v: v >= 1,
                     "a whole number of batches, 1 or more, or None (all of them)", "steps=100")
    if collect is not None and not callable(collect):
        raise TypeError(f"predict_stream(collect=...): collect must be a callable `collect(y_pred, batch)` or "
                        f"None; got {type(collect).__name__}.")
