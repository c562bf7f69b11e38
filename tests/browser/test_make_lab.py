"""`make lab` starts a JupyterLab that answers, as root and as a normal user.

The test runs `make lab` itself (the Makefile's own recipe, which calls
scripts/lab.sh), with this interpreter's environment as the venv and its
install step marked done (`make -o`), in a temporary HOME and Jupyter
folders, on a free port. It reads the URL with its token from what the
server prints, as a person on a headless machine would, and asks that URL's
server for `/api/status`.

No browser is needed; it lives beside the browser tests because it needs the
installed JupyterLab and starts a real server.
"""

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

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "lab.sh"
ANSWER_SECONDS = 60
NOBODY = 65534

pytestmark = pytest.mark.browser


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _make_lab_args(extra_lab_args=""):
    """`make lab` for this interpreter's environment, without its install step."""
    venv = pathlib.Path(sys.prefix)
    return ["make", "--no-print-directory", "-C", str(ROOT), "-o", str(venv / "bin" / ".installed"),
            "lab", f"VENV={venv}", f"LAB_ARGS={extra_lab_args}"]


def _environment(base):
    env = {key: value for key, value in os.environ.items()
           if key not in ("DISPLAY", "WAYLAND_DISPLAY", "JUPYTER_PATH", "JUPYTER_TOKEN", "MAKEFLAGS", "MFLAGS")}
    for name, relative in {"HOME": "home", "JUPYTER_CONFIG_DIR": "config", "JUPYTER_DATA_DIR": "data",
                           "JUPYTER_RUNTIME_DIR": "runtime", "JUPYTERLAB_SETTINGS_DIR": "settings",
                           "JUPYTERLAB_WORKSPACES_DIR": "workspaces", "IPYTHONDIR": "ipython",
                           "XDG_CONFIG_HOME": "home/.config", "XDG_CACHE_HOME": "home/.cache"}.items():
        path = base / relative
        path.mkdir(parents=True, exist_ok=True)
        env[name] = str(path)
    env["PYTHONNOUSERSITE"] = "1"
    return env


def _status(url, token):
    request = urllib.request.Request(f"{url}/api/status", headers={"Authorization": f"token {token}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return response.status


def _page(url):
    """The page at the printed URL, as a browser gets it (the token becomes a cookie)."""
    import http.cookiejar

    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar()))
    with opener.open(url, timeout=30) as response:
        return response.status, response.read().decode(errors="replace")


def _shutdown(url, token):
    request = urllib.request.Request(f"{url}/api/shutdown", method="POST",
                                     headers={"Authorization": f"token {token}"})
    urllib.request.urlopen(request, timeout=10).read()


def _run_make_lab(base, prefix=(), owner=None):
    """Starts `make lab`, waits for the printed URL and for /api/status on it;
    returns (seconds to answer, the URL printed, everything printed); stops it."""
    port = _free_port()
    command = [*prefix, *_make_lab_args(f"--ServerApp.port={port} --ServerApp.port_retries=0")]
    env = _environment(base)
    if owner is not None:
        for path in [base, *base.rglob("*")]:
            os.chown(path, owner, owner)
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, start_new_session=True)
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(iter(process.stdout.readline, b"")), daemon=True)
    reader.start()
    started = time.monotonic()
    url = token = None
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
                    if _status(url, token) == 200:
                        seconds = time.monotonic() - started
                        status, body = _page(found.group(0))
                        assert status == 200 and "jupyter-config-data" in body, (status, body[:500])
                        return seconds, found.group(0), printed
                except (urllib.error.URLError, ConnectionError):
                    pass
            time.sleep(0.25)
        pytest.fail(f"`make lab` did not answer /api/status within {ANSWER_SECONDS} s:\n"
                    + b"".join(lines).decode(errors="replace")[-4000:])
    finally:
        try:
            if url and process.poll() is None:
                _shutdown(url, token)
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
    seconds, url, printed = _run_make_lab(lab_home)
    assert "Running as root is not recommended" not in printed
    assert ("--allow-root" in printed) == (os.getuid() == 0), printed[-2000:]
    assert "--no-browser" in printed or sys.platform == "darwin", printed[-2000:]
    assert "/lab/tree/01_quickstart.ipynb?token=" in url, url
    print(f"`make lab` as uid {os.getuid()} answered /api/status after {seconds:.1f} s at {url}")


def test_make_lab_answers_as_a_normal_user(lab_home):
    if os.getuid() != 0:
        seconds, _, printed = _run_make_lab(lab_home)
        assert "--allow-root" not in printed
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
    seconds, url, printed = _run_make_lab(lab_home, prefix=as_nobody, owner=NOBODY)
    assert "--allow-root" not in printed, printed[-2000:]
    print(f"`make lab` as uid {NOBODY} answered /api/status after {seconds:.1f} s at {url}")
