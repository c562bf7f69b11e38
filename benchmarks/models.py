"""The models the overhead benchmarks time, on any Keras backend (no backend import here)."""

import keras


def make_mlp():
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(256, activation="relu"),
                             keras.layers.Dense(256, activation="relu"), keras.layers.Dense(10)])


def make_cnn():
    return keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Conv2D(16, 3, activation="relu"),
                             keras.layers.Conv2D(16, 3, activation="relu"), keras.layers.Flatten(),
                             keras.layers.Dense(10)])


def make_deep():
    """25 Dense layers, 50 variables: where per-variable statistics cost most."""
    layers = [keras.Input((64,))] + [keras.layers.Dense(64, activation="relu") for _ in range(24)]
    return keras.Sequential(layers + [keras.layers.Dense(10)])
