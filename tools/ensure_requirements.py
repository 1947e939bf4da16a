"""Install the examples' requirements into the running venv, only when one is missing.

    python tools/ensure_requirements.py [pip args...]

Reads examples/*/requirements.txt. A requirement counts as present when its distribution is
installed (any version), so an offline machine that already has them never reaches for pip.
Otherwise pip installs them with the venv's torch pinned to the installed version, so that a
dependency (torchvision, via timm) resolves to the matching build instead of replacing torch.
"""
import glob
import importlib.metadata
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def requirement_names(path):
    for line in open(path):
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-"):
            yield line, re.split(r"[<>=!~; \[]", line, 1)[0]


def main(pip_args):
    files = sorted(glob.glob(os.path.join(ROOT, "examples", "*", "requirements.txt")))
    missing = []
    for path in files:
        for line, name in requirement_names(path):
            try:
                importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                missing.append(line)
    if not missing:
        return 0
    import torch
    pin = "torch==" + torch.__version__.split("+")[0]
    print("installing the examples' requirements:", ", ".join(missing), flush=True)
    cmd = [sys.executable, "-m", "pip", "install", "-q", *pip_args, pin]
    for path in files:
        cmd += ["-r", path]
    return subprocess.call(cmd)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
