"""What a training step must return, said where Keras' own error names neither the value nor the fix.

`fit()` reads a `train_step`'s logs by name, for its callbacks, its History
and its progress bar. A step that returns a tensor or None instead fails far
from the step, in words about the failing operation: "'EagerTensor' object
has no attribute 'items'", "Attr 'Toutput_types' of 'OptionalFromValue' Op
passed list of length 0". The lab keeps Keras' error, with its type, and
adds these words to it (`add_note`).
"""

import sys

LOGS_FIX = ("return a dict of logs from train_step, e.g. `return {\"loss\": loss}`, or "
            "`return {m.name: m.result() for m in self.metrics}` once each metric is updated")


def not_logs(logs):
    """What `logs` is, in words ("a Tensor", "None"), where a step returned
    something other than a dict of logs; None for a dict."""
    if isinstance(logs, dict):
        return None
    if logs is None:
        return "None"
    if hasattr(logs, "dtype") and hasattr(logs, "shape"):
        try:
            return f"a tensor of shape {tuple(logs.shape)}"
        except (TypeError, ValueError):  # a graph tensor of unknown rank
            return "a tensor"
    return f"a {type(logs).__name__}"


def not_logs_message(step, returned):
    """The lab's words for a `step` ("train_step") that returned `returned` (from `not_logs`)."""
    return (f"{step} returned {returned}, not a dict of logs: fit() reads the step's logs by name (for "
            f"callbacks, History and the progress bar). Fix: {LOGS_FIX}.")


def add_note(error, note):
    """Adds `note` to `error`, once: Python 3.11's `add_note` (shown under the
    traceback), the same `__notes__` list on older Pythons. Never raises."""
    try:
        if note in (getattr(error, "__notes__", None) or ()):
            return
        if sys.version_info >= (3, 11):
            error.add_note(note)
        else:
            error.__notes__ = list(getattr(error, "__notes__", None) or ()) + [note]
    except Exception:  # noqa: BLE001 - an error that takes no attribute keeps its own words
        pass


def step_failure_note(error, model, returned=None, has_targets=True, pointer=""):
    """The lab's words for an error that ended a watched fit() because of what
    train_step returned or was handed, on any backend; "" where it has none.

    Args:
        error: the exception.
        model: keras.Model being fit.
        returned: str or None, what train_step returned instead of a dict of
            logs (`not_logs`).
        has_targets: bool, whether the batches held targets y.
        pointer: str, where the backend's user can see more of their data.
    """
    from lab.data_rules import missing_targets, needs_targets

    if returned is not None:
        return not_logs_message("train_step", returned)
    if isinstance(error, Exception) and not has_targets and needs_targets(model):
        problem = missing_targets(model)
        return f"{problem.message} Fix: {problem.fix} {pointer}".strip()
    return ""
