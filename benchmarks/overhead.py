"""What watching costs: fit() with the lab's callbacks (and others') against bare fit().

Every configuration runs in this one process, each round on a new copy of
the model of its own, and the fits take turns: in each round every configuration runs one
fit, each in a thread of its own, one at a time, passing the turn on every
8 steps to the others in a shuffled order (`Turns`), so a burst of load
from another tenant falls on all of them alike. Each is reported as the
ratio of its median fit time (the sum of its turns) to bare
`fit(verbose=0)`'s median (beside it, the ratio of its fastest fit to the
fastest bare fit), and as the same ratio of the process's CPU time (it
counts every thread of this process, TensorFlow's pools included). The JSON
also holds the median of the per-round ratios. The batches come from a
`tf.data.Dataset` with tf.data's autotuning off (`dataset` says why). The
machines are shared and noisy: absolute times from different runs are not
comparable, and the load averages are printed with the table. Tracing is
excluded: each round's models first run a warm-up of two executions with
the same callbacks. A second table gives the share of each fit
spent inside the callbacks' own hooks (`timed`); what a configuration costs
beyond it is in the graph (`benchmarks/step_cost.py`).

Rows: a per-batch `float(logs)` callback, TensorBoard(update_freq="batch"),
TensorBoard with histogram_freq=1, livelossplot (only if it is installed),
`lab.Recorder()`, `widgets.Dashboard(gradients=True)` (headless: its widget
messages go to a comm that drops them), `lab.Recorder(gradients=True,
weights=True)`, and bare fit again on a model of its own (the control: its
ratio is what the run can tell apart). Columns: steps_per_execution 1 and 32. Models: the MLP
64-256-256-10, a small CNN and a deep MLP of 25 Dense layers (50 variables),
batch 64, 624 steps per fit (3 epochs of 208 batches). Then `lab.watch` on a
hand-written `tf.function` loop against the same loop unwatched
(`benchmarks/watch_overhead.py`).

At the end it holds the figures against the targets the lab aims for
(`TARGETS`): a target is "met" when the 90% bootstrap interval of the ratio
(rounds resampled whole: each round's configuration and bare fit ran under
the same load) lies at or under it, "not met" when it lies over it, and
"noise" when the interval straddles it: this machine cannot tell.

Usage:
    python benchmarks/overhead.py                       # full: 3 models, 7 rounds, and lab.watch
    python benchmarks/overhead.py --quick               # the short form: MLP, fewer steps and rounds
    python benchmarks/overhead.py --json out.json       # also write the figures as JSON
    python benchmarks/overhead.py --models mlp --rounds 5 --no-watch
    python benchmarks/overhead.py --watch-only --rounds 15  # lab.watch's figures alone
    python benchmarks/overhead.py --threads 1           # one TF thread: less scheduling noise
    python benchmarks/overhead.py --threads 1 --cpu 1   # the whole process on CPU 1: far steadier fits
"""

import argparse
import functools
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import lab  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import make_cnn, make_deep, make_mlp  # noqa: E402  (shared with overhead_jax.py)
from turns import TURN_STEPS, Turns, pin, verdict  # noqa: E402,F401  (shared with overhead_jax.py)

BATCH_SIZE = 64
SPES = (1, 32)
# What watching may cost at most: median time over bare fit's median, by
# steps_per_execution, on every model; and a watched hand-written loop's.
TARGETS = {
    "1": {"`lab.Recorder()`": 1.03, "`widgets.Dashboard(gradients=True)`": 1.05,
          "`lab.Recorder(gradients=True, weights=True)`": 1.08},
    "32": {"`lab.Recorder()`": 1.02, "`widgets.Dashboard(gradients=True)`": 1.03,
           "`lab.Recorder(gradients=True, weights=True)`": 1.05},
}
WATCH_TARGETS = {"watch()": 1.05}
# The control: bare fit again, on a model of its own. Its ratio to bare fit
# is what this run can tell apart: the two differ in nothing but the copy.
A_A = "bare fit, a second copy (the control)"


