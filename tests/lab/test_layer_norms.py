"""lab.layer_norms: per-variable norms combined per layer and per part of a model."""

import keras
import numpy as np
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
