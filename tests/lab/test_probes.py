"""Gradient and weight probes: the gradients the optimizer applied, for any step."""

import collections
import contextlib
import functools
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import lab

BATCH = 32


@pytest.fixture(scope="module")
def digits():
    (x, y), _ = lab.datasets.digits()
    return x[:128], y[:128]


def make_mlp(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [keras.Input((64,)), keras.layers.Dense(12, activation="tanh"), keras.layers.Dense(10)]
    )


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def tape_gradients(model, x, y):
    with tf.GradientTape() as tape:
        loss = LOSS(y, model(x, training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    return {v.path: np.linalg.norm(g.numpy()) for v, g in zip(model.trainable_variables, grads)}


def first_row(model, x, y, **recorder_kwargs):
    rec = lab.Recorder(gradients=True, **recorder_kwargs)
    model.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, callbacks=[rec], verbose=0)
    return rec.run.batches().iloc[0], rec


@pytest.mark.parametrize("mode", ["eager", "graph", "xla"])
def test_gradient_norms_equal_the_tape_on_the_same_batch(digits, mode):
    x, y = digits
    model = make_mlp()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=LOSS, run_eagerly=mode == "eager",
                  jit_compile=mode == "xla")
    expected = tape_gradients(model, x[:BATCH], y[:BATCH])
    row, _ = first_row(model, x, y)
    for path, norm in expected.items():
        np.testing.assert_allclose(row[f"grad_norm/{path}"], norm, rtol=1e-4)
    np.testing.assert_allclose(row["grad_norm"], np.sqrt(sum(n**2 for n in expected.values())), rtol=1e-4)
    assert row["mode"] == mode


def test_reported_norm_is_after_clipping(digits):
    x, y = digits
    model = make_mlp()
    model.compile(optimizer=keras.optimizers.SGD(0.1, global_clipnorm=0.01), loss=LOSS)
    unclipped = tape_gradients(model, x[:BATCH], y[:BATCH])
    row, _ = first_row(model, x, y)
    assert np.sqrt(sum(n**2 for n in unclipped.values())) > 0.05
    np.testing.assert_allclose(row["grad_norm"], 0.01, rtol=1e-3)


def test_weights_give_update_ratios(digits):
    x, y = digits
    model = make_mlp()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=LOSS)
    grads = tape_gradients(model, x[:BATCH], y[:BATCH])
    row, _ = first_row(model, x, y, weights=True)
    for variable in model.trainable_variables:
        after = np.linalg.norm(variable.numpy())
        np.testing.assert_allclose(row[f"weight_norm/{variable.path}"], after, rtol=1e-4)
        # SGD: the update is lr * g.
        np.testing.assert_allclose(row[f"update_ratio/{variable.path}"], 0.1 * grads[variable.path] / after, rtol=1e-3)


class TwoOptimizerGAN(keras.Model):
    """A tiny GAN: a generator and a discriminator, each with its own optimizer."""

    def __init__(self):
        super().__init__()
        self.generator = keras.Sequential([keras.Input((4,)), keras.layers.Dense(64)], name="generator")
        self.discriminator = keras.Sequential([keras.Input((64,)), keras.layers.Dense(1)], name="discriminator")
        self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
        self.g_loss_tracker = keras.metrics.Mean(name="g_loss")

    def compile(self, d_opt, g_opt):
        super().compile()
        self.d_opt, self.g_opt = d_opt, g_opt

    @property
    def metrics(self):
        return [self.d_loss_tracker, self.g_loss_tracker]

    def train_step(self, data):
        real = data[0] if isinstance(data, tuple) else data
        bce = keras.losses.BinaryCrossentropy(from_logits=True)
        noise = tf.random.normal((tf.shape(real)[0], 4), seed=1)
        with tf.GradientTape() as tape:
            fake = self.generator(noise)
            logits = self.discriminator(tf.concat([real, fake], 0))
            labels = tf.concat([tf.ones((tf.shape(real)[0], 1)), tf.zeros((tf.shape(real)[0], 1))], 0)
            d_loss = bce(labels, logits)
        self.d_opt.apply_gradients(zip(tape.gradient(d_loss, self.discriminator.trainable_variables),
                                       self.discriminator.trainable_variables))
        with tf.GradientTape() as tape:
            g_loss = bce(tf.ones((tf.shape(real)[0], 1)), self.discriminator(self.generator(noise)))
        self.g_opt.apply(tape.gradient(g_loss, self.generator.trainable_variables), self.generator.trainable_variables)
        self.d_loss_tracker.update_state(d_loss)
        self.g_loss_tracker.update_state(g_loss)
        return {"d_loss": self.d_loss_tracker.result(), "g_loss": self.g_loss_tracker.result()}


def _xla_sums_in_columns(monkeypatch, columns):
    """Makes this process's XLA traces take the columns path (`lab.compat.slow_xla_cpu_trace`) or not, whatever
    the TF release: both paths are tested at both ends of the supported range."""
    if columns and tf.config.list_logical_devices("GPU"):
        pytest.skip("the columns path is for XLA on a CPU alone")
    monkeypatch.setattr(lab.compat, "SLOW_XLA_CPU_REDUCTIONS", columns)


@pytest.mark.parametrize("mode,columns", [("graph", False), ("xla", False), ("xla", True)],
                         ids=["graph", "xla", "xla-summed-in-columns"])
def test_weights_of_a_model_with_large_layers_are_recorded_under_xla(digits, mode, columns, monkeypatch):
    # Three Dense layers of 64-256-256-10: 18 norms in one update. Under XLA
    # the overflow branch's segment ids once had a bounded size that failed
    # to compile, and fit() raised at its first step. Where XLA sums large
    # tensors over columns (TF 2.19 and 2.21 on a CPU), the norms are the
    # same up to rounding and the training is still the bare one.
    _xla_sums_in_columns(monkeypatch, columns)
    x, y = digits

    def make():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256, activation="relu"),
                                  keras.layers.Dense(256, activation="relu"), keras.layers.Dense(10)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=LOSS, jit_compile=mode == "xla")
        return model

    bare, model = make(), make()
    bare.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, verbose=0)
    grads = tape_gradients(model, x[:BATCH], y[:BATCH])
    row, rec = first_row(model, x, y, weights=True)
    assert row["mode"] == mode
    for watched, plain in zip(model.weights, bare.weights):  # and the training is the bare one
        np.testing.assert_array_equal(watched.numpy(), plain.numpy())
    for variable in model.trainable_variables:
        after = np.linalg.norm(variable.numpy())
        np.testing.assert_allclose(row[f"grad_norm/{variable.path}"], grads[variable.path], rtol=1e-4)
        np.testing.assert_allclose(row[f"weight_norm/{variable.path}"], after, rtol=1e-4)
        np.testing.assert_allclose(row[f"update_ratio/{variable.path}"], 0.1 * grads[variable.path] / after, rtol=1e-3)
    # Under XLA the run says that its training is the bare one only up to float rounding.
    model.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, callbacks=[rec], verbose=0)
    notes = [d for d in rec.run.events()["detail"] if "XLA" in d]
    assert len(notes) == (1 if mode == "xla" else 0)


@pytest.mark.parametrize("columns", [False, True], ids=["whole", "in-columns"])
def test_a_half_sum_of_squares_under_xla_is_l2_loss_up_to_rounding(columns, monkeypatch):
    # Sizes around the columns' threshold (4,096) and their width (4), empty,
    # a matrix, float16 and large elements; a NaN or inf element gives NaN or inf.
    _xla_sums_in_columns(monkeypatch, columns)
    draw = np.random.default_rng(0)
    tensors = [draw.normal(size=n).astype(np.float32) for n in (0, 10, 4095, 4096, 4097, 65539)]
    tensors += [draw.normal(size=(256, 256)).astype(np.float32), draw.normal(size=8192).astype(np.float16)]
    tensors += [np.where(np.arange(5000) == 4999, np.nan, 1.0).astype(np.float32),
                np.where(np.arange(5000) == 7, np.inf, 1.0).astype(np.float32),
                np.full(4100, 2.6e17, np.float32)]
    compiled = tf.function(lambda t: lab.backend.tensorflow.norms.half_sum_of_squares(t), jit_compile=True)
    for tensor in tensors:
        got = float(compiled(tf.constant(tensor)))
        want = float(tf.nn.l2_loss(tf.cast(tf.constant(tensor), tf.float32)))
        if np.isnan(want) or np.isinf(want):
            assert got == want or (np.isnan(got) and np.isnan(want)), tensor.shape
        else:
            np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=str(tensor.shape))
            assert np.isfinite(got)


