"""The tour in a real JupyterLab: the Lab panel's tabs, live chart and buttons in the page.

The tour's own cells run first, unchanged. Then, in the page, as a person
would: Run again and watch the chart in the Training tab while the kernel is
idle; Run, Pause, look at the Modes tab and Continue there, so the run ends
and the panel redraws its output while the chart is hidden; back on the
Training tab the chart must show the whole run, not an empty plot; the same
to and from the Stepper tab. Everything asserted is read from the page (tab
labels, plotly's own data and drawing on the chart element, the notebook's
text), not from Python.
"""

import re
import time

import pytest

NOTEBOOK = "00_tour.ipynb"
TAB_TITLES = ["Training", "Modes", "Stepper", "Devices"]  # widgets.panel.TABS, as the page shows them
LAST_OUTPUT = "last epoch's val_accuracy >= 0.9: True"
STATE_SECONDS = 300  # for any one state to show, on a busy 2-core machine
CHART_SECONDS = 30  # for a chart just shown to be drawn
SAMPLE_EVERY = 0.25

# One look at the page. The panel is its newest Tab view: when training ends
# the panel redraws its output, and the new view replaces the old one. The
# Dashboard's chart is the plotly plot beside its status line, in the first
# tab; textContent, unlike innerText, reads hidden tabs too.
SAMPLE_JS = """() => {
    const tabs = [...document.querySelectorAll('.jupyter-widget-tab')];
    const tab = tabs[tabs.length - 1];
    const header = tab ? tab.querySelector('.training-lab-status') : null;
    const chart = header ? header.closest('.widget-vbox').querySelector('.js-plotly-plot') : null;
    const trace = chart && chart.data && chart.data.length ? chart.data[0] : null;
    const panel = tab ? tab.closest('.widget-vbox') : null;
    const status = panel ? panel.querySelector(':scope > .widget-hbox .widget-html') : null;
    const widget = window.jupyterapp.shell.currentWidget;
    const kernel = widget && widget.sessionContext.session && widget.sessionContext.session.kernel;
    const outputs = [...document.querySelectorAll('.jp-OutputArea-output')];
    const errors = outputs.filter(o => o.getAttribute('data-mime-type') === 'application/vnd.jupyter.stderr')
        .map(o => o.textContent).filter(t => /Error|Traceback/.test(t));
    const dialog = document.querySelector('.jp-Dialog');
    return {
        panels: tabs.length,
        titles: tab ? [...tab.querySelectorAll('.lm-TabBar-tab .lm-TabBar-tabLabel')].map(t => t.textContent) : [],
        current: tab ? (tab.querySelector('.lm-TabBar-tab.lm-mod-current') || {}).textContent || null : null,
        marked: tab ? tab.hasAttribute('data-test-old-view') : null,
        state: status ? status.textContent : null,
        header: header ? header.textContent : null,
        points: trace && trace.y ? trace.y.length : null,
        kernel: kernel ? kernel.status : null,
        output: outputs.map(o => o.textContent).join('\\n'),
        errors: errors,
        dialog: dialog ? dialog.textContent : null,
    };
}"""

# What a person sees of the Dashboard's chart: its loss trace drawn as a line
# of points, at a real size. A plotly figure first drawn in a hidden tab can
# come back as an empty plot.
CHART_JS = """() => {
    const tabs = [...document.querySelectorAll('.jupyter-widget-tab')];
    const header = tabs[tabs.length - 1].querySelector('.training-lab-status');
    const chart = header.closest('.widget-vbox').querySelector('.js-plotly-plot');
    const box = chart.getBoundingClientRect();
    const line = chart.querySelector('.scatterlayer .trace path.js-line');
    const d = line ? line.getAttribute('d') || '' : '';
    return {
        shown: chart.offsetParent !== null,
        width: box.width,
        height: box.height,
        points: chart.data && chart.data.length && chart.data[0].y ? chart.data[0].y.length : 0,
        vertices: (d.match(/[ML]/g) || []).length,
        line_width: line ? line.getBoundingClientRect().width : 0,
    };
}"""

# Run all cells without handing the command's promise back: Playwright would
# otherwise wait for every cell to finish before the first sample.
RUN_ALL_JS = "() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }"


class _Page:
    """The notebook page and every sample taken of it, failing fast on errors."""

    def __init__(self, page):
        self.page = page
        self.samples = []

    def sample(self):
        sample = self.page.evaluate(SAMPLE_JS)
        self.samples.append(sample)
        if sample["dialog"]:
            pytest.fail(f"a dialog blocks the notebook: {sample['dialog']!r}")
        if sample["errors"]:
            pytest.fail("a cell failed in the page:\n" + "\n".join(sample["errors"])[-3000:])
        return sample

    def wait_for(self, condition, what, fail_if=None):
        """Samples until `condition(sample)`; fails when `fail_if(sample)` or after STATE_SECONDS."""
        deadline = time.monotonic() + STATE_SECONDS
        while time.monotonic() < deadline:
            sample = self.sample()
            if condition(sample):
                return sample
            if fail_if is not None and fail_if(sample):
                pytest.fail(f"{what}: did not happen; the page reads {_brief(sample)}")
            self.page.wait_for_timeout(SAMPLE_EVERY * 1000)
        pytest.fail(f"{what}: not within {STATE_SECONDS} s; the page reads {_brief(self.samples[-1])}")

    def click(self, button):
        """Clicks one of the panel's buttons above its tabs (Run, Pause, Continue, Stop)."""
        # By text: a button's accessible name also holds its icon's glyph.
        self.page.locator("button.widget-button").filter(has_text=re.compile(rf"^\s*{button}\s*$")).last.click()

    def tab(self):
        return self.page.locator(".jupyter-widget-tab").last

    def show_tab(self, title):
        self.tab().locator(".lm-TabBar-tab", has_text=title).click()
        self.wait_for(lambda s: s["current"] == title, f"the {title} tab becomes the current one")

    def chart(self):
        return self.page.evaluate(CHART_JS)

    def drawn_chart(self):
        """The chart once it looks drawn (plotly redraws a plot just shown in its own time),
        or as it is after CHART_SECONDS."""
        deadline = time.monotonic() + CHART_SECONDS
        chart = self.chart()
        while time.monotonic() < deadline and not _looks_drawn(chart):
            self.page.wait_for_timeout(SAMPLE_EVERY * 1000)
            chart = self.chart()
        return chart


