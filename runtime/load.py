"""Open a .pmx file: mmap it, read its header into plain data, have it verified, and wrap its weights.

The reader. It owns the preamble's checks and CRC32 and the header's CRC32 and padding,
checked first, so accidental damage is refused before anything reads the header; the
decoding of the header into Model, TensorInfo and NodeInfo; the parsing of expression
text into trees (_expression, memoized); the zero-copy weight views; the pause of the
garbage collector. Nothing here trusts the file: a forged file with recomputed CRCs
meets the reader's checks and then the verifier's. The header is read by a small
FlatBuffers reader of our own (the generated accessors neither check bounds nor run
fast: they cost microseconds per field, which was most of the load time). It takes each
field's vtable slot, type and default from schema/layout.py (derived from the generated
code by tools/regen_schema.py); each vtable in a file becomes one struct that reads all
of a table's fields in one call. Tensors and nodes are stored as columns (format
versions 2 and 3, one layout: schema/pmx.fbs; runtime/fileformat.py says what 3 adds):
each field of all tensors is one vector, read with one struct call, and the names are
one string cut at stored ends, so a model's hundreds of tensors cost a few dozen calls
instead of a table each. Attribute sets, which a CNN repeats across hundreds of nodes,
are stored once each (compiler/write.py) and nodes with equal attributes share one dict
(read-only: nothing in pmx changes a loaded node's attributes). Where tables remain
(attributes, pass statistics), one field of all of them is read by one list
comprehension, each distinct position once. That is plain Python on purpose: a model has
hundreds of tables, not millions, and numpy's per-call overhead (tens of microseconds
for each operation's first use in a process) costs more than the loops do. Every
position is checked against the header's bytes before it is read, and every vector and
string is charged against a budget the size of the header before any of it is read, so a
hostile file cannot make the reader loop or allocate more than a small multiple of its
header size. Decoding checks what decoding itself needs: every column's length and every
set of ends (names, shapes, node inputs and outputs) against what it cuts, ranks, dim
ranges, dtype and attribute kind codes, and the string and attribute-set entries nodes
name.

Everything else the header claims is checked by runtime/verify.py, which open_model runs
on the decoded model before any numpy view is made (and, with verify_checksum, which
checks the data's CRC32). The reader trusts it: once verify_structure returns, every
constant lies inside the data section, so _wrap_constants makes its views unchecked
(read-only numpy views of the mmap). The verifier is handed _expression and parses each
node's expression in its own order of checks, so the first fault in a file is the one
named. Any failure raises PmxFormatError naming the field and the values found; sizes
beyond the configured limits raise PmxResourceError before anything is allocated.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import mmap
import operator
import os
import struct

import numpy as np

from pmx.runtime import expr as E
from pmx.runtime import fileformat as ff
from pmx.runtime.dtypes import ENUM_TO_NAME, ENUM_TO_NUMPY
from pmx.runtime.errors import PmxError, PmxFormatError, PmxResourceError
from pmx.runtime.hints import foreign_model_hint
from pmx.runtime.record import Record
from pmx.runtime.verify import MAX_EXPANDED_EXPR, _fail, check_data_checksum, verify_structure
from pmx.runtime.verify import check_shape_rules as check_shape_rules  # importable from here, as before
from pmx.schema import layout as schema

# Refuse files whose arena or tensors exceed this before allocating anything; raise it
# with InferenceSession(..., max_arena_bytes=N) for models that really need more.
DEFAULT_MAX_ARENA_BYTES = 8 << 30
MAX_RANK = 32

# What reading a damaged header can raise: positions outside it (IndexError, from
# _Reader, which turns struct's errors into it), names that are not UTF-8, and (kept as
# a safety net) struct or Python refusing a nonsensical size.
_READ_ERRORS = (IndexError, ValueError, UnicodeDecodeError, TypeError, OverflowError, struct.error)


class TensorInfo(Record):
    __slots__ = (
        "name",
        "kind",
        "dtype",
        "shape",
        "data_offset",
        "data_size",
        "arena_offset",
        "alias_of",
        "alias_offset",
        "alias_strides",
        "dim_min",
        "dim_max",
    )

    def __init__(
        self,
        name,
        kind,
        dtype,
        shape,
        data_offset,
        data_size,
        arena_offset,
        alias_of,
        alias_offset,
        alias_strides,
        dim_min=None,
        dim_max=None,
    ):
        self.name, self.kind, self.dtype, self.shape = name, kind, dtype, shape
        self.data_offset, self.data_size, self.arena_offset = data_offset, data_size, arena_offset
        self.alias_of, self.alias_offset, self.alias_strides = alias_of, alias_offset, alias_strides
        # graph inputs/outputs with dims that may change: per dim its least and greatest
        # size (-1 = unbounded); None for fixed shapes
        self.dim_min, self.dim_max = dim_min, dim_max

    @property
    def nbytes(self):
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


class NodeInfo(Record):
    __slots__ = ("op", "name", "inputs", "outputs", "attrs", "expr", "variant")

    def __init__(self, op, name, inputs, outputs, attrs, expr, variant):
        self.op, self.name, self.inputs, self.outputs = op, name, inputs, outputs
        self.attrs, self.expr, self.variant = attrs, expr, variant


class Model(Record):
    __slots__ = (
        "path",
        "tensors",
        "nodes",
        "inputs",
        "outputs",
        "kept",
        "arena_size",
        "constants",
        "pass_stats",
        "producer",
        "source",
        "file_size",
        "preamble",
        "_map",
        "roots",
        "metadata",
    )

    def __init__(
        self,
        path,
        tensors,
        nodes,
        inputs,
        outputs,
        kept,
        arena_size,
        constants,
        pass_stats,
        producer,
        source,
        file_size,
        preamble,
        _map=None,
        roots=None,
        metadata=None,
    ):
        self.path, self.tensors, self.nodes = path, tensors, nodes
        self.inputs, self.outputs, self.kept, self.arena_size = inputs, outputs, kept, arena_size
        self.constants = constants  # tensor index -> read-only ndarray over the mmap
        self.pass_stats, self.producer, self.source = pass_stats, producer, source
        self.file_size, self.preamble, self._map = file_size, preamble, _map
        # tensor index -> (root tensor index, byte offset into the root), filled by the verifier
        self.roots = [] if roots is None else roots
        self.metadata = {} if metadata is None else metadata  # user metadata (pmx compile --meta)


# How messages name a model given as bytes instead of a path.
BYTES_LABEL = "<model bytes>"


def open_model(path, verify_checksum=False, max_arena_bytes=DEFAULT_MAX_ARENA_BYTES) -> Model:
    """mmap and verify `path`, or verify the bytes of a model given as bytes, bytearray
    or memoryview (the same checks; weights are views of those bytes, copied first unless
    they are immutable bytes, so a later change to the buffer cannot reach them).
    The header's CRC32 is always checked; verify_checksum also checks the data's (reads
    every weight byte: `pmx verify`, InferenceSession(verify=True))."""
    if isinstance(path, (bytes, bytearray, memoryview)):
        buf = path if isinstance(path, bytes) else bytes(path)
        path, size = BYTES_LABEL, len(buf)
        if size < ff.PREAMBLE_SIZE:
            _fail(
                path,
                f"{size} bytes, shorter than the {ff.PREAMBLE_SIZE}-byte preamble: bytes are read as the "
                f"model's content (pass a str or os.PathLike for a path)",
            )
        return _open_buffer(path, buf, size, verify_checksum, max_arena_bytes)
    try:
        f = open(path, "rb")  # noqa: SIM115 - the with below closes it; only the open is guarded
    except (OSError, ValueError) as e:
        raise PmxFormatError(f"{path}: cannot open: {getattr(e, 'strerror', None) or e}") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        if size < ff.PREAMBLE_SIZE:
            _fail(
                path,
                f"file is {size} bytes, shorter than the {ff.PREAMBLE_SIZE}-byte preamble (truncated or not a .pmx)",
            )
        try:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:
            raise PmxFormatError(f"{path}: cannot map the file: {e}") from None
    return _open_buffer(path, buf, size, verify_checksum, max_arena_bytes)


def _open_buffer(path, buf, size, verify_checksum, max_arena_bytes):
    """Verify the model in `buf` (an mmap or bytes of `size` bytes) and wrap it."""
    pre = _check_preamble(path, buf, size)
    check_header_checksum(path, buf, pre)
    if verify_checksum:
        check_data_checksum(path, buf, pre)
    with memoryview(buf) as view:
        header = bytes(view[pre["header_offset"] : pre["header_offset"] + pre["header_size"]])
    with collector_paused():
        try:
            if header[4:8] != ff.FILE_IDENTIFIER:
                _fail(path, f"header file identifier is {header[4:8]!r}, expected {ff.FILE_IDENTIFIER!r}")
            model = _read_header(path, header, pre, size)
        except PmxError:
            raise
        except _READ_ERRORS as e:
            _fail(path, f"damaged header (an offset or length points outside it): {type(e).__name__}: {str(e)[:120]}")
        except MemoryError:
            raise PmxResourceError(f"{path}: out of memory while reading the header") from None
        verify_structure(model, pre, max_arena_bytes, _expression)
        model._map = buf
        _wrap_constants(model, buf, pre)
    return model


@contextlib.contextmanager
def collector_paused():
    """Reading a header allocates thousands of small tuples and lists, none in a cycle;
    the cyclic garbage collector's passes over them cost 2-8% of a load (measured on
    torchvision models), so it waits until the load is done. Binding a model's kernels
    (session.py) pauses it too: 6-13% of a bind (DenseNet-121 54.5 -> 51.2 ms, GoogLeNet
    23.6 -> 20.4, medians of 12 alternating binds). Its state is restored as
    found (with overlapping loads on several threads, it ends enabled if it was enabled
    when the first one started)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _check_preamble(path, buf, size):
    pre = ff.unpack_preamble(bytes(buf[: ff.PREAMBLE_SIZE]))
    if pre["magic"] != ff.MAGIC:
        hint = foreign_model_hint(path, "run") if isinstance(path, (str, os.PathLike)) else None
        _fail(
            path, f"magic is {pre['magic']!r}, expected {ff.MAGIC!r}: not a .pmx file" + (f"; {hint}" if hint else "")
        )
    if pre["preamble_crc"] != pre["preamble_crc_actual"]:
        _fail(
            path,
            f"preamble checksum {pre['preamble_crc']:#010x} does not match its bytes ({pre['preamble_crc_actual']:#010x}): the file is damaged",
        )
    if pre["reserved"] != 0:
        _fail(path, f"preamble bytes 60..63 are {pre['reserved']:#010x}, expected 0: the file is damaged")
    if pre["version"] > ff.FORMAT_VERSION:
        _fail(
            path,
            f"format version {pre['version']} is newer than this runtime reads ({ff.FORMAT_VERSION}); upgrade pnnx-pmx",
        )
    if pre["version"] < 1:
        _fail(path, f"format version {pre['version']} is invalid")
    if pre["version"] < ff.OLDEST_READABLE_VERSION:
        # version 1 stored a table per tensor and per node (version 2: columns, read faster)
        _fail(
            path,
            f"format version {pre['version']} was written by an older pmx; this runtime reads versions "
            f"{ff.OLDEST_READABLE_VERSION}-{ff.FORMAT_VERSION}: compile the model again (pmx compile model.pnnx.param)",
        )
    if pre["flags"] != 0:
        _fail(path, f"preamble flags {pre['flags']:#x}: this runtime knows no flags")
    if pre["header_offset"] != ff.PREAMBLE_SIZE:
        _fail(path, f"header offset {pre['header_offset']} (expected {ff.PREAMBLE_SIZE})")
    if pre["header_size"] < 8 or pre["header_offset"] + pre["header_size"] > pre["data_offset"]:
        _fail(
            path,
            f"header [{pre['header_offset']}, +{pre['header_size']}) is too small or overlaps the data section at {pre['data_offset']}",
        )
    header_end = pre["header_offset"] + pre["header_size"]
    if pre["data_offset"] != ff.align(header_end):
        _fail(
            path,
            f"data offset {pre['data_offset']} is not the first {ff.ALIGNMENT}-byte boundary after the "
            f"header's end at {header_end} ({ff.align(header_end)})",
        )
    if pre["data_offset"] + pre["data_size"] != size:
        _fail(
            path,
            f"header says the file is {pre['data_offset'] + pre['data_size']} bytes (data at {pre['data_offset']}, {pre['data_size']} bytes) but it is {size} bytes: truncated or padded",
        )
    return pre