@pytest.mark.parametrize("columns", [False, True], ids=["xla-checked", "xla-summed-in-columns"])
def test_under_xla_a_norm_whose_squares_overflow_is_exact_or_inf_and_the_run_says_which(
        digits, columns, monkeypatch):
    # Gradients near 1e22. Where XLA's overflow check is cheap the step keeps
    # their norms exact; where it is not (TF 2.19 and 2.21 on a CPU) the host
    # finishes them, records inf, and the warning does not send the user to
    # jit_compile=True for exact norms.
    _xla_sums_in_columns(monkeypatch, columns)
    x, y = digits
    keras.utils.set_random_seed(5)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(12, activation="tanh", name="hidden"),
                              keras.layers.Dense(10, name="out")], name="net")
    model.compile(keras.optimizers.SGD(1e-25), lambda y, p: 1e22 * LOSS(y, p), jit_compile=True)
    rec = lab.Recorder(gradients=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x[:2 * BATCH], y[:2 * BATCH], batch_size=BATCH, callbacks=[rec], verbose=0)
    norms = rec.run.batches()["grad_norm/net/hidden/kernel"].to_numpy()
    told = [str(w.message) for w in caught if "inf from step" in str(w.message)]
    if columns:
        assert np.isinf(norms).all()
        assert len(told) == 1 and "1.8e19" in told[0] and "jit_compile" not in told[0]
    else:
        assert np.isfinite(norms).all() and (norms > 1e19).all()
        assert told == []


def test_a_gan_with_two_optimizers_gets_rows_for_both(digits):
    x, _ = digits
    keras.utils.set_random_seed(3)
    gan = TwoOptimizerGAN()
    gan.compile(keras.optimizers.Adam(1e-3), keras.optimizers.SGD(0.05))
    rec = lab.Recorder(gradients=True)
    gan.fit(x, batch_size=BATCH, epochs=2, callbacks=[rec], verbose=0)
    rows = rec.run.batches()
    assert len(rows) == 8
    for column in ("d_loss", "g_loss", "learning_rate/d_opt", "learning_rate/g_opt", "grad_norm"):
        assert np.isfinite(rows[column]).all(), column
    np.testing.assert_allclose(rows["learning_rate/g_opt"], 0.05, rtol=1e-6)
    generator = [c for c in rows.columns if c.startswith("grad_norm/generator")]
    discriminator = [c for c in rows.columns if c.startswith("grad_norm/discriminator")]
    assert len(generator) == 2 and len(discriminator) == 2
    # The global norm spans both optimizers' updates.
    parts = np.sqrt((rows[generator + discriminator] ** 2).sum(axis=1))
    np.testing.assert_allclose(rows["grad_norm"], parts, rtol=1e-4)
    # d_loss rows are each batch's own value, not the running mean.
    assert not np.allclose(rows["d_loss"].iloc[1], rows["d_loss"].iloc[:2].mean())


class PartlyUsed(keras.Model):
    def __init__(self):
        super().__init__()
        self.used = keras.layers.Dense(10, name="used")
        self.unused = keras.layers.Dense(10, name="unused")

    def call(self, x):
        self.unused(x)
        return self.used(x)


def test_a_variable_without_gradient_is_missing_not_zero(digits):
    x, y = digits
    keras.utils.set_random_seed(0)
    model = PartlyUsed()
    model(x[:1])
    model.compile(optimizer="sgd", loss=LOSS)
    with pytest.warns(UserWarning, match="Gradients do not exist"):
        row, _ = first_row(model, x, y)
    assert np.isnan(row["grad_norm/partly_used/unused/kernel"])
    assert row["grad_norm/partly_used/used/kernel"] > 0


class SameNames(keras.Model):
    def __init__(self):
        super().__init__()
        self.a = keras.layers.Dense(8, name="dense")
        self.b = keras.layers.Dense(10, name="dense")

    def call(self, x):
        return self.b(self.a(x))


def test_variables_sharing_a_path_are_numbered(digits):
    x, y = digits
    model = SameNames()
    model(x[:1])
    model.compile(optimizer="sgd", loss=LOSS)
    row, _ = first_row(model, x, y)
    paths = [v.path for v in model.trainable_variables]
    assert len(set(paths)) < len(paths)
    assert f"grad_norm/{paths[0]}#2" in row.index
    assert np.isfinite(row[[c for c in row.index if c.startswith("grad_norm/")]].astype(float)).all()


def test_loss_scale_optimizer_reports_unscaled_gradients_and_skipped_steps(digits):
    x, y = digits
    model = make_mlp()
    model.compile(optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=1024.0),
                  loss=LOSS)
    expected = tape_gradients(model, x[:BATCH], y[:BATCH])
    row, _ = first_row(model, x, y)
    np.testing.assert_allclose(row["grad_norm"], np.sqrt(sum(n**2 for n in expected.values())), rtol=1e-3)
    assert row["updated"] == 1
    # A batch with an infinite input: the loss scale optimizer skips the update.
    bad = x[:BATCH].copy()
    bad[0, 0] = np.inf
    before = [w.copy() for w in model.get_weights()]
    rec = lab.Recorder(gradients=True)
    model.fit(bad, y[:BATCH], batch_size=BATCH, callbacks=[rec], verbose=0)
    skipped = rec.run.batches().iloc[0]
    assert skipped["updated"] == 0 and np.isnan(skipped["grad_norm"])
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)


def poisoned(x, at_batch):
    x = x.copy()
    x[at_batch * BATCH + 3, 5] = np.nan
    return x


@pytest.mark.parametrize("steps_per_execution", [1, 4])
def test_nonfinite_breakpoint_keeps_the_bad_update_out(digits, steps_per_execution):
    x, y = digits
    model = make_mlp()
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss=LOSS, steps_per_execution=steps_per_execution)
    twin = make_mlp()
    twin.compile(optimizer=keras.optimizers.Adam(1e-2), loss=LOSS)
    twin.set_weights(model.get_weights())
    twin.fit(x[: 2 * BATCH], y[: 2 * BATCH], batch_size=BATCH, shuffle=False, verbose=0)

    rec = lab.Recorder(gradients=True, breakpoints=[lab.breakpoints.nonfinite()])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(poisoned(x, 2), y, batch_size=BATCH, shuffle=False, epochs=3, callbacks=[rec], verbose=0)
    # The NaN poisons Keras' loss tracker; that is no mistake of the step's to warn about.
    assert not [w for w in caught if "loss tracker" in str(w.message)]

    assert int(model.optimizer.iterations.numpy()) == 2
    for got, want in zip(model.get_weights(), twin.get_weights()):
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    rows = rec.run.batches()
    assert len(rows) == 3 and np.isnan(rows["loss"].iloc[2])
    event = rec.run.events().iloc[-1]
    assert event["kind"] == "nonfinite" and event["step"] == 2
    assert "loss" in event["detail"] and "sequential" in event["detail"]
    assert rec.status == "stopped"
    assert "train_step" not in model.__dict__ and "apply" not in model.optimizer.__dict__
    # Released: a later fit trains again.
    model.fit(x, y, batch_size=BATCH, callbacks=[lab.Recorder(breakpoints=[lab.breakpoints.nonfinite()])], verbose=0)
    assert int(model.optimizer.iterations.numpy()) > 2


