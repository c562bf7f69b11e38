"""Run: the append-only record of one training run.

One source of truth per run. Batch rows live in typed columns that grow by
doubling (float32 for values: 4 bytes per value per step), epoch rows and
events in small lists. Views subscribe; files and comparisons read it.
"""

import os
import threading
import time
import weakref

import numpy as np
import pandas as pd

from lab import runfile, schema
from lab.observers import Observers

_INDEX_COLUMNS = ("step", "epoch", "batch")


class _Column:
    """A growable 1-D array; values before the column existed read as NaN."""

    def __init__(self, dtype, length):
        self.dtype = np.dtype(dtype)
        self.data = np.full(max(16, length), self._missing(), self.dtype)

    def _missing(self):
        if self.dtype.kind == "f":
            return np.nan
        if self.dtype.kind in "iu":
            return -1
        return None

    def reserve(self, length):
        if length > len(self.data):
            grown = np.full(max(length, 2 * len(self.data)), self._missing(), self.dtype)
            grown[: len(self.data)] = self.data
            self.data = grown

    def fill(self, start, stop):
        self.reserve(stop)
        self.data[start:stop] = self._missing()


class Run:
    """The record of one training run: batch rows, epoch rows and events.

    Rows are appended by a `lab.Recorder` (or `lab.watch`, or a `Stepper`) and
    never changed afterwards. Read them as pandas DataFrames.

    A row's `step` counts training steps: the run numbers each row it is
    handed without one from `next_step`, so rows from `fit()` and from a
    stepper that share the run go on from each other. A step that is
    rewound and run again (a stepper's replay) keeps its number: its last
    row is the one that stands.

    Args:
        name: str, a label for comparisons and files.
        metadata: dict, free-form facts about the run (model, optimizer, ...).

    Example:

    ```python
    rec = lab.Recorder()
    model.fit(x, y, callbacks=[rec])
    rec.run.batches()[["step", "loss"]]
    ```
    """

    def __init__(self, name="run", metadata=None):
        self.name = name
        self.metadata = dict(metadata or {})
        self.metadata.setdefault("created", time.strftime("%Y-%m-%dT%H:%M:%S%z"))
        self._lock = threading.RLock()
        self._length = 0
        self._next_step = 0
        self._columns = {}
        self._epochs = []
        self._events = []
        self._subscribers = Observers(f"run {name!r}")
        self._model = None  # weak reference to the model whose rows these are

    # ---- writing -----------------------------------------------------------

    def append_batches(self, rows):
        """Appends batch rows.

        Args:
            rows: dict, column name -> sequence of equal length. `step` is
                filled in from `next_step` when absent; `mode` holds strings.
        """
        lengths = {len(v) for v in rows.values()}
        if len(lengths) != 1:
            raise ValueError(f"Batch columns must have one length; got {sorted(lengths)}.")
        count = lengths.pop()
        if count == 0:
            return
        with self._lock:
            start, stop = self._length, self._length + count
            if "step" not in rows:
                rows = dict(rows, step=np.arange(self._next_step, self._next_step + count))
            steps = np.asarray(rows["step"])
            _check_step(steps.max(), "a batch row's step")
            _check_step(steps.min(), "a batch row's step")
            for name, values in rows.items():
                column = self._columns.get(name)
                if column is None:
                    column = self._columns[name] = _Column(self._dtype_for(name, values), stop)
                    column.fill(0, start)
                column.reserve(stop)
                column.data[start:stop] = values
            for name, column in self._columns.items():
                if name not in rows:
                    column.fill(start, stop)
            self._length = stop
            self._next_step = int(rows["step"][-1]) + 1
        self._notify("batches", start, stop)

    @staticmethod
    def _dtype_for(name, values):
        if name == "step":
            return np.int64
        if name in _INDEX_COLUMNS:
            return np.int32
        if name == "mode" or (len(values) and isinstance(values[0], str)):
            return object
        if name == "seconds":
            return np.float64
        return np.float32

    def append_epoch(self, epoch, logs):
        """Appends one epoch row (Keras' epoch logs, validation included)."""
        row = {"epoch": int(epoch), "step": self._next_step - 1}
        row.update(_numbers(logs))
        with self._lock:
            self._epochs.append(row)
        self._notify("epochs", len(self._epochs) - 1, len(self._epochs))

    def complete_epoch(self, logs):
        """Updates the last epoch row with `logs` as they are now: Keras hands
        every callback the same epoch logs, and callbacks after the recorder
        add to them (ReduceLROnPlateau's `learning_rate`, a user's `test_acc`),
        so the row ends as History's."""
        values = _numbers(logs)
        with self._lock:
            if not self._epochs or all(self._epochs[-1].get(k) == v for k, v in values.items()):
                return
            self._epochs[-1].update(values)
        self._notify("epochs", len(self._epochs) - 1, len(self._epochs))

    def add_event(self, kind, detail="", step=None):
        """Records an event (`mode`, `breakpoint`, `nonfinite`, `interrupt`, `error`, ...)."""
        with self._lock:
            event = {
                "step": self._next_step - 1 if step is None else _check_step(int(step), "an event's step"),
                "kind": str(kind),  # text, as a run file's events hold it
                "detail": str(detail),
                "time": time.time(),
            }
            self._events.append(event)
        self._notify("events", len(self._events) - 1, len(self._events))
        return event

    # ---- reading -----------------------------------------------------------

    def note_running_values(self, names, step, replicas=1):
        """Marks the columns `names` as Keras' running values, not each batch's
        own (`schema.RUNNING_VALUES`), with one `running_value` event for each
        not marked before; trained on several `replicas`, it says what Keras
        reports there."""
        known = self.metadata.get(schema.RUNNING_VALUES, [])
        new = [name for name in sorted(names) if name not in known]
        if not new:
            return
        self.metadata[schema.RUNNING_VALUES] = list(known) + new
        for name in new:
            self.add_event(
                "running_value",
                f"{name!r} is the value Keras reports, a running value since the epoch began: "
                "its metric is not a mean, so the batch's own value cannot be read off its state"
                + (REPLICAS_RUNNING_NOTE.format(replicas=replicas) if replicas > 1 else ""),
                step=step)

    def __len__(self):
        return self._length

    @property
    def next_step(self):
        """int, the step the next training step gets: one past the last row's,
        or where a rewind went back to. Set it when the model is put back to
        the state after another step (the stepper's `rewind` does)."""
        return self._next_step

    @next_step.setter
    def next_step(self, step):
        step = int(step)
        if step < 0:
            raise ValueError(f"next_step counts training steps from 0; got {step}.")
        _check_step(step, "next_step")
        with self._lock:
            self._next_step = step

    @property
    def columns(self):
        with self._lock:
            return list(self._columns)

    def column(self, name, start=0, stop=None):
        """One batch column (rows `start` to `stop`) as a numpy array (a copy)."""
        with self._lock:
            stop = self._length if stop is None else min(stop, self._length)
            return self._columns[name].data[start:stop].copy()

    def batches(self):
        """One row per training batch, as a DataFrame (see DESIGN.md for columns)."""
        with self._lock:
            data = {n: c.data[: self._length].copy() for n, c in self._columns.items()}
        ordered = [c for c in ("step", "epoch", "batch", "seconds", "mode", "loss") if c in data]
        rest = [c for c in data if c not in ordered and not c.startswith("_")]
        ordered += sorted(rest, key=lambda c: ("/" in c or c.startswith("grad_norm"), c))
        frame = pd.DataFrame({c: data[c] for c in ordered})
        if "mode" in frame:
            frame["mode"] = frame["mode"].astype("string")
        return frame

    def epochs(self):
        """One row per finished epoch: Keras' epoch logs, `val_*` included."""
        with self._lock:
            return pd.DataFrame(list(self._epochs))

    def events(self):
        """Events with columns `step`, `kind`, `detail`, `time`."""
        with self._lock:
            return pd.DataFrame(list(self._events), columns=["step", "kind", "detail", "time"])

    # ---- subscribers -------------------------------------------------------

    def subscribe(self, fn):
        """Calls `fn(run, table, start, stop)` after rows are added.

        `table` is "batches", "epochs" or "events". A subscriber that raises is
        reported once and dropped: a view never stops training.

        Returns:
            A callable that unsubscribes.
        """
        return self._subscribers.add(fn)

    def _notify(self, table, start, stop):
        self._subscribers.notify(self, table, start, stop)

    # ---- the model it records --------------------------------------------

    def claim_model(self, model):
        """Marks `model` as the one whose training this run records.

        A run holds one model's steps under one model's metadata. The first
        model claimed is kept; claiming another once the run has rows raises
        (a run loaded from a file, or still empty, may be claimed by any model).

        Args:
            model: keras.Model, the model about to be recorded.

        Raises:
            ValueError: the run already holds rows of a different model.
        """
        with self._lock:
            claimed = self._model() if self._model is not None else None
            if claimed is model:
                return
            if self._model is not None and self._length:
                raise ValueError(
                    f"This run already holds {self._length} batch rows of model "
                    f"{_model_name(claimed) if claimed is not None else self.metadata.get('model', '?')!r}; "
                    "one run records one model, "
                    f"so rows of model {_model_name(model)!r} would be mixed up with them under its "
                    "metadata. Give each model its own recorder: `lab.Recorder()` (or "
                    "`widgets.Dashboard()`) per model, then put them side by side with "
                    "`lab.compare([run_a, run_b])`.")
            try:
                self._model = weakref.ref(model)
            except TypeError:
                self._model = lambda: model

    # ---- files -------------------------------------------------------------

    def save(self, path):
        """Writes the run to an HDF5 file, atomically (see `lab.runfile`).

        Args:
            path: str or os.PathLike, the file to (over)write.

        Returns:
            str, the path written.
        """
        return runfile.save(self, path)

    @classmethod
    def load(cls, path):
        """Reads a run saved by `Run.save`.

        Args:
            path: str or os.PathLike.

        Returns:
            `lab.Run`, equal to the run that was saved.

        Raises:
            lab.RunFileError: the file is missing, damaged, foreign or unsafe;
                the message names it and the problem.
        """
        parts = runfile.load(path)
        problem = schema.metadata_problem(parts.metadata)
        if problem:
            # The lab reads these keys back (schema.value_kind, a recorder
            # continuing the run): refused here, not as a TypeError there.
            raise runfile.RunFileError(f"{os.fsdecode(os.fspath(path))!r}: {problem}; the file is damaged "
                                       "or not written by training-lab.")
        try:
            return cls._from_parts(parts)
        except Exception as error:  # noqa: BLE001 - parts that passed the reader's checks but make no run
            raise runfile.RunFileError(
                f"{os.fsdecode(os.fspath(path))!r}: its rows cannot be made a run "
                f"({type(error).__name__}: {error}); the file is damaged or not written by training-lab."
            ) from error

    @classmethod
    def _from_parts(cls, parts):
        """A Run holding exactly the rows of `parts` (a `runfile.RunParts`), dtypes included."""
        run = cls(name=parts.name, metadata=parts.metadata)
        length = len(next(iter(parts.batches.values()))) if parts.batches else 0
        for name, values in parts.batches.items():
            column = _Column(values.dtype, length)
            column.data[:length] = values
            run._columns[name] = column
        run._length = length
        if length and "step" in parts.batches:
            run._next_step = max(0, int(parts.batches["step"][-1]) + 1)
        run._epochs = list(parts.epochs)
        run._events = list(parts.events)
        return run

    def __repr__(self):
        return f"<lab.Run {self.name!r}: {self._length} batches, {len(self._epochs)} epochs, {len(self._events)} events>"


def _check_step(step, what):
    """`step`, or a ValueError when a run file could not hold it (`runfile.MAX_STEP`)."""
    if not -runfile.MAX_STEP <= step <= runfile.MAX_STEP:
        raise ValueError(f"{what} is {int(step)}, beyond {runfile.MAX_STEP} (2**53), the largest step a run "
                         "(and its file) holds either way; no run takes that many steps.")
    return step


REPLICAS_RUNNING_NOTE = (
    ". On {replicas} replicas each keeps its own running state of the metric, over its share of the "
    "batches: Keras reports at each batch the mean of the replicas' values, which is not the value over "
    "all the samples, and its epoch value (History, the epoch table) can differ from the last batch's")


def _numbers(logs):
    """The numbers of Keras' logs by column, a vector's elements each in its own (`schema.number_columns`)."""
    return dict(pair for key, value in (logs or {}).items() for pair in schema.number_columns(key, value))


def _model_name(model):
    return getattr(model, "name", type(model).__name__)
