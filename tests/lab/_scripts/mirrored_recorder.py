"""Two virtual CPUs: strategy specs, and a Recorder under MirroredStrategy
against the same training on one device. Prints one JSON line."""

import json
import os
import sys
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import lab  # noqa: E402
from lab.backend.tensorflow.devices import batch_split  # noqa: E402

lab.virtual_cpus(2)

import keras  # noqa: E402
import numpy as np  # noqa: E402


def errors(call):
    try:
        call()
    except Exception as error:  # noqa: BLE001 - the message is what is checked
        return f"{type(error).__name__}: {error}"
    return None


def make_model(normalized=False):
    keras.utils.set_random_seed(1)
    model = keras.Sequential([
        keras.Input((8,)),
        # relu(NaN) is 0: the statistics are taken before it, where a NaN reaches them.
        *([keras.layers.Dense(6, name="hidden"), keras.layers.BatchNormalization(name="bn"),
           keras.layers.Activation("relu")] if normalized else [keras.layers.Dense(6, activation="relu", name="hidden")]),
        keras.layers.Dense(3, name="logits"),
    ], name="net")  # fixed names: both runs' variables get the same paths
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def record(strategy, x, y):
    with strategy.scope():
        model = make_model()
    recorder = lab.Recorder(gradients=True)
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[recorder])
    frame = recorder.run.batches()
    columns = [c for c in frame.columns
               if c in ("loss", "accuracy", "replica_skew") or c.startswith(("grad_norm", "loss/"))]
    return {
        "columns": {c: frame[c].astype(float).tolist() for c in columns},
        "weights": [w.tolist() for w in model.get_weights()],
    }


def sampled_norms(strategy, x, y):
    """norms_every on the replicas: every replica takes the same branch of
    the step (one step count for all), and the measured rows equal those
    of a recorder that takes the norms at every step."""
    runs = {}
    for every in (1, 2):
        with strategy.scope():
            model = make_model()
        recorder = lab.Recorder(gradients=True, weights=True, norms_every=every)
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[recorder])
        frame = recorder.run.batches()
        runs[every] = {c: frame[c].astype(float).tolist() for c in frame.columns
                       if c.startswith(("grad_norm", "weight_norm", "update_ratio"))}
        runs[f"weights_{every}"] = [w.tolist() for w in model.get_weights()]
    return {"every": runs[1], "sampled": runs[2], "weights_every": runs["weights_1"],
            "weights_sampled": runs["weights_2"]}


def breakpoint_run(strategy, x, y):
    """A NaN in one replica's share of batch 2: the nonfinite breakpoint must
    catch it, skip that update on every replica (the moving statistics of
    each replica's BatchNormalization too) and stop fit()."""
    x = x.copy()
    x[40] = np.nan
    with strategy.scope():
        model = make_model(normalized=True)
    recorder = lab.Recorder(gradients=True, breakpoints=[lab.breakpoints.nonfinite()])
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[recorder])
    events = recorder.run.events()
    batches = recorder.run.batches()
    grad_norms = batches["grad_norm"] if "grad_norm" in batches else np.full(len(batches), np.nan)
    return {
        "rows": len(batches),
        "grad_norms": [float(v) for v in grad_norms],
        "events": events[["step", "kind"]].values.tolist(),
        "iterations": int(model.optimizer.iterations.numpy()),
        "finite_weights": all(bool(np.isfinite(w).all()) for w in model.get_weights()),
        "finite_statistics": [bool(np.isfinite(copy.numpy()).all()) for variable in model.non_trainable_variables
                              for copy in getattr(variable.value, "values", [variable.value])],
    }


