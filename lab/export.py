"""Exports of a Run for other tools: CSV files and TensorBoard event files.

TensorBoard files are written with TensorFlow's own summary op
(`tf.summary.write`, tagged for TensorBoard's scalar plugin), so they need no
`tensorboard` package to write; TensorBoard, `tf.data.TFRecordDataset` or
`tf.compat.v1.train.summary_iterator` read them. TensorFlow is imported only
when a TensorBoard file is written: CSV export needs no backend.
"""

import functools
import glob
import os

import numpy as np
import pandas as pd

from lab.run import Run

_TABLES = ("batches", "epochs", "events")
_INDEX = ("step", "epoch", "batch")


def _tensorflow():
    """TensorFlow, for writing TensorBoard files (imported here, not with the module)."""
    try:
        import tensorflow as tf
    except ImportError as error:
        raise ImportError(
            "TensorBoard event files are written with TensorFlow's summary writer, and TensorFlow is not "
            "installed: pip install tensorflow (CSV export, lab.export.to_csv, needs nothing)."
        ) from error
    return tf


@functools.cache
def _metadata():
    """The serialized SummaryMetadata of TensorBoard's scalar and text plugins: (scalar, text)."""
    from tensorflow.core.framework import summary_pb2  # TensorFlow's, imported when first written

    scalar = summary_pb2.SummaryMetadata(
        plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars"),
        data_class=summary_pb2.DATA_CLASS_SCALAR,
    ).SerializeToString()
    text = summary_pb2.SummaryMetadata(
        plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="text"),
        data_class=summary_pb2.DATA_CLASS_TENSOR,
    ).SerializeToString()
    return scalar, text


def to_csv(run, path, table="batches"):
    """Writes one table of a run to a CSV file (no index column; NaN as empty).

    Text cells (and column names) that a spreadsheet would run as a formula,
    those beginning with `=`, `+`, `-`, `@`, a tab or a carriage return, are
    written with a leading `'`, as OWASP advises; numeric columns are written
    as numbers, negative ones included.

    Args:
        run: `lab.Run`, the record to export.
        path: str or os.PathLike, the CSV file to write.
        table: str, `"batches"`, `"epochs"` or `"events"`.

    Returns:
        str, the path written. `pandas.read_csv(path)` reads it back.

    Example:

    ```python
    lab.export.to_csv(recorder.run, "lr-0.01.csv")
    ```
    """
    _check_run(run)
    if table not in _TABLES:
        raise ValueError(f"table must be one of {_TABLES}; got {table!r}.")
    path = os.fspath(path)
    frame = getattr(run, table)()
    safe = frame.rename(columns=lambda name: _neutralized(str(name)))
    for column in safe.columns:
        if not pd.api.types.is_numeric_dtype(safe[column].dtype):
            safe[column] = safe[column].map(_neutralized, na_action="ignore")
    safe.to_csv(path, index=False)
    return path


# Spreadsheets run a cell that begins with one of these as a formula (OWASP,
# "CSV Injection"): such text cells get a leading single quote.
_FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def _neutralized(value):
    if isinstance(value, str) and value.startswith(_FORMULA_STARTS):
        return "'" + value
    return value


def to_tensorboard(run, logdir, overwrite=False):
    """Writes a run as TensorBoard event files: scalars per step, events as text.

    Batch columns become tags `batch/<column>` at their `step`, epoch columns
    `epoch/<column>` at the step that ended the epoch (so both overlay on one
    step axis), and the run's events a text summary `events`. The event wall
    times are those of the export, not of training.

    Args:
        run: `lab.Run`, the record to export.
        logdir: str or os.PathLike, the folder for this run's event file
            (TensorBoard shows each folder under its `--logdir` as one run).
        overwrite: bool, delete event files already in `logdir` first;
            otherwise a folder that has some raises `FileExistsError`
            (TensorBoard would mix both).

    Returns:
        str, the path of the event file written.

    Raises:
        ImportError: TensorFlow is not installed (its summary writer writes
            the files).

    Example:

    ```python
    lab.export.to_tensorboard(recorder.run, "logs/lr-0.01")
    # then: tensorboard --logdir logs
    ```
    """
    _check_run(run)
    tf = _tensorflow()
    logdir = os.fspath(logdir)
    existing = glob.glob(os.path.join(logdir, "events.out.tfevents.*"))
    if existing and not overwrite:
        raise FileExistsError(
            f"{logdir!r} already holds TensorBoard event files ({len(existing)}); TensorBoard "
            "would show them mixed with this run. Export into an empty folder, or pass "
            "overwrite=True to delete them first."
        )
    for old in existing:
        os.remove(old)
    os.makedirs(logdir, exist_ok=True)
    writer = tf.summary.create_file_writer(logdir)
    # A traced summary op keeps the writer it saw at trace time: one function
    # per export, traced under this writer.
    write_series = tf.function(_write_series, autograph=False, reduce_retracing=True)
    try:
        with writer.as_default():
            _write_scalars(write_series, "batch", run.batches())
            _write_scalars(write_series, "epoch", run.epochs())
            events = run.events()
            if len(events):
                lines = [f"{kind}: {detail}" if detail else kind
                         for kind, detail in zip(events["kind"], events["detail"])]
                write_series(tf.constant("events"), tf.constant(lines),
                             tf.constant(events["step"].to_numpy(np.int64)), tf.constant(_metadata()[1]))
        writer.flush()
    finally:
        writer.close()
    written = sorted(set(glob.glob(os.path.join(logdir, "events.out.tfevents.*"))))
    return written[-1]


def _write_scalars(write_series, prefix, frame):
    import tensorflow as tf  # to_tensorboard imported it (or said how to install it)

    if "step" not in frame or not len(frame):
        return
    steps = tf.constant(frame["step"].to_numpy(np.int64))
    for column in frame.columns:
        values = frame[column]
        if column in _INDEX or not pd.api.types.is_numeric_dtype(values.dtype):
            continue
        write_series(tf.constant(f"{prefix}/{column}"),
                     tf.constant(values.to_numpy(np.float32)), steps, tf.constant(_metadata()[0]))


def _write_series(tag, values, steps, metadata):
    import tensorflow as tf  # to_tensorboard imported it (or said how to install it)

    # One graph loop per tag: an eager tf.summary call per value is several
    # times slower on long runs.
    def body(i):
        written = tf.summary.write(tag, values[i], step=steps[i], metadata=metadata)
        with tf.control_dependencies([written]):
            return i + 1

    tf.while_loop(lambda i: i < tf.shape(steps)[0], body, [tf.constant(0)])


def _check_run(run):
    if not isinstance(run, Run):
        raise TypeError(
            f"Expected a lab.Run; got {type(run).__name__}. Pass `recorder.run` "
            "(or `lab.Run.load(path)` for a saved run)."
        )
