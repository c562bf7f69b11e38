"""lab.watch on Keras' JAX backend: keras-io's "Writing a training loop from
scratch in JAX" (guides/writing_a_custom_training_loop_in_jax.py) watched.

`guide_loop` is the guide's first end-to-end example as the guide writes it,
but for two things: the data (MNIST-shaped random numbers as numpy batches
in place of `keras.datasets.mnist` and `tf.data`, which this environment
does not have: no download, no TensorFlow), and the state built from the
variables' values (`[v.value for v in ...]`): the guide's
`state = model.trainable_variables, ...` hands Keras Variables to `jax.jit`,
which jax 0.10 refuses ("Triggering __jax_array__() during abstractification
is no longer supported"; keras-io#2295 makes the same change). The watched
loop is that code inside `with lab.watch(model, optimizer) as run:` with
`run.step(loss=loss)` after each step.
"""

import contextlib
import warnings

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest

import lab

BATCH = 32
STEPS = 6


def mnist_like(steps=STEPS, seed=0):
    """MNIST-shaped data: pixels 0..255 as float32 (the guide does not scale them), one-hot labels."""
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, (steps * BATCH, 784)).astype("float32")
    y = keras.utils.to_categorical(rng.integers(0, 10, steps * BATCH), 10)
    return [(x[i:i + BATCH], y[i:i + BATCH]) for i in range(0, len(x), BATCH)]


class Guide:
    """The guide's first end-to-end example: its model, loss, optimizer, grad_fn and jitted train_step."""

    def __init__(self, seed=1, optimizer=None, jit=True):
        keras.utils.set_random_seed(seed)

        def get_model():
            inputs = keras.Input(shape=(784,), name="digits")
            x1 = keras.layers.Dense(64, activation="relu")(inputs)
            x2 = keras.layers.Dense(64, activation="relu")(x1)
            outputs = keras.layers.Dense(10, name="predictions")(x2)
            model = keras.Model(inputs=inputs, outputs=outputs)
            return model

        model = get_model()
        # Instantiate a loss function.
        loss_fn = keras.losses.CategoricalCrossentropy(from_logits=True)
        # Instantiate an optimizer.
        optimizer = optimizer or keras.optimizers.Adam(learning_rate=1e-3)

        def compute_loss_and_updates(trainable_variables, non_trainable_variables, x, y):
            y_pred, non_trainable_variables = model.stateless_call(
                trainable_variables, non_trainable_variables, x
            )
            loss = loss_fn(y, y_pred)
            return loss, non_trainable_variables

        grad_fn = jax.value_and_grad(compute_loss_and_updates, has_aux=True)

        def train_step(state, data):
            trainable_variables, non_trainable_variables, optimizer_variables = state
            x, y = data
            (loss, non_trainable_variables), grads = grad_fn(
                trainable_variables, non_trainable_variables, x, y
            )
            trainable_variables, optimizer_variables = optimizer.stateless_apply(
                optimizer_variables, grads, trainable_variables
            )
            # Return updated state
            return loss, (
                trainable_variables,
                non_trainable_variables,
                optimizer_variables,
            )

        self.model, self.loss_fn, self.optimizer, self.grad_fn = model, loss_fn, optimizer, grad_fn
        self.train_step = jax.jit(train_step) if jit else train_step

    def start(self):
        model, optimizer = self.model, self.optimizer
        # Build optimizer variables.
        optimizer.build(model.trainable_variables)

        trainable_variables = [v.value for v in model.trainable_variables]
        non_trainable_variables = [v.value for v in model.non_trainable_variables]
        optimizer_variables = [v.value for v in optimizer.variables]
        state = trainable_variables, non_trainable_variables, optimizer_variables
        return state

    def finish(self, state):
        model = self.model
        trainable_variables, non_trainable_variables, optimizer_variables = state
        for variable, value in zip(model.trainable_variables, trainable_variables):
            variable.assign(value)
        for variable, value in zip(model.non_trainable_variables, non_trainable_variables):
            variable.assign(value)


