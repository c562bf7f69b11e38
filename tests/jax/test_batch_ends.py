"""Keras on JAX ends batches on a thread pool, without waiting for a step's
logs, unless a callback needs them at once. A recorder without breakpoints
keeps that pipeline (`async_safe`): its rows, their timing and Keras' running
values come out as when Keras waits for it, and a Dashboard draws on fit()'s
thread only."""

import threading
import time

import keras
import numpy as np
import pytest

import lab
from jax_models import assert_same, classification_data, make_mlp

BATCH = 32


class BatchEndThreads(keras.callbacks.Callback):
    """Notes the thread each batch end runs on; needs no logs at once, so it
    leaves Keras' choice to the other callbacks."""

    async_safe = True

    def __init__(self, watched=None):
        super().__init__()
        self.threads = []
        self.rows_seen = []
        self.watched = watched

    def on_train_batch_end(self, batch, logs=None):
        self.threads.append(threading.get_ident())
        if self.watched is not None:
            self.rows_seen.append(len(self.watched.run))


class WaitsForLogs(keras.callbacks.Callback):
    """A callback that needs each batch's logs at once (as ProgbarLogger
    does): Keras then ends every batch on fit()'s thread."""

    def __init__(self):
        super().__init__()
        self.logs = []

    def on_train_batch_end(self, batch, logs=None):
        self.logs.append((batch, dict(logs)))


def binary_data(n=192, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype("float32")
    return x, (x[:, 0] + 0.5 * rng.normal(size=n) > 0).astype("float32")


def binary_model(steps_per_execution=1):
    """Metrics that are no mean (AUC, Precision): the rows keep Keras' running values."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(1, activation="sigmoid")])
    model.compile(keras.optimizers.Adam(1e-2), "binary_crossentropy",
                  metrics=[keras.metrics.AUC(name="auc"), keras.metrics.Precision(name="precision")],
                  steps_per_execution=steps_per_execution)
    return model


@pytest.mark.parametrize("make", ["recorder", "dashboard"])
def test_without_breakpoints_keras_ends_batches_on_its_pool(make):
    import widgets

    x, y = classification_data(n=640)
    model = make_mlp()
    callback = lab.Recorder(gradients=True) if make == "recorder" else widgets.Dashboard(gradients=True, view="html")
    spy = BatchEndThreads()
    began = time.perf_counter()
    model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[callback, spy])
    took = time.perf_counter() - began
    assert callback.async_safe
    assert threading.get_ident() not in set(spy.threads), "Keras waited for each batch's logs"
    rows = callback.run.batches()
    steps = len(x) // BATCH
    assert list(rows["step"]) == list(range(2 * steps))
    assert list(rows["batch"]) == list(range(steps)) * 2 and list(rows["epoch"]) == [0] * steps + [1] * steps
    assert (rows["seconds"] > 0).all() and rows["seconds"].sum() <= took
    assert rows["grad_norm"].notna().all()


def test_with_breakpoints_keras_waits_for_the_recorder():
    x, y = classification_data()
    spy = BatchEndThreads()
    recorder = lab.Recorder(breakpoints=[lab.breakpoints.nonfinite()])
    make_mlp().fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[recorder, spy])
    assert not recorder.async_safe
    assert set(spy.threads) == {threading.get_ident()}


def test_rows_arrive_while_fit_runs_not_only_at_its_end():
    x, y = classification_data(n=3200)
    recorder = lab.Recorder(flush_every=0.001)
    spy = BatchEndThreads(watched=recorder)
    make_mlp().fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[recorder, spy])
    assert 0 < max(spy.rows_seen[:-1]) < len(x) // BATCH
    assert len(recorder.run) == len(x) // BATCH


@pytest.mark.parametrize("steps_per_execution", [1, 4])
def test_running_values_are_keras_own_at_each_executions_last_step(steps_per_execution):
    # 192 samples, batch 32: 6 steps; at 4 a step the second execution is a partial one.
    x, y = binary_data()
    waited = binary_model(steps_per_execution)
    logs = WaitsForLogs()
    bare_history = waited.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[logs]).history
    model = binary_model(steps_per_execution)
    recorder = lab.Recorder()
    spy = BatchEndThreads()
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                        callbacks=[recorder, spy]).history
    assert threading.get_ident() not in set(spy.threads)
    assert history == bare_history
    assert_same(model.weights, waited.weights)
    rows = recorder.run.batches()
    assert len(rows) == 12
    ends = [6 * epoch + min(batch, 5) for epoch in range(2) for batch, _ in logs.logs[epoch * len(logs.logs) // 2:
                                                                                      (epoch + 1) * len(logs.logs) // 2]]
    assert len(ends) == len(logs.logs) == 2 * -(-6 // steps_per_execution)
    for name in ("auc", "precision"):
        expected = np.full(12, np.nan, np.float32)
        expected[ends] = [values[name] for _, values in logs.logs]
        np.testing.assert_array_equal(rows[name].to_numpy(np.float32), expected)
    assert sorted(recorder.run.metadata["running_values"]) == ["auc", "precision"]
    assert (recorder.run.events()["kind"] == "running_value").sum() == 2


def test_the_dashboard_draws_on_fits_thread_only():
    import widgets

    x, y = classification_data(n=1600)
    dashboard = widgets.Dashboard(view="html", refresh_every=0.001, refresh_budget=1.0)
    drawn_on = []
    draw = dashboard.refresh

    progress = []

    def refresh(*args, **kwargs):
        drawn_on.append(threading.get_ident())
        progress.append(dashboard.progress_text())
        return draw(*args, **kwargs)

    dashboard.refresh = refresh
    make_mlp().fit(x, y, batch_size=BATCH, epochs=2, verbose=0, callbacks=[dashboard, BatchEndThreads()])
    assert len(drawn_on) > 3 and set(drawn_on) == {threading.get_ident()}
    # After the first drawing (at fit()'s begin), the progress line is never blank.
    assert all(progress[1:]), progress
    assert dashboard.status == "finished" and len(dashboard.run) == 2 * (len(x) // BATCH)
