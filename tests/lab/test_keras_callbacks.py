"""Keras' own callbacks beside the lab: what they do, and what they write,
is what they do and write without it.

A user attaches a Recorder to the callbacks the fit() already has. Each test
fits the same model twice from the same weights, once without the lab and
once with `lab.Recorder(gradients=True, weights=True)` among the callbacks,
and compares what a user sees: the weights, the optimizer's state, the
History, and each callback's own output (the files it writes, what it prints,
where it stops). Then it checks what the run says about that fit.

- BackupAndRestore: a fit interrupted by an exception, then resumed from its
  backup, with the Recorder kept across both fits, and with a new one;
- TerminateOnNaN: a loss that goes NaN stops fit() at the same batch;
- SwapEMAWeights with an optimizer's `use_ema=True`: validation on the moving
  averages, the weights swapped back;
- LearningRateScheduler, `initial_epoch` and `validation_freq`;
- CSVLogger and TensorBoard(update_freq="batch", histogram_freq=1): the
  files they write;
- the progress bar `fit(verbose=1)` prints;
- from keras-io's guides/training_with_built_in_methods.py: its PyDataset fed
  by 4 threads (and the Stepper over it), its ModelCheckpoint every few
  batches named by the loss, and its make_or_restore_model resuming from the
  latest checkpoint.
"""

import contextlib
import io
import os
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import lab

BATCH = 16


def data(n=96):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 8)).astype("float32")
    y = (x[:, :2].sum(axis=1, keepdims=True) > 0).astype("float32")
    return x, y


def make(optimizer=None):
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((8,), name="features"), keras.layers.Dense(16, activation="relu", name="hidden"),
                              keras.layers.BatchNormalization(name="norm"),
                              keras.layers.Dense(1, activation="sigmoid", name="out")], name="classifier")
    model.compile(optimizer or keras.optimizers.Adam(1e-2, name="adam"), "binary_crossentropy", metrics=["accuracy"])
    return model


def state(model):
    """Everything of the model a fit() may change, bit for bit."""
    return [v.numpy().tobytes() for v in model.weights + model.optimizer.variables]


def fit(model, callbacks, recorder=None, **kwargs):
    x, y = kwargs.pop("data", data())
    keras.utils.set_random_seed(5)
    callbacks = list(callbacks) + ([recorder] if recorder is not None else [])
    kwargs = {"batch_size": BATCH, "shuffle": False, "verbose": 0, "epochs": 3, **kwargs}
    return model.fit(x, y, callbacks=callbacks, **kwargs).history


def watching():
    return lab.Recorder(gradients=True, weights=True)


def warnings_of(recorder):
    events = recorder.run.events()
    return list(events[events["kind"] == "warning"]["detail"])


class InterruptAt(keras.callbacks.Callback):
    """Stops fit() with an exception after the optimizer's `iteration`-th update."""

    def __init__(self, iteration):
        super().__init__()
        self.iteration = iteration

    def on_train_batch_end(self, batch, logs=None):
        if int(self.model.optimizer.iterations.numpy()) == self.iteration:
            raise RuntimeError("interrupted")


def interrupted_and_resumed(backup_dir, recorders):
    """Two fits of 4 epochs of 6 batches with BackupAndRestore: the first
    interrupted after 15 updates (in its third epoch), the second resumed
    from the backup of its second epoch's end."""
    model, histories = make(), []
    for attempt, recorder in enumerate(recorders):
        callbacks = [keras.callbacks.BackupAndRestore(str(backup_dir))] + ([InterruptAt(15)] if attempt == 0 else [])
        try:
            histories.append(fit(model, callbacks, recorder, epochs=4))
        except RuntimeError as error:
            histories.append(str(error))
    return model, histories


def test_a_fit_resumed_by_backup_and_restore_trains_as_without_the_lab(tmp_path):
    bare, bare_histories = interrupted_and_resumed(tmp_path / "bare", [None, None])
    recorder = watching()
    model, histories = interrupted_and_resumed(tmp_path / "lab", [recorder, recorder])
    assert bare_histories[0] == "interrupted" and len(bare_histories[1]["loss"]) == 2  # resumed at epoch 3 of 4
    assert histories == bare_histories
    assert state(model) == state(bare)
    assert not (tmp_path / "lab").exists() and not (tmp_path / "bare").exists()  # Keras removes it when done
    # One run across both fits: the interrupted epoch's 3 rows, then that epoch
    # again from the backup, and the last one. The run tells the error, and
    # that the weights were put back after its 15th row.
    rows = recorder.run.batches()
    assert list(rows["step"]) == list(range(27))
    assert list(rows["epoch"]) == [0] * 6 + [1] * 6 + [2] * 3 + [2] * 6 + [3] * 6
    np.testing.assert_array_equal(rows["loss"].iloc[15:18], rows["loss"].iloc[12:15])  # the same batches, same weights
    events = recorder.run.events()
    assert "interrupted" in " ".join(events[events["kind"] == "error"]["detail"])
    told = [w for w in warnings_of(recorder) if "load_weights" in w]
    assert len(told) == 1 and "after step 14" in told[0]


