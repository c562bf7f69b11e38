"""Status: what a recording is doing, told to the views that listen."""


class StatusReporter:
    """A `status` ("idle", "running", "finished", "failed", ...) with listeners.

    Shared by the Recorder and a watched loop's run, so a view follows either
    the same way.
    """

    def _init_status(self):
        self.status, self.status_detail = "idle", ""
        self._status_listeners = []

    def add_status_listener(self, fn):
        """Calls `fn(status, detail)` when the status changes (views use this)."""
        self._status_listeners.append(fn)

    def _set_status(self, status, detail=""):
        self.status, self.status_detail = status, detail
        for fn in list(self._status_listeners):
            try:
                fn(status, detail)
            except Exception:  # noqa: BLE001 - a view must not stop training
                self._status_listeners.remove(fn)
