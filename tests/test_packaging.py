"""The wheel: only `enn_backend` at the top level, and backend="enn" works with no import."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

_NO_IMPORT_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    assert "enn_backend" not in sys.modules
    assert "enn" in torch._dynamo.list_backends(), torch._dynamo.list_backends()
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    x = torch.randn(3, 4)
    y = torch.compile(m, backend="enn")(x)
    torch.testing.assert_close(y, m(x))
    import enn_backend, enn_backend.custom_ops, enn_backend.lowerings
    assert len(enn_backend.report().graphs) == 1
    print("ENN_FROM", enn_backend.__file__)
    print("OPS_FROM", enn_backend.custom_ops.__file__)
    print("TORCH", torch.__version__)
    """
)


def _build_outputs() -> dict[str, int]:
    """What setuptools writes beside the sources it builds, in the checkout: build/, dist/ and
    *.egg-info/, each file and folder with its modification time."""
    tops = [ROOT / "build", ROOT / "dist", *ROOT.glob("*.egg-info")]
    return {str(p): p.stat().st_mtime_ns for top in tops if top.exists() for p in (top, *top.rglob("*"))}


@pytest.fixture(scope="module")
def checkout_before_the_build() -> dict[str, int]:
    return _build_outputs()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory, checkout_before_the_build) -> Path:
    out = tmp_path_factory.mktemp("dist")
    # built from a copy of the sources: setuptools writes its build/ folder beside the sources it
    # builds, and the suite leaves nothing in the checkout
    src = tmp_path_factory.mktemp("src") / "enn"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__",
                                                             ".venv", ".pytest_cache", "results"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)],
                   check=True, capture_output=True, timeout=600)
    (whl,) = out.glob("enn_backend-*.whl")
    return whl


def test_building_the_wheel_leaves_nothing_in_the_checkout(wheel, checkout_before_the_build):
    """The suite builds the wheel from a copy: no build/ folder (nor a rewritten egg-info) is left
    in the checkout, which a user's `git status` would show after running the tests."""
    assert _build_outputs() == checkout_before_the_build


def test_wheel_has_only_enn_backend_at_top_level(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert top == {"enn_backend", f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info"}, top
    assert "enn_backend/lowerings/__init__.py" in names and "enn_backend/custom_ops/__init__.py" in names
    entry_points = zipfile.ZipFile(wheel).read(f"enn_backend-{wheel.name.split('-')[1]}.dist-info/entry_points.txt").decode()
    assert "[torch_dynamo_backends]" in entry_points and "enn = enn_backend.backend:enn" in entry_points


def test_fresh_venv_compiles_with_backend_enn_without_import(wheel, tmp_path):
    # The wheel is installed into a fresh venv that sees nothing else; then a .pth file lends it
    # the site-packages folders of the interpreter running this test (torch and its
    # dependencies), as --system-site-packages would outside a venv (inside one, that flag lends
    # the base interpreter's, which may have another torch or none). A .pth line only adds its
    # folder to sys.path, after the venv's own: a development install of enn there (an editable
    # finder) stays inert.
    # The test checks that the process really ran the venv's copy, not a development checkout.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True,
                   capture_output=True, timeout=300)
    venv_site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               check=True, capture_output=True, text=True).stdout.strip()
    lent = [p for p in sys.path if Path(p).name in ("site-packages", "dist-packages")]
    (Path(venv_site) / "lent_site_packages.pth").write_text("".join(p + "\n" for p in lent))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([str(py), "-c", _NO_IMPORT_SCRIPT], env=env, capture_output=True, text=True, timeout=300,
                         cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    site = str(venv)
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if line.startswith(("ENN_FROM", "OPS_FROM", "TORCH")))
    assert lines["ENN_FROM"].startswith(site), lines
    assert lines["OPS_FROM"].startswith(site) and "enn_backend/custom_ops" in lines["OPS_FROM"], lines
    assert lines["TORCH"] == torch.__version__, lines  # the torch this suite tests, not another one


def test_every_package_folder_is_listed_in_pyproject():
    """A package folder pyproject.toml does not list is left out of the wheel (and of a
    non-editable install), which only a fresh venv notices."""
    import tomllib

    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed, dirs = set(tool["packages"]), tool["package-dir"]
    found = {(name + "." + ".".join(p.parent.relative_to(ROOT / where).parts)).rstrip(".")
             for name, where in dirs.items() for p in (ROOT / where).rglob("__init__.py")}
    assert found - listed == set(), "package folders missing from pyproject.toml's packages"