def test_a_new_recorder_on_the_resumed_fit_starts_where_the_backup_does(tmp_path):
    # The backup's weights are put in before the run's first step: the run
    # starts from them, and there is nothing to tell. It said "after step -1".
    first, second = watching(), watching()
    interrupted_and_resumed(tmp_path / "lab", [first, second])
    rows = second.run.batches()
    assert list(rows["epoch"]) == [2] * 6 + [3] * 6 and list(rows["step"]) == list(range(12))
    assert not [w for w in warnings_of(second) if "load_weights" in w]


def test_terminate_on_nan_stops_at_the_same_batch_and_the_run_holds_it():
    x, y = data()
    y[40] = np.nan  # the third batch's loss is NaN
    bare, model, recorder = make(), make(), watching()
    bare_history = fit(bare, [keras.callbacks.TerminateOnNaN()], data=(x, y))
    history = fit(model, [keras.callbacks.TerminateOnNaN()], recorder, data=(x, y))
    assert len(bare_history["loss"]) == 1 and np.isnan(bare_history["loss"][0])  # stopped in the first epoch
    assert int(bare.optimizer.iterations.numpy()) == 3
    assert state(model) == state(bare)
    np.testing.assert_equal(history, bare_history)
    rows = recorder.run.batches()
    assert len(rows) == 3 and np.isnan(rows["loss"].iloc[-1]) and np.isfinite(rows["loss"].iloc[:2]).all()


def test_swap_ema_weights_validates_on_the_averages_as_without_the_lab():
    def ema_fit(recorder):
        model = make(keras.optimizers.Adam(1e-2, use_ema=True, ema_momentum=0.9))
        x, y = data()
        history = fit(model, [keras.callbacks.SwapEMAWeights(swap_on_epoch=True)], recorder,
                      validation_data=(x[:32], y[:32]))
        return model, history

    (bare, bare_history), recorder = ema_fit(None), watching()
    model, history = ema_fit(recorder)
    assert state(model) == state(bare)
    assert history == bare_history
    # The run's epochs hold the validation Keras ran on the averages, and the
    # run says where the model's weights came from at the end.
    assert recorder.run.epochs()["val_loss"].iloc[-1] == pytest.approx(bare_history["val_loss"][-1])
    assert "use_ema" in " ".join(warnings_of(recorder))


def test_learning_rate_scheduler_initial_epoch_and_validation_freq():
    def scheduled_fit(recorder):
        model = make()
        x, y = data()
        schedule = keras.callbacks.LearningRateScheduler(lambda epoch, rate: 0.01 / (epoch + 1))
        history = fit(model, [schedule], recorder, epochs=5, initial_epoch=1, validation_data=(x[:32], y[:32]),
                      validation_freq=2)
        return model, history

    (bare, bare_history), recorder = scheduled_fit(None), watching()
    model, history = scheduled_fit(recorder)
    assert state(model) == state(bare)
    assert history == bare_history
    rows, epochs = recorder.run.batches(), recorder.run.epochs()
    assert list(epochs["epoch"]) == [1, 2, 3, 4]
    # Each batch's rate is the one the scheduler set for its epoch.
    np.testing.assert_array_equal(rows["learning_rate"], (0.01 / (rows["epoch"] + 1)).astype("float32"))
    # Validated at every second epoch (the 2nd and 4th of the fit), as Keras' History has it.
    assert list(epochs["val_loss"].notna()) == [True, False, True, False]
    np.testing.assert_array_equal(epochs["val_loss"].dropna(), bare_history["val_loss"])


def test_csv_logger_writes_the_same_file(tmp_path):
    for name, recorder in (("bare", None), ("lab", watching())):
        fit(make(), [keras.callbacks.CSVLogger(str(tmp_path / f"{name}.csv"))], recorder)
    assert (tmp_path / "lab.csv").read_text() == (tmp_path / "bare.csv").read_text()


