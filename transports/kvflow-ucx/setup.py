from setuptools import setup

setup(cffi_modules=["src/kvflow_ucx/_build.py:ffibuilder"])
