"""The HTML live view: chosen by front end when training begins, bounded, throttled, true to the run."""

import re
import subprocess
import sys
import types

import numpy as np
import pytest

import widgets
from widgets.html_view import HtmlView, html_page
from widgets.series import ChartState, chart_data
from widgets.views import choose_view, frontend

# One refresh of the HTML view, whatever the run's length (2 layers of gradients here: about 22 kB).
PAGE_BOUND = 40_000


def polyline(page, name):
    """(number of points, data-last) of the line drawn for series `name`."""
    match = re.search(rf'<polyline data-name="{re.escape(name)}" data-last="([^"]+)"[^>]* points="([^"]*)"', page)
    assert match, f"no line {name!r} in the page"
    return len(match.group(2).split()), float(match.group(1))


# ---- the choice ------------------------------------------------------------------


def test_the_view_follows_the_front_end_when_asked_not_at_import(plain_jupyter):
    assert frontend() == "jupyter" and choose_view("auto") == "plotly"
    plain_jupyter.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    assert frontend() == "colab" and choose_view("auto") == "html"
    plain_jupyter.delitem(sys.modules, "google.colab")
    plain_jupyter.setenv("VSCODE_PID", "4242")
    assert frontend() == "vscode" and choose_view("auto") == "html"
    plain_jupyter.delenv("VSCODE_PID")
    plain_jupyter.setenv("VSCODE_CWD", "/home/me")
    assert choose_view("auto") == "html"
    plain_jupyter.delenv("VSCODE_CWD")
    assert choose_view("auto") == "plotly"
    # Asked for by name, the front end does not matter; the environment variable overrides "auto" only.
    plain_jupyter.setenv("TRAINING_LAB_VIEW", "html")
    assert choose_view("auto") == "html" and choose_view("plotly") == "plotly"


def test_importing_widgets_decides_nothing():
    code = ("import sys, widgets, widgets.views; "
            "assert 'IPython' not in sys.modules and 'plotly' not in sys.modules, sorted(sys.modules); "
            "import widgets.views as v; assert not [k for k, x in vars(v).items() if x in ('html', 'plotly')]")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_a_bad_view_names_the_allowed_ones():
    with pytest.raises(ValueError, match="'auto', 'plotly', 'html'; got 'svg'"):
        widgets.Dashboard(view="svg")
    with pytest.raises(ValueError, match="'auto', 'plotly', 'html'"):
        choose_view("HTML")


def test_a_dashboard_built_before_colab_is_seen_draws_html_when_training_begins(
        plain_jupyter, digits, make_model, notebook):
    (x, y), _ = digits
    dashboard = widgets.Dashboard(gradients=False)  # auto: nothing decided yet
    assert dashboard.live_view is None
    plain_jupyter.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    make_model().fit(x, y, epochs=1, batch_size=64, callbacks=[dashboard], verbose=0)
    assert dashboard.live_view.kind == "html"
    controls, page = notebook  # the smoothing control, then the charts' page
    assert controls.shown[0]["application/vnd.jupyter.widget-view+json"]["model_id"] == \
        dashboard.smoothing_controls.model_id
    shown = page.shown
    assert all("application/vnd.jupyter.widget-view+json" not in b for b in shown)  # no widget front end needed
    assert "<svg" in shown[-1]["text/html"] and "Dashboard (finished)" in shown[-1]["text/plain"]


# ---- the Dashboard's HTML view -----------------------------------------------------