class _SeenBatches(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.batches = []

    def on_train_batch_end(self, batch, logs=None):
        self.batches.append(batch)


@pytest.mark.parametrize("steps_per_execution", [1, 4])
def test_a_blocking_fit_stops_at_the_execution_a_device_breakpoint_hits_and_counts_the_batches_held(
        digits, steps_per_execution):
    # fit() learned of the hit at the recorder's next read (every 0.25 s):
    # the batches in between ran with their updates held, counted by Keras'
    # logs and seen by other callbacks, and the run said nothing of them.
    x, y = digits
    model = make_mlp()
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss=LOSS, steps_per_execution=steps_per_execution)
    rec = lab.Recorder(breakpoints=[lab.breakpoints.nonfinite()], flush_every=3600)
    seen = _SeenBatches()
    model.fit(poisoned(x, 2), y, batch_size=BATCH // 4, shuffle=False, epochs=2, callbacks=[rec, seen], verbose=0)
    poisoned_batch = 2 * 4 + (3 // (BATCH // 4))  # the NaN's sample, in batches of BATCH // 4
    assert int(model.optimizer.iterations.numpy()) == poisoned_batch
    executed = -(-(poisoned_batch + 1) // steps_per_execution) * steps_per_execution  # to its execution's end
    assert len(seen.batches) == executed // steps_per_execution  # one batch end per execution
    detail = rec.run.events().iloc[-1]["detail"]
    held = executed - poisoned_batch - 1
    if held:
        assert f"{held} later batch(es) ran with their updates held" in detail
    else:
        assert "held" not in detail


def test_a_stepper_opened_after_a_device_hit_in_a_blocking_fit_steps_the_batch_that_hit(digits):
    # fit() ran on until the recorder's next read, so the kept batch was a
    # later one: the stepper was labelled with the hit's step and stepped
    # batch 19's data.
    from lab.backend.tensorflow.in_flight import BatchInFlight

    x, y = digits
    model = make_mlp()
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss=LOSS)
    keep = BatchInFlight()
    rec = lab.Recorder(breakpoints=[lab.breakpoints.nonfinite()])
    bad = poisoned(x, 2)
    model.fit(bad, y, batch_size=BATCH, shuffle=False, callbacks=[keep, rec], verbose=0)
    trace = keep.stepper(run=rec.run).step()
    assert (trace.index, trace.batch) == (2, 2)
    np.testing.assert_array_equal(trace.x, bad[2 * BATCH:3 * BATCH])


class OwnLossRegressor(keras.Model):
    """A step with a loss of its own (as a GAN's): no compute_loss."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(1)
        self.mse = keras.losses.MeanSquaredError()
        self.tracker = keras.metrics.Mean(name="own_loss")

    def call(self, x):
        return self.dense(x)

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.mse(y, self(x))
        self.optimizer.apply(tape.gradient(loss, self.trainable_variables), self.trainable_variables)
        self.tracker.update_state(loss)
        return {"own_loss": self.tracker.result()}


def test_a_loss_spike_on_a_step_without_compute_loss_is_told_it_can_never_hit(digits):
    # It read no loss, never hit, and said nothing.
    x, _ = digits
    keras.utils.set_random_seed(0)
    model = OwnLossRegressor()
    model.compile(optimizer=keras.optimizers.SGD(1e-3))
    rec = lab.Recorder(breakpoints=[lab.breakpoints.loss_spike(3.0, warmup=1)])
    model.fit(x, np.zeros((len(x), 1), "float32"), batch_size=BATCH, shuffle=False, callbacks=[rec], verbose=0)
    told = rec.run.events()["detail"]
    assert told.str.contains(r"loss_spike\(3\) watch the loss compute_loss returns").sum() == 1
    assert told.str.contains("lab.Breakpoint").any()
    plain = lab.Recorder(breakpoints=[lab.breakpoints.nonfinite()])  # reads the gradients too: not told
    model.fit(x, np.zeros((len(x), 1), "float32"), batch_size=BATCH, shuffle=False, callbacks=[plain], verbose=0)
    assert not plain.run.events()["detail"].str.contains("never hit").any()


class EmaRegressor(keras.Model):
    """keras-io's DDIM in small: a network with BatchNormalization trained
    by hand, and an EMA copy of all its weights (moving statistics too)
    that no optimizer updates; the step logs its own loss only."""

    def __init__(self):
        super().__init__()
        self.network = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.BatchNormalization(),
                                         keras.layers.Dense(1)], name="network")
        self.ema_network = keras.models.clone_model(self.network)

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(self.network(x, training=True) - y))
        gradients = tape.gradient(loss, self.network.trainable_weights)
        self.optimizer.apply_gradients(zip(gradients, self.network.trainable_weights))
        for weight, ema_weight in zip(self.network.weights, self.ema_network.weights):
            ema_weight.assign(0.9 * ema_weight + 0.1 * weight)
        return {"n_loss": loss}


def fit_ema_regressor(x, y, recorder=None):
    keras.utils.set_random_seed(0)
    model = EmaRegressor()
    model.compile(optimizer=keras.optimizers.Adam(1e-2))
    model.fit(x, y, batch_size=4, shuffle=False, verbose=0, callbacks=[recorder] if recorder else [])
    return model


def test_a_nonfinite_hit_keeps_the_batch_out_of_the_moving_statistics_and_names_only_the_values_the_step_gave():
    # The optimizer's update was kept out, but BatchNormalization's moving
    # statistics (assigned by the forward pass) took the NaN batch in, and the
    # EMA copy took them: the model predicted NaN after a "clean" stop. The
    # event named the EMA copy's variables (no gradient: NaN for "none") and
    # Keras' unused loss tracker as not finite.
    x = np.random.default_rng(0).normal(size=(12, 4)).astype("float32")
    y = x.sum(1, keepdims=True)
    bad = x.copy()
    bad[9, 2] = np.nan  # the third batch
    good = fit_ema_regressor(x[:8], y[:8])
    recorder = lab.Recorder(gradients=True, breakpoints=[lab.breakpoints.nonfinite()])
    model = fit_ema_regressor(bad, y, recorder)
    # The network and its statistics are those of the good batches alone; the
    # EMA copy took one more step of those weights (the step's own code ran),
    # and its statistics are put back with the network's.
    for got, want in zip(model.network.weights + model.ema_network.non_trainable_weights,
                         good.network.weights + good.ema_network.non_trainable_weights):
        np.testing.assert_array_equal(got.numpy(), want.numpy(), err_msg=got.path)
    assert all(np.isfinite(v.numpy()).all() for v in model.weights)
    assert np.isfinite(model.ema_network.predict(x, verbose=0)).all()
    event = recorder.run.events().query("kind == 'nonfinite'")["detail"].iloc[0]
    named = event.split("not finite: ")[1].split(", ")
    assert sorted(named) == sorted(v.path for v in model.network.trainable_weights)


def fit_half_precision_regressor(x, y, recorder=None):
    """A mixed_float16 regressor with BatchNormalization: Keras wraps Adam in
    a LossScaleOptimizer, whose first scales overflow on this large loss."""
    keras.utils.set_random_seed(0)
    previous = keras.config.dtype_policy()
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    try:
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16), keras.layers.BatchNormalization(),
                                  keras.layers.Dense(1, dtype="float32")])
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    finally:
        keras.mixed_precision.set_dtype_policy(previous)
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0, callbacks=[recorder] if recorder else [])
    return model


def test_nonfinite_leaves_a_loss_scale_optimizers_overflows_to_it_and_stops_at_a_nonfinite_loss():
    # The gate took the overflowing scaled gradients of mixed precision's
    # first steps for a NaN: it stopped training at step 0, where bare fit()
    # lets the LossScaleOptimizer skip those updates and lower its scale.
    x = (np.random.default_rng(0).normal(size=(128, 8)) * 100).astype("float32")
    y = x.sum(1, keepdims=True) * 50
    bare = fit_half_precision_regressor(x, y)
    assert isinstance(bare.optimizer, keras.optimizers.LossScaleOptimizer)
    assert int(bare.optimizer.iterations.numpy()) < 16  # updates skipped for overflows
    recorder = lab.Recorder(breakpoints=[lab.breakpoints.nonfinite()])
    watched = fit_half_precision_regressor(x, y, recorder)
    assert recorder.run.events().query("kind == 'nonfinite'").empty
    for got, want in zip(watched.weights + watched.optimizer.variables, bare.weights + bare.optimizer.variables):
        np.testing.assert_array_equal(got.numpy(), want.numpy(), err_msg=got.path)
    bad = x.copy()
    bad[40, 3] = np.nan  # the third batch
    recorder = lab.Recorder(breakpoints=[lab.breakpoints.nonfinite()])
    stopped = fit_half_precision_regressor(bad, y, recorder)
    assert recorder.run.events().query("kind == 'nonfinite'")["step"].tolist() == [2]
    assert all(np.isfinite(v.numpy()).all() for v in stopped.weights)


def test_a_nan_gradient_that_went_into_the_update_makes_the_total_nan_and_is_said_once():
    # One NaN input row makes only the hidden kernel's gradient NaN (the loss
    # stays finite): the kernel's column was NaN, read as "no gradient", so
    # grad_norm showed the other variables' norm, finite, and the run said
    # nothing while the kernel turned NaN.
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="relu", name="hidden"),
                              keras.layers.Dense(1, name="out")])
    model.compile(optimizer="sgd", loss="mse")
    x = np.random.default_rng(0).normal(size=(96, 4)).astype("float32")
    x[40] = np.nan  # the second batch
    recorder = lab.Recorder(gradients=True)
    model.fit(x, np.ones((96, 1), "float32"), batch_size=32, shuffle=False, verbose=0, callbacks=[recorder])
    rows = recorder.run.batches()
    kernel = model.get_layer("hidden").kernel
    assert np.isnan(kernel.numpy()).any() and np.isfinite(rows["loss"].iloc[1])
    assert np.isnan(rows[f"grad_norm/{kernel.path}"].iloc[1]) and np.isnan(rows["grad_norm"].iloc[1])
    assert np.isfinite(rows["grad_norm"].iloc[0])
    said = [(step, d) for step, d in zip(recorder.run.events()["step"], recorder.run.events()["detail"])
            if "not finite from step" in d]
    assert len(said) == 1 and said[0][0] == 1 and kernel.path in said[0][1] and "nonfinite()" in said[0][1]


def test_loss_spike_stops_before_the_spiking_update(digits):
    x, y = digits
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(1e-3), loss="mse")
    target = np.zeros((len(x), 1), "float32")
    target[3 * BATCH : 4 * BATCH] = 1e3
    rec = lab.Recorder(breakpoints=[lab.breakpoints.loss_spike(5.0, warmup=2)])
    model.fit(x, target, batch_size=BATCH, shuffle=False, callbacks=[rec], verbose=0)
    assert len(rec.run) == 4
    assert int(model.optimizer.iterations.numpy()) == 3
    assert rec.run.events()["kind"].tolist() == ["breakpoint"]
    assert "loss_spike(5)" in rec.run.events()["detail"].iloc[0]


def test_loss_spike_needs_a_factor_above_one():
    with pytest.raises(ValueError, match=r"factor=\.\.\.\) must be a number above 1"):
        lab.breakpoints.loss_spike(0.5)


def test_learning_rate_is_the_value_each_step_used(digits):
    x, y = digits
    schedule = keras.optimizers.schedules.PiecewiseConstantDecay([1, 2], [0.3, 0.2, 0.1])
    model = make_mlp()
    model.compile(optimizer=keras.optimizers.SGD(schedule), loss=LOSS)
    rec = lab.Recorder()
    model.fit(x, y, batch_size=BATCH, callbacks=[rec], verbose=0)
    # PiecewiseConstantDecay: steps <= 1 use 0.3, step 2 uses 0.2, later steps 0.1.
    np.testing.assert_allclose(rec.run.column("learning_rate"), [0.3, 0.3, 0.2, 0.1], rtol=1e-6)


def test_gradient_accumulation_rows_carry_each_batch_and_mark_updates(digits):
    x, y = digits
    model = make_mlp()
    model.compile(optimizer=keras.optimizers.SGD(0.1, gradient_accumulation_steps=2), loss=LOSS)
    twin = make_mlp()
    twin.compile(optimizer=keras.optimizers.SGD(0.1, gradient_accumulation_steps=2), loss=LOSS)
    twin.set_weights(model.get_weights())
    first = tape_gradients(twin, x[:BATCH], y[:BATCH])
    rec = lab.Recorder(gradients=True)
    model.fit(x, y, batch_size=BATCH, shuffle=False, callbacks=[rec], verbose=0)
    rows = rec.run.batches()
    assert rows["updated"].tolist() == [0, 1, 0, 1]
    assert np.isfinite(rows["grad_norm"]).all()
    np.testing.assert_allclose(rows["grad_norm"].iloc[0], np.sqrt(sum(n**2 for n in first.values())), rtol=1e-4)


def _dense_stack(layers):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,))] + [keras.layers.Dense(8, activation="relu") for _ in range(layers)]
                             + [keras.layers.Dense(3)])
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _traced_step(model, probe_args):
    """`train_step` of `_dense_stack`'s model traced with a probe (None:
    without), as a concrete function. The optimizer is built first, as fit()
    builds it: a trace that creates its variables is traced again."""
    if not model.optimizer.built:
        model.optimizer.build(model.trainable_variables)
    probe = lab.backend.tensorflow.probes.Probe(model, **probe_args) if probe_args is not None else None
    if probe is not None:
        probe.install()
    try:
        specs = (tf.TensorSpec([4, 8], tf.float32), tf.TensorSpec([4], tf.int32))
        return tf.function(lambda data: model.train_step(data), autograph=False).get_concrete_function(specs)
    finally:
        if probe is not None:
            probe.uninstall()


def _step_ops(model, probe_args):
    """Nodes of `train_step` traced with a probe (None: without), by op
    type, branch functions included (a graph runs a branch not taken as
    dead nodes), and a cond's Switches."""
    return lab.compat.graph_nodes(_traced_step(model, probe_args).graph)


def _stack_ops(layers, probe_args):
    """`_step_ops(_dense_stack(layers), probe_args)`, traced once for all the
    tests here (a 25-layer step takes seconds to trace); a copy, which the
    caller may change."""
    key = None if probe_args is None else tuple(sorted(probe_args.items()))
    return collections.Counter(_traced_stack(layers, key))


@functools.lru_cache(maxsize=None)
def _traced_stack(layers, key):
    return _step_ops(_dense_stack(layers), None if key is None else dict(key))


def _kernels(ops):
    """Kernels among a step's nodes (`_step_ops`)."""
    return sum(n for kind, n in ops.items() if kind not in ("Const", "Placeholder", "NoOp"))


def test_an_updates_norms_add_no_branch_to_the_step_however_many_variables():
    # An overflow check of the norms, as one If node that reads every tensor
    # (150 for the gradients, weights and updates of 50 variables), cost
    # 7-10% of the 50-variable MLP's step; as a lowered tf.cond it was a
    # Switch per tensor. The step writes half sums of squares with no check:
    # the host finishes them and says when one is inf.
    for layers in (1, 25):
        watched, bare = _stack_ops(layers, {"gradients": True, "weights": True}), _stack_ops(layers, None)
        for kind in ("Switch", "Merge", "If", "StatelessIf"):
            assert watched[kind] == bare[kind], kind


def test_what_a_probe_adds_to_a_step_grows_by_a_few_kernels_per_variable():
    # The per-variable values travel as one vector (no op per column): a
    # model with 48 more variables costs a few kernels more for each of them,
    # and Recorder()'s own kernels do not depend on the variables at all.
    small, deep = _dense_stack(1), _dense_stack(25)
    extra = len(deep.trainable_variables) - len(small.trainable_variables)
    added = {}
    for name, args in {"plain": {}, "gradients": {"gradients": True},
                       "weights": {"gradients": True, "weights": True}}.items():
        added[name] = [_kernels(_stack_ops(layers, args)) - _kernels(_stack_ops(layers, None))
                       for layers in (1, 25)]
    assert added["plain"][0] == added["plain"][1] <= 20
    assert (added["gradients"][1] - added["gradients"][0]) / extra <= 3
    assert (added["weights"][1] - added["weights"][0]) / extra <= 9
    # The weight and update norms go into the gradients' one stack.
    assert added["weights"][0] - added["gradients"][0] <= 9 * len(small.trainable_variables) + 15


def test_the_step_leaves_square_roots_and_update_ratios_to_the_host():
    # The step writes each norm as its half sum of squares (l2_loss) into the
    # row; the doubling, the square root and the update ratios are the
    # host's, and the row goes in with no slice of the norms and no gather.
    added = _stack_ops(1, {"gradients": True, "weights": True})
    added.subtract(_stack_ops(1, None))
    for kind in ("Sqrt", "Mul", "DivNoNan", "RealDiv", "GatherV2"):
        assert added[kind] == 0, (kind, dict(added))
    assert added["StridedSlice"] <= 1  # the batch size


def _optimized_ops(model, probe_args):
    """Nodes of `train_step` (`_traced_step`) by op type, after Grappler has
    optimized the graph as a step's run would, with the step's outputs and
    its variable writes as what it must keep."""
    from tensorflow.core.protobuf import config_pb2
    from tensorflow.python.grappler import tf_optimizer

    traced = _traced_step(model, probe_args)
    graph = traced.graph
    meta = tf.compat.v1.train.export_meta_graph(graph_def=graph.as_graph_def(add_shapes=True), graph=graph)
    kept = meta.collection_def["train_op"].node_list.value
    kept.extend(t.name for t in traced.outputs)
    kept.extend(op.name for op in graph.get_operations() if op.type.startswith(("Assign", "ResourceScatter")))
    optimized = tf_optimizer.OptimizeGraph(config_pb2.ConfigProto(), meta)
    counts = collections.Counter(node.op for node in optimized.node)
    counts.update(node.op for function in optimized.library.function for node in function.node_def)
    return counts


@pytest.mark.parametrize("probe_args", [{"gradients": True}, {"gradients": True, "weights": True}],
                         ids=["gradients", "weights"])
def test_each_update_still_starts_when_its_own_gradient_is_ready(probe_args):
    # Keras' step hands the gradients to the optimizer through one IdentityN
    # of all of them, which Grappler removes while each reader takes one of
    # its outputs. A lab node that reads several (small gradients stacked to
    # sum them together, tried on 2026-12-06) kept it, and every update then
    # waited for the whole backward pass: the 50-variable MLP's watched step
    # got slower by 50-100 us with fewer kernels.
    model = _dense_stack(6)
    bare = _optimized_ops(model, None)
    assert bare["IdentityN"] == 0
    assert _optimized_ops(model, probe_args)["IdentityN"] == bare["IdentityN"]


def test_a_mean_metrics_batch_value_is_divided_on_the_host():
    # The step puts the metric's total and count, after and before, into the
    # row as they are: no subtraction, comparison or division per metric.
    keras.utils.set_random_seed(0)
    plain, measured = _dense_stack(1), _dense_stack(1)
    measured.compile("adam", LOSS, metrics=["accuracy", keras.metrics.SparseCategoricalCrossentropy(from_logits=True)])
    extra = {}
    for model in (plain, measured):
        added = _step_ops(model, {})
        added.subtract(_step_ops(model, None))
        extra[model] = added
    more = extra[measured] - extra[plain]
    for kind in ("Sub", "Greater", "DivNoNan", "RealDiv", "SelectV2", "Select"):
        assert more[kind] == 0, (kind, dict(more))
    assert more["ReadVariableOp"] == 2 * 4  # each metric's total and count, before and after: reads only


class CriticSteps(keras.Sequential):
    """A critic loop in miniature: one optimizer applied three times per step."""

    def train_step(self, data):
        x, y = data
        for _ in range(3):
            with tf.GradientTape() as tape:
                loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
            grads = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply(grads, self.trainable_variables)
        for metric in self.metrics:
            metric.update_state(loss)
        return {"loss": loss}


def _model_for(kind):
    keras.utils.set_random_seed(5)
    layers = [keras.Input((64,)), keras.layers.Dense(12, activation="tanh", name="hidden"),
              keras.layers.Dense(10, name="out")]
    model = (CriticSteps if kind == "critic" else keras.Sequential)(layers, name="net")
    if kind == "overflowing":
        # Gradients near 1e22: finite, but their sums of squares overflow
        # float32. The step that computes its norms keeps them exact; the
        # host cannot, and says so.
        loss = lambda y, p: 1e22 * LOSS(y, p)  # noqa: E731
        model.compile(keras.optimizers.SGD(1e-25), loss, steps_per_execution=4)
    else:
        model.compile("adam", LOSS, metrics=None if kind == "critic" else ["accuracy"],
                      steps_per_execution=4 if kind == "spe4" else 1)
    return model


@pytest.mark.parametrize("kind", ["plain", "spe4", "critic", "overflowing"])
def test_rows_the_host_finishes_equal_what_the_step_computed_bit_for_bit(digits, kind, monkeypatch):
    x, y = digits
    runs = []
    for on_host in (True, False):
        monkeypatch.setattr(lab.backend.tensorflow.probes.Probe, "FINISHES_ON_HOST", on_host)
        model = _model_for(kind)
        rec = lab.Recorder(gradients=True, weights=True)
        model.fit(x, y, batch_size=BATCH, epochs=2, callbacks=[rec], verbose=0, shuffle=False)
        runs.append((rec.run.batches(), rec.run.events()))
    (finished, finished_events), (computed, computed_events) = runs
    assert list(finished.columns) == list(computed.columns)
    assert len(finished) == 8
    norms = [c for c in finished.columns if c.startswith(("grad_norm", "weight_norm/", "update_ratio/"))]
    assert len(norms) == 1 + 3 * 4
    means = ["loss", "accuracy"] if "accuracy" in finished else ["loss"]
    overflowed = [c for c in norms if c.startswith("grad_norm")] if kind == "overflowing" else []
    for column in norms + means:
        if column in overflowed:
            continue
        assert np.isfinite(finished[column]).all(), column
        if overflowed:
            # The step's overflow check sends the whole update, weights
            # included, to its scaled computation: a few ulps away (a ratio, two).
            np.testing.assert_allclose(finished[column], computed[column], rtol=1e-6, atol=0, err_msg=column)
        else:
            np.testing.assert_array_equal(finished[column].to_numpy(), computed[column].to_numpy(), err_msg=column)
    assert computed_events.empty
    if kind == "overflowing":
        assert (computed["grad_norm/net/hidden/kernel"] > 1e19).all()
        for column in overflowed:
            assert np.isinf(finished[column]).all() and np.isfinite(computed[column]).all(), column
        # One warning, at the first step, naming the four columns; once per run.
        assert list(finished_events["kind"]) == ["warning"]
        detail = finished_events["detail"].iloc[0]
        assert int(finished_events["step"].iloc[0]) == 0
        assert "are inf from step 0" in detail and "1.8e19" in detail
        assert all(column in detail for column in overflowed if column != "grad_norm")
    else:
        assert finished_events.empty


def test_under_xla_a_critic_loops_norms_finished_on_the_host_are_the_steps_own(digits, monkeypatch):
    # One optimizer applied three times a step under XLA. Where the host
    # finishes the norms (TF 2.19 and 2.21 on a CPU alone) the later applies
    # decode the first's half sums on the device and combine with theirs,
    # and the 8,192-element kernel is summed over columns; against the step
    # computing its norms itself (the other XLA path), the same norms up to
    # rounding, and the same training bit for bit.
    x, y = digits
    runs = []
    for columns in (False, True):
        _xla_sums_in_columns(monkeypatch, columns)
        keras.utils.set_random_seed(5)
        model = CriticSteps([keras.Input((64,)), keras.layers.Dense(128, activation="tanh", name="hidden"),
                             keras.layers.Dense(10, name="out")], name="net")
        model.compile("adam", LOSS, jit_compile=True)
        rec = lab.Recorder(gradients=True, weights=True)
        model.fit(x, y, batch_size=BATCH, epochs=1, callbacks=[rec], verbose=0, shuffle=False)
        runs.append((rec.run.batches(), [w.numpy() for w in model.weights]))
    (checked, checked_weights), (finished, finished_weights) = runs
    for before, after in zip(checked_weights, finished_weights):
        np.testing.assert_array_equal(before, after)
    assert list(finished.columns) == list(checked.columns) and len(finished) == 4
    norms = [c for c in finished.columns if c.startswith(("grad_norm", "weight_norm/", "update_ratio/"))]
    assert len(norms) == 1 + 3 * 4
    assert (finished["applies/optimizer"] == 3).all()
    for column in norms:
        assert np.isfinite(finished[column]).all() and (finished[column] > 0).all(), column
        np.testing.assert_allclose(finished[column], checked[column], rtol=1e-5, err_msg=column)


class TwoLosses(keras.Model):
    """A custom step whose per-output loss trackers (fed by compute_loss)
    exist only after the first trace: a later trace reads their totals where
    the first took their logged values."""

    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True)
        self.optimizer.apply(tape.gradient(loss, self.trainable_variables), self.trainable_variables)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss, sample_weight=tf.shape(x)[0])
        return self.get_metrics_result()


