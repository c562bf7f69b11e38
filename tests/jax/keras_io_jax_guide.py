"""The two models of keras-io's "Customizing what happens in `fit()` with JAX"
(guides/custom_train_step_in_jax.py), as the guide writes them, shared by
the tests that train them under the lab."""

import jax
import keras


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
