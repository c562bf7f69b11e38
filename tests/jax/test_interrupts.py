"""Interrupts during a recorded fit() on Keras' JAX backend: recorded as
interrupts wherever they land, the rows kept in memory and on disk, no hook
left (Keras' JAX fit() ends in a `finally` the recorder guards)."""

import json
import subprocess
import sys
from pathlib import Path

import keras
import pytest
from keras.src.backend.jax import trainer

import lab
from jax_models import classification_data, make_mlp

BATCH = 32  # 6 batches an epoch


def assert_left_interrupted(recorder, model, path):
    """Interrupted, a row per step the optimizer counted, in memory and in the file, and no hook left."""
    rows = int(model.optimizer.iterations)
    assert recorder.status == "interrupted" and len(recorder.run) == rows
    [event] = recorder.run.events().itertuples()
    assert event.kind == "interrupt" and event.detail.startswith("KeyboardInterrupt")
    saved = lab.Run.load(path)
    assert len(saved) == rows and saved.metadata["status"] == "interrupted"
    assert saved.events()["kind"].tolist() == ["interrupt"]
    assert not lab.hooks.attached(model)
    assert "train_step" not in vars(model) and "finalize_variable_values" not in vars(model.optimizer)
    assert not any("lab_ring" in v.path for v in model.optimizer.variables)
    return rows


class EpochEnds(keras.callbacks.Callback):
    ended = 0

    def on_epoch_end(self, epoch, logs=None):
        self.ended += 1


def raising_after_an_epoch(inner, epochs):
    """`inner` that raises KeyboardInterrupt instead at its first call once `epochs` counts an epoch's end."""
    def replaced(*args, **kwargs):
        if epochs.ended == 1:
            epochs.ended += 1
            raise KeyboardInterrupt
        return inner(*args, **kwargs)

    return replaced


@pytest.mark.parametrize("place", ["making the epoch's data iterator", "reading a batch", "the metrics' reset"])
def test_an_interrupt_in_keras_own_code_between_steps_is_recorded(place, monkeypatch, tmp_path):
    owner, name = {"making the epoch's data iterator": (trainer.JAXEpochIterator, "_get_iterator"),
                   "reading a batch": (trainer.JAXEpochIterator, "__next__"),
                   "the metrics' reset": (keras.Model, "reset_metrics")}[place]
    epochs = EpochEnds()
    monkeypatch.setattr(owner, name, raising_after_an_epoch(getattr(owner, name), epochs))
    x, y = classification_data()
    model = make_mlp()
    recorder = lab.Recorder(gradients=True, path=str(tmp_path / "run.h5"), flush_every=3600)
    with pytest.raises(KeyboardInterrupt):
        model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[recorder, epochs])
    assert assert_left_interrupted(recorder, model, tmp_path / "run.h5") == 6


def batches_until_interrupt(at):
    """A generator of batches that raises KeyboardInterrupt when asked for batch `at` (from 0)."""
    x, y = classification_data()
    for i in range(100):
        if i == at:
            raise KeyboardInterrupt
        yield x[:BATCH], y[:BATCH]


def test_an_interrupt_inside_a_data_generator_is_recorded(tmp_path):
    model = make_mlp()
    recorder = lab.Recorder(path=str(tmp_path / "run.h5"), flush_every=3600)
    with pytest.raises(KeyboardInterrupt):
        model.fit(batches_until_interrupt(4), epochs=1, steps_per_epoch=8, verbose=0, callbacks=[recorder])
    rows = assert_left_interrupted(recorder, model, tmp_path / "run.h5")
    # Every step that ran is a row: 4, or 3 where Keras reads a batch ahead of the step (3.11).
    assert rows == int(model.optimizer.iterations) and rows in (3, 4)


@pytest.mark.parametrize("how, status, kind", [("interrupt", "interrupted", "interrupt"), ("error", "failed", "error")])
def test_a_script_ended_by_its_fit_keeps_every_row_in_its_run_file(how, status, kind, tmp_path):
    error = "KeyboardInterrupt()" if how == "interrupt" else "RuntimeError('Keras failed')"
    script = (
        "import json, sys, numpy as np, keras, lab\n"
        "model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)]); model.compile('sgd', 'mse')\n"
        "x, y = np.ones((48, 4), 'f4'), np.ones((48, 1), 'f4')\n"
        f"error = {error}\n"
        "def should_eval(epoch, validation_freq):\n"
        "    raise error\n"
        "model._should_eval = should_eval\n"
        "rec = lab.Recorder(path=sys.argv[1], flush_every=3600, save_every=3600)\n"
        "print(json.dumps({'rows': 6}), flush=True)\n"
        "model.fit(x, y, batch_size=8, epochs=3, verbose=0, validation_data=(x, y), callbacks=[rec])\n"
    )
    path = tmp_path / "run.h5"
    out = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=300)
    assert out.returncode != 0, out.stdout[-2000:]
    [line] = [line for line in out.stdout.splitlines() if line.startswith("{")] or [out.stderr[-2000:]]
    saved = lab.Run.load(Path(path))
    assert len(saved) == json.loads(line)["rows"]
    assert saved.metadata["status"] == status and saved.events()["kind"].tolist() == [kind]


def test_an_interrupt_in_a_host_callback_of_a_watched_loop_is_recorded_as_one():
    # JAX raises a KeyboardInterrupt inside a host callback (a data pipeline's
    # io_callback) as JaxRuntimeError; the run says interrupted all the same.
    import jax
    import jax.numpy as jnp
    from test_watch import Guide, mnist_like

    def host(x):
        raise KeyboardInterrupt

    @jax.jit
    def augmented(x):
        jax.experimental.io_callback(host, None, x[0, 0])
        return x

    guide = Guide()
    state = guide.start()
    with pytest.raises(Exception, match="KeyboardInterrupt") as raised:
        with lab.watch(guide.model, guide.optimizer) as run:
            for step, (x, y) in enumerate(mnist_like(4)):
                if step == 2:
                    x = augmented(jnp.asarray(x))
                loss, state = guide.train_step(state, (x, y))
                run.step(loss=loss)
    assert not isinstance(raised.value, KeyboardInterrupt)
    assert run.status == "interrupted" and len(run) == 2
    [event] = run.events().itertuples()
    assert event.kind == "interrupt" and type(raised.value).__name__ in event.detail
    assert not lab.hooks.attached(guide.model)


def test_an_interrupt_in_a_steppers_data_is_recorded_and_no_step_is_lost():
    model = make_mlp()
    stepper = lab.Stepper(model, batches_until_interrupt(3), run=lab.Run())
    with pytest.raises(KeyboardInterrupt):
        stepper.step(5)
    assert len(stepper.traces) == len(stepper.run) == 3
    events = stepper.run.events()
    assert events[events["kind"] == "interrupt"]["detail"].tolist() == [
        "KeyboardInterrupt in the data, reading step 3's batch"]
    assert not lab.hooks.attached(model)