def compare_modes_replicas(strategy, x, y):
    """compare_modes on a mirrored model with BatchNormalization: each
    replica's copy of every variable (the moving statistics differ between
    replicas) must be put back as it was, not replica 0's copied onto all."""
    with strategy.scope():
        model = make_model(normalized=True)
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)

    def copies():
        return [c.numpy().copy() for v in model.variables + model.optimizer.variables
                for c in strategy.experimental_local_results(v.value)]

    first, second = strategy.experimental_local_results(model.get_layer("bn").moving_mean.value)
    differ = not np.array_equal(first.numpy(), second.numpy())
    before = copies()
    lab.compare_modes(model, (x, y), steps=2, batch_size=16, modes=("eager", "graph"), steps_per_execution=(1,))
    after = copies()
    return {
        "replicas_differ": differ,
        "unchanged": len(before) == len(after) and all(np.array_equal(a, b) for a, b in zip(before, after)),
    }


def predicted_on_replicas(strategy, x, y):
    """predict_stream on a mirrored model whose replicas' BatchNormalization
    statistics differ, 41 samples in batches of 16 (the last 9 split 5 and
    4): model.predict's values, bit for bit, graph and eager."""
    with strategy.scope():
        model = make_model(normalized=True)
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    first, second = strategy.experimental_local_results(model.get_layer("bn").moving_mean.value)
    out = {"replicas_differ": not np.array_equal(first.numpy(), second.numpy())}
    for mode in ("graph", "eager"):
        lab.set_mode(model, mode)
        expected = model.predict(x[:41], batch_size=16, verbose=0)
        got = np.concatenate(list(lab.predict_stream(model, x[:41], batch_size=16)))
        out[mode] = {"same": bool(np.array_equal(got, expected)),
                     "largest_difference": float(np.abs(got - expected).max())}
    return out


def uneven_first_batch_told(strategy, x, y):
    """A global batch the two replicas cannot share evenly (65: 33 and 32):
    bare fit() fails before it trains, and the lab says so where the batch
    size is given, with the fix: lab.inspect_data and the DevicePicker."""
    import widgets

    x, y = np.concatenate([x, x, x])[:130], np.concatenate([y, y, y])[:130]

    def build():
        with strategy.scope():
            return make_model()

    out = {"fit_65": errors(lambda: build().fit(x, y, batch_size=65, epochs=1, verbose=0)),
           "fit_64": errors(lambda: build().fit(x, y, batch_size=64, epochs=1, verbose=0))}
    model = build()
    for batch in (65, 64):
        report = lab.inspect_data(x, y, batch_size=batch, model=model)
        out[f"inspect_{batch}"] = [str(problem) for problem in report.problems if problem.kind == "replicas"]
        picker = widgets.DevicePicker(make_model, value="mirrored", batch_size=batch)
        picker.build()
        out[f"picker_{batch}"] = picker.status.value
    return out


def stepper_rewind_replicas(strategy, x, y):
    """Stepper.rewind on a mirrored model with BatchNormalization: each
    replica's copy of every variable must be put back as it was (it put
    replica 0's moving statistics on every replica), so stepping again, or
    a fit() after the rewind, goes as it would have."""
    def trained():
        with strategy.scope():
            model = make_model(normalized=True)
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        return model

    def copies(model):
        return [c.numpy().copy() for v in model.variables + model.optimizer.variables
                for c in strategy.experimental_local_results(v.value)]

    def same(a, b):
        return len(a) == len(b) and all(np.array_equal(u, v) for u, v in zip(a, b))

    model = trained()
    before = copies(model)
    stepper = lab.Stepper(model, (x, y), batch_size=16, shuffle=False)
    stepper.step(2)
    stepped = copies(model)
    stepper.rewind(2)
    rewound = copies(model)
    stepper.step(2)
    replayed = copies(model)
    stepper.rewind(2)
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    bare = trained()
    bare.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    return {"rewound": same(before, rewound), "replayed": same(stepped, replayed),
            "fit_after": same(copies(model), copies(bare))}


