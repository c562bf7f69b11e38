"""Every tutorial opens anywhere, downloads nothing by default and stays small.

Checks the stored notebooks in notebooks/ as files (no kernel): the Colab
badge and setup cell come first, the default path downloads nothing, the
stored outputs are the small, clean ones nbval checks, and the metadata
carries no per-machine churn.
"""

import ast
import json
import pathlib
import re

import nbformat
import pytest
from IPython.core.inputtransformer2 import TransformerManager

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
REPOSITORY = "training-lab/training-lab"  # owner/name on GitHub, as the badges use it

MAX_NOTEBOOK_BYTES = 200_000
MAX_OUTPUT_BYTES = 100_000
NBVAL_TAGS = {"nbval-ignore-output", "nbval-skip", "nbval-check-output", "raises-exception",
              "nbval-raises-exception"}

# Calls and commands that fetch data or code from the network.
DOWNLOAD_CALLS = re.compile(
    r"(^|\.)(urlretrieve|urlopen|get_file|load_data|fetch_\w+|tfds\.load|"
    r"requests\.(get|post)|httpx\.(get|stream)|hf_hub_download|snapshot_download)$")
DOWNLOAD_COMMANDS = re.compile(r"\b(pip|wget|curl|git\s+clone|gsutil|gdown|kaggle)\b")


def _python(cell):
    """The cell's source as Python: IPython magics and `!` commands become calls."""
    return TransformerManager().transform_cell(cell.source)


def _is_colab_guard(node):
    """`if "google.colab" in sys.modules:`"""
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
            and isinstance(node.test.left, ast.Constant) and node.test.left.value == "google.colab"
            and len(node.test.ops) == 1 and isinstance(node.test.ops[0], ast.In)
            and ast.unparse(node.test.comparators[0]) == "sys.modules")


def _dotted(node):
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _dotted(node.value)
        return f"{inner}.{node.attr}" if inner else node.attr
    if isinstance(node, ast.Call):
        return _dotted(node.func) + "()"
    return ""


