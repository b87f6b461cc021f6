"""PNNX frontend: read `model.pnnx.param` + `model.pnnx.bin` into the IR, nothing more.

Format (Tencent/ncnn tools/pnnx/src/ir.cpp Graph::load, storezip.cpp StoreZipReader):

    7767517                                  magic
    <operator count> <operand count>
    <type> <name> <nin> <nout> <in operands...> <out operands...> key=value ...

Tokens are separated by ASCII whitespace (C++ `iss >>`). key=value items split at the
first '=':
    name=value        parameter (Parameter::parse_from_string): a value containing '%'
                      is a symbolic string; None; True/False; (..) / [..] lists whose
                      elements are typed one by one; otherwise a value that starts with a
                      digit or '-digit' is a number (float if it has '.' or 'e'), anything
                      else a bare string
    expr=...          kept as the raw string (pnnx.Expression, Tensor.index; has commas,
                      parentheses and brackets): canon/math_ops.py's pnnx_expression_tree
                      reads it into a tree
    @name=(2,3)f32    weight stored in the .bin zip as entry "<op name>.<name>"
    $name=operand     labels the input that reads that operand
    #operand=(1,?,8)f32  operand shape and type; '?' is dynamic, '%s' symbolic
dtype codes: f32 f64 f16 bf16 i8 u8 i16 i32 i64 bool c64 c128 c32, and "null" (type unknown)
for an operand; pnnx writes dims it does not know as '?' (older versions: -1 / -233).

The .bin is a store-only (method 0) zip, zip64 when large; pnnx's own writer always
writes zip64 records.

Deliberate differences from pnnx's reader, which trusts its input:
- Anything malformed raises PmxFormatError naming file, line and token (pnnx prints a
  warning and goes on, or crashes in std::stoi): bad counts, operands read before they
  are produced, '#' for an operand the op does not touch, '$' naming no input, unknown
  dtypes, missing weights, weight sizes that disagree with the declared shape, a zip
  entry whose CRC does not match. Sizes beyond the limits below raise PmxResourceError
  before anything of that size is read or allocated.
- Numbers are parsed exactly or not at all: "1x1" stays a string (pnnx's stoi would give
  1), 1E5 / -2.5E+3 are floats (pnnx only looks for a lower-case 'e'), inf / -inf / nan
  are floats (pnnx reads them back as strings, although it writes them), complex values
  "1.0e+00+-2.0e+00j" (pnnx's "%e+%ej" spelling) are complex (pnnx reads the real part).
  Integers outside int64 are refused (pnnx clamps to int32 when writing).
- "()" and "[]" are the empty tuple, not None: pnnx writes them for empty lists such as
  `Tensor.view shape=()`.
- '$a=x $b=x' (one operand read twice) labels the first and the second input; pnnx's
  load_input_key relabels the first input twice.
- A "()" weight is a scalar (one element); pnnx writes 0-d tensors as (1).
- A zero-element weight may be absent from the zip (pnnx treats a 0-byte entry as absent).
- A model returning a (nested) tuple or list ends in prim::TupleConstruct/ListConstruct ->
  pnnx.Output; the graph outputs are the flattened items and the pack nodes are dropped.
  prim::TupleUnpack/ListUnpack of such a pack reads the items directly.

Graph inputs are named in0, in1, ... and outputs out0, out1, ... in the order of
pnnx.Input / pnnx.Output, as pnnx's own ncnn export names them; every other tensor
keeps its pnnx operand name (suffixed if it would clash with those).
"""

from __future__ import annotations

import math
import mmap
import os
import re
import struct
import zlib

import numpy as np

from pmx.compiler.ir import Graph, Node, Value
from pmx.runtime.errors import PmxFormatError, PmxResourceError