def check_header_checksum(path, buf, pre):
    """CRC32 of the header against the preamble, and the padding after it all zero, at
    every load: the header is small (tens of kilobytes) and every byte of it steers the
    reader, so damage there is refused here rather than met as whatever structure the
    flipped bytes happen to describe."""
    h0, h1 = pre["header_offset"], pre["header_offset"] + pre["header_size"]
    with memoryview(buf) as view:
        crc = ff.crc32(view[h0:h1])
        padding = bytes(view[h1 : pre["data_offset"]])  # under 64 bytes (_check_preamble)
    if crc != pre["header_crc"]:
        _fail(
            path,
            f"header checksum mismatch: stored {pre['header_crc']:#010x}, computed {crc:#010x}: the file is damaged",
        )
    if padding.count(0) != len(padding):
        _fail(
            path,
            f"the padding between header and data (bytes {h1}..{pre['data_offset'] - 1}) is not zero: the file is damaged",
        )


# --- reading the FlatBuffer under a budget ------------------------------------------------
#
# _field learns each field's layout from the generated accessors; _vtable turns one
# vtable into a struct that reads every field of a table in one call; _Reader reads a
# field of many tables at once, checking every position and charging the budget.


class _Field:
    """Where one field of a table type lives (a plain class: a dataclass would cost a
    millisecond of import time)."""

    __slots__ = ("slot", "code", "size", "default", "scalar")

    def __init__(self, slot, code, default, scalar):
        self.slot = slot  # byte offset of the field's entry in its table's vtable
        # struct code of a scalar or of a vector's elements (None: strings, tables)
        self.code = code
        self.default = default if scalar else 0  # what an absent field reads as
        # stored in the table itself (else the table holds a uoffset to it)
        self.scalar = scalar
        self.size = struct.calcsize("<" + code) if scalar else 4  # bytes inside the table


