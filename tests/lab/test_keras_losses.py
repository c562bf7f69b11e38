"""Keras' own losses, and the ways compile() combines them, with the lab attached.

Users compile whichever loss their task needs: one of `keras.losses` by
class or by name, with a reduction of their choice, a function of their own
or a `keras.losses.Loss` subclass; sample weights in the data or
`class_weight=` in fit(); a model with several outputs and a loss (and a
weight) for each, a layer's `add_loss`, a float64 loss or a mixed-precision
policy (whose compile() wraps the optimizer in a LossScaleOptimizer). For
each case, a small model is fit from the same weights bare and with
`lab.Recorder(gradients=True, weights=True)`, and stepped by a graph
`lab.Stepper`:

- the History, every weight and every optimizer variable are bare fit()'s,
  bit for bit;
- the rows' `loss` (and each output's `<name>_loss`, where Keras logs one)
  is the batch's own value, as a fit() that resets its metrics at every
  batch logs it, and its running mean over the epoch is the value Keras
  logs; the epoch table holds History's values;
- the Stepper's four steps (given fit()'s `class_weight` too) end with the
  state of fit()'s first epoch, and its rows' losses are fit()'s per-batch
  losses.
"""

import keras
import numpy as np
import pytest

import lab

# A model whose one output has no loss: bare fit() warns that its weights get no gradient.
pytestmark = pytest.mark.filterwarnings("ignore:Gradients do not exist:UserWarning")

L = keras.losses
BATCHES, BATCH = 4, 16
N = BATCHES * BATCH


# ---- data ----------------------------------------------------------------------------------------

def features(shape=(8,)):
    return np.random.default_rng(0).normal(size=(N, *shape)).astype("float32")


def targets(kind, x):
    rng = np.random.default_rng(1)
    label = (x[:, 0] > 0).astype("int32") + (x[:, 1] > 1)
    if kind == "regression":
        return (np.abs(x[:, :1] + 0.5 * x[:, 1:2]) + 0.5).astype("float32")
    if kind == "binary":
        return (x[:, :1] + 0.3 * x[:, 1:2] > 0).astype("float32")
    if kind == "signed":
        return np.where(x[:, :1] > 0, 1.0, -1.0).astype("float32")
    if kind == "onehot":
        return np.eye(3, dtype="float32")[label]
    if kind == "sparse":
        return label
    if kind == "ignored":  # a quarter of the labels are -1, the class to ignore
        return np.where(np.arange(N) % 4 == 3, -1, label).astype("int32")
    if kind == "distribution":
        logits = rng.normal(size=(N, 3))
        return (np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)).astype("float32")
    if kind == "vector":
        return (x[:, :3] + 0.1).astype("float32")
    if kind == "sequence":  # CTC: labels 1..4, 0 is the mask/blank
        return rng.integers(1, 5, size=(N, 3)).astype("int32")
    raise ValueError(kind)


# ---- single-output cases ---------------------------------------------------------------------------

