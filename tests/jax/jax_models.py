"""Small models and data the JAX tests train."""

import keras
import numpy as np


def classification_data(n=192, features=8, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype("float32")
    y = rng.integers(0, classes, n).astype("int32")
    return x, y


def make_mlp(optimizer=None, seed=0, metrics=("accuracy",), steps_per_execution=1):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(3)])
    model.compile(optimizer=optimizer or keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=list(metrics), steps_per_execution=steps_per_execution)
    return model


def values(variables):
    return [np.asarray(v) for v in variables]


def assert_same(a, b):
    a, b = values(a), values(b)
    assert len(a) == len(b)
    for left, right in zip(a, b):
        np.testing.assert_array_equal(left, right)


def batch_losses(make, x, y, batch_size):
    """Each batch's own loss and accuracy: a twin trained by `train_on_batch`
    on the same batches in order, its metrics reset before each."""
    twin = make()
    losses, accuracies = [], []
    for start in range(0, len(x), batch_size):
        twin.reset_metrics()
        logs = twin.train_on_batch(x[start:start + batch_size], y[start:start + batch_size], return_dict=True)
        losses.append(logs["loss"])
        accuracies.append(logs.get("accuracy", np.nan))
    return np.asarray(losses, np.float32), np.asarray(accuracies, np.float32), twin


def named_mlp(seed=0):
    """The MLP with names of its own, so its variables have the same paths on every backend."""
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu", name="hidden"),
                              keras.layers.Dense(3, name="out")], name="mlp")
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model
