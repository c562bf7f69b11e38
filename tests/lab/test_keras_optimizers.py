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
  regrouping of SGD's arithmetic, `lab.probes.REGROUPED_NOTE`);
- every trainable variable has its gradient, weight-norm and update-ratio
  values in every row, and the row's learning rate is the optimizer's (each
  of a MultiOptimizer's optimizers in a column of its own);
- the Stepper's steps end where fit()'s first epoch ends, and a rewind puts
  back the weights and the optimizer's state.
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
