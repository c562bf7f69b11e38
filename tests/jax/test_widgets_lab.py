"""widgets.BackgroundFit, TrainingControls and widgets.Lab on Keras' JAX backend, without TensorFlow.

During a JAX `fit()` the weights and optimizer state live in arrays outside
the Keras variables; a pause must leave the variables holding them, and
pausing, stepping, resuming and stopping must train exactly what bare Keras
trains on the same batches.
"""

import sys
import time

import keras
import numpy as np
import pytest
from jax_models import classification_data, make_mlp

import lab
import widgets

X, Y = classification_data()  # 192 rows
BATCH = 16
BATCHES = len(X) // BATCH  # per epoch
TIMEOUT = 120


def state_of(model):
    return [np.asarray(v) for v in model.weights + model.optimizer.variables + model.metrics_variables]


def assert_bit_exact(model, twin):
    mine, theirs = state_of(model), state_of(twin)
    assert len(mine) == len(theirs)
    for a, b in zip(mine, theirs):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()


def bare_fit(batches, epochs=1):
    """A twin trained by bare Keras on the first `batches` batches (in data order)."""
    twin = make_mlp()
    twin.fit(X[:batches * BATCH], Y[:batches * BATCH], batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0)
    return twin


def stepped(training, done):
    """Lets one batch run at a pause; True once `done` batches ran and it is parked again."""
    training.step()
    return training.wait_for("paused", timeout=TIMEOUT) and wait_until(
        lambda: training.batches_done == done and training.state == "paused")


def wait_until(predicate, timeout=TIMEOUT):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def in_background(model, epochs=1, x=X, **kwargs):
    return widgets.BackgroundFit(model, x, Y, batch_size=BATCH, epochs=epochs, shuffle=False, **kwargs)


@pytest.fixture
def trainings():
    """BackgroundFits made by a test; whatever still runs is stopped and joined."""
    made = []

    def make(*args, **kwargs):
        training = in_background(*args, **kwargs)
        made.append(training)
        return training

    yield make
    for training in made:
        training.stop()
        assert training.join(TIMEOUT)


def test_the_lab_widgets_load_on_jax_without_tensorflow():
    assert keras.config.backend() == "jax"
    for name in ("BackgroundFit", "TrainingControls", "Lab", "StepperPanel", "ModeSwitch", "DevicePicker"):
        assert getattr(widgets, name) is not None
    assert "tensorflow" not in sys.modules


def test_background_fit_trains_on_a_thread_and_finishes_as_bare_fit(trainings):
    model = make_mlp()
    training = trainings(model, epochs=2).start()
    assert training.state in ("running", "finished")
    assert training.join(TIMEOUT)
    assert training.state == "finished", training.detail
    assert training.batches_done == 2 * BATCHES
    assert len(training.history.history["loss"]) == 2
    assert_bit_exact(model, bare_fit(BATCHES, epochs=2))


def test_a_pause_holds_the_weights_of_the_batches_that_ran(trainings):
    model = make_mlp()
    training = trainings(model, epochs=3)
    training.pause()
    training.start()
    assert training.wait_for("paused", timeout=TIMEOUT)
    assert training.batches_done == 1
    # fit() keeps JAX's state outside the variables between batches; parked, they hold it.
    assert_bit_exact(model, bare_fit(1))


def test_pause_step_and_resume_train_exactly_what_bare_fit_trains(trainings):
    model = make_mlp()
    training = trainings(model, epochs=2)
    training.pause()
    training.start()
    assert training.wait_for("paused", timeout=TIMEOUT)
    assert stepped(training, 2)
    assert training.detail == "stepped one batch"
    training.resume()
    assert training.join(TIMEOUT) and training.state == "finished"
    assert training.batches_done == 2 * BATCHES
    assert_bit_exact(model, bare_fit(BATCHES, epochs=2))


