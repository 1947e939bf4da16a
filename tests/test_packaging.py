"""What a pip-installed fastlapsum promises: type information, a torch pin matching the torch
it was compiled against, and exported programs that load once fastlapsum is imported."""
import importlib.metadata
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from packaging.requirements import Requirement

import fastlapsum

PACKAGE_DIR = os.path.dirname(os.path.abspath(fastlapsum.__file__))


def test_py_typed_ships_with_the_package():
    assert os.path.isfile(os.path.join(PACKAGE_DIR, "py.typed"))


def test_installed_metadata_pins_the_running_torch():
    """A wheel runs only with the torch major.minor it was built against; its metadata says so."""
    try:
        dist = importlib.metadata.distribution("fastlapsum")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("fastlapsum runs from the source tree, not an installed wheel")
    if os.path.dirname(os.path.abspath(dist.locate_file("fastlapsum/__init__.py"))) != PACKAGE_DIR:
        pytest.skip("the installed distribution is not the fastlapsum imported here")
    torch_reqs = [Requirement(r) for r in dist.requires or [] if Requirement(r).name == "torch"]
    assert len(torch_reqs) == 1, dist.requires
    version = torch.__version__.split("+")[0]
    assert torch_reqs[0].specifier.contains(version, prereleases=True), (torch_reqs[0], version)
    major, minor = (int(v) for v in version.split(".")[:2])
    assert not torch_reqs[0].specifier.contains(f"{major}.{minor + 1}.0"), torch_reqs[0]


def test_exported_program_loads_after_import(tmp_path):
    """torch.export.load resolves fastlapsum's ops by name: they exist once `import fastlapsum`
    has run in the loading process, and not before."""

    class Model(torch.nn.Module):
        def forward(self, x):
            return fastlapsum.soft_topk(x, 3.0, 0.5), fastlapsum.topk(x, 2)[1]

    x = torch.randn(4, 10, generator=torch.Generator().manual_seed(0))
    path = tmp_path / "model.pt2"
    torch.export.save(torch.export.export(Model(), (x,)), str(path))
    torch.save(x, str(tmp_path / "x.pt"))
    script = textwrap.dedent(f"""
        import torch
        try:
            torch.export.load({str(path)!r})
        except Exception as e:
            print("without import:", type(e).__name__)
        else:
            print("without import: loaded")
        import fastlapsum
        p, idx = torch.export.load({str(path)!r}).module()(torch.load({str(tmp_path / "x.pt")!r}))
        print("sums", [round(v, 5) for v in p.double().sum(-1).tolist()])
        print("idx", sorted(idx[0].tolist()))
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(PACKAGE_DIR), os.environ.get("PYTHONPATH", "")]),
               TORCH_LOGS="-all", PYTHONWARNINGS="ignore")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0] == "without import: RuntimeError", out.stdout
    assert lines[1] == "sums [3.0, 3.0, 3.0, 3.0]", out.stdout
    assert lines[2] == f"idx {sorted(torch.topk(x[0], 2).indices.tolist())}", out.stdout
