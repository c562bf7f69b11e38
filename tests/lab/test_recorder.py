"""Recorder: one row per batch with the batch's own values, for any model shape."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import lab

BATCH = 32


def make_mlp(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [keras.Input((64,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(10)]
    )


def compile_(model, **kwargs):
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        **kwargs,
    )
    return model


@pytest.fixture(scope="module")
def digits():
    (x, y), (xt, yt) = lab.datasets.digits()
    return x[:256], y[:256], xt[:64], yt[:64]


def per_batch(model, *arrays):
    """The batch's own logs by train_on_batch, metrics reset first (Keras < 3.8
    keeps the running mean across train_on_batch calls)."""
    model.reset_metrics()
    return model.train_on_batch(*arrays, return_dict=True)


def batches_of(x, y):
    return [(x[i : i + BATCH], y[i : i + BATCH]) for i in range(0, len(x), BATCH)]


def test_rows_hold_each_batch_own_loss_not_the_running_mean(digits):
    x, y, _, _ = digits
    model = compile_(make_mlp())
    twin = compile_(make_mlp())
    twin.set_weights(model.get_weights())
    rec = lab.Recorder()
    history = model.fit(x, y, batch_size=BATCH, shuffle=False, epochs=1, callbacks=[rec], verbose=0)
    expected = [per_batch(twin, bx, by) for bx, by in batches_of(x, y)]
    rows = rec.run.batches()
    assert list(rows["step"]) == list(range(len(expected)))
    np.testing.assert_allclose(rows["loss"], [e["loss"] for e in expected], rtol=1e-5)
    np.testing.assert_allclose(rows["accuracy"], [e["accuracy"] for e in expected], rtol=1e-5)
    # Keras' own figure is the running mean: the last row differs from it.
    assert abs(rows["loss"].iloc[-1] - history.history["loss"][-1]) > 1e-4
    np.testing.assert_allclose(rows["loss"].mean(), history.history["loss"][-1], rtol=1e-4)


def test_columns_and_epochs_with_validation(digits):
    x, y, xt, yt = digits
    model = compile_(make_mlp())
    rec = lab.Recorder()
    model.fit(x, y, batch_size=BATCH, epochs=2, validation_data=(xt, yt), callbacks=[rec], verbose=0)
    rows = rec.run.batches()
    assert list(rows.columns[:6]) == ["step", "epoch", "batch", "seconds", "mode", "loss"]
    assert {"accuracy", "learning_rate"} <= set(rows.columns)
    assert len(rows) == 16 and list(rows["epoch"].unique()) == [0, 1]
    assert list(rows["batch"][:8]) == list(range(8))
    assert (rows["mode"] == "graph").all()
    assert (rows["seconds"] > 0).all()
    np.testing.assert_allclose(rows["learning_rate"], 0.1, rtol=1e-6)
    epochs = rec.run.epochs()
    assert list(epochs["epoch"]) == [0, 1]
    assert {"loss", "accuracy", "val_loss", "val_accuracy"} <= set(epochs.columns)


@pytest.mark.parametrize("steps_per_execution", [4, 5])
def test_every_batch_has_its_row_at_steps_per_execution(digits, steps_per_execution):
    x, y, _, _ = digits
    model = compile_(make_mlp())
    reference = compile_(make_mlp())
    reference.set_weights(model.get_weights())
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        steps_per_execution=steps_per_execution,
    )
    rec, ref = lab.Recorder(), lab.Recorder()
    model.fit(x, y, batch_size=BATCH, shuffle=False, callbacks=[rec], verbose=0)
    reference.fit(x, y, batch_size=BATCH, shuffle=False, callbacks=[ref], verbose=0)
    rows, expected = rec.run.batches(), ref.run.batches()
    assert len(rows) == len(expected) == 8
    assert list(rows["batch"]) == list(range(8))
    np.testing.assert_allclose(rows["loss"], expected["loss"], rtol=1e-4)
    assert len(set(np.round(rows["loss"], 6))) == 8


def test_dataset_and_generator_inputs(digits):
    x, y, _, _ = digits
    model = compile_(make_mlp())
    rec = lab.Recorder()
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH), callbacks=[rec], verbose=0)
    assert len(rec.run) == 8

    def generator():
        for bx, by in batches_of(x, y):
            yield bx, by

    counted = _built(Keras3Step)
    counted.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", run_eagerly=True)
    rec = lab.Recorder()
    counted.fit(generator(), callbacks=[rec], verbose=0)
    assert len(rec.run) == 8
    assert np.isfinite(rec.run.column("loss")).all()
    # Some Keras versions call train_step once more, on an empty batch, at the
    # end of a generator; the run says so rather than show a batch that was not there.
    hidden_steps = counted.traces - 8
    assert (rec.run.events()["kind"] == "empty_step").sum() == (1 if hidden_steps else 0)


def test_functional_model_and_sample_weights(digits):
    x, y, _, _ = digits
    keras.utils.set_random_seed(1)
    inputs = keras.Input((64,))
    outputs = keras.layers.Dense(10)(keras.layers.Dense(8, activation="tanh")(inputs))
    model = compile_(keras.Model(inputs, outputs))
    weights = np.where(y == 3, 5.0, 1.0).astype("float32")
    twin = compile_(keras.models.clone_model(model))
    twin.set_weights(model.get_weights())
    rec = lab.Recorder()
    model.fit(x, y, sample_weight=weights, batch_size=BATCH, shuffle=False, callbacks=[rec], verbose=0)
    expected = [
        per_batch(twin, x[i : i + BATCH], y[i : i + BATCH], weights[i : i + BATCH])["loss"]
        for i in range(0, len(x), BATCH)
    ]
    np.testing.assert_allclose(rec.run.column("loss"), expected, rtol=1e-5)


@pytest.mark.parametrize("jit_compile", [False, True])
def test_a_batch_with_no_weight_is_told_not_shown_as_nan_training(digits, jit_compile):
    # A weighted metric has no value on a batch whose sample weights are all
    # 0 (Keras' running value stays): its row is NaN, and the run says why,
    # once, at that step; the loss (0.0 there, as Keras logs) and an
    # unweighted metric keep their values.
    x, y, _, _ = digits
    keras.utils.set_random_seed(1)
    model = make_mlp()
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", metrics=["accuracy"],
                  weighted_metrics=["accuracy"], jit_compile=jit_compile)
    weights = np.ones(len(x), "float32")
    weights[2 * BATCH:3 * BATCH] = 0.0
    rec = lab.Recorder()
    model.fit(x, y, sample_weight=weights, batch_size=BATCH, shuffle=False, callbacks=[rec], verbose=0)
    weighted = rec.run.column("weighted_accuracy")
    assert np.isnan(weighted[2]) and np.isfinite(np.delete(weighted, 2)).all()
    assert np.isfinite(rec.run.column("accuracy")).all() and rec.run.column("loss")[2] == 0.0
    told = rec.run.events()
    told = told[told["detail"].str.startswith("weighted_accuracy: ")]
    assert list(told["step"]) == [2] and "sample weights all 0" in told["detail"].iloc[0]


class Keras3Step(keras.Model):
    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(16, activation="relu")
        self.out = keras.layers.Dense(10)
        self.traces = 0

    def call(self, x):
        return self.out(self.hidden(x))

    def train_step(self, data):
        self.traces += 1
        x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


class OldStyleStep(Keras3Step):
    def train_step(self, data):
        x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compiled_loss(y, y_pred, regularization_losses=self.losses)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        self.compiled_metrics.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


def _built(cls, seed=2):
    keras.utils.set_random_seed(seed)
    model = cls()
    model(np.zeros((1, 64), "float32"))
    return compile_(model)


def test_custom_train_step_rows_match_train_on_batch(digits):
    x, y, _, _ = digits
    model = _built(Keras3Step)
    twin = _built(Keras3Step)
    twin.set_weights(model.get_weights())
    rec = lab.Recorder()
    model.fit(x, y, batch_size=BATCH, shuffle=False, callbacks=[rec], verbose=0)
    expected = [per_batch(twin, bx, by)["loss"] for bx, by in batches_of(x, y)]
    np.testing.assert_allclose(rec.run.column("loss"), expected, rtol=1e-5)


def test_old_style_step_records_the_true_loss_and_warns_once(digits):
    x, y, _, _ = digits
    model = _built(OldStyleStep)
    twin = _built(Keras3Step)
    twin.set_weights(model.get_weights())
    rec, ref = lab.Recorder(), lab.Recorder()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(x, y, batch_size=BATCH, shuffle=False, epochs=2, callbacks=[rec], verbose=0)
        model.fit(x, y, batch_size=BATCH, shuffle=False, callbacks=[rec], verbose=0)
    twin.fit(x, y, batch_size=BATCH, shuffle=False, epochs=2, callbacks=[ref], verbose=0)
    true_loss = rec.run.column("loss")[:16]
    np.testing.assert_allclose(true_loss, ref.run.column("loss"), rtol=1e-4)
    # What Keras reports is the mean of the predictions, far from the loss.
    assert abs(history.history["loss"][-1] - true_loss[8:].mean()) > 0.1
    ours = [w for w in caught if "compiled_metrics.update_state" in str(w.message)]
    assert len(ours) == 1
    assert "self.compute_loss" in str(ours[0].message)
    assert "warning" in set(rec.run.events()["kind"])


def test_one_recorder_serves_several_fits_without_retracing(digits):
    x, y, _, _ = digits
    model = _built(Keras3Step)
    rec = lab.Recorder()
    model.fit(x, y, batch_size=BATCH, callbacks=[rec], verbose=0)
    traces = model.traces
    model.fit(x, y, batch_size=BATCH, epochs=2, callbacks=[rec], verbose=0)
    assert model.traces == traces
    rows = rec.run.batches()
    assert list(rows["step"]) == list(range(24))
    assert np.isfinite(rows["loss"]).all()


def times_traced(function):
    """How often the tf.functions in a Keras train function (or its closures) were traced."""
    seen, count, todo = set(), 0, [function]
    while todo:
        function = todo.pop()
        if id(function) in seen:
            continue
        seen.add(id(function))
        if isinstance(function, tf.types.experimental.PolymorphicFunction):
            count += function.experimental_get_tracing_count()
            function = function.python_function
        for cell in getattr(function, "__closure__", None) or ():
            try:
                todo.append(cell.cell_contents)
            except ValueError:  # a cell not filled yet
                pass
    return count


def test_the_lab_leaves_no_trace_on_the_model(digits, tmp_path):
    x, y, _, _ = digits
    model = compile_(make_mlp())
    before = [id(w) for w in model.weights]
    model.fit(x, y, batch_size=BATCH, callbacks=[lab.Recorder(gradients=True, weights=True)], verbose=0)
    assert [id(w) for w in model.weights] == before
    for name in ("train_step", "compute_loss"):
        assert name not in model.__dict__
    assert "_backend_update_step" not in model.optimizer.__dict__
    # A clean function, not traced yet (a later fit() traces it without the
    # hooks), in the mode of the one dropped.
    assert times_traced(model.train_function) == 0
    assert lab.modes.running_mode(model) == "graph"
    path = str(tmp_path / "m.weights.h5")
    model.save_weights(path)
    fresh = compile_(make_mlp(seed=5))
    fresh.load_weights(path)
    for a, b in zip(fresh.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    history = model.fit(x, y, batch_size=BATCH, verbose=0)
    assert np.isfinite(history.history["loss"][0])


def test_uncompiled_model_shows_keras_own_error(digits):
    x, y, _, _ = digits
    rec = lab.Recorder()
    with pytest.raises(ValueError, match=r"You must call `compile\(\)`"):
        make_mlp().fit(x, y, callbacks=[rec], verbose=0)
    assert len(rec.run) == 0


def test_shape_mismatch_fails_with_keras_error_and_readable_run(digits):
    x, y, _, _ = digits
    model = compile_(make_mlp())
    rec = lab.Recorder()
    model.fit(x, y, batch_size=BATCH, callbacks=[rec], verbose=0)
    with pytest.raises((ValueError, tf.errors.InvalidArgumentError), match="incompatible|expected|size"):
        model.fit(x[:, :10], y, batch_size=BATCH, callbacks=[rec], verbose=0)
    assert rec.status == "failed"
    events = rec.run.events()
    assert events["kind"].iloc[-1] == "error"
    assert len(rec.run.batches()) == 8
    assert "train_step" not in model.__dict__


def test_a_loss_that_raises_stops_fit_with_its_own_message(digits):
    x, y, _, _ = digits
    calls = {"n": 0}

    def bad_loss(y_true, y_pred):
        calls["n"] += 1
        if calls["n"] > 3:
            raise ArithmeticError("my loss broke")
        return keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True)

    model = make_mlp()
    model.compile(optimizer="sgd", loss=bad_loss, run_eagerly=True)
    rec = lab.Recorder()
    with pytest.raises(ArithmeticError, match="my loss broke"):
        model.fit(x, y, batch_size=BATCH, callbacks=[rec], verbose=0)
    assert len(rec.run) == 3
    assert "my loss broke" in rec.status_detail
    assert np.isfinite(rec.run.column("loss")).all()


def test_python_breakpoint_stops_fit_after_its_batch(digits):
    x, y, _, _ = digits
    model = compile_(make_mlp())
    point = lab.Breakpoint(lambda row: row["step"] >= 2, name="third step")
    rec = lab.Recorder(breakpoints=[point])
    model.fit(x, y, batch_size=BATCH, epochs=3, callbacks=[rec], verbose=0)
    assert len(rec.run) == 3
    events = rec.run.events()
    assert list(events["kind"]) == ["breakpoint"]
    assert "third step at step 2" in events["detail"].iloc[0]
    assert int(model.optimizer.iterations.numpy()) == 3


def test_breakpoint_needs_a_callable():
    with pytest.raises(TypeError, match="callable condition"):
        lab.Breakpoint(0.5)


class TrackerNeverUpdated(Keras3Step):
    def train_step(self, data):
        x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return self.compute_metrics(x, y, y_pred)


def test_a_step_that_never_updates_the_loss_tracker_is_named(digits):
    x, y, _, _ = digits
    model = _built(TrackerNeverUpdated)
    rec = lab.Recorder()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=BATCH, callbacks=[rec], verbose=0)
    assert np.isfinite(rec.run.column("loss")).all() and (rec.run.column("loss") > 0).all()
    messages = [str(w.message) for w in caught if "loss tracker" in str(w.message)]
    assert len(messages) == 1 and "never updates the loss tracker" in messages[0]
    assert "compiled_metrics" not in messages[0]


def test_a_partial_last_execution_of_each_epoch_leaves_every_row_its_own_epoch_and_batch():
    # 10 batches at steps_per_execution=4: executions of 4, 4 and 2 steps. Keras
    # 3.11+ reports the last one by its full span (batch 11), as if 4 steps ran.
    r = np.random.default_rng(0)
    x = r.normal(size=(320, 4)).astype("float32")
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=4)
    rec = lab.Recorder()
    model.fit(x, x.sum(1, keepdims=True), batch_size=32, epochs=3, verbose=0, shuffle=False, callbacks=[rec])
    rows = rec.run.batches()
    assert rows["step"].tolist() == list(range(30))
    assert rows["epoch"].tolist() == [e for e in range(3) for _ in range(10)]
    assert rows["batch"].tolist() == list(range(10)) * 3


class SwitchAtBatchEnd(keras.callbacks.Callback):
    """Switches the model to eager at the end of batch `at` (for the next batch)."""

    def __init__(self, at):
        super().__init__()
        self.at = at

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.at:
            lab.set_mode(self.model, "eager")


def test_each_row_has_the_mode_its_batch_ran_in_when_a_callback_ahead_switches_at_batch_end(digits):
    # The recorder read the mode at its own batch end, after the callback
    # ahead of it had switched for the next batch: that batch's row said eager.
    x, y, _, _ = digits
    model = compile_(make_mlp())
    rec = lab.Recorder()
    model.fit(x[:128], y[:128], batch_size=32, shuffle=False, verbose=0, callbacks=[SwitchAtBatchEnd(1), rec])
    assert rec.run.batches()["mode"].tolist() == ["graph", "graph", "eager", "eager"]
    modes_ = rec.run.events().query("kind == 'mode'")
    assert modes_["step"].tolist() == [2] and modes_["detail"].tolist() == ["graph -> eager"]


class OwnLossesOnly(Keras3Step):
    """A GAN-shaped step: it logs losses of its own names and never feeds
    Keras' loss tracker (`feed_tracker` makes it feed the tracker a NaN)."""

    feed_tracker = False

    def __init__(self):
        super().__init__()
        self.own = keras.metrics.Mean(name="own_loss")

    def train_step(self, data):
        x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
                y, self(x, training=True), from_logits=True))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        self.own.update_state(loss)
        if self.feed_tracker:
            [tracker] = [m for m in self.metrics if m.name == "loss"]
            tracker.update_state(loss * np.nan)
        return {"own_loss": self.own.result()}