def stepper_as_fit(strategy, x, y):
    """The Stepper on a mirrored model with BatchNormalization and Adam,
    over batches that end in one split unevenly (41 samples, batch 16: the
    last 9 go 5 and 4): each step runs on the replicas as a mirrored fit()
    runs it, so every replica's copy of every variable ends as fit()'s,
    bit for bit (graph mode against fit(), eager mode against
    fit(run_eagerly=True)), and the rows hold the Recorder's values."""
    x, y = x[:41], y[:41]

    def made(run_eagerly=False):
        with strategy.scope():
            model = make_model(normalized=True)
            model.compile(optimizer=keras.optimizers.Adam(0.01), loss=model.loss, metrics=["accuracy"],
                          run_eagerly=run_eagerly)
        return model

    def copies(model):
        return [c.numpy() for v in model.variables + model.optimizer.variables
                for c in strategy.experimental_local_results(v.value)]

    out = {}
    for mode in ("graph", "eager"):
        fitted, recorder = made(run_eagerly=mode == "eager"), lab.Recorder(gradients=True)
        fitted.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[recorder])
        rows = recorder.run.batches()
        model = made()
        with warnings.catch_warnings(record=True) as told:
            warnings.simplefilter("always")
            stepper = lab.Stepper(model, (x, y), batch_size=16, shuffle=False, mode=mode)
            traces = [stepper.step() for _ in range(3)]
        after = copies(model)
        stepper.rewind(3)
        stepper.step(3)
        out[mode] = {
            "errors": [repr(t.error) for t in traces if t.error is not None],
            "told": [str(w.message) for w in told],
            "same_as_fit": [bool(np.array_equal(a, b)) for a, b in zip(after, copies(fitted))],
            "replayed": all(np.array_equal(a, b) for a, b in zip(after, copies(model))),
            "y_pred_rows": [int(t.y_pred.shape[0]) for t in traces],
            "columns": {c: [[float(t.row.get(c, np.nan)) for t in traces], rows[c].astype(float).tolist()]
                        for c in ("loss", "accuracy", "grad_norm")},
        }
    return out


def stepper_gan_as_fit(strategy, x, y):
    """keras-io's GAN of "Customizing what happens in fit()" (two optimizers
    given to its own compile(), seeded keras.random noise drawn twice per
    step, two Mean trackers) compiled under MirroredStrategy: three Stepper
    steps end with fit()'s weights and slots on every replica, bit for bit;
    the rows hold the Recorder's; rewind and replay land on them again."""
    import tensorflow as tf
    from keras import layers

    class GAN(keras.Model):
        def __init__(self, discriminator, generator, latent_dim):
            super().__init__()
            self.discriminator, self.generator, self.latent_dim = discriminator, generator, latent_dim
            self.seed_generator = keras.random.SeedGenerator(1337)
            self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
            self.g_loss_tracker = keras.metrics.Mean(name="g_loss")

        def call(self, x):  # Keras builds a mirrored model by calling it
            return self.discriminator(x)

        @property
        def metrics(self):
            return [self.d_loss_tracker, self.g_loss_tracker]

        def compile(self, d_optimizer, g_optimizer, loss_fn):
            super().compile()
            self.d_optimizer, self.g_optimizer, self.loss_fn = d_optimizer, g_optimizer, loss_fn

        def train_step(self, real):
            if isinstance(real, tuple):
                real = real[0]
            batch_size = tf.shape(real)[0]
            noise = keras.random.normal(shape=(batch_size, self.latent_dim), seed=self.seed_generator)
            combined = tf.concat([self.generator(noise), real], axis=0)
            labels = tf.concat([tf.ones((batch_size, 1)), tf.zeros((batch_size, 1))], axis=0)
            with tf.GradientTape() as tape:
                d_loss = self.loss_fn(labels, self.discriminator(combined))
            grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
            self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))
            noise = keras.random.normal(shape=(batch_size, self.latent_dim), seed=self.seed_generator)
            with tf.GradientTape() as tape:
                g_loss = self.loss_fn(tf.zeros((batch_size, 1)), self.discriminator(self.generator(noise)))
            grads = tape.gradient(g_loss, self.generator.trainable_weights)
            self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))
            self.d_loss_tracker.update_state(d_loss)
            self.g_loss_tracker.update_state(g_loss)
            return {"d_loss": self.d_loss_tracker.result(), "g_loss": self.g_loss_tracker.result()}

    def made():
        keras.utils.set_random_seed(0)
        with strategy.scope():
            discriminator = keras.Sequential([keras.Input((8,)), layers.Dense(16, activation="relu"), layers.Dense(1)])
            generator = keras.Sequential([keras.Input((4,)), layers.Dense(16, activation="relu"), layers.Dense(8)])
            gan = GAN(discriminator, generator, 4)
            gan.compile(keras.optimizers.Adam(1e-3), keras.optimizers.Adam(1e-3),
                        keras.losses.BinaryCrossentropy(from_logits=True))
            # Built in the scope: a mirrored fit() cannot make their slots inside its step.
            gan.d_optimizer.build(discriminator.trainable_variables)
            gan.g_optimizer.build(generator.trainable_variables)
        return gan

    def copies(model):
        return [c.numpy() for v in model.variables + model.d_optimizer.variables + model.g_optimizer.variables
                for c in strategy.experimental_local_results(v.value)]

    images = x[:48]
    fitted, recorder = made(), lab.Recorder(gradients=True)
    fitted.fit(images, batch_size=16, shuffle=False, epochs=1, verbose=0, callbacks=[recorder])
    rows = recorder.run.batches()
    stepped = made()
    with warnings.catch_warnings(record=True) as told:
        warnings.simplefilter("always")
        stepper = lab.Stepper(stepped, images, batch_size=16, shuffle=False, mode="graph")
        traces = [stepper.step() for _ in range(3)]
    same = all(np.array_equal(a, b) for a, b in zip(copies(stepped), copies(fitted)))
    stepper.rewind(3)
    stepper.step(3)
    return {"errors": [repr(t.error) for t in traces if t.error is not None], "told": [str(w.message) for w in told],
            "same_as_fit": same,
            "replayed": all(np.array_equal(a, b) for a, b in zip(copies(stepped), copies(fitted))),
            "columns": {c: [[float(t.row.get(c, np.nan)) for t in traces], rows[c].astype(float).tolist()]
                        for c in ("d_loss", "g_loss", "grad_norm")}}


