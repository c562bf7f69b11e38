"""lab.Recorder and widgets.Dashboard in fit() on Keras' JAX backend."""

import importlib.util
import subprocess
import sys
import warnings

import keras
import numpy as np
import pytest

import lab
from jax_models import assert_same, batch_losses, classification_data, make_mlp

BATCH = 32


def test_this_environment_has_no_tensorflow():
    # What the JAX half proves holds only where TensorFlow cannot be imported.
    assert importlib.util.find_spec("tensorflow") is None
    assert keras.config.backend() == "jax"


def test_the_lab_its_views_and_a_recorded_fit_import_no_tensorflow():
    script = (
        "import os, sys; os.environ['KERAS_BACKEND'] = 'jax'\n"
        "import numpy as np, keras, lab, widgets\n"
        "m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]); m.compile('adam', 'mse')\n"
        "d = widgets.Dashboard(gradients=True, view='html')\n"
        "m.fit(np.zeros((64, 4), 'f4'), np.zeros((64, 2), 'f4'), epochs=1, verbose=0, callbacks=[d])\n"
        "print(len(d.run), sorted(n for n in sys.modules if n.split('.')[0] == 'tensorflow'))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-2:] == ["2", "[]"]


@pytest.mark.parametrize("steps_per_execution", [1, 4])
def test_rows_hold_each_batchs_own_values_and_training_is_as_bare(steps_per_execution):
    x, y = classification_data()
    make = lambda: make_mlp(steps_per_execution=steps_per_execution)  # noqa: E731
    own_loss, own_accuracy, twin = batch_losses(lambda: make_mlp(), x, y, BATCH)
    bare = make()
    bare_history = bare.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0).history
    model = make()
    recorder = lab.Recorder(gradients=True)
    history = model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[recorder]).history
    rows = recorder.run.batches()
    assert list(rows["step"]) == list(range(len(x) // BATCH))
    assert list(rows["batch"]) == list(range(len(x) // BATCH))
    np.testing.assert_allclose(rows["loss"], own_loss, rtol=2e-6)
    np.testing.assert_allclose(rows["accuracy"], own_accuracy, rtol=2e-6)
    assert (rows["mode"] == "xla").all() and (rows["seconds"] > 0).all()
    assert history == bare_history
    assert_same(model.weights, bare.weights)
    assert_same(model.weights, twin.weights)
    assert_same(model.optimizer.variables, bare.optimizer.variables)
    assert rows["loss"].iloc[-1] != pytest.approx(history["loss"][-1]), "a batch's own loss, not the epoch mean"


def test_the_model_afterwards_is_as_if_the_lab_had_never_been_there(tmp_path):
    x, y = classification_data()
    bare, model = make_mlp(), make_mlp()
    bare.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
              callbacks=[lab.Recorder(gradients=True, weights=True)])
    assert "train_step" not in vars(model)
    assert not [name for name in vars(model.optimizer) if name.startswith("_backend_update_step")]
    assert [v.shape for v in model.optimizer.variables] == [v.shape for v in bare.optimizer.variables]
    model.save_weights(tmp_path / "m.weights.h5")
    clean = make_mlp()
    clean.optimizer.build(clean.trainable_variables)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        clean.load_weights(tmp_path / "m.weights.h5")
    assert_same(clean.optimizer.variables, bare.optimizer.variables)
    # A later fit() without the lab trains as the bare model's.
    bare.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert_same(model.weights, bare.weights)
    assert_same(model.optimizer.variables, bare.optimizer.variables)


def test_a_checkpoint_written_during_fit_holds_only_the_optimizers_own_state(tmp_path):
    x, y = classification_data()
    model = make_mlp()
    saved = str(tmp_path / "ckpt.weights.h5")
    checkpoint = keras.callbacks.ModelCheckpoint(saved, save_weights_only=True, save_freq=3)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=[lab.Recorder(gradients=True), checkpoint])
    clean = make_mlp()
    clean.optimizer.build(clean.trainable_variables)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        clean.load_weights(saved)


def test_gradient_norms_are_those_the_optimizer_applied_after_clipping():
    x, y = classification_data()
    rate, clip = 0.1, 0.05
    model = make_mlp(optimizer=keras.optimizers.SGD(rate, clipnorm=clip))
    recorder = lab.Recorder(gradients=True, weights=True)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[recorder])
    rows = recorder.run.batches()
    keys = [v.path for v in model.trainable_variables]
    assert {f"grad_norm/{k}" for k in keys} <= set(rows.columns)
    for key in keys:
        applied = rows[f"grad_norm/{key}"].to_numpy()
        assert (applied <= clip * (1 + 1e-5)).all(), "clipped, as applied"
        # Plain SGD moves each weight by rate * gradient.
        moved = rows[f"update_ratio/{key}"] * rows[f"weight_norm/{key}"]
        np.testing.assert_allclose(moved / rate, applied, rtol=1e-3, atol=1e-7)
    total = np.sqrt(sum(rows[f"grad_norm/{k}"].astype(float) ** 2 for k in keys))
    np.testing.assert_allclose(rows["grad_norm"], total, rtol=1e-6)


def test_the_learning_rate_is_the_one_each_step_used():
    x, y = classification_data()
    schedule = keras.optimizers.schedules.PiecewiseConstantDecay([2, 4], [0.1, 0.01, 0.001])
    model = make_mlp(optimizer=keras.optimizers.SGD(schedule))
    recorder = lab.Recorder()
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[recorder])
    np.testing.assert_allclose(recorder.run.batches()["learning_rate"], [0.1, 0.1, 0.1, 0.01, 0.01, 0.001],
                               rtol=1e-6)


