"""The lab on Keras' JAX backend: `jax.jit` steps, rows written into a
ring carried in the optimizer's state, read in blocks.

What runs here: `lab.Recorder` and `widgets.Dashboard` in `fit()` (with
gradients, weights and device breakpoints), pausing a `fit()` that runs on
a thread of its own (`pause`, `in_flight`), the Stepper, `lab.watch` over a
hand-written jitted loop, modes and `compare_modes`, `inspect_data` and
`DataReport` (arrays, PyDatasets and generators: no `tf.data` on this path),
devices, virtual CPUs and data parallelism (`keras.distribution`). A public
name this backend did not have would be a placeholder that says so when
used (`lab.backend.unavailable`).
"""

import importlib

from lab.backend.jax import compat, in_flight, modes  # noqa: E402
from lab.backend.jax.data_check import DataReport, inspect_data  # noqa: E402
from lab.backend.jax.devices import devices, strategy, virtual_cpus  # noqa: E402
from lab.backend.jax.mode_comparison import compare_modes  # noqa: E402
from lab.backend.jax.modes import ModeError, ModeSwitcher, set_mode  # noqa: E402
from lab.backend.jax.predict import predict_stream  # noqa: E402
from lab.backend.jax.recorder import Recorder  # noqa: E402
from lab.backend.jax.stepper import Stepper  # noqa: E402
from lab.backend.jax.watch import watch  # noqa: E402
from lab.breakpoints import BreakpointHit  # noqa: E402
from lab.step_trace import StepTrace  # noqa: E402

NAME = "jax"
MODES = modes.MODES
STATE_OUTSIDE_VARIABLES_DURING_FIT = True
HAS_REPLICA_CONTEXT = False
CALLBACKS_MAY_RUN_OFF_THREAD = True

# The devices module itself (its `devices` function shadows the name): the
# DevicePicker reads its strategy_choices, describe and batch_split.
device_support = importlib.import_module(__name__ + ".devices")

__all__ = ["device_support", "NAME", "MODES", "STATE_OUTSIDE_VARIABLES_DURING_FIT", "HAS_REPLICA_CONTEXT",
           "CALLBACKS_MAY_RUN_OFF_THREAD", "compat", "in_flight", "modes", "DataReport", "inspect_data",
           "devices", "strategy", "virtual_cpus", "compare_modes", "ModeError", "ModeSwitcher", "set_mode",
           "predict_stream", "Recorder", "Stepper", "StepTrace", "BreakpointHit", "watch"]
