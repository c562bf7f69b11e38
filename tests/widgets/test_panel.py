"""widgets.Lab: one panel; Run trains in the background; a breakpoint opens the stepper."""

import ipywidgets
import keras
import numpy as np
import pytest

import widgets

RNG = np.random.default_rng(0)
X = RNG.random((64, 6), dtype=np.float32)
Y = RNG.integers(0, 3, 64).astype(np.int32)
BATCHES = 8  # per epoch at batch_size=8
TIMEOUT = 120


def make_model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(3)])
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.fixture
def panels():
    """Panels made by a test; any training left running is stopped and joined."""
    made = []

    def make(model=None, data=(X, Y), **kwargs):
        kwargs.setdefault("batch_size", 8)
        kwargs.setdefault("shuffle", False)
        panel = widgets.Lab(model if model is not None else make_model(), data, **kwargs)
        made.append(panel)
        return panel

    yield make
    for panel in made:
        panel.stop()
        assert panel.training is None or panel.training.join(TIMEOUT)


def test_one_panel_holds_the_four_views_under_tabs(panels):
    panel = panels()
    assert isinstance(panel.tabs, ipywidgets.Tab)
    assert panel.tabs.titles == ("Training", "Modes", "Stepper", "Devices")
    training, modes, _stepper, devices = panel.tabs.children
    assert training is panel.dashboard.widget
    assert isinstance(modes, widgets.ModeSwitch) and modes.model is panel.model
    assert "<table" in devices.value  # no build function: the device list
    assert panel.state == "idle" and not panel.run_button.disabled
    assert panel.pause_button.disabled and panel.continue_button.disabled and panel.stop_button.disabled


def test_run_trains_in_the_background_and_wait_returns_when_done(panels):
    panel = panels(epochs=2)
    panel.run_button.click()
    assert panel.state in ("running", "finished")
    assert panel.wait(TIMEOUT)
    assert panel.state == "finished"
    frame = panel.run.batches()
    assert len(frame) == 2 * BATCHES and np.isfinite(frame["loss"]).all()
    assert any(c.startswith("grad_norm/") for c in frame.columns)
    assert not panel.run_button.disabled and panel.stop_button.disabled
    assert "Lab (finished)" in panel.summary() and f"{2 * BATCHES} steps" in panel.summary()


def test_a_second_run_continues_the_same_record(panels):
    panel = panels(epochs=1)
    panel.start().wait(TIMEOUT)
    panel.start().wait(TIMEOUT)
    assert list(panel.run.batches()["step"]) == list(range(2 * BATCHES))


def test_after_training_the_panel_output_shows_the_final_static_charts(panels, displayed):
    outputs = displayed
    panel = panels(epochs=1)
    panel._ipython_display_()
    assert "(idle), 0 steps" in outputs[0].shown[0]["text/html"]
    panel.start().wait(TIMEOUT)
    assert len(outputs) == 1  # the panel's one output; the Dashboard inside it made none
    final = outputs[0].shown[-1]
    assert f"(finished), {BATCHES} steps" in final["text/html"] and "<svg" in final["text/html"]
    assert "Dashboard (finished)" in final["text/plain"]


def test_pause_and_continue_buttons(panels):
    panel = panels(epochs=1000)
    panel.start()
    panel.pause_button.click()
    assert panel.wait(TIMEOUT) and panel.state == "paused"
    done = len(panel.run)
    assert not panel.continue_button.disabled and panel.pause_button.disabled
    assert not panel.wait(0.3) or panel.state == "paused"
    assert len(panel.run) == done  # parked: no batch ran meanwhile
    with pytest.raises(RuntimeError, match="training already"):
        panel.start()
    panel.continue_button.click()
    assert panel.state == "running"
    panel.stop_button.click()
    assert panel.training.join(TIMEOUT) and panel.state == "stopped"
    assert len(panel.run) > done


def test_a_nonfinite_batch_pauses_training_and_opens_the_stepper_on_it(panels):
    x = X.copy()
    x[3 * 8 + 2, 0] = np.nan  # one value in batch 3
    model = make_model()
    panel = widgets.Lab(model, (x, Y), batch_size=8, epochs=1, shuffle=False)
    try:
        panel.start()
        assert panel.wait(TIMEOUT) and panel.state == "paused"
        assert "nonfinite" in panel.training.detail
        assert all(np.isfinite(v.numpy()).all() for v in model.weights)  # the update was kept out
        assert panel.tabs.selected_index == widgets.panel.TABS.index("Stepper")
        stepper_panel = panel.tabs.children[2]
        assert stepper_panel is panel.stepper_panel and isinstance(stepper_panel, widgets.StepperPanel)
        assert stepper_panel.stepper.next_index == 3
        np.testing.assert_array_equal(stepper_panel.stepper.peek()[0], x[24:32])  # the batch that hit
        assert not stepper_panel.continue_button.disabled
        stepper_panel.continue_button.click()
        assert panel.training.join(TIMEOUT)
        assert panel.state in ("finished", "stopped")
        assert "nonfinite" in set(panel.run.events()["kind"])
    finally:
        panel.stop()
        panel.training.join(TIMEOUT)