# name -> (loss factory, target kind, output units, output activation ("unit": UnitNormalization))
SINGLE = {
    "MeanSquaredError": (lambda: L.MeanSquaredError(), "regression", 1, None),
    "MeanAbsoluteError": (lambda: L.MeanAbsoluteError(), "regression", 1, None),
    "MeanAbsolutePercentageError": (lambda: L.MeanAbsolutePercentageError(), "regression", 1, "softplus"),
    "MeanSquaredLogarithmicError": (lambda: L.MeanSquaredLogarithmicError(), "regression", 1, "softplus"),
    "Huber": (lambda: L.Huber(delta=0.5), "regression", 1, None),
    "LogCosh": (lambda: L.LogCosh(), "regression", 1, None),
    "Poisson": (lambda: L.Poisson(), "regression", 1, "softplus"),
    "CosineSimilarity": (lambda: L.CosineSimilarity(), "vector", 3, None),
    "BinaryCrossentropy": (lambda: L.BinaryCrossentropy(), "binary", 1, "sigmoid"),
    "BinaryCrossentropy/logits": (lambda: L.BinaryCrossentropy(from_logits=True), "binary", 1, None),
    "BinaryCrossentropy/smoothing": (lambda: L.BinaryCrossentropy(from_logits=True, label_smoothing=0.1),
                                     "binary", 1, None),
    "BinaryFocalCrossentropy": (lambda: L.BinaryFocalCrossentropy(apply_class_balancing=True, gamma=2.0),
                                "binary", 1, "sigmoid"),
    "CategoricalCrossentropy": (lambda: L.CategoricalCrossentropy(label_smoothing=0.1), "onehot", 3, "softmax"),
    "CategoricalCrossentropy/logits": (lambda: L.CategoricalCrossentropy(from_logits=True), "onehot", 3, None),
    "CategoricalFocalCrossentropy": (lambda: L.CategoricalFocalCrossentropy(), "onehot", 3, "softmax"),
    "SparseCategoricalCrossentropy": (lambda: L.SparseCategoricalCrossentropy(from_logits=True), "sparse", 3, None),
    "SparseCategoricalCrossentropy/ignore_class": (
        lambda: L.SparseCategoricalCrossentropy(from_logits=True, ignore_class=-1), "ignored", 3, None),
    "KLDivergence": (lambda: L.KLDivergence(), "distribution", 3, "softmax"),
    "Hinge": (lambda: L.Hinge(), "signed", 1, "tanh"),
    "SquaredHinge": (lambda: L.SquaredHinge(), "signed", 1, "tanh"),
    "CategoricalHinge": (lambda: L.CategoricalHinge(), "onehot", 3, None),
    "Tversky": (lambda: L.Tversky(alpha=0.3, beta=0.7), "binary", 1, "sigmoid"),
    "Dice": (lambda: L.Dice(), "binary", 1, "sigmoid"),
    "CTC": (lambda: L.CTC(), "sequence", 5, "softmax"),
    "Circle": (lambda: L.Circle(gamma=8), "sparse", 4, "unit"),
    "CategoricalGeneralizedCrossEntropy": (lambda: L.CategoricalGeneralizedCrossEntropy(q=0.5),
                                           "sparse", 3, "softmax"),
    # reductions
    "reduction/sum": (lambda: L.MeanSquaredError(reduction="sum"), "regression", 1, None),
    "reduction/sum_over_batch_size": (lambda: L.Huber(reduction="sum_over_batch_size"), "regression", 1, None),
    "reduction/mean": (lambda: L.CategoricalCrossentropy(reduction="mean"), "onehot", 3, "softmax"),
    "reduction/mean_with_sample_weight": (lambda: L.MeanSquaredError(reduction="mean_with_sample_weight"),
                                          "regression", 1, None),
    "reduction/None": (lambda: L.MeanSquaredError(reduction=None), "regression", 1, None),
    # how the loss is given
    "string": (lambda: "binary_crossentropy", "binary", 1, "sigmoid"),
    "function": (lambda: my_loss, "regression", 1, None),
    "subclass": (lambda: MyLoss(), "regression", 1, None),
    "dtype/float64": (lambda: L.MeanSquaredError(dtype="float64"), "regression", 1, None),
}
# The losses and reductions of later Keras versions than the oldest supported.
LATER = {"Circle": "Circle", "CategoricalGeneralizedCrossEntropy": "CategoricalGeneralizedCrossEntropy"}
LATER_REDUCTIONS = {"reduction/mean": "mean", "reduction/mean_with_sample_weight": "mean_with_sample_weight"}


def my_loss(y_true, y_pred):
    return keras.ops.mean(keras.ops.square(y_true - y_pred) + 0.1 * keras.ops.abs(y_true - y_pred), axis=-1)


