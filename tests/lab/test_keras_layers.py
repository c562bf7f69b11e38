"""Every layer Keras ships, with the lab attached.

Users build their models from `keras.layers`, and each layer keeps its state
in its own way: BatchNormalization's moving statistics and SpectralNormalization's
power-iteration vectors are written in the forward pass, Dropout and the
random augmentations advance seed generators, a stateful RNN carries its
states from batch to batch in variables Keras does not list among the model's,
an Embedding's gradient is sparse, regularizers add losses, masks flow from
Embedding and Masking into RNNs, and preprocessing layers (lookups, hashing,
adapted normalization) hold tables and constants. For each group of layers of
the installed Keras, a small model on generated data is fit twice from the
same weights, bare and with `lab.Recorder(gradients=True, weights=True)`, and
stepped by a graph `lab.Stepper`:

- the History, the model's variables (seed generators and RNN states too) and
  the optimizer's equal bare fit()'s bit for bit, or differ only where the run
  says they may (Grappler's regrouping, `lab.backend.tensorflow.probes.REGROUPED_NOTE`);
- every trainable variable has its gradient, weight-norm and update-ratio
  values in every row; one the loss does not reach (a Dense before a
  Discretization: Keras warns that it gets no gradient) trains as bare, its
  gradient column is missing (NaN) in every row, not zero, and the run says
  that no optimizer updates it (`lab.backend.tensorflow.probes.NO_UPDATE_NOTE`);
- the Stepper's steps end where fit()'s first epoch ends, a rewind puts back
  every variable, and the steps taken again end there again, silently;
- a `nonfinite()` hit at a NaN batch ends fit() with the model of the good
  batches before it: what the bad batch's forward pass assigned (moving
  statistics, RNN states, seed generators, SpectralNormalization's
  renormalized kernel) is kept out with its update.
"""

import functools
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import lab

L = keras.layers
BATCH, BATCHES = 16, 4
N = BATCH * BATCHES


def rng():
    return np.random.default_rng(0)


def classes(x, k=3):
    """Labels that depend on the inputs, so every layer gets a gradient."""
    flat = np.asarray(x, "float32").reshape(len(x), -1)
    return (np.abs(flat).sum(axis=1) * 7).astype("int64") % k


