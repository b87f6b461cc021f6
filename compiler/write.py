"""Serialize a Graph and its Plan (compiler/plan.py) into a .pmx file, atomically.

Layout: 64-byte preamble (runtime/fileformat.py), the FlatBuffer header (schema/pmx.fbs),
padding to 64 bytes, then the data section with every constant 64-byte aligned.
The file is written to a temporary file in the target directory, flushed, fsynced and
renamed over the target, so a failed compile never leaves a half-written file and the
previous file stays untouched.
"""

import itertools
import os
import tempfile
import zlib

import flatbuffers
import numpy as np

from pmx.compiler.plan import Plan
from pmx.runtime import expr as E
from pmx.runtime import fileformat as ff
from pmx.runtime.dtypes import NAME_TO_ENUM
from pmx.runtime.errors import PmxCompileError, PmxFormatError, PmxInternalError
from pmx.runtime.header import MAX_RANK
from pmx.runtime.kernels.registry import get
from pmx.runtime.load import open_model
from pmx.runtime.version import __version__
from pmx.schema import pmx_generated as fb

PRODUCER = f"pmx {__version__}"


def _attr_fields(name, value):
    """(kind, ints, floats, strings) that store `value`; None for the vectors not used."""
    kind, ints, floats, strings = 0, None, None, None  # 0 = AttrKind None
    if value is None:
        pass
    elif isinstance(value, bool):
        kind, ints = fb.AttrKind.Bool, [int(value)]
    elif isinstance(value, (int, np.integer)):
        kind, ints = fb.AttrKind.Int, [int(value)]
    elif isinstance(value, (float, np.floating)):
        kind, floats = fb.AttrKind.Float, [float(value)]
    elif isinstance(value, str):
        kind, strings = fb.AttrKind.String, [value]
    elif isinstance(value, (tuple, list)):
        if all(isinstance(v, str) for v in value) and value:
            kind, strings = fb.AttrKind.Strings, list(value)
        elif all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in value):
            kind, ints = fb.AttrKind.Ints, [int(v) for v in value]
        elif all(isinstance(v, (int, float, np.integer, np.floating)) for v in value):
            kind, floats = fb.AttrKind.Floats, [float(v) for v in value]
        else:
            raise PmxCompileError(f"attribute {name}={value!r} cannot be stored (mixed or nested list)")
    else:
        raise PmxCompileError(f"attribute {name}={value!r} of type {type(value).__name__} cannot be stored")
    return kind, ints, floats, strings


class _SharedParts:
    """Writes each string, number vector, attribute table and attribute set once and lets
    everything that holds an equal one point at it (FlatBuffers allows any number of
    references to one object). A CNN repeats a few attribute sets across hundreds of
    nodes; the loader reads each distinct position once (runtime/load.py) and nodes with
    equal attributes share one dict."""

    def __init__(self, builder):
        self.b = builder
        self._vectors, self._attrs, self._attr_sets = {}, {}, {}
        self.attr_set_offsets = []  # Model.attr_sets, in index order

    def string(self, text):
        return self.b.CreateSharedString(text)

    def numbers(self, values, dtype=np.int32):
        arr = np.asarray(values, dtype=dtype)
        key = (arr.dtype.str, arr.tobytes())  # bytes: -0.0 and 0.0 stay apart
        off = self._vectors.get(key)
        if off is None:
            off = self._vectors[key] = self.b.CreateNumpyVector(arr)
        return off

    def attr(self, name, value):
        """The attribute table storing name=value, written once. Its parts are written
        first, each once, so equal offsets mean equal stored values and the table is
        keyed on them: 1, 1.0 and True differ in kind or vector, -0.0 and 0.0 in bytes."""
        kind, ints, floats, strings = _attr_fields(name, value)
        key = (
            self.string(name),
            kind,
            None if ints is None else self.numbers(ints, np.int64),
            None if floats is None else self.numbers(floats, np.float64),
            None if strings is None else tuple(self.string(s) for s in strings),
        )
        off = self._attrs.get(key)
        if off is None:
            off = self._attrs[key] = _attr(self.b, *key)
        return off

    def attr_set(self, attrs):
        """The index of `attrs` in Model.attr_sets (an equal set is written once)."""
        offs = tuple(self.attr(k, attrs[k]) for k in sorted(attrs))
        i = self._attr_sets.get(offs)
        if i is None:
            vector = _table_vector(self.b, fb.AttrSetStartAttrsVector, offs)
            fb.AttrSetStart(self.b)
            fb.AttrSetAddAttrs(self.b, vector)
            self.attr_set_offsets.append(fb.AttrSetEnd(self.b))
            i = self._attr_sets[offs] = len(self._attr_sets)
        return i


