"""The Open Inference Protocol (KServe V2, Triton's HTTP/REST protocol) as plain functions:
datatypes, model metadata, and infer requests and responses, in JSON and with the binary
tensor data extension. No web framework here, so every rule is testable on bytes alone.

A request body is a JSON inference header, optionally followed by a binary section when
the `Inference-Header-Content-Length` HTTP header gives the header's length: each input
with `parameters.binary_data_size` takes that many bytes of the section, in the order of
`inputs`, little-endian, row-major (BOOL one byte per element). A response is built the
same way: outputs asked for in binary (`parameters.binary_data` on an output, or
`binary_data_output` on the request) follow the JSON header.

Every refusal is a RequestError naming the tensor and saying what was expected and what
was found; the server sends it as `{"error": "..."}` with its HTTP status.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import numpy as np

MODEL_VERSION = "1"  # one .pmx file is one version; the protocol's version paths name it

# numpy dtype name -> the protocol's datatype. pmx tensors use the int, float and bool
# ones; complex tensors have no datatype in the protocol (refused when a model is opened).
DATATYPE_OF_DTYPE = {
    "bool": "BOOL",
    "uint8": "UINT8",
    "uint16": "UINT16",
    "uint32": "UINT32",
    "uint64": "UINT64",
    "int8": "INT8",
    "int16": "INT16",
    "int32": "INT32",
    "int64": "INT64",
    "float16": "FP16",
    "float32": "FP32",
    "float64": "FP64",
}
DTYPE_OF_DATATYPE = {datatype: np.dtype(name) for name, datatype in DATATYPE_OF_DTYPE.items()}
# datatypes the protocol defines that no pmx tensor has
FOREIGN_DATATYPES = ("BYTES", "BF16")


class RequestError(Exception):
    """A request the server refuses: the HTTP status and the message of its error body."""

    def __init__(self, status, message):
        super().__init__(message)
        self.status = status
        self.message = message


def bad_request(message):
    return RequestError(400, message)


# --- model metadata -----------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    """A model input or output as the protocol describes it: shape dims that may change are -1."""

    name: str
    datatype: str
    shape: tuple
    dtype: np.dtype


def datatype_of(dtype):
    """The protocol's datatype of a numpy dtype, or None when the protocol has none."""
    return DATATYPE_OF_DTYPE.get(np.dtype(dtype).name)


def tensor_spec(node_arg, dtype):
    """TensorSpec of an InferenceSession NodeArg whose tensors have numpy dtype `dtype`;
    ValueError when the protocol has no datatype for it."""
    datatype = datatype_of(dtype)
    if datatype is None:
        raise ValueError(
            f"tensor {node_arg.name!r} is {np.dtype(dtype).name}, which the Open Inference Protocol has no "
            f"datatype for (it has {', '.join(DTYPE_OF_DATATYPE)})"
        )
    shape = tuple(-1 if d is None else int(d) for d in node_arg.shape)
    return TensorSpec(node_arg.name, datatype, shape, np.dtype(dtype))


def model_metadata(name, inputs, outputs):
    """The body of GET /v2/models/{name}."""

    def describe(spec):
        return {"name": spec.name, "datatype": spec.datatype, "shape": list(spec.shape)}

    return {
        "name": name,
        "versions": [MODEL_VERSION],
        "platform": "pmx",
        "inputs": [describe(s) for s in inputs],
        "outputs": [describe(s) for s in outputs],
    }


# --- infer requests -----------------------------------------------------------------------


@dataclass
class InferRequest:
    """A parsed infer request: the feed for the model, the outputs asked for (None: every
    output) and how each is to be sent back."""

    id: str | None
    feed: dict
    output_names: list | None
    binary_default: bool = False
    binary_outputs: dict = field(default_factory=dict)

    def wants_binary(self, name):
        return self.binary_outputs.get(name, self.binary_default)


def parse_infer_request(body, header_length, inputs):
    """InferRequest from a request body (bytes) and its Inference-Header-Content-Length
    header (None when absent), checked against `inputs` ({name: TensorSpec}). Shapes the
    model cannot take are left to the session's own check, whose message names them."""
    header, binary = split_body(body, header_length)
    doc = load_header(header, binary_expected=header_length is not None)
    request_id = doc.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise bad_request(f"'id' must be a string, got {_json_type(request_id)}")
    parameters = _parameters(doc, "the request")
    binary_default = _flag(parameters, "binary_data_output", "the request")
    feed = _parse_inputs(doc, binary, inputs)
    names, binary_outputs = _parse_outputs(doc)
    return InferRequest(request_id, feed, names, binary_default, binary_outputs)


