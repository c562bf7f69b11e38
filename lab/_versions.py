"""The Keras backends and versions the lab supports, checked at import.

The lab leans on Keras internals (the train function cache, the optimizer's
update step, metric variables) that move between releases, so the supported
ranges are explicit and the test suite runs at their ends. Versions are read
from the installed distributions, so checking one backend imports no other.
"""

import importlib.metadata

# Keep in step with the bounds in pyproject.toml (tests/lab/test_versions.py checks).
KERAS_RANGE = ((3, 5), (3, 16))  # lower inclusive, upper exclusive
BACKEND_RANGES = {
    "tensorflow": ("tensorflow", ((2, 16), (2, 22))),
    "jax": ("jax", ((0, 7), (0, 13))),
}
# Keras on JAX from 3.11: its fit() ends in a `finally` (where the lab takes
# its hooks off after an error or Ctrl-C) and reports each execution's span.
KERAS_RANGES = {"tensorflow": KERAS_RANGE, "jax": ((3, 11), KERAS_RANGE[1])}
TENSORFLOW_RANGE = BACKEND_RANGES["tensorflow"][1]
JAX_RANGE = BACKEND_RANGES["jax"][1]


def _major_minor(version):
    parts = version.split(".")
    return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)


def _describe(bounds):
    (lo, hi) = bounds
    return f">={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]}"


def check_backend(backend):
    """Raises ImportError naming the backends the lab runs on when `backend` is another."""
    if backend not in BACKEND_RANGES:
        raise ImportError(
            f"The training lab runs on Keras' TensorFlow or JAX backend, but Keras' backend is "
            f"{backend!r}. Set KERAS_BACKEND='jax' or 'tensorflow' before importing keras (restart "
            "the kernel if keras is already imported) and install that backend, e.g. "
            "`pip install 'training-lab[jax]'`."
        )


def check_versions(backend_version, keras_version, backend="tensorflow"):
    """Raises ImportError naming installed and supported versions when out of range."""
    package, backend_bounds = BACKEND_RANGES[backend]
    problems = []
    for name, version, bounds in (
        (package, backend_version, backend_bounds),
        ("keras", keras_version, KERAS_RANGES[backend]),
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
            f"The training lab does not support this {package}/Keras: "
            + "; ".join(problems)
            + f". Install a supported pair, e.g. `pip install 'training-lab[{backend}]'` "
            "in a fresh virtual environment."
        )


def _installed(package):
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def check():
    """Checks Keras' backend and the installed versions; returns the backend's name."""
    try:
        import keras
    except ModuleNotFoundError as error:
        missing = (error.name or "").split(".")[0]
        if missing not in ("tensorflow", "jax", "torch"):
            raise
        have = [name for name, (package, _) in BACKEND_RANGES.items() if _installed(package)]
        fix = (f"{', '.join(have)} is installed: set KERAS_BACKEND={have[0]!r} before importing keras "
               f"(`os.environ['KERAS_BACKEND'] = {have[0]!r}` or in the shell)" if have else
               "install one: `pip install 'training-lab[jax]'` or `pip install 'training-lab[tensorflow]'`")
        raise ImportError(f"Keras could not start its {missing!r} backend because {missing} is not installed; "
                          f"{fix}.") from error

    backend = keras.config.backend()
    check_backend(backend)
    package = BACKEND_RANGES[backend][0]
    version = _installed(package)
    if version is None:
        raise ImportError(
            f"Keras' backend is {backend!r}, but {package} is not installed: "
            f"`pip install 'training-lab[{backend}]'`."
        )
    check_versions(version, keras.__version__, backend)
    return backend
