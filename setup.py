"""The core's one compiled part: tcp's socket loop in C (kvflow/_pumpc.c). It is optional: where it
cannot be built (no C compiler or no Python headers), the install goes on and kvflow._pump moves
payloads with its Python loop instead."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvflow._pumpc", ["kvflow/_pumpc.c"], optional=True,
                             extra_compile_args=["-O2", "-Wall", "-Wextra"])])