def test_the_dashboard_still_draws_after_a_step_taken_at_a_breakpoint():
    x = X.copy()
    x[3 * 8 + 2, 0] = np.nan
    panel = widgets.Lab(make_model(), (x, Y), batch_size=8, epochs=1, shuffle=False)
    try:
        panel.start()
        assert panel.wait(TIMEOUT) and panel.state == "paused"
        panel.stepper_panel.step_button.click()  # steps the NaN batch itself: the weights go NaN
        panel.resume()
        # Going on lets updates in again, and nonfinite() pauses at the next batch.
        assert panel.wait(TIMEOUT) and panel.state == "paused"
        assert panel.dashboard.recorder.run.events()["kind"].tolist().count("nonfinite") == 2
        refreshes = panel.dashboard.refreshes
        panel.dashboard.refresh()
        assert panel.dashboard.refreshes == refreshes + 1
    finally:
        panel.stop()
        panel.training.join(TIMEOUT)


def test_step_here_opens_a_stepper_while_no_training_runs(panels):
    panel = panels()
    panel.step_here_button.click()
    stepper_panel = panel.tabs.children[2]
    assert isinstance(stepper_panel, widgets.StepperPanel) and panel.tabs.selected_index == 2
    stepper_panel.step_button.click()
    assert stepper_panel.shown is not None and stepper_panel.shown.index == 0
    panel.start().wait(TIMEOUT)
    assert not isinstance(panel.tabs.children[2], widgets.StepperPanel)  # fit() moved the weights on


def test_the_stepper_opened_by_hand_weighs_the_classes_as_the_panels_fit_does(panels):
    # widgets.Lab(..., class_weight=...) passes it to fit(); a stepper opened
    # on the same data stepped unweighted batches, another training.
    class_weight = {0: 1.0, 1: 3.0, 2: 0.25}
    panel = panels(class_weight=class_weight)
    stepper = panel.open_stepper().stepper
    stepper.step(BATCHES)
    fitted = make_model()
    fitted.fit(X, Y, batch_size=8, shuffle=False, verbose=0, class_weight=class_weight)
    for got, expected in zip(panel.model.weights, fitted.weights, strict=True):
        np.testing.assert_array_equal(got.numpy(), expected.numpy())
    with pytest.raises(TypeError, match=r"widgets.Lab\(class_weight=...\) must be a dict"):
        widgets.Lab(make_model(), (X, Y), class_weight=[1.0, 3.0, 0.25])


def test_a_build_function_gives_the_device_picker_and_the_panel_trains_its_model(panels):
    built = []

    def build_model():
        built.append(make_model())
        return built[-1]

    panel = widgets.Lab(None, (X, Y), batch_size=8, build_model=build_model)
    assert isinstance(panel.tabs.children[3], widgets.DevicePicker)
    assert panel.model is built[0] and panel.mode_switch.model is built[0]
    panel.picker.build("cpu")
    assert panel.model is built[1] and panel.tabs.children[1].model is built[1]


def test_data_of_the_wrong_shape_is_refused():
    with pytest.raises(ValueError, match=r"\(x, y\)"):
        widgets.Lab(make_model(), (X, Y, None, None))
    with pytest.raises(ValueError, match="build_model"):
        widgets.Lab(None, (X, Y))


def test_a_model_trained_on_inputs_alone_takes_them_as_fit_does(panels, make_x_only_model):
    for data in (X, (X,), (X, None)):
        panel = widgets.Lab(make_x_only_model(), data, batch_size=8)
        assert panel.data[0] is X and panel.data[1] is None
    panel = panels(make_x_only_model(), data=X)
    panel.start()
    assert panel.wait(TIMEOUT) and panel.state == "finished"
    assert len(panel.run) == BATCHES and "series: recon" in panel.summary()
    with pytest.raises(TypeError, match=r"widgets.Lab\(gan, x_train\)"):
        widgets.Lab(make_x_only_model(), "x.npy")


def test_a_failing_fit_shows_its_error_and_run_is_enabled_again():
    panel = widgets.Lab(make_model(), (X, Y[:10]), batch_size=8)  # mismatched lengths
    panel.start()
    assert panel.wait(TIMEOUT) and panel.state == "failed"
    assert "ValueError" in panel.status.value
    assert not panel.run_button.disabled and panel.stop_button.disabled