def test_values_a_later_trace_gives_in_another_form_are_recorded(digits):
    x, y = digits
    keras.utils.set_random_seed(0)
    inputs = keras.Input((64,))
    trunk = keras.layers.Dense(16, activation="relu")(inputs)
    model = TwoLosses(inputs, {"digit": keras.layers.Dense(10, name="digit")(trunk),
                               "parity": keras.layers.Dense(1, name="parity")(trunk)})
    model.compile("adam", loss={"digit": LOSS, "parity": keras.losses.BinaryCrossentropy(from_logits=True)},
                  loss_weights={"digit": 1.0, "parity": 10.0})
    targets = {"digit": y, "parity": (y % 2).astype("float32")[:, None]}
    rec = lab.Recorder(gradients=True, weights=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        model.fit(x[:120], {k: v[:120] for k, v in targets.items()}, batch_size=BATCH, epochs=1, verbose=0,
                  callbacks=[rec])  # 3 full batches and one of 24: a second trace
    rows = rec.run.batches()
    assert len(rows) == 4
    for column in ("loss", "digit_loss", "parity_loss"):
        assert np.isfinite(rows[column]).all(), column
    # (How the trackers' values add up to the loss moves between Keras
    # releases; notebooks/11 checks it on the current one.)


def test_a_switch_to_xla_inside_fit_keeps_every_column(digits):
    # The first (graph) trace fixes the row's columns with norms and metric
    # totals for the host to finish; the XLA trace computes them itself, and
    # its values go into those columns all the same.
    x, y = digits
    model = make_mlp(4)
    model.compile("adam", LOSS, metrics=["accuracy"])
    rec = lab.Recorder(gradients=True, weights=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                  callbacks=[rec, lab.ModeSwitcher({2: "xla", 6: "graph"})])
    rows = rec.run.batches()
    assert list(rows["mode"]) == ["graph"] * 2 + ["xla"] * 4 + ["graph"] * 2
    values = [c for c in rows.columns if c.startswith(("grad_norm", "weight_norm/", "update_ratio/"))]
    assert len(values) == 1 + 3 * 4
    for column in values + ["loss", "accuracy"]:
        assert np.isfinite(rows[column]).all(), column
    ratios = rows[[c for c in values if c.startswith("update_ratio/")]].to_numpy()
    assert ((ratios > 0) & (ratios <= 1)).all()  # a bias from 0: its first update is all of it
    assert ((rows["accuracy"] * BATCH).round(3) % 1 == 0).all()  # each batch's own share of 32


# ---- an Embedding's sparse gradient ------------------------------------------------

VOCABULARY, WIDTH = 400, 6


def make_embedding_classifier(optimizer):
    keras.utils.set_random_seed(0)
    inputs = keras.Input(shape=(None,), dtype="int32")
    pooled = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(VOCABULARY, WIDTH)(inputs))
    model = keras.Model(inputs, keras.layers.Dense(1, activation="sigmoid")(pooled))
    model.compile(optimizer=optimizer, loss="binary_crossentropy")
    return model