MAGIC = 7767517
MAX_PARAM_BYTES = 1 << 30
MAX_OPERATORS = 1 << 22
MAX_ZIP_ENTRIES = 1 << 20
MAX_ZIP_DIRECTORY = 256 << 20
MAX_DIM = (1 << 31) - 1  # pnnx stores dims as C int
MAX_ELEMENTS = 1 << 40
MAX_PACKED = 1 << 20  # tensors a (nested) output tuple may unpack to
MAX_RANK = 32  # numpy stops at 64; leave room for passes that add axes

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
    "Input",
    "Convolution",
    "ConvolutionDepthWise",
    "Convolution1D",
    "Convolution3D",
    "Deconvolution",
    "DeconvolutionDepthWise",
    "Pooling",
    "Pooling1D",
    "Pooling3D",
    "ReLU",
    "InnerProduct",
    "BatchNorm",
    "Split",
    "Concat",
    "Eltwise",
    "Softmax",
    "Reshape",
    "Permute",
    "Flatten",
    "Sigmoid",
    "Interp",
    "Crop",
    "Slice",
    "BinaryOp",
    "UnaryOp",
    "MemoryData",
    "Padding",
    "Gemm",
    "MatMul",
    "LayerNorm",
    "GELU",
    "Swish",
    "HardSwish",
    "HardSigmoid",
    "Clip",
    "Dropout",
    "Noop",
    "ExpandDims",
    "Squeeze",
    "Reduction",
    "MultiHeadAttention",
    "GroupNorm",
    "InstanceNorm",
    "PReLU",
    "ELU",
    "TanH",
    "Mish",
}

_PACK = ("prim::TupleConstruct", "prim::ListConstruct")
_UNPACK = ("prim::TupleUnpack", "prim::ListUnpack")
# op types this frontend consumes itself (for `pmx compile --list-ops`); tuple packs as
# pnnx writes them for a model returning a tuple. Unpacks are left out: only the unpack of
# such a pack is read, not of a module's tuple result (max pool with indices)
FRONTEND_OPS = ("pnnx.Input", "pnnx.Output", "pnnx.Attribute") + _PACK
_WS = re.compile(r"[ \t\n\r\v\f]+")
_INT = re.compile(r"[-+]?[0-9]+")
_REAL = r"[-+]?(?:[0-9]+\.?[0-9]*(?:[eE][-+]?[0-9]+)?|\.[0-9]+(?:[eE][-+]?[0-9]+)?|inf|nan)"
_FLOAT = re.compile(_REAL)
_COMPLEX = re.compile(rf"({_REAL})([-+]{_REAL})j")
_NCNN_KEY = re.compile(r"-?[0-9]+=")
_INT64 = 1 << 63


def _split(line: str) -> list[str]:
    return [t for t in _WS.split(line) if t]


# --- parameter values ----------------------------------------------------------------


def parse_scalar(s: str):
    """One parameter value (or list element) in pnnx's spelling."""
    if s == "None":
        return None
    if s in ("True", "False"):
        return s == "True"
    if _INT.fullmatch(s):
        n = int(s)
        if not -_INT64 <= n < _INT64:
            raise ValueError(f"integer {s} is outside the int64 range")
        return n
    if _FLOAT.fullmatch(s):
        return float(s)
    m = _COMPLEX.fullmatch(s)
    if m:
        real, imag = m.group(1), m.group(2)
        sign = -1.0 if imag[0] == "-" else 1.0
        return complex(float(real), sign * float(imag[1:]))
    return s


def parse_value(s: str):
    """A parameter value: scalar, string or list. Symbolic values (with '%') stay strings.
    Raises ValueError for an integer outside int64."""
    if "%" in s:
        return s
    if s in ("()", "[]"):
        return ()
    if len(s) >= 2 and s[0] in "([" and s[-1] in ")]":
        return tuple(parse_scalar(e) for e in s[1:-1].split(","))
    return parse_scalar(s)


