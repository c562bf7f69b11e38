"""A self-contained HTML report of a Run: charts, epoch table, events.

The charts are the inline SVG of `widgets.static`, the same drawing the
Dashboard leaves in a notebook where no widget frontend runs, rather than
plotly with `include_plotlyjs=True`: the page must open offline, anywhere
(a CI artifact, an e-mail attachment, a browser with scripts blocked), and
inline plotly.js adds about 4.6 MB to every file while the SVG charts of a
long run weigh tens of kilobytes. What is lost is zoom and hover, which the
live Dashboard and `lab.Run.load` in a notebook give back.
"""

import html
import os
import time

from widgets.series import chart_data
from widgets.static import charts_html

_STYLE = """
body { font-family: sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; font-size: 13px; margin: 0.5em 0 1.5em; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: right; }
th { background: #f4f4f4; }
td.text { text-align: left; }
"""


def report_html(run, title=None):
    """The report of `run` as one HTML page (no scripts, no external files).

    Args:
        run: lab.Run.
        title: str or None; defaults to the run's name.

    Returns:
        str, a complete HTML document.

    Example:

    ```python
    page = report_html(lab.Run.load("run.h5"))
    ```
    """
    title = title or f"Training Lab run: {run.name}"
    meta = "".join(
        f'<tr><th>{html.escape(str(k))}</th><td class="text">{html.escape(str(v))}</td></tr>'
        for k, v in sorted(run.metadata.items())
    )
    epochs = run.epochs()
    events = run.events()
    if len(events):
        events = events.assign(time=[time.strftime("%H:%M:%S", time.localtime(t)) for t in events["time"]])
    sections = [
        f"<h1>{html.escape(title)}</h1>",
        f"<p>{len(run)} training steps, {len(epochs)} epochs, {len(events)} events.</p>",
        f"<table>{meta}</table>" if meta else "",
        "<h2>Charts</h2>",
        charts_html(chart_data(run), width=760),
        "<h2>Epochs</h2>",
        epochs.to_html(index=False, float_format=lambda v: f"{v:.4g}", border=0) if len(epochs) else "<p>No finished epoch.</p>",
        "<h2>Events</h2>",
        events.to_html(index=False, border=0) if len(events) else "<p>No events.</p>",
    ]
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f"<style>{_STYLE}</style></head><body>{''.join(sections)}</body></html>")


def write_report(run, path, title=None):
    """Writes `report_html(run)` to `path` (folders are created); returns the path.

    Args:
        run: lab.Run.
        path: str or os.PathLike, the HTML file to write.
        title: str or None.
    """
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(report_html(run, title))
    return path