def token_batches(n=48, length=10):
    # Few distinct tokens: most batches repeat ids, whose gradient rows add up.
    r = np.random.default_rng(3)
    return r.integers(0, 30, (n, length)).astype("int32"), r.integers(0, 2, n).astype("float32")


def dense_conversions(caught):
    return [str(w.message) for w in caught if "Converting sparse IndexedSlices" in str(w.message)]


@pytest.fixture
def warn_at_every_dense_conversion(monkeypatch):
    # TensorFlow warns where it turns a sparse gradient into a dense tensor of
    # 1e8 elements or more (an Embedding of a large vocabulary: the whole table
    # at every step). At 1 it warns at every conversion.
    from tensorflow.python.framework import indexed_slices

    monkeypatch.setattr(indexed_slices, "_LARGE_SPARSE_NUM_ELEMENTS", 1)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.usefixtures("warn_at_every_dense_conversion")
def test_an_embeddings_sparse_gradient_is_not_made_dense_by_the_lab(optimizer):
    # The bare fit's count of dense conversions is the reference: plain SGD
    # applies the slices as they are.
    x, y = token_batches()
    fits = {}
    for name, callbacks in [("bare", []), ("lab", [lab.Recorder(gradients=True, weights=True,
                                                                  breakpoints=[lab.breakpoints.nonfinite()])])]:
        model = make_embedding_classifier(optimizer)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)
        fits[name] = (model, dense_conversions(caught), callbacks)
    (bare, bare_conversions, _), (watched, lab_conversions, (rec,)) = fits["bare"], fits["lab"]
    assert len(lab_conversions) == len(bare_conversions), lab_conversions
    for a, b in zip(watched.weights, bare.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    # The first row's norm is the dense gradient's: its repeated rows summed.
    model = make_embedding_classifier(optimizer)
    with tf.GradientTape() as tape:
        loss = model.compute_loss(y=y[:16], y_pred=model(x[:16], training=True))
    table = model.trainable_variables[0]
    sparse = tape.gradient(loss, [table])[0]
    assert isinstance(sparse, tf.IndexedSlices) and len(np.unique(sparse.indices)) < len(sparse.indices)
    recorded = rec.run.batches().iloc[0][f"grad_norm/{watched.trainable_variables[0].path}"]
    np.testing.assert_allclose(recorded, np.linalg.norm(tf.convert_to_tensor(sparse).numpy()), rtol=1e-6)
    assert not np.isclose(recorded, np.linalg.norm(sparse.values.numpy()), rtol=1e-3)


@pytest.mark.usefixtures("warn_at_every_dense_conversion")
def test_a_watched_loop_reads_a_sparse_gradient_as_it_is():
    x, y = token_batches(16)
    model = make_embedding_classifier("sgd")
    optimizer = keras.optimizers.SGD(0.5)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = keras.losses.binary_crossentropy(y[:, None], model(x, training=True))
            loss = tf.reduce_mean(loss)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)
        return loss, grads[0]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with lab.watch(model, optimizer, breakpoints=[lab.breakpoints.nonfinite()]) as run:
            loss, sparse = step(x, y)
            run.step(loss=loss)
    assert dense_conversions(caught) == []
    row = run.batches().iloc[0]
    key = model.trainable_variables[0].path
    np.testing.assert_allclose(row[f"grad_norm/{key}"], np.linalg.norm(tf.convert_to_tensor(sparse).numpy()),
                               rtol=1e-6)


