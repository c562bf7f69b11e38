"""Keras' own losses, and the ways compile() combines them, with the lab attached.

Users compile whichever loss their task needs: one of `keras.losses` by
class or by name, with a reduction of their choice, a function of their own
or a `keras.losses.Loss` subclass; sample weights in the data or
`class_weight=` in fit(); a model with several outputs and a loss (and a
weight) for each, a layer's `add_loss`, a float64 loss or a mixed-precision
policy (whose compile() wraps the optimizer in a LossScaleOptimizer). For
each case, a small model is fit from the same weights bare and with
`lab.Recorder(gradients=True, weights=True)`, and stepped by a graph
`lab.Stepper`:

- the History, every weight and every optimizer variable are bare fit()'s,
  bit for bit;
- the rows' `loss` (and each output's `<name>_loss`, where Keras logs one)
  is the batch's own value, as a fit() that resets its metrics at every
  batch logs it, and its running mean over the epoch is the value Keras
  logs; the epoch table holds History's values;
- the Stepper's four steps end with the state of fit()'s first epoch, and
  its rows' losses are fit()'s per-batch losses.
"""

import keras
import numpy as np
import pytest

import lab

L = keras.losses
BATCHES, BATCH = 4, 16
N = BATCHES * BATCH


# ---- data ----------------------------------------------------------------------------------------

def features(shape=(8,)):
    return np.random.default_rng(0).normal(size=(N, *shape)).astype("float32")


def targets(kind, x):
    rng = np.random.default_rng(1)
    label = (x[:, 0] > 0).astype("int32") + (x[:, 1] > 1)
    if kind == "regression":
        return (np.abs(x[:, :1] + 0.5 * x[:, 1:2]) + 0.5).astype("float32")
    if kind == "binary":
        return (x[:, :1] + 0.3 * x[:, 1:2] > 0).astype("float32")
    if kind == "signed":
        return np.where(x[:, :1] > 0, 1.0, -1.0).astype("float32")
    if kind == "onehot":
        return np.eye(3, dtype="float32")[label]
    if kind == "sparse":
        return label
    if kind == "ignored":  # a quarter of the labels are -1, the class to ignore
        return np.where(np.arange(N) % 4 == 3, -1, label).astype("int32")
    if kind == "distribution":
        logits = rng.normal(size=(N, 3))
        return (np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)).astype("float32")
    if kind == "vector":
        return (x[:, :3] + 0.1).astype("float32")
    if kind == "sequence":  # CTC: labels 1..4, 0 is the mask/blank
        return rng.integers(1, 5, size=(N, 3)).astype("int32")
    raise ValueError(kind)


# ---- single-output cases ---------------------------------------------------------------------------

