"""The quickstart in a real JupyterLab: the Dashboard draws live in the page.

Everything asserted here is read from the page (plotly's own data on the
chart element, the notebook's text), not from Python.
"""

import time

import pytest

NOTEBOOK = "01_quickstart.ipynb"
LAST_OUTPUT = "test accuracy >= 0.9: True"
RUN_SECONDS = 600  # the whole notebook, on a busy 2-core machine
SAMPLE_EVERY = 0.25

# One look at the page: the Dashboard's chart (kept in view, as a person
# watching would), its loss trace's point count, the kernel's state and
# whether the last cell has printed. textContent, unlike innerText, does not
# depend on what is scrolled into view.
SAMPLE_JS = """() => {
    const plots = document.querySelectorAll('.js-plotly-plot');
    const plot = plots[0];
    if (plot) plot.scrollIntoView({block: 'center'});
    const traces = plot && plot.data ? plot.data.length : null;
    const trace = traces ? plot.data[0] : null;
    const indicator = document.querySelector('.jp-Notebook-ExecutionIndicator');
    const outputs = [...document.querySelectorAll('.jp-OutputArea-output')];
    const errors = outputs.filter(o => o.getAttribute('data-mime-type') === 'application/vnd.jupyter.stderr')
        .map(o => o.textContent).filter(t => /Error|Traceback/.test(t));
    const dialog = document.querySelector('.jp-Dialog');
    const header = document.querySelector('.training-lab-status');
    return {
        header: header ? header.textContent : null,
        dialog: dialog ? dialog.textContent : null,
        plots: plots.length,
        traces: traces,
        points: trace && trace.y ? trace.y.length : null,
        draws: window.trainingLabLossDraws ? window.trainingLabLossDraws.slice() : [],
        status: indicator ? indicator.getAttribute('data-status') : null,
        done: outputs.some(o => o.textContent.includes(%r)),
        errors: errors,
    };
}""" % LAST_OUTPUT

# Run all cells without handing the command's promise back: Playwright would
# otherwise wait for every cell to finish before the first sample.
RUN_ALL_JS = "() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }"

RUNNING_JS = "() => [...document.querySelectorAll('.jp-InputArea-prompt')].some(p => p.textContent.includes('*'))"


def _run_and_sample(page):
    """Runs all cells; returns the samples taken until the last cell printed."""
    page.evaluate(RUN_ALL_JS)
    page.wait_for_function(RUNNING_JS, timeout=60_000)
    samples, idle_since = [], None
    deadline = time.monotonic() + RUN_SECONDS
    while time.monotonic() < deadline:
        sample = page.evaluate(SAMPLE_JS)
        sample["t"] = time.monotonic()
        samples.append(sample)
        if sample["dialog"]:
            pytest.fail(f"a dialog blocks the notebook: {sample['dialog']!r}")
        if sample["errors"]:
            pytest.fail("a cell failed in the page:\n" + "\n".join(sample["errors"])[-3000:])
        if sample["done"]:
            return samples
        # A run-all that stopped early leaves the kernel idle with no last output.
        if sample["status"] == "idle" and any(s["status"] == "busy" for s in samples):
            idle_since = idle_since or sample["t"]
            if sample["t"] - idle_since > 30:
                pytest.fail(f"the kernel went idle before the last cell printed {LAST_OUTPUT!r}")
        else:
            idle_since = None
        page.wait_for_timeout(SAMPLE_EVERY * 1000)
    pytest.fail(f"the notebook did not finish in {RUN_SECONDS} s; last sample {samples[-1]}")


@pytest.mark.browser
def test_dashboard_draws_the_loss_live_while_the_quickstart_trains(page, open_notebook, assert_drawn_live,
                                                                   artifacts):
    open_notebook(NOTEBOOK)
    try:
        samples = _run_and_sample(page)
    finally:
        # The artifact: the Dashboard as a person would have seen it when the run ended.
        page.evaluate("() => document.querySelector('.js-plotly-plot')?.scrollIntoView({block: 'start'})")
        page.wait_for_timeout(500)
        page.screenshot(path=str(artifacts / "quickstart.png"))

    headers = [s["header"] for s in samples if s["header"]]
    assert any(h.startswith("running") for h in headers), (
        f"the Dashboard's status line never read 'running' during training: {headers[-1:]}")
    assert headers[-1].startswith("finished") and "epoch 8/8" in headers[-1], headers[-1]
    assert any(s["plots"] for s in samples), "the Dashboard's plotly chart never appeared in the page"
    assert any(s["traces"] for s in samples), (
        "the Dashboard's chart is in the page but holds no trace: the FigureWidget's "
        "data never reached plotly.js in the browser")
    counts = [s["points"] for s in samples if s["points"] is not None]
    assert counts, "the loss trace never received any point in the page"
    final = counts[-1]
    # Live: every draw the page recorded (the samples may miss a short run's middle).
    assert_drawn_live(samples[-1]["draws"], final)
    assert counts == sorted(counts), "the loss trace lost points while training"
    assert final >= 100, f"the finished loss trace has only {final} points"

    chart = page.locator(".js-plotly-plot").first
    chart.scroll_into_view_if_needed()
    assert chart.locator(".scatterlayer .trace path.js-line").count() >= 1, "the loss line is not drawn"
    assert chart.bounding_box()["height"] > 100