def summaries(log_dir):
    """Every scalar and histogram TensorBoard wrote: (run, tag, step) -> value."""
    found = {}
    for path in sorted(log_dir.rglob("events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(str(path)):
            for value in event.summary.value:
                found[(path.parent.name, value.tag, event.step)] = value.tensor.SerializeToString()
    return found


def test_tensorboard_writes_the_same_summaries(tmp_path):
    def logged(name, recorder):
        model = make()
        board = keras.callbacks.TensorBoard(str(tmp_path / name), update_freq="batch", histogram_freq=1)
        x, y = data()
        fit(model, [board], recorder, epochs=2, validation_data=(x[:32], y[:32]))
        return model

    bare, model = logged("bare", None), logged("lab", watching())
    assert state(model) == state(bare)
    bare_summaries, lab_summaries = summaries(tmp_path / "bare"), summaries(tmp_path / "lab")
    assert {tag for _, tag, _ in bare_summaries} >= {"batch_loss", "epoch_loss", "epoch_accuracy"}
    assert any(run == "train" and tag.endswith("kernel/histogram") for run, tag, _ in bare_summaries)
    assert lab_summaries == bare_summaries


def test_the_progress_bar_prints_what_it_prints_without_the_lab():
    def printed(recorder):
        model, out = make(), io.StringIO()
        x, y = data()
        with contextlib.redirect_stdout(out):
            fit(model, [], recorder, epochs=2, verbose=1, validation_data=(x[:32], y[:32]))
        # The bar redraws its line as time passes (how often depends on the
        # machine): each line as it ends, timings left out.
        ended = [line.rsplit("\r", 1)[-1] for line in out.getvalue().split("\n")]
        return re.sub(r"\d+m?s(/step)?", "<time>", "\n".join(ended))

    bare = printed(None)
    assert "val_loss" in bare and "Epoch 2/2" in bare
    assert printed(watching()) == bare


# =================================================================================
# keras-io's guides/training_with_built_in_methods.py, as a user pastes it:
# a PyDataset fed by 4 threads (fit()'s default shuffle shuffles its batch
# order), a ModelCheckpoint every few batches named by the batch's loss, and
# the guide's make_or_restore_model that resumes from the latest checkpoint.
# =================================================================================


class ExamplePyDataset(keras.utils.PyDataset):
    def __init__(self, x, y, batch_size, **kwargs):
        super().__init__(**kwargs)
        self.x = x
        self.y = y
        self.batch_size = batch_size

    def __len__(self):
        return int(np.ceil(len(self.x) / float(self.batch_size)))

    def __getitem__(self, idx):
        batch_x = self.x[idx * self.batch_size: (idx + 1) * self.batch_size]
        batch_y = self.y[idx * self.batch_size: (idx + 1) * self.batch_size]
        return batch_x, batch_y


def test_a_pydataset_fed_by_four_threads_trains_and_steps_as_without_the_lab():
    x, y = data()

    def threaded_fit(recorder):
        model = make()
        train = ExamplePyDataset(x, y, batch_size=16, workers=4)
        val = ExamplePyDataset(x[:32], y[:32], batch_size=16, workers=4)
        keras.utils.set_random_seed(5)
        callbacks = [recorder] if recorder is not None else []
        history = model.fit(train, validation_data=val, epochs=2, verbose=0, callbacks=callbacks).history
        return model, history

    (bare, bare_history), recorder = threaded_fit(None), watching()
    model, history = threaded_fit(recorder)
    assert state(model) == state(bare)
    assert history == bare_history
    assert len(recorder.run.batches()) == 12
    # The Stepper over the same PyDataset, shuffled as fit() shuffles it
    # after keras.utils.set_random_seed(5). Keras 3.5 shuffles it in a
    # tf.data buffer too, which the Stepper cannot step, and says so.
    stepped = make()
    if not lab.compat.PYDATASET_SHUFFLE_IS_PYTHON_RANDOM:
        with pytest.warns(UserWarning, match="shuffle=False to both"):
            lab.Stepper(stepped, ExamplePyDataset(x, y, batch_size=16, workers=4), seed=5)
        return
    lab.Stepper(stepped, ExamplePyDataset(x, y, batch_size=16, workers=4), seed=5, mode="graph").step(6)
    first_epoch = make()
    keras.utils.set_random_seed(5)
    first_epoch.fit(ExamplePyDataset(x, y, batch_size=16, workers=4), epochs=1, verbose=0)
    assert state(stepped) == state(first_epoch)


def test_checkpoints_every_few_batches_are_named_and_resumed_as_without_the_lab(tmp_path):
    x, y = data()

    def checkpointed(directory, recorder):
        model = make()
        checkpoint = keras.callbacks.ModelCheckpoint(filepath=str(directory / "model-loss={loss:.4f}.keras"),
                                                     save_freq=4)
        fit(model, [checkpoint], recorder, epochs=2)
        return model

    for name in ("bare", "lab"):
        (tmp_path / name).mkdir()
    checkpointed(tmp_path / "bare", None)
    checkpointed(tmp_path / "lab", watching())
    names = sorted(p.name for p in (tmp_path / "bare").iterdir())
    assert len(names) == 3  # every 4 of the 12 batches, each named by that batch's loss
    assert sorted(p.name for p in (tmp_path / "lab").iterdir()) == names

    def make_or_restore_model(directory):  # the guide's, without its fresh-model branch
        checkpoints = [os.path.join(directory, name) for name in os.listdir(directory)]
        latest_checkpoint = max(checkpoints, key=os.path.getctime)
        return keras.models.load_model(latest_checkpoint), os.path.basename(latest_checkpoint)

    (resumed_bare, bare_name), (resumed, name) = make_or_restore_model(tmp_path / "bare"), \
        make_or_restore_model(tmp_path / "lab")
    assert name == bare_name
    assert state(resumed) == state(resumed_bare)  # the checkpoint written with the lab is the bare one
    recorder = watching()
    fit(resumed_bare, [], epochs=1)
    fit(resumed, [], recorder, epochs=1)
    assert state(resumed) == state(resumed_bare)
    assert len(recorder.run.batches()) == 6