def split_body(body, header_length):
    """(JSON header bytes, binary section as a memoryview) of a request body."""
    if header_length is None:
        return body, memoryview(b"")
    text = header_length.strip()
    if not (text.isascii() and text.isdigit()):  # isdigit alone takes "²", which int() refuses
        raise bad_request(f"Inference-Header-Content-Length must be a byte count, got {header_length!r}")
    length = int(text)
    if length > len(body):
        raise bad_request(
            f"Inference-Header-Content-Length is {length} but the request body has only {len(body)} bytes"
        )
    return body[:length], memoryview(body)[length:]


def load_header(header, binary_expected):
    """The inference header's JSON object."""
    try:
        doc = json.loads(header)
    except UnicodeDecodeError:
        raise bad_request("the inference header is not UTF-8 JSON") from None
    except (ValueError, RecursionError) as e:
        # bytes after a whole JSON document: binary tensors sent without saying where they start
        trailing = isinstance(e, json.JSONDecodeError) and e.msg == "Extra data" and not binary_expected
        hint = " (a request with binary tensors needs the Inference-Header-Content-Length header)" if trailing else ""
        raise bad_request(f"malformed JSON in the inference header: {e}{hint}") from None
    if not isinstance(doc, dict):
        raise bad_request(f"the inference header must be a JSON object, got {_json_type(doc)}")
    return doc


def _parse_inputs(doc, binary, inputs):
    entries = doc.get("inputs")
    if not isinstance(entries, list) or not entries:
        raise bad_request(
            f"'inputs' must be a non-empty list of tensors, got {_json_type(entries)}; "
            f"the model's inputs are {list(inputs)}"
        )
    feed, offset = {}, 0
    for k, entry in enumerate(entries):
        name = _tensor_name(entry, f"inputs[{k}]")
        spec = inputs.get(name)
        if spec is None:
            raise bad_request(f"the model has no input {name!r}; its inputs are {list(inputs)}")
        if name in feed:
            raise bad_request(f"input {name!r} is given twice")
        where = f"input {name!r}"
        _check_datatype(entry.get("datatype"), spec, where)
        shape = _shape(entry.get("shape"), where)
        parameters = _parameters(entry, where)
        _refuse_shared_memory(parameters, where)
        size = parameters.get("binary_data_size")
        if size is not None:
            if "data" in entry:
                raise bad_request(f"{where} has both 'data' and parameters.binary_data_size; give one")
            feed[name] = _array_from_binary(binary, offset, size, spec.dtype, shape, where)
            offset += size
        elif "data" in entry:
            feed[name] = _array_from_json(entry["data"], spec.dtype, shape, where)
        else:
            raise bad_request(f"{where} has neither 'data' nor parameters.binary_data_size")
    if offset != len(binary):
        raise bad_request(
            f"the binary section after the inference header is {len(binary)} bytes, but the inputs' "
            f"binary_data_size add up to {offset}"
        )
    return feed


def _parse_outputs(doc):
    """(requested output names or None for all, {name: binary flag given on it})."""
    entries = doc.get("outputs")
    if entries is None:
        return None, {}
    if not isinstance(entries, list):
        raise bad_request(f"'outputs' must be a list of requested outputs, got {_json_type(entries)}")
    names, binary = [], {}
    for k, entry in enumerate(entries):
        name = _tensor_name(entry, f"outputs[{k}]")
        if name in names:
            raise bad_request(f"output {name!r} is requested twice")
        where = f"output {name!r}"
        parameters = _parameters(entry, where)
        _refuse_shared_memory(parameters, where)
        if "classification" in parameters:
            raise bad_request(f"{where}: the classification extension is not supported; request the raw output")
        if "binary_data" in parameters:
            binary[name] = _flag(parameters, "binary_data", where)
        names.append(name)
    return names or None, binary


def _tensor_name(entry, where):
    if not isinstance(entry, dict):
        raise bad_request(f"{where} must be a JSON object, got {_json_type(entry)}")
    name = entry.get("name")
    if not isinstance(name, str):
        raise bad_request(f"{where}: 'name' must be a string, got {_json_type(name)}")
    return name


def _check_datatype(datatype, spec, where):
    if not isinstance(datatype, str):
        raise bad_request(f"{where}: 'datatype' must be a string such as {spec.datatype!r}, got {_json_type(datatype)}")
    if datatype not in DTYPE_OF_DATATYPE and datatype not in FOREIGN_DATATYPES:
        known = ", ".join([*DTYPE_OF_DATATYPE, *FOREIGN_DATATYPES])
        raise bad_request(f"{where}: unknown datatype {datatype!r}; the protocol's datatypes are {known}")
    if datatype != spec.datatype:
        raise bad_request(f"{where}: the model takes datatype {spec.datatype}, the request says {datatype}")


def _shape(shape, where):
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
        raise bad_request(f"{where}: 'shape' must be a list of integers, got {json.dumps(shape)[:80]}")
    if any(d < 0 for d in shape):
        raise bad_request(f"{where}: shape {shape} has a negative dim")
    return tuple(shape)


