"""pmx runtime: load a .pmx file and run it with numpy and numexpr.

    from pmx.runtime import InferenceSession
    sess = InferenceSession("model.pmx")
    outputs = sess.run(None, {"in0": x})

Imports only numpy, numexpr and flatbuffers (never torch or the compiler).
"""

import importlib as _importlib
import sys as _sys

from pmx.runtime import openblas_env as _openblas_env

# OpenBLAS's idle pool threads spin for ~0.1 s (2^28 cycles) after the pool starts, as
# numpy loads it, and after each multi-threaded BLAS call, on the core pmx's worker
# thread needs. MobileNetV3-small ran 10.8-12.6 ms instead of 5.3 right after a 384x384
# matmul of the caller's, and ResNet-18's first run in a fresh process took 60-63 ms
# instead of 41-43. So when numpy is not loaded yet, it loads with a short timeout
# (openblas_env); when it is, parallel._calm_blas_pool restarts the pool at the first
# run. A timeout you set yourself is left alone; see README, Threads and tuning.
if "numpy" not in _sys.modules and not _openblas_env.user_set_timeout():
    with _openblas_env.short_timeout():
        _importlib.import_module("numpy")  # OpenBLAS reads the variable as numpy loads it

from pmx.runtime.errors import (
    PmxCompileError,
    PmxError,
    PmxFormatError,
    PmxInputError,
    PmxInternalError,
    PmxResourceError,
    PmxUnsupportedOpError,
)
from pmx.runtime.options import SessionOptions
from pmx.runtime.session import InferenceSession, NodeArg
from pmx.runtime.version import __version__

__all__ = [
    "InferenceSession",
    "SessionOptions",
    "NodeArg",
    "PmxError",
    "PmxFormatError",
    "PmxCompileError",
    "PmxUnsupportedOpError",
    "PmxInputError",
    "PmxInternalError",
    "PmxResourceError",
    "__version__",
]
