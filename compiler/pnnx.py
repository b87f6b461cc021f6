"""PNNX frontend: read `model.pnnx.param` + `model.pnnx.bin` into the IR, nothing more.

Format (Tencent/ncnn tools/pnnx/src/ir.cpp, Graph::load / storezip.cpp):

    7767517                                  magic
    <operator count> <operand count>
    <type> <name> <nin> <nout> <in operands...> <out operands...> key=value ...

key=value items:
    name=value        parameter: None, True/False, int, float (1.5, 1e-05, inf, nan),
                      bare string, (..) / [..] lists of int, float, string or complex,
                      complex (1.0+2.0j); a value containing '%' is a symbolic string
    expr=...          kept as the raw string
    @name=(2,3)f32    weight stored in the .bin zip as entry "<op name>.<name>";
                      "()" is a scalar
    $name=operand     names an input operand (first input with that operand name)
    #operand=(1,?,8)f32  operand shape and type; '?' is dynamic, '%s' symbolic

The .bin is a store-only (uncompressed) zip, zip64 when large. Graph inputs are named
in0, in1, ... and outputs out0, out1, ... in the order of pnnx.Input / pnnx.Output, as
pnnx's own ncnn export names them; every other tensor keeps its pnnx operand name.
"""

from __future__ import annotations

import mmap
import os
import struct

import numpy as np

from pmx.compiler.ir import Graph, Node, Value
from pmx.runtime.errors import PmxFormatError, PmxResourceError

MAGIC = 7767517
MAX_PARAM_BYTES = 1 << 30
MAX_ZIP_ENTRIES = 1 << 20
MAX_ZIP_DIRECTORY = 256 << 20

# pnnx dtype string -> (numpy dtype of the stored bytes, numpy dtype pmx keeps)
DTYPES = {
    "f32": ("float32", "float32"),
    "f64": ("float64", "float64"),
    "f16": ("float16", "float16"),
    "bf16": ("uint16", "float32"),  # no numpy bfloat16: widen bit-exactly to float32
    "i8": ("int8", "int8"),
    "u8": ("uint8", "uint8"),
    "i16": ("int16", "int16"),
    "i32": ("int32", "int32"),
    "i64": ("int64", "int64"),
    "bool": ("bool", "bool"),
    "c64": ("complex64", "complex64"),
    "c128": ("complex128", "complex128"),
    "c32": ("float16", "complex64"),  # complex32: pairs of float16, widened
}

_NCNN_LAYERS = {
    "Input", "Convolution", "ConvolutionDepthWise", "Pooling", "ReLU", "InnerProduct",
    "BatchNorm", "Split", "Concat", "Eltwise", "Softmax", "Reshape", "Permute", "Flatten",
    "Sigmoid", "Interp", "Crop", "Slice", "BinaryOp", "UnaryOp", "MemoryData", "Padding",
}


# --- parameter values ----------------------------------------------------------------


def _looks_numeric(s: str) -> bool:
    if not s:
        return False
    if s[0] == "-" or s[0] == "+":
        s = s[1:]
    return bool(s) and (s[0].isdigit() or (s[0] == "." and len(s) > 1 and s[1].isdigit()) or s in ("inf", "nan"))


def parse_scalar(s: str):
    """One parameter value (or list element) in pnnx's spelling."""
    if s == "None":
        return None
    if s in ("True", "False"):
        return s == "True"
    if not _looks_numeric(s):
        return s
    if s.endswith("j"):
        try:
            return complex(s)
        except ValueError:
            return s
    if any(c in s for c in ".eEn") or s.lstrip("+-") in ("inf", "nan"):
        try:
            return float(s)
        except ValueError:
            return s
    try:
        return int(s)
    except ValueError:
        try:
            return float(s)
        except ValueError:
            return s


def parse_value(s: str):
    """A parameter value: scalar, string or list. Symbolic values (with '%') stay strings."""
    if "%" in s:
        return s
    if s in ("()", "[]"):
        return ()
    if len(s) >= 2 and s[0] in "([" and s[-1] in ")]":
        return tuple(parse_scalar(e) for e in s[1:-1].split(","))
    return parse_scalar(s)


