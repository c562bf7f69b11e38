"""Execution modes: switching keeps training continuous; comparing leaves the model as it was."""

import os
import random
import subprocess
import sys
import textwrap
import time

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework import config as tf_config

import lab
from lab.backend.tensorflow import modes
from lab.backend.tensorflow.modes import ModeError


class CountingModel(keras.Sequential):
    """Counts how often train_step runs as Python: every step in eager, once per trace otherwise."""

    python_steps = 0
    python_test_steps = 0

    def train_step(self, data):
        CountingModel.python_steps += 1
        return super().train_step(data)

    def test_step(self, data):
        CountingModel.python_test_steps += 1
        return super().test_step(data)


def make_model(cls=keras.Sequential, extra=(), steps_per_execution=1, seed=0):
    keras.utils.set_random_seed(seed)
    model = cls([keras.Input((64,)), keras.layers.Dense(8, activation="relu"), *extra, keras.layers.Dense(10)])
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        steps_per_execution=steps_per_execution,
    )
    return model


@pytest.fixture(scope="module")
def data():
    (x, y), _ = lab.datasets.digits()
    return x[:80], y[:80]  # 10 batches of 8


@pytest.fixture
def deterministic():
    tf_config.enable_op_determinism()
    yield
    tf_config.disable_op_determinism()


class NumpyIdentity(keras.layers.Layer):
    """An op XLA has no kernel for: tf.py_function."""

    def call(self, x):
        y = tf.py_function(lambda a: a, [x], tf.float32)
        y.set_shape(x.shape)
        return y


def state(model):
    return [v.numpy().copy() for v in model.weights + model.optimizer.variables]


# ---- set_mode ---------------------------------------------------------------


def test_switch_runs_the_new_mode_at_the_next_fit_and_keeps_the_state(data):
    x, y = data
    model = make_model(CountingModel)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    before = state(model)

    assert lab.set_mode(model, "eager") == "graph"
    assert model.run_eagerly and modes.current_mode(model) == "eager"
    after_switch = state(model)
    assert all(np.array_equal(a, b) for a, b in zip(before, after_switch))

    CountingModel.python_steps = 0
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert CountingModel.python_steps == 10  # Python on every step: really eager
    assert int(model.optimizer.iterations) == 20  # the optimizer state carried on
    CountingModel.python_test_steps = 0
    model.evaluate(x, y, batch_size=8, verbose=0)
    assert CountingModel.python_test_steps == 10  # the test function was rebuilt too

    lab.set_mode(model, "graph")
    CountingModel.python_steps = 0
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert 1 <= CountingModel.python_steps <= 2  # traced, not run as Python per step


def test_switch_inside_fit_continues_the_same_trajectory(data, deterministic):
    x, y = data
    reference = make_model()
    reference.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)

    model = make_model()
    recorder = lab.Recorder()
    switcher = lab.ModeSwitcher({3: "eager", 6: "graph"})
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[recorder, switcher])

    for got, want in zip(model.weights, reference.weights):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-6)
    assert int(model.optimizer.iterations) == 10
    rows = recorder.run.batches()
    assert list(rows["mode"]) == ["graph"] * 3 + ["eager"] * 3 + ["graph"] * 4
    assert modes.current_mode(model) == "graph"


def test_a_schedule_counts_steps_not_executions_at_several_steps_per_execution(data):
    # Keras before 3.11 passes an execution's first step at its end too: the
    # switcher counted one step an execution, and its switch never came.
    x, y = data
    model = make_model(steps_per_execution=4)
    recorder, switcher = lab.Recorder(), lab.ModeSwitcher({4: "eager"})
    model.fit(x[:64], y[:64], batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[recorder, switcher])
    assert switcher.step == 16  # 2 epochs of 2 executions of 4
    assert list(recorder.run.batches()["mode"]) == ["graph"] * 4 + ["eager"] * 12


class TraceRecordingModel(keras.Sequential):
    """Notes, for each time train_step runs as Python, whether eager or XLA traced it."""

    seen = []

    def train_step(self, data):
        TraceRecordingModel.seen.append("eager" if tf.executing_eagerly()
                                        else "xla" if lab.compat.in_xla_trace() else "graph")
        return super().train_step(data)


