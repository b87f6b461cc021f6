"""Open a .pmx file: mmap it, verify it completely, and describe it as plain data.

Nothing here trusts the file. The python flatbuffers library does not verify buffers, so
every vector length and string read from the header is charged against a budget the
size of the header (a hostile file cannot make the reader loop or allocate more than a
few times its header size), and every read is confined to the header's bytes. Then,
before any numpy view is made, every offset and size is checked against the file and
the data section, every tensor index a node names against the tensor table, every shape
for sign, rank and overflow, the stored order, arena offsets, alias chains and extents,
expression strings (parsed by runtime/expr.py, never eval'd, and bounded in expanded
size) and each node's attributes against its op's shape rule. Any failure raises
PmxFormatError naming the field and the values found; sizes beyond the configured limits
raise PmxResourceError before anything is allocated. Weights are then wrapped zero-copy
(read-only numpy views of the mmap).
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass, field

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
# What a damaged FlatBuffer makes the flatbuffers/numpy readers raise.
_READ_ERRORS = (struct.error, IndexError, ValueError, UnicodeDecodeError, TypeError, OverflowError,
                KeyError, AttributeError, RecursionError)


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
        kind = "struct.error" if isinstance(e, struct.error) else type(e).__name__
        _fail(path, f"damaged header (an offset or length points outside it): {kind}: {str(e)[:120]}")
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


class _Reader:
    """Charges every vector and string read against the header size. In a file pmx wrote
    each vector and string is stored once, so the total never exceeds the header; a
    hostile file whose tables all point at one big vector is stopped after reading about
    twice its header, however many times it repeats the pointer."""

    def __init__(self, path, header_size):
        self.path = path
        self.budget = self.left = 2 * header_size + 4096

    def charge(self, nbytes, what):
        self.left -= nbytes
        if nbytes < 0 or self.left < 0:
            _fail(self.path, f"{what}: the header's vectors and strings add up to more than {self.budget} bytes, twice its size (damaged or hostile offsets)")

    def count(self, n, elem_bytes, what):
        self.charge(n * elem_bytes, f"{what} ({n} elements)")
        return n

    def ints(self, n, as_numpy, elem_bytes, what):
        if not self.count(n, elem_bytes, what):
            return ()
        return tuple(as_numpy().tolist())

    def str(self, raw, what):
        if raw is None:
            return ""
        self.charge(len(raw), what)
        return raw.decode("utf-8")


def _read_header(path, header, pre, size) -> Model:
    r = _Reader(path, pre["header_size"])
    m = fb.Model.GetRootAs(header, 0)
    tensors = [_read_tensor(r, m.Tensors(i), i) for i in range(r.count(m.TensorsLength(), 4, "tensors"))]
    nodes = [_read_node(r, m.Nodes(i), i) for i in range(r.count(m.NodesLength(), 4, "nodes"))]
    inputs = list(r.ints(m.InputsLength(), m.InputsAsNumpy, 4, "model inputs"))
    outputs = list(r.ints(m.OutputsLength(), m.OutputsAsNumpy, 4, "model outputs"))
    kept = list(r.ints(m.KeptLength(), m.KeptAsNumpy, 4, "model kept"))
    stats = []
    for i in range(r.count(m.PassStatsLength(), 4, "pass_stats")):
        s = m.PassStats(i)
        stats.append((r.str(s.Name(), "pass name"), s.NodesBefore(), s.NodesAfter()))
    return Model(path, tensors, nodes, inputs, outputs, kept, int(m.ArenaSize()), {}, stats,
                 r.str(m.Producer(), "producer"), r.str(m.Source(), "source"), size, pre)


def _read_tensor(r, t, i):
    rank = t.ShapeLength()
    if rank > MAX_RANK:
        _fail(r.path, f"tensor {i} has rank {rank}, more than {MAX_RANK}")
    shape = r.ints(rank, t.ShapeAsNumpy, 8, f"tensor {i} shape")
    dtype_enum = t.Dtype()
    if dtype_enum not in ENUM_TO_NUMPY:
        _fail(r.path, f"tensor {i} has dtype code {dtype_enum}, not one of {sorted(ENUM_TO_NAME)}")
    strides = None
    n_strides = t.AliasStridesLength()
    if n_strides:
        if n_strides > MAX_RANK:
            _fail(r.path, f"tensor {i} has {n_strides} alias strides, more than {MAX_RANK}")
        strides = r.ints(n_strides, t.AliasStridesAsNumpy, 8, f"tensor {i} alias_strides")
    dim_min = dim_max = None
    if t.DimMinLength() or t.DimMaxLength():
        if t.DimMinLength() != rank or t.DimMaxLength() != rank:
            _fail(r.path, f"tensor {i} has {t.DimMinLength()}/{t.DimMaxLength()} dim ranges for rank {rank}")
        dim_min = r.ints(rank, t.DimMinAsNumpy, 8, f"tensor {i} dim_min")
        dim_max = r.ints(rank, t.DimMaxAsNumpy, 8, f"tensor {i} dim_max")
        for d, lo, hi in zip(shape, dim_min, dim_max):
            if lo < 0 or hi < -1 or (hi != -1 and not lo <= d <= hi):
                _fail(r.path, f"tensor {i} dim range {lo}..{hi} does not contain its planned size {d}")
    return TensorInfo(r.str(t.Name(), f"tensor {i} name"), t.Kind(), ENUM_TO_NUMPY[dtype_enum], shape,
                      t.DataOffset(), t.DataSize(), t.ArenaOffset(), t.AliasOf(), t.AliasOffset(), strides,
                      dim_min, dim_max)


def _read_node(r, n, i):
    where = f"node {i}"
    attrs = {}
    for j in range(r.count(n.AttrsLength(), 4, f"{where} attrs")):
        a = n.Attrs(j)
        name = r.str(a.Name(), f"{where} attribute name")
        attrs[name] = _attr_value(r, a, f"{where} attribute {name!r}")
    return NodeInfo(r.str(n.Op(), f"{where} op"), r.str(n.Name(), f"{where} name"),
                    r.ints(n.InputsLength(), n.InputsAsNumpy, 4, f"{where} inputs"),
                    r.ints(n.OutputsLength(), n.OutputsAsNumpy, 4, f"{where} outputs"),
                    attrs, r.str(n.Expr(), f"{where} expr"), r.str(n.Variant(), f"{where} variant"))


def _attr_value(r, a, where):
    k = a.Kind()
    if k == fb.AttrKind.None_:
        return None
    if k in (fb.AttrKind.Bool, fb.AttrKind.Int, fb.AttrKind.Ints):
        vals = r.ints(a.IntsLength(), a.IntsAsNumpy, 8, where)
        if k == fb.AttrKind.Ints:
            return vals
        if len(vals) != 1:
            _fail(r.path, f"{where} should hold one value, holds {len(vals)}")
        return bool(vals[0]) if k == fb.AttrKind.Bool else vals[0]
    if k in (fb.AttrKind.Float, fb.AttrKind.Floats):
        vals = r.ints(a.FloatsLength(), a.FloatsAsNumpy, 8, where)
        if k == fb.AttrKind.Floats:
            return vals
        if len(vals) != 1:
            _fail(r.path, f"{where} should hold one value, holds {len(vals)}")
        return vals[0]
    if k in (fb.AttrKind.String, fb.AttrKind.Strings):
        n = r.count(a.StringsLength(), 4, where)
        vals = tuple(r.str(a.Strings(j), where) for j in range(n))
        if k == fb.AttrKind.Strings:
            return vals
        if len(vals) != 1:
            _fail(r.path, f"{where} should hold one value, holds {len(vals)}")
        return vals[0]
    _fail(r.path, f"{where} has unknown kind {k}")


# --- structural verification --------------------------------------------------------------


def _verify_structure(model: Model, pre, max_arena_bytes):
    path = model.path
    n = len(model.tensors)
    if model.arena_size > max_arena_bytes:
        raise PmxResourceError(f"{path}: arena of {model.arena_size} bytes exceeds the limit of {max_arena_bytes} bytes (raise it with max_arena_bytes=)")
    data_size = pre["data_size"]
    for i, t in enumerate(model.tensors):
        where = f"tensor {i} ({t.name[:40]!r})"
        if t.kind not in _KINDS:
            _fail(path, f"{where} has kind {t.kind}, not one of {list(_KINDS)}")
        if any(d < 0 for d in t.shape):
            _fail(path, f"{where} has shape {t.shape}: dims must be non-negative")
        # Zero dims count as 1 (kernels may loop over the other dims of an empty tensor)
        # and views count in full (a stride-0 view of 4 bytes can have 2**40 elements):
        # the bound is on work, not only on bytes.
        bound = t.dtype.itemsize
        for d in t.shape:
            bound *= max(d, 1)
            if bound > max(max_arena_bytes, data_size):
                raise PmxResourceError(f"{path}: {where} of shape {t.shape} {t.dtype.name} exceeds the limit of {max_arena_bytes} bytes (max_arena_bytes)")
        nbytes = t.nbytes
        if t.kind == fb.TensorKind.Constant:
            if t.alias_of != -1 or t.alias_strides is not None:
                _fail(path, f"{where} is a constant but has alias_of {t.alias_of} / alias_strides {t.alias_strides}")
            if t.data_size != nbytes:
                _fail(path, f"{where}: data_size {t.data_size} != shape {t.shape} x {t.dtype.itemsize} bytes = {nbytes}")
            if t.data_offset % ff.ALIGNMENT or t.data_offset + t.data_size > data_size:
                _fail(path, f"{where}: data [{t.data_offset}, +{t.data_size}) is outside the {data_size}-byte data section or not {ff.ALIGNMENT}-byte aligned")
        elif t.alias_of == -1:
            if t.alias_strides is not None:
                _fail(path, f"{where} has alias_strides {t.alias_strides} but aliases nothing")
            if t.arena_offset % ff.ALIGNMENT or t.arena_offset + nbytes > model.arena_size:
                _fail(path, f"{where}: arena range [{t.arena_offset}, +{nbytes}) is outside the {model.arena_size}-byte arena or not {ff.ALIGNMENT}-byte aligned")
        elif not 0 <= t.alias_of < n:
            _fail(path, f"{where}: alias_of {t.alias_of} is not a tensor index (0..{n - 1})")
    model.roots = _resolve_aliases(model)
    for i, t in enumerate(model.tensors):
        if t.kind != fb.TensorKind.Constant and t.alias_of >= 0:
            _check_alias_extent(model, i, t)
    _check_io(model)
    _check_nodes(model)
    _check_shape_rules(model)


def _resolve_aliases(model):
    """(root, byte offset) for every tensor, following alias chains once each (memoized,
    so long chains cost linear time); a chain that loops or ends at a constant fails."""
    path, tensors = model.path, model.tensors
    roots = [None] * len(tensors)
    for i in range(len(tensors)):
        chain = []
        on_chain = set()
        j = i
        while roots[j] is None and tensors[j].kind != fb.TensorKind.Constant and tensors[j].alias_of >= 0:
            if j in on_chain:
                _fail(path, f"tensor {i} ({tensors[i].name[:40]!r}): alias chain loops at tensor {j}")
            on_chain.add(j)
            chain.append(j)
            j = tensors[j].alias_of
        if roots[j] is None:
            if tensors[j].kind == fb.TensorKind.Constant and j != i:
                _fail(path, f"tensor {chain[-1]} ({tensors[chain[-1]].name[:40]!r}) aliases constant tensor {j}; views of constants are not stored")
            roots[j] = (j, 0)
        root, offset = roots[j]
        for k in reversed(chain):
            offset += tensors[k].alias_offset
            roots[k] = (root, offset)
    return roots


def _check_alias_extent(model, i, t):
    """The bytes a view can touch must lie inside its root's arena range."""
    path = model.path
    root, offset = model.roots[i]
    root_bytes = model.tensors[root].nbytes
    where = f"tensor {i} ({t.name[:40]!r})"
    if any(d == 0 for d in t.shape):
        lo, hi = 0, 0
    elif t.alias_strides is not None:
        if len(t.alias_strides) != len(t.shape):
            _fail(path, f"{where}: {len(t.alias_strides)} alias strides for rank {len(t.shape)}")
        lo = sum(s * (d - 1) for s, d in zip(t.alias_strides, t.shape) if s < 0)
        hi = sum(s * (d - 1) for s, d in zip(t.alias_strides, t.shape) if s > 0) + t.dtype.itemsize
    else:
        lo, hi = 0, t.nbytes
    if offset + lo < 0 or offset + hi > root_bytes:
        _fail(path, f"{where}: view bytes [{offset + lo}, {offset + hi}) exceed its root tensor {root}'s {root_bytes} bytes (alias_of {t.alias_of}, alias_offset {t.alias_offset}, strides {t.alias_strides})")
    target = model.tensors[t.alias_of]
    if target.alias_strides is None and t.alias_offset + hi > target.nbytes:
        # inside the arena, but reaching past the tensor it claims to view
        _fail(path, f"{where}: view bytes [{t.alias_offset + lo}, {t.alias_offset + hi}) exceed its target tensor {t.alias_of}'s {target.nbytes} bytes")


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