def parse_shape(spec: str, what: str):
    """'(1,3,?,%h)f32' -> (shape tuple with None for dynamic dims, pnnx dtype string)."""
    close = spec.rfind(")")
    if not spec.startswith("(") or close < 0:
        raise PmxFormatError(f"{what}: expected '(dims)type', found {spec!r}")
    type_str = spec[close + 1:]
    if type_str not in DTYPES:
        raise PmxFormatError(f"{what}: unknown dtype {type_str!r} in {spec!r} (known: {', '.join(DTYPES)})")
    body = spec[1:close]
    dims = []
    if body:
        for d in body.split(","):
            if d == "?" or d.startswith("%"):
                dims.append(None)
                continue
            try:
                n = int(d)
            except ValueError:
                raise PmxFormatError(f"{what}: dimension {d!r} in {spec!r} is not an integer, '?' or '%name'") from None
            if n < 0:
                n = None  # pnnx writes -1 for unknown in some versions
            dims.append(n)
    return tuple(dims), type_str


# --- .bin store-only zip --------------------------------------------------------------


class StoreZip:
    """Reader for the store-only zip pnnx writes. Entries are served from an mmap;
    nothing is decompressed, so a zip bomb cannot make us allocate."""

    def __init__(self, path: str):
        self.path = path
        self.entries = {}
        try:
            self._file = open(path, "rb")
        except OSError as e:
            raise PmxFormatError(f"{path}: cannot open weights file: {e.strerror}") from None
        size = os.fstat(self._file.fileno()).st_size
        if size < 22:
            self._file.close()
            if size == 0:
                self._map = b""
                return  # an empty .bin: a model without weights
            raise PmxFormatError(f"{path}: {size} bytes is too small for a zip archive")
        self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            self._read_directory(size)
        except struct.error:
            raise PmxFormatError(f"{path}: truncated zip structure") from None

    def _fail(self, msg):
        raise PmxFormatError(f"{self.path}: not a valid pnnx weights zip: {msg}")

    def _read_directory(self, size):
        m = self._map
        tail_start = max(0, size - 65557)
        eocd = m.rfind(b"PK\x05\x06", tail_start)
        if eocd < 0:
            self._fail("no end-of-central-directory record (truncated or not a zip)")
        _, _, _, count, cd_size, cd_offset, _ = struct.unpack_from("<HHHHIIH", m, eocd + 4)
        if count == 0xFFFF or cd_size == 0xFFFFFFFF or cd_offset == 0xFFFFFFFF:
            loc = eocd - 20
            if loc < 0 or m[loc:loc + 4] != b"PK\x06\x07":
                self._fail("zip64 fields used but no zip64 locator")
            (z64_offset,) = struct.unpack_from("<Q", m, loc + 8)
            if z64_offset + 56 > size or m[z64_offset:z64_offset + 4] != b"PK\x06\x06":
                self._fail("zip64 end record out of range")
            count, _, cd_size, cd_offset = struct.unpack_from("<QQQQ", m, z64_offset + 24)
        if count > MAX_ZIP_ENTRIES or cd_size > MAX_ZIP_DIRECTORY:
            raise PmxResourceError(f"{self.path}: zip directory declares {count} entries / {cd_size} bytes, over the limit")
        if cd_offset + cd_size > size:
            self._fail(f"central directory [{cd_offset}, +{cd_size}) beyond file size {size}")
        pos = cd_offset
        for _ in range(count):
            if pos + 46 > cd_offset + cd_size or m[pos:pos + 4] != b"PK\x01\x02":
                self._fail(f"bad central directory record at offset {pos}")
            (flag, method, _t, _d, _crc, csize, usize, nlen, xlen, clen, _ds, _ia, _ea,
             lfh) = struct.unpack_from("<HHHHIIIHHHHHIi", m, pos + 8)
            lfh &= 0xFFFFFFFF
            name = bytes(m[pos + 46:pos + 46 + nlen]).decode("utf-8", "replace")
            extra = m[pos + 46 + nlen:pos + 46 + nlen + xlen]
            usize, csize, lfh = self._zip64_extra(extra, usize, csize, lfh)
            pos += 46 + nlen + xlen + clen
            if method != 0:
                self._fail(f"entry {name!r} uses compression method {method}; pnnx writes store-only (method 0) zips")
            if flag & 0x1:
                self._fail(f"entry {name!r} is encrypted")
            if csize != usize:
                self._fail(f"entry {name!r}: stored size {csize} differs from size {usize}")
            if lfh + 30 > size or m[lfh:lfh + 4] != b"PK\x03\x04":
                self._fail(f"entry {name!r}: local header at {lfh} missing")
            lnlen, lxlen = struct.unpack_from("<HH", m, lfh + 26)
            data = lfh + 30 + lnlen + lxlen
            if data + usize > size:
                self._fail(f"entry {name!r}: data [{data}, +{usize}) runs past end of file ({size} bytes)")
            self.entries[name] = (data, usize)

    def _zip64_extra(self, extra, usize, csize, lfh):
        i = 0
        while i + 4 <= len(extra):
            hid, hlen = struct.unpack_from("<HH", extra, i)
            if hid == 1:
                j = i + 4
                vals = []
                while j + 8 <= i + 4 + hlen:
                    vals.append(struct.unpack_from("<Q", extra, j)[0])
                    j += 8
                it = iter(vals)
                if usize == 0xFFFFFFFF:
                    usize = next(it, usize)
                if csize == 0xFFFFFFFF:
                    csize = next(it, csize)
                if lfh == 0xFFFFFFFF:
                    lfh = next(it, lfh)
                break
            i += 4 + hlen
        return usize, csize, lfh

    def read(self, name, stored_dtype, count):
        if name not in self.entries:
            return None
        offset, size = self.entries[name]
        itemsize = np.dtype(stored_dtype).itemsize
        if size != count * itemsize:
            raise PmxFormatError(
                f"{self.path}: entry {name!r} has {size} bytes but its declared shape needs "
                f"{count} x {itemsize} = {count * itemsize} bytes")
        return np.frombuffer(self._map, dtype=stored_dtype, count=count, offset=offset).copy()


