"""`make lab` starts a JupyterLab that answers, as root and as a normal user,
with a kernel that keeps TensorFlow's C++ start-up lines out of the tutorials' cells.

The test runs `make lab` itself (the Makefile's own recipe, which calls
scripts/lab.sh), with this interpreter's environment as the venv and its
install step marked done (`make -o`), in a temporary HOME and Jupyter
folders, on a free port. It reads the URL with its token from what the
server prints, as a person on a headless machine would, and asks that URL's
server for `/api/status`.

Those tests need no browser; they live beside the browser tests because they
need the installed JupyterLab and start a real server. One opens the
quickstart from that server in headless Chromium and runs its first cells, to
see what a newcomer's first cells show.
"""

import contextlib
import json
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

import nbformat
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "lab.sh"
QUICKSTART = "01_quickstart.ipynb"
ANSWER_SECONDS = 60
SET_UP_SECONDS = 300  # TensorFlow's import and the first model, on a busy 2-core machine
NOBODY = 65534

pytestmark = pytest.mark.browser


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _capture_fd_output_off(spec):
    """Whether a kernel spec's kernel leaves what C++ code writes to stdout and
    stderr on the server's terminal instead of sending it into cells."""
    return "--IPKernelApp.capture_fd_output=False" in spec["argv"]


def _venv_kernel_as_ipykernel_installs_it():
    """Puts back the venv's python3 kernel spec as a fresh venv has it
    (ipykernel's own), so what a test sees of it next is `make lab`'s doing."""
    kernels = pathlib.Path(sys.prefix) / "share" / "jupyter" / "kernels"
    if not os.access(kernels, os.W_OK):
        pytest.skip(f"{kernels} is not writable by this user")
    subprocess.run([sys.executable, "-m", "ipykernel", "install", "--sys-prefix"], check=True,
                   capture_output=True)


def _make_lab_args(extra_lab_args=""):
    """`make lab` for this interpreter's environment, without its install step."""
    venv = pathlib.Path(sys.prefix)
    return ["make", "--no-print-directory", "-C", str(ROOT), "-o", str(venv / "bin" / ".installed"),
            "lab", f"VENV={venv}", f"LAB_ARGS={extra_lab_args}"]


def _environment(base):
    # A user's environment: among what goes, PYTEST_CURRENT_TEST, under which
    # ipykernel never sends C++ output into cells, whatever the kernel spec says.
    env = {key: value for key, value in os.environ.items()
           if key not in ("DISPLAY", "WAYLAND_DISPLAY", "JUPYTER_PATH", "JUPYTER_TOKEN", "MAKEFLAGS", "MFLAGS",
                          "PYTEST_CURRENT_TEST")}
    for name, relative in {"HOME": "home", "JUPYTER_CONFIG_DIR": "config", "JUPYTER_DATA_DIR": "data",
                           "JUPYTER_RUNTIME_DIR": "runtime", "JUPYTERLAB_SETTINGS_DIR": "settings",
                           "JUPYTERLAB_WORKSPACES_DIR": "workspaces", "IPYTHONDIR": "ipython",
                           "XDG_CONFIG_HOME": "home/.config", "XDG_CACHE_HOME": "home/.cache"}.items():
        path = base / relative
        path.mkdir(parents=True, exist_ok=True)
        env[name] = str(path)
    env["PYTHONNOUSERSITE"] = "1"
    return env


def _api(url, token, method, path):
    """The server's answer to `method /api/path`, parsed (None if empty)."""
    request = urllib.request.Request(f"{url}/api/{path}", method=method,
                                     headers={"Authorization": f"token {token}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        body = response.read()
    return json.loads(body) if body else None


def _page(url):
    """The page at the printed URL, as a browser gets it (the token becomes a cookie)."""
    import http.cookiejar

    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar()))
    with opener.open(url, timeout=30) as response:
        return response.status, response.read().decode(errors="replace")


class MakeLab:
    """A running `make lab`: the URL it printed, its token, what it printed so
    far, and what the browser fixtures (`page`, `open_notebook`) ask of a server."""

    def __init__(self, env, url, token, printed_url, seconds, lines):
        self.env = env
        self.url = url
        self.token = token
        self.printed_url = printed_url
        self.seconds = seconds
        self._lines = lines

    def printed(self):
        return b"".join(self._lines).decode(errors="replace")

    def api(self, method, path):
        return _api(self.url, self.token, method, path)

    def page_url(self, notebook):
        """The URL `make lab` printed; it opens the quickstart (`notebook`) itself."""
        assert self.printed_url.split("?")[0].endswith(f"/lab/tree/{notebook}"), self.printed_url
        return self.printed_url

    def delete_sessions(self):
        for session in self.api("GET", "sessions"):
            self.api("DELETE", f"sessions/{session['id']}")

    def reset_workspaces(self):
        """Nothing to do: each test starts `make lab` afresh, with no saved tabs."""


