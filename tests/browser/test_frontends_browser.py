"""The quickstart in other front ends: Notebook 7 with the plotly view.

Notebook 7 gets a server of its own for this module (conftest's
`start_server`), serving a copy of the quickstart with one cell added at the end that prints what the kernel
recorded (`dash.run.batches()`'s steps and losses) as JSON. The test runs all
cells in the page, samples the Dashboard's loss chart at 4 Hz while `fit()`
runs, and checks, from the page alone: the chart gained points during the
run, never lost any, and when the run ended it held exactly the kernel's
steps and losses. Then, as a reader sees it: the smoothing control is there
and on, each row's legend sits beside its own row, loss and accuracy are in
different colours, and unticking "smooth" takes the smoothed lines away.

It also photographs the Dashboard while it trains (artifacts/
dashboard-running.png); with TRAINING_LAB_SCREENSHOT=docs/dashboard.png
(`make screenshot`) that picture, cropped to the Dashboard and compressed,
becomes the README's.
"""

import json
import os
import pathlib

import nbformat
import pytest

NOTEBOOK = "01_quickstart.ipynb"
MARK = "TRAINING_LAB_RUN "
SCREENSHOT_ENV = "TRAINING_LAB_SCREENSHOT"
SCREENSHOT_MIN_POINTS = 100  # of the quickstart's 360: the run well under way
SCREENSHOT_MAX_BYTES = 200_000
VIEWPORT = {"width": 1280, "height": 1800}

CHECK_CELL = f"""\
# Added by the browser test: what the kernel recorded, for the page to compare with.
import json
_batches = dash.run.batches()
print({MARK!r} + json.dumps({{"step": [int(s) for s in _batches["step"]],
                              "loss": [float(v) for v in _batches["loss"]]}}))
"""


# The part of the page the Dashboard draws on: its output, cut at the right
# edge of its status line and charts (the output spans the whole cell).
DASHBOARD_BOX_JS = """() => {
    const output = document.querySelector('.training-lab-status').closest('.jp-OutputArea-output');
    const box = output.getBoundingClientRect();
    const parts = [...output.querySelectorAll('.js-plotly-plot .main-svg, svg.training-lab-chart')];
    const right = Math.max(...parts.map(p => p.getBoundingClientRect().right));
    return {x: box.left, y: box.top, width: Math.min(box.width, right - box.left + 16), height: box.height};
}"""

HEADER_JS = "() => document.querySelector('.training-lab-status').textContent"

# One look at the page: the Dashboard's loss trace (kept in view, as a person
# watching would), its status line, the kernel's state, failures, and the
# check cell's output once it printed.
SAMPLE_JS = """([mark]) => {
    const status = document.querySelector('.training-lab-status');
    const output = status ? status.closest('.jp-OutputArea-output') : null;
    const plot = output ? output.querySelector('.js-plotly-plot') : null;
    if (output) output.scrollIntoView({block: 'center'});
    const trace = plot && plot.data ? plot.data.find(t => t.name === 'loss') : null;
    const names = plot && plot.data ? plot.data.map(t => t.name) : null;
    const indicator = document.querySelector('.jp-Notebook-ExecutionIndicator');
    const outputs = [...document.querySelectorAll('.jp-OutputArea-output')];
    const errors = outputs.filter(o => o.getAttribute('data-mime-type') === 'application/vnd.jupyter.stderr')
        .map(o => o.textContent).filter(t => /Error|Traceback/.test(t));
    const check = outputs.map(o => o.textContent).find(t => t.includes(mark));
    const dialog = document.querySelector('.jp-Dialog');
    return {
        header: status ? status.textContent : null,
        plot: !!plot,
        names: names,
        points: trace && trace.y ? trace.y.length : null,
        draws: window.trainingLabLossDraws ? window.trainingLabLossDraws.slice() : [],
        status: indicator ? indicator.getAttribute('data-status') : null,
        check: check ? check.slice(check.indexOf(mark) + mark.length) : null,
        done: !!check,
        errors: errors,
        dialog: dialog ? dialog.textContent : null,
    };
}"""

# The loss trace as plotly holds it at the end (typed arrays made plain).
FINAL_TRACE_JS = """() => {
    const output = document.querySelector('.training-lab-status').closest('.jp-OutputArea-output');
    const plot = output.querySelector('.js-plotly-plot');
    const trace = plot.data.find(t => t.name === 'loss');
    return {x: Array.from(trace.x, Number), y: Array.from(trace.y, Number),
            drawn: plot.querySelectorAll('.scatterlayer .trace path.js-line').length,
            height: plot.getBoundingClientRect().height};
}"""

