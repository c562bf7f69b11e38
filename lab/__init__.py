"""The training lab, engine side: record, probe and steer Keras 3 training.

Headless: nothing here imports ipywidgets, plotly or IPython. The modules in
this package know no Keras backend; `lab.backend` picks the part written for
the one Keras runs on (`lab/backend/tensorflow/`, `lab/backend/jax/`).
"""

from lab import backend  # noqa: E402  (checks Keras' backend and versions first)
from lab import breakpoints, datasets, export, hooks, runfile, schema  # noqa: E402
from lab.backend import (  # noqa: E402
    BreakpointHit, DataReport, ModeError, ModeSwitcher, Recorder, Stepper, StepTrace, compare_modes, compat,
    devices, in_flight, inspect_data, modes, predict_stream, set_mode, strategy, virtual_cpus, watch)
from lab.breakpoints import Breakpoint  # noqa: E402
from lab.compare import compare  # noqa: E402
from lab.layer_norms import layer_norms  # noqa: E402
from lab.run import Run  # noqa: E402
from lab.runfile import RunFileError  # noqa: E402
from lab.weights import load_weights_checked  # noqa: E402

__all__ = ["Breakpoint", "Recorder", "Run", "RunFileError", "breakpoints", "compat", "hooks", "in_flight", "modes", "runfile", "schema", "compare", "DataReport", "inspect_data", "datasets", "export", "layer_norms", "predict_stream", "load_weights_checked", "devices", "ModeError", "ModeSwitcher", "compare_modes", "set_mode", "StepTrace", "Stepper", "strategy", "virtual_cpus", "BreakpointHit", "watch"]
__version__ = "0.1.0"