@contextlib.contextmanager
def _make_lab(base, prefix=(), owner=None, lab_args="", settings=None):
    """Starts `make lab`, waits for the printed URL and for /api/status on it;
    yields a MakeLab; stops it. `settings(folder)` may write JupyterLab user
    settings first."""
    port = _free_port()
    command = [*prefix, *_make_lab_args(f"--ServerApp.port={port} --ServerApp.port_retries=0 {lab_args}")]
    env = _environment(base)
    if settings is not None:
        settings(pathlib.Path(env["JUPYTERLAB_SETTINGS_DIR"]))
    if owner is not None:
        for path in [base, *base.rglob("*")]:
            os.chown(path, owner, owner)
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, start_new_session=True)
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(iter(process.stdout.readline, b"")), daemon=True)
    reader.start()
    started = time.monotonic()
    url = token = lab = None
    try:
        while time.monotonic() - started < ANSWER_SECONDS:
            printed = b"".join(lines).decode(errors="replace")
            if process.poll() is not None:
                time.sleep(0.5)  # the reader's last lines
                pytest.fail(f"`make lab` exited with {process.returncode}:\n"
                            + b"".join(lines).decode(errors="replace")[-4000:])
            found = re.search(r"http://127\.0\.0\.1:(\d+)/\S*\?token=([0-9a-f]+)", printed)
            if found:
                assert int(found.group(1)) == port, found.group(0)
                url, token = f"http://127.0.0.1:{port}", found.group(2)
                try:
                    _api(url, token, "GET", "status")
                    lab = MakeLab(env, url, token, found.group(0), time.monotonic() - started, lines)
                    break
                except (urllib.error.URLError, ConnectionError):
                    pass
            time.sleep(0.25)
        else:
            pytest.fail(f"`make lab` did not answer /api/status within {ANSWER_SECONDS} s:\n"
                        + b"".join(lines).decode(errors="replace")[-4000:])
        status, body = _page(lab.printed_url)
        assert status == 200 and "jupyter-config-data" in body, (status, body[:500])
        yield lab
    finally:
        try:
            if url and process.poll() is None:
                _api(url, token, "POST", "shutdown")
                process.wait(timeout=30)
        except (urllib.error.URLError, ConnectionError, subprocess.TimeoutExpired):
            pass
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        reader.join(timeout=5)


