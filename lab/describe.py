"""What a run's metadata says of the model it records, on any backend."""

import time

import keras
import numpy as np


def model_metadata(model):
    """The model, its optimizer and the versions a recording ran with, as
    run metadata (each recorder adds its backend's own: devices, versions)."""
    meta = {"model": model.name, "model_class": type(model).__name__}
    try:
        meta["parameters"] = int(model.count_params())
    except ValueError:
        pass
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        meta["optimizer"] = type(optimizer).__name__
    meta["started"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    if optimizer is not None:
        try:
            meta["optimizer_config"] = optimizer.get_config()
        except (NotImplementedError, TypeError, ValueError):
            pass
    # Not model.summary(): in a Jupyter kernel it also emits a display output.
    meta["summary"] = "\n".join(
        f"{layer.name} ({type(layer).__name__}): {layer.count_params() if layer.built else '?'} parameters"
        for layer in model.layers)
    meta["numpy"] = np.__version__
    meta["steps_per_execution"] = int(model.steps_per_execution)
    meta["keras"] = keras.__version__
    meta["backend"] = keras.config.backend()
    return meta
