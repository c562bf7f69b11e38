"""A run recorded on JAX and one recorded on TensorFlow (`data/mlp_tensorflow.h5`,
written by `data/record_on_tensorflow.py`) of the same model: the same
columns, both loadable, comparable and exportable side by side."""

import pathlib

import numpy as np

import lab
from jax_models import classification_data, named_mlp

RECORDED_ON_TENSORFLOW = pathlib.Path(__file__).with_name("data") / "mlp_tensorflow.h5"


def _on_jax():
    x, y = classification_data()
    recorder = lab.Recorder(gradients=True, weights=True)
    named_mlp().fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0, validation_split=0.25,
                    callbacks=[recorder])
    return recorder.run


def test_the_same_model_gives_the_same_columns_on_both_backends(tmp_path):
    theirs = lab.Run.load(RECORDED_ON_TENSORFLOW)
    ours = lab.Run.load(_on_jax().save(tmp_path / "mlp_jax.h5"))
    assert theirs.metadata["backend"] == "tensorflow" and ours.metadata["backend"] == "jax"
    assert sorted(ours.batches().columns) == sorted(theirs.batches().columns)
    assert sorted(ours.epochs().columns) == sorted(theirs.epochs().columns)
    assert len(ours) == len(theirs) == 10
    assert np.isfinite(ours.batches()["loss"]).all() and np.isfinite(theirs.batches()["loss"]).all()


def test_runs_from_both_backends_compare_and_export_together(tmp_path):
    theirs = lab.Run.load(RECORDED_ON_TENSORFLOW)
    both = lab.compare({"tensorflow": theirs, "jax": _on_jax()})
    assert set(both["run"]) == {"tensorflow", "jax"}
    assert {"grad_norm/mlp/hidden/kernel", "loss", "accuracy"} <= set(both.columns)
    written = lab.export.to_csv(theirs, tmp_path / "tf.csv")
    assert pathlib.Path(written if written else tmp_path / "tf.csv").exists()
