"""A private JupyterLab server and a headless Chromium page for browser tests.

The server binds 127.0.0.1 on a free port with a random token, runs as root
if need be, and keeps everything it writes (settings, runtime files, kernels'
IPython and Keras homes, the browser profile) in a temporary folder. The
notebooks it serves are copies with their outputs cleared, so a run never
writes into the repository, and what a test sees in the page comes from that
run alone.
"""

import json
import os
import pathlib
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import nbformat
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHROMIUM = pathlib.Path(os.environ.get("TRAINING_LAB_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SERVER_START_SECONDS = 180

# User settings that keep a scripted session quiet and the repository untouched.
LAB_SETTINGS = {
    # No news toast over the screenshots, no request to the network.
    "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
    # Outputs of the run must not be saved into the notebook under test.
    "@jupyterlab/docmanager-extension/plugin": {"autosave": False},
    # Every cell stays in the DOM, so the page can be read wherever it is scrolled;
    # the notebook's kernel starts without a "Select Kernel" dialog.
    "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none",
                                               "autoStartDefaultKernel": True},
}


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "browser: runs JupyterLab and drives it from headless Chromium (/usr/bin/chromium)")


# The notebook's own kernel, connected and idle. (The status bar reads "idle"
# before any kernel exists, and a run-all sent then does nothing.)
KERNEL_READY_JS = """() => {
    const widget = window.jupyterapp && window.jupyterapp.shell.currentWidget;
    const session = widget && widget.sessionContext && widget.sessionContext.session;
    const kernel = session && session.kernel;
    return !!kernel && kernel.connectionStatus === 'connected' && kernel.status === 'idle';
}"""


def artifacts_dir():
    """Where screenshots go: $TRAINING_LAB_ARTIFACTS, else artifacts/ at the repository root."""
    path = pathlib.Path(os.environ.get("TRAINING_LAB_ARTIFACTS", ROOT / "artifacts"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _write_settings(settings_dir):
    for plugin, values in LAB_SETTINGS.items():
        path = settings_dir / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))


class LabServer:
    """A running JupyterLab: its URL, token, served folder, environment and log."""

    def __init__(self, base, notebook_dir):
        self.base = base
        self.notebook_dir = notebook_dir
        self.token = secrets.token_hex(16)
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = base / "jupyterlab.log"
        self.env = self._environment()
        self.process = None

    def _environment(self):
        env = dict(os.environ)
        dirs = {"HOME": "home", "JUPYTER_CONFIG_DIR": "config", "JUPYTER_DATA_DIR": "data",
                "JUPYTER_RUNTIME_DIR": "runtime", "JUPYTERLAB_SETTINGS_DIR": "settings",
                "JUPYTERLAB_WORKSPACES_DIR": "workspaces", "IPYTHONDIR": "ipython",
                "KERAS_HOME": "keras", "XDG_CONFIG_HOME": "home/.config",
                "XDG_CACHE_HOME": "home/.cache"}
        for name, relative in dirs.items():
            path = self.base / relative
            path.mkdir(parents=True, exist_ok=True)
            env[name] = str(path)
        env.pop("JUPYTER_PATH", None)
        env["TF_CPP_MIN_LOG_LEVEL"] = "2"
        env["PYTHONNOUSERSITE"] = "1"
        _write_settings(self.base / "settings")
        return env

    def command(self):
        """The server's command line (NotebookServer runs Notebook 7 instead)."""
        return [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root",
                "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={self.port}",
                "--ServerApp.port_retries=0", f"--IdentityProvider.token={self.token}",
                f"--ServerApp.root_dir={self.notebook_dir}",
                "--LabApp.expose_app_in_browser=True"]

    def jupyter(self, *args):
        """Runs `jupyter ARGS` in this server's environment (its own config and
        data folders): `server.jupyter("labextension", "disable", "--level=user", name)`
        changes this server's settings only. Call it before start()."""
        return subprocess.run([sys.executable, "-m", "jupyter", *args], cwd=self.base, env=self.env,
                              capture_output=True, text=True, check=True)

    def start(self):
        command = self.command()
        log = open(self.log_path, "wb")
        self.process = subprocess.Popen(command, cwd=self.notebook_dir, env=self.env, stdout=log,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + SERVER_START_SECONDS
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"JupyterLab exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                self.api("GET", "status")
                return self
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.5)
        raise RuntimeError(f"JupyterLab did not answer in {SERVER_START_SECONDS} s:\n{self.log_tail()}")

    def api(self, method, path):
        request = urllib.request.Request(f"{self.url}/api/{path}", method=method,
                                         headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(request, timeout=30) as response:
            body = response.read()
        return json.loads(body) if body else None

    def reset_workspaces(self):
        """JupyterLab restores a page's open tabs from its workspace file: without
        this a new page reopens the notebooks of earlier tests beside its own."""
        for path in (self.base / "workspaces").glob("*"):
            if path.is_file():
                path.unlink()

    def delete_sessions(self):
        """A kernel outlives its page: without this a new page reconnects to an old kernel."""
        for session in self.api("GET", "sessions"):
            self.api("DELETE", f"sessions/{session['id']}")

    def page_url(self, notebook):
        return f"{self.url}/lab/tree/{notebook}?token={self.token}"

    def log_tail(self, lines=60):
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self):
        if self.process is None or self.process.poll() is not None:
            return
        try:
            self.api("POST", "shutdown")  # also shuts its kernels down
            self.process.wait(timeout=60)
        except (urllib.error.URLError, ConnectionError, subprocess.TimeoutExpired):
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


