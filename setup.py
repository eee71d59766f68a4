"""The native part of the package (everything else is in pyproject.toml): the multithreaded Huffman encoder and
decoder of expert stores and consolidation's expert distances in native/, a plain C extension (no dependencies
beyond a C compiler and pthreads)."""

from setuptools import Extension, setup

SOURCES = ["native/module.c", "native/huffman_encode.c", "native/huffman_decode.c", "native/distances.c"]

setup(ext_modules=[Extension("esftctl._native", SOURCES, depends=["native/huffman.h"],
                             extra_compile_args=["-O3", "-pthread"], extra_link_args=["-pthread"])])
