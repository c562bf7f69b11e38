"""lab.backend.tensorflow.pause: fit() on a thread parks at batch boundaries and at a breakpoint's hit, headless."""

import threading
import time

import keras
import numpy as np
import pytest

import lab
from lab.backend.tensorflow.pause import PauseController, find_recorder

RNG = np.random.default_rng(0)
X = RNG.random((64, 6), dtype=np.float32)
Y = RNG.integers(0, 3, 64).astype(np.int32)
BATCHES = 8  # per epoch at batch_size=8
TIMEOUT = 120


def make_model(steps_per_execution=1):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(3)])
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  steps_per_execution=steps_per_execution)
    return model


class Training:
    """fit() on a thread with a PauseController; the states it reported, in order."""

    def __init__(self, model, recorder=None, epochs=1, callbacks=(), x=X):
        self.model = model
        self.states = []
        self.controller = PauseController(recorder, on_state=lambda s, d: self.states.append((s, d)))
        fit_callbacks = self.controller.callbacks(([recorder] if recorder else []) + list(callbacks))
        self.thread = threading.Thread(
            target=model.fit, args=(x, Y),
            kwargs=dict(batch_size=8, epochs=epochs, shuffle=False, verbose=0, callbacks=fit_callbacks),
            daemon=True)

    def start(self):
        self.thread.start()
        return self

    def wait_paused(self, count=1):
        deadline = time.monotonic() + TIMEOUT
        while sum(s == "paused" for s, _ in self.states) < count:
            assert time.monotonic() < deadline, f"never paused; states {self.states}"
            assert self.thread.is_alive() or sum(s == "paused" for s, _ in self.states) >= count, "fit() ended"
            time.sleep(0.01)

    def join(self):
        self.thread.join(TIMEOUT)
        assert not self.thread.is_alive()


def at_step(n):
    return lab.Breakpoint(lambda row: row["step"] == n, name=f"step {n}")


def test_a_hit_pauses_on_the_batch_that_hit_with_the_state_before_it():
    model = make_model()
    recorder = lab.Recorder(breakpoints=[at_step(3)])
    before = {}

    class Spy(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if batch == 3:
                before.update({v.path: v.numpy().copy() for v in self.model.weights})

    training = Training(model, recorder, callbacks=[Spy()]).start()
    training.wait_paused()
    controller = training.controller
    # The Recorder told the controller (its breakpoint listener) which step hit.
    assert controller.last_hit[0] == 3 and "step 3" in controller.last_hit[1]
    assert "step 3" in training.states[-1][1]
    assert recorder.status == "breakpoint" and controller.batches_done == 4
    for variable in model.weights:
        np.testing.assert_array_equal(variable.numpy(), before[variable.path])
    assert controller.stepper.next_index == 3
    np.testing.assert_array_equal(controller.stepper.peek()[0], X[24:32])  # the batch in flight
    controller.resume()
    training.join()
    assert recorder.status == "finished"  # the Recorder's stop was cancelled: fit() went on
    assert controller.batches_done == BATCHES and len(recorder.run) == BATCHES
    assert training.states[-1] == ("running", "")


def test_going_on_without_stepping_changes_nothing_and_the_listener_is_gone_after():
    plain = make_model()
    plain.fit(X, Y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    model = make_model()
    recorder = lab.Recorder(breakpoints=[lab.Breakpoint(lambda row: row["step"] in (2, BATCHES + 1))])
    training = Training(model, recorder).start()
    training.wait_paused()
    training.controller.resume()
    training.join()
    for a, b in zip(plain.weights, model.weights):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7)
    assert recorder.run.batches()["step"].tolist() == list(range(BATCHES))
    # Without the controller, the same recorder's next hit stops a blocking fit() as usual.
    model.fit(X, Y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[recorder])
    assert recorder.status == "stopped" and len(recorder.run) == BATCHES + 2


def test_a_step_at_the_pause_replays_the_batch_that_hit_and_is_recorded():
    model = make_model()
    recorder = lab.Recorder(breakpoints=[at_step(3)])
    training = Training(model, recorder).start()
    training.wait_paused()
    trace = training.controller.stepper.step()
    assert trace.index == 3
    assert trace.loss == pytest.approx(float(recorder.run.batches()["loss"].iloc[3]), rel=1e-5)
    training.controller.resume()
    training.join()
    frame = recorder.run.batches()
    assert list(frame["source"].fillna("fit")).count("stepper") == 1
    assert int(model.optimizer.iterations.numpy()) == BATCHES  # fit's 0-2, the step, fit's 4-7


def test_pause_step_and_stop_park_the_thread_between_batches():
    model = make_model()
    training = Training(model, epochs=50)
    controller = training.controller
    controller.pause()
    training.start()
    training.wait_paused()
    done = controller.batches_done
    time.sleep(0.2)
    assert controller.batches_done == done  # parked
    controller.step()
    training.wait_paused(2)
    assert controller.batches_done == done + 1 and training.states[-1] == ("paused", "stepped one batch")
    controller.stop()
    training.join()
    assert controller.batches_done < 50 * BATCHES and controller.stop_requested


def test_without_a_kept_batch_the_recorders_stop_stands():
    model = make_model(steps_per_execution=2)  # nothing is kept at steps_per_execution > 1
    recorder = lab.Recorder(breakpoints=[at_step(3)])
    training = Training(model, recorder, epochs=2).start()
    training.join()
    assert not any(s == "paused" for s, _ in training.states)
    assert recorder.status == "stopped" and "step 3" in training.controller.detail
    assert training.controller.stepper is None


def test_find_recorder_looks_inside_a_view_that_holds_one():
    recorder = lab.Recorder()

    class View(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.recorder = recorder

    assert find_recorder([keras.callbacks.History(), View()]) is recorder
    assert find_recorder([recorder]) is recorder
    assert find_recorder([keras.callbacks.History()]) is None
    assert PauseController().callbacks([])[0].__class__ is lab.ModeSwitcher


def test_released_after_a_failed_fit_the_controller_hears_no_later_hit():
    model = make_model()
    recorder = lab.Recorder(breakpoints=[lab.Breakpoint(lambda row: row["step"] == 9)])

    class Failing(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 2:
                raise RuntimeError("a callback failed")

    controller = PauseController(recorder)
    with pytest.raises(RuntimeError, match="a callback failed"):
        try:
            model.fit(X, Y, batch_size=8, epochs=1, verbose=0, callbacks=controller.callbacks([recorder, Failing()]))
        finally:
            controller.release()  # Keras calls no on_train_end after an exception
    model.fit(X, Y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[recorder])
    assert recorder.status == "stopped"  # the hit at step 9 stopped this fit() ...
    assert controller.last_hit is None  # ... without reaching the released controller


def test_going_on_after_a_device_breakpoint_lets_every_later_update_in():
    # nonfinite() holds every update after its hit until the lab lets go: going
    # on from the pause must let go, or the rest of the fit trained nothing.
    bad = X.copy()
    bad[2 * 8 + 3, 1] = np.inf  # batch 2
    model = make_model()
    recorder = lab.Recorder(breakpoints=[lab.breakpoints.nonfinite()])
    training = Training(model, recorder, x=bad).start()
    training.wait_paused()
    training.controller.resume()
    training.join()
    assert recorder.status == "finished"
    assert recorder.run.column("updated").tolist() == [1, 1, 0] + [1] * (BATCHES - 3)
    assert int(model.optimizer.iterations.numpy()) == BATCHES - 1