def _brief(sample):
    return {k: v for k, v in sample.items() if k != "output"}


def _state(sample):
    return (sample["state"] or "").split(" ")[0]


def _panel_shows(state):
    return lambda s: _state(s) == state


def _looks_drawn(chart):
    return chart["shown"] and chart["vertices"] >= 10 and chart["line_width"] > 100


def _assert_chart_drawn(chart, points, where):
    assert chart["shown"], f"{where}: the Dashboard's chart is hidden in the Training tab"
    assert chart["width"] > 300 and chart["height"] > 100, f"{where}: the chart is drawn at {chart}"
    assert chart["points"] == points, f"{where}: the loss trace holds {chart['points']} points, not {points}"
    assert chart["vertices"] >= 10 and chart["line_width"] > 100, (
        f"{where}: the chart is an empty plot, its loss line is not drawn ({chart})")


@pytest.mark.browser
def test_lab_panel_trains_in_the_background_and_its_tabs_switch_in_the_page(page, open_notebook, artifacts):
    open_notebook(NOTEBOOK)
    lab = _Page(page)
    try:
        _run_the_tour(lab)
    finally:
        # The artifact: the panel as a person would have seen it at the end.
        page.evaluate("() => document.querySelector('.jupyter-widget-tab')?.parentElement"
                      ".scrollIntoView({block: 'start'})")
        page.wait_for_timeout(500)
        page.screenshot(path=str(artifacts / "tour.png"))


def _run_the_tour(lab):
    lab.page.evaluate(RUN_ALL_JS)
    done = lab.wait_for(lambda s: "val_accuracy >= 0.9" in s["output"] and s["kernel"] == "idle",
                        "the tour's last cell prints its summary")
    assert LAST_OUTPUT in done["output"], done["output"][-2000:]
    steps = int(re.search(r"(\d+) steps, 5 epochs", done["output"]).group(1))  # the panel's summary
    assert done["titles"] == TAB_TITLES, f"the panel's tabs read {done['titles']}"
    assert done["current"] == "Training", f"the panel opens on the {done['current']} tab"
    lab.wait_for(lambda s: s["points"] == steps, "the chart holds the tour's run")
    _assert_chart_drawn(lab.drawn_chart(), steps, "after the tour's run")

    # Run again from the page, as a person would: with no cell running, the
    # kernel stays idle while fit() runs on the background thread and the
    # chart in view gains the new run's points.
    lab.click("Run")
    live = lab.wait_for(lambda s: _state(s) == "running" and steps < (s["points"] or 0) < 2 * steps,
                        "the chart gains points while the Run button's training runs",
                        fail_if=lambda s: s["points"] == 2 * steps)
    assert live["kernel"] == "idle", f"the kernel is {live['kernel']} while the panel trains"
    lab.wait_for(lambda s: _state(s) == "finished" and s["points"] == 2 * steps, "the second run finishes")

    # A third run, paused at once (the kernel answers clicks mid-run), goes on
    # and ends while another tab is in front; then the chart must come back
    # drawn, not as an empty plot.
    lab.click("Run")
    lab.click("Pause")
    lab.wait_for(_panel_shows("paused"), "Pause parks training", fail_if=lambda s: s["points"] == 3 * steps)
    lab.show_tab("Modes")
    lab.tab().get_by_role("button", name="Compare").wait_for(state="visible", timeout=STATE_SECONDS * 1000)
    assert lab.tab().locator(".widget-toggle-buttons").first.is_visible(), "the mode toggle is not in view"
    assert not lab.chart()["shown"], "the Dashboard's chart still shows in the Modes tab"
    # The panel's redraw at the end replaces this view: the new chart is made in a hidden tab.
    lab.page.evaluate("() => document.querySelectorAll('.jupyter-widget-tab')"
                      ".forEach(t => t.setAttribute('data-test-old-view', ''))")
    lab.click("Continue")
    lab.wait_for(lambda s: _state(s) == "finished" and s["points"] == 3 * steps and not s["marked"],
                 "the third run finishes, and the panel redraws, behind the Modes tab")
    assert lab.samples[-1]["current"] == "Modes", "the panel left the Modes tab by itself"
    lab.show_tab("Training")
    _assert_chart_drawn(lab.drawn_chart(), 3 * steps, "back from the Modes tab")

    lab.show_tab("Stepper")
    step_here = lab.tab().get_by_role("button", name="Step here")
    step_here.wait_for(state="visible", timeout=STATE_SECONDS * 1000)
    assert step_here.is_enabled(), "Step here is disabled after training ended"
    assert not lab.chart()["shown"], "the Dashboard's chart still shows in the Stepper tab"
    lab.show_tab("Training")
    _assert_chart_drawn(lab.drawn_chart(), 3 * steps, "back from the Stepper tab")

    header = lab.samples[-1]["header"]
    assert header.startswith("finished") and "epoch 5/5" in header, header
