"""The training lab, notebook side: views and controls over `lab`."""

from widgets.background import BackgroundFit, TrainingControls
from widgets.dashboard import Dashboard
from widgets.device_picker import DevicePicker
from widgets.mode_switch import ModeSwitch
from widgets.panel import Lab
from widgets.run_compare import RunCompare
from widgets.stepper_panel import StepperPanel

__all__ = ["BackgroundFit", "Dashboard", "DevicePicker", "Lab", "ModeSwitch", "RunCompare", "StepperPanel", "TrainingControls"]
