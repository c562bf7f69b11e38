"""lab.Stepper.from_step on Keras' JAX backend: the stateless train_step(state, data)
of keras-io's "Writing a training loop from scratch in JAX", one batch at a time."""

import jax
import keras
import numpy as np
import pytest

import lab
from test_watch import BATCH, Guide

STEPS = 3


def mnist_arrays(steps=STEPS, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, (steps * BATCH, 784)).astype("float32")
    y = keras.utils.to_categorical(rng.integers(0, 10, steps * BATCH), 10)
    return x, y


def batches(x, y):
    return [(x[i:i + BATCH], y[i:i + BATCH]) for i in range(0, len(x), BATCH)]


class MetricGuide:
    """The guide's loop with `train_acc_metric` in the state (its "Low-level handling of metrics")."""

    def __init__(self, seed=1, jit=True):
        keras.utils.set_random_seed(seed)
        inputs = keras.Input(shape=(784,), name="digits")
        x1 = keras.layers.Dense(64, activation="relu")(inputs)
        outputs = keras.layers.Dense(10, name="predictions")(x1)
        model = keras.Model(inputs=inputs, outputs=outputs)
        optimizer = keras.optimizers.Adam(learning_rate=1e-3)
        loss_fn = keras.losses.CategoricalCrossentropy(from_logits=True)
        train_acc_metric = keras.metrics.CategoricalAccuracy()

        def compute_loss_and_updates(trainable_variables, non_trainable_variables, metric_variables, x, y):
            y_pred, non_trainable_variables = model.stateless_call(trainable_variables, non_trainable_variables, x)
            loss = loss_fn(y, y_pred)
            metric_variables = train_acc_metric.stateless_update_state(metric_variables, y, y_pred)
            return loss, (non_trainable_variables, metric_variables)

        grad_fn = jax.value_and_grad(compute_loss_and_updates, has_aux=True)

        def train_step(state, data):
            trainable_variables, non_trainable_variables, optimizer_variables, metric_variables = state
            x, y = data
            (loss, (non_trainable_variables, metric_variables)), grads = grad_fn(
                trainable_variables, non_trainable_variables, metric_variables, x, y)
            trainable_variables, optimizer_variables = optimizer.stateless_apply(
                optimizer_variables, grads, trainable_variables)
            return loss, (trainable_variables, non_trainable_variables, optimizer_variables, metric_variables)

        self.model, self.optimizer, self.metric = model, optimizer, train_acc_metric
        self.train_step = jax.jit(train_step) if jit else train_step

    def start(self):
        self.optimizer.build(self.model.trainable_variables)
        return ([v.value for v in self.model.trainable_variables],
                [v.value for v in self.model.non_trainable_variables],
                [v.value for v in self.optimizer.variables],
                [v.value for v in self.metric.variables])


def own_loop(guide, data, steps):
    """The user's own loop on the same batches: the states after each step and the losses."""
    state = guide.start()
    states, losses = [], []
    for batch in batches(*data)[:steps]:
        loss, state = guide.train_step(state, batch)
        states.append(state)
        losses.append(np.asarray(loss))
    return states, losses


def model_state(guide, metric=None):
    lists = [guide.model.trainable_variables, guide.model.non_trainable_variables, guide.optimizer.variables]
    if metric is not None:
        lists.append(metric.variables)
    return tuple([np.array(v.value) for v in variables] for variables in lists)


def assert_state(actual, expected):
    assert len(actual) == len(expected)
    for a_list, e_list in zip(actual, expected):
        assert len(a_list) == len(e_list)
        for a, e in zip(a_list, e_list):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


def hooks_of(optimizer):
    return set(vars(optimizer))


@pytest.mark.parametrize("jit", [True, False], ids=["jitted", "python"])
def test_three_steps_give_the_users_own_loop_weights_bit_for_bit(jit):
    data = mnist_arrays()
    expected, losses = own_loop(Guide(jit=jit), data, STEPS)
    guide = Guide(jit=jit)
    guide.optimizer.build(guide.model.trainable_variables)
    attributes = hooks_of(guide.optimizer)
    stepper = lab.Stepper.from_step(guide.train_step, guide.model, data, optimizers=[guide.optimizer],
                                    batch_size=BATCH, shuffle=False)
    assert stepper.mode == ("xla" if jit else "eager")
    for index in range(STEPS):
        trace = stepper.step()
        assert trace.error is None, trace.traceback
        # The model's, optimizer's variables hold the stepped state after each step.
        assert_state(model_state(guide), expected[index])
        assert trace.loss == float(losses[index])
        x, y = batches(*data)[index]
        np.testing.assert_array_equal(trace.x, x)
        np.testing.assert_array_equal(trace.y, y)
        assert trace.logs["loss"] == trace.loss
        assert set(trace.weights_after) == {v.path for v in guide.model.trainable_variables}
        for variable, array in zip(guide.model.trainable_variables, expected[index][0]):
            np.testing.assert_array_equal(trace.weights_after[variable.path], np.asarray(array))
        assert trace.y_pred.shape == (BATCH, 10)
    assert hooks_of(guide.optimizer) == attributes  # no wrapper left on the optimizer
    assert [t.index for t in stepper.traces] == [0, 1, 2]


