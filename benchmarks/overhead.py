"""What watching costs: fit() with the lab's callbacks against bare fit().

Every configuration runs in this one process, interleaved and repeated, and is
reported as the median ratio of its fit time to bare `fit(verbose=0)` measured
in the same round (configurations in a shuffled order each round), and as the
ratio of its fastest fit to the fastest bare fit (the machines are shared and noisy: absolute times from
different runs are not comparable). Tracing is excluded: each configuration
first runs a warm-up fit with the same callbacks on the same model.

Usage:
    python benchmarks/overhead.py             # full: MLP and CNN, 7 rounds
    python benchmarks/overhead.py --quick     # CI's short form
"""

import argparse
import os
import random
import statistics
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import lab  # noqa: E402


class StoreFloats(keras.callbacks.Callback):
    """The plain per-batch callback people write: float() of each log."""

    def on_train_begin(self, logs=None):
        self.rows = []

    def on_train_batch_end(self, batch, logs=None):
        self.rows.append({k: float(v) for k, v in (logs or {}).items()})


def make_mlp():
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(256, activation="relu"),
                             keras.layers.Dense(256, activation="relu"), keras.layers.Dense(10)])


def make_cnn():
    return keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Conv2D(16, 3, activation="relu"),
                             keras.layers.Conv2D(16, 3, activation="relu"), keras.layers.Flatten(),
                             keras.layers.Dense(10)])


def dashboard():
    """A Dashboard whose refreshes go to a comm that records instead of sending."""
    import comm
    from comm.base_comm import BaseComm

    class Recording(BaseComm):
        kernel = "recording"

        def publish_msg(self, *args, **kwargs):
            pass

    comm.create_comm = lambda *a, **k: Recording(**k)
    import widgets

    dash = widgets.Dashboard(gradients=True)
    return dash


CONFIGS = {
    "bare fit": lambda: [],
    "Recorder()": lambda: [lab.Recorder()],
    "Recorder(gradients, weights)": lambda: [lab.Recorder(gradients=True, weights=True)],
    "Dashboard(gradients)": lambda: [dashboard()],
    "TensorBoard(update_freq=batch)": lambda: [
        keras.callbacks.TensorBoard(tempfile.mkdtemp(prefix="tb-"), update_freq="batch")
    ],
    "per-batch float(logs)": lambda: [StoreFloats()],
}


def measure(build, flat, steps_per_execution, rounds, samples, epochs):
    (x, y), _ = lab.datasets.digits(flat=flat)
    repeat = int(np.ceil(samples / len(x)))
    x, y = np.concatenate([x] * repeat)[:samples], np.concatenate([y] * repeat)[:samples]
    models, callbacks = {}, {}
    for name, make in CONFIGS.items():
        keras.utils.set_random_seed(0)
        model = build()
        model.compile("adam", "sparse_categorical_crossentropy", steps_per_execution=steps_per_execution)
        callbacks[name] = make()
        model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=callbacks[name])  # warm-up: traces
        models[name] = model
    ratios = {name: [] for name in CONFIGS}
    seconds = {name: [] for name in CONFIGS}
    order = list(CONFIGS)
    shuffle = random.Random(0).shuffle
    for _ in range(rounds):
        shuffle(order)  # no configuration always runs first (or right after another)
        times = {}
        for name in order:
            start = time.perf_counter()
            models[name].fit(x, y, batch_size=32, epochs=epochs, verbose=0, callbacks=callbacks[name])
            times[name] = time.perf_counter() - start
            seconds[name].append(times[name])
        for name in CONFIGS:
            ratios[name].append(times[name] / times["bare fit"])
    steps = epochs * int(np.ceil(samples / 32))
    # Two estimates: the median of the ratios within a round, and the ratio of
    # the fastest fits (noise from other work only ever adds time, so the
    # minimum is the least disturbed figure). They disagree when the machine is busy.
    fastest = {name: min(s) / min(seconds["bare fit"]) for name, s in seconds.items()}
    medians = {name: statistics.median(r) for name, r in ratios.items()}
    return medians, fastest, statistics.median(seconds["bare fit"]), steps


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short form for CI")
    args = parser.parse_args(argv)
    rounds, samples, epochs = (3, 4800, 2) if args.quick else (7, 6400, 3)
    models = [("MLP", make_mlp, True)] if args.quick else [("MLP", make_mlp, True), ("CNN", make_cnn, False)]
    print(f"{'model':5} {'spe':>4}  {'configuration':32} {'median ratio':>13} {'fastest / fastest':>18}")
    for label, build, flat in models:
        for spe in (1, 32):
            medians, fastest, bare, steps = measure(build, flat, spe, rounds, samples, epochs)
            for name in CONFIGS:
                print(f"{label:5} {spe:>4}  {name:32} {medians[name]:>12.3f}x {fastest[name]:>17.3f}x")
            print(f"{'':11} (bare fit: {steps} steps in {bare:.2f} s, {1000 * bare / steps:.2f} ms/step)")


if __name__ == "__main__":
    main()
