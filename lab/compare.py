"""compare: several runs aligned by step in one long DataFrame."""

import os
import re

import pandas as pd

from lab import schema
from lab.run import Run

_TABLES = ("batches", "epochs")


def compare(runs, table="batches", columns=None, match_layers=True):
    """Aligns runs by step into one long DataFrame with a `run` column.

    Rows are ordered by `step`, then by the order the runs were given, so the
    rows of one step sit together. A column that only some runs have is NaN in
    the others' rows. A step a run took more than once (a `Stepper` rewound
    and replayed it) is in the table once, with its last row: the one that
    stands, as in the run.

    The same model built twice is named otherwise the second time (Keras
    numbers its layers: `dense` and `dense_1`, then `dense_2` and `dense_3`),
    so its per-variable columns (`grad_norm/<path>`, `weight_norm/<path>`,
    `update_ratio/<path>`) would never meet. With `match_layers`, a run whose
    variable paths are the first such run's but for those numbers gets that
    run's paths, matched in the order the layers were made (each name's
    numbers in order): its gradient norms sit in the same columns. What was
    renamed is in the result's `attrs["matched_layers"]`: run name ->
    {its path: the path it is shown under}, and whose paths they are shown
    under in `attrs["layers_named_as"]` (None where nothing was renamed).

    Args:
        runs: list of `lab.Run` (or Recorders, or paths of run files), named
            by `run.name` (a repeated name gets `#2`, `#3`, ...), or dict
            name -> run.
        table: str, `"batches"` (one row per training batch) or `"epochs"`
            (one row per epoch, at the step that ended it).
        columns: sequence of str or None, the value columns to keep (`run` and
            `step` always come first); None keeps every column.
        match_layers: bool, show the per-variable columns of runs of the same
            model, built again, under the first run's paths (above); False
            keeps each run's own.

    Returns:
        pandas.DataFrame with columns `run`, `step`, then the value columns.

    Example:

    ```python
    long = lab.compare({"lr=0.1": fast.run, "lr=0.01": slow.run})
    long.pivot(index="step", columns="run", values="loss")  # one loss column per run
    ```
    """
    if table not in _TABLES:
        raise ValueError(f"table must be one of {_TABLES}; got {table!r}.")
    if not isinstance(match_layers, bool):
        raise TypeError(f"compare(match_layers=...) must be True or False; got {match_layers!r}.")
    named = named_runs(runs)
    reference, matched = matched_layers(named) if match_layers else (None, {})
    frames = []
    for order, (name, run) in enumerate(named.items()):
        frame = getattr(run, table)()
        if len(frame.columns) == 0:
            continue
        if name in matched:
            frame = frame.rename(columns={f"{prefix}{own}": f"{prefix}{shown}" for own, shown in matched[name].items()
                                          for prefix in schema.PER_VARIABLE_PREFIXES})
        if table == "batches":
            # A replayed step's earlier rows were superseded; keeping them
            # would give one run two rows at a step (and break `pivot`).
            frame = frame.drop_duplicates("step", keep="last")
        frame.insert(0, "run", name)
        frame["_order"] = order
        frames.append(frame)
    if not frames:
        empty = pd.DataFrame({"run": pd.Series(dtype="str"), "step": pd.Series(dtype="int64")})
        empty.attrs.update(matched_layers=matched, layers_named_as=reference if matched else None)
        return empty
    long = pd.concat(frames, ignore_index=True, sort=False)
    long = long.sort_values(["step", "_order"], kind="stable").drop(columns="_order")
    long = long.reset_index(drop=True)
    if columns is not None:
        missing = [c for c in columns if c not in long.columns]
        if missing:
            available = [c for c in long.columns if c not in ("run", "step")]
            hint = (f" The per-variable columns of {list(matched)} are shown under {reference!r}'s paths (the same "
                    "model built again): name those, or pass match_layers=False for each run's own." if matched else "")
            raise KeyError(f"No run has the column(s) {missing}; available: {available}.{hint}")
        long = long[["run", "step"] + [c for c in columns if c not in ("run", "step")]]
    first = ["run", "step"]
    long = long[first + [c for c in long.columns if c not in first]]
    long.attrs.update(matched_layers=matched, layers_named_as=reference if matched else None)
    return long


def matched_layers(named):
    """`(reference, matched)` for `named` (name -> Run): the name of the
    first run with per-variable columns, and run name -> {variable path:
    the reference's path} for each run whose paths are, but for Keras'
    numbering of names, the reference's, and are not its paths themselves.
    Paths are matched in the order the layers were made: each path as
    (name, number) parts, numbers compared as numbers."""
    reference, reference_paths, matched = None, None, {}
    for name, run in named.items():
        paths = _variable_paths(run)
        if not paths:
            continue
        if reference is None:
            reference, reference_paths = name, paths
        elif paths != reference_paths and [_unnumbered(p) for p in paths] == [_unnumbered(p) for p in reference_paths]:
            matched[name] = dict(zip(paths, reference_paths))
    return reference, matched


def _variable_paths(run):
    """The run's variable paths (of its per-variable columns), in the order
    their layers were made."""
    paths = {c[len(prefix):] for c in run.columns if schema.is_variable_column(c)
             for prefix in schema.PER_VARIABLE_PREFIXES if c.startswith(prefix)}
    return sorted(paths, key=_numbered)


_NUMBERED = re.compile(r"^(.*?)(?:_(\d+))?(#\d+)?$")


def _numbered(path):
    """`path` as a tuple of (name, number, repeat) parts: `sequential_1/dense_12/kernel`
    gives ("sequential", 1, ""), ("dense", 12, ""), ("kernel", 0, "")."""
    parts = []
    for part in path.split("/"):
        base, number, repeat = _NUMBERED.match(part).groups()
        parts.append((base, int(number or 0), repeat or ""))
    return tuple(parts)


def _unnumbered(path):
    return tuple((base, repeat) for base, _, repeat in _numbered(path))


def named_runs(runs):
    """The runs `compare()` takes (a list or dict of Runs, Recorders,
    Dashboards or run-file paths) as a dict of name to loaded `lab.Run`,
    each file read once; names repeated get `#2`, `#3`.

    Example:

    ```python
    from lab.compare import named_runs

    named = named_runs({"a": "run.h5", "b": "runs/lr-0.01.h5"})  # {'a': Run, 'b': Run}
    batches, epochs = lab.compare(named), lab.compare(named, table="epochs")
    ```
    """
    if isinstance(runs, (Run, str, os.PathLike)):
        raise TypeError(
            "compare() takes several runs: pass a list `[run_a, run_b]` or a dict "
            "`{'name': run}`, not a single run."
        )
    if isinstance(runs, dict):
        items = [(str(name), run) for name, run in runs.items()]
    else:
        items = [(None, run) for run in runs]
    if not items:
        raise ValueError("compare() needs at least one run; got none.")
    named, seen = {}, {}
    for name, run in items:
        run = _as_run(run)
        name = run.name if name is None else name
        seen[name] = seen.get(name, 0) + 1
        named[name if seen[name] == 1 else f"{name}#{seen[name]}"] = run
    return named


def _as_run(run):
    if isinstance(run, Run):
        return run
    if isinstance(run, (str, os.PathLike)):
        return Run.load(run)
    if isinstance(getattr(run, "run", None), Run):  # a Recorder or a Dashboard
        return run.run
    raise TypeError(
        f"compare() takes lab.Run objects, Recorders or paths of run files; got "
        f"{type(run).__name__}."
    )
