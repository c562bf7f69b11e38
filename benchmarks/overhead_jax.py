"""What watching costs on Keras' JAX backend: fit() with the lab's callbacks against bare fit().

The JAX column of `benchmarks/overhead.py` (which measures the TensorFlow
backend): the same three models (`overhead.MODELS`' MLP 64-256-256-10, small
CNN, deep MLP of 25 Dense layers), batch 64, 624 steps per fit (3 epochs of
208 batches), steps_per_execution 1 and 32. Run it where Keras runs on JAX
(`make bench-jax` uses `.venv-jax`, which has no TensorFlow).

Two baselines, both measured in the same run: bare `fit(verbose=0)`, and
fit with a no-op callback that overrides `on_train_batch_end`. Keras on JAX
dispatches batch-end callbacks on a thread pool unless some callback
overrides them (the no-op callback does, as `verbose=1`'s progress bar
does); a lab callback without breakpoints does not, so bare fit is its
like-for-like baseline, and the targets are held against it.

As in `overhead.py`, the fits take turns (`turns.Turns`): each round makes
a new model for every configuration, warms each up with its callbacks (so
compiling is not timed: the lab keeps the function it jitted for the next
fit), then runs one fit of each, each in a thread of its own, one at a
time, passing the turn on every 8 steps (at a batch's begin, after waiting
for the steps it has put on the device), so that a burst of load from
another tenant falls on every configuration alike. A ratio is a
configuration's median fit time (the sum of its turns) over the baseline's
median; the 90% bootstrap interval resamples whole rounds (`turns.verdict`).
"control" is bare fit again on a model of its own: its ratio is what this
run can tell apart.

Usage:
    python benchmarks/overhead_jax.py                    # 3 models, 7 rounds
    python benchmarks/overhead_jax.py --quick            # MLP, 3 rounds, fewer steps
    python benchmarks/overhead_jax.py --cpu 1            # the whole process on CPU 1: steadier fits
    python benchmarks/overhead_jax.py --json out.json
"""

import argparse
import functools
import json
import os
import platform
import random
import statistics
import sys
import threading

os.environ.setdefault("KERAS_BACKEND", "jax")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import lab  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import make_cnn, make_deep, make_mlp  # noqa: E402  (shared with overhead.py)
from turns import TURN_STEPS, Turns, pin, verdict  # noqa: E402  (shared with overhead.py)

BATCH_SIZE = 64
SPES = (1, 32)
TARGETS = {"`lab.Recorder()`": 1.05, "`widgets.Dashboard(gradients=True)`": 1.08,
           "`lab.Recorder(gradients=True, weights=True)`": 1.12}
BARE, NOOP, CONTROL = "bare fit", "no-op batch-end callback", "control (bare fit again)"
SAMPLED = "`lab.Recorder(gradients=True, weights=True, norms_every=10)`"


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


def dashboard(every):
    headless_comms()
    import widgets

    return widgets.Dashboard(gradients=True, view="html", refresh_every=every, flush_every=every)


def configs(every=0.25):
    """name -> () -> list of callbacks. `every`: the lab's seconds between
    reads and refreshes; fits taking turns pass a multiple of the default,
    so that each reads and refreshes as often per step as a fit alone."""
    return {
        BARE: lambda: [],
        NOOP: lambda: [NoOp()],
        "`lab.Recorder()`": lambda: [lab.Recorder(flush_every=every)],
        "`widgets.Dashboard(gradients=True)`": lambda: [dashboard(every)],
        "`lab.Recorder(gradients=True, weights=True)`": lambda: [
            lab.Recorder(gradients=True, weights=True, flush_every=every)],
        SAMPLED: lambda: [lab.Recorder(gradients=True, weights=True, norms_every=10, flush_every=every)],
        CONTROL: lambda: [],
    }


CONFIGS = configs()


_fit_callbacks = threading.local()  # the CallbackList of the fit running in this thread


def track_callback_lists():
    """Keeps, per thread, the `CallbackList` that the fit running in it made,
    so that `settle` can wait for the batch ends it sent to Keras' pool."""
    from keras.src.callbacks import callback_list

    made = callback_list.CallbackList.__init__
    if getattr(made, "tracked", False):
        return

    def __init__(self, *args, **kwargs):
        made(self, *args, **kwargs)
        _fit_callbacks.current = self

    __init__.tracked = True
    callback_list.CallbackList.__init__ = __init__


