"""Run files: exact round trips, atomic writes, clear errors on bad files."""

import ast
import importlib.util
import inspect
import json
import os
import pickle
import subprocess
import sys
import time

import h5py
import keras
import numpy as np
import pandas as pd
import pytest
from pandas.testing import assert_frame_equal

import lab
from lab import runfile
from lab.runfile import RunFileError


def assert_same_run(loaded, saved):
    assert loaded.name == saved.name
    assert loaded.metadata == saved.metadata
    for table in ("batches", "epochs", "events"):
        assert_frame_equal(getattr(loaded, table)(), getattr(saved, table)(), check_exact=True)


def handmade_run():
    run = lab.Run("lr=0.01 ü", metadata={
        "optimizer_config": {"name": "SGD", "learning_rate": 0.01, "clipnorm": None, "nesterov": False},
        "tensorflow": "2.21.0", "steps": [1, 2], "started": "2026-11-29T11:00:00+0000",
        "summary": 'Model: "sequential"\n┏━━━━━━┳━━━━━━┓\n┃ dense ┃ (None, 3) ┃'})
    run.append_batches({
        "epoch": [0, 0, 0], "batch": [0, 1, 2], "seconds": [0.1, np.nan, 0.3],
        "mode": ["graph", "eager", "graph"],
        "loss": np.array([1.5, np.nan, np.inf], np.float32),
    })
    # A column that appears later (earlier rows missing) and a row without mode.
    run.append_batches({"epoch": [1], "batch": [0], "seconds": [0.2],
                        "loss": [-np.inf], "grad_norm/dense/kernel": [0.5]})
    run.append_epoch(0, {"loss": 1.0, "val_loss": 2.0})
    run.append_epoch(1, {"loss": 0.5})
    run.add_event("mode", "graph -> eager", step=1)
    run.add_event("interrupt", "KeyboardInterrupt — ü")
    return run


def tiny_model():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", metrics=["mae"])
    return model


def data(n=32, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 4)).astype("float32"), rng.normal(size=(n, 1)).astype("float32")


def test_round_trip_keeps_values_dtypes_nans_strings_and_metadata(tmp_path):
    run = handmade_run()
    path = run.save(tmp_path / "run.h5")
    loaded = lab.Run.load(path)
    assert_same_run(loaded, run)
    frame = loaded.batches()
    assert frame["mode"].isna().tolist() == [False, False, False, True]
    assert np.isnan(frame["grad_norm/dense/kernel"][:3]).all()
    assert loaded.events()["detail"].iloc[-1] == "KeyboardInterrupt — ü"


def test_round_trip_of_an_empty_run(tmp_path):
    run = lab.Run("empty")
    loaded = lab.Run.load(run.save(tmp_path / "empty.h5"))
    assert_same_run(loaded, run)
    assert len(loaded) == 0


def test_round_trip_of_a_recorded_run_with_versions_and_start_time(tmp_path):
    x, y = data()
    recorder = lab.Recorder(gradients=True)
    tiny_model().fit(x, y, batch_size=8, epochs=2, validation_split=0.25, verbose=0,
                     callbacks=[recorder])
    run = recorder.run
    loaded = lab.Run.load(run.save(tmp_path / "recorded.h5"))
    assert_same_run(loaded, run)
    assert loaded.metadata[lab.backend.NAME] and loaded.metadata["keras"] == keras.__version__
    assert "created" in loaded.metadata
    assert "val_loss" in loaded.epochs()
    assert any(c.startswith("grad_norm/") for c in loaded.batches())


def test_a_loaded_run_keeps_growing(tmp_path):
    run = handmade_run()
    loaded = lab.Run.load(run.save(tmp_path / "run.h5"))
    loaded.append_batches({"epoch": [2], "batch": [0], "loss": [0.25]})
    assert loaded.batches()["step"].tolist() == [0, 1, 2, 3, 4]
    assert loaded.batches()["loss"].iloc[-1] == 0.25


