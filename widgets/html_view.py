"""The HTML live view: one display output updated in place with SVG charts.

For front ends where plotly's `FigureWidget` does not render (Colab, VS Code
with anywidget missing, a JupyterLab without the widget extension): what it
shows needs nothing but HTML display updates, as fastprogress does it. It is
displayed once with a display id (`IPython.display.display(...,
display_id=True)`) and then updated through that handle (`handle.update`),
never with `clear_output`, so nothing flickers and no other output is
wiped. Inside a container widget (the Lab panel's Training tab) the same
page goes into an `ipywidgets.HTML` instead, a core widget that renders
wherever ipywidgets do.

A page is the status line and `widgets.static.charts_html` of a
`widgets.series.ChartData`, which is bounded (at most `max_points` per line,
a fixed number of heatmap bins) and drawn with at most
`widgets.static.POINTS` points per line: a page weighs the same at a
thousand steps and at a million. Updates are throttled (`update_every`);
a final one always goes out.
"""

import time

from widgets import static


def html_page(data, status="", width=640):
    """The HTML the view shows: the status line above the SVG charts of `data`.

    A pure function of its arguments (what fastprogress's
    `html_progress_bar` is to its bar), so tests check it without a
    front end.

    Args:
        data: `widgets.series.ChartData`.
        status: str, the status line, HTML.
        width: int, pixels per chart.

    Returns:
        str, an HTML fragment with inline SVG and no JavaScript.

    Example:

    ```python
    from widgets.series import chart_data
    html_page(chart_data(run), "<b>finished</b>")
    ```
    """
    charts = static.charts_html(data, width, raster=True)
    return f'<div class="training-lab-dashboard training-lab-html-view">{status}{charts}</div>'


class HtmlView:
    """Shows charts as HTML in one output, updated in place, at most a few times a second.

    Where it draws: the display handles in `handles` (updated with a
    `text/html` and `text/plain` bundle), or, while there is none, `widget`
    (an `ipywidgets.HTML`), or a handle of its own from `show()`.

    Args:
        handles: list of IPython display handles, shared with the owner
            (the Dashboard's own output), or None.
        widget: `ipywidgets.HTML` or None, drawn into while no handle exists.
        text: callable returning the `text/plain` of the output, or None.
        update_every: float, the fewest seconds between two updates; a
            final update always goes out.
        width: int, pixels per chart.
        clock: callable returning seconds (`time.monotonic`; tests pass their own).
        render: callable `render(data, status, width) -> str`, the page
            (`html_page` by default; `widgets.RunCompare` draws its overlay).

    Example:

    ```python
    view = HtmlView().show()
    view.send(state.update(), "<b>running</b>")
    view.send(state.update(), "<b>finished</b>", final=True)
    ```
    """

    kind = "html"

    def __init__(self, handles=None, widget=None, text=None, update_every=0.25, width=640, clock=time.monotonic,
                 render=None):
        if update_every < 0:
            raise ValueError(f"update_every must be 0 or more seconds; got {update_every}.")
        self.handles = handles if handles is not None else []
        self.widget = widget
        self.text = text
        self.update_every = update_every
        self.width = width
        self.clock = clock
        self.render = render or html_page
        self.updates = 0
        self.last_page = ""
        self._last = None

    def show(self):
        """Displays the view once, with a display id; later sends update that output. Returns self."""
        from IPython.display import display

        handle = display(self._bundle(self.last_page), raw=True, display_id=True)
        if handle is not None:
            self.handles.append(handle)
        return self

    def send(self, data, status="", final=False):
        """Draws `data` under the status line `status` unless the last update was too recent.

        Args:
            data: `widgets.series.ChartData` (or what `render` draws).
            status: str, the status line, HTML.
            final: bool, send whatever the throttle says (the end of training).

        Returns:
            bool, True when the output was updated.
        """
        now = self.clock()
        if not final and self._last is not None and now - self._last < self.update_every:
            return False
        self._last = now
        self.last_page = self.render(data, status, self.width)
        if self.handles:
            bundle = self._bundle(self.last_page)
            for handle in self.handles:
                handle.update(bundle, raw=True)
        elif self.widget is not None:
            self.widget.value = self.last_page
        self.updates += 1
        return True

    def _bundle(self, page):
        return {"text/html": page, "text/plain": self.text() if self.text is not None else "Training Lab charts"}
