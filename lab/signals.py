"""Ctrl-C on any backend: writes it must not cut, and telling one from other errors."""

import contextlib
import re
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


_REPORTED_INTERRUPT = re.compile(r"^KeyboardInterrupt(:.*)?$", re.MULTILINE)
_BACKEND_RUNTIMES = ("tensorflow", "jax", "jaxlib")


def is_interrupt(error):
    """Whether `error` is a Ctrl-C, as it reached the caller.

    A `KeyboardInterrupt`, or the error a backend's runtime made of one: a
    KeyboardInterrupt raised inside a data generator that TensorFlow runs
    through `tf.data` comes out of the step as `UnknownError: Graph
    execution error`, its only trace the generator's traceback in the
    message (a last line `KeyboardInterrupt`); a host callback's reaches
    JAX as a runtime error the same way. An error raised `from` a
    KeyboardInterrupt counts too (not one merely raised while handling
    one: the interrupt was over by then).

    Args:
        error: BaseException.

    Returns:
        bool.
    """
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, KeyboardInterrupt):
            return True
        runtime = type(error).__module__.split(".", 1)[0] in _BACKEND_RUNTIMES
        if runtime and _REPORTED_INTERRUPT.search(str(error)):
            return True
        error = error.__cause__
    return False


def interrupt_detail(error, where=None):
    """An `interrupt` event's detail for `error` (`is_interrupt`), landed in `where`."""
    detail = "KeyboardInterrupt" + (f" in {where}" if where else "")
    if not isinstance(error, KeyboardInterrupt):
        detail += (f"; the backend's runtime reported it as {type(error).__name__} (a Ctrl-C inside Python code "
                   "it ran: a data generator, a host callback), which is what was raised")
    return detail


def notice_interrupts(landed):
    """Calls `landed(error)` when a Ctrl-C arrives, before `error` (a
    KeyboardInterrupt) is raised where it landed, as Python's own handler
    raises it.

    For a recording that must hear of an interrupt landing where no guard of
    the lab will see it pass (a line of Keras' fit() between two calls).
    Installed only on the main thread, where Python delivers signals, and
    only over Python's default handler: a handler of the user's (or of an
    embedding) stays as it is.

    Args:
        landed: callable `landed(error)`; what it raises is ignored.

    Returns:
        A callable that puts the previous handler back, where this one is
        still installed.
    """
    if threading.current_thread() is not threading.main_thread():
        return _nothing
    try:
        if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            return _nothing

        def handler(number, frame):
            error = KeyboardInterrupt()
            try:
                landed(error)
            except Exception:  # noqa: BLE001 - the interrupt is what the user asked for
                pass
            raise error

        signal.signal(signal.SIGINT, handler)
    except ValueError:  # an embedding that owns the signals
        return _nothing

    def restore():
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is handler:
            signal.signal(signal.SIGINT, signal.default_int_handler)

    return restore


def _nothing():
    return None


def record_interrupt(run, error, where, step):
    """Adds an `interrupt` event for `error` to `run` where it is one
    (`is_interrupt`) and there is a run; the error is the caller's to raise.

    Args:
        run: `lab.Run` or None.
        error: BaseException.
        where: str, where it landed ("the data, reading step 3's batch").
        step: int, the step it is about.
    """
    if run is not None and is_interrupt(error):
        run.add_event("interrupt", interrupt_detail(error, where), step=step)
