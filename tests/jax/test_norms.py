"""The norms the JAX probes record: each tensor's own, whatever its shape, size
or company, and a non-finite value only in the norm of the tensor that holds it."""

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest

import lab
from lab.backend.jax import norms
from jax_models import classification_data, make_mlp

BATCH = 32


def stacked(tensors, minus=None):
    return jnp.stack(norms.sums_of_squares(tensors, minus=minus))


def expected(tensors):
    return np.asarray([np.sum(np.square(np.asarray(t, np.float64))) for t in tensors])


def mixed_tensors(rng):
    """Every path `sums_of_squares` takes: a scalar, an empty tensor, a lone
    small one, five of one size (stacked), a large one, a 4-D kernel, other dtypes."""
    tensors = [np.float32(3.0), np.zeros((0, 4), np.float32), rng.normal(size=(7,)).astype(np.float32)]
    tensors += [rng.normal(size=(16,)).astype(np.float32) for _ in range(5)]
    tensors += [rng.normal(size=(300, 300)).astype(np.float32), rng.normal(size=(3, 3, 2, 8)).astype(np.float32)]
    tensors += [jnp.asarray(rng.normal(size=(16,)), jnp.bfloat16), jnp.asarray(rng.normal(size=(5, 2)), jnp.float16)]
    return tensors


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "jit"])
def test_each_tensor_gets_its_own_sum_of_squares(compiled):
    tensors = mixed_tensors(np.random.default_rng(0))
    run = jax.jit(stacked) if compiled else stacked
    found = np.asarray(run(tensors))
    assert found.shape == (len(tensors),) and found.dtype == np.float32
    np.testing.assert_allclose(found, expected([np.asarray(t, np.float32) for t in tensors]), rtol=1e-5)
    assert norms.sums_of_squares([]) == []
    differences = np.asarray(stacked(tensors[2:], minus=[np.asarray(t, np.float32) / 2 for t in tensors[2:]]))
    np.testing.assert_allclose(differences, expected([np.asarray(t, np.float32) / 2 for t in tensors[2:]]), rtol=1e-5)


@pytest.mark.parametrize("bad", [np.inf, np.nan])
@pytest.mark.parametrize("where", [2, 4, 8])  # a lone small tensor, a stacked one, the large one
def test_a_non_finite_value_stays_in_its_own_tensors_sum(bad, where):
    tensors = mixed_tensors(np.random.default_rng(2))
    tensors[where] = np.array(tensors[where], copy=True)
    tensors[where].reshape(-1)[1] = bad
    found = np.asarray(jax.jit(stacked)(tensors))
    others = [i for i in range(len(tensors)) if i != where]
    assert np.isfinite(found[others]).all(), "a non-finite value spread to other tensors' norms"
    assert np.isnan(found[where]) if np.isnan(bad) else np.isposinf(found[where])


class WeightsAfterEachBatch(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.weights = []

    def on_train_begin(self, logs=None):
        self.weights.append([np.asarray(v) for v in self.model.trainable_variables])

    def on_train_batch_end(self, batch, logs=None):
        self.weights.append([np.asarray(v) for v in self.model.trainable_variables])


def test_weight_norms_and_update_ratios_are_those_of_each_steps_weights():
    x, y = classification_data()
    model = make_mlp()
    recorder = lab.Recorder(gradients=True, weights=True)
    seen = WeightsAfterEachBatch()
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[recorder, seen])
    rows = recorder.run.batches()
    assert len(rows) == len(seen.weights) - 1 == len(x) // BATCH
    for i, variable in enumerate(model.trainable_variables):
        before = np.asarray([w[i] for w in seen.weights[:-1]], np.float64)
        after = np.asarray([w[i] for w in seen.weights[1:]], np.float64)
        axes = tuple(range(1, after.ndim))
        weight = np.sqrt(np.sum(after ** 2, axis=axes))
        update = np.sqrt(np.sum((after - before) ** 2, axis=axes))
        np.testing.assert_allclose(rows[f"weight_norm/{variable.path}"], weight, rtol=1e-5)
        np.testing.assert_allclose(rows[f"update_ratio/{variable.path}"], update / weight, rtol=1e-3)


