"""compare: several runs aligned by step in one long DataFrame."""

import os

import pandas as pd

from lab.run import Run

_TABLES = ("batches", "epochs")


def compare(runs, table="batches", columns=None):
    """Aligns runs by step into one long DataFrame with a `run` column.

    Rows are ordered by `step`, then by the order the runs were given, so the
    rows of one step sit together. A column that only some runs have is NaN in
    the others' rows. A step a run took more than once (a `Stepper` rewound
    and replayed it) is in the table once, with its last row: the one that
    stands, as in the run.

    Args:
        runs: list of `lab.Run` (or Recorders, or paths of run files), named
            by `run.name` (a repeated name gets `#2`, `#3`, ...), or dict
            name -> run.
        table: str, `"batches"` (one row per training batch) or `"epochs"`
            (one row per epoch, at the step that ended it).
        columns: sequence of str or None, the value columns to keep (`run` and
            `step` always come first); None keeps every column.

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
    named = named_runs(runs)
    frames = []
    for order, (name, run) in enumerate(named.items()):
        frame = getattr(run, table)()
        if len(frame.columns) == 0:
            continue
        if table == "batches":
            # A replayed step's earlier rows were superseded; keeping them
            # would give one run two rows at a step (and break `pivot`).
            frame = frame.drop_duplicates("step", keep="last")
        frame.insert(0, "run", name)
        frame["_order"] = order
        frames.append(frame)
    if not frames:
        return pd.DataFrame({"run": pd.Series(dtype="str"), "step": pd.Series(dtype="int64")})
    long = pd.concat(frames, ignore_index=True, sort=False)
    long = long.sort_values(["step", "_order"], kind="stable").drop(columns="_order")
    long = long.reset_index(drop=True)
    if columns is not None:
        missing = [c for c in columns if c not in long.columns]
        if missing:
            available = [c for c in long.columns if c not in ("run", "step")]
            raise KeyError(f"No run has the column(s) {missing}; available: {available}.")
        long = long[["run", "step"] + [c for c in columns if c not in ("run", "step")]]
    first = ["run", "step"]
    return long[first + [c for c in long.columns if c not in first]]


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