# Where each legend entry and each row is drawn, in page pixels, and the
# smoothing control's state.
LOOK_JS = """() => {
    const output = document.querySelector('.training-lab-status').closest('.jp-OutputArea-output');
    const plot = output.querySelector('.js-plotly-plot');
    const box = plot.getBoundingClientRect();
    const layout = plot._fullLayout;
    const rows = {};
    for (const [name, axis] of [['loss', 'yaxis'], ['metrics', 'yaxis2'], ['gradients', 'yaxis3']]) {
        rows[name] = {top: box.top + layout[axis]._offset, bottom: box.top + layout[axis]._offset + layout[axis]._length};
    }
    const plotRight = box.left + layout.xaxis._offset + layout.xaxis._length;
    // Legend n's entries are text.legend<n>text (the first's, text.legendtext).
    const entries = [...plot.querySelectorAll('text[class^="legend"][class$="text"]')].map(t => {
        const r = t.getBoundingClientRect();
        return {name: t.textContent, top: r.top, bottom: r.bottom, left: r.left};
    });
    const color = name => { const t = plot._fullData.find(d => d.name === name); return t ? t.line.color : null; };
    const control = output.querySelector('.training-lab-smoothing');
    const box2 = control ? control.getBoundingClientRect() : null;
    return {
        rows: rows, plotRight: plotRight, entries: entries,
        colors: {loss: color('loss (smoothed)'), accuracy: color('accuracy (smoothed)'), raw: color('loss')},
        rawOpacity: (plot._fullData.find(d => d.name === 'loss') || {}).opacity,
        control: control ? {
            text: control.textContent,
            checked: control.querySelector('input[type=checkbox]').checked,
            slider: !!control.querySelector('.widget-slider, .noUi-target, input[type=range]'),
            visible: box2.width > 0 && box2.height > 0 && box2.bottom <= box.top + 5,
        } : null,
    };
}"""

SMOOTHED_POINTS_JS = """() => {
    const output = document.querySelector('.training-lab-status').closest('.jp-OutputArea-output');
    const plot = output.querySelector('.js-plotly-plot');
    const trace = plot.data.find(t => t.name === 'loss (smoothed)');
    return trace && trace.y ? trace.y.length : null;
}"""


def _assert_reads_at_a_glance(page, steps):
    """The smoothing control, a legend beside each row, loss and accuracy in two colours; untick "smooth"."""
    look = page.evaluate(LOOK_JS)
    control = look["control"]
    assert control and control["visible"] and "smooth" in control["text"] and "weight" in control["text"], control
    assert control["checked"] and control["slider"] and "0.60" in control["text"], control
    rows, entries = look["rows"], {e["name"]: e for e in look["entries"]}
    for name, row in (("loss (smoothed)", "loss"), ("val_loss", "loss"), ("accuracy (smoothed)", "metrics"),
                      ("val_accuracy", "metrics"), ("sequential/dense", "gradients")):
        assert name in entries, f"no legend entry {name!r}; the legends hold {sorted(entries)}"
        entry = entries[name]
        assert rows[row]["top"] - 5 <= entry["top"] and entry["bottom"] <= rows[row]["bottom"] + 5, (
            f"the legend entry {name!r} is not beside the {row} row: {entry} vs {rows}")
        assert entry["left"] > look["plotRight"], f"the legend entry {name!r} overlaps its plot"
    assert "loss" not in entries, "the raw loss line, faint behind the smoothed one, has a legend entry"
    colors = look["colors"]
    assert colors["loss"] and colors["accuracy"] and colors["loss"] != colors["accuracy"], colors
    assert colors["raw"] == colors["loss"] and look["rawOpacity"] < 0.5, look
    assert page.evaluate(SMOOTHED_POINTS_JS) == steps
    page.locator(".training-lab-smoothing input[type=checkbox]").click()
    page.wait_for_function(f"() => ({SMOOTHED_POINTS_JS})() === 0", timeout=30_000)


def _add_check_cell(name, notebook):
    if name == NOTEBOOK:
        notebook.cells.append(nbformat.v4.new_code_cell(CHECK_CELL))


@pytest.fixture(scope="module")
def lab_server(start_server):
    """Notebook 7 serving the quickstart (with the check cell)."""
    return start_server(app="notebook", edit=_add_check_cell)


def _save_readme_screenshot(source, target):
    """The running Dashboard's picture, compressed (a 128-colour palette) for the README."""
    from PIL import Image

    target.parent.mkdir(parents=True, exist_ok=True)
    with Image.open(source) as image:
        image.convert("RGB").quantize(colors=128).save(target, optimize=True)
    size = target.stat().st_size
    assert size < SCREENSHOT_MAX_BYTES, f"{target} is {size} bytes"
    return size


