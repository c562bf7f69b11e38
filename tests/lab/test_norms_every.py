"""`norms_every`: the gradient and weight norms of one step in n, on every backend.

Backend-neutral (Keras and the lab only): `make unit` runs it on TensorFlow
and `make test-jax` on JAX, where TensorFlow is not installed.
"""

import keras
import numpy as np
import pytest

import lab

X = np.random.default_rng(0).normal(size=(96, 6)).astype("float32")
Y = np.random.default_rng(1).integers(0, 3, 96).astype("int32")
BATCH = 8  # 12 steps an epoch


def make_model(steps_per_execution=1, run_eagerly=False, jit_compile="auto"):
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(5, activation="relu", name="hidden"),
                              keras.layers.Dense(3, name="out")], name="mlp")
    model.compile(keras.optimizers.Adam(1e-2), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], steps_per_execution=steps_per_execution, run_eagerly=run_eagerly,
                  jit_compile=jit_compile)
    return model


def recorded(model, epochs=2, x=X, **options):
    recorder = lab.Recorder(**options)
    model.fit(x, Y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0, callbacks=[recorder])
    return recorder.run


def state(model):
    return [np.asarray(v) for v in model.weights + model.optimizer.variables]


def norm_columns(batches):
    return [c for c in batches.columns if c.split("/")[0] in ("grad_norm", "weight_norm", "update_ratio")]


EXECUTIONS = {"spe=1": {}, "spe=5": {"steps_per_execution": 5}, "eager": {"run_eagerly": True},
              "xla": {"jit_compile": True}}


@pytest.mark.parametrize("execution", list(EXECUTIONS))
def test_norms_are_taken_at_the_first_step_and_every_nth_the_rest_per_step(execution):
    sampled = make_model(**EXECUTIONS[execution])
    run = recorded(sampled, gradients=True, weights=True, norms_every=5)
    every = make_model(**EXECUTIONS[execution])
    full = recorded(every, gradients=True, weights=True)
    mine, theirs = run.batches(), full.batches()
    assert len(mine) == len(theirs) == 24
    assert norm_columns(mine) == norm_columns(theirs) and len(norm_columns(mine)) == 13  # grad_norm + 4 x 3
    measured = [0, 5, 10, 15, 20]  # the step count runs on across the two epochs
    for column in norm_columns(mine):
        assert np.flatnonzero(np.isfinite(mine[column].to_numpy())).tolist() == measured, column
        # A measured row holds the norms an every-step recorder takes of that step.
        np.testing.assert_array_equal(mine[column].to_numpy()[measured], theirs[column].to_numpy()[measured])
    for column in ["loss", "accuracy", "learning_rate"]:
        assert np.isfinite(mine[column].to_numpy()).all(), column
    np.testing.assert_array_equal(mine["loss"].to_numpy(), theirs["loss"].to_numpy())
    assert run.metadata["norms_every"] == 5 and "norms_every" not in full.metadata
    # Watching never changes training: the same weights and optimizer state as bare fit().
    bare = make_model(**EXECUTIONS[execution])
    bare.fit(X, Y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    for mine_value, bare_value in zip(state(sampled), state(bare)):
        assert mine_value.tobytes() == bare_value.tobytes()


def test_the_step_count_goes_on_across_fits_of_one_recorder():
    model = make_model()
    recorder = lab.Recorder(gradients=True, norms_every=5)
    for _ in range(2):
        model.fit(X[:56], Y[:56], batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[recorder])
    rows = recorder.run.batches()
    assert len(rows) == 14
    assert np.flatnonzero(np.isfinite(rows["grad_norm"].to_numpy())).tolist() == [0, 5, 10]


def test_a_nonfinite_breakpoint_still_looks_at_every_step():
    # Step 3 is not one whose norms are taken; its gradient is NaN all the
    # same, and the breakpoint keeps its update out.
    x = X.copy()
    x[3 * BATCH + 1, 0] = np.nan
    model = make_model()
    run = recorded(model, epochs=1, x=x, gradients=True, weights=True, norms_every=5,
                   breakpoints=[lab.breakpoints.nonfinite()])
    rows = run.batches()
    assert len(rows) == 4 and rows["updated"].tolist() == [1, 1, 1, 0]
    assert np.isfinite(rows["grad_norm"].to_numpy()).tolist() == [True, False, False, False]
    # The hit's event, of the kind both backends give a nonfinite() hit.
    assert run.events()[["step", "kind"]].values.tolist() == [[3, "nonfinite"]]
    assert all(np.isfinite(value).all() for value in state(model))  # the NaN update is not in the weights


def test_norms_every_shows_in_a_saved_run(tmp_path):
    run = recorded(make_model(), epochs=1, gradients=True, norms_every=3)
    loaded = lab.Run.load(run.save(tmp_path / "sampled.h5"))
    assert loaded.metadata["norms_every"] == 3
    assert np.flatnonzero(np.isfinite(loaded.batches()["grad_norm"].to_numpy())).tolist() == [0, 3, 6, 9]


@pytest.mark.parametrize("value, error, words", [
    (0, ValueError, "1 or more"), (2.5, TypeError, "whole number"), (True, TypeError, "whole number"),
    ("10", TypeError, "whole number")])
def test_a_bad_norms_every_is_refused_where_it_is_given(value, error, words):
    with pytest.raises(error, match=words) as raised:
        lab.Recorder(gradients=True, norms_every=value)
    assert "norms_every=10" in str(raised.value)  # the example of a good value


def test_norms_every_without_norms_to_take_names_the_fix():
    with pytest.raises(ValueError, match="records neither: pass gradients=True or weights=True"):
        lab.Recorder(norms_every=10)
    lab.Recorder(weights=True, norms_every=10)  # weights alone are norms too


def test_a_dashboard_draws_the_sampled_norms_as_lines_and_a_heatmap_of_the_steps_that_have_them():
    pytest.importorskip("ipywidgets")
    import re

    import widgets
    from widgets.series import chart_data

    dashboard = widgets.Dashboard(gradients=True, norms_every=4, view="html")
    make_model().fit(X, Y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[dashboard])
    dashboard.refresh(final=True)
    assert dashboard.run.metadata["norms_every"] == 4
    lines = dict(re.findall(r'data-name="(mlp/\w+)" data-last="[^"]*" [^>]*points="([^"]*)"',
                            dashboard.chart_html.value))
    assert sorted(lines) == ["mlp/hidden", "mlp/out"]
    assert all(len(points.split()) == 6 for points in lines.values())  # steps 0, 4, ..., 20, joined
    heat = chart_data(dashboard.run).heatmap
    assert sorted(set(heat.x.tolist())) == [0, 4, 8, 12, 16, 20]  # no blank columns between them
    assert np.isfinite(heat.z).all()