@pytest.mark.parametrize("watcher", ["recorder", "recorder_with_gradients"])
@pytest.mark.parametrize("mode", ["eager", "xla"])
def test_a_switch_inside_a_watched_fit_runs_the_new_mode(data, mode, watcher):
    # The lab's own wrappers on the train function come and go at a switch
    # (its first-step check); the function Keras rebuilt for the new mode
    # must be the one that runs, not the old one put back.
    x, y = data
    model = make_model(TraceRecordingModel)
    TraceRecordingModel.seen = []
    recorder = lab.Recorder(gradients=watcher == "recorder_with_gradients")
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0,
              callbacks=[recorder, lab.ModeSwitcher({3: mode})])
    assert list(recorder.run.batches()["mode"]) == ["graph"] * 3 + [mode] * 7
    if mode == "eager":
        assert TraceRecordingModel.seen.count("eager") == 7  # Python on every step after the switch
    else:
        assert "xla" in TraceRecordingModel.seen  # the step was compiled by XLA
        assert recorder.run.metadata.get("traced_in_xla")


class FlipInFit(keras.callbacks.Callback):
    """Sets a mode attribute by hand (no compile(), no set_mode) after the third batch."""

    def __init__(self, attribute):
        super().__init__()
        self.attribute = attribute

    def on_train_batch_end(self, batch, logs=None):
        if batch == 2:
            setattr(self.model, self.attribute, True)


def fit_flipped(data, attribute, when, recorder=None, second_recorded=True):
    """Two fits of one epoch; `attribute` set True by hand between them or inside the first."""
    x, y = data
    model = make_model(TraceRecordingModel)
    TraceRecordingModel.seen = []
    callbacks = [recorder] if recorder is not None else []
    keras.utils.set_random_seed(1)
    history = model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0,
                        callbacks=callbacks + ([FlipInFit(attribute)] if when == "inside" else []))
    if when == "between":
        setattr(model, attribute, True)
    keras.utils.set_random_seed(2)
    history.history.update({f"2/{k}": v for k, v in model.fit(
        x, y, batch_size=8, epochs=1, shuffle=False, verbose=0,
        callbacks=callbacks if second_recorded else []).history.items()})
    return model, history.history, list(TraceRecordingModel.seen)


@pytest.mark.parametrize("when", ["between", "inside"])
@pytest.mark.parametrize("attribute", ["run_eagerly", "jit_compile"])
def test_an_attribute_set_by_hand_is_recorded_as_what_keras_runs(data, attribute, when):
    # Keras keeps the train function it made when `run_eagerly` or
    # `jit_compile` is set by hand: the steps run in graph mode still. The
    # lab traced the next fit()'s function in the attributes' mode (other
    # weights than plain Keras), and labelled the steps by the attributes.
    bare, bare_logs, bare_traces = fit_flipped(data, attribute, when)
    assert "eager" not in bare_traces and "xla" not in bare_traces  # plain Keras: graph throughout
    recorder = lab.Recorder()
    model, logs, traces = fit_flipped(data, attribute, when, recorder)
    assert traces == bare_traces
    assert all(np.array_equal(a, b) for a, b in zip(state(model), state(bare)))
    assert logs == bare_logs
    assert list(recorder.run.batches()["mode"]) == ["graph"] * 20
    assert "mode" not in set(recorder.run.events()["kind"]) and "recompile" not in set(recorder.run.events()["kind"])
    assert getattr(model, attribute) is True  # the attribute stays as the user set it


@pytest.mark.parametrize("when", ["between", "inside"])
@pytest.mark.parametrize("attribute", ["run_eagerly", "jit_compile"])
def test_a_plain_fit_after_a_recorded_one_runs_the_mode_keras_kept(data, attribute, when):
    # The Recorder drops the train function it traced with its hooks at the
    # end of its fit(); the function Keras made at the next plain fit()
    # followed the attributes set by hand since: eager or XLA steps where
    # plain Keras runs its kept graph function.
    bare, bare_logs, bare_traces = fit_flipped(data, attribute, when)
    model, logs, traces = fit_flipped(data, attribute, when, lab.Recorder(), second_recorded=False)
    assert set(traces) == set(bare_traces) == {"graph"}  # retraced, in the mode Keras kept
    assert all(np.array_equal(a, b) for a, b in zip(state(model), state(bare)))
    assert logs == bare_logs
    assert modes.running_mode(model) == "graph" and getattr(model, attribute) is True


