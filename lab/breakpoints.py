"""Breakpoints: conditions checked per batch that stop or pause training."""

class Breakpoint:
    """A condition over the batch row the Recorder just made.

    A Python condition sees the row after its batch, so it acts after that
    batch's update.

    Args:
        condition: callable, `condition(row) -> bool`; `row` is a pandas Series
            with the run's batch columns (`step`, `loss`, ...).
        name: str, how events name this breakpoint.

    Example:

    ```python
    stop_at_200 = lab.Breakpoint(lambda row: row["step"] >= 200, name="step 200")
    model.fit(x, y, callbacks=[lab.Recorder(breakpoints=[stop_at_200])])
    ```
    """

    def __init__(self, condition, name=None):
        if not callable(condition):
            raise TypeError(
                f"Breakpoint needs a callable condition(row) -> bool, got {type(condition).__name__}."
            )
        self.condition = condition
        self.name = name or getattr(condition, "__name__", "condition")

    def hit(self, row):
        return bool(self.condition(row))

    def describe(self, row):
        return f"{self.name} at step {int(row['step'])}"

