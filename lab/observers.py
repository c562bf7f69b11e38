"""Observers: one way for the lab to tell views what happened, with one failure policy.

A run's subscribers, a recorder's status and breakpoint listeners and the
mode-switch listeners all go through `Observers`. A listener that raises is
reported once (a `RuntimeWarning` naming it and the error) and removed:
training never dies of a view.
"""

import threading
import warnings


class Observers:
    """Listeners of one kind of news.

    Args:
        what: str, what the listeners are told of, for the warning
            ("run 'run' rows", "status", ...).

    Example:

    ```python
    news = Observers("status")
    news.add(print)
    news.notify("running", "")   # print("running", "")
    ```
    """

    def __init__(self, what):
        self.what = what
        self._listeners = []
        self._lock = threading.Lock()

    def add(self, fn):
        """Adds `fn`; returns a callable that removes it again."""
        with self._lock:
            self._listeners.append(fn)
        return lambda: self.remove(fn)

    def remove(self, fn):
        with self._lock:
            self._listeners = [f for f in self._listeners if f is not fn and f != fn]

    def __len__(self):
        return len(self._listeners)

    def __bool__(self):
        return bool(self._listeners)

    def notify(self, *args):
        """Calls every listener with `args`; one that raises is reported and removed."""
        for fn in list(self._listeners):
            try:
                fn(*args)
            except Exception as error:  # noqa: BLE001 - a view must not stop training
                self.remove(fn)
                name = getattr(fn, "__qualname__", None) or repr(fn)
                warnings.warn(f"A listener of {self.what} ({name}) raised {error!r} and was removed; "
                              "training goes on.", RuntimeWarning, stacklevel=2)