def test_after_an_attribute_set_by_hand_compile_runs_the_new_mode(data):
    x, y = data
    model = make_model(TraceRecordingModel)
    recorder = lab.Recorder()
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    model.run_eagerly = True
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy",
                  run_eagerly=True)
    TraceRecordingModel.seen = []
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[recorder])
    assert TraceRecordingModel.seen == ["eager"] * 10
    assert list(recorder.run.batches()["mode"]) == ["eager"] * 10
    assert recorder.run.metadata["mode"] == "eager"


def test_changing_steps_per_execution_skips_no_optimizer_step(data):
    x, y = data
    model = make_model()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)  # builds and caches a 1-step function
    lab.set_mode(model, "graph", steps_per_execution=5)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert model.steps_per_execution == 5
    assert int(model.optimizer.iterations) == 20  # 10 batches, 10 updates


def test_steps_per_execution_cannot_change_inside_fit(data):
    x, y = data
    model = make_model()
    refused = []

    class ChangeIt(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            try:
                lab.set_mode(self.model, "graph", steps_per_execution=2)
            except ValueError as error:
                refused.append(str(error))

    model.fit(x[:16], y[:16], batch_size=8, verbose=0, callbacks=[lab.ModeSwitcher(), ChangeIt()])
    assert len(refused) == 2 and "between fit() calls" in refused[0]
    assert model.steps_per_execution == 1 and int(model.optimizer.iterations) == 2


def test_xla_with_an_op_it_cannot_compile_fails_at_the_first_step_and_reverts(data):
    x, y = data
    model = make_model(extra=[NumpyIdentity()])
    model.fit(x[:16], y[:16], batch_size=8, verbose=0)
    before = state(model)

    lab.set_mode(model, "xla")
    with pytest.raises(ModeError, match="back in 'graph' mode") as failure:
        model.fit(x[:16], y[:16], batch_size=8, verbose=0)
    assert "XLA cannot compile" in str(failure.value)
    assert modes.current_mode(model) == "graph"
    assert all(np.array_equal(a, b) for a, b in zip(before, state(model)))

    model.fit(x[:16], y[:16], batch_size=8, verbose=0)  # the previous mode still trains
    assert int(model.optimizer.iterations) == 4

    # A Recorder rebuilds the train function as fit() starts; the check survives.
    lab.set_mode(model, "xla")
    recorder = lab.Recorder()
    with pytest.raises(ModeError, match="back in 'graph' mode"):
        model.fit(x[:16], y[:16], batch_size=8, verbose=0, callbacks=[recorder, lab.ModeSwitcher()])
    assert modes.current_mode(model) == "graph"
    assert "error" in set(recorder.run.events()["kind"])
    assert int(model.optimizer.iterations) == 4


def test_a_watched_fit_checks_the_first_xla_step_too(data):
    # A Recorder has fit() build a new train function; it is checked all the same.
    x, y = data
    model = make_model(extra=[NumpyIdentity()])
    lab.set_mode(model, "xla")
    with pytest.raises(ModeError, match="back in 'graph' mode"):
        model.fit(x[:16], y[:16], batch_size=8, verbose=0, callbacks=[lab.Recorder()])
    assert modes.current_mode(model) == "graph"


@pytest.mark.parametrize("callback", [None, "switcher", "recorder"])
def test_the_first_xla_step_is_checked_after_run_eagerly_set_by_hand(data, callback):
    # Keras keeps the XLA function set_mode made when run_eagerly is set by
    # hand; a ModeSwitcher or Recorder dropped its check (the attributes
    # said eager), and the failing step raised TensorFlow's error in XLA.
    x, y = data
    model = make_model(extra=[NumpyIdentity()])
    model.fit(x[:16], y[:16], batch_size=8, verbose=0)
    lab.set_mode(model, "xla")
    model.run_eagerly = True
    callbacks = {None: [], "switcher": [lab.ModeSwitcher()], "recorder": [lab.Recorder()]}[callback]
    with pytest.raises(ModeError, match="back in 'graph' mode"):
        model.fit(x[:16], y[:16], batch_size=8, verbose=0, callbacks=callbacks)
    assert modes.running_mode(model) == "graph" and int(model.optimizer.iterations) == 2


def test_a_step_failing_in_eager_raises_its_own_error_and_stays_in_eager(data):
    # Eager is where one debugs a failing step: its error is the step's own.
    x, y = data
    model = make_model()
    model.fit(x[:16], y[:16], batch_size=8, verbose=0)
    lab.set_mode(model, "eager")
    with pytest.raises(ValueError, match="64"):  # the user's own error, not a ModeError
        model.fit(x[:16, :63], y[:16], batch_size=8, verbose=0)
    assert modes.current_mode(model) == "eager"


@pytest.mark.parametrize("mode", ["graph", "xla"])
def test_a_steps_own_error_after_a_switch_is_raised_as_it_is_and_the_mode_stays(data, mode):
    x, y = data
    model = make_model()
    model.fit(x[:16], y[:16], batch_size=8, verbose=0)
    lab.set_mode(model, "eager")
    lab.set_mode(model, mode)
    with pytest.raises(ValueError, match="64"):  # a wrong input width fails in any mode
        model.fit(x[:16, :63], y[:16], batch_size=8, verbose=0)
    assert modes.current_mode(model) == mode
    model.fit(x[:16], y[:16], batch_size=8, verbose=0)  # the fixed input trains in the mode asked for
    assert modes.current_mode(model) == mode and int(model.optimizer.iterations) == 4


class NeedsEager(keras.Sequential):
    """Reads a tensor's value in Python in its train_step: runs eagerly only."""

    def train_step(self, data):
        logs = super().train_step(data)
        self.last_loss = float(logs["loss"])
        return logs


def test_a_step_that_needs_eager_fails_its_first_graph_step_and_goes_back(data):
    x, y = data
    model = make_model(NeedsEager)
    lab.set_mode(model, "eager")
    model.fit(x[:16], y[:16], batch_size=8, verbose=0)
    lab.set_mode(model, "graph")
    with pytest.raises(ModeError, match="back in 'eager' mode") as failure:
        model.fit(x[:16], y[:16], batch_size=8, verbose=0)
    assert "Keep 'eager'" in str(failure.value)
    assert modes.current_mode(model) == "eager"
    model.fit(x[:16], y[:16], batch_size=8, verbose=0)
    assert int(model.optimizer.iterations) == 4


@pytest.mark.parametrize("mode", ["eager", "graph", "xla"])
def test_set_mode_puts_no_lab_hook_on_the_model(data, mode):
    x, y = data
    model = make_model()
    lab.set_mode(model, mode)
    assert not lab.hooks.attached(model)  # also if the model never trains again
    model.fit(x[:16], y[:16], batch_size=8, verbose=0)
    assert not lab.hooks.attached(model)
    assert not type(model.train_function).__module__.startswith("lab")  # Keras' own function, nothing in front


def test_xla_with_op_determinism_is_refused_at_the_switch(deterministic):
    model = make_model()
    model.make_train_function()
    function = model.train_function
    with pytest.raises(ModeError, match="determinism"):
        lab.set_mode(model, "xla")
    assert modes.current_mode(model) == "graph"
    assert model.train_function is function


def test_bad_input_names_the_fix():
    with pytest.raises(ValueError, match="'eager', 'graph', 'xla'"):
        lab.set_mode(make_model(), "jit")
    uncompiled = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    with pytest.raises(ValueError, match=r"model.compile"):
        lab.set_mode(uncompiled, "eager")
    with pytest.raises(ValueError, match="positive int"):
        lab.set_mode(make_model(), "graph", steps_per_execution=0)


def test_request_mode_applies_at_once_when_no_other_thread_trains():
    model = make_model()
    assert modes.request_mode(model, "eager") == "applied"
    assert modes.current_mode(model) == "eager"
    assert modes.pending_mode(model) is None


def test_xla_under_a_mirrored_strategy_is_refused_at_the_switch():
    # Devices must be split before TensorFlow starts: a fresh process.
    script = textwrap.dedent(
        """
        import tensorflow as tf
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
        import keras, lab
        from lab.backend.tensorflow.modes import ModeError, current_mode
        with tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]).scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
            model.compile("sgd", "mse")
        try:
            lab.set_mode(model, "xla")
        except ModeError as error:
            assert "MirroredStrategy" in str(error), error
            print("refused", current_mode(model))
        """
    )
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("refused graph")


# ---- compare_modes ------------------------------------------------------------


def test_compare_modes_times_each_mode_and_leaves_the_model_as_it_was(data):
    x, y = data
    model = make_model()
    model.fit(x[:16], y[:16], batch_size=8, verbose=0)
    lab.set_mode(model, "eager")
    function = model.train_function
    before = state(model)

    frame = lab.compare_modes(model, (x, y), steps=4, batch_size=8, modes=("eager", "graph"),
                              steps_per_execution=(1, 2))

    assert list(frame.columns) == ["mode", "steps_per_execution", "trace_seconds", "step_ms", "steps_per_second",
                                   "speedup_vs_eager", "max_loss_diff", "traces", "bound_by", "error"]
    assert list(zip(frame["mode"], frame["steps_per_execution"])) == [
        ("eager", 1), ("eager", 2), ("graph", 1), ("graph", 2)]
    assert frame["error"].isna().all()
    assert (frame["step_ms"] > 0).all() and (frame["trace_seconds"] >= 0).all()
    assert (frame["trace_seconds"][frame["mode"] == "graph"] > 0).all()
    assert list(frame["traces"][frame["mode"] == "eager"]) == [0, 0]
    assert (frame["traces"][frame["mode"] == "graph"] >= 1).all()
    assert frame["speedup_vs_eager"].iloc[0] == 1.0
    assert (frame["max_loss_diff"] < 1e-4).all()  # same batches, same start, same losses
    assert set(frame["bound_by"]) <= {"model", "data"}
    assert frame.attrs["data_batches_per_second"] > 0
    assert frame.attrs["bottleneck"].split(":")[0] in ("model", "data")

    assert modes.current_mode(model) == "eager"
    assert model.train_function is function
    assert model.steps_per_execution == 1
    assert all(np.array_equal(a, b) for a, b in zip(before, state(model)))


def test_compare_modes_reports_a_mode_that_cannot_run_and_times_the_others(data):
    x, y = data
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    model = make_model(extra=[NumpyIdentity()])
    frame = lab.compare_modes(model, dataset, steps=2, modes=("graph", "xla"), steps_per_execution=(1,))
    graph, xla = frame.iloc[0], frame.iloc[1]
    assert graph["error"] is None and graph["step_ms"] > 0
    assert "XLA cannot compile" in xla["error"] and np.isnan(xla["step_ms"])
    assert modes.current_mode(model) == "graph"


def test_compare_modes_bad_input_names_the_fix(data):
    x, y = data
    model = make_model()
    with pytest.raises(ValueError, match="at least 16"):
        lab.compare_modes(model, (x, y), steps=4, steps_per_execution=(1, 8))
    with pytest.raises(ValueError, match="already batched"):
        lab.compare_modes(model, tf.data.Dataset.from_tensor_slices((x, y)).batch(8), steps=16, batch_size=8)
    with pytest.raises(ValueError, match=r"x alone for a model trained with fit\(x\)"):
        lab.compare_modes(model, iter([x]), steps=16)
    with pytest.raises(ValueError, match=r"\(x, y, sample_weight\)"):
        lab.compare_modes(model, (x, y, y, y), steps=16)


class NoisyModel(keras.Model):
    """Adds noise to its inputs with no seed of its own, as a user's train_step might."""

    draw = "keras"  # keras.random (Keras' global SeedGenerator), or "tf": tf.random (TF's op seeds)

    def train_step(self, data):
        x, y = data
        noise = keras.random.normal if self.draw == "keras" else tf.random.normal
        return super().train_step((x + noise(tf.shape(x), stddev=0.5), y))


@pytest.mark.parametrize("draw, mode", [("keras", "graph"), ("tf", "eager"), ("tf", "graph")])
def test_the_fit_after_compare_modes_trains_as_it_would_have(data, draw, mode):
    x, y = data

    def next_fit(compare):
        keras.utils.set_random_seed(0)
        lab.compat.set_keras_global_seed_generator(None)  # newer Keras' set_random_seed does this too, 3.5's not
        inputs = keras.Input((64,))
        model = NoisyModel(inputs, keras.layers.Dense(10)(inputs))
        model.draw = draw
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      run_eagerly=mode == "eager")
        if mode == "graph":
            model.fit(x[:16], y[:16], batch_size=8, verbose=0)  # its train function traced before comparing
        if compare:
            lab.compare_modes(model, (x, y), steps=2, batch_size=8, modes=("eager", "graph"),
                              steps_per_execution=(1,))
        model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
        return model.get_weights() + [random.random(), np.random.random()]

    for got, want in zip(next_fit(compare=True), next_fit(compare=False)):
        np.testing.assert_array_equal(got, want)