# name -> (loss factory, target kind, output units, output activation, fit extras)
SINGLE = {
    "MeanSquaredError": (lambda: L.MeanSquaredError(), "regression", 1, None),
    "MeanAbsoluteError": (lambda: L.MeanAbsoluteError(), "regression", 1, None),
    "MeanAbsolutePercentageError": (lambda: L.MeanAbsolutePercentageError(), "regression", 1, "softplus"),
    "MeanSquaredLogarithmicError": (lambda: L.MeanSquaredLogarithmicError(), "regression", 1, "softplus"),
    "Huber": (lambda: L.Huber(delta=0.5), "regression", 1, None),
    "LogCosh": (lambda: L.LogCosh(), "regression", 1, None),
    "Poisson": (lambda: L.Poisson(), "regression", 1, "softplus"),
    "CosineSimilarity": (lambda: L.CosineSimilarity(), "vector", 3, None),
    "BinaryCrossentropy": (lambda: L.BinaryCrossentropy(), "binary", 1, "sigmoid"),
    "BinaryCrossentropy/logits": (lambda: L.BinaryCrossentropy(from_logits=True), "binary", 1, None),
    "BinaryCrossentropy/smoothing": (lambda: L.BinaryCrossentropy(from_logits=True, label_smoothing=0.1),
                                     "binary", 1, None),
    "BinaryFocalCrossentropy": (lambda: L.BinaryFocalCrossentropy(apply_class_balancing=True, gamma=2.0),
                                "binary", 1, "sigmoid"),
    "CategoricalCrossentropy": (lambda: L.CategoricalCrossentropy(label_smoothing=0.1), "onehot", 3, "softmax"),
    "CategoricalCrossentropy/logits": (lambda: L.CategoricalCrossentropy(from_logits=True), "onehot", 3, None),
    "CategoricalFocalCrossentropy": (lambda: L.CategoricalFocalCrossentropy(), "onehot", 3, "softmax"),
    "SparseCategoricalCrossentropy": (lambda: L.SparseCategoricalCrossentropy(from_logits=True), "sparse", 3, None),
    "SparseCategoricalCrossentropy/ignore_class": (
        lambda: L.SparseCategoricalCrossentropy(from_logits=True, ignore_class=-1), "ignored", 3, None),
    "KLDivergence": (lambda: L.KLDivergence(), "distribution", 3, "softmax"),
    "Hinge": (lambda: L.Hinge(), "signed", 1, "tanh"),
    "SquaredHinge": (lambda: L.SquaredHinge(), "signed", 1, "tanh"),
    "CategoricalHinge": (lambda: L.CategoricalHinge(), "onehot", 3, None),
    "Tversky": (lambda: L.Tversky(alpha=0.3, beta=0.7), "binary", 1, "sigmoid"),
    "Dice": (lambda: L.Dice(), "binary", 1, "sigmoid"),
    "CTC": (lambda: L.CTC(), "sequence", 5, "softmax"),
    "Circle": (lambda: L.Circle(gamma=8), "sparse", 4, "unit"),
    "CategoricalGeneralizedCrossEntropy": (lambda: L.CategoricalGeneralizedCrossEntropy(q=0.5),
                                           "sparse", 3, "softmax"),
    # reductions
    "reduction/sum": (lambda: L.MeanSquaredError(reduction="sum"), "regression", 1, None),
    "reduction/sum_over_batch_size": (lambda: L.Huber(reduction="sum_over_batch_size"), "regression", 1, None),
    "reduction/mean": (lambda: L.CategoricalCrossentropy(reduction="mean"), "onehot", 3, "softmax"),
    "reduction/mean_with_sample_weight": (lambda: L.MeanSquaredError(reduction="mean_with_sample_weight"),
                                          "regression", 1, None),
    "reduction/None": (lambda: L.MeanSquaredError(reduction=None), "regression", 1, None),
    # how the loss is given
    "string": (lambda: "binary_crossentropy", "binary", 1, "sigmoid"),
    "function": (lambda: my_loss, "regression", 1, None),
    "subclass": (lambda: MyLoss(), "regression", 1, None),
    "dtype/float64": (lambda: L.MeanSquaredError(dtype="float64"), "regression", 1, None),
}
# The losses and reductions of later Keras versions than the oldest supported.
LATER = {"Circle": "Circle", "CategoricalGeneralizedCrossEntropy": "CategoricalGeneralizedCrossEntropy"}
LATER_REDUCTIONS = {"reduction/mean": "mean", "reduction/mean_with_sample_weight": "mean_with_sample_weight"}


def my_loss(y_true, y_pred):
    return keras.ops.mean(keras.ops.square(y_true - y_pred) + 0.1 * keras.ops.abs(y_true - y_pred), axis=-1)


class MyLoss(L.Loss):
    def call(self, y_true, y_pred):
        return keras.ops.mean(keras.ops.abs(y_true - y_pred) ** 1.5, axis=-1)


def reduction_allowed(reduction):
    try:
        L.MeanSquaredError(reduction=reduction)
    except ValueError:
        return False
    return True


def single_params():
    params = []
    for name in SINGLE:
        marks = []
        if name in LATER and not hasattr(L, LATER[name]):
            marks.append(pytest.mark.skip(reason=f"keras.losses.{LATER[name]} is newer than Keras {keras.__version__}"))
        if name in LATER_REDUCTIONS and not reduction_allowed(LATER_REDUCTIONS[name]):
            marks.append(pytest.mark.skip(reason=f"reduction={LATER_REDUCTIONS[name]!r} is newer than "
                                                 f"Keras {keras.__version__}"))
        params.append(pytest.param(name, marks=marks))
    return params