def guide_loop(batches, watch=None, guide=None, before=None):
    """The guide's training loop, watched by `watch(model, optimizer)` when given.

    Returns the guide, the final state, the run (or None) and the loss of each
    step as the loop computed it."""
    guide = guide or Guide()
    state = guide.start()
    if before is not None:
        state = before(guide, state)
    losses = []
    block = watch(guide.model, guide.optimizer) if watch else contextlib.nullcontext(None)
    with block as run:
        # Training loop
        for step, data in enumerate(batches):
            loss, state = guide.train_step(state, data)
            if run is not None:
                run.step(loss=loss)
            losses.append(np.asarray(loss))
    guide.finish(state)
    return guide, state, run, np.array(losses, np.float32)


def assert_same_state(a, b):
    for left, right in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(left), np.asarray(right))


def hand_norms(guide, state, data):
    """Each variable's gradient norm as the step computes the gradient, by hand (numpy)."""
    trainable, non_trainable, _ = state
    (_, _), grads = guide.grad_fn(trainable, non_trainable, *data)
    return {v.path: float(np.linalg.norm(np.asarray(g, np.float64)))
            for v, g in zip(guide.model.trainable_variables, grads)}


def optimizer_trace(optimizer):
    return set(vars(optimizer)), [id(v) for v in optimizer.variables]


# ---- the guide's loop ------------------------------------------------------


def test_the_guides_loop_watched_trains_bit_for_bit_as_unwatched_and_has_a_row_per_step():
    batches = mnist_like()
    bare, bare_state, _, bare_losses = guide_loop(batches)
    seen = {}

    def watch(model, optimizer):
        seen["before"] = optimizer_trace(optimizer), set(vars(model))
        return lab.watch(model, optimizer)

    guide, state, run, losses = guide_loop(batches, watch=watch)
    assert_same_state(state, bare_state)
    for ours, theirs in zip(guide.model.weights, bare.model.weights):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
    np.testing.assert_array_equal(losses, bare_losses)

    rows = run.batches()
    assert list(rows["step"]) == list(range(STEPS))
    np.testing.assert_array_equal(rows["loss"].to_numpy(np.float32), losses)
    assert (rows["seconds"] > 0).all() and set(rows["mode"]) == {"xla"}
    np.testing.assert_allclose(rows["learning_rate"], 1e-3, rtol=1e-6)
    assert (rows["updated"] == 1).all()
    paths = [v.path for v in guide.model.trainable_variables]
    assert all(np.isfinite(rows[f"grad_norm/{p}"]).all() for p in paths)
    assert run.status == "finished" and len(run.events()) == 0
    assert run.metadata["loop"] == "watch" and run.metadata["backend"] == "jax"

    # No trace on the model or the optimizer.
    assert (optimizer_trace(guide.optimizer), set(vars(guide.model))) == seen["before"]
    assert len(guide.optimizer.variables) == len(bare.optimizer.variables)
    assert not lab.hooks.attached(guide.model)


def test_each_row_holds_the_norms_of_the_gradients_its_own_step_applied():
    batches = mnist_like()
    expected = []

    def record_as_it_goes(guide, state):
        # The state before each step, kept to compute that step's gradients by hand.
        step = guide.train_step

        def train_step(state, data):
            expected.append(hand_norms(guide, state, data))
            return step(state, data)

        guide.train_step = train_step
        return state

    guide, _, run, _ = guide_loop(batches, watch=lab.watch, before=record_as_it_goes)
    rows = run.batches()
    assert len(expected) == len(rows) == STEPS
    for norms, (_, row) in zip(expected, rows.iterrows()):
        for path, norm in norms.items():
            np.testing.assert_allclose(row[f"grad_norm/{path}"], norm, rtol=1e-5)
        np.testing.assert_allclose(row["grad_norm"], np.sqrt(sum(n ** 2 for n in norms.values())), rtol=1e-5)
    assert len({tuple(n.values()) for n in expected}) == STEPS  # each step's own, not one repeated


def test_the_norms_are_of_the_gradients_the_optimizer_applied_after_clipping():
    batches = mnist_like(3)
    guide = Guide(optimizer=keras.optimizers.Adam(1e-3, clipnorm=0.05))
    unclipped = []

    def keep(guide, state):
        step = guide.train_step

        def train_step(state, data):
            unclipped.append(hand_norms(guide, state, data))
            return step(state, data)

        guide.train_step = train_step
        return state

    _, _, run, _ = guide_loop(batches, watch=lab.watch, guide=guide, before=keep)
    rows = run.batches()
    for norms, (_, row) in zip(unclipped, rows.iterrows()):
        for path, norm in norms.items():
            np.testing.assert_allclose(row[f"grad_norm/{path}"], min(norm, 0.05), rtol=1e-4)


