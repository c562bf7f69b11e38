"""lab.watch: a hand-written training loop recorded, checked and stopped by the lab."""

import contextlib
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import lab

BATCH = 16
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@pytest.fixture(scope="module")
def digits():
    (x, y), _ = lab.datasets.digits()
    return x[: 4 * BATCH].astype("float32"), y[: 4 * BATCH]


def batches(x, y, n):
    return [(x[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH]) for i in range(n)]


def make_mlp(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(10)])


def make_step(model, optimizer, mode="eager"):
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = LOSS(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return step if mode == "eager" else tf.function(step, jit_compile=mode == "xla")


def tape_norms(model, x, y):
    with tf.GradientTape() as tape:
        loss = LOSS(y, model(x, training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    return float(loss), {v.path: np.linalg.norm(g.numpy()) for v, g in zip(model.trainable_variables, grads)}


def assert_row_holds(row, norms):
    """Each `grad_norm/<path>` of a run's row is the tape's norm for that variable."""
    for path, norm in norms.items():
        np.testing.assert_allclose(row[f"grad_norm/{path}"], norm, rtol=1e-4)


def weights_of(model):
    return [w.numpy().copy() for w in model.trainable_variables]


@pytest.mark.parametrize("mode", ["eager", "graph", "xla"])
def test_rows_hold_the_gradients_the_tape_gives_on_the_same_batch(digits, mode):
    model, optimizer = make_mlp(), keras.optimizers.SGD(0.05)
    step = make_step(model, optimizer, mode)
    data = batches(*digits, 3)
    expected = []
    with lab.watch(model, optimizer) as run:
        for x, y in data:
            expected.append(tape_norms(model, x, y))
            run.step(loss=step(x, y), seen=float(len(x)))
    frame = run.batches()
    assert list(frame["step"]) == [0, 1, 2]
    assert run.status == "finished"
    assert (frame["seconds"] > 0).all()
    for (loss, norms), (_, row) in zip(expected, frame.iterrows()):
        np.testing.assert_allclose(row["loss"], loss, rtol=1e-5)
        assert_row_holds(row, norms)
        np.testing.assert_allclose(row["grad_norm"], np.sqrt(sum(n**2 for n in norms.values())), rtol=1e-4)
    np.testing.assert_allclose(frame["learning_rate"], 0.05)
    assert (frame["seen"] == BATCH).all()
    assert "apply" not in vars(optimizer) and "_backend_update_step" not in vars(optimizer)
    # An XLA step has the lab's reads compiled in: the run says so, once.
    assert sum("XLA" in d for d in run.events()["detail"]) == (1 if mode == "xla" else 0)


def test_several_optimizers_are_named_by_keyword_and_each_reports_its_own_variables(digits):
    keras.utils.set_random_seed(1)
    encoder = keras.Sequential([keras.Input((64,)), keras.layers.Dense(6, name="enc")])
    head = keras.Sequential([keras.Input((6,)), keras.layers.Dense(10, name="head")])
    model = keras.Sequential([encoder, head])
    fast, slow = keras.optimizers.SGD(0.1), keras.optimizers.Adam(1e-3)

    @tf.function
    def step(x, y):
        with tf.GradientTape(persistent=True) as tape:
            loss = LOSS(y, model(x, training=True))
        fast.apply_gradients(zip(tape.gradient(loss, encoder.trainable_variables), encoder.trainable_variables))
        slow.apply_gradients(zip(tape.gradient(loss, head.trainable_variables), head.trainable_variables))
        return loss

    with lab.watch(model, encoder_opt=fast, head_opt=slow) as run:
        for x, y in batches(*digits, 2):
            run.step(loss=step(x, y))
    frame = run.batches()
    np.testing.assert_allclose(frame["learning_rate/encoder_opt"], 0.1)
    np.testing.assert_allclose(frame["learning_rate/head_opt"], 1e-3)
    grads = [c for c in frame if c.startswith("grad_norm/")]
    assert len(grads) == 4 and frame[grads].notna().all().all()
    assert "apply" not in vars(fast) and "apply" not in vars(slow)


def test_optimizers_given_by_position_are_named_by_position(digits):
    model, first, second = make_mlp(), keras.optimizers.SGD(0.1), keras.optimizers.SGD(0.2)
    step = make_step(model, second)
    with lab.watch(model, first, second) as run:
        x, y = batches(*digits, 1)[0]
        run.step(loss=step(x, y))
    row = run.batches().iloc[0]
    assert np.isnan(row["learning_rate/optimizer_0"])  # the first one did not update
    np.testing.assert_allclose(row["learning_rate/optimizer_1"], 0.2)


def test_probes_are_removed_and_the_error_recorded_when_the_loop_raises(digits):
    model, optimizer = make_mlp(), keras.optimizers.SGD(0.1)
    step = make_step(model, optimizer)
    with pytest.raises(RuntimeError, match="data ran out"):
        with lab.watch(model, optimizer) as run:
            for x, y in batches(*digits, 2):
                run.step(loss=step(x, y))
            raise RuntimeError("data ran out")
    assert len(run) == 2
    assert list(run.events()["kind"]) == ["error"]
    assert not {"apply", "_backend_update_step"} & set(vars(optimizer))
    with lab.watch(model, optimizer) as again:  # watchable again
        run_x, run_y = batches(*digits, 1)[0]
        again.step(loss=step(run_x, run_y))
    assert len(again.batches()) == 1


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_nonfinite_skips_the_update_and_raises_at_that_step(digits, mode):
    model, optimizer = make_mlp(), keras.optimizers.SGD(0.1)
    step = make_step(model, optimizer, mode)
    (x, y), (x2, y2) = batches(*digits, 2)
    bad = x2.copy()
    bad[0, 0] = np.nan
    with lab.watch(model, optimizer, breakpoints=[lab.breakpoints.nonfinite()]) as run:
        run.step(loss=step(x, y))
        before, iterations = weights_of(model), int(optimizer.iterations.numpy())
        with pytest.raises(lab.BreakpointHit, match="nonfinite at step 1: the update was skipped") as hit:
            run.step(loss=step(bad, y2))
        assert hit.value.step == 1 and hit.value.skipped
        for old, new in zip(before, weights_of(model)):
            np.testing.assert_array_equal(old, new)
        assert int(optimizer.iterations.numpy()) == iterations
        run.step(loss=step(x2, y2))  # caught: the loop goes on from the weights before the bad step
    assert any(not np.array_equal(o, n) for o, n in zip(before, weights_of(model)))
    events = run.events()
    assert list(events["kind"]) == ["nonfinite"] and list(events["step"]) == [1]
    assert len(run.batches()) == 3 and list(run.batches()["updated"]) == [1, 0, 1]


@pytest.mark.parametrize("mode", ["graph", "xla"])
def test_a_nonfinite_hit_raises_at_its_step_without_a_device_read_per_step(digits, mode, monkeypatch):
    # A traced step tells the host when its gate hits; XLA cannot, and there
    # the run reads each step's row instead. Either way the hit's own step raises.
    model, optimizer = make_mlp(), keras.optimizers.Adam(1e-3)
    step = make_step(model, optimizer, mode)
    data = batches(*digits, 4) + batches(*digits, 2)
    bad = data[4][0].copy()
    bad[3, 5] = np.inf
    with lab.watch(model, optimizer, breakpoints=[lab.breakpoints.nonfinite()]) as run:
        reads = []
        read = run.probe.hit
        monkeypatch.setattr(run.probe, "hit", lambda taken: reads.append(taken) or read(taken))
        for x, y in data[:4]:
            run.step(loss=step(x, y))
        before = weights_of(model) + [v.numpy().copy() for v in optimizer.variables]
        with pytest.raises(lab.BreakpointHit) as hit:
            run.step(loss=step(bad, data[4][1]))
        assert hit.value.step == 4 and hit.value.skipped
        after = weights_of(model) + [v.numpy().copy() for v in optimizer.variables]
        for old, new in zip(before, after):
            np.testing.assert_array_equal(old, new)
        run.step(loss=step(*data[5]))
    assert len(reads) == (1 if mode == "graph" else 6)  # XLA: one read per step
    events = run.events()
    events = events[events["kind"] != "warning"]  # XLA's own note
    assert list(events["kind"]) == ["nonfinite"] and list(events["step"]) == [4]
    assert list(run.batches()["updated"]) == [1, 1, 1, 1, 0, 1]


def test_a_hit_on_a_step_that_made_its_weights_not_finite_itself_says_so(digits):
    # A sharpness-aware step moves every weight up its gradient and back, by
    # hand: on a NaN batch the weights are NaN before the optimizer's update,
    # which the gate kept out. The hit said "the weights are as before this step".
    model, optimizer = make_mlp(), keras.optimizers.Adam(1e-3)

    @tf.function
    def sharpness_aware_step(x, y):
        with tf.GradientTape() as tape:
            loss = keras.losses.sparse_categorical_crossentropy(y, model(x, training=True), from_logits=True)
        grads = tape.gradient(loss, model.trainable_variables)
        scale = 0.05 / (tf.linalg.global_norm(grads) + 1e-12)
        for grad, weight in zip(grads, model.trainable_variables):
            weight.assign_add(grad * scale)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, model(x, training=True),
                                                                              from_logits=True))
        sharp = tape.gradient(loss, model.trainable_variables)
        for grad, weight in zip(grads, model.trainable_variables):
            weight.assign_sub(grad * scale)
        optimizer.apply_gradients(zip(sharp, model.trainable_variables))
        return loss

    (x, y), (bad, y2) = batches(*digits, 2)
    bad = bad.copy()
    bad[0, 0] = np.nan
    with pytest.raises(lab.BreakpointHit) as hit:
        with lab.watch(model, optimizer, breakpoints=[lab.breakpoints.nonfinite()]) as run:
            run.step(loss=sharpness_aware_step(x, y))
            run.step(loss=sharpness_aware_step(bad, y2))
    names = ", ".join(v.path for v in model.trainable_variables)
    assert hit.value.skipped and f"the step itself made {names} not finite outside the optimizer" in str(hit.value)
    assert "as before this step" not in str(hit.value)
    assert run.events()["detail"].tolist() == [f"nonfinite at step 1; update skipped; not finite, assigned by "
                                               f"the step outside the optimizer: {names}"]


def test_an_ungated_step_beside_a_gated_one_is_reported_when_the_rows_are_read(digits):
    # The gated step tells its hits, so the run reads no row per step; a step
    # traced before breakpoints were asked for is found in the rows instead.
    model, optimizer = make_mlp(), keras.optimizers.SGD(0.1)
    old = make_step(model, optimizer, "graph")
    (x, y), (x2, y2) = batches(*digits, 2)
    with lab.watch(model, optimizer) as run:
        run.step(loss=old(x, y))
    new = make_step(model, optimizer, "graph")
    with pytest.warns(RuntimeWarning, match="without the device breakpoints being checked"):
        with lab.watch(model, optimizer, breakpoints=[lab.breakpoints.nonfinite()]) as run:
            run.step(loss=new(x, y))
            run.step(loss=old(x2, y2))
    events = run.events()
    assert list(events["kind"]) == ["warning"] and list(events["step"]) == [1]


def test_a_row_condition_raises_after_its_update(digits):
    model, optimizer = make_mlp(), keras.optimizers.SGD(0.1)
    step = make_step(model, optimizer)
    point = lab.Breakpoint(lambda row: row["step"] >= 1, name="second step")
    with pytest.raises(lab.BreakpointHit, match="second step") as hit:
        with lab.watch(model, optimizer, breakpoints=[point]) as run:
            for x, y in batches(*digits, 3):
                run.step(loss=step(x, y))
    assert hit.value.step == 1 and not hit.value.skipped
    assert len(run) == 2 and list(run.events()["kind"]) == ["breakpoint"]
    assert run.status == "stopped"


def test_loss_computed_outside_the_tape_names_the_fix(digits):
    model, optimizer = make_mlp(), keras.optimizers.SGD(0.1)
    x, y = batches(*digits, 1)[0]
    with pytest.raises(ValueError, match="inside the `with tf.GradientTape"):
        with lab.watch(model, optimizer) as run:
            loss = LOSS(y, model(x, training=True))
            with tf.GradientTape() as tape:
                pass
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            run.step(loss=loss)
    assert list(run.events()["kind"]) == ["error"]


def test_none_gradients_name_the_variables_that_never_train(digits):
    keras.utils.set_random_seed(0)
    used = keras.layers.Dense(10, name="used")
    unused = keras.layers.Dense(10, name="unused")
    inputs = keras.Input((64,))
    model = keras.Model(inputs, [used(inputs), unused(inputs)])
    optimizer = keras.optimizers.SGD(0.1)
    x, y = batches(*digits, 1)[0]
    with lab.watch(model, optimizer) as run:
        with tf.GradientTape() as tape:
            loss = LOSS(y, model(x)[0])
        grads = tape.gradient(loss, model.trainable_variables)
        with pytest.warns(UserWarning, match=r"2 of 4 variables.*unused/kernel"):
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
        run.step(loss=loss)
    assert "warning" in set(run.events()["kind"])


def test_a_metric_that_never_changes_is_reported(digits):
    model, optimizer = make_mlp(), keras.optimizers.SGD(0.1)
    step = make_step(model, optimizer, "graph")
    accuracy = keras.metrics.SparseCategoricalAccuracy(name="accuracy")
    data = batches(*digits, 2) * 5
    with pytest.warns(UserWarning, match=r"'accuracy' has been 0 for all 10 steps.*update_state"):
        with lab.watch(model, optimizer) as run:
            for x, y in data:
                run.step(loss=step(x, y), accuracy=accuracy)  # never updated: the mistake
    assert "accuracy.update_state" in run.events()["detail"].iloc[-1]


def test_a_step_that_retraces_on_a_python_value_names_the_argument(digits):
    model, optimizer = make_mlp(), keras.optimizers.SGD(0.1)

    @tf.function
    def train_step(x, y, step):
        with tf.GradientTape() as tape:
            loss = LOSS(y, model(x, training=True)) * (1.0 + 0.0 * step)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    x, y = batches(*digits, 1)[0]
    with pytest.warns(RuntimeWarning, match=r"traced 4 times in 4 calls.*argument `step` is a Python value.*0, 1, 2, 3"):
        with lab.watch(model, optimizer) as run:
            for i in range(4):
                run.step(loss=train_step(x, y, i))
    assert run.events()["kind"].tolist() == ["warning"]


def test_a_step_traced_before_watching_is_reported(digits):
    model, optimizer = make_mlp(), keras.optimizers.SGD(0.1)
    step = make_step(model, optimizer, "graph")
    x, y = batches(*digits, 1)[0]
    step(x, y)  # traced without the lab
    with pytest.warns(RuntimeWarning, match="traced before `lab.watch` first watched this model"):
        with lab.watch(model, optimizer) as run:
            run.step(loss=step(x, y))
    assert np.isnan(run.batches()["grad_norm"].iloc[0])


def test_weights_adds_norms_and_update_ratios(digits):
    model, optimizer = make_mlp(), keras.optimizers.SGD(0.1)
    step = make_step(model, optimizer, "graph")
    with lab.watch(model, optimizer, weights=True) as run:
        for x, y in batches(*digits, 2):
            run.step(loss=step(x, y))
    row = run.batches().iloc[-1]
    kernel = model.trainable_variables[0]
    np.testing.assert_allclose(row[f"weight_norm/{kernel.path}"], np.linalg.norm(kernel.numpy()), rtol=1e-5)
    assert 0 < row[f"update_ratio/{kernel.path}"] < 1


@pytest.mark.parametrize("mode", ["eager", "graph", "xla"])
def test_norms_and_update_ratios_are_bit_for_bit_what_the_step_would_compute(digits, mode):
    # The step puts half sums of squares in the row and the host finishes
    # them: every norm is exactly sqrt(2 * l2_loss) in float32, and every
    # update ratio exactly divide_no_nan(update norm, weight norm), as
    # computed in the step itself (the same values lab.watch gave before).
    model, optimizer = make_mlp(), keras.optimizers.SGD(0.1)
    expected = []

    def step(x, y):
        before = [tf.identity(v) for v in model.trainable_variables]
        with tf.GradientTape() as tape:
            loss = LOSS(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        norm = lambda t: tf.sqrt(2.0 * tf.nn.l2_loss(t))  # noqa: E731
        weights = [norm(v) for v in model.trainable_variables]
        ratios = [tf.math.divide_no_nan(norm(v - b), w) for v, b, w in zip(model.trainable_variables, before, weights)]
        return loss, [norm(g) for g in grads], weights, ratios

    step = step if mode == "eager" else tf.function(step, jit_compile=mode == "xla")
    with lab.watch(model, optimizer, weights=True) as run:
        for x, y in batches(*digits, 2):
            loss, *values = step(x, y)
            expected.append([[float(t) for t in part] for part in values])
            run.step(loss=loss)
    frame = run.batches()
    for (grads, weights, ratios), (_, row) in zip(expected, frame.iterrows()):
        for kind, values in (("grad_norm", grads), ("weight_norm", weights), ("update_ratio", ratios)):
            got = [float(row[f"{kind}/{v.path}"]) for v in model.trainable_variables]
            assert got == values, (kind, got, values)


def test_bad_arguments_name_the_fix():
    model = make_mlp()
    with pytest.raises(TypeError, match="not a keras optimizer"):
        with lab.watch(model, "sgd"):
            pass
    with pytest.raises(TypeError, match="unexpected keyword gradient=bool"):
        with lab.watch(model, keras.optimizers.SGD(), gradient=True):
            pass
    with pytest.raises(ValueError, match="needs the one your loop calls `apply_gradients` on"):
        with lab.watch(model):
            pass
    with pytest.raises(ValueError, match=r"lab.Breakpoint\(lambda row"):
        with lab.watch(model, keras.optimizers.SGD(), breakpoints=[lab.breakpoints.loss_spike(3)]):
            pass
    with lab.watch(model, keras.optimizers.SGD()):
        with pytest.raises(RuntimeError, match="already watched"):
            with lab.watch(model, keras.optimizers.SGD()):
                pass
    with lab.watch(model, keras.optimizers.SGD()) as run:
        with pytest.raises(RuntimeError, match="call it in the Python loop"):
            tf.function(lambda: run.step(loss=1.0))()
    with pytest.raises(ValueError, match="rename it"):
        with lab.watch(model, keras.optimizers.SGD()) as run:
            run.step(loss=1.0, grad_norm=2.0)
    # strategy.run's result, one loss per replica, was refused as "got PerReplica", with no fix.
    from tensorflow.python.distribute.values import PerReplica

    with pytest.raises(TypeError, match=r"one value per replica.*strategy.reduce\(\"SUM\", loss, axis=None\)"):
        with lab.watch(model, keras.optimizers.SGD()) as run:
            run.step(loss=PerReplica([tf.constant(1.0), tf.constant(2.0)]))
    for bad, error in ((0, ValueError), (2.5, TypeError), ("64", TypeError), (True, TypeError)):
        with pytest.raises(error, match=r"lab.watch\(capacity=\.\.\.\) must be a positive whole number"):
            with lab.watch(model, keras.optimizers.SGD(), capacity=bad):
                pass
    for bad, error in ((-1.0, ValueError), (float("nan"), ValueError), ("0.5", TypeError), (None, TypeError)):
        with pytest.raises(error, match=r"lab.watch\(flush_every=\.\.\.\) must be a number of seconds, 0 or"):
            with lab.watch(model, keras.optimizers.SGD(), flush_every=bad):
                pass


class Subclassed(keras.Model):
    """A subclassed model, built by its first call (in the loop's first step)."""

    def __init__(self):
        super().__init__(name="subclassed")
        self.hidden = keras.layers.Dense(8, activation="tanh", name="hidden")
        self.logits = keras.layers.Dense(10, name="logits")

    def call(self, x):
        return self.logits(self.hidden(x))


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_variables_the_model_did_not_list_when_watching_began_get_the_tapes_norms_from_the_first_step(digits, mode):
    # A subclassed model built by its first step, and a tf.Variable no model
    # holds (neural style transfer's image, its own optimizer's): their slots
    # were added while the step ran, onto rows holding NaN, and read NaN for
    # the ring's whole first lap (1,025 steps).
    keras.utils.set_random_seed(0)
    model, optimizer, image_optimizer = Subclassed(), keras.optimizers.SGD(0.05), keras.optimizers.SGD(0.01)
    image = tf.Variable(np.random.default_rng(0).normal(size=(3, 64)).astype("float32"), name="image")

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = LOSS(y, model(x, training=True)) + tf.reduce_sum(tf.square(model(image)))
        grads = tape.gradient(loss, model.trainable_variables + [image])
        optimizer.apply_gradients(zip(grads[:-1], model.trainable_variables))
        image_optimizer.apply_gradients([(grads[-1], image)])
        return loss, grads

    step = step if mode == "eager" else tf.function(step)
    expected = []
    with lab.watch(model, optimizer, image_optimizer, flush_every=3600) as run:
        for x, y in batches(*digits, 3):
            loss, grads = step(x, y)
            expected.append([float(tf.norm(g)) for g in grads] + [float(tf.linalg.global_norm(grads))])
            run.step(loss=loss)
    frame = run.batches()
    paths = [v.path for v in model.trainable_variables] + ["image:0"]
    got = frame[[f"grad_norm/{p}" for p in paths] + ["grad_norm"]].to_numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-5)


@pytest.mark.parametrize("make_first, named", [
    (lambda: tf.Variable(np.zeros((2, 3), np.float32)), r"got a tf.Variable \('Variable:0'\)"),
    (lambda: None, "got None"),
    (lambda: [tf.Variable(np.zeros((2, 3), np.float32))], "got a list of tf.Variable"),
    (lambda: keras.optimizers.SGD(0.1), r"got a keras optimizer \(SGD\) first"),
], ids=["variable", "none", "list", "optimizer"])
def test_a_first_argument_that_is_no_model_is_refused_at_the_call_with_the_fix(make_first, named):
    first, optimizer = make_first(), keras.optimizers.SGD(0.1)
    with pytest.raises(TypeError, match=named) as caught:
        lab.watch(first, optimizer)  # not entered: refused at the call
    message = str(caught.value)
    assert message.startswith("lab.watch takes the keras.Model (or Layer) your loop trains first")
    assert "`lab.watch(model, optimizer)`" in message
    if not isinstance(first, keras.optimizers.Optimizer):
        # What works for a variable no model holds: the model computing the loss.
        assert "`lab.watch(feature_extractor, optimizer)` records the variable's gradient norm" in message


def test_a_model_with_no_optimizer_is_refused_at_the_call_with_what_to_do_instead():
    # Deep dream: gradient ascent by hand, no optimizer anywhere.
    model = make_mlp()
    with pytest.raises(ValueError, match=f"found no optimizer on the model '{model.name}'") as caught:
        lab.watch(model)
    message = str(caught.value)
    assert "`lab.watch(model, optimizer)`" in message
    assert "`optimizer.apply_gradients([(-grads, img)])`" in message  # or make the update an optimizer's
    assert "`run.append_batches({'loss': [float(loss)]})`" in message  # or keep a lab.Run


def events_about(run, text):
    return [d for d in run.events()["detail"] if text in d]


def test_a_watched_optimizer_the_loop_never_applies_is_reported_once_and_an_accumulating_loop_is_not(digits):
    from lab.backend.tensorflow.watch import UNAPPLIED_STEPS

    # keras-io's reptile: `lab.watch(model)` watches the RMSprop `compile()`
    # made, while the loop applies its own SGD; the weights change every step.
    model = make_mlp()
    model.compile()
    sgd = keras.optimizers.SGD(0.05)
    step = make_step(model, sgd, "graph")
    data = batches(*digits, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with lab.watch(model, flush_every=0) as run:
            for index in range(UNAPPLIED_STEPS + 4):
                run.step(loss=step(*data[index % 4]))
            # Told while the loop runs, at the step the run noticed.
            told = events_about(run, "Pass the optimizer your loop applies: `lab.watch(model, optimizer)`")
            assert len(told) == 1 and run.events()["step"].iloc[-1] == UNAPPLIED_STEPS - 1
    assert told[0].startswith(f"The optimizer 'optimizer' (RMSprop) that lab.watch watches applied no update "
                              f"in {UNAPPLIED_STEPS} steps")
    assert [str(w.message) for w in caught if "no update" in str(w.message)] == told
    assert (run.batches()["updated"] == 0).all()

    # Deep dream with an optimizer that never applies, fewer steps: told at the block's end.
    model, unused = make_mlp(), keras.optimizers.SGD(0.01)
    with pytest.warns(UserWarning, match="applied no update in 3 steps"):
        with lab.watch(model, unused) as run:
            for _ in range(3):
                run.step(loss=1.0)
    assert len(events_about(run, "no update")) == 1

    # Gradients accumulated by hand over 8 batches, or by Keras over 64: not told.
    for every, optimizer in ((8, keras.optimizers.SGD(0.05)),
                             (None, keras.optimizers.SGD(0.05, gradient_accumulation_steps=64))):
        model = make_mlp()
        sums = [tf.Variable(tf.zeros_like(v)) for v in model.trainable_variables]

        @tf.function
        def accumulate(x, y, apply):
            with tf.GradientTape() as tape:
                loss = LOSS(y, model(x, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            if every is None:
                optimizer.apply_gradients(zip(grads, model.trainable_variables))
            elif apply:
                optimizer.apply_gradients(zip([s + g for s, g in zip(sums, grads)], model.trainable_variables))
                for total in sums:
                    total.assign(tf.zeros_like(total))
            else:
                for total, grad in zip(sums, grads):
                    total.assign_add(grad)
            return loss

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with lab.watch(model, optimizer, flush_every=0) as run:
                for index in range(UNAPPLIED_STEPS + 8):
                    run.step(loss=accumulate(*data[index % 4], apply=every is not None and index % every == every - 1))
        assert not events_about(run, "no update") and not [w for w in caught if "no update" in str(w.message)]
        assert run.batches()["updated"].sum() == (5 if every else 0)


def test_a_run_has_columns_only_for_the_variables_its_block_saw(digits):
    # The model's ring keeps every slot an earlier block added; a later run
    # showed them as columns of NaN.
    model, optimizer, extra_optimizer = make_mlp(), keras.optimizers.SGD(0.05), keras.optimizers.SGD(0.01)
    extra = tf.Variable(np.ones((3, 64), np.float32), name="extra")

    @tf.function
    def with_extra(x, y):
        with tf.GradientTape() as tape:
            loss = LOSS(y, model(x, training=True)) + tf.reduce_sum(tf.square(model(extra)))
        grads = tape.gradient(loss, model.trainable_variables + [extra])
        optimizer.apply_gradients(zip(grads[:-1], model.trainable_variables))
        extra_optimizer.apply_gradients([(grads[-1], extra)])
        return loss

    data = batches(*digits, 2)
    with lab.watch(model, optimizer, extra_optimizer) as first:
        for x, y in data:
            first.step(loss=with_extra(x, y))
    assert first.batches()["grad_norm/extra:0"].notna().all()
    other = keras.optimizers.SGD(0.05)
    step = make_step(model, other, "graph")
    with lab.watch(model, other) as second:
        for x, y in data:
            second.step(loss=step(x, y))
    grads = [c for c in second.batches() if c.startswith("grad_norm/")]
    assert sorted(grads) == sorted(f"grad_norm/{v.path}" for v in model.trainable_variables)
    assert second.batches()[grads].notna().all().all()
    # The step traced in the first block, not traced again: its optimizer's variables are the block's.
    with lab.watch(model, optimizer, extra_optimizer) as third:
        third.step(loss=with_extra(*data[0]))
    assert third.batches()["grad_norm/extra:0"].notna().all()


@pytest.mark.parametrize("mode", ["eager", "graph", "xla"])
def test_more_steps_than_the_device_keeps_arrive_each_in_its_own_row(digits, mode):
    # capacity=2: the device's ring of rows wraps around several times.
    model, optimizer = make_mlp(), keras.optimizers.SGD(0.05)
    step = make_step(model, optimizer, mode)
    data = batches(*digits, 4) * 2
    expected = []
    with lab.watch(model, optimizer, capacity=2, flush_every=3600) as run:
        for x, y in data:
            expected.append(tape_norms(model, x, y)[1])
            run.step(loss=step(x, y))
    frame = run.batches()
    assert list(frame["step"]) == list(range(8))
    assert (frame["updated"] == 1).all()
    for norms, (_, row) in zip(expected, frame.iterrows()):
        assert_row_holds(row, norms)


def test_reading_the_run_between_an_update_and_run_step_loses_nothing(digits):
    # The running row is neither read nor reset by a read of the run.
    model, optimizer = make_mlp(), keras.optimizers.SGD(0.05)
    step = make_step(model, optimizer, "graph")
    (x, y), (x2, y2) = batches(*digits, 2)
    with lab.watch(model, optimizer, flush_every=3600) as run:
        run.step(loss=step(x, y))
        norms = tape_norms(model, x2, y2)[1]
        loss = step(x2, y2)
        assert len(run.batches()) == 1  # the second step's update is in, its row not closed
        run.step(loss=loss)
    row = run.batches().iloc[1]
    assert row["updated"] == 1
    assert_row_holds(row, norms)


def test_a_later_block_may_keep_more_steps_than_the_first(digits):
    model, optimizer = make_mlp(), keras.optimizers.SGD(0.05)
    step = make_step(model, optimizer, "graph")
    data = batches(*digits, 4)
    with lab.watch(model, optimizer, capacity=1) as first:
        first.step(loss=step(*data[0]))
    with lab.watch(model, optimizer, capacity=64, flush_every=3600) as second:
        for x, y in data * 3:
            second.step(loss=step(x, y))
        assert second.probe.rows_kept == 64
    frame = second.batches()
    assert len(frame) == 12 and (frame["updated"] == 1).all()
    assert frame["grad_norm"].notna().all()


def test_a_step_traced_in_one_block_is_watched_again_in_the_next(digits):
    model, optimizer = make_mlp(), keras.optimizers.SGD(0.1)
    step = make_step(model, optimizer, "graph")
    (x, y), (x2, y2) = batches(*digits, 2)
    with lab.watch(model, optimizer, breakpoints=[lab.breakpoints.nonfinite()]) as first:
        first.step(loss=step(x, y))
    step(x2, y2)  # between blocks: the graph's gate lets it through
    bad = x2.copy()
    bad[0, 0] = np.inf
    before = weights_of(model)
    with lab.watch(model, optimizer, breakpoints=[lab.breakpoints.nonfinite()]) as second:
        second.step(loss=step(x, y))
        with pytest.raises(lab.BreakpointHit):
            second.step(loss=step(bad, y2))
    assert second.batches()["grad_norm"].notna().tolist() == [True, False]
    assert any(not np.array_equal(o, n) for o, n in zip(before, weights_of(model)))
    assert np.isfinite(np.concatenate([w.ravel() for w in weights_of(model)])).all()


def test_a_gate_traced_in_a_block_lets_a_call_after_it_train_as_bare_and_holds_nothing_for_the_next_block(digits):
    # The gate kept in the traced graph still put back a non-finite update
    # after the block, and the hit it held there froze every update of the
    # next block, which said only that the optimizer applied no update.
    (x, y), (x2, y2) = batches(*digits, 2)
    bad = x2.copy()
    bad[0, 0] = np.inf

    def after_a_block(watched):
        model, optimizer = make_mlp(), keras.optimizers.SGD(0.1)
        step = make_step(model, optimizer, "graph")
        initial = weights_of(model)
        block = lab.watch(model, optimizer, breakpoints=[lab.breakpoints.nonfinite()]) if watched \
            else contextlib.nullcontext()
        with block as run:
            loss = step(x, y)
            if run is not None:
                run.step(loss=loss)
        step(bad, y2)  # after the block, unwatched
        return model, optimizer, step, initial

    bare, traced = after_a_block(False), after_a_block(True)
    assert int(traced[1].iterations.numpy()) == int(bare[1].iterations.numpy()) == 2
    for ours, theirs in zip(weights_of(traced[0]), weights_of(bare[0])):
        np.testing.assert_array_equal(ours, theirs)  # NaN where bare has NaN
    model, optimizer, step, initial = traced
    model.set_weights(initial)
    with lab.watch(model, optimizer, breakpoints=[lab.breakpoints.nonfinite()]) as run:
        for xb, yb in batches(*digits, 2):
            run.step(loss=step(xb, yb))
    assert run.batches()["updated"].tolist() == [1.0, 1.0]
    assert int(optimizer.iterations.numpy()) == 4


def test_a_step_traced_without_breakpoints_is_reported_when_they_are_asked_for(digits):
    model, optimizer = make_mlp(), keras.optimizers.SGD(0.1)
    step = make_step(model, optimizer, "graph")
    x, y = batches(*digits, 1)[0]
    with lab.watch(model, optimizer) as run:
        run.step(loss=step(x, y))
    with pytest.warns(RuntimeWarning, match="without the device breakpoints being checked"):
        with lab.watch(model, optimizer, breakpoints=[lab.breakpoints.nonfinite()]) as run:
            run.step(loss=step(x, y))


@pytest.mark.parametrize(("first", "then", "columns"), [
    ({"gradients": False}, {}, "grad_norm"),
    ({}, {"weights": True}, "weight_norm/"),
], ids=["gradients", "weights"])
def test_a_step_traced_without_the_norms_a_later_block_asks_for_is_reported_and_retraced_records_them(
        digits, first, then, columns):
    # The graph keeps the settings it was traced under: the later block's
    # columns were NaN and the run said nothing.
    model, optimizer = make_mlp(), keras.optimizers.SGD(0.1)
    step = make_step(model, optimizer, "graph")
    (x, y), (x2, y2) = batches(*digits, 2)
    with lab.watch(model, optimizer, **first) as run:
        run.step(loss=step(x, y))
    with pytest.warns(RuntimeWarning, match=r"traced in an earlier `lab.watch` block.*python_function"):
        with lab.watch(model, optimizer, **then) as run:
            run.step(loss=step(x, y))
            run.step(loss=step(x2, y2))
    frame = run.batches()
    assert frame[[c for c in frame if c.startswith(columns)]].isna().all().all()
    events = run.events()
    assert events[events["detail"].str.contains("traced in an earlier")]["step"].tolist() == [0]
    step = tf.function(step.python_function)  # the fix the run names
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with lab.watch(model, optimizer, **then) as run:
            run.step(loss=step(x, y))
    frame = run.batches()
    assert frame[[c for c in frame if c.startswith(columns)]].notna().all().all()
    assert events_about(run, "traced in an earlier") == []


def test_rows_reach_the_run_when_read_and_the_model_keeps_no_trace(digits, tmp_path):
    model, optimizer = make_mlp(), keras.optimizers.SGD(0.1)
    step = make_step(model, optimizer, "graph")
    paths = [w.path for w in model.weights]
    with lab.watch(model, optimizer, flush_every=3600) as run:
        for epoch in range(2):
            for x, y in batches(*digits, 2):
                run.step(loss=step(x, y), epoch=epoch)
            assert len(run.batches()) == 2 * (epoch + 1)  # read mid-loop: rows are there
    assert list(run.batches()["epoch"]) == [0, 0, 1, 1]
    assert [w.path for w in model.weights] == paths
    assert not any("lab" in v.name for v in optimizer.variables)
    run.save(tmp_path / "loop.h5")
    np.testing.assert_allclose(lab.Run.load(tmp_path / "loop.h5").batches()["loss"], run.batches()["loss"])


def test_an_interrupted_loop_leaves_an_interrupt_event(digits):
    model, optimizer = make_mlp(), keras.optimizers.SGD(0.1)
    step = make_step(model, optimizer)
    with pytest.raises(KeyboardInterrupt):
        with lab.watch(model, optimizer) as run:
            x, y = batches(*digits, 1)[0]
            run.step(loss=step(x, y))
            raise KeyboardInterrupt
    assert list(run.events()["kind"]) == ["interrupt"] and len(run) == 1
    assert run.status == "interrupted"
    assert "apply" not in vars(optimizer)


@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("ending", ["interrupt", "error", "caught"])
def test_an_update_the_loop_never_closed_with_run_step_is_told_when_the_block_ends(digits, mode, ending):
    # A Ctrl-C (or an error) between a step's update and its run.step, or a
    # loop that catches it and breaks: the model had one update more than the
    # run had rows, and the run said nothing of it.
    model, optimizer = make_mlp(), keras.optimizers.SGD(0.1)
    step = make_step(model, optimizer, mode)
    raised = {"interrupt": KeyboardInterrupt, "error": ValueError, "caught": KeyboardInterrupt}[ending]
    with pytest.raises(raised) if ending != "caught" else pytest.warns(RuntimeWarning, match="no row"):
        with lab.watch(model, optimizer) as run:
            try:
                for index, (x, y) in enumerate(batches(*digits, 3)):
                    loss = step(x, y)
                    if index == 2:
                        raise raised("stopped")
                    run.step(loss=loss)
            except KeyboardInterrupt:
                if ending != "caught":
                    raise
    assert len(run) == 2 and int(optimizer.iterations.numpy()) == 3
    told = events_about(run, "1 update after the last run.step")
    assert len(told) == 1 and "no row" in told[0]
    assert "apply" not in vars(optimizer)


@pytest.mark.parametrize("failure", [KeyboardInterrupt, RuntimeWarning])
def test_a_ctrl_c_or_a_warning_made_an_error_while_the_rows_are_read_loses_no_row(digits, monkeypatch, failure):
    # A Ctrl-C lands where the host waits, and a loop on a GPU waits for the
    # device where the rows are read: it lost every step since the last read
    # (the rows were reset on the device, the run had none of them).
    model, optimizer = make_mlp(), keras.optimizers.SGD(0.1)
    step = make_step(model, optimizer, "graph")
    with pytest.raises(failure):
        with lab.watch(model, optimizer, flush_every=3600) as run:
            read = run.probe.read_rows

            def read_then_fail(taken):
                monkeypatch.setattr(run.probe, "read_rows", read)  # once
                read(taken)
                raise failure("while the rows were read")

            monkeypatch.setattr(run.probe, "read_rows", read_then_fail)
            for x, y in batches(*digits, 4):
                run.step(loss=step(x, y))
            run.batches()
    frame = run.batches()
    assert frame["step"].tolist() == [0, 1, 2, 3] and frame["updated"].tolist() == [1.0] * 4
    assert frame["grad_norm"].notna().all()
    assert run.events()["step"].tolist() == [3]


def test_a_block_that_closed_every_update_tells_of_none(digits):
    model, optimizer = make_mlp(), keras.optimizers.SGD(0.1)
    step = make_step(model, optimizer, "graph")
    with pytest.raises(KeyboardInterrupt):
        with lab.watch(model, optimizer) as run:
            for x, y in batches(*digits, 2):
                run.step(loss=step(x, y))
            raise KeyboardInterrupt
    assert list(run.events()["detail"]) == ["KeyboardInterrupt"]


def test_a_model_too_wide_for_the_default_ring_gets_fewer_rows_within_the_64_mib_cap():
    # 2**16 slots a row: 256 rows fill the 2**24 slots (64 MiB) the ring may take.
    from lab.backend.tensorflow.loop_probe import _LoopSlots

    slots = _LoopSlots([("loss", 0.0)], 2**16 - 1, 1025, lambda name, value: tf.Variable(value))
    assert slots.rows == 256
    assert slots.vector.shape.num_elements() == slots.rows * slots.width <= 2**24


def applied_norms(steps):
    """What a step's row must hold: per variable, the norm over every apply of the step (tape gradients)."""
    return [np.sqrt(sum(np.sum(g[i].astype(np.float64) ** 2) for g in steps)) for i in range(len(steps[0]))]


def tape_gradients(model, x, y):
    with tf.GradientTape() as tape:
        loss = LOSS(y, model(x, training=True))
    return [g.numpy() for g in tape.gradient(loss, model.trainable_variables)]


@pytest.mark.parametrize("shape", ["apply in a tf.cond", "applies in a tf.while_loop",
                                   "a step function traced inside another's loop"])
def test_each_call_of_a_traced_step_writes_the_row_running_when_it_is_called(digits, shape):
    # The row a traced step writes is an input of each call, given by the host:
    # it must reach a branch, a loop body and a function called inside a loop.
    model, optimizer = make_mlp(), keras.optimizers.SGD(0.05)
    twin = make_mlp()

    def update(x, y):
        with tf.GradientTape() as tape:
            loss = LOSS(y, model(x, training=True))
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss

    inner = tf.function(update)

    @tf.function
    def step(x, y, times):
        if shape == "apply in a tf.cond":
            return tf.cond(times > 0, lambda: update(x, y), lambda: tf.constant(0.0))
        for _ in tf.range(times):
            if shape == "applies in a tf.while_loop":
                update(x, y)
            else:
                inner(x, y)
        return tf.constant(0.0)

    twin_optimizer = keras.optimizers.SGD(0.05)
    data = batches(*digits, 4)
    counts = [1, 2, 1, 0] if shape != "apply in a tf.cond" else [1, 0, 1, 1]
    with lab.watch(model, optimizer, flush_every=3600) as run:
        expected = []
        for (x, y), times in zip(data, counts):
            grads = []
            for _ in range(times):  # the same updates on a twin, for the tape's gradients
                grads.append(tape_gradients(twin, x, y))
                twin_optimizer.apply_gradients(zip([tf.constant(g) for g in grads[-1]], twin.trainable_variables))
            expected.append(applied_norms(grads) if grads else None)
            step(x, y, tf.constant(times))
            run.step(loss=0.0)
    frame = run.batches()
    assert list(frame["updated"]) == [1.0 if times else 0.0 for times in counts]
    for norms, (_, row) in zip(expected, frame.iterrows()):
        for index, variable in enumerate(model.trainable_variables):
            if norms is None:
                assert np.isnan(row[f"grad_norm/{variable.path}"])
            else:
                np.testing.assert_allclose(row[f"grad_norm/{variable.path}"], norms[index], rtol=1e-4)


def test_closing_a_step_runs_no_op_on_the_device(digits):
    # run.step costs the loop no eager op: the next call of the step takes its
    # row from the host (counted here by TensorFlow's own op callback).
    from tensorflow.python.framework import op_callbacks

    model, optimizer = make_mlp(), keras.optimizers.SGD(0.05)
    step = make_step(model, optimizer, "graph")
    data = batches(*digits, 3)
    executed = []

    def count(op_type, inputs, attrs, outputs, op_name=None, graph=None):
        if graph is None:
            executed.append(op_type)

    with lab.watch(model, optimizer, flush_every=3600) as run:
        losses = [step(x, y) for x, y in data[:1]]
        run.step(loss=losses[0])
        op_callbacks.add_op_callback(count)
        try:
            for x, y in data[1:]:
                loss = step(x, y)
                run.step(loss=loss)
        finally:
            op_callbacks.remove_op_callback(count)
    assert [op for op in executed if "train_step" not in op and "step" not in op] == []
    assert len(executed) == 2  # the two calls of the step itself
    assert list(run.batches()["updated"]) == [1.0, 1.0, 1.0]


def test_run_step_values_of_every_kind_arrive_as_float32_columns(digits):
    # Per-example losses are averaged; float64, int and bool tensors, Keras
    # metrics and Python numbers are kept, whatever the number of steps read at once.
    model, optimizer = make_mlp(), keras.optimizers.SGD(0.05)
    step = make_step(model, optimizer, "graph")
    mean = keras.metrics.Mean()
    expected = []
    with lab.watch(model, optimizer, flush_every=3600) as run:
        for index, (x, y) in enumerate(batches(*digits, 4) * 2):
            per_example = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)(y, model(x))
            step(x, y)
            mean.update_state(float(index))
            run.step(loss=per_example, precise=tf.constant(index / 3, tf.float64), count=tf.constant(index),
                     flag=tf.constant(index % 2 == 0), running=mean, number=index * 0.5)
            expected.append((float(np.mean(per_example.numpy())), index / 3, index, index % 2 == 0,
                             float(np.mean(np.arange(index + 1))), index * 0.5))
            if index == 2:
                assert len(run.batches()) == 3  # a read of three steps, then one of five
    frame = run.batches()
    columns = ["loss", "precise", "count", "flag", "running", "number"]
    for column in columns:
        assert frame[column].dtype == np.float32, column
    np.testing.assert_allclose(frame[columns].to_numpy(), np.array(expected, np.float32), rtol=1e-6)


def test_an_empty_batchs_per_example_loss_is_nan_without_a_numpy_warning(digits):
    # A batch with no examples has no loss: its row says NaN, and numpy's
    # "Mean of empty slice" does not reach the user.
    model, optimizer = make_mlp(), keras.optimizers.SGD(0.05)
    step = make_step(model, optimizer, "graph")
    (x, y), = batches(*digits, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with lab.watch(model, optimizer) as run:
            run.step(loss=step(x, y), other=1.0)
            run.step(loss=tf.zeros([0]), other=[])
            run.step(loss=tf.constant([1.0, 3.0]), other=[2.0])
    frame = run.batches()
    assert np.isnan(frame["loss"][1]) and np.isnan(frame["other"][1])
    assert frame["loss"][2] == 2.0 and frame["other"][2] == 2.0 and np.isfinite(frame["loss"][0])


def test_a_module_whose_step_was_traced_while_watching_saves_and_loads(digits, tmp_path):
    # The row's start is an input the host gives each call; a SavedModel, which
    # has no host to ask, gets row 0 and still runs.
    model, optimizer = make_mlp(), keras.optimizers.SGD(0.05)

    class Trainer(tf.Module):
        def __init__(self):
            super().__init__()
            self.model, self.optimizer = model, optimizer

        @tf.function(input_signature=[tf.TensorSpec([None, 64]), tf.TensorSpec([None], tf.int64)])
        def train(self, x, y):
            with tf.GradientTape() as tape:
                loss = LOSS(y, self.model(x, training=True))
            grads = tape.gradient(loss, self.model.trainable_variables)
            self.optimizer.apply_gradients(zip(grads, self.model.trainable_variables))
            return loss

    trainer = Trainer()
    x, y = batches(*digits, 1)[0]
    with lab.watch(model, optimizer) as run:
        run.step(loss=trainer.train(x, y.astype("int64")))
    assert run.batches()["updated"].tolist() == [1.0]
    tf.saved_model.save(trainer, str(tmp_path / "trainer"))
    loaded = tf.saved_model.load(str(tmp_path / "trainer"))
    assert np.isfinite(float(loaded.train(x, y.astype("int64"))))


def test_a_ring_past_the_kept_row_starts_still_writes_each_step_in_its_own_row(digits, monkeypatch):
    # Row starts beyond the first few thousand are made at each call, not kept.
    from lab.backend.tensorflow import loop_probe

    monkeypatch.setattr(loop_probe, "_KEPT_OFFSETS", 2)
    model, optimizer = make_mlp(), keras.optimizers.SGD(0.05)
    step = make_step(model, optimizer, "graph")
    expected = []
    with lab.watch(model, optimizer, flush_every=3600) as run:
        for x, y in batches(*digits, 4) * 2:
            expected.append(tape_norms(model, x, y)[1])
            run.step(loss=step(x, y))
        assert len(run.probe._slots._starts) == 2
    frame = run.batches()
    assert len(frame) == 8 and (frame["updated"] == 1).all()
    for norms, (_, row) in zip(expected, frame.iterrows()):
        assert_row_holds(row, norms)


def test_the_steps_of_the_rings_first_lap_make_no_tensor_between_steps(digits, monkeypatch):
    # Each call of a traced step takes where its row starts as a tensor. Made
    # at the call that first needed it, between two steps that leave the
    # caches cold, it cost that step 40-80 us for the first 1,024 steps of
    # every model; the ring makes them all when it is made.
    model, optimizer = make_mlp(), keras.optimizers.SGD(0.05)
    step = make_step(model, optimizer, "graph")
    (x, y), (x2, y2) = batches(*digits, 2)
    made = []
    constant = tf.constant
    with lab.watch(model, optimizer, flush_every=3600) as run:
        run.step(loss=step(x, y))  # traces the step
        monkeypatch.setattr(tf, "constant", lambda *args, **kwargs: made.append(args) or constant(*args, **kwargs))
        for _ in range(4):
            run.step(loss=step(x2, y2))
        monkeypatch.undo()
    assert made == []
    frame = run.batches()
    assert len(frame) == 5 and (frame["updated"] == 1).all() and frame["grad_norm"].notna().all()


def test_a_step_closed_while_another_thread_reads_the_run_is_kept(digits):
    # A widget reading a watched loop from its own thread: the loop's thread
    # may be between taking its row and listing it when the read starts.
    import threading

    model, optimizer = make_mlp(), keras.optimizers.SGD(0.05)
    step = make_step(model, optimizer, "graph")
    (x, y), (x2, y2) = batches(*digits, 2)
    listing, go_on = threading.Event(), threading.Event()
    with lab.watch(model, optimizer, flush_every=3600) as run:
        run.step(loss=step(x, y))

        class Held(type(run._pending)):
            """Holds the loop's thread between fetching the list and adding to it."""

            def append(self, item):
                listing.set()
                go_on.wait(10)
                super().append(item)

        run._pending = Held(run._pending)
        loss = step(x2, y2)
        closing = threading.Thread(target=run.step, kwargs={"loss": loss})
        closing.start()
        assert listing.wait(10)
        reader = threading.Thread(target=run.flush)
        reader.start()
        reader.join(0.5)  # the read runs now, or waits for the step to be closed
        go_on.set()
        closing.join(10)
        reader.join(10)
        assert len(run.batches()) == 2
    frame = run.batches()
    assert frame["step"].tolist() == [0, 1] and (frame["updated"] == 1).all()
    assert (run.events()["kind"] != "warning").all()


def make_deep(layers, seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((64,))] + [keras.layers.Dense(8, activation="relu") for _ in range(layers)]
                            + [keras.layers.Dense(10)])


def test_a_watched_step_adds_a_square_sum_per_variable_two_scatters_and_no_control_flow(digits):
    # Each node of a step costs the executor a few us on a CPU, and a check
    # with its branch (a Switch or an If) more: a watched step adds no
    # control flow, only each variable's l2_loss, one scatter that adds
    # (update counts, gradients' squares) and one that assigns (the learning
    # rate), and a few nodes more whatever the number of variables.
    def nodes(make, watched):
        model, optimizer = make(), keras.optimizers.SGD(0.05)
        step = make_step(model, optimizer, "graph")
        x, y = batches(*digits, 1)[0]
        if not watched:
            return lab.compat.graph_nodes(step.get_concrete_function(x, y).graph), model
        with lab.watch(model, optimizer) as run:
            run.step(loss=step(x, y))
            return lab.compat.graph_nodes(step.get_concrete_function(x, y).graph), model

    others = []
    for make in (make_mlp, lambda: make_deep(12)):
        (bare, _), (watched, model) = nodes(make, False), nodes(make, True)
        added = watched - bare
        assert all(added[kind] == 0 for kind in ("Switch", "Merge", "If", "StatelessIf", "While")), added
        assert added["L2Loss"] == len(model.trainable_variables)
        assert added["ResourceScatterNdAdd"] == 1 and added["ResourceScatterNdUpdate"] == 1, added
        others.append(sum(added.values()) - added["L2Loss"])
    assert others[0] == others[1] <= 14, others


def test_a_call_of_a_watched_step_costs_the_host_no_more_tensorflow_work_than_an_unwatched_one(digits, monkeypatch):
    # Each call takes its row as a call-time capture, which TensorFlow casts
    # to its spec at every call (about 12 us, over 1% of a 1 ms step): the
    # lab hands TensorFlow the tensor as it is, so a watched call casts
    # exactly what an unwatched call of the same step casts (its arguments).
    from tensorflow.python.framework import tensor as tensor_lib

    casts = []
    cast = tensor_lib.TensorSpec.cast
    monkeypatch.setattr(tensor_lib.TensorSpec, "cast", lambda spec, *a, **k: casts.append(spec) or cast(spec, *a, **k))

    def count(watched):
        model, optimizer = make_mlp(), keras.optimizers.SGD(0.05)
        step = make_step(model, optimizer, "graph")
        data = batches(*digits, 4)
        with (lab.watch(model, optimizer) if watched else contextlib.nullcontext()) as run:
            step(*data[0])
            casts.clear()
            for x, y in data:
                loss = step(x, y)
                if run is not None:
                    run.step(loss=loss)
            return len(casts)

    assert count(True) == count(False) > 0


def test_a_norm_whose_squares_overflow_is_inf_and_the_run_says_so(digits):
    # A finite gradient near 1e20 has a finite norm, but its sum of squares
    # overflows float32: lab.watch records inf for it and says so, in one
    # warning for every such column, at the step; the other steps keep their
    # exact norms.
    model, optimizer = make_mlp(), keras.optimizers.SGD(0.0)
    kernel = model.layers[-1].kernel

    @tf.function
    def step(x, y, scale):
        with tf.GradientTape() as tape:
            loss = LOSS(y, model(x, training=True)) * scale
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    data = batches(*digits, 3)
    with pytest.warns(RuntimeWarning, match="are inf from step 1") as caught:
        with lab.watch(model, optimizer) as run:
            for scale, (x, y) in zip([1.0, 1e30, 1e30], data):
                run.step(loss=step(x, y, tf.constant(scale)))
    frame = run.batches()
    column = frame[f"grad_norm/{kernel.path}"]
    assert np.isfinite(column[0]) and np.isinf(column[1]) and np.isinf(column[2])
    events = run.events()
    inf = events[events["detail"].str.contains("inf from step")]
    assert len(inf) == 1 and int(inf["step"].iloc[0]) == 1 and f"grad_norm/{kernel.path}" in inf["detail"].iloc[0]
    assert sum("inf from step" in str(w.message) for w in caught) == 1
    _, norms = tape_norms(model, *data[0])
    np.testing.assert_allclose(frame.iloc[0][f"grad_norm/{kernel.path}"], norms[kernel.path], rtol=1e-4)


def test_importing_the_lab_leaves_tensorflow_to_be_configured():
    # A notebook imports the lab first and may then set TensorFlow's threads
    # or devices, which TensorFlow refuses once its runtime has started: no
    # module of the lab may make a tensor at import.
    import subprocess
    import sys

    code = ("import lab, widgets, tensorflow as tf; tf.config.threading.set_intra_op_parallelism_threads(1); "
            "tf.config.set_visible_devices(tf.config.list_physical_devices('CPU')); print('configured')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "configured" in done.stdout, done.stderr[-2000:]


def test_a_keras_metric_with_a_vector_result_gets_a_column_per_element():
    # F1Score(average=None) gives one value per class: run.step averaged them
    # into one number, as if they were per-example values.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8)).astype("float32")
    y = np.eye(3, dtype="float32")[(x[:, 0] > 0).astype(int) + (x[:, 1] > 1)]
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3, activation="softmax")])
    optimizer, f1, accuracy = keras.optimizers.Adam(0.01), keras.metrics.F1Score(), keras.metrics.CategoricalAccuracy()
    results = []
    with lab.watch(model, optimizer) as run:
        for i in range(0, 64, 16):
            with tf.GradientTape() as tape:
                predicted = model(x[i:i + 16], training=True)
                loss = tf.reduce_mean(keras.losses.categorical_crossentropy(y[i:i + 16], predicted))
            optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
            f1.update_state(y[i:i + 16], predicted)
            accuracy.update_state(y[i:i + 16], predicted)
            run.step(loss=loss, f1=f1, accuracy=accuracy)
            results.append(f1.result().numpy())
    rows = run.batches()
    assert "f1" not in rows
    np.testing.assert_array_equal(rows[["f1/0", "f1/1", "f1/2"]].to_numpy(), np.array(results, np.float32))
    assert rows["accuracy"].notna().all()
