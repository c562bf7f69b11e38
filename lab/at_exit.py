"""Runs saving as they grow are settled when the process ends.

A plain script whose `fit()` is ended by an exception that no guard of the
lab saw exits with the recording still "running": its rows after the last
save are on the device, and its file holds neither them nor what ended it.
At exit the lab settles each recorder still recording (`abandon_if_gone`:
the rows read, the status and the event written, the file saved) with the
exception that ended the script, where Python kept one.
"""

import atexit
import sys
import threading
import weakref

_RECORDING = weakref.WeakSet()  # recorders with a path, while they record
_lock = threading.Lock()
_REGISTERED = []


def settle_at_exit(recorder):
    """Has `recorder.abandon_if_gone(error)` called when the process ends.

    Registered once per process; the recorder is held weakly, so one that
    is gone is forgotten.

    Args:
        recorder: a Recorder with `abandon_if_gone(error=None)`, which does
            nothing when its fit() ended as it should.
    """
    with _lock:
        _RECORDING.add(recorder)
        if not _REGISTERED:
            atexit.register(_settle)
            _REGISTERED.append(_settle)


def _ending_error():
    """The exception that ended the script, where Python kept it (an uncaught one)."""
    return getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)


def _settle():
    error = _ending_error()
    for recorder in list(_RECORDING):
        try:
            recorder.abandon_if_gone(error)
        except Exception:  # noqa: BLE001 - one recorder's failure must not keep the others' rows out
            pass