class _Layout:
    """The fields of one table type that the loader reads, in the order _vtable's readers
    return them in; each attribute named as given holds that field's index."""

    def __init__(self, table, **accessors):
        self.fields = tuple(_Field(*schema.TABLES[table][name]) for name in accessors.values())
        vars(self).update((name, k) for k, name in enumerate(accessors))


# the Model table's fields the loader reads (a test builds the layout without the last)
MODEL_ACCESSORS = dict(
    producer="Producer",
    tensors="Tensors",
    nodes="Nodes",
    strings="StringsLength",
    attr_sets="AttrSetsLength",
    inputs="InputsAsNumpy",
    outputs="OutputsAsNumpy",
    kept="KeptAsNumpy",
    arena_size="ArenaSize",
    pass_stats="PassStatsLength",
    source="Source",
    metadata="MetadataLength",
)
_MODEL = _Layout("Model", **MODEL_ACCESSORS)
_TENSORS = _Layout(
    "Tensors",
    names="Names",
    name_ends="NameEndsAsNumpy",
    kinds="KindsAsNumpy",
    dtypes="DtypesAsNumpy",
    ranks="RanksAsNumpy",
    dims="DimsAsNumpy",
    data_offsets="DataOffsetsAsNumpy",
    data_sizes="DataSizesAsNumpy",
    arena_offsets="ArenaOffsetsAsNumpy",
    alias_of="AliasOfAsNumpy",
    alias_offsets="AliasOffsetsAsNumpy",
    strided="StridedAsNumpy",
    strides="StridesAsNumpy",
    ranged="RangedAsNumpy",
    dim_min="DimMinAsNumpy",
    dim_max="DimMaxAsNumpy",
)
_NODES = _Layout(
    "Nodes",
    ops="OpsAsNumpy",
    names="Names",
    name_ends="NameEndsAsNumpy",
    input_ends="InputEndsAsNumpy",
    inputs="InputsAsNumpy",
    output_ends="OutputEndsAsNumpy",
    outputs="OutputsAsNumpy",
    attr_sets="AttrSetsAsNumpy",
    exprs="ExprsAsNumpy",
    variants="VariantsAsNumpy",
)
_ATTR_SET = _Layout("AttrSet", attrs="AttrsLength")
_ATTR = _Layout("Attr", name="Name", kind="Kind", ints="IntsAsNumpy", floats="FloatsAsNumpy", strings="StringsLength")
_PASS_STAT = _Layout("PassStat", name="Name", nodes_before="NodesBefore", nodes_after="NodesAfter")
_KEY_VALUE = _Layout("KeyValue", key="Key", value="Value")
_SOFFSET, _UOFFSET, _VOFFSET = (struct.Struct(f).unpack_from for f in ("<i", "<I", "<H"))


