"""Stepper: train_step one batch at a time, rewind, errors inside a step."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import lab

RNG = np.random.default_rng(0)
X = RNG.random((40, 6), dtype=np.float32)
Y = RNG.integers(0, 3, 40).astype(np.int32)


def make_model(optimizer="adam", metrics=("accuracy",), seed=0):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(5, activation="relu"), keras.layers.Dense(3)])
    model.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=list(metrics))
    return model


class Recording(keras.Model):
    """A subclassed model with its own train_step (Keras 3 form) that keeps what it was handed."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(3)
        self.handed = []

    def call(self, x):
        return self.dense(x)

    def train_step(self, data):
        self.handed.append(data)
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        return self.compute_metrics(x, y, y_pred, sample_weight)


def recording_model():
    keras.utils.set_random_seed(0)
    model = Recording()
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


# ---- data, shaped as fit() shapes it ------------------------------------------


def test_train_step_gets_batches_shaped_as_fit_passes_them():
    model = recording_model()
    lab.Stepper(model, (X, Y), batch_size=8).step()
    lab.Stepper(model, (X, Y, np.ones(40, np.float32)), batch_size=8).step()
    assert [len(d) for d in model.handed] == [2, 3]  # (x, y), (x, y, sw): never (x, y, None)
    assert all(isinstance(d, tuple) for d in model.handed)


def test_arrays_without_shuffle_come_in_data_order_and_epochs_wrap():
    stepper = lab.Stepper(make_model(), (X, Y), batch_size=16, shuffle=False)
    traces = [stepper.step() for _ in range(4)]
    assert [(t.index, t.epoch, t.batch) for t in traces] == [(0, 0, 0), (1, 0, 1), (2, 0, 2), (3, 1, 0)]
    np.testing.assert_array_equal(traces[1].x, X[16:32])
    np.testing.assert_array_equal(traces[2].y, Y[32:40])  # the short last batch, as in fit()
    np.testing.assert_array_equal(traces[3].x, X[:16])


def test_metrics_reset_at_each_epoch_start():
    stepper = lab.Stepper(make_model(), (X, Y), batch_size=16, shuffle=False)
    first_of_epoch_1 = stepper.step(4)
    # Keras' running accuracy restarts with the epoch: it equals this batch's own.
    assert first_of_epoch_1.logs["accuracy"] == pytest.approx(first_of_epoch_1.row["accuracy"])
    assert first_of_epoch_1.logs["loss"] == pytest.approx(first_of_epoch_1.row["loss"], rel=1e-5)


def test_a_seed_makes_the_shuffled_order_reproducible():
    orders = []
    for _ in range(2):
        stepper = lab.Stepper(make_model(), (X, Y), batch_size=8, seed=3)
        orders.append(np.concatenate([stepper.step().y for _ in range(5)]))
    np.testing.assert_array_equal(orders[0], orders[1])
    assert not np.array_equal(orders[0], Y)  # and it is shuffled


def test_dataset_and_generator_batches_reach_train_step():
    dataset = tf.data.Dataset.from_tensor_slices((X, Y)).batch(10)
    stepper = lab.Stepper(make_model(), dataset)
    traces = [stepper.step() for _ in range(5)]
    assert [(t.epoch, t.batch) for t in traces][3:] == [(0, 3), (1, 0)]
    np.testing.assert_array_equal(traces[4].x, X[:10])

    generator = ((X[i:i + 10], Y[i:i + 10]) for i in range(0, 40, 10))
    stepper = lab.Stepper(make_model(), generator)
    stepper.step(4)
    with pytest.raises(ValueError, match="steps_per_epoch"):
        stepper.step()  # a generator runs once; the error says how to get epochs


@pytest.mark.parametrize("data", ["arrays", "dataset"])
def test_an_interrupt_while_the_batch_is_made_skips_no_batch(data, monkeypatch):
    # Ctrl-C while the feed turned the batch it had taken into tensors lost
    # that batch: the next step trained on the one after it.
    from lab.backend.tensorflow import feed

    made, convert = [], feed._as_step_input

    def interrupted_once(batch, **how):
        made.append(True)
        if len(made) == 3:
            raise KeyboardInterrupt
        return convert(batch, **how)

    source = (X, Y) if data == "arrays" else tf.data.Dataset.from_tensor_slices((X, Y)).batch(8)
    stepper = lab.Stepper(make_model(), source, batch_size=8 if data == "arrays" else None, shuffle=False)
    monkeypatch.setattr(feed, "_as_step_input", interrupted_once)
    with pytest.raises(KeyboardInterrupt):
        stepper.step(4)
    traces = stepper.traces + [stepper.step() for _ in range(4)]
    assert [(t.epoch, t.batch) for t in traces] == [(0, 0), (0, 1), (0, 2), (0, 3), (0, 4), (1, 0)]
    np.testing.assert_array_equal(traces[2].x, X[16:24])
    np.testing.assert_array_equal(traces[5].x, X[:8])


def test_x_alone_is_handed_bare_as_fit_hands_it():
    fitted = recording_model()
    fitted.run_eagerly = True
    with pytest.raises(Exception):  # no targets for the loss: fit() fails in compute_loss
        fitted.fit(X, batch_size=8, epochs=1, verbose=0)
    stepped = recording_model()
    trace = lab.Stepper(stepped, X, batch_size=8).step()  # and so does the step
    assert trace.y is None and trace.error is not None
    for model in (fitted, stepped):
        assert tf.is_tensor(model.handed[0]) and model.handed[0].shape == (8, 6)


def test_a_pydatasets_bare_array_batch_is_handed_as_fit_hands_it():
    # fit() hands a PyDataset's bare array as (x,): a step reading `data[0]`
    # (an autoencoder's) got the first sample from the Stepper, not the batch.
    class Inputs(keras.utils.PyDataset):
        def __len__(self):
            return 5

        def __getitem__(self, index):
            return X[index * 8:(index + 1) * 8]

    fitted = recording_model()
    fitted.run_eagerly = True
    with pytest.raises(Exception):  # no targets for the loss
        fitted.fit(Inputs(), epochs=1, shuffle=False, verbose=0)
    stepped = recording_model()
    trace = lab.Stepper(stepped, Inputs(), shuffle=False).step()
    assert trace.error is not None
    for model in (fitted, stepped):
        assert isinstance(model.handed[0], tuple) and len(model.handed[0]) == 1
        assert model.handed[0][0].shape == (8, 6)
    np.testing.assert_array_equal(trace.x, X[:8])


def test_a_pydataset_that_reorders_at_each_epoch_begin_gives_fits_batches():
    # keras.utils.PyDataset's on_epoch_begin, which fit() calls before each
    # epoch, was never called by the Stepper: its batches came in another order.
    class Reordered(keras.utils.PyDataset):
        def __init__(self):
            super().__init__()
            self.order, self.rng = np.arange(5), np.random.default_rng(1)

        def __len__(self):
            return 5

        def on_epoch_begin(self):
            self.order = self.rng.permutation(5)

        def __getitem__(self, index):
            rows = slice(self.order[index] * 8, (self.order[index] + 1) * 8)
            return X[rows], Y[rows]

    fitted = recording_model()
    fitted.run_eagerly = True
    fitted.fit(Reordered(), epochs=2, shuffle=False, verbose=0)
    stepped = recording_model()
    lab.Stepper(stepped, Reordered(), shuffle=False).step(10)
    assert len(fitted.handed) == len(stepped.handed) == 10
    for fit_batch, stepped_batch in zip(fitted.handed, stepped.handed):
        np.testing.assert_array_equal(stepped_batch[0], fit_batch[0])



class Counted(keras.utils.PyDataset):
    """Four batches of X, Y that count the epoch hooks called on them."""

    def __init__(self):
        super().__init__()
        self.begun = self.ended = 0

    def __len__(self):
        return 4

    def on_epoch_begin(self):
        self.begun += 1

    def on_epoch_end(self):
        self.ended += 1

    def __getitem__(self, index):
        return X[index * 8:(index + 1) * 8], Y[index * 8:(index + 1) * 8]


def test_a_pydataset_is_told_of_every_epoch_with_steps_per_epoch_as_fit_tells_it():
    # With steps_per_epoch=2 the Stepper called on_epoch_begin only when it
    # started a pass over the 4 batches (every other epoch), and at the third
    # epoch, where that pass ended, said "The PyDataset yields no batches".
    fitted, stepped = Counted(), Counted()
    make_model().fit(fitted, epochs=3, steps_per_epoch=2, shuffle=False, verbose=0)
    stepper = lab.Stepper(make_model(), stepped, shuffle=False, steps_per_epoch=2)
    stepper.step(6)
    traces = stepper.traces
    assert [trace.error for trace in traces] == [None] * 6
    assert stepped.begun == fitted.begun == 3
    np.testing.assert_array_equal(traces[4].x, X[:8])  # the third epoch starts the data again



