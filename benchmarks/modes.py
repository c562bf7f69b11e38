"""Eager vs graph vs XLA, at steps_per_execution 1 and 8, on a small MLP and a small CNN.

Prints `lab.compare_modes` for each model: ratios come from one run on one
machine, so compare rows within a table, not across machines.

    TF_CPP_MIN_LOG_LEVEL=2 python benchmarks/modes.py [--steps 64] [--batch-size 32]
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import pandas as pd  # noqa: E402

import lab  # noqa: E402


def mlp():
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                             keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)], name="mlp")


def cnn():
    return keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Conv2D(16, 3, activation="relu"),
                             keras.layers.Conv2D(32, 3, activation="relu"), keras.layers.Flatten(),
                             keras.layers.Dense(10)], name="cnn")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()
    pd.set_option("display.width", 200)
    pd.set_option("display.max_columns", 20)
    for build, flat in ((mlp, True), (cnn, False)):
        keras.utils.set_random_seed(0)
        (x, y), _ = lab.datasets.digits(flat=flat)
        model = build()
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
        frame = lab.compare_modes(model, (x, y), steps=args.steps, batch_size=args.batch_size)
        print(f"\n{model.name}: {model.count_params():,} parameters, batch {args.batch_size}, {args.steps} steps")
        print(frame.drop(columns=["error"]).round(4).to_string(index=False))
        for _, row in frame[frame["error"].notna()].iterrows():
            print(f"  {row['mode']} x{row['steps_per_execution']}: {row['error']}")
        print(f"input alone: {frame.attrs['data_batches_per_second']:,.0f} batches/s")
        print(f"bottleneck: {frame.attrs['bottleneck']}")


if __name__ == "__main__":
    main()