@pytest.mark.parametrize("failure", [OSError("disk full"), KeyboardInterrupt()])
def test_a_crash_during_save_leaves_the_previous_file_intact(tmp_path, monkeypatch, failure):
    path = tmp_path / "run.h5"
    previous = handmade_run()
    previous.save(path)
    before = path.read_bytes()

    def crash(*args, **kwargs):
        # By now the temporary file exists and is half written.
        assert [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]
        raise failure

    monkeypatch.setattr(runfile, "_write_table", crash)
    bigger = handmade_run()
    bigger.append_batches({"loss": [9.0]})
    with pytest.raises(type(failure)):
        bigger.save(path)

    assert path.read_bytes() == before
    assert_same_run(lab.Run.load(path), previous)
    assert os.listdir(tmp_path) == ["run.h5"]


def test_save_replaces_the_file_and_gives_it_ordinary_permissions(tmp_path):
    path = tmp_path / "run.h5"
    handmade_run().save(path)
    newer = lab.Run("newer")
    newer.save(path)
    assert lab.Run.load(path).name == "newer"
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(path).st_mode & 0o777 == 0o666 & ~umask


@pytest.mark.parametrize("keep", [0.1, 0.5, 0.9, -16])
def test_a_truncated_file_raises_a_clear_error(tmp_path, keep):
    whole = handmade_run().save(tmp_path / "whole.h5")
    content = open(whole, "rb").read()
    cut = tmp_path / "cut.h5"
    cut.write_bytes(content[: int(len(content) * keep)] if keep > 0 else content[:keep])
    with pytest.raises(RunFileError, match="cut.h5") as caught:
        lab.Run.load(cut)
    assert "truncated" in str(caught.value) or "damaged" in str(caught.value)


def test_a_foreign_hdf5_file_raises_a_clear_error(tmp_path):
    path = tmp_path / "weights.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("kernel", data=np.ones((2, 2)))
    with pytest.raises(RunFileError, match="weights.h5.*not a training-lab run record"):
        lab.Run.load(path)


@pytest.mark.parametrize("content", [b"", b"step,loss\n0,1.0\n", b"\x89HDF\r\n\x1a\n" + b"\0" * 8])
def test_a_file_that_is_not_hdf5_raises_a_clear_error(tmp_path, content):
    path = tmp_path / "run.h5"
    path.write_bytes(content)
    with pytest.raises(RunFileError, match=r"run\.h5.*not a readable HDF5 file"):
        lab.Run.load(path)


def test_a_missing_file_or_a_folder_raises_a_clear_error(tmp_path):
    with pytest.raises(RunFileError, match="No run file at .*absent.h5"):
        lab.Run.load(tmp_path / "absent.h5")
    with pytest.raises(RunFileError, match="not a file"):
        lab.Run.load(tmp_path)


def test_a_run_file_with_a_missing_table_is_reported_damaged(tmp_path):
    path = handmade_run().save(tmp_path / "run.h5")
    with h5py.File(path, "a") as f:
        del f["events"]
    with pytest.raises(RunFileError, match="run.h5.*damaged"):
        lab.Run.load(path)


def test_a_column_of_the_wrong_length_is_reported_damaged(tmp_path):
    path = handmade_run().save(tmp_path / "run.h5")
    with h5py.File(path, "a") as f:
        del f["batches/c5"]
        f["batches"].create_dataset("c5", data=np.zeros(2, np.float32)).attrs["kind"] = "float"
    with pytest.raises(RunFileError, match="column 'loss' of table 'batches'.*damaged"):
        lab.Run.load(path)


def test_a_file_from_a_newer_version_asks_for_an_upgrade(tmp_path):
    path = handmade_run().save(tmp_path / "run.h5")
    with h5py.File(path, "a") as f:
        f.attrs["version"] = runfile.VERSION + 1
    with pytest.raises(RunFileError, match="newer training-lab.*Upgrade"):
        lab.Run.load(path)


