"""Published keras-io guides and examples, run unchanged with the lab attached.

"Test against code nobody here wrote" (issue 13). Each section below is the
model and training code of one keras-io guide or example (keras-team/keras-io,
Apache License 2.0; the source path is named at the top of each section),
with only the data download replaced by small seeded random arrays and the
sizes shrunk (epochs, number of batches) so each guide trains in seconds.

For each guide, a run is trained three times from identical weights and data
order (`keras.utils.set_random_seed`, `shuffle=False`):

- `bare`: plain `fit()`, the reference;
- `oracle`: plain `fit()` plus a callback that resets the model's metrics at
  each batch begin, so each batch's Keras logs are that batch's own values
  (metric state touches no weight: its weights are checked equal to `bare`'s);
- `lab`: `fit()` with `lab.Recorder(gradients=True)`.

and checked: (1) final weights equal exactly, (2) optimizer variables equal,
(3) Keras' History equal, (4) per-batch values in `rec.run.batches()` equal the
batch's own, (5) a `grad_norm/<path>` column for every updated variable,
(6) `lab.Stepper` over the same batches gives fit()'s weights and rewinds
exactly, (7) no extra weights or `_lab*` attributes, save/load into a clean
copy, and a later plain `fit()` continues as on the bare model.
"""


import collections
import dataclasses

import keras
import pytest
import tensorflow as tf
import numpy as np

import lab

SEED = 1234


def optimizers_of(model):
    """Every optimizer held as an attribute of the model, `optimizer` first."""
    found = collections.OrderedDict()
    if getattr(model, "optimizer", None) is not None:
        found["optimizer"] = model.optimizer
    for name, value in sorted(vars(model).items()):
        if isinstance(value, keras.optimizers.Optimizer) and all(value is not v for v in found.values()):
            found[name] = value
    return found


def weights(model):
    return [np.array(v.numpy()) for v in model.weights]


def optimizer_state(model):
    return {name: [np.array(v.numpy()) for v in opt.variables] for name, opt in optimizers_of(model).items()}


def assert_same_arrays(got, expected, what):
    assert len(got) == len(expected), f"{what}: {len(got)} arrays, expected {len(expected)}"
    diffs = [float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)))) if np.size(a) else 0.0
             for a, b in zip(got, expected)]
    bad = [(i, d) for i, (a, b, d) in enumerate(zip(got, expected, diffs)) if not np.array_equal(a, b)]
    assert not bad, f"{what}: {len(bad)} of {len(got)} arrays differ, (index, max abs diff): {bad[:6]}"


def assert_same_optimizer_state(got, expected):
    assert list(got) == list(expected)
    for name in expected:
        assert_same_arrays(got[name], expected[name], f"optimizer {name!r} variables")


def variable_keys(variables):
    """`variable.path`, with `#2`, `#3`, ... for repeated paths (DESIGN.md)."""
    seen, keys = collections.Counter(), []
    for v in variables:
        seen[v.path] += 1
        keys.append(v.path if seen[v.path] == 1 else f"{v.path}#{seen[v.path]}")
    return keys


def lab_traces(model):
    """Names of attributes the lab may have left on the model or its optimizers."""
    left = []
    for owner, obj in [("model", model)] + [(n, o) for n, o in optimizers_of(model).items()]:
        left += [f"{owner}.{name}" for name in vars(obj) if name.startswith("_lab")]
        left += [f"{owner}.{name} (instance patch)" for name in ("train_step", "compute_loss", "apply",
                                                                "apply_gradients", "_backend_update_step")
                 if name in vars(obj)]
    return left


class BatchLogs(keras.callbacks.Callback):
    """Keeps each `on_train_batch_end` logs; with `reset=True` resets the
    model's metrics at each batch begin first (then logs are per batch)."""

    def __init__(self, reset=False):
        super().__init__()
        self.reset = reset
        self.logs = []

    def on_train_batch_begin(self, batch, logs=None):
        if self.reset:
            for metric in self.model.metrics:
                metric.reset_state()

    def on_train_batch_end(self, batch, logs=None):
        self.logs.append(dict(logs or {}))


@dataclasses.dataclass
class Three:
    make: object
    bare: keras.Model
    oracle: keras.Model
    lab: keras.Model
    initial: list
    history_bare: dict
    history_lab: dict
    logs_bare: list  # Keras' logs per batch, bare run (running values)
    logs_own: list  # each batch's own logs (oracle run)
    rec: lab.Recorder
    weights_before: int

    @property
    def rows(self):
        return self.rec.run.batches()


