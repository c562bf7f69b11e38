"""Writes that must not be cut by a Ctrl-C, on any backend."""

import contextlib
import signal
import threading


@contextlib.contextmanager
def uninterrupted():
    """Holds a Ctrl-C (SIGINT) back until the block ends, then delivers it.

    For writes that must happen together (a rewind's variables, its history
    and the data position): an interrupt between two of them left a model
    half rewound. Off the main thread, where Python delivers no signal, the
    block runs as it is.

    Example:

    ```python
    saved = [(variable, variable.numpy()) for variable in model.variables]
    with uninterrupted():
        for variable, array in saved:
            variable.assign(array)
    ```
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = []
    try:
        previous = signal.signal(signal.SIGINT, lambda number, frame: held.append(number))
    except ValueError:  # an embedding that owns the signals
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if held:
            signal.raise_signal(signal.SIGINT)