def test_a_dataset_that_needs_a_filter_plugin_is_refused_without_loading_plugins(tmp_path):
    path = handmade_run().save(tmp_path / "run.h5")
    with h5py.File(path, "a") as f:
        del f["batches/c5"]
        # A third-party filter id, as a plugin-compressed dataset would carry.
        plist = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        plist.set_chunk((4,))
        plist.set_filter(32001, h5py.h5z.FLAG_OPTIONAL, ())
        space = h5py.h5s.create_simple((4,))
        dataset = h5py.Dataset(h5py.h5d.create(f["batches"].id, b"c5", h5py.h5t.NATIVE_FLOAT,
                                               space, dcpl=plist))
        dataset[...] = np.zeros(4, np.float32)
        dataset.attrs["kind"] = "float"
    search_path = [h5py.h5pl.get(i) for i in range(h5py.h5pl.size())]
    with pytest.raises(RunFileError, match="filter 32001.*plugin"):
        lab.Run.load(path)
    # The user's own HDF5 plugin path is back as it was.
    assert [h5py.h5pl.get(i) for i in range(h5py.h5pl.size())] == search_path


def test_loading_never_unpickles(tmp_path, monkeypatch):
    run = handmade_run()
    path = run.save(tmp_path / "run.h5")

    def refuse(*args, **kwargs):
        raise AssertionError("a run file was unpickled")

    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    assert_same_run(lab.Run.load(path), run)


