"""BackgroundFit: fit() on a thread; pause, continue, step, stop; breakpoints pause."""

import time

import keras
import numpy as np
import pytest

import lab
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


def fit_in_background(model, epochs, callbacks=(), **kwargs):
    return widgets.BackgroundFit(model, X, Y, batch_size=8, epochs=epochs, shuffle=False,
                                 callbacks=list(callbacks), **kwargs)


def wait_until(predicate, timeout=TIMEOUT):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.fixture
def training():
    """A training that is told to pause before it starts, so tests act mid-training."""
    run = fit_in_background(make_model(), epochs=50)
    run.pause()
    yield run.start()
    run.stop()
    assert run.join(TIMEOUT)


def test_start_returns_while_training_goes_on_and_join_waits():
    run = fit_in_background(make_model(), epochs=2).start()
    assert run.state in ("running", "finished")
    assert run.join(TIMEOUT)
    assert run.state == "finished" and run.batches_done == 2 * BATCHES
    assert len(run.history.history["loss"]) == 2


def test_pause_holds_training_and_resume_finishes_it(training):
    assert training.wait_for("paused", timeout=TIMEOUT)
    done = training.batches_done
    assert not training.join(0.3)  # parked, not finished
    assert training.batches_done == done
    training.resume()
    assert training.wait_for("running", "finished", timeout=TIMEOUT)


def test_step_runs_one_batch_then_pauses_again(training):
    assert training.wait_for("paused", timeout=TIMEOUT)
    done = training.batches_done
    training.step()
    assert wait_until(lambda: training.batches_done > done and training.state == "paused")
    assert not training.join(0.3)  # parked again after exactly one batch
    assert training.batches_done == done + 1


def test_stop_ends_training_before_it_finishes(training):
    assert training.wait_for("paused", timeout=TIMEOUT)
    training.stop()
    assert training.join(TIMEOUT)
    assert training.state == "stopped" and training.batches_done < 50 * BATCHES


def test_a_failing_fit_is_reported_not_printed():
    model = make_model()
    run = widgets.BackgroundFit(model, X, Y[:10], epochs=1).start()  # mismatched lengths
    assert run.join(TIMEOUT)
    assert run.state == "failed" and run.error is not None and "ValueError" in run.detail


def test_a_breakpoint_pauses_on_the_batch_in_flight_with_the_state_before_it():
    model = make_model()
    recorder = lab.Recorder(breakpoints=[lab.Breakpoint(lambda row: row["step"] == 3, name="step 3")])
    before = {}

    class Spy(keras.callbacks.Callback):  # what the weights were before batch 3
        def on_train_batch_begin(self, batch, logs=None):
            if batch == 3:
                before.update({v.path: v.numpy().copy() for v in self.model.weights})

    run = fit_in_background(model, epochs=1, callbacks=[recorder, Spy()]).start()
    assert run.wait_for("paused", timeout=TIMEOUT)
    assert "step 3" in run.detail and run.batches_done == 4
    for variable in model.weights:
        np.testing.assert_array_equal(variable.numpy(), before[variable.path])
    stepper = run.stepper
    assert stepper.next_index == 3
    np.testing.assert_array_equal(stepper.peek()[0], X[24:32])  # the batch in flight
    trace = stepper.step()
    recorded = recorder.run.batches()
    assert trace.loss == pytest.approx(float(recorded["loss"].iloc[3]), rel=1e-5)
    run.resume()
    assert run.join(TIMEOUT) and run.state == "finished"
    frame = recorder.run.batches()
    assert list(frame["source"].fillna("fit")).count("stepper") == 1
    assert run.batches_done == BATCHES  # Continue went on with the next batch


@pytest.mark.parametrize("stepped, rewound", [(1, 0), (2, 0), (2, 1)])
def test_steps_stay_optimizer_steps_when_batches_are_stepped_at_a_pause(stepped, rewound):
    model = make_model()
    recorder = lab.Recorder(breakpoints=[lab.Breakpoint(lambda row: row["step"] == 3, name="step 3")])
    run = fit_in_background(model, epochs=1, callbacks=[recorder]).start()
    assert run.wait_for("paused", timeout=TIMEOUT)
    run.stepper.step(stepped)  # the batch that hit, replayed as step 3, then again as step 4
    if rewound:
        run.stepper.rewind(rewound)
    run.resume()
    assert run.join(TIMEOUT) and run.state == "finished"
    frame = recorder.run.batches()
    fit_rows = frame[frame["source"].fillna("fit") == "fit"]
    stood = stepped - rewound
    iterations = int(model.optimizer.iterations.numpy())
    assert iterations == 3 + stood + (BATCHES - 4)  # fit's batches 0-2, the steps that stand, fit's 4-7
    # fit()'s own rows: unique and increasing, going on right after the steps that stand.
    assert fit_rows["step"].tolist() == [0, 1, 2, 3] + list(range(3 + stood, iterations))
    # A replayed step keeps its number (the stepped batch 3 replays fit's step 3), so the
    # step column never goes back, and its last row of each step is the one that stands.
    assert frame["step"].is_monotonic_increasing
    assert frame.drop_duplicates("step", keep="last")["step"].tolist() == list(range(iterations))


def test_a_pause_at_a_breakpoint_that_steps_nothing_changes_nothing():
    plain = make_model()
    plain.fit(X, Y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    model = make_model()
    recorder = lab.Recorder(breakpoints=[lab.Breakpoint(lambda row: row["step"] == 2)])
    run = fit_in_background(model, epochs=1, callbacks=[recorder]).start()
    assert run.wait_for("paused", timeout=TIMEOUT)
    run.resume()
    assert run.join(TIMEOUT)
    for a, b in zip(plain.weights + plain.optimizer.variables, model.weights + model.optimizer.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())  # bit for bit, optimizer state too


def test_controls_buttons_follow_the_state(training):
    controls = training.controls()
    assert training.wait_for("paused", timeout=TIMEOUT)
    assert controls.pause_button.disabled and not controls.continue_button.disabled
    assert "paused" in controls.status.value
    controls.continue_button.click()
    assert training.wait_for("running", timeout=TIMEOUT)
    controls.pause_button.click()
    assert training.wait_for("paused", timeout=TIMEOUT)
    controls.stop_button.click()
    assert training.join(TIMEOUT) and training.state == "stopped"
    assert controls.stop_button.disabled


def test_a_mode_switch_asked_for_while_training_runs_lands_at_a_batch():
    from lab.backend.tensorflow import modes

    recorder = lab.Recorder()
    run = fit_in_background(make_model(), epochs=50, callbacks=[recorder])
    run.pause()
    run.start()
    assert run.wait_for("paused", timeout=TIMEOUT)
    assert modes.request_mode(run.model, "eager") == "pending"  # not applied from this thread
    run.resume()
    assert wait_until(lambda: "eager" in set(recorder.run.batches()["mode"]))
    run.stop()
    assert run.join(TIMEOUT) and run.state == "stopped"  # switched before training ended


def test_a_fit_that_fails_mid_epoch_leaves_no_lab_hook_on_the_model():
    class FailsAtBatch2(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 2:
                raise RuntimeError("failed at batch 2")

    model = make_model()
    recorder = lab.Recorder(breakpoints=[lab.breakpoints.nonfinite()])  # arms the batch keeper
    run = fit_in_background(model, epochs=1, callbacks=[recorder, FailsAtBatch2()]).start()
    assert run.join(TIMEOUT) and run.state == "failed" and "failed at batch 2" in run.detail
    assert not lab.hooks.hooks_for(model).active