def test_a_step_jitted_before_the_block_is_said_and_its_rows_keep_loss_and_seconds():
    batches = mnist_like()
    _, bare_state, _, bare_losses = guide_loop(batches)

    def trace_first(guide, state):
        guide.train_step(state, batches[0])  # traced and called once before the block (result dropped)
        return state

    with pytest.warns(RuntimeWarning, match="traced before this `lab.watch` block"):
        guide, state, run, losses = guide_loop(batches, watch=lab.watch, before=trace_first)
    assert_same_state(state, bare_state)
    rows = run.batches()
    assert len(rows) == STEPS
    np.testing.assert_array_equal(rows["loss"].to_numpy(np.float32), bare_losses)
    assert (rows["seconds"] > 0).all()
    assert rows["grad_norm"].isna().all() and rows["updated"].isna().all()
    assert all(rows[f"grad_norm/{v.path}"].isna().all() for v in guide.model.trainable_variables)
    events = run.events()
    assert list(events["kind"]) == ["warning"] and "train_step.clear_cache()" in events["detail"][0]
    assert run.metadata["record_errors"] == [events["detail"][0]]
    assert not lab.hooks.attached(guide.model)


def test_a_step_jitted_before_the_block_and_traced_anew_in_it_is_seen():
    batches = mnist_like(4)
    guide = Guide()
    state = guide.start()
    loss, state = guide.train_step(state, batches[0])  # traced without the lab
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with lab.watch(guide.model, guide.optimizer) as run:
            guide.train_step.clear_cache()  # the fix the note names
            for data in batches[1:]:
                loss, state = guide.train_step(state, data)
                run.step(loss=loss)
    rows = run.batches()
    assert np.isfinite(rows["grad_norm"]).all() and len(run.events()) == 0


def test_a_step_traced_in_the_block_trains_as_bare_after_it_and_is_seen_again_in_the_next():
    batches = mnist_like(6)
    bare, bare_state, _, _ = guide_loop(batches)
    guide = Guide()
    state = guide.start()
    with lab.watch(guide.model, guide.optimizer) as first:
        for data in batches[:2]:
            loss, state = guide.train_step(state, data)
            first.step(loss=loss)
    for data in batches[2:4]:  # outside any block: the callback in the trace does nothing
        loss, state = guide.train_step(state, data)
    with lab.watch(guide.model, guide.optimizer) as second:
        for data in batches[4:]:
            loss, state = guide.train_step(state, data)
            second.step(loss=loss)
    assert_same_state(state, bare_state)
    assert len(first.batches()) == 2 and len(second.batches()) == 2
    assert np.isfinite(second.batches()["grad_norm"]).all()  # the trace of the first block, seen again


def test_an_eager_step_is_recorded_in_eager_mode_with_the_same_weights():
    batches = mnist_like(3)
    _, bare_state, _, _ = guide_loop(batches, guide=Guide(jit=False))
    guide, state, run, _ = guide_loop(batches, watch=lab.watch, guide=Guide(jit=False))
    assert_same_state(state, bare_state)
    rows = run.batches()
    assert set(rows["mode"]) == {"eager"} and np.isfinite(rows["grad_norm"]).all()


def test_metrics_passed_get_columns_and_weights_adds_norms_and_update_ratios():
    batches = mnist_like(3)
    guide = Guide()
    metric = keras.metrics.CategoricalAccuracy()
    state = guide.start()
    with lab.watch(guide.model, guide.optimizer, weights=True) as run:
        for data in batches:
            loss, new_state = guide.train_step(state, data)
            y_pred, _ = guide.model.stateless_call(new_state[0], new_state[1], data[0])
            metric.update_state(data[1], y_pred)
            run.step(loss=loss, accuracy=metric.result(), seen=float(len(data[0])))
            kernel = guide.model.trainable_variables[0].path
            expected_weight = np.linalg.norm(np.asarray(new_state[0][0], np.float64))
            expected_update = np.linalg.norm(np.asarray(new_state[0][0], np.float64) - np.asarray(state[0][0]))
            state = new_state
            row = run.batches().iloc[-1]
            np.testing.assert_allclose(row[f"weight_norm/{kernel}"], expected_weight, rtol=1e-5)
            np.testing.assert_allclose(row[f"update_ratio/{kernel}"], expected_update / expected_weight, rtol=1e-3)
    rows = run.batches()
    assert {"accuracy", "seen"} <= set(rows.columns) and (rows["seen"] == BATCH).all()
    assert ((rows["accuracy"] >= 0) & (rows["accuracy"] <= 1)).all()