def _attr(builder, name_off, kind, ints_off, floats_off, str_offs):
    """An Attr table from offsets already written (None: that vector is absent)."""
    strings_off = _string_vector(builder, fb.AttrStartStringsVector, str_offs) if str_offs is not None else None
    fb.AttrStart(builder)
    fb.AttrAddName(builder, name_off)
    fb.AttrAddKind(builder, kind)
    if ints_off is not None:
        fb.AttrAddInts(builder, ints_off)
    if floats_off is not None:
        fb.AttrAddFloats(builder, floats_off)
    if strings_off is not None:
        fb.AttrAddStrings(builder, strings_off)
    return fb.AttrEnd(builder)


def _string_vector(builder, start_fn, offsets):
    start_fn(builder, len(offsets))
    for off in reversed(offsets):
        builder.PrependUOffsetTRelative(off)
    return builder.EndVector()


def _table_vector(builder, start_fn, offsets):
    return _string_vector(builder, start_fn, offsets)


def _unique_names(values):
    seen = {}
    names = []
    for v in values:
        name = v.name
        if name in seen:
            seen[name] += 1
            name = f"{name}#{seen[v.name]}"
        seen.setdefault(name, 0)
        names.append(name)
    return names


def _dim_ranges(graph, plan):
    """{value uid: [(min, max) per dim]} for graph inputs with dynamic dims (from
    mark_dynamic_dims) and for outputs whose dims follow them (their ranges, from the same pass)."""
    out = {}
    dynamic = plan.dynamic
    for v in graph.inputs:
        if v.name in dynamic:
            out[v.uid] = [tuple(r) for r in dynamic[v.name]]
    for v in graph.outputs:
        dims = plan.dynamic_outputs.get(v.uid)
        if dims and v.uid not in out:
            out[v.uid] = [dims.get(i, (d, d)) for i, d in enumerate(v.shape)]
    return out


def _vector(builder, values, dtype):
    return builder.CreateNumpyVector(np.asarray(values, dtype=dtype))


def _ends(lengths):
    return list(itertools.accumulate(lengths))


