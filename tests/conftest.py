import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_HOME", os.path.join(os.path.dirname(__file__), "..", ".keras-home"))

import gc  # noqa: E402
import pathlib  # noqa: E402

import pytest  # noqa: E402

_END_TO_END = ("browser", "kernel")


def pytest_configure(config):
    config.addinivalue_line("markers", "kernel: drives a real ipykernel through jupyter_client")
    config.addinivalue_line(
        "markers", "newest_only: a sweep's Stepper, rewind and XLA variants, and the keras-io programs' checks "
        "beyond fit(): run on the newest stack only; the oldest runs every sweep's fit() check "
        "(`make test-oldest`, docs/testing.md)")


def pytest_collection_modifyitems(config, items):
    # End-to-end tests drive a real JupyterLab/Chromium or kernel on a shared
    # 2-core machine; a rerun tells a slow machine from a broken feature.
    if not config.pluginmanager.hasplugin("rerunfailures"):
        return
    for item in items:
        parts = pathlib.Path(str(item.fspath)).parts
        if any(part in _END_TO_END for part in parts[-2:-1]):
            item.add_marker(pytest.mark.flaky(reruns=2, reruns_delay=5))


@pytest.fixture(scope="module", autouse=True)
def _freeze_what_the_last_module_left():
    """Keeps Python's full garbage collections short in a process that runs many test files.

    A test process holds millions of TensorFlow objects (the graphs and
    functions of the models earlier files built and cache), and a full
    collection walks every one: over 6 s each in a worker of the unit phase,
    about a quarter of its time (measured with gc.callbacks, 2 cores). After
    each file its garbage is collected, and what is left moves out of the
    collector's sight (`gc.freeze`); only what later files make is walked.
    What a later file frees by reference count is still freed.
    """
    yield
    gc.collect()
    gc.freeze()