def _parameters(entry, where):
    parameters = entry.get("parameters", {})
    if not isinstance(parameters, dict):
        raise bad_request(f"{where}: 'parameters' must be a JSON object, got {_json_type(parameters)}")
    return parameters


def _flag(parameters, key, where):
    value = parameters.get(key, False)
    if not isinstance(value, bool):
        raise bad_request(f"{where}: parameters.{key} must be true or false, got {json.dumps(value)[:40]}")
    return value


def _refuse_shared_memory(parameters, where):
    if "shared_memory_region" in parameters:
        raise bad_request(f"{where}: shared memory is not supported; send the tensor in the request body")


def _array_from_binary(binary, offset, size, dtype, shape, where):
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise bad_request(f"{where}: parameters.binary_data_size must be a byte count, got {json.dumps(size)[:40]}")
    expected = math.prod(shape) * dtype.itemsize
    if size != expected:
        raise bad_request(
            f"{where}: shape {list(shape)} of {DATATYPE_OF_DTYPE[dtype.name]} needs {expected} bytes, "
            f"binary_data_size says {size}"
        )
    if offset + size > len(binary):
        raise bad_request(
            f"{where}: its {size} bytes run past the end of the binary section ({len(binary) - offset} bytes left)"
        )
    chunk = binary[offset : offset + size]
    if dtype == np.bool_:  # any nonzero byte is true, as in C; numpy's bool view would keep the byte
        return (np.frombuffer(chunk, np.uint8) != 0).reshape(shape)
    return np.frombuffer(chunk, dtype.newbyteorder("<")).reshape(shape)


def _array_from_json(data, dtype, shape, where):
    """The array of a JSON 'data' field: numbers flattened in row-major order (or nested
    as the shape), of a kind the datatype holds exactly: no float given to an int, no
    number to a BOOL, no int out of the datatype's range."""
    try:
        values = np.asarray(data)
    except (ValueError, TypeError):  # ragged nesting
        raise bad_request(f"{where}: 'data' must be a list of numbers (flat, or nested as the shape)") from None
    count = math.prod(shape)
    if values.size != count:
        raise bad_request(f"{where}: shape {list(shape)} holds {count} values, 'data' has {values.size}")
    if values.size:
        _check_value_kind(values, dtype, where)
    return values.astype(dtype).reshape(shape)


def _check_value_kind(values, dtype, where):
    datatype = DATATYPE_OF_DTYPE[dtype.name]
    kind = values.dtype.kind
    if dtype.kind == "b":
        if kind != "b":
            raise bad_request(f"{where}: BOOL data must be true or false, got {_json_values(values)}")
        return
    if kind not in "iuf" or (dtype.kind in "iu" and kind == "f"):
        wanted = "integers" if dtype.kind in "iu" else "numbers"
        raise bad_request(f"{where}: {datatype} data must be {wanted}, got {_json_values(values)}")
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        low, high = int(values.min()), int(values.max())
        if low < info.min or high > info.max:
            raise bad_request(f"{where}: {datatype} holds {info.min}..{info.max}, 'data' has {low}..{high}")


def _json_values(values):
    kinds = {"b": "booleans", "f": "non-integers", "U": "strings", "O": "nulls, objects or huge integers"}
    return kinds.get(values.dtype.kind, values.dtype.name)


def _json_type(value):
    if value is None:
        return "null"
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}.get(type(value), "a number")


# --- infer responses ----------------------------------------------------------------------


def encode_infer_response(model_name, request, names, arrays):
    """(body bytes, header length or None) of an infer response: the JSON header, then
    the binary outputs' bytes in the order of `outputs`. The header length is None when
    every output is in the JSON, and then no Inference-Header-Content-Length is sent."""
    outputs, blobs = [], []
    for name, array in zip(names, arrays):
        datatype = datatype_of(array.dtype)
        if datatype is None:  # a kept tensor can be complex; the model's outputs were checked at open
            raise bad_request(f"output {name!r} is {array.dtype.name}, which the protocol has no datatype for")
        entry = {"name": name, "datatype": datatype, "shape": list(array.shape)}
        if request.wants_binary(name):
            little = np.ascontiguousarray(array, array.dtype.newbyteorder("<"))
            entry["parameters"] = {"binary_data_size": little.nbytes}
            blobs.append(memoryview(little).cast("B"))
        else:
            entry["data"] = array.ravel().tolist()
        outputs.append(entry)
    header = {"model_name": model_name, "model_version": MODEL_VERSION, "outputs": outputs}
    if request.id is not None:
        header["id"] = request.id
    head = json.dumps(header, separators=(",", ":")).encode()
    if not blobs:
        return head, None
    return b"".join([head, *blobs]), len(head)


def error_body(message):
    return json.dumps({"error": message}).encode()
