"""On JAX: errors Keras leaves bare get the lab's words where the lab is given the input (the Stepper,
compare_modes), and the Stepper's arguments are checked at construction."""

import jax
import keras
import numpy as np
import pytest

import lab
from jax_models import classification_data, make_mlp as mlp

X, Y = classification_data(n=32)


class ReturnsNoLogs(keras.Model):
    """A stateless train_step that returns the loss (or None) where fit() reads a dict of logs."""

    def __init__(self, returns):
        super().__init__()
        self.dense = keras.layers.Dense(3)
        self.returns = returns

    def call(self, inputs):
        return self.dense(inputs)

    def train_step(self, state, data):
        trainable, non_trainable, optimizer_variables, metrics_variables = state
        x, y = data

        def loss_of(trainable):
            y_pred, _ = self.stateless_call(trainable, non_trainable, x)
            loss, _ = self.stateless_compute_loss(trainable, non_trainable, metrics_variables, x=x, y=y,
                                                  y_pred=y_pred)
            return loss

        loss, grads = jax.value_and_grad(loss_of)(trainable)
        trainable, optimizer_variables = self.optimizer.stateless_apply(optimizer_variables, grads, trainable)
        returned = loss if self.returns == "loss" else None
        return returned, (trainable, non_trainable, optimizer_variables, metrics_variables)


@pytest.mark.parametrize("returns, described", [("loss", "a tensor of shape ()"), (None, "None")])
def test_the_stepper_fails_a_train_step_returning_no_logs_as_fit_would(returns, described):
    keras.utils.set_random_seed(0)
    model = ReturnsNoLogs(returns)
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    stepper = lab.Stepper(model, (X, Y), batch_size=8, shuffle=False)
    before = [w.copy() for w in model.get_weights()]
    trace = stepper.step()
    assert isinstance(trace.error, TypeError)
    assert f"train_step returned {described}, not a dict of logs" in str(trace.error)
    assert 'return {"loss": loss}' in str(trace.error) and trace.hint == ""
    for old, new in zip(before, model.get_weights()):
        np.testing.assert_array_equal(old, new)


@pytest.mark.parametrize("arguments, error, named", [
    ({"seed": "0"}, TypeError, "seed=...) must be a whole number"),
    ({"run": "run"}, TypeError, "run=...) must be a lab.Run"),
    ({"start_step": -1}, ValueError, "start_step=...) must be a whole number, 0 or more"),
    ({"start_batch": 3}, TypeError, "start_batch=...) must be a pair (epoch, batch)"),
])
def test_the_stepper_refuses_bad_arguments_at_construction(arguments, error, named):
    with pytest.raises(error) as caught:
        lab.Stepper(mlp(), (X, Y), **arguments)
    assert named in str(caught.value)


CASES = [
    ((X, Y, Y, Y), "data is a tuple of 4", "pass (x, y) or (x, y, sample_weight)"),
    (X, "The data has no targets y", "(x, y)"),
    ((X, Y + 5), "y holds class labels from 5 to 7, but the model outputs 3 classes", "Dense(8)"),
    ((np.array(["a"] * 32), Y), "x is an array of dtype <U1, which fit() refuses", "np.asarray(array, 'float32')"),
    ((X, list(Y)), "y is a Python list of 32 numbers", "np.asarray(y)"),
]


@pytest.mark.parametrize("data, named, fix", CASES)
def test_the_stepper_names_arrays_fit_would_fail_on_at_construction(data, named, fix):
    with pytest.raises(ValueError) as caught:
        lab.Stepper(mlp(), data, batch_size=8)
    message = str(caught.value)
    assert message.startswith("lab.Stepper: ") and named in message and "Fix: " in message and fix in message


@pytest.mark.parametrize("data, named, fix", CASES)
def test_compare_modes_names_arrays_fit_would_fail_on_at_the_call(data, named, fix):
    # Labels out of range give no error at all on JAX: the losses would just be wrong.
    with pytest.raises(ValueError) as caught:
        lab.compare_modes(mlp(), data, steps=4)
    message = str(caught.value)
    assert message.startswith("lab.compare_modes: ") and named in message and fix in message


def test_a_recorder_given_the_model_says_fit_hands_it_over():
    with pytest.raises(TypeError, match=r"takes no model.*callbacks=\[lab.Recorder\(\)\]"):
        lab.Recorder(mlp())


@pytest.mark.parametrize("returns", ["loss", "none"])
def test_fit_with_a_train_step_returning_no_logs_says_what_it_returned_and_the_fix(returns):
    from lab.step_logs import LOGS_FIX

    bare = ReturnsNoLogs(returns)
    bare.compile(keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    # Keras reads a step's logs at once where a callback needs each batch's
    # end, and otherwise on a thread pool, where which read fails first is a
    # race: with such a callback in both fits, the errors are like for like.
    with pytest.raises(Exception) as bare_error:
        bare.fit(X, Y, batch_size=8, verbose=0, callbacks=[_BatchEnds()])
    model = ReturnsNoLogs(returns)
    model.compile(keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    recorder = lab.Recorder()
    with pytest.raises(type(bare_error.value)) as caught:  # Keras' own error, its type kept
        model.fit(X, Y, batch_size=8, verbose=0, callbacks=[recorder, _BatchEnds()])
    returned = "a tensor of shape ()" if returns == "loss" else "None"
    note = "\n".join(getattr(caught.value, "__notes__", []))
    assert f"train_step returned {returned}, not a dict of logs" in note and LOGS_FIX in note
    error = recorder.run.events().query("kind == 'error'")["detail"].iloc[-1]
    assert f"train_step returned {returned}" in error and LOGS_FIX in error
    assert recorder.status == "failed"


@pytest.mark.parametrize("returns", ["loss", "none"])
def test_no_logs_read_on_kerass_thread_pool_get_the_same_words(returns):
    # The lab alone lets Keras read the logs on its pool: whichever of
    # Keras' reads fails first, the error gains the lab's words.
    from lab.step_logs import LOGS_FIX

    model = ReturnsNoLogs(returns)
    model.compile(keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    recorder = lab.Recorder()
    with pytest.raises((AttributeError, TypeError)) as caught:
        model.fit(X, Y, batch_size=8, verbose=0, callbacks=[recorder])
    assert LOGS_FIX in "\n".join(getattr(caught.value, "__notes__", []))
    assert recorder.status == "failed" and model.train_step.__func__ is type(model).train_step


class _BatchEnds(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        pass