def stepper_interrupted(strategy, x, y):
    """Ctrl-C while an eager step runs on the replicas (in threads of their
    own): the step is undone on every replica's copy, and the next step
    trains as fit() does."""
    import signal
    import threading
    import time

    import tensorflow as tf

    class Interrupted(keras.Sequential):
        armed = False

        def train_step(self, data):
            if Interrupted.armed and tf.distribute.get_replica_context().replica_id_in_sync_group == 1:
                Interrupted.armed = False
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.3)  # the other replica and the main thread go on meanwhile
            return super().train_step(data)

    def made(cls, run_eagerly=False):
        keras.utils.set_random_seed(1)
        with strategy.scope():
            model = cls([keras.Input((8,)), keras.layers.Dense(3)])
            model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", run_eagerly=run_eagerly)
        return model

    def copies(model):
        return [c.numpy().copy() for v in model.variables + model.optimizer.variables
                for c in strategy.experimental_local_results(v.value)]

    targets = np.eye(3, dtype="float32")[y[:32]]
    threads = threading.active_count()
    model = made(Interrupted)
    stepper = lab.Stepper(model, (x[:32], targets), batch_size=16, shuffle=False, mode="eager")
    stepper.step()
    before = copies(model)
    Interrupted.armed = True
    try:
        stepper.step()
        interrupted = False
    except KeyboardInterrupt:
        interrupted = True
    undone = all(np.array_equal(a, b) for a, b in zip(before, copies(model)))
    error = repr(stepper.step().error)
    fitted = made(keras.Sequential, run_eagerly=True)
    fitted.fit(x[:32], targets, batch_size=16, shuffle=False, epochs=1, verbose=0)
    return {"interrupted": interrupted, "undone": undone, "next_error": error,
            "as_fit": all(np.array_equal(a, b) for a, b in zip(copies(model), copies(fitted))),
            "threads_left": threading.active_count() - threads}


