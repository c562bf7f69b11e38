"""Peak memory of `model.predict` against `lab.predict_stream` with a running aggregate.

Each measurement runs in a fresh subprocess, so one cannot inherit the other's
allocator pools. Two measures, because neither sees everything:

- RSS: the process's resident high-water mark (`ru_maxrss`) after the
  measured call minus the mark before it. It counts TensorFlow's own buffers
  (tensors, the copy `model.predict` makes of its input) as well as numpy's;
  it is a high-water mark, so a transient spike during warm-up can hide a
  smaller later one (the warm-up is kept small for that reason).
- tracemalloc: the peak of Python-tracked allocations during the call. numpy
  reports its array buffers to tracemalloc, TensorFlow's C++ allocator does
  not, so this counts the numpy outputs `model.predict` accumulates and
  concatenates, and nothing of TensorFlow.

The input array exists before either mark is taken: both calls read the same
data, and only what they allocate on top of it is measured.

Usage:
    python benchmarks/predict_memory.py                # 1e4, 1e5, 1e6 samples
    python benchmarks/predict_memory.py --samples 10000 100000
"""

import argparse
import json
import os
import subprocess
import sys

FEATURES = 32
CLASSES = 10
BATCH = 1024


def child(method, samples):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import resource
    import tracemalloc

    import keras
    import numpy as np

    import lab

    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((FEATURES,)),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(CLASSES, activation="softmax"),
    ])
    x = np.random.default_rng(0).random((samples, FEATURES), dtype=np.float32)
    warm = x[: 2 * BATCH]
    # Warm-up: trace the functions and touch the allocators once.
    model.predict(warm, batch_size=BATCH, verbose=0)
    for _ in lab.predict_stream(model, warm, batch_size=BATCH):
        pass

    counts = np.zeros(CLASSES, np.int64)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    tracemalloc.start()
    if method == "predict":
        y_pred = model.predict(x, batch_size=BATCH, verbose=0)
        counts += np.bincount(y_pred.argmax(-1), minlength=CLASSES)
        del y_pred
    else:
        def collect(y_pred, batch):
            counts[:] += np.bincount(y_pred.argmax(-1), minlength=CLASSES)

        lab.predict_stream(model, x, batch_size=BATCH, collect=collect)
    _, traced = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # ru_maxrss is in KiB on Linux.
    print(json.dumps({"method": method, "samples": samples, "rss_bytes": (after - before) * 1024,
                      "traced_bytes": traced, "checksum": int(counts.sum())}))


def measure(method, samples):
    result = subprocess.run(
        [sys.executable, __file__, "--child", method, str(samples)],
        capture_output=True, text=True, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
    )
    if result.returncode:
        sys.exit(f"The {method} measurement at {samples} samples failed:\n{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def mib(value):
    return f"{value / 2**20:9.1f}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]))
        return
    print(f"Dense {FEATURES}->64->{CLASSES}, batch {BATCH}; MiB above the mark before the call")
    print(f"{'samples':>9} | {'predict RSS':>11} {'stream RSS':>10} {'ratio':>7} | "
          f"{'predict numpy':>13} {'stream numpy':>12} {'ratio':>7}")
    for samples in args.samples:
        full, stream = measure("predict", samples), measure("stream", samples)
        assert full["checksum"] == stream["checksum"] == samples
        rss_ratio = full["rss_bytes"] / max(stream["rss_bytes"], 1)
        traced_ratio = full["traced_bytes"] / max(stream["traced_bytes"], 1)
        print(f"{samples:>9} | {mib(full['rss_bytes']):>11} {mib(stream['rss_bytes']):>10} "
              f"{rss_ratio:>6.1f}x | {mib(full['traced_bytes']):>13} "
              f"{mib(stream['traced_bytes']):>12} {traced_ratio:>6.1f}x")


if __name__ == "__main__":
    main()