def _check_nodes(model):
    """Indices in range, stored order respected (each input is a constant, a model input
    or produced earlier), each tensor produced once, expressions within the grammar."""
    path, tensors, n = model.path, model.tensors, len(model.tensors)
    available = {i for i, t in enumerate(tensors) if t.kind == fb.TensorKind.Constant} | set(model.inputs)
    produced = set()
    for j, node in enumerate(model.nodes):
        where = f"node {j} ({node.op[:40]!r} {node.name[:40]!r})"
        if node.op not in REGISTRY:
            _fail(path, f"{where}: unknown op {node.op[:40]!r}")
        for idx in node.inputs:
            if idx == -1:
                continue
            if not 0 <= idx < n:
                _fail(path, f"{where}: input tensor index {idx} out of range (0..{n - 1})")
            if idx not in available:
                _fail(path, f"{where}: reads tensor {idx} ({tensors[idx].name[:40]!r}) before any node produces it")
        for idx in node.outputs:
            if not 0 <= idx < n:
                _fail(path, f"{where}: output tensor index {idx} out of range (0..{n - 1})")
            t = tensors[idx]
            if t.kind in (fb.TensorKind.Constant, fb.TensorKind.Input) or idx in produced:
                _fail(path, f"{where}: writes tensor {idx} ({t.name[:40]!r}), which is a constant, an input or already produced")
            produced.add(idx)
            available.add(idx)
        if node.expr:
            try:
                tree = E.parse(node.expr, len(node.inputs) if node.op == "elementwise" else 1)
            except PmxFormatError as e:
                _fail(path, f"{where}: {e}")
            size = _expanded_size(E.desugar(tree))
            if size > MAX_EXPANDED_EXPR:
                _fail(path, f"{where}: expression expands to more than {MAX_EXPANDED_EXPR} terms ({size})")
    for idx in model.outputs + model.kept:
        if idx not in available:
            _fail(path, f"output tensor {idx} ({tensors[idx].name[:40]!r}) is never produced")


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
    padding or stride is refused here instead of becoming a huge allocation at bind."""
    path, tensors = model.path, model.tensors
    for j, node in enumerate(model.nodes):
        present = [i for i in node.inputs if i >= 0]
        try:
            got = [shape for shape, _ in output_shapes(node, [tensors[i].shape for i in present],
                                                       [tensors[i].dtype for i in present])]
        except PmxError as e:
            _fail(path, f"node {j} ({node.op} {node.name[:40]!r}): {e}")
        except MemoryError:
            raise PmxResourceError(f"{path}: node {j} ({node.op} {node.name[:40]!r}): attributes need too much memory") from None
        except Exception as e:  # noqa: BLE001 - a rule refusing hostile attributes, whatever it raises
            _fail(path, f"node {j} ({node.op} {node.name[:40]!r}) has attributes its op cannot use: {type(e).__name__}: {str(e)[:100]}")
        want = [tensors[i].shape for i in node.outputs]
        k = min(len(got), len(want))
        if got[:k] != want[:k]:
            _fail(path, f"node {j} ({node.op} {node.name[:40]!r}): its attributes and input shapes give output shapes {got[:k]}, the file stores {want[:k]}")


def _wrap_constants(model, buf, pre):
    base = pre["data_offset"]
    for i, t in enumerate(model.tensors):
        if t.kind == fb.TensorKind.Constant:
            count = t.data_size // t.dtype.itemsize
            model.constants[i] = np.frombuffer(buf, dtype=t.dtype, count=count, offset=base + t.data_offset).reshape(t.shape)


def resolve_alias(model, i):
    """(root tensor index, byte offset into the root) of tensor i (resolved at load)."""
    return model.roots[i]