@pytest.fixture
def lab_home():
    """A temporary folder any user can reach (pytest's own tmp_path is root-only)."""
    pytest.importorskip("jupyterlab", reason="JupyterLab (the notebook extra) is not installed")
    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    base = pathlib.Path(tempfile.mkdtemp(prefix="make-lab-"))
    base.chmod(0o755)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def test_make_lab_calls_scripts_lab_sh_with_the_venvs_jupyter():
    recipe = subprocess.run([*_make_lab_args(), "-n"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout
    assert f"JUPYTER={sys.prefix}/bin/jupyter sh scripts/lab.sh" in recipe, recipe


@pytest.mark.parametrize("uid, display, expected", [
    ("0", "", ["--allow-root", "--no-browser", "--ServerApp.ip=127.0.0.1"]),
    ("1000", "", ["--no-browser", "--ServerApp.ip=127.0.0.1"]),
    ("0", ":0", ["--allow-root", "--ServerApp.ip=127.0.0.1"]),
    ("1000", ":0", ["--ServerApp.ip=127.0.0.1"]),
])
def test_lab_sh_adds_allow_root_only_as_root_and_no_browser_only_without_a_display(uid, display, expected):
    if sys.platform == "darwin" and not display:
        expected = [option for option in expected if option != "--no-browser"]
    env = {key: value for key, value in os.environ.items() if key not in ("DISPLAY", "WAYLAND_DISPLAY")}
    env["LAB_UID"] = uid
    if display:
        env["DISPLAY"] = display
    printed = subprocess.run(["sh", str(SCRIPT), "--print-options"], env=env, capture_output=True,
                             text=True, check=True).stdout
    assert printed.split() == expected


def test_make_lab_answers_within_a_minute_as_this_user_and_prints_its_url(lab_home):
    with _make_lab(lab_home) as lab:
        seconds, url, printed = lab.seconds, lab.printed_url, lab.printed()
    assert "Running as root is not recommended" not in printed
    assert ("--allow-root" in printed) == (os.getuid() == 0), printed[-2000:]
    assert "--no-browser" in printed or sys.platform == "darwin", printed[-2000:]
    assert "/lab/tree/01_quickstart.ipynb?token=" in url, url
    print(f"`make lab` as uid {os.getuid()} answered /api/status after {seconds:.1f} s at {url}")


def test_make_lab_answers_as_a_normal_user(lab_home):
    if os.getuid() != 0:
        with _make_lab(lab_home) as lab:
            assert "--allow-root" not in lab.printed()
            assert _capture_fd_output_off(lab.api("GET", "kernelspecs/python3")["spec"])
        return
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv: no way to run `make lab` as another user")
    as_nobody = [setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    # As make will: through sh (a venv whose interpreter lives under /root is out of reach).
    jupyter = pathlib.Path(sys.prefix) / "bin" / "jupyter"
    probe = subprocess.run([*as_nobody, "sh", "-c", f"'{jupyter}' lab --version"], cwd=ROOT,
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"user {NOBODY} cannot run {jupyter}: {probe.stderr.strip()[-300:]}")
    with _make_lab(lab_home, prefix=as_nobody, owner=NOBODY) as lab:
        printed = lab.printed()
        assert "--allow-root" not in printed, printed[-2000:]
        # The venv is root's: this server reads the tutorials' kernel from the repository.
        spec = lab.api("GET", "kernelspecs/python3")["spec"]
        assert _capture_fd_output_off(spec), (spec, printed[-2000:])
    print(f"`make lab` as uid {NOBODY} answered /api/status after {lab.seconds:.1f} s at {lab.printed_url}")


def test_make_lab_installs_the_tutorials_kernel_where_the_venvs_own_jupyter_finds_it(lab_home):
    _venv_kernel_as_ipykernel_installs_it()
    with _make_lab(lab_home) as lab:
        printed = lab.printed()
    # Later, `jupyter lab` started from the venv by hand, without make or JUPYTER_PATH.
    listed = subprocess.run([str(pathlib.Path(sys.prefix) / "bin" / "jupyter"), "kernelspec", "list", "--json"],
                            env=_environment(lab_home / "later"), capture_output=True, text=True, check=True)
    python3 = json.loads(listed.stdout)["kernelspecs"]["python3"]
    assert pathlib.Path(python3["resource_dir"]).is_relative_to(sys.prefix), (python3, printed[-2000:])
    assert _capture_fd_output_off(python3["spec"]), (python3, printed[-2000:])


# The first cells up to `count`: run as a person runs them (the active cell
# below them, then "Run All Above"), and what they showed once the kernel is
# idle again, each output with its MIME type.
RUN_ABOVE_JS = """(count) => {
    window.jupyterapp.shell.currentWidget.content.activeCellIndex = count;
    window.jupyterapp.commands.execute('notebook:run-all-above');
}"""
RAN_ABOVE_JS = """(count) => {
    const widget = window.jupyterapp.shell.currentWidget;
    const kernel = widget.sessionContext.session && widget.sessionContext.session.kernel;
    const prompts = [...document.querySelectorAll('.jp-Notebook .jp-Cell')].slice(0, count)
        .filter(cell => cell.classList.contains('jp-CodeCell'))
        .map(cell => cell.querySelector('.jp-InputArea-prompt').textContent);
    return !!kernel && kernel.status === 'idle' && prompts.every(p => /\\[\\d+\\]/.test(p));
}"""
OUTPUTS_ABOVE_JS = """(count) => [...document.querySelectorAll('.jp-Notebook .jp-Cell')].slice(0, count)
    .flatMap((cell, index) => [...cell.querySelectorAll('.jp-OutputArea-output')].map(output => ({
        cell: index, mime: output.getAttribute('data-mime-type'), text: output.textContent})))"""


@pytest.fixture
def lab_server(chromium_path, lab_home, write_lab_settings):
    """`make lab` itself, from a venv whose kernel spec is ipykernel's own, for
    the `page` and `open_notebook` fixtures (the app exposed to the page's
    scripts; nothing written beside the repository's notebook: no autosave, and
    the checkpoint JupyterLab makes when it opens a notebook kept in lab_home)."""
    _venv_kernel_as_ipykernel_installs_it()
    lab_args = f"--LabApp.expose_app_in_browser=True --FileCheckpoints.checkpoint_dir={lab_home / 'checkpoints'}"
    with _make_lab(lab_home, lab_args=lab_args, settings=write_lab_settings) as lab:
        yield lab


def test_the_quickstarts_first_cells_show_no_stderr_when_started_by_make_lab(lab_server, page, open_notebook):
    cells = nbformat.read(ROOT / "notebooks" / QUICKSTART, as_version=4).cells
    training = next(index for index, cell in enumerate(cells)
                    if cell.cell_type == "code" and ".fit(" in cell.source)
    open_notebook(QUICKSTART)
    page.evaluate(RUN_ABOVE_JS, training)
    page.wait_for_function(RAN_ABOVE_JS, arg=training, timeout=SET_UP_SECONDS * 1000)
    outputs = page.evaluate(OUTPUTS_ABOVE_JS, training)
    stderr = [output for output in outputs if output["mime"] == "application/vnd.jupyter.stderr"]
    assert not stderr, ("the quickstart's first cells, as `make lab` runs them, show stderr:\n"
                        + "\n".join(f"cell {o['cell']}: {o['text']}" for o in stderr)[-3000:])
    # The cells' own results did reach the page (the data's shapes).
    assert any(output["mime"] == "text/plain" for output in outputs), outputs