class ShufflesOnEpochEnd(keras.utils.PyDataset):
    """keras-io's Sequence pattern: the samples' order shuffled in on_epoch_end."""

    def __init__(self):
        super().__init__()
        self.order = np.arange(32)

    def __len__(self):
        return 4

    def on_epoch_end(self):
        np.random.shuffle(self.order)

    def __getitem__(self, index):
        rows = self.order[index * 8:(index + 1) * 8]
        return X[rows], Y[rows]


def test_a_pydataset_that_shuffles_on_epoch_end_is_stepped_in_fits_order():
    # fit() (Keras 3.7 on) ends an epoch of the data before its first one, so
    # such a PyDataset trains its first epoch already shuffled; the Stepper
    # stepped it in its unshuffled order, other batches than fit() trains on.
    fitted = recording_model()
    fitted.run_eagerly = True
    keras.utils.set_random_seed(3)
    fitted.fit(ShufflesOnEpochEnd(), epochs=2, shuffle=False, verbose=0)
    stepped = recording_model()
    keras.utils.set_random_seed(3)
    lab.Stepper(stepped, ShufflesOnEpochEnd(), shuffle=False).step(8)
    assert len(stepped.handed) == len(fitted.handed) == 8
    for fit_batch, stepped_batch in zip(fitted.handed, stepped.handed):
        np.testing.assert_array_equal(stepped_batch[0], fit_batch[0])
    np.testing.assert_array_equal(stepped.get_weights()[0], fitted.get_weights()[0])


@pytest.mark.skipif(not lab.compat.PYDATASET_SHUFFLE_IS_PYTHON_RANDOM,
                    reason="fit() before Keras 3.6 also shuffles a PyDataset's batches in a tf.data buffer")
def test_a_seeded_stepper_steps_a_pydataset_in_the_shuffled_order_fit_trains_on():
    # fit(shuffle=True) shuffles a PyDataset's batch order every epoch with
    # Python's random; the Stepper, shuffle=True too, stepped it in index order.
    fitted = recording_model()
    fitted.run_eagerly = True
    keras.utils.set_random_seed(5)
    fitted.fit(Counted(), epochs=3, shuffle=True, verbose=0)
    stepped = recording_model()
    lab.Stepper(stepped, Counted(), shuffle=True, seed=5).step(12)
    fit_order = [int(np.flatnonzero((X == np.asarray(batch[0])[0]).all(1))[0]) // 8 for batch in fitted.handed]
    assert sorted(fit_order) == sorted(list(range(4)) * 3) and fit_order != list(range(4)) * 3
    for fit_batch, stepped_batch in zip(fitted.handed, stepped.handed, strict=True):
        np.testing.assert_array_equal(stepped_batch[0], fit_batch[0])


def test_an_unseeded_stepper_says_its_pydataset_order_is_not_fits():
    # Unseeded, fit() and the Stepper each draw their own order: nothing said so.
    with pytest.warns(UserWarning, match="shuffle=False") as told:
        stepper = lab.Stepper(make_model(), Counted(), shuffle=True)
    assert len(told) == 1
    stepper.step(4)
    assert sorted(trace.x[0, 0] for trace in stepper.traces) == sorted(X[::8][:4, 0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lab.Stepper(make_model(), Counted(), shuffle=False)  # the PyDataset's own order: nothing to say



SEQUENCES = [(RNG.integers(1, 20, (4, length)), RNG.random((4, 1), dtype=np.float32)) for length in (5, 7, 4, 9, 6)]


class PaddedSequences(keras.utils.PyDataset):
    """Token sequences padded per batch, to another length in each batch."""

    def __len__(self):
        return len(SEQUENCES)

    def __getitem__(self, index):
        return SEQUENCES[index]


class CountedTraces(keras.Sequential):
    def train_step(self, data):
        self.traced += 1  # Python runs: one per trace
        return super().train_step(data)


def sequence_model():
    keras.utils.set_random_seed(0)
    model = CountedTraces([keras.Input((None,), dtype="int32"), keras.layers.Embedding(20, 3),
                           keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1)])
    model.traced = 0
    model.compile("sgd", "mse")
    return model


@pytest.mark.parametrize("data", ["generator", "PyDataset"])
def test_a_graph_stepper_traces_batches_of_varying_length_once_as_fit_does(data):
    # fit() leaves open every dimension a generator's or PyDataset's first two
    # batches disagree on; the graph Stepper left only the batch size open and
    # traced its step again for the second length.
    source = {"generator": lambda: (batch for batch in SEQUENCES), "PyDataset": PaddedSequences}[data]
    fitted = sequence_model()
    fitted.fit(source(), epochs=1, steps_per_epoch=len(SEQUENCES), shuffle=False, verbose=0)
    stepped = sequence_model()
    stepper = lab.Stepper(stepped, source(), shuffle=False, mode="graph")
    stepper.step(len(SEQUENCES))
    assert [trace.error for trace in stepper.traces] == [None] * len(SEQUENCES)
    assert [trace.x.shape[1] for trace in stepper.traces] == [x.shape[1] for x, _ in SEQUENCES]
    assert stepped.traced == fitted.traced == 1
    for fit_weight, stepped_weight in zip(fitted.get_weights(), stepped.get_weights(), strict=True):
        np.testing.assert_array_equal(stepped_weight, fit_weight)


# ---- what a trace holds ----------------------------------------------------------


def test_trace_holds_predictions_and_the_gradients_the_optimizer_applied():
    model = make_model(keras.optimizers.SGD(learning_rate=0.5))
    trace = lab.Stepper(model, (X, Y), batch_size=8, shuffle=False).step()
    w = [trace.weights_before[v.path] for v in model.trainable_variables]
    expected = np.maximum(X[:8] @ w[0] + w[1], 0) @ w[2] + w[3]  # the step's forward pass
    np.testing.assert_allclose(trace.y_pred, expected, rtol=1e-5, atol=1e-6)
    assert set(trace.gradients) == set(trace.weights_before) == {
        v.path for v in model.trainable_variables
    }
    for key, grad in trace.gradients.items():
        # Plain SGD: the change of each weight is -lr * the gradient it received.
        np.testing.assert_allclose(trace.weights_after[key] - trace.weights_before[key], -0.5 * grad, atol=1e-6)
    assert trace.row["learning_rate"] == pytest.approx(0.5)
    assert trace.seconds > 0 and trace.error is None


def test_predictions_are_captured_from_a_custom_step():
    model = recording_model()
    trace = lab.Stepper(model, (X, Y), batch_size=8, shuffle=False).step()
    # The model was built inside the step: its initial weights are the "before".
    kernel, bias = (trace.weights_before[v.path] for v in (model.dense.kernel, model.dense.bias))
    expected = X[:8] @ kernel + bias
    np.testing.assert_allclose(trace.y_pred, expected, rtol=1e-5, atol=1e-6)


def test_graph_mode_gives_the_eager_values():
    eager = lab.Stepper(make_model(), (X, Y), batch_size=8, shuffle=False).step(2)
    graph = lab.Stepper(make_model(), (X, Y), batch_size=8, shuffle=False, mode="graph").step(2)
    assert graph.loss == pytest.approx(eager.loss, rel=1e-5)
    assert graph.y_pred.shape == (8, 3)
    assert len(graph.gradients) == len(eager.gradients) == 4
    for a, b in zip(graph.gradients.values(), eager.gradients.values()):  # twins: by position
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_stepping_leaves_no_trace_on_the_model():
    model = make_model()
    lab.Stepper(model, (X, Y), batch_size=8).step(2)
    patched = {"compute_loss", "call", "train_step"} & set(vars(model))
    assert not patched
    assert not {"apply", "_backend_update_step"} & set(vars(model.optimizer))
    model.fit(X, Y, epochs=1, verbose=0)  # a later fit() without the lab still trains


# ---- rewind ------------------------------------------------------------------------


def test_rewind_then_step_reproduces_the_same_steps_bit_for_bit():
    model = make_model()
    stepper = lab.Stepper(model, (X, Y), batch_size=8, seed=0)
    stepper.step()
    weights = [v.numpy().copy() for v in model.weights]
    optimizer_state = [v.numpy().copy() for v in model.optimizer.variables]
    first = [stepper.step() for _ in range(3)]
    stepper.rewind(3)
    assert [t.index for t in stepper.traces] == [0]
    for variable, saved in zip(model.weights, weights):
        np.testing.assert_array_equal(variable.numpy(), saved)
    for variable, saved in zip(model.optimizer.variables, optimizer_state):
        np.testing.assert_array_equal(variable.numpy(), saved)  # slots and iterations
    again = [stepper.step() for _ in range(3)]
    for a, b in zip(first, again):
        assert (a.index, a.epoch, a.batch) == (b.index, b.epoch, b.batch)
        np.testing.assert_array_equal(a.x, b.x)
        assert a.row["loss"] == b.row["loss"]
        for key in a.gradients:
            np.testing.assert_array_equal(a.gradients[key], b.gradients[key])
        assert a.logs == b.logs  # metric state was restored too


class HeldState(keras.Model):
    """State a step changes outside model.variables and optimizer.variables:
    a step counter kept as a tf.Variable, a tf.random.Generator's state, and
    two optimizers kept in a list (one per layer)."""

    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(5, activation="relu")
        self.out = keras.layers.Dense(3)
        self.step_count = tf.Variable(0.0, trainable=False)
        self.rng = tf.random.Generator.from_seed(7)

    def call(self, x):
        return self.out(self.hidden(x))

    def train_step(self, data):
        x, y = data
        self.step_count.assign_add(1.0)
        x = x * tf.minimum(1.0, self.step_count / 4.0) + self.rng.normal(tf.shape(x), stddev=0.1)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, self(x), from_logits=True))
        first, second = self.hidden.trainable_variables, self.out.trainable_variables
        grads = tape.gradient(loss, first + second)
        self.optimizers[0].apply(grads[:len(first)], first)
        self.optimizers[1].apply(grads[len(first):], second)
        return {"loss": loss}


