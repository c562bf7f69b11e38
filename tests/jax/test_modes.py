"""Modes on JAX: eager (train_step as Python) and xla (jax.jit), switched
between batches of a running fit(); "graph" refused; compare_modes leaves the
model as it was; the ModeSwitch widget."""

import keras
import numpy as np
import pytest

import lab
from jax_models import assert_same, classification_data, make_mlp, values

BATCH = 32


def test_graph_and_unknown_modes_are_refused_naming_the_modes_jax_has():
    model = make_mlp()
    with pytest.raises(ValueError, match="'graph' is TensorFlow's.*'eager'.*'xla'"):
        lab.set_mode(model, "graph")
    with pytest.raises(ValueError, match="Unknown mode 'fast'.*'eager', 'xla'"):
        lab.set_mode(model, "fast")
    with pytest.raises(ValueError, match="'graph' is TensorFlow's"):
        lab.ModeSwitcher({0: "graph"})
    uncompiled = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    with pytest.raises(ValueError, match="not compiled"):
        lab.set_mode(uncompiled, "eager")


def test_a_switch_mid_fit_keeps_training_as_bare_and_rows_carry_their_mode():
    x, y = classification_data()
    bare, model = make_mlp(), make_mlp()
    bare.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
             callbacks=[lab.ModeSwitcher({2: "eager", 4: "xla"})])
    recorder = lab.Recorder(gradients=True)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=[recorder, lab.ModeSwitcher({2: "eager", 4: "xla"})])
    rows = recorder.run.batches()
    assert rows["mode"].tolist() == ["xla", "xla", "eager", "eager", "xla", "xla"]
    events = recorder.run.events()
    assert events[events["kind"] == "mode"][["step", "detail"]].values.tolist() == [
        [2, "xla -> eager"], [4, "eager -> xla"]]
    assert_same(model.weights, bare.weights)
    assert_same(model.optimizer.variables, bare.optimizer.variables)
    assert np.isfinite(rows["grad_norm"]).all()


def test_switching_back_to_xla_reuses_the_compiled_function():
    model = make_mlp()
    x, y = classification_data()
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    compiled = model.train_function
    assert lab.set_mode(model, "eager") == "xla"
    assert model.run_eagerly and lab.modes.running_mode(model) == "eager"
    lab.set_mode(model, "xla")
    assert model.train_function is compiled
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)


def test_compare_modes_times_both_and_leaves_the_model_bit_for_bit():
    x, y = classification_data()
    model = make_mlp()
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    before = values(model.weights + model.optimizer.variables + model.metrics_variables)
    frame = lab.compare_modes(model, (x, y), steps=6, batch_size=BATCH)
    assert frame["mode"].tolist() == ["eager", "xla"]
    assert frame["error"].isna().all() and (frame["step_ms"] > 0).all()
    assert frame.loc[frame["mode"] == "xla", "traces"].item() == 1
    assert frame["max_loss_diff"].max() < 1e-5
    assert "model" in frame.attrs["bottleneck"] or "data" in frame.attrs["bottleneck"]
    after = values(model.weights + model.optimizer.variables + model.metrics_variables)
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)
    # and the next fit trains as it would have
    twin = make_mlp()
    twin.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    twin.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert_same(model.weights, twin.weights)


def test_the_mode_switch_widget_offers_jax_modes_and_switches():
    import widgets

    x, y = classification_data()
    model = make_mlp()
    switch = widgets.ModeSwitch(model, data=(x, y), steps=4)
    assert [value for _, value in switch.toggle.options] == ["eager", "xla"]
    switch.toggle.value = "eager"
    assert model.run_eagerly
    frame = switch.compare()
    assert frame is not None and frame["error"].isna().all()
    assert "Bottleneck" in switch.status.value


def test_a_mode_listener_that_raises_is_reported_and_removed_and_the_switch_stands():
    model = make_mlp()
    calls = []

    def broken(switched, mode):
        calls.append(mode)
        raise RuntimeError("a view broke")

    lab.modes.add_mode_listener(broken)
    with pytest.warns(RuntimeWarning, match="raised .*a view broke.* was removed"):
        lab.set_mode(model, "eager")
    lab.set_mode(model, "xla")
    assert calls == ["eager"] and lab.modes.running_mode(model) == "xla"
