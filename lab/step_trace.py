"""StepTrace: what one training step saw and did, on any Keras backend.

Backend-neutral (NumPy only): each backend's Stepper
(`lab.backend.<name>.stepper`) fills one per step.
"""

import dataclasses

import numpy as np


@dataclasses.dataclass
class StepTrace:
    """What one training step saw and did.

    Attributes:
        index: int, the global step from 0 (a replayed step reuses its index).
        epoch: int, the epoch the batch belongs to.
        batch: int, the batch's position in its epoch.
        x: ndarray or structure of them, the batch's inputs.
        y: ndarray or None, the batch's targets.
        y_pred: ndarray or None, the predictions the step made (what it passed
            to `compute_loss`, else what the model's `call` returned).
        logs: dict, what `train_step` returned (Keras' running epoch values).
        gradients: dict, variable key -> ndarray, the gradients the optimizer applied.
        weights_before: dict, variable key -> ndarray, trainable weights before the step.
        weights_after: dict, variable key -> ndarray, trainable weights after it.
        seconds: float, wall time of the `train_step` call.
        error: BaseException or None, what the step raised (the model is then
            as before it; a KeyboardInterrupt is raised on after the undo).
        traceback: str, the formatted traceback of `error` ("" without one).
        hint: str, how to fix the usual cause of `error` ("" when none is known).
        row: dict, the batch's own values as a run row (`loss`, metrics,
            `learning_rate`, `grad_norm/<key>`, `grad_norm`).
        no_gradient: list of str, keys of variables passed to the optimizer with a None gradient.
        sample_weight: ndarray or None.
        running: list of str, the columns of `row` that hold Keras' running
            value since the epoch began (a metric that is not a mean, such as
            AUC), not the batch's own.
        skipped: bool, whether the step's update was kept out of the model: a
            device-side breakpoint (`nonfinite()`, `loss_spike()`) hit it in
            `run_until`, which rewound it (its batch comes next again).

    Example:

    ```python
    trace = stepper.step()
    trace.loss, trace.y_pred[:4], trace.gradients["dense/kernel"]
    trace.weight_deltas()  # what the step changed, per variable
    ```
    """

    index: int
    epoch: int
    batch: int
    x: object = None
    y: object = None
    y_pred: object = None
    logs: dict = dataclasses.field(default_factory=dict)
    gradients: dict = dataclasses.field(default_factory=dict)
    weights_before: dict = dataclasses.field(default_factory=dict)
    weights_after: dict = dataclasses.field(default_factory=dict)
    seconds: float = float("nan")
    error: BaseException = None
    traceback: str = ""
    hint: str = ""
    row: dict = dataclasses.field(default_factory=dict)
    no_gradient: list = dataclasses.field(default_factory=list)
    sample_weight: object = None
    running: list = dataclasses.field(default_factory=list)
    skipped: bool = False

    @property
    def loss(self):
        """float, the batch's own loss (NaN when the step failed)."""
        return float(self.row.get("loss", float("nan")))

    def weight_deltas(self):
        """dict, variable key -> ndarray, what the step added to each trainable weight."""
        return {k: self.weights_after[k] - v for k, v in self.weights_before.items() if k in self.weights_after}

    def __repr__(self):
        if self.error is not None:
            return f"<StepTrace {self.index} (epoch {self.epoch}, batch {self.batch}): {type(self.error).__name__}>"
        values = {"loss": self.row["loss"]} if "loss" in self.row else self.logs
        shown = ", ".join(f"{k} {v:.4g}" for k, v in list(values.items())[:3] if np.ndim(v) == 0)
        return f"<StepTrace {self.index} (epoch {self.epoch}, batch {self.batch}): {shown}>"
