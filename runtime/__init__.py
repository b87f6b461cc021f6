"""pmx runtime: load a .pmx file and run it with numpy and numexpr.

    from pmx.runtime import InferenceSession
    sess = InferenceSession("model.pmx")
    outputs = sess.run(None, {"in0": x})

Imports only numpy, numexpr and flatbuffers (never torch or the compiler).
"""

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
from pmx.runtime.predictor import Predictor
from pmx.runtime.session import InferenceSession, NodeArg
from pmx.runtime.version import __version__

__all__ = [
    "InferenceSession",
    "SessionOptions",
    "Predictor",
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