def classifier(inputs, outputs, x, k=3):
    """A model ending in `k` logits, with labels from `x`. Adam, not plain
    SGD, whose update Grappler regroups once the lab reads the gradients
    (test_keras_optimizers.py covers that)."""
    logits = L.Dense(k, name="logits")(L.Flatten()(outputs) if len(outputs.shape) > 2 else outputs)
    model = keras.Model(inputs, logits)
    model.compile(keras.optimizers.Adam(0.01), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model, (x, classes(x, k))


def stack(shape, layers, x, dtype="float32", batch_size=None):
    inputs = keras.Input(shape, dtype=dtype, batch_size=batch_size)
    h = inputs
    for layer in layers:
        h = layer(h)
    return classifier(inputs, h, x)


def normal(*shape):
    return rng().normal(size=(N, *shape)).astype("float32")


def tokens(length, vocabulary, padded=True):
    """Token ids, with a zero padding tail of varying length when `padded`."""
    ids = rng().integers(1, vocabulary, size=(N, length))
    if padded:
        ids[np.arange(length)[None, :] >= rng().integers(1, length + 1, size=(N, 1))] = 0
    return ids.astype("int32")


def dense():
    return stack((8,), [L.Dense(16, activation="relu"), L.EinsumDense("ab,bc->ac", output_shape=8, bias_axes="c")],
                 normal(8))


def conv1d():
    return stack((12, 2), [L.Conv1D(4, 3, activation="relu"), L.SeparableConv1D(4, 3), L.GlobalAveragePooling1D()],
                 normal(12, 2))


def conv2d():
    return stack((8, 8, 2), [L.Conv2D(4, 3, activation="relu"), L.DepthwiseConv2D(3), L.SeparableConv2D(4, 3),
                             L.MaxPooling2D()], normal(8, 8, 2))


def conv3d():
    return stack((4, 4, 4, 1), [L.Conv3D(2, 2, activation="relu"), L.AveragePooling3D(2)], normal(4, 4, 4, 1))


def conv2d_transpose():
    # An image-to-image model, fit to a target image (mse).
    keras.utils.set_random_seed(3)
    x = normal(4, 4, 2)
    model = keras.Sequential([keras.Input((4, 4, 2)), L.Conv2DTranspose(2, 3, strides=2, padding="same"),
                              L.Conv2D(1, 3, padding="same")])
    model.compile(keras.optimizers.Adam(0.01), "mse")
    return model, (x, np.repeat(np.repeat(x[..., :1], 2, axis=1), 2, axis=2))


def embedding_masked_lstm():
    return stack((6,), [L.Embedding(10, 4, mask_zero=True), L.LSTM(4)], tokens(6, 10), dtype="int32")


def simple_rnn_and_gru_sequences():
    return stack((5, 3), [L.SimpleRNN(4, return_sequences=True), L.GRU(4, return_sequences=True),
                          L.GlobalAveragePooling1D()], normal(5, 3))


def bidirectional():
    return stack((5, 3), [L.Bidirectional(L.GRU(3, return_sequences=True)), L.GlobalAveragePooling1D()],
                 normal(5, 3))


def stateful_lstm():
    # States carried from batch to batch: the batch size is fixed.
    return stack((5, 3), [L.LSTM(4, stateful=True)], normal(5, 3), batch_size=BATCH)


def frozen_and_lora():
    lora = L.Dense(8, name="lora")
    lora.build((None, 8))
    lora.enable_lora(2)  # the kernel frozen, two low-rank factors trained
    return stack((8,), [L.Dense(8, trainable=False), lora], normal(8))


def conv_lstm2d():
    return stack((3, 5, 5, 1), [L.ConvLSTM2D(2, 3)], normal(3, 5, 5, 1))


def time_distributed():
    return stack((4, 6), [L.TimeDistributed(L.Dense(3, activation="relu"))], normal(4, 6))


def attention(layer):
    def build():
        inputs = keras.Input((5, 4))
        h = layer()(inputs, inputs)
        return classifier(inputs, L.GlobalAveragePooling1D()(h), normal(5, 4))
    return build


def batch_normalization():
    return stack((8,), [L.Dense(8), L.BatchNormalization(), L.Activation("relu")], normal(8))


def normalizations():
    return stack((8,), [L.Dense(8), L.LayerNormalization(), L.GroupNormalization(groups=2), L.Dense(8),
                        L.UnitNormalization()], normal(8))


def rms_normalization():
    return stack((8,), [L.Dense(8), L.RMSNormalization()], normal(8))


def spectral_normalization():
    return stack((8,), [L.SpectralNormalization(L.Dense(8, activation="relu")),
                        L.SpectralNormalization(L.Dense(4))], normal(8))


def dropouts():
    return stack((8,), [L.Dense(16, activation="relu"), L.Dropout(0.3), L.GaussianNoise(0.1),
                        L.GaussianDropout(0.2), L.AlphaDropout(0.2)], normal(8))


def spatial_dropouts():
    return stack((8, 8, 2), [L.Conv2D(3, 3), L.SpatialDropout2D(0.3), L.Reshape((36, 3)),
                             L.SpatialDropout1D(0.3), L.Conv1D(2, 3)], normal(8, 8, 2))


def regularizers():
    r = keras.regularizers
    return stack((8,), [L.Dense(8, activation="relu", kernel_regularizer=r.L2(0.01), bias_regularizer=r.L1(0.01),
                                activity_regularizer=r.L1L2(0.001, 0.001)),
                        L.ActivityRegularization(l1=0.01, l2=0.01)], normal(8))


def masking():
    x = normal(6, 3)
    x[:, 4:] = 0.0  # padded steps, skipped by the RNN
    return stack((6, 3), [L.Masking(0.0), L.SimpleRNN(4)], x)


def numeric_preprocessing():
    x = normal(8) * 5 + 2
    norm = L.Normalization()
    norm.adapt(x)
    return stack((8,), [L.Rescaling(0.5, offset=1.0), norm, L.Dense(8, activation="relu")], x)


def image_augmentation():
    return stack((8, 8, 1), [L.RandomFlip(), L.RandomRotation(0.2), L.RandomZoom(0.2), L.RandomContrast(0.3),
                             L.Conv2D(2, 3)], normal(8, 8, 1))


def discretization_and_category_encoding():
    return stack((3,), [L.Discretization(bin_boundaries=[-1.0, 0.0, 1.0]),
                        L.CategoryEncoding(num_tokens=4, output_mode="multi_hot"), L.Dense(4)], normal(3))


def hashing_and_integer_lookup():
    inputs = keras.Input((4,), dtype="int64")
    hashed = L.CategoryEncoding(num_tokens=8, output_mode="count")(L.Hashing(num_bins=8)(inputs))
    looked_up = L.Flatten()(L.Embedding(6, 2)(L.IntegerLookup(vocabulary=[1, 2, 3, 4])(inputs)))
    x = rng().integers(0, 7, size=(N, 4)).astype("int64")
    return classifier(inputs, L.Concatenate()([hashed, looked_up]), x)


def string_lookup():
    words = np.array(["red", "green", "blue", "cyan", "gold"])
    ids = rng().integers(0, len(words), size=(N, 3))
    inputs = keras.Input((3,), dtype="string")
    h = L.Flatten()(L.Embedding(7, 2)(L.StringLookup(vocabulary=list(words[:4]))(inputs)))
    model, _ = classifier(inputs, h, ids)
    return model, (tf.constant(words[ids]), classes(ids))


def gqa():
    return L.GroupQueryAttention(head_dim=2, num_query_heads=2, num_key_value_heads=1)


CASES = {
    "Dense+EinsumDense": dense,
    "Conv1D+SeparableConv1D": conv1d,
    "Conv2D+DepthwiseConv2D+SeparableConv2D": conv2d,
    "Conv3D": conv3d,
    "Conv2DTranspose": conv2d_transpose,
    "Embedding(mask_zero)+LSTM": embedding_masked_lstm,
    "SimpleRNN+GRU(return_sequences)": simple_rnn_and_gru_sequences,
    "Bidirectional": bidirectional,
    "stateful LSTM": stateful_lstm,
    "ConvLSTM2D": conv_lstm2d,
    "TimeDistributed": time_distributed,
    "MultiHeadAttention": attention(lambda: L.MultiHeadAttention(2, key_dim=2)),
    "GroupQueryAttention": attention(gqa),
    "frozen Dense+LoRA Dense": frozen_and_lora,
    "BatchNormalization": batch_normalization,
    "Layer+Group+UnitNormalization": normalizations,
    "RMSNormalization": rms_normalization,
    "SpectralNormalization": spectral_normalization,
    "Dropout+GaussianNoise+GaussianDropout+AlphaDropout": dropouts,
    "SpatialDropout1D+2D": spatial_dropouts,
    "regularizers+ActivityRegularization": regularizers,
    "Masking+SimpleRNN": masking,
    "Normalization(adapted)+Rescaling": numeric_preprocessing,
    "RandomFlip+Rotation+Zoom+Contrast": image_augmentation,
    "Discretization+CategoryEncoding": discretization_and_category_encoding,
    "Hashing+IntegerLookup": hashing_and_integer_lookup,
    "StringLookup": string_lookup,
}
# The layers of later Keras versions than the oldest supported.
LATER = {"RMSNormalization": "RMSNormalization", "GroupQueryAttention": "GroupQueryAttention"}
# Layers whose forward pass assigns variables, for the nonfinite() hit
# (BatchNormalization's and a stateful RNN's are checked in test_probes.py).
ASSIGNING = ["SpectralNormalization", "Dropout+GaussianNoise+GaussianDropout+AlphaDropout"]


def params():
    return [pytest.param(name, marks=pytest.mark.skipif(not hasattr(L, LATER[name]),
                                                        reason=f"keras.layers.{LATER[name]} is newer than "
                                                               f"Keras {keras.__version__}"))
            if name in LATER else name for name in CASES]


def make(name):
    keras.utils.set_random_seed(3)
    return CASES[name]()


def model_variables(model):
    """The model's variables (seed generators too) and a stateful RNN's
    states, which Keras keeps out of them."""
    states = [s for layer in model._flatten_layers() if getattr(layer, "stateful", False)
              for s in keras.tree.flatten(getattr(layer, "states", None) or [])]
    return model.variables + states


def state(model, optimizer=True):
    return [v.numpy().tobytes() for v in model_variables(model) + (model.optimizer.variables if optimizer else [])]


def differing(model, expected, optimizer=True):
    """The paths of the variables whose bytes are not `expected`'s (the
    models' layer names differ, so variables are matched by position)."""
    values = model_variables(model) + (model.optimizer.variables if optimizer else [])
    assert len(values) == len(expected)
    return [v.path for v, e in zip(values, expected) if v.numpy().tobytes() != e]


class FirstEpoch(keras.callbacks.Callback):
    """Every variable as fit()'s first epoch ends."""

    def on_epoch_end(self, epoch, logs=None):
        if epoch == 0:
            self.state = state(self.model)


@functools.lru_cache(maxsize=None)
def bare(name):
    """Bare fit()'s History, its state after the first epoch and at the end."""
    model, (x, y) = make(name)
    first = FirstEpoch()
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[first]).history
    return history, first.state, state(model)