# ---- breakpoints --------------------------------------------------------------


def test_nonfinite_gradients_keep_the_update_out_of_the_state_and_raise_at_that_step():
    batches = mnist_like(3)
    bad_x = batches[1][0].copy()
    bad_x[0, 0] = np.nan
    guide = Guide()
    state = guide.start()
    with lab.watch(guide.model, guide.optimizer, breakpoints=[lab.breakpoints.nonfinite()]) as run:
        loss, state = guide.train_step(state, batches[0])
        run.step(loss=loss)
        loss, after = guide.train_step(state, (bad_x, batches[1][1]))
        with pytest.raises(lab.BreakpointHit, match="nonfinite at step 1: the update was skipped") as hit:
            run.step(loss=loss)
        assert hit.value.step == 1 and hit.value.skipped
        assert_same_state(after, state)  # weights, slots and iterations as before the bad step
        loss, state = guide.train_step(after, batches[2])  # caught: the loop goes on
        run.step(loss=loss)
    events = run.events()
    assert list(events["kind"]) == ["nonfinite"] and list(events["step"]) == [1]
    assert list(run.batches()["updated"]) == [1, 0, 1]
    assert np.isfinite(jax.tree.leaves(state)[0]).all()


def test_a_nonfinite_loss_given_to_run_step_raises_saying_the_update_is_in_the_weights():
    batches = mnist_like(1)
    guide = Guide()
    state = guide.start()
    with pytest.raises(lab.BreakpointHit, match="this step's update is in the weights") as hit:
        with lab.watch(guide.model, guide.optimizer, breakpoints=[lab.breakpoints.nonfinite()]) as run:
            loss, state = guide.train_step(state, batches[0])
            run.step(loss=float("nan"))
    assert not hit.value.skipped and "the loss is nan" in hit.value.detail
    assert list(run.events()["kind"]) == ["nonfinite"] and run.status == "stopped"
    assert not lab.hooks.attached(guide.model)


def test_a_gate_traced_in_a_block_lets_a_nan_step_after_it_train_as_bare():
    batches = mnist_like(2)
    bad = (np.full_like(batches[1][0], np.nan), batches[1][1])
    bare = Guide()
    bare_state = bare.start()
    for data in (batches[0], bad):
        _, bare_state = bare.train_step(bare_state, data)
    guide = Guide()
    state = guide.start()
    with lab.watch(guide.model, guide.optimizer, breakpoints=[lab.breakpoints.nonfinite()]) as run:
        loss, state = guide.train_step(state, batches[0])
        run.step(loss=loss)
    _, state = guide.train_step(state, bad)  # outside the block: no gate
    assert_same_state(state, bare_state)
    assert not np.isfinite(np.asarray(state[0][0])).all()


def test_a_row_condition_raises_after_its_update():
    batches = mnist_like(3)
    guide = Guide()
    state = guide.start()
    with pytest.raises(lab.BreakpointHit, match="step 1"):
        with lab.watch(guide.model, guide.optimizer,
                       breakpoints=[lab.Breakpoint(lambda row: row["step"] >= 1, name="step 1")]) as run:
            for data in batches:
                loss, state = guide.train_step(state, data)
                run.step(loss=loss)
    assert len(run.batches()) == 2 and list(run.events()["kind"]) == ["breakpoint"]


# ---- failures and bad input -------------------------------------------------------


@pytest.mark.parametrize("error", [ValueError("data ran out"), KeyboardInterrupt()], ids=["error", "interrupt"])
def test_an_exception_in_the_block_ends_the_run_with_its_event_and_takes_every_hook_off(error):
    batches = mnist_like(2)
    guide = Guide()
    state = guide.start()
    before = optimizer_trace(guide.optimizer)
    with pytest.raises(type(error)):
        with lab.watch(guide.model, guide.optimizer) as run:
            for data in batches:
                loss, state = guide.train_step(state, data)
                run.step(loss=loss)
            raise error
    kind = "interrupt" if isinstance(error, KeyboardInterrupt) else "error"
    assert list(run.events()["kind"]) == [kind] and len(run.batches()) == 2
    assert run.status == ("interrupted" if kind == "interrupt" else "failed")
    assert not lab.hooks.attached(guide.model) and optimizer_trace(guide.optimizer) == before
    with pytest.raises(RuntimeError, match="block has ended"):
        run.step(loss=loss)
    with lab.watch(guide.model, guide.optimizer) as again:  # watchable again
        loss, state = guide.train_step(state, batches[0])
        again.step(loss=loss)
    assert len(again.batches()) == 1


