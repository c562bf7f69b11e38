"""The quickstart in a JupyterLab without anywidget, with the HTML view.

The server of this module has the `anywidget` JupyterLab extension disabled
in its own settings (`jupyter labextension disable --level=user anywidget`
with the test's JUPYTER_CONFIG_DIR), so plotly's FigureWidget cannot render
there, as on Colab or in a VS Code without anywidget. It serves a copy of the
quickstart whose Dashboard is `widgets.Dashboard(gradients=True,
view="html")`, with one cell added at the end that prints what the kernel
recorded (`dash.run.batches()`'s steps and losses) as JSON.

The test runs all cells in the page, samples the HTML view's loss line (the
raw per-batch SVG polyline, drawn faint under its smoothed one) at 4 Hz while `fit()` runs,
and checks from the page alone: the extension is off, no plotly chart
appeared, the line gained points during the run and never lost any, and the
final line is the kernel's run: one point per batch, x proportional to the
step and y to the batch's own loss (a least-squares fit of the drawn pixels
to the kernel's numbers leaves no more than the SVG's rounding). And as a
reader sees it: the smoothing control above the charts, on; the loss and the
metrics on charts of their own, each with its legend naming its own lines,
in different colours.
"""

import json

import nbformat
import numpy as np
import pytest

NOTEBOOK = "01_quickstart.ipynb"
DASHBOARD = "widgets.Dashboard(gradients=True)"
HTML_DASHBOARD = 'widgets.Dashboard(gradients=True, view="html")'
MARK = "TRAINING_LAB_RUN "
PIXEL_ROUNDING = 0.06  # the SVG writes coordinates with one decimal

CHECK_CELL = f"""\
# Added by the browser test: what the kernel recorded, for the page to compare with.
import json
_batches = dash.run.batches()
print({MARK!r} + json.dumps({{"step": [int(s) for s in _batches["step"]],
                              "loss": [float(v) for v in _batches["loss"]]}}))
"""

# The raw loss line of the newest HTML view (its first chart's polyline
# named "loss"). Its points, as [x, y] pixels.
LOSS_LINE_JS = """
function lossLine() {
    const views = document.querySelectorAll('.training-lab-html-view');
    const view = views.length ? views[views.length - 1] : null;
    const svg = view ? view.querySelector('svg') : null;
    if (!svg) return {view: view, points: null};
    const line = svg.querySelector('polyline[data-name="loss"]');
    const points = line ? line.getAttribute('points').trim().split(/\\s+/).map(p => p.split(',').map(Number)) : [];
    return {view: view, points: points};
}
"""

# Each chart of the newest HTML view: its title, its legend's names, the
# stroke of each named line; and the smoothing control above the view.
CHARTS_JS = """() => {
    const views = document.querySelectorAll('.training-lab-html-view');
    const view = views[views.length - 1];
    const charts = [...view.querySelectorAll('svg')].map(svg => {
        const texts = [...svg.querySelectorAll('text')];
        return {
            title: texts[0].textContent,
            legend: texts.filter(t => t.getAttribute('font-size') === '10' && t.previousElementSibling &&
                                      ['rect', 'circle'].includes(t.previousElementSibling.tagName)).map(t => t.textContent),
            strokes: Object.fromEntries([...svg.querySelectorAll('polyline[data-name]')].map(
                p => [p.getAttribute('data-name'), p.getAttribute('stroke')])),
        };
    });
    const control = document.querySelector('.training-lab-smoothing');
    return {charts: charts, control: control ? {
        text: control.textContent, checked: control.querySelector('input[type=checkbox]').checked,
        above: control.getBoundingClientRect().bottom <= view.getBoundingClientRect().top} : null};
}"""

SAMPLE_JS = """([mark]) => {
    %s
    const {view, points} = lossLine();
    if (view) view.scrollIntoView({block: 'center'});
    const indicator = document.querySelector('.jp-Notebook-ExecutionIndicator');
    const outputs = [...document.querySelectorAll('.jp-OutputArea-output')];
    const errors = outputs.filter(o => o.getAttribute('data-mime-type') === 'application/vnd.jupyter.stderr')
        .map(o => o.textContent).filter(t => /Error|Traceback/.test(t));
    const check = outputs.map(o => o.textContent).find(t => t.includes(mark));
    const dialog = document.querySelector('.jp-Dialog');
    return {
        views: document.querySelectorAll('.training-lab-html-view').length,
        text: view ? view.textContent.slice(0, 200) : null,
        points: points ? points.length : null,
        plotly: document.querySelectorAll('.js-plotly-plot').length,
        status: indicator ? indicator.getAttribute('data-status') : null,
        check: check ? check.slice(check.indexOf(mark) + mark.length) : null,
        done: !!check,
        errors: errors,
        dialog: dialog ? dialog.textContent : null,
    };
}""" % LOSS_LINE_JS

