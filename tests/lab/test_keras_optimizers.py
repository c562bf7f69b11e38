"""Every optimizer Keras ships, with the lab attached.

Users pick whichever optimizer their paper used: each one's update step is
Keras' code, not ours, and each reads its gradients in its own way (Lion by
their sign, Adafactor by factored second moments, Muon by Newton-Schulz
iterations on 2-D kernels, a MultiOptimizer by handing each variable to an
optimizer of its own). For each optimizer in `keras.optimizers` of the
installed Keras, a small classifier is fit twice from the same weights, bare
and with `lab.Recorder(gradients=True, weights=True)`, and stepped by a graph
`lab.Stepper`:

- the weights, every optimizer variable and the History equal bare fit()'s
  bit for bit, or differ only where the run says they may (Grappler's
  regrouping of SGD's arithmetic, `lab.backend.tensorflow.probes.REGROUPED_NOTE`);
- every trainable variable has its gradient, weight-norm and update-ratio
  values in every row, and the row's learning rate is the optimizer's (each
  of a MultiOptimizer's optimizers in a column of its own);
- the Stepper's steps end where fit()'s first epoch ends, and a rewind puts
  back the weights and the optimizer's state.

Then the arguments every optimizer takes (clipping, `loss_scale_factor`,
`gradient_accumulation_steps`, `use_ema`, weight decay and its exclusions)
and learning-rate schedules (Keras' own and a user's subclass), with the same
checks, the rows' learning rate and gradient norms held against what the
update used, and `nonfinite()` keeping a NaN batch out as if fit() had
stopped before it.
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import lab

O = keras.optimizers
BATCHES = 4


def multi_optimizer():
    """The hidden layer trained by Adam, the rest by SGD (Keras 3.12 on)."""
    return O.MultiOptimizer(O.OptimizerMap(default_optimizer=O.SGD(0.1, name="sgd"),
                                           optimizer_map={"clf/hidden/.*": O.Adam(0.01, name="adam")}))


OPTIMIZERS = {
    "SGD": lambda: O.SGD(0.1),
    "SGD/momentum": lambda: O.SGD(0.1, momentum=0.9),
    "SGD/nesterov": lambda: O.SGD(0.1, momentum=0.9, nesterov=True),
    "RMSprop": lambda: O.RMSprop(),
    "Adam": lambda: O.Adam(),
    "AdamW": lambda: O.AdamW(),
    "Adadelta": lambda: O.Adadelta(),
    "Adafactor": lambda: O.Adafactor(),
    "Adagrad": lambda: O.Adagrad(),
    "Adamax": lambda: O.Adamax(),
    "Ftrl": lambda: O.Ftrl(),
    "Lamb": lambda: O.Lamb(),
    "Lion": lambda: O.Lion(),
    "Nadam": lambda: O.Nadam(),
    "Muon": lambda: O.Muon(exclude_layers=["out"]),
    "ScheduleFreeAdamW": lambda: O.ScheduleFreeAdamW(learning_rate=0.01),
    "MultiOptimizer": multi_optimizer,
}
# The optimizers of later Keras versions than the oldest supported.
LATER = {"Lamb": "Lamb", "Muon": "Muon", "ScheduleFreeAdamW": "ScheduleFreeAdamW", "MultiOptimizer": "MultiOptimizer"}


def params():
    return [pytest.param(name, marks=pytest.mark.skipif(not hasattr(O, LATER[name]),
                                                        reason=f"keras.optimizers.{LATER[name]} is newer than "
                                                               f"Keras {keras.__version__}"))
            if name in LATER else name for name in OPTIMIZERS]


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16 * BATCHES, 8)).astype("float32")
    y = (x[:, 0] > 0).astype("int32") + (x[:, 1] > 1)
    return x, y


def make(name):
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu", name="hidden"),
                              keras.layers.BatchNormalization(name="norm"), keras.layers.Dense(3, name="out")],
                             name="clf")
    model.compile(OPTIMIZERS[name](), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def state(model):
    return [v.numpy().tobytes() for v in model.weights + model.optimizer.variables]


def fitted(name, callbacks=(), epochs=2):
    model = make(name)
    history = model.fit(*data(), batch_size=16, epochs=epochs, shuffle=False, verbose=0,
                        callbacks=list(callbacks)).history
    return model, history


def parts(model):
    """The optimizers whose learning rates the rows hold, by column."""
    multi = getattr(O, "MultiOptimizer", None)
    if multi is not None and isinstance(model.optimizer, multi):
        return {f"learning_rate/optimizer/{o.name}": o for o in model.optimizer.optimizers}
    return {"learning_rate": model.optimizer}


@pytest.mark.parametrize("name", params())
def test_each_keras_optimizer_trains_as_bare_fit_and_every_variable_has_its_columns(name):
    bare, bare_history = fitted(name)
    recorder = lab.Recorder(gradients=True, weights=True)
    model, history = fitted(name, [recorder])
    assert history == bare_history
    warned = " ".join(recorder.run.events().query("kind == 'warning'")["detail"])
    assert state(model) == state(bare) or "Grappler" in warned, "weights parted from bare fit()'s, and the run said nothing"
    rows = recorder.run.batches()
    assert len(rows) == 2 * BATCHES
    for variable in model.trainable_variables:
        for prefix in ("grad_norm/", "weight_norm/", "update_ratio/"):
            column = prefix + variable.path
            assert column in rows and rows[column].notna().all(), f"{column} is missing or empty"
            assert (rows[column] > 0).any()
    assert rows["grad_norm"].notna().all() and rows["updated"].eq(1).all()
    for column, optimizer in parts(model).items():
        np.testing.assert_allclose(rows[column], float(keras.ops.convert_to_numpy(optimizer.learning_rate)),
                                   rtol=1e-6)


def stepped_and_replayed(name, mode):
    """A Stepper's steps over fit()'s first epoch, checked against it, then
    rewound to the start and taken again."""
    model = make(name)
    initial = [v.numpy().tobytes() for v in model.weights]
    stepper = lab.Stepper(model, data(), batch_size=16, shuffle=False, mode=mode)
    reference = make(name)
    reference.run_eagerly = mode == "eager"
    reference.fit(*data(), batch_size=16, epochs=1, shuffle=False, verbose=0)
    regrouped = name.startswith("SGD") and mode == "graph"
    with pytest.warns(RuntimeWarning, match="Grappler") if regrouped else _nothing():
        stepper.step(BATCHES)
    assert state(model) == state(reference) or regrouped  # SGD: the Grappler warning above
    trace = stepper.last_trace
    assert trace.error is None and set(trace.gradients) >= {v.path for v in model.trainable_variables}
    stepper.rewind(BATCHES)
    assert [v.numpy().tobytes() for v in model.weights] == initial
    assert int(model.optimizer.iterations.numpy()) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a replay that parts from the first run warns
        stepper.step(BATCHES)
    assert state(model) == state(reference) or regrouped


@pytest.mark.newest_only
@pytest.mark.parametrize("name", params())
def test_each_keras_optimizer_steps_as_fit_and_replays_after_a_rewind(name):
    stepped_and_replayed(name, "graph")


@pytest.mark.skipif(not hasattr(O, "ScheduleFreeAdamW"), reason="keras.optimizers.ScheduleFreeAdamW is newer")
def test_an_optimizer_that_sets_its_state_as_it_builds_is_rewound_to_it():
    # ScheduleFreeAdamW starts its momentum at the weights when it is built,
    # in the first step's apply. The eager Stepper rewound it to the zeros it
    # was made with, and the replay parted from fit()'s weights.
    stepped_and_replayed("ScheduleFreeAdamW", "eager")


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.skipif(not hasattr(O, "MultiOptimizer"), reason="keras.optimizers.MultiOptimizer is newer")
@pytest.mark.parametrize("breakpoints", [False, True], ids=["plain", "nonfinite"])
def test_a_multi_optimizer_is_watched_in_a_hand_written_loop_and_under_breakpoints(breakpoints):
    # Its apply() hands each variable to an optimizer of its own: the lab saw
    # no update step, and its gradient columns stayed empty, the run silent.
    x, y = data()
    if breakpoints:
        recorder = lab.Recorder(gradients=True, breakpoints=[lab.breakpoints.nonfinite()])
        bare, _ = fitted("MultiOptimizer")
        model, _ = fitted("MultiOptimizer", [recorder])
        assert state(model) == state(bare)
        rows = recorder.run.batches()
        assert rows["updated/optimizer"].eq(1).all()
    else:
        model = make("MultiOptimizer")
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

        @tf.function
        def train_step(xb, yb):
            with tf.GradientTape() as tape:
                loss = loss_fn(yb, model(xb, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            model.optimizer.apply(grads, model.trainable_variables)
            return loss

        with lab.watch(model, model.optimizer, weights=True) as run:
            for i in range(BATCHES):
                run.step(loss=train_step(x[16 * i:16 * (i + 1)], y[16 * i:16 * (i + 1)]))
        rows = run.batches()
    assert len(rows) == 2 * BATCHES or len(rows) == BATCHES
    for variable in model.trainable_variables:
        assert rows[f"grad_norm/{variable.path}"].notna().all()
    assert {"learning_rate/optimizer/adam", "learning_rate/optimizer/sgd"} <= set(rows), list(rows)


# The arguments every Keras optimizer takes, and the learning-rate schedules:
# each changes what the update consumes (a clipped gradient, one divided
# back by the loss scale, an accumulated one, a decayed rate) or what the
# weights hold (a moving average written over them, decoupled weight decay).
# The lab must train as bare fit() with each, record the learning rate the
# update used and the gradient it applied, and step and rewind exactly.
S = keras.optimizers.schedules


class HalvingEvery(S.LearningRateSchedule):
    """A schedule of the user's own: the rate halves every `every` steps."""

    def __init__(self, initial, every):
        self.initial, self.every = initial, every

    def __call__(self, step):
        return self.initial * keras.ops.power(0.5, keras.ops.floor(keras.ops.cast(step, "float32") / self.every))

    def get_config(self):
        return {"initial": self.initial, "every": self.every}


