"""The training lab, engine side: record, probe and steer Keras 3 training.

Headless: nothing here imports ipywidgets, plotly or IPython.
"""

from lab import _versions

_versions.check()

from lab import breakpoints, compat, datasets, export, hooks, in_flight, modes, runfile, schema  # noqa: E402
from lab.breakpoints import Breakpoint  # noqa: E402
from lab.compare import compare  # noqa: E402
from lab.data_check import DataReport, inspect_data  # noqa: E402
from lab.devices import devices, strategy, virtual_cpus  # noqa: E402
from lab.layer_norms import layer_norms  # noqa: E402
from lab.mode_comparison import compare_modes  # noqa: E402
from lab.modes import ModeError, ModeSwitcher, set_mode  # noqa: E402
from lab.predict import predict_stream  # noqa: E402
from lab.recorder import Recorder  # noqa: E402
from lab.run import Run  # noqa: E402
from lab.runfile import RunFileError  # noqa: E402
from lab.stepper import Stepper, StepTrace  # noqa: E402
from lab.watch import BreakpointHit, watch  # noqa: E402
from lab.weights import load_weights_checked  # noqa: E402

__all__ = ["Breakpoint", "Recorder", "Run", "RunFileError", "breakpoints", "compat", "hooks", "in_flight", "modes", "runfile", "schema", "compare", "DataReport", "inspect_data", "datasets", "export", "layer_norms", "predict_stream", "load_weights_checked", "devices", "ModeError", "ModeSwitcher", "compare_modes", "set_mode", "StepTrace", "Stepper", "strategy", "virtual_cpus", "BreakpointHit", "watch"]
__version__ = "0.1.0"
