"""layer_norms: a run's per-variable norms combined per layer or per part of a model."""

import numpy as np
import pandas as pd


def layer_norms(run, parts=None, column="grad_norm"):
    """Per-step norms of groups of variables, from a run's per-variable columns.

    A run holds one `<column>/<variable.path>` column per variable. The norm of
    a group of variables together is the square root of the sum of their
    squared norms: the length of all their gradients as one vector. A step
    where none of a group's variables has a value stays NaN (missing, not 0).

    Args:
        run: `lab.Run` recorded with `gradients=True` (for
            `column="grad_norm"`), the DataFrame from `run.batches()`, or a
            `lab.StepTrace` (its one row).
        parts: None, or dict name -> what the part holds: a `keras.Layer` or
            `keras.Model` (its trainable variables, matched by `variable.path`),
            a path prefix (`"decoder"` holds `decoder/...`), or a list of
            those. None gives one column per layer: the variable path without
            its last component (`trunk/kernel` -> `trunk`).
        column: str, the per-variable column family, e.g. `"grad_norm"` or
            `"weight_norm"`.

    Returns:
        DataFrame indexed by `step`, one column per layer or part.

    Example:

    ```python
    rec = lab.Recorder(gradients=True)
    vae.fit(x, epochs=2, callbacks=[rec])
    lab.layer_norms(rec.run, {"encoder": vae.encoder, "decoder": vae.decoder})
    ```
    """
    if hasattr(run, "batches"):
        rows = run.batches()
    elif hasattr(run, "row"):  # a StepTrace
        rows = pd.DataFrame([{**run.row, "step": run.index}])
    else:
        rows = run
    prefix = column + "/"
    paths = [c[len(prefix):] for c in rows.columns if c.startswith(prefix)]
    if not paths:
        raise ValueError(
            f"This run has no `{prefix}<variable>` columns. Record it with "
            f"`lab.Recorder(gradients=True)` (or `weights=True` for weight norms), "
            f"or pass the `column` it has.")
    if parts is None:
        groups = {}
        for path in paths:
            groups.setdefault(path.rsplit("/", 1)[0] if "/" in path else path, []).append(path)
    else:
        groups = {name: _paths_of(name, part, paths) for name, part in parts.items()}
    steps = rows["step"].to_numpy() if "step" in rows else np.arange(len(rows))
    combined = {name: _combine(rows[[prefix + p for p in members]].to_numpy(np.float64))
                for name, members in groups.items()}
    return pd.DataFrame(combined, index=pd.Index(steps, name="step"))


def _paths_of(name, part, paths):
    members = []
    for item in part if isinstance(part, (list, tuple)) else [part]:
        if isinstance(item, str):
            found = [p for p in paths if p == item or p.startswith(item.rstrip("/") + "/")]
        elif hasattr(item, "trainable_variables"):
            wanted = {_base(v.path) for v in item.trainable_variables}
            found = [p for p in paths if _base(p) in wanted]
        else:
            raise TypeError(
                f"Part {name!r}: expected a layer, a model, a path prefix or a list of "
                f"those, got {type(item).__name__}.")
        if not found:
            raise ValueError(
                f"Part {name!r} matches no variable of this run ({item!r}). "
                f"The run has: {', '.join(paths)}. Pass a layer or model that was "
                f"trained in it, or a prefix of one of these paths.")
        members += [p for p in found if p not in members]
    return members


def _base(path):
    # A run names a repeated path `p#2`; the variable itself still says `p`, so
    # a layer matches both namesakes.
    return path.split("#", 1)[0]


def _combine(values):
    missing = np.isnan(values).all(axis=1)
    total = np.sqrt(np.nansum(np.square(values), axis=1))
    total[missing] = np.nan
    return total