def _tensor_columns(b, graph, plan, values, names, index, const_place):
    """The Tensors table: one vector per field (schema/pmx.fbs)."""
    input_ids = {v.uid for v in graph.inputs}
    output_ids = {v.uid for v in graph.outputs}
    ranges = _dim_ranges(graph, plan)
    cols = {
        k: []
        for k in (
            "kinds",
            "dtypes",
            "ranks",
            "dims",
            "data_offsets",
            "data_sizes",
            "arena_offsets",
            "alias_of",
            "alias_offsets",
            "strided",
            "strides",
            "ranged",
            "dim_min",
            "dim_max",
        )
    }
    for i, v in enumerate(values):
        if v.dtype not in NAME_TO_ENUM:
            raise PmxCompileError(f"tensor {v.name} has dtype {v.dtype}, which .pmx cannot store")
        if len(v.shape) > MAX_RANK:
            raise PmxCompileError(f"tensor {v.name} has rank {len(v.shape)}; the runtime reads at most {MAX_RANK}")
        cols["kinds"].append(
            fb.TensorKind.Constant
            if v.is_constant
            else fb.TensorKind.Input
            if v.uid in input_ids
            else fb.TensorKind.Output
            if v.uid in output_ids
            else fb.TensorKind.Intermediate
        )
        cols["dtypes"].append(NAME_TO_ENUM[v.dtype])
        cols["ranks"].append(len(v.shape))
        cols["dims"].extend(v.shape)
        data_offset = data_size = arena_offset = alias_offset = 0
        alias_of = -1
        alias = plan.aliases.get(v.uid) if not v.is_constant else None
        if v.is_constant:
            data_offset, data_size = const_place[v.uid]
        elif alias is not None:
            alias_of, alias_offset = index[alias[0].uid], alias[1]
            if alias[2] is not None:
                cols["strided"].append(i)
                cols["strides"].extend(alias[2])
        elif v.uid in plan.offsets:
            arena_offset = plan.offsets[v.uid]
        else:
            raise PmxInternalError(
                f"{graph.source}: tensor {v.name} has neither an arena offset nor an alias in the "
                f"plan: the graph changed after it was planned"
            )
        for k, x in (
            ("data_offsets", data_offset),
            ("data_sizes", data_size),
            ("arena_offsets", arena_offset),
            ("alias_of", alias_of),
            ("alias_offsets", alias_offset),
        ):
            cols[k].append(x)
        rng = ranges.get(v.uid)
        if rng:
            cols["ranged"].append(i)
            cols["dim_min"].extend(lo for lo, _ in rng)
            cols["dim_max"].extend(hi for _, hi in rng)
    columns = (  # (add to the table, values, element type)
        (fb.TensorsAddNameEnds, _ends(map(len, names)), np.uint32),
        (fb.TensorsAddKinds, cols["kinds"], np.int8),
        (fb.TensorsAddDtypes, cols["dtypes"], np.int8),
        (fb.TensorsAddRanks, cols["ranks"], np.uint8),
        (fb.TensorsAddDims, cols["dims"], np.int64),
        (fb.TensorsAddDataOffsets, cols["data_offsets"], np.uint64),
        (fb.TensorsAddDataSizes, cols["data_sizes"], np.uint64),
        (fb.TensorsAddArenaOffsets, cols["arena_offsets"], np.uint64),
        (fb.TensorsAddAliasOf, cols["alias_of"], np.int32),
        (fb.TensorsAddAliasOffsets, cols["alias_offsets"], np.uint64),
        (fb.TensorsAddStrided, cols["strided"], np.uint32),
        (fb.TensorsAddStrides, cols["strides"], np.int64),
        (fb.TensorsAddRanged, cols["ranged"], np.uint32),
        (fb.TensorsAddDimMin, cols["dim_min"], np.int64),
        (fb.TensorsAddDimMax, cols["dim_max"], np.int64),
    )
    offs = [b.CreateString("".join(names))] + [_vector(b, values, dtype) for _, values, dtype in columns]
    fb.TensorsStart(b)
    for add, off in zip([fb.TensorsAddNames] + [add for add, _, _ in columns], offs):
        add(b, off)
    return fb.TensorsEnd(b)


def _node_columns(b, shared, plan, index):
    """The Nodes table (schema/pmx.fbs) and the strings its ops, expressions and variants
    index (the first is "")."""
    strings = {"": 0}
    ops, exprs, variants, attr_sets, inputs, outputs = [], [], [], [], [], []
    for node in plan.order:
        ops.append(strings.setdefault(node.op, len(strings)))
        exprs.append(strings.setdefault(E.to_text(node.expr) if node.expr else "", len(strings)))
        variants.append(strings.setdefault(node.variant or "", len(strings)))
        attr_sets.append(shared.attr_set(node.attrs))
        inputs.append([index[v.uid] if v is not None else -1 for v in node.inputs])
        outputs.append([index[v.uid] for v in node.outputs])
    names = [node.name for node in plan.order]
    offs = [b.CreateString("".join(names))] + [
        _vector(b, values, dtype)
        for values, dtype in (
            (_ends(map(len, names)), np.uint32),
            (ops, np.uint32),
            (_ends(map(len, inputs)), np.uint32),
            ([i for ins in inputs for i in ins], np.int32),
            (_ends(map(len, outputs)), np.uint32),
            ([i for outs in outputs for i in outs], np.int32),
            (attr_sets, np.uint32),
            (exprs, np.uint32),
            (variants, np.uint32),
        )
    ]
    fb.NodesStart(b)
    for add, off in zip(
        (
            fb.NodesAddNames,
            fb.NodesAddNameEnds,
            fb.NodesAddOps,
            fb.NodesAddInputEnds,
            fb.NodesAddInputs,
            fb.NodesAddOutputEnds,
            fb.NodesAddOutputs,
            fb.NodesAddAttrSets,
            fb.NodesAddExprs,
            fb.NodesAddVariants,
        ),
        offs,
    ):
        add(b, off)
    return fb.NodesEnd(b), list(strings)