def test_view_html_updates_one_output_in_place_and_ends_on_the_run(digits, make_model, notebook, comm_log):
    (x, y), validation = digits
    model = make_model()
    dashboard = widgets.Dashboard(gradients=True, view="html", refresh_every=0)
    assert dashboard.chart is None  # no plotly figure is built for the HTML view
    model.fit(x, y, epochs=2, batch_size=32, validation_data=validation, callbacks=[dashboard], verbose=0)
    # One output for the charts, displayed once with a display id (the smoothing control has its own).
    assert len(notebook) == 2 and len(notebook[0].shown) == 1
    shown = notebook[1].shown
    assert len(shown) >= 3  # updated in place while training ran
    running = [b["text/html"] for b in shown if "running" in b["text/html"]]
    assert running and "epoch" in running[-1]
    final = shown[-1]["text/html"]
    run = dashboard.run.batches()
    points, last = polyline(final, "loss")
    assert points == len(run) == 20
    assert last == pytest.approx(float(run["loss"].iloc[-1]), rel=1e-6)
    points, last = polyline(final, "accuracy")
    assert points == 20 and last == pytest.approx(float(run["accuracy"].iloc[-1]), rel=1e-6)
    assert "(finished), 20 steps" in final and "steps/s" not in final  # no timings in the final page
    assert final.count("<svg") == 4  # loss, metrics, gradient norms, heatmap
    assert "<script" not in final


def test_inside_a_container_the_html_view_draws_into_its_widget(digits, make_model):
    (x, y), _ = digits
    received = []
    dashboard = widgets.Dashboard(gradients=False, view="html", refresh_every=0).show_inside(received.append)
    make_model().fit(x, y, epochs=1, batch_size=64, callbacks=[dashboard], verbose=0)
    assert dashboard.widget.children == (dashboard.smoothing_controls, dashboard.chart_html)
    assert polyline(dashboard.chart_html.value, "loss")[0] == len(dashboard.run) == 5
    assert "widget-view" not in " ".join(received[0]) and "<svg" in received[0]["text/html"]


def test_the_lab_panel_charts_through_the_html_view(plain_jupyter, digits, make_model):
    plain_jupyter.setenv("VSCODE_PID", "4242")
    (x, y), _ = digits
    panel = widgets.Lab(make_model(), (x, y), batch_size=64, epochs=1, breakpoints=())
    panel.start()
    assert panel.wait(120) and panel.state == "finished"
    chart = panel.tabs.children[0]
    assert chart is panel.dashboard.widget
    assert chart.children == (panel.dashboard.smoothing_controls, panel.dashboard.chart_html)
    assert polyline(panel.dashboard.chart_html.value, "loss")[0] == len(panel.run) == 5
    assert widgets.Lab(make_model(), (x, y), view="html", breakpoints=()).dashboard.chart is None
    with pytest.raises(ValueError, match="'auto', 'plotly', 'html'"):
        widgets.Lab(make_model(), (x, y), view="svg")


# ---- the view itself ---------------------------------------------------------------