def test_gradients_are_those_the_optimizer_applied():
    data = mnist_arrays()
    guide = Guide()
    stepper = lab.Stepper.from_step(guide.train_step, guide.model, data, optimizers=guide.optimizer,
                                    batch_size=BATCH, shuffle=False)
    state = ([v.value for v in guide.model.trainable_variables], [v.value for v in guide.model.non_trainable_variables])
    (_, _), grads = guide.grad_fn(*state, *batches(*data)[0])
    trace = stepper.step()
    assert list(trace.gradients) == [v.path for v in guide.model.trainable_variables]
    for variable, grad in zip(guide.model.trainable_variables, grads):
        np.testing.assert_allclose(trace.gradients[variable.path], np.asarray(grad), rtol=1e-5, atol=1e-6)
    assert trace.row["grad_norm"] > 0
    assert trace.row["learning_rate"] == pytest.approx(1e-3)
    for key, before in trace.weights_before.items():
        assert not np.array_equal(before, trace.weights_after[key])


def test_rewind_is_bit_exact_and_replays_the_same_steps():
    data = mnist_arrays()
    guide = Guide()
    stepper = lab.Stepper.from_step(guide.train_step, guide.model, data, optimizers=[guide.optimizer],
                                    batch_size=BATCH, shuffle=False)
    start = model_state(guide)
    stepper.step()
    after_one = model_state(guide)
    stepper.step(2)
    after_three = model_state(guide)
    stepper.rewind(2)
    assert_state(model_state(guide), after_one)
    assert stepper.next_index == 1 and len(stepper.traces) == 1
    with_replay = stepper.step(2)
    assert with_replay.batch == 2
    assert_state(model_state(guide), after_three)
    stepper.rewind(3)
    assert_state(model_state(guide), start)
    with pytest.raises(ValueError):
        stepper.rewind()


def test_metric_variables_are_the_fourth_element_of_the_state():
    data = mnist_arrays()
    guide = MetricGuide()
    expected, losses = own_loop(guide, data, STEPS)
    guide = MetricGuide()
    stepper = lab.Stepper.from_step(guide.train_step, guide.model, data, optimizers=[guide.optimizer],
                                    metrics=[guide.metric], batch_size=BATCH, shuffle=False)
    traces = [stepper.step() for _ in range(STEPS)]
    for index, trace in enumerate(traces):
        assert trace.error is None, trace.traceback
        assert trace.loss == float(losses[index])
    assert_state(model_state(guide, guide.metric), expected[-1])
    assert guide.metric.result() == pytest.approx(float(traces[-1].logs[guide.metric.name]))
    # The row holds the batch's own accuracy (read off the change of total and count).
    assert 0.0 <= traces[-1].row[guide.metric.name] <= 1.0
    stepper.rewind(1)
    assert_state(model_state(guide, guide.metric), expected[-2])


def test_aux_logs_go_into_the_row():
    data = mnist_arrays()
    guide = Guide()

    @jax.jit
    def step(state, data):
        loss, state = guide.train_step(state, data)
        return (loss, {"double": 2 * loss}), state

    # The update runs inside guide.train_step's own jax.jit: its gradients cannot come out, and it says so.
    with pytest.warns(RuntimeWarning, match="inside a jax.jit"):
        stepper = lab.Stepper.from_step(step, guide.model, data, optimizers=[guide.optimizer],
                                        batch_size=BATCH, shuffle=False)
    trace = stepper.step()
    assert trace.error is None, trace.traceback
    assert trace.row["double"] == pytest.approx(2 * trace.loss)
    assert trace.gradients == {}


def test_a_step_of_the_wrong_shape_is_a_type_error():
    data = mnist_arrays()
    guide = Guide()
    make = lambda fn, **kw: lab.Stepper.from_step(fn, guide.model, data, optimizers=[guide.optimizer], **kw)  # noqa: E731

    with pytest.raises(TypeError, match="step_fn\\(state, data\\)"):
        make(42)

    def tf_style(x, y):
        return 0.0

    with pytest.raises(TypeError, match="TensorFlow"):
        make(tf_style)

    with pytest.raises(TypeError, match="cannot be called with"):
        make(lambda state: state)

    with pytest.raises(TypeError, match="not \\(loss, state\\)"):
        make(jax.jit(lambda state, data: guide.train_step.__wrapped__(state, data)[0]))

    with pytest.raises(TypeError, match="returned a tuple of 2 as the state"):
        make(lambda state, data: (0.0, state[:2]))

    with pytest.raises(TypeError, match="order it went in"):
        make(lambda state, data: (0.0, (state[0][::-1], state[1], state[2])))

    # A step that unpacks metric_variables from a state that has none: said with the fix.
    metric_guide = MetricGuide()
    with pytest.raises(ValueError, match="metrics="):
        lab.Stepper.from_step(metric_guide.train_step, metric_guide.model, data, optimizers=[metric_guide.optimizer])
    assert "_backend_update_step" not in vars(guide.optimizer)  # nothing left wrapped


def test_needs_one_optimizer():
    guide = Guide()
    data = mnist_arrays()
    with pytest.raises(ValueError, match="optimizers=\\[optimizer\\]"):
        lab.Stepper.from_step(guide.train_step, guide.model, data)
    with pytest.raises(ValueError, match="one optimizer"):
        lab.Stepper.from_step(guide.train_step, guide.model, data,
                              optimizers=[guide.optimizer, keras.optimizers.SGD()])