@pytest.mark.parametrize("name", params())
def test_each_keras_layer_trains_as_bare_fit_and_every_variable_has_its_columns(name):
    bare_history, _, bare_state = bare(name)
    recorder = lab.Recorder(gradients=True, weights=True)
    model, (x, y) = make(name)
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[recorder]).history
    assert history == bare_history
    warned = " ".join(recorder.run.events().query("kind == 'warning'")["detail"])
    parted = differing(model, bare_state)
    assert not parted or "Grappler" in warned, f"{parted} parted from bare fit()'s, and the run said nothing"
    rows = recorder.run.batches()
    assert len(rows) == 2 * BATCHES
    for variable in model.trainable_variables:
        for prefix in ("grad_norm/", "weight_norm/", "update_ratio/"):
            column = prefix + variable.path
            assert column in rows and rows[column].notna().all(), f"{column} is missing or empty"
    assert rows["grad_norm"].notna().all() and rows["updated"].eq(1).all()


@pytest.mark.newest_only
@pytest.mark.parametrize("name", params())
def test_each_keras_layer_steps_as_fit_and_replays_after_a_rewind(name):
    _, first_epoch, _ = bare(name)
    model, data = make(name)
    initial = state(model, optimizer=False)
    stepper = lab.Stepper(model, data, batch_size=BATCH, shuffle=False, mode="graph")
    stepper.step(BATCHES)
    trace = stepper.last_trace
    assert trace.error is None and set(trace.gradients) >= {v.path for v in model.trainable_variables}
    assert not differing(model, first_epoch), "the steps parted from fit()'s first epoch"
    stepper.rewind(BATCHES)
    assert not differing(model, initial, optimizer=False), "the rewind left these as they were"
    assert int(model.optimizer.iterations.numpy()) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a replay that parts from the first run warns
        stepper.step(BATCHES)
    assert not differing(model, first_epoch), "the replay parted from fit()'s first epoch"