class SqrtScale(keras.layers.Layer):
    """y = x * sqrt(s), s starting at 0: the gradient of s is infinite (or nan
    where x is 0), every other gradient finite."""

    def build(self, input_shape):
        self.s = self.add_weight(shape=(input_shape[-1],), initializer="zeros", name="s")

    def call(self, x):
        return x * keras.ops.sqrt(self.s) + x


def test_a_non_finite_gradient_shows_in_its_own_variables_norm_only():
    x, y = classification_data()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), SqrtScale(),
                              keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.SGD(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    recorder = lab.Recorder(gradients=True)
    model.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, epochs=1, verbose=0, callbacks=[recorder])
    first = recorder.run.batches().iloc[0]
    scale = [v.path for v in model.trainable_variables if v.path.endswith("/s")][0]
    assert not np.isfinite(first[f"grad_norm/{scale}"])
    others = [v.path for v in model.trainable_variables if v.path != scale]
    assert all(np.isfinite(first[f"grad_norm/{key}"]) for key in others), first.to_dict()


def test_norms_every_runs_two_compiled_steps_and_trains_as_bare_fit():
    # fit() runs the step with the norms at steps 0, 3, 6, ... and the one
    # without at the others (steps_per_execution 2: Keras' JAX trainer
    # calls the jitted step once a step); the weights are bare fit's.
    x, y = classification_data()
    model = make_mlp(steps_per_execution=2)
    recorder = lab.Recorder(gradients=True, weights=True, norms_every=3)
    model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[recorder])
    rows = recorder.run.batches()
    assert len(rows) == 12
    assert np.flatnonzero(np.isfinite(rows["grad_norm"].to_numpy())).tolist() == [0, 3, 6, 9]
    assert recorder._probe.sampled is True and "warning" not in set(recorder.run.events()["kind"])
    bare = make_mlp(steps_per_execution=2)
    bare.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    for mine, theirs in zip(model.weights + model.optimizer.variables, bare.weights + bare.optimizer.variables):
        assert np.asarray(mine).tobytes() == np.asarray(theirs).tobytes()
    # No hook left: Keras' own make_train_function and train_step, and a
    # later plain fit() trains as bare fit's does.
    assert "make_train_function" not in vars(model) and "train_step" not in vars(model)
    from keras.src.backend.jax import trainer

    assert trainer.jit is jax.jit  # the trainer jits with its own jit again
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    bare.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    for mine, theirs in zip(model.weights, bare.weights):
        assert np.asarray(mine).tobytes() == np.asarray(theirs).tobytes()


def test_a_trainer_the_lab_cannot_sample_takes_the_norms_every_step_and_the_run_says_so(monkeypatch):
    import contextlib

    from lab.backend.jax import compat

    @contextlib.contextmanager
    def unknown_trainer(replace):
        yield False  # a Keras that jits fit()'s step without the name the lab replaces

    monkeypatch.setattr(compat, "trainer_jit", unknown_trainer)
    x, y = classification_data()
    recorder = lab.Recorder(gradients=True, norms_every=3)
    make_mlp().fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[recorder])
    rows = recorder.run.batches()
    assert np.isfinite(rows["grad_norm"].to_numpy()).all()
    assert recorder.run.metadata["norms_every"] == 1
    warnings = recorder.run.events().query("kind == 'warning'")["detail"].tolist()
    assert len(warnings) == 1 and "norms_every=3 was not applied" in warnings[0]


def test_two_threads_making_train_functions_at_once_leave_the_trainers_jit_as_it_was():
    # A norms_every recorder's make_train_function jits through the lab's
    # replacement for the trainer's `jit`. A second thread making one in the
    # meantime (a background fit beside a foreground one) waits: had it
    # taken the first's replacement for Keras' own, it would put it back
    # after the first had restored Keras' own, and leave it there.
    import threading
    import time

    from keras.src.backend.jax import trainer

    from lab.backend.jax import compat

    seen, later_may_end = [], threading.Event()

    def later():
        with compat.trainer_jit(lambda own: seen.append(own) or own):
            later_may_end.wait(5)

    with compat.trainer_jit(lambda own: (lambda *args, **kwargs: own(*args, **kwargs))):
        thread = threading.Thread(target=later)
        thread.start()
        time.sleep(0.2)
        assert seen == []  # waiting for this block
    later_may_end.set()
    thread.join(5)
    assert seen == [jax.jit] and trainer.jit is jax.jit
