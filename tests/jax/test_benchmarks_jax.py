"""The JAX step benchmark runs where TensorFlow is not installed, and times every configuration it names."""

import pathlib
import re
import sys

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"


def test_the_step_cost_benchmark_times_each_probe_and_the_norms_alone(capsys):
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import step_cost_jax
    finally:
        sys.path.remove(str(BENCHMARKS))
    step_cost_jax.main(["--rounds", "1"])
    rows = dict(re.findall(r"^(.+?)\s+[\d.]+ us a step\s+([\d.]+) x bare$", capsys.readouterr().out, re.M))
    assert set(rows) == {"bare", "bare again", "Recorder()", "gradients", "gradients + weights",
                         "weight + update norms alone"}, rows
    assert float(rows["bare"]) == 1.0 and all(float(ratio) > 0 for ratio in rows.values())
