"""Helpers for testing kvflow and code built on it (also a pytest plugin: see ``pytest_plugin``)."""