def single(name, sample_weight=False, class_weight=False):
    """A case: (make, data, fit extras) for a one-output model."""
    loss, kind, units, activation = SINGLE[name]
    sequence = kind == "sequence"
    x = features((6, 8) if sequence else (8,))
    y = targets(kind, x)

    def make():
        keras.utils.set_random_seed(3)
        layers = [keras.Input(x.shape[1:]), keras.layers.Dense(8, activation="relu"),
                  keras.layers.Dense(units, activation=None if activation == "unit" else activation)]
        if activation == "unit":
            layers.append(keras.layers.UnitNormalization())
        model = keras.Sequential(layers)
        model.compile(keras.optimizers.Adam(0.01), loss())
        return model

    data = (x, y)
    if sample_weight:
        data = (x, y, np.linspace(0.0, 2.0, N).astype("float32"))
    extras = {"class_weight": {0: 0.5, 1: 2.0, 2: 1.0}} if class_weight else {}
    return make, data, extras


# ---- the checks ------------------------------------------------------------------------------------

class BatchLogs(keras.callbacks.Callback):
    """Keras' logs at each batch's end; with `reset`, of that batch alone."""

    def __init__(self, reset=False):
        super().__init__()
        self.reset, self.rows = reset, []

    def on_train_batch_begin(self, batch, logs=None):
        if self.reset:
            self.model.reset_metrics()

    def on_train_batch_end(self, batch, logs=None):
        self.rows.append({key: float(value) for key, value in logs.items()})


def state(model):
    return [v.numpy().tobytes() for v in model.weights + model.optimizer.variables]


def fitted(make, data, extras, callbacks=(), epochs=2):
    model = make()
    history = model.fit(*data, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0,
                        callbacks=list(callbacks), **extras).history
    return model, history


def losses_of(logs):
    return [key for key in logs if key == "loss" or key.endswith("_loss")]


def check_fit(make, data, extras):
    """Bare fit() and a recorded one: same History and state; the rows hold
    each batch's own losses, whose running mean is what Keras logs."""
    running = BatchLogs()
    bare, bare_history = fitted(make, data, extras, [running])
    recorder = lab.Recorder(gradients=True, weights=True)
    model, history = fitted(make, data, extras, [recorder])
    assert history == bare_history
    assert state(model) == state(bare), "the recorded fit() parted from bare fit()'s weights"
    rows = recorder.run.batches()
    assert len(rows) == 2 * BATCHES
    keys = losses_of(running.rows[0])
    assert not set(keys) & set(recorder.run.metadata.get(lab.schema.RUNNING_VALUES, [])), "a loss is a running value"
    for key in keys:
        assert key in rows, f"{key} is missing from the rows"
        values = rows[key].to_numpy(np.float64)
        logged = np.array([r[key] for r in running.rows])
        first = np.arange(2 * BATCHES) % BATCHES == 0
        np.testing.assert_array_equal(values[first], logged[first], err_msg=f"{key}: a first batch's loss is not Keras'")
        mean = np.concatenate([np.cumsum(v) / np.arange(1, BATCHES + 1) for v in values.reshape(2, BATCHES)])
        np.testing.assert_allclose(mean, logged, rtol=2e-6, err_msg=f"{key}: the rows' running mean is not Keras'")
    epochs = recorder.run.epochs()
    for key, values in bare_history.items():
        assert list(epochs[key]) == pytest.approx(values, rel=1e-6), key
    return recorder


def check_stepper(make, data, extras):
    """A graph Stepper's steps end where fit()'s first epoch ends, each
    step's losses those of a fit() that resets its metrics at every batch."""
    own = BatchLogs(reset=True)
    reference, _ = fitted(make, data, extras, [own], epochs=1)
    model = make()
    run = lab.Run()
    stepper = lab.Stepper(model, data, batch_size=BATCH, shuffle=False, mode="graph", run=run)
    trace = stepper.step(BATCHES)
    assert trace.error is None, trace.traceback
    assert state(model) == state(reference), "the Stepper parted from fit()'s weights"
    rows = run.batches()
    for key in losses_of(own.rows[0]):
        assert key in rows, f"{key} is missing from the Stepper's rows"
        np.testing.assert_array_equal(rows[key].to_numpy(np.float64), [r[key] for r in own.rows],
                                      err_msg=f"{key}: not fit()'s per-batch value")


@pytest.mark.parametrize("name", single_params())
def test_each_keras_loss_trains_as_bare_fit_and_its_rows_hold_each_batchs_loss(name):
    check_fit(*single(name))


@pytest.mark.parametrize("name", single_params())
def test_each_keras_loss_steps_as_fit(name):
    check_stepper(*single(name))
