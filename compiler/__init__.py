"""pmx compiler: PNNX frontend, IR, passes, .pmx writer and the `pmx` CLI.

compile_model and CompileResult load on first use, so `pmx run` (whose entry point lives
in this package) imports neither the compiler's passes nor flatbuffers."""

import pmx.runtime  # noqa: F401 - the compiler folds constants with the runtime's kernels
from pmx.runtime.version import __version__

__all__ = ["CompileResult", "__version__", "check_against_torch", "compile_model", "from_torch"]

# from_torch is also a submodule's name: importing the submodule anywhere would bind the
# package attribute to the module, so the function is bound here, eagerly (the module
# imports the driver only when called)
from pmx.compiler.from_torch import check_against_torch, from_torch

_LAZY = {"CompileResult": "pmx.compiler.driver", "compile_model": "pmx.compiler.driver"}


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pmx.compiler' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(__all__)