class FeedsTheTrackerNaN(OwnLossesOnly):
    feed_tracker = True


def _own_losses_model(cls):
    keras.utils.set_random_seed(2)
    model = cls()
    model(np.zeros((1, 64), "float32"))
    model.compile(optimizer=keras.optimizers.SGD(0.1))
    return model


def test_a_step_that_logs_no_loss_and_never_feeds_the_tracker_gets_no_empty_loss_column(digits):
    x, y, _, _ = digits
    model = _own_losses_model(OwnLossesOnly)
    rec = lab.Recorder(gradients=True)
    history = model.fit(x, y, batch_size=BATCH, epochs=2, callbacks=[rec], verbose=0).history
    assert set(history) == {"own_loss"}
    assert "loss" not in rec.run.columns  # it was a column of NaN: "no value" in every row
    assert np.isfinite(rec.run.column("own_loss")).all() and len(rec.run.column("own_loss")) == 16


def test_a_tracker_fed_a_nan_loss_keeps_its_nan_loss_column(digits):
    x, y, _, _ = digits
    model = _own_losses_model(FeedsTheTrackerNaN)
    rec = lab.Recorder()
    model.fit(x, y, batch_size=BATCH, callbacks=[rec], verbose=0)
    assert "loss" in rec.run.columns and np.isnan(rec.run.column("loss")).all()


