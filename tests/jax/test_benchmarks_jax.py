"""The JAX benchmarks run where TensorFlow is not installed, and time every configuration they name."""

import pathlib
import re
import sys
import time

import keras
import numpy as np

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"


def test_the_step_cost_benchmark_times_each_probe_and_the_norms_alone(capsys):
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import step_cost_jax
    finally:
        sys.path.remove(str(BENCHMARKS))
    step_cost_jax.main(["--rounds", "1"])
    rows = dict(re.findall(r"^(.+?)\s+[\d.]+ us a step\s+([\d.]+) x bare$", capsys.readouterr().out, re.M))
    assert set(rows) == {"bare", "bare again", "Recorder()", "gradients", "gradients + weights",
                         "weight + update norms alone"}, rows
    assert float(rows["bare"]) == 1.0 and all(float(ratio) > 0 for ratio in rows.values())


def _benchmark(name):
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(BENCHMARKS))


class Begins(keras.callbacks.Callback):
    """Notes `(name, "begin", batch)` in `seen` at each batch's begin."""

    def __init__(self, name, seen):
        super().__init__()
        self.name, self.seen = name, seen

    def on_train_batch_begin(self, batch, logs=None):
        self.seen.append((self.name, "begin", batch))


def _tiny_fits(turns, seen, extra=None, settle=None):
    """name -> a fit of 6 batches of a small model, noting its batch begins
    in `seen` and passing the turn through `turns` (with `settle`)."""
    fits = {}
    for name in turns.seconds:
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.compile("sgd", "mse")
        hooks = [Begins(name, seen), *(extra or {}).get(name, []), turns.callback(name, settle)]
        fits[name] = (lambda model=model, hooks=hooks: model.fit(
            np.zeros((12, 3)), np.zeros((12, 2)), batch_size=2, verbose=0, callbacks=hooks))
    return fits


def test_jax_fits_pass_the_turn_at_batch_begin_and_keep_keras_pool_for_batch_ends():
    # A turn passed at a batch's end would make Keras wait for every step's
    # logs, which bare fit on JAX does not: the fit measured would not be
    # the fit a user runs.
    import random

    from keras.src.utils.python_utils import is_default

    turns = _benchmark("turns").Turns(["a", "b"], 2, random.Random(0).shuffle, hook="on_train_batch_begin")
    passer = turns.callback("a")
    assert is_default(passer.on_train_batch_end) and not is_default(passer.on_train_batch_begin)
    events = []
    turns.run(_tiny_fits(turns, events))
    seen = [name for name, _, _ in events]
    assert sorted(seen) == ["a"] * 6 + ["b"] * 6
    runs = [seen[i:i + 2] for i in range(0, 12, 2)]
    assert all(len(set(run)) == 1 for run in runs), seen  # blocks of 2 batches, one fit at a time


def test_a_jax_fit_passes_the_turn_only_once_the_batch_ends_it_sent_to_keras_pool_ran():
    # Keras on JAX runs batch ends on a thread pool: without waiting for
    # them when it passes the turn, a fit's batch ends ran in the next
    # fit's turn and were counted there (a no-op callback came out at 1.9
    # of bare fit, bare fit's own batch ends counted in the others' turns).
    import random

    overhead_jax = _benchmark("overhead_jax")
    overhead_jax.track_callback_lists()
    seen = []

    class SlowEnd(keras.callbacks.Callback):
        async_safe = True  # Keras (3.15) sends its batch ends to the pool

        def on_train_batch_end(self, batch, logs=None):
            time.sleep(0.03)
            seen.append(("slow", "end", batch))

    turns = _benchmark("turns").Turns(["slow", "bare"], 1, random.Random(0).shuffle, hook="on_train_batch_begin")
    turns.run(_tiny_fits(turns, seen, extra={"slow": [SlowEnd()]}, settle=overhead_jax.settle))
    assert sum(1 for event in seen if event[:2] == ("slow", "end")) == 6
    for at, event in enumerate(seen):
        if event[0] == "bare":
            begun = [batch for name, kind, batch in seen[:at] if (name, kind) == ("slow", "begin")]
            ended = {batch for name, kind, batch in seen[:at] if (name, kind) == ("slow", "end")}
            # Every batch the slow fit began before its last turn ended in its turns.
            assert set(begun[:-1]) <= ended, seen


def test_the_jax_fit_benchmark_times_every_configuration_taking_turns():
    overhead_jax = _benchmark("overhead_jax")
    overhead_jax.headless_comms()
    seconds = overhead_jax.measure(overhead_jax.make_mlp, (64,), spe=2, rounds=2, steps=16, batches=8)
    assert set(seconds) == set(overhead_jax.CONFIGS)
    assert all(len(times) == 2 and all(t > 0 for t in times) for times in seconds.values()), seconds
