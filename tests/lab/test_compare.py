"""lab.compare and the CSV / TensorBoard exports."""

import collections

import numpy as np
import pandas as pd
import pytest

import lab
from lab import export


def made_run(name, losses, grad=False, epochs=()):
    run = lab.Run(name)
    columns = {"epoch": [0] * len(losses), "batch": list(range(len(losses))),
               "seconds": [0.01] * len(losses), "mode": ["graph"] * len(losses),
               "loss": np.array(losses, np.float32)}
    if grad:
        columns["grad_norm"] = np.array(losses, np.float32) * 10
    run.append_batches(columns)
    for epoch, logs in epochs:
        run.append_epoch(epoch, logs)
    return run


def read_events(path):
    """(tag, step, value) for every summary in a TensorBoard event file."""
    tf = pytest.importorskip("tensorflow", reason="TensorBoard files are written and read with TensorFlow")
    from tensorflow.core.util import event_pb2

    found = []
    for record in tf.data.TFRecordDataset(path):
        event = event_pb2.Event.FromString(record.numpy())
        for value in event.summary.value:
            array = tf.make_ndarray(value.tensor)
            found.append((value.tag, event.step, array.item() if array.dtype != object
                          else array.item().decode()))
    return found


def test_compare_aligns_runs_by_step_in_one_long_table():
    a = made_run("a", [1.0, 0.5, 0.25], grad=True)
    b = made_run("b", [2.0, 1.0])
    long = lab.compare([a, b])
    assert list(long.columns[:2]) == ["run", "step"]
    assert list(zip(long["run"], long["step"])) == [("a", 0), ("b", 0), ("a", 1), ("b", 1), ("a", 2)]
    assert long["loss"].tolist() == [1.0, 2.0, 0.5, 1.0, 0.25]
    # b recorded no gradients: NaN in its rows, values in a's.
    assert long.loc[long["run"] == "b", "grad_norm"].isna().all()
    assert long.loc[long["run"] == "a", "grad_norm"].tolist() == [10.0, 5.0, 2.5]
    wide = long.pivot(index="step", columns="run", values="loss")
    assert wide.loc[1].tolist() == [0.5, 1.0]


def test_a_rewound_and_replayed_step_is_compared_once_with_its_last_row():
    stepped = made_run("stepped", [1.0, 0.9, 0.8, 0.7])
    stepped.next_step = 2  # as Stepper.rewind(2) leaves it: steps 2 and 3 are taken again
    stepped.append_batches({"loss": np.array([0.6, 0.5], np.float32)})
    assert stepped.batches()["step"].tolist() == [0, 1, 2, 3, 2, 3]
    long = lab.compare([stepped, made_run("fit", [2.0, 1.0, 0.5, 0.25])])
    assert list(zip(long["run"], long["step"])) == [
        ("stepped", 0), ("fit", 0), ("stepped", 1), ("fit", 1),
        ("stepped", 2), ("fit", 2), ("stepped", 3), ("fit", 3)]
    wide = long.pivot(index="step", columns="run", values="loss")  # the docstring's example
    assert wide["stepped"].tolist() == pytest.approx([1.0, 0.9, 0.6, 0.5])


def test_compare_takes_a_dict_of_names_and_repeated_names_get_numbers():
    a, b = made_run("run", [1.0]), made_run("run", [2.0])
    assert lab.compare([a, b])["run"].tolist() == ["run", "run#2"]
    by_name = lab.compare({"lr=0.1": a, "lr=0.01": b})
    assert by_name["run"].tolist() == ["lr=0.1", "lr=0.01"]


def test_compare_reads_run_files_and_recorders(tmp_path):
    a = made_run("saved", [1.0, 2.0])
    path = a.save(tmp_path / "a.h5")
    recorder = lab.Recorder(run=made_run("live", [3.0]))
    long = lab.compare([path, recorder])
    assert sorted(set(long["run"])) == ["live", "saved"]


def test_compare_epochs_and_chosen_columns():
    a = made_run("a", [1.0, 0.5], epochs=[(0, {"loss": 0.75, "val_loss": 0.9})])
    b = made_run("b", [2.0], epochs=[(0, {"loss": 2.0})])
    long = lab.compare([a, b], table="epochs", columns=["val_loss"])
    assert list(long.columns) == ["run", "step", "val_loss"]
    assert long["step"].tolist() == [0, 1]  # b's epoch ended at step 0, a's at 1
    assert long["run"].tolist() == ["b", "a"]
    with pytest.raises(KeyError, match="accuracy.*available"):
        lab.compare([a, b], columns=["accuracy"])


def recorded(make, x, y):
    import keras

    model = make()
    recorder = lab.Recorder(gradients=True, weights=True)
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[recorder])
    return model, recorder.run