OPTIONS = {
    "clipvalue": lambda: O.Adam(0.01, clipvalue=0.01),
    "global_clipnorm": lambda: O.Adam(0.01, global_clipnorm=0.05),
    "loss_scale_factor": lambda: O.Adam(0.01, loss_scale_factor=128.0),
    "gradient_accumulation_steps": lambda: O.Adam(0.01, gradient_accumulation_steps=2),
    "use_ema": lambda: O.Adam(0.01, use_ema=True, ema_momentum=0.9, ema_overwrite_frequency=3),
    "weight_decay": lambda: O.SGD(0.1, momentum=0.9, weight_decay=0.05),
    "AdamW/exclude": lambda: exclude_biases(O.AdamW(0.01, weight_decay=0.1)),
    "CosineDecay": lambda: O.Adam(S.CosineDecay(0.01, decay_steps=5, warmup_target=0.02, warmup_steps=2)),
    "schedule of the user's own": lambda: O.Adam(HalvingEvery(0.01, 3)),
}


def exclude_biases(optimizer):
    optimizer.exclude_from_weight_decay(var_names=["bias"])
    return optimizer


def with_options(name):
    """The classifier of `make`, compiled with OPTIONS[name]."""
    model = make("SGD")
    model.compile(OPTIONS[name](), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def fitted_with_options(name, callbacks=(), x=None, epochs=2):
    model = with_options(name)
    x = data()[0] if x is None else x
    history = model.fit(x, data()[1], batch_size=16, epochs=epochs, shuffle=False, verbose=0,
                        callbacks=list(callbacks)).history
    return model, history


def rate_at(optimizer, iteration):
    rate = optimizer._learning_rate
    if isinstance(rate, S.LearningRateSchedule):
        rate = rate(iteration)
    return float(keras.ops.convert_to_numpy(rate))


@pytest.mark.parametrize("name", list(OPTIONS))
def test_each_optimizer_option_trains_as_bare_fit_and_its_rows_hold_what_the_update_used(name):
    bare, bare_history = fitted_with_options(name)
    recorder = lab.Recorder(gradients=True, weights=True)
    model, history = fitted_with_options(name, [recorder])
    assert history == bare_history
    assert state(model) == state(bare) or regrouped_and_said(name, recorder)
    rows = recorder.run.batches()
    assert len(rows) == 2 * BATCHES
    updated = rows["updated"].eq(1)
    assert updated.all() or ("accumulation" in name and updated.tolist() == [False, True] * BATCHES)
    for variable in model.trainable_variables:
        assert rows["grad_norm/" + variable.path].notna().all()
        for prefix in ("weight_norm/", "update_ratio/"):  # of the steps that updated the weights
            assert rows[prefix + variable.path].notna().eq(updated).all(), prefix + variable.path
    # Each row's rate is the one its update used: the schedule's value at
    # the optimizer's iteration as the step began (none where no update ran).
    iterations = np.cumsum(np.r_[0, updated.to_numpy()[:-1]])
    np.testing.assert_allclose(rows["learning_rate"][updated],
                               [rate_at(model.optimizer, i) for i in iterations[updated]], rtol=1e-6)
    assert rows["learning_rate"][~updated].isna().all()


def regrouped_and_said(name, recorder):
    """Plain SGD's update regrouped by Grappler (lab.backend.tensorflow.probes.REGROUPED_NOTE),
    which the run must say."""
    warned = " ".join(recorder.run.events().query("kind == 'warning'")["detail"])
    return name == "weight_decay" and "Grappler" in warned


def fits_end(model):
    """The state fit() ends with: with `use_ema`, fit() writes the moving
    averages over the trainable weights as it ends."""
    optimizer = model.optimizer
    if not optimizer.use_ema:
        return state(model)
    averages = {v.path: a for v, a in zip(optimizer._trainable_variables, optimizer._model_variables_moving_average)}
    return [averages.get(v.path, v).numpy().tobytes() for v in model.weights] + state(model)[len(model.weights):]


@pytest.mark.parametrize("name", ["clipvalue", "global_clipnorm", "loss_scale_factor"])
def test_the_gradient_columns_hold_the_gradients_the_update_applied(name):
    # Clipped where the optimizer clips; divided back by the loss scale
    # factor the loss was multiplied by, as the update divides it.
    recorder = lab.Recorder(gradients=True)
    model = with_options(name)
    fresh = with_options(name)
    x, y = data()
    model.fit(x[:16], y[:16], batch_size=16, shuffle=False, verbose=0, callbacks=[recorder])
    with tf.GradientTape() as tape:
        loss = fresh.compute_loss(x[:16], y[:16], fresh(x[:16], training=True), training=True)
    grads = tape.gradient(loss, fresh.trainable_variables)
    optimizer = fresh.optimizer
    if optimizer.clipvalue:
        grads = [tf.clip_by_value(g, -optimizer.clipvalue, optimizer.clipvalue) for g in grads]
    if optimizer.global_clipnorm:
        grads = tf.clip_by_global_norm(grads, optimizer.global_clipnorm)[0]
    row = recorder.run.batches().iloc[0]
    clipped = 0
    for variable, grad in zip(model.trainable_variables, grads):
        want = float(tf.norm(grad))
        np.testing.assert_allclose(row["grad_norm/" + variable.path], want, rtol=1e-5)
        clipped += name != "loss_scale_factor" and want < float(tf.norm(tape_free(fresh, variable, x, y))) - 1e-6
    assert clipped or name == "loss_scale_factor", "the case should clip some gradient"


def tape_free(model, variable, x, y):
    """The unclipped gradient of one variable on the first batch."""
    with tf.GradientTape() as tape:
        loss = model.compute_loss(x[:16], y[:16], model(x[:16], training=True), training=True)
    return tape.gradient(loss, model.trainable_variables[[v.path for v in model.trainable_variables].index(
        variable.path)])


@pytest.mark.newest_only
@pytest.mark.parametrize("name", list(OPTIONS))
def test_each_optimizer_option_steps_as_fit_and_replays_after_a_rewind(name):
    model = with_options(name)
    initial = [v.numpy().tobytes() for v in model.weights]
    stepper = lab.Stepper(model, data(), batch_size=16, shuffle=False, mode="graph")
    reference, _ = fitted_with_options(name, epochs=1)
    regrouped = name == "weight_decay"  # plain SGD: lab.backend.tensorflow.probes.REGROUPED_NOTE
    with pytest.warns(RuntimeWarning, match="Grappler") if regrouped else _nothing():
        stepper.step(BATCHES)
    assert fits_end(model) == state(reference) or regrouped
    stepper.rewind(BATCHES)
    assert [v.numpy().tobytes() for v in model.weights] == initial
    assert int(model.optimizer.iterations.numpy()) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stepper.step(BATCHES)
    assert fits_end(model) == state(reference) or regrouped


@pytest.mark.parametrize("name", list(OPTIONS))
def test_each_optimizer_option_keeps_a_nan_batch_out_as_if_fit_had_stopped_before_it(name):
    x, y = data()
    poisoned = x.copy()
    poisoned[2 * 16 + 3, 5] = np.nan
    recorder = lab.Recorder(gradients=True, breakpoints=[lab.breakpoints.nonfinite()])
    model, _ = fitted_with_options(name, [recorder], x=poisoned)
    twin = with_options(name)
    twin.fit(x[:32], y[:32], batch_size=16, shuffle=False, verbose=0)
    assert recorder.status == "stopped"
    assert state(model) == state(twin) or regrouped_and_said(name, recorder)
    assert [e for e in recorder.run.events()["kind"] if e == "nonfinite"] == ["nonfinite"]
