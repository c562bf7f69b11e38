"""widgets.RunCompare: runs overlaid per column, checked on the figure's traces."""

import numpy as np
import pytest

import lab
import widgets
from widgets.run_compare import RunCompare


def made_run(name, losses, grad=None, val=None):
    run = lab.Run(name)
    n = len(losses)
    columns = {"epoch": [0] * n, "batch": list(range(n)), "mode": ["graph"] * n,
               "loss": np.array(losses, np.float32)}
    if grad is not None:
        columns["grad_norm"] = np.array(grad, np.float32)
    run.append_batches(columns)
    if val is not None:
        run.append_epoch(0, {"loss": float(np.mean(losses)), "val_loss": val})
    return run


@pytest.fixture
def view():
    fast = made_run("lr=0.1", [1.0, 0.5, 0.25, 0.125], grad=[4.0, 2.0, 1.0, 0.5], val=0.3)
    slow = made_run("lr=0.01", [1.0, 0.9, 0.8])
    return RunCompare([fast, slow])


def test_one_line_per_run_with_each_runs_loss(view):
    lines = view.lines()
    assert [t.name for t in lines] == ["lr=0.1", "lr=0.01"]
    assert list(lines[0].x) == [0, 1, 2, 3] and list(lines[0].y) == [1.0, 0.5, 0.25, 0.125]
    assert list(lines[1].x) == [0, 1, 2]
    np.testing.assert_allclose(lines[1].y, [1.0, 0.9, 0.8], rtol=1e-6)
    assert view.figure.layout.yaxis.title.text == "loss"


def test_validation_markers_sit_at_the_step_that_ended_the_epoch(view):
    fast_val, slow_val = view.validation()
    assert list(fast_val.x) == [3] and list(fast_val.y) == pytest.approx([0.3])
    assert len(slow_val.x) == 0


def test_the_dropdown_switches_every_run_to_gradient_norms_on_a_log_axis(view):
    assert view.column.options == ("loss", "grad_norm")
    view.column.value = "grad_norm"
    fast, slow = view.lines()
    assert list(fast.y) == [4.0, 2.0, 1.0, 0.5]
    assert len(slow.y) == 0 and slow.name == "lr=0.01 (not recorded)"
    assert view.figure.layout.yaxis.type == "log"
    assert view.figure.layout.yaxis.title.text == "grad_norm"
    view.column.value = "loss"
    assert view.lines()[1].name == "lr=0.01" and view.figure.layout.yaxis.type == "linear"


def test_long_runs_are_drawn_with_bounded_points_as_float32_buffers():
    rng = np.random.default_rng(0)
    loss = rng.random(20_000).astype(np.float32)
    loss[12_345] = 9.0
    view = RunCompare({"long": made_run("a", loss), "short": made_run("b", [1.0])}, max_points=500)
    long_line = view.lines()[0]
    assert len(long_line.y) <= 500 and max(long_line.y) == 9.0
    # Binary buffers, not JSON lists, travel to the browser.
    state = long_line.to_plotly_json()
    assert state["y"].dtype == np.float32


def test_it_is_a_displayable_widget_and_reads_saved_runs(tmp_path):
    path = made_run("saved", [2.0, 1.0]).save(tmp_path / "saved.h5")
    view = widgets.RunCompare([path, made_run("live", [3.0])])
    bundle = view._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert [t.name for t in view.lines()] == ["saved", "live"]


def test_bad_input_names_the_problem():
    with pytest.raises(ValueError, match="accuracy.*choose one of.*loss"):
        RunCompare([made_run("a", [1.0])], column="accuracy")
    with pytest.raises(ValueError, match="at least one"):
        RunCompare([])
    with pytest.raises(ValueError, match="at least one recorded batch"):
        RunCompare([lab.Run("empty")])


