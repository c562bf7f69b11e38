"""Writes binder/requirements.txt: the exact versions installed in this environment.

Run it with the project's interpreter after changing dependencies:

    .venv/bin/python binder/lock.py

It pins the closure of `training-lab[notebook]` (runtime dependencies plus
JupyterLab and the kernel), leaving out the packaging tools Binder brings.
"""

import importlib.metadata as metadata
import pathlib

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = "training-lab"
EXTRAS = ("notebook",)
LEFT_OUT = {"pip", "setuptools", "wheel", ROOT}

HEADER = """\
# Exact versions for Binder (repo2docker), written by binder/lock.py from a
# working environment. The project itself is installed by binder/postBuild.
"""


def closure(root, extras):
    """Names of the distributions `root[extras]` needs, root included."""
    seen = set()
    pending = [(root, tuple(extras))]
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
    names = sorted(closure(ROOT, EXTRAS) - {canonicalize_name(n) for n in LEFT_OUT})
    lines = [f"{metadata.metadata(n)['Name']}=={metadata.version(n)}" for n in names]
    path = pathlib.Path(__file__).with_name("requirements.txt")
    path.write_text(HEADER + "\n".join(lines) + "\n")
    print(f"{path}: {len(lines)} pins")


if __name__ == "__main__":
    main()
