"""image_grid: rows of small images (digits, reconstructions, samples) as one PNG."""

import numpy as np

from widgets.png import png_bytes


def image_grid(rows, scale=4, gap=1, low=0.0, high=1.0):
    """Rows of small gray images as one PNG, e.g. digits over their reconstructions.

    Every image is drawn on the same scale (`low` black, `high` white), so a
    faint reconstruction looks faint next to its original.

    Args:
        rows: sequence of arrays, one per row, each `(n, h, w)`, `(n, h, w, 1)`
            or `(n, side * side)` (flat square images); rows may differ in n.
        scale: int, pixels per image pixel.
        gap: int, image pixels of background between images.
        low: float, the value drawn black.
        high: float, the value drawn white.

    Returns:
        `IPython.display.Image` (PNG, a few kilobytes).

    Example:

    ```python
    widgets.image_grid([x_test[:8], vae.predict(x_test[:8])])
    ```
    """
    from IPython.display import Image

    if isinstance(rows, np.ndarray) and rows.ndim in (2, 3):
        rows = [rows]
    images = [_as_square_images(np.asarray(row, np.float64), i) for i, row in enumerate(rows)]
    if high <= low:
        raise ValueError(f"`high` ({high}) must be above `low` ({low}).")
    shapes = {row.shape[1:] for row in images if len(row)}
    if len(shapes) > 1:
        raise ValueError(f"All images must have one size; got {sorted(shapes)}. Resize them first.")
    h, w = shapes.pop() if shapes else (1, 1)
    columns = max([len(row) for row in images] + [1])
    canvas = np.zeros((len(images) * (h + gap) + gap, columns * (w + gap) + gap))
    for r, row in enumerate(images):
        for c, image in enumerate(row):
            top, left = gap + r * (h + gap), gap + c * (w + gap)
            canvas[top:top + h, left:left + w] = (image - low) / (high - low)
    pixels = np.clip(np.nan_to_num(canvas) * 255, 0, 255).astype(np.uint8)
    pixels = np.kron(pixels, np.ones((scale, scale), np.uint8))
    return Image(data=png_bytes(pixels), format="png")


def _as_square_images(row, index):
    if row.ndim == 4 and row.shape[-1] == 1:
        row = row[..., 0]
    if row.ndim == 2:
        side = int(round(np.sqrt(row.shape[1])))
        if side * side != row.shape[1]:
            raise ValueError(
                f"Row {index} holds flat images of {row.shape[1]} values, not a square "
                f"number; reshape them to (n, height, width) first.")
        row = row.reshape(len(row), side, side)
    if row.ndim != 3:
        raise ValueError(
            f"Row {index} has shape {row.shape}; expected (n, height, width), "
            f"(n, height, width, 1) or (n, side * side).")
    return row
