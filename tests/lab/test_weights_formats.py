"""Keras 3 weight formats: round trips, wrong shapes, safe_mode."""

import warnings

import keras
import numpy as np
import pytest

import lab


def mlp(hidden=3, outputs=1, extra=False, compile=True):
    layers = [keras.Input((4,)), keras.layers.Dense(hidden, name="hidden"),
              keras.layers.BatchNormalization(name="norm"), keras.layers.Dense(outputs, name="out")]
    if extra:
        layers.append(keras.layers.Dense(2, name="extra"))
    model = keras.Sequential(layers)
    if compile:
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


@pytest.fixture(scope="module")
def x():
    return np.random.default_rng(0).normal(size=(16, 4)).astype("float32")


@pytest.fixture(scope="module")
def trained(x):
    model = mlp()
    model.fit(x, np.ones((16, 1), "float32"), batch_size=8, epochs=2, verbose=0)
    return model


def test_weights_h5_round_trip_with_optimizer_state(tmp_path, trained, x):
    path = tmp_path / "model.weights.h5"
    trained.save_weights(path)
    fresh = mlp()
    # Optimizer state is only read into a built optimizer (else: a warning).
    fresh.optimizer.build(fresh.trainable_variables)
    fresh.load_weights(path)
    np.testing.assert_array_equal(fresh.predict(x, verbose=0), trained.predict(x, verbose=0))
    assert int(fresh.optimizer.iterations) == int(trained.optimizer.iterations) == 4
    for a, b in zip(fresh.optimizer.variables, trained.optimizer.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_save_weights_insists_on_the_weights_h5_suffix(tmp_path, trained):
    with pytest.raises(ValueError, match=r"\.weights\.h5"):
        trained.save_weights(tmp_path / "model.h5")


def test_keras_file_round_trip_keeps_architecture_compile_and_state(tmp_path, trained, x):
    path = tmp_path / "model.keras"
    trained.save(path)
    loaded = keras.models.load_model(path)
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), trained.predict(x, verbose=0))
    assert [layer.name for layer in loaded.layers] == ["hidden", "norm", "out"]
    assert isinstance(loaded.optimizer, keras.optimizers.Adam)
    assert int(loaded.optimizer.iterations) == 4
    loaded.fit(x, np.ones((16, 1), "float32"), verbose=0)  # trains on, compiled


@pytest.mark.parametrize("suffix", [".weights.h5", ".keras"])
def test_a_wrong_shape_names_the_layer_and_checked_loading_changes_nothing(tmp_path, trained, suffix):
    path = tmp_path / f"model{suffix}"
    trained.save_weights(path) if suffix == ".weights.h5" else trained.save(path)
    wider = mlp(outputs=2)
    # Keras names the layer and shapes, but has already loaded the layers that fit.
    with pytest.raises(ValueError, match=r"(?s)name=out.*\(3, 2\).*\(3, 1\)"):
        wider.load_weights(path)
    np.testing.assert_array_equal(wider.get_layer("hidden").kernel.numpy(),
                                  trained.get_layer("hidden").kernel.numpy())

    wider = mlp(outputs=2)
    before = [w.copy() for w in wider.get_weights()]
    with pytest.raises(ValueError, match=r"(?s)name=out.*Nothing was loaded"):
        lab.load_weights_checked(wider, path)
    for a, b in zip(before, wider.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_a_file_from_a_bigger_model_is_refused_not_silently_half_used(tmp_path, x):
    bigger = mlp(extra=True)
    path = tmp_path / "bigger.weights.h5"
    bigger.save_weights(path)
    smaller = mlp()
    smaller.load_weights(path)  # what Keras does: no error, "extra" ignored
    smaller = mlp()
    before = [w.copy() for w in smaller.get_weights()]
    with pytest.raises(ValueError, match=r"(?s)bigger model.*layers/dense_2.*unchanged"):
        lab.load_weights_checked(smaller, path)
    for a, b in zip(before, smaller.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_checked_loading_of_a_matching_file_loads_it_optimizer_state_included(tmp_path, trained, x):
    path = tmp_path / "model.weights.h5"
    trained.save_weights(path)
    fresh = mlp()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # Keras warns when it skips optimizer state
        lab.load_weights_checked(fresh, path)
    np.testing.assert_array_equal(fresh.predict(x, verbose=0), trained.predict(x, verbose=0))
    assert int(fresh.optimizer.iterations) == 4
    with pytest.raises(FileNotFoundError, match="absent"):
        lab.load_weights_checked(fresh, tmp_path / "absent.weights.h5")


def test_safe_mode_refuses_a_lambda_with_arbitrary_code(tmp_path, x):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Lambda(lambda v: v * 2)])
    path = tmp_path / "lambda.keras"
    model.save(path)
    with pytest.raises(ValueError, match="(?s)Lambda.*(arbitrary code|unsafe).*safe_mode=False"):
        keras.models.load_model(path)
    # Only an explicit opt-out runs the stored bytecode.
    unsafe = keras.models.load_model(path, safe_mode=False)
    np.testing.assert_allclose(unsafe.predict(x, verbose=0), 2 * x)
