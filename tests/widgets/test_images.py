"""widgets.image_grid: rows of small images as one PNG."""

import struct
import zlib

import numpy as np
import pytest

import widgets


def decoded(image):
    """The gray pixels of a PNG written without row filters (as png_bytes writes it)."""
    data = image.data
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    raw = zlib.decompress(data[data.index(b"IDAT") + 4:])
    rows = np.frombuffer(raw[: height * (width + 1)], np.uint8).reshape(height, width + 1)
    assert (rows[:, 0] == 0).all()
    return rows[:, 1:]


def test_rows_of_flat_digits_become_one_png_on_a_shared_scale():
    originals = np.ones((3, 64))
    faint = np.full((2, 64), 0.5)
    pixels = decoded(widgets.image_grid([originals, faint], scale=2, gap=1))
    # 2 rows and 3 columns of 8x8 images with a 1-pixel gap, each pixel 2x2.
    assert pixels.shape == (2 * (2 * 9 + 1), 2 * (3 * 9 + 1))
    assert pixels[2:4, 2:4].min() == 255  # an original: white
    assert pixels[2 * 10, 2 * 1] == 127  # a faint reconstruction stays faint
    assert pixels[2 * 10, 2 * 19] == 0  # the missing third image in the short row: background


def test_images_of_other_sizes_say_what_to_do():
    with pytest.raises(ValueError, match="not a square number"):
        widgets.image_grid([np.zeros((2, 10))])
    with pytest.raises(ValueError, match="one size"):
        widgets.image_grid([np.zeros((2, 64)), np.zeros((2, 4, 4))])