@pytest.mark.parametrize("steps_per_execution, bad", [(1, 3), (3, 4)])
def test_nonfinite_keeps_the_bad_update_out_and_stops_fit(steps_per_execution, bad):
    x, y = classification_data()
    x[bad * BATCH + 5, 2] = np.nan
    bare = make_mlp(steps_per_execution=steps_per_execution)
    bare.fit(x[:bad * BATCH], y[:bad * BATCH], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    model = make_mlp(steps_per_execution=steps_per_execution)
    recorder = lab.Recorder(breakpoints=[lab.breakpoints.nonfinite()], gradients=True)
    model.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0, callbacks=[recorder])
    assert_same(model.weights, bare.weights)
    assert_same(model.optimizer.variables, bare.optimizer.variables)
    assert int(model.optimizer.iterations) == bad
    rows = recorder.run.batches()
    assert list(rows["updated"][:bad]) == [1.0] * bad and (rows["updated"][bad:] == 0).all()
    assert np.isnan(rows["loss"][bad])
    events = recorder.run.events()
    hit = events[events["kind"] == "nonfinite"]
    assert list(hit["step"]) == [bad] and "nonfinite" in hit["detail"].iloc[0]
    assert recorder.status == "stopped"
    assert len(recorder.run.epochs()) == 0 or recorder.run.epochs()["epoch"].max() == 0


def test_loss_spike_stops_before_the_spiking_update():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(20 * 16, 4)).astype("float32")
    y = (x @ rng.normal(size=(4, 1))).astype("float32")
    y[15 * 16:16 * 16] *= 1000.0
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.01), "mse")
    before = []
    recorder = lab.Recorder(breakpoints=[lab.breakpoints.loss_spike(5.0, warmup=5)])
    keep = keras.callbacks.LambdaCallback(on_train_batch_begin=lambda b, logs: None)
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[recorder, keep])
    events = recorder.run.events()
    assert list(events[events["kind"] == "breakpoint"]["step"]) == [15]
    assert int(model.optimizer.iterations) == 15
    del before


def test_a_python_breakpoint_stops_after_its_batch():
    x, y = classification_data()
    model = make_mlp()
    recorder = lab.Recorder(breakpoints=[lab.Breakpoint(lambda row: row["step"] >= 2, name="third")])
    model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[recorder])
    assert len(recorder.run) == 3 and int(model.optimizer.iterations) == 3
    assert recorder.status == "stopped"


class _Interrupt(keras.callbacks.Callback):
    def __init__(self, at, error):
        super().__init__()
        self.at, self.error = at, error

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.at:
            raise self.error


@pytest.mark.parametrize("error", [KeyboardInterrupt(), RuntimeError("a callback failed")], ids=["ctrl-c", "error"])
def test_an_interrupt_anywhere_leaves_no_hook_and_keeps_the_rows(error):
    x, y = classification_data()
    model = make_mlp()
    recorder = lab.Recorder(gradients=True)
    with pytest.raises(type(error)):
        model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                  callbacks=[recorder, _Interrupt(2, error)])
    assert "train_step" not in vars(model) and "finalize_variable_values" not in vars(model.optimizer)
    assert len(model.optimizer.variables) == 2 + 2 * len(model.trainable_variables)  # Adam's own
    assert not any("lab_ring" in v.path for v in model.optimizer.variables)
    assert len(recorder.run) == 3
    kinds = list(recorder.run.events()["kind"])
    assert ("interrupt" if isinstance(error, KeyboardInterrupt) else "error") in kinds
    # The model trains on, recorded again, from where it stopped.
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[recorder])
    assert list(recorder.run.batches()["step"]) == list(range(3 + 6))


