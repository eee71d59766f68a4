"""The wheel a non-editable install gets holds every module of the source tree (issue 18, item 18), and the
native encoder compiled from native/ (issue 19).

CI installs in editable mode, which reads the source tree and so cannot see a package left out of the wheel:
a hand-kept package list once left `esftctl.bench` out, and every non-editable install failed at import.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _modules(paths) -> set[str]:
    return {str(p) for p in paths if str(p).endswith(".py") and "__pycache__" not in str(p)}


def test_wheel_holds_every_source_module(tmp_path):
    src = tmp_path / "src"  # a copy, so the build leaves nothing (build/, *.egg-info) in the checkout
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "native", src / "native")
    shutil.copytree(ROOT / "esftctl", src / "esftctl", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    wheel, = (tmp_path / "dist").glob("esftctl-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        entry_points = next(z.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt"))
    source = _modules(p.relative_to(ROOT).as_posix() for p in (ROOT / "esftctl").rglob("*.py"))
    assert source and _modules(n for n in names if n.startswith("esftctl/")) == source
    assert any(n.startswith("esftctl/_native") and n.endswith(".so") for n in names)  # the native encoder, built
    assert "esftctl = esftctl.cli:main" in entry_points
    assert "esftctl = esftctl.runtime.vllm_plugin:register" in entry_points
