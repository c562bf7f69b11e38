"""keras-io's "Multi-GPU distributed training with TensorFlow" guide on two
virtual CPUs, bare and with a Recorder attached: its end-to-end example
(model made and compiled in `MirroredStrategy`'s scope, fit on Datasets with
validation, evaluate) and its fault-tolerance example (a ModelCheckpoint each
epoch, then `make_or_restore_model` and a second fit resumed from the
checkpoint), each run twice in directories of their own. Only the guide's
MNIST download is replaced, by generated arrays of the same shapes and
kinds; the models are seeded alike. Prints one JSON line."""

import json
import os
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import lab  # noqa: E402

lab.virtual_cpus(2)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402


# ---- the guide's code (its MNIST download replaced) ---------------------------

def get_compiled_model():
    # Make a simple 2-layer densely-connected neural network.
    inputs = keras.Input(shape=(784,))
    x = keras.layers.Dense(256, activation="relu")(inputs)
    x = keras.layers.Dense(256, activation="relu")(x)
    outputs = keras.layers.Dense(10)(x)
    model = keras.Model(inputs, outputs)
    model.compile(
        optimizer=keras.optimizers.Adam(),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[keras.metrics.SparseCategoricalAccuracy()],
    )
    return model


def load_data():
    """In place of `keras.datasets.mnist.load_data()`: uint8 images of 28x28
    and their labels, 480 for training and 96 for testing."""
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(576, 28, 28)).astype("uint8")
    labels = rng.integers(0, 10, size=576).astype("uint8")
    return (images[:480], labels[:480]), (images[480:], labels[480:])


def get_dataset():
    batch_size = 32
    num_val_samples = 96

    # Return the MNIST dataset in the form of a `tf.data.Dataset`.
    (x_train, y_train), (x_test, y_test) = load_data()

    # Preprocess the data (these are Numpy arrays)
    x_train = x_train.reshape(-1, 784).astype("float32") / 255
    x_test = x_test.reshape(-1, 784).astype("float32") / 255
    y_train = y_train.astype("float32")
    y_test = y_test.astype("float32")

    # Reserve num_val_samples samples for validation
    x_val = x_train[-num_val_samples:]
    y_val = y_train[-num_val_samples:]
    x_train = x_train[:-num_val_samples]
    y_train = y_train[:-num_val_samples]
    return (
        tf.data.Dataset.from_tensor_slices((x_train, y_train)).batch(batch_size),
        tf.data.Dataset.from_tensor_slices((x_val, y_val)).batch(batch_size),
        tf.data.Dataset.from_tensor_slices((x_test, y_test)).batch(batch_size),
    )


def end_to_end(callbacks):
    # Create a MirroredStrategy.
    strategy = tf.distribute.MirroredStrategy()
    print("Number of devices: {}".format(strategy.num_replicas_in_sync))

    # Open a strategy scope.
    with strategy.scope():
        # Everything that creates variables should be under the strategy scope.
        # In general this is only model construction & `compile()`.
        model = get_compiled_model()

        # Train the model on all available devices.
        train_dataset, val_dataset, test_dataset = get_dataset()
        history = model.fit(train_dataset, epochs=2, validation_data=val_dataset, callbacks=callbacks)

        # Test the model on all available devices.
        evaluated = model.evaluate(test_dataset)
    return strategy, model, history, evaluated


def fault_tolerant(checkpoint_dir, callbacks_of_run):
    """The guide's `make_or_restore_model` and `run_training`, run twice."""
    train_dataset, val_dataset, _ = get_dataset()

    def make_or_restore_model():
        # Either restore the latest model, or create a fresh one
        # if there is no checkpoint available.
        checkpoints = [checkpoint_dir + "/" + name for name in os.listdir(checkpoint_dir)]
        if checkpoints:
            latest_checkpoint = max(checkpoints, key=os.path.getctime)
            print("Restoring from", latest_checkpoint)
            return keras.models.load_model(latest_checkpoint)
        print("Creating a new model")
        return get_compiled_model()

    def run_training(epochs=1):
        # Create a MirroredStrategy.
        strategy = tf.distribute.MirroredStrategy()

        # Open a strategy scope and create/restore the model
        with strategy.scope():
            model = make_or_restore_model()

            callbacks = [
                # This callback saves a SavedModel every epoch
                # We include the current epoch in the folder name.
                keras.callbacks.ModelCheckpoint(
                    filepath=checkpoint_dir + "/ckpt-{epoch}.keras",
                    save_freq="epoch",
                )
            ]
            history = model.fit(
                train_dataset,
                epochs=epochs,
                callbacks=callbacks + callbacks_of_run(),
                validation_data=val_dataset,
                verbose=2,
            )
        return model, history

    # Running the first time creates the model
    first = run_training(epochs=1)
    # Calling the same function again will resume from where we left off
    second = run_training(epochs=1)
    return first, second


