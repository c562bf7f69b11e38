"""Writes binder/requirements.txt: the exact versions installed in this environment.

Run it with the project's interpreter after changing dependencies:

    .venv/bin/python binder/lock.py

It pins what pyproject.toml's runtime dependencies and `notebook` extra need
(JupyterLab and the kernel included), at the versions installed here, leaving
out the packaging tools Binder brings.
"""

import importlib.metadata as metadata
import pathlib
import tomllib

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

PYPROJECT = pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml"
EXTRAS = ("notebook",)
LEFT_OUT = {"pip", "setuptools", "wheel"}

HEADER = """\
# Exact versions for Binder (repo2docker), written by binder/lock.py from a
# working environment. The project itself is installed by binder/postBuild.
"""


def declared():
    """The project's own requirements: runtime plus the extras Binder installs."""
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    lines = list(project["dependencies"])
    for extra in EXTRAS:
        lines += project["optional-dependencies"][extra]
    return [Requirement(line) for line in lines]


def closure(requirements):
    """Names of the installed distributions `requirements` need, themselves included."""
    seen = set()
    pending = [(r.name, tuple(sorted(r.extras))) for r in requirements
               if r.marker is None or r.marker.evaluate({"extra": ""})]
    while pending:
        name, wanted = pending.pop()
        key = (canonicalize_name(name), wanted)
        if key in seen:
            continue
        seen.add(key)
        for line in metadata.distribution(name).requires or []:
            requirement = Requirement(line)
            marker = requirement.marker
            if marker is None or any(marker.evaluate({"extra": extra})
                                     for extra in ("",) + wanted):
                pending.append((requirement.name, tuple(sorted(requirement.extras))))
    return {name for name, _ in seen}


def main():
    names = sorted(closure(declared()) - {canonicalize_name(n) for n in LEFT_OUT})
    lines = [f"{metadata.metadata(n)['Name']}=={metadata.version(n)}" for n in names]
    path = pathlib.Path(__file__).with_name("requirements.txt")
    path.write_text(HEADER + "\n".join(lines) + "\n")
    print(f"{path}: {len(lines)} pins")


if __name__ == "__main__":
    main()
