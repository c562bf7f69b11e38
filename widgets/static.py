"""Static rendering of a run's charts: small inline SVG, no JavaScript.

Used where no widget frontend exists (nbconvert, nbval, an HTML export, a
report file): the Dashboard's output bundle carries this next to its widget
view, and `widgets.report` builds its page from it. A chart is a few
kilobytes; plotly.js would weigh megabytes per page.

For nbval: the numbers drawn change from run to run and all of them sit
inside `<svg>` elements, so one sanitizer line (`SANITIZE_SVG`) makes the
HTML comparable; the text around the charts is deterministic.
"""

import base64
import html

import numpy as np

from widgets.downsampling import downsample
from widgets.png import png_bytes

SANITIZE_SVG = r"<svg[\s\S]*?</svg>"
POINTS = 400
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2",
           "#7f7f7f", "#bcbd22", "#17becf")
_MARGIN = dict(left=56, right=12, top=40, bottom=30)


def _fmt(value):
    return f"{value:.3g}"


class _Scale:
    """Maps data values to pixels on one axis (linear or log10)."""

    def __init__(self, values, low_px, high_px, log=False):
        self.log = log
        values = np.asarray(values, np.float64)
        values = values[np.isfinite(values)]
        if log:
            values = np.log10(values[values > 0])
        if len(values) == 0:
            values = np.array([0.0, 1.0])
        self.lo, self.hi = float(values.min()), float(values.max())
        if self.hi - self.lo < 1e-12:
            self.lo, self.hi = self.lo - 0.5, self.hi + 0.5
        self.low_px, self.high_px = low_px, high_px

    def __call__(self, values):
        values = np.asarray(values, np.float64)
        if self.log:
            with np.errstate(divide="ignore", invalid="ignore"):
                values = np.log10(values)
        return self.low_px + (values - self.lo) / (self.hi - self.lo) * (self.high_px - self.low_px)

    def label(self, end):
        value = self.lo if end == "low" else self.hi
        return _fmt(10 ** value if self.log else value)


