"""HDF5 files of a Run: atomic writes, validated reads, no pickles, no plugins."""

import json
import os
import tempfile

import numpy as np
import pandas as pd

FORMAT = "training-lab-run"
VERSION = 1


class RunFileError(ValueError):
    """A file that is not a readable run record."""


def _h5py():
    # HDF5 filter plugins are shared libraries loaded from HDF5_PLUGIN_PATH;
    # a run file never needs one, so none is loaded from the environment.
    os.environ["HDF5_PLUGIN_PATH"] = ""
    import h5py

    return h5py


def save(run, path):
    """Writes `run` to `path` (HDF5) through a temporary file and a rename.

    A crash during the write leaves any previous file at `path` intact.

    Returns:
        str, the path written.
    """
    h5py = _h5py()
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=".run-", suffix=".h5.tmp", dir=folder)
    os.close(handle)
    try:
        with h5py.File(temporary, "w") as f:
            f.attrs["format"] = FORMAT
            f.attrs["version"] = VERSION
            f.attrs["name"] = run.name
            f.attrs["metadata"] = json.dumps(run.metadata, default=str)
            _write_table(f.create_group("batches"), run.batches())
            _write_table(f.create_group("epochs"), run.epochs())
            _write_table(f.create_group("events"), run.events())
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise
    return path


def _write_table(group, frame):
    group.attrs["columns"] = json.dumps([str(c) for c in frame.columns])
    group.attrs["length"] = len(frame)
    for i, name in enumerate(frame.columns):
        values = frame[name]
        if values.dtype == object or str(values.dtype) == "string":
            data = np.array(["" if v is None or v is pd.NA else str(v) for v in values], dtype=object)
            dataset = group.create_dataset(f"c{i}", data=data.astype("S") if len(data) else np.zeros(0, "S1"))
            dataset.attrs["kind"] = "string"
        else:
            group.create_dataset(f"c{i}", data=values.to_numpy())
            group[f"c{i}"].attrs["kind"] = "number"


def load(path):
    """Reads a run written by `save`.

    Raises:
        RunFileError: the file is missing, truncated, or not a run record; the
            message names the file and what is wrong.
    """
    from lab.run import Run

    h5py = _h5py()
    path = os.fspath(path)
    if not os.path.exists(path):
        raise RunFileError(f"No run file at {path!r}.")
    try:
        f = h5py.File(path, "r")
    except OSError as error:
        raise RunFileError(
            f"{path!r} is not a readable HDF5 run file (truncated or another format): {error}"
        ) from None
    with f:
        if f.attrs.get("format") != FORMAT:
            raise RunFileError(
                f"{path!r} is an HDF5 file but not a training-lab run record "
                f"(format attribute {f.attrs.get('format')!r})."
            )
        if int(f.attrs.get("version", 0)) > VERSION:
            raise RunFileError(
                f"{path!r} was written by a newer training-lab (run file version "
                f"{int(f.attrs['version'])}; this one reads up to {VERSION}). Upgrade training-lab."
            )
        try:
            run = Run(name=str(f.attrs["name"]), metadata=json.loads(f.attrs["metadata"]))
            batches = _read_table(f["batches"])
            epochs = _read_table(f["epochs"])
            events = _read_table(f["events"])
        except (KeyError, OSError, ValueError) as error:
            raise RunFileError(f"{path!r} is damaged or incomplete: {error}") from None
    if len(batches):
        run.append_batches({c: batches[c].to_numpy() for c in batches.columns})
    run._epochs = epochs.to_dict("records")
    run._events = events.to_dict("records")
    return run


def _read_table(group):
    columns = json.loads(group.attrs["columns"])
    data = {}
    for i, name in enumerate(columns):
        dataset = group[f"c{i}"]
        values = dataset[()]
        if dataset.attrs.get("kind") == "string":
            values = np.array([v.decode() if isinstance(v, bytes) else str(v) for v in values], dtype=object)
        data[name] = values
    return pd.DataFrame(data, columns=columns)
