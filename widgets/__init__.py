"""The training lab, notebook side: views and controls over `lab`.

Names load on first use, so the `training-lab` command answers `--help`
without importing TensorFlow. Every name runs on Keras' TensorFlow and
JAX backends.
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
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + __all__)
