"""The lab on Keras' TensorFlow backend: tf.function and XLA steps, device
buffers written inside the traced step, tf.distribute strategies."""

import importlib

NAME = "tensorflow"
MODES = ("eager", "graph", "xla")
STATE_OUTSIDE_VARIABLES_DURING_FIT = False
HAS_REPLICA_CONTEXT = True
CALLBACKS_MAY_RUN_OFF_THREAD = False

from lab.backend.tensorflow import compat, in_flight, modes  # noqa: E402
from lab.backend.tensorflow.data_check import DataReport, inspect_data  # noqa: E402
from lab.backend.tensorflow.devices import devices, strategy, virtual_cpus  # noqa: E402
from lab.backend.tensorflow.mode_comparison import compare_modes  # noqa: E402
from lab.backend.tensorflow.modes import ModeError, ModeSwitcher, set_mode  # noqa: E402
from lab.backend.tensorflow.predict import predict_stream  # noqa: E402
from lab.backend.tensorflow.recorder import Recorder  # noqa: E402
from lab.backend.tensorflow.stepper import Stepper, StepTrace  # noqa: E402
from lab.backend.tensorflow.watch import watch  # noqa: E402
from lab.breakpoints import BreakpointHit  # noqa: E402

# The devices module itself (its `devices` function shadows the name): the
# DevicePicker reads its strategy_choices, describe and batch_split.
device_support = importlib.import_module(__name__ + ".devices")

__all__ = ["device_support", "NAME", "MODES", "STATE_OUTSIDE_VARIABLES_DURING_FIT", "HAS_REPLICA_CONTEXT",
           "CALLBACKS_MAY_RUN_OFF_THREAD", "compat", "in_flight", "modes", "DataReport", "inspect_data",
           "devices", "strategy", "virtual_cpus", "compare_modes", "ModeError", "ModeSwitcher", "set_mode",
           "predict_stream", "Recorder", "Stepper", "StepTrace", "BreakpointHit", "watch"]
