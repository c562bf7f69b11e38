"""Keras' own metrics in a Recorder's rows.

Users compile whichever metrics their task needs. For a binary and a
three-class classifier compiled with most of `keras.metrics`, fit twice from
the same weights, bare and with `lab.Recorder()`:

- the History and the weights are bare fit()'s;
- every value Keras logs has its column(s): a number one column, a vector
  (F1Score with `average=None`: one value per class) one column per element,
  `<name>/<index>`;
- a mean metric's column holds each batch's own value (a fit that resets the
  metrics at every batch logs it), any other metric's (AUC, Precision,
  RootMeanSquaredError, whose result is the root of its mean) Keras' running
  value, and the run lists exactly those as running values;
- the epoch table holds every number History holds, vectors by element;
- a Stepper's rows hold the same columns.
"""

import keras
import numpy as np
import pytest

import lab
from lab import schema
from lab.metric_names import is_mean, leaf_metrics

M = keras.metrics


def binary_metrics():
    return [M.AUC(name="auc"), M.AUC(curve="PR", name="pr_auc"), M.Precision(name="precision"),
            M.Recall(name="recall"), M.PrecisionAtRecall(0.5, name="precision_at_recall"),
            M.SensitivityAtSpecificity(0.5, name="sensitivity"), M.TruePositives(name="tp"),
            M.BinaryIoU(name="iou"), M.BinaryAccuracy(name="accuracy"), M.R2Score(name="r2"),
            M.KLDivergence(name="kl"), M.CosineSimilarity(name="cosine"), M.LogCoshError(name="logcosh"),
            M.Poisson(name="poisson"), M.MeanSquaredLogarithmicError(name="msle"), M.Hinge(name="hinge"),
            M.SquaredHinge(name="squared_hinge"), M.RootMeanSquaredError(name="rmse"),
            M.BinaryCrossentropy(name="bce")]


def categorical_metrics():
    return [M.F1Score(name="f1"), M.F1Score(average="macro", name="f1_macro"),
            M.FBetaScore(beta=2.0, average="weighted", name="f2"), M.CategoricalAccuracy(name="accuracy"),
            M.TopKCategoricalAccuracy(k=2, name="top2"), M.AUC(multi_label=True, num_labels=3, name="auc"),
            M.OneHotIoU(num_classes=3, target_class_ids=[0, 2], name="iou"), M.RootMeanSquaredError(name="rmse"),
            M.CategoricalCrossentropy(name="cce"), M.MeanAbsoluteError(name="mae")]


TASKS = {
    "binary": (binary_metrics, "binary_crossentropy", 1, "sigmoid"),
    "categorical": (categorical_metrics, "categorical_crossentropy", 3, "softmax"),
}


def data(task):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 8)).astype("float32")
    if task == "binary":
        return x, (x[:, 0] + 0.3 * x[:, 1] > 0).astype("float32")[:, None]
    return x, np.eye(3, dtype="float32")[(x[:, 0] > 0).astype(int) + (x[:, 1] > 1)]


def make(task):
    metrics, loss, outputs, activation = TASKS[task]
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(outputs, activation=activation)])
    model.compile("adam", loss, metrics=metrics())
    return model


class BatchLogs(keras.callbacks.Callback):
    """Keras' logs at each batch's end; with `reset`, of that batch alone."""

    def __init__(self, reset=False):
        super().__init__()
        self.reset, self.rows = reset, []

    def on_train_batch_begin(self, batch, logs=None):
        if self.reset:
            self.model.reset_metrics()

    def on_train_batch_end(self, batch, logs=None):
        self.rows.append(dict(logs))


def columns(logs):
    return dict(pair for key, value in logs.items() for pair in schema.number_columns(key, value))


def arrays(history):
    """A History's values as NumPy (Keras 3.5 keeps a vector as a tensor)."""
    return {key: [np.asarray(value) for value in values] for key, values in history.items()}


def fitted(task, callbacks):
    model = make(task)
    history = model.fit(*data(task), batch_size=16, epochs=2, shuffle=False, verbose=0, callbacks=callbacks).history
    return model, history


@pytest.fixture(scope="module", params=list(TASKS))
def runs(request):
    task = request.param
    running, own, recorder = BatchLogs(), BatchLogs(reset=True), lab.Recorder()
    bare, bare_history = fitted(task, [running])
    fitted(task, [own])
    model, history = fitted(task, [recorder])
    return task, bare, bare_history, running, own, model, history, recorder


def test_the_history_and_weights_are_bare_fits(runs):
    task, bare, bare_history, _, _, model, history, _ = runs
    np.testing.assert_equal(arrays(history), arrays(bare_history))
    assert all(np.array_equal(a.numpy(), b.numpy()) for a, b in zip(model.weights, bare.weights))


def test_every_logged_value_has_its_columns_own_for_means_running_for_the_rest(runs):
    task, bare, _, running, own, model, _, recorder = runs
    rows = recorder.run.batches()
    means = {name for name, metric in leaf_metrics(model).items() if is_mean(metric)}
    expected_running = set()
    for key in running.rows[0]:
        keras_running = [columns({key: r[key]}) for r in running.rows]
        keras_own = [columns({key: r[key]}) for r in own.rows]
        assert keras_running[0], f"{key} is logged as neither a number nor a short vector"
        for column in keras_running[0]:
            assert column in rows, f"{column} is missing from the rows"
            expected = keras_own if key in means or key == "loss" else keras_running
            if expected is keras_running:
                expected_running.add(column)
            np.testing.assert_allclose(rows[column], [e[column] for e in expected], rtol=2e-6,
                                       err_msg=f"{column}: not the {'own' if expected is keras_own else 'running'} value")
    assert "rmse" in expected_running  # a Mean whose result is the root of its mean
    if task == "categorical":
        assert {"f1/0", "f1/1", "f1/2"} <= expected_running  # F1Score(average=None): one value per class
    assert set(recorder.run.metadata[schema.RUNNING_VALUES]) == expected_running


def test_the_epoch_table_holds_every_number_of_the_history(runs):
    _, _, bare_history, _, _, _, _, recorder = runs
    epochs = recorder.run.epochs()
    for key, values in bare_history.items():
        for epoch, value in enumerate(values):
            for column, number in columns({key: value}).items():
                assert epochs[column].iloc[epoch] == pytest.approx(number, rel=1e-6)


def test_a_steppers_rows_hold_the_same_columns(runs):
    task, _, _, _, _, _, _, recorder = runs
    stepper = lab.Stepper(make(task), data(task), batch_size=16, shuffle=False, mode="graph")
    trace = stepper.step(2)
    assert trace.error is None
    recorded = {c for c in recorder.run.batches() if not c.startswith(("seconds", "mode", "updated"))}
    stepped = set(trace.row) if hasattr(trace, "row") else set(stepper.run.batches())
    assert recorded <= stepped | {"step", "epoch", "batch"}, recorded - stepped