class _Vtables(dict):
    """vtable position -> its reader (_vtable) for one table type in one header, built on
    first use (a writer shares one vtable between all tables with the same fields
    present, so a header has a handful)."""

    def __init__(self, r, layout, what):
        super().__init__()
        self.r, self.layout, self.what = r, layout, what

    def __missing__(self, vt):
        read = self[vt] = _vtable(self.r, self.layout, vt, self.what)
        return read


def _vtable(r, layout, vt, what):
    """The reader of tables whose vtable is at byte `vt`: read(raw, pos) gives a table's
    fields in the layout's order, absent ones as their defaults (0 for strings and
    vectors), then `at`: each field's byte offset in the table (0 where absent), so a
    string or vector field's uoffset `u` read at `pos` points at `pos + at[k] + u`."""
    at = _field_offsets(r.raw, layout, vt, what)
    read = _READERS.get((layout, at))
    if read is None:
        if len(_READERS) > 256:
            _READERS.clear()
        read = _READERS[layout, at] = _new_reader(layout, at)
    return read


def _field_offsets(raw, layout, vt, what):
    """`at` of the vtable at byte vt: each field's byte offset in its table (0 = absent)."""
    if vt < 0:
        raise IndexError(f"{what} vtable at byte {vt} is outside the {len(raw)}-byte header")
    (vlen,) = _VOFFSET(raw, vt)
    return tuple([_VOFFSET(raw, vt + f.slot)[0] if f.slot < vlen else 0 for f in layout.fields])


def _read_one(raw, layout, pos, at):
    """One table's fields (then `at`), as a reader would give them, read one by one: for
    the types a header holds once (model, tensor and node columns), building a reader
    costs more (~15-35 us in a fresh process) than reading its fields."""
    return tuple(
        [_SCALARS[f.code if f.scalar else "I"](raw, pos + a)[0] if a else f.default for f, a in zip(layout.fields, at)]
    ) + (at,)


_SCALARS = {code: struct.Struct("<" + code).unpack_from for code in "bBhHiIqQfd?"}

# (layout, `at`) -> reader: the files pmx writes share their few vtables, so later loads
# in a process skip building them.
_READERS = {}