class NotebookServer(LabServer):
    """Notebook 7 (`jupyter notebook`) instead of JupyterLab; same settings,
    same `window.jupyterapp`, notebooks at /notebooks/<name>."""

    def command(self):
        return [sys.executable, "-m", "notebook", "--no-browser", "--allow-root",
                "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={self.port}",
                "--ServerApp.port_retries=0", f"--IdentityProvider.token={self.token}",
                f"--ServerApp.root_dir={self.notebook_dir}",
                "--JupyterNotebookApp.expose_app_in_browser=True"]

    def page_url(self, notebook):
        return f"{self.url}/notebooks/{notebook}?token={self.token}"


def copy_without_outputs(source, folder):
    """A copy of notebook `source` in `folder`, outputs and execution counts cleared."""
    notebook = nbformat.read(source, as_version=4)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
    target = folder / source.name
    nbformat.write(notebook, target)
    return target


@pytest.fixture(scope="session")
def write_lab_settings():
    """`write_lab_settings(folder)`: LAB_SETTINGS in a JupyterLab user settings
    folder, for a server a test starts its own way (as `make lab` does)."""
    return _write_settings


@pytest.fixture(scope="session")
def artifacts():
    """The folder where a browser test leaves its screenshots."""
    return artifacts_dir()


@pytest.fixture(scope="session")
def chromium_path():
    if not CHROMIUM.exists():
        pytest.skip(f"no Chromium at {CHROMIUM} (install Debian's `chromium` package, "
                    "or set TRAINING_LAB_CHROMIUM)")
    pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")
    return CHROMIUM


@pytest.fixture(scope="session")
def lab_server(chromium_path, tmp_path_factory):
    base = tmp_path_factory.mktemp("jupyterlab")
    notebook_dir = base / "notebooks"
    notebook_dir.mkdir()
    for source in sorted((ROOT / "notebooks").glob("*.ipynb")):
        copy_without_outputs(source, notebook_dir)
    server = LabServer(base, notebook_dir).start()
    yield server
    server.stop()
    if os.environ.get("TRAINING_LAB_KEEP_SERVER_LOG"):
        shutil.copy(server.log_path, artifacts_dir() / "jupyterlab.log")


# Run all cells without handing the command's promise back: Playwright would
# otherwise wait for every cell to finish before the first sample.
RUN_ALL_JS = "() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }"

# Installed in every page before its own scripts: each time a plotly widget's
# chart draws, the length of its "loss" trace is appended to
# `window.trainingLabLossDraws`. A test reads what the page drew, every draw,
# however slowly it samples: on a cold machine the page answered a sample
# only once a second while the quickstart's three seconds of training were
# drawn, and no sample saw a partial run that the chart did draw.
# `plotlywidget-after-render` is the plotly widget's own event, sent once its
# view has drawn for the first time (a later `newPlot` would drop listeners
# added before it).
LOSS_DRAWS_JS = """(() => {
    window.trainingLabLossDraws = [];
    document.addEventListener('plotlywidget-after-render', (event) => {
        const plot = event.detail.element;
        const record = () => {
            const trace = (plot.data || []).find(t => t.name === 'loss');
            if (trace && trace.y) window.trainingLabLossDraws.push(trace.y.length);
        };
        record();
        plot.on('plotly_afterplot', record);
    });
})();"""
RUNNING_JS = "() => [...document.querySelectorAll('.jp-InputArea-prompt')].some(p => p.textContent.includes('*'))"


