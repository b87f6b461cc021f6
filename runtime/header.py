"""What a .pmx header says, as plain data: TensorInfo, NodeInfo and Model, and
read_header, which decodes the header's bytes into them through the bounded reader of
runtime/flatbuffer_reader.py. runtime/load.py checks the bytes before (preamble, CRCs)
and has the result verified after (runtime/verify.py)."""

from __future__ import annotations

import itertools

from pmx.runtime import flatbuffer_reader as fb
from pmx.runtime.dtypes import ENUM_TO_NAME, ENUM_TO_NUMPY
from pmx.runtime.record import Record
from pmx.runtime.verify import _fail
from pmx.schema import layout as schema

MAX_RANK = 32


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
        "run_sized",
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
        run_sized=frozenset(),
    ):
        self.path, self.tensors, self.nodes = path, tensors, nodes
        self.inputs, self.outputs, self.kept, self.arena_size = inputs, outputs, kept, arena_size
        self.constants = constants  # tensor index -> read-only ndarray over the mmap
        self.pass_stats, self.producer, self.source = pass_stats, producer, source
        self.file_size, self.preamble, self._map = file_size, preamble, _map
        # tensor index -> (root tensor index, byte offset into the root), filled by the verifier
        self.roots = [] if roots is None else roots
        self.metadata = {} if metadata is None else metadata  # user metadata (pmx compile --meta)
        # tensors whose size is known only when the model runs (registry, "Tensors sized at
        # run time"), filled by the verifier
        self.run_sized = run_sized


# --- the tables the loader reads ---------------------------------------------------------

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
_MODEL = fb.Layout("Model", **MODEL_ACCESSORS)
_TENSORS = fb.Layout(
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
_NODES = fb.Layout(
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
_ATTR_SET = fb.Layout("AttrSet", attrs="AttrsLength")
_ATTR = fb.Layout("Attr", name="Name", kind="Kind", ints="IntsAsNumpy", floats="FloatsAsNumpy", strings="StringsLength")
_PASS_STAT = fb.Layout("PassStat", name="Name", nodes_before="NodesBefore", nodes_after="NodesAfter")
_KEY_VALUE = fb.Layout("KeyValue", key="Key", value="Value")


def read_header(path, header, pre, size) -> Model:
    """The header's bytes decoded into a Model (its constants not yet wrapped); damage
    the decoding meets is a PmxFormatError, or an IndexError the caller names."""
    r = fb.Reader(path, header)
    M = _MODEL
    m = r.tables(M, [fb.UOFFSET(r.raw, 0)[0]], "model")
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