# ---- an optimizer that trains a tf.Variable no model holds -------------------------


def style_transfer_loop(watch_kwargs=None, steps=3):
    """keras-io's neural style transfer, in small: an SGD trains a plain
    `tf.Variable` image through a frozen feature extractor, in a
    tf.function. With `watch_kwargs`, in a `lab.watch` block. Returns the
    image after each step, and the run."""
    keras.utils.set_random_seed(4)
    extractor = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
    image = tf.Variable(np.random.default_rng(2).normal(size=(2, 6)).astype("float32"))
    optimizer = keras.optimizers.SGD(keras.optimizers.schedules.ExponentialDecay(0.5, 100, 0.96))

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(extractor(image)))
        optimizer.apply_gradients([(tape.gradient(loss, image), image)])
        return loss

    images, run = [], None
    with (lab.watch(extractor, optimizer, **watch_kwargs) if watch_kwargs is not None
          else contextlib.nullcontext()) as run:
        for _ in range(steps):
            loss = step()
            if run is not None:
                run.step(loss=loss)
            images.append(image.numpy())
    return images, run


def test_a_watched_loop_that_trains_a_plain_tf_variable_keeps_its_weights_and_reads_them():
    # tf.Variable.value is a method (a Keras variable's is a property): the
    # lab read it as a property with weights=True or nonfinite(), and the
    # watched step failed inside apply_gradients.
    bare, _ = style_transfer_loop()
    images, run = style_transfer_loop({"weights": True, "breakpoints": [lab.breakpoints.nonfinite()]})
    assert all(np.array_equal(a, b) for a, b in zip(images, bare))
    column = next(c for c in run.batches().columns if c.startswith("weight_norm/"))
    np.testing.assert_allclose(run.batches()[column], [np.linalg.norm(image) for image in images], rtol=1e-6)


# ---- an optimizer subclass that changes the gradients (gradient centralization) ----


def centralized(gradient):
    """keras-io's gradient centralization: a kernel's gradient less its mean over the inputs."""
    if len(gradient.shape) > 1:
        return gradient - tf.reduce_mean(gradient, axis=list(range(len(gradient.shape) - 1)), keepdims=True)
    return gradient


class CentralizingApply(keras.optimizers.RMSprop):
    def apply(self, grads, trainable_variables=None):
        return super().apply([centralized(g) for g in grads], trainable_variables)


class CentralizingUpdateStep(keras.optimizers.SGD):
    def update_step(self, gradient, variable, learning_rate):
        return super().update_step(centralized(gradient), variable, learning_rate)


def fit_centralizing(optimizer, recorder=None):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])
    model.compile(optimizer=optimizer(0.01), loss="mse")
    x = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
    model.fit(x, x.sum(1, keepdims=True), batch_size=8, epochs=1, shuffle=False, verbose=0,
              callbacks=[recorder] if recorder else [])
    return model, x


