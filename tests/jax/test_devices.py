"""Devices on JAX: the device table, virtual CPUs (before JAX starts; a
clear error after), and data-parallel training over two virtual CPUs recorded
exactly as bare Keras trains it, each case in a process of its own."""

import subprocess
import sys

import pytest

import lab

DATA_PARALLEL = r"""
import os, sys
os.environ["KERAS_BACKEND"] = "jax"
sys.path.insert(0, {tests!r})
import lab
assert lab.virtual_cpus(2) == 2
import keras, numpy as np
from jax_models import classification_data, make_mlp
print("devices", list(lab.devices()["name"]))
x, y = classification_data()
distribution = lab.strategy("cpu:0,1")
with distribution.scope():
    bare = make_mlp()
    bare.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
with distribution.scope():
    model = make_mlp()
    recorder = lab.Recorder(gradients=True, weights=True)
    model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0, callbacks=[recorder])
same = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
           zip(model.weights + model.optimizer.variables, bare.weights + bare.optimizer.variables))
print("same", same)
print("rows", len(recorder.run), int(np.isfinite(recorder.run.batches()["grad_norm"]).all()))
print("sharded", len(model.weights[0].value.sharding.device_set))
try:
    lab.virtual_cpus(4)
except RuntimeError as error:
    print("late", str(error).split(".")[0])
"""


def test_data_parallel_over_two_virtual_cpus_is_recorded_as_bare_keras_trains(tmp_path):
    import pathlib

    script = DATA_PARALLEL.format(tests=str(pathlib.Path(__file__).parent))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = dict(line.split(" ", 1) for line in done.stdout.strip().splitlines())
    assert out["devices"] == "['cpu:0', 'cpu:1']"
    assert out["same"] == "True"
    assert out["rows"] == "12 1"
    assert out["sharded"] == "2"
    assert out["late"] == "JAX has already started with 2 CPU device(s), and the number is fixed once it starts"


def test_the_device_table_lists_jax_devices():
    table = lab.devices()
    assert list(table.columns) == ["name", "type", "memory_bytes", "description"]
    assert table["name"].iloc[0].startswith("cpu:") and (table["type"] == "CPU").all()


@pytest.mark.parametrize("spec, message", [
    ("multiworker", "jax.distributed.initialize"),
    ("gpu", "no GPU for JAX"),
    ("cpu:7", "no CPU device 7; this machine has cpu:0"),
    ("fast", "Unknown strategy spec 'fast'; on Keras' JAX backend use one of 'cpu'"),
])
def test_a_spec_this_backend_or_machine_does_not_have_is_refused_naming_what_it_has(spec, message):
    with pytest.raises(ValueError, match=message):
        lab.strategy(spec)


def test_virtual_cpus_refuses_a_bad_count_at_the_call():
    with pytest.raises(ValueError, match="whole number of devices"):
        lab.virtual_cpus(0)


def test_the_device_picker_builds_the_model_under_a_data_parallel_distribution():
    import widgets
    from jax_models import make_mlp

    picker = widgets.DevicePicker(make_mlp, batch_size=64)
    assert "cpu" in picker.dropdown.options
    model = picker.build("cpu")
    assert model is picker.model and "DataParallel: 1 device (cpu:0)" in picker.status.value
    assert "64 on cpu:0" in picker.status.value