def _fitted_with_first_layer(trainable):
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 3)).astype("float32"), rng.normal(size=(64, 3)).astype("float32")
    keras.utils.set_random_seed(7)
    first = keras.layers.Dense(3, activation="relu", name="first")
    model = keras.Sequential([keras.Input((3,)), first, keras.layers.Dense(3)])
    first.trainable = trainable
    model.compile(optimizer="adam", loss="mse")
    model.fit(x, y, batch_size=16, verbose=0)
    return model, first, x, y


def test_a_layer_made_trainable_without_compile_is_refused_before_any_step_and_compile_lets_the_lab_watch():
    model, first, x, y = _fitted_with_first_layer(trainable=False)
    first.trainable = True  # Keras' fit() would go on training the old set: no compile()
    before = [w.copy() for w in model.get_weights()] + [v.numpy().copy() for v in model.optimizer.variables]
    rec = lab.Recorder(gradients=True)
    model.evaluate(x, y, verbose=0, callbacks=[rec])  # trains nothing: not refused
    with pytest.raises(ValueError, match=r"not compiled again.*made trainable: \S*first/kernel.*model.compile"):
        model.fit(x, y, batch_size=16, verbose=0, callbacks=[rec])
    after = model.get_weights() + [v.numpy() for v in model.optimizer.variables]
    assert all(np.array_equal(a, b) for a, b in zip(before, after))
    assert not lab.hooks.attached(model) and "train_step" not in model.__dict__ and rec._fit_frame is None
    model.compile(optimizer="adam", loss="mse")
    model.fit(x, y, batch_size=16, verbose=0, callbacks=[rec])
    assert sorted(c for c in rec.run.columns if c.startswith("grad_norm/")) == sorted(
        f"grad_norm/{v.path}" for v in model.trainable_variables)


