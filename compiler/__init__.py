"""pmx compiler: PNNX frontend, IR, passes, .pmx writer and the `pmx` CLI."""

import pmx.runtime  # noqa: F401 - the compiler folds constants with the runtime's kernels
from pmx.compiler.driver import CompileResult, compile_model
from pmx.compiler.from_torch import check_against_torch, from_torch
from pmx.runtime.version import __version__

__all__ = ["CompileResult", "__version__", "check_against_torch", "compile_model", "from_torch"]