def gan_run(name, d_loss):
    """A run as a two-optimizer GAN records it: d_loss and g_loss, no loss, per-optimizer bookkeeping."""
    run = lab.Run(name)
    n = len(d_loss)
    run.append_batches({"epoch": [0] * n, "batch": list(range(n)), "mode": ["graph"] * n,
                        "d_loss": np.array(d_loss, np.float32), "g_loss": np.full(n, 0.5, np.float32),
                        "updated": np.ones(n, np.float32), "updated/d_optimizer": np.ones(n, np.float32),
                        "updated/g_optimizer": np.ones(n, np.float32),
                        "applies/d_optimizer": np.full(n, 2.0, np.float32),
                        "learning_rate/d_optimizer": np.full(n, 1e-3, np.float32)})
    return run


def test_runs_without_a_loss_open_on_their_first_metric_and_offer_no_bookkeeping():
    view = RunCompare([gan_run("a", [0.7, 0.6]), gan_run("b", [0.8])])
    assert view.column.value == "d_loss"
    assert [list(t.y) for t in view.lines()] == [pytest.approx([0.7, 0.6]), pytest.approx([0.8])]
    # A learning rate is worth comparing; whether an optimizer updated is bookkeeping.
    assert view.column.options == ("d_loss", "g_loss", "learning_rate/d_optimizer")
    mixed = RunCompare({"gan": gan_run("a", [0.7]), "mlp": made_run("m", [1.0, 0.5])})
    assert mixed.column.value == "loss"
    assert [t.name for t in mixed.lines()] == ["gan (not recorded)", "mlp"]
    with pytest.raises(ValueError, match="'loss'.*choose one of"):
        RunCompare([gan_run("a", [0.7])], column="loss")  # asked for by name: still refused


def test_a_run_without_rows_keeps_its_legend_entry():
    view = RunCompare([lab.Run("empty"), made_run("a", [1.0, 0.5])])
    assert [t.name for t in view.lines()] == ["empty (no rows)", "a"]
    assert len(view.lines()[0].y) == 0 and list(view.lines()[1].y) == [1.0, 0.5]
    page = RunCompare([lab.Run("empty"), made_run("a", [1.0])], view="html").chart_html.value
    assert "Not drawn: empty (no rows)" in page  # the SVG legend holds only what is drawn


def test_max_points_is_checked_when_the_comparison_is_made():
    for bad in (3, 0, 2.5, True):
        with pytest.raises((TypeError, ValueError), match=r"RunCompare\(max_points=\.\.\.\).*8 or more"):
            RunCompare([made_run("a", [1.0] * 20)], max_points=bad)


def test_the_same_model_built_again_shares_its_per_layer_columns_and_the_view_says_so():
    def run_of(name, layers, scale):
        run = lab.Run(name)
        columns = {"epoch": [0, 0], "batch": [0, 1], "mode": ["graph"] * 2, "loss": np.array([1.0, 0.5], np.float32)}
        for i, layer in enumerate(layers):
            columns[f"grad_norm/{layer}/kernel"] = np.array([scale * (i + 1)] * 2, np.float32)
        run.append_batches(columns)
        return run

    first = run_of("first", ["sequential/dense", "sequential/dense_1"], 1.0)
    again = run_of("again", ["sequential_1/dense_9", "sequential_1/dense_10"], 10.0)  # "dense_10" sorts first
    view = RunCompare([first, again])
    grads = [c for c in view.column.options if c.startswith("grad_norm/")]
    assert grads == ["grad_norm/sequential/dense/kernel", "grad_norm/sequential/dense_1/kernel"]
    view.column.value = "grad_norm/sequential/dense_1/kernel"
    assert [list(line.y) for line in view.lines()] == [[2.0, 2.0], [20.0, 20.0]]
    assert "<b>again</b> are shown under <b>first</b>'s names" in view.note.value and view.note in view.children
    assert RunCompare([first, run_of("other", ["sequential_1/conv2d"], 1.0)]).note.value == ""