def _new_reader(layout, at):
    """One struct reads every present field (absent ones come from `tail`, and
    itemgetter puts all in the layout's order)."""
    fields = layout.fields
    present = sorted((a, k) for k, a in enumerate(at) if a)
    absent = [k for k, a in enumerate(at) if not a]
    codes = {k: fields[k].code if fields[k].scalar else "I" for _, k in present}  # offsets: u32
    fmt, end, overlap = "<", 0, False
    for a, k in present:
        overlap |= a < end  # legal FlatBuffers, never written: read such fields one by one
        fmt += f"{a - end}x{codes[k]}"
        end = a + fields[k].size
    if overlap:
        parts = [(a, struct.Struct("<" + codes[k]).unpack_from) for a, k in present]

        def unpack(raw, pos):
            return tuple(read(raw, pos + a)[0] for a, read in parts)
    else:
        unpack = struct.Struct(fmt).unpack_from
    tail = tuple(fields[k].default for k in absent) + (at,)
    order = [0] * len(fields)  # where each field is in unpack(...) + tail
    for j, k in enumerate([k for _, k in present] + absent):
        order[k] = j
    pick = operator.itemgetter(*order, len(fields))  # the fields, then `at`
    return lambda raw, pos: pick(unpack(raw, pos) + tail)


class _Tables:
    """Tables of one type: their positions, their vtables' `at`, their fields as columns
    (one tuple per field, in layout order), and the layout's fields."""

    __slots__ = ("pos", "at", "columns", "fields")


class _Reader:
    """The header's bytes, read only at checked positions and under a budget: every vector
    and string read is charged against the header size. Each distinct position is read
    once (_each_once: tables pointing at one vector share the object read), so in any
    file the distinct vectors and strings of a column are what is charged. In a file pmx
    wrote they do not overlap and the total never exceeds the header; a hostile file whose
    strings or vectors overlap (each starting a few bytes into the previous one) is
    stopped after reading about twice its header. A whole column is charged before any
    of it is read, so nothing is allocated beyond a small multiple of the budget.

    Positions come from unsigned offsets added to positions already read, so only a
    vtable (a table's position minus a signed offset) can lie before the header; struct
    refuses any read past its end, and string slices are checked here.

    Each method reads one field of many tables with list comprehensions: on the few
    hundred tables of a model that costs less than numpy would, whose every call costs
    microseconds and, in a fresh process, tens of microseconds the first time."""

    def __init__(self, path, header):
        self.path = path
        self.raw = bytes(header)
        self.size = len(self.raw)
        self.budget = self.left = 2 * self.size + 4096
        self.vtables = {}  # layout -> _Vtables

    def charge(self, nbytes, what, count):
        self.left -= nbytes
        if self.left < 0:
            _fail(
                self.path,
                f"{what} ({count} elements): the header's vectors and strings add up to more than {self.budget} bytes, twice its size (damaged or hostile offsets)",
            )

    def tables(self, layout, positions, what):
        raw = self.raw
        try:
            # a table's vtable sits at its position minus the soffset stored there
            if len(positions) == 1:
                pos = positions[0]
                rows = [_read_one(raw, layout, pos, _field_offsets(raw, layout, pos - _SOFFSET(raw, pos)[0], what))]
            else:
                vtables = self.vtables.get(layout)
                if vtables is None:
                    vtables = self.vtables[layout] = _Vtables(self, layout, what)
                rows = [vtables[pos - _SOFFSET(raw, pos)[0]](raw, pos) for pos in positions]
        except struct.error as e:
            raise IndexError(f"{what} tables: {e}") from None
        t = _Tables()
        t.pos, t.fields = positions, layout.fields
        *t.columns, t.at = zip(*rows) if rows else [()] * (len(layout.fields) + 1)
        return t

    def _spans(self, t, k, column):
        """Which tables hold string or vector field k (uoffsets `column`; 0 = absent) and
        where each one's data starts."""
        held = list(itertools.compress(range(len(column)), column))
        if len(held) == len(column):
            starts = [p + at[k] + u + 4 for p, at, u in zip(t.pos, t.at, column)]
        else:
            pos, at = t.pos, t.at
            starts = [pos[i] + at[i][k] + column[i] + 4 for i in held]
        return held, starts

    def _lengths(self, starts, elem_bytes, what):
        raw = self.raw
        try:
            lengths = [_UOFFSET(raw, s - 4)[0] for s in starts]
        except struct.error as e:
            raise IndexError(f"{what} lengths: {e}") from None
        count = sum(lengths)
        self.charge(count * elem_bytes, what, count)
        return lengths

    def strings(self, t, k, what, column=None):
        """Field k of every table as a str ("" where absent)."""
        column = t.columns[k] if column is None else column
        held, starts = self._spans(t, k, column)
        return _scatter(
            _each_once(starts, lambda s: self._decode(s, self._lengths(s, 1, what), what)), held, len(column), ""
        )

    def strings_at(self, positions, what):
        """The strings at `positions` (what a vector of strings points at)."""
        starts = [p + 4 for p in positions]
        return self._decode(starts, self._lengths(starts, 1, what), what)

    def _decode(self, starts, lengths, what):
        ends = list(map(operator.add, starts, lengths))
        if ends and max(ends) > self.size:
            s = next(s for s, e in zip(starts, ends) if e > self.size)
            raise IndexError(f"{what} at byte {s - 4} runs past the {self.size}-byte header")
        raw = self.raw
        return [raw[s:e].decode() for s, e in zip(starts, ends)]

    def numbers(self, t, k, what, column=None):
        """Field k (a vector of numbers) of every table as a tuple (() where absent)."""
        column = t.columns[k] if column is None else column
        code = t.fields[k].code
        held, starts = self._spans(t, k, column)
        return _scatter(_each_once(starts, lambda s: self._vectors(s, code, what)), held, len(column), ())

    def _vectors(self, starts, code, what):
        """The vectors of struct code `code` whose length words are at `starts`, as tuples
        (charged against the budget)."""
        lengths = self._lengths(starts, struct.calcsize("<" + code), what)
        structs, raw = _VECTOR_STRUCTS[code], self.raw
        try:
            return [(structs.get(n) or _vector_struct(code, n))(raw, s) for s, n in zip(starts, lengths)]
        except struct.error as e:
            raise IndexError(f"{what}: {e}") from None

    def subtable(self, t, k):
        """The position of table field k of t's first table (None where absent)."""
        u = t.columns[k][0]
        return t.pos[0] + t.at[0][k] + u if u else None

    def column(self, t, k, what):
        """Vector field k of t's first table (a table of columns) as a tuple: one vector,
        read without numbers()'s machinery for many tables (~7 us a call, and a model
        reads some 30 columns)."""
        u = t.columns[k][0]
        return self._vectors([t.pos[0] + t.at[0][k] + u + 4], t.fields[k].code, what)[0] if u else ()

    def targets(self, t, k, what, column=None):
        """Per table, the positions a vector of uoffsets (to tables or strings) in field
        k points at."""
        column = t.columns[k] if column is None else column
        held, starts = self._spans(t, k, column)
        structs, raw = _VECTOR_STRUCTS["I"], self.raw

        def read(starts):
            lengths = self._lengths(starts, 4, what)
            try:
                return [
                    [s + 4 * j + u for j, u in enumerate((structs.get(n) or _vector_struct("I", n))(raw, s))]
                    for s, n in zip(starts, lengths)
                ]
            except struct.error as e:
                raise IndexError(f"{what}: {e}") from None

        return _scatter(_each_once(starts, read), held, len(column), ())