def test_a_variable_the_loss_does_not_reach_trains_as_bare_and_the_run_says_it_is_not_trained():
    def build():
        keras.utils.set_random_seed(3)
        inputs = keras.Input((8,))
        binned = L.Discretization(bin_boundaries=[-1.0, 0.0, 1.0])(L.Dense(3, name="before_bins")(inputs))
        h = L.Concatenate()([L.CategoryEncoding(4, output_mode="multi_hot")(binned), L.Dense(4)(inputs)])
        return classifier(inputs, h, normal(8))

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Gradients do not exist", UserWarning)
        bare_model, (x, y) = build()
        bare_history = bare_model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0).history
        recorder = lab.Recorder(gradients=True, weights=True)
        model, _ = build()
        history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[recorder]).history
    assert history == bare_history and not differing(model, state(bare_model))
    rows = recorder.run.batches()
    for variable in model.trainable_variables:
        column = rows[f"grad_norm/{variable.path}"]
        if variable.path.startswith("before_bins/"):
            assert column.isna().all() and f"weight_norm/{variable.path}" not in rows
        else:
            assert column.notna().all() and rows[f"weight_norm/{variable.path}"].notna().all()
    # Keras warns "Gradients do not exist"; the run says what that means for its columns.
    warned = recorder.run.events().query("kind == 'warning'")["detail"].tolist()
    assert len(warned) == 1 and warned[0].startswith("before_bins/kernel, before_bins/bias: trainable, but no optimizer")