def held_state_model():
    keras.utils.set_random_seed(0)
    model = HeldState()
    model.compile("sgd")
    model.optimizers = [keras.optimizers.Adam(0.01), keras.optimizers.Adam(0.02)]
    model.fit(X[:16], Y[:16], batch_size=8, shuffle=False, verbose=0)
    return model


def held_state(model):
    return [v.numpy().copy() for v in model.weights + [model.step_count, model.rng.state]
            + model.optimizers[0].variables + model.optimizers[1].variables]


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_rewind_puts_back_state_held_outside_the_models_variables(mode):
    # The step counter, the generator's state and the listed optimizers' slots
    # kept the rewound steps' values: stepping again, and a fit() after the
    # rewind, trained otherwise than the first time / a bare fit().
    model = held_state_model()
    before = held_state(model)
    stepper = lab.Stepper(model, (X, Y), batch_size=8, shuffle=False, mode=mode)
    first = [stepper.step().logs["loss"] for _ in range(3)]
    stepped = held_state(model)
    stepper.rewind(3)
    for now, saved in zip(held_state(model), before):
        np.testing.assert_array_equal(now, saved)
    assert [stepper.step().logs["loss"] for _ in range(3)] == first
    for now, saved in zip(held_state(model), stepped):
        np.testing.assert_array_equal(now, saved)
    stepper.rewind(3)
    history = model.fit(X, Y, batch_size=8, shuffle=False, verbose=0).history
    bare = held_state_model()
    assert bare.fit(X, Y, batch_size=8, shuffle=False, verbose=0).history == history
    for mine, theirs in zip(held_state(model), held_state(bare)):
        np.testing.assert_array_equal(mine, theirs)


class NoisyModel(keras.Model):
    """A train_step that adds noise to its inputs, drawn by TensorFlow's own
    random op (`draw="tf"`) or by keras.random with the model's SeedGenerator."""

    def __init__(self, draw):
        super().__init__()
        self.draw, self.dense, self.noise = draw, keras.layers.Dense(1), keras.random.SeedGenerator(1)

    def call(self, x):
        return self.dense(x)

    def train_step(self, data):
        x, y = data
        noise = (tf.random.normal(tf.shape(x)) if self.draw == "tf"
                 else keras.random.normal(tf.shape(x), seed=self.noise))
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(self(x + noise) - y))
        self.optimizer.apply_gradients(zip(tape.gradient(loss, self.trainable_weights), self.trainable_weights))
        return {"loss": loss}


@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("draw", ["tf", "keras"])
def test_a_replay_after_rewind_that_ends_otherwise_than_the_first_time_is_said(draw, mode):
    # tf.random's stream is not state rewind can restore: the replayed step
    # trained on other noise, and nothing said so.
    keras.utils.set_random_seed(0)
    model = NoisyModel(draw)
    model.compile(optimizer="sgd")
    model(X[:1])
    run = lab.Run()
    stepper = lab.Stepper(model, (X, X.sum(1, keepdims=True)), batch_size=8, shuffle=False, mode=mode, run=run)
    assert stepper.step(2).error is None
    first = [v.numpy() for v in model.weights]
    stepper.rewind(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stepper.step()
    replayed = all(np.array_equal(a, v.numpy()) for a, v in zip(first, model.weights))
    said = [d for d in run.events().query("kind == 'warning'")["detail"] if "after a rewind" in d]
    assert replayed == (draw == "keras")
    assert len(said) == (0 if replayed else 1)
    assert len([w for w in caught if "after a rewind" in str(w.message)]) == len(said)
    if said:
        assert "Step 1" in said[0] and "keras.random.SeedGenerator" in said[0]


def test_rewind_across_an_epoch_boundary_restores_metrics():
    stepper = lab.Stepper(make_model(), (X, Y), batch_size=16, shuffle=False)
    last_of_epoch_0 = stepper.step(3)
    stepper.step()
    stepper.rewind(1)
    assert stepper.last_trace.logs == last_of_epoch_0.logs
    assert stepper.step().batch == 0


def test_rewinding_past_the_kept_history_raises():
    stepper = lab.Stepper(make_model(), (X, Y), batch_size=8, history=2)
    stepper.step(3)
    assert len(stepper.traces) == 2
    with pytest.raises(ValueError, match="history"):
        stepper.rewind(3)


def test_unchanged_weights_are_shared_not_copied():
    model = make_model()
    model.layers[0].trainable = False
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    stepper = lab.Stepper(model, (X, Y), batch_size=8)
    a, b = stepper.step(), stepper.step()
    frozen = model.layers[0].kernel.path
    assert frozen not in a.weights_after  # only trainable weights are listed
    kernel = model.layers[1].kernel.path
    assert a.weights_after[kernel] is b.weights_before[kernel]


# ---- run_until --------------------------------------------------------------------


def test_one_loss_spike_given_to_two_steppers_watches_each_loss_on_its_own():
    # It kept the first stepper's running average, so the second model, whose
    # loss is large but steady, "spiked" at its first step after the warmup.
    x = np.random.default_rng(0).random((160, 4)).astype("float32")
    point = lab.breakpoints.loss_spike(3.0, warmup=5)
    for level in (0.5, 3.0):
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(1e-4), loss="mse")
        stepper = lab.Stepper(model, (x, np.full((160, 1), level, "float32")), batch_size=8, shuffle=False)
        trace = stepper.run_until(point, max_steps=15)
        assert not stepper.hit and trace.index == 14, (level, trace.index, trace.loss)


@pytest.mark.parametrize("back", [15, 12])
def test_a_loss_spike_after_a_rewind_decides_as_the_first_time(back):
    # Rewind kept the running average of the rewound steps' losses: run again
    # to the breakpoint, the first (high) losses of training "spiked" against
    # the average of the later, lower ones.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(160, 6)).astype("float32")
    y = x @ rng.normal(size=(6, 1)).astype("float32")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.BatchNormalization(), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    stepper = lab.Stepper(model, (x, y), batch_size=8, shuffle=False, history=32)
    point = lab.breakpoints.loss_spike(1.5, warmup=3)

    def run_to_step_15(start):
        # Checked steps, then steps 5-7 without a check, then checked steps again.
        stepper.run_until(point, max_steps=5 - start) if start < 5 else None
        assert not stepper.hit
        stepper.step(3)
        last = stepper.run_until(point, max_steps=7)
        assert not stepper.hit and last.index == 14
        return last.loss

    first = run_to_step_15(0)
    stepper.rewind(back)
    assert run_to_step_15(15 - back) == first


def test_run_until_a_callable_or_a_breakpoint():
    stepper = lab.Stepper(make_model(), (X, Y), batch_size=8)
    trace = stepper.run_until(lambda t: t.index == 3, max_steps=10)
    assert trace.index == 3 and stepper.hit
    trace = stepper.run_until(lab.Breakpoint(lambda row: row["step"] >= 6), max_steps=10)
    assert trace.index == 6 and stepper.hit
    trace = stepper.run_until(lambda t: False, max_steps=2)
    assert trace.index == 8 and not stepper.hit


