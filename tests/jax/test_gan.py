"""A GAN with its own JAX `train_step` and two optimizers, trained by `fit()`
with a Dashboard attached (tests/jax/jax_gan.py: keras-io's DCGAN written
for Keras' JAX backend, the state fit() carries holding both optimizers'
variables): training exactly as bare, each batch's own losses, a gradient
column for every variable each optimizer updated, and the optimizers as
without the lab afterwards."""

import h5py
import jax.numpy as jnp
import keras
import numpy as np
import pytest

import lab
import widgets
from jax_gan import GAN, make_gan
from jax_models import assert_same

BATCH = 16


def _images(n=64, seed=0):
    return np.random.default_rng(seed).random((n, 12)).astype("float32")


def _own_losses(x, epochs):
    """Each batch's own d_loss and g_loss: a twin trained by train_on_batch on
    the same batches in order, its trackers reset before each."""
    twin = make_gan()
    rows = []
    for _ in range(epochs):
        for start in range(0, len(x), BATCH):
            twin.reset_metrics()
            logs = twin.train_on_batch(x[start:start + BATCH], return_dict=True)
            rows.append((logs["d_loss"], logs["g_loss"]))
    return np.asarray(rows, np.float32), twin


def test_a_gan_with_two_optimizers_trains_with_a_dashboard_as_bare():
    x = _images()
    bare = make_gan()
    bare_history = bare.fit(x, batch_size=BATCH, epochs=2, shuffle=False, verbose=0).history
    gan = make_gan()
    dashboard = widgets.Dashboard(gradients=True, weights=True, view="html")
    history = gan.fit(x, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[dashboard]).history

    assert history == bare_history
    assert_same(gan.weights, bare.weights)
    assert_same(gan.d_optimizer.variables, bare.d_optimizer.variables)
    assert_same(gan.g_optimizer.variables, bare.g_optimizer.variables)
    own, twin = _own_losses(x, epochs=2)
    assert_same(twin.weights, bare.weights)  # the twin's batches are fit()'s

    rows = dashboard.run.batches()
    assert len(rows) == 2 * len(x) // BATCH
    np.testing.assert_allclose(rows["d_loss"], own[:, 0], rtol=1e-6)
    np.testing.assert_allclose(rows["g_loss"], own[:, 1], rtol=1e-6)
    for variable in gan.trainable_variables:
        column = rows[f"grad_norm/{variable.path}"]
        assert np.isfinite(column).all() and (column > 0).all(), variable.path
    assert (rows["learning_rate/d_optimizer"] == np.float32(3e-3)).all()
    assert (rows["learning_rate/g_optimizer"] == np.float32(3e-3)).all()
    assert (rows["updated/d_optimizer"] == 1).all() and (rows["updated/g_optimizer"] == 1).all()
    assert dashboard.status == "finished"


def test_the_gans_optimizers_are_as_without_the_lab_afterwards(tmp_path):
    x = _images()
    gan, bare = make_gan(), make_gan()
    gan.fit(x, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[lab.Recorder(gradients=True)])
    bare.fit(x, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    for mine, theirs in [(gan.d_optimizer, bare.d_optimizer), (gan.g_optimizer, bare.g_optimizer),
                         (gan.optimizer, bare.optimizer)]:
        assert [v.shape for v in mine.variables] == [v.shape for v in theirs.variables]
        assert not any(v.name.startswith("lab_") for v in mine.variables)
    gan.save_weights(tmp_path / "gan.weights.h5")
    bare.save_weights(tmp_path / "bare.weights.h5")
    with h5py.File(tmp_path / "gan.weights.h5") as saved, h5py.File(tmp_path / "bare.weights.h5") as expected:
        assert _datasets(saved) == _datasets(expected)
    # A later plain fit() trains on as after a bare one.
    gan.fit(x, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    bare.fit(x, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert_same(gan.weights, bare.weights)
    assert_same(gan.g_optimizer.variables, bare.g_optimizer.variables)


def test_nonfinite_stops_a_gan_before_its_bad_update():
    x = _images()
    bad = 2
    x[bad * BATCH + 3, 4] = np.nan
    bare = make_gan()
    bare.fit(x[:bad * BATCH], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    gan = make_gan()
    recorder = lab.Recorder(gradients=True, breakpoints=[lab.breakpoints.nonfinite()])
    gan.fit(x, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[recorder])
    assert_same(gan.trainable_variables, bare.trainable_variables)
    assert_same(gan.d_optimizer.variables, bare.d_optimizer.variables)
    assert_same(gan.g_optimizer.variables, bare.g_optimizer.variables)
    events = recorder.run.events()
    assert list(events[events["kind"] == "nonfinite"]["step"]) == [bad]
    assert recorder.status == "stopped"


class _CopiedState(GAN):
    """Carries copies of its optimizers' values: the lab cannot tell whose they are."""

    def _get_jax_state(self, *args, **kwargs):
        state = super()._get_jax_state(*args, **kwargs)
        return tuple([jnp.array(v) for v in part] for part in state)


def test_a_state_the_lab_cannot_place_its_rows_in_gets_a_clear_error_before_training():
    keras.utils.set_random_seed(0)
    gan = _CopiedState(keras.Sequential([keras.Input((12,)), keras.layers.Dense(1)]),
                       keras.Sequential([keras.Input((8,)), keras.layers.Dense(12)]), 8)
    gan.compile(keras.optimizers.Adam(), keras.optimizers.Adam(), keras.losses.BinaryCrossentropy(from_logits=True))
    gan.build()
    before = [np.asarray(v) for v in gan.weights]
    with pytest.raises(TypeError, match="nowhere to keep each step's row.*_get_jax_state.*lab.watch"):
        gan.fit(_images(), batch_size=BATCH, epochs=1, verbose=0, callbacks=[lab.Recorder()])
    assert_same(gan.weights, before)
    assert not any("lab_" in v.name for o in (gan.d_optimizer, gan.g_optimizer, gan.optimizer) for v in o.variables)


def _datasets(store):
    """Each dataset's name and values in an HDF5 file, as comparable lists."""
    found = []
    store.visititems(lambda name, item: found.append((name, item[()].tolist()))
                     if isinstance(item, h5py.Dataset) else None)
    return found
