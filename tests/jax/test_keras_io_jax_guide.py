"""keras-io's "Customizing what happens in `fit()` with JAX"
(guides/custom_train_step_in_jax.py), its two models as the guide writes them
(a stateless `train_step(self, state, data)`; the second also keeps its own
loss tracker and metric and overrides `metrics`), trained on the guide's
random data with a Dashboard attached: weights as bare `fit()`, rows equal
to each batch's own values, a gradient column for every variable."""

import jax
import keras
import numpy as np
import pytest

import widgets


class CustomModel(keras.Model):
    def compute_loss_and_updates(self, trainable_variables, non_trainable_variables, metrics_variables, x, y,
                                 sample_weight, training=False):
        y_pred, non_trainable_variables = self.stateless_call(
            trainable_variables, non_trainable_variables, x, training=training)
        loss, (trainable_variables, non_trainable_variables, metrics_variables) = self.stateless_compute_loss(
            trainable_variables, non_trainable_variables, metrics_variables, x=x, y=y, y_pred=y_pred,
            sample_weight=sample_weight, training=training)
        return loss, (y_pred, non_trainable_variables, metrics_variables)

    def train_step(self, state, data):
        trainable_variables, non_trainable_variables, optimizer_variables, metrics_variables = state
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        grad_fn = jax.value_and_grad(self.compute_loss_and_updates, has_aux=True)
        (loss, (y_pred, non_trainable_variables, metrics_variables)), grads = grad_fn(
            trainable_variables, non_trainable_variables, metrics_variables, x, y, sample_weight, training=True)
        trainable_variables, optimizer_variables = self.optimizer.stateless_apply(
            optimizer_variables, grads, trainable_variables)
        new_metrics_vars = []
        logs = {}
        for metric in self.metrics:
            this_metric_vars = metrics_variables[len(new_metrics_vars):len(new_metrics_vars) + len(metric.variables)]
            if metric.name == "loss":
                this_metric_vars = metric.stateless_update_state(this_metric_vars, loss, sample_weight=sample_weight)
            else:
                this_metric_vars = metric.stateless_update_state(this_metric_vars, y, y_pred,
                                                                 sample_weight=sample_weight)
            logs[metric.name] = metric.stateless_result(this_metric_vars)
            new_metrics_vars += this_metric_vars
        state = (trainable_variables, non_trainable_variables, optimizer_variables, new_metrics_vars)
        return logs, state


class LowerLevelModel(keras.Model):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.mae_metric = keras.metrics.MeanAbsoluteError(name="mae")
        self.loss_fn = keras.losses.MeanSquaredError()

    def compute_loss_and_updates(self, trainable_variables, non_trainable_variables, x, y, sample_weight,
                                 training=False):
        y_pred, non_trainable_variables = self.stateless_call(
            trainable_variables, non_trainable_variables, x, training=training)
        loss = self.loss_fn(y, y_pred, sample_weight=sample_weight)
        return loss, (y_pred, non_trainable_variables)

    def train_step(self, state, data):
        trainable_variables, non_trainable_variables, optimizer_variables, metrics_variables = state
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        grad_fn = jax.value_and_grad(self.compute_loss_and_updates, has_aux=True)
        (loss, (y_pred, non_trainable_variables)), grads = grad_fn(
            trainable_variables, non_trainable_variables, x, y, sample_weight, training=True)
        trainable_variables, optimizer_variables = self.optimizer.stateless_apply(
            optimizer_variables, grads, trainable_variables)
        loss_tracker_vars = metrics_variables[:len(self.loss_tracker.variables)]
        mae_metric_vars = metrics_variables[len(self.loss_tracker.variables):]
        loss_tracker_vars = self.loss_tracker.stateless_update_state(loss_tracker_vars, loss,
                                                                     sample_weight=sample_weight)
        mae_metric_vars = self.mae_metric.stateless_update_state(mae_metric_vars, y, y_pred,
                                                                 sample_weight=sample_weight)
        logs = {}
        logs[self.loss_tracker.name] = self.loss_tracker.stateless_result(loss_tracker_vars)
        logs[self.mae_metric.name] = self.mae_metric.stateless_result(mae_metric_vars)
        new_metrics_vars = loss_tracker_vars + mae_metric_vars
        state = (trainable_variables, non_trainable_variables, optimizer_variables, new_metrics_vars)
        return logs, state

    @property
    def metrics(self):
        return [self.loss_tracker, self.mae_metric]


def _first(seed):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input(shape=(32,))
    outputs = keras.layers.Dense(1)(inputs)
    model = CustomModel(inputs, outputs)
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    return model


def _lower_level(seed):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input(shape=(32,))
    outputs = keras.layers.Dense(1)(inputs)
    model = LowerLevelModel(inputs, outputs)
    model.compile(optimizer="adam")
    return model


@pytest.mark.parametrize("make", [_first, _lower_level], ids=["first-simple-example", "going-lower-level"])
def test_the_guides_models_train_with_a_dashboard_as_bare(make):
    rng = np.random.default_rng(0)
    x = rng.random((320, 32)).astype("float32")
    y = rng.random((320, 1)).astype("float32")
    bare = make(1)
    bare_history = bare.fit(x, y, epochs=2, shuffle=False, verbose=0).history
    model = make(1)
    dashboard = widgets.Dashboard(gradients=True, view="html")
    history = model.fit(x, y, epochs=2, shuffle=False, verbose=0, callbacks=[dashboard]).history
    assert history == bare_history
    for ours, theirs in zip(model.weights + model.optimizer.variables, bare.weights + bare.optimizer.variables):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))

    twin = make(1)
    own = []
    for start in range(0, len(x), 32):
        twin.reset_metrics()  # each batch's own values (not every Keras resets them in train_on_batch)
        twin.train_on_batch(x[start:start + 32], y[start:start + 32])
        own.append({name: float(value) for name, value in twin.get_metrics_result().items()})
    rows = dashboard.run.batches()
    assert len(rows) == 20 and list(rows["epoch"]) == [0] * 10 + [1] * 10
    np.testing.assert_allclose(rows["loss"][:10], [logs["loss"] for logs in own], rtol=1e-5)
    np.testing.assert_allclose(rows["mae"][:10], [logs["mae"] for logs in own], rtol=1e-5)
    for variable in model.trainable_variables:
        column = rows[f"grad_norm/{variable.path}"]
        assert np.isfinite(column).all() and (column > 0).all()
