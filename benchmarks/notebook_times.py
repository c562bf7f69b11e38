"""How long each tutorial takes to run top to bottom, as a newcomer runs it.

    .venv/bin/python benchmarks/notebook_times.py            # every notebook
    .venv/bin/python benchmarks/notebook_times.py notebooks/01_quickstart.ipynb

Each notebook runs in a fresh kernel (the kernel spec nbval uses, from
jupyter/kernels), from its own folder, nothing saved. The same run
first times a baseline notebook that only starts a kernel and imports
TensorFlow, Keras and the lab, so every figure also reads as "seconds of the
tutorial's own work" (total minus baseline) and as a ratio to the baseline.
Absolute seconds depend on the machine and on what else runs on it; the
target is that every notebook finishes in about two minutes on 2 CPU cores.
"""

import argparse
import os
import pathlib
import sys
import time

import nbformat
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "notebooks"))

from refresh_outputs import kernel_environment  # noqa: E402

BASELINE_SOURCE = "import keras\nimport tensorflow as tf\n\nimport lab\nimport widgets"


def run(notebook, folder):
    """Executes `notebook` in a fresh kernel; returns (total seconds, slowest cell seconds, index)."""
    client = NotebookClient(notebook, timeout=600, kernel_name="python3", store_widget_state=False,
                            resources={"metadata": {"path": str(folder)}})
    start = time.perf_counter()
    client.execute()
    total = time.perf_counter() - start
    slowest, index = 0.0, None
    for i, cell in enumerate(notebook.cells):
        timing = cell.metadata.get("execution", {})
        began, ended = timing.get("iopub.execute_input"), timing.get("shell.execute_reply")
        if began and ended:
            seconds = _seconds(ended) - _seconds(began)
            if seconds > slowest:
                slowest, index = seconds, i
    return total, slowest, index


def _seconds(stamp):
    from datetime import datetime

    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", help="notebooks to time (default: notebooks/*.ipynb)")
    parser.add_argument("--budget", type=float, default=120.0,
                        help="seconds a notebook may take before it is flagged (default 120)")
    args = parser.parse_args(argv)
    paths = [pathlib.Path(p) for p in args.notebooks] or sorted((ROOT / "notebooks").glob("*.ipynb"))
    os.environ.update(kernel_environment())

    baseline_nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(BASELINE_SOURCE)])
    baseline, _, _ = run(baseline_nb, ROOT)
    print(f"baseline (kernel start + import tensorflow, keras, lab, widgets): {baseline:.1f} s\n")
    print("| notebook | total s | own work s | x baseline | slowest cell s |")
    print("|---|---:|---:|---:|---:|")
    over = []
    for path in paths:
        notebook = nbformat.read(path, as_version=4)
        total, slowest, index = run(notebook, path.resolve().parent)
        print(f"| `{path.name}` | {total:.0f} | {total - baseline:.0f} | {total / baseline:.1f} "
              f"| {slowest:.0f} (cell {index}) |", flush=True)
        if total > args.budget:
            over.append(path.name)
    if over:
        print(f"\nover the {args.budget:.0f} s budget: {', '.join(over)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