def fit_one(make, args, kwargs, callbacks):
    model = make()
    initial = weights(model)
    keras.utils.set_random_seed(SEED + 1)
    history = model.fit(*args, callbacks=callbacks, verbose=0, **kwargs)
    return model, initial, history.history


def fit_three(make, *args, oracle=True, recorder=None, **kwargs):
    kwargs.setdefault("shuffle", False)
    logs_bare = BatchLogs()
    bare, initial, history_bare = fit_one(make, args, kwargs, [logs_bare])
    if oracle:
        logs_own = BatchLogs(reset=True)
        oracle_model, initial_o, _ = fit_one(make, args, kwargs, [logs_own])
        assert_same_arrays(initial_o, initial, "initial weights (oracle)")
        assert_same_arrays(weights(oracle_model), weights(bare), "oracle run against the bare run")
    else:
        logs_own, oracle_model = None, None
    rec = recorder or lab.Recorder(gradients=True)
    labbed = make()
    count = len(labbed.weights)
    initial_l = weights(labbed)
    assert_same_arrays(initial_l, initial, "initial weights (lab)")
    keras.utils.set_random_seed(SEED + 1)
    history_lab = labbed.fit(*args, callbacks=[rec], verbose=0, **kwargs).history
    return Three(make, bare, oracle_model, labbed, initial, history_bare, history_lab, logs_bare.logs,
                 logs_own.logs if logs_own else None, rec, count)


# ---- the seven checks -----------------------------------------------------------


def check_weights(t):
    assert_same_arrays(weights(t.lab), weights(t.bare), "final weights, lab against bare fit()")


def check_optimizer(t):
    assert_same_optimizer_state(optimizer_state(t.lab), optimizer_state(t.bare))


def check_history(t):
    assert t.history_lab == t.history_bare


def check_batch_values(t, columns, own=True):
    """Each column of the run equals the batch's own value (own=True) or Keras'
    running value (own=False) of the same name, batch by batch."""
    rows = t.rows
    reference = t.logs_own if own else t.logs_bare
    assert len(rows) == len(reference), f"{len(rows)} rows for {len(reference)} batches"
    for column in columns:
        assert column in rows.columns, f"no column {column!r} in {list(rows.columns)}"
        np.testing.assert_allclose(
            rows[column].to_numpy(np.float64), [r[column] for r in reference], rtol=1e-6, atol=1e-7,
            err_msg=f"column {column!r} against the batch's {'own' if own else 'running'} values")


def updated_keys(t):
    """The lab model's keys of the trainable variables that training changed
    (twins are matched by position: Keras numbers layer names per process)."""
    initial = {id(v): a for v, a in zip(t.bare.weights, t.initial)}
    keys = variable_keys(t.lab.trainable_variables)
    assert len(keys) == len(t.bare.trainable_variables)
    return [k for k, v in zip(keys, t.bare.trainable_variables) if not np.array_equal(v.numpy(), initial[id(v)])]


def check_gradient_columns(t):
    rows = t.rows
    keys = updated_keys(t)
    assert keys, "training changed no variable"
    missing = [k for k in keys if f"grad_norm/{k}" not in rows.columns]
    assert not missing, f"no gradient column for {missing}; columns: {[c for c in rows.columns if c.startswith('grad')]}"
    values = rows[[f"grad_norm/{k}" for k in keys]].to_numpy()
    assert np.isfinite(values).all() and (values > 0).any(axis=0).all()