def stepper_and_modes(strategy, x, y):
    """The Stepper, and set_mode's eager mode and XLA refusal, on a mirrored model."""
    with strategy.scope():
        model = make_model()
    run = lab.Run()
    with warnings.catch_warnings(record=True) as told:
        warnings.simplefilter("always")
        stepper = lab.Stepper(model, (x, y), batch_size=16, shuffle=False, run=run)
    replicas_told = [str(w.message) for w in told if "replicas" in str(w.message)]
    trace = stepper.step()
    stepper.step()
    stepper.rewind(1)
    out = {"step_index": trace.index, "step_loss": float(trace.logs["loss"]),
           "step_gradients": len(trace.gradients or {}), "step_error": repr(trace.error),
           "traces_after_rewind": len(stepper.traces), "replicas_told": replicas_told,
           "replicas_events": [d for d in run.events()["detail"] if "replicas" in d]}
    # Adam's slots: made in the scope before the first step, as fit() makes them.
    with strategy.scope():
        adam = make_model()
        adam.compile(optimizer=keras.optimizers.Adam(0.01), loss=model.loss)
    adam_trace = lab.Stepper(adam, (x, y), batch_size=16, shuffle=False).step()
    out["adam_step_error"] = repr(adam_trace.error)
    out["adam_slots"] = len(adam.optimizer.variables)
    with strategy.scope():  # stepped inside the scope, as keras-io's distributed guide keeps everything
        out["in_scope_error"] = repr(lab.Stepper(model, (x, y), batch_size=16, shuffle=False).step().error)
    # Gradient accumulation's update runs in a nested graph, whose values
    # cannot leave a replica: such a model steps as one device, and says so.
    with strategy.scope():
        accumulating = make_model()
        accumulating.compile(optimizer=keras.optimizers.SGD(0.1, gradient_accumulation_steps=2), loss=model.loss)
    with warnings.catch_warnings(record=True) as told:
        warnings.simplefilter("always")
        lab.Stepper(accumulating, (x, y), batch_size=16, shuffle=False)
    out["one_device_told"] = [str(w.message) for w in told if "replicas" in str(w.message)]
    out["xla"] = errors(lambda: lab.set_mode(model, "xla"))
    lab.set_mode(model, "eager")
    try:
        recorder = lab.Recorder(gradients=True)
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[recorder])
        out["eager_grad_norms"] = recorder.run.batches()["grad_norm"].astype(float).tolist()
    except Exception as error:  # noqa: BLE001 - reported, so the other checks still run
        out["eager_error"] = f"{type(error).__name__}: {error}"
    return out


def half_batches(x, y):
    """Loss and gradient norm of the untrained model on each half of the first batch:
    what each of two replicas computes at step 0."""
    import tensorflow as tf

    model = make_model()
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    halves = []
    for part in (slice(0, 8), slice(8, 16)):
        with tf.GradientTape() as tape:
            loss = loss_fn(y[part], model(x[part]))
        grads = tape.gradient(loss, model.trainable_variables)
        halves.append([float(loss), float(tf.linalg.global_norm(grads))])
    return halves


def watched_loop(strategy, x, y, compiled=True, breakpoints=(), in_scope=False):
    """The tf.distribute guide's custom loop (`strategy.run` inside a
    `tf.function`, or called eagerly) under `lab.watch`: its rows and weights.
    With `in_scope`, the block and the loop run inside `strategy.scope()`, as
    keras-io's distributed training guide keeps everything."""
    import contextlib

    import tensorflow as tf

    with strategy.scope():
        model = make_model()
        optimizer = keras.optimizers.SGD(0.1)
    loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    def train_step(inputs):
        def step_fn(batch):
            features, labels = batch
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(loss_object(labels, model(features, training=True)),
                                                  global_batch_size=16)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        return strategy.reduce("SUM", strategy.run(step_fn, args=(inputs,)), axis=None)

    if compiled:
        train_step = tf.function(train_step)
    dataset = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(16))
    hit = None
    try:
        with strategy.scope() if in_scope else contextlib.nullcontext(), \
                lab.watch(model, optimizer, weights=not breakpoints, breakpoints=breakpoints, flush_every=3600) as run:
            for batch in dataset:
                run.step(loss=train_step(batch))
    except lab.BreakpointHit as error:
        hit = [error.step, error.breakpoint, error.skipped]
    frame = run.batches()
    columns = [c for c in frame.columns
               if c in ("loss", "updated") or c.startswith(("grad_norm", "weight_norm", "update_ratio"))]
    return {"columns": {c: frame[c].astype(float).tolist() for c in columns},
            "weights": [w.tolist() for w in model.get_weights()], "hit": hit,
            "iterations": int(optimizer.iterations.numpy()),
            "finite_weights": all(bool(np.isfinite(w).all()) for w in model.get_weights())}


