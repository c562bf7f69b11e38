"""What watching costs on Keras' JAX backend: fit() with the lab's callbacks against bare fit().

The JAX column of `benchmarks/overhead.py` (which measures the TensorFlow
backend): the same three models (`overhead.MODELS`' MLP 64-256-256-10, small
CNN, deep MLP of 25 Dense layers), batch 64, 624 steps per fit (3 epochs of
208 batches), steps_per_execution 1 and 32. Run it where Keras runs on JAX
(`make bench-jax` uses `.venv-jax`, which has no TensorFlow).

Two baselines, both measured in the same run: bare `fit(verbose=0)`, and
fit with a no-op callback that overrides `on_train_batch_end`. Keras on JAX
dispatches batch-end callbacks on a thread pool unless some callback
overrides them; every lab callback does, so the no-op callback is the
like-for-like baseline (on two CPUs it was faster than bare fit). Ratios
are against both; the targets are held against bare fit.

Each round runs every configuration once, in a shuffled order, each on a new
model after a warm-up fit with the same callbacks (so compiling is not
timed: the lab keeps the function it jitted for the next fit). A ratio is a
configuration's median fit time over the baseline's median; the bootstrap
interval resamples whole rounds. "control" is bare fit again on a model of
its own: its ratio is what this run can tell apart.

Usage:
    python benchmarks/overhead_jax.py                    # 3 models, 7 rounds
    python benchmarks/overhead_jax.py --quick            # MLP, 3 rounds, fewer steps
    python benchmarks/overhead_jax.py --json out.json
"""

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "jax")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import lab  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import make_cnn, make_deep, make_mlp  # noqa: E402  (shared with overhead.py)

BATCH_SIZE = 64
SPES = (1, 32)
TARGETS = {"`lab.Recorder()`": 1.05, "`widgets.Dashboard(gradients=True)`": 1.08,
           "`lab.Recorder(gradients=True, weights=True)`": 1.12}
BARE, NOOP, CONTROL = "bare fit", "no-op batch-end callback", "control (bare fit again)"


class NoOp(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        pass


MODELS = {"mlp": ("MLP 64-256-256-10", make_mlp, (64,)),
          "cnn": ("CNN (2 Conv2D 16 + Dense)", make_cnn, (8, 8, 1)),
          "deep": ("deep MLP (25 Dense, 50 variables)", make_deep, (64,))}


def headless_comms():
    """Widgets send into comms that drop messages (serialised as in a kernel, never sent)."""
    import comm
    from comm.base_comm import BaseComm

    class Dropping(BaseComm):
        kernel = "headless"

        def publish_msg(self, *args, **kwargs):
            pass

    comm.create_comm = lambda *a, **k: Dropping(**k)


def dashboard():
    headless_comms()
    import widgets

    return widgets.Dashboard(gradients=True, view="html")


CONFIGS = {
    BARE: lambda: [],
    NOOP: lambda: [NoOp()],
    "`lab.Recorder()`": lambda: [lab.Recorder()],
    "`widgets.Dashboard(gradients=True)`": lambda: [dashboard()],
    "`lab.Recorder(gradients=True, weights=True)`": lambda: [lab.Recorder(gradients=True, weights=True)],
    CONTROL: lambda: [],
}


def one_fit(make, shape, spe, callbacks, steps):
    """Seconds of one fit of `steps` batches (epochs of 208), after a warm-up fit."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(208 * BATCH_SIZE, *shape)).astype("float32")
    y = rng.integers(0, 10, len(x))
    model = make()
    model.compile(keras.optimizers.Adam(1e-3), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  steps_per_execution=spe)
    warm = 2 * spe * BATCH_SIZE
    model.fit(x[:warm], y[:warm], batch_size=BATCH_SIZE, epochs=1, verbose=0, callbacks=callbacks)
    start = time.perf_counter()
    model.fit(x, y, batch_size=BATCH_SIZE, epochs=steps // 208, verbose=0, callbacks=callbacks, shuffle=False)
    return time.perf_counter() - start


def bootstrap(times, base, draws=2000, seed=0):
    rng = random.Random(seed)
    rounds = range(len(times))
    ratios = []
    for _ in range(draws):
        pick = [rng.choice(rounds) for _ in rounds]
        ratios.append(statistics.median(times[i] for i in pick) / statistics.median(base[i] for i in pick))
    ratios.sort()
    return ratios[int(0.05 * draws)], ratios[int(0.95 * draws)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="MLP only, 3 rounds, 208 steps a fit")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--models", default=None, help="comma-separated: mlp,cnn,deep")
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    rounds = args.rounds or (3 if args.quick else 7)
    models = (args.models or ("mlp" if args.quick else "mlp,cnn,deep")).split(",")
    steps = 208 if args.quick else 624
    import jax

    print(f"Keras {keras.__version__} on JAX {jax.__version__}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}; {rounds} rounds, {steps} steps a fit")
    results = {}
    for key in models:
        title, make, shape = MODELS[key]
        for spe in SPES:
            times = {name: [] for name in CONFIGS}
            for _ in range(rounds):
                order = list(CONFIGS)
                random.shuffle(order)
                for name in order:
                    times[name].append(one_fit(make, shape, spe, CONFIGS[name](), steps))
            cell = {}
            for name in CONFIGS:
                lo, hi = bootstrap(times[name], times[BARE])
                cell[name] = {
                    "vs_bare": statistics.median(times[name]) / statistics.median(times[BARE]),
                    "vs_noop": statistics.median(times[name]) / statistics.median(times[NOOP]),
                    "interval_vs_bare": [lo, hi],
                    "verdict": _verdict(TARGETS.get(name), lo, hi),
                }
            results[f"{key}/spe={spe}"] = cell
            print(f"\n{title}, steps_per_execution={spe} (bare fit median "
                  f"{statistics.median(times[BARE]) * 1e3 / steps:.3f} ms a step)")
            for name, figures in cell.items():
                target = TARGETS.get(name)
                print(f"  {name:48s} {figures['vs_bare']:.3f} x bare  {figures['vs_noop']:.3f} x no-op   "
                      f"90% [{figures['interval_vs_bare'][0]:.3f}, {figures['interval_vs_bare'][1]:.3f}]"
                      + (f"  target {target}: {figures['verdict']}" if target else ""))
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"keras": keras.__version__, "jax": jax.__version__, "rounds": rounds, "steps": steps,
                       "results": results}, file, indent=1)


def _verdict(target, lo, hi):
    if target is None:
        return None
    if hi <= target:
        return "met"
    if lo > target:
        return "not met"
    return "noise"


if __name__ == "__main__":
    main()