class StudentOnly(keras.Model):
    """keras-io's knowledge distillation before Keras 3: the step trains the
    student only; the teacher stays trainable, and no optimizer touches it."""

    def __init__(self):
        super().__init__()
        self.teacher = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])
        self.student = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])

    def call(self, x):
        return self.student(x)

    def train_step(self, data):
        x, y = data
        taught = tf.nn.softmax(self.teacher(x, training=False))
        with tf.GradientTape() as tape:
            guess = self.student(x, training=True)
            loss = tf.reduce_mean(keras.losses.kl_divergence(taught, tf.nn.softmax(guess)))
        variables = self.student.trainable_variables
        self.optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
        return {"distillation_loss": loss}


def test_compare_modes_leaves_the_optimizer_to_be_built_on_the_variables_the_step_applies(data):
    # Its symbolic build gave the optimizer slots for the teacher too, which
    # fit() (no strategy) never makes: every later fit() carried them.
    x, y = data

    def fitted(compare):
        keras.utils.set_random_seed(0)
        model = StudentOnly()
        model.compile("adam")
        if compare:
            lab.compare_modes(model, (x, y), steps=2, batch_size=8, modes=("eager", "graph"),
                              steps_per_execution=(1,))
        model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
        return model

    got, want = fitted(compare=True), fitted(compare=False)
    assert [v.shape for v in got.optimizer.variables] == [v.shape for v in want.optimizer.variables]
    for mine, theirs in zip(got.optimizer.variables + got.weights, want.optimizer.variables + want.weights):
        np.testing.assert_array_equal(mine.numpy(), theirs.numpy())


