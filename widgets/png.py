"""PNG files of small uint8 images, written with zlib alone (no imaging library)."""

import struct
import zlib

import numpy as np


def png_bytes(image):
    """A PNG file of a 2-D (gray) or (h, w, 3) uint8 image; no imaging library needed."""
    image = np.ascontiguousarray(image, np.uint8)
    height, width = image.shape[:2]
    color = 2 if image.ndim == 3 else 0
    raw = b"".join(b"\x00" + image[row].tobytes() for row in range(height))

    def chunk(tag, data):
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, color, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")
