"""Hand-written training loops the way users write them, under `lab.watch`.

A sweep of the custom-loop variants of the keras-io guides
(guides/writing_a_custom_training_loop_in_tensorflow.py: `optimizer.apply`
in a `tf.function`, the GAN's two optimizers; guides/mixed_precision.py's
Keras 3 form: a `LossScaleOptimizer` with `scale_loss`) and of TensorFlow's
custom-loop tutorials (a persistent tape, `tape.watch` on an input,
`watch_accessed_variables=False`, gradient accumulation and clipping by
hand), each small, on the bundled digits:

- `apply_gradients(zip(grads, vars))` and `apply(grads, vars)` with the
  gradients of a subset of the variables (the body is skipped by the user),
  given in another order than `model.trainable_variables`;
- two `apply` calls per step on disjoint subsets with one optimizer (built
  first on all the variables, as Keras asks), `apply(grads)` with no
  variables (those the optimizer was built on, reordered), and a GAN's two
  optimizers in one `tf.function`;
- an Embedding, whose gradients are IndexedSlices with repeated rows; a
  learnable temperature no model holds, applied with the model's variables;
- `tf.function(jit_compile=True)`, `tf.function(reduce_retracing=True)` on
  batches of three sizes, and a fully eager step;
- a persistent tape with two losses, a gradient penalty through
  `tape.watch(x)`, `watch_accessed_variables=False` with `tape.watch(vars)`;
- accumulation over 2 batches into the user's own `tf.Variable`s, applied
  every second step, `run.step` at each batch;
- mixed precision by hand (`mixed_float16`, `LossScaleOptimizer`,
  `scale_loss`; the optimizer unscales in `apply`), whose first steps
  overflow and are skipped by Keras;
- clipping by `tf.clip_by_global_norm` before the apply.

- the tf.distribute guide's loop (`strategy.run` + `strategy.reduce` in a
  `tf.function`, `tf.nn.compute_average_loss`) under a MirroredStrategy on
  two virtual CPUs, in a fresh process (`_scripts/mirrored_watch_twins.py`:
  TensorFlow fixes its devices at first use), Adam built in the scope.

Each variant runs three times from the same seed: bare; watched with
`gradients=True, weights=True` (then on bare for two more batches); and
watched with `breakpoints=[lab.breakpoints.nonfinite()]` on data with a NaN
in one batch. Checked: the weights and every optimizer variable are bit for
bit the bare loop's, after the block and after the later bare phase (XLA
may round differently with the lab's reads compiled in, and the run says
so); one row per `run.step`, each `grad_norm/<path>` the norm of the
gradient the update applied (returned by the step of the bare loop), NaN
where the step applied none; the run's warnings are the expected ones and
no others; nothing of the lab is left on the model or optimizers; and with
`nonfinite()` the update carrying the NaN is kept out, `run.step` raises at
that step, and the state is the bare loop's stopped before the NaN batch.

Finding: under a LossScaleOptimizer, a watched loop's `nonfinite()` gate
checked nothing before the update (the optimizer's own skip of overflowing
scaled gradients is its business; the loss reaches the lab only at
`run.step`), so a NaN batch went by with no hit and no event while Keras
skipped it and halved the scale; fit() stops there ("not finite: loss").
The gate now checks the loss the step hands `scale_loss` (in the update's
graph): the mixed-precision variants' nonfinite runs.
"""

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import layers

import lab

SEED = 11
BATCH = 16
WATCHED = 4  # batches in the watched block
LATER = 2  # bare batches after it
BAD = 2  # the batch that gets a NaN in the nonfinite run
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
KERAS = tuple(int(p) for p in keras.__version__.split(".")[:2])


@pytest.fixture(scope="module")
def data():
    (x, y), _ = lab.datasets.digits()
    n = WATCHED + LATER
    return [(x[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH]) for i in range(n)]


def mlp(name="net"):
    keras.utils.set_random_seed(SEED)
    return keras.Sequential([keras.Input((64,)), layers.Dense(8, activation="tanh", name="body"),
                             layers.Dense(10, name="head")], name=name)


class Holder(keras.Model):
    """Holds the networks (and optimizers) a loop trains together, for `lab.watch`."""

    def __init__(self, **parts):
        super().__init__()
        for name, part in parts.items():
            setattr(self, name, part)


def applied(variables, grads):
    return {v.path: g for v, g in zip(variables, grads)}