# ---- bare and watched --------------------------------------------------------

def state(model):
    """Every weight and optimizer variable, as lists (in order)."""
    return [np.asarray(v).tolist() for v in model.get_weights()] + \
        [np.asarray(v.numpy()).tolist() for v in model.optimizer.variables]


def logs(history):
    return {k: [float(v) for v in values] for k, values in history.history.items()}


def strategies_made_again():
    """The guide's end-to-end example bare, then again with a Recorder on a
    new MirroredStrategy, in one process: TensorFlow gives the second
    strategy the first one's collective keys, and the watched step's
    all-reduces are not the bare step's."""
    import warnings

    end_to_end([])
    recorder = lab.Recorder()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            end_to_end([recorder])
            error = None
        except Exception as raised:  # noqa: BLE001 - what the user sees is what is checked
            error = f"{type(raised).__name__}: {raised}"
    events = recorder.run.events()
    return {"error": error, "status": recorder.status, "detail": recorder.status_detail,
            "events": list(zip(events["kind"], events["detail"])),
            "warnings": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]}


def loop_on_a_strategy_made_again():
    """The guide's end-to-end example bare, then a wider model trained by the
    tf.distribute custom loop under `lab.watch` on a new MirroredStrategy, in
    one process: its gradients' all-reduce has another shape under the keys
    the first strategy used."""
    import warnings

    end_to_end([])
    strategy = tf.distribute.MirroredStrategy()
    with strategy.scope():
        inputs = keras.Input(shape=(784,))
        model = keras.Model(inputs, keras.layers.Dense(10)(keras.layers.Dense(300, activation="relu")(inputs)))
        model.compile(optimizer=keras.optimizers.Adam(),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.optimizer.build(model.trainable_variables)  # its variables before the loop's function
    loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    @tf.function
    def train_step(inputs):
        def step_fn(batch):
            features, labels = batch
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(loss_object(labels, model(features, training=True)),
                                                  global_batch_size=32)
            grads = tape.gradient(loss, model.trainable_variables)
            model.optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        return strategy.reduce("SUM", strategy.run(step_fn, args=(inputs,)), axis=None)

    dataset = strategy.experimental_distribute_dataset(get_dataset()[0])
    run, error = None, None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with lab.watch(model, model.optimizer) as run:
                for batch in dataset:
                    run.step(loss=train_step(batch))
        except Exception as raised:  # noqa: BLE001 - what the user sees is what is checked
            error = f"{type(raised).__name__}: {raised}"
    events = run.events()
    return {"error": error, "status": run.status, "events": list(zip(events["kind"], events["detail"])),
            "warnings": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]}


def main(kind):
    """Runs the guide bare or watched (`kind`): in a process of its own, since
    TensorFlow keys a MirroredStrategy's collective ops by their order, and a
    new strategy in the same process reuses the keys of an earlier one."""
    if kind in ("made again", "loop made again"):
        print(json.dumps((strategies_made_again if kind == "made again" else loop_on_a_strategy_made_again)()))
        return
    recorders = []

    def callbacks():
        if kind == "bare":
            return []
        recorders.append(lab.Recorder(gradients=True, weights=True))
        return [recorders[-1]]

    keras.utils.set_random_seed(7)
    fresh = get_compiled_model()  # as the strategy's first model starts, on one device
    x, y = next(iter(get_dataset()[0]))
    first_batch_loss = float(fresh.loss(y, fresh(x)))
    keras.utils.set_random_seed(7)
    strategy, model, history, evaluated = end_to_end(callbacks())
    out = {"replicas": strategy.num_replicas_in_sync, "first_batch_loss": first_batch_loss,
           "state": state(model), "logs": logs(history),
           "evaluated": [float(v) for v in evaluated]}
    with tempfile.TemporaryDirectory() as checkpoint_dir:
        keras.utils.set_random_seed(7)
        (first, first_history), (second, second_history) = fault_tolerant(checkpoint_dir, callbacks)
        out["checkpoints"] = sorted(os.listdir(checkpoint_dir))
        restored = keras.models.load_model(os.path.join(checkpoint_dir, "ckpt-1.keras"))
    out.update(first=state(first), second=state(second), restored=state(restored),
               first_logs=logs(first_history), second_logs=logs(second_history))
    if recorders:
        out["recorded"] = [{"rows": len(r.run.batches()), "status": r.status,
                            "columns": sorted(c for c in r.run.batches().columns
                                              if c.startswith(("grad_norm/", "weight_norm/", "update_ratio/"))),
                            "finite": bool(np.isfinite(r.run.batches()["grad_norm"]).all()),
                            "loss": r.run.batches()["loss"].astype(float).tolist(),
                            "events": r.run.events()["kind"].tolist()} for r in recorders]
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
