"""Run-file helpers for subprocesses: lab/runfile.py alone, without TensorFlow.

    python run_files.py load CAP_MB REFERENCE FILE...   one JSON line per FILE
    python run_files.py save-forever TARGET ROWS        saves one run to TARGET until killed

`load` caps the address space (RLIMIT_AS) at CAP_MB before importing numpy or
h5py, loads REFERENCE (or nothing, for "-"), then each FILE, and prints its
outcome: "equal" (the same parts as REFERENCE), "loaded" (other parts),
"RunFileError" or the name of any other exception, with the message and the
seconds it took.
"""

import importlib.util
import json
import math
import os
import resource
import sys
import time

REPOSITORY = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def runfile_module():
    spec = importlib.util.spec_from_file_location(
        "runfile_alone", os.path.join(REPOSITORY, "lab", "runfile.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def plain(value):
    """A comparable form: NaN equal to NaN, arrays with their dtype."""
    import numpy as np

    if isinstance(value, np.ndarray):
        return (value.dtype.str, [plain(v) for v in value.tolist()])
    if isinstance(value, float) and math.isnan(value):
        return "NaN"
    if isinstance(value, dict):
        return [(k, plain(v)) for k, v in value.items()]
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def load(cap_mb, reference, files):
    cap = int(cap_mb) << 20
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    runfile = runfile_module()
    expected = None if reference == "-" else plain(list(runfile.load(reference)))
    for path in files:
        start = time.perf_counter()
        try:
            parts = runfile.load(path)
            outcome, message = ("equal" if plain(list(parts)) == expected else "loaded"), ""
        except runfile.RunFileError as error:
            outcome, message = "RunFileError", str(error)
        except BaseException as error:  # noqa: BLE001 - reported, the caller fails on it
            outcome, message = type(error).__name__, str(error)
        print(json.dumps({"path": path, "outcome": outcome, "message": message,
                          "seconds": time.perf_counter() - start}), flush=True)


class PlainRun:
    """What `runfile.save` reads of a run, made of pandas frames."""

    def __init__(self, rows):
        import numpy as np
        import pandas as pd

        steps = np.arange(rows)
        self.name = "killed while saving"
        self.metadata = {"rows": rows}
        self._batches = pd.DataFrame({
            "step": steps, "epoch": (steps // 100).astype(np.int32), "batch": (steps % 100).astype(np.int32),
            "mode": pd.array(["graph"] * rows, dtype="string"),
            "loss": np.linspace(2.0, 0.1, rows, dtype=np.float32),
            "grad_norm": np.linspace(1.0, 0.5, rows, dtype=np.float32)})
        self._epochs = pd.DataFrame({"epoch": [0], "step": [99], "loss": [1.0]})
        self._events = pd.DataFrame([{"step": 3, "kind": "mode", "detail": "graph", "time": 1.0}])

    def batches(self):
        return self._batches

    def epochs(self):
        return self._epochs

    def events(self):
        return self._events


def save_version_1(run, path):
    """Writes `run` as training-lab wrote run files before version 2: variable-length
    strings (in HDF5's global heap), a mask of missing strings, no digest."""
    import h5py
    import numpy as np
    import pandas as pd

    with h5py.File(path, "w") as f:
        f.attrs["format"] = "training-lab-run"
        f.attrs["version"] = 1
        f.attrs["name"] = str(run.name)
        f.attrs["metadata"] = json.dumps(run.metadata, default=str)
        f.attrs["written_by"] = json.dumps({"training-lab": "0.1.0"})
        for table in ("batches", "epochs", "events"):
            frame = getattr(run, table)()
            group = f.create_group(table)
            group.attrs["columns"] = json.dumps([str(c) for c in frame.columns])
            group.attrs["length"] = len(frame)
            for i, name in enumerate(frame.columns):
                values = frame[name]
                dtype = values.dtype
                kind = ("bool" if pd.api.types.is_bool_dtype(dtype) else "int" if pd.api.types.is_integer_dtype(dtype)
                        else "float" if pd.api.types.is_float_dtype(dtype) else "string")
                if kind == "string":
                    missing = values.isna().to_numpy(dtype=bool)
                    text = ["" if gone else str(v) for v, gone in zip(values, missing)]
                    dataset = group.create_dataset(f"c{i}", data=np.array(text, dtype=object),
                                                   dtype=h5py.string_dtype("utf-8"))
                    if missing.any():
                        group.create_dataset(f"m{i}", data=missing)
                else:
                    dataset = group.create_dataset(f"c{i}", data=values.to_numpy())
                dataset.attrs["kind"] = kind
    return str(path)


def save_forever(target, rows):
    runfile = runfile_module()
    run = PlainRun(int(rows))
    runfile.save(run, target)
    print("saved", flush=True)
    while True:
        runfile.save(run, target)


if __name__ == "__main__":
    command, *arguments = sys.argv[1:]
    if command == "load":
        load(arguments[0], arguments[1], arguments[2:])
    elif command == "save-forever":
        save_forever(*arguments)
    else:
        sys.exit(f"unknown command {command!r}")
