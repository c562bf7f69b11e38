"""Arguments of the engine: a wrong one fails at construction, naming itself and the fix."""

import keras
import numpy as np
import pandas as pd
import pytest

import lab
from lab.backend.tensorflow.feed import Feed
from lab.breakpoints import BreakpointError, as_breakpoints, loss_spike, nonfinite


def tiny_model(inputs=4):
    model = keras.Sequential([keras.Input((inputs,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    return model


def data(n=16, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 4)).astype("float32"), rng.normal(size=(n, 1)).astype("float32")


# ---- breakpoints ---------------------------------------------------------------

def test_a_plain_callable_or_a_single_breakpoint_is_accepted_as_breakpoints():
    recorder = lab.Recorder(breakpoints=[lambda row: row["step"] >= 1])
    assert isinstance(recorder.breakpoints[0], lab.Breakpoint)
    assert [p.name for p in lab.Recorder(breakpoints=nonfinite()).breakpoints] == ["nonfinite"]
    assert len(lab.Recorder(breakpoints=lambda row: False).breakpoints) == 1
    assert as_breakpoints(None) == [] and as_breakpoints(()) == []


@pytest.mark.parametrize("arguments, error, named", [
    ({"flush_every": -1}, ValueError, r"lab.Recorder\(flush_every=\.\.\.\) must be a number of seconds, 0 or more"),
    ({"flush_every": "0.5"}, TypeError, r"flush_every=\.\.\.\) must be .* got str '0.5'"),
    ({"save_every": float("inf")}, ValueError, r"save_every=\.\.\.\) must be a number of seconds"),
    ({"path": 3}, TypeError, r"path=\.\.\.\) must be a file path"),
    ({"run": {}}, TypeError, r"run=\.\.\.\) must be a lab.Run"),
    # A string or a number passed as true or false: gradients="no" recorded the gradients.
    ({"gradients": "no"}, TypeError, r"lab.Recorder\(gradients=\.\.\.\) must be True or False; got str 'no'"),
    ({"weights": 1}, TypeError, r"lab.Recorder\(weights=\.\.\.\) must be True or False; got int 1"),
])
def test_a_recorder_refuses_bad_timings_paths_and_runs_at_construction(arguments, error, named):
    with pytest.raises(error, match=named):
        lab.Recorder(**arguments)


def test_a_plain_callable_breakpoint_stops_fit():
    x, y = data()
    recorder = lab.Recorder(breakpoints=[lambda row: row["step"] >= 1])
    tiny_model().fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[recorder])
    assert len(recorder.run) == 2
    assert recorder.run.events()["kind"].tolist()[-1] == "breakpoint"


@pytest.mark.parametrize("value, named", [(3, "breakpoints must be a list"), ([nonfinite(), "loss"], r"breakpoints\[1\] is str"),
                                          ({"loss": 3}, "breakpoints must be a list")])
def test_something_that_is_not_a_breakpoint_is_refused_at_construction(value, named):
    with pytest.raises(TypeError, match=named) as caught:
        lab.Recorder(breakpoints=value)
    assert "lab.Breakpoint" in str(caught.value)
    with pytest.raises(TypeError, match=named):
        with lab.watch(tiny_model(), breakpoints=value):
            pass


@pytest.mark.parametrize("arguments, error, named", [
    (dict(factor="3"), TypeError, r"factor=.*number above 1.*str '3'"),
    (dict(factor=1.0), ValueError, r"factor=.*above 1"),
    (dict(factor=float("inf")), ValueError, r"factor="),
    (dict(warmup=-5), ValueError, r"warmup=.*0 or more.*-5"),
    (dict(warmup=2.5), TypeError, r"warmup=.*whole number"),
    (dict(decay=5), ValueError, r"decay=.*from 0 up to.*1"),
    (dict(decay=1.0), ValueError, r"decay="),
    (dict(decay=True), TypeError, r"decay="),
])
def test_loss_spike_checks_its_arguments(arguments, error, named):
    with pytest.raises(error, match=named) as caught:
        loss_spike(**arguments)
    assert "e.g." in str(caught.value)


def test_loss_spike_takes_numpy_numbers():
    point = loss_spike(np.float32(2.0), warmup=np.int64(3), decay=0.5)
    assert (point.factor, point.warmup, point.decay) == (2.0, 3, 0.5)


ROW = pd.Series({"step": 7, "epoch": 0, "batch": 7, "loss": 1.5})


@pytest.mark.parametrize("condition, message", [
    (lambda row: row["val_loss"] > 1, r"'slow'.*column 'val_loss'.*'step', 'epoch', 'batch', 'loss'"),
    (lambda row: 1 / 0, r"'slow' raised ZeroDivisionError.*step 7"),
    (lambda row: np.array([True, False]), r"'slow' returned ndarray of shape \(2,\).*one truth value"),
    (lambda row: pd.NA, r"'slow' returned <NA>"),
])
def test_a_failing_condition_names_the_breakpoint_and_the_column(condition, message):
    point = lab.Breakpoint(condition, name="slow")
    with pytest.raises(BreakpointError, match=message):
        point.hit(ROW)


def test_a_failing_condition_stops_fit_with_its_name_and_the_run_stays_readable(tmp_path):
    x, y = data()
    recorder = lab.Recorder(breakpoints=[lab.Breakpoint(lambda row: row["accuracy"] > 0.9, name="good enough")])
    with pytest.raises(BreakpointError, match="'good enough' reads the column 'accuracy'"):
        tiny_model().fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[recorder])
    assert len(recorder.run) >= 1
    assert len(lab.Run.load(recorder.run.save(tmp_path / "run.h5"))) == len(recorder.run)


def test_breakpoint_needs_a_callable_and_a_string_name():
    with pytest.raises(TypeError, match="callable condition.*e.g."):
        lab.Breakpoint("loss > 3")
    with pytest.raises(TypeError, match="name=.*str"):
        lab.Breakpoint(lambda row: True, name=3)


# ---- devices, modes ---------------------------------------------------------------

@pytest.mark.parametrize("n, named", [(10000, "more than the 64 logical CPUs"), (0, "positive integer"),
                                      ("2", "positive integer"), (True, "positive integer")])
def test_virtual_cpus_refuses_what_it_cannot_use_before_touching_tensorflow(n, named):
    with pytest.raises(ValueError, match=named):
        lab.virtual_cpus(n)


def test_set_mode_names_a_model_that_is_not_a_model():
    with pytest.raises(TypeError, match=r"set_mode\(model, mode\): model must be a compiled keras.Model; got NoneType"):
        lab.set_mode(None, "graph")
    with pytest.raises(ValueError, match="Unknown mode None.*'eager', 'graph', 'xla'"):
        lab.set_mode(tiny_model(), None)


def test_compare_modes_says_steps_must_be_an_int():
    with pytest.raises(TypeError, match=r"steps must be an int.*16\.0"):
        lab.compare_modes(tiny_model(), data(), steps=16.0)


@pytest.mark.parametrize(("arguments", "error", "named"), [
    (dict(modes=None), TypeError, r"modes must be a mode or a list of modes.*None"),
    (dict(steps_per_execution="8"), TypeError, r"steps_per_execution must be an int or a list of ints"),
    (dict(batch_size=0), ValueError, r"compare_modes\(batch_size=\.\.\.\).*1 or more"),
    (dict(batch_size=2.5), TypeError, r"compare_modes\(batch_size=\.\.\.\)"),
])
def test_compare_modes_names_a_bad_argument_at_the_call(arguments, error, named):
    # modes=None and steps_per_execution=8 failed with "... is not iterable",
    # batch_size=0 ran with 32, and batch_size=2.5 failed inside TensorFlow.
    with pytest.raises(error, match=named):
        lab.compare_modes(tiny_model(), data(), steps=16, **arguments)


def test_compare_modes_takes_one_mode_and_one_steps_per_execution_as_they_are():
    # modes="graph" was split into letters ("Unknown mode 'g'").
    frame = lab.compare_modes(tiny_model(), data(), steps=4, modes="graph", steps_per_execution=2)
    assert frame[["mode", "steps_per_execution"]].values.tolist() == [["graph", 2]]


# ---- one run, one model ------------------------------------------------------------

def test_a_run_refuses_rows_of_a_second_model():
    first, second = tiny_model(), tiny_model()
    run = lab.Run()
    run.claim_model(first)
    run.claim_model(first)  # the same model again (a second fit()) is fine
    run.claim_model(second)  # no rows yet: the run follows the new model
    run.append_batches({"loss": [1.0]})
    with pytest.raises(ValueError, match=rf"1 batch rows of model '{second.name}'.*one run records one model.*"
                                         rf"rows of model '{first.name}'.*lab.Recorder\(\)"):
        run.claim_model(first)
    run.claim_model(second)
    loaded = lab.Run("loaded")
    loaded.append_batches({"loss": [1.0]})
    loaded.claim_model(first)  # rows of no known model (read from a file): adopted


# ---- data as fit() reads it ---------------------------------------------------------

def test_the_stepper_reads_a_list_as_the_inputs_of_a_model_with_several_inputs():
    x, y = data()
    fed = Feed([x, y], batch_size=8, shuffle=False).next().data
    assert isinstance(fed, tuple) and len(fed) == 1 and len(fed[0]) == 2  # ([x, y],), as fit() packs it
    a, b = keras.Input((4,)), keras.Input((1,))
    two_inputs = keras.Model([a, b], keras.layers.Dense(1)(keras.layers.Concatenate()([a, b])))
    two_inputs.compile(optimizer="sgd", loss="mse")
    trace = lab.Stepper(two_inputs, ([x, y], y), batch_size=8).step()
    assert trace.error is None and np.isfinite(trace.logs["loss"])


def test_the_stepper_refuses_a_list_x_y_as_fit_does_but_at_construction():
    x, y = data()
    model = tiny_model()
    with pytest.raises(ValueError):
        model.fit([x, y], epochs=1, verbose=0)  # fit() reads the list as inputs, not (x, y)
    with pytest.raises(ValueError, match="Pass the arrays as a tuple"):
        lab.Stepper(tiny_model(), [x, y], batch_size=8)


def test_one_recorder_on_two_models_is_refused_before_the_second_trains():
    x, y = data()
    recorder = lab.Recorder()
    first, second = tiny_model(), tiny_model()
    first.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[recorder])
    weights = [w.numpy().copy() for w in second.weights]
    with pytest.raises(ValueError, match=f"rows of model '{first.name}'.*model '{second.name}'.*own recorder"):
        second.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[recorder])
    assert all(np.array_equal(w.numpy(), before) for w, before in zip(second.weights, weights))
    assert len(recorder.run) == 2