def run_all_and_sample(page, sample_js, arg=None, on_sample=None, seconds=600, every=0.25):
    """Runs all cells of the open notebook and samples the page every `every`
    seconds until a sample says `done`; returns the samples (each with `t`,
    monotonic seconds). `sample_js` returns a dict with at least `done`,
    `status` (the execution indicator's), `errors` (failed outputs' text) and
    `dialog`; `on_sample(sample)` runs after each sample (a screenshot, say)."""
    page.evaluate(RUN_ALL_JS)
    page.wait_for_function(RUNNING_JS, timeout=60_000)
    samples, idle_since = [], None
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        sample = page.evaluate(sample_js, arg)
        sample["t"] = time.monotonic()
        samples.append(sample)
        if sample["dialog"]:
            pytest.fail(f"a dialog blocks the notebook: {sample['dialog']!r}")
        if sample["errors"]:
            pytest.fail("a cell failed in the page:\n" + "\n".join(sample["errors"])[-3000:])
        if sample["done"]:
            return samples
        if on_sample is not None:
            on_sample(sample)
        # A run-all that stopped early leaves the kernel idle with no last output.
        if sample["status"] == "idle" and any(s["status"] == "busy" for s in samples):
            idle_since = idle_since or sample["t"]
            if sample["t"] - idle_since > 30:
                pytest.fail("the kernel went idle before the notebook's last output appeared")
        else:
            idle_since = None
        page.wait_for_timeout(every * 1000)
    pytest.fail(f"the notebook did not finish in {seconds} s; last sample {samples[-1]}")


@pytest.fixture(scope="module")
def start_server(chromium_path, tmp_path_factory):
    """A function that starts a server of the test module's own, stopped after
    the module: `start_server(app="lab", notebooks=("01_quickstart.ipynb",),
    edit=None, configure=None)`. app "notebook" runs Notebook 7. `edit(name,
    notebook)` may change each served copy (an nbformat notebook, outputs
    cleared) before it is written; `configure(server)` runs before the server
    starts (its settings: `server.jupyter(...)`, files under `server.base`).
    A module that overrides `lab_server` with it gets `page` and
    `open_notebook` on that server."""
    servers = []

    def start(app="lab", notebooks=("01_quickstart.ipynb",), edit=None, configure=None):
        base = tmp_path_factory.mktemp(app)
        notebook_dir = base / "notebooks"
        notebook_dir.mkdir()
        for name in notebooks:
            target = copy_without_outputs(ROOT / "notebooks" / name, notebook_dir)
            if edit is not None:
                notebook = nbformat.read(target, as_version=4)
                edit(name, notebook)
                nbformat.write(notebook, target)
        server = (NotebookServer if app == "notebook" else LabServer)(base, notebook_dir)
        if configure is not None:
            configure(server)
        servers.append(server)
        return server.start()

    yield start
    for server in servers:
        server.stop()
        if os.environ.get("TRAINING_LAB_KEEP_SERVER_LOG"):
            shutil.copy(server.log_path, artifacts_dir() / f"{server.base.name}.log")


@pytest.fixture
def page(lab_server):
    from playwright.sync_api import sync_playwright

    lab_server.delete_sessions()
    lab_server.reset_workspaces()
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True,
                                             args=CHROMIUM_FLAGS, env=lab_server.env)
        context = browser.new_context(viewport={"width": 1280, "height": 1000})
        context.add_init_script(LOSS_DRAWS_JS)
        page = context.new_page()
        page.set_default_timeout(120_000)
        try:
            yield page
        finally:
            context.close()
            browser.close()


@pytest.fixture
def open_notebook(page, lab_server):
    """A function that opens a served notebook in the page, by name, and waits
    for its cells and its own idle kernel."""

    def open_(notebook):
        page.goto(lab_server.page_url(notebook), wait_until="domcontentloaded")
        page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=180_000)
        page.wait_for_function(KERNEL_READY_JS, timeout=180_000)

    return open_


@pytest.fixture
def assert_drawn_live():
    """`assert_drawn_live(draws, total)`: the loss trace's lengths at each draw
    the page recorded (`LOSS_DRAWS_JS`) show a chart that grew while a run of
    `total` steps trained, without its first refreshes holding it back."""

    def check(draws, total):
        assert draws, ("the page recorded no draw of the chart: the plotly widget sent no "
                       "`plotlywidget-after-render` event (LOSS_DRAWS_JS listens for it)")
        # After its first points the chart drew again within the first third
        # of the run (paced by each refresh alone, the quickstart's drew 1
        # point and then 270 of 360; 45 since).
        partial = sorted({n for n in draws if 0 < n < total})
        assert len(partial) >= 2 and partial[1] < total / 3, (
            f"the chart did not grow while training; the loss trace's lengths at each draw: {draws}")
        assert draws == sorted(draws), f"the loss trace lost points between draws: {draws}"

    return check


@pytest.fixture
def run_and_sample(page):
    """`run_and_sample(sample_js, arg=None, on_sample=None, ...)`: `run_all_and_sample`
    on this test's page (test modules cannot import conftest)."""

    def run(sample_js, arg=None, **options):
        return run_all_and_sample(page, sample_js, arg, **options)

    return run
