"""Status: what a recording is doing, told to the views that listen."""

from lab.observers import Observers


class StatusReporter:
    """A `status` ("idle", "running", "finished", "failed", ...) with listeners.

    Shared by the Recorder and a watched loop's run, so a view follows either
    the same way.
    """

    def _init_status(self):
        self.status, self.status_detail = "idle", ""
        self._status_listeners = Observers("a recording's status")

    def add_status_listener(self, fn):
        """Calls `fn(status, detail)` when the status changes (views use this).

        A listener that raises is reported once and removed.
        """
        self._status_listeners.add(fn)

    def _set_status(self, status, detail=""):
        self.status, self.status_detail = status, detail
        self._status_listeners.notify(status, detail)
