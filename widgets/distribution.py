"""The distribution a model trains under, carried to where the widgets act.

Keras keeps the `keras.distribution` in effect (JAX's data parallelism) per
thread, and a `with distribution.scope():` block ends with its cell, while
widgets act later: on the training thread of a `BackgroundFit`, or on a
button click. So a widget takes the distribution in effect where it is made
(`current()`) and acts under it (`scope(...)`). A TensorFlow strategy
travels with the model itself; its scope is harmless to enter again.
"""

import contextlib

import keras


def current():
    """The `keras.distribution` in effect on this thread, or None."""
    return keras.distribution.distribution()


def scope(distribution):
    """`distribution.scope()` (a `keras.distribution` or a `tf.distribute`
    strategy), or a block that does nothing for None."""
    return distribution.scope() if distribution is not None else contextlib.nullcontext()
