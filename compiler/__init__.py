"""pmx compiler: PNNX frontend, IR, passes, .pmx writer and the `pmx` CLI."""

from pmx.compiler.driver import compile_model

__all__ = ["compile_model"]
