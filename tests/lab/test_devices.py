"""lab.devices, lab.virtual_cpus and lab.strategy in this (already initialised) process."""

import time

import pytest
import tensorflow as tf

import lab
from lab.backend.tensorflow.devices import batch_split, describe, strategy_choices


def test_devices_lists_what_tensorflow_sees():
    frame = lab.devices()
    assert list(frame.columns[:3]) == ["name", "type", "memory_bytes"]
    assert len(frame) == len(tf.config.list_logical_devices())
    assert "/device:CPU:0" in set(frame["name"])
    assert set(frame["type"]) <= {"CPU", "GPU", "TPU"}


def test_one_device_strategy_is_made_once():
    first = lab.strategy("cpu")
    assert isinstance(first, tf.distribute.OneDeviceStrategy)
    assert lab.strategy(" CPU:0 ") is first
    assert first.num_replicas_in_sync == 1


def test_a_strategy_passes_through():
    made = lab.strategy("cpu")
    assert lab.strategy(made) is made


@pytest.mark.parametrize("spec", ["banana", "gpu:", "cpu:0,0", "gpu:x", ""])
def test_malformed_specs_list_the_valid_forms(spec):
    with pytest.raises(ValueError, match="gpu|twice"):
        lab.strategy(spec)


def test_missing_device_names_what_was_found():
    count = len(tf.config.list_logical_devices("CPU"))
    with pytest.raises(ValueError, match=rf"CPU:{count}.*TensorFlow sees CPU:0"):
        lab.strategy(f"cpu:{count}")


@pytest.mark.skipif(bool(tf.config.list_logical_devices("GPU")), reason="a GPU is present")
def test_gpu_without_gpu_says_so():
    with pytest.raises(ValueError, match="GPU:0, but TensorFlow sees CPU:0"):
        lab.strategy("gpu")


@pytest.mark.skipif(len(tf.config.list_logical_devices("CPU")) > 1
                    or bool(tf.config.list_logical_devices("GPU")),
                    reason="several devices present")
def test_mirrored_on_one_cpu_points_to_virtual_cpus():
    with pytest.raises(ValueError, match=r"lab.virtual_cpus\(2\)"):
        lab.strategy("mirrored")


@pytest.mark.skipif(bool(tf.config.list_logical_devices("TPU")), reason="a TPU is present")
def test_tpu_without_tpu_fails_fast_with_tensorflows_error():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="No TPU could be initialised.*TensorFlow said") as caught:
        lab.strategy("tpu")
    # No search for a TPU over the network (`tpu="local"`), whose retries take
    # many minutes; TensorFlow's own failing set-up took up to 49 s on a loaded
    # two-core machine.
    assert time.monotonic() - start < 150
    assert caught.value.__cause__ is not None


def test_virtual_cpus_after_initialisation_says_restart():
    count = len(tf.config.list_logical_devices("CPU"))
    lab.virtual_cpus(count)  # the split in force: allowed, a re-run cell must not fail
    with pytest.raises(RuntimeError, match="Restart the kernel.*first"):
        lab.virtual_cpus(count + 1)


@pytest.mark.parametrize("n", [0, -1, 1.5, "2", True])
def test_virtual_cpus_needs_a_positive_integer(n):
    with pytest.raises(ValueError, match="positive integer"):
        lab.virtual_cpus(n)


def test_bad_tf_config_is_explained(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", '{"cluster": {}}')
    with pytest.raises(ValueError, match="TF_CONFIG is not a multi-worker configuration"):
        lab.strategy("multiworker")
    monkeypatch.setenv("TF_CONFIG", '{"cluster": {"worker": ["127.0.0.1:1"]}, "task": {"type": "worker", "index": 3}}')
    with pytest.raises(ValueError, match="task index 3"):
        lab.strategy("multiworker")


def test_choices_are_all_accepted():
    choices = strategy_choices()
    assert "cpu" in choices
    for spec in choices:
        if spec not in ("tpu", "multiworker"):
            assert isinstance(lab.strategy(spec), tf.distribute.Strategy)


def test_describe_names_replicas_and_devices():
    text = describe(lab.strategy("cpu"))
    assert text == "OneDeviceStrategy: 1 replica on CPU:0"


def test_batch_split_of_one_device_and_bad_sizes():
    split = batch_split(lab.strategy("cpu"), 32)
    assert split[["device", "examples"]].values.tolist() == [["CPU:0", 32]]
    with pytest.raises(ValueError, match="positive integer"):
        batch_split(lab.strategy("cpu"), 0)


def test_recorder_works_under_a_one_device_strategy():
    import keras
    import numpy as np

    with lab.strategy("cpu").scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile(optimizer="sgd", loss="mse")
    recorder = lab.Recorder(gradients=True)
    x = np.ones((8, 4), "float32")
    model.fit(x, x[:, :2], batch_size=4, epochs=1, verbose=0, callbacks=[recorder])
    frame = recorder.run.batches()
    assert len(frame) == 2 and np.isfinite(frame["grad_norm"]).all()