def test_the_same_model_built_again_is_compared_layer_by_layer_under_the_first_runs_names():
    # Keras numbers a model built again otherwise (dense_2 and dense_3 for
    # dense and dense_1): its gradient columns never met the first run's.
    import keras

    def make(width=8):
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(width, activation="relu"),
                                  keras.layers.Dense(3)])
        model.compile(keras.optimizers.Adam(0.01), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    from keras.src.backend.common import global_state

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 4)).astype("float32"), rng.integers(0, 3, 64)
    counters = global_state.get_global_attribute("object_name_uids", collections.defaultdict(int), set_to_default=True)
    counters.pop("dense", None)
    first, run_a = recorded(make, x, y)  # dense and dense_1
    counters["dense"] = 9  # as if other layers were made between: dense_9 and dense_10 ("dense_10" sorts first)
    again, run_b = recorded(make, x, y)
    paths_a = [v.path for v in first.trainable_variables]
    paths_b = [v.path for v in again.trainable_variables]
    assert [p.split("/")[1] for p in paths_a] == ["dense", "dense", "dense_1", "dense_1"]
    assert [p.split("/")[1] for p in paths_b] == ["dense_9", "dense_9", "dense_10", "dense_10"]
    long = lab.compare({"a": run_a, "b": run_b})
    assert long.attrs["matched_layers"] == {"b": dict(zip(paths_b, paths_a))}
    assert long.attrs["layers_named_as"] == "a"
    for prefix in ("grad_norm/", "weight_norm/", "update_ratio/"):
        for path_a, path_b in zip(paths_a, paths_b):
            assert prefix + path_b not in long
            for name, run, path in (("a", run_a, path_a), ("b", run_b, path_b)):
                np.testing.assert_array_equal(long.loc[long["run"] == name, prefix + path_a],
                                              run.batches()[prefix + path])
    assert long.pivot(index="step", columns="run", values=f"grad_norm/{paths_a[0]}").notna().all().all()
    # Each run's own paths on request, and an unknown column names the switch.
    own = lab.compare({"a": run_a, "b": run_b}, match_layers=False)
    assert f"grad_norm/{paths_b[0]}" in own and own.attrs["matched_layers"] == {}
    with pytest.raises(KeyError, match="match_layers=False"):
        lab.compare({"a": run_a, "b": run_b}, columns=[f"grad_norm/{paths_b[0]}"])
    # Another model (a third layer) keeps its own paths.
    def deeper():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(8),
                                  keras.layers.Dense(3)])
        model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    other, run_c = recorded(deeper, x, y)
    mixed = lab.compare({"a": run_a, "c": run_c})
    assert mixed.attrs["matched_layers"] == {}
    assert all(f"grad_norm/{v.path}" in mixed for v in other.trainable_variables)


def test_compare_rejects_bad_input_with_the_fix():
    with pytest.raises(TypeError, match="match_layers"):
        lab.compare([made_run("a", [1.0])], match_layers="yes")
    run = made_run("a", [1.0])
    with pytest.raises(TypeError, match="list"):
        lab.compare(run)
    with pytest.raises(ValueError, match="at least one run"):
        lab.compare([])
    with pytest.raises(TypeError, match="got DataFrame"):
        lab.compare([run.batches()])
    with pytest.raises(ValueError, match="table"):
        lab.compare([run], table="steps")


def test_to_csv_writes_a_table_pandas_reads_back(tmp_path):
    run = made_run("a", [1.0, np.nan, 0.1], epochs=[(0, {"loss": 0.5})])
    run.add_event("interrupt", "KeyboardInterrupt")
    path = export.to_csv(run, tmp_path / "a.csv")
    back = pd.read_csv(path)
    assert list(back.columns) == list(run.batches().columns)
    np.testing.assert_array_equal(back["loss"].to_numpy(np.float32), run.batches()["loss"].to_numpy())
    assert back["mode"].tolist() == ["graph"] * 3
    events = pd.read_csv(export.to_csv(run, tmp_path / "events.csv", table="events"))
    assert events["kind"].tolist() == ["interrupt"]
    with pytest.raises(TypeError, match="recorder.run"):
        export.to_csv(lab.Recorder(), tmp_path / "x.csv")


def test_to_tensorboard_writes_scalars_per_step_that_read_back(tmp_path):
    pytest.importorskip("tensorflow", reason="TensorBoard event files are written with TensorFlow")
    run = made_run("a", [1.0, 0.5, 0.25], grad=True, epochs=[(0, {"loss": 0.6, "val_loss": 0.7})])
    run.add_event("breakpoint", "loss > 0.9", step=0)
    path = export.to_tensorboard(run, tmp_path / "logs")
    found = read_events(path)
    loss = [(step, value) for tag, step, value in found if tag == "batch/loss"]
    assert loss == [(0, 1.0), (1, 0.5), (2, 0.25)]
    assert [(s, v) for t, s, v in found if t == "batch/grad_norm"] == [(0, 10.0), (1, 5.0), (2, 2.5)]
    assert [(s, round(v, 6)) for t, s, v in found if t == "epoch/val_loss"] == [(2, 0.7)]
    assert ("events", 0, "breakpoint: loss > 0.9") in found
    tags = {tag for tag, _, _ in found}
    assert not tags & {"batch/step", "batch/epoch", "batch/batch", "batch/mode"}


def test_to_tensorboard_refuses_to_mix_with_an_earlier_export(tmp_path):
    pytest.importorskip("tensorflow", reason="TensorBoard event files are written with TensorFlow")
    logdir = tmp_path / "logs"
    export.to_tensorboard(made_run("a", [1.0]), logdir)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        export.to_tensorboard(made_run("b", [2.0]), logdir)
    path = export.to_tensorboard(made_run("b", [2.0]), logdir, overwrite=True)
    assert len(list(logdir.iterdir())) == 1
    assert [v for t, s, v in read_events(path) if t == "batch/loss"] == [2.0]