def test_a_stop_at_a_pause_leaves_weights_and_optimizer_as_bare_fit_after_as_many_batches(trainings):
    model = make_mlp()
    training = trainings(model, epochs=3)
    training.pause()
    training.start()
    assert training.wait_for("paused", timeout=TIMEOUT)
    assert stepped(training, 2) and stepped(training, 3)
    training.stop()
    assert training.join(TIMEOUT) and training.state == "stopped"
    assert training.batches_done == 3
    assert model.optimizer.iterations.numpy() == 3
    assert_bit_exact(model, bare_fit(3))


def test_a_stop_while_training_runs_keeps_every_batch_that_ran():
    model = make_mlp()
    big_x, big_y = np.concatenate([X] * 8), np.concatenate([Y] * 8)
    training = widgets.BackgroundFit(model, big_x, big_y, batch_size=BATCH, epochs=1, shuffle=False).start()
    try:
        assert training.wait_for("running", timeout=TIMEOUT)
        while training.batches_done < 3 and training.join(0.005) is False:
            pass
    finally:
        training.stop()
    assert training.join(TIMEOUT) and training.state == "stopped"
    ran = training.batches_done
    assert 3 <= ran < 8 * BATCHES
    twin = make_mlp()
    twin.fit(big_x[:ran * BATCH], big_y[:ran * BATCH], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert_bit_exact(model, twin)


def test_a_recorded_background_fit_paused_and_resumed_records_every_batch_once(trainings):
    model = make_mlp()
    recorder = lab.Recorder(gradients=True)
    training = trainings(model, epochs=1, callbacks=[recorder])
    assert training.recorder is recorder
    training.pause()
    training.start()
    assert training.wait_for("paused", timeout=TIMEOUT)
    training.resume()
    assert training.join(TIMEOUT) and training.state == "finished"
    frame = recorder.run.batches()
    assert list(frame["step"]) == list(range(BATCHES))
    assert np.isfinite(frame["grad_norm"]).all()
    assert_bit_exact(model, bare_fit(BATCHES))


def test_a_mode_switch_asked_for_at_a_pause_lands_at_the_next_batch(trainings):
    model = make_mlp()
    recorder = lab.Recorder()
    training = trainings(model, epochs=1, callbacks=[recorder])
    training.pause()
    training.start()
    assert training.wait_for("paused", timeout=TIMEOUT)
    assert lab.modes.request_mode(model, "eager") == "pending"
    assert stepped(training, 2)
    training.stop()
    assert training.join(TIMEOUT)
    assert list(recorder.run.batches()["mode"]) == ["xla", "eager"]
    # As a fit() told to switch at that batch, without any pause, trains.
    twin = make_mlp()
    twin.fit(X[:2 * BATCH], Y[:2 * BATCH], batch_size=BATCH, shuffle=False, verbose=0,
             callbacks=[lab.ModeSwitcher({1: "eager"})])
    assert_bit_exact(model, twin)


def test_a_python_breakpoint_pauses_on_its_batch_with_the_state_before_it(trainings):
    model = make_mlp()
    recorder = lab.Recorder(breakpoints=[lab.Breakpoint(lambda row: row["step"] == 2)])
    training = trainings(model, epochs=1, callbacks=[recorder]).start()
    assert training.wait_for("paused", timeout=TIMEOUT)
    stepper = training.stepper
    assert stepper is not None and stepper.next_index == 2 and recorder.run.next_step == 2
    np.testing.assert_array_equal(stepper.peek()[0], X[2 * BATCH:3 * BATCH])
    assert_bit_exact_weights(model, bare_fit(2))  # the model as before the batch that hit
    assert model.optimizer.iterations.numpy() == 2
    training.resume()  # nothing stepped: as if the pause had never been
    assert training.join(TIMEOUT) and training.state == "finished"
    assert list(recorder.run.batches()["step"]) == list(range(BATCHES))
    assert_bit_exact_weights(model, bare_fit(BATCHES))


def test_the_batch_that_hit_stepped_at_the_pause_goes_on_into_the_same_run(trainings):
    model = make_mlp()
    recorder = lab.Recorder(breakpoints=[lab.Breakpoint(lambda row: row["step"] == 2)])
    training = trainings(model, epochs=1, callbacks=[recorder]).start()
    assert training.wait_for("paused", timeout=TIMEOUT)
    trace = training.stepper.step()
    assert trace.error is None and trace.index == 2
    training.resume()
    assert training.join(TIMEOUT) and training.state == "finished"
    frame = recorder.run.batches()
    # The stepped batch replays fit()'s step 2 under its number; fit() goes on with step 3.
    assert list(frame["source"].fillna("fit")).count("stepper") == 1
    assert frame["step"].is_monotonic_increasing
    assert frame.drop_duplicates("step", keep="last")["step"].tolist() == list(range(BATCHES))
    assert np.isfinite(frame["loss"]).all()
    assert_bit_exact_weights(model, bare_fit(BATCHES))


def test_a_nonfinite_batch_pauses_with_its_update_kept_out_and_continue_lets_updates_through(trainings):
    model = make_mlp()
    bad_x = X.copy()
    bad_x[(BATCHES - 1) * BATCH] = np.nan  # each epoch's last batch
    recorder = lab.Recorder(breakpoints=[lab.breakpoints.nonfinite()])
    training = trainings(model, epochs=3, x=bad_x, callbacks=[recorder]).start()
    assert training.wait_for("paused", timeout=TIMEOUT) and "nonfinite" in training.detail
    assert training.stepper.next_index == BATCHES - 1
    assert np.isnan(training.stepper.peek()[0]).any()
    assert_bit_exact_weights(model, bare_fit(BATCHES - 1))
    training.resume()  # the update hold is released: the next epoch trains
    assert wait_until(lambda: training.state == "paused" and training.batches_done == 2 * BATCHES)
    training.stop()
    assert training.join(TIMEOUT) and training.state == "stopped"
    twin = bare_fit(BATCHES - 1)
    twin.fit(X[:(BATCHES - 1) * BATCH], Y[:(BATCHES - 1) * BATCH], batch_size=BATCH, shuffle=False, verbose=0)
    assert_bit_exact_weights(model, twin)
    assert model.optimizer.iterations.numpy() == 2 * (BATCHES - 1)
    updated = recorder.run.batches()["updated"].tolist()
    assert updated == ([1.0] * (BATCHES - 1) + [0.0]) * 2


def test_batch_in_flight_keeps_the_batch_that_hit_in_a_blocking_fit():
    model = make_mlp()
    keep = lab.in_flight.BatchInFlight()
    recorder = lab.Recorder(breakpoints=[lab.Breakpoint(lambda row: row["step"] == 4)])
    model.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[keep, recorder])
    assert model.optimizer.iterations.numpy() == 5  # the hit stopped fit() after that batch's update
    stepper = keep.stepper(run=recorder.run)
    assert stepper.next_index == 4 and recorder.run.next_step == 4
    assert_bit_exact_weights(model, bare_fit(4))
    assert len(model.optimizer.variables) == len(bare_fit(4).optimizer.variables)  # no ring left behind
    stepper.step()
    assert_bit_exact_weights(model, bare_fit(5))
    with pytest.raises(ValueError, match="No batch is kept"):
        lab.in_flight.BatchInFlight().stepper()


