"""lab.layer_norms: per-variable norms combined per layer and per part of a model."""

import keras
import numpy as np
import pandas as pd
import pytest

import lab


def run_with(columns, steps=None):
    run = lab.Run()
    n = len(next(iter(columns.values())))
    run.append_batches({"epoch": [0] * n, "batch": list(range(n)), "seconds": [0.01] * n,
                        "mode": ["graph"] * n, "loss": np.ones(n, np.float32),
                        **{k: np.array(v, np.float32) for k, v in columns.items()}})
    return run


def test_by_layer_combines_a_layers_variables_into_one_norm():
    run = run_with({"grad_norm": [5.0, 1.0], "grad_norm/trunk/kernel": [3.0, 1.0],
                    "grad_norm/trunk/bias": [4.0, 0.0], "grad_norm/head/kernel": [2.0, np.nan]})
    norms = lab.layer_norms(run)
    assert sorted(norms.columns) == ["head", "trunk"]
    assert list(norms.index) == [0, 1]
    np.testing.assert_allclose(norms["trunk"], [5.0, 1.0])
    # A step where the layer got no gradient is missing, not zero.
    assert norms["head"].iloc[0] == 2.0 and np.isnan(norms["head"].iloc[1])


def test_parts_by_prefix_and_list():
    run = run_with({"grad_norm/decoder/hidden/kernel": [3.0], "grad_norm/decoder/pixels/kernel": [4.0],
                    "grad_norm/decoder_extra/kernel": [100.0], "grad_norm/z_mean/kernel": [1.0]})
    norms = lab.layer_norms(run, {"decoder": "decoder", "rest": ["z_mean", "decoder_extra"]})
    # "decoder" holds decoder/..., not decoder_extra/...
    np.testing.assert_allclose(norms["decoder"], [5.0])
    np.testing.assert_allclose(norms["rest"], [np.sqrt(100.0**2 + 1.0)])


def test_parts_by_model_split_encoder_and_decoder_of_a_recorded_fit():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    encoder = keras.Model(inputs, keras.layers.Dense(2, name="code")(keras.layers.Dense(3, name="enc")(inputs)))
    decoder = keras.Sequential([keras.Input((2,)), keras.layers.Dense(4, name="out")], name="decoder")
    model = keras.Sequential([encoder, decoder])
    model.compile(optimizer="sgd", loss="mse")
    rec = lab.Recorder(gradients=True)
    x = np.random.default_rng(0).normal(size=(16, 4)).astype("float32")
    model.fit(x, x, batch_size=8, epochs=1, verbose=0, callbacks=[rec])
    norms = lab.layer_norms(rec.run, {"encoder": encoder, "decoder": decoder})
    rows = rec.run.batches()
    assert len(norms) == 2 and norms.notna().all().all()
    # Encoder and decoder together make up the global norm the run recorded.
    np.testing.assert_allclose(np.hypot(norms["encoder"], norms["decoder"]), rows["grad_norm"], rtol=1e-5)


def test_a_stepped_trace_gives_its_own_row():
    pytest.importorskip("tensorflow", reason="a TensorFlow-style step (GradientTape, the Stepper)")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="a"), keras.layers.Dense(1, name="b")])
    model.compile(optimizer="sgd", loss="mse")
    x = np.ones((8, 4), "float32")
    trace = lab.Stepper(model, (x, np.zeros((8, 1), "float32")), batch_size=8).step()
    norms = lab.layer_norms(trace)
    assert list(norms.index) == [trace.index]
    kernel, bias = trace.gradients[model.layers[1].kernel.path], trace.gradients[model.layers[1].bias.path]
    np.testing.assert_allclose(norms.filter(like="/b").iloc[0, 0],
                               np.sqrt(np.sum(kernel**2) + np.sum(bias**2)), rtol=1e-5)


def test_a_run_without_gradients_says_how_to_record_them():
    run = run_with({"accuracy": [0.5]})
    with pytest.raises(ValueError, match=r"Recorder\(gradients=True\)"):
        lab.layer_norms(run)


def test_a_part_matching_nothing_names_the_paths_the_run_has():
    run = run_with({"grad_norm/trunk/kernel": [1.0]})
    with pytest.raises(ValueError, match=r"Part 'head' matches no variable.*trunk/kernel"):
        lab.layer_norms(run, {"head": "head"})
    with pytest.raises(TypeError, match="expected a layer, a model, a path prefix"):
        lab.layer_norms(run, {"head": 3})


class _WithEMA(keras.Model):
    """keras-io's DDIM shape: an EMA copy with the trained network's variable paths."""

    def __init__(self, built=True):
        super().__init__()

        def layers():
            return ([keras.Input((3,))] if built else []) + [keras.layers.Dense(2, name="d")]
        # Declared first, so the copy's variables are `net/d/...` and the trained
        # network's `net/d/...#2`: a part's own paths cannot say which.
        self.ema_network = keras.Sequential(layers(), name="net")
        self.network = keras.Sequential(layers(), name="net")

    def train_step(self, data):
        x, y = data
        import tensorflow as tf  # a TensorFlow-style train_step (the test runs where Recorder records it)

        self.ema_network(x)
        with tf.GradientTape() as tape:
            loss = keras.ops.mean(keras.ops.square(self.network(x) - y))
        variables = self.network.trainable_variables
        self.optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
        return {"loss": loss}