def parse_shape(spec: str, what: str, allow_null=False):
    """'(1,3,?,%h)f32' -> (shape tuple with None for dynamic dims, pnnx dtype string).
    pnnx writes 'null' for an operand whose type it does not know (allow_null)."""
    close = spec.rfind(")")
    if not spec.startswith("(") or close < 0:
        raise PmxFormatError(f"{what}: expected '(dims)type' such as (1,3,?,?)f32, found {spec[:80]!r}")
    type_str = spec[close + 1 :]
    if type_str not in DTYPES and not (allow_null and type_str == "null"):
        raise PmxFormatError(f"{what}: unknown dtype {type_str[:20]!r} in {spec[:80]!r} (known: {', '.join(DTYPES)})")
    body = spec[1:close]
    dims = []
    if body:
        if body.count(",") >= MAX_RANK:
            raise PmxFormatError(f"{what}: {body.count(',') + 1} dimensions in {spec[:80]!r}; the limit is {MAX_RANK}")
        for d in body.split(","):
            if d == "?" or (d.startswith("%") and len(d) > 1):
                dims.append(None)
                continue
            if not _INT.fullmatch(d):
                raise PmxFormatError(f"{what}: dimension {d[:20]!r} in {spec[:80]!r} is not an integer, '?' or '%name'")
            n = int(d)
            if n > MAX_DIM:
                raise PmxResourceError(f"{what}: dimension {d[:24]} in {spec[:80]!r} exceeds {MAX_DIM}")
            if n < 0:
                if n not in (-1, -233):
                    raise PmxFormatError(
                        f"{what}: dimension {d[:24]} in {spec[:80]!r} is negative (only '?', '%name', "
                        f"-1 and -233 mark unknown dimensions)"
                    )
                n = None  # older pnnx writes its in-memory -1 (unknown) / -233 (symbolic)
            dims.append(n)
    return tuple(dims), type_str


# --- .bin store-only zip --------------------------------------------------------------

_EOCD = struct.Struct("<4sHHHHIIH")  # 22 bytes
_Z64_LOCATOR = struct.Struct("<4sIQI")  # 20 bytes
_Z64_EOCD = struct.Struct("<4sQHHIIQQQQ")  # 56 bytes
_CDFH = struct.Struct("<4sHHHHHHIIIHHHHHII")  # 46 bytes
_LFH = struct.Struct("<4sHHHHHIIIHH")  # 30 bytes