# ---- the loops ---------------------------------------------------------------
# Each `step(i, x, y)` is the user's step; it returns the loss and what the
# update applied ({variable path: gradient}; empty where the step applied
# nothing). `warnings`: text each expected warning event of the watched run
# holds. `hit`: the step at which the NaN reaches an update (None: the
# loop's own optimizer handles it, no hit).


class Loop:
    warnings = ()
    hit = BAD
    exact = True  # weights bit for bit (False: the run must say why not)
    extra = ()  # variables the loop trains that no model holds

    def __init__(self):
        self.model = mlp()
        self.optimizer = keras.optimizers.Adam(1e-2)
        self.optimizers = [self.optimizer]
        self.setup()

    def setup(self):
        self.train_step = tf.function(self.body)

    def step(self, i, x, y):
        return self.train_step(x, y)

    @property
    def watched(self):
        return self.model


class SubsetApplyGradients(Loop):
    # The user fine-tunes the head only: its variables, bias first.
    warnings = ("net/body/kernel, net/body/bias: trainable variables of the watched model that no watched optimizer",)

    def body(self, x, y):
        head = self.model.get_layer("head")
        variables = [head.bias, head.kernel]
        with tf.GradientTape() as tape:
            loss = LOSS(y, self.model(x, training=True))
        grads = tape.gradient(loss, variables)
        self.optimizer.apply_gradients(zip(grads, variables))
        return loss, applied(variables, grads)


class SubsetApply(SubsetApplyGradients):
    def body(self, x, y):
        head = self.model.get_layer("head")
        variables = [head.bias, head.kernel]
        with tf.GradientTape() as tape:
            loss = LOSS(y, self.model(x, training=True))
        grads = tape.gradient(loss, variables)
        self.optimizer.apply(grads, variables)
        return loss, applied(variables, grads)


class TwoAppliesOneOptimizer(Loop):
    def setup(self):
        # Keras refuses an apply on variables the optimizer was not built
        # on: the user builds it on all of them first.
        self.optimizer.build(self.model.trainable_variables)
        super().setup()

    def body(self, x, y):
        body, head = self.model.get_layer("body"), self.model.get_layer("head")
        with tf.GradientTape() as tape:
            loss = LOSS(y, self.model(x, training=True))
        grads = tape.gradient(loss, body.trainable_variables + head.trainable_variables)
        self.optimizer.apply(grads[2:], head.trainable_variables)
        self.optimizer.apply(grads[:2], body.trainable_variables)
        return loss, applied(body.trainable_variables + head.trainable_variables, grads)


class ApplyToTheBuiltVariables(Loop):
    # `optimizer.apply(grads)` with no variables: those it was built on, here
    # in another order than the model's.
    def setup(self):
        self.variables = self.model.trainable_variables[::-1]
        self.optimizer.build(self.variables)
        super().setup()

    def body(self, x, y):
        with tf.GradientTape() as tape:
            loss = LOSS(y, self.model(x, training=True))
        grads = tape.gradient(loss, self.variables)
        self.optimizer.apply(grads)
        return loss, applied(self.variables, grads)


class OutsideVariable(Loop):
    # A learnable temperature the loop holds, applied with the model's
    # variables: its column is `grad_norm/<its path>`.
    def setup(self):
        self.temperature = keras.Variable(1.0, name="temperature")
        self.extra = [self.temperature]
        super().setup()

    def body(self, x, y):
        variables = self.model.trainable_variables + [self.temperature]
        with tf.GradientTape() as tape:
            loss = LOSS(y, self.model(x, training=True) / self.temperature)
        grads = tape.gradient(loss, variables)
        self.optimizer.apply_gradients(zip(grads, variables))
        return loss, applied(variables, grads)


class Embedding(Loop):
    # An Embedding's gradient is an IndexedSlices whose rows repeat (a token
    # seen twice in a batch): the applied gradient sums them. The digits'
    # pixels are its tokens (0 to 16), beside the float pixels in a Dense.
    def __init__(self):
        keras.utils.set_random_seed(SEED)
        tokens, pixels = keras.Input((64,), dtype="int32"), keras.Input((64,))
        seen = layers.GlobalAveragePooling1D()(layers.Embedding(17, 4, name="embed")(tokens))
        joined = layers.Concatenate()([seen, layers.Dense(8, activation="tanh", name="body")(pixels)])
        self.model = keras.Model([tokens, pixels], layers.Dense(10, name="head")(joined), name="net")
        self.optimizer = keras.optimizers.Adam(1e-2)
        self.optimizers = [self.optimizer]
        self.setup()

    def body(self, tokens, x, y):
        variables = self.model.trainable_variables
        with tf.GradientTape() as tape:
            loss = LOSS(y, self.model([tokens, x], training=True))
        grads = tape.gradient(loss, variables)
        assert isinstance(grads[0], tf.IndexedSlices)
        self.optimizer.apply_gradients(zip(grads, variables))
        return loss, applied(variables, [tf.convert_to_tensor(g) for g in grads])

    def step(self, i, x, y):
        return self.train_step(np.nan_to_num(x * 16).astype("int32"), x, y)


