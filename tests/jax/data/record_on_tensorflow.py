"""Writes `mlp_tensorflow.h5`: a run recorded on Keras' TensorFlow backend,
which the JAX tests load and compare with the same model recorded on JAX.

Run it with the TensorFlow environment when the row schema changes:
    .venv/bin/python tests/jax/data/record_on_tensorflow.py
"""

import os
import pathlib
import sys

os.environ["KERAS_BACKEND"] = "tensorflow"
sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))

import lab  # noqa: E402
from jax_models import classification_data, named_mlp  # noqa: E402

x, y = classification_data()
recorder = lab.Recorder(gradients=True, weights=True)
named_mlp().fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0, validation_split=0.25,
                callbacks=[recorder])
recorder.run.save(pathlib.Path(__file__).with_name("mlp_tensorflow.h5"))
