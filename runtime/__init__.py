"""pmx runtime: load a .pmx file and run it with numpy and numexpr.

    from pmx.runtime import InferenceSession
    sess = InferenceSession("model.pmx")
    outputs = sess.run(None, {"in0": x})

Imports only numpy and numexpr (never torch, flatbuffers or the compiler: the header
reader takes the schema's layouts from pmx.schema.layout).
"""

from pmx.runtime.batching import BatchingSession
from pmx.runtime.compat import (
    IOBinding,
    ModelMetadata,
    OrtValue,
    RunOptions,
    get_all_providers,
    get_available_providers,
    get_device,
    set_default_logger_severity,
    set_default_logger_verbosity,
)
from pmx.runtime.errors import (
    PmxCompileError,
    PmxError,
    PmxFormatError,
    PmxInputError,
    PmxInternalError,
    PmxResourceError,
    PmxRunTerminated,
    PmxUnsupportedOpError,
)
from pmx.runtime.options import ExecutionMode, ExecutionOrder, GraphOptimizationLevel, SessionOptions
from pmx.runtime.predictor import Predictor
from pmx.runtime.session import InferenceSession, NodeArg
from pmx.runtime.version import __version__

__all__ = [
    "BatchingSession",
    "ExecutionMode",
    "ExecutionOrder",
    "GraphOptimizationLevel",
    "IOBinding",
    "InferenceSession",
    "ModelMetadata",
    "NodeArg",
    "OrtValue",
    "PmxCompileError",
    "PmxError",
    "PmxFormatError",
    "PmxInputError",
    "PmxInternalError",
    "PmxResourceError",
    "PmxRunTerminated",
    "PmxUnsupportedOpError",
    "Predictor",
    "RunOptions",
    "SessionOptions",
    "__version__",
    "get_all_providers",
    "get_available_providers",
    "get_device",
    "set_default_logger_severity",
    "set_default_logger_verbosity",
]