def test_steps_are_rows_of_a_run():
    run = lab.Run()
    stepper = lab.Stepper(make_model(), (X, Y), batch_size=8, run=run)
    stepper.step(2)
    stepper.rewind()
    stepper.step()
    frame = run.batches()
    assert list(frame["step"]) == [0, 1, 1]
    assert list(frame["source"]) == ["stepper"] * 3
    assert "rewind" in set(run.events()["kind"])


# ---- errors inside a step ----------------------------------------------------------


class Broken(Recording):
    def __init__(self, mistake):
        super().__init__()
        self.mistake = mistake

    def train_step(self, data):
        x, y = data
        if self.mistake == "shape":
            x = tf.reshape(x, (-1, 3))  # wrong feature count for the Dense layer
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            if self.mistake != "no_tape":
                loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
        if self.mistake == "no_tape":
            loss = self.compute_loss(x=x, y=y, y_pred=y_pred)  # outside the tape: no gradients
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return {"loss": loss}


def broken(mistake):
    keras.utils.set_random_seed(0)
    model = Broken(mistake)
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model(X[:1])
    return model


@pytest.mark.parametrize("mistake", ["shape", "no_tape"])
def test_an_error_in_the_step_leaves_the_model_as_before(mistake):
    model = broken(mistake)
    before = [v.numpy().copy() for v in model.weights]
    stepper = lab.Stepper(model, (X, Y), batch_size=8, shuffle=False)
    trace = stepper.step(3)
    assert trace.error is not None and trace.index == 0
    assert "Traceback" in trace.traceback
    for variable, saved in zip(model.weights, before):
        np.testing.assert_array_equal(variable.numpy(), saved)
    assert int(model.optimizer.iterations.numpy()) == 0
    assert stepper.traces == []
    model.mistake = None  # the user fixes the step; the same batch runs next
    fixed = stepper.step()
    assert fixed.error is None and fixed.index == 0
    np.testing.assert_array_equal(fixed.x, X[:8])


@pytest.mark.parametrize("where", ["_check_replay", "append_batches", "note_running_values"])
def test_an_interrupt_in_the_bookkeeping_after_the_step_leaves_the_history_as_the_model_is(where, monkeypatch):
    # Ctrl-C after train_step returned, before the step was kept, left the model
    # trained on a batch the stepper and the run did not know of: the next step
    # skipped it, and a row was missing from the run.
    from lab import hooks

    model, run = make_model(), lab.Run()
    stepper = lab.Stepper(model, (X, Y), batch_size=8, shuffle=False, run=run)
    stepper.step(2)
    before = [v.numpy().copy() for v in model.weights + model.optimizer.variables + model.metrics_variables]

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    owner = lab.Stepper if where == "_check_replay" else lab.Run
    with monkeypatch.context() as patched:
        patched.setattr(owner, where, interrupt)
        with pytest.raises(KeyboardInterrupt):
            stepper.step()
    assert not hooks.hooks_for(model).active
    now = [v.numpy() for v in model.weights + model.optimizer.variables + model.metrics_variables]
    undone = all(np.array_equal(a, b) for a, b in zip(before, now))
    taken = 2 if undone else 3  # undone, or kept whole: never half
    assert (stepper.next_index, len(stepper.traces), len(run.batches()), run.next_step) == (taken,) * 4
    assert undone == (where != "note_running_values")  # once the run has its row, the step is taken
    stepper.step(4 - taken)
    assert list(run.batches()["batch"]) == [0, 1, 2, 3]
    straight = make_model()
    lab.Stepper(straight, (X, Y), batch_size=8, shuffle=False).step(4)
    for mine, theirs in zip(model.weights + model.optimizer.variables, straight.weights + straight.optimizer.variables):
        np.testing.assert_array_equal(mine.numpy(), theirs.numpy())


@pytest.mark.parametrize("raised", [KeyboardInterrupt, ValueError])
def test_a_view_of_the_runs_rows_raising_after_the_row_is_in_keeps_the_step(raised):
    # Ctrl-C while a view drew the step's row (or, with warnings as errors,
    # the warning of a view that raised) undid the step whose row stayed in
    # the run: the run had a step the model did not.
    model, run = make_model(), lab.Run()
    stepper = lab.Stepper(model, (X, Y), batch_size=8, shuffle=False, run=run)
    stepper.step(2)

    def view(run, table, start, stop):
        if table == "batches":
            raise raised("drawing the row")

    unsubscribe = run.subscribe(view)
    with warnings.catch_warnings(), pytest.raises((KeyboardInterrupt, RuntimeWarning)):
        warnings.simplefilter("error")
        stepper.step()
    unsubscribe()
    assert (stepper.next_index, len(stepper.traces), len(run.batches()), run.next_step) == (3, 3, 3, 3)
    assert int(model.optimizer.iterations.numpy()) == 3
    stepper.rewind()  # the step is in the history, as in the model
    stepper.step(2)
    assert list(run.batches().drop_duplicates("step", keep="last")["batch"]) == [0, 1, 2, 3]
    straight = make_model()
    lab.Stepper(straight, (X, Y), batch_size=8, shuffle=False).step(4)
    for mine, theirs in zip(model.weights + model.optimizer.variables, straight.weights + straight.optimizer.variables):
        np.testing.assert_array_equal(mine.numpy(), theirs.numpy())


def test_a_warning_made_an_error_after_the_step_undoes_it():
    # With warnings as errors, the replay warning raised after the model had
    # moved: the step stayed in the model but not in the stepper's history.
    model = NoisyModel("tf")
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x = RNG.random((16, 2), dtype=np.float32)
    stepper = lab.Stepper(model, (x, x[:, :1]), batch_size=8, shuffle=False)
    stepper.step()
    stepper.rewind()
    before = [v.numpy().copy() for v in model.weights + model.optimizer.variables]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trace = stepper.step()
    assert isinstance(trace.error, RuntimeWarning)
    for variable, saved in zip(model.weights + model.optimizer.variables, before):
        np.testing.assert_array_equal(variable.numpy(), saved)
    assert (stepper.next_index, len(stepper.traces)) == (0, 0)


class InterruptedAfterUpdate(Recording):
    """Ctrl-C lands after the optimizer moved the weights, before the metrics saw the batch."""

    interrupt = False

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
        self.optimizer.apply(tape.gradient(loss, self.trainable_variables), self.trainable_variables)
        if self.interrupt:
            raise KeyboardInterrupt
        return self.compute_metrics(x, y, y_pred)


def interrupted_model():
    keras.utils.set_random_seed(0)
    model = InterruptedAfterUpdate()
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    model(X[:1])
    return model


def test_an_interrupted_step_is_undone_and_its_batch_comes_next_again():
    model, run = interrupted_model(), lab.Run()
    stepper = lab.Stepper(model, (X, Y), batch_size=8, shuffle=False, run=run)
    stepper.step(2)
    before = [v.numpy().copy() for v in model.weights + model.optimizer.variables + model.metrics_variables]
    model.interrupt = True
    with pytest.raises(KeyboardInterrupt):
        stepper.step()
    after = [v.numpy() for v in model.weights + model.optimizer.variables + model.metrics_variables]
    for saved, now in zip(before, after):
        np.testing.assert_array_equal(now, saved)
    assert stepper.next_index == 2 and len(stepper.traces) == 2
    events = run.events()
    assert list(events["kind"]) == ["interrupt"] and list(events["step"]) == [2]
    model.interrupt = False
    resumed = stepper.step()
    assert (resumed.index, resumed.batch) == (2, 2)
    np.testing.assert_array_equal(resumed.x, X[16:24])  # the interrupted batch, not the one after it
    straight = interrupted_model()
    lab.Stepper(straight, (X, Y), batch_size=8, shuffle=False).step(3)
    for mine, theirs in zip(model.weights + model.optimizer.variables, straight.weights + straight.optimizer.variables):
        np.testing.assert_array_equal(mine.numpy(), theirs.numpy())
    assert list(run.batches()["batch"]) == [0, 1, 2]


def test_a_none_gradient_hint_names_the_variables_that_got_none():
    model = broken("no_tape")
    trace = lab.Stepper(model, (X, Y), batch_size=8).step()
    assert str(trace.error) == "No gradients provided for any variable."  # the user's own message
    kernel, bias = model.dense.kernel.path, model.dense.bias.path
    assert kernel in trace.hint and "GradientTape" in trace.hint
    assert set(trace.no_gradient) == {kernel, bias}


def test_a_shape_error_hint_shows_the_batch_shapes():
    trace = lab.Stepper(broken("shape"), (X, Y), batch_size=8).step()
    assert "(8, 6)" in trace.hint
    assert "lab.inspect_data" in trace.hint  # the tool that names the mismatch and its fix


