"""What watching costs: a hand-written training loop under `lab.watch` against the same loop unwatched.

The loop is the one the TensorFlow guides teach: a `@tf.function` step with a
`tf.GradientTape` and `optimizer.apply_gradients`, a Python `for` over the
batches. Every configuration runs in this one process, each round on a new
model and optimizer of its own, with its own watch block open for the whole
round (the step is traced inside it, in a warm-up pass); a second copy of
the unwatched loop is the control, its ratio what the run can tell apart
(`measure_round` says why the models are new each round). Within a round the
configurations take turns every `BLOCK` steps, in a shuffled order each
turn, so a burst of load from another tenant (these machines are shared)
falls on all of them alike; a round's time for a configuration is the sum of
its blocks, reads of the rows included (`run.step` reads them every
`flush_every` seconds, scaled so that a run reads its rows as often per step
as a loop running alone, and each round ends with one). Each configuration is
reported as the ratio of its median round time to the unwatched loop's
median, beside the ratio of its fastest round to the fastest unwatched round
and the same ratio of the process's CPU time (absolute times from different
runs are not comparable). Running whole loops in turn instead, the ratios
moved by ±0.2 from run to run on a loaded machine.
`benchmarks/overhead.py` runs this too, after its fit() table.

Usage:
    python benchmarks/watch_overhead.py           # full: graph and eager steps, 5 rounds
    python benchmarks/watch_overhead.py --quick   # the short form
    python benchmarks/watch_overhead.py --threads 1
    python benchmarks/watch_overhead.py --jit-compile   # the step compiled by XLA
"""

import argparse
import contextlib
import os
import random
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import lab  # noqa: E402

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
# Steps a configuration runs before the next one takes its turn: few enough that
# load changes fall on every configuration, enough to keep its caches warm.
BLOCK = 8


def make_mlp():
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(256, activation="relu"),
                             keras.layers.Dense(256, activation="relu"), keras.layers.Dense(10)])


class Unwatched:
    """Stands in for a watched run: the loop calls `step` and nothing happens."""

    def step(self, **values):
        pass


class FloatLoss:
    """What people write without the lab: the loss as a Python float each step."""

    def __init__(self):
        self.losses = []

    def step(self, loss):
        self.losses.append(float(loss))


# The control: the unwatched loop again, on a model of its own. Its ratio to
# the unwatched loop is what this run can tell apart.
A_A = "unwatched, a second copy (the control)"
# Each configuration gets `flush_every` scaled by the number of configurations
# taking turns: a run reads its rows every `flush_every` seconds of wall time,
# and taking turns, each runs one step in that many, so it reads them after as
# many of its own steps as a loop running alone does at the default 0.25 s.
CONFIGS = {
    "unwatched": lambda model, opt, flush_every: contextlib.nullcontext(Unwatched()),
    "watch(gradients=False)": lambda model, opt, flush_every: lab.watch(model, opt, gradients=False,
                                                                       flush_every=flush_every),
    "watch()": lambda model, opt, flush_every: lab.watch(model, opt, flush_every=flush_every),
    "watch(weights=True)": lambda model, opt, flush_every: lab.watch(model, opt, weights=True,
                                                                    flush_every=flush_every),
    "watch(nonfinite)": lambda model, opt, flush_every: lab.watch(
        model, opt, breakpoints=[lab.breakpoints.nonfinite()], flush_every=flush_every),
    "per-step float(loss)": lambda model, opt, flush_every: contextlib.nullcontext(FloatLoss()),
    A_A: lambda model, opt, flush_every: contextlib.nullcontext(Unwatched()),
}
FLUSH_EVERY = 0.25  # lab.watch's default