@pytest.mark.parametrize("compiled", [False, True])
def test_a_layer_frozen_since_the_optimizer_was_built_is_told_once_and_a_compile_keeping_the_optimizer_trains_as_bare(
        compiled):
    bare, first_bare, x, y = _fitted_with_first_layer(trainable=True)
    model, first, _, _ = _fitted_with_first_layer(trainable=True)
    for m, layer in ((bare, first_bare), (model, first)):
        layer.trainable = False
        if compiled:  # keeping Adam's state: Keras then trains the new set, with or without the lab
            m.compile(optimizer=m.optimizer, loss="mse")
            m.fit(x, y, batch_size=16, verbose=0)
    rec = lab.Recorder(gradients=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            model.fit(x, y, batch_size=16, verbose=0, callbacks=[rec])
    told = [e for e in rec.run.events().itertuples() if "not trainable now" in e.detail]
    assert len(told) == 1 and "first/kernel" in told[0].detail and "model.compile" in told[0].detail
    assert len([w for w in caught if "not trainable now" in str(w.message)]) == 1
    if compiled:
        for _ in range(2):
            bare.fit(x, y, batch_size=16, verbose=0)
        assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), bare.get_weights()))


def test_evaluate_and_predict_with_a_recorder_leave_keras_own_train_function(digits):
    x, y, _, _ = digits
    model = compile_(make_mlp())
    model.fit(x, y, batch_size=BATCH, verbose=0)
    traced = model.train_function
    rec = lab.Recorder(gradients=True)
    model.evaluate(x, y, verbose=0, callbacks=[rec])
    model.predict(x, verbose=0, callbacks=[rec])
    # A later fit() reuses it, as without the lab: no new trace.
    assert model.train_function is traced and not lab.hooks.attached(model)
    assert len(rec.run.batches()) == 0


