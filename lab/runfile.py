"""HDF5 files of a Run: atomic writes, validated reads, no pickles, no plugins.

Layout of a run file (format "training-lab-run", version 1):

- root attributes `format`, `version`, `name`, `metadata` (JSON) and
  `written_by` (JSON: package versions of the writer);
- groups `batches`, `epochs` and `events`, one per table. A group's `columns`
  attribute (JSON) lists the column names in order and `length` the rows;
  column i is the dataset `c<i>`, whose `kind` attribute is `int`, `float`,
  `bool` or `string`. Strings are UTF-8; a string column with missing values
  has a boolean dataset `m<i>` marking them.

Metadata is stored as JSON: tuples come back as lists and values JSON cannot
hold come back as their `str()`.
"""

import contextlib
import json
import os
import tempfile

import numpy as np
import pandas as pd

FORMAT = "training-lab-run"
VERSION = 1
_TABLES = ("batches", "epochs", "events")
# Filter ids below 256 are HDF5's own (deflate, shuffle, fletcher32, szip,
# nbit, scaleoffset); others come from plugins, which a run file never needs.
_FIRST_PLUGIN_FILTER = 256


class RunFileError(ValueError):
    """A file that is not a readable run record."""


def _h5py():
    import h5py

    return h5py


@contextlib.contextmanager
def _no_plugins(h5py):
    """Empties HDF5's plugin search path while a run file is open.

    HDF5 loads filter plugins (shared libraries) from this path when a dataset
    names a filter it lacks; a run file never needs one. The path is global,
    so it is restored afterwards for the user's other HDF5 files.
    """
    saved = [h5py.h5pl.get(i) for i in range(h5py.h5pl.size())]
    for _ in saved:
        h5py.h5pl.remove(0)
    try:
        yield
    finally:
        for _ in range(h5py.h5pl.size()):
            h5py.h5pl.remove(0)
        for entry in saved:
            h5py.h5pl.append(entry)


