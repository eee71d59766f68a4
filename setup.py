"""What pyproject.toml cannot say: the package's layout and its native part.

- Layout: the top level keeps one layer per folder (the design card): `esftctl/` the CLI, launcher and offline
  pipeline, `runtime/` what runs inside the engine, `kernels/` the Triton kernels. `runtime/` and `kernels/`
  install as `esftctl.runtime` and `esftctl.kernels`; every package is found, not listed (a hand-kept list once
  left esftctl.bench out of the wheel; tests/test_project_packaging.py builds the wheel and compares it with the tree).
- Native: the multithreaded Huffman encoder and decoder of expert stores and consolidation's expert distances
  in native/, a plain C extension (no dependencies beyond a C compiler and pthreads).
"""

from setuptools import Extension, find_packages, setup

LAYERS = {"esftctl.runtime": "runtime", "esftctl.kernels": "kernels"}  # import name: folder at the top level
SOURCES = ["native/module.c", "native/huffman_encode.c", "native/huffman_decode.c", "native/distances.c"]


def packages() -> list[str]:
    found = find_packages(include=["esftctl", "esftctl.*"])
    for name, folder in LAYERS.items():
        found += [name] + [f"{name}.{sub}" for sub in find_packages(folder)]
    return found


setup(packages=packages(), package_dir=LAYERS,
      ext_modules=[Extension("esftctl._native", SOURCES, depends=["native/huffman.h"],
                             extra_compile_args=["-O3", "-pthread"], extra_link_args=["-pthread"])])