def test_bad_input_is_refused_at_the_call_naming_the_problem_and_the_fix():
    guide = Guide()
    model, optimizer = guide.model, guide.optimizer
    with pytest.raises(TypeError, match=r"takes the keras.Model .* first.*got a keras optimizer"):
        lab.watch(optimizer, model)
    with pytest.raises(TypeError, match="takes the keras.Model.*got None"):
        lab.watch(None, optimizer)
    with pytest.raises(TypeError, match="takes the keras.Model.*got a function"):
        lab.watch(guide.train_step.__wrapped__, optimizer)

    class GradientTransformation:  # what optax.adam(1e-3) is
        def init(self, params):
            pass

        def update(self, updates, state, params=None):
            pass

    with pytest.raises(TypeError, match=r"argument 1 after the model is an optax .*not a keras optimizer.*"
                                        r"keras.optimizers.Adam"):
        lab.watch(model, GradientTransformation())
    with pytest.raises(TypeError, match="not a keras optimizer"):
        lab.watch(model, "adam")
    with pytest.raises(ValueError, match=r"found no optimizer.*lab.watch\(model, optimizer\)"):
        lab.watch(model)
    with pytest.raises(ValueError, match=r"lab.Breakpoint\(lambda row"):
        lab.watch(model, optimizer, breakpoints=[lab.breakpoints.loss_spike(3)])
    with pytest.raises(TypeError, match=r"gradients=\.\.\.\) must be True or False"):
        lab.watch(model, optimizer, gradients="yes")
    state = guide.start()
    with lab.watch(model, optimizer) as run:
        with pytest.raises(RuntimeError, match="already watched"):
            with lab.watch(model, optimizer):
                pass
        with pytest.raises(TypeError, match=r"needs the step's loss: `run.step\(loss=loss\)`"):
            run.step()
        with pytest.raises(RuntimeError, match="inside a jitted function.*call it in the Python loop"):
            jax.jit(lambda x: run.step(loss=x) and x)(1.0)
        with pytest.raises(ValueError, match="rename it"):
            run.step(loss=1.0, grad_norm=2.0)
        loss, state = guide.train_step(state, mnist_like(1)[0])
        run.step(loss=loss)
    assert len(run.batches()) == 1
    with pytest.raises(RuntimeError, match=r"block has ended.*call it inside the block"):
        run.step(loss=loss)
    assert not lab.hooks.attached(model)


@pytest.mark.parametrize("settings, sent", [
    (dict(gradients=False), None),
    (dict(gradients=True), "debug_callback"),
    (dict(gradients=False, breakpoints=[lab.breakpoints.nonfinite()]), "io_callback"),
], ids=["nothing", "gradients", "nonfinite"])
def test_a_step_traced_in_a_block_carries_a_host_callback_only_for_what_the_block_asks(settings, sent):
    guide = Guide()
    state, data = guide.start(), mnist_like(1)[0]

    def traced():  # a new function each time: JAX keeps the trace of one it traced before
        return str(jax.make_jaxpr(lambda state, data: guide.train_step.__wrapped__(state, data))(state, data))

    with lab.watch(guide.model, guide.optimizer, **settings):
        inside = traced()
    callbacks = {name for name in ("debug_callback", "io_callback") if name in inside}
    assert callbacks == ({sent} if sent else set())
    assert "callback" not in traced()  # traced after the block: as without the lab