class StoreZip:
    """Reader for the store-only zip pnnx writes. Every offset and size is checked against
    the file before use; entries are served from an mmap and nothing is decompressed, so
    a hostile zip cannot make us read or allocate more than the file holds."""

    def __init__(self, path: str):
        self.path = path
        self.entries = {}  # name -> (data offset, size, crc32)
        self._map = b""
        self._file = None
        try:
            self._file = open(path, "rb")  # noqa: SIM115 - held for the mmap, closed by close()
            size = os.fstat(self._file.fileno()).st_size
        except OSError as e:
            raise PmxFormatError(f"{path}: cannot open weights file: {e.strerror}") from None
        if size == 0:
            self.close()
            return  # an empty .bin: a model without weights
        if size < _EOCD.size:
            self.close()
            raise PmxFormatError(f"{path}: {size} bytes is too small for a zip archive")
        try:
            self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
            self._read_directory(size)
        except struct.error:
            self.close()
            raise PmxFormatError(f"{path}: not a valid pnnx weights zip: truncated zip structure") from None
        except OSError as e:
            self.close()
            raise PmxFormatError(f"{path}: cannot map weights file: {e.strerror}") from None
        except BaseException:
            self.close()
            raise

    def close(self):
        if isinstance(self._map, mmap.mmap):
            self._map.close()
        self._map = b""
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _fail(self, msg):
        raise PmxFormatError(f"{self.path}: not a valid pnnx weights zip: {msg}")

    def _find_eocd(self, size):
        m = self._map
        pos = size - _EOCD.size
        low = max(0, size - 65557)
        while pos >= low:
            pos = m.rfind(b"PK\x05\x06", low, pos + 4)
            if pos < 0:
                break
            comment_len = struct.unpack_from("<H", m, pos + 20)[0]
            if pos + _EOCD.size + comment_len == size:
                return pos
            pos -= 1
        self._fail("no end-of-central-directory record (truncated, or not a zip file)")

    def _read_directory(self, size):
        m = self._map
        eocd = self._find_eocd(size)
        _, disk, start_disk, n_here, count, cd_size, cd_offset, _ = _EOCD.unpack_from(m, eocd)
        limit = eocd
        needs64 = 0xFFFF in (disk, start_disk, n_here, count) or 0xFFFFFFFF in (cd_size, cd_offset)
        loc = eocd - _Z64_LOCATOR.size
        if loc >= 0 and m[loc : loc + 4] == b"PK\x06\x07":
            _, _, z64_offset, _ = _Z64_LOCATOR.unpack_from(m, loc)
            if z64_offset > loc - _Z64_EOCD.size or m[z64_offset : z64_offset + 4] != b"PK\x06\x06":
                self._fail(f"zip64 end record offset {z64_offset} does not point at a zip64 end record")
            rec = _Z64_EOCD.unpack_from(m, z64_offset)
            count, cd_size, cd_offset = rec[7], rec[8], rec[9]
            if rec[6] != count:
                self._fail(f"zip64 end record: {rec[6]} entries on this disk but {count} in total")
            limit = z64_offset
        elif needs64:
            self._fail("end record says zip64 but there is no zip64 end locator")
        elif n_here != count or disk != 0 or start_disk != 0:
            self._fail("multi-disk archives are not supported")
        if count > MAX_ZIP_ENTRIES or cd_size > MAX_ZIP_DIRECTORY:
            raise PmxResourceError(
                f"{self.path}: zip directory declares {count} entries in {cd_size} bytes; the limits are "
                f"{MAX_ZIP_ENTRIES} entries and {MAX_ZIP_DIRECTORY} bytes"
            )
        if cd_offset > limit or cd_size > limit - cd_offset:
            self._fail(f"central directory [{cd_offset}, +{cd_size}) runs past the end record at {limit}")
        if count * _CDFH.size > cd_size:
            self._fail(f"central directory of {cd_size} bytes cannot hold the {count} entries it declares")
        pos, end = cd_offset, cd_offset + cd_size
        for _ in range(count):
            pos = self._read_entry(pos, end, cd_offset)
        if pos != end:
            self._fail(f"central directory has {end - pos} bytes after its {count} declared entries")

    def _read_entry(self, pos, end, cd_offset):
        m = self._map
        if pos + _CDFH.size > end or m[pos : pos + 4] != b"PK\x01\x02":
            self._fail(f"bad central directory record at offset {pos}")
        fields = _CDFH.unpack_from(m, pos)
        flag, method = fields[3], fields[4]
        crc, csize, usize, nlen, xlen, clen, start_disk = fields[7:14]
        lfh = fields[16]
        var = pos + _CDFH.size
        if var + nlen + xlen + clen > end:
            self._fail(f"central directory record at offset {pos} runs past the directory")
        raw_name = bytes(m[var : var + nlen])
        name = raw_name.decode("utf-8", "replace")
        extra = bytes(m[var + nlen : var + nlen + xlen])
        usize, csize, lfh, start_disk = _zip64_extra(extra, usize, csize, lfh, start_disk)
        if usize is None:
            self._fail(f"entry {name!r}: malformed zip64 extra field")
        if not name or name in self.entries:
            self._fail(f"entry name {name!r} is empty or appears twice")
        if flag & 0x2041:
            self._fail(f"entry {name!r} is encrypted")
        if method != 0:
            self._fail(f"entry {name!r} uses compression method {method}; pnnx writes store-only (method 0) zips")
        if csize != usize:
            self._fail(f"entry {name!r}: stored size {csize} differs from its size {usize}")
        if start_disk != 0:
            self._fail(f"entry {name!r} is on disk {start_disk}; multi-disk archives are not supported")
        if lfh > cd_offset - _LFH.size or m[lfh : lfh + 4] != b"PK\x03\x04":
            self._fail(f"entry {name!r}: no local header at offset {lfh}")
        _, _, _, lmethod, _, _, _, _, _, lnlen, lxlen = _LFH.unpack_from(m, lfh)
        data = lfh + _LFH.size + lnlen + lxlen
        if lmethod != method or bytes(m[lfh + _LFH.size : lfh + _LFH.size + lnlen]) != raw_name:
            self._fail(f"entry {name!r}: local header at {lfh} disagrees with the central directory")
        if data > cd_offset or usize > cd_offset - data:
            self._fail(
                f"entry {name!r}: data [{data}, +{usize}) runs past the end of the stored data "
                f"(central directory at {cd_offset}, file {len(m)} bytes)"
            )
        self.entries[name] = (data, usize, crc)
        return var + nlen + xlen + clen

    def read(self, name, stored_dtype, count):
        """The entry as a fresh array of `count` items, or None if there is no such entry."""
        if name not in self.entries:
            return None
        offset, size, crc = self.entries[name]
        itemsize = np.dtype(stored_dtype).itemsize
        if size != count * itemsize:
            raise PmxFormatError(
                f"{self.path}: entry {name!r} has {size} bytes but its declared shape needs "
                f"{count} x {itemsize} = {count * itemsize} bytes"
            )
        view = memoryview(self._map)[offset : offset + size]
        try:
            if zlib.crc32(view) != crc:
                raise PmxFormatError(f"{self.path}: entry {name!r}: CRC-32 mismatch, the weights are damaged")
            arr = np.frombuffer(view, dtype=stored_dtype, count=count)
            out = arr.copy()
            del arr
            return out
        finally:
            view.release()