class MetricsNeverUpdated(Recording):
    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
        self.optimizer.apply(tape.gradient(loss, self.trainable_variables), self.trainable_variables)
        return self.get_metrics_result()  # the mistake: no metric saw this batch


def test_a_step_that_updates_no_metric_gets_a_hint_saying_so():
    keras.utils.set_random_seed(0)
    model = MetricsNeverUpdated()
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    trace = lab.Stepper(model, (X, Y), batch_size=8).step()
    assert trace.error is not None
    assert "No metric was updated" in trace.hint
    assert "update_state" in trace.hint and "self.metrics" in trace.hint
    assert "shape" not in trace.hint.lower()


def test_bad_input_gets_a_clear_error():
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
    with pytest.raises(ValueError, match="compile"):
        lab.Stepper(model, (X, Y))
    with pytest.raises(ValueError, match="x and y differ in length .x has 40, y has 30 examples.. Fix: "):
        lab.Stepper(make_model(), (X, Y[:30]))
    with pytest.raises(TypeError, match="tf.data.Dataset"):
        lab.Stepper(make_model(), 42)
    with pytest.raises(ValueError, match="step first"):
        lab.Stepper(make_model(), (X, Y)).rewind()


# ---- a step function of the user's own -------------------------------------------------


def hand_written_step(model, optimizer):
    """A hand-written loop's step: a tape, a sparse cross-entropy from logits, the optimizer's apply."""
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        return {"loss": loss}

    return step


def test_from_step_steps_a_hand_written_step_and_rewinds_it():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
    optimizer = keras.optimizers.Adam(0.01)
    step = hand_written_step(model, optimizer)

    stepper = lab.Stepper.from_step(step, model, (X, Y), optimizers=[optimizer], batch_size=8, seed=0)
    first = stepper.step(2)
    assert set(first.gradients) == {v.path for v in model.trainable_variables}
    stepper.rewind(2)
    assert int(optimizer.iterations.numpy()) == 0
    again = stepper.step(2)
    assert again.row["loss"] == first.row["loss"]


def loop_from_scratch():
    """writing_a_training_loop_from_scratch: a model, an optimizer and a metric of the loop's own."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
    optimizer = keras.optimizers.Adam(0.01)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    train_acc_metric = keras.metrics.SparseCategoricalAccuracy()

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = loss_fn(y, logits)
        optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        train_acc_metric.update_state(y, logits)
        return {"loss": loss}

    return step, model, optimizer, train_acc_metric


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_from_step_rewinds_the_loops_own_metric_passed_as_metrics(mode):
    step, model, optimizer, accuracy = loop_from_scratch()
    stepper = lab.Stepper.from_step(step, model, (X, Y), optimizers=[optimizer], metrics=[accuracy],
                                    batch_size=8, shuffle=False, mode=mode)
    stepper.step(2)
    counted = [v.numpy().copy() for v in accuracy.variables]
    stepper.rewind(1)
    stepper.step(1)
    for variable, saved in zip(accuracy.variables, counted):
        np.testing.assert_array_equal(variable.numpy(), saved)  # 16 samples seen, not 24
    stepper.step(4)  # on into the second epoch: the metric starts it afresh, as the model's would
    assert float(accuracy.count.numpy()) == 8


def test_from_step_says_what_metrics_takes():
    step, model, optimizer, _ = loop_from_scratch()
    with pytest.raises(TypeError, match=r"keras.metrics.Metric.*metrics=\[train_acc_metric\]"):
        lab.Stepper.from_step(step, model, (X, Y), optimizers=[optimizer], metrics="accuracy")
    with pytest.raises(TypeError, match="'accuracy' is for compile"):
        lab.Stepper.from_step(step, model, (X, Y), optimizers=[optimizer], metrics=["accuracy"])


# ---- a custom step with two optimizers ----------------------------------------------


class TinyGAN(keras.Model):
    def __init__(self):
        super().__init__()
        self.generator = keras.Sequential([keras.Input((2,)), keras.layers.Dense(6)], name="generator")
        self.discriminator = keras.Sequential([keras.Input((6,)), keras.layers.Dense(1)], name="discriminator")
        self.noise = keras.random.SeedGenerator(0)
        self.d_loss_tracker = keras.metrics.Mean(name="d_loss")

    @property
    def metrics(self):
        return [self.d_loss_tracker]

    def compile(self, d_opt, g_opt):
        super().compile()
        self.d_opt, self.g_opt = d_opt, g_opt

    def train_step(self, data):
        real, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        bce = keras.losses.BinaryCrossentropy(from_logits=True)
        z = keras.random.normal((tf.shape(real)[0], 2), seed=self.noise)
        with tf.GradientTape() as tape:
            real_logits, fake_logits = self.discriminator(real), self.discriminator(self.generator(z))
            d_loss = bce(tf.ones_like(real_logits), real_logits) + bce(tf.zeros_like(fake_logits), fake_logits)
        self.d_opt.apply(tape.gradient(d_loss, self.discriminator.trainable_variables),
                         self.discriminator.trainable_variables)
        with tf.GradientTape() as tape:
            fake_logits = self.discriminator(self.generator(z))
            g_loss = bce(tf.ones_like(fake_logits), fake_logits)
        self.g_opt.apply(tape.gradient(g_loss, self.generator.trainable_variables),
                         self.generator.trainable_variables)
        self.d_loss_tracker.update_state(d_loss)
        return {"d_loss": self.d_loss_tracker.result(), "g_loss": g_loss}


def test_a_gan_step_records_both_optimizers_and_rewinds_both():
    keras.utils.set_random_seed(0)
    gan = TinyGAN()
    gan.compile(d_opt=keras.optimizers.Adam(1e-2), g_opt=keras.optimizers.SGD(1e-2))
    stepper = lab.Stepper(gan, X, batch_size=8, seed=0)
    first = stepper.step()
    assert {k.split("/")[0] for k in first.gradients} == {"generator", "discriminator"}
    assert {"learning_rate/d_opt", "learning_rate/g_opt"} <= set(first.row)
    steps = [stepper.step() for _ in range(2)]
    stepper.rewind(3)
    assert int(gan.d_opt.iterations.numpy()) == int(gan.g_opt.iterations.numpy()) == 0
    replay = stepper.step(3)
    assert replay.logs == steps[-1].logs  # the noise replays too: its seed state was restored


class RenamedTrackers(keras.Model):
    """Trackers logged under other names than their own: a VAE's Mean("total_loss")
    returned as "loss", a conditional GAN's "discriminator_loss" as "d_loss"."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(6)
        self.total_tracker = keras.metrics.Mean(name="total_loss")
        self.squared_tracker = keras.metrics.Mean(name="discriminator_loss")

    @property
    def metrics(self):
        return [self.total_tracker, self.squared_tracker]

    def call(self, x):
        return self.dense(x)

    def train_step(self, data):
        with tf.GradientTape() as tape:
            total = tf.reduce_mean(tf.square(self(data) - data))
        self.optimizer.apply(tape.gradient(total, self.trainable_variables), self.trainable_variables)
        self.total_tracker.update_state(total)
        self.squared_tracker.update_state(tf.square(total))
        return {"loss": self.total_tracker.result(), "d_loss": self.squared_tracker.result()}


def renamed_trackers():
    keras.utils.set_random_seed(0)
    model = RenamedTrackers()
    model.compile("sgd")
    model(X[:1])
    return model


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_a_tracker_logged_under_another_name_gives_each_batch_its_own_value(mode):
    run = lab.Run()
    stepper = lab.Stepper(renamed_trackers(), X, batch_size=8, shuffle=False, run=run, mode=mode)
    traces = [stepper.step() for _ in range(4)]
    recorder = lab.Recorder()
    renamed_trackers().fit(X, batch_size=8, shuffle=False, epochs=1, steps_per_epoch=4, verbose=0,
                           callbacks=[recorder])
    rows, fitted = run.batches(), recorder.run.batches()
    for column in ("loss", "d_loss"):
        np.testing.assert_allclose(rows[column], fitted[column], rtol=1e-6)
    # Not Keras' running means, which the step returned.
    assert rows["loss"].iloc[-1] != pytest.approx(traces[-1].logs["loss"])


