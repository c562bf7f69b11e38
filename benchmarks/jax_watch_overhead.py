"""What `lab.watch` costs a hand-written JAX loop: keras-io's guide loop watched against unwatched.

The loop is the one "Writing a training loop from scratch in JAX" teaches
(the MNIST MLP 784-64-64-10, batch 32, Adam, a `jax.jit` step calling
`optimizer.stateless_apply`), on MNIST-shaped random data. Each configuration
trains a model and optimizer of its own, its watch block open for the whole
run and its step traced inside it (a warm-up call); the configurations take
turns every `BLOCK` steps in a shuffled order, so load from other tenants of
a shared machine falls on all alike. A configuration's time is the sum of its
turns, `run.step` and the reads of its rows included; the table gives the
median time per step and its ratio to the unwatched loop's. "control" is a
second unwatched loop: its ratio is what the run can tell apart.

Configurations:
    unwatched             the guide's loop
    control               the same, a second copy
    watch, no gradients   lab.watch(model, optimizer, gradients=False): nothing in the step
    watch, gradients      lab.watch(model, optimizer): one host callback per step
    watch, gradients+nonfinite   also breakpoints=[nonfinite()]: the callback answers, the step gates

Usage:
    KERAS_BACKEND=jax python benchmarks/jax_watch_overhead.py            # 6 rounds of 256 steps
    KERAS_BACKEND=jax python benchmarks/jax_watch_overhead.py --quick    # 3 rounds of 64 steps
"""

import argparse
import os
import random
import statistics
import time

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import lab  # noqa: E402

BLOCK = 16
BATCH = 32


def get_model():
    inputs = keras.Input(shape=(784,), name="digits")
    x1 = keras.layers.Dense(64, activation="relu")(inputs)
    x2 = keras.layers.Dense(64, activation="relu")(x1)
    outputs = keras.layers.Dense(10, name="predictions")(x2)
    return keras.Model(inputs=inputs, outputs=outputs)


class Unwatched:
    def step(self, **values):
        pass


class Loop:
    """One configuration: the guide's model, optimizer, jitted step and state, and its watch block."""

    def __init__(self, name, watch_kwargs, batches):
        self.name = name
        self.batches = batches
        self.model = model = get_model()
        self.optimizer = optimizer = keras.optimizers.Adam(learning_rate=1e-3)
        loss_fn = keras.losses.CategoricalCrossentropy(from_logits=True)

        def compute_loss_and_updates(trainable_variables, non_trainable_variables, x, y):
            y_pred, non_trainable_variables = model.stateless_call(trainable_variables, non_trainable_variables, x)
            return loss_fn(y, y_pred), non_trainable_variables

        grad_fn = jax.value_and_grad(compute_loss_and_updates, has_aux=True)

        @jax.jit
        def train_step(state, data):
            trainable_variables, non_trainable_variables, optimizer_variables = state
            x, y = data
            (loss, non_trainable_variables), grads = grad_fn(trainable_variables, non_trainable_variables, x, y)
            trainable_variables, optimizer_variables = optimizer.stateless_apply(
                optimizer_variables, grads, trainable_variables)
            return loss, (trainable_variables, non_trainable_variables, optimizer_variables)

        self.train_step = train_step
        optimizer.build(model.trainable_variables)
        self.state = ([v.value for v in model.trainable_variables], [v.value for v in model.non_trainable_variables],
                      [v.value for v in optimizer.variables])
        if watch_kwargs is None:
            self.block, self.run = None, Unwatched()
        else:
            self.block = lab.watch(model, optimizer, **watch_kwargs)
            self.run = self.block.__enter__()
        self.position = 0
        self.turns = []
        self.steps(2)  # traced inside the block
        self.turns = []

    def steps(self, count):
        start = time.perf_counter()
        for _ in range(count):
            data = self.batches[self.position % len(self.batches)]
            self.position += 1
            loss, self.state = self.train_step(self.state, data)
            self.run.step(loss=loss)
        jax.block_until_ready(self.state)
        self.turns.append(time.perf_counter() - start)

    def close(self):
        if self.block is not None:
            self.block.__exit__(None, None, None)


CONFIGURATIONS = [
    ("unwatched", None),
    ("control", None),
    ("watch, no gradients", dict(gradients=False)),
    ("watch, gradients", dict(gradients=True)),
    ("watch, gradients+nonfinite", dict(gradients=True, breakpoints=[lab.breakpoints.nonfinite()])),
]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None, help="steps per configuration per round")
    args = parser.parse_args()
    rounds = args.rounds or (3 if args.quick else 6)
    steps = args.steps or (64 if args.quick else 256)
    rng = np.random.default_rng(0)
    x = rng.random((BATCH * 64, 784)).astype("float32")
    y = keras.utils.to_categorical(rng.integers(0, 10, BATCH * 64), 10)
    batches = [(x[i:i + BATCH], y[i:i + BATCH]) for i in range(0, len(x), BATCH)]
    loops = [Loop(name, kwargs, batches) for name, kwargs in CONFIGURATIONS]
    per_round = {loop.name: [] for loop in loops}
    try:
        for _ in range(rounds):
            for loop in loops:
                loop.turns = []
            for _ in range(steps // BLOCK):
                order = loops[:]
                random.shuffle(order)
                for loop in order:
                    loop.steps(BLOCK)
            for loop in loops:
                per_round[loop.name].append(sum(loop.turns) / (steps // BLOCK * BLOCK))
    finally:
        for loop in loops:
            loop.close()
    base = statistics.median(per_round["unwatched"])
    print(f"jax {jax.__version__}, keras {keras.__version__}, {jax.devices()[0].platform}: "
          f"{rounds} rounds x {steps} steps, batch {BATCH}")
    print(f"{'configuration':30s} {'us/step':>9s} {'ratio':>7s} {'fastest-round ratio':>20s}")
    fastest = min(per_round["unwatched"])
    for name, times in per_round.items():
        print(f"{name:30s} {statistics.median(times) * 1e6:9.1f} {statistics.median(times) / base:7.2f} "
              f"{min(times) / fastest:20.2f}")


if __name__ == "__main__":
    main()
