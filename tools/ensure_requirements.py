"""Install the examples' requirements into the running venv, only when one is missing.

    python tools/ensure_requirements.py [pip args...]

Reads examples/*/requirements.txt. A requirement counts as present when its distribution is
installed (any version), so an offline machine that already has them never reaches for pip.
Otherwise pip installs them with the venv's torch pinned to the installed version, so that a
dependency (torchvision, via timm) resolves to the matching build instead of replacing torch.
A line marked `# [no-deps]` is installed without its dependencies (a package whose declared
dependencies cannot be installed, e.g. adv-lib's visdom, an sdist that no longer builds; its
file lists what it really needs).
"""
import glob
import importlib.metadata
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def requirements(path):
    """(requirement, distribution name, no_deps) for each line of a requirements file."""
    for raw in open(path):
        line, _, comment = raw.partition("#")
        line = line.strip()
        if line and not line.startswith("-"):
            yield line, re.split(r"[<>=!~; \[]", line, 1)[0], "[no-deps]" in comment


def main(pip_args):
    files = sorted(glob.glob(os.path.join(ROOT, "examples", "*", "requirements.txt")))
    reqs = [r for path in files for r in requirements(path)]
    missing = []
    for line, name, _ in reqs:
        try:
            importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(line)
    if not missing:
        return 0
    import torch
    pin = "torch==" + torch.__version__.split("+")[0]
    print("installing the examples' requirements:", ", ".join(missing), flush=True)
    pip = [sys.executable, "-m", "pip", "install", "-q", *pip_args]
    rc = subprocess.call(pip + [pin] + sorted({line for line, _, no_deps in reqs if not no_deps}))
    no_deps = sorted({line for line, _, no_deps in reqs if no_deps})
    if rc == 0 and no_deps:
        rc = subprocess.call(pip + ["--no-deps"] + no_deps)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