def test_a_stepper_given_a_list_for_a_one_input_model_says_so_at_construction():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.zeros((8, 4), "float32"), np.zeros((8, 1), "float32")
    with pytest.raises(ValueError, match=r"Pass the arrays as a tuple"):
        lab.Stepper(model, [x, y])
    assert lab.Stepper(model, (x, y), batch_size=4).step().error is None


@pytest.mark.parametrize("call, error, named", [
    (lambda model, data: lab.Stepper(model, data, history=2.5), TypeError, r"lab.Stepper\(history=\.\.\.\)"),
    (lambda model, data: lab.Stepper(model, data, history=0), ValueError, r"lab.Stepper\(history=\.\.\.\)"),
    (lambda model, data: lab.Stepper(model, data, batch_size="8"), TypeError, r"lab.Stepper\(batch_size=\.\.\.\)"),
    (lambda model, data: lab.Stepper(model, data, shuffle="no"), TypeError, r"lab.Stepper\(shuffle=\.\.\.\)"),
    (lambda model, data: lab.Stepper(model, data, steps_per_epoch=0), ValueError,
     r"lab.Stepper\(steps_per_epoch=\.\.\.\)"),
    (lambda model, data: lab.Stepper(model, data, batch_size=8).step(1.5), TypeError, r"Stepper.step\(n=\.\.\.\)"),
    (lambda model, data: lab.Stepper(model, data, batch_size=8).rewind(0), ValueError, r"Stepper.rewind\(n=\.\.\.\)"),
    (lambda model, data: lab.Stepper(model, data, batch_size=8).run_until(lambda t: False, max_steps="5"),
     TypeError, r"Stepper.run_until\(max_steps=\.\.\.\)"),
])
def test_the_stepper_refuses_numbers_it_would_have_truncated_or_misread(call, error, named):
    # history=2.5 used to keep 2 steps and batch_size="8" to pass as 8; now each is named where given.
    x, y = np.zeros((16, 4), "float32"), np.zeros((16, 1), "float32")
    model = tiny_model()
    with pytest.raises(error, match=named + r" must be .*\(e.g. "):
        call(model, (x, y))
    assert "train_step" not in vars(model)


def test_the_flags_of_a_recorder_a_dashboard_a_lab_and_watch_are_true_or_false():
    import widgets

    model = tiny_model()
    x, y = np.zeros((16, 4), "float32"), np.zeros((16, 1), "float32")
    assert lab.Recorder(gradients=np.bool_(True)).gradients  # a NumPy bool is a bool
    for call, named in ((lambda: widgets.Dashboard(gradients="no"), r"widgets.Dashboard\(gradients=\.\.\.\)"),
                        (lambda: widgets.Dashboard(weights=0), r"widgets.Dashboard\(weights=\.\.\.\)"),
                        (lambda: widgets.Lab(model, (x, y), gradients="no"), r"widgets.Lab\(gradients=\.\.\.\)"),
                        (lambda: lab.watch(model, model.optimizer, weights="yes").__enter__(),
                         r"lab.watch\(weights=\.\.\.\)")):
        with pytest.raises(TypeError, match=named + r" must be True or False; got .*\(e.g. "):
            call()
    assert "train_step" not in vars(model)
