"""Status: what a recording is doing, told to the views that listen."""

from lab.observers import Observers

STATUS_KEY = "status"  # in a run's metadata: the status of the recording that wrote it


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
        kept = self._status_kept_in()
        if kept is not None:
            kept[STATUS_KEY] = status
        self._status_listeners.notify(status, detail)

    def _status_kept_in(self):
        """The run metadata that keeps the status, so that a run's file says
        how its recording ended ("interrupted", "failed", ...); None: none."""
        return None