def settle(model):
    """Waits for what a fit has started and not finished: the steps it put
    on the device (Keras keeps the state its last step returned in
    `model._jax_state`; waiting on it syncs nothing into the variables) and
    the batch ends it sent to Keras' thread pool, which would otherwise run
    in the next fit's turn and be counted there."""
    state = getattr(model, "_jax_state", None)
    if state:
        import jax

        jax.block_until_ready(state)
    callbacks = getattr(_fit_callbacks, "current", None)
    # Keras' name for "wait for every batch end sent to the pool": 3.12+ and 3.11.
    flush = getattr(callbacks, "_flush_futures", None) or getattr(callbacks, "_clear_futures", None)
    if flush is not None:
        flush()


def measure(make, shape, spe, rounds, steps, seed=0, batches=208):
    """Each configuration's fit seconds, one per round, the fits taking turns
    (fits of `steps` steps, in epochs of `batches` batches)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batches * BATCH_SIZE, *shape)).astype("float32")
    y = rng.integers(0, 10, len(x))
    warm = 2 * spe * BATCH_SIZE
    found = configs(every=0.25 * len(CONFIGS))
    shuffle = random.Random(seed + spe).shuffle
    every = max(1, TURN_STEPS // spe)
    seconds = {name: [] for name in found}
    for _ in range(rounds):
        names = list(found)
        shuffle(names)
        models, callbacks = {}, {}
        for name in names:  # every model made before any traces a step
            keras.utils.set_random_seed(0)
            model = make()
            model.compile(keras.optimizers.Adam(1e-3),
                          keras.losses.SparseCategoricalCrossentropy(from_logits=True), steps_per_execution=spe)
            model.optimizer.build(model.trainable_variables)
            models[name] = model
        for name in names:
            callbacks[name] = found[name]()
            models[name].fit(x[:warm], y[:warm], batch_size=BATCH_SIZE, epochs=1, verbose=0,
                             callbacks=callbacks[name])
        turns = Turns(found, every, shuffle, hook="on_train_batch_begin")
        turns.run({name: functools.partial(
            models[name].fit, x, y, batch_size=BATCH_SIZE, epochs=max(1, steps // batches), verbose=0,
            shuffle=False, callbacks=callbacks[name] + [turns.callback(name, settle)]) for name in found})
        for name in found:
            seconds[name].append(turns.seconds[name])
    return seconds


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="MLP only, 3 rounds, 208 steps a fit")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--models", default=None, help="comma-separated: mlp,cnn,deep")
    parser.add_argument("--json", default=None, help="also write the figures here")
    parser.add_argument("--cpu", type=int, help="run on this CPU only, every thread (default: any)")
    args = parser.parse_args(argv)
    pin(args.cpu)
    track_callback_lists()
    rounds = args.rounds or (3 if args.quick else 7)
    models = (args.models or ("mlp" if args.quick else "mlp,cnn,deep")).split(",")
    steps = 208 if args.quick else 624
    import jax

    print(f"Keras {keras.__version__} on JAX {jax.__version__}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}; {rounds} rounds, {steps} steps a fit, "
          f"taking turns every {TURN_STEPS} steps; pinned to CPU {args.cpu}")
    results = {}
    for key in models:
        title, make, shape = MODELS[key]
        for spe in SPES:
            times = measure(make, shape, spe, rounds, steps)
            cell = {}
            for name in CONFIGS:
                found, lo, hi = verdict(times[name], times[BARE], TARGETS.get(name, 1.0))
                cell[name] = {
                    "vs_bare": statistics.median(times[name]) / statistics.median(times[BARE]),
                    "vs_noop": statistics.median(times[name]) / statistics.median(times[NOOP]),
                    "interval_vs_bare": [lo, hi],
                    "verdict": found if name in TARGETS else None,
                    "seconds": times[name],
                }
            results[f"{key}/spe={spe}"] = cell
            print(f"\n{title}, steps_per_execution={spe} (bare fit median "
                  f"{statistics.median(times[BARE]) * 1e3 / steps:.3f} ms a step)")
            for name, figures in cell.items():
                target = TARGETS.get(name)
                print(f"  {name:64s} {figures['vs_bare']:.3f} x bare  {figures['vs_noop']:.3f} x no-op   "
                      f"90% [{figures['interval_vs_bare'][0]:.3f}, {figures['interval_vs_bare'][1]:.3f}]"
                      + (f"  target {target}: {figures['verdict']}" if target else ""))
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"keras": keras.__version__, "jax": jax.__version__, "rounds": rounds, "steps": steps,
                       "cpu": args.cpu, "load": os.getloadavg(), "results": results}, file, indent=1)


if __name__ == "__main__":
    main()
