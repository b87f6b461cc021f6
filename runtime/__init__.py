"""pmx runtime: load a .pmx file and run it with numpy and numexpr.

    from pmx.runtime import InferenceSession
    sess = InferenceSession("model.pmx")
    outputs = sess.run(None, {"in0": x})

Imports only numpy, numexpr and flatbuffers (never torch or the compiler).
"""

import importlib as _importlib
import os as _os
import sys as _sys

# OpenBLAS's idle pool threads spin for ~0.1 s (2^28 cycles) after the pool starts, as
# numpy loads it, and after each multi-threaded BLAS call, on the core pmx's worker
# thread needs. MobileNetV3-small ran 10.8-12.6 ms instead of 5.3 right after a 384x384
# matmul of the caller's, and ResNet-18's first run in a fresh process took 60-63 ms
# instead of 41-43. OpenBLAS reads OPENBLAS_THREAD_TIMEOUT once, as it loads, so when
# numpy is not loaded yet the pool starts with idle threads that sleep after 2^4 cycles
# (parallel.BLAS_RESTART_TIMEOUT, as after a worker process's fork) and the variable is
# removed again. A timeout you set yourself is left alone; see README, Threads and tuning.
if "numpy" not in _sys.modules and not {"OPENBLAS_THREAD_TIMEOUT", "GOTO_THREAD_TIMEOUT"} & set(_os.environ):
    _os.environ["OPENBLAS_THREAD_TIMEOUT"] = "4"
    try:
        _importlib.import_module("numpy")  # OpenBLAS reads the variable as numpy loads it
    finally:
        del _os.environ["OPENBLAS_THREAD_TIMEOUT"]

from pmx.runtime.errors import (
    PmxCompileError,
    PmxError,
    PmxFormatError,
    PmxInputError,
    PmxResourceError,
    PmxUnsupportedOpError,
)
from pmx.runtime.session import InferenceSession, NodeArg

__version__ = "0.1.0"

__all__ = [
    "InferenceSession",
    "NodeArg",
    "PmxError",
    "PmxFormatError",
    "PmxCompileError",
    "PmxUnsupportedOpError",
    "PmxInputError",
    "PmxResourceError",
]
