"""Who is told of a mode switch, on any backend: views such as the ModeSwitch."""

import threading
import warnings
import weakref

_lock = threading.Lock()
_listeners = []  # weak references to fn(model, mode), told of every switch and revert


def add_mode_listener(fn):
    """Calls `fn(model, mode)` after every switch and every revert, on the thread that made it.

    Only a weak reference is kept, so a view that goes away stops listening.

    Args:
        fn: callable `(keras.Model, str) -> None`, e.g. a widget's bound method.
    """
    ref = weakref.WeakMethod(fn) if hasattr(fn, "__self__") else weakref.ref(fn)
    with _lock:
        _listeners.append(ref)


def notify(model, mode):
    """Tells every listener of a switch; a listener that raises is reported once and removed."""
    with _lock:
        _listeners[:] = [ref for ref in _listeners if ref() is not None]
        listeners = [ref() for ref in _listeners]
    for ref, fn in zip(list(_listeners), listeners):
        if fn is None:
            continue
        try:
            fn(model, mode)
        except Exception as error:  # noqa: BLE001 - a view must not stop training
            # The lab's one failure policy (lab.observers): reported once, removed.
            with _lock:
                if ref in _listeners:
                    _listeners.remove(ref)
            warnings.warn(f"A mode listener ({getattr(fn, '__qualname__', fn)!r}) raised {error!r} and was "
                          "removed; training goes on.", RuntimeWarning, stacklevel=2)
