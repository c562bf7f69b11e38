"""GPU check: discovery, a one-GPU strategy, a Recorder with gradients, training unchanged by the lab, a watched loop, eager vs graph vs XLA.

For a machine with a GPU; on one without, it says so and runs the same checks
on the CPU, so the script itself stays exercised. Prints a short report and
exits with 1 if a check failed.

    TF_CPP_MIN_LOG_LEVEL=2 python benchmarks/gpu_check.py [--steps 32]
"""

import argparse
import os
import sys
import time
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import tensorflow as tf  # noqa: E402

import lab  # noqa: E402
from lab.backend.tensorflow.devices import describe  # noqa: E402


def build_model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256, activation="relu"),
                              keras.layers.Dense(256, activation="relu"), keras.layers.Dense(10)], name="mlp")
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def check(name, results, fn):
    start = time.perf_counter()
    try:
        detail = fn()
        results.append((name, "ok", detail))
    except Exception as error:  # noqa: BLE001 - a failed check is reported, the others still run
        traceback.print_exc(limit=3)
        results.append((name, "FAILED", f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"))
    print(f"  {name}: {results[-1][1]} ({time.perf_counter() - start:.1f} s) {results[-1][2]}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=32, help="training steps per compared mode")
    args = parser.parse_args()

    print(f"TensorFlow {tf.__version__}, Keras {keras.__version__}")
    frame = lab.devices()
    with pd.option_context("display.width", 120):
        print(frame.to_string(index=False))
    gpus = frame[frame["type"] == "GPU"]
    spec = "gpu" if len(gpus) else "cpu"
    if len(gpus):
        print(f"GPU found: {len(gpus)} ({', '.join(gpus['description'].fillna(''))}).")
    else:
        print("No GPU found: TensorFlow sees only " + ", ".join(frame["name"])
              + ". Running the same checks on the CPU.")
    (x, y), _ = lab.datasets.digits()
    results = []

    def one_device():
        strategy = lab.strategy(spec)
        with strategy.scope():
            model = build_model()
        recorder = lab.Recorder(gradients=True)
        model.fit(x, y, batch_size=64, epochs=2, verbose=0, callbacks=[recorder])
        batches = recorder.run.batches()
        placed = {v.value.device.split("device:")[-1] for v in model.weights}
        grads = [c for c in batches.columns if c.startswith("grad_norm/")]
        if not (np.isfinite(batches["loss"]).all() and np.isfinite(batches["grad_norm"]).all()):
            raise AssertionError("non-finite loss or gradient norm recorded")
        return (f"{describe(strategy)}; weights on {sorted(placed)}; {len(batches)} rows, "
                f"{len(grads)} gradient columns, loss {batches['loss'].iloc[0]:.3f} -> "
                f"{batches['loss'].iloc[-1]:.3f}")

    def watched_loop():
        # The row a traced step writes is an input from the host: on a GPU it
        # must reach the scatter on the device; the norms must be the tape's.
        import watch_overhead  # beside this script: the loop the TensorFlow guides teach

        keras.utils.set_random_seed(0)
        model, optimizer = build_model(), keras.optimizers.SGD(0.05)
        loop = watch_overhead.make_loop(model, optimizer, compiled=True)
        expected, worst = [], 0.0
        with lab.watch(model, optimizer, capacity=4) as run:
            for i in range(12):
                xb, yb = x[64 * i:64 * (i + 1)].astype("float32"), y[64 * i:64 * (i + 1)]
                with tf.GradientTape() as tape:
                    loss = watch_overhead.LOSS(yb, model(xb, training=True))
                expected.append([float(tf.norm(g)) for g in tape.gradient(loss, model.trainable_variables)])
                loop(run, [(xb, yb)])
        frame = run.batches()
        for norms, (_, row) in zip(expected, frame.iterrows()):
            for variable, norm in zip(model.trainable_variables, norms):
                worst = max(worst, abs(row[f"grad_norm/{variable.path}"] - norm) / norm)
        if len(frame) != 12 or worst > 1e-4:
            raise AssertionError(f"{len(frame)} rows; largest relative difference from the tape {worst:.2e}")
        placed = sorted({run.probe._slots.vector.device.split("device:")[-1]})
        return f"12 rows equal the tape's norms (largest relative difference {worst:.1e}); ring on {placed}"

    def unchanged():
        # Keras' jit_compile="auto" is XLA where there is a GPU: the step and
        # the lab's reads are one XLA program. The weights must still be a
        # bare fit's, and the run must say that XLA compiled its step.
        bare, watched = build_model(), build_model()
        bare.fit(x, y, batch_size=64, epochs=2, verbose=0, shuffle=False)
        recorder = lab.Recorder(gradients=True, weights=True)
        watched.fit(x, y, batch_size=64, epochs=2, verbose=0, shuffle=False, callbacks=[recorder])
        differ = [w.path for w, b in zip(watched.weights, bare.weights)
                  if not np.array_equal(w.numpy(), b.numpy())]
        noted = any("XLA" in d for d in recorder.run.events()["detail"])
        if differ or noted != bool(watched.jit_compile):
            raise AssertionError(f"jit_compile={watched.jit_compile}; weights that differ from a bare fit: "
                                 f"{differ}; XLA note in the run: {noted}")
        return f"jit_compile={watched.jit_compile}: every weight equals the bare fit's; XLA note: {noted}"

    comparison = {}

    def timings():
        model = build_model()  # default placement: the GPU when there is one
        comparison["frame"] = lab.compare_modes(model, (x, y), steps=args.steps, batch_size=64)
        failed = comparison["frame"]["error"].notna().sum()
        return f"{failed} mode(s) failed" if failed else "all modes ran"

    check(f"one-device strategy '{spec}' + Recorder(gradients=True)", results, one_device)
    check("Recorder(gradients=True, weights=True) leaves training as a bare fit's", results, unchanged)
    check("lab.watch on a tf.function loop", results, watched_loop)
    check("eager vs graph vs XLA", results, timings)
    if "frame" in comparison:
        columns = ["mode", "steps_per_execution", "trace_seconds", "step_ms", "speedup_vs_eager",
                   "max_loss_diff", "error"]
        with pd.option_context("display.width", 160, "display.max_colwidth", 60):
            print(comparison["frame"][columns].to_string(index=False))
        print(comparison["frame"].attrs.get("bottleneck", ""))
    failed = [name for name, status, _ in results if status != "ok"]
    print("GPU check: " + ("passed" if not failed else f"FAILED: {', '.join(failed)}")
          + ("" if len(gpus) else " (no GPU: checked on the CPU)"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
