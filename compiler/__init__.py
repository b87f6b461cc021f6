"""pmx compiler: PNNX frontend, IR, passes, .pmx writer and the `pmx` CLI."""

import pmx.runtime  # noqa: F401 - the compiler folds constants with the runtime's kernels
from pmx.compiler.driver import compile_model
from pmx.runtime.version import __version__

__all__ = ["compile_model", "__version__"]
