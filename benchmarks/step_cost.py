"""What the probes add to one training step: kernels in the traced step, and its time.

`overhead.py` measures whole `fit()` calls, where Keras' own per-batch work
and the lab's hooks are part of the figure. This benchmark isolates the part
the lab puts inside the compiled step, on one model: its bare train function,
a second bare one (the control), and one traced with each configuration's
probe (the probe a Recorder installs; taken off the model again once traced,
while the traced function keeps writing its rows) all train the same model,
taking turns in blocks of 8 steps (one call at spe=32) in a shuffled order.
A block of each is one pair with the same block's bare function; the table
shows the median of those ratios with its quartiles. On one model there is
no "model of its own" in the figure: models made and warmed one after the
other ran their steps up to 10% apart whatever their configuration (see the
README), which is what the pairs of separate models this benchmark used
before measured as much as the probes. Each probe's rows are read every 16
blocks, outside the timed part, as a Recorder's flush would. It also counts
the kernels each configuration adds to the traced `train_step` (Const and
Placeholder nodes left out; the branch functions of conds counted, since a
graph runs the nodes of a branch not taken as dead ones, and a cond's
Switches, one per tensor its branches read; not the nodes of a function
that is called as one node, `lab.backend.tensorflow.compat.rarely`'s branch).

`--overflow-check` measures one part of it instead: what the norms'
overflow check costs per update, `lab.backend.tensorflow.norms.norms_of` against the same
sums of squares with no check (the floor) and with the check as a plain
`tf.cond` (a Switch per tensor), for 6, 18 and 150 tensors (a 6-variable
update's gradients; with weights and updates; a 50-variable one's). Each
form runs 20 chained calls in one `tf.function`; the forms are timed in
turn, in a shuffled order, and the fastest tenth of each is compared.

Usage:
    python benchmarks/step_cost.py                      # MLP, CNN, 50-variable MLP; spe 1 and 32
    python benchmarks/step_cost.py --threads 1          # one TF thread: less scheduling noise
    python benchmarks/step_cost.py --models deep --blocks 300
    python benchmarks/step_cost.py --threads 1 --overflow-check
    python benchmarks/step_cost.py --threads 1 --cpu 1   # pinned to CPU 1: far steadier on a shared machine
    python benchmarks/step_cost.py --jit-compile        # under XLA: the step and the probes in one program
    python benchmarks/step_cost.py --models embedding   # an Embedding's sparse gradient, trained by SGD
    python benchmarks/step_cost.py --models mlp --nonfinite   # also the nonfinite() breakpoint's gate
"""

import argparse
import os
import random
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

CONFIGS = {
    "`Recorder()`": {},
    "`Recorder(gradients=True)`": {"gradients": True},
    "`Recorder(gradients=True, weights=True)`": {"gradients": True, "weights": True},
}
# A model whose gradient is sparse, an Embedding's (`tf.IndexedSlices`),
# trained by plain SGD, which applies it as it is. Not among the default
# models: `--models embedding`.
VOCABULARY, TOKENS = 200_000, 20


def make_embedding():
    import keras

    return keras.Sequential([keras.Input((TOKENS,), dtype="int32"), keras.layers.Embedding(VOCABULARY, 64),
                             keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(10)])


SPARSE_MODELS = {"embedding": ("Embedding 200,000 x 64, pooled, Dense 10; SGD (a sparse gradient)", make_embedding)}
NONFINITE = "`Recorder(breakpoints=[nonfinite()])`"  # with --nonfinite
SKIPPED_NODES = ("Const", "Placeholder", "NoOp")
CONTROL = "bare again, a second train function of the same model (the control)"
BLOCK = 8  # steps per turn


def build(overhead, key, steps_per_execution, jit_compile=False):
    """A compiled model of `overhead.MODELS[key]` or `SPARSE_MODELS[key]`
    (compiled by XLA with `jit_compile`) with its optimizer built, an endless
    iterator of its batches (tf.data's autotuning off, `overhead.batched`)
    and one batch for tracing."""
    import keras
    import numpy as np

    keras.utils.set_random_seed(0)
    if key in SPARSE_MODELS:
        model, optimizer = SPARSE_MODELS[key][1](), "sgd"
        draw = np.random.default_rng(0)
        samples = 208 * overhead.BATCH_SIZE
        x = draw.integers(0, VOCABULARY, (samples, TOKENS)).astype("int32")
        y = draw.integers(0, 10, samples)
        batches = overhead.batched(x, y)
    else:
        _, make, flat = overhead.MODELS[key]
        model, optimizer = make(), "adam"
        x, y = overhead.data(flat, 208)
        batches = overhead.dataset(flat, 208)
    model.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  steps_per_execution=steps_per_execution, jit_compile=jit_compile)
    model.optimizer.build(model.trainable_variables)
    return model, iter(batches.repeat()), (x[: overhead.BATCH_SIZE], y[: overhead.BATCH_SIZE])