class MyLoss(L.Loss):
    def call(self, y_true, y_pred):
        return keras.ops.mean(keras.ops.abs(y_true - y_pred) ** 1.5, axis=-1)


def reduction_allowed(reduction):
    try:
        L.MeanSquaredError(reduction=reduction)
    except ValueError:
        return False
    return True


def single(name, sample_weight=False, class_weight=False):
    """A case: (make, data, fit extras) for a one-output model."""
    loss, kind, units, activation = SINGLE[name]
    sequence = kind == "sequence"
    x = features((6, 8) if sequence else (8,))
    y = targets(kind, x)

    def make():
        keras.utils.set_random_seed(3)
        layers = [keras.Input(x.shape[1:]), keras.layers.Dense(8, activation="relu"),
                  keras.layers.Dense(units, activation=None if activation == "unit" else activation)]
        if activation == "unit":
            layers.append(keras.layers.UnitNormalization())
        model = keras.Sequential(layers)
        model.compile(keras.optimizers.Adam(0.01), loss())
        return model

    data = (x, y)
    if sample_weight:
        data = (x, y, np.linspace(0.0, 2.0, N).astype("float32"))
    extras = {"class_weight": {0: 0.5, 1: 2.0, 2: 1.0}} if class_weight else {}
    return make, data, extras


# ---- multi-output and other models ---------------------------------------------------------------

def two_outputs(loss, loss_weights=None, as_dict=False, sample_weight=False):
    """A regressor and a three-class classifier on one trunk, outputs `reg` and
    `clf`; `as_dict`: the model's outputs and the targets are dicts by name
    (Keras 3.5 pairs a dict of targets with a list of outputs out of order)."""
    x = features()
    y = [targets("regression", x), targets("onehot", x)]
    if as_dict:
        y = dict(zip(["reg", "clf"], y))

    def make():
        keras.utils.set_random_seed(3)
        inputs = keras.Input((8,))
        hidden = keras.layers.Dense(8, activation="relu", name="hidden")(inputs)
        outputs = [keras.layers.Dense(1, name="reg")(hidden),
                   keras.layers.Dense(3, activation="softmax", name="clf")(hidden)]
        model = keras.Model(inputs, dict(zip(["reg", "clf"], outputs)) if as_dict else outputs)
        model.compile(keras.optimizers.Adam(0.01), loss, loss_weights=loss_weights)
        return model

    data = (x, y)
    if sample_weight:
        data = (x, y, np.linspace(0.0, 2.0, N).astype("float32"))
    return make, data, {}


class ActivityPenalty(keras.layers.Layer):
    """Adds a penalty on its inputs to the model's losses (`add_loss`)."""

    def call(self, inputs):
        self.add_loss(1e-2 * keras.ops.sum(keras.ops.square(inputs)))
        return inputs


def with_add_loss():
    x = features()

    def make():
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, activation="relu"), ActivityPenalty(),
                                  keras.layers.Dense(1, kernel_regularizer=keras.regularizers.L2(1e-2))])
        model.compile(keras.optimizers.Adam(0.01), "mse")
        return model

    return make, (x, targets("regression", x)), {}


def under_policy(policy):
    """A classifier built and compiled under a mixed-precision policy (compile
    wraps its optimizer in a LossScaleOptimizer for mixed_float16)."""
    make, data, extras = single("SparseCategoricalCrossentropy")

    def made():
        keras.mixed_precision.set_dtype_policy(policy)
        try:
            return make()
        finally:
            keras.mixed_precision.set_dtype_policy("float32")

    return made, data, extras