class OwnLoss(Recording):
    """A custom step that never calls compute_loss: predictions come from the model's call."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            logits = self(x, training=True)
            loss = keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
        self.optimizer.apply(tape.gradient(loss, self.trainable_variables), self.trainable_variables)
        return {"loss": tf.reduce_mean(loss)}


def test_predictions_come_from_the_model_call_when_the_step_has_its_own_loss():
    keras.utils.set_random_seed(0)
    model = OwnLoss()
    model.compile("sgd")
    trace = lab.Stepper(model, (X, Y), batch_size=8, shuffle=False).step()
    kernel, bias = (trace.weights_before[v.path] for v in (model.dense.kernel, model.dense.bias))
    np.testing.assert_allclose(trace.y_pred, X[:8] @ kernel + bias, rtol=1e-5, atol=1e-6)
    assert trace.row["loss"] == pytest.approx(trace.logs["loss"])


def test_graph_mode_rewinds_and_replays_too():
    stepper = lab.Stepper(make_model(), (X, Y), batch_size=8, seed=0, mode="graph")
    ahead = stepper.step(3)
    stepper.rewind(2)
    again = stepper.step(2)
    assert again.index == ahead.index and again.row["loss"] == ahead.row["loss"]


# ---- after a blocking fit() stopped at a breakpoint -------------------------------------


def test_a_blocking_fit_stopped_by_a_breakpoint_opens_a_stepper_on_that_batch():
    from lab.backend.tensorflow.in_flight import BatchInFlight

    model = make_model()
    keep = BatchInFlight()
    recorder = lab.Recorder(breakpoints=[lab.Breakpoint(lambda row: row["step"] == 2)])
    model.fit(X, Y, batch_size=8, epochs=1, shuffle=False, callbacks=[keep, recorder], verbose=0)
    assert len(recorder.run) == 3  # the hit stopped fit() after batch 2
    assert not getattr(model.train_function, "_lab_keep_batch", False)  # no wrapper left behind
    stepper = keep.stepper(run=recorder.run, start_step=2)
    trace = stepper.step()
    np.testing.assert_array_equal(trace.x, X[16:24])
    assert (trace.index, trace.epoch, trace.batch) == (2, 0, 2)
    assert trace.loss == pytest.approx(float(recorder.run.batches()["loss"].iloc[2]), rel=1e-5)


def test_a_fit_after_stepping_goes_on_at_the_next_optimizer_step():
    from lab.backend.tensorflow.in_flight import BatchInFlight

    model = make_model()
    keep = BatchInFlight()
    recorder = lab.Recorder(breakpoints=[lab.Breakpoint(lambda row: row["step"] == 2)])
    model.fit(X, Y, batch_size=8, epochs=1, shuffle=False, callbacks=[keep, recorder], verbose=0)
    stepper = keep.stepper(run=recorder.run)  # on batch 2, the one that hit
    assert stepper.next_index == 2
    stepper.step(3)  # steps 2, 3, 4
    stepper.rewind()  # step 4 undone
    model.fit(X, Y, batch_size=8, epochs=1, shuffle=False, callbacks=[recorder], verbose=0)
    frame = recorder.run.batches()
    iterations = int(model.optimizer.iterations.numpy())
    assert iterations == 2 + 2 + 5  # fit's batches 0-1, the two steps that stand, a fit of 5 batches
    assert frame["step"].iloc[-5:].tolist() == [4, 5, 6, 7, 8]  # fit goes on after the steps that stand
    # A replayed or rewound step keeps its number; the last row of each step is the one that stands.
    assert frame.drop_duplicates("step", keep="last")["step"].tolist() == list(range(iterations))


def test_rewinding_after_the_model_changed_elsewhere_raises():
    model = make_model()
    stepper = lab.Stepper(model, (X, Y), batch_size=8)
    stepper.step(2)
    model.fit(X, Y, batch_size=8, epochs=1, verbose=0)
    fitted = model.layers[0].kernel.numpy().copy()
    with pytest.raises(ValueError, match="changed outside the stepper"):
        stepper.rewind()
    # Stepping goes on from where fit() left the model.
    np.testing.assert_array_equal(stepper.step().weights_before[model.layers[0].kernel.path], fitted)


def test_a_device_side_breakpoint_keeps_the_offending_update_out():
    x = X.copy()
    x[26] = np.nan  # batch 3 at batch_size=8 without shuffling
    model = make_model()
    run = lab.Run()
    stepper = lab.Stepper(model, (x, Y), batch_size=8, shuffle=False, run=run)
    trace = stepper.run_until([lambda t: False, lab.breakpoints.nonfinite()], max_steps=10)
    assert stepper.hit and trace.index == 3 and not np.isfinite(trace.loss)
    assert stepper.next_index == 3  # the bad batch comes next again
    assert int(model.optimizer.iterations.numpy()) == 3
    assert all(np.isfinite(v.numpy()).all() for v in model.weights)
    assert "breakpoint" in set(run.events()["kind"])


def test_rewind_puts_back_a_stateful_rnns_recurrent_state_and_the_replay_is_exact():
    rng = np.random.default_rng(4)
    x, y = rng.normal(size=(32, 5, 3)).astype("float32"), rng.normal(size=(32, 1)).astype("float32")
    keras.utils.set_random_seed(8)
    model = keras.Sequential([keras.Input((5, 3), batch_size=8), keras.layers.LSTM(4, stateful=True),
                              keras.layers.Dense(1)])
    model.compile("adam", "mse")
    stepper = lab.Stepper(model, (x, y), batch_size=8, shuffle=False, mode="graph")
    stepper.step(2)
    state = [s.numpy().copy() for s in model.layers[0].states]  # held outside model.variables
    first = stepper.step(1).logs["loss"]
    stepper.rewind(1)
    assert all(np.array_equal(a, s.numpy()) for a, s in zip(state, model.layers[0].states))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no "ended with other weights" replay warning
        assert stepper.step(1).logs["loss"] == first


class StudentOnly(keras.Model):
    """keras-io's knowledge distillation before Keras 3: the step trains the
    student only; the teacher stays trainable, and no optimizer touches it."""

    def __init__(self):
        super().__init__()
        self.teacher = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
        self.student = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])

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


def test_a_graph_stepper_builds_the_optimizer_on_the_variables_the_step_applies_as_fit_does():
    # A symbolic build before tracing gave Adam slots for the teacher too,
    # which fit() (no strategy) never makes: 10 optimizer variables, not 6.
    def make():
        keras.utils.set_random_seed(0)
        model = StudentOnly()
        model.compile("adam")
        return model

    bare = make()
    bare.fit(X, Y, batch_size=8, shuffle=False, verbose=0)
    model = make()
    stepper = lab.Stepper(model, (X, Y), batch_size=8, shuffle=False, mode="graph")
    stepper.step(5)
    assert [v.shape for v in model.optimizer.variables] == [v.shape for v in bare.optimizer.variables]
    for mine, theirs in zip(model.optimizer.variables + model.weights, bare.optimizer.variables + bare.weights):
        np.testing.assert_array_equal(mine.numpy(), theirs.numpy())
    stepper.rewind(5)
    assert int(model.optimizer.iterations.numpy()) == 0
    assert all(not np.any(v.numpy()) for v in model.optimizer.variables if "momentum" in v.path or "velocity" in v.path)


@pytest.mark.parametrize("mode", ["graph", "eager"])
def test_rewinding_the_first_steps_puts_adams_new_moments_back_to_zero_and_the_replay_is_fit(mode):
    # The graph step built Adam's slots before tracing, after the state it
    # is undone to was read: rewind kept the first steps' moments.
    rng = np.random.default_rng(1)
    x, y = rng.random((48, 4), np.float32), rng.integers(0, 3, 48).astype("int32")

    def make():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)])
        model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    model = make()
    stepper = lab.Stepper(model, (x, y), batch_size=16, shuffle=False, mode=mode)
    first = stepper.step(3).weights_after
    stepper.rewind(3)
    assert all(not np.any(v.numpy()) for v in model.optimizer.variables if "moment" in v.path or "velocity" in v.path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no "ended with other weights" replay warning
        again = stepper.step(3).weights_after
    assert all(np.array_equal(first[key], again[key]) for key in first)
    bare = make()
    bare.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    for mine, theirs in zip(model.optimizer.variables, bare.optimizer.variables):
        np.testing.assert_allclose(mine.numpy(), theirs.numpy(), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("mode", ["graph", "eager"])
def test_a_stepper_kept_across_a_fine_tuning_recompile_steps_as_fit_does_after_it(mode):
    # Keras' transfer-learning guide: train the head on a frozen base, then
    # unfreeze the base, compile() again with a new optimizer, train on.
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(48, 6)).astype("float32"), rng.integers(0, 2, (48, 1)).astype("float32")

    def make():
        keras.utils.set_random_seed(7)
        base = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4, activation="relu")], name="base")
        base.trainable = False
        inputs = keras.Input((6,))
        model = keras.Model(inputs, keras.layers.Dense(1)(base(inputs, training=False)))
        model.compile(keras.optimizers.Adam(), keras.losses.BinaryCrossentropy(from_logits=True),
                      run_eagerly=mode == "eager")
        return model, base

    def unfreeze(model, base):
        base.trainable = True
        model.compile(keras.optimizers.Adam(1e-2), keras.losses.BinaryCrossentropy(from_logits=True),
                      run_eagerly=mode == "eager")

    fitted, base = make()
    fitted.fit(x[:32], y[:32], batch_size=16, shuffle=False, verbose=0)
    unfreeze(fitted, base)
    fitted.fit(x[32:], y[32:], batch_size=16, shuffle=False, verbose=0)
    stepped, base = make()
    stepper = lab.Stepper(stepped, (x, y), batch_size=16, shuffle=False, mode=mode)
    stepper.step(2)
    unfreeze(stepped, base)
    trace = stepper.step(1)
    assert sorted(trace.gradients) == sorted(v.path for v in stepped.trainable_variables)  # the base's too
    assert all(np.array_equal(a.numpy(), b.numpy()) for a, b in zip(stepped.weights, fitted.weights))


@pytest.mark.parametrize("mode", ["graph", "eager"])
def test_a_graph_stepper_says_where_grappler_may_round_an_update_otherwise_than_fit(mode):
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 4)).astype("float32"), rng.integers(0, 3, size=(64,)).astype("int32")

    def build():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)])
        # Clipped SGD: its update's one reader of the gradient is the product Grappler regroups.
        model.compile(optimizer=keras.optimizers.SGD(0.01, global_clipnorm=0.2),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), run_eagerly=mode == "eager")
        return model

    fitted = build()
    fitted.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    stepped, run = build(), lab.Run()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lab.Stepper(stepped, (x, y), batch_size=8, shuffle=False, mode=mode, run=run).step(8)
    said = [str(w.message) for w in caught if "Grappler" in str(w.message)]
    same = all(np.array_equal(a.numpy(), b.numpy()) for a, b in zip(fitted.weights, stepped.weights))
    if mode == "eager":
        assert same and said == [] and len(run.events()) == 0
    else:
        assert len(said) == 1 and "Stepper(mode='eager')" in said[0]
        assert list(run.events()["kind"]) == ["warning"]


def test_a_loss_spike_on_a_step_that_logs_no_loss_warns_that_it_can_never_hit():
    # It read no loss, never hit, and said nothing.
    class OwnLoss(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(1)
            self.tracker = keras.metrics.Mean(name="own_loss")

        def call(self, x):
            return self.dense(x)

        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                loss = keras.ops.mean((self(x) - y) ** 2)
            self.optimizer.apply(tape.gradient(loss, self.trainable_variables), self.trainable_variables)
            self.tracker.update_state(loss)
            return {"own_loss": self.tracker.result()}

    keras.utils.set_random_seed(0)
    model = OwnLoss()
    model.compile(optimizer=keras.optimizers.SGD(1e-3))
    x = np.random.default_rng(0).random((64, 4)).astype("float32")
    stepper = lab.Stepper(model, (x, np.zeros((64, 1), "float32")), batch_size=8, shuffle=False)
    with pytest.warns(UserWarning, match=r"loss_spike\(3\) watches the step's loss.*own_loss.*never hit"):
        stepper.run_until(lab.breakpoints.loss_spike(3.0, warmup=1), max_steps=3)
    assert not stepper.hit


@pytest.mark.parametrize("case", ["accumulation", "loss scale overflow"])
def test_a_graph_stepper_shows_no_gradient_for_an_update_that_did_not_run_as_an_eager_one(case):
    # Gradient accumulation applies on every second step; a LossScaleOptimizer
    # whose scale overflows float16 skips its updates. The graph step's update
    # runs in a cond branch: where it did not run, its gradients were NaN, so
    # run_until(nonfinite()) stopped at step 0 on training that bare fit() and
    # the eager Stepper go through.
    def build():
        keras.utils.set_random_seed(0)
        if case == "accumulation":
            optimizer = keras.optimizers.SGD(0.1, gradient_accumulation_steps=2)
        else:
            keras.mixed_precision.set_global_policy("mixed_float16")
            optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=2.0 ** 40)
        try:
            model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(5, activation="relu", name="hidden"),
                                      keras.layers.Dense(3, name="out"),
                                      keras.layers.Activation("linear", dtype="float32")], name="net")
            model.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        finally:
            keras.mixed_precision.set_global_policy("float32")
        return model

    traces = {}
    for mode in ("eager", "graph"):
        stepper = lab.Stepper(build(), (X, Y), batch_size=8, shuffle=False, mode=mode, run=lab.Run())
        stepper.run_until(lab.breakpoints.nonfinite(), max_steps=4)
        assert not stepper.hit and stepper.next_index == 4, mode
        traces[mode] = stepper.traces
    updated = [False, True, False, True] if case == "accumulation" else [False] * 4  # every second applies the mean
    for eager, graph, applied in zip(traces["eager"], traces["graph"], updated):
        assert sorted(graph.gradients) == sorted(eager.gradients) and bool(graph.gradients) == applied
        assert sorted(graph.row) == sorted(eager.row)
        for key, gradient in eager.gradients.items():
            np.testing.assert_allclose(graph.gradients[key], gradient, rtol=1e-5)


def test_a_ctrl_c_during_rewind_rewinds_whole_and_reaches_the_user(monkeypatch):
    # A real SIGINT (the notebook's interrupt button) between two variables'
    # writes left the model half rewound: some weights back, the history
    # and the data position not, so stepping on replayed nothing as before.
    import signal

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 6)).astype("float32"), rng.integers(0, 3, 32)
    model = make_model()
    before = [v.numpy().copy() for v in model.variables + model.optimizer.variables]
    stepper = lab.Stepper(model, (x, y), batch_size=8, shuffle=False)
    first = [float(trace.logs["loss"]) for trace in [stepper.step() for _ in range(3)]]
    calls = {"n": 0}
    replicated = lab.backend.tensorflow.stepper.replicated

    def interrupting(variable):
        calls["n"] += 1
        if calls["n"] == 2:
            signal.raise_signal(signal.SIGINT)
        return replicated(variable)

    monkeypatch.setattr(lab.backend.tensorflow.stepper, "replicated", interrupting)
    with pytest.raises(KeyboardInterrupt):
        stepper.rewind(3)
    monkeypatch.undo()
    after = [v.numpy() for v in model.variables + model.optimizer.variables]
    assert all(np.array_equal(a, b) for a, b in zip(before, after))
    assert calls["n"] > 2, "the interrupt must land inside the rewind's writes"
    again = [float(trace.logs["loss"]) for trace in [stepper.step() for _ in range(3)]]
    assert again == first and [t.index for t in stepper.traces] == [0, 1, 2]


class ReconstructsInDataType(keras.Model):
    """An autoencoder whose step takes its loss in the data's own float type
    (a reconstruction loss written against x, as keras-io's VAE writes it)."""

    def __init__(self):
        super().__init__()
        self.code = keras.layers.Dense(2)
        self.back = keras.layers.Dense(4)
        self.handed = []

    def call(self, x):
        return self.back(self.code(x))

    def train_step(self, data):
        x = data[0] if isinstance(data, tuple) else data
        self.handed.append(x.dtype.name)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(x - tf.cast(self(x), x.dtype)))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return {"loss": loss}