def _zip64_extra(extra, usize, csize, lfh, disk):
    """Fill the saturated fields from the zip64 extra (id 1), in the order the spec gives.
    Returns usize None when the extra field is malformed or a needed value is missing."""
    i = 0
    need = [usize == 0xFFFFFFFF, csize == 0xFFFFFFFF, lfh == 0xFFFFFFFF, disk == 0xFFFF]
    found = False
    while i < len(extra):
        if len(extra) - i < 4:
            return None, csize, lfh, disk
        hid, hlen = struct.unpack_from("<HH", extra, i)
        i += 4
        if hlen > len(extra) - i:
            return None, csize, lfh, disk
        if hid == 1:
            if found:
                return None, csize, lfh, disk
            found = True
            j, end = i, i + hlen
            vals = [usize, csize, lfh, disk]
            for k in range(4):
                if not need[k]:
                    continue
                width = 4 if k == 3 else 8
                if end - j < width:
                    return None, csize, lfh, disk
                vals[k] = int.from_bytes(extra[j : j + width], "little")
                j += width
            usize, csize, lfh, disk = vals
        i += hlen
    if not found and any(need[:3]):
        return None, csize, lfh, disk
    if not found and need[3]:
        disk = 0  # pnnx's writer saturates the disk number and leaves it out
    return usize, csize, lfh, disk


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
    try:
        with open(param_path, "rb") as f:
            raw = f.read(max_param_bytes + 1)
    except OSError as e:
        raise PmxFormatError(f"{param_path}: cannot read: {e.strerror}") from None
    try:
        text = raw.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        raise PmxFormatError(f"{param_path}: not a text file (byte {e.start} is not UTF-8)") from None
    if bin_path is None:
        bin_path = param_path[: -len(".param")] + ".bin" if param_path.endswith(".param") else param_path + ".bin"
    lines = text.split("\n", 3)
    if len(lines) >= 3:
        _check_not_ncnn(_split(lines[2]), f"{param_path}: line 3")
    with StoreZip(bin_path) as zf:
        return parse(text, zf, param_path)