def uneven_last_batch(strategy):
    """41 samples in batches of 8: the last batch's one sample goes to one
    replica, none to the other. Learning rate 0: every batch at the same weights."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(41, 5)).astype("float32"), rng.integers(0, 3, size=(41,))
    with strategy.scope():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)])
        model.compile(keras.optimizers.SGD(0.0), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    recorder = lab.Recorder()
    history = model.fit(x, y, batch_size=8, shuffle=False, verbose=0, callbacks=[recorder]).history
    rows = recorder.run.batches()
    last = rows.iloc[-1]
    sizes = np.array([8, 8, 8, 8, 8, 1])
    return {"loss": float(last["loss"]), "replicas": [float(last["loss/replica_0"]), float(last["loss/replica_1"])],
            "skew": float(last["replica_skew"]),
            "own": float(keras.losses.SparseCategoricalCrossentropy(from_logits=True)(y[40:], model(x[40:]))),
            "all_own": float(keras.losses.SparseCategoricalCrossentropy(from_logits=True)(y, model(x))),
            "history": history["loss"][0], "rows_weighted": float((sizes * rows["loss"].to_numpy()).sum() / 41)}


def data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(64, 8)).astype("float32"), rng.integers(0, 3, 64).astype("int32")


def guide_step_warnings(strategy, x, y):
    """keras-io's custom train_step guide under the strategy: its step feeds
    the loss tracker compute_loss's loss, scaled by 1/replicas (Keras 3.8+).
    The warnings the lab gives, with the tracker fed as it is and unscaled."""
    import warnings

    import tensorflow as tf

    class CustomModel(keras.Model):
        unscaled = False

        def train_step(self, data):
            features, labels = data
            with tf.GradientTape() as tape:
                predictions = self(features, training=True)
                loss = self.compute_loss(y=labels, y_pred=predictions)
            self.optimizer.apply(tape.gradient(loss, self.trainable_variables), self.trainable_variables)
            for metric in self.metrics:
                if metric.name == "loss":
                    # Keras before 3.8 does not scale: the fix applies from 3.8 on.
                    scaled = self.unscaled and lab.compat.SCALES_LOSS_BY_REPLICAS
                    metric.update_state(loss * self.distribute_strategy.num_replicas_in_sync if scaled else loss)
                else:
                    metric.update_state(labels, predictions)
            return {m.name: m.result() for m in self.metrics}

    found = {}
    for unscaled in (False, True):
        keras.utils.set_random_seed(1)
        with strategy.scope():
            inputs = keras.Input((8,))
            model = CustomModel(inputs, keras.layers.Dense(3)(inputs))
            model.unscaled = unscaled
            model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[lab.Recorder()])
        found["unscaled" if unscaled else "as_guide"] = [str(w.message) for w in caught
                                                         if "loss Keras reports" in str(w.message)]
    return found


def lower_level_step(strategy, x, y):
    """keras-io's "going lower-level" step (its own loss object and Mean
    tracker), under the strategy and on one device, its tracker fed as the
    guide feeds it and unscaled: the lab's loss rows, History and warnings."""
    import warnings

    import tensorflow as tf

    class CustomModel(keras.Model):
        unscaled = False

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.loss_tracker = keras.metrics.Mean(name="loss")
            self.loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

        def train_step(self, data):
            features, labels = data
            with tf.GradientTape() as tape:
                loss = self.loss_fn(labels, self(features, training=True))
            self.optimizer.apply(tape.gradient(loss, self.trainable_variables), self.trainable_variables)
            scaled = self.unscaled and lab.compat.SCALES_LOSS_BY_REPLICAS
            self.loss_tracker.update_state(loss * self.distribute_strategy.num_replicas_in_sync if scaled else loss)
            return {"loss": self.loss_tracker.result()}

        @property
        def metrics(self):
            return [self.loss_tracker]

    from keras.src.losses import loss as loss_module

    def keras_functions():  # Keras before 3.8 has neither
        return (getattr(loss_module, "scale_loss_for_distribution", None),
                getattr(loss_module, "unscale_loss_for_distribution", None))

    own = keras_functions()
    found = {}
    for name, where, unscaled in (("one", lab.strategy("cpu"), False), ("as_guide", strategy, False),
                                  ("unscaled", strategy, True)):
        keras.utils.set_random_seed(1)
        with where.scope():
            inputs = keras.Input((8,))
            model = CustomModel(inputs, keras.layers.Dense(3)(inputs))
            model.unscaled = unscaled
            model.compile(optimizer="adam")
        recorder = lab.Recorder()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            history = model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[recorder])
        found[name] = {"rows": recorder.run.batches()["loss"].tolist(), "history": history.history["loss"],
                       "warnings": [str(w.message) for w in caught if "train_step logs" in str(w.message)],
                       "events": recorder.run.events()["detail"].tolist()}
    found["keras_functions_back"] = own == keras_functions()
    return found