def _photographer(page, screenshot):
    """An on_sample hook that photographs the Dashboard once while it trains,
    to `screenshot`."""
    shot = False

    def on_sample(sample):
        nonlocal shot
        if (shot or not (sample["header"] or "").startswith("running")
                or (sample["points"] or 0) < SCREENSHOT_MIN_POINTS):
            return
        # A clip of the page as it is now: an element screenshot would wait
        # for the chart to stop moving, that is, for the run to end. Kept
        # only if the status line still reads "running" afterwards, so the
        # picture was taken during the run.
        candidate = screenshot.with_suffix(".tmp.png")
        page.screenshot(path=str(candidate), clip=page.evaluate(DASHBOARD_BOX_JS), animations="allow")
        if page.evaluate(HEADER_JS).startswith("running"):
            candidate.replace(screenshot)
            shot = sample["photographed"] = True
        else:
            candidate.unlink()

    return on_sample


@pytest.mark.browser
# This test failed now and then (its reruns passed), the chart seen empty
# while the status line read "running". The cause, found on a cold page
# cache: the samples missed the middle of the quickstart's three seconds of
# training (the page answered one a second while it drew), and the Dashboard,
# paced by each refresh alone, sent nothing for 1.1 s after its first,
# slowest refresh. The test now reads every draw the page recorded, and the
# Dashboard spends its first refreshes ahead (`REFRESH_AHEAD_SECONDS`).
def test_notebook7_draws_the_quickstarts_loss_live_and_ends_with_the_kernels_run(
        page, open_notebook, run_and_sample, assert_drawn_live, artifacts):
    # Tall enough for the whole Dashboard, centred below Notebook 7's header.
    page.set_viewport_size(VIEWPORT)
    console = []
    page.on("console", lambda message: console.append(f"{message.type}: {message.text}"))
    page.on("pageerror", lambda error: console.append(f"pageerror: {error}"))
    open_notebook(NOTEBOOK)
    screenshot = artifacts / "dashboard-running.png"
    screenshot.unlink(missing_ok=True)
    samples = []
    try:
        samples = run_and_sample(SAMPLE_JS, [MARK], on_sample=_photographer(page, screenshot))
    finally:
        page.screenshot(path=str(artifacts / "notebook7-quickstart.png"))
        (artifacts / "notebook7-console.txt").write_text("\n".join(console))

    (artifacts / "notebook7-samples.json").write_text(json.dumps(
        [{k: v for k, v in s.items() if k != "check"} for s in samples], indent=0))
    headers = [s["header"] for s in samples if s["header"]]
    assert any(h.startswith("running") for h in headers), (
        f"the Dashboard's status line never read 'running' during training: {headers[-1:]}")
    assert headers[-1].startswith("finished") and "epoch 8/8" in headers[-1], headers[-1]
    assert any(s["plot"] for s in samples), "the Dashboard's plotly chart never appeared in Notebook 7"
    counts = [s["points"] for s in samples if s["points"] is not None]
    assert counts, ("the loss trace never received a point in the page; trace names seen: "
                    f"{sorted({str(s['names']) for s in samples if s['plot']})} (see notebook7-console.txt)")
    assert counts == sorted(counts), f"the loss trace lost points while training: {counts}"

    kernel = json.loads(samples[-1]["check"])
    final = page.evaluate(FINAL_TRACE_JS)
    steps = len(kernel["step"])
    assert steps == 360, f"the kernel recorded {steps} batches; the quickstart runs 8 x 45"
    # Live: every draw the page recorded (the samples may miss a short run's middle).
    assert_drawn_live(samples[-1]["draws"], steps)
    running = [s["points"] for s in samples if (s["header"] or "").startswith("running") and s["points"]]
    # The final chart is the kernel's run: every step, every batch's own loss.
    assert final["x"] == kernel["step"], "the chart's steps differ from run.batches()['step']"
    worst = max(abs(a - b) / max(abs(b), 1e-6) for a, b in zip(final["y"], kernel["loss"]))
    assert worst < 1e-5, f"the chart's losses differ from run.batches()['loss'] (relative {worst:.2g})"
    assert final["drawn"] >= 1 and final["height"] > 100, final
    _assert_reads_at_a_glance(page, steps)

    if os.environ.get(SCREENSHOT_ENV):
        assert screenshot.exists(), (
            f"no sample caught the Dashboard running with >= {SCREENSHOT_MIN_POINTS} points; "
            f"counts while running: {sorted(set(running))}")
        target = pathlib.Path(os.environ[SCREENSHOT_ENV])
        size = _save_readme_screenshot(screenshot, target)
        print(f"wrote {target} ({size} bytes)")