def _each_once(starts, read):
    """read(starts), reading each distinct start once: tables that point at the same
    string or vector (pmx writes each equal one once: compiler/write.py) get the same
    object, and only distinct bytes are charged against the budget, so a hostile file
    pointing every table at one vector costs one read of it."""
    distinct = list(dict.fromkeys(starts))
    if len(distinct) == len(starts):
        return read(starts)
    found = dict(zip(distinct, read(distinct)))
    return list(map(found.__getitem__, starts))


def _scatter(values, held, n, absent):
    """`values` of the tables `held` among n, `absent` for the others."""
    if len(held) == n:
        return values
    out = [absent] * n
    for i, v in zip(held, values):
        out[i] = v
    return out


_VECTOR_STRUCTS = {code: {} for code in "bBhHiIqQfd?"}  # code -> {length: unpack_from}


def _vector_struct(code, n):
    structs = _VECTOR_STRUCTS[code]
    if len(structs) > 256:
        structs.clear()
    read = structs[n] = struct.Struct(f"<{n}{code}").unpack_from
    return read


def _read_header(path, header, pre, size) -> Model:
    r = _Reader(path, header)
    M = _MODEL
    m = r.tables(M, [_UOFFSET(r.raw, 0)[0]], "model")
    [stats], [strings], [attr_sets] = (
        r.targets(m, k, what)
        for k, what in ((M.pass_stats, "pass_stats"), (M.strings, "model strings"), (M.attr_sets, "attribute sets"))
    )
    inputs, outputs, kept = (
        r.column(m, k, f"model {what}") for k, what in ((M.inputs, "inputs"), (M.outputs, "outputs"), (M.kept, "kept"))
    )
    s = r.tables(_PASS_STAT, stats, "pass_stats")
    stats = list(
        zip(
            r.strings(s, _PASS_STAT.name, "pass names"),
            s.columns[_PASS_STAT.nodes_before],
            s.columns[_PASS_STAT.nodes_after],
        )
    )
    [producer], [source] = r.strings(m, M.producer, "producer"), r.strings(m, M.source, "source")
    tensors_at, nodes_at = r.subtable(m, M.tensors), r.subtable(m, M.nodes)
    if tensors_at is None or nodes_at is None:
        _fail(path, f"the header has no {'tensors' if tensors_at is None else 'nodes'} table")
    tensors = _read_tensors(r, tensors_at)
    nodes = _read_nodes(r, nodes_at, r.strings_at(strings, "model strings"), _read_attr_sets(r, attr_sets))
    return Model(
        path,
        tensors,
        nodes,
        list(inputs),
        list(outputs),
        list(kept),
        m.columns[M.arena_size][0],
        {},
        stats,
        producer,
        source,
        size,
        pre,
        metadata=_read_metadata(r, m),
    )