def _check_not_ncnn(tokens, where):
    """ncnn .param files share pnnx's magic line; say so before the .bin (not a zip) fails."""
    if not tokens:
        return
    op_type = tokens[0]
    if "." in op_type or "::" in op_type:
        return
    if any(t.startswith("#") and "=(" in t for t in tokens[4:]):
        return  # pnnx's operand types: a pnnx file with an op pnnx left as it found it (ONNX's)
    if op_type in _NCNN_LAYERS or any(_NCNN_KEY.match(t) for t in tokens[4:]):
        raise PmxFormatError(
            f"{where}: layer type {op_type[:40]!r} is an ncnn layer: this looks like an ncnn .param "
            f"file. pmx reads the model.pnnx.param / model.pnnx.bin pair pnnx writes beside it"
        )


def parse(text: str, zf: StoreZip, path: str = "<param>") -> Graph:
    lines = text.split("\n")
    while lines and not lines[-1].strip():
        lines.pop()
    first = _split(lines[0]) if lines else []
    if first != [str(MAGIC)]:
        got = lines[0].strip()[:40] if lines else ""
        raise PmxFormatError(f"{path}: line 1: expected the pnnx magic number {MAGIC}, found {got!r}")
    if len(lines) < 2:
        raise PmxFormatError(f"{path}: line 2: missing '<operator count> <operand count>' line")
    counts = _split(lines[1])
    if len(counts) != 2 or not all(re.fullmatch(r"[0-9]+", c) for c in counts):
        raise PmxFormatError(
            f"{path}: line 2: expected '<operator count> <operand count>' (two non-negative integers), "
            f"found {lines[1][:60]!r}"
        )
    op_count, operand_count = int(counts[0]), int(counts[1])
    if op_count > MAX_OPERATORS:
        raise PmxResourceError(f"{path}: line 2 declares {counts[0][:24]} operators; the limit is {MAX_OPERATORS}")
    body = lines[2:]
    if op_count != len(body):
        raise PmxFormatError(
            f"{path}: line 2 declares {op_count} operators but the file has {len(body)} operator lines"
        )

    graph = Graph(source=path)
    operands: dict[str, Value] = {}
    outputs = []
    for lineno, line in enumerate(body, start=3):
        _parse_op_line(line, lineno, path, zf, graph, operands, outputs)
    if len(operands) != operand_count:
        # pnnx writes the count it had; a mismatch means a hand-edited or damaged file.
        raise PmxFormatError(
            f"{path}: line 2 declares {operand_count} operands but the operators define {len(operands)}"
        )
    if not outputs:
        raise PmxFormatError(f"{path}: the model has no pnnx.Output operator (or it reads no operand)")
    _name_graph_tensors(graph, outputs)
    _drop_unused_packs(graph)
    for v in graph.inputs:
        if v.recorded_dtype is None:
            v.dtype = None  # pnnx wrote none (a 0-d input): the compile asks for it (driver._type_inputs)
    return graph


def _name_graph_tensors(graph, outputs):
    renamed = {}
    for i, v in enumerate(graph.inputs):
        renamed[v.uid] = f"in{i}"
    for i, v in enumerate(outputs):
        if v.uid not in renamed:
            renamed[v.uid] = f"out{i}"
    for v in graph.inputs + outputs:
        v.name = renamed[v.uid]
    graph.outputs = outputs
    taken = set(renamed.values())
    for v in graph.values():
        if v.uid not in renamed and v.name in taken:
            v.name = f"{v.name}_pnnx"  # an intermediate operand that happened to be called out0


