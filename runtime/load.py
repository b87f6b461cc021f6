"""Open a .pmx file: mmap it, verify it completely, and describe it as plain data.

Nothing here trusts the file. The header is read by a small FlatBuffers reader of our
own (the generated accessors neither check bounds nor run fast: they cost microseconds
per field, which was most of the load time). It takes each field's vtable slot, type and
default from the generated code once, at import, then reads one field of all tables of
a type (all tensors, all nodes, all attributes) with a few numpy calls. Every position
is checked against the header's bytes before it is read, and every vector and string is
charged against a budget the size of the header before any of it is read, so a hostile
file cannot make the reader loop or allocate more than a small multiple of its header
size. Then, before any numpy view is made, every offset and size is checked against the
file and the data section, every tensor index a node names against the tensor table,
every shape for sign, rank and overflow, the stored order, arena offsets, alias chains
and extents, expression strings (parsed by runtime/expr.py, never eval'd, and bounded
in expanded size) and each node's attributes against its op's shape rule (run once per
distinct op, attributes and input shapes). Checks over all tensors run as numpy array
operations; a failure names the first tensor or node that fails. Any failure raises
PmxFormatError naming the field and the values found; sizes beyond the configured
limits raise PmxResourceError before anything is allocated. Weights are then wrapped
zero-copy (read-only numpy views of the mmap).
"""

from __future__ import annotations

import functools
import itertools
import math
import mmap
import os
from dataclasses import dataclass, field
from operator import attrgetter
from types import SimpleNamespace

import numpy as np

from pmx.runtime import expr as E
from pmx.runtime import fileformat as ff
from pmx.runtime.dtypes import ENUM_TO_NAME, ENUM_TO_NUMPY
from pmx.runtime.errors import PmxError, PmxFormatError, PmxResourceError
from pmx.runtime.kernels import REGISTRY, output_shapes
from pmx.schema import pmx_generated as fb

# Refuse files whose arena or tensors exceed this before allocating anything; raise it
# with InferenceSession(..., max_arena_bytes=N) for models that really need more.
DEFAULT_MAX_ARENA_BYTES = 8 << 30
MAX_RANK = 32
# Nodes of the expression after desugaring, counting repeated subtrees each time: the
# numexpr and numpy backends walk the expanded tree, so nested erf/square would blow up.
MAX_EXPANDED_EXPR = 1 << 16

_KINDS = (fb.TensorKind.Intermediate, fb.TensorKind.Constant, fb.TensorKind.Input, fb.TensorKind.Output)
# What reading a damaged header can raise: positions outside it (IndexError, from
# _Reader), names that are not UTF-8, and numpy refusing a nonsensical size.
_READ_ERRORS = (IndexError, ValueError, UnicodeDecodeError, TypeError, OverflowError)


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
    dim_min: tuple | None = None  # graph inputs/outputs with dims that may change
    dim_max: tuple | None = None  # -1 = unbounded

    @property
    def nbytes(self):
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


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
    # tensor index -> (root tensor index, byte offset into the root), filled by the verifier
    roots: list = field(default_factory=list)


def _fail(path, msg):
    raise PmxFormatError(f"{path}: {msg}")


def open_model(path, verify_checksum=False, max_arena_bytes=DEFAULT_MAX_ARENA_BYTES) -> Model:
    """mmap and verify `path`. verify_checksum also checks the CRC32s of header and data
    (reads every byte: `pmx verify`, InferenceSession(verify=True))."""
    try:
        f = open(path, "rb")
    except (OSError, ValueError) as e:
        raise PmxFormatError(f"{path}: cannot open: {getattr(e, 'strerror', None) or e}") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        if size < ff.PREAMBLE_SIZE:
            _fail(path, f"file is {size} bytes, shorter than the {ff.PREAMBLE_SIZE}-byte preamble (truncated or not a .pmx)")
        try:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:
            raise PmxFormatError(f"{path}: cannot map the file: {e}") from None
    pre = _check_preamble(path, buf, size)
    if verify_checksum:
        verify_checksums(path, buf, pre)
    header = memoryview(buf)[pre["header_offset"]:pre["header_offset"] + pre["header_size"]]
    try:
        if bytes(header[4:8]) != ff.FILE_IDENTIFIER:
            _fail(path, f"header file identifier is {bytes(header[4:8])!r}, expected {ff.FILE_IDENTIFIER!r}")
        model = _read_header(path, header, pre, size)
    except PmxError:
        raise
    except _READ_ERRORS as e:
        _fail(path, f"damaged header (an offset or length points outside it): {type(e).__name__}: {str(e)[:120]}")
    except MemoryError:
        raise PmxResourceError(f"{path}: out of memory while reading the header") from None
    _verify_structure(model, pre, max_arena_bytes)
    model._map = buf
    _wrap_constants(model, buf, pre)
    return model