class GAN(Loop):
    # The guide's GAN step: the discriminator on real and generated digits,
    # then the generator through it, each with its own Adam, one tf.function.
    # The noise comes from the host, drawn per step.
    def __init__(self):
        keras.utils.set_random_seed(SEED)
        self.generator = keras.Sequential([keras.Input((4,)), layers.Dense(16, activation="relu", name="g_hidden"),
                                           layers.Dense(64, activation="sigmoid", name="g_out")], name="generator")
        self.discriminator = keras.Sequential([keras.Input((64,)), layers.Dense(8, activation="tanh", name="d_hidden"),
                                               layers.Dense(1, name="d_out")], name="discriminator")
        self.d_optimizer, self.g_optimizer = keras.optimizers.Adam(3e-3), keras.optimizers.Adam(1e-3)
        self.optimizers = [self.d_optimizer, self.g_optimizer]
        self.gan = Holder(generator=self.generator, discriminator=self.discriminator,
                          d_optimizer=self.d_optimizer, g_optimizer=self.g_optimizer)
        self.model = self.gan
        self.bce = keras.losses.BinaryCrossentropy(from_logits=True)
        self.setup()

    def body(self, real, noise):
        fake = self.generator(noise)
        both = tf.concat([fake, real], axis=0)
        labels = tf.concat([tf.ones((tf.shape(noise)[0], 1)), tf.zeros((tf.shape(real)[0], 1))], axis=0)
        with tf.GradientTape() as tape:
            d_loss = self.bce(labels, self.discriminator(both))
        d_vars = self.discriminator.trainable_weights
        d_grads = tape.gradient(d_loss, d_vars)
        self.d_optimizer.apply(d_grads, d_vars)
        with tf.GradientTape() as tape:
            g_loss = self.bce(tf.zeros((tf.shape(noise)[0], 1)), self.discriminator(self.generator(noise)))
        g_vars = self.generator.trainable_weights
        g_grads = tape.gradient(g_loss, g_vars)
        self.g_optimizer.apply(g_grads, g_vars)
        return d_loss + g_loss, {**applied(d_vars, d_grads), **applied(g_vars, g_grads)}

    def step(self, i, x, y):
        noise = np.random.default_rng(i).normal(size=(8, 4)).astype("float32")
        return self.train_step(x, noise)


class Full(Loop):
    def body(self, x, y):
        variables = self.model.trainable_variables
        with tf.GradientTape() as tape:
            loss = LOSS(y, self.model(x, training=True))
        grads = tape.gradient(loss, variables)
        self.optimizer.apply_gradients(zip(grads, variables))
        return loss, applied(variables, grads)


class Jit(Full):
    exact = False
    warnings = ("This step is compiled by XLA with the lab's reads",)

    def setup(self):
        self.train_step = tf.function(self.body, jit_compile=True)


class ReduceRetracing(Full):
    def setup(self):
        self.train_step = tf.function(self.body, reduce_retracing=True)

    def step(self, i, x, y):
        size = BATCH - 3 * (i % 3)  # batches of 16, 13 and 10
        return self.train_step(x[:size], y[:size])


class Eager(Full):
    def setup(self):
        self.train_step = self.body


class PersistentTwoLosses(Loop):
    def body(self, x, y):
        variables = self.model.trainable_variables
        with tf.GradientTape(persistent=True) as tape:
            logits = self.model(x, training=True)
            loss = LOSS(y, logits)
            penalty = 1e-3 * tf.reduce_mean(tf.reduce_sum(tf.square(logits), axis=1))
        grads = [a + b for a, b in zip(tape.gradient(loss, variables), tape.gradient(penalty, variables))]
        del tape
        self.optimizer.apply(grads, variables)
        return loss + penalty, applied(variables, grads)