CASES = {
    **{name: (lambda name=name: single(name)) for name in SINGLE},
    "sample_weight/MeanSquaredError": lambda: single("MeanSquaredError", sample_weight=True),
    "sample_weight/SparseCategoricalCrossentropy": lambda: single("SparseCategoricalCrossentropy", sample_weight=True),
    "sample_weight/reduction/sum": lambda: single("reduction/sum", sample_weight=True),
    "sample_weight/reduction/mean_with_sample_weight": lambda: single("reduction/mean_with_sample_weight",
                                                                      sample_weight=True),
    "class_weight/SparseCategoricalCrossentropy": lambda: single("SparseCategoricalCrossentropy", class_weight=True),
    "class_weight/BinaryCrossentropy": lambda: single("BinaryCrossentropy", class_weight=True),
    "outputs/list": lambda: two_outputs(["mse", "categorical_crossentropy"]),
    "outputs/dict": lambda: two_outputs({"reg": L.Huber(), "clf": L.CategoricalCrossentropy()}, as_dict=True),
    "outputs/loss_weights_list": lambda: two_outputs(["mse", "categorical_crossentropy"], loss_weights=[0.5, 2.0]),
    "outputs/loss_weights_dict": lambda: two_outputs({"reg": "mse", "clf": "categorical_crossentropy"},
                                                     loss_weights={"reg": 0.5, "clf": 2.0}, as_dict=True),
    "outputs/one_without_loss": lambda: two_outputs({"reg": "mse", "clf": None}, as_dict=True),
    "outputs/sample_weight": lambda: two_outputs(["mse", "categorical_crossentropy"], sample_weight=True),
    "add_loss": with_add_loss,
    "policy/mixed_float16": lambda: under_policy("mixed_float16"),
    "policy/mixed_bfloat16": lambda: under_policy("mixed_bfloat16"),
}


def case_params():
    params = []
    for name in CASES:
        base = name.split("/", 1)[1] if name.startswith(("sample_weight/", "class_weight/")) else name
        marks = []
        if base in LATER and not hasattr(L, LATER[base]):
            marks.append(pytest.mark.skip(reason=f"keras.losses.{LATER[base]} is newer than Keras {keras.__version__}"))
        if base in LATER_REDUCTIONS and not reduction_allowed(LATER_REDUCTIONS[base]):
            marks.append(pytest.mark.skip(reason=f"reduction={LATER_REDUCTIONS[base]!r} is newer than "
                                                 f"Keras {keras.__version__}"))
        params.append(pytest.param(name, marks=marks))
    return params


# ---- the checks ------------------------------------------------------------------------------------

class BatchLogs(keras.callbacks.Callback):
    """Keras' logs at each batch's end, and the model's state at the first
    epoch's end (reading it changes nothing)."""

    def __init__(self):
        super().__init__()
        self.rows, self.first_epoch = [], None

    def on_train_batch_end(self, batch, logs=None):
        self.rows.append({key: float(value) for key, value in logs.items()})

    def on_epoch_end(self, epoch, logs=None):
        if epoch == 0:
            self.first_epoch = state(self.model)


def state(model):
    return [v.numpy().tobytes() for v in model.weights + model.optimizer.variables]


def fitted(make, data, extras, callbacks=()):
    model = make()
    x, y, sample_weight = (*data, None)[:3]
    history = model.fit(x, y, sample_weight=sample_weight, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                        callbacks=list(callbacks), **extras).history
    return model, history


_BARE = {}


def bare(name):
    """The case's bare fit(): (case, model, History, Keras' batch logs), once per case."""
    if name not in _BARE:
        case = CASES[name]()
        logs = BatchLogs()
        try:
            model, history = fitted(*case, [logs])
        except ValueError as error:
            if name == "outputs/one_without_loss" and "No loss to compute" in str(error):
                pytest.skip(f"bare fit() of Keras {keras.__version__} takes no output without a loss: {error}")
            raise
        _BARE[name] = case, model, history, logs
    return _BARE[name]


def losses_of(logs):
    return [key for key in logs if key == "loss" or key.endswith("_loss")]