def _check_preamble(path, buf, size):
    pre = ff.unpack_preamble(bytes(buf[: ff.PREAMBLE_SIZE]))
    if pre["magic"] != ff.MAGIC:
        _fail(path, f"magic is {pre['magic']!r}, expected {ff.MAGIC!r}: not a .pmx file")
    if pre["preamble_crc"] != pre["preamble_crc_actual"]:
        _fail(path, f"preamble checksum {pre['preamble_crc']:#010x} does not match its bytes ({pre['preamble_crc_actual']:#010x}): the file is damaged")
    if pre["reserved"] != 0:
        _fail(path, f"preamble bytes 60..63 are {pre['reserved']:#010x}, expected 0: the file is damaged")
    if pre["version"] > ff.FORMAT_VERSION:
        _fail(path, f"format version {pre['version']} is newer than this runtime reads ({ff.FORMAT_VERSION}); upgrade pnnx-pmx")
    if pre["version"] < 1:
        _fail(path, f"format version {pre['version']} is invalid")
    if pre["flags"] != 0:
        _fail(path, f"preamble flags {pre['flags']:#x}: this runtime knows no flags")
    if pre["header_offset"] != ff.PREAMBLE_SIZE:
        _fail(path, f"header offset {pre['header_offset']} (expected {ff.PREAMBLE_SIZE})")
    if pre["header_size"] < 8 or pre["header_offset"] + pre["header_size"] > pre["data_offset"]:
        _fail(path, f"header [{pre['header_offset']}, +{pre['header_size']}) is too small or overlaps the data section at {pre['data_offset']}")
    if pre["data_offset"] % ff.ALIGNMENT:
        _fail(path, f"data offset {pre['data_offset']} is not {ff.ALIGNMENT}-byte aligned")
    if pre["data_offset"] + pre["data_size"] != size:
        _fail(path, f"header says the file is {pre['data_offset'] + pre['data_size']} bytes (data at {pre['data_offset']}, {pre['data_size']} bytes) but it is {size} bytes: truncated or padded")
    return pre


def verify_checksums(path, buf, pre):
    """CRC32 of header and data against the preamble (`pmx verify`, verify=True)."""
    h0 = pre["header_offset"]
    with memoryview(buf) as view:
        header_crc = ff.crc32(view[h0:h0 + pre["header_size"]])
        if header_crc != pre["header_crc"]:
            _fail(path, f"header checksum mismatch: stored {pre['header_crc']:#010x}, computed {header_crc:#010x}")
        d0 = pre["data_offset"]
        data_crc = ff.crc32(view[d0:d0 + pre["data_size"]])
        if data_crc != pre["data_crc"]:
            _fail(path, f"data checksum mismatch: stored {pre['data_crc']:#010x}, computed {data_crc:#010x}")


# --- reading the FlatBuffer under a budget ------------------------------------------------
#
# _field learns each field's layout from the generated accessors; _Tables reads one field
# of many tables at once; _Reader checks every position and charges the budget.


class _Probe:
    """Stands in for flatbuffers' Table (hence the method names) while one generated
    accessor runs, noting the vtable slot it asks for and the number type it reads."""

    Pos = 0

    def __init__(self, present):
        self.present, self.slot, self.flags, self.scalar = present, None, None, False

    def Offset(self, slot):
        self.slot = slot
        return 4 if self.present else 0

    def Get(self, flags, off):
        self.flags, self.scalar = flags, True
        return 0

    def GetVectorAsNumpy(self, flags, off):
        self.flags = flags
        return 0

    def VectorLen(self, off):
        return 0

    def String(self, off):
        return None


class _Field:
    """Where one field of a table type lives (a plain class: a dataclass would cost a
    millisecond of import time)."""

    __slots__ = ("slot", "dtype", "default", "scalar")

    def __init__(self, slot, dtype, default, scalar):
        self.slot = slot  # byte offset of the field's entry in its table's vtable
        self.dtype = dtype  # of a scalar or of a vector's elements (None: strings, tables)
        self.default = default  # a scalar's value when the table omits it
        self.scalar = scalar  # stored in the table itself (else the table holds an offset to it)


def _field(accessor):
    """The layout of the field `accessor` (a generated method, e.g. fb.Tensor.AliasOf)
    reads: the generated code stays the one place that knows slots, types and defaults
    (tools/regen_schema.py rewrites it from schema/pmx.fbs)."""
    absent, present = _Probe(False), _Probe(True)
    default = accessor(SimpleNamespace(_tab=absent))
    accessor(SimpleNamespace(_tab=present))
    dtype = np.dtype(present.flags.packer_type.format) if present.flags else None
    return _Field(absent.slot, dtype, default, present.scalar)


