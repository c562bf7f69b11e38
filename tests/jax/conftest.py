"""The JAX half of the engine's tests: run with Keras on JAX, where
TensorFlow is not installed (`make test-jax`), so nothing on this path can
lean on it."""

import os
import sys

os.environ["KERAS_BACKEND"] = "jax"
sys.path.insert(0, os.path.dirname(__file__))  # jax_models, shared by the test files

import pytest  # noqa: E402

try:
    import jax  # noqa: F401
except ImportError:  # the TensorFlow environment: these tests are the JAX one's
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(autouse=True)
def _seeded():
    import keras

    keras.utils.set_random_seed(0)
    yield