def _widen(raw: np.ndarray, type_str: str) -> np.ndarray:
    if type_str == "bf16":
        return (raw.astype(np.uint32) << 16).view(np.float32)
    if type_str == "c32":
        pairs = raw.astype(np.float32).reshape(-1, 2)
        return (pairs[:, 0] + 1j * pairs[:, 1]).astype(np.complex64)
    return raw


# --- .param ----------------------------------------------------------------------------


def load(param_path: str, bin_path: str | None = None, max_param_bytes=MAX_PARAM_BYTES) -> Graph:
    """Parse a PNNX model into a Graph of PNNX-typed nodes (canonicalization comes later)."""
    try:
        size = os.path.getsize(param_path)
    except OSError as e:
        raise PmxFormatError(f"{param_path}: cannot read: {e.strerror}") from None
    if size > max_param_bytes:
        raise PmxResourceError(f"{param_path}: {size} bytes exceeds the {max_param_bytes}-byte limit for .param files")
    with open(param_path, "rb") as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PmxFormatError(f"{param_path}: not a text file (byte {e.start} is not UTF-8)") from None
    if bin_path is None:
        bin_path = param_path[: -len(".param")] + ".bin" if param_path.endswith(".param") else param_path + ".bin"
    _sniff_ncnn(text.split("\n", 3), param_path)
    zf = StoreZip(bin_path)
    return parse(text, zf, param_path)


def _sniff_ncnn(first_lines, path):
    """ncnn .param files share pnnx's magic line; say so before touching the .bin."""
    if len(first_lines) >= 3 and first_lines[0].strip() == str(MAGIC):
        op_type = (first_lines[2].split() or [""])[0]
        if op_type in _NCNN_LAYERS or (op_type[:1].isupper() and "." not in op_type):
            raise PmxFormatError(
                f"{path}: line 3: layer type {op_type!r} is an ncnn layer: this looks like an ncnn "
                f".param file. pmx reads the .pnnx.param/.pnnx.bin pair pnnx writes beside it")


def parse(text: str, zf: StoreZip, path: str = "<param>") -> Graph:
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if not lines or lines[0].strip() != str(MAGIC):
        got = lines[0].strip()[:40] if lines else ""
        raise PmxFormatError(f"{path}: line 1: expected the pnnx magic number {MAGIC}, found {got!r}")
    if len(lines) < 2:
        raise PmxFormatError(f"{path}: line 2: missing '<operator count> <operand count>' line")
    counts = lines[1].split()
    if len(counts) != 2 or not all(c.isdigit() for c in counts):
        raise PmxFormatError(f"{path}: line 2: expected '<operator count> <operand count>', found {lines[1][:60]!r}")
    op_count, operand_count = int(counts[0]), int(counts[1])
    body = [ln for ln in lines[2:]]
    if op_count != len(body):
        raise PmxFormatError(f"{path}: line 2 declares {op_count} operators but the file has {len(body)} operator lines")

    graph = Graph(source=path)
    operands: dict[str, Value] = {}
    outputs = []
    for lineno, line in enumerate(body, start=3):
        _parse_op_line(line, lineno, path, zf, graph, operands, outputs)
    if len(operands) != operand_count:
        # pnnx writes the count it had; a mismatch means a hand-edited or damaged file.
        raise PmxFormatError(f"{path}: line 2 declares {operand_count} operands but the operators define {len(operands)}")
    for i, v in enumerate(graph.inputs):
        v.name = f"in{i}"
    graph.outputs = outputs
    for i, v in enumerate(outputs):
        if v.producer is not None or v.is_constant:
            v.name = f"out{i}" if v not in graph.inputs else v.name
    if not graph.outputs:
        raise PmxFormatError(f"{path}: the model has no pnnx.Output operator")
    return graph