class StoreFloats(keras.callbacks.Callback):
    """The plain per-batch callback people write: float() of each log."""

    def on_train_begin(self, logs=None):
        self.rows = []

    def on_train_batch_end(self, batch, logs=None):
        self.rows.append({k: float(v) for k, v in (logs or {}).items()})


MODELS = {
    "mlp": ("MLP 64-256-256-10", make_mlp, True),
    "cnn": ("CNN (2 Conv2D 16 + Dense)", make_cnn, False),
    "deep": ("deep MLP (25 Dense, 50 variables)", make_deep, True),
}


def headless_comms():
    """Widgets send into comms that drop messages (serialised as in a kernel, never sent)."""
    import comm
    from comm.base_comm import BaseComm

    class Dropping(BaseComm):
        kernel = "headless"  # ipywidgets only serialises for a comm with a kernel

        def publish_msg(self, *args, **kwargs):
            pass

    comm.create_comm = lambda *a, **k: Dropping(**k)


def dashboard(every=0.25):
    headless_comms()
    import widgets

    return widgets.Dashboard(gradients=True, refresh_every=every, flush_every=every)


def livelossplot_callback():
    import matplotlib

    matplotlib.use("Agg")
    from livelossplot import PlotLossesKeras

    return PlotLossesKeras()


def has_livelossplot():
    try:
        import livelossplot  # noqa: F401
    except ImportError:
        return False
    return True


def configs(tmp, every=0.25):
    """name -> () -> list of callbacks. "bare fit" first; it is the reference.

    `every`: the lab's seconds between reads of the device and between
    refreshes (0.25 s by default); fits taking turns pass a multiple (`measure`)."""
    found = {
        "bare fit": lambda: [],
        'a per-batch `float(logs)` callback': lambda: [StoreFloats()],
        'TensorBoard(update_freq="batch")': lambda: [
            keras.callbacks.TensorBoard(tempfile.mkdtemp(prefix="tb-", dir=tmp), update_freq="batch")],
        "TensorBoard + histogram_freq=1": lambda: [
            keras.callbacks.TensorBoard(tempfile.mkdtemp(prefix="tb-", dir=tmp), update_freq="batch",
                                        histogram_freq=1)],
    }
    if has_livelossplot():
        found["livelossplot"] = lambda: [livelossplot_callback()]
    found.update({
        "`lab.Recorder()`": lambda: [lab.Recorder(flush_every=every)],
        "`widgets.Dashboard(gradients=True)`": lambda: [dashboard(every)],
        "`lab.Recorder(gradients=True, weights=True)`": lambda: [
            lab.Recorder(gradients=True, weights=True, flush_every=every)],
        "`lab.Recorder(gradients=True, weights=True, norms_every=10)`": lambda: [
            lab.Recorder(gradients=True, weights=True, norms_every=10, flush_every=every)],
        A_A: lambda: [],
    })
    return found


HOOKS = ("on_train_begin", "on_epoch_begin", "on_train_batch_begin", "on_train_batch_end", "on_epoch_end",
         "on_train_end")


def timed(callbacks):
    """Times the fit() hooks of `callbacks` in place; returns a list whose
    one item adds up the seconds spent inside them.

    That is the callbacks' own share of a fit, measured in the same process
    and far steadier than the fit's wall time: what remains of a
    configuration's overhead is in the graph (`benchmarks/step_cost.py`). A
    hook is wrapped on the instance, so Keras calls it as before; the
    wrapper's own cost (two clock reads) is part of the figure.
    """
    spent = [0.0]
    for callback in callbacks:
        for name in HOOKS:
            hook = getattr(callback, name)

            def timed_hook(*args, _hook=hook, **kwargs):
                start = time.perf_counter()
                try:
                    return _hook(*args, **kwargs)
                finally:
                    spent[0] += time.perf_counter() - start

            setattr(callback, name, timed_hook)
    return spent


