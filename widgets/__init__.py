"""The training lab, notebook side: views and controls over `lab`."""

from widgets.dashboard import Dashboard

__all__ = ["Dashboard"]