def _check_plan_fits(graph, plan):
    """Refuse (PmxInternalError) to write without a Plan, or with one made for another
    node list: the file would store offsets and aliases no check has seen."""
    if not isinstance(plan, Plan):
        raise PmxInternalError(
            f"{graph.source}: write() needs the Plan the pipeline returned, got {type(plan).__name__}"
        )
    if len(plan.order) != len(graph.nodes) or any(a is not b for a, b in zip(plan.order, graph.nodes)):
        raise PmxInternalError(
            f"{graph.source}: the plan orders other nodes than the graph has: the graph changed after it was planned"
        )


def build(graph, plan, options):
    """Return (header bytes, list of (relative offset, constant array), data size)."""
    _check_plan_fits(graph, plan)
    values = graph.values()
    index = {v.uid: i for i, v in enumerate(values)}
    names = _unique_names(values)

    blobs = []
    cursor = 0
    const_place = {}
    for v in values:
        if v.is_constant:
            arr = np.ascontiguousarray(v.data)
            const_place[v.uid] = (cursor, arr.nbytes)
            blobs.append((cursor, arr))
            cursor = ff.align(cursor + arr.nbytes)
    data_size = cursor

    b = flatbuffers.Builder(1024)
    shared = _SharedParts(b)
    tensors_off = _tensor_columns(b, graph, plan, values, names, index, const_place)
    nodes_off, strings = _node_columns(b, shared, plan, index)
    strings_off = _string_vector(b, fb.ModelStartStringsVector, [b.CreateString(t) for t in strings])
    attr_sets_off = _table_vector(b, fb.ModelStartAttrSetsVector, shared.attr_set_offsets)

    stat_offs = []
    for name, before, after in plan.pass_stats:
        n_off = b.CreateString(name)
        fb.PassStatStart(b)
        fb.PassStatAddName(b, n_off)
        fb.PassStatAddNodesBefore(b, before)
        fb.PassStatAddNodesAfter(b, after)
        stat_offs.append(fb.PassStatEnd(b))

    producer_off = b.CreateString(PRODUCER)
    source_off = b.CreateString(os.path.basename(graph.source))
    stats_off = _table_vector(b, fb.ModelStartPassStatsVector, stat_offs)
    inputs_off = shared.numbers([index[v.uid] for v in graph.inputs])
    outputs_off = shared.numbers([index[v.uid] for v in graph.outputs])
    kept_off = shared.numbers([index[v.uid] for v in graph.kept])
    metadata_off = _metadata(b, options.metadata)
    fb.ModelStart(b)
    fb.ModelAddProducer(b, producer_off)
    fb.ModelAddTensors(b, tensors_off)
    fb.ModelAddNodes(b, nodes_off)
    fb.ModelAddStrings(b, strings_off)
    fb.ModelAddAttrSets(b, attr_sets_off)
    fb.ModelAddInputs(b, inputs_off)
    fb.ModelAddOutputs(b, outputs_off)
    fb.ModelAddKept(b, kept_off)
    fb.ModelAddArenaSize(b, plan.arena_size)
    fb.ModelAddPassStats(b, stats_off)
    fb.ModelAddSource(b, source_off)
    if metadata_off is not None:
        fb.ModelAddMetadata(b, metadata_off)
    b.Finish(fb.ModelEnd(b), file_identifier=ff.FILE_IDENTIFIER)
    return bytes(b.Output()), blobs, data_size


def _metadata(b, metadata):
    """The user metadata as a vector of KeyValue tables, in the order given; None when
    there is none, so such files keep the layout they had before the field existed."""
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str) or not key:
            raise PmxCompileError(f"metadata {key!r}={value!r}: keys and values must be strings, keys non-empty")
    if not metadata:
        return None
    entries = []
    for key, value in metadata.items():
        key_off, value_off = b.CreateString(key), b.CreateString(value)
        fb.KeyValueStart(b)
        fb.KeyValueAddKey(b, key_off)
        fb.KeyValueAddValue(b, value_off)
        entries.append(fb.KeyValueEnd(b))
    return _table_vector(b, fb.ModelStartMetadataVector, entries)


