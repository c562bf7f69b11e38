"""Executes tutorial notebooks and stores the small outputs nbval checks.

    .venv/bin/python tests/notebooks/refresh_outputs.py notebooks/01_quickstart.ipynb

Each notebook runs in a fresh kernel from its own folder, with the kernel spec
in jupyter/kernels (TensorFlow's C++ start-up lines go to the
terminal, not into the notebook). Widget state is not stored (plotly.js alone
weighs megabytes), nor are execution timings; notebook metadata is reduced to
the kernel spec. A notebook that raises or writes to stderr is not saved.
"""

import os
import pathlib
import sys

import nbformat
from nbclient import NotebookClient

HERE = pathlib.Path(__file__).resolve().parent
KERNELS = HERE.parents[1] / "jupyter"
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}


def kernel_environment():
    """The variables nbval and this script run notebooks with."""
    paths = [str(KERNELS)] + [p for p in os.environ.get("JUPYTER_PATH", "").split(os.pathsep) if p]
    return {"JUPYTER_PATH": os.pathsep.join(paths), "TF_CPP_MIN_LOG_LEVEL": "2"}


def clean_metadata(notebook):
    """Keeps what Jupyter needs to pick the kernel; drops version and timing churn."""
    notebook.metadata = nbformat.from_dict({"kernelspec": KERNELSPEC,
                                            "language_info": {"name": "python"}})
    for cell in notebook.cells:
        kept = {k: v for k, v in cell.metadata.items() if k == "tags" and v}
        cell.metadata = nbformat.from_dict(kept)


def stderr_outputs(notebook):
    return [(index, output.text) for index, cell in enumerate(notebook.cells)
            if cell.cell_type == "code" for output in cell.outputs
            if output.output_type == "stream" and output.name == "stderr"]


def refresh(path):
    path = pathlib.Path(path).resolve()
    notebook = nbformat.read(path, as_version=4)
    os.environ.update(kernel_environment())
    client = NotebookClient(notebook, timeout=600, kernel_name="python3",
                            store_widget_state=False, record_timing=False,
                            resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    problems = stderr_outputs(notebook)
    if problems:
        raise SystemExit(f"{path.name}: stderr in cells {[i for i, _ in problems]}, not saved:\n"
                         + "\n".join(text for _, text in problems))
    clean_metadata(notebook)
    nbformat.write(notebook, path)
    print(f"{path}: {path.stat().st_size:,} bytes")


if __name__ == "__main__":
    for name in sys.argv[1:] or sorted(map(str, (HERE.parents[1] / "notebooks").glob("*.ipynb"))):
        refresh(name)