def test_a_python_breakpoint_inside_an_execution_says_the_steps_after_it_ran_too(digits):
    x, y, _, _ = digits
    model = compile_(make_mlp(), steps_per_execution=3)
    rec = lab.Recorder(breakpoints=[lab.Breakpoint(lambda row: row["step"] == 3, name="at3")])
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[rec])
    [event] = rec.run.events().query("kind == 'breakpoint'").itertuples()
    assert event.step == 3 and int(model.optimizer.iterations.numpy()) == 6  # steps 3, 4, 5: one execution
    assert "steps 4 to 5 of the same execution" in event.detail and "steps_per_execution=1" in event.detail


def test_epoch_rows_hold_what_callbacks_after_the_recorder_add_to_the_epoch_logs_as_history_does(digits):
    x, y, _, _ = digits
    model = compile_(make_mlp())

    class AddHeldOut(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            logs["held_out_accuracy"] = self.model.evaluate(x[:64], y[:64], verbose=0, return_dict=True)["accuracy"]

    rec = lab.Recorder()
    history = model.fit(x, y, epochs=2, batch_size=BATCH, verbose=0, callbacks=[
        rec, AddHeldOut(), keras.callbacks.ReduceLROnPlateau(monitor="loss")]).history
    epochs = rec.run.epochs()
    assert sorted(c for c in epochs.columns if c not in ("epoch", "step")) == sorted(history)
    for key, values in history.items():
        np.testing.assert_array_equal(epochs[key].to_numpy(), np.float64(values))


def test_the_run_says_once_that_keras_put_the_moving_averages_in_place_of_the_weights_at_the_end(digits):
    x, y, _, _ = digits
    model = make_mlp()
    model.compile(optimizer=keras.optimizers.Adam(0.01, use_ema=True),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rec = lab.Recorder(weights=True)
    for _ in range(2):
        model.fit(x, y, batch_size=BATCH, verbose=0, callbacks=[rec])
    told = [e for e in rec.run.events().itertuples() if "moving averages" in e.detail]
    assert len(told) == 1 and told[0].step == len(x) // BATCH - 1
    # What the last row read is not what the model holds now: the swap came after it.
    last = rec.run.batches().iloc[-1]
    kernel = model.layers[0].kernel
    assert not np.isclose(last[f"weight_norm/{kernel.path}"], np.linalg.norm(kernel.numpy()), rtol=1e-6)
    plain = compile_(make_mlp())
    plain_rec = lab.Recorder(weights=True)
    plain.fit(x, y, batch_size=BATCH, verbose=0, callbacks=[plain_rec])
    assert not any("moving averages" in d for d in plain_rec.run.events()["detail"])


class _TrainsInside(keras.callbacks.Callback):
    """Trains the model itself from inside fit(): a fit() at the first
    epoch's end, a train_on_batch() at the end of the next epoch's batch 2."""

    def __init__(self, x, y, callbacks=()):
        super().__init__()
        self.x, self.y, self.callbacks = x, y, list(callbacks)

    def on_epoch_end(self, epoch, logs=None):
        if epoch == 0:
            self.model.fit(self.x[:3 * 8], self.y[:3 * 8], batch_size=8, epochs=1, shuffle=False, verbose=0,
                           callbacks=self.callbacks)

    def on_train_batch_end(self, batch, logs=None):
        if self.params["steps"] and batch == 2 and self.model.optimizer.iterations.numpy() > 6:
            self.model.train_on_batch(self.x[:8], self.y[:8])


def test_steps_a_callback_trains_inside_fit_are_left_out_of_the_run_and_told(digits):
    # They were labelled as this fit()'s batches, and the rows after them
    # shifted: a fit() inside on_epoch_end gave the next epoch batches 0-2
    # that were the inner fit's, then batch 3 for the outer batch 0.
    x, y = digits[0][:48], digits[1][:48]

    def trained(callbacks):
        model = compile_(make_mlp())
        keras.utils.set_random_seed(1)
        history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
                            callbacks=[*callbacks, _TrainsInside(x, y)])
        return model, history.history

    bare, bare_history = trained([])
    rec = lab.Recorder(gradients=True, flush_every=0)
    watched, history = trained([rec])
    assert int(watched.optimizer.iterations.numpy()) == 12 + 3 + 1
    for ours, theirs in zip(watched.get_weights(), bare.get_weights()):
        np.testing.assert_array_equal(ours, theirs)
    assert history == bare_history
    rows = rec.run.batches()
    assert list(zip(rows["epoch"], rows["batch"])) == [(e, b) for e in (0, 1) for b in range(6)]
    told = rec.run.events()
    told = told[told["kind"] == "not_ours"]
    assert [int(d.split()[0]) for d in told["detail"]] == [3, 1] and "called inside a callback" in told["detail"].iloc[0]
    assert not lab.hooks.attached(watched)


def test_the_same_recorder_given_to_a_fit_inside_its_fit_is_refused_naming_the_fix(digits):
    # The inner fit took the outer one's hooks away: the outer fit() failed
    # with Keras' "'NoneType' object is not callable" and the run said "finished".
    x, y = digits[0][:48], digits[1][:48]
    model = compile_(make_mlp())
    rec = lab.Recorder()
    with pytest.raises(RuntimeError, match=r"recording the fit\(\) .* that runs this callback.*Leave the Recorder out"):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[rec, _TrainsInside(x, y, callbacks=[rec])])
    assert rec.status == "failed" and len(rec.run) == 6
    assert not lab.hooks.attached(model)