def test_an_optimizer_whose_own_apply_changes_the_gradients_trains_as_bare_under_breakpoints_and_is_read_as_applied():
    # Its apply() centralized the kernels' gradients inside the gate's branch
    # and passed the biases' on from outside it: Keras' cross-replica sum
    # failed ("All custom_gradient outputs should be from the same graph").
    bare, x = fit_centralizing(CentralizingApply)
    recorder = lab.Recorder(gradients=True, breakpoints=[lab.breakpoints.nonfinite()])
    watched, _ = fit_centralizing(CentralizingApply, recorder)
    assert all(np.array_equal(a.numpy(), b.numpy()) for a, b in zip(watched.weights, bare.weights))
    # The columns hold the gradients applied: the first batch's, centralized.
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(keras.losses.mean_squared_error(x[:8].sum(1, keepdims=True), model(x[:8])))
    kernel = tape.gradient(loss, model.layers[0].kernel)
    row = recorder.run.batches().iloc[0]
    np.testing.assert_allclose(row[f"grad_norm/{watched.layers[0].kernel.path}"],
                               np.linalg.norm(centralized(kernel).numpy()), rtol=1e-5)


def test_an_optimizer_whose_own_update_step_may_change_the_gradients_is_named_in_the_run():
    bare, _ = fit_centralizing(CentralizingUpdateStep)
    recorder = lab.Recorder(gradients=True)
    watched, _ = fit_centralizing(CentralizingUpdateStep, recorder)
    assert all(np.array_equal(a.numpy(), b.numpy()) for a, b in zip(watched.weights, bare.weights))
    warned = [d for d in recorder.run.events()["detail"] if "update_step" in d]
    assert len(warned) == 1 and "CentralizingUpdateStep" in warned[0] and "apply_gradients()" in warned[0]
    # Keras' own optimizers, which all define update_step, are not named.
    plain = lab.Recorder(gradients=True)
    fit_centralizing(keras.optimizers.SGD, plain)
    assert not any("update_step" in d for d in plain.run.events()["detail"])


class GCRMSprop(keras.optimizers.RMSprop):
    """An override of Keras 2's get_gradients, which Keras 3 never calls (as
    keras-io's gradient centralization writes it: test_keras_io_examples.py)."""

    def get_gradients(self, loss, params):
        raise AssertionError("Keras 3 called get_gradients")


def test_an_optimizer_method_keras_3_never_calls_is_named_in_the_run():
    # The example's optimizer trains as plain RMSprop: its centralization never
    # runs. The lab's columns were right and the run said nothing of it.
    bare, _ = fit_centralizing(keras.optimizers.RMSprop)
    recorder = lab.Recorder()
    watched, _ = fit_centralizing(GCRMSprop, recorder)
    assert all(np.array_equal(a.numpy(), b.numpy()) for a, b in zip(watched.weights, bare.weights))
    warned = [d for d in recorder.run.events()["detail"] if "never call" in d]
    assert len(warned) == 1 and "GCRMSprop.get_gradients" in warned[0] and "apply()" in warned[0]
    plain = lab.Recorder()
    fit_centralizing(keras.optimizers.RMSprop, plain)
    assert not any("never call" in d for d in plain.run.events()["detail"])


# ---- the update of an optimizer that decays the weights ----------------------------


class WeightsAround(keras.callbacks.Callback):
    """Each batch's weights before and after its step."""

    def on_train_begin(self, logs=None):
        self.steps = []

    def on_train_batch_begin(self, batch, logs=None):
        self.before = [v.numpy().astype(np.float64) for v in self.model.trainable_variables]

    def on_train_batch_end(self, batch, logs=None):
        after = [v.numpy().astype(np.float64) for v in self.model.trainable_variables]
        self.steps.append([np.linalg.norm(a - b) / np.linalg.norm(a) for a, b in zip(after, self.before)])


@pytest.mark.parametrize("optimizer", [lambda: keras.optimizers.AdamW(0.01, weight_decay=0.5),
                                       lambda: keras.optimizers.SGD(0.05, weight_decay=0.5)], ids=["adamw", "sgd"])
def test_update_ratios_of_an_optimizer_that_decays_the_weights_include_the_decay(digits, optimizer):
    # Keras decays the weights before its update step: the update the row shows
    # is the weights' whole change over the step, and training is the bare one.
    x, y = digits
    trained = []
    for callbacks in ([], [lab.Recorder(weights=True), WeightsAround()]):
        model = make_mlp()
        model.compile(optimizer=optimizer(), loss=LOSS)
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)
        trained.append(model)
    for a, b in zip(trained[1].weights, trained[0].weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert "_apply_weight_decay" not in vars(trained[1].optimizer)  # the hook is off again
    rec, around = callbacks
    rows = rec.run.batches()
    keys = [v.path for v in trained[1].trainable_variables]
    np.testing.assert_allclose(rows[[f"update_ratio/{k}" for k in keys]].to_numpy(np.float64),
                               np.array(around.steps), rtol=1e-4)


@pytest.mark.parametrize("case", ["ema", "constraint"])
def test_weights_the_optimizer_changes_after_its_update_step_are_named_in_the_run(digits, case):
    # An EMA that overwrites the weights, and a variable's constraint, change the
    # weights after the update step, where the lab reads them: the run says
    # which variables, once, and the training is the bare one.
    x, y = digits
    trained = []
    for callbacks in ([], [lab.Recorder(weights=True)]):
        keras.utils.set_random_seed(0)
        constraint = keras.constraints.MaxNorm(0.5) if case == "constraint" else None
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(12, kernel_constraint=constraint),
                                  keras.layers.Dense(10)])
        optimizer = keras.optimizers.Adam(use_ema=True, ema_overwrite_frequency=2) if case == "ema" else "adam"
        model.compile(optimizer=optimizer, loss=LOSS)
        model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
        trained.append(model)
    for a, b in zip(trained[1].weights, trained[0].weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    events = callbacks[0].run.events()
    said = [d for d in events.query("kind == 'warning'")["detail"] if "update step" in d]
    kernel = trained[1].trainable_variables[0].path
    assert len(said) == 1 and kernel in said[0]
    assert ("use_ema" in said[0]) == (case == "ema") and ("constraint" in said[0]) == (case == "constraint")
    if case == "constraint":  # only the constrained variable
        assert trained[1].trainable_variables[2].path not in said[0]


def test_an_optimizer_that_changes_nothing_after_its_update_step_gets_no_such_warning(digits):
    x, y = digits
    model = make_mlp()
    model.compile(optimizer="adam", loss=LOSS)
    rec = lab.Recorder(gradients=True, weights=True)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[rec])
    assert not any("update step" in d or "Grappler" in d for d in rec.run.events()["detail"])


def _digits_with_a_nan_feature():
    (x, y), _ = lab.datasets.digits()
    x, y = np.array(x[:640], np.float32), y[:640]
    x[6 * 64 + 3, 5] = np.nan  # batch 6: only the first layer's kernel gradient is NaN
    return x, y


def _two_layer_digits_model():
    keras.utils.set_random_seed(1)
    inputs = keras.Input((64,))
    hidden = keras.layers.Dense(16, activation="relu", name="hidden")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(10, activation="softmax", name="out")(hidden))
    model.compile("rmsprop", "sparse_categorical_crossentropy")
    return model


def test_a_nonfinite_hit_names_only_the_gradients_that_were_not_finite():
    x, y = _digits_with_a_nan_feature()
    rec = lab.Recorder(gradients=True, breakpoints=[lab.breakpoints.nonfinite()])
    _two_layer_digits_model().fit(x, y, batch_size=64, shuffle=False, verbose=0, callbacks=[rec])
    [hit] = rec.run.events().query("kind == 'nonfinite'").itertuples()
    assert hit.step == 6 and hit.detail.endswith("not finite: hidden/kernel")
    assert not any(name.startswith("_nonfinite_gradient/") for name in rec.run.columns)


def test_a_loss_spike_hit_names_no_gradient_as_not_finite():
    rng = np.random.RandomState(0)
    x = rng.rand(1280, 8).astype("float32")
    y = x.sum(1, keepdims=True).astype("float32")
    y[14 * 64:15 * 64] *= 3.0  # batch 14: a loss many times the running one, every value finite
    keras.utils.set_random_seed(1)
    inputs = keras.Input((8,))
    model = keras.Model(inputs, keras.layers.Dense(1, name="d")(keras.layers.Dense(8, name="h")(inputs)))
    model.compile(keras.optimizers.SGD(0.01), "mse")
    rec = lab.Recorder(gradients=True, breakpoints=[lab.breakpoints.loss_spike(3)])
    model.fit(x, y, batch_size=64, shuffle=False, verbose=0, callbacks=[rec])
    [hit] = rec.run.events().query("kind == 'breakpoint'").itertuples()
    assert hit.step == 14 and "loss_spike" in hit.detail and "not finite" not in hit.detail


