"""pmx compiler: PNNX frontend, IR, passes, .pmx writer and the `pmx` CLI.

The names below load on first use, so `pmx run` (whose entry point lives in this
package) imports neither the compiler's passes nor flatbuffers."""

import pmx.runtime  # noqa: F401 - the compiler folds constants with the runtime's kernels
from pmx.runtime.version import __version__

__all__ = ["CompileResult", "__version__", "check_against_torch", "compile_model", "from_torch"]

_LAZY = {
    "CompileResult": "pmx.compiler.driver",
    "compile_model": "pmx.compiler.driver",
    "check_against_torch": "pmx.compiler.from_torch",
    "from_torch": "pmx.compiler.from_torch",
}


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