SAMPLES_64 = np.random.default_rng(3).normal(size=(24, 4))  # float64, as numpy makes them


def float64_batches():
    for start in range(0, 24, 8):
        yield (SAMPLES_64[start:start + 8],)


class Float64Batches(keras.utils.PyDataset):
    def __len__(self):
        return 3

    def __getitem__(self, index):
        return (SAMPLES_64[index * 8:(index + 1) * 8],)


@pytest.mark.parametrize("source", [float64_batches, Float64Batches])
@pytest.mark.parametrize("mode", ["graph", "eager"])
def test_float64_batches_of_a_generator_or_pydataset_reach_train_step_as_fit_hands_them(source, mode):
    # fit() casts float arrays to floatx but hands a generator's or a
    # PyDataset's float64 batches on as they are; the Stepper cast those to
    # float32 too, so a step computing its loss in the data's type trained
    # on other values than fit().
    def made():
        keras.utils.set_random_seed(0)
        model = ReconstructsInDataType()
        model.compile(optimizer=keras.optimizers.SGD(0.1), run_eagerly=mode == "eager")
        return model

    fitted, stepped = made(), made()
    fitted.fit(source(), epochs=1, verbose=0, **({"shuffle": False} if source is Float64Batches else {}))
    stepper = lab.Stepper(stepped, source(), shuffle=False, mode=mode)
    stepper.step(3)
    assert [t.error for t in stepper.traces] == [None] * 3
    assert fitted.handed[-1] == stepped.handed[-1] == "float64"
    for got, expected in zip(stepped.get_weights(), fitted.get_weights(), strict=True):
        np.testing.assert_array_equal(got, expected)