class InputGradientPenalty(Loop):
    def body(self, x, y):
        variables = self.model.trainable_variables
        x = tf.convert_to_tensor(x)
        with tf.GradientTape() as tape:
            with tf.GradientTape() as inner:
                inner.watch(x)
                loss = LOSS(y, self.model(x, training=True))
            slope = inner.gradient(loss, x)
            loss = loss + 0.1 * tf.reduce_mean(tf.reduce_sum(tf.square(slope), axis=1))
        grads = tape.gradient(loss, variables)
        self.optimizer.apply_gradients(zip(grads, variables))
        return loss, applied(variables, grads)


class WatchedVariablesOnly(Loop):
    def body(self, x, y):
        variables = self.model.trainable_variables[::-1]
        with tf.GradientTape(watch_accessed_variables=False) as tape:
            tape.watch([v.value for v in variables])  # Keras 3: a keras Variable holds the tf.Variable
            loss = LOSS(y, self.model(x, training=True))
        grads = tape.gradient(loss, variables)
        self.optimizer.apply_gradients(zip(grads, variables))
        return loss, applied(variables, grads)


class Accumulation(Loop):
    # The NaN of batch 2 reaches the update of step 3, which applies its sum.
    k = 2
    hit = BAD + 1

    def setup(self):
        self.sums = [tf.Variable(tf.zeros_like(v), trainable=False) for v in self.model.trainable_variables]
        self.accumulate = tf.function(self.accumulate_body)
        self.apply = tf.function(self.apply_body)

    def accumulate_body(self, x, y):
        with tf.GradientTape() as tape:
            loss = LOSS(y, self.model(x, training=True))
        for total, grad in zip(self.sums, tape.gradient(loss, self.model.trainable_variables)):
            total.assign_add(grad)
        return loss

    def apply_body(self):
        variables = self.model.trainable_variables
        grads = [total / self.k for total in self.sums]
        self.optimizer.apply_gradients(zip(grads, variables))
        for total in self.sums:
            total.assign(tf.zeros_like(total))
        return applied(variables, grads)

    def step(self, i, x, y):
        loss = self.accumulate(x, y)
        return loss, self.apply() if (i + 1) % self.k == 0 else {}


class MixedPrecision(Loop):
    # Keras 3's LossScaleOptimizer unscales in `apply` and skips an update
    # whose gradients overflow, lowering its scale: the first two steps here
    # do (the scale starts at 2**20), with no hit, as in bare training. A
    # NaN batch's loss, which the loop scales, is what nonfinite() stops on.
    INITIAL_SCALE = 2.0**20

    def __init__(self):
        policy = keras.mixed_precision.global_policy()
        keras.mixed_precision.set_global_policy("mixed_float16")
        try:
            keras.utils.set_random_seed(SEED)
            self.model = keras.Sequential([
                keras.Input((64,)), layers.Dense(8, activation="tanh", name="body"), layers.Dense(10, name="head"),
                layers.Activation("linear", dtype="float32", name="logits")], name="net")
            self.optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-2),
                                                                 initial_scale=self.INITIAL_SCALE)
        finally:
            keras.mixed_precision.set_global_policy(policy)
        self.optimizers = [self.optimizer]
        # Built before the step is traced: else `scale_loss` bakes in the initial scale.
        self.optimizer.build(self.model.trainable_variables)
        self.setup()

    def body(self, x, y):
        variables = self.model.trainable_variables
        with tf.GradientTape() as tape:
            loss = LOSS(y, self.model(x, training=True))
            scaled = self.optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, variables)
        unscale = 1.0 / self.optimizer.dynamic_scale
        self.optimizer.apply(grads, variables)
        return loss, applied(variables, [g * tf.cast(unscale, g.dtype) for g in grads])

    def step(self, i, x, y):
        loss, grads = self.train_step(x, y)
        finite = all(np.isfinite(g.numpy()).all() for g in grads.values())
        return loss, grads if finite else {}  # Keras skipped the update


class MixedPrecisionEager(MixedPrecision):
    def setup(self):
        self.train_step = self.body


class Clipping(Loop):
    CLIP = 0.05

    def body(self, x, y):
        variables = self.model.trainable_variables
        with tf.GradientTape() as tape:
            loss = LOSS(y, self.model(x, training=True))
        grads, _ = tf.clip_by_global_norm(tape.gradient(loss, variables), self.CLIP)
        self.optimizer.apply_gradients(zip(grads, variables))
        return loss, applied(variables, grads)