FINAL_LINE_JS = "() => { %s return lossLine().points; }" % LOSS_LINE_JS

DISABLED_JS = """() => JSON.parse(document.getElementById('jupyter-config-data').textContent).disabledExtensions"""


def _html_view_copy(name, notebook):
    if name != NOTEBOOK:
        return
    cells = [cell for cell in notebook.cells if cell.cell_type == "code" and DASHBOARD in cell.source]
    assert len(cells) == 1, f"the quickstart no longer has one {DASHBOARD!r} cell"
    cells[0].source = cells[0].source.replace(DASHBOARD, HTML_DASHBOARD)
    notebook.cells.append(nbformat.v4.new_code_cell(CHECK_CELL))


def _disable_anywidget(server):
    server.jupyter("labextension", "disable", "--level=user", "anywidget")


@pytest.fixture(scope="module")
def lab_server(start_server):
    """JupyterLab without the anywidget extension, serving the HTML-view quickstart."""
    return start_server(app="lab", edit=_html_view_copy, configure=_disable_anywidget)


def _residual(pixels, values):
    """Largest distance of `pixels` from the best affine map of `values`, and its slope."""
    a = np.vstack([np.asarray(values, np.float64), np.ones(len(values))]).T
    (slope, offset), *_ = np.linalg.lstsq(a, np.asarray(pixels, np.float64), rcond=None)
    return float(np.max(np.abs(a @ [slope, offset] - pixels))), float(slope)


@pytest.mark.browser
def test_html_view_draws_the_quickstarts_loss_live_without_anywidget_and_ends_with_the_kernels_run(
        page, open_notebook, run_and_sample, artifacts):
    open_notebook(NOTEBOOK)
    disabled = page.evaluate(DISABLED_JS)
    assert "anywidget" in disabled, f"anywidget is not disabled in the test's JupyterLab: {disabled}"
    samples = []
    try:
        samples = run_and_sample(SAMPLE_JS, [MARK])
    finally:
        page.screenshot(path=str(artifacts / "html-view-quickstart.png"))
        (artifacts / "html-view-samples.json").write_text(json.dumps(
            [{k: v for k, v in s.items() if k != "check"} for s in samples], indent=0))

    done = samples[-1]
    assert not any(s["plotly"] for s in samples), "a plotly chart appeared: the HTML view was not used"
    samples = [s for s in samples if s["text"] is not None]
    assert samples, "the HTML view never appeared in the page"
    counts = [s["points"] for s in samples if s["points"] is not None]
    assert counts, "the HTML view never drew a loss line"
    assert counts == sorted(counts), f"the loss line lost points while training: {counts}"

    kernel = json.loads(done["check"])
    steps = len(kernel["step"])
    assert steps == 360, f"the kernel recorded {steps} batches; the quickstart runs 8 x 45"
    # Live: while its status line read "running", the page showed part of the run.
    running = [s["points"] for s in samples if s["text"].startswith("running") and s["points"]]
    assert any(0 < n < steps for n in running), (
        f"the loss line never showed a partial run while training; point counts seen: {sorted(set(counts))}")

    # The final picture is the kernel's run: a point per batch (360 is under
    # the view's per-line limit, so nothing is downsampled), x an increasing
    # affine map of the step, y a decreasing one of the loss (SVG y grows down).
    final = page.evaluate(FINAL_LINE_JS)
    assert len(final) == steps, f"the final loss line has {len(final)} points for {steps} batches"
    x_off, x_slope = _residual([p[0] for p in final], kernel["step"])
    y_off, y_slope = _residual([p[1] for p in final], kernel["loss"])
    assert x_slope > 0 and x_off <= PIXEL_ROUNDING, (
        f"the line's x pixels are not the kernel's steps (off by up to {x_off:.2f} px)")
    assert y_slope < 0 and y_off <= PIXEL_ROUNDING, (
        f"the line's y pixels are not the kernel's losses (off by up to {y_off:.2f} px)")

    look = page.evaluate(CHARTS_JS)
    control = look["control"]
    assert control and control["checked"] and "smooth" in control["text"] and control["above"], control
    loss, metrics = look["charts"][:2]
    assert loss["title"].startswith("loss per batch") and metrics["title"].startswith("metrics per batch"), look
    assert loss["legend"] == ["loss (smoothed)", "val_loss"], loss
    assert metrics["legend"] == ["accuracy (smoothed)", "val_accuracy"], metrics
    assert loss["strokes"]["loss"] == loss["strokes"]["loss (smoothed)"] != metrics["strokes"]["accuracy (smoothed)"]