def test_one_recorder_serves_several_fits_and_the_run_saves_and_loads(tmp_path):
    x, y = classification_data()
    model = make_mlp()
    recorder = lab.Recorder(gradients=True, path=str(tmp_path / "run.h5"))
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[recorder])
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[recorder])
    assert list(recorder.run.batches()["step"]) == list(range(12))
    loaded = lab.Run.load(str(tmp_path / "run.h5"))
    assert loaded.metadata["backend"] == "jax"
    np.testing.assert_array_equal(loaded.batches()["loss"], recorder.run.batches()["loss"])
    both = lab.compare({"a": loaded, "b": recorder.run})
    assert set(both["run"]) == {"a", "b"}


def test_the_dashboard_records_what_the_recorder_does():
    import widgets

    x, y = classification_data()
    model, twin = make_mlp(), make_mlp()
    dashboard = widgets.Dashboard(gradients=True, view="html")
    recorder = lab.Recorder(gradients=True)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[dashboard])
    twin.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[recorder])
    shown, recorded = dashboard.run.batches(), recorder.run.batches()
    assert [c.split("/")[0] for c in shown.columns] == [c.split("/")[0] for c in recorded.columns]
    np.testing.assert_array_equal(shown["loss"], recorded["loss"])
    np.testing.assert_array_equal(shown["grad_norm"], recorded["grad_norm"])
    assert dashboard.status == "finished"


def test_a_name_a_backend_does_not_have_says_so_when_used_not_at_import():
    from lab.backend.unavailable import placeholder

    missing = placeholder("inspect_data", "JAX")  # what lab.inspect_data was on JAX before it ran here
    with pytest.raises(NotImplementedError, match="lab.inspect_data does not run on Keras' JAX backend yet.*TensorFlow"):
        missing(*classification_data(), model=make_mlp())


def test_with_gradient_accumulation_every_batch_keeps_its_row_and_training_is_as_bare():
    # Keras rolls the optimizer's variables back on the steps that only
    # accumulate; the rows are written after that, so none is lost.
    x, y = classification_data()
    make = lambda: make_mlp(optimizer=keras.optimizers.Adam(1e-2, gradient_accumulation_steps=2))  # noqa: E731
    bare, model = make(), make()
    bare.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    recorder = lab.Recorder(gradients=True)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[recorder])
    assert_same(model.weights, bare.weights)
    assert_same(model.optimizer.variables, bare.optimizer.variables)
    rows = recorder.run.batches()
    assert list(rows["step"]) == list(range(6)) and np.isfinite(rows["grad_norm"]).all()


def test_gradient_norms_under_loss_scaling_are_the_unscaled_ones():
    x, y = classification_data()
    plain, scaled = lab.Recorder(gradients=True), lab.Recorder(gradients=True)
    make_mlp(optimizer=keras.optimizers.SGD(0.1)).fit(
        x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[plain])
    make_mlp(optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=2.0**10)).fit(
        x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[scaled])
    np.testing.assert_allclose(scaled.run.batches()["grad_norm"], plain.run.batches()["grad_norm"], rtol=1e-4)


def test_eager_steps_are_recorded_as_compiled_ones():
    x, y = classification_data()
    compiled, eager = make_mlp(), make_mlp()
    eager.run_eagerly = True
    ours, theirs = lab.Recorder(gradients=True), lab.Recorder(gradients=True)
    compiled.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[ours])
    eager.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[theirs])
    rows = theirs.run.batches()
    assert (rows["mode"] == "eager").all()
    np.testing.assert_allclose(rows["loss"], ours.run.batches()["loss"], rtol=1e-5)
    np.testing.assert_allclose(rows["grad_norm"], ours.run.batches()["grad_norm"], rtol=1e-5)
    assert "train_step" not in vars(eager)


def test_nonfinite_with_loss_scaling_stops_at_a_nan_batch():
    # A LossScaleOptimizer applies inside a `lax.cond` (only finite steps):
    # its gradients reach the row through its own state.
    x, y = classification_data()
    x[100, 0] = np.nan
    model = make_mlp(optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1)))
    recorder = lab.Recorder(gradients=True, breakpoints=[lab.breakpoints.nonfinite()])
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[recorder])
    rows = recorder.run.batches()
    events = recorder.run.events()
    assert list(events[events["kind"] == "nonfinite"]["step"]) == [3]
    assert rows["updated"].tolist() == [1.0, 1.0, 1.0, 0.0]
    assert np.isfinite(rows["grad_norm"][:3]).all() and np.isnan(rows["grad_norm"][3])
    assert int(model.optimizer.inner_optimizer.iterations) == 3


def test_without_keras_backend_set_the_error_names_the_installed_backend(tmp_path):
    # Keras starts on TensorFlow unless told otherwise; here only JAX is installed.
    env = {k: v for k, v in __import__("os").environ.items() if k != "KERAS_BACKEND"}
    env["KERAS_HOME"] = str(tmp_path)
    done = subprocess.run([sys.executable, "-c", "import lab"], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=120)
    assert done.returncode != 0
    assert "set KERAS_BACKEND='jax' before importing keras" in done.stderr.splitlines()[-1]
