"""The wheel a non-editable install gets holds every module of the source tree (issue 18, item 18), nothing of the
team's lab (benchmarks/lab/), and the native encoder compiled from native/ (issue 19); installed, it imports every
module and runs `esftctl --version` (issue 30: runtime/ and kernels/ sit at the top level and install as
esftctl.runtime and esftctl.kernels).

CI installs in editable mode, which reads the source tree and so cannot see a package left out of the wheel:
a hand-kept package list once left `esftctl.bench` out, and every non-editable install failed at import.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = {"esftctl": "esftctl", "esftctl/runtime": "runtime", "esftctl/kernels": "kernels"}  # wheel: tree
IMPORT_ALL = """
import importlib, pkgutil, sys
import esftctl
skip = () if importlib.util.find_spec("vllm") else ("esftctl.runtime.vllm",)  # the glue needs vLLM itself
names = [m.name for m in pkgutil.walk_packages(esftctl.__path__, "esftctl.")
         if not m.name.startswith(skip) and m.name != "esftctl.__main__"]  # __main__ runs the command
for name in names:
    module = importlib.import_module(name)
    assert module.__file__.startswith(sys.argv[1]), (name, module.__file__)
print(len(names))
"""


def _modules(paths) -> set[str]:
    return {str(p) for p in paths if str(p).endswith(".py") and "__pycache__" not in str(p)}


def _source_modules() -> set[str]:
    found = set()
    for prefix, folder in LAYERS.items():
        found |= {f"{prefix}/{p.relative_to(ROOT / folder).as_posix()}" for p in (ROOT / folder).rglob("*.py")}
    return _modules(found)


def _build_wheel(tmp_path: Path) -> Path:
    src = tmp_path / "src"  # a copy, so the build leaves nothing (build/, *.egg-info) in the checkout
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for folder in {"native", *LAYERS.values()}:
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    wheel, = (tmp_path / "dist").glob("esftctl-*.whl")
    return wheel


def test_wheel_holds_and_imports_every_source_module(tmp_path):
    wheel = _build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        entry_points = next(z.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt"))
        z.extractall(tmp_path / "site")
    assert _modules(n for n in names if n.startswith("esftctl/")) == _source_modules()
    # The team's lab (benchmarks/lab/) stays out of the wheel: no file of it under any name.
    lab = {p.name for p in (ROOT / "benchmarks" / "lab").rglob("*") if p.is_file() and p.name != "README.md"}
    assert lab and not [n for n in names if n.startswith("benchmarks/") or n.rpartition("/")[2] in lab]
    assert any(n.startswith("esftctl/_native") and n.endswith(".so") for n in names)  # the native encoder, built
    assert "esftctl = esftctl.cli:main" in entry_points
    plugin = "esftctl.runtime.vllm.plugin:register"
    assert f"esftctl = {plugin}" in entry_points
    # Installed from the wheel alone (its folder first on the path, run away from the checkout), every module
    # imports from it, the plugin's entry point resolves, and the command answers --version.
    site = tmp_path / "site"
    env = {**os.environ, "PYTHONPATH": str(site)}
    run = dict(cwd=tmp_path, env=env, capture_output=True, text=True)
    proc = subprocess.run([sys.executable, "-c", IMPORT_ALL, str(site)], **run)
    assert proc.returncode == 0 and int(proc.stdout.split()[-1]) > 60, proc.stderr
    module, attr = plugin.split(":")
    proc = subprocess.run([sys.executable, "-c", f"import {module} as m; assert callable(m.{attr})"], **run)
    assert proc.returncode == 0, proc.stderr
    proc = subprocess.run([sys.executable, "-m", "esftctl", "--version"], **run)
    assert proc.returncode == 0 and proc.stdout.startswith("esftctl "), proc.stderr


def test_editable_install_imports_the_top_level_layers():
    """The checkout's own install (editable, as CI's) maps esftctl.runtime and esftctl.kernels to their folders."""
    for name, folder in (("esftctl.runtime", "runtime"), ("esftctl.kernels", "kernels")):
        assert Path(importlib.util.find_spec(name).origin).parent == ROOT / folder
