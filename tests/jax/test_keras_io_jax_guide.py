"""keras-io's "Customizing what happens in `fit()` with JAX"
(guides/custom_train_step_in_jax.py), its two models as the guide writes them
(a stateless `train_step(self, state, data)`; the second also keeps its own
loss tracker and metric and overrides `metrics`), trained on the guide's
random data with a Dashboard attached: weights as bare `fit()`, rows equal
to each batch's own values, a gradient column for every variable."""

import keras
import numpy as np
import pytest

import widgets
from keras_io_jax_guide import CustomModel, LowerLevelModel


def _first(seed):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input(shape=(32,))
    outputs = keras.layers.Dense(1)(inputs)
    model = CustomModel(inputs, outputs)
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    return model


def _lower_level(seed):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input(shape=(32,))
    outputs = keras.layers.Dense(1)(inputs)
    model = LowerLevelModel(inputs, outputs)
    model.compile(optimizer="adam")
    return model


@pytest.mark.parametrize("make", [_first, _lower_level], ids=["first-simple-example", "going-lower-level"])
def test_the_guides_models_train_with_a_dashboard_as_bare(make):
    rng = np.random.default_rng(0)
    x = rng.random((320, 32)).astype("float32")
    y = rng.random((320, 1)).astype("float32")
    bare = make(1)
    bare_history = bare.fit(x, y, epochs=2, shuffle=False, verbose=0).history
    model = make(1)
    dashboard = widgets.Dashboard(gradients=True, view="html")
    history = model.fit(x, y, epochs=2, shuffle=False, verbose=0, callbacks=[dashboard]).history
    assert history == bare_history
    for ours, theirs in zip(model.weights + model.optimizer.variables, bare.weights + bare.optimizer.variables):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))

    twin = make(1)
    own = []
    for start in range(0, len(x), 32):
        twin.reset_metrics()  # each batch's own values (not every Keras resets them in train_on_batch)
        twin.train_on_batch(x[start:start + 32], y[start:start + 32])
        own.append({name: float(value) for name, value in twin.get_metrics_result().items()})
    rows = dashboard.run.batches()
    assert len(rows) == 20 and list(rows["epoch"]) == [0] * 10 + [1] * 10
    np.testing.assert_allclose(rows["loss"][:10], [logs["loss"] for logs in own], rtol=1e-5)
    np.testing.assert_allclose(rows["mae"][:10], [logs["mae"] for logs in own], rtol=1e-5)
    for variable in model.trainable_variables:
        column = rows[f"grad_norm/{variable.path}"]
        assert np.isfinite(column).all() and (column > 0).all()