def title(overhead, key):
    return SPARSE_MODELS[key][0] if key in SPARSE_MODELS else overhead.MODELS[key][0]


def train_function(model, iterator, batch, steps_per_execution, probe_args):
    """A new train function of `model`, traced with a probe when
    `probe_args` is not None (then the probe is taken off the model again:
    the traced function keeps its ops and writes its rows), and the kernels
    its `train_step` has. Returns (function, probe, kernels)."""
    from lab.backend.tensorflow.probes import Probe

    probe = None
    if probe_args is not None:
        probe = Probe(model, **probe_args)
        probe.ensure_capacity(steps_per_execution)
        probe.install()
    try:
        model.make_train_function(force=True)
        function = model.train_function
        for _ in range(3):  # traces, and warms the kernels
            function(iterator)
        count = kernels(model, batch)
    finally:
        if probe is not None:
            probe.read()
            probe.uninstall()
    return function, probe, count


def kernels(model, batch):
    """Nodes of `train_step` traced on one batch, by op type (branch functions included)."""
    import tensorflow as tf

    from lab.backend.tensorflow.compat import graph_nodes

    x, y = batch
    traced = tf.function(lambda data: model.train_step(data)).get_concrete_function(
        (tf.TensorSpec(x.shape, tf.as_dtype(x.dtype)), tf.TensorSpec(y.shape, tf.as_dtype(y.dtype))))
    counts = graph_nodes(traced.graph)
    return sum(v for k, v in counts.items() if k not in SKIPPED_NODES)