def _read_metadata(r, m):
    """The user metadata (absent in files written without it) as {key: value}: its
    strings are read and charged like every other; a key given twice is refused."""
    [entries] = r.targets(m, _MODEL.metadata, "metadata")
    if not entries:
        return {}
    t = r.tables(_KEY_VALUE, entries, "metadata entries")
    keys = r.strings(t, _KEY_VALUE.key, "metadata keys")
    values = r.strings(t, _KEY_VALUE.value, "metadata values")
    metadata = dict(zip(keys, values))
    if len(metadata) != len(keys):
        key = next(k for k in keys if keys.count(k) > 1)
        _fail(r.path, f"metadata key {key[:40]!r} appears more than once")
    return metadata


def _same_lengths(path, what, n, columns):
    """Every column of a table of columns holds n entries."""
    for name, values in columns.items():
        if len(values) != n:
            _fail(path, f"{what} column {name} has {len(values)} entries, expected {n} (one per {what[:-1]})")


def _split(path, what, values, ends):
    """values[ends[i-1]:ends[i]] for each i (0 before the first): ends must rise, and the
    last must be len(values)."""
    if ends and (ends[-1] != len(values) or list(ends) != sorted(ends)):
        _fail(
            path,
            f"{what}: ends {list(ends[:8])}{'...' if len(ends) > 8 else ''} do not rise to its {len(values)} entries",
        )
    if not ends and values:
        _fail(path, f"{what}: {len(values)} entries and no ends")
    return list(map(values.__getitem__, map(slice, (0,) + tuple(ends[:-1]), ends)))


def _sparse(path, what, n, indices, ranks, values):
    """Per tensor, its values (rank entries each, in index order) where `indices` (rising
    tensor indices) names it, else None."""
    if list(indices) != sorted(set(indices)) or (indices and indices[-1] >= n):
        _fail(path, f"{what}: tensor indices {list(indices[:8])} are not rising indices below {n}")
    per = _split(path, what, values, list(itertools.accumulate(ranks[i] for i in indices)))
    out = [None] * n
    for i, v in zip(indices, per):
        out[i] = v
    return out


def _read_columns(r, layout, pos, what, counted_by, per_row):
    """A table of columns (schema/pmx.fbs): (names, {column: values}, rows). The rows
    are counted by column `counted_by`; the `per_row` columns must hold one entry per
    row, and the names are cut from one string at the name_ends column."""
    t = r.tables(layout, [pos], f"{what}s")
    [text] = r.strings(t, layout.names, f"{what} names")
    c = {name: r.column(t, k, f"{what} {name}") for name, k in vars(layout).items() if name not in ("fields", "names")}
    n = len(c[counted_by])
    _same_lengths(r.path, f"{what}s", n, {k: c[k] for k in per_row})
    return _split(r.path, f"{what} names", text, c["name_ends"]), c, n


def _read_tensors(r, pos):
    path = r.path
    names, c, n = _read_columns(
        r,
        _TENSORS,
        pos,
        "tensor",
        "kinds",
        ("name_ends", "dtypes", "ranks", "data_offsets", "data_sizes", "arena_offsets", "alias_of", "alias_offsets"),
    )
    ranks = c["ranks"]
    if max(ranks, default=0) > MAX_RANK:
        i = next(i for i, k in enumerate(ranks) if k > MAX_RANK)
        _fail(path, f"tensor {i} has rank {ranks[i]}, more than {MAX_RANK}")
    shapes = _split(path, "tensor dims", c["dims"], list(itertools.accumulate(ranks)))
    strides = _sparse(path, "tensor alias strides", n, c["strided"], ranks, c["strides"])
    if len(c["dim_min"]) != len(c["dim_max"]):
        _fail(path, f"tensor dim ranges: {len(c['dim_min'])} minima, {len(c['dim_max'])} maxima")
    dim_min = _sparse(path, "tensor dim ranges", n, c["ranged"], ranks, c["dim_min"])
    dim_max = _sparse(path, "tensor dim ranges", n, c["ranged"], ranks, c["dim_max"])
    for i in c["ranged"]:  # graph inputs and outputs with dims that may change
        for d, a, b in zip(shapes[i], dim_min[i], dim_max[i]):
            if a < 0 or b < -1 or a > d or (b != -1 and d > b):
                _fail(path, f"tensor {i} dim range {a}..{b} does not contain its planned size {d}")
    codes = c["dtypes"]
    dtypes = list(map(ENUM_TO_NUMPY.get, codes))
    # by identity: np.dtype("float64") == None is True (None converts to float64), so
    # `None in dtypes` and dtypes.index(None) would refuse every float64 tensor
    unknown = next((i for i, d in enumerate(dtypes) if d is None), None)
    if unknown is not None:
        _fail(path, f"tensor {unknown} has dtype code {codes[unknown]}, not one of {sorted(ENUM_TO_NAME)}")
    return list(
        map(
            TensorInfo,
            names,
            c["kinds"],
            dtypes,
            shapes,
            c["data_offsets"],
            c["data_sizes"],
            c["arena_offsets"],
            c["alias_of"],
            c["alias_offsets"],
            strides,
            dim_min,
            dim_max,
        )
    )