def save(run, path):
    """Writes `run` to `path` (HDF5) through a temporary file and a rename.

    A crash or an interrupt during the write leaves any previous file at
    `path` intact and no temporary file behind.

    Args:
        run: `lab.Run`, the record to write.
        path: str or os.PathLike, the file to (over)write.

    Returns:
        str, the path written.

    Example:

    ```python
    lab.runfile.save(recorder.run, "runs/lr-0.01.h5")
    ```
    """
    h5py = _h5py()
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=".run-", suffix=".h5.tmp", dir=folder)
    os.close(handle)
    try:
        # mkstemp makes the file private (0600); give it the permissions a
        # plainly created file would get.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(temporary, 0o666 & ~umask)
        with h5py.File(temporary, "w") as f:
            f.attrs["format"] = FORMAT
            f.attrs["version"] = VERSION
            f.attrs["name"] = str(run.name)
            f.attrs["metadata"] = json.dumps(run.metadata, default=str)
            f.attrs["written_by"] = json.dumps(_writer_versions())
            for table in _TABLES:
                _write_table(f.create_group(table), getattr(run, table)(), h5py)
        # The rename must not reach the disk before the data it points at.
        descriptor = os.open(temporary, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(temporary)
        raise
    return path


def _writer_versions():
    import h5py

    import lab

    return {"training-lab": lab.__version__, "h5py": h5py.__version__,
            "numpy": np.__version__, "pandas": pd.__version__}


def _write_table(group, frame, h5py):
    group.attrs["columns"] = json.dumps([str(c) for c in frame.columns])
    group.attrs["length"] = len(frame)
    for i, name in enumerate(frame.columns):
        values = frame[name]
        kind = _kind(values)
        if kind == "string":
            missing = values.isna().to_numpy(dtype=bool)
            text = ["" if gone else str(v) for v, gone in zip(values, missing)]
            dataset = group.create_dataset(
                f"c{i}", data=np.array(text, dtype=object), dtype=h5py.string_dtype("utf-8"))
            if missing.any():
                group.create_dataset(f"m{i}", data=missing)
        else:
            dataset = group.create_dataset(f"c{i}", data=values.to_numpy())
        dataset.attrs["kind"] = kind


def _kind(values):
    dtype = values.dtype
    if pd.api.types.is_bool_dtype(dtype):
        return "bool"
    if pd.api.types.is_integer_dtype(dtype):
        return "int"
    if pd.api.types.is_float_dtype(dtype):
        return "float"
    return "string"


def load(path):
    """Reads a run written by `save`.

    Args:
        path: str or os.PathLike, a file written by `Run.save`.

    Returns:
        `lab.Run` whose `batches()`, `epochs()`, `events()`, `name` and
        `metadata` equal those of the run that was saved.

    Raises:
        RunFileError: the file is missing, truncated, or not a run record; the
            message names the file and what is wrong.

    Example:

    ```python
    run = lab.Run.load("runs/lr-0.01.h5")
    ```
    """
    h5py = _h5py()
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise RunFileError(f"No run file at {path!r}: it does not exist or is not a file.")
    with _no_plugins(h5py):
        try:
            f = h5py.File(path, "r")
        except OSError as error:
            raise RunFileError(
                f"{path!r} is not a readable HDF5 file (truncated, or another format): {error}. "
                "Run files are written by `run.save(path)` or `lab.Recorder(path=...)`."
            ) from None
        with f:
            _check_header(f, path)
            try:
                name = str(f.attrs["name"])
                metadata = json.loads(f.attrs["metadata"])
                tables = {table: _read_table(f[table], path) for table in _TABLES}
            except RunFileError:
                raise
            except (KeyError, OSError, ValueError, TypeError, RuntimeError) as error:
                raise RunFileError(
                    f"{path!r} is a damaged or incomplete run file ({type(error).__name__}: {error})."
                ) from None
    return _restore(name, metadata, tables)


def _check_header(f, path):
    found = f.attrs.get("format")
    if isinstance(found, bytes):
        found = found.decode("utf-8", "replace")
    if found != FORMAT:
        raise RunFileError(
            f"{path!r} is an HDF5 file but not a training-lab run record "
            f"(its `format` attribute is {found!r}, expected {FORMAT!r})."
        )
    version = int(f.attrs.get("version", 0))
    if version > VERSION:
        raise RunFileError(
            f"{path!r} was written by a newer training-lab (run file version "
            f"{version}; this one reads up to {VERSION}). Upgrade training-lab."
        )


def _read_table(group, path):
    columns = json.loads(group.attrs["columns"])
    length = int(group.attrs["length"])
    data = {}
    for i, name in enumerate(columns):
        dataset = group[f"c{i}"]
        where = f"column {name!r} of table {group.name.strip('/')!r}"
        plist = dataset.id.get_create_plist()
        for k in range(plist.get_nfilters()):
            code = plist.get_filter(k)[0]
            if code >= _FIRST_PLUGIN_FILTER:
                raise RunFileError(
                    f"{path!r}: {where} needs HDF5 filter {code}, which only a plugin "
                    "provides; run files use none and plugins are never loaded."
                )
        if dataset.shape != (length,):
            raise RunFileError(
                f"{path!r}: {where} has shape {dataset.shape}, expected ({length},); "
                "the file is damaged."
            )
        kind = dataset.attrs.get("kind")
        if kind == "string":
            values = np.array(dataset.asstr()[()], dtype=object) if length else np.empty(0, object)
            if f"m{i}" in group:
                values[group[f"m{i}"][()]] = None
        elif kind in ("int", "float", "bool"):
            values = dataset[()]
            if values.dtype.kind not in "iufb":
                raise RunFileError(f"{path!r}: {where} holds {values.dtype}, not numbers.")
        else:
            raise RunFileError(f"{path!r}: {where} has unknown kind {kind!r}.")
        data[name] = values
    return data


def _restore(name, metadata, tables):
    """Builds a Run holding exactly the rows read (dtypes included)."""
    from lab.run import Run, _Column

    run = Run(name=name, metadata=metadata)
    batches = tables["batches"]
    length = len(next(iter(batches.values()))) if batches else 0
    for column_name, values in batches.items():
        column = _Column(values.dtype, length)
        column.data[:length] = values
        run._columns[column_name] = column
    run._length = length
    if length and "step" in batches:
        run._next_step = int(batches["step"][-1]) + 1
    run._epochs = _records(tables["epochs"])
    run._events = _records(tables["events"])
    return run


def _records(columns):
    """Rows as dicts of plain Python values, as `Run` stores epochs and events."""
    length = len(next(iter(columns.values()))) if columns else 0
    plain = {name: values.tolist() for name, values in columns.items()}
    return [{name: values[i] for name, values in plain.items()} for i in range(length)]