def check_stepper(t, data, batch_size, steps, replay=True, mode="graph"):
    """Stepping the same batches gives fit()'s weights; rewinding restores the
    state exactly (and, when the step is deterministic, replays identically)."""
    model = t.make()
    keras.utils.set_random_seed(SEED + 1)
    stepper = lab.Stepper(model, data, batch_size=batch_size, shuffle=False, mode=mode)
    half = max(1, steps // 2)
    stepper.step(half)
    middle_w, middle_o = weights(model), optimizer_state(model)
    stepper.step(steps - half)
    final_w, final_o = weights(model), optimizer_state(model)
    assert_same_arrays(final_w, weights(t.bare), "weights after stepping, against fit()")
    assert_same_optimizer_state(final_o, optimizer_state(t.bare))
    stepper.rewind(steps - half)
    assert_same_arrays(weights(model), middle_w, "weights after rewind")
    assert_same_optimizer_state(optimizer_state(model), middle_o)
    if replay:
        stepper.step(steps - half)
        assert_same_arrays(weights(model), final_w, "weights after replaying the rewound steps")
    return stepper


def check_no_trace(t, tmp_path, more=None):
    """No extra weights or lab attributes; save/load into a clean copy; a later
    plain fit() continues exactly as it does on the bare model."""
    assert len(t.lab.weights) == t.weights_before == len(t.bare.weights)
    assert lab_traces(t.lab) == []
    path = tmp_path / "lab.weights.h5"
    t.lab.save_weights(path)
    clean = t.make()
    # Build the clean copy's optimizers on the twin variables, so that
    # load_weights restores their state too (NOTES.md, Saving).
    position = {id(v): i for i, v in enumerate(t.lab.weights)}
    clean_optimizers = optimizers_of(clean)
    for name, opt in optimizers_of(t.lab).items():
        if opt.built and opt._trainable_variables:
            clean_optimizers[name].build([clean.weights[position[id(v)]] for v in opt._trainable_variables])
    clean.load_weights(path)
    assert_same_arrays(weights(clean), weights(t.lab), "weights loaded into a clean copy")
    assert_same_optimizer_state(optimizer_state(clean), optimizer_state(t.lab))
    if more is not None:
        args, kwargs = more
        kwargs.setdefault("shuffle", False)
        for model in (t.bare, t.lab):
            keras.utils.set_random_seed(SEED + 2)
            model.fit(*args, verbose=0, **kwargs)
        assert_same_arrays(weights(t.lab), weights(t.bare), "weights after a later plain fit()")


def rng(offset=0):
    return np.random.default_rng(SEED + offset)


# =================================================================================
# keras-io: guides/custom_train_step_in_tensorflow.py
# ("Customizing what happens in `fit()` with TensorFlow"): the first CustomModel,
# the lower-level one with its own metrics, the sample_weight one, and the GAN.
# Data: `np.random.random((1000, 32))` -> 128 seeded examples; epochs 3 -> 2.
# =================================================================================


class CustomModel(keras.Model):
    def train_step(self, data):
        # Unpack the data. Its structure depends on your model and
        # on what you pass to `fit()`.
        x, y = data

        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)  # Forward pass
            # Compute the loss value
            # (the loss function is configured in `compile()`)
            loss = self.compute_loss(y=y, y_pred=y_pred)

        # Compute gradients
        trainable_vars = self.trainable_variables
        gradients = tape.gradient(loss, trainable_vars)

        # Update weights
        self.optimizer.apply(gradients, trainable_vars)

        # Update metrics (includes the metric that tracks the loss)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)

        # Return a dict mapping metric names to current value
        return {m.name: m.result() for m in self.metrics}


def make_custom_model():
    keras.utils.set_random_seed(SEED)
    # Construct and compile an instance of CustomModel
    inputs = keras.Input(shape=(32,))
    outputs = keras.layers.Dense(1)(inputs)
    model = CustomModel(inputs, outputs)
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    return model


def regression_data(n=128):
    r = rng(1)
    return r.random((n, 32)), r.random((n, 1))


@pytest.fixture(scope="module")
def custom_model_runs():
    x, y = regression_data()
    return fit_three(make_custom_model, x, y, epochs=2, batch_size=32)


def test_custom_train_step_fit_is_unchanged(custom_model_runs):
    t = custom_model_runs
    check_weights(t)
    check_optimizer(t)
    check_history(t)


def test_custom_train_step_rows_hold_each_batch_own_values(custom_model_runs):
    check_batch_values(custom_model_runs, ["loss", "mae"])


def test_custom_train_step_gradient_columns_are_the_applied_gradients(custom_model_runs):
    t = custom_model_runs
    check_gradient_columns(t)
    # The first batch's gradients, by a tape on a clean copy at the initial weights.
    x, y = regression_data()
    model = make_custom_model()
    with tf.GradientTape() as tape:
        loss = keras.losses.MeanSquaredError()(y[:32], model(x[:32], training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    row = t.rows.iloc[0]
    for key, g in zip(variable_keys(t.lab.trainable_variables), grads):
        np.testing.assert_allclose(row[f"grad_norm/{key}"], np.linalg.norm(g.numpy()), rtol=1e-5)
    np.testing.assert_allclose(row["grad_norm"], np.sqrt(sum(np.sum(g.numpy() ** 2) for g in grads)), rtol=1e-5)


def test_custom_train_step_stepper_matches_fit_and_rewinds(custom_model_runs):
    x, y = regression_data()
    check_stepper(custom_model_runs, (x, y), batch_size=32, steps=8)


def test_custom_train_step_leaves_no_trace(custom_model_runs, tmp_path):
    x, y = regression_data()
    check_no_trace(custom_model_runs, tmp_path, more=((x, y), dict(epochs=1, batch_size=32)))
