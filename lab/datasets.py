"""Data that ships inside installed packages: nothing is downloaded."""

import numpy as np


def digits(flat=True, test_fraction=0.2, seed=0):
    """The 8x8 handwritten digits bundled with scikit-learn, split and scaled.

    Args:
        flat: bool, images as 64 values (True) or as (8, 8, 1) arrays.
        test_fraction: float, share of samples held out.
        seed: int, the shuffle before the split.

    Returns:
        `((x_train, y_train), (x_test, y_test))`: float32 pixels in [0, 1] and
        int32 labels 0-9, as `keras.datasets` returns them.
    """
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = (bunch.data / 16.0).astype(np.float32)
    y = bunch.target.astype(np.int32)
    if not flat:
        x = x.reshape(-1, 8, 8, 1)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    cut = int(round(len(x) * (1 - test_fraction)))
    return (x[:cut], y[:cut]), (x[cut:], y[cut:])