def line_chart(series, title, width=640, height=200, log_y=False, right=()):
    """An SVG line chart of `widgets.series.Series` (markers where `series.markers`).

    Each series is drawn in its `color` (from the palette where it has
    none) and named in the chart's own legend, above the plot; a `faint`
    series (a raw line under its smoothed one) is drawn thin and pale and
    has no legend entry.

    Args:
        series: list of `Series`.
        title: str, drawn above the plot.
        width: int, pixels.
        height: int, pixels.
        log_y: bool, a log10 value axis (non-positive values are left out).
        right: sequence of str, names of series drawn against their own
            scale (labelled on the right), e.g. accuracy next to a loss.

    Returns:
        str, an `<svg>` element.

    Example:

    ```python
    from widgets.series import chart_data
    line_chart(chart_data(run).loss, "loss")
    ```
    """
    series = [s for s in series if len(s.x)]
    legend_rows = -(-sum(not s.faint for s in series) // 4)
    x0, x1 = _MARGIN["left"], width - _MARGIN["right"] - (40 if right else 0)
    y0, y1 = height - _MARGIN["bottom"], 26 + 12 * max(legend_rows, 1)
    parts = [_open(width, height, title)]
    if not series:
        parts.append(f'<text x="{width / 2:.0f}" y="{height / 2:.0f}" text-anchor="middle" fill="#888">no data yet</text>')
        return "".join(parts + ["</svg>"])
    left = [s for s in series if s.name not in right]
    other = [s for s in series if s.name in right]
    xs = _Scale(np.concatenate([s.x for s in series]), x0, x1)
    ys = _Scale(np.concatenate([s.y for s in left]) if left else [0, 1], y0, y1, log=log_y)
    ys_right = _Scale(np.concatenate([s.y for s in other]), y0, y1) if other else None
    parts.append(_frame(x0, x1, y0, y1, xs, ys, ys_right))
    colors = iter(PALETTE * (1 + len(series) // len(PALETTE)))
    legend = 0
    for s in series:
        color = "crimson" if s.name == "events" else s.color or next(colors)
        scale = ys_right if s.name in right else ys
        x, y = downsample(s.x, s.y, POINTS) if len(s.x) > POINTS else (s.x, s.y)
        px, py = xs(x), scale(y)
        keep = np.isfinite(px) & np.isfinite(py)
        px, py = px[keep], py[keep]
        if s.markers:
            shape = "x" if s.name == "events" else "o"
            for a, b in zip(px, py):
                if shape == "x":
                    parts.append(f'<path d="M{a - 4:.1f},{b - 4:.1f}l8,8m0,-8l-8,8" stroke="{color}" stroke-width="2"/>')
                else:
                    parts.append(f'<circle cx="{a:.1f}" cy="{b:.1f}" r="3" fill="{color}"/>')
        elif len(px):
            points = " ".join(f"{a:.1f},{b:.1f}" for a, b in zip(px, py))
            # The series' name and last value, for a test (or a reader) to check the line against the run.
            last = float(y[keep][-1])
            # A raw line under its smoothed one is drawn faint and left out of the legend.
            style = 'stroke-width="1" stroke-opacity="0.3"' if s.faint else 'stroke-width="1.5"'
            parts.append(f'<polyline data-name="{html.escape(s.name)}" data-last="{last:.7g}" fill="none" '
                         f'stroke="{color}" {style} points="{points}"/>')
        if not s.faint:
            parts.append(_legend(legend, s.name + (" (right)" if s.name in right else ""), color, x0, s.markers))
            legend += 1
    return "".join(parts + ["</svg>"])


def heatmap_chart(heat, title, width=640, height=None, raster=False):
    """An SVG layer x step heatmap of `widgets.series.Heatmap` (log10 values, viridis-like).

    Args:
        heat: `widgets.series.Heatmap`.
        title: str, drawn above the plot.
        width: int, pixels.
        height: int or None, pixels (from the number of layers when None).
        raster: bool, draw the cells as one embedded PNG (one pixel per
            cell, a few kB) instead of one `<rect>` each (about 65 bytes a
            cell): what the live HTML view sends several times a second.

    Returns:
        str, an `<svg>` element.
    """
    rows = max(1, len(heat.layers))
    height = height or (_MARGIN["top"] + _MARGIN["bottom"] + 18 * rows + 10)
    parts = [_open(width, height, title)]
    if len(heat.z) == 0:
        parts.append(f'<text x="{width / 2:.0f}" y="{height / 2:.0f}" text-anchor="middle" fill="#888">no gradients recorded</text>')
        return "".join(parts + ["</svg>"])
    label_px = 150
    x0, x1 = label_px, width - _MARGIN["right"] - 60
    y_top = _MARGIN["top"]
    row_px = (height - _MARGIN["top"] - _MARGIN["bottom"]) / rows
    columns = np.unique(heat.x)
    cell_px = (x1 - x0) / len(columns)
    finite = heat.z[np.isfinite(heat.z)]
    lo, hi = (float(finite.min()), float(finite.max())) if len(finite) else (0.0, 1.0)
    span = max(hi - lo, 1e-9)
    if raster:
        parts.append(_cells_image(heat, columns, lo, span, x0, x1, y_top, row_px * rows))
    else:
        column_of = {float(c): i for i, c in enumerate(columns)}
        for x, y, z in zip(heat.x, heat.y, heat.z):
            if not np.isfinite(z):
                continue
            px = x0 + column_of[float(x)] * cell_px
            py = y_top + int(y) * row_px
            parts.append(f'<rect x="{px:.1f}" y="{py:.1f}" width="{cell_px + 0.5:.1f}" height="{row_px:.1f}" fill="{_viridis((z - lo) / span)}"/>')
    for i, layer in enumerate(heat.layers):
        name = layer if len(layer) <= 22 else "…" + layer[-21:]
        parts.append(f'<text x="{label_px - 4}" y="{y_top + (i + 0.6) * row_px:.1f}" text-anchor="end" font-size="10">{html.escape(name)}</text>')
    parts.append(f'<text x="{x1 + 6}" y="{y_top + 10}" font-size="10">{_fmt(hi)}</text>')
    parts.append(f'<text x="{x1 + 6}" y="{height - _MARGIN["bottom"]}" font-size="10">{_fmt(lo)}</text>')
    parts.append(f'<text x="{x0}" y="{height - 8}" font-size="10">step {_fmt(float(columns[0]))}</text>')
    parts.append(f'<text x="{x1}" y="{height - 8}" font-size="10" text-anchor="end">{_fmt(float(columns[-1]))}</text>')
    return "".join(parts + ["</svg>"])


def charts_html(data, width=640, raster=False):
    """The SVG charts of a `ChartData` as one HTML fragment (what the Dashboard shows statically).

    Args:
        data: `widgets.series.ChartData`.
        width: int, pixels per chart.
        raster: bool, the heatmap's cells as one PNG (see `heatmap_chart`).
    """
    # The loss and the metrics each on a chart of their own: their scales differ
    # (a loss of 2.3 falling, an accuracy of 0.1 rising), and two axes on one chart read badly.
    drawn = [s for s in data.metrics if len(s.x)]
    parts = []
    if any(len(s.x) for s in data.loss) or not drawn:
        parts.append(line_chart(data.loss, "loss per batch (points: validation)", width=width))
    if drawn:
        parts.append(line_chart(data.metrics, "metrics per batch (points: validation)", width=width))
    if data.gradients:
        parts.append(line_chart(data.gradients, "gradient norm per layer (log scale)", width=width, log_y=True))
        parts.append(heatmap_chart(data.heatmap, "log10 gradient norm, layer x step", width=width, raster=raster))
    if data.update_ratios:
        parts.append(line_chart(data.update_ratios, "update / weight norm per layer (log scale)",
                                width=width, log_y=True))
    return "<div>" + "".join(f"<div>{p}</div>" for p in parts) + "</div>"


def _open(width, height, title):
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">'
            f'<text x="{_MARGIN["left"]}" y="14" font-size="12" font-weight="bold">{html.escape(title)}</text>')


def _frame(x0, x1, y0, y1, xs, ys, ys_right):
    parts = [f'<rect x="{x0}" y="{y1}" width="{x1 - x0}" height="{y0 - y1}" fill="none" stroke="#ccc"/>',
             f'<text x="{x0 - 4}" y="{y1 + 9}" text-anchor="end">{ys.label("high")}</text>',
             f'<text x="{x0 - 4}" y="{y0}" text-anchor="end">{ys.label("low")}</text>',
             f'<text x="{x0}" y="{y0 + 14}">{xs.label("low")}</text>',
             f'<text x="{x1}" y="{y0 + 14}" text-anchor="end">step {xs.label("high")}</text>']
    if ys_right is not None:
        parts.append(f'<text x="{x1 + 4}" y="{y1 + 9}">{ys_right.label("high")}</text>')
        parts.append(f'<text x="{x1 + 4}" y="{y0}">{ys_right.label("low")}</text>')
    return "".join(parts)


def _legend(i, name, color, x0, markers=False):
    x = x0 + 8 + (i % 4) * 130
    y = 30 + (i // 4) * 12
    swatch = (f'<circle cx="{x + 4}" cy="{y - 3}" r="3" fill="{color}"/>' if markers
              else f'<rect x="{x}" y="{y - 7}" width="8" height="8" fill="{color}"/>')
    return f'{swatch}<text x="{x + 11}" y="{y}" font-size="10">{html.escape(name[:20])}</text>'



def _cells_image(heat, columns, lo, span, x0, x1, y_top, height):
    """The heatmap's cells as one `<image>`: a PNG of one pixel per (layer, step column), scaled up."""
    grid = np.full((max(1, len(heat.layers)), len(columns)), np.nan)
    grid[heat.y.astype(np.int64), np.searchsorted(columns, heat.x)] = heat.z
    pixels = _viridis_array((grid - lo) / span)
    pixels[~np.isfinite(grid)] = 255  # no value: left white, as the vector form leaves it
    data = base64.b64encode(png_bytes(pixels)).decode("ascii")
    return (f'<image x="{x0}" y="{y_top}" width="{x1 - x0}" height="{height:.1f}" preserveAspectRatio="none" '
            f'style="image-rendering:pixelated" href="data:image/png;base64,{data}"/>')


_VIRIDIS = ((68, 1, 84), (59, 82, 139), (33, 145, 140), (94, 201, 98), (253, 231, 37))


def _viridis_array(t):
    """`_viridis` of every value of `t` at once: (..., 3) uint8 (NaN maps anywhere; mask it)."""
    stops = np.asarray(_VIRIDIS, np.float64)
    t = np.clip(np.nan_to_num(np.asarray(t, np.float64)), 0.0, 1.0) * (len(stops) - 1)
    i = np.minimum(t.astype(np.int64), len(stops) - 2)
    f = (t - i)[..., None]
    return np.round(stops[i] + (stops[i + 1] - stops[i]) * f).astype(np.uint8)


def _viridis(t):
    t = min(max(float(t), 0.0), 1.0) * (len(_VIRIDIS) - 1)
    i = min(int(t), len(_VIRIDIS) - 2)
    f = t - i
    r, g, b = (round(a + (b - a) * f) for a, b in zip(_VIRIDIS[i], _VIRIDIS[i + 1]))
    return f"#{r:02x}{g:02x}{b:02x}"