class _Layout:
    """The fields of one table type that the loader reads (attributes named as given),
    and what _Tables needs to know about them, worked out once."""

    def __init__(self, table, **accessors):
        fields = [_field(getattr(table, name)) for name in accessors.values()]
        vars(self).update(zip(accessors, fields))
        self.slots = np.arange(4, max(f.slot for f in fields) + 2, 2)  # vtable entries to read
        vectors = [f for f in fields if not f.scalar]
        self.span_of = {f.slot: j for j, f in enumerate(vectors)}  # vectors and strings: column in _Tables.start
        self.span_columns = [(f.slot - 4) // 2 for f in vectors]  # their columns in _Tables.offsets


_MODEL = _Layout(fb.Model, producer="Producer", tensors="TensorsLength", nodes="NodesLength",
                 inputs="InputsAsNumpy", outputs="OutputsAsNumpy", kept="KeptAsNumpy",
                 arena_size="ArenaSize", pass_stats="PassStatsLength", source="Source")
_TENSOR = _Layout(fb.Tensor, name="Name", kind="Kind", dtype="Dtype", shape="ShapeAsNumpy",
                  data_offset="DataOffset", data_size="DataSize", arena_offset="ArenaOffset",
                  alias_of="AliasOf", alias_offset="AliasOffset", alias_strides="AliasStridesAsNumpy",
                  dim_min="DimMinAsNumpy", dim_max="DimMaxAsNumpy")
_NODE = _Layout(fb.Node, op="Op", name="Name", inputs="InputsAsNumpy", outputs="OutputsAsNumpy",
                attrs="AttrsLength", expr="Expr", variant="Variant")
_ATTR = _Layout(fb.Attr, name="Name", kind="Kind", ints="IntsAsNumpy", floats="FloatsAsNumpy",
                strings="StringsLength")
_PASS_STAT = _Layout(fb.PassStat, name="Name", nodes_before="NodesBefore", nodes_after="NodesAfter")
_I32, _U16, _U32 = np.dtype("<i4"), np.dtype("<u2"), np.dtype("<u4")


class _Reader:
    """The header's bytes, read only at checked positions and under a budget: every vector
    and string read is charged against the header size. In a file pmx wrote each vector
    and string is stored once, so the total never exceeds the header; a hostile file whose
    tables all point at one big vector is stopped after reading about twice its header,
    however many times it repeats the pointer. A whole column is charged before any of it
    is read, so nothing is allocated beyond a small multiple of the budget."""

    def __init__(self, path, header):
        self.path = path
        self.raw = bytes(header)
        self.u8 = np.frombuffer(self.raw, np.uint8)
        self.views = {}  # dtype -> the header as an array of it
        self.budget = self.left = 2 * len(self.raw) + 4096

    def charge(self, nbytes, what):
        self.left -= nbytes
        if nbytes < 0 or self.left < 0:
            _fail(self.path, f"{what}: the header's vectors and strings add up to more than {self.budget} bytes, twice its size (damaged or hostile offsets)")

    def count(self, n, elem_bytes, what):
        self.charge(n * elem_bytes, f"{what} ({n} elements)")

    def gather(self, pos, dtype, what):
        """The little-endian `dtype` values at byte positions `pos` (an int64 array: every
        position computed here is one)."""
        size = dtype.itemsize
        outside = pos.view(np.uint64) > len(self.raw) - size  # negative ones too: seen unsigned, they are huge
        if np.count_nonzero(outside):
            raise IndexError(f"{what} at byte {pos[outside][0]} is outside the {len(self.raw)}-byte header")
        if not np.count_nonzero(pos % size):  # aligned, as flatbuffers writes them: one lookup
            return self._view(dtype)[pos // size]
        out = np.empty((len(pos), size), np.uint8)  # a hostile file need not align anything
        for b in range(size):
            out[:, b] = self.u8[pos + b]
        return out.view(dtype).reshape(len(pos))

    def _view(self, dtype):
        view = self.views.get(dtype)
        if view is None:
            view = self.views[dtype] = np.frombuffer(self.raw, dtype, len(self.raw) // dtype.itemsize)
        return view

    def elements(self, start, length, size):
        """Byte positions of the elements of every run (`length` elements of `size` bytes
        from `start`), run after run. Charge the runs first: this allocates per element."""
        first = np.cumsum(length) - length
        return np.repeat(start - first * size, length) + np.arange(int(length.sum())) * size

    def numbers(self, start, length, dtype, what):
        """One tuple of Python numbers per run."""
        self.count(int(length.sum()), dtype.itemsize, what)
        return _split(self.gather(self.elements(start, length, dtype.itemsize), dtype, what).tolist(), length)

    def strings(self, start, length, what):
        self.charge(int(length.sum()), what)
        outside = (length > 0) & ((start < 0) | (start > len(self.raw) - length))
        if np.count_nonzero(outside):
            raise IndexError(f"{what} at byte {start[outside][0]} runs past the {len(self.raw)}-byte header")
        raw = self.raw
        return [raw[s:s + n].decode() for s, n in zip(start.tolist(), length.tolist())]


def _split(flat, length):
    """`flat` cut into one tuple per run of `length` items."""
    ends = np.cumsum(length).tolist()
    return [tuple(flat[a:b]) for a, b in zip([0] + ends[:-1], ends)]


class _Tables:
    """Tables of one type (`layout`) at byte positions `pos` of the header,
    read a field at a time for all of them."""

    def __init__(self, r, pos, layout, what):
        self.r, self.pos, self.what, self.span_of = r, pos, what, layout.span_of
        vtable = pos - r.gather(pos, _I32, f"{what} vtable offset")
        vtable_len = r.gather(vtable, _U16, f"{what} vtable length")
        # every vtable entry of every table at once: (tables, fields) offsets, 0 = absent.
        # Unlisted entries read byte 0 instead, which every header has (see _or_zero).
        listed = layout.slots < vtable_len[:, None]
        entries = r.gather(_or_zero(listed, vtable[:, None] + layout.slots).ravel(), _U16, f"{what} vtable entry")
        self.offsets = np.where(listed, entries.reshape(listed.shape), 0)
        self._read_spans(layout.span_columns)

    def _read_spans(self, columns):
        """(position of the first element, length) of every vector and string field of
        every table, (4, 0) where a table omits one: all fields at once, since each numpy
        call costs about as much for one table as for a thousand."""
        off = self.offsets[:, columns]
        present = (off > 0).ravel()
        at = _or_zero(present, (self.pos[:, None] + off).ravel())
        target = _or_zero(present, at + self.r.gather(at, _U32, f"{self.what} offset"))
        length = np.where(present, self.r.gather(target, _U32, f"{self.what} length"), 0)
        self.start = (target + 4).reshape(off.shape)
        self.length = length.astype(np.int64).reshape(off.shape)

    def __len__(self):
        return len(self.pos)

    def subset(self, idx):
        sub = object.__new__(_Tables)
        sub.r, sub.what, sub.span_of = self.r, self.what, self.span_of
        sub.pos, sub.offsets = self.pos[idx], self.offsets[idx]
        sub.start, sub.length = self.start[idx], self.length[idx]
        return sub

    def scalars(self, field):
        off = self.offsets[:, (field.slot - 4) // 2]
        present = off > 0
        values = self.r.gather(_or_zero(present, self.pos + off), field.dtype, f"{self.what} field")
        return np.where(present, values, field.default).astype(field.dtype)

    def lengths(self, field):
        """Each table's length of a vector or string field (0 where omitted)."""
        return self.length[:, self.span_of[field.slot]]

    def numbers(self, fields, what):
        """Per field, each table's vector as a tuple of Python numbers. Fields of one
        element type are read together: a numpy call costs the same for more elements."""
        return self._per_field(fields, self.r.numbers(*self._spans(fields), fields[0].dtype, what))

    def strings(self, fields, what):
        return self._per_field(fields, self.r.strings(*self._spans(fields), what))

    def _spans(self, fields):
        columns = [self.span_of[f.slot] for f in fields]
        return self.start[:, columns].T.ravel(), self.length[:, columns].T.ravel()

    def _per_field(self, fields, flat):
        n = len(self.pos)
        return [flat[k * n:(k + 1) * n] for k in range(len(fields))]

    def _targets(self, field, what):
        """Positions of what a vector of offsets (to tables or strings) points at, all
        tables' vectors one after another, and each vector's length."""
        start, length = self._spans([field])
        self.r.count(int(length.sum()), 4, what)
        pos = self.r.elements(start, length, 4)
        return pos + self.r.gather(pos, _U32, what), length

    def tables(self, field, layout, what):
        pos, length = self._targets(field, what)
        return _Tables(self.r, pos, layout, what), length

    def string_lists(self, field, what):
        pos, length = self._targets(field, what)
        return _split(self.r.strings(pos + 4, self.r.gather(pos, _U32, what).astype(np.int64), what), length)


def _or_zero(present, at):
    """`at` where `present`, else byte 0: the header's first 8 bytes (root offset and file
    identifier) always exist, so reading any scalar there is safe, and the value read is
    discarded. Cheaper than selecting the present tables and scattering back."""
    return np.where(present, at, 0)


def _one_of(values, allowed):
    """Which of `values` (an integer array) are in the tuple `allowed`."""
    return (values[:, None] == np.array(allowed)).any(axis=1)


def _check_all(path, bad, message):
    """Fail with message(i) for the first i where the boolean array `bad` holds."""
    if np.count_nonzero(bad):  # (much cheaper than bad.any() on small arrays)
        _fail(path, message(int(np.argmax(bad))))


def _read_header(path, header, pre, size) -> Model:
    r = _Reader(path, header)
    m = _Tables(r, r.gather(np.zeros(1, np.int64), _U32, "root offset").astype(np.int64), _MODEL, "model")
    tensors = _read_tensors(r, m.tables(_MODEL.tensors, _TENSOR, "tensors")[0])
    nodes = _read_nodes(r, m.tables(_MODEL.nodes, _NODE, "nodes")[0])
    [inputs], [outputs], [kept] = m.numbers((_MODEL.inputs, _MODEL.outputs, _MODEL.kept),
                                            "model inputs, outputs, kept")
    s = m.tables(_MODEL.pass_stats, _PASS_STAT, "pass_stats")[0]
    [names] = s.strings((_PASS_STAT.name,), "pass names")
    stats = list(zip(names, s.scalars(_PASS_STAT.nodes_before).tolist(), s.scalars(_PASS_STAT.nodes_after).tolist()))
    [producer], [source] = m.strings((_MODEL.producer, _MODEL.source), "producer, source")
    return Model(path, tensors, nodes, list(inputs), list(outputs), list(kept), int(m.scalars(_MODEL.arena_size)[0]),
                 {}, stats, producer, source, size, pre)


def _read_tensors(r, t):
    path = r.path
    rank, n_strides = t.lengths(_TENSOR.shape), t.lengths(_TENSOR.alias_strides)
    n_min, n_max = t.lengths(_TENSOR.dim_min), t.lengths(_TENSOR.dim_max)
    _check_all(path, rank > MAX_RANK, lambda i: f"tensor {i} has rank {rank[i]}, more than {MAX_RANK}")
    _check_all(path, n_strides > MAX_RANK, lambda i: f"tensor {i} has {n_strides[i]} alias strides, more than {MAX_RANK}")
    ranged = (n_min > 0) | (n_max > 0)  # graph inputs and outputs with dims that may change
    _check_all(path, ranged & ((n_min != rank) | (n_max != rank)),
               lambda i: f"tensor {i} has {n_min[i]}/{n_max[i]} dim ranges for rank {rank[i]}")
    codes = t.scalars(_TENSOR.dtype)
    _check_all(path, ~_one_of(codes, tuple(ENUM_TO_NUMPY)),
               lambda i: f"tensor {i} has dtype code {codes[i]}, not one of {sorted(ENUM_TO_NAME)}")
    vectors = (_TENSOR.shape, _TENSOR.alias_strides, _TENSOR.dim_min, _TENSOR.dim_max)
    shapes, strides, dim_min, dim_max = t.numbers(vectors, "tensor shapes, alias_strides, dim ranges")
    for i in np.flatnonzero(ranged).tolist():
        for d, lo, hi in zip(shapes[i], dim_min[i], dim_max[i]):
            if lo < 0 or hi < -1 or (hi != -1 and not lo <= d <= hi):
                _fail(path, f"tensor {i} dim range {lo}..{hi} does not contain its planned size {d}")
    [names] = t.strings((_TENSOR.name,), "tensor names")
    dtypes = [ENUM_TO_NUMPY[c] for c in codes.tolist()]
    kinds, data_offsets, data_sizes, arena_offsets, alias_ofs, alias_offsets = (
        t.scalars(getattr(_TENSOR, k)).tolist()
        for k in ("kind", "data_offset", "data_size", "arena_offset", "alias_of", "alias_offset"))
    strides, dim_min, dim_max = ([v or None for v in col] for col in (strides, dim_min, dim_max))  # () -> None
    return [TensorInfo(*row) for row in zip(names, kinds, dtypes, shapes, data_offsets, data_sizes,
                                            arena_offsets, alias_ofs, alias_offsets, strides, dim_min, dim_max)]


def _read_nodes(r, n):
    ops, names, exprs, variants = n.strings((_NODE.op, _NODE.name, _NODE.expr, _NODE.variant),
                                            "node ops, names, expressions, variants")
    inputs, outputs = n.numbers((_NODE.inputs, _NODE.outputs), "node inputs, outputs")
    attrs = _read_attrs(r, *n.tables(_NODE.attrs, _ATTR, "node attrs"))
    return [NodeInfo(*row) for row in zip(ops, names, inputs, outputs, attrs, exprs, variants)]


_INTS = (fb.AttrKind.Bool, fb.AttrKind.Int, fb.AttrKind.Ints)
_FLOATS = (fb.AttrKind.Float, fb.AttrKind.Floats)
_STRINGS = (fb.AttrKind.String, fb.AttrKind.Strings)
_LISTS = (fb.AttrKind.Ints, fb.AttrKind.Floats, fb.AttrKind.Strings)


def _read_attrs(r, a, per_node):
    """One dict per node, from all nodes' attribute tables (`per_node` of them each)."""
    [names] = a.strings((_ATTR.name,), "attribute names")
    kinds = a.scalars(_ATTR.kind)
    owner = np.repeat(np.arange(len(per_node)), per_node)

    def where(i):
        return f"node {owner[i]} attribute {names[i]!r}"

    _check_all(r.path, ~_one_of(kinds, (fb.AttrKind.None_,) + _INTS + _FLOATS + _STRINGS),
               lambda i: f"{where(i)} has unknown kind {kinds[i]}")
    values = [None] * len(a)
    for group, read in ((_INTS, lambda s: s.numbers((_ATTR.ints,), "attribute ints")[0]),
                        (_FLOATS, lambda s: s.numbers((_ATTR.floats,), "attribute floats")[0]),
                        (_STRINGS, lambda s: s.string_lists(_ATTR.strings, "attribute strings"))):
        idx = np.flatnonzero(_one_of(kinds, group))
        if not len(idx):
            continue
        for i, kind, vals in zip(idx.tolist(), kinds[idx].tolist(), read(a.subset(idx))):
            if kind in _LISTS:
                values[i] = vals
            elif len(vals) != 1:
                _fail(r.path, f"{where(i)} should hold one value, holds {len(vals)}")
            else:
                values[i] = bool(vals[0]) if kind == fb.AttrKind.Bool else vals[0]
    names, values = _split(names, per_node), _split(values, per_node)
    return [dict(zip(k, v)) for k, v in zip(names, values)]


# --- structural verification --------------------------------------------------------------


def _verify_structure(model: Model, pre, max_arena_bytes):
    if model.arena_size > max_arena_bytes:
        raise PmxResourceError(f"{model.path}: arena of {model.arena_size} bytes exceeds the limit of {max_arena_bytes} bytes (raise it with max_arena_bytes=)")
    nbytes = _check_tensors(model, pre["data_size"], max_arena_bytes)
    model.roots = _resolve_aliases(model)
    for i, t in enumerate(model.tensors):
        if t.kind != fb.TensorKind.Constant and t.alias_of >= 0:
            _check_alias_extent(model, i, t, nbytes)
    _check_io(model)
    _check_nodes(model)
    _check_shape_rules(model)


# Offsets and sizes read from the file are compared as int64 after clamping to this, and
# every limit and tensor size is kept below it, so a clamped value fails the checks its
# true value fails and the sum of two never overflows. (Nothing real comes near 2 EiB.)
_CLAMP = 1 << 61


def _check_tensors(model, data_size, max_arena_bytes):
    """Kind, shape, size, and where each tensor's bytes are (data section, arena range or
    alias target), checked for all tensors at once. Returns each tensor's byte count."""
    path, tensors, n = model.path, model.tensors, len(model.tensors)

    def where(i):
        return f"tensor {i} ({tensors[i].name[:40]!r})"

    def column(name, dtype):
        return np.fromiter(map(attrgetter(name), tensors), dtype, n)

    kind = column("kind", np.int64)
    _check_all(path, ~_one_of(kind, _KINDS), lambda i: f"{where(i)} has kind {kind[i]}, not one of {list(_KINDS)}")
    shapes = [t.shape for t in tensors]
    rank = np.fromiter(map(len, shapes), np.int64, n)
    dims = np.fromiter(itertools.chain.from_iterable(shapes), np.int64, int(rank.sum()))
    owner = np.repeat(np.arange(n), rank)  # the tensor each dim belongs to
    _check_all(path, np.bincount(owner[dims < 0], minlength=n) > 0,
               lambda i: f"{where(i)} has shape {shapes[i]}: dims must be non-negative")
    nbytes = [math.prod(s) * t.dtype.itemsize for s, t in zip(shapes, tensors)]
    # Zero dims count as 1 (kernels may loop over the other dims of an empty tensor) and
    # views count in full (a stride-0 view of 4 bytes can have 2**40 elements): the bound
    # is on work, not only on bytes.
    bound = list(nbytes)
    for i in np.flatnonzero(np.bincount(owner[dims == 0], minlength=n)).tolist():
        bound[i] = math.prod(max(d, 1) for d in shapes[i]) * tensors[i].dtype.itemsize
    limit = min(max(max_arena_bytes, data_size), _CLAMP - 1)
    if max(bound, default=0) > limit:
        i = next(i for i, b in enumerate(bound) if b > limit)
        raise PmxResourceError(f"{path}: {where(i)} of shape {shapes[i]} {tensors[i].dtype.name} exceeds the limit of {max_arena_bytes} bytes (max_arena_bytes)")
    size = np.array(nbytes, np.int64)
    data_offset, data_bytes, arena_offset = (np.minimum(column(k, np.uint64), _CLAMP).astype(np.int64)
                                             for k in ("data_offset", "data_size", "arena_offset"))
    alias_of = column("alias_of", np.int64)
    strided = np.array([t.alias_strides is not None for t in tensors], bool)
    const = kind == fb.TensorKind.Constant
    own = ~const & (alias_of == -1)
    in_data, in_arena = min(data_size, _CLAMP), min(model.arena_size, _CLAMP)
    _check_all(path, const & ((alias_of != -1) | strided),
               lambda i: f"{where(i)} is a constant but has alias_of {alias_of[i]} / alias_strides {tensors[i].alias_strides}")
    _check_all(path, const & (data_bytes != size),
               lambda i: f"{where(i)}: data_size {tensors[i].data_size} != shape {shapes[i]} x {tensors[i].dtype.itemsize} bytes = {nbytes[i]}")
    _check_all(path, const & ((data_offset % ff.ALIGNMENT != 0) | (data_offset + data_bytes > in_data)),
               lambda i: f"{where(i)}: data [{tensors[i].data_offset}, +{tensors[i].data_size}) is outside the {data_size}-byte data section or not {ff.ALIGNMENT}-byte aligned")
    _check_all(path, own & strided, lambda i: f"{where(i)} has alias_strides {tensors[i].alias_strides} but aliases nothing")
    _check_all(path, own & ((arena_offset % ff.ALIGNMENT != 0) | (arena_offset + size > in_arena)),
               lambda i: f"{where(i)}: arena range [{tensors[i].arena_offset}, +{nbytes[i]}) is outside the {model.arena_size}-byte arena or not {ff.ALIGNMENT}-byte aligned")
    _check_all(path, ~const & ~own & ((alias_of < 0) | (alias_of >= n)),
               lambda i: f"{where(i)}: alias_of {alias_of[i]} is not a tensor index (0..{n - 1})")
    return nbytes


def _resolve_aliases(model):
    """(root, byte offset) for every tensor, following alias chains once each (memoized,
    so long chains cost linear time); a chain that loops or ends at a constant fails."""
    path, tensors = model.path, model.tensors
    roots = [None if t.kind != fb.TensorKind.Constant and t.alias_of >= 0 else (i, 0) for i, t in enumerate(tensors)]
    for i in [i for i, r in enumerate(roots) if r is None]:
        chain = []
        on_chain = set()
        j = i
        while roots[j] is None:
            if j in on_chain:
                _fail(path, f"tensor {i} ({tensors[i].name[:40]!r}): alias chain loops at tensor {j}")
            on_chain.add(j)
            chain.append(j)
            j = tensors[j].alias_of
        if tensors[j].kind == fb.TensorKind.Constant:
            _fail(path, f"tensor {chain[-1]} ({tensors[chain[-1]].name[:40]!r}) aliases constant tensor {j}; views of constants are not stored")
        root, offset = roots[j]
        for k in reversed(chain):
            offset += tensors[k].alias_offset
            roots[k] = (root, offset)
    return roots


def _check_alias_extent(model, i, t, nbytes):
    """The bytes a view can touch must lie inside its root's arena range."""
    path = model.path
    root, offset = model.roots[i]
    root_bytes = nbytes[root]
    where = f"tensor {i} ({t.name[:40]!r})"
    if any(d == 0 for d in t.shape):
        lo, hi = 0, 0
    elif t.alias_strides is not None:
        if len(t.alias_strides) != len(t.shape):
            _fail(path, f"{where}: {len(t.alias_strides)} alias strides for rank {len(t.shape)}")
        lo = sum(s * (d - 1) for s, d in zip(t.alias_strides, t.shape) if s < 0)
        hi = sum(s * (d - 1) for s, d in zip(t.alias_strides, t.shape) if s > 0) + t.dtype.itemsize
    else:
        lo, hi = 0, nbytes[i]
    if offset + lo < 0 or offset + hi > root_bytes:
        _fail(path, f"{where}: view bytes [{offset + lo}, {offset + hi}) exceed its root tensor {root}'s {root_bytes} bytes (alias_of {t.alias_of}, alias_offset {t.alias_offset}, strides {t.alias_strides})")
    target = model.tensors[t.alias_of]
    if target.alias_strides is None and t.alias_offset + hi > nbytes[t.alias_of]:
        # inside the arena, but reaching past the tensor it claims to view
        _fail(path, f"{where}: view bytes [{t.alias_offset + lo}, {t.alias_offset + hi}) exceed its target tensor {t.alias_of}'s {nbytes[t.alias_of]} bytes")


def _check_io(model):
    path, tensors, n = model.path, model.tensors, len(model.tensors)
    for name, ids in (("inputs", model.inputs), ("outputs", model.outputs), ("kept", model.kept)):
        for idx in ids:
            if not 0 <= idx < n:
                _fail(path, f"model {name} names tensor {idx}, but there are {n} tensors")
    if len(set(model.inputs)) != len(model.inputs):
        _fail(path, f"model inputs {model.inputs} name a tensor twice")
    marked = {i for i, t in enumerate(tensors) if t.kind == fb.TensorKind.Input}
    if marked != set(model.inputs):
        _fail(path, f"tensors marked as inputs {sorted(marked)} differ from the model inputs {sorted(model.inputs)}")


def _label(j, node):
    """How messages name node j (built only on failure: formatting it for every node
    would cost more than the checks)."""
    return f"node {j} ({node.op[:40]!r} {node.name[:40]!r})"


def _check_nodes(model):
    """Indices in range, stored order respected (each input is a constant, a model input
    or produced earlier), each tensor produced once, expressions within the grammar."""
    path, tensors, n = model.path, model.tensors, len(model.tensors)
    available = {i for i, t in enumerate(tensors) if t.kind == fb.TensorKind.Constant} | set(model.inputs)
    produced = set()
    for j, node in enumerate(model.nodes):
        if node.op not in REGISTRY:
            _fail(path, f"{_label(j, node)}: unknown op {node.op[:40]!r}")
        for idx in node.inputs:
            if idx == -1:
                continue
            if not 0 <= idx < n:
                _fail(path, f"{_label(j, node)}: input tensor index {idx} out of range (0..{n - 1})")
            if idx not in available:
                _fail(path, f"{_label(j, node)}: reads tensor {idx} ({tensors[idx].name[:40]!r}) before any node produces it")
        for idx in node.outputs:
            if not 0 <= idx < n:
                _fail(path, f"{_label(j, node)}: output tensor index {idx} out of range (0..{n - 1})")
            t = tensors[idx]
            if t.kind in (fb.TensorKind.Constant, fb.TensorKind.Input) or idx in produced:
                _fail(path, f"{_label(j, node)}: writes tensor {idx} ({t.name[:40]!r}), which is a constant, an input or already produced")
            produced.add(idx)
            available.add(idx)
        if node.expr:
            try:
                size = _expression_size(node.expr, len(node.inputs) if node.op == "elementwise" else 1)
            except PmxFormatError as e:
                _fail(path, f"{_label(j, node)}: {e}")
            if size > MAX_EXPANDED_EXPR:
                _fail(path, f"{_label(j, node)}: expression expands to more than {MAX_EXPANDED_EXPR} terms ({size})")
    for idx in model.outputs + model.kept:
        if idx not in available:
            _fail(path, f"output tensor {idx} ({tensors[idx].name[:40]!r}) is never produced")


@functools.lru_cache(maxsize=4096)
def _expression_size(text, num_inputs):
    """_expanded_size of an expression string, memoized as E.parse is: a model repeats
    the same few activations many times."""
    return _expanded_size(E.desugar(E.parse(text, num_inputs)))


def _expanded_size(tree):
    """Terms of `tree` written out as the backends write it (shared subtrees counted each
    time they appear, operands of square/maximum/minimum twice: numexpr text repeats
    them). Memoized on identity, so linear in the size of the shared structure, and
    iterative, since desugared trees can be deeper than Python's recursion limit."""
    memo = {}
    twice = ("square", "maximum", "minimum")
    stack = [(tree, False)]
    while stack:
        t, ready = stack.pop()
        if id(t) in memo:
            continue
        if t[0] in ("@", "#"):
            memo[id(t)] = 1
        elif ready:
            s = 1 + sum(memo[id(a)] for a in t[1:]) * (2 if t[0] in twice else 1)
            memo[id(t)] = min(s, MAX_EXPANDED_EXPR + 1)
        else:
            stack.append((t, True))
            stack.extend((a, False) for a in t[1:] if id(a) not in memo)
    return memo[id(tree)]


def _check_shape_rules(model):
    """Run each node's shape rule on its stored input shapes and compare with its stored
    output shapes. Kernels size their scratch buffers (padding, im2col) from attributes;
    this ties the attributes to shapes already checked against the arena, so a damaged
    padding or stride is refused here instead of becoming a huge allocation at bind.
    A rule reads only the op, attributes, expression, variant and input shapes and
    dtypes, so a node that repeats all of them (the blocks of a CNN stage, the layers of
    a transformer) reuses the first one's result."""
    path, tensors = model.path, model.tensors
    results = {}
    for j, node in enumerate(model.nodes):
        present = [tensors[i] for i in node.inputs if i >= 0]
        shapes = [t.shape for t in present]
        dtypes = [t.dtype for t in present]
        key = (node.op, node.expr, node.variant, _attrs_key(node.attrs), len(node.inputs), *shapes, *dtypes)
        got = results.get(key)
        if got is None:
            got = results[key] = _rule_shapes(path, j, node, shapes, dtypes)
        want = [tensors[i].shape for i in node.outputs]
        k = min(len(got), len(want))
        if got[:k] != want[:k]:
            _fail(path, f"node {j} ({node.op} {node.name[:40]!r}): its attributes and input shapes give output shapes {got[:k]}, the file stores {want[:k]}")


def _attrs_key(attrs):
    """`attrs` as a hashable key that tells 1, 1.0 and True apart: equal in Python, not
    necessarily to a shape rule. (Tuples read from a file hold one type throughout.)"""
    return tuple((k, v, type(v[0]) if type(v) is tuple and v else type(v)) for k, v in attrs.items())


def _rule_shapes(path, j, node, shapes, dtypes):
    """The output shapes node j's shape rule gives; any failure names the node."""
    try:
        return [shape for shape, _ in output_shapes(node, shapes, dtypes)]
    except PmxError as e:
        _fail(path, f"node {j} ({node.op} {node.name[:40]!r}): {e}")
    except MemoryError:
        raise PmxResourceError(f"{path}: node {j} ({node.op} {node.name[:40]!r}): attributes need too much memory") from None
    except Exception as e:  # noqa: BLE001 - a rule refusing hostile attributes, whatever it raises
        _fail(path, f"node {j} ({node.op} {node.name[:40]!r}) has attributes its op cannot use: {type(e).__name__}: {str(e)[:100]}")


def _wrap_constants(model, buf, pre):
    base = pre["data_offset"]
    for i, t in enumerate(model.tensors):
        if t.kind == fb.TensorKind.Constant:
            count = t.data_size // t.dtype.itemsize
            model.constants[i] = np.frombuffer(buf, dtype=t.dtype, count=count, offset=base + t.data_offset).reshape(t.shape)


def resolve_alias(model, i):
    """(root tensor index, byte offset into the root) of tensor i (resolved at load)."""
    return model.roots[i]
