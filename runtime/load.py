"""Open a .pmx file: mmap it, verify it completely, and describe it as plain data.

Nothing here trusts the file. Before any numpy view is made, every offset and size is
checked against the file and the data section, every tensor index a node names against
the tensor table, every shape for sign and overflow, the stored order, arena offsets,
alias extents and expression strings (parsed by runtime/expr.py, never eval'd). Any
failure raises PmxFormatError naming the field and the values found. Weights are then
wrapped zero-copy (read-only numpy views of the mmap).
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass

import numpy as np

from pmx.runtime import expr as E
from pmx.runtime import fileformat as ff
from pmx.runtime.dtypes import ENUM_TO_NAME, ENUM_TO_NUMPY
from pmx.runtime.errors import PmxFormatError, PmxResourceError
from pmx.runtime.kernels import REGISTRY
from pmx.schema import pmx_generated as fb

# Refuse files whose arena or tensors exceed these before allocating anything.
DEFAULT_MAX_ARENA_BYTES = 16 << 30
MAX_RANK = 32


@dataclass
class TensorInfo:
    name: str
    kind: int
    dtype: np.dtype
    shape: tuple
    data_offset: int
    data_size: int
    arena_offset: int
    alias_of: int
    alias_offset: int
    alias_strides: tuple | None

    @property
    def nbytes(self):
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


@dataclass
class NodeInfo:
    op: str
    name: str
    inputs: tuple
    outputs: tuple
    attrs: dict
    expr: str
    variant: str


@dataclass
class Model:
    path: str
    tensors: list
    nodes: list
    inputs: list
    outputs: list
    kept: list
    arena_size: int
    constants: dict  # tensor index -> read-only ndarray over the mmap
    pass_stats: list
    producer: str
    source: str
    file_size: int
    preamble: dict
    _map: object = None


def _fail(path, msg):
    raise PmxFormatError(f"{path}: {msg}")


def open_model(path, verify_checksum=False, max_arena_bytes=DEFAULT_MAX_ARENA_BYTES) -> Model:
    try:
        f = open(path, "rb")
    except OSError as e:
        raise PmxFormatError(f"{path}: cannot open: {e.strerror}") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        if size < ff.PREAMBLE_SIZE:
            _fail(path, f"file is {size} bytes, shorter than the {ff.PREAMBLE_SIZE}-byte preamble (truncated or not a .pmx)")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    pre = _check_preamble(path, buf, size)
    header = memoryview(buf)[pre["header_offset"]:pre["header_offset"] + pre["header_size"]]
    if verify_checksum:
        verify_checksums(path, buf, pre)
    if not fb.Model.ModelBufferHasIdentifier(header, 0):
        _fail(path, f"header file identifier is {bytes(header[4:8])!r}, expected {ff.FILE_IDENTIFIER!r}")
    try:
        model = _read_header(path, header, pre, size, max_arena_bytes)
    except PmxFormatError:
        raise
    except (struct.error, IndexError, ValueError, UnicodeDecodeError, TypeError, OverflowError) as e:
        _fail(path, f"damaged header ({type(e).__name__}: {e})")
    model._map = buf
    _wrap_constants(model, buf, pre)
    return model


def _check_preamble(path, buf, size):
    pre = ff.unpack_preamble(bytes(buf[: ff.PREAMBLE_SIZE]))
    if pre["magic"] != ff.MAGIC:
        _fail(path, f"magic is {pre['magic']!r}, expected {ff.MAGIC!r}: not a .pmx file")
    if pre["version"] > ff.FORMAT_VERSION:
        _fail(path, f"format version {pre['version']} is newer than this runtime reads ({ff.FORMAT_VERSION}); upgrade pnnx-pmx")
    if pre["version"] < 1:
        _fail(path, f"format version {pre['version']} is invalid")
    if pre["preamble_crc"] != pre["preamble_crc_actual"]:
        _fail(path, f"preamble checksum {pre['preamble_crc']:#010x} does not match its bytes ({pre['preamble_crc_actual']:#010x}): the file is damaged")
    if pre["header_offset"] != ff.PREAMBLE_SIZE:
        _fail(path, f"header offset {pre['header_offset']} (expected {ff.PREAMBLE_SIZE})")
    if pre["header_size"] < 8 or pre["header_offset"] + pre["header_size"] > pre["data_offset"]:
        _fail(path, f"header [{pre['header_offset']}, +{pre['header_size']}) overlaps the data section at {pre['data_offset']}")
    if pre["data_offset"] % ff.ALIGNMENT:
        _fail(path, f"data offset {pre['data_offset']} is not {ff.ALIGNMENT}-byte aligned")
    if pre["data_offset"] + pre["data_size"] != size:
        _fail(path, f"header says the file is {pre['data_offset'] + pre['data_size']} bytes (data at {pre['data_offset']}, {pre['data_size']} bytes) but it is {size} bytes: truncated or padded")
    return pre


def verify_checksums(path, buf, pre):
    """CRC32 of header and data against the preamble (`pmx verify`, verify=True)."""
    h0 = pre["header_offset"]
    header_crc = ff.crc32(memoryview(buf)[h0:h0 + pre["header_size"]])
    if header_crc != pre["header_crc"]:
        _fail(path, f"header checksum mismatch: stored {pre['header_crc']:#010x}, computed {header_crc:#010x}")
    d0 = pre["data_offset"]
    data_crc = ff.crc32(memoryview(buf)[d0:d0 + pre["data_size"]])
    if data_crc != pre["data_crc"]:
        _fail(path, f"data checksum mismatch: stored {pre['data_crc']:#010x}, computed {data_crc:#010x}")


def _vec_len(path, length, elem_bytes, header_size, what):
    if length < 0 or length * elem_bytes > header_size:
        _fail(path, f"{what} declares {length} elements, more than the {header_size}-byte header can hold")
    return length


def _ints(path, n, get, header_size, what):
    _vec_len(path, n, 4, header_size, what)
    return tuple(int(get(i)) for i in range(n))


def _read_header(path, header, pre, size, max_arena_bytes) -> Model:
    hs = pre["header_size"]
    m = fb.Model.GetRootAs(header, 0)
    n_tensors = _vec_len(path, m.TensorsLength(), 4, hs, "tensors")
    tensors = [_read_tensor(path, m.Tensors(i), i, hs) for i in range(n_tensors)]
    n_nodes = _vec_len(path, m.NodesLength(), 4, hs, "nodes")
    nodes = [_read_node(path, m.Nodes(i), i, hs) for i in range(n_nodes)]
    inputs = list(_ints(path, m.InputsLength(), m.Inputs, hs, "inputs"))
    outputs = list(_ints(path, m.OutputsLength(), m.Outputs, hs, "outputs"))
    kept = list(_ints(path, m.KeptLength(), m.Kept, hs, "kept"))
    stats = []
    for i in range(_vec_len(path, m.PassStatsLength(), 4, hs, "pass_stats")):
        s = m.PassStats(i)
        stats.append((_str(s.Name()), s.NodesBefore(), s.NodesAfter()))
    model = Model(path, tensors, nodes, inputs, outputs, kept, int(m.ArenaSize()), {}, stats,
                  _str(m.Producer()), _str(m.Source()), size, pre)
    _verify_structure(model, pre, max_arena_bytes)
    return model


def _str(b):
    return b.decode("utf-8") if b is not None else ""


def _read_tensor(path, t, i, hs):
    shape = _ints(path, t.ShapeLength(), t.Shape, hs, f"tensor {i} shape")
    dtype_enum = t.Dtype()
    if dtype_enum not in ENUM_TO_NUMPY:
        _fail(path, f"tensor {i} has dtype code {dtype_enum}, not one of {sorted(ENUM_TO_NAME)}")
    strides = None
    if t.AliasStridesLength():
        strides = _ints(path, t.AliasStridesLength(), t.AliasStrides, hs, f"tensor {i} alias_strides")
    return TensorInfo(_str(t.Name()), t.Kind(), ENUM_TO_NUMPY[dtype_enum], shape, t.DataOffset(),
                      t.DataSize(), t.ArenaOffset(), t.AliasOf(), t.AliasOffset(), strides)


def _read_node(path, n, i, hs):
    attrs = {}
    for j in range(_vec_len(path, n.AttrsLength(), 4, hs, f"node {i} attrs")):
        a = n.Attrs(j)
        attrs[_str(a.Name())] = _attr_value(path, a, hs)
    return NodeInfo(_str(n.Op()), _str(n.Name()),
                    _ints(path, n.InputsLength(), n.Inputs, hs, f"node {i} inputs"),
                    _ints(path, n.OutputsLength(), n.Outputs, hs, f"node {i} outputs"),
                    attrs, _str(n.Expr()), _str(n.Variant()))


def _attr_value(path, a, hs):
    k = a.Kind()
    if k == fb.AttrKind.None_:
        return None
    if k in (fb.AttrKind.Bool, fb.AttrKind.Int, fb.AttrKind.Ints):
        vals = tuple(int(v) for v in (a.IntsAsNumpy() if a.IntsLength() else ()))
        _vec_len(path, len(vals), 8, hs, "attr ints")
        if k == fb.AttrKind.Ints:
            return vals
        if len(vals) != 1:
            _fail(path, f"attribute {_str(a.Name())!r} should hold one value, holds {len(vals)}")
        return bool(vals[0]) if k == fb.AttrKind.Bool else vals[0]
    if k in (fb.AttrKind.Float, fb.AttrKind.Floats):
        vals = tuple(float(v) for v in (a.FloatsAsNumpy() if a.FloatsLength() else ()))
        if k == fb.AttrKind.Floats:
            return vals
        if len(vals) != 1:
            _fail(path, f"attribute {_str(a.Name())!r} should hold one value, holds {len(vals)}")
        return vals[0]
    if k in (fb.AttrKind.String, fb.AttrKind.Strings):
        n = _vec_len(path, a.StringsLength(), 4, hs, "attr strings")
        vals = tuple(_str(a.Strings(j)) for j in range(n))
        if k == fb.AttrKind.Strings:
            return vals
        if len(vals) != 1:
            _fail(path, f"attribute {_str(a.Name())!r} should hold one value, holds {len(vals)}")
        return vals[0]
    _fail(path, f"attribute {_str(a.Name())!r} has unknown kind {k}")


def _verify_structure(model: Model, pre, max_arena_bytes):
    path = model.path
    n = len(model.tensors)
    if model.arena_size > max_arena_bytes:
        raise PmxResourceError(f"{path}: arena of {model.arena_size} bytes exceeds the limit of {max_arena_bytes} (max_arena_bytes)")
    for i, t in enumerate(model.tensors):
        if len(t.shape) > MAX_RANK or any(d < 0 for d in t.shape):
            _fail(path, f"tensor {i} ({t.name!r}) has shape {t.shape}: dims must be non-negative, rank <= {MAX_RANK}")
        count = 1
        for d in t.shape:
            count *= d
            if count * t.dtype.itemsize > max(max_arena_bytes, pre["data_size"]):
                raise PmxResourceError(f"{path}: tensor {i} ({t.name!r}) of shape {t.shape} is larger than the limit")
        nbytes = count * t.dtype.itemsize
        if t.kind == fb.TensorKind.Constant:
            if t.data_size != nbytes:
                _fail(path, f"tensor {i} ({t.name!r}): data_size {t.data_size} != {count} elements x {t.dtype.itemsize} bytes")
            if t.data_offset % ff.ALIGNMENT or t.data_offset + t.data_size > pre["data_size"]:
                _fail(path, f"tensor {i} ({t.name!r}): data [{t.data_offset}, +{t.data_size}) is outside the {pre['data_size']}-byte data section or unaligned")
        elif t.alias_of >= 0:
            _check_alias(model, i, t, nbytes)
        else:
            if t.alias_of != -1:
                _fail(path, f"tensor {i} ({t.name!r}): alias_of {t.alias_of} is invalid")
            if t.arena_offset % ff.ALIGNMENT or t.arena_offset + nbytes > model.arena_size:
                _fail(path, f"tensor {i} ({t.name!r}): arena range [{t.arena_offset}, +{nbytes}) outside the {model.arena_size}-byte arena or unaligned")
    for name, ids in (("inputs", model.inputs), ("outputs", model.outputs), ("kept", model.kept)):
        for idx in ids:
            if not 0 <= idx < n:
                _fail(path, f"model {name} names tensor {idx}, but there are {n} tensors")
            if name == "inputs" and model.tensors[idx].kind != fb.TensorKind.Input:
                _fail(path, f"model input {idx} ({model.tensors[idx].name!r}) is not marked as an input tensor")
    available = {i for i, t in enumerate(model.tensors) if t.kind == fb.TensorKind.Constant} | set(model.inputs)
    produced = set()
    for j, node in enumerate(model.nodes):
        where = f"node {j} ({node.op} {node.name!r})"
        if node.op not in REGISTRY:
            _fail(path, f"{where}: unknown op {node.op!r}")
        for idx in node.inputs:
            if idx == -1:
                continue
            if not 0 <= idx < n:
                _fail(path, f"{where}: input tensor index {idx} out of range (0..{n - 1})")
            if idx not in available:
                _fail(path, f"{where}: reads tensor {idx} ({model.tensors[idx].name!r}) before any node produces it")
        for idx in node.outputs:
            if not 0 <= idx < n:
                _fail(path, f"{where}: output tensor index {idx} out of range (0..{n - 1})")
            t = model.tensors[idx]
            if t.kind in (fb.TensorKind.Constant, fb.TensorKind.Input) or idx in produced:
                _fail(path, f"{where}: writes tensor {idx} ({t.name!r}), which is a constant, an input or already produced")
            produced.add(idx)
            available.add(idx)
        if node.expr:
            E.parse(node.expr, len(node.inputs) if node.op == "elementwise" else 1)
    for idx in model.outputs + model.kept:
        if idx not in available:
            _fail(path, f"output tensor {idx} ({model.tensors[idx].name!r}) is never produced")


def _check_alias(model, i, t, nbytes):
    path = model.path
    seen = set()
    j, offset = i, 0
    while model.tensors[j].alias_of >= 0:
        if j in seen or len(seen) > len(model.tensors):
            _fail(path, f"tensor {i} ({t.name!r}): alias chain loops")
        seen.add(j)
        nxt = model.tensors[j].alias_of
        if not 0 <= nxt < len(model.tensors):
            _fail(path, f"tensor {j}: alias_of {nxt} out of range")
        offset += model.tensors[j].alias_offset
        j = nxt
    root = model.tensors[j]
    if root.kind == fb.TensorKind.Constant:
        _fail(path, f"tensor {i} ({t.name!r}) aliases constant tensor {j}")
    root_bytes = root.nbytes
    if t.alias_strides is not None:
        if len(t.alias_strides) != len(t.shape):
            _fail(path, f"tensor {i} ({t.name!r}): {len(t.alias_strides)} strides for rank {len(t.shape)}")
        lo = sum(s * (d - 1) for s, d in zip(t.alias_strides, t.shape) if s < 0 and d > 0)
        hi = sum(s * (d - 1) for s, d in zip(t.alias_strides, t.shape) if s > 0 and d > 0) + t.dtype.itemsize
        if offset + lo < 0 or offset + hi > root_bytes:
            _fail(path, f"tensor {i} ({t.name!r}): strided view [{offset + lo}, {offset + hi}) exceeds its target's {root_bytes} bytes")
    elif offset + nbytes > root_bytes:
        _fail(path, f"tensor {i} ({t.name!r}): view [{offset}, +{nbytes}) exceeds its target's {root_bytes} bytes")


def _wrap_constants(model, buf, pre):
    base = pre["data_offset"]
    for i, t in enumerate(model.tensors):
        if t.kind == fb.TensorKind.Constant:
            count = t.data_size // t.dtype.itemsize
            model.constants[i] = np.frombuffer(buf, dtype=t.dtype, count=count, offset=base + t.data_offset).reshape(t.shape)


def resolve_alias(model, i):
    """(root tensor index, byte offset into the root) of tensor i."""
    offset = 0
    while model.tensors[i].alias_of >= 0:
        offset += model.tensors[i].alias_offset
        i = model.tensors[i].alias_of
    return i, offset