def test_float64_arrays_reach_train_step_as_floatx_as_fit_casts_them():
    def made():
        keras.utils.set_random_seed(0)
        model = ReconstructsInDataType()
        model.compile(optimizer=keras.optimizers.SGD(0.1), run_eagerly=True)
        return model

    fitted, stepped = made(), made()
    fitted.fit(SAMPLES_64, batch_size=8, shuffle=False, epochs=1, verbose=0)
    lab.Stepper(stepped, SAMPLES_64, batch_size=8, shuffle=False).step(3)
    assert fitted.handed[-1] == stepped.handed[-1] == keras.backend.floatx()
    for got, expected in zip(stepped.get_weights(), fitted.get_weights(), strict=True):
        np.testing.assert_array_equal(got, expected)


def test_from_step_compiles_the_step_as_the_loop_does_not_as_the_models_jit_compile_says():
    # A hand-written loop compiles its own step (a plain tf.function here); the
    # model's jit_compile (on: compile()'s "auto" on a machine with a GPU) is
    # fit()'s, not the loop's. Stepped with XLA, the weights parted from the loop's.
    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(96, 16)).astype("float32"), rng.integers(0, 3, 96)

    def made():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(64, activation="tanh"), keras.layers.Dense(3)])
        model.compile(jit_compile=True)
        optimizer = keras.optimizers.Adam(1e-2)
        return model, optimizer, hand_written_step(model, optimizer)

    looped, _, step = made()
    compiled_step = tf.function(step)
    for start in range(0, 96, 32):
        compiled_step(x[start:start + 32], y[start:start + 32])
    stepped, optimizer, step = made()
    stepper = lab.Stepper.from_step(step, stepped, (x, y), optimizers=[optimizer], batch_size=32, shuffle=False,
                                    mode="graph")
    stepper.step(3)
    for got, expected in zip(stepped.get_weights(), looped.get_weights(), strict=True):
        np.testing.assert_array_equal(got, expected)


# ---- a tf.SparseTensor of inputs, as fit() takes it --------------------------------


def sparse_inputs(n=64):
    rng = np.random.default_rng(5)
    dense = rng.normal(size=(n, 6)).astype("float32")
    x = tf.sparse.from_dense(np.where(np.abs(dense) > 0.8, dense, 0).astype("float32"))
    return x, (dense[:, :1] > 0).astype("float32")


def sparse_model():
    keras.utils.set_random_seed(3)
    inputs = keras.Input((6,), sparse=True)
    model = keras.Model(inputs, keras.layers.Dense(1, activation="sigmoid")(keras.layers.Dense(4)(inputs)))
    model.compile(optimizer="adam", loss="binary_crossentropy")
    return model


@pytest.mark.parametrize("mode", ["graph", "eager"])
def test_a_sparse_tensor_of_inputs_is_stepped_as_fit_batches_it(mode):
    # fit(x_sparse, y, batch_size=...) slices the SparseTensor; the Stepper
    # iterated the (x, y) tuple as if it were two batches, and the step failed.
    x, y = sparse_inputs()
    fitted, stepped = sparse_model(), sparse_model()
    fitted.run_eagerly = mode == "eager"
    fitted.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)  # 6 batches an epoch, the last of 4
    stepper = lab.Stepper(stepped, (x, y), batch_size=12, shuffle=False, mode=mode)
    trace = stepper.step(12)
    assert trace.error is None
    for got, expected in zip(stepped.weights + stepped.optimizer.variables,
                             fitted.weights + fitted.optimizer.variables, strict=True):
        np.testing.assert_array_equal(got.numpy(), expected.numpy())
    # The trace shows the batch's inputs as an array; the last batch holds the last 4 samples.
    np.testing.assert_array_equal(trace.x, tf.sparse.to_dense(x).numpy()[60:])
    report = lab.inspect_data(x, y, batch_size=12, model=sparse_model(), validation_split=0.25)
    assert report.ok and report.batches_per_epoch == 4  # 48 training samples


# ---- class_weight, as fit() takes it ------------------------------------------

CLASS_WEIGHT = {0: 1.0, 1: 4.0, 2: 0.5}


class FortyByEight(keras.utils.PyDataset):
    def __len__(self):
        return 5

    def __getitem__(self, index):
        return X[index * 8:(index + 1) * 8], Y[index * 8:(index + 1) * 8]


def weighted_model():
    model = make_model()
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"],
                  weighted_metrics=["accuracy"])
    return model


CLASS_WEIGHTED_DATA = {
    "arrays": lambda: ((X, Y), 8),
    "one-hot arrays": lambda: ((X, np.eye(3, dtype=np.float32)[Y]), 8),  # weighted by each row's argmax
    "dataset": lambda: (tf.data.Dataset.from_tensor_slices((X, Y)).batch(8), None),
    "pydataset": lambda: (FortyByEight(), None),
}


@pytest.mark.parametrize("mode", ["graph", "eager"])
@pytest.mark.parametrize("kind", list(CLASS_WEIGHTED_DATA))
def test_class_weights_weigh_the_steps_as_they_weigh_fit(kind, mode):
    # A user who fits an imbalanced set with class_weight steps the same
    # batches: without it the Stepper's losses and updates were unweighted.
    data, batch_size = CLASS_WEIGHTED_DATA[kind]()
    fitted = weighted_model()
    if kind == "one-hot arrays":
        fitted.compile("adam", keras.losses.CategoricalCrossentropy(from_logits=True), metrics=["accuracy"],
                       weighted_metrics=["accuracy"])
    fitted.run_eagerly = mode == "eager"
    recorder = lab.Recorder()
    arrays = isinstance(data, tuple)
    fitted.fit(*(data if arrays else (data,)), batch_size=batch_size, shuffle=False, verbose=0,
               class_weight=CLASS_WEIGHT, callbacks=[recorder])
    stepped = weighted_model()
    if kind == "one-hot arrays":
        stepped.compile("adam", keras.losses.CategoricalCrossentropy(from_logits=True), metrics=["accuracy"],
                        weighted_metrics=["accuracy"])
    run = lab.Run()
    stepper = lab.Stepper(stepped, data, batch_size=batch_size, shuffle=False, mode=mode, run=run,
                          class_weight=CLASS_WEIGHT)
    stepper.step(5)
    for got, expected in zip(stepped.weights + stepped.optimizer.variables,
                             fitted.weights + fitted.optimizer.variables, strict=True):
        np.testing.assert_array_equal(got.numpy(), expected.numpy())
    for column in ("loss", "weighted_accuracy"):  # each batch's own, as the Recorder's rows of fit() hold them
        np.testing.assert_array_equal(run.batches()[column], recorder.run.batches()[column])
    trace = stepper.last_trace
    np.testing.assert_array_equal(trace.sample_weight, [CLASS_WEIGHT[int(c)] for c in Y[32:]])


@pytest.mark.parametrize("class_weight, error, message", [
    ([1.0, 4.0], TypeError, r"class_weight=\.\.\.\) must be a dict from class index to weight; got list"),
    ({"cat": 1.0}, ValueError, r"has the key 'cat': its keys must be class indices"),
    ({-1: 1.0}, ValueError, r"has the key -1"),
    ({0: float("nan")}, ValueError, r"gives class 0 the weight nan: each weight must be a finite number"),
    ({0: "heavy"}, ValueError, r"gives class 0 the weight 'heavy'"),
])
def test_a_class_weight_that_is_not_a_map_of_classes_to_weights_is_refused_where_given(class_weight, error, message):
    with pytest.raises(error, match=message):
        lab.Stepper(make_model(), (X, Y), class_weight=class_weight)


@pytest.mark.parametrize("data, message", [
    (lambda: (X, Y, np.ones(40, np.float32)), "holds sample weights and class_weight is given too"),
    (lambda: X, "(?i)the data has no targets"),
    (lambda: (X, [Y, Y]), "a model with one output"),
    (lambda: iter([(X, Y)]), "cannot weight the batches of a list_iterator: fit\\(\\) refuses it there too"),
    (lambda: tf.data.Dataset.from_tensor_slices((X, Y, np.ones(40, np.float32))).batch(8),
     "cannot `class_weight` and `sample_weight`"),  # Keras' own words, from the map fit() applies
])
def test_class_weights_on_data_fit_refuses_them_for_are_refused_by_the_stepper_too(data, message):
    with pytest.raises(ValueError, match=message):
        lab.Stepper(make_model(), data(), class_weight=CLASS_WEIGHT)