NO_UPDATE_FIRST = {"accumulation": [0.0, 1.0, 0.0, 1.0], "loss scale": [0.0, 0.0, 1.0, 1.0]}  # `updated`


def _fit_with_no_update_first(case, recorder, eager=False):
    """Four steps whose first makes no update: Adam accumulating over two
    steps, or a LossScaleOptimizer whose first two steps overflow (Keras
    skips them and lowers the scale). Returns the recorder's run."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 4)).astype("float32"), rng.integers(0, 3, size=(32,)).astype("int32")
    policy = keras.mixed_precision.global_policy()
    try:
        if case == "accumulation":
            optimizer = keras.optimizers.Adam(0.01, gradient_accumulation_steps=2)
        else:
            keras.mixed_precision.set_global_policy("mixed_float16")
            optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.01), initial_scale=2.0 ** 19)
        keras.utils.set_random_seed(1)
        # Named layers: columns sorted by name keep one order whatever layers the process made before
        # (auto names "dense_9" and "dense_10" sort the other way round).
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu", name="hidden"),
                                  keras.layers.Dense(3, name="out")], name="net")
        model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      run_eagerly=eager)
        model.fit(x, y, batch_size=8, shuffle=False, verbose=0, callbacks=[recorder])
    finally:
        keras.mixed_precision.set_global_policy(policy)
    return recorder.run


@pytest.mark.parametrize("case", list(NO_UPDATE_FIRST))
def test_updated_says_the_same_with_and_without_a_device_breakpoint(case):
    seen = []
    for breakpoints in ([], [lab.breakpoints.nonfinite()]):
        run = _fit_with_no_update_first(case, lab.Recorder(gradients=True, breakpoints=breakpoints))
        seen.append((list(run.column("updated")), list(run.events()["kind"])))
    assert seen == [(NO_UPDATE_FIRST[case], []), (NO_UPDATE_FIRST[case], [])]


def _stateful_lstm():
    keras.utils.set_random_seed(8)
    model = keras.Sequential([keras.Input((5, 3), batch_size=8), keras.layers.LSTM(4, stateful=True),
                              keras.layers.Dense(1)])
    model.compile("adam", "mse")
    return model


def test_a_nonfinite_hit_keeps_the_batch_out_of_a_stateful_rnns_recurrent_state():
    rng = np.random.default_rng(4)
    x, y = rng.normal(size=(32, 5, 3)).astype("float32"), rng.normal(size=(32, 1)).astype("float32")
    x[16] = np.nan  # one bad sample in batch 2
    model = _stateful_lstm()

    class StateBefore(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if batch == 2:
                self.state = [s.numpy().copy() for s in model.layers[0].states]

    before = StateBefore()
    rec = lab.Recorder(breakpoints=[lab.breakpoints.nonfinite()])
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0, callbacks=[before, rec])
    assert list(rec.run.events()["kind"]) == ["nonfinite"]
    # Keras keeps the state out of model.variables; the NaN batch's forward pass assigned it.
    assert all(np.array_equal(a, s.numpy()) for a, s in zip(before.state, model.layers[0].states))
    assert np.isfinite(model.fit(np.nan_to_num(x), y, batch_size=8, shuffle=False, verbose=0).history["loss"]).all()


@pytest.mark.parametrize("case", list(NO_UPDATE_FIRST))
def test_run_eagerly_a_first_step_with_no_update_keeps_the_columns_graph_mode_has(case):
    runs = {}
    for eager in (False, True):
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # no "new values ... not recorded"
            run = _fit_with_no_update_first(case, lab.Recorder(gradients=True, weights=True), eager=eager)
        runs[eager] = run.batches().drop(columns=["seconds", "mode"])
    graph, eager = runs[False], runs[True]
    # Keras numbers layer names per process: the two models' columns match by position.
    assert [c.split("/")[0] for c in eager.columns] == [c.split("/")[0] for c in graph.columns]
    eager.columns = graph.columns
    assert list(eager["updated"]) == list(graph["updated"]) == NO_UPDATE_FIRST[case]
    assert (eager.isna() == graph.isna()).all().all()
    np.testing.assert_allclose(eager.to_numpy(np.float64), graph.to_numpy(np.float64), rtol=1e-5)


def test_a_nonfinite_hit_keeps_the_batch_out_of_dropouts_seed_state_and_training_goes_on_as_bare():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(40, 5)).astype("float32"), rng.integers(0, 3, size=(40,))
    bad = x.copy()
    bad[21, 2] = np.nan  # batch 5 of 10

    def build():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"),
                                  keras.layers.Dropout(0.3, seed=3), keras.layers.Dense(3)])
        model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    model, bare = build(), build()
    rec = lab.Recorder(breakpoints=[lab.breakpoints.nonfinite()])
    model.fit(bad, y, batch_size=4, shuffle=False, verbose=0, callbacks=[rec])
    assert rec.run.events()[["step", "kind"]].values.tolist() == [[5, "nonfinite"]]
    bare.fit(x[:20], y[:20], batch_size=4, shuffle=False, verbose=0)  # the five batches before the hit
    # The hit batch and the ones held after it drew no dropout mask: the seed is where bare's is.
    np.testing.assert_array_equal(model.layers[1].seed_generator.state.numpy(),
                                  bare.layers[1].seed_generator.state.numpy())
    for m in (model, bare):
        m.fit(x[20:], y[20:], batch_size=4, shuffle=False, verbose=0)
    assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), bare.get_weights()))


class _SharpnessAware(keras.Model):
    """A sharpness-aware minimization step (Foret et al., 2021) as users write
    it in Keras (the SAMModel of the public lihachev9/CAPTCHA repository, in
    Keras 3 form): the step moves every weight up its gradient by e_w, takes
    the gradient there, moves the weights back and applies that gradient."""

    def __init__(self, rho=0.05):
        super().__init__(name="sam")
        self.rho = rho
        self.hidden = keras.layers.Dense(8, activation="relu")
        self.out = keras.layers.Dense(3)

    def call(self, x, training=False):
        return self.out(self.hidden(x))

    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x, y, self(x, training=True), sample_weight)
        gradients = tape.gradient(loss, self.trainable_variables)
        scale = self.rho / (tf.norm(tf.stack([tf.norm(g) for g in gradients])) + 1e-12)
        e_ws = []
        for gradient, weight in zip(gradients, self.trainable_variables):
            e_ws.append(gradient * scale)
            weight.assign_add(e_ws[-1])
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(x, y, y_pred, sample_weight)
        sam_gradients = tape.gradient(loss, self.trainable_variables)
        for weight, e_w in zip(self.trainable_variables, e_ws):
            weight.assign_sub(e_w)
        self.optimizer.apply_gradients(zip(sam_gradients, self.trainable_variables))
        return self.compute_metrics(x, y, y_pred, sample_weight)


def test_a_nonfinite_hit_keeps_out_what_the_step_itself_assigned_to_the_weights():
    # A NaN batch makes SAM's e_w NaN: the step's own assign_add and
    # assign_sub leave every weight NaN before the optimizer's update, which
    # the gate kept out. The run said "update skipped" over a NaN model.
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 5)).astype("float32"), rng.integers(0, 3, size=(64,))
    bad = x.copy()
    bad[37, 1] = np.nan  # batch 2 of 4

    def build():
        keras.utils.set_random_seed(1)
        model = _SharpnessAware()
        model.compile(keras.optimizers.Adam(0.01), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model(x[:1])
        return model

    model, good = build(), build()
    rec = lab.Recorder(breakpoints=[lab.breakpoints.nonfinite()])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the step updates no loss tracker: the lab says so
        model.fit(bad, y, batch_size=16, shuffle=False, verbose=0, callbacks=[rec])
        good.fit(x[:32], y[:32], batch_size=16, shuffle=False, verbose=0)  # the batches before the hit
    assert rec.run.events().query("kind == 'nonfinite'")["step"].tolist() == [2]
    for got, expected in zip(model.weights + model.optimizer.variables, good.weights + good.optimizer.variables,
                             strict=True):
        np.testing.assert_array_equal(got.numpy(), expected.numpy())