class CountedModel(keras.Sequential):
    """Keeps its own step counter, a tf.Variable (e.g. for a warm-up ramp)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.step_count = tf.Variable(0.0, trainable=False)

    def train_step(self, data):
        self.step_count.assign_add(1.0)
        x, y = data
        return super().train_step((x * tf.minimum(1.0, self.step_count / 10.0), y))


class GeneratorNoise(keras.layers.Layer):
    """Noise from a tf.random.Generator of its own, as TensorFlow's random-number guide has it."""

    def __init__(self):
        super().__init__()
        self.rng = tf.random.Generator.from_seed(7)

    def call(self, inputs, training=False):
        return inputs + self.rng.normal(tf.shape(inputs), stddev=0.1) if training else inputs


class ListedOptimizers(keras.Model):
    """Each half of the model updated by its own optimizer, kept in a list."""

    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(8, activation="relu")
        self.out = keras.layers.Dense(10)

    def call(self, inputs):
        return self.out(self.hidden(inputs))

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = keras.losses.sparse_categorical_crossentropy(y, self(x, training=True), from_logits=True)
            loss = tf.reduce_mean(loss)
        first, second = self.hidden.trainable_variables, self.out.trainable_variables
        grads = tape.gradient(loss, first + second)
        self.optimizers[0].apply(grads[:len(first)], first)
        self.optimizers[1].apply(grads[len(first):], second)
        return {"loss": loss}