def _parse_op_line(line, lineno, path, zf, graph, operands, outputs):
    where = f"{path}: line {lineno}"
    tokens = _split(line)
    if len(tokens) < 4:
        raise PmxFormatError(f"{where}: expected '<type> <name> <nin> <nout> ...', found {line[:60]!r}")
    op_type, name = tokens[0], tokens[1]
    if not (_INT.fullmatch(tokens[2]) and _INT.fullmatch(tokens[3])):
        raise PmxFormatError(
            f"{where}: {op_type[:40]} {name[:40]}: input/output counts {tokens[2][:20]!r} {tokens[3][:20]!r} "
            f"are not integers"
        )
    nin, nout = int(tokens[2]), int(tokens[3])
    if nin < 0 or nout < 0 or nin + nout > len(tokens) - 4:
        raise PmxFormatError(
            f"{where}: {op_type[:40]} {name[:40]} declares {tokens[2][:20]} inputs and {tokens[3][:20]} outputs "
            f"but lists {len(tokens) - 4} names"
        )
    _check_not_ncnn(tokens, where)
    if (op_type in ("pnnx.Input", "pnnx.Attribute") and nin) or (op_type == "pnnx.Output" and nout):
        raise PmxFormatError(
            f"{where}: {op_type} {name[:40]} declares {nin} inputs and {nout} outputs; "
            f"{'pnnx.Output has no outputs' if op_type == 'pnnx.Output' else op_type + ' has no inputs'}"
        )
    in_names = tokens[4 : 4 + nin]
    out_names = tokens[4 + nin : 4 + nin + nout]
    inputs = []
    for n in in_names:
        if n not in operands:
            raise PmxFormatError(
                f"{where}: {op_type[:40]} {name[:40]} reads operand {n[:40]!r} before any operator produces it"
            )
        inputs.append(operands[n])
    outs = []
    for n in out_names:
        if n in operands:
            raise PmxFormatError(f"{where}: {op_type[:40]} {name[:40]} produces operand {n[:40]!r} a second time")
        v = Value(n, None)
        operands[n] = v
        outs.append(v)
    packed = _tuple_items(inputs[0], where) if op_type in _UNPACK and len(inputs) == 1 else None
    if packed is not None and len(packed) == nout:
        for n, v in zip(out_names, packed):
            operands[n] = v  # unpacking a tuple built in this graph reads its items directly
        return

    params, weights, labels = {}, {}, []
    touched = {v.uid for v in inputs} | {v.uid for v in outs}
    for item in tokens[4 + nin + nout :]:
        key, eq, value = item.partition("=")
        if not eq or not key or (key[0] in "@$#" and len(key) == 1):
            raise PmxFormatError(f"{where}: {op_type[:40]} {name[:40]}: expected key=value, found {item[:60]!r}")
        if key[0] == "@":
            weights[key[1:]] = value
        elif key[0] == "$":
            labels.append((key[1:], value))
        elif key[0] == "#":
            shape, type_str = parse_shape(value, f"{where}: operand {key[1:][:40]}", allow_null=True)
            v = operands.get(key[1:])
            if v is None or v.uid not in touched:
                raise PmxFormatError(
                    f"{where}: shape given for operand {key[1:][:40]!r}, which is not an input or output "
                    f"of {op_type[:40]} {name[:40]}"
                )
            v.shape = shape
            if type_str != "null":
                v.dtype = v.recorded_dtype = DTYPES[type_str][1]
        elif key == "expr":
            params[key] = value
        else:
            try:
                params[key] = parse_value(value)
            except ValueError as e:
                raise PmxFormatError(f"{where}: {op_type[:40]} {name[:40]}: parameter {key[:40]}: {e}") from None

    input_names = [None] * len(inputs)
    unlabelled = {}  # operand name -> indices of the inputs reading it, not yet labelled
    for i in reversed(range(len(in_names))):
        unlabelled.setdefault(in_names[i], []).append(i)
    for label, operand_name in labels:
        slots = unlabelled.get(operand_name)
        if slots:
            input_names[slots.pop()] = label
        else:
            raise PmxFormatError(
                f"{where}: ${label[:40]}={operand_name[:40]} names no (unlabelled) input of "
                f"{op_type[:40]} {name[:40]}; its inputs are {' '.join(in_names)[:80]}"
            )

    const_values = {}
    for wname, spec in weights.items():
        const_values[wname] = _load_weight(zf, name, wname, spec, where)

    if op_type == "pnnx.Input":
        graph.inputs.extend(outs)
        return
    if op_type == "pnnx.Output":
        for v in inputs:
            outputs.extend(_tuple_items(v, where) or [v])
        return
    if op_type == "pnnx.Attribute":
        if len(outs) != 1 or "data" not in const_values:
            raise PmxFormatError(f"{where}: pnnx.Attribute {name[:40]} needs one output and an @data weight")
        data = const_values["data"].data
        v = outs[0]
        if v.shape is not None and None not in v.shape and v.shape != data.shape and math.prod(v.shape) == data.size:
            data = data.reshape(v.shape)
        v.data, v.shape, v.dtype = data, data.shape, str(data.dtype)
        return
    if op_type.startswith("nn.") and const_values:
        inputs, input_names = _drop_tied_parameters(inputs, input_names, const_values)
    names = input_names + [f"@{k}" for k in const_values]
    node = Node(
        op_type,
        name,
        inputs + list(const_values.values()),
        outs,
        params,
        input_names=names,
        line=lineno,
    )
    graph.add_node(node)


