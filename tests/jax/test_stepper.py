"""lab.Stepper and widgets.StepperPanel on Keras' JAX backend: the model's own
train_step one batch at a time, as fit() trains it, and back."""

import os
import subprocess
import sys

import keras
import numpy as np
import pytest

import lab
import widgets
from jax_models import assert_same, batch_losses, classification_data, make_mlp
from keras_io_jax_guide import CustomModel, LowerLevelModel

BATCH = 32


def state_of(model):
    """Every array of the training state, as the user can read it."""
    return [np.array(v.value) for v in
            model.trainable_variables + model.non_trainable_variables + model.optimizer.variables
            + model.metrics_variables]


def assert_state(model, arrays):
    now = state_of(model)
    assert len(now) == len(arrays)
    for a, b in zip(now, arrays):
        np.testing.assert_array_equal(a, b)


def test_three_steps_train_as_fit_on_the_same_three_batches():
    x, y = classification_data()
    bare = make_mlp()
    bare.fit(x[:3 * BATCH], y[:3 * BATCH], batch_size=BATCH, shuffle=False, epochs=1, verbose=0)
    model = make_mlp()
    stepper = lab.Stepper(model, (x, y), batch_size=BATCH, shuffle=False, seed=0)
    trace = stepper.step(3)
    assert (trace.index, trace.epoch, trace.batch, stepper.next_index) == (2, 0, 2, 3)
    assert_same(model.weights, bare.weights)
    assert_same(model.optimizer.variables, bare.optimizer.variables)  # iterations and Adam's moments too
    # Each trace holds its batch and the batch's own values, not Keras' running means.
    losses, accuracies, _ = batch_losses(make_mlp, x[:3 * BATCH], y[:3 * BATCH], BATCH)
    np.testing.assert_allclose([t.row["loss"] for t in stepper.traces], losses, rtol=1e-6)
    np.testing.assert_allclose([t.row["accuracy"] for t in stepper.traces], accuracies, rtol=1e-6)
    np.testing.assert_array_equal(trace.x, x[2 * BATCH:3 * BATCH])
    np.testing.assert_array_equal(trace.y, y[2 * BATCH:3 * BATCH])
    assert trace.y_pred.shape == (BATCH, 3) and np.isfinite(trace.y_pred).all()
    assert trace.row["learning_rate"] == pytest.approx(1e-2) and trace.row["grad_norm"] > 0
    assert trace.error is None and not trace.skipped and trace.seconds > 0