def measure(overhead, key, steps_per_execution, blocks, jit_compile=False, configs=None):
    configs = CONFIGS if configs is None else configs
    model, iterator, batch = build(overhead, key, steps_per_execution, jit_compile)
    functions = {"bare": train_function(model, iterator, batch, steps_per_execution, None),
                 CONTROL: train_function(model, iterator, batch, steps_per_execution, None)}
    for name, args in configs.items():
        functions[name] = train_function(model, iterator, batch, steps_per_execution, args)
    calls = max(1, BLOCK // steps_per_execution)
    steps = calls * steps_per_execution
    draw = random.Random(steps_per_execution)
    order = list(functions)
    seconds = {name: [] for name in functions}
    for block in range(blocks):
        draw.shuffle(order)
        for name in order:
            function = functions[name][0]
            start = time.perf_counter()
            for _ in range(calls):
                function(iterator)
            seconds[name].append((time.perf_counter() - start) / steps)
        if block % 16 == 15:
            for function, probe, _ in functions.values():
                if probe is not None:
                    probe.read()  # as a Recorder's flush does; outside the timed part
    bare_kernels = functions["bare"][2]
    result = {"bare_us_per_step": 1e6 * statistics.median(seconds["bare"]), "bare_kernels": bare_kernels,
              "configs": {}}
    for name in [CONTROL, *configs]:
        ratios = [a / b for a, b in zip(seconds[name], seconds["bare"])]
        q1, _, q3 = statistics.quantiles(ratios, n=4)
        result["configs"][name] = {"median_ratio": statistics.median(ratios), "q1": q1, "q3": q3,
                                   "added_us_per_step": 1e6 * (statistics.median(seconds[name])
                                                               - statistics.median(seconds["bare"])),
                                   "kernels_added": functions[name][2] - bare_kernels}
    return result


def _checked_by_cond(tensors):
    """`norms_of` with its overflow check as a plain `tf.cond` (what it was)."""
    import tensorflow as tf

    from lab.backend.tensorflow.norms import _scaled_norms

    squares = 2.0 * tf.stack([tf.nn.l2_loss(t) for t in tensors])
    return tf.cond(tf.reduce_all(tf.math.is_finite(squares)), lambda: tf.sqrt(squares),
                   lambda: _scaled_norms(tensors))


def _unchecked(tensors):
    import tensorflow as tf

    return tf.sqrt(2.0 * tf.stack([tf.nn.l2_loss(t) for t in tensors]))


# How many tensors the overflow check covers: the MLP's gradients, its
# gradients, weights and updates, and the 50-variable MLP's.
OVERFLOW_COUNTS = (6, 18, 150)


def overflow_check(rounds, calls=20, elements=1000, counts=OVERFLOW_COUNTS):
    """Microseconds per call of each form of the norms over the unchecked
    one, for each number of tensors in `counts`."""
    import tensorflow as tf

    from lab.backend.tensorflow.norms import norms_of

    forms = {"`norms_of` (one Switch)": norms_of, "as a `tf.cond`": _checked_by_cond, "no check": _unchecked}
    results = {}
    for count in counts:
        tensors = [tf.random.stateless_normal([elements], seed=[i, 0]) for i in range(count)]
        functions = {}
        for name, form in forms.items():
            def chained(*tensors, form=form):
                total = tf.zeros([len(tensors)])
                for _ in tf.range(calls):
                    total += form(list(tensors))
                return total

            functions[name] = tf.function(chained)
            functions[name](*tensors)
        times = {name: [] for name in forms}
        draw, order = random.Random(count), list(forms)
        for _ in range(rounds):
            draw.shuffle(order)
            for name in order:
                start = time.perf_counter()
                functions[name](*tensors)
                times[name].append((time.perf_counter() - start) / calls)
        fastest = {name: sorted(values)[len(values) // 10] for name, values in times.items()}
        results[count] = {name: 1e6 * (fastest[name] - fastest["no check"]) for name in forms if name != "no check"}
        results[count]["no check, us per call"] = 1e6 * fastest["no check"]
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,cnn,deep",
                        help="comma-separated, from overhead.py's models, and `embedding` (a sparse gradient)")
    parser.add_argument("--blocks", type=int, default=200,
                        help="turns of 8 steps per train function (200); with --overflow-check, runs (40)")
    parser.add_argument("--threads", type=int, help="TensorFlow intra- and inter-op threads (default: TF's)")
    parser.add_argument("--cpu", type=int, help="run on this CPU only (its threads too); default: any")
    parser.add_argument("--jit-compile", action="store_true",
                        help="the model compiled with jit_compile=True: the step and the probes in one XLA program")
    parser.add_argument("--nonfinite", action="store_true",
                        help="also `Recorder(breakpoints=[nonfinite()])`: the gate that keeps a non-finite update out")
    parser.add_argument("--overflow-check", action="store_true",
                        help="only what the norms' overflow check costs per update (see above)")
    args = parser.parse_args(argv)
    if args.cpu is not None:
        # Before TensorFlow starts its thread pools: threads inherit the mask.
        os.sched_setaffinity(0, {args.cpu})
    import overhead

    overhead.use_threads(args.threads)
    configs = dict(CONFIGS)
    if args.nonfinite:
        from lab.breakpoints import nonfinite

        configs[NONFINITE] = {"breakpoints": [nonfinite()]}
    if args.overflow_check:
        print(f"load average at start: {overhead.loadavg()} on {os.cpu_count()} CPUs; "
              f"TF threads: {args.threads or 'default'}; pinned to CPU {args.cpu}")
        results = overflow_check(max(10, args.blocks))
        print(f"\nThe norms' overflow check, us per update over no check (fastest tenth of {max(10, args.blocks)} "
              f"runs of 20 calls; 1,000 elements a tensor)\n")
        print("| tensors | no check, us per call | " + " | ".join(k for k in results[OVERFLOW_COUNTS[0]] if "per call" not in k) + " |")
        print("|---|---|---|---|")
        for count, row in results.items():
            cells = " | ".join(f"{v:+.1f}" for k, v in row.items() if "per call" not in k)
            print(f"| {count} | {row['no check, us per call']:.1f} | {cells} |")
        print(f"\n(load average after: {overhead.loadavg()})", flush=True)
        return

    keys = args.models.split(",")
    unknown = [k for k in keys if k not in overhead.MODELS and k not in SPARSE_MODELS]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {[*overhead.MODELS, *SPARSE_MODELS]}")
    print(f"load average at start: {overhead.loadavg()} on {os.cpu_count()} CPUs; "
          f"TF threads: {args.threads or 'default'}; pinned to CPU {args.cpu}")
    for key in keys:
        results = {spe: measure(overhead, key, spe, args.blocks, args.jit_compile, configs) for spe in overhead.SPES}
        # Under XLA the kernels are XLA's, not the traced graph's nodes: not counted.
        counted = not args.jit_compile
        kernels = f"; kernels the probe adds to a {results[1]['bare_kernels']}-kernel step" if counted else ""
        print(f"\n**{title(overhead, key)}**{'' if counted else ' under XLA (`jit_compile=True`)'}: "
              f"the train function alone, watched / bare on the same model, median of {args.blocks} blocks of "
              f"{BLOCK} steps [quartiles] (us a step over bare){kernels}\n")
        head = ["", *(["kernels added"] if counted else []),
                *(f"spe={spe} ({r['bare_us_per_step']:.0f} us/step)" for spe, r in results.items())]
        print("| " + " | ".join(head) + " |\n" + "|---" * len(head) + "|")
        for name in [*configs, CONTROL]:
            cells = [f"{r['configs'][name]['median_ratio']:.3f} [{r['configs'][name]['q1']:.2f}-"
                     f"{r['configs'][name]['q3']:.2f}] ({r['configs'][name]['added_us_per_step']:+.0f})"
                     for r in results.values()]
            added = [str(results[1]["configs"][name]["kernels_added"])] if counted else []
            print("| " + " | ".join([name, *added, *cells]) + " |")
        print(f"\n(load average after: {overhead.loadavg()})", flush=True)


if __name__ == "__main__":
    main()