def _read_nodes(r, pos, strings, attr_sets):
    path = r.path
    names, c, _ = _read_columns(
        r, _NODES, pos, "node", "ops", ("name_ends", "input_ends", "output_ends", "attr_sets", "exprs", "variants")
    )
    inputs = _split(path, "node inputs", c["inputs"], c["input_ends"])
    outputs = _split(path, "node outputs", c["outputs"], c["output_ends"])
    picked = []
    for column, table, what in (
        (c["ops"], strings, "model strings"),
        (c["exprs"], strings, "model strings"),
        (c["variants"], strings, "model strings"),
        (c["attr_sets"], attr_sets, "attribute sets"),
    ):
        # an empty column (a model with no nodes, or none with attributes) names nothing
        if column and max(column) >= len(table):
            j = next(j for j, i in enumerate(column) if i >= len(table))
            _fail(path, f"node {j} names entry {column[j]} of the {len(table)} {what}")
        picked.append(list(map(table.__getitem__, column)))
    ops, exprs, variants, attrs = picked
    return list(map(NodeInfo, ops, names, inputs, outputs, attrs, exprs, variants))


def _read_attr_sets(r, positions):
    """One dict per attribute set (nodes with equal attributes share one: read-only,
    nothing in pmx changes a loaded node's attributes)."""
    sets = r.tables(_ATTR_SET, positions, "attribute sets")
    return _read_attrs(r, r.targets(sets, _ATTR_SET.attrs, "attribute set attrs"))


_INTS = (schema.AttrKind.Bool, schema.AttrKind.Int, schema.AttrKind.Ints)
_FLOATS = (schema.AttrKind.Float, schema.AttrKind.Floats)
_STRINGS = (schema.AttrKind.String, schema.AttrKind.Strings)
_LISTS = (schema.AttrKind.Ints, schema.AttrKind.Floats, schema.AttrKind.Strings)
_KNOWN = (schema.AttrKind.None_,) + _INTS + _FLOATS + _STRINGS


def _read_attrs(r, per_set):
    """One dict per attribute set from all sets' attribute tables (a list of positions
    per set). Only the vector an attribute's kind names is read."""
    A = _ATTR
    t = r.tables(A, [p for attrs in per_set for p in attrs], "node attrs")
    names, kinds = r.strings(t, A.name, "attribute names"), t.columns[A.kind]

    def where(i):
        owner = [j for j, attrs in enumerate(per_set) for _ in attrs][i]
        return f"attribute set {owner} attribute {names[i]!r}"

    for i, kind in enumerate(kinds):
        if kind not in _KNOWN:
            _fail(r.path, f"{where(i)} has unknown kind {kind}")

    def only(group, k):
        """Column k where the kind is in `group`, else 0 (absent: not read)."""
        return [u if kind in group else 0 for kind, u in zip(kinds, t.columns[k])]

    ints = r.numbers(t, A.ints, "attribute ints", only(_INTS, A.ints))
    floats = r.numbers(t, A.floats, "attribute floats", only(_FLOATS, A.floats))
    lists = r.targets(t, A.strings, "attribute strings", only(_STRINGS, A.strings))
    strings = [()] * len(kinds)
    if any(lists):
        flat = iter(r.strings_at([p for targets in lists for p in targets], "attribute strings"))
        strings = [tuple(itertools.islice(flat, len(targets))) for targets in lists]
    values = []
    for i, (kind, a, b, c) in enumerate(zip(kinds, ints, floats, strings)):
        vals = a or b or c  # at most one was read
        if kind in _LISTS:
            values.append(vals)
        elif kind == schema.AttrKind.None_:
            values.append(None)
        elif len(vals) != 1:
            _fail(r.path, f"{where(i)} should hold one value, holds {len(vals)}")
        else:
            values.append(bool(vals[0]) if kind == schema.AttrKind.Bool else vals[0])
    items = zip(names, values)
    return [dict(itertools.islice(items, len(attrs))) for attrs in per_set]


# --- expressions ------------------------------------------------------------------------


@functools.lru_cache(maxsize=4096)
def _expression(text, num_inputs):
    """(tree, _expanded_size) of a stored expression: the one place the runtime parses
    expression text. Memoized: a model repeats the same few activations many times, and
    nodes with equal text then share one tree object (verify.check_shape_rules relies on it:
    trees that differ only in a literal's type compare equal, their objects do not)."""
    tree = E.parse(text, num_inputs)
    return tree, _expanded_size(E.desugar(tree))


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


def _wrap_constants(model, buf, pre):
    """Read-only views of the mmap (np.ndarray over the buffer: one call, where
    frombuffer + reshape is two), placed where the verifier checked they fit."""
    base, constant = pre["data_offset"], schema.TensorKind.Constant
    model.constants.update(
        (i, np.ndarray(t.shape, t.dtype, buffer=buf, offset=base + t.data_offset))
        for i, t in enumerate(model.tensors)
        if t.kind == constant
    )