def test_a_seed_makes_the_shuffled_order_repeat_and_each_epoch_holds_every_sample_once():
    x, y = classification_data()
    x = np.arange(len(x), dtype="float32")[:, None] * np.ones((1, 8), "float32")  # row i holds i
    orders = []
    for seed in (3, 3, 4):
        stepper = lab.Stepper(make_mlp(), (x, y), batch_size=BATCH, shuffle=True, seed=seed)
        traces = [stepper.step() for _ in range(2 * len(x) // BATCH)]
        orders.append(np.concatenate([t.x[:, 0] for t in traces]).astype(int))
        assert [t.epoch for t in traces] == [0] * 6 + [1] * 6
    np.testing.assert_array_equal(orders[0], orders[1])
    assert not np.array_equal(orders[0], orders[2])
    for order in orders:
        assert sorted(order[:192]) == sorted(order[192:]) == list(range(192))
        assert not np.array_equal(order[:192], order[192:])  # reshuffled every epoch


def test_rewind_puts_everything_back_bit_for_bit_and_the_replay_repeats():
    x, y = classification_data()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dropout(0.5), keras.layers.BatchNormalization(), keras.layers.Dense(3)])
    model.compile(keras.optimizers.Adam(1e-2), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    stepper = lab.Stepper(model, (x, y), batch_size=BATCH, shuffle=True, seed=1)
    stepper.step(5)  # into the second epoch (metrics reset there)
    kept = state_of(model)
    iterations = int(model.optimizer.iterations.value)
    first = [stepper.step() for _ in range(3)]
    assert first[-1].epoch == 1 and int(model.optimizer.iterations.value) == iterations + 3
    assert stepper.rewind(3) is stepper.traces[-1] and stepper.next_index == 5
    assert_state(model, kept)  # weights, BatchNormalization's statistics, dropout seeds, Adam, metrics
    assert int(model.optimizer.iterations.value) == iterations and len(stepper.traces) == 5
    again = [stepper.step() for _ in range(3)]
    for a, b in zip(first, again):
        assert (a.index, a.epoch, a.batch) == (b.index, b.epoch, b.batch)
        np.testing.assert_array_equal(a.x, b.x)  # the data position came back
        assert a.row == b.row and a.logs == b.logs
        np.testing.assert_array_equal(a.y_pred, b.y_pred)
        for key in a.weights_after:
            np.testing.assert_array_equal(a.gradients[key], b.gradients[key])
            np.testing.assert_array_equal(a.weights_after[key], b.weights_after[key])


def test_run_until_nonfinite_stops_at_the_nan_batch_with_the_weights_as_before_it():
    x, y = classification_data()
    x = x.copy()
    x[3 * BATCH + 5, 2] = np.nan  # batch 3
    model = make_mlp()
    run = lab.Run()
    stepper = lab.Stepper(model, (x, y), batch_size=BATCH, shuffle=False, run=run)
    stepper.step(3)
    before = state_of(model)
    trace = stepper.run_until(lab.breakpoints.nonfinite(), max_steps=20)
    assert stepper.hit and trace.index == 3 and trace.skipped
    assert not np.isfinite(trace.loss) and not np.isfinite(trace.gradients[next(iter(trace.gradients))]).all()
    assert_state(model, before)  # the bad update is not in the weights
    assert all(np.isfinite(w).all() for w in before)
    assert stepper.next_index == 3 and len(stepper.traces) == 3  # its batch comes next again
    np.testing.assert_array_equal(stepper.peek()[0], x[3 * BATCH:4 * BATCH])
    events = run.events()
    assert "nonfinite at step 3: the update was kept out" in " ".join(events[events["kind"] == "breakpoint"]["detail"])
    assert list(run.batches()["step"]) == [0, 1, 2, 3] and run.next_step == 3


def test_run_until_a_condition_and_a_breakpoint_stop_where_they_say():
    x, y = classification_data()
    stepper = lab.Stepper(make_mlp(), (x, y), batch_size=BATCH, shuffle=False)
    trace = stepper.run_until(lambda t: t.index == 4, max_steps=50)
    assert stepper.hit and trace.index == 4 and stepper.next_index == 5 and not trace.skipped
    trace = stepper.run_until(lab.Breakpoint(lambda row: row["step"] >= 7), max_steps=50)
    assert trace.index == 7 and stepper.next_index == 8
    trace = stepper.run_until(lambda t: False, max_steps=2)
    assert not stepper.hit and trace.index == 9
    spike = lab.breakpoints.loss_spike(1.0001, warmup=0, decay=0.0)  # any rise of the loss
    trace = stepper.run_until(spike, max_steps=50)
    assert stepper.hit and trace.skipped and stepper.next_index == trace.index


def _custom(seed):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input(shape=(32,))
    model = CustomModel(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    return model


def _lower_level(seed):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input(shape=(32,))
    model = LowerLevelModel(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="adam")
    return model


@pytest.mark.parametrize("make", [_custom, _lower_level], ids=["first-simple-example", "going-lower-level"])
def test_a_custom_stateless_train_step_steps_as_its_fit(make):
    rng = np.random.default_rng(0)
    x = rng.random((160, 32)).astype("float32")
    y = rng.random((160, 1)).astype("float32")
    bare = make(1)
    bare.fit(x[:96], y[:96], batch_size=BATCH, shuffle=False, epochs=1, verbose=0)
    model = make(1)
    stepper = lab.Stepper(model, (x, y), batch_size=BATCH, shuffle=False)
    trace = stepper.step(3)
    assert trace.error is None, trace.traceback
    assert_same(model.weights + model.optimizer.variables, bare.weights + bare.optimizer.variables)
    assert set(trace.row) >= {"loss", "mae", "grad_norm"} and np.isfinite(trace.loss)
    twin = make(1)
    for start in range(0, 96, BATCH):  # each batch's own loss
        twin.reset_metrics()
        twin.train_on_batch(x[start:start + BATCH], y[start:start + BATCH])
    assert trace.loss == pytest.approx(float(twin.get_metrics_result()["loss"]), rel=1e-5)
    assert sorted(trace.gradients) == sorted(v.path for v in model.trainable_variables)
    assert trace.y_pred.shape == (BATCH, 1)
    stepper.rewind(3)
    assert_same(model.weights, make(1).weights)


def test_gradients_are_the_ones_the_optimizer_applied():
    x, y = classification_data()
    learning_rate = 0.1
    model = make_mlp(optimizer=keras.optimizers.SGD(learning_rate))
    stepper = lab.Stepper(model, (x, y), batch_size=BATCH, shuffle=False)
    trace = stepper.step()
    keys = [v.path for v in model.trainable_variables]
    assert list(trace.gradients) == keys
    assert list(trace.weights_before) == keys and list(trace.weights_after) == keys
    for key in keys:
        applied = (trace.weights_before[key] - trace.weights_after[key]) / learning_rate
        np.testing.assert_allclose(trace.gradients[key], applied, rtol=1e-4, atol=1e-6)
        assert trace.gradients[key].shape == trace.weights_before[key].shape
        assert trace.row[f"grad_norm/{key}"] == pytest.approx(np.linalg.norm(trace.gradients[key]), rel=1e-5)
    np.testing.assert_array_equal(trace.weights_after[keys[0]], np.asarray(model.trainable_variables[0].value))
    # Clipped gradients are what the update applied: clipping shows.
    clipped = make_mlp(optimizer=keras.optimizers.SGD(learning_rate, global_clipnorm=0.01))
    trace = lab.Stepper(clipped, (x, y), batch_size=BATCH, shuffle=False).step()
    assert trace.row["grad_norm"] == pytest.approx(0.01, rel=1e-4)


def test_eager_mode_steps_the_same_batches():
    x, y = classification_data()
    jitted = lab.Stepper(make_mlp(), (x, y), batch_size=BATCH, shuffle=False)
    eager = lab.Stepper(make_mlp(), (x, y), batch_size=BATCH, shuffle=False, mode="eager")
    assert (jitted.mode, eager.mode) == ("xla", "eager")
    a, b = jitted.step(2), eager.step(2)
    assert b.loss == pytest.approx(a.loss, rel=1e-5)
    assert len(a.gradients) == len(b.gradients) == 4
    for ours, theirs in zip(b.gradients.values(), a.gradients.values()):  # twins: by position, not path
        np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-6)
    eager.rewind(2)
    assert_same(eager.model.weights, make_mlp().weights)


def test_the_model_is_left_as_without_the_lab(tmp_path):
    x, y = classification_data()
    model = make_mlp()
    own_before = set(vars(model))
    stepper = lab.Stepper(model, (x, y), batch_size=BATCH, shuffle=False)
    stepper.step(3)
    stepper.rewind(1)
    stepper.step(1)
    assert not lab.hooks.attached(model)
    assert "_backend_update_step" not in vars(model.optimizer) and "train_step" not in vars(model)
    assert set(vars(model)) - own_before <= {"_jax_state_synced"}  # nothing of the lab's
    assert len(model.weights) == len(make_mlp().weights) == 4
    # save / load as a model that never saw the lab
    path = str(tmp_path / "stepped.weights.h5")
    model.save_weights(path)
    clean = make_mlp()
    clean.optimizer.build(clean.trainable_variables)
    clean.load_weights(path)
    assert_same(clean.weights + clean.optimizer.variables, model.weights + model.optimizer.variables)
    # a later plain fit() goes on as fit() would have
    twin = make_mlp()
    twin.fit(x[:3 * BATCH], y[:3 * BATCH], batch_size=BATCH, shuffle=False, epochs=1, verbose=0)
    twin.fit(x[3 * BATCH:], y[3 * BATCH:], batch_size=BATCH, shuffle=False, epochs=1, verbose=0)
    model.fit(x[3 * BATCH:], y[3 * BATCH:], batch_size=BATCH, shuffle=False, epochs=1, verbose=0)
    assert_same(model.weights + model.optimizer.variables, twin.weights + twin.optimizer.variables)
    # and the stepper knows the model moved: its history is gone
    with pytest.raises(ValueError, match="changed outside the stepper"):
        stepper.rewind()


def test_stepper_panel_steps_and_rewinds_through_its_buttons():
    x, y = classification_data()
    model = make_mlp()
    stepper = lab.Stepper(model, (x, y), batch_size=BATCH, shuffle=False, history=4)
    initial = state_of(model)
    panel = widgets.StepperPanel(stepper, breakpoints=[lab.breakpoints.nonfinite()], max_steps=5)
    assert "not stepped yet" in panel.status.value
    panel.step_button.click()
    assert "step 0" in panel.status.value and "loss" in panel.status.value
    keys = [v.path for v in model.trainable_variables]
    assert list(panel.gradient_bars.data[0].x) == keys
    assert np.all(np.asarray(panel.gradient_bars.data[0].y) > 0)
    assert all(key in panel.weights_view.value for key in keys)
    assert "ŷ" in panel.batch_view.value
    panel.n_steps.value = 2
    panel.step_n_button.click()
    assert [value for _, value in panel.timeline.options] == [0, 1, 2]
    panel.rewind_button.click()
    assert "step 1" in panel.status.value and panel.stepper.next_index == 2
    for _ in range(2):
        panel.rewind_button.click()
    assert "not stepped yet" in panel.status.value
    assert_state(model, initial)  # weights, optimizer and metrics back to the start
    panel.rewind_button.click()
    assert "step first" in panel.status.value
    panel.run_button.click()  # no NaN in this data: runs max_steps
    assert panel.shown.index == 4 and panel.stepper.next_index == 5 and not panel.stepper.hit


def test_bad_input_is_refused_at_the_call_with_the_fix():
    x, y = classification_data()
    with pytest.raises(ValueError, match=r"cannot run on the data's first batch \(x: float32 \(32, 5\).*"
                                         r"as model.fit\(\) takes it.*\(None, 8\)"):
        lab.Stepper(make_mlp(), (x[:, :5], y), batch_size=BATCH)
    with pytest.raises(ValueError, match=r"\(x: float32 \(32, 8\), y: float32 \(32, 7\)\).*target.shape=\(32, 7\)"):
        lab.Stepper(make_mlp(), (x, np.zeros((len(x), 7), "float32")), batch_size=BATCH, mode="eager")
    with pytest.raises(ValueError, match="The arrays differ in length"):
        lab.Stepper(make_mlp(), (x, y[:10]))
    with pytest.raises(ValueError, match="pass the arrays as a tuple|Pass the arrays as a tuple"):
        lab.Stepper(make_mlp(), [x, y])
    with pytest.raises(ValueError, match="'graph' is TensorFlow's"):
        lab.Stepper(make_mlp(), (x, y), mode="graph")
    uncompiled = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)])
    with pytest.raises(ValueError, match="not compiled.*model.compile"):
        lab.Stepper(uncompiled, (x, y))
    stepper = lab.Stepper(make_mlp(), (x, y), batch_size=BATCH, shuffle=False, history=2)
    with pytest.raises(ValueError, match=r"Stepper.step\(n=...\) must be a whole number of steps, 1 or more; got 0"):
        stepper.step(0)
    with pytest.raises(ValueError, match="There is no step to rewind: step first"):
        stepper.rewind()
    stepper.step(3)
    with pytest.raises(ValueError, match=r"Cannot rewind 3 steps: only the last 2 can be rewound.*history=..."):
        stepper.rewind(3)
    with pytest.raises(ValueError, match=r"Stepper.rewind\(n=...\) must be a whole number"):
        stepper.rewind(-1)
    with pytest.raises(TypeError, match="run_until needs a callable condition"):
        stepper.run_until("loss > 3")
    assert stepper.next_index == 3 and len(stepper.traces) == 2  # nothing moved