def assert_bit_exact_weights(model, twin):
    for a, b in zip(model.weights, twin.weights, strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_a_failing_fit_is_reported_through_the_state(trainings):
    model = make_mlp()
    training = widgets.BackgroundFit(model, X[:, :5], Y, batch_size=BATCH, epochs=1)
    assert training.start().join(TIMEOUT)
    assert training.state == "failed" and training.error is not None
    assert type(training.error).__name__ in training.detail


def test_training_controls_follow_the_state_and_their_buttons_steer(trainings):
    model = make_mlp()
    training = trainings(model, epochs=3)
    controls = widgets.TrainingControls(training)
    assert "idle" in controls.status.value and controls.pause_button.disabled
    training.pause()
    training.start()
    assert training.wait_for("paused", timeout=TIMEOUT)
    assert controls.pause_button.disabled and not controls.continue_button.disabled
    assert not controls.step_button.disabled and not controls.stop_button.disabled
    assert "paused" in controls.status.value and "1 batches" in controls.status.value
    controls.step_button.click()
    assert wait_until(lambda: training.batches_done == 2 and training.state == "paused")
    controls.stop_button.click()
    assert training.join(TIMEOUT) and training.state == "stopped"
    assert controls.stop_button.disabled and controls.continue_button.disabled
    assert "stopped" in controls.status.value
    assert training.controls() is training.controls()
    assert_bit_exact(model, bare_fit(2))


# ---- widgets.Lab --------------------------------------------------------------------


@pytest.fixture
def panels():
    made = []

    def make(model=None, **kwargs):
        kwargs.setdefault("batch_size", BATCH)
        kwargs.setdefault("shuffle", False)
        panel = widgets.Lab(model if model is not None else make_mlp(), (X, Y), **kwargs)
        made.append(panel)
        return panel

    yield make
    for panel in made:
        panel.stop()
        assert panel.training is None or panel.training.join(TIMEOUT)


def test_the_lab_panel_trains_records_and_shows_the_jax_modes(panels):
    model = make_mlp()
    panel = panels(model, epochs=2)
    training, modes, _stepper, devices = panel.tabs.children
    assert modes.model is model and [value for _, value in modes.toggle.options] == ["eager", "xla"]
    assert "<table" in devices.value and "cpu" in devices.value.lower()
    panel.run_button.click()
    assert panel.wait(TIMEOUT) and panel.state == "finished"
    frame = panel.run.batches()
    assert list(frame["step"]) == list(range(2 * BATCHES))
    assert np.isfinite(frame["loss"]).all() and any(c.startswith("grad_norm/") for c in frame.columns)
    assert set(frame["mode"]) == {"xla"}
    assert f"{2 * BATCHES} steps" in panel.summary()
    assert_bit_exact(model, bare_fit(BATCHES, epochs=2))
    assert "tensorflow" not in sys.modules


def test_the_lab_panel_pauses_continues_and_stops_with_its_buttons(panels):
    model = make_mlp()
    panel = panels(model, epochs=50)
    panel.start()
    panel.pause_button.click()
    assert panel.wait(TIMEOUT) and panel.state == "paused"
    assert not panel.continue_button.disabled and panel.run_button.disabled
    ran = panel.training.batches_done
    assert_bit_exact_weights(model, bare_fit(ran) if ran <= BATCHES else model)
    panel.continue_button.click()
    assert panel.state in ("running", "finished")
    panel.stop_button.click()
    assert panel.training.join(TIMEOUT) and panel.state == "stopped"
    assert len(panel.run.batches()) == panel.training.batches_done


def test_the_lab_panel_steps_the_model_where_training_left_it(panels):
    model = make_mlp()
    panel = panels(model, epochs=1)
    panel.start().wait(TIMEOUT)
    stepper_panel = panel.open_stepper()
    assert panel.tabs.selected_index == 2 and panel.tabs.children[2] is stepper_panel
    stepper_panel.step_button.click()
    trace = stepper_panel.stepper.traces[-1]
    assert trace.error is None and np.isfinite(trace.loss)
    # The stepped batch is the data's first, on the model as fit() left it.
    twin = bare_fit(BATCHES)
    twin.train_on_batch(X[:BATCH], Y[:BATCH])
    assert_bit_exact_weights(model, twin)
    stepper_panel.rewind_button.click()
    assert_bit_exact_weights(model, bare_fit(BATCHES))


def test_a_nonfinite_batch_pauses_the_lab_panel_with_the_stepper_on_it(panels):
    model = make_mlp()
    bad_x = X.copy()
    bad_x[2 * BATCH] = np.nan  # the third batch
    panel = widgets.Lab(model, (bad_x, Y), batch_size=BATCH, epochs=1, shuffle=False)
    assert panel.start().wait(TIMEOUT) and panel.state == "paused"
    assert "nonfinite" in panel.training.detail
    stepper_panel = panel.tabs.children[2]
    assert panel.tabs.selected_index == 2 and stepper_panel is panel.stepper_panel
    assert stepper_panel.stepper is panel.training.stepper and stepper_panel.stepper.next_index == 2
    assert not stepper_panel.continue_button.disabled
    assert_bit_exact_weights(model, bare_fit(2))
    panel.stop_button.click()
    assert panel.training.join(TIMEOUT) and panel.state == "stopped"
    assert list(panel.run.events()["kind"]).count("nonfinite") == 1
    assert_bit_exact_weights(model, bare_fit(2))


DATA_PARALLEL = r"""
import os, sys
os.environ["KERAS_BACKEND"] = "jax"
sys.path.insert(0, {tests!r})
import lab
lab.virtual_cpus(2)
import keras, numpy as np
import widgets
from jax_models import classification_data, make_mlp
x, y = classification_data()
distribution = lab.strategy("cpu:0,1")
with distribution.scope():
    bare = make_mlp()
    bare.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)

def same(model):
    pairs = list(zip(model.weights + model.optimizer.variables, bare.weights + bare.optimizer.variables))
    if all(np.asarray(a).tobytes() == np.asarray(b).tobytes() for a, b in pairs):
        return True
    return "close" if all(np.allclose(a, b, rtol=1e-6, atol=1e-8) for a, b in pairs) else False

with distribution.scope():
    model = make_mlp()
    training = widgets.BackgroundFit(model, x, y, batch_size=32, epochs=2, shuffle=False)
training.pause()
training.start()
assert training.wait_for("paused", timeout=120)
training.resume()
assert training.join(120), training.state
print("background", training.state, same(model))
panel = widgets.Lab(None, (x, y), batch_size=32, epochs=2, shuffle=False, build_model=make_mlp)
panel.picker.build("cpu:0,1")
panel.start().wait(120)
print("panel", panel.state, same(panel.model), len(panel.model.weights[0].value.sharding.device_set))
panel.open_stepper().step_button.click()  # a click, outside any scope: steps as fit() does, data-parallel
with distribution.scope():
    bare.fit(x[:32], y[:32], batch_size=32, shuffle=False, verbose=0)
print("stepped", same(panel.model))
print("keras", keras.__version__)
"""


def test_background_training_and_the_panel_train_data_parallel_as_bare_keras_does():
    # Keras keeps the distribution per thread: the training thread must train under the caller's.
    import pathlib
    import subprocess

    script = DATA_PARALLEL.format(tests=str(pathlib.Path(__file__).parent))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = dict(line.split(" ", 1) for line in done.stdout.strip().splitlines())
    assert out["background"] == "finished True"
    # On Keras 3.11 the panel's model, built by the picker under the strategy,
    # ends a float rounding (3.7e-9) away from one built in the strategy's
    # scope; from Keras 3.15 on, bit for bit.
    exact = tuple(int(part) for part in out["keras"].split(".")[:2]) >= (3, 15)
    assert out["panel"] in (("finished True 2",) if exact else ("finished True 2", "finished close 2"))
    assert out["stepped"] in (("True",) if exact else ("True", "close"))


def test_a_second_run_of_the_panel_goes_on_in_the_same_record_as_one_longer_fit(panels):
    model = make_mlp()
    panel = panels(model, epochs=1)
    assert panel.start().wait(TIMEOUT) and panel.start().wait(TIMEOUT) and panel.state == "finished"
    assert list(panel.run.batches()["step"]) == list(range(2 * BATCHES))
    assert_bit_exact_weights(model, bare_fit(BATCHES, epochs=2))
    # Keras' own train function is the model's again: no wrapper of the lab's is left on it.
    assert not lab.hooks.hooks_for(model).active


def test_a_fit_that_fails_mid_epoch_leaves_no_lab_hook_on_the_model(trainings):
    class FailsAtBatch2(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 2:
                raise RuntimeError("failed at batch 2")

    model = make_mlp()
    recorder = lab.Recorder(breakpoints=[lab.breakpoints.nonfinite()])  # arms the batch keeper
    training = trainings(model, epochs=1, callbacks=[recorder, FailsAtBatch2()]).start()
    assert training.join(TIMEOUT) and training.state == "failed" and "failed at batch 2" in training.detail
    assert not lab.hooks.hooks_for(model).active
    model.fit(X, Y, batch_size=BATCH, shuffle=False, verbose=0)  # as without the lab
