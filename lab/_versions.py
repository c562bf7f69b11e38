"""The TensorFlow / Keras versions the lab supports, checked at import.

The lab leans on Keras internals (the train function cache, the optimizer's
update step, metric variables) that move between releases, so the supported
range is explicit and the test suite runs at both of its ends.
"""

import os

# Keep in step with the bounds in pyproject.toml (tests/test_packaging.py checks).
TENSORFLOW_RANGE = ((2, 16), (2, 22))  # lower inclusive, upper exclusive
KERAS_RANGE = ((3, 5), (3, 16))


def _major_minor(version):
    parts = version.split(".")
    return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)


def _describe(bounds):
    (lo, hi) = bounds
    return f">={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]}"


def check_backend(environ=None):
    """Raises if Keras is set to a backend other than TensorFlow."""
    environ = os.environ if environ is None else environ
    backend = environ.get("KERAS_BACKEND", "tensorflow")
    if backend != "tensorflow":
        raise ImportError(
            f"The training lab needs Keras' TensorFlow backend, but "
            f"KERAS_BACKEND={backend!r}. Unset KERAS_BACKEND or set it to "
            "'tensorflow' before importing keras (restart the kernel if keras "
            "is already imported)."
        )


def check_versions(tf_version, keras_version):
    """Raises ImportError naming installed and supported versions when out of range."""
    problems = []
    for name, version, bounds in (
        ("tensorflow", tf_version, TENSORFLOW_RANGE),
        ("keras", keras_version, KERAS_RANGE),
    ):
        try:
            mm = _major_minor(version)
        except (ValueError, IndexError):
            problems.append(f"{name} {version} (unreadable version)")
            continue
        lo, hi = bounds
        if not (lo <= mm < hi):
            problems.append(f"{name} {version} is installed; supported: {name}{_describe(bounds)}")
    if problems:
        raise ImportError(
            "The training lab does not support this TensorFlow/Keras: "
            + "; ".join(problems)
            + ". Install a supported pair, e.g. `pip install 'training-lab[test]'` "
            "in a fresh virtual environment."
        )


def check():
    check_backend()
    import keras
    import tensorflow as tf

    if keras.backend.backend() != "tensorflow":
        check_backend({"KERAS_BACKEND": keras.backend.backend()})
    check_versions(tf.__version__, keras.__version__)