def metrics_on_replicas(strategy, x, y):
    """A vector metric (F1Score, one value per class) and one that is not a
    mean (RootMeanSquaredError) on the replicas: the rows hold what Keras
    reports at each batch, and the run says what that is there."""
    with strategy.scope():
        model = make_model()
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=keras.losses.CategoricalCrossentropy(from_logits=True),
                      metrics=[keras.metrics.F1Score(name="f1"), keras.metrics.RootMeanSquaredError(name="rmse")])

    class Logs(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.rows = []

        def on_train_batch_end(self, batch, logs=None):
            self.rows.append({k: np.asarray(v).tolist() for k, v in logs.items()})

    recorder, logs = lab.Recorder(), Logs()
    onehot = np.eye(3, dtype="float32")[y]
    model.fit(x, onehot, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[logs, recorder])
    frame, events = recorder.run.batches(), recorder.run.events()
    return {"f1": frame[["f1/0", "f1/1", "f1/2"]].astype(float).values.tolist(),
            "rmse": frame["rmse"].astype(float).tolist(),
            "keras_f1": [row["f1"] for row in logs.rows], "keras_rmse": [row["rmse"] for row in logs.rows],
            "running": sorted(recorder.run.metadata["running_values"]),
            "told": [d for k, d in zip(events["kind"], events["detail"]) if k == "running_value"]}


def tf_split(strategy, n):
    """The examples each replica gets of one batch of `n`, from tf.distribute itself."""
    import tensorflow as tf

    batches = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices(np.zeros((n, 2), "float32")).batch(n))
    return [int(v.shape[0]) for v in strategy.experimental_local_results(next(iter(batches)))]


def float8_replicas(strategy, x, y):
    """Float8 training on the replicas: each replica's gradient norm at step
    0, recorded and by a tape on its half of the batch, of the kernels and
    biases alone (the scales and amax histories the step sets are handed to
    the optimizer as gradients too)."""
    import tensorflow as tf

    def made():
        model = make_model()
        model.quantize("float8")
        return model

    with strategy.scope():
        model = made()
    recorder = lab.Recorder(gradients=True)
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[recorder])
    frame = recorder.run.batches()
    fresh = made()
    trained = [v for v in fresh.trainable_variables if not getattr(v, "overwrite_with_gradient", False)]
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function  # Keras' float8 gradient fails eagerly
    def norm(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, fresh(xb, training=True))
        return tf.linalg.global_norm(tape.gradient(loss, trained))

    return {"recorded": [float(frame[f"grad_norm/replica_{i}"].iloc[0]) for i in range(2)],
            "tape": [float(norm(x[part], y[part])) for part in (slice(0, 8), slice(8, 16))],
            "set_apart": [c for c in frame.columns if c.endswith(("_scale", "_amax_history"))]}


