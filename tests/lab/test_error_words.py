"""Errors Keras leaves bare get the lab's words: the input or return value at fault, its fix, and
`lab.inspect_data`; the error keeps its type. Arguments are checked where they are given."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import lab

RNG = np.random.default_rng(0)
X = RNG.random((32, 4), dtype=np.float32)
Y = RNG.integers(0, 3, 32).astype(np.int32)
LOGS_FIX = 'return {"loss": loss}'


def mlp():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


class ReturnsNoLogs(keras.Model):
    """A custom train_step that ends `return loss` (or returns nothing) instead of a dict of logs."""

    def __init__(self, returns):
        super().__init__()
        self.dense = keras.layers.Dense(3)
        self.returns = returns

    def call(self, x):
        return self.dense(x)

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
        self.optimizer.apply(tape.gradient(loss, self.trainable_variables), self.trainable_variables)
        return loss if self.returns == "loss" else None


def no_logs_model(returns, run_eagerly=False):
    keras.utils.set_random_seed(0)
    model = ReturnsNoLogs(returns)
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True), run_eagerly=run_eagerly)
    return model


# ---- a train_step that returns no dict of logs ------------------------------


class _BatchEnds(keras.callbacks.Callback):
    """A callback that watches batch ends, as every lab callback does."""

    def on_train_batch_end(self, batch, logs=None):
        pass


@pytest.mark.parametrize("returns, run_eagerly", [("loss", False), ("loss", True), (None, False), (None, True)])
def test_fit_with_a_train_step_returning_no_logs_says_what_it_returned_and_the_fix(returns, run_eagerly):
    # Keras' own error, whose type changes between releases ("'EagerTensor'
    # object has no attribute 'items'", "Attr 'Toutput_types' of
    # 'OptionalFromValue' Op passed list of length 0", ...): the lab keeps it.
    with pytest.raises(Exception) as bare:
        no_logs_model(returns, run_eagerly).fit(X, Y, batch_size=8, verbose=0, callbacks=[_BatchEnds()])
    recorder = lab.Recorder()
    with pytest.raises(Exception) as caught:
        no_logs_model(returns, run_eagerly).fit(X, Y, batch_size=8, verbose=0, callbacks=[recorder])
    assert type(caught.value) is type(bare.value)
    returned = "a tensor of shape ()" if returns == "loss" else "None"
    note = "\n".join(getattr(caught.value, "__notes__", []))
    assert f"train_step returned {returned}, not a dict of logs" in note and LOGS_FIX in note
    events = recorder.run.events()
    error = events[events["kind"] == "error"]["detail"].iloc[-1]
    assert f"train_step returned {returned}" in error and LOGS_FIX in error
    # The tracker was never updated because the step returned no logs: no event says otherwise.
    assert not events["detail"].str.contains("loss tracker").any()
    assert recorder.status == "failed"


@pytest.mark.parametrize("run_eagerly", [False, True])
def test_fit_without_targets_says_the_model_needs_them_and_how_to_give_them(run_eagerly):
    model = mlp()
    model.run_eagerly = run_eagerly
    recorder = lab.Recorder()
    with pytest.raises(ValueError) as caught:  # Keras': "None values not supported."
        model.fit(X, verbose=0, callbacks=[recorder])
    note = "\n".join(getattr(caught.value, "__notes__", []))
    assert "The data has no targets y" in note and "as fit(x, y) takes them" in note and "lab.inspect_data" in note
    assert "The data has no targets y" in recorder.run.events()["detail"].iloc[-1]


@pytest.mark.parametrize("data, error", [((X, Y + 5), tf.errors.InvalidArgumentError),
                                         ((X[:, :3], Y), ValueError)])
def test_fit_failing_on_its_data_points_to_inspect_data_which_names_the_fix(data, error):
    recorder = lab.Recorder()
    with pytest.raises(error) as caught:
        mlp().fit(*data, batch_size=8, verbose=0, callbacks=[recorder])
    note = "\n".join(getattr(caught.value, "__notes__", []))
    assert "lab.inspect_data(x, y, model=model)" in note
    assert "lab.inspect_data" in recorder.run.events()["detail"].iloc[-1]
    assert not lab.inspect_data(*data, batch_size=8, model=mlp()).ok  # which names it


@pytest.mark.parametrize("returns", ["loss", None])
@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_the_stepper_fails_a_train_step_returning_no_logs_as_fit_would_and_undoes_it(returns, mode):
    model = no_logs_model(returns)
    stepper = lab.Stepper(model, (X, Y), batch_size=8, shuffle=False, mode=mode)
    before = [w.copy() for w in model.get_weights()]
    trace = stepper.step()
    assert isinstance(trace.error, TypeError)
    assert "not a dict of logs" in str(trace.error) and LOGS_FIX in str(trace.error)
    for old, new in zip(before, model.get_weights()):
        np.testing.assert_array_equal(old, new)  # undone, as a failed step is


def test_a_step_function_returning_something_that_is_no_loss_is_named():
    model = mlp()
    trace = lab.Stepper.from_step(lambda x, y: "done", model, (X, Y)).step()
    assert isinstance(trace.error, TypeError)
    assert "returned a str" in str(trace.error) and "return its loss" in str(trace.error)


def test_a_step_function_may_return_its_loss():
    model = mlp()

    def step(x, y):
        return model.compute_loss(x=x, y=y, y_pred=model(x))

    trace = lab.Stepper.from_step(step, model, (X, Y)).step()
    assert trace.error is None and trace.row["loss"] > 0


# ---- the Stepper checks at construction what it used to fail on at every step --


@pytest.mark.parametrize("arguments, error, named", [
    ({"mode": "xla"}, ValueError, "lab.set_mode(model, 'xla'), then mode='graph'"),
    ({"mode": "fast"}, ValueError, "mode=...) must be one of ['eager', 'graph']"),
    ({"seed": "0"}, TypeError, "seed=...) must be a whole number"),
    ({"run": "run"}, TypeError, "run=...) must be a lab.Run"),
    ({"start_step": "a"}, TypeError, "start_step=...) must be a whole number"),
    ({"start_batch": 3}, TypeError, "start_batch=...) must be a pair (epoch, batch)"),
])
def test_the_stepper_refuses_bad_arguments_at_construction(arguments, error, named):
    with pytest.raises(error) as caught:
        lab.Stepper(mlp(), (X, Y), **arguments)
    assert named in str(caught.value)


def test_from_step_refuses_optimizer_names_at_construction():
    with pytest.raises(TypeError, match="optimizers=\\[opt\\]"):
        lab.Stepper.from_step(lambda x, y: {"loss": 0.0}, mlp(), (X, Y), optimizers="adam")


@pytest.mark.parametrize("data, named, fix", [
    ((X, Y, Y, Y), "data is a tuple of 4", "pass (x, y) or (x, y, sample_weight)"),
    (X, "The data has no targets y", "(x, y)"),
    ((X, Y + 5), "y holds class labels from 5 to 7, but the model outputs 3 classes", "Dense(8)"),
    ((np.array(["a"] * 32), Y), "x is an array of dtype <U1, which fit() refuses", "tf.constant(array)"),
])
def test_the_stepper_names_arrays_fit_would_fail_on_at_construction(data, named, fix):
    with pytest.raises(ValueError) as caught:
        lab.Stepper(mlp(), data, batch_size=8)
    message = str(caught.value)
    assert message.startswith("lab.Stepper: ") and named in message and fix in message
    assert "lab.inspect_data(x, y, model=model)" in message


def test_the_label_a_sparse_loss_ignores_is_no_label_out_of_range():
    model = mlp()
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=-1))
    labels = np.where(np.arange(32) % 4 == 0, -1, Y).astype(np.int32)
    assert lab.Stepper(model, (X, labels), batch_size=8).step().error is None


def test_x_alone_is_taken_for_a_train_step_that_needs_no_targets():
    model = ReturnsNoLogs("loss")
    model.compile("sgd")  # no compiled loss: nothing to compare y with
    lab.Stepper(model, X, batch_size=8)


@pytest.mark.parametrize("dataset, named", [
    (tf.data.Dataset.from_tensor_slices(X).batch(8), "The data has no targets y"),
    (tf.data.Dataset.from_tensor_slices((X, Y + 5)).batch(8), "y holds class labels from 5 to 7"),
    (tf.data.Dataset.from_tensor_slices(({"a": X}, Y)).batch(8), "The model cannot take x"),
])
@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_a_step_failing_on_a_dataset_the_model_does_not_take_names_the_problem(dataset, named, mode):
    try:
        mlp().fit(dataset, verbose=0)
    except Exception:  # noqa: BLE001 - fit() fails on this data, as the Stepper's step should
        pass
    else:
        pytest.skip(f"Keras {keras.__version__} trains on this dataset")
    trace = lab.Stepper(mlp(), dataset, mode=mode).step()
    assert trace.error is not None
    assert named in trace.hint and "lab.inspect_data(x, y, model=model)" in trace.hint


# ---- compare_modes ------------------------------------------------------------


@pytest.mark.parametrize("data, named", [
    (X, "The data has no targets y"),
    ((X,), "The data has no targets y"),
    ((np.array(["a"] * 32), Y), "x is an array of dtype <U1, which fit() refuses"),
    ((X, Y + 5), "y holds class labels from 5 to 7"),
    ((X, Y[:5]), "x and y differ in length"),
])
def test_compare_modes_names_arrays_fit_would_fail_on_at_the_call(data, named):
    with pytest.raises(ValueError) as caught:
        lab.compare_modes(mlp(), data, steps=4, modes=["eager"])
    assert str(caught.value).startswith("lab.compare_modes: ") and named in str(caught.value)
    assert "Fix: " in str(caught.value) and "lab.inspect_data" in str(caught.value)


@pytest.mark.parametrize("dataset, error, named", [
    (tf.data.Dataset.from_tensor_slices(X).batch(8), ValueError, "The data has no targets y"),
    (tf.data.Dataset.from_tensor_slices((X[:, :3], Y)).batch(8), ValueError, "expected axis -1"),
    (tf.data.Dataset.from_tensor_slices((X, Y + 5)).batch(8), tf.errors.InvalidArgumentError,
     "y holds class labels from 5 to 7"),
])
def test_compare_modes_adds_the_problem_to_keras_error_on_a_dataset(dataset, error, named):
    model = mlp()
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(error) as caught:  # Keras' own error, its type kept
        lab.compare_modes(model, dataset, steps=4, modes=["eager"])
    note = "\n".join(getattr(caught.value, "__notes__", []))
    assert note.startswith("lab.compare_modes: ") and named in note and "lab.inspect_data" in note
    for old, new in zip(before, model.get_weights()):
        np.testing.assert_array_equal(old, new)


# ---- inspect_data ---------------------------------------------------------------


def test_inspect_data_names_labels_outside_the_classes_of_a_sparse_loss():
    report = lab.inspect_data(X, Y + 5, batch_size=8, model=mlp())
    labels = [p for p in report.problems if p.kind == "labels"]
    assert labels and "from 5 to 7" in labels[0].message and "Dense(8)" in labels[0].fix


def test_inspect_data_refuses_a_model_that_is_no_model():
    with pytest.raises(TypeError, match="model=...\\) must be a keras.Model"):
        lab.inspect_data(X, Y, model="model")


def test_a_recorder_given_the_model_says_fit_hands_it_over():
    with pytest.raises(TypeError, match=r"takes no model.*callbacks=\[lab.Recorder\(\)\]"):
        lab.Recorder(mlp())


def test_a_dashboard_given_the_model_says_fit_hands_it_over():
    import widgets

    with pytest.raises(TypeError, match=r"widgets.Dashboard\(\) takes no model.*callbacks=\[widgets.Dashboard\(\)\]"):
        widgets.Dashboard(mlp())


def test_a_recorder_given_a_folder_to_save_to_says_so_at_construction(tmp_path):
    with pytest.raises(ValueError, match="is the folder .*give the file to save the run to"):
        lab.Recorder(path=tmp_path)


def test_a_python_list_of_labels_is_named_with_its_fix_where_keras_says_index_out_of_range():
    with pytest.raises(IndexError):  # Keras' own words: "tuple index out of range"
        mlp().fit(X, list(Y), verbose=0)
    with pytest.raises(ValueError, match=r"y is a Python list of 32 numbers.*np.asarray\(y\)"):
        lab.Stepper(mlp(), (X, list(Y)))
    assert "np.asarray(y)" in lab.inspect_data(X, list(Y)).problems[0].fix