def check_losses(rows, keras_rows, running, epochs=2):
    """Each of Keras' logged losses has its column: the batch's own value,
    whose running mean over each epoch is what Keras logs at every batch (a
    first batch's value is Keras' own: the running value of one batch); or,
    where the run lists the column among its `running` values, Keras' value."""
    for key in losses_of(keras_rows[0]):
        assert key in rows, f"{key} is missing from the rows"
        values = rows[key].to_numpy(np.float64)
        logged = np.array([r[key] for r in keras_rows[:epochs * BATCHES]])
        if key in running:
            np.testing.assert_array_equal(values, logged, err_msg=f"{key}: listed as running, not Keras' value")
            continue
        first = np.arange(epochs * BATCHES) % BATCHES == 0
        np.testing.assert_array_equal(values[first], logged[first],
                                      err_msg=f"{key}: a first batch's loss is not Keras'")
        mean = np.concatenate([np.cumsum(v) / np.arange(1, BATCHES + 1) for v in values.reshape(epochs, BATCHES)])
        np.testing.assert_allclose(mean, logged, rtol=2e-6, err_msg=f"{key}: the rows' running mean is not Keras'")


_RECORDED = {}


def recorded(name):
    """The case's fit() with `lab.Recorder(gradients=True, weights=True)`, once per case."""
    if name not in _RECORDED:
        case = bare(name)[0]
        recorder = lab.Recorder(gradients=True, weights=True)
        model, history = fitted(*case, [recorder])
        _RECORDED[name] = model, history, recorder
    return _RECORDED[name]


@pytest.mark.parametrize("name", case_params())
def test_each_loss_trains_as_bare_fit_with_a_recorder(name):
    _, reference, bare_history, _ = bare(name)
    model, history, recorder = recorded(name)
    assert history == bare_history
    assert state(model) == state(reference), "the recorded fit() parted from bare fit()'s weights"
    epochs = recorder.run.epochs()
    for key, values in bare_history.items():
        assert list(epochs[key]) == pytest.approx(values, rel=1e-6), key
    rows = recorder.run.batches()
    assert np.isfinite(rows["grad_norm"]).all() and (rows["grad_norm"] > 0).all()
    for variable in model.trainable_variables:
        if name == "outputs/one_without_loss" and variable.path.startswith("clf/"):
            # No loss reaches it: no gradient, no update, no columns, and the run says so.
            warned = " ".join(recorder.run.events().query("kind == 'warning'")["detail"])
            assert f"{variable.path}" in warned and "no optimizer updates them" in warned
            continue
        column = f"weight_norm/{variable.path}"
        assert column in rows and np.isfinite(rows[column]).all(), f"{column} is missing or not finite"
    if name == "policy/mixed_float16":
        assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)  # what compile() made
        assert rows["grad_norm"].iloc[0] < 100, "the gradient norm is the scaled loss's"


@pytest.mark.parametrize("name", case_params())
def test_each_loss_has_its_columns_each_batchs_own_or_listed_as_running(name):
    _, _, _, logs = bare(name)
    _, _, recorder = recorded(name)
    rows = recorder.run.batches()
    assert len(rows) == 2 * BATCHES
    running = set(recorder.run.metadata.get(lab.schema.RUNNING_VALUES, []))
    assert "loss" not in running
    check_losses(rows, logs.rows, running)


@pytest.mark.newest_only
@pytest.mark.parametrize("name", case_params())
def test_each_loss_steps_as_fits_first_epoch(name):
    case, _, _, logs = bare(name)
    make, data, extras = case
    model = make()
    run = lab.Run()
    stepper = lab.Stepper(model, data, batch_size=BATCH, shuffle=False, mode="graph", run=run, **extras)
    trace = stepper.step(BATCHES)
    assert trace.error is None, trace.traceback
    assert state(model) == logs.first_epoch, "the Stepper parted from fit()'s weights"
    running = set(run.metadata.get(lab.schema.RUNNING_VALUES, [])) | {c for t in stepper.traces for c in t.running}
    check_losses(run.batches(), logs.rows, running, epochs=1)