def test_two_optimizers_in_one_step_each_report_their_own_variables():
    class Pair(keras.Model):
        def __init__(self):
            super().__init__(name="pair")
            self.first = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="first_dense")], name="first")
            self.second = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, name="second_dense")],
                                           name="second")

        def call(self, x):
            return self.second(self.first(x))

    def train(watched):
        keras.utils.set_random_seed(0)
        pair = Pair()
        pair(np.zeros((1, 4), "float32"))
        first_opt, second_opt = keras.optimizers.SGD(0.1), keras.optimizers.Adam(0.01)
        first_opt.build(pair.first.trainable_variables)
        second_opt.build(pair.second.trainable_variables)

        def loss_of(first, second, x):
            hidden, _ = pair.first.stateless_call(first, [], x)
            y, _ = pair.second.stateless_call(second, [], hidden)
            return jnp.mean(y ** 2)

        @jax.jit
        def step(state, x):
            first, second, first_slots, second_slots = state
            loss, (first_grads, second_grads) = jax.value_and_grad(loss_of, argnums=(0, 1))(first, second, x)
            first, first_slots = first_opt.stateless_apply(first_slots, first_grads, first)
            second, second_slots = second_opt.stateless_apply(second_slots, second_grads, second)
            return loss, (first, second, first_slots, second_slots)

        state = tuple([v.value for v in variables] for variables in (
            pair.first.trainable_variables, pair.second.trainable_variables, first_opt.variables,
            second_opt.variables))
        rng = np.random.default_rng(0)
        block = lab.watch(pair, first=first_opt, second=second_opt) if watched else contextlib.nullcontext(None)
        with block as run:
            for _ in range(3):
                loss, state = step(state, rng.normal(size=(8, 4)).astype("float32"))
                if run is not None:
                    run.step(loss=loss)
        return state, run

    bare_state, _ = train(False)
    state, run = train(True)
    assert_same_state(state, bare_state)
    rows = run.batches()
    np.testing.assert_allclose(rows["learning_rate/first"], 0.1)
    np.testing.assert_allclose(rows["learning_rate/second"], 0.01)
    assert (rows["updated/first"] == 1).all() and (rows["updated/second"] == 1).all()
    for path in ("first/first_dense/kernel", "second/second_dense/kernel"):
        assert np.isfinite(rows[f"grad_norm/{path}"]).all()


def test_a_step_traced_without_breakpoints_raises_on_nan_saying_the_update_is_in_the_weights():
    batches = mnist_like(2)
    guide = Guide()
    state = guide.start()
    with lab.watch(guide.model, guide.optimizer) as first:  # traced here, without breakpoints
        loss, state = guide.train_step(state, batches[0])
        first.step(loss=loss)
    bad = (np.full_like(batches[1][0], np.nan), batches[1][1])
    with pytest.warns(RuntimeWarning, match="cannot keep an update out"):
        with pytest.raises(lab.BreakpointHit, match="this step's update is in the weights") as hit:
            with lab.watch(guide.model, guide.optimizer, breakpoints=[lab.breakpoints.nonfinite()]) as run:
                loss, state = guide.train_step(state, bad)
                run.step(loss=loss)
    assert not hit.value.skipped and "train_step.clear_cache()" in hit.value.detail
    assert not np.isfinite(np.asarray(state[0][0])).all()  # as without the lab
    assert "nonfinite" in list(run.events()["kind"])


def test_an_optimizer_applied_twice_in_a_step_gets_the_norm_of_both_applies():
    guide = Guide(optimizer=keras.optimizers.SGD(0.01))
    optimizer, grad_fn = guide.optimizer, guide.grad_fn

    @jax.jit
    def two_updates(state, data):  # a critic trained twice per step, on the same batch
        trainable, non_trainable, slots = state
        for scale in (1.0, 0.5):
            (loss, non_trainable), grads = grad_fn(trainable, non_trainable, *data)
            grads = [g * scale for g in grads]
            trainable, slots = optimizer.stateless_apply(slots, grads, trainable)
        return loss, (trainable, non_trainable, slots)

    state, data = guide.start(), mnist_like(1)[0]
    first = hand_norms(guide, state, data)
    (_, _), grads = grad_fn(state[0], state[1], *data)
    after_first, _ = optimizer.stateless_apply(state[2], grads, state[0])
    second = hand_norms(guide, (after_first, state[1], state[2]), data)
    with lab.watch(guide.model, optimizer) as run:
        loss, state = two_updates(state, data)
        run.step(loss=loss)
    row = run.batches().iloc[0]
    for path in first:
        np.testing.assert_allclose(row[f"grad_norm/{path}"], np.hypot(first[path], 0.5 * second[path]), rtol=1e-5)