def data(flat, batches):
    (x, y), _ = lab.datasets.digits(flat=flat)
    samples = batches * BATCH_SIZE
    repeat = int(np.ceil(samples / len(x)))
    return np.concatenate([x] * repeat)[:samples], np.concatenate([y] * repeat)[:samples]


def dataset(flat, batches):
    """The fits' batches, as a `tf.data.Dataset` with tf.data's autotuning off.

    Autotuned (as fit() makes it from arrays), the first batch of an epoch
    now and then waited 0.2-0.3 s, in bare fit as much as in any other
    configuration: bare fits of 3 epochs took 0.95, 1.27, 1.6 or 1.92 s
    on one CPU, by how many epochs stalled, and the ratios compared those
    counts. Off, no batch waited over 20 ms (scratch timings, 2026-12-02).
    The steps are those of fit() on the arrays, without the shuffle."""
    return batched(*data(flat, batches))


def batched(x, y):
    """Arrays `x` and `y` in batches of `BATCH_SIZE`, tf.data's autotuning off (`dataset`)."""
    options = tf.data.Options()
    options.autotune.enabled = False
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH_SIZE).with_options(options)


def measure(build, flat, steps_per_execution, rounds, batches, epochs, tmp, seed=0):
    """Median and fastest ratios to bare fit, per configuration, at one steps_per_execution.

    In each round every configuration runs one fit on a new model, all
    taking turns (`Turns`). Each round makes every model, and its
    optimizer's variables, before any of them traces or runs a step, in a
    shuffled order, then warms each up with its callbacks (two executions:
    that traces the hooked train function). Made and warmed up one after
    the other, the model made last ran its steps 7-10% faster than the
    others, whichever configuration it was (`watch_overhead.measure_round`
    has the figures); made first but kept for the whole run, a copy of
    bare fit still came out at 0.91-0.95 on the 50-variable MLP (2026-12-02
    19:35): new models each round turn what a copy differs by into a
    difference between rounds, which the median evens out."""
    batches_data = dataset(flat, batches)
    warm_up = batches_data.take(2 * steps_per_execution)
    # Taking turns, each fit runs one step in every len(configs): its lab
    # reads and refreshes as often per step as a fit running alone.
    every_seconds = 0.25 * len(configs(tmp))
    seconds, cpu_seconds, ratios, hook_shares, cpu_ratios = {}, {}, {}, {}, {}
    shuffle = random.Random(seed + steps_per_execution).shuffle
    every = max(1, TURN_STEPS // steps_per_execution)
    for _ in range(rounds):
        found = configs(tmp, every=every_seconds)
        names = list(found)
        shuffle(names)
        models, callbacks, spent = {}, {}, {}
        for name in names:
            keras.utils.set_random_seed(0)
            model = build()
            model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          steps_per_execution=steps_per_execution)
            model.optimizer.build(model.trainable_variables)
            models[name] = model
        for name in names:
            callbacks[name] = found[name]()
            spent[name] = timed(callbacks[name])
            models[name].fit(warm_up, epochs=1, verbose=0, shuffle=False, callbacks=callbacks[name])
        turns = Turns(found, every, shuffle)
        fits = {}
        for name in found:
            spent[name][0] = 0.0
            fits[name] = functools.partial(models[name].fit, batches_data, epochs=epochs, verbose=0, shuffle=False,
                                           callbacks=callbacks[name] + [turns.callback(name)])
        turns.run(fits)
        for name in found:
            seconds.setdefault(name, []).append(turns.seconds[name])
            cpu_seconds.setdefault(name, []).append(turns.cpu[name])
            hook_shares.setdefault(name, []).append(spent[name][0] / turns.seconds[name])
            ratios.setdefault(name, []).append(turns.seconds[name] / turns.seconds["bare fit"])
            cpu_ratios.setdefault(name, []).append(turns.cpu[name] / turns.cpu["bare fit"])
    fastest_bare = min(seconds["bare fit"])
    steps = batches * epochs
    return {
        "steps": steps,
        "bare_seconds_median": statistics.median(seconds["bare fit"]),
        "bare_ms_per_step": 1000 * statistics.median(seconds["bare fit"]) / steps,
        "configs": {name: {"median_ratio": statistics.median(seconds[name]) / statistics.median(seconds["bare fit"]),
                           "fastest_ratio": min(seconds[name]) / fastest_bare,
                           "cpu_median_ratio": (statistics.median(cpu_seconds[name])
                                                / statistics.median(cpu_seconds["bare fit"])),
                           "round_median_ratio": statistics.median(ratios[name]),
                           "hook_share_median": statistics.median(hook_shares[name]),
                           "hook_shares": hook_shares[name],
                           "ratios": ratios[name], "cpu_ratios": cpu_ratios[name], "seconds": seconds[name],
                           "cpu_seconds": cpu_seconds[name]}
                    for name in found},
    }