def held_state_model(case):
    keras.utils.set_random_seed(0)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if case == "counter":
        model = CountedModel([keras.Input((64,)), keras.layers.Dense(10)])
        model.compile("sgd", loss)
        return model, lambda: [model.step_count]
    if case == "generator":
        noise = GeneratorNoise()
        model = keras.Sequential([keras.Input((64,)), noise, keras.layers.Dense(10)])
        model.compile("sgd", loss)
        return model, lambda: [noise.rng.state]
    model = ListedOptimizers()
    model.compile("sgd")
    model.optimizers = [keras.optimizers.Adam(0.01), keras.optimizers.Adam(0.02)]
    return model, lambda: model.optimizers[0].variables + model.optimizers[1].variables


@pytest.mark.parametrize("case", ["counter", "generator", "optimizer_list"])
def test_compare_modes_puts_back_state_held_outside_the_models_variables(data, case):
    # A tf.Variable on the model, a layer's tf.random.Generator and optimizers in a list
    # were left as the comparison's steps had moved them: the next fit() trained differently.
    x, y = data

    def next_fit(compare):
        model, held = held_state_model(case)
        model.fit(x[:32], y[:32], batch_size=8, shuffle=False, verbose=0)
        before = [v.numpy().copy() for v in held()]
        if compare:
            lab.compare_modes(model, (x, y), steps=2, batch_size=8, modes=("eager", "graph"),
                              steps_per_execution=(1,))
        assert all(np.array_equal(a, v.numpy()) for a, v in zip(before, held()))
        keras.utils.set_random_seed(1)
        model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
        return model.get_weights()

    for got, want in zip(next_fit(compare=True), next_fit(compare=False)):
        np.testing.assert_array_equal(got, want)


