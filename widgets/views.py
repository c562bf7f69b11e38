"""Where the charts render: the plotly widget or the HTML view, chosen in one place.

Two views sit behind one method, `send(data, status, final=False)` (`data` a
`widgets.series.ChartData`, `status` the status line as HTML), as
livelossplot's outputs do: `PlotlyView` updates a plotly `FigureWidget`
(JupyterLab, Notebook 7), `widgets.html_view.HtmlView` updates one display
output with SVG (Colab, VS Code, anywhere the plotly widget cannot render).

`choose_view` decides when it is called, never at import, so a test (or a
notebook) can change what it sees: the Dashboard asks when training begins.
"""

import os
import sys

VIEWS = ("auto", "plotly", "html")
# Overrides the automatic choice for every view left at "auto" (a browser
# test, a front end the choice gets wrong).
ENV_VAR = "TRAINING_LAB_VIEW"


def check_view(view):
    """`view` if it is one of `VIEWS`, else a ValueError naming them.

    Args:
        view: str, `"auto"`, `"plotly"` or `"html"`.
    """
    if view not in VIEWS:
        allowed = ", ".join(repr(v) for v in VIEWS)
        raise ValueError(f"view must be one of {allowed}; got {view!r}. \"auto\" picks \"html\" on Colab "
                         "and in VS Code and \"plotly\" elsewhere.")
    return view


def frontend():
    """The notebook front end as far as the kernel can tell: `"colab"`, `"vscode"` or `"jupyter"`.

    Colab's kernel imports `google.colab` at start. VS Code's Jupyter
    extension starts kernels from its own process, whose environment has
    `VSCODE_PID` (what plotly's renderer detection reads) and `VSCODE_CWD`.
    `JPY_SESSION_NAME` is no help: JupyterLab and VS Code both set it to the
    notebook's path. A Jupyter server started from a VS Code terminal passes
    the VS Code variables on, so its kernels count as VS Code.
    """
    if "google.colab" in sys.modules:
        return "colab"
    if "VSCODE_PID" in os.environ or "VSCODE_CWD" in os.environ:
        return "vscode"
    return "jupyter"


def choose_view(requested="auto"):
    """The view to draw with: `requested`, or for `"auto"` the one that renders in this front end.

    `"auto"` gives `"html"` on Colab and in VS Code, where plotly's
    `FigureWidget` often does not render (googlecolab/colab-cdn-widget-manager#51,
    manzt/anywidget#684), and `"plotly"` elsewhere; the environment variable
    `TRAINING_LAB_VIEW` (`plotly` or `html`), when set, decides instead.

    Args:
        requested: str, one of `VIEWS`.

    Returns:
        str, `"plotly"` or `"html"`.

    Example:

    ```python
    choose_view("auto")  # "html" on Colab, "plotly" in JupyterLab
    ```
    """
    check_view(requested)
    if requested != "auto":
        return requested
    forced = os.environ.get(ENV_VAR, "").strip().lower()
    if forced:
        if forced not in ("plotly", "html"):
            raise ValueError(f"{ENV_VAR} must be 'plotly' or 'html'; got {forced!r}.")
        return forced
    return "html" if frontend() in ("colab", "vscode") else "plotly"


class PlotlyView:
    """The plotly view: a `widgets.charts.LiveFigure` and a status line widget.

    Throttling is the caller's (the Dashboard refreshes on a timer with a
    time budget); each `send` is one plotly update message.

    Args:
        chart: `widgets.charts.LiveFigure`.
        header: `ipywidgets.HTML`, the status line.
    """

    kind = "plotly"

    def __init__(self, chart, header):
        self.chart = chart
        self.header = header

    def send(self, data, status, final=False):
        """Draws `data` and the status line `status` (HTML); returns True (always sent)."""
        self.chart.update(data)
        self.header.value = status
        return True
