from setuptools import setup

setup(cffi_modules=["src/kvflow_shm/_build.py:ffibuilder"])