def test_a_stall_while_the_input_is_timed_does_not_make_a_slow_model_data_bound(data):
    x, y = data
    drawn = []

    def pull(batch):
        drawn.append(1)
        if len(drawn) == 12:  # once: the machine was busy elsewhere for a moment
            time.sleep(0.3)
        return batch

    def stalls_once(xb, yb):
        xb = tf.py_function(pull, [xb], tf.float32)
        xb.set_shape((None, 64))
        return xb, yb

    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(8).map(stalls_once)
    frame = lab.compare_modes(make_model(), dataset, steps=4, modes=("eager",), steps_per_execution=(1,))
    assert frame.attrs["bottleneck"].startswith("model:")  # eager steps are far slower than in-memory batches
    assert list(frame["bound_by"]) == ["model"]


class Reconstructing(keras.Model):
    """Trained with fit(x) alone, as a VAE: its train_step takes the batch of x itself."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(64)
        self.tracker = keras.metrics.Mean(name="loss")

    def call(self, x):
        return self.dense(x)

    @property
    def metrics(self):
        return [self.tracker]

    def train_step(self, data):
        if isinstance(data, tuple):
            raise TypeError(f"fit(x) hands train_step the batch of x, not a {len(data)}-tuple")
        with tf.GradientTape() as tape:
            loss = keras.ops.mean((self(data, training=True) - data) ** 2)
        self.optimizer.apply(tape.gradient(loss, self.trainable_variables), self.trainable_variables)
        self.tracker.update_state(loss)
        return {"loss": self.tracker.result()}


@pytest.mark.parametrize("as_given", ["x", "(x,)"])
def test_compare_modes_feeds_x_alone_as_fit_x_does(data, as_given):
    x, _ = data
    model = Reconstructing()
    model.compile(optimizer="adam")
    frame = lab.compare_modes(model, x if as_given == "x" else (x,), steps=2, batch_size=8,
                              modes=("eager", "graph"), steps_per_execution=(1,))
    assert list(frame["error"]) == [None, None]
    assert (frame["max_loss_diff"] < 1e-4).all()
    model.fit(x, batch_size=8, verbose=0)  # what compare_modes fed it, fit(x) feeds it too


def test_the_fit_after_compare_modes_on_a_shuffled_cached_dataset_trains_on_the_batches_it_would_have(data):
    # compare_modes timed the user's dataset in part and over again: a seeded
    # shuffle moved on to a later order, and fit() trained on other batches.
    x, y = data

    def next_fit(compare):
        keras.utils.set_random_seed(0)
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).cache().shuffle(64, seed=1).batch(8).prefetch(2)
        inputs = keras.Input((64,))
        model = keras.Model(inputs, keras.layers.Dense(10)(inputs))
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        if compare:
            lab.compare_modes(model, dataset, steps=2, modes=("graph",), steps_per_execution=(1,))
        model.fit(dataset, epochs=2, verbose=0)
        return model.get_weights()

    for got, want in zip(next_fit(compare=True), next_fit(compare=False)):
        np.testing.assert_array_equal(got, want)