def float8_model():
    """Dense layers quantized for float8 training: each holds scales and
    amax histories (trainable, `overwrite_with_gradient`) that its custom
    gradient computes anew at every step and the optimizer assigns."""
    keras.utils.set_random_seed(3)
    inputs = keras.Input((8,))
    h = L.Dense(16, activation="relu")(inputs)
    model, data = classifier(inputs, h, normal(8))
    model.quantize("float8")
    return model, data


def overwritten_paths(model):
    return [v.path for v in model.trainable_variables if getattr(v, "overwrite_with_gradient", False)]


def test_float8_training_trains_as_bare_and_its_scales_are_said_to_be_set_each_step():
    # The lab gave each scale and amax history a grad_norm column of NaN and
    # told the run they were "not trained", though they change at every step.
    bare_model, (x, y) = float8_model()
    bare_history = bare_model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0).history
    recorder = lab.Recorder(gradients=True, weights=True)
    model, _ = float8_model()
    set_each_step = overwritten_paths(model)
    assert len(set_each_step) == 12  # 6 in each of the 2 Dense layers
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[recorder]).history
    assert history == bare_history and not differing(model, state(bare_model))
    rows = recorder.run.batches()
    trained = [v.path for v in model.trainable_variables if v.path not in set_each_step]
    assert len(trained) == 4
    for path in trained:
        for prefix in ("grad_norm/", "weight_norm/", "update_ratio/"):
            assert rows[prefix + path].notna().all()
    assert not [c for c in rows if c.split("/", 1)[-1] in set_each_step]
    # grad_norm is the gradients' norm, of the kernels and biases alone.
    parts = rows[[f"grad_norm/{path}" for path in trained]].to_numpy("float64")
    np.testing.assert_allclose(rows["grad_norm"], np.sqrt((parts ** 2).sum(axis=1)), rtol=1e-6)
    warned = recorder.run.events().query("kind == 'warning'")["detail"].tolist()
    assert len(warned) == 1 and "overwrite_with_gradient" in warned[0] and "not trained" not in warned[0]
    assert warned[0].startswith(", ".join(set_each_step[:4]))
    # A graph Stepper steps as fit() does and a rewind puts the scales back too.
    stepped, data = float8_model()
    initial = state(stepped, optimizer=False)
    stepper = lab.Stepper(stepped, data, batch_size=BATCH, shuffle=False, mode="graph")
    stepper.step(2 * BATCHES)
    assert stepper.last_trace.error is None
    updated = {v.path for v in stepped.trainable_variables} - set(overwritten_paths(stepped))
    assert set(stepper.last_trace.gradients) == updated
    assert not differing(stepped, state(bare_model))
    stepper.rewind(2 * BATCHES)
    assert not differing(stepped, initial, optimizer=False)


def test_float8_training_watched_by_hand_has_no_columns_for_its_scales():
    model, (x, y) = float8_model()
    optimizer, loss = keras.optimizers.Adam(0.01), keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def train_step(xb, yb):
        with tf.GradientTape() as tape:
            value = loss(yb, model(xb, training=True))
        optimizer.apply(tape.gradient(value, model.trainable_variables), model.trainable_variables)
        return value

    with lab.watch(model, optimizer) as run:
        for i in range(BATCHES):
            run.step(loss=train_step(x[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH]))
    rows = run.batches()
    set_each_step = overwritten_paths(model)
    assert len(rows) == BATCHES and not [c for c in rows if c.split("/", 1)[-1] in set_each_step]
    assert sum(c.startswith("grad_norm/") for c in rows) == 4 and rows["grad_norm"].notna().all()
    warned = run.events().query("kind == 'warning'")["detail"].tolist()
    assert len(warned) == 1 and "overwrite_with_gradient" in warned[0]


@pytest.mark.parametrize("name", ASSIGNING)
def test_a_nonfinite_hit_keeps_out_what_the_bad_batchs_forward_pass_assigned(name):
    good, (x, y) = make(name)
    good.fit(x[:2 * BATCH], y[:2 * BATCH], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    bad = x.copy()
    bad[2 * BATCH + 3].flat[0] = np.nan  # in the third batch
    recorder = lab.Recorder(breakpoints=[lab.breakpoints.nonfinite()])
    model, _ = make(name)
    model.fit(bad, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[recorder])
    assert list(recorder.run.events()["kind"]) == ["nonfinite"]
    assert not differing(model, state(good)), "the bad batch's forward pass left these changed"