DATA_PARALLEL = r"""
import os, sys
os.environ["KERAS_BACKEND"] = "jax"
sys.path.insert(0, {tests!r})
import lab
lab.virtual_cpus(2)
import keras, numpy as np
from jax_models import classification_data, make_mlp
x, y = classification_data()
with lab.strategy("cpu:0,1").scope():
    bare = make_mlp()
    bare.fit(x[:96], y[:96], batch_size=32, shuffle=False, verbose=0)
    model = make_mlp()
    stepper = lab.Stepper(model, (x, y), batch_size=32, shuffle=False)
    start = [np.asarray(v.value) for v in model.weights + model.optimizer.variables]
    stepper.step(3)
    same = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
               zip(model.weights + model.optimizer.variables, bare.weights + bare.optimizer.variables))
    sharded = len(model.weights[0].value.sharding.device_set)
    stepper.rewind(3)
    back = all(np.array_equal(np.asarray(v.value), a) for v, a in zip(model.weights + model.optimizer.variables, start))
print("result", same, sharded, back)
"""


def test_data_parallel_steps_as_its_fit_over_two_virtual_cpus():
    import pathlib

    script = DATA_PARALLEL.format(tests=str(pathlib.Path(__file__).parent))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-4:] == ["result", "True", "2", "True"]


def test_the_stepper_imports_no_tensorflow():
    script = ("import os, sys; os.environ['KERAS_BACKEND'] = 'jax'\n"
              "import numpy as np, keras, lab, widgets\n"
              "m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]); m.compile('sgd', 'mse')\n"
              "s = lab.Stepper(m, (np.zeros((8, 4), 'f4'), np.zeros((8, 2), 'f4')), batch_size=4)\n"
              "widgets.StepperPanel(s).step_button.click()\n"
              "print(s.next_index, sorted(n for n in sys.modules if n.split('.')[0] == 'tensorflow'))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, KERAS_BACKEND="jax"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-2:] == ["1", "[]"]