def _drop_tied_parameters(inputs, input_names, weights):
    """A module whose parameter is shared with another (a tied embedding / output layer)
    reaches pnnx as the module op with its @weight plus, as an extra unlabelled operand,
    the pnnx.Attribute of the same tensor. The attribute is the parameter: the operand
    goes, so the module's data input is its only operand again."""

    def tied(v, label):
        return (
            label is None
            and v.data is not None
            and any(
                w.data is not None
                and w.data.shape == v.data.shape
                and w.data.dtype == v.data.dtype
                and np.array_equal(w.data, v.data)
                for w in weights.values()
            )
        )

    keep = [i for i, (v, label) in enumerate(zip(inputs, input_names)) if not tied(v, label)]
    if not keep or len(keep) == len(inputs):
        return inputs, input_names
    return [inputs[i] for i in keep], [input_names[i] for i in keep]


def _tuple_items(v, where):
    """The tensors a prim::TupleConstruct / ListConstruct operand packs, flattened; None
    for an ordinary tensor. Iterative and bounded: a hostile file may nest packs deeply,
    or pack one pack twice at every level (2**depth items)."""
    if v.producer is None or v.producer.op not in _PACK:
        return None
    items, stack, steps = [], [v], 0
    while stack:
        steps += 1
        if steps > MAX_PACKED:
            raise PmxResourceError(f"{where}: tuple {v.name[:40]!r} unpacks to more than {MAX_PACKED} tensors")
        x = stack.pop()
        if x.producer is not None and x.producer.op in _PACK:
            stack.extend(reversed(x.producer.inputs))
        else:
            items.append(x)
    return items


def _drop_unused_packs(graph):
    """A model returning a tuple ends in prim::TupleConstruct -> pnnx.Output; the output
    list now holds the items, so the pack nodes (no shape, no kernel) go. One reverse
    sweep also removes packs that only fed removed packs."""
    removed = set()
    kept_outputs = {v.uid for v in graph.outputs}
    for node in reversed(graph.nodes):
        if node.op in _PACK and all(
            v.uid not in kept_outputs and all(c in removed for c in v.consumers) for v in node.outputs
        ):
            removed.add(node)
    if not removed:
        return
    for node in removed:
        graph.remove_node(node)


def _load_weight(zf, op_name, wname, spec, where):
    shape, type_str = parse_shape(spec, f"{where}: weight @{wname[:40]}")
    if any(d is None for d in shape):
        raise PmxFormatError(f"{where}: weight @{wname[:40]} has a dynamic or negative shape {spec[:80]!r}")
    count = math.prod(shape)
    if count > MAX_ELEMENTS:
        raise PmxResourceError(
            f"{where}: weight @{wname[:40]} {spec[:80]} declares {count} elements; the limit is {MAX_ELEMENTS}"
        )
    stored, _kept = DTYPES[type_str]
    if type_str == "c32":
        count *= 2
    entry = f"{op_name}.{wname}"
    raw = zf.read(entry, stored, count)
    if raw is None:
        if count != 0:
            raise PmxFormatError(f"{where}: weight {entry!r} ({spec[:80]}) is missing from {zf.path}")
        raw = np.zeros(0, stored)
    data = _widen(raw, type_str).reshape(shape)
    return Value(entry, data.shape, str(data.dtype), data=data)