@pytest.mark.parametrize("source", ["filtered dataset", "generator"])
def test_rows_of_data_of_unknown_size_keep_their_batch_labels_at_several_steps_per_execution(digits, source):
    # Keras 3.5 numbers each execution of its first epoch over data of unknown
    # size by its last step: the rows were labelled batch 2 to 8 of 7.
    x, y = digits[0][:56].astype("float32"), digits[1][:56]
    model = compile_(make_mlp(), steps_per_execution=3)
    if source == "generator":  # one pass: a generator ends with its first epoch
        data, epochs = ((x[i:i + 8], y[i:i + 8]) for i in range(0, 56, 8)), 1
    else:
        data, epochs = tf.data.Dataset.from_tensor_slices((x, y)).filter(lambda a, b: True).batch(8), 2
    rec = lab.Recorder()
    model.fit(data, epochs=epochs, verbose=0, callbacks=[rec])
    rows = rec.run.batches()
    assert list(zip(rows["epoch"], rows["batch"]))[:7] == [(0, b) for b in range(7)]
    if epochs == 2:
        assert list(zip(rows["epoch"], rows["batch"]))[7:] == [(1, b) for b in range(7)]


def test_early_stopping_that_puts_back_earlier_weights_is_told(digits):
    # The model ended with an earlier epoch's weights, the last rows showed
    # the last ones', and the run said nothing (as it does for use_ema).
    x, y = digits[0][:64], digits[1][:64]
    model = compile_(make_mlp())
    rising = keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: logs.update(watched=float(epoch)))
    stop = keras.callbacks.EarlyStopping(monitor="watched", mode="min", patience=1, restore_best_weights=True)
    rec = lab.Recorder(weights=True)
    model.fit(x, y, batch_size=16, epochs=5, verbose=0, callbacks=[rec, rising, stop])
    told = rec.run.events()
    told = told[told["detail"].str.contains("EarlyStopping")]
    assert len(told) == 1 and "epoch 1:" in told["detail"].iloc[0]
    plain = lab.Recorder(weights=True)
    compile_(make_mlp()).fit(x, y, batch_size=16, epochs=2, verbose=0,
                             callbacks=[plain, keras.callbacks.EarlyStopping(monitor="loss", restore_best_weights=True)])
    assert not plain.run.events()["detail"].str.contains("EarlyStopping").any()  # the best epoch was the last