def _ema_columns(kernel, bias, kernel2, bias2):
    return {"grad_norm/net/d/kernel": [kernel], "grad_norm/net/d/bias": [bias],
            "grad_norm/net/d/kernel#2": [kernel2], "grad_norm/net/d/bias#2": [bias2]}


def test_an_ema_clone_gets_its_own_norms_in_a_recorded_fit_given_the_model():
    pytest.importorskip("tensorflow", reason="a TensorFlow-style step (GradientTape, the Stepper)")
    # Built inside fit(): the run keys variables that did not exist at install.
    keras.utils.set_random_seed(0)
    model = _WithEMA(built=False)
    model.compile(optimizer="sgd")
    rec = lab.Recorder(gradients=True)
    model.fit(np.ones((8, 3), "float32"), np.zeros((8, 2), "float32"), batch_size=4, verbose=0,
              callbacks=[rec])
    norms = lab.layer_norms(rec.run, {"network": model.network, "ema": model.ema_network}, model=model)
    rows = rec.run.batches()
    assert len(norms) == 2
    # Only the network trained: its norm is the whole step's, from the `#2` columns.
    np.testing.assert_allclose(norms["network"], rows["grad_norm"], rtol=1e-5)
    np.testing.assert_allclose(norms["network"], np.hypot(rows["grad_norm/net/d/kernel#2"],
                                                          rows["grad_norm/net/d/bias#2"]), rtol=1e-5)
    assert norms["ema"].isna().all()


def test_namesakes_are_told_apart_by_position_in_the_model():
    model = _WithEMA()
    parts = {"network": model.network, "ema": model.ema_network}
    norms = lab.layer_norms(run_with(_ema_columns(np.nan, np.nan, 3.0, 4.0)), parts, model=model)
    assert norms["network"].iloc[0] == 5.0 and np.isnan(norms["ema"].iloc[0])
    norms = lab.layer_norms(run_with(_ema_columns(6.0, 8.0, 3.0, 4.0)), parts, model=model)
    assert list(norms.iloc[0]) == [5.0, 10.0]


def test_namesakes_without_the_model_raise_naming_the_paths_and_the_fix():
    model = _WithEMA()
    run = run_with(_ema_columns(np.nan, np.nan, 3.0, 4.0))
    with pytest.raises(ValueError, match=r"Part 'network' holds some, not all, of the variables named "
                                         r"'net/d/kernel', 'net/d/bias'.*model=model"):
        lab.layer_norms(run, {"network": model.network, "ema": model.ema_network})
    # A trace has no column for a variable without a gradient: the parts still show the namesakes.
    trace_row = pd.DataFrame({"grad_norm/net/d/kernel#2": [3.0], "grad_norm/net/d/bias#2": [4.0]})
    with pytest.raises(ValueError, match="model=model"):
        lab.layer_norms(trace_row, {"network": model.network, "ema": model.ema_network})
    norms = lab.layer_norms(trace_row, {"network": model.network, "ema": model.ema_network}, model=model)
    assert norms["network"].iloc[0] == 5.0 and np.isnan(norms["ema"].iloc[0])
    # A part holding every namesake, a prefix and a column's key need no model.
    norms = lab.layer_norms(run, {"all": model, "net": "net", "copy": "net/d/kernel#2"})
    assert list(norms.iloc[0]) == [5.0, 5.0, 3.0]


def test_a_model_whose_namesakes_are_no_longer_trainable_raises():
    model = _WithEMA()
    run = run_with(_ema_columns(np.nan, np.nan, 3.0, 4.0))
    model.network.trainable = False  # the EMA copy's variables would now be keyed `net/d/...#1`
    with pytest.raises(ValueError, match=r"2 keys of 'net/d/kernel'.*trainable_variables` only 1"):
        lab.layer_norms(run, {"ema": model.ema_network}, model=model)


def test_by_layer_keeps_namesake_layers_apart():
    norms = lab.layer_norms(run_with(_ema_columns(np.nan, np.nan, 3.0, 4.0)))
    assert sorted(norms.columns) == ["net/d", "net/d#2"]
    assert np.isnan(norms["net/d"].iloc[0]) and norms["net/d#2"].iloc[0] == 5.0


def test_a_part_frozen_again_after_its_fine_tuning_run_is_matched_by_its_paths():
    keras.utils.set_random_seed(0)
    base = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="b")], name="base")
    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Dense(1, name="head")(base(inputs)))
    model.compile(optimizer="sgd", loss="mse")
    rec = lab.Recorder(gradients=True)
    x = np.random.default_rng(0).normal(size=(16, 4)).astype("float32")
    model.fit(x, x[:, :1], batch_size=8, verbose=0, callbacks=[rec])
    expected = lab.layer_norms(rec.run, {"base": base})
    base.trainable = False  # the fine-tuning round is over
    np.testing.assert_array_equal(lab.layer_norms(rec.run, {"base": base}), expected)
    assert expected["base"].notna().all()
