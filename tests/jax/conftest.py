"""The JAX half of the engine's tests: run with Keras on JAX, where
TensorFlow is not installed (`make test-jax`), so nothing on this path can
lean on it."""

import importlib.util
import os
import sys

import pytest

if importlib.util.find_spec("jax") is None:  # the TensorFlow environment: these tests are the JAX one's
    collect_ignore_glob = ["test_*.py"]
else:
    os.environ["KERAS_BACKEND"] = "jax"
    sys.path.insert(0, os.path.dirname(__file__))  # jax_models, shared by the test files


@pytest.fixture(autouse=True)
def _seeded():
    import keras

    keras.utils.set_random_seed(0)
    yield
