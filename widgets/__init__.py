"""The training lab, notebook side: views and controls over `lab`.

Names load on first use, so the `training-lab` command answers `--help`
without importing TensorFlow.
"""

import importlib

_HOMES = {
    "BackgroundFit": "widgets.background",
    "TrainingControls": "widgets.background",
    "Dashboard": "widgets.dashboard",
    "DevicePicker": "widgets.device_picker",
    "Lab": "widgets.panel",
    "image_grid": "widgets.images",
    "ModeSwitch": "widgets.mode_switch",
    "RunCompare": "widgets.run_compare",
    "StepperPanel": "widgets.stepper_panel",
}

__all__ = sorted(_HOMES)


def __getattr__(name):
    if name not in _HOMES:
        raise AttributeError(f"module 'widgets' has no attribute {name!r}")
    try:
        module = importlib.import_module(_HOMES[name])
    except ModuleNotFoundError as error:
        if (error.name or "").split(".")[0] != "tensorflow":
            raise
        import keras

        raise NotImplementedError(
            f"widgets.{name} does not run on Keras' {keras.config.backend()} backend yet (it runs on Keras' "
            "TensorFlow backend); the README's \"Backends\" table lists what runs on each.") from error
    value = getattr(module, name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + __all__)
