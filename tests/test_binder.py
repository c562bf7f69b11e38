"""Binder's locked environment agrees with what pyproject.toml declares.

No network: the pins in binder/requirements.txt are read as text and checked
against the bounds in pyproject.toml with `packaging`.
"""

import pathlib
import re
import subprocess
import sys
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = pathlib.Path(__file__).resolve().parents[1]
BINDER = ROOT / "binder"
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
EXTRAS_ON_BINDER = ("notebook",)


def _pins():
    """{canonical name: Version} from binder/requirements.txt."""
    pins = {}
    for number, raw in enumerate((BINDER / "requirements.txt").read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        requirement = Requirement(line)
        (specifier,) = requirement.specifier  # exactly one clause
        assert specifier.operator == "==", f"line {number} is not an exact pin: {raw!r}"
        name = canonicalize_name(requirement.name)
        assert name not in pins, f"line {number} pins {requirement.name} twice"
        pins[name] = Version(specifier.version)
    return pins


def _declared():
    """The project's requirements Binder must satisfy: runtime plus the notebook extra."""
    lines = list(PROJECT["dependencies"])
    for extra in EXTRAS_ON_BINDER:
        lines += PROJECT["optional-dependencies"][extra]
    return [Requirement(line) for line in lines]


PINS = _pins()
DECLARED = _declared()


@pytest.mark.parametrize("requirement", DECLARED, ids=str)
def test_each_declared_dependency_is_pinned_within_its_bounds(requirement):
    if requirement.marker is not None and not requirement.marker.evaluate(
            {"python_version": _binder_python(), "extra": ""}):
        pytest.skip(f"{requirement} does not apply on Binder's Python")
    name = canonicalize_name(requirement.name)
    assert name in PINS, f"binder/requirements.txt does not pin {requirement.name}"
    assert requirement.specifier.contains(PINS[name], prereleases=True), (
        f"Binder pins {requirement.name}=={PINS[name]}, outside {requirement.specifier} "
        "from pyproject.toml; rerun binder/lock.py in an environment that satisfies it")


def _binder_python():
    text = (BINDER / "runtime.txt").read_text().strip()
    match = re.fullmatch(r"python-(\d+\.\d+)", text)
    assert match, f"binder/runtime.txt should read like 'python-3.11', not {text!r}"
    return match.group(1)


def test_binder_python_is_supported_by_the_project():
    python = _binder_python()
    assert python == "3.11"
    assert SpecifierSet(PROJECT["requires-python"]).contains(python)


def test_the_project_itself_is_installed_by_post_build():
    post_build = BINDER / "postBuild"
    assert post_build.stat().st_mode & 0o111, "binder/postBuild must be executable"
    assert re.search(r"pip install\b.*-e \.", post_build.read_text())
    assert "training-lab" not in PINS, "the project must come from this checkout, not a pin"


def test_post_build_installs_the_tutorials_kernel_that_make_lab_installs(tmp_path):
    """Binder's python3 kernel is the one `make lab` gives: TensorFlow's C++
    start-up lines go to the server's log, not into the first cell."""
    kernelspec = pytest.importorskip("jupyter_client.kernelspec")
    found = re.search(r"^jupyter (kernelspec install .*--sys-prefix.*)$", (BINDER / "postBuild").read_text(), re.M)
    assert found, "binder/postBuild should install the tutorials' kernel spec (jupyter/kernels/python3)"
    arguments = found.group(1).replace("--sys-prefix", f"--prefix={tmp_path}").split()
    subprocess.run([sys.executable, "-m", "jupyter", *arguments], cwd=ROOT, check=True, capture_output=True)
    manager = kernelspec.KernelSpecManager(kernel_dirs=[str(tmp_path / "share" / "jupyter" / "kernels")])
    spec = manager.get_kernel_spec("python3")
    assert "--IPKernelApp.capture_fd_output=False" in spec.argv, spec.argv


def test_start_script_passes_the_command_on():
    start = BINDER / "start"
    assert start.stat().st_mode & 0o111, "binder/start must be executable"
    assert 'exec "$@"' in start.read_text()


def test_the_quickstart_binder_opens_exists():
    assert (ROOT / "notebooks" / "01_quickstart.ipynb").is_file()