LOOPS = {
    "apply_gradients a subset, reordered": SubsetApplyGradients,
    "apply a subset, reordered": SubsetApply,
    "two applies, one optimizer": TwoAppliesOneOptimizer,
    "apply(grads) to the built variables": ApplyToTheBuiltVariables,
    "embedding: IndexedSlices gradients": Embedding,
    "a variable outside the model": OutsideVariable,
    "gan: two optimizers in one tf.function": GAN,
    "tf.function(jit_compile=True)": Jit,
    "tf.function(reduce_retracing=True)": ReduceRetracing,
    "eager": Eager,
    "persistent tape, two losses": PersistentTwoLosses,
    "tape.watch on the input": InputGradientPenalty,
    "watch_accessed_variables=False": WatchedVariablesOnly,
    "accumulation by hand": Accumulation,
    "mixed precision by hand": MixedPrecision,
    "mixed precision by hand, eager": MixedPrecisionEager,
    "clip_by_global_norm": Clipping,
}


# ---- running and checking ----------------------------------------------------


def state(loop):
    """Every weight of the watched model and every optimizer variable, as numpy arrays."""
    return ([np.array(v.numpy()) for v in [*loop.watched.variables, *loop.extra]],
            [np.array(v.numpy()) for o in loop.optimizers for v in o.variables])


def assert_same_state(got, expected, what, exact=True):
    """Bit for bit; or, where the run said why not (XLA), to float rounding."""
    for part, a, b in zip(("weights", "optimizer variables"), got, expected):
        assert len(a) == len(b), f"{what}: {len(a)} {part}, expected {len(b)}"
        if exact:
            bad = [i for i, (u, v) in enumerate(zip(a, b)) if not np.array_equal(u, v)]
        else:
            bad = [i for i, (u, v) in enumerate(zip(a, b)) if not np.allclose(u, v, rtol=1e-5, atol=1e-6)]
        assert not bad, f"{what}: {part} {bad} of {len(a)} differ"


def train(loop, batches, run=None, first=0):
    """The user's loop; returns the losses and the gradients each step applied (numpy)."""
    losses, grads = [], []
    for i, (x, y) in enumerate(batches, first):
        loss, step_grads = loop.step(i, x, y)
        if run is not None:
            run.step(loss=loss)
        losses.append(float(loss))
        grads.append({k: np.asarray(g) for k, g in step_grads.items()})
    return losses, grads


def lab_traces(loop):
    left = []
    for obj in [loop.watched, *loop.optimizers]:
        left += [f"{obj.name}.{n}" for n in vars(obj) if n.startswith("_lab")]
        left += [f"{obj.name}.{n}" for n in ("train_step", "apply", "apply_gradients", "_backend_update_step")
                 if n in vars(obj)]
    return left


def warnings_of(run):
    events = run.events()
    return list(events[events["kind"] == "warning"]["detail"]) if len(events) else []


_BARE = {}


def bare(name, batches):
    """The bare loop over all batches: losses, applied gradients, state after each count of steps."""
    if name not in _BARE:
        loop = LOOPS[name]()
        states, losses, grads = [state(loop)], [], []
        for i, batch in enumerate(batches):
            step_losses, step_grads = train(loop, [batch], first=i)
            losses += step_losses
            grads += step_grads
            states.append(state(loop))
        _BARE[name] = collections.namedtuple("Bare", "losses grads states")(losses, grads, states)
    return _BARE[name]


def norm(array):
    return np.linalg.norm(np.asarray(array, np.float64))