def _downloads(tree):
    """What in `tree` would reach the network: dotted call names and shell/magic commands."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        if DOWNLOAD_CALLS.search(name):
            found.append(name)
        if name.endswith(("run_line_magic", "run_cell_magic", "system", "getoutput")):
            command = " ".join(a.value for a in node.args
                               if isinstance(a, ast.Constant) and isinstance(a.value, str))
            if DOWNLOAD_COMMANDS.search(command):
                found.append(command)
    return found


def _code_cells(notebook):
    return [cell for cell in notebook.cells if cell.cell_type == "code"]


@pytest.fixture(params=NOTEBOOKS, ids=lambda path: path.name)
def notebook_path(request):
    return request.param


@pytest.fixture
def notebook(notebook_path):
    return nbformat.read(notebook_path, as_version=4)


def test_there_are_tutorials():
    assert NOTEBOOKS, "notebooks/ holds no .ipynb"


def test_is_valid_nbformat(notebook):
    nbformat.validate(notebook)


def test_opens_with_a_colab_badge_for_this_notebook(notebook, notebook_path):
    first = notebook.cells[0]
    assert first.cell_type == "markdown", "the first cell should be the Colab badge (markdown)"
    url = (f"https://colab.research.google.com/github/{REPOSITORY}/blob/main/"
           f"notebooks/{notebook_path.name}")
    assert "colab-badge.svg" in first.source and f"({url})" in first.source, (
        f"the first cell should link the Colab badge to {url}")


def test_first_code_cell_sets_up_colab_and_nothing_else(notebook):
    setup = _code_cells(notebook)[0]
    tree = ast.parse(_python(setup))
    guards = [node for node in tree.body if _is_colab_guard(node)]
    assert len(guards) == 1, 'the first code cell should hold one `if "google.colab" in sys.modules:`'
    others = [node for node in tree.body if node is not guards[0]]
    assert all(isinstance(node, (ast.Import, ast.ImportFrom)) for node in others), (
        "outside the Colab branch, the setup cell should only import")
    inside = ast.unparse(guards[0])
    assert "enable_custom_widget_manager()" in inside, (
        "on Colab, plotly's FigureWidget needs output.enable_custom_widget_manager()")
    assert re.search(r"pip.*install.*git\+https://github\.com/" + re.escape(REPOSITORY), inside), (
        f"on Colab, the setup cell should install the lab from github.com/{REPOSITORY}")


def test_downloads_nothing_outside_the_colab_branch(notebook):
    for index, cell in enumerate(_code_cells(notebook)):
        tree = ast.parse(_python(cell))
        tree.body = [node for node in tree.body if not _is_colab_guard(node)]
        assert not _downloads(tree), f"code cell {index} downloads: {_downloads(tree)}"


def test_download_check_would_notice_a_download():
    cell = nbformat.v4.new_code_cell(
        "import keras\n!wget https://example.org/x.npz\n"
        "(x, y), _ = keras.datasets.mnist.load_data()")
    found = _downloads(ast.parse(_python(cell)))
    assert any("wget" in f for f in found) and any("load_data" in f for f in found)


def test_every_code_cell_ran_once_in_order(notebook):
    counts = [cell.execution_count for cell in _code_cells(notebook)]
    assert counts == list(range(1, len(counts) + 1)), (
        f"execution counts {counts}: store outputs from one top-to-bottom run "
        "(nbval does not check the outputs of a cell that never ran); "
        "see tests/notebooks/refresh_outputs.py")


def test_stored_outputs_hold_no_error_and_no_stderr(notebook):
    for index, cell in enumerate(_code_cells(notebook)):
        for output in cell.outputs:
            assert output.output_type != "error", f"code cell {index} stores an error"
            assert not (output.output_type == "stream" and output.name == "stderr"), (
                f"code cell {index} stores stderr: {output.text[:200]!r}")


def test_stored_outputs_are_small_and_hold_no_widget_state(notebook, notebook_path):
    size = notebook_path.stat().st_size
    assert size <= MAX_NOTEBOOK_BYTES, f"{notebook_path.name} weighs {size:,} bytes"
    assert "widgets" not in notebook.metadata, "widget state is stored (it embeds plotly.js)"
    for index, cell in enumerate(_code_cells(notebook)):
        for output in cell.outputs:
            text = json.dumps(output)
            assert len(text) <= MAX_OUTPUT_BYTES, f"code cell {index} has a {len(text):,}-byte output"
            assert "application/vnd.jupyter.widget-state+json" not in output.get("data", {})


def test_stored_outputs_name_no_local_paths(notebook):
    local = [str(path) for path in (ROOT, pathlib.Path.home()) if len(path.parts) > 1]
    for index, cell in enumerate(_code_cells(notebook)):
        text = json.dumps(cell.outputs)
        assert not [p for p in local if p in text], f"code cell {index} output names a local path"


def test_metadata_holds_only_the_kernel(notebook):
    assert set(notebook.metadata) <= {"kernelspec", "language_info"}, set(notebook.metadata)
    assert notebook.metadata["kernelspec"]["name"] == "python3"
    assert dict(notebook.metadata.get("language_info", {})) in ({}, {"name": "python"}), (
        "language_info carries the Python version of whoever ran it last")
    for index, cell in enumerate(notebook.cells):
        assert set(cell.metadata) <= {"tags"}, f"cell {index} metadata {dict(cell.metadata)}"
        unknown = set(cell.metadata.get("tags", ())) - NBVAL_TAGS
        assert not unknown, f"cell {index} has tags {unknown}"


def test_nbval_markers_stand_alone_on_their_line(notebook):
    for index, cell in enumerate(_code_cells(notebook)):
        for line in cell.source.splitlines():
            if "NBVAL_" in line:
                assert re.fullmatch(r"\s*# NBVAL_[A-Z_]+\s*", line), (
                    f"code cell {index}: nbval ignores a marker with anything else on its line: {line!r}")