@pytest.mark.parametrize("steps", [1_000, 10_000, 100_000, 1_000_000])
def test_one_refresh_has_a_bounded_payload_at_any_run_length(make_run, fake_handle, steps):
    run = make_run(steps)
    run.append_epoch(0, {"loss": 1.0, "val_loss": 1.1})
    view = HtmlView(update_every=0)
    handle = fake_handle
    view.handles.append(handle)
    assert view.send(ChartState(run).update(), "<b>running</b>")
    page = handle.shown[-1]["text/html"]
    assert len(page.encode()) < PAGE_BOUND
    points, last = polyline(page, "loss")
    assert points <= 410
    # The line ends on a value of the run's last few rows (a long run is drawn by min/max buckets).
    tail = run.column("loss")[-max(1, steps // 100):]
    assert np.isclose(tail, last, rtol=1e-6).any()


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_updates_are_throttled_and_the_final_one_always_goes(make_run):
    run = make_run(50)
    clock = Clock()
    view = HtmlView(widget=types.SimpleNamespace(value=""), update_every=0.25, clock=clock)
    sent = 0
    for i in range(100):  # a refresh every 10 ms for a second
        clock.now = i * 0.01
        sent += view.send(chart_data(run), f"step {i}")
    assert 4 <= sent <= 5 and view.updates == sent
    clock.now += 0.001
    assert view.send(chart_data(run), "finished", final=True)  # too soon, but final
    assert "finished" in view.widget.value and view.updates == sent + 1


def test_the_page_is_a_pure_function_of_the_data(make_run):
    data = chart_data(make_run(30))
    page = html_page(data, "<b>finished</b>")
    assert page == html_page(data, "<b>finished</b>")
    assert page.startswith('<div class="training-lab-dashboard') and "<b>finished</b>" in page
    assert polyline(page, "loss")[0] == 30
    np.testing.assert_allclose(polyline(page, "loss")[1], data.loss[0].y[-1], rtol=1e-6)


def test_run_compare_draws_its_overlay_as_html(make_run):
    fast, slow = make_run(40, seed=0), make_run(25, seed=1)
    fast.name, slow.name = "fast", "slow"
    view = widgets.RunCompare([fast, slow], view="html")
    assert view.figure is None and view.children == (view.column, view.chart_html)
    page = view.chart_html.value
    assert polyline(page, "fast")[0] == 40 and polyline(page, "slow")[0] == 25
    view.column.value = "grad_norm/m/dense/kernel"
    assert "grad_norm/m/dense/kernel" in view.chart_html.value
    assert polyline(view.chart_html.value, "fast")[1] == pytest.approx(
        float(fast.column("grad_norm/m/dense/kernel")[-1]), rel=1e-6)
    with pytest.raises(ValueError, match="'auto', 'plotly', 'html'"):
        widgets.RunCompare([fast], view="svg")


def test_a_status_change_shows_at_once_in_the_html_view(digits, make_model, notebook):
    import lab

    (x, y), _ = digits
    at_step_5 = lab.Breakpoint(lambda row: row["step"] >= 5, name="step 5")
    dashboard = widgets.Dashboard(gradients=False, view="html", breakpoints=[at_step_5], refresh_every=60)
    make_model().fit(x, y, epochs=2, batch_size=32, callbacks=[dashboard], verbose=0)
    pages = [b["text/html"] for b in notebook[-1].shown]
    # Throttled to one update a minute, yet the hit and the stop each showed when they happened.
    assert any("breakpoint" in p and "step 5 at step 5" in p for p in pages)
    assert "(stopped: step 5 at step 5), 6 steps" in pages[-1]
    assert polyline(pages[-1], "loss")[0] == 6


def test_the_live_heatmap_is_one_png_of_a_pixel_per_cell_in_the_colors_of_the_static_one(make_run):
    import base64
    import struct
    import zlib

    from widgets import static

    data = chart_data(make_run(300), heatmap_bins=50)
    page = html_page(data)
    assert page.count("<image") == 1 and "<rect" not in page.split("log10 gradient norm")[1]
    encoded = re.search(r'href="data:image/png;base64,([^"]+)"', page).group(1)
    png = base64.b64decode(encoded)
    width, height = struct.unpack(">II", png[16:24])
    columns = np.unique(data.heatmap.x)
    assert (height, width) == (len(data.heatmap.layers), len(columns))
    # Unfiltered RGB rows (as widgets.png writes them): compare each pixel with the vector form's fill.
    start = png.index(b"IDAT") + 4
    length = struct.unpack(">I", png[start - 8:start - 4])[0]
    raw = zlib.decompress(png[start:start + length])
    pixels = np.frombuffer(raw, np.uint8).reshape(height, 1 + 3 * width)[:, 1:].reshape(height, width, 3)
    vector = static.heatmap_chart(data.heatmap, "h")
    fills = re.findall(r'<rect x="[^"]+" y="[^"]+" width="[^"]+" height="[^"]+" fill="#([0-9a-f]{6})"', vector)
    for (x, y), fill in zip(zip(data.heatmap.x, data.heatmap.y), fills):
        r, g, b = pixels[int(y), int(np.searchsorted(columns, x))]
        assert f"{r:02x}{g:02x}{b:02x}" == fill