def _parse_op_line(line, lineno, path, zf, graph, operands, outputs):
    where = f"{path}: line {lineno}"
    tokens = line.split()
    if len(tokens) < 4:
        raise PmxFormatError(f"{where}: expected '<type> <name> <nin> <nout> ...', found {line[:60]!r}")
    op_type, name = tokens[0], tokens[1]
    try:
        nin, nout = int(tokens[2]), int(tokens[3])
    except ValueError:
        raise PmxFormatError(f"{where}: input/output counts {tokens[2]!r} {tokens[3]!r} are not integers") from None
    if nin < 0 or nout < 0 or 4 + nin + nout > len(tokens):
        raise PmxFormatError(f"{where}: {op_type} {name} declares {nin} inputs and {nout} outputs but lists {len(tokens) - 4} names")
    if op_type in _NCNN_LAYERS or (op_type[0].isupper() and "." not in op_type):
        raise PmxFormatError(
            f"{where}: layer type {op_type!r} is an ncnn layer: this looks like an ncnn .param "
            f"file. pmx reads the .pnnx.param/.pnnx.bin pair pnnx writes beside it")
    in_names = tokens[4:4 + nin]
    out_names = tokens[4 + nin:4 + nin + nout]
    inputs = []
    for n in in_names:
        if n not in operands:
            raise PmxFormatError(f"{where}: {op_type} {name} reads operand {n!r} before any operator produces it")
        inputs.append(operands[n])
    outs = []
    for n in out_names:
        if n in operands:
            raise PmxFormatError(f"{where}: operand {n!r} is produced twice")
        v = Value(n, None)
        operands[n] = v
        outs.append(v)

    params, weights, labels = {}, {}, {}
    for item in tokens[4 + nin + nout:]:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise PmxFormatError(f"{where}: expected key=value, found {item[:60]!r}")
        if key[0] == "@":
            weights[key[1:]] = value
        elif key[0] == "$":
            labels[key[1:]] = value
        elif key[0] == "#":
            shape, type_str = parse_shape(value, f"{where}: operand {key[1:]}")
            v = operands.get(key[1:])
            if v is None or (v not in inputs and v not in outs):
                raise PmxFormatError(f"{where}: shape given for {key[1:]!r}, which is not an input or output of {name}")
            v.shape, v.dtype = shape, DTYPES[type_str][1]
        elif key == "expr":
            params[key] = value
        else:
            params[key] = parse_value(value)

    input_names = [None] * len(inputs)
    for label, operand_name in labels.items():
        for i, v in enumerate(inputs):
            if v.name == operand_name and input_names[i] is None:
                input_names[i] = label
                break
        else:
            raise PmxFormatError(f"{where}: ${label}={operand_name} names an operand that is not an input of {name}")

    const_values = {}
    for wname, spec in weights.items():
        const_values[wname] = _load_weight(zf, name, wname, spec, where)

    if op_type == "pnnx.Input":
        for v in outs:
            graph.inputs.append(v)
        return
    if op_type == "pnnx.Output":
        outputs.extend(inputs)
        return
    if op_type == "pnnx.Attribute":
        if len(outs) != 1 or "data" not in const_values:
            raise PmxFormatError(f"{where}: pnnx.Attribute {name} needs one output and an @data weight")
        data = const_values["data"].data
        v = outs[0]
        if v.shape is not None and v.shape != data.shape and int(np.prod(v.shape)) == data.size:
            data = data.reshape(v.shape)
        v.data, v.shape, v.dtype = data, data.shape, str(data.dtype)
        return
    names = input_names + [f"@{k}" for k in const_values]
    node = Node(op_type, name, inputs + list(const_values.values()), outs, params,
                input_names=names, line=lineno)
    graph.add_node(node)


def _load_weight(zf, op_name, wname, spec, where):
    shape, type_str = parse_shape(spec, f"{where}: weight @{wname}")
    if any(d is None for d in shape):
        raise PmxFormatError(f"{where}: weight @{wname} has a dynamic shape {spec!r}")
    stored, _kept = DTYPES[type_str]
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if type_str == "c32":
        count *= 2
    entry = f"{op_name}.{wname}"
    raw = zf.read(entry, stored, count)
    if raw is None:
        raise PmxFormatError(f"{where}: weight {entry!r} ({spec}) is missing from {zf.path}")
    data = _widen(raw, type_str).reshape(shape)
    return Value(entry, data.shape, str(data.dtype), data=data)
