"""The dtypes a .pmx tensor can have, and their schema enum values."""

import numpy as np

from pmx.schema.layout import DType

# numpy dtype name <-> schema enum. bfloat16 and complex32 have no numpy dtype; the
# compiler widens them to float32 / complex64 when it reads the .bin.
NAME_TO_ENUM = {
    "float32": DType.Float32,
    "float64": DType.Float64,
    "float16": DType.Float16,
    "int8": DType.Int8,
    "uint8": DType.UInt8,
    "int16": DType.Int16,
    "int32": DType.Int32,
    "int64": DType.Int64,
    "bool": DType.Bool,
    "complex64": DType.Complex64,
    "complex128": DType.Complex128,
}
ENUM_TO_NAME = {v: k for k, v in NAME_TO_ENUM.items()}
ENUM_TO_NUMPY = {v: np.dtype(k) for k, v in NAME_TO_ENUM.items()}

# onnxruntime-style type strings for NodeArg.type
ORT_TYPE = {
    "float32": "tensor(float)",
    "float64": "tensor(double)",
    "float16": "tensor(float16)",
    "int8": "tensor(int8)",
    "uint8": "tensor(uint8)",
    "int16": "tensor(int16)",
    "int32": "tensor(int32)",
    "int64": "tensor(int64)",
    "bool": "tensor(bool)",
    "complex64": "tensor(complex64)",
    "complex128": "tensor(complex128)",
}

# ONNX TensorProto element type numbers of the dtypes above that ONNX numbers, as
# onnxruntime's OrtValue.ortvalue_from_shape_and_type takes them
ONNX_ELEMENT_TYPE = {
    1: "float32",
    2: "uint8",
    3: "int8",
    5: "int16",
    6: "int32",
    7: "int64",
    9: "bool",
    10: "float16",
    11: "float64",
    14: "complex64",
    15: "complex128",
}
