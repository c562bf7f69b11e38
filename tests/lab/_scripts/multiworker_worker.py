"""One worker of a two-worker MultiWorkerMirroredStrategy run on localhost.

TF_CONFIG comes from the parent. Trains a small model with a Recorder; the
chief (task 0) saves its run to argv[1]. Prints one JSON line with the final
weights and the number of recorded rows.

Keras 3.15's `fit()` fails under a real multi-worker strategy in two places
(keras-team/keras#20585): its symbolic build reduces the first batch's
tuple, and each step's scalar logs are reduced along axis 0. The two
work-arounds below are the ones a user needs today, with or without the lab.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import lab  # noqa: E402

# A multi-worker strategy has to be made before any other TensorFlow work.
strategy = lab.strategy("multiworker")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402


class Classifier(keras.Sequential):
    def train_step(self, data):
        logs = super().train_step(data)
        # Rank-1 logs survive Keras' multi-worker "mean along axis 0" reduction.
        return {name: tf.reshape(value, [1]) for name, value in logs.items()}


def main():
    run_path = sys.argv[1]
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    with strategy.scope():
        keras.utils.set_random_seed(1)
        model = Classifier([
            keras.Input((8,)),
            keras.layers.Dense(6, activation="relu"),
            keras.layers.Dense(3),
        ])
        model.compile(optimizer=keras.optimizers.SGD(0.1),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8)).astype("float32")
    y = rng.integers(0, 3, 64).astype("int32")
    recorder = lab.Recorder(gradients=True)
    # Without a strategy of its own the model skips the failing symbolic build
    # and takes the strategy from the scope fit() runs in.
    model._distribute_strategy = None
    with strategy.scope():
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0, callbacks=[recorder])
    if task["index"] == 0:
        recorder.run.save(run_path)
    print(json.dumps({
        "index": task["index"],
        "replicas": strategy.num_replicas_in_sync,
        "rows": len(recorder.run.batches()),
        "weights": [w.tolist() for w in model.get_weights()],
    }))


if __name__ == "__main__":
    main()
