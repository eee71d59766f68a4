"""The native part of the package (everything else is in pyproject.toml): the multithreaded Huffman encoder in
native/, a plain C extension (no dependencies beyond a C compiler and pthreads)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("esftctl._native", ["native/huffman_encode.c"],
                             extra_compile_args=["-O3", "-pthread"], extra_link_args=["-pthread"])])