def main():
    out = {}
    frame = lab.devices()
    out["devices"] = frame[["name", "type"]].values.tolist()
    mirrored = lab.strategy("mirrored")
    out["replicas"] = mirrored.num_replicas_in_sync
    out["mirrored_type"] = type(mirrored).__name__
    out["same_object"] = (lab.strategy("mirrored") is mirrored and lab.strategy("cpu:0,1") is mirrored
                          and lab.strategy(" CPU:1, 0") is mirrored)
    out["cpu1"] = type(lab.strategy("cpu:1")).__name__
    out["split"] = batch_split(mirrored, 33)[["device", "examples"]].values.tolist()
    out["split_against_tf"] = [(batch_split(mirrored, n)["examples"].tolist(), tf_split(mirrored, n)) for n in (33, 1)]
    out["gpu_error"] = errors(lambda: lab.strategy("gpu"))
    out["cpu2_error"] = errors(lambda: lab.strategy("cpu:2"))
    out["virtual_again"] = errors(lambda: lab.virtual_cpus(2))
    out["virtual_other"] = errors(lambda: lab.virtual_cpus(3))
    if "--no-fit" not in sys.argv:
        x, y = data()
        try:
            out["one"] = record(lab.strategy("cpu"), x, y)
            out["mirrored"] = record(mirrored, x, y)
            out["halves"] = half_batches(x, y)
            out["breakpoint"] = breakpoint_run(mirrored, x, y)
            out["guide_step"] = guide_step_warnings(mirrored, x, y)
            out["lower_level"] = lower_level_step(mirrored, x, y)
            out["uneven"] = uneven_last_batch(mirrored)
            out["loop_one"] = watched_loop(lab.strategy("cpu"), x, y)
            out["loop_mirrored"] = watched_loop(mirrored, x, y)
            out["loop_mirrored_eager"] = watched_loop(mirrored, x, y, compiled=False)
            bad = x.copy()
            bad[40] = np.nan  # batch 2, the second replica's half
            out["loop_nonfinite"] = watched_loop(mirrored, bad, y, breakpoints=[lab.breakpoints.nonfinite()])
        except Exception as error:  # noqa: BLE001 - reported, so the other checks still run
            out["fit_error"] = f"{type(error).__name__}: {error}"
        try:
            bad = x.copy()
            bad[40] = np.nan
            out["loop_mirrored_in_scope"] = watched_loop(mirrored, x, y, in_scope=True)
            out["loop_mirrored_in_scope_eager"] = watched_loop(mirrored, x, y, compiled=False, in_scope=True)
            out["loop_nonfinite_in_scope"] = watched_loop(mirrored, bad, y, breakpoints=[lab.breakpoints.nonfinite()],
                                                          in_scope=True)
        except Exception as error:  # noqa: BLE001 - reported, so the other checks still run
            out["loop_in_scope_error"] = f"{type(error).__name__}: {error}"
        # Each check on its own: one that fails is reported, and the others still run.
        for key, check in (("tools", stepper_and_modes), ("stepper_as_fit", stepper_as_fit),
                           ("stepper_gan", stepper_gan_as_fit),
                           ("stepper_interrupted", stepper_interrupted), ("predicted", predicted_on_replicas),
                           ("stepper_rewind", stepper_rewind_replicas), ("compare_modes", compare_modes_replicas),
                           ("uneven_first", uneven_first_batch_told), ("metrics", metrics_on_replicas),
                           ("float8", float8_replicas), ("sampled_norms", sampled_norms)):
            try:
                out[key] = check(mirrored, x, y)
            except Exception as error:  # noqa: BLE001 - reported, so the other checks still run
                out[f"{key}_error"] = f"{type(error).__name__}: {error}"
    print(json.dumps(out))


if __name__ == "__main__":
    main()
