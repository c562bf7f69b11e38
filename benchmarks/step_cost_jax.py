"""What the JAX probe adds inside the jitted step: the train step alone, bare and probed.

Each configuration's step is jitted once (with the probe's wrappers for the
probed ones, as `fit()` jits it) and run in blocks of 200 steps, the
configurations taking turns, on a model of `benchmarks/models.py` (the MLP
by default; `--model deep` is the 25-layer MLP of 50 variables). Ratios are
each configuration's median block time over the bare step's, in the same
run; "bare again" is a second bare step, the control. With them take turns
the weight and update norms that `weights=True` adds, jitted by themselves:
what those reductions cost without a step around them.

Usage:
    KERAS_BACKEND=jax python benchmarks/step_cost_jax.py [--model mlp|cnn|deep] [--rounds 15]
"""

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

from lab.backend.jax import compat  # noqa: E402
from lab.backend.jax.norms import sums_of_squares  # noqa: E402
from lab.backend.jax.probes import Probe  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import make_cnn, make_deep, make_mlp  # noqa: E402

MODELS = {"mlp": (make_mlp, (64,)), "cnn": (make_cnn, (8, 8, 1)), "deep": (make_deep, (64,))}

CONFIGS = {"bare": None, "bare again": None, "Recorder()": {}, "gradients": {"gradients": True},
           "gradients + weights": {"gradients": True, "weights": True}}


def jitted_step(options, x, y, make):
    model = make()
    model.compile(keras.optimizers.Adam(1e-3), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x[:128], y[:128], batch_size=64, verbose=0)
    if options is not None:
        Probe(model, **options).install()
    state = model._get_jax_state(trainable_variables=True, non_trainable_variables=True,
                                 optimizer_variables=True, metrics_variables=True)
    step = jax.jit(model.train_step, donate_argnums=0)
    data = (jax.numpy.asarray(x[:64]), jax.numpy.asarray(y[:64]))
    with compat.state_shardings_recorded(model):  # traced here, outside fit() (Keras 3.11 needs them)
        _, state = step(state, data)
    jax.block_until_ready(state)
    return [step, state, data]


def norms_alone(x, y, make):
    """The weight and update norms `weights=True` takes, jitted by
    themselves, over the model's weights after a step and before it: what
    the reductions cost without the step around them."""
    model = make()
    model.compile(keras.optimizers.Adam(1e-3), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    before = [jax.numpy.asarray(np.asarray(v.value)) for v in model.trainable_variables]
    model.fit(x[:128], y[:128], batch_size=64, verbose=0)
    after = [jax.numpy.asarray(np.asarray(v.value)) for v in model.trainable_variables]
    norms = jax.jit(lambda a, b: sums_of_squares(a) + sums_of_squares(a, minus=b))

    def step(state, data):
        return None, (state[0], state[1], norms(state[0], state[1]))
    return [step, (after, before, norms(after, before)), None]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--model", choices=sorted(MODELS), default="mlp")
    args = parser.parse_args(argv)
    make, shape = MODELS[args.model]
    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, *shape)).astype("float32")
    y = rng.integers(0, 10, len(x))
    steps = {name: jitted_step(options, x, y, make) for name, options in CONFIGS.items()}
    steps["weight + update norms alone"] = norms_alone(x, y, make)
    times = {name: [] for name in steps}
    for _ in range(args.rounds):
        for name, held in steps.items():
            step, state, data = held
            began = time.perf_counter()
            for _ in range(200):
                _, state = step(state, data)
            jax.block_until_ready(state)
            times[name].append((time.perf_counter() - began) / 200)
            held[1] = state
    base = statistics.median(times["bare"])
    for name, values in times.items():
        print(f"{name:28s} {statistics.median(values) * 1e6:7.1f} us a step  {statistics.median(values) / base:.3f} x bare")


if __name__ == "__main__":
    main()