def _format_version(graph):
    """The oldest format version that carries the graph's meaning (runtime/fileformat.py):
    the newest any node's kernel asks for (registry `format_version`: a conv with an input
    scale, a channel shuffle writing split parts, a reshape following its like inputs, a
    slice whose end follows one, which a version-2 runtime would misread without
    noticing), else 2, which every runtime since reads."""
    version = ff.OLDEST_READABLE_VERSION
    for n in graph.nodes:
        asks = get(n.op).format_version
        if asks is not None:
            version = max(version, asks(n) or version)
    return version


def write(graph, plan, options, path, _fail_after_bytes=None, check_loads=True):
    """Write `graph` as `plan` (from run_pipeline) places it, with `options`' metadata,
    atomically, once the written bytes pass the loader's checks (_check_loads). Tests that
    forge damaged files through the writer pass check_loads=False; `_fail_after_bytes` is a
    test hook simulating a crash mid-write."""
    header, blobs, data_size = build(graph, plan, options)
    data_offset = ff.align(ff.PREAMBLE_SIZE + len(header))
    crc = 0
    for _off, arr in _with_padding(blobs, data_size):
        crc = zlib.crc32(arr, crc)
    version = _format_version(graph)
    preamble = ff.pack_preamble(len(header), data_offset, data_size, ff.crc32(header), crc & 0xFFFFFFFF, version)

    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise PmxCompileError(f"cannot write {path}: directory {directory} does not exist")
    if os.path.isdir(path):
        raise PmxCompileError(f"cannot write {path}: it is a directory")
    try:
        fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=directory)
    except OSError as e:
        raise PmxCompileError(
            f"cannot write {path}: cannot create a temporary file in {directory}: {e.strerror}"
        ) from None
    try:
        # mkstemp makes the file 0600; give it the mode a plain open() would (or the
        # mode of the file it replaces) so other users and services can still read it.
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), _target_mode(path))
            written = 0

            def put(chunk):
                nonlocal written
                if _fail_after_bytes is not None and written + len(chunk) > _fail_after_bytes:
                    f.write(chunk[: _fail_after_bytes - written])  # leave a torn temporary behind
                    f.flush()
                    raise OSError(f"simulated failure after {_fail_after_bytes} bytes")
                f.write(chunk)
                written += len(chunk)

            put(preamble)
            put(header)
            put(b"\0" * (data_offset - ff.PREAMBLE_SIZE - len(header)))
            for _, chunk in _with_padding(blobs, data_size):
                put(memoryview(chunk).cast("B") if isinstance(chunk, np.ndarray) else chunk)
            f.flush()
            os.fsync(f.fileno())
        if check_loads:
            _check_loads(graph, tmp, path)
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError):
            raise PmxCompileError(
                f"cannot write {path}: {e.strerror or e}; the previous file (if any) is unchanged"
            ) from e
        raise
    _fsync_directory(directory)
    return data_offset + data_size


def _check_loads(graph, tmp, path):
    """The written file passes every structural check of the runtime's loader (the same
    code), before it replaces `path`: the compiler never leaves a file its runtime refuses.
    A refusal is pmx's own bug (two halves that disagree), reported as one."""
    try:
        open_model(tmp)
    except PmxFormatError as e:
        raise PmxInternalError(
            f"{graph.source}: internal error: the compiled model fails the loader's checks, so "
            f"{path} was not written: {str(e).replace(tmp, path)}. This is a bug in pmx; please report it "
            f"with the .pnnx.param and .pnnx.bin and this message"
        ) from None


def _target_mode(path):
    try:
        return os.stat(path).st_mode & 0o7777
    except OSError:
        return 0o666 & ~_umask()


def _umask():
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)  # no other portable way to read it
    os.umask(mask)
    return mask


def _fsync_directory(directory):
    """Make the rename itself durable (a crash right after compile keeps the new file)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _with_padding(blobs, data_size):
    """Constant bytes interleaved with the zero padding between them."""
    cursor = 0
    for off, arr in blobs:
        if off > cursor:
            yield cursor, b"\0" * (off - cursor)
        raw = arr.reshape(-1).view(np.uint8) if arr.size else np.zeros(0, np.uint8)
        yield off, raw
        cursor = off + arr.nbytes
    if data_size > cursor:
        yield cursor, b"\0" * (data_size - cursor)