def test_recorder_path_saves_a_loadable_file_after_the_first_epoch(tmp_path):
    path = tmp_path / "live.h5"
    seen = {}

    class ReadDuringEpochTwo(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 1:
                seen["run"] = lab.Run.load(path)

    x, y = data()
    recorder = lab.Recorder(path=str(path))
    tiny_model().fit(x, y, batch_size=8, epochs=3, verbose=0,
                     callbacks=[recorder, ReadDuringEpochTwo()])
    during = seen["run"]
    assert len(during) == 4 and during.batches()["epoch"].tolist() == [0, 0, 0, 0]
    assert during.epochs()["epoch"].tolist() == [0]
    final = lab.Run.load(path)
    assert len(final) == 12 and final.epochs()["epoch"].tolist() == [0, 1, 2]
    assert_same_run(final, recorder.run)


def test_recorder_save_every_writes_the_file_before_the_first_epoch_ends(tmp_path):
    path = tmp_path / "timer.h5"
    seen = []

    class ReadAfterBatchTwo(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 1:
                seen.append(lab.Run.load(path))

    x, y = data()
    recorder = lab.Recorder(path=path, save_every=0, flush_every=0)
    tiny_model().fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[recorder, ReadAfterBatchTwo()])
    assert len(seen[0]) == 2 and len(seen[0].epochs()) == 0


# ---- files from anyone ------------------------------------------------------------

def rewrite_attribute(path, name, value, where="/"):
    with h5py.File(path, "a") as f:
        f[where].attrs[name] = value


@pytest.mark.parametrize("name, value, message", [
    ("version", "abc", r"'version' attribute of the file is 'abc', not an integer"),
    ("version", np.array([1, 2]), r"'version' attribute of the file is not a single value"),
    ("version", 0, r"version is 0"),
    ("metadata", "[1, 2]", r"'metadata' attribute of the file is '\[1, 2\]', not a JSON object"),
    ("metadata", "{not json", r"'metadata' attribute of the file is not valid JSON"),
    ("name", 7, r"'name' attribute of the file is an integer, not a string"),
])
def test_a_foreign_or_damaged_header_raises_the_run_file_error_naming_the_file(tmp_path, name, value, message):
    path = handmade_run().save(tmp_path / "run.h5")
    rewrite_attribute(path, name, value)
    with pytest.raises(lab.RunFileError, match=rf"run\.h5.*{message}"):
        lab.Run.load(path)


def test_a_string_step_column_is_refused(tmp_path):
    run = lab.Run()
    run.append_batches({"loss": [1.0, 2.0]})
    path = run.save(tmp_path / "run.h5")
    with h5py.File(path, "a") as f:
        step = json.loads(f["batches"].attrs["columns"]).index("step")
        del f[f"batches/c{step}"]
        f["batches"].create_dataset(f"c{step}", data=np.array(["0", "1"], dtype=object),
                                    dtype=h5py.string_dtype()).attrs["kind"] = "string"
    with pytest.raises(lab.RunFileError, match=r"run\.h5.*column 'step'.*holds string values.*integers"):
        lab.Run.load(path)


def crafted_file(path, batches, epochs=(), events=()):
    """A run file with the given tables, as `runfile.save` writes them (digest
    included): only the loader's checks of the contents stand in its way."""
    tables = {"batches": pd.DataFrame(batches), "epochs": pd.DataFrame(list(epochs)),
              "events": pd.DataFrame(list(events))}
    record = type("Crafted", (), {"name": "crafted", "metadata": {},
                                  **{t: (lambda frame=frame: frame) for t, frame in tables.items()}})
    return runfile.save(record, path)


def test_unsigned_integer_columns_load_as_signed_and_the_run_keeps_growing(tmp_path):
    path = crafted_file(tmp_path / "run.h5", {
        "step": np.array([0, 1, 2], np.uint64), "batch": np.array([0, 1, 2], np.uint32),
        "flag": np.array([1, 0, 255], np.uint8), "loss": np.array([1.0, 2.0, 3.0], np.float32)})
    run = lab.Run.load(path)
    frame = run.batches()
    assert frame["flag"].tolist() == [1, 0, 255] and frame["step"].tolist() == [0, 1, 2]
    assert all(frame[c].dtype.kind == "i" for c in ("step", "batch", "flag"))
    run.append_batches({"loss": [4.0]})  # a row without `flag`: missing, as in any run
    assert run.batches()["step"].tolist() == [0, 1, 2, 3] and run.batches()["flag"].tolist()[-1] == -1


def test_an_unsigned_step_beyond_64_bit_signed_integers_is_refused(tmp_path):
    path = crafted_file(tmp_path / "run.h5", {"step": np.array([0, 2**64 - 1], np.uint64),
                                              "loss": np.array([1.0, 2.0], np.float32)})
    with pytest.raises(lab.RunFileError, match=r"run\.h5.*column 'step'.*18446744073709551615"):
        lab.Run.load(path)


@pytest.mark.parametrize("tables, message", [
    ({"batches": {"loss": [1.0, 2.0]}}, r"table 'batches' has 2 rows but no 'step' column"),
    ({"batches": {"step": [0]}, "epochs": [{"epoch": 0, "loss": 1.0}]},
     r"table 'epochs' has 1 row but no 'step' column"),
    ({"batches": {"step": [0]}, "events": [{"step": 0, "kind": "note", "detail": ""}]},
     r"table 'events' has 1 row but no 'time' column"),
])
def test_a_table_without_the_columns_every_run_writes_is_refused(tmp_path, tables, message):
    path = crafted_file(tmp_path / "run.h5", **tables)
    with pytest.raises(lab.RunFileError, match=rf"run\.h5.*{message}"):
        lab.Run.load(path)
    with pytest.raises(lab.RunFileError, match=message):
        lab.compare([path, path])  # was a raw KeyError: 'step' from a file that loaded


def test_a_step_no_run_reaches_is_refused_and_a_step_of_minus_one_loads(tmp_path):
    huge = crafted_file(tmp_path / "huge.h5", {"step": np.array([0, 1, 2**63 - 1], np.int64)})
    with pytest.raises(lab.RunFileError, match=r"huge\.h5.*column 'step'.*9223372036854775807.*overflow"):
        lab.Run.load(huge)  # loaded, its next step would have wrapped to -2**63
    run = lab.Run()
    run.add_event("note", "before the first step")  # at step -1
    run.append_batches({"loss": [1.0]})
    assert lab.Run.load(run.save(tmp_path / "early.h5")).events()["step"].tolist() == [-1]


def crafted_metadata_file(path, metadata):
    """A run file of one batch row whose metadata is `metadata`, digest included."""
    record = type("Crafted", (), {"name": "crafted", "metadata": metadata,
                                  "batches": lambda: pd.DataFrame({"step": [0], "loss": [1.0]}),
                                  "epochs": pd.DataFrame, "events": pd.DataFrame})
    return runfile.save(record, path)


@pytest.mark.parametrize("metadata, message", [
    ({"running_values": 5}, r"metadata 'running_values' is 5, not a list of strings"),
    ({"running_values": "loss"}, r"metadata 'running_values' is 'loss', not a list of strings"),
    ({"record_errors": [1]}, r"metadata 'record_errors' is \[1\], not a list of strings"),
    ({"told_regrouped": ["dense/kernel"]}, r"metadata 'told_regrouped' is \['dense/kernel'\], not a string"),
])
def test_metadata_the_lab_reads_back_of_the_wrong_type_is_refused(tmp_path, metadata, message):
    path = crafted_metadata_file(tmp_path / "run.h5", metadata)
    with pytest.raises(lab.RunFileError, match=rf"run\.h5.*{message}"):
        lab.Run.load(path)  # loaded, then schema.value_kind raised a raw TypeError: 'int' is not iterable
    free = crafted_metadata_file(tmp_path / "free.h5", {"model": 5, "running_values": ["loss"], "told_x": 1})
    assert lab.schema.value_kind(lab.Run.load(free), "loss") == lab.schema.RUNNING


def test_the_metadata_types_name_every_trace_note():
    pytest.importorskip("tensorflow", reason="the trace notes are the TensorFlow probe's")
    from lab.backend.tensorflow import probes
    assert set(probes.TRACE_NOTES) == set(lab.schema.TRACE_NOTE_KINDS)


def test_an_epoch_value_of_text_is_refused_and_numbers_load(tmp_path):
    text = crafted_file(tmp_path / "text.h5", {"step": [0, 1]}, epochs=[{"epoch": 0, "step": 1, "val_loss": "x"}])
    with pytest.raises(lab.RunFileError, match=r"text\.h5.*column 'val_loss' of table 'epochs' holds text"):
        lab.Run.load(text)  # loaded, then RunCompare failed on float("x")
    numbers = crafted_file(tmp_path / "numbers.h5", {"step": [0, 1]},
                           epochs=[{"epoch": 0, "step": 1, "val_loss": 0.5, "lr_drops": 2, "stopped": True}])
    assert lab.Run.load(numbers).epochs().iloc[0][["val_loss", "lr_drops"]].tolist() == [0.5, 2]


EVENT = {"step": 0, "kind": "note", "detail": "", "time": 1.7e9}


@pytest.mark.parametrize("change, message", [
    ({"time": "t"}, r"column 'time' of table 'events' holds string values"),
    ({"kind": 3}, r"column 'kind' of table 'events' holds int values"),
    ({"detail": 1.5}, r"column 'detail' of table 'events' holds float values"),
    ({"kind": None}, r"column 'kind' of table 'events' has missing values"),
    ({"time": float("nan")}, r"column 'time' of table 'events' holds nan, not a time"),
    ({"time": 1e300}, r"column 'time' of table 'events' holds 1e\+300, not a time"),
])
def test_an_events_column_of_the_wrong_type_is_refused(tmp_path, change, message):
    path = crafted_file(tmp_path / "run.h5", {"step": [0]}, events=[dict(EVENT, **change)])
    with pytest.raises(lab.RunFileError, match=rf"run\.h5.*{message}"):
        lab.Run.load(path)  # loaded, then widgets' report failed on time.localtime("t")


def test_events_as_a_run_adds_them_load_and_an_event_kind_is_kept_as_text(tmp_path):
    run = lab.Run()
    run.append_batches({"loss": [1.0]})
    run.add_event(7, "a kind that is no string")
    run.add_event(8, 3)  # every kind an int: saved as text, or the file would hold an int column
    events = lab.Run.load(run.save(tmp_path / "run.h5")).events()
    assert events["kind"].tolist() == ["7", "8"] and events["detail"].tolist() == ["a kind that is no string", "3"]
    assert lab.Run.load(crafted_file(tmp_path / "int_time.h5", {"step": [0]},
                                     events=[dict(EVENT, time=1700000000)])).events()["time"].tolist() == [1700000000]


def test_a_run_refuses_a_step_its_file_could_not_hold_when_it_is_given(tmp_path):
    run = lab.Run()
    with pytest.raises(ValueError, match=r"next_step is 9007199254740993, beyond 9007199254740992 \(2\*\*53\)"):
        run.next_step = 2**53 + 1  # was taken, and the run saved a file that load refuses
    with pytest.raises(ValueError, match=r"a batch row's step is 1152921504606846976, beyond 9007199254740992"):
        run.append_batches({"step": [0, 2**60], "loss": [1.0, 2.0]})
    with pytest.raises(ValueError, match=r"a batch row's step is -1152921504606846976, beyond"):
        run.append_batches({"step": [-2**60], "loss": [1.0]})
    with pytest.raises(ValueError, match=r"an event's step is 1152921504606846976, beyond"):
        run.add_event("note", step=2**60)
    assert len(run) == 0 and run.columns == [] and len(run.events()) == 0  # nothing went in
    run.next_step = 2**53
    run.append_batches({"loss": [1.0]})  # the last step a run holds
    with pytest.raises(ValueError, match=r"a batch row's step is 9007199254740993, beyond"):
        run.append_batches({"loss": [2.0]})
    assert len(run) == 1
    assert lab.Run.load(run.save(tmp_path / "run.h5")).batches()["step"].tolist() == [2**53]


def test_parts_that_make_no_run_raise_the_run_file_error_naming_the_file(tmp_path, monkeypatch):
    path = handmade_run().save(tmp_path / "run.h5")

    def unbuildable(cls, parts):
        raise OverflowError("Python integer -1 out of bounds for uint8")

    monkeypatch.setattr(lab.Run, "_from_parts", classmethod(unbuildable))
    with pytest.raises(lab.RunFileError, match=r"run\.h5.*cannot be made a run.*OverflowError"):
        lab.Run.load(path)


def test_a_changed_value_is_caught_by_the_digest(tmp_path):
    path = handmade_run().save(tmp_path / "run.h5")
    with h5py.File(path, "a") as f:
        f["batches/c5"][0] = 1.25  # the loss of step 0, was 1.5
    with pytest.raises(lab.RunFileError, match=r"run\.h5.*do not match the digest"):
        lab.Run.load(path)


def scripts():
    spec = importlib.util.spec_from_file_location(
        "run_files", os.path.join(os.path.dirname(__file__), "_scripts", "run_files.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_version_2_file_without_its_digest_is_refused(tmp_path):
    path = handmade_run().save(tmp_path / "run.h5")
    with h5py.File(path, "a") as f:
        del f.attrs["digest"]
    with pytest.raises(lab.RunFileError, match=r"run\.h5.*no 'digest' attribute"):
        lab.Run.load(path)


def test_a_version_1_file_loads_as_it_was_written(tmp_path):
    run = handmade_run()
    path = scripts().save_version_1(run, tmp_path / "old.h5")
    with h5py.File(path, "r") as f:
        assert f.attrs["version"] == 1 and "digest" not in f.attrs
    assert_same_run(lab.Run.load(path), run)


def test_a_version_2_file_has_nothing_variable_length(tmp_path):
    path = handmade_run().save(tmp_path / "run.h5")
    assert b"GCOL" not in open(path, "rb").read()  # no global heap: strings are codes and bytes
    with h5py.File(path, "r") as f:
        assert f.attrs["version"] == runfile.VERSION == 2


def test_run_file_error_is_exported_and_load_wants_a_path(tmp_path):
    assert lab.RunFileError is RunFileError and "RunFileError" in lab.__all__
    with pytest.raises(TypeError, match=r"needs a file path.*got int"):
        lab.Run.load(3)


def test_runfile_imports_nothing_of_the_run_it_reads_and_writes():
    tree = ast.parse(inspect.getsource(runfile))
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not {name for name in imported if name and (name == "lab" or name.startswith("lab."))}


def test_runfile_load_returns_plain_parts(tmp_path):
    parts = runfile.load(handmade_run().save(tmp_path / "run.h5"))
    assert isinstance(parts, runfile.RunParts) and isinstance(parts.batches["loss"], np.ndarray)


# ---- saving where it cannot go -----------------------------------------------------

def test_save_to_an_empty_path_a_folder_or_under_a_file_says_what_is_wrong(tmp_path):
    run = handmade_run()
    with pytest.raises(ValueError, match="needs a file name"):
        run.save("")
    with pytest.raises(IsADirectoryError, match="is a folder.*run.h5"):
        run.save(tmp_path)
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    with pytest.raises(NotADirectoryError, match=r"notes\.txt' is a file, not a folder"):
        run.save(a_file / "runs" / "run.h5")
    with pytest.raises(TypeError, match="needs a file path"):
        run.save(None)
    assert sorted(os.listdir(tmp_path)) == ["notes.txt"]


def test_the_next_save_removes_temporary_files_of_dead_writers_only(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = runfile._HOST
    left = {
        "dead": f".run-{host}-{dead.pid}-0123abcd.h5.tmp",
        "alive": f".run-{host}-{os.getppid()}-0123abcd.h5.tmp",
        "other_host": f".run-{'f' * 8 if host != 'f' * 8 else '0' * 8}-{dead.pid}-0123abcd.h5.tmp",
        "own_finished": f".run-{host}-{os.getpid()}-0123abcd.h5.tmp",
        "legacy_old": ".run-abcd1234.h5.tmp",
        "legacy_new": ".run-wxyz9876.h5.tmp",
        "unrelated": "notes.h5.tmp",
    }
    for name in left.values():
        (tmp_path / name).write_bytes(b"half")
    os.utime(tmp_path / left["legacy_old"], (0, time.time() - 2 * runfile._LEGACY_TEMPORARY_AGE))
    handmade_run().save(tmp_path / "run.h5")
    kept = set(os.listdir(tmp_path))
    assert kept == {"run.h5", left["alive"], left["other_host"], left["legacy_new"], left["unrelated"]}


# ---- CSV export ------------------------------------------------------------------

def test_csv_export_neutralises_formula_cells_and_keeps_numbers(tmp_path):
    run = lab.Run()
    run.append_batches({"loss": [-1.5, 2.0], "mode": ["=HYPERLINK(\"http://x\")", "graph"]})
    for detail in ["+1+1", "-2", "@SUM(A1)", "\tx", "plain", "a=b"]:
        run.add_event("note", detail)
    run.add_event("note", "\r=1")
    batches = pd.read_csv(lab.export.to_csv(run, tmp_path / "b.csv"))
    assert batches["loss"].tolist() == [-1.5, 2.0]  # a numeric column stays numeric, minus sign and all
    assert batches["mode"].tolist() == ["'=HYPERLINK(\"http://x\")", "graph"]
    events = pd.read_csv(lab.export.to_csv(run, tmp_path / "e.csv", table="events"), keep_default_na=False)
    assert events["detail"].tolist()[:6] == ["'+1+1", "'-2", "'@SUM(A1)", "'\tx", "plain", "a=b"]
    assert "'\r=1" in open(tmp_path / "e.csv", newline="").read()
