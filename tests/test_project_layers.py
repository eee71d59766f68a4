"""The layers' import rules, walked over every module's source (issue 30): the folders say which layer a module
is in, and this says what each layer may import.

- vLLM's internals are reached only through one door, esftctl.runtime.vllm (runtime/vllm/): a vLLM upgrade
  changes that folder and nothing else. Aside: the client side, which uses vLLM as a user does
  (esftctl/vllm_generate.py, plain vLLM generating the references; esftctl/bench/load.py, vLLM's load
  generator against a server).
- The engine-free runtime (runtime/ outside the door) and the kernels import no vLLM, not even through the
  door, and nothing of the CLI, the launcher or the benches.
- The formats (esftctl/formats/) import each other, the package's utilities, selection's expert config and the
  GPU decoder of the kernels, nothing else of the package.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from esftctl.errors import EsftError

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"esftctl": ROOT / "esftctl", "esftctl.runtime": ROOT / "runtime", "esftctl.kernels": ROOT / "kernels"}
DOOR = "esftctl.runtime.vllm"
CLIENT_SIDE = {"esftctl.vllm_generate", "esftctl.bench.load"}
ENGINE = ("vllm", "starlette", "fastapi")  # vLLM and its server's framework
ABOVE_THE_RUNTIME = ("esftctl.cli", "esftctl.serve", "esftctl.serve_client", "esftctl.bench", "esftctl.world")
FORMATS_MAY_IMPORT = ("esftctl.formats", "esftctl.__version__", "esftctl._native", "esftctl.atomic", "esftctl.errors",
                      "esftctl.beneath", "esftctl.jsonfile", "esftctl.names", "esftctl.units", "esftctl.selection",
                      "esftctl.kernels")


def _modules() -> dict[str, Path]:
    """Every module of the package: import name -> file."""
    found = {}
    for prefix, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            name = ".".join((prefix, *parts[:-1]) if parts[-1] == "__init__" else (prefix, *parts))
            found.setdefault(name, path)  # esftctl/ holds no runtime/ or kernels/ of its own
    return found


def _imports(name: str, path: Path) -> set[str]:
    """The modules `name` imports anywhere in its source (at the top or inside functions)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            out |= {module} | {f"{module}.{a.name}" for a in node.names}
    return out


def _under(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _violations(rule) -> list[str]:
    return sorted(f"{name} imports {imported}" for name, path in _modules().items()
                  for imported in _imports(name, path) if rule(name, imported))


def test_the_walk_sees_every_layer():
    modules = _modules()
    assert {"esftctl.cli", "esftctl.runtime.moe_layer", "esftctl.runtime.vllm.plugin",
            "esftctl.kernels.reroute"} <= set(modules)
    assert "vllm.platforms" in _imports("esftctl.runtime.vllm.plugin", modules["esftctl.runtime.vllm.plugin"])


def test_only_the_door_imports_vllm():
    assert _violations(lambda name, imported: _under(imported, ENGINE) and not _under(name, [DOOR])
                       and name not in CLIENT_SIDE) == []


def test_the_engine_free_runtime_and_the_kernels_import_no_engine_and_nothing_above_them():
    def below_the_door(name):
        return _under(name, ["esftctl.runtime", "esftctl.kernels"]) and not _under(name, [DOOR])

    assert _violations(lambda name, imported: below_the_door(name)
                       and _under(imported, [DOOR, *ENGINE, *ABOVE_THE_RUNTIME])) == []



def test_the_formats_import_only_each_other_and_the_utilities():
    assert _violations(lambda name, imported: _under(name, ["esftctl.formats"]) and _under(imported, ["esftctl"])
                       and imported != "esftctl" and not _under(imported, FORMATS_MAY_IMPORT)) == []


@pytest.mark.vllm
def test_the_plugin_refuses_a_vllm_without_what_it_patches():
    import torch
    import vllm

    from esftctl.runtime.vllm.plugin import CPU_PATCHED, PATCHED, check_patched

    check_patched(PATCHED if torch.cuda.is_available() else PATCHED | CPU_PATCHED)  # as the plugin checks them
    with pytest.raises(EsftError, match=rf"^vLLM {vllm.__version__} has no vllm\.v1\.worker\.lora_model_runner_mixin"
                                        r"\.Renamed, which esftctl's plugin replaces; [^\n]*$"):
        check_patched({"vllm.v1.worker.lora_model_runner_mixin": ("Renamed",)})
