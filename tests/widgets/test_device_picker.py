"""DevicePicker: lists devices, builds the model under the chosen strategy, hands it on."""

import pytest
import tensorflow as tf

import lab
from widgets import DevicePicker


def test_lists_the_devices_and_the_choices_this_machine_has(comm_log, make_model):
    picker = DevicePicker(make_model)
    assert "/device:CPU:0" in picker.devices_table.value
    assert "cpu" in picker.dropdown.options
    if not tf.config.list_logical_devices("GPU"):
        assert "gpu" not in picker.dropdown.options
    assert picker.model is None and picker.strategy is None


def test_build_makes_the_model_under_the_strategy(comm_log, make_model, digits):
    built = []
    picker = DevicePicker(make_model, batch_size=32)
    picker.on_build(lambda model, strategy: built.append((model, strategy)))
    model = picker.build("cpu")
    assert picker.model is model and picker.strategy is lab.strategy("cpu")
    assert model.distribute_strategy is picker.strategy
    assert all(v.value.device.endswith("CPU:0") for v in model.weights)
    assert built == [(model, picker.strategy)]
    assert "OneDeviceStrategy: 1 replica on CPU:0" in picker.status.value
    assert "32 on CPU:0" in picker.status.value
    (x, y), _ = digits
    history = model.fit(x[:64], y[:64], batch_size=32, epochs=1, verbose=0)
    assert len(history.history["loss"]) == 1


def test_clicking_build_uses_the_selected_spec(comm_log, make_model):
    picker = DevicePicker(make_model, choices=["cpu"])
    picker.build_button.click()
    assert picker.strategy is lab.strategy("cpu") and picker.model is not None


def test_an_unavailable_choice_is_explained_in_the_panel(comm_log, make_model):
    picker = DevicePicker(make_model, choices=["cpu", "gpu:7"])
    picker.dropdown.value = "gpu:7"
    picker.build_button.click()  # a click has no caller: the panel says why
    assert picker.model is None
    assert "GPU:7" in picker.status.value and "TensorFlow sees" in picker.status.value
    with pytest.raises(ValueError, match="GPU:7"):
        picker.build()


def test_a_model_instead_of_a_factory_is_refused(make_model):
    with pytest.raises(TypeError, match="pass the factory, not a model"):
        DevicePicker(make_model())
