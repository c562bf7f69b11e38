"""ModeSwitch: the toggle switches an idle model at once and a training one at the next batch."""

import threading

import keras
import numpy as np
from tensorflow.python.framework import config as tf_config

import lab
from lab.backend.tensorflow import modes
from widgets import ModeSwitch


def test_toggle_switches_an_idle_model_at_once(comm_log, make_model):
    model = make_model()
    switch = ModeSwitch(model)
    assert switch.toggle.value == "graph"
    assert switch.compare_button.disabled  # no data to compare on

    switch.toggle.value = "eager"
    assert model.run_eagerly and modes.current_mode(model) == "eager"
    assert "next batch" in switch.status.value


def test_toggle_follows_a_switch_made_elsewhere(comm_log, make_model):
    model = make_model()
    switch = ModeSwitch(model)
    lab.set_mode(model, "eager")
    assert switch.toggle.value == "eager"


def test_toggle_shows_the_mode_keras_runs_after_an_attribute_set_by_hand(comm_log, make_model, digits):
    (x, y), _ = digits
    model = make_model()
    model.fit(x[:64], y[:64], batch_size=32, verbose=0)
    model.run_eagerly = True  # Keras keeps running the graph function it made
    switch = ModeSwitch(model)
    assert switch.toggle.value == "graph"  # was "eager", from the attribute
    switch.toggle.value = "eager"
    assert modes.running_mode(model) == "eager"  # the switch made Keras drop the graph function


def test_toggle_refuses_a_mode_that_cannot_run_and_shows_why(comm_log, make_model):
    model = make_model()
    switch = ModeSwitch(model)
    tf_config.enable_op_determinism()
    try:
        switch.toggle.value = "xla"
    finally:
        tf_config.disable_op_determinism()
    assert modes.current_mode(model) == "graph"
    assert switch.toggle.value == "graph"  # the toggle shows the mode that stayed
    assert "determinism" in switch.status.value


class Gate(keras.callbacks.Callback):
    """Holds the training thread at one batch so the test can click meanwhile."""

    def __init__(self, batch):
        super().__init__()
        self.batch, self.reached, self.release = batch, threading.Event(), threading.Event()

    def on_train_batch_begin(self, batch, logs=None):
        if batch == self.batch:
            self.reached.set()
            self.release.wait(timeout=60)


def test_toggle_during_training_on_another_thread_switches_at_the_next_batch(comm_log, make_model, digits):
    (x, y), _ = digits
    model = make_model()
    switch = ModeSwitch(model)
    recorder, gate = lab.Recorder(), Gate(batch=2)
    callbacks = [recorder, lab.ModeSwitcher(), gate]
    thread = threading.Thread(target=lambda: model.fit(x[:48], y[:48], batch_size=8, shuffle=False, verbose=0,
                                                       callbacks=callbacks))
    thread.start()
    try:
        assert gate.reached.wait(timeout=120)
        switch.toggle.value = "eager"
        # Requested, not applied: no model op ran on this thread.
        assert modes.pending_mode(model) == "eager"
        assert modes.current_mode(model) == "graph"
        assert "next batch" in switch.status.value
    finally:
        gate.release.set()
        thread.join(timeout=120)
    assert list(recorder.run.batches()["mode"]) == ["graph"] * 3 + ["eager"] * 3
    assert modes.pending_mode(model) is None and modes.current_mode(model) == "eager"


def test_compare_button_draws_trace_cost_and_step_cost_apart(comm_log, make_model, digits):
    (x, y), _ = digits
    model = make_model()
    switch = ModeSwitch(model, data=(x, y), steps=4, batch_size=16, modes=("eager", "graph"),
                        steps_per_execution=(1, 2))
    switch.compare_button.click()

    frame = switch.comparison
    assert list(frame["mode"]) == ["eager", "eager", "graph", "graph"]
    trace_bars, step_bars = switch.figure.data
    assert list(trace_bars.x) == ["eager ×1", "eager ×2", "graph ×1", "graph ×2"]
    np.testing.assert_allclose(trace_bars.y, frame["trace_seconds"])
    np.testing.assert_allclose(step_bars.y, frame["step_ms"])
    assert trace_bars.xaxis != step_bars.xaxis  # two panels: seconds and milliseconds
    assert any(child is switch.figure for child in switch.children)
    assert switch.status.value.startswith("Bottleneck: ")
    assert not switch.compare_button.disabled
