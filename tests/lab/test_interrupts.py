"""Interrupts and failures during fit(): the record survives, the model stays usable."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import lab


def data(n=48, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 4)).astype("float32"), rng.normal(size=(n, 1)).astype("float32")


class RaiseAtStep(keras.layers.Layer):
    """Passes its input through; raises `error` in the training step number `at` (from 1)."""

    def __init__(self, at, error):
        super().__init__()
        self.at, self.error, self.calls = at, error, 0

    def call(self, inputs, training=None):
        if training and tf.executing_eagerly():
            self.calls += 1
            if self.calls == self.at:
                raise self.error
        return inputs


class RaiseInCallback(keras.callbacks.Callback):
    def __init__(self, hook, at, error):
        super().__init__()
        self.hook, self.at, self.error = hook, at, error

    def on_train_batch_end(self, batch, logs=None):
        if self.hook == "batch" and batch == self.at:
            raise self.error

    def on_epoch_end(self, epoch, logs=None):
        if self.hook == "epoch" and epoch == self.at:
            raise self.error


def model_with(*layers, run_eagerly=False):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), *layers, keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", run_eagerly=run_eagerly)
    return model


def assert_usable_without_the_lab(model):
    """No lab patch is left, weights are finite, and a plain fit() trains."""
    assert "train_step" not in model.__dict__
    assert "compute_loss" not in model.__dict__
    assert "_backend_update_step" not in model.optimizer.__dict__
    assert getattr(model.train_function, "_lab_recorder", None) is None
    assert all(np.isfinite(w).all() for w in model.get_weights())
    before = [w.copy() for w in model.get_weights()]
    x, y = data(16, seed=1)
    history = model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])
    assert any(not np.array_equal(a, b) for a, b in zip(before, model.get_weights()))


def interrupted_fit(model, recorder, callbacks=(), error=KeyboardInterrupt, epochs=1):
    x, y = data()
    with pytest.raises(error):
        model.fit(x, y, batch_size=8, epochs=epochs, verbose=0, callbacks=[recorder, *callbacks])


def test_an_interrupt_inside_a_step_keeps_every_completed_batch(tmp_path):
    # Steps 1-3 complete; the interrupt comes in the forward pass of step 4.
    model = model_with(RaiseAtStep(4, KeyboardInterrupt()), run_eagerly=True)
    recorder = lab.Recorder(gradients=True, path=str(tmp_path / "run.h5"))
    interrupted_fit(model, recorder)

    assert recorder.status == "interrupted"
    assert len(recorder.run) == 3 == int(model.optimizer.iterations)
    assert recorder.run.batches()["batch"].tolist() == [0, 1, 2]
    assert np.isfinite(recorder.run.batches()["grad_norm"]).all()
    events = recorder.run.events()
    assert events[["step", "kind"]].values.tolist() == [[2, "interrupt"]]
    saved = lab.Run.load(tmp_path / "run.h5")
    assert len(saved) == 3 and saved.events()["kind"].tolist() == ["interrupt"]
    assert_usable_without_the_lab(model)


def test_an_error_inside_a_step_is_recorded_as_a_failure():
    model = model_with(RaiseAtStep(2, ValueError("bad batch")), run_eagerly=True)
    recorder = lab.Recorder()
    interrupted_fit(model, recorder, error=ValueError)

    assert recorder.status == "failed" and "bad batch" in recorder.status_detail
    assert len(recorder.run) == 1
    events = recorder.run.events()
    assert events["kind"].tolist() == ["error"] and "bad batch" in events["detail"][0]
    assert_usable_without_the_lab(model)


def test_the_same_recorder_continues_after_an_interrupt():
    model = model_with(RaiseAtStep(4, KeyboardInterrupt()), run_eagerly=True)
    recorder = lab.Recorder()
    interrupted_fit(model, recorder)
    x, y = data(16)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[recorder])
    assert recorder.status == "finished"
    assert recorder.run.batches()["step"].tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("recorder_first", [True, False])
def test_an_interrupt_between_batches_keeps_the_record_and_frees_the_model(recorder_first):
    model = model_with()
    recorder = lab.Recorder(flush_every=3600)
    stop = RaiseInCallback("batch", 2, KeyboardInterrupt())
    x, y = data()
    with pytest.raises(KeyboardInterrupt):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0,
                  callbacks=[recorder, stop] if recorder_first else [stop, recorder])

    # Batches 0-2 each updated the weights: all three are in the record.
    assert len(recorder.run) == 3 == int(model.optimizer.iterations)
    assert recorder.status == "interrupted"
    assert recorder.run.events()["kind"].tolist() == ["interrupt"]
    assert_usable_without_the_lab(model)


def test_after_an_interrupt_between_batches_a_new_recorder_can_watch_the_model():
    model = model_with()
    interrupted_fit(model, lab.Recorder(), [RaiseInCallback("batch", 1, KeyboardInterrupt())])
    fresh = lab.Recorder()
    x, y = data(16)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[fresh])
    assert len(fresh.run) == 2


def test_an_error_in_another_callback_is_recorded_and_frees_the_model(tmp_path):
    model = model_with()
    recorder = lab.Recorder(path=str(tmp_path / "run.h5"))
    interrupted_fit(model, recorder, [RaiseInCallback("epoch", 0, RuntimeError("plot failed"))],
                    error=RuntimeError, epochs=2)
    assert recorder.status == "failed"
    assert recorder.run.events()["kind"].tolist() == ["error"]
    assert lab.Run.load(tmp_path / "run.h5").events()["kind"].tolist() == ["error"]
    assert_usable_without_the_lab(model)


def test_a_failing_subscriber_never_stops_training():
    model = model_with()
    recorder = lab.Recorder(flush_every=0)
    calls = []

    def broken_view(run, table, start, stop):
        calls.append(table)
        raise RuntimeError("cannot render")

    recorder.run.subscribe(broken_view)
    healthy = []
    recorder.run.subscribe(lambda run, table, start, stop: healthy.append((table, stop)))
    x, y = data()
    with pytest.warns(RuntimeWarning, match="cannot render.*training goes on"):
        model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[recorder])

    assert recorder.status == "finished"
    assert len(recorder.run) == 12 == int(model.optimizer.iterations)
    assert calls == ["batches"]  # detached after its first failure
    assert ("epochs", 2) in healthy


def test_a_failing_status_listener_never_stops_training():
    model = model_with()
    recorder = lab.Recorder()

    def broken(status, detail):
        raise RuntimeError("view gone")

    recorder.add_status_listener(broken)
    x, y = data()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[recorder])
    assert recorder.status == "finished" and len(recorder.run) == 6


class RaiseAtTrainEnd(keras.callbacks.Callback):
    def on_train_end(self, logs=None):
        raise RuntimeError("report failed")


def test_an_error_in_another_callbacks_on_train_end_still_frees_the_model():
    model = model_with()
    recorder = lab.Recorder()
    x, y = data()
    with pytest.raises(RuntimeError, match="report failed"):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[RaiseAtTrainEnd(), recorder])
    assert len(recorder.run) == 6
    assert recorder.status == "failed"
    assert_usable_without_the_lab(model)


def _attached_names(model):
    return sorted(k for k in ("train_step", "compute_loss", "evaluate", "make_train_function") if k in model.__dict__)


@pytest.mark.parametrize("error", ["wrong validation data", "interrupt in validation"])
def test_a_failure_in_fits_validation_is_recorded_and_frees_the_model(error):
    x, y = data()
    model = model_with()
    recorder = lab.Recorder(gradients=True)
    if error == "wrong validation data":
        validation, raised = (x[:, :3], y), ValueError  # 3 features for a model of 4: Keras fails in evaluate()
    else:
        validation, raised = (x, y), KeyboardInterrupt

        class InterruptValidation(keras.callbacks.Callback):
            def on_test_batch_end(self, batch, logs=None):
                raise KeyboardInterrupt

    callbacks = [recorder] + ([InterruptValidation()] if raised is KeyboardInterrupt else [])
    with pytest.raises(raised):
        model.fit(x, y, batch_size=8, epochs=2, verbose=0, validation_data=validation, callbacks=callbacks)
    assert recorder.status == ("failed" if raised is ValueError else "interrupted")
    assert list(recorder.run.events()["kind"]) == ["error" if raised is ValueError else "interrupt"]
    assert len(recorder.run.batches()) == 6  # every batch of the first epoch, read before the hooks came off
    assert not lab.hooks.attached(model) and _attached_names(model) == []
    assert_usable_without_the_lab(model)


class CompileAtEpochEnd(keras.callbacks.Callback):
    """Recompiles mid-fit: Keras' own fit() loop then fails calling the train
    function compile() took away, outside every step and callback."""

    def on_epoch_end(self, epoch, logs=None):
        self.model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")


def _fit_failing_in_keras_own_code(recorder):
    keras.utils.set_random_seed(3)
    model = model_with()
    x, y = data()
    with pytest.raises(TypeError):
        model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[CompileAtEpochEnd()] + (
            [recorder] if recorder else []))
    return model


@pytest.mark.parametrize("next_use", ["fit", "evaluate", "another recorder"])
def test_a_fit_ended_by_keras_own_code_is_told_and_unhooked_as_it_ends(next_use):
    # Keras fails in its own loop over the epoch's batches, calling the train
    # function compile() took away: seen there, before fit() has ended.
    x, y = data()
    bare = _fit_failing_in_keras_own_code(None)
    recorder = lab.Recorder(gradients=True, breakpoints=[lab.breakpoints.nonfinite()])
    model = _fit_failing_in_keras_own_code(recorder)
    assert recorder.status == "failed" and not lab.hooks.attached(model)
    assert_same = [np.array_equal(a, b) for a, b in zip(model.get_weights(), bare.get_weights())]
    assert all(assert_same)
    if next_use == "fit":
        for m in (bare, model):
            m.fit(x, y, batch_size=8, epochs=1, verbose=0)
    elif next_use == "evaluate":
        model.evaluate(x, y, verbose=0)
    else:
        again = lab.Recorder()
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[again])
        bare.fit(x, y, batch_size=8, epochs=1, verbose=0)
        assert again.status == "finished" and len(again.run.batches()) == 6
    assert recorder.status == "failed"
    [event] = recorder.run.events().itertuples()
    assert event.kind == "error" and "TypeError" in event.detail
    assert len(recorder.run.batches()) == 6
    assert not (lab.hooks.attached(model) and next_use != "another recorder")
    assert _attached_names(model) == []
    if next_use != "evaluate":
        assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), bare.get_weights()))


@pytest.mark.parametrize("next_use", ["fit", "evaluate"])
def test_a_fit_ended_where_no_guard_sees_is_told_and_unhooked_at_the_models_next_use(next_use, monkeypatch):
    # An error (no Ctrl-C, which is heard as it lands) raised by a line of
    # fit() between its epoch's loop and its callbacks reaches no guard of the lab.
    def should_eval(epoch, validation_freq):
        raise RuntimeError("Keras failed between steps")

    model = model_with()
    x, y = data()
    monkeypatch.setattr(model, "_should_eval", should_eval, raising=False)
    recorder = lab.Recorder()
    with pytest.raises(RuntimeError):
        model.fit(x, y, batch_size=8, epochs=2, verbose=0, validation_data=(x, y), callbacks=[recorder])
    monkeypatch.undo()
    if next_use == "fit":
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    else:
        model.evaluate(x, y, verbose=0)
    assert recorder.status == "failed" and len(recorder.run) == 6
    [event] = recorder.run.events().itertuples()
    assert event.kind == "error" and "Keras' own code" in event.detail
    assert not lab.hooks.attached(model) and _attached_names(model) == []


def test_in_a_notebook_a_fit_ended_by_keras_own_code_is_told_and_unhooked_when_its_cell_ends():
    code = r'''
import numpy as np, keras, lab
from IPython.core.interactiveshell import InteractiveShell
shell = InteractiveShell.instance()
shell.run_cell("""
import numpy as np, keras, lab
class CompileAtEpochEnd(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        self.model.compile(optimizer="sgd", loss="mse")
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
model.compile(optimizer="sgd", loss="mse")
rec = lab.Recorder()
model.fit(np.ones((16, 4)), np.ones((16, 1)), batch_size=8, epochs=2, verbose=0, callbacks=[rec, CompileAtEpochEnd()])
""")
ns = shell.user_ns
print("RESULT", ns["rec"].status, list(ns["rec"].run.events()["kind"]), lab.hooks.attached(ns["model"]),
      "TypeError" in ns["rec"].run.events()["detail"].iloc[0])
'''
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    [line] = [line for line in out.stdout.splitlines() if line.startswith("RESULT")] or [out.stderr[-2000:]]
    assert line == "RESULT failed ['error'] False True"


# ---- an interrupt wherever it lands in fit() --------------------------------

def raising_on_call(inner, at, error=KeyboardInterrupt):
    """`inner` that raises `error` instead at its call number `at` (from 1)."""
    calls = []

    def replaced(*args, **kwargs):
        calls.append(1)
        if len(calls) == at:
            raise error
        return inner(*args, **kwargs)

    return replaced


def assert_left_interrupted(recorder, model, rows, path, where=None):
    """The run is interrupted with `rows` rows, in memory and in its file,
    its event says where, and no hook of the lab is left on the model."""
    assert recorder.status == "interrupted"
    assert len(recorder.run) == rows
    [event] = recorder.run.events().itertuples()
    assert event.kind == "interrupt" and event.detail.startswith("KeyboardInterrupt")
    if where:
        assert where in event.detail
    saved = lab.Run.load(path)
    assert len(saved) == rows and saved.metadata["status"] == "interrupted"
    assert saved.events()["kind"].tolist() == ["interrupt"]
    assert not lab.hooks.attached(model) and _attached_names(model) == []
    assert "catch_stop_iteration" not in vars(recorder_epoch_iterator[0])
    assert "finalize_variable_values" not in vars(model.optimizer)


recorder_epoch_iterator = []  # the epoch iterator of the last fit() that `fit_keeping_iterator` ran


@pytest.fixture
def fit_keeping_iterator(monkeypatch):
    """fit() whose epoch iterator is kept in `recorder_epoch_iterator` (to check no hook is left on it)."""
    from keras.src.backend.tensorflow import trainer

    made = trainer.TFEpochIterator.__init__

    def keep(self, *args, **kwargs):
        made(self, *args, **kwargs)
        recorder_epoch_iterator[:] = [self]

    monkeypatch.setattr(trainer.TFEpochIterator, "__init__", keep)
    return trainer


@pytest.mark.parametrize("place", ["making the epoch's data iterator", "reading a batch", "the metrics' reset",
                                   "the metrics' results", "the optimizer's finalize"])
def test_an_interrupt_in_keras_own_code_between_steps_is_recorded_at_once(place, fit_keeping_iterator, monkeypatch,
                                                                          tmp_path):
    # Each raises where Keras' fit() calls no callback and none of its steps
    # runs. The second epoch's start for the first three, the first epoch's
    # end, fit()'s end.
    trainer = fit_keeping_iterator
    # Older Keras releases (3.5 among them) make an epoch's iterator in
    # `enumerate_epoch` and read batches inside the compiled train function
    # (no line of Keras' Python runs there); newer ones make it in
    # `_get_iterator` and read each batch in `__next__`.
    reads_in_python = hasattr(trainer.TFEpochIterator, "__next__")
    if place == "reading a batch" and not reads_in_python:
        pytest.skip(f"Keras {keras.__version__} reads batches inside the compiled train function")
    targets = {
        "making the epoch's data iterator": (trainer.TFEpochIterator,
                                             "_get_iterator" if reads_in_python else "enumerate_epoch", 2, 6),
        "reading a batch": (trainer.TFEpochIterator, "__next__", 9, 7),
        "the metrics' reset": (keras.Model, "reset_metrics", 2, 6),
        "the metrics' results": (keras.Model, "_get_metrics_result_or_logs", 1, 6),
        "the optimizer's finalize": (keras.optimizers.SGD, "finalize_variable_values", 1, 12),
    }
    owner, name, at, rows = targets[place]
    monkeypatch.setattr(owner, name, raising_on_call(getattr(owner, name), at))
    model = model_with()
    recorder = lab.Recorder(gradients=True, path=str(tmp_path / "run.h5"), flush_every=3600)
    interrupted_fit(model, recorder, epochs=2)

    # Every step that ran is in the run: the optimizer counts them.
    assert rows == int(model.optimizer.iterations)
    assert_left_interrupted(recorder, model, rows, tmp_path / "run.h5")
    monkeypatch.undo()
    assert_usable_without_the_lab(model)


def batches_until_interrupt(at, n=8):
    """A generator of batches that raises KeyboardInterrupt when asked for batch `at` (from 0)."""
    x, y = data(8 * n)
    for i in range(n):
        if i == at:
            raise KeyboardInterrupt
        yield x[8 * i: 8 * i + 8], y[8 * i: 8 * i + 8]


def bare_fit_error(make_data, run_eagerly):
    """What bare Keras raises for this data, on a model of its own, and its optimizer's iterations then."""
    model = model_with(run_eagerly=run_eagerly)
    with pytest.raises(BaseException) as raised:
        model.fit(make_data(), epochs=1, steps_per_epoch=8, verbose=0)
    return type(raised.value), int(model.optimizer.iterations)


@pytest.mark.parametrize("run_eagerly", [False, True])
def test_an_interrupt_inside_a_data_generator_is_recorded_as_one(run_eagerly, fit_keeping_iterator, tmp_path):
    # TensorFlow runs the generator inside the step (tf.data) and turns its
    # KeyboardInterrupt into "UnknownError: Graph execution error": the run
    # says interrupted all the same, and fit() raises what it raises without the lab.
    raised, iterations = bare_fit_error(lambda: batches_until_interrupt(3), run_eagerly)
    model = model_with(run_eagerly=run_eagerly)
    recorder = lab.Recorder(path=str(tmp_path / "run.h5"), flush_every=3600)
    with pytest.raises(raised) as error:
        model.fit(batches_until_interrupt(3), epochs=1, steps_per_epoch=8, verbose=0, callbacks=[recorder])
    assert raised is KeyboardInterrupt or "KeyboardInterrupt" in str(error.value)
    assert_left_interrupted(recorder, model, 3, tmp_path / "run.h5")
    if raised is not KeyboardInterrupt:
        assert type(error.value).__name__ in recorder.run.events()["detail"][0]
    assert int(model.optimizer.iterations) == iterations  # as without the lab
    assert_usable_without_the_lab(model)


def test_a_data_generators_own_error_stays_a_failure(tmp_path):
    def failing():
        yield from batches_until_interrupt(99, n=2)
        raise ValueError("the data ran dry")

    model = model_with()
    recorder = lab.Recorder(path=str(tmp_path / "run.h5"))
    with pytest.raises(Exception, match="the data ran dry"):
        model.fit(failing(), epochs=1, steps_per_epoch=8, verbose=0, callbacks=[recorder])
    assert recorder.status == "failed" and recorder.run.events()["kind"].tolist() == ["error"]
    assert lab.Run.load(tmp_path / "run.h5").metadata["status"] == "failed"


def test_an_interrupt_in_a_callback_after_the_lab_keeps_the_rows_on_disk(fit_keeping_iterator, tmp_path):
    model = model_with()
    recorder = lab.Recorder(path=str(tmp_path / "run.h5"), flush_every=3600)
    interrupted_fit(model, recorder, [RaiseInCallback("batch", 4, KeyboardInterrupt())])
    assert_left_interrupted(recorder, model, 5, tmp_path / "run.h5", where="on_train_batch_end")


@pytest.mark.parametrize("how, status, kind", [("interrupt-in-keras", "interrupted", "interrupt"),
                                               ("error-in-keras", "failed", "error"),
                                               ("interrupt-in-generator", "interrupted", "interrupt")])
def test_a_script_ended_by_its_fit_keeps_every_row_in_its_run_file(how, status, kind, tmp_path):
    # Nothing is read or saved on a timer: every row is still on the device
    # when the script ends, and no one calls anything after.
    import json
    import subprocess
    import sys
    from pathlib import Path

    path = tmp_path / "run.h5"
    script = Path(__file__).parent / "_scripts" / "ended_script.py"
    out = subprocess.run([sys.executable, str(script), str(path), how], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode != 0, out.stdout[-2000:]
    assert ("KeyboardInterrupt" if "interrupt" in how else "RuntimeError") in out.stderr
    [line] = [line for line in out.stdout.splitlines() if line.startswith("{")] or [out.stderr[-2000:]]
    saved = lab.Run.load(path)
    assert len(saved) == json.loads(line)["rows"]
    assert np.isfinite(saved.batches()["grad_norm"]).all()
    assert saved.metadata["status"] == status
    assert saved.events()["kind"].tolist() == [kind]


@pytest.mark.parametrize("window", ["validation's turn", "making the validation data's iterator"])
def test_a_ctrl_c_landing_on_a_line_of_fit_itself_is_recorded_before_fit_ends(window, monkeypatch, tmp_path):
    # A real SIGINT, sent deterministically from where no guard of the lab
    # runs: Python raises its KeyboardInterrupt from the frame it lands in.
    import signal

    model = model_with()
    x, y = data()
    seen_by_the_user = []

    def ctrl_c(*args, **kwargs):
        signal.raise_signal(signal.SIGINT)

    if window == "validation's turn":
        monkeypatch.setattr(model, "_should_eval", ctrl_c, raising=False)
    else:
        from keras.src.backend.tensorflow import trainer

        made = trainer.TFEpochIterator.__init__

        def make(self, *args, **kwargs):
            made(self, *args, **kwargs)
            if kwargs.get("shuffle") is False:  # fit()'s validation data, after the first epoch's steps
                ctrl_c()

        monkeypatch.setattr(trainer.TFEpochIterator, "__init__", make)
    recorder = lab.Recorder(path=str(tmp_path / "run.h5"), flush_every=3600)
    recorder.add_status_listener(lambda status, detail: seen_by_the_user.append(status))
    with pytest.raises(KeyboardInterrupt):
        model.fit(x, y, batch_size=8, epochs=2, verbose=0, validation_data=(x, y), callbacks=[recorder])

    rows = int(model.optimizer.iterations)
    assert rows == 6
    assert seen_by_the_user == ["running", "interrupted"]
    assert recorder.status == "interrupted" and len(recorder.run) == rows
    assert lab.Run.load(tmp_path / "run.h5").metadata["status"] == "interrupted"
    assert recorder.run.events()["kind"].tolist() == ["interrupt"]
    assert not lab.hooks.attached(model) and _attached_names(model) == []
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


# ---- a watched loop -------------------------------------------------------------

@pytest.mark.parametrize("source", ["python generator", "tf.data from a generator"])
def test_an_interrupt_in_a_watched_loops_data_is_recorded_as_one(source):
    # Through tf.data, TensorFlow raises the generator's KeyboardInterrupt
    # as UnknownError; the run says interrupted either way, and the loop
    # gets the error it gets without the lab.
    model = model_with()
    optimizer = model.optimizer

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = keras.ops.mean((model(x, training=True) - y) ** 2)
        optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        return loss

    def batches():
        yield from batches_until_interrupt(3)

    stream = batches() if source == "python generator" else tf.data.Dataset.from_generator(
        batches, output_signature=(tf.TensorSpec((8, 4), tf.float32), tf.TensorSpec((8, 1), tf.float32)))
    with pytest.raises(BaseException) as raised:
        with lab.watch(model, optimizer) as run:
            for x, y in stream:
                run.step(loss=train_step(x, y))
    assert lab.signals.is_interrupt(raised.value)
    assert isinstance(raised.value, KeyboardInterrupt) == (source == "python generator")
    assert run.status == "interrupted" and len(run) == 3 == int(optimizer.iterations)
    [event] = run.events().itertuples()
    assert event.kind == "interrupt" and event.detail.startswith("KeyboardInterrupt")
    assert "apply" not in vars(optimizer) and "_backend_update_step" not in vars(optimizer)


def test_an_error_that_only_mentions_an_interrupt_is_no_interrupt():
    assert not lab.signals.is_interrupt(ValueError("KeyboardInterrupt"))
    assert not lab.signals.is_interrupt(RuntimeError("stopped"))
    try:
        raise RuntimeError("stopped") from KeyboardInterrupt()
    except RuntimeError as error:
        assert lab.signals.is_interrupt(error)


# ---- a Stepper ------------------------------------------------------------------

@pytest.mark.parametrize("source", ["python generator", "tf.data from a generator"])
def test_an_interrupt_in_a_steppers_data_is_recorded_and_no_step_is_lost(source):
    model = model_with()
    stream = batches_until_interrupt(3) if source == "python generator" else tf.data.Dataset.from_generator(
        lambda: batches_until_interrupt(3),
        output_signature=(tf.TensorSpec((8, 4), tf.float32), tf.TensorSpec((8, 1), tf.float32)))
    stepper = lab.Stepper(model, stream, run=lab.Run())
    with pytest.raises(BaseException) as raised:
        stepper.step(5)
    assert lab.signals.is_interrupt(raised.value)
    assert len(stepper.traces) == len(stepper.run) == 3 == int(model.optimizer.iterations)
    events = stepper.run.events()
    [detail] = events[events["kind"] == "interrupt"]["detail"]
    assert detail.startswith("KeyboardInterrupt in the data, reading step 3's batch")
    assert not lab.hooks.attached(model)


def test_an_interrupt_before_the_first_step_leaves_no_hook(monkeypatch, tmp_path):
    # fit() makes its train function after the recorder put its hooks on and
    # before any callback's on_train_begin.
    monkeypatch.setattr(keras.Model, "make_train_function",
                        raising_on_call(keras.Model.make_train_function, 1))
    model = model_with()
    recorder = lab.Recorder(gradients=True, path=str(tmp_path / "run.h5"))
    interrupted_fit(model, recorder)
    assert recorder.status == "interrupted" and len(recorder.run) == 0
    assert recorder.run.events()["detail"].tolist() == ["KeyboardInterrupt in fit()'s make_train_function()"]
    assert lab.Run.load(tmp_path / "run.h5").metadata["status"] == "interrupted"
    assert not lab.hooks.attached(model) and _attached_names(model) == []
    monkeypatch.undo()
    assert_usable_without_the_lab(model)