def use_threads(count):
    """TensorFlow's intra- and inter-op threads, before any op runs (None: TF's default)."""
    if count:
        tf.config.threading.set_intra_op_parallelism_threads(count)
        tf.config.threading.set_inter_op_parallelism_threads(count)


def target_rows(report):
    """One row per target the report holds: (where, configuration, target, ratio, verdict, low, high)."""
    rows = []
    for model in report["models"].values():
        for spe, limits in TARGETS.items():
            result = model["results"].get(spe)
            if result is None:
                continue
            bare = result["configs"]["bare fit"]["seconds"]
            for name, limit in limits.items():
                config = result["configs"][name]
                rows.append((f"{model['label']}, spe={spe}", name, limit, config["median_ratio"],
                             *verdict(config["seconds"], bare, limit)))
    watch = report.get("watch")
    if watch is not None:
        bare = watch["configs"]["unwatched"]["seconds"]
        for name, limit in WATCH_TARGETS.items():
            config = watch["configs"][name]
            rows.append(("hand-written tf.function loop", f"`lab.{name}`", limit, config["median_ratio"],
                         *verdict(config["seconds"], bare, limit)))
    return rows


def loadavg():
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return None


def table(label, results, rounds):
    """One markdown table: rows = configurations, columns = steps_per_execution."""
    spes = sorted(results, key=int)
    names = [n for n in results[spes[0]]["configs"] if n != "bare fit"]
    head = " | ".join(f"steps_per_execution={spe} ({results[spe]['bare_ms_per_step']:.2f} ms/step)" for spe in spes)
    lines = [(f"**{label}**, {results[spes[0]]['steps']} steps per fit, {rounds} rounds: "
              "median time / bare fit's median (fastest / fastest; CPU time, median / median)"), "",
             f"| | {head} |", "|---|" + "---|" * len(spes)]
    for name in names:
        cells = " | ".join(f"{results[spe]['configs'][name]['median_ratio']:.2f} "
                           f"({results[spe]['configs'][name]['fastest_ratio']:.2f}; "
                           f"cpu {results[spe]['configs'][name]['cpu_median_ratio']:.2f})" for spe in spes)
        lines.append(f"| {name} | {cells} |")
    lines += ["", "Inside the callbacks' hooks: median share of each fit's time (in-process, steady)", "",
              "| | " + " | ".join(f"steps_per_execution={spe}" for spe in spes) + " |", "|---|" + "---|" * len(spes)]
    for name in names:
        cells = " | ".join(f"{100 * results[spe]['configs'][name]['hook_share_median']:.1f}%" for spe in spes)
        lines.append(f"| {name} | {cells} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the short form: MLP only, fewer steps and rounds")
    parser.add_argument("--json", metavar="PATH", help="also write the figures to this JSON file")
    parser.add_argument("--models", help="comma-separated, from: " + ", ".join(MODELS))
    parser.add_argument("--rounds", type=int, help="rounds of interleaved fits (7; 3 with --quick)")
    parser.add_argument("--no-watch", action="store_true", help="skip the lab.watch loop benchmark")
    parser.add_argument("--watch-only", action="store_true", help="only the lab.watch loop benchmark (no fit())")
    parser.add_argument("--threads", type=int, help="TensorFlow intra- and inter-op threads (default: TF's)")
    parser.add_argument("--cpu", type=int, help="run on this CPU only, every thread (default: any); see pin()")
    args = parser.parse_args(argv)
    pin(args.cpu)
    use_threads(args.threads)
    rounds = args.rounds or (3 if args.quick else 7)
    batches, epochs = (64, 2) if args.quick else (208, 3)
    keys = args.models.split(",") if args.models else (["mlp"] if args.quick else list(MODELS))
    unknown = [k for k in keys if k not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {list(MODELS)}")
    if args.watch_only and (args.no_watch or args.models):
        parser.error("--watch-only runs no fit() model: leave out --models and --no-watch")
    if args.watch_only:
        keys = []
    report = {
        "command": " ".join(["python", "benchmarks/overhead.py"] + list(sys.argv[1:] if argv is None else argv)),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "tensorflow": tf.__version__, "keras": keras.__version__},
        "batch_size": BATCH_SIZE, "rounds": rounds, "threads": args.threads, "cpu": args.cpu, "loadavg": {"start": loadavg()},
        "models": {},
    }
    print(f"load average at start (1, 5, 15 min): {report['loadavg']['start']} on {os.cpu_count()} CPUs; "
          f"TF threads: {args.threads or 'default'}; pinned to CPU {args.cpu}")
    if not has_livelossplot():
        print("(livelossplot is not installed: its row is left out)")
    tmp = tempfile.mkdtemp(prefix="lab-overhead-")
    try:
        for key in keys:
            label, build, flat = MODELS[key]
            results = {}
            for spe in SPES:
                results[str(spe)] = measure(build, flat, spe, rounds, batches, epochs, tmp)
                shutil.rmtree(tmp, ignore_errors=True)
                os.makedirs(tmp, exist_ok=True)
            report["models"][key] = {"label": label, "results": results, "loadavg_after": loadavg()}
            print()
            print(table(label, results, rounds))
            print(f"\n(load average after: {report['models'][key]['loadavg_after']})", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if not args.no_watch:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import watch_overhead

        steps = 128 if args.quick else 624
        ratios, bare = watch_overhead.measure(True, rounds, steps, batch_size=BATCH_SIZE)
        report["watch"] = {"steps": steps, "unwatched_ms_per_step": 1000 * bare / steps, "configs": ratios,
                           "loadavg_after": loadavg()}
        print(f"\n**lab.watch** on a hand-written `tf.function` loop (MLP, batch {BATCH_SIZE}, {steps} steps, "
              f"{rounds} rounds; unwatched {1000 * bare / steps:.2f} ms/step): median time / the unwatched loop's "
              "median (fastest / fastest; CPU time, median / median); and the median of the rounds' own "
              "ratios (each round's configurations ran under the same load)\n")
        print("| | ratio | rounds' median |\n|---|---|---|")
        for name, value in ratios.items():
            if name != "unwatched":
                print(f"| {name} | {value['median_ratio']:.2f} ({value['fastest_ratio']:.2f}; "
                      f"cpu {value['cpu_median_ratio']:.2f}) | {value['round_median_ratio']:.2f} |")
        print(f"\n(load average after: {report['watch']['loadavg_after']})")
    rows = target_rows(report)
    report["targets"] = [dict(zip(("where", "configuration", "target", "ratio", "verdict", "low", "high"), row))
                         for row in rows]
    print("\n**Targets**: median ratio [90% bootstrap interval] against the target; \"noise\": "
          "the interval straddles it\n")
    print("| where | configuration | target | ratio | verdict |\n|---|---|---|---|---|")
    for where, name, limit, ratio, found, low, high in rows:
        print(f"| {where} | {name} | {limit:.2f} | {ratio:.2f} [{low:.2f}-{high:.2f}] | {found} |")
    report["loadavg"]["end"] = loadavg()
    report["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
