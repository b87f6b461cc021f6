"""The package version, in one place: pyproject.toml reads it at build time
([tool.setuptools.dynamic]), pmx.runtime and pmx.compiler export it, and the compiler
stamps it into each file's producer string."""

__version__ = "0.1.0"