def make_loop(model, optimizer, compiled, jit_compile=False):
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = LOSS(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    step = tf.function(train_step, jit_compile=jit_compile or None) if compiled else train_step

    def loop(run, data):
        for x, y in data:
            run.step(loss=step(x, y))

    return loop


def measure_round(compiled, data, blocks, shuffle, jit_compile=False):
    """One round, on models of its own: per configuration, its seconds and CPU seconds.

    Every model, and its optimizer's variables, are made before any step is
    traced or run, in a shuffled order, new each round. Made, watched and
    warmed up one configuration after the other, the model made last ran its
    steps 7-10% faster than the others, whichever configuration it was (six
    copies of the unwatched loop, two runs: five at 1.21-1.30 ms a step, the
    last made at 1.10 and 1.16). Made first, copies still differed by up to
    4% for the whole of a run, not from round to round; no page faults
    differed (scratch timings on one CPU, 2026-12-02). New models each round
    make that a difference between rounds, which the median evens out.
    """
    names = list(CONFIGS)
    shuffle(names)
    built = {}
    for name in names:
        keras.utils.set_random_seed(0)
        model, optimizer = make_mlp(), keras.optimizers.Adam(1e-3)
        optimizer.build(model.trainable_variables)
        built[name] = model, optimizer
    times, cpu = dict.fromkeys(CONFIGS, 0.0), dict.fromkeys(CONFIGS, 0.0)
    with contextlib.ExitStack() as stack:
        loops = {}
        for name in names:
            model, optimizer = built[name]
            run = stack.enter_context(CONFIGS[name](model, optimizer, FLUSH_EVERY * len(CONFIGS)))
            loops[name] = (make_loop(model, optimizer, compiled, jit_compile), run)
        for loop, run in loops.values():
            loop(run, data[:2])  # warm-up: traces the step inside its block
        for part in blocks + [None]:
            shuffle(names)
            for name in names:
                loop, run = loops[name]
                start, start_cpu = time.perf_counter(), time.process_time()
                if part is not None:
                    loop(run, part)
                elif hasattr(run, "flush"):
                    run.flush()  # the round's rows reach the run inside the measured time
                times[name] += time.perf_counter() - start
                cpu[name] += time.process_time() - start_cpu
    return times, cpu


def measure(compiled, rounds, steps, batch_size=32, block=BLOCK, jit_compile=False):
    """Per configuration: median and fastest ratio to the unwatched loop; and the unwatched median seconds.
    `jit_compile`: the step compiled by XLA (with `compiled`)."""
    (x, y), _ = lab.datasets.digits()
    data = [(tf.constant(x[i:i + batch_size], tf.float32), tf.constant(y[i:i + batch_size]))
            for i in range(0, batch_size * steps, batch_size) if i + batch_size <= len(x)]
    data = (data * (steps // len(data) + 1))[:steps]
    blocks = [data[i:i + block] for i in range(0, steps, block)]
    seconds = {name: [] for name in CONFIGS}
    cpu_seconds = {name: [] for name in CONFIGS}
    ratios = {name: [] for name in CONFIGS}
    shuffle = random.Random(0).shuffle
    # New steps each round: TensorFlow's warning that functions trace often is about them.
    logger = tf.get_logger()
    level = logger.level
    logger.setLevel("ERROR")
    try:
        for _ in range(rounds):
            times, cpu = measure_round(compiled, data, blocks, shuffle, jit_compile)
            for name in CONFIGS:
                seconds[name].append(times[name])
                cpu_seconds[name].append(cpu[name])
                ratios[name].append(times[name] / times["unwatched"])
    finally:
        logger.setLevel(level)
    fastest = min(seconds["unwatched"])
    median = statistics.median
    return ({name: {"median_ratio": median(seconds[name]) / median(seconds["unwatched"]),
                    "fastest_ratio": min(seconds[name]) / fastest,
                    "cpu_median_ratio": median(cpu_seconds[name]) / median(cpu_seconds["unwatched"]),
                    "round_median_ratio": median(ratios[name]), "seconds": seconds[name]}
             for name in CONFIGS}, median(seconds["unwatched"]))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the short form: graph steps only, 2 rounds")
    parser.add_argument("--threads", type=int, help="TensorFlow intra- and inter-op threads (default: TF's)")
    parser.add_argument("--jit-compile", action="store_true", help="only the step compiled by XLA (jit_compile=True)")
    args = parser.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import overhead

    overhead.use_threads(args.threads)
    shapes = [("tf.function", True, 200)] if args.quick else [("tf.function", True, 400), ("eager", False, 60)]
    if args.jit_compile:
        shapes = [("XLA", True, 200 if args.quick else 400)]
    rounds = 2 if args.quick else 5
    print(f"{'step':12} {'configuration':26} {'median ratio':>13} {'fastest / fastest':>18}")
    for label, compiled, steps in shapes:
        ratios, bare = measure(compiled, rounds, steps, jit_compile=args.jit_compile)
        for name, ratio in ratios.items():
            print(f"{label:12} {name:26} {ratio['median_ratio']:>12.3f}x {ratio['fastest_ratio']:>17.3f}x")
        print(f"{'':12} (unwatched: {steps} steps in {bare:.2f} s, {1000 * bare / steps:.2f} ms/step)")


if __name__ == "__main__":
    main()