@pytest.mark.parametrize("watched", ["nonfinite", "accumulated gradients"])
def test_an_execution_the_end_of_the_data_cuts_short_trains_as_bare_or_is_told(digits, watched):
    # Keras before 3.7 runs, where the data ends inside an execution, the
    # part of one more train step that needs no batch (3 batches at
    # steps_per_execution=2: bare counted 4 optimizer iterations). With
    # nonfinite() the lab's gate made that part wait for a batch (3), and
    # with gradients under gradient accumulation the step's state came out
    # otherwise now and then: Adam trained otherwise than bare from the
    # second epoch on, and the run said nothing.
    x, y = digits[0][:96], digits[1][:96]

    def fit(recorder):
        model = make_mlp()
        accumulation = 2 if watched == "accumulated gradients" else None
        model.compile(optimizer=keras.optimizers.Adam(1e-2, gradient_accumulation_steps=accumulation),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), steps_per_execution=2)
        model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                  callbacks=[recorder] if recorder is not None else [])
        return model

    bare = fit(None)
    rec = lab.Recorder(breakpoints=[lab.breakpoints.nonfinite()]) if watched == "nonfinite" \
        else lab.Recorder(gradients=True)
    model = fit(rec)
    events = rec.run.events()
    told = events[events["detail"].str.contains("steps_per_execution=2")]
    if lab.compat.SHORT_EXECUTION_RUNS_PART_OF_A_STEP:
        assert len(told) == 1 and told["kind"].iloc[0] == "warning"
        assert "3.7" in told["detail"].iloc[0]
    else:
        assert told.empty
        for got, expected in zip(model.weights + model.optimizer.variables, bare.weights + bare.optimizer.variables):
            np.testing.assert_array_equal(got.numpy(), expected.numpy())