def check_rows(run, loop, grads, states):
    """One row per step; each `grad_norm/<path>` the norm of the gradient the
    step applied to that variable (NaN where it applied none), `grad_norm`
    theirs together; `weight_norm/<path>` and `update_ratio/<path>` those of
    the weights after the step (`states`: after each count of steps)."""
    frame = run.batches()
    assert list(frame["step"]) == list(range(len(grads)))
    assert list(frame["updated"] > 0) == [bool(g) for g in grads]
    keys = [v.path for v in [*loop.watched.trainable_variables, *loop.extra]]
    assert len(set(keys)) == len(keys)
    paths = [v.path for v in [*loop.watched.variables, *loop.extra]]
    for (_, row), step, before, after in zip(frame.iterrows(), grads, states, states[1:]):
        before, after = dict(zip(paths, before[0])), dict(zip(paths, after[0]))
        at = f"step {row['step']}"
        for key in keys:
            got = row[f"grad_norm/{key}"]
            if key not in step:
                assert np.isnan(got), f"{at}: grad_norm/{key} is {got}, its variable was not updated"
                continue
            np.testing.assert_allclose(got, norm(step[key]), rtol=1e-5, err_msg=f"{at}: grad_norm/{key}")
            np.testing.assert_allclose(row[f"weight_norm/{key}"], norm(after[key]), rtol=1e-5,
                                       err_msg=f"{at}: weight_norm/{key}")
            np.testing.assert_allclose(row[f"update_ratio/{key}"], norm(after[key] - before[key]) / norm(after[key]),
                                       rtol=1e-4, err_msg=f"{at}: update_ratio/{key}")
        if step:
            total = np.sqrt(sum(norm(g) ** 2 for g in step.values()))
            np.testing.assert_allclose(row["grad_norm"], total, rtol=1e-5, err_msg=f"{at}: grad_norm")
    return frame


@pytest.mark.parametrize("name", list(LOOPS))
def test_a_watched_loop_trains_as_the_bare_one_and_its_rows_hold_the_applied_gradients(data, name):
    twin = bare(name, data)
    loop = LOOPS[name]()
    with lab.watch(loop.watched, *loop.optimizers, gradients=True, weights=True) as run:
        losses, grads = train(loop, data[:WATCHED], run)
    warnings = warnings_of(run)
    assert sorted(any(text in w for w in warnings) for text in loop.warnings) == [True] * len(loop.warnings)
    assert len(warnings) == len(loop.warnings), warnings
    compare = np.testing.assert_array_equal if loop.exact else np.testing.assert_allclose
    compare(losses, twin.losses[:WATCHED])
    assert_same_state(state(loop), twin.states[WATCHED], "after the block", loop.exact)
    frame = check_rows(run, loop, twin.grads[:WATCHED] if loop.exact else grads, twin.states)
    assert len(frame) == WATCHED and run.status == "finished"
    assert lab_traces(loop) == []
    later, _ = train(loop, data[WATCHED:], first=WATCHED)
    compare(later, twin.losses[WATCHED:])
    assert_same_state(state(loop), twin.states[-1], "after a later bare phase", loop.exact)


@pytest.mark.parametrize("name", list(LOOPS))
def test_nonfinite_keeps_the_update_with_the_nan_out_and_stops_where_the_bare_loop_stopped_before_it(data, name):
    twin = bare(name, data)
    loop = LOOPS[name]()
    batches = [(x.copy(), y) for x, y in data[:WATCHED]]
    batches[BAD][0][3, 5] = np.nan
    with pytest.raises(lab.BreakpointHit, match=f"nonfinite at step {loop.hit}: the update was skipped") as hit:
        with lab.watch(loop.watched, *loop.optimizers, breakpoints=[lab.breakpoints.nonfinite()]) as run:
            train(loop, batches, run)
    assert hit.value.step == loop.hit and hit.value.skipped
    assert run.status == "stopped" and len(run) == loop.hit + 1
    events = run.events()
    assert list(events[events["kind"] == "nonfinite"]["step"]) == [loop.hit]
    assert_same_state(state(loop), twin.states[BAD], "after the hit, against the bare loop stopped before it",
                      loop.exact)
    assert lab_traces(loop) == []


def test_the_tf_distribute_guides_loop_on_two_replicas_trains_as_bare_and_its_rows_hold_the_applied_gradients():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    env.pop("TF_CONFIG", None)
    done = subprocess.run([sys.executable, str(Path(__file__).parent / "_scripts" / "mirrored_watch_twins.py")],
                          capture_output=True, text=True, timeout=150, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0 and lines, f"script failed ({done.returncode}):\n{done.stderr[-3000:]}"
    out = json.loads(lines[-1])
    assert out["steps"] == list(range(WATCHED)) and out["updated"] == [1.0] * WATCHED
    # The replicas' gradients summed, once: not each replica's write counted as an apply.
    np.testing.assert_allclose(out["rows"], out["applied"], rtol=1e-5)
    assert out["warnings"] == []
    assert out["same_losses"] and out["same_after_block"], "the watched replicas trained otherwise than the bare"
    assert out["same_later_losses"] and out["same_after_later_bare_phase"]
    assert out["traces"] == []
    assert out["hit"] == [BAD, True] and out["same_as_bare_stopped_before_the_nan"]
