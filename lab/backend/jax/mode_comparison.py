"""compare_modes on JAX: the same training steps timed as Python and under `jax.jit`.

Each mode runs the model's own `train_step(state, data)` on a copy of its
state (the arrays, never the model's variables), so the model is left as it
was, bit for bit, whatever the modes do: nothing is assigned back.
"""

import statistics
import time

import numpy as np
import pandas as pd

from lab.arguments import check_number
from lab.backend.jax import compat
from lab.backend.jax.modes import MODES, check_compiled, check_mode
from lab.mode_report import bottleneck
from lab.data_rules import arrays_problem, said_at


def compare_modes(model, data, steps=16, batch_size=None, modes=MODES, steps_per_execution=None):
    """Times the same training steps in each mode, each from the same starting state.

    The first call (tracing and XLA compiling, for "xla") is timed apart from
    the steps after it. The model is left as it was: weights, optimizer and
    metric state, mode and compiled functions (an unbuilt optimizer is left
    built).

    Args:
        model: keras.Model, compiled.
        data: `(x, y)`, `(x, y, sample_weight)` or `x` as arrays, batched as
            `fit()` batches them (repeated if shorter than `steps`).
        steps: int, training steps per mode (at least 2).
        batch_size: int or None (default 32).
        modes: str or sequence of str among "eager" and "xla" ("graph" is
            TensorFlow's).
        steps_per_execution: accepted for the TensorFlow signature's sake and
            not an axis here: Keras' JAX trainer runs an execution of n steps
            as n calls of the jitted step, so a step costs the same.

    Returns:
        pandas.DataFrame, one row per mode: `mode`, `steps_per_execution` (1),
        `trace_seconds`, `step_ms` (median over the steps after the first),
        `steps_per_second`, `speedup_vs_eager`, `max_loss_diff` (largest gap
        to the eager run's reported loss at the same step), `traces` (times
        `train_step` was traced; 0 in eager), `bound_by` ("model" or "data")
        and `error` (why a mode could not run, else None);
        `frame.attrs["bottleneck"]` a one-line verdict.

    Example:

    ```python
    frame = lab.compare_modes(model, (x, y), steps=16, batch_size=64)
    frame[["mode", "step_ms", "speedup_vs_eager"]]
    ```
    """
    import jax

    check_compiled(model)
    check_number("compare_modes", "steps", steps, int, lambda v: v >= 2, "a whole number, 2 or more",
                 "steps=16")
    batch_size = 32 if batch_size is None else batch_size
    check_number("compare_modes", "batch_size", batch_size, int, lambda v: v >= 1, "a whole number, 1 or more",
                 "batch_size=64")
    modes = [modes] if isinstance(modes, str) else list(modes)
    for mode in modes:
        check_mode(mode)
    problem = arrays_problem(model, data)  # said before Keras fails on it in words that name no input
    if problem is not None:
        raise ValueError(said_at("lab.compare_modes", problem))
    batches = _batches(data, batch_size, steps)
    compat.build_for(model, batches[0])
    start_state = _state_of(model)
    rows, losses = [], {}
    for mode in modes:
        traced = [0]

        def counted(state, batch):
            traced[0] += 1
            with compat.state_shardings_recorded(model):
                return model.train_step(state, batch)

        step = jax.jit(counted) if mode == "xla" else counted
        state = jax.tree_util.tree_map(jax.numpy.array, start_state)  # a copy of its own each mode
        times, mode_losses, error = [], [], None
        try:
            for batch in batches:
                began = time.perf_counter()
                logs, state = step(state, batch)
                jax.block_until_ready(state)
                times.append(time.perf_counter() - began)
                mode_losses.append(float(np.asarray(logs.get("loss", np.nan))) if isinstance(logs, dict) else np.nan)
        except Exception as failure:  # noqa: BLE001 - reported in the row
            error = f"{type(failure).__name__}: {failure}"
        later = times[1:] or times
        median = statistics.median(later) if later else float("nan")
        losses[mode] = mode_losses
        rows.append({"mode": mode, "steps_per_execution": 1,
                     "trace_seconds": max(0.0, times[0] - median) if times else float("nan"),
                     "step_ms": median * 1e3, "steps_per_second": 1.0 / median if median else float("nan"),
                     "traces": traced[0] if mode == "xla" else 0, "error": error})
    frame = pd.DataFrame(rows)
    eager = frame.loc[frame["mode"] == "eager", "step_ms"]
    frame["speedup_vs_eager"] = eager.iloc[0] / frame["step_ms"] if len(eager) else float("nan")
    reference = losses.get("eager")
    frame["max_loss_diff"] = [
        float(np.nanmax(np.abs(np.asarray(losses[m][:len(reference)]) - np.asarray(reference[:len(losses[m])]))))
        if reference and losses[m] else float("nan") for m in frame["mode"]]
    data_rate = _input_rate(data, batch_size, steps)
    frame["bound_by"] = np.where(data_rate < frame["steps_per_second"], "data", "model")
    frame.loc[frame["error"].notna(), "bound_by"] = None
    frame = frame[["mode", "steps_per_execution", "trace_seconds", "step_ms", "steps_per_second",
                   "speedup_vs_eager", "max_loss_diff", "traces", "bound_by", "error"]]
    frame.attrs["data_batches_per_second"] = data_rate
    frame.attrs["bottleneck"] = bottleneck(frame, data_rate)
    return frame


def _input_rate(data, batch_size, steps):
    """Batches per second the input yields alone (slicing the arrays as the steps were fed)."""
    rates = []
    for _ in range(3):
        began = time.perf_counter()
        _batches(data, batch_size, steps)
        rates.append(steps / max(time.perf_counter() - began, 1e-9))
    return statistics.median(rates)


def _state_of(model):
    """Copies of the arrays `fit()` would start from (the variables are not touched)."""
    def values(variables):
        return [np.array(v.value) for v in variables]

    return (values(model.trainable_variables), values(model.non_trainable_variables),
            values(model.optimizer.variables), values(model.metrics_variables))


def _batches(data, batch_size, steps):
    if isinstance(data, (tuple, list)):
        parts = [None if p is None else np.asarray(p) for p in data]
    else:
        parts = [np.asarray(data)]
    length = len(parts[0])
    if length == 0:
        raise ValueError("compare_modes needs data with at least one sample.")
    if any(p is not None and len(p) != length for p in parts):
        raise ValueError(f"compare_modes: the arrays of `data` have different lengths "
                         f"({[len(p) for p in parts if p is not None]}); give x, y (and sample_weight) of one length.")
    per_epoch = max(1, -(-length // batch_size))
    found = []
    for i in range(steps):
        start = (i % per_epoch) * batch_size
        chunk = tuple(None if p is None else p[start:start + batch_size] for p in parts)
        found.append(chunk if len(chunk) > 1 else chunk[0])
    return found
