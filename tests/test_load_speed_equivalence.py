"""The fast paths of the loader give what a plain reading gives.

runtime/load.py reads the header with one struct per vtable and list comprehensions,
checks nodes with set operations, caches shape rules by (op, input signatures) and
pauses the garbage collector while it works. These tests hold each shortcut to a straightforward
reference: the generated FlatBuffers accessors, on valid files and on files whose
vtables overlap fields; the checks' messages on models damaged where a shortcut could
look away; the collector's state. No timing is asserted.
"""

import gc
import math
import pathlib
import re
import struct

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_pmx_fuzz import Views

from pmx.compiler.driver import compile_graph, compile_model
from pmx.compiler.ir import Graph, Node, Value
from pmx.compiler.options import CompileOptions
from pmx.compiler.write import write
from pmx.runtime import InferenceSession, PmxError, PmxFormatError, flatbuffer_reader, load, verify
from pmx.runtime import expr as E
from pmx.runtime import fileformat as ff
from pmx.runtime import header as pmx_header
from pmx.runtime.dtypes import ENUM_TO_NUMPY
from pmx.schema import pmx_generated as fb

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "tools" / "example" / "cnn"


class Dynamic(nn.Module):
    """Dynamic batch and image size (dim ranges), grouped conv, hardswish, mean."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1, groups=4)
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        y = F.relu(self.c1(x))
        y = y + F.hardswish(self.c2(y))
        return self.fc(y.mean((2, 3)))


@pytest.fixture(scope="module")
def files(exporter, tmp_path_factory):
    """name -> bytes of valid .pmx files covering every field the loader reads."""
    d = tmp_path_factory.mktemp("load_equiv")
    out = {}
    compile_model(str(EXAMPLE) + ".pnnx.param", str(EXAMPLE) + ".pnnx.bin", str(d / "cnn.pmx"))
    out["cnn"] = (d / "cnn.pmx").read_bytes()
    prefix = exporter("load_equiv_views", Views(), (torch.rand(1, 3, 8, 8),))
    compile_model(prefix + ".pnnx.param", prefix + ".pnnx.bin", str(d / "views.pmx"))
    out["views"] = (d / "views.pmx").read_bytes()
    prefix = exporter("load_equiv_dynamic", Dynamic(), (torch.rand(2, 3, 16, 16),))
    compile_model(
        prefix + ".pnnx.param",
        prefix + ".pnnx.bin",
        str(d / "dynamic.pmx"),
        dynamic={"in0": {0: (1, -1), 2: (8, 64), 3: (8, 64)}},
    )
    out["dynamic"] = (d / "dynamic.pmx").read_bytes()
    return out


def header_of(data):
    pre = ff.unpack_preamble(data[: ff.PREAMBLE_SIZE])
    return pre, data[ff.PREAMBLE_SIZE : ff.PREAMBLE_SIZE + pre["header_size"]]


# --- the reference reading: the generated accessors -------------------------------------


def _text(b):
    return b.decode() if b is not None else ""


def _vector(obj, name):
    return tuple(getattr(obj, name)(j) for j in range(getattr(obj, name + "Length")()))


def _attr_value(a):
    k = a.Kind()
    ints, floats = _vector(a, "Ints"), _vector(a, "Floats")
    strings = tuple(_text(a.Strings(j)) for j in range(a.StringsLength()))
    return {
        fb.AttrKind.None_: lambda: None,
        fb.AttrKind.Bool: lambda: bool(ints[0]),
        fb.AttrKind.Int: lambda: ints[0],
        fb.AttrKind.Float: lambda: floats[0],
        fb.AttrKind.String: lambda: strings[0],
        fb.AttrKind.Ints: lambda: ints,
        fb.AttrKind.Floats: lambda: floats,
        fb.AttrKind.Strings: lambda: strings,
    }[k]()


def _take(values, counts):
    """values cut into consecutive pieces of the given lengths."""
    out, at = [], 0
    for n in counts:
        out.append(tuple(values[at : at + n]))
        at += n
    return out


def reference(header):
    """Everything _read_header returns, read element by element with the generated code
    and cut as schema/pmx.fbs describes."""
    m = fb.Model.GetRootAs(header, 0)
    T = m.Tensors()
    n = T.KindsLength()
    text, ends = _text(T.Names()), _vector(T, "NameEnds")
    ranks = _vector(T, "Ranks")
    shapes = _take(_vector(T, "Dims"), ranks)
    strides, dim_min, dim_max = [None] * n, [None] * n, [None] * n
    for i, v in zip(_vector(T, "Strided"), _take(_vector(T, "Strides"), [ranks[i] for i in _vector(T, "Strided")])):
        strides[i] = v
    ranged = _vector(T, "Ranged")
    for i, lo, hi in zip(
        ranged,
        _take(_vector(T, "DimMin"), [ranks[i] for i in ranged]),
        _take(_vector(T, "DimMax"), [ranks[i] for i in ranged]),
    ):
        dim_min[i], dim_max[i] = lo, hi
    tensors = [
        pmx_header.TensorInfo(
            text[(ends[i - 1] if i else 0) : ends[i]],
            T.Kinds(i),
            ENUM_TO_NUMPY[T.Dtypes(i)],
            shapes[i],
            T.DataOffsets(i),
            T.DataSizes(i),
            T.ArenaOffsets(i),
            T.AliasOf(i),
            T.AliasOffsets(i),
            strides[i],
            dim_min[i],
            dim_max[i],
        )
        for i in range(n)
    ]
    strings = [_text(m.Strings(k)) for k in range(m.StringsLength())]
    attr_sets = []
    for k in range(m.AttrSetsLength()):
        s = m.AttrSets(k)
        attr_sets.append({_text(s.Attrs(j).Name()): _attr_value(s.Attrs(j)) for j in range(s.AttrsLength())})
    N = m.Nodes()
    text, ends = _text(N.Names()), _vector(N, "NameEnds")
    input_ends, output_ends = _vector(N, "InputEnds"), _vector(N, "OutputEnds")
    inputs = _take(_vector(N, "Inputs"), [e - (input_ends[j - 1] if j else 0) for j, e in enumerate(input_ends)])
    outputs = _take(_vector(N, "Outputs"), [e - (output_ends[j - 1] if j else 0) for j, e in enumerate(output_ends)])
    nodes = [
        pmx_header.NodeInfo(
            strings[N.Ops(j)],
            text[(ends[j - 1] if j else 0) : ends[j]],
            inputs[j],
            outputs[j],
            attr_sets[N.AttrSets(j)],
            strings[N.Exprs(j)],
            strings[N.Variants(j)],
        )
        for j in range(N.OpsLength())
    ]
    stats = [
        (_text(s.Name()), s.NodesBefore(), s.NodesAfter()) for s in (m.PassStats(k) for k in range(m.PassStatsLength()))
    ]
    return dict(
        tensors=tensors,
        nodes=nodes,
        inputs=list(_vector(m, "Inputs")),
        outputs=list(_vector(m, "Outputs")),
        kept=list(_vector(m, "Kept")),
        arena_size=m.ArenaSize(),
        pass_stats=stats,
        producer=_text(m.Producer()),
        source=_text(m.Source()),
    )


def verified(ref):
    """`ref` as open_model gives it after the verifier: stored expressions parsed to trees."""
    for node in ref["nodes"]:
        node.expr = E.parse(node.expr) if node.expr else None
    return ref


def assert_same(model, ref):
    for key, want in ref.items():
        got = getattr(model, key)
        assert got == want, key
    for got, want in zip(model.tensors, ref["tensors"]):
        for f in pmx_header.TensorInfo.__slots__:
            assert type(getattr(got, f)) is type(getattr(want, f)), (f, got, want)
    for got, want in zip(model.nodes, ref["nodes"]):
        # 1 == 1.0 == True: compare the types too (a shape rule may not treat them alike)
        assert [(k, type(v)) for k, v in got.attrs.items()] == [(k, type(v)) for k, v in want.attrs.items()]
        for v, w in zip(got.attrs.values(), want.attrs.values()):
            if isinstance(w, tuple):
                assert [type(x) for x in v] == [type(x) for x in w]
        assert type(got.inputs) is tuple and type(got.outputs) is tuple


@pytest.mark.parametrize("name", ["cnn", "views", "dynamic"])
def test_reader_matches_generated_accessors(files, name):
    data = files[name]
    pre, header = header_of(data)
    model = pmx_header.read_header(
        "x.pmx", memoryview(data)[ff.PREAMBLE_SIZE : ff.PREAMBLE_SIZE + pre["header_size"]], pre, len(data)
    )
    ref = reference(header)
    assert_same(model, ref)
    covered = {type(v) for n in model.nodes for v in n.attrs.values()}
    if name == "views":
        assert any(t.alias_of >= 0 for t in model.tensors) and bool in covered and str in covered
    if name == "dynamic":
        assert any(t.dim_min is not None for t in model.tensors)


# attribute values that compare equal in Python but are stored apart (kind, sign of
# zero), and repeats that the writer stores once
SHARED_ATTR_VALUES = [1, 1.0, True, 0.0, -0.0, (1, 2), (1.0, 2.0), (1.0, -0.0), "s", ("s",), None, 1, -0.0, (1, 2), "s"]


def test_equal_parts_are_written_once_and_read_back_exactly(tmp_path):
    """compiler/write.py stores each distinct attribute set, string and vector once and
    the loader reads each position once, sharing one dict between nodes with equal
    attributes. Values that Python calls equal but a file stores apart (1, 1.0, True;
    0.0 and -0.0) must not be merged, and the generated accessors must read the same.
    (The attributes are ones elementwise does not take, so the verifier refuses the
    file after reading it, naming the first.)"""
    g = Graph("shared")
    x = prev = Value("x", (2, 3))
    g.inputs = [x]
    for i, v in enumerate(SHARED_ATTR_VALUES):
        y = Value(f"y{i}", (2, 3))
        g.add_node(Node("elementwise", f"n{i}", [prev], [y], expr=E.call("neg", E.at(0)), attrs={"a": v, "b": 2}))
        prev = y
    g.outputs = [prev]
    options = CompileOptions(disabled=["fuse_elementwise"])
    plan = compile_graph(g, options)
    path = tmp_path / "shared.pmx"
    write(g, plan, options, str(path), check_loads=False)  # the verifier refuses it (docstring)
    data = path.read_bytes()
    pre, header = header_of(data)
    model = pmx_header.read_header(str(path), header, pre, len(data))
    assert_same(model, reference(header))
    got = {n.name: n.attrs for n in model.nodes}
    for i, v in enumerate(SHARED_ATTR_VALUES):
        a = got[f"n{i}"]["a"]
        assert a == v and type(a) is type(v), (i, a, v)
        flat, want = (a, v) if isinstance(v, tuple) else ((a,), (v,))
        assert [math.copysign(1, f) for f in flat if isinstance(f, float)] == [
            math.copysign(1, f) for f in want if isinstance(f, float)
        ], (i, a, v)
    # nodes n0..n10 hold distinct values, n11..n14 repeat n0, n4, n5, n8's
    assert len({id(got[f"n{i}"]) for i in range(11)}) == 11
    for i, j in ((11, 0), (12, 4), (13, 5), (14, 8)):
        assert got[f"n{i}"] is got[f"n{j}"]
    assert len({id(n.op) for n in model.nodes}) == 1 and len({id(n.expr) for n in model.nodes}) == 1
    with pytest.raises(
        PmxFormatError, match=r"node 0 \(elementwise 'n0'\): attribute 'a' is not an attribute this op takes"
    ):
        load.open_model(str(path))


def _table_vtable(header, table_pos):
    return table_pos - struct.unpack_from("<i", header, table_pos)[0]


def test_overlapping_fields_read_like_the_generated_code(files):
    """A vtable may point two fields at the same bytes (legal FlatBuffers, never written
    by pmx): the reader falls back to one read per field and still agrees."""
    data = bytearray(files["cnn"])
    header, pos = _tensors_table(bytes(data))
    vt = ff.PREAMBLE_SIZE + _table_vtable(header, pos)
    slot_of = {
        name: pmx_header._TENSORS.fields[getattr(pmx_header._TENSORS, name)].slot
        for name in ("data_offsets", "data_sizes")
    }
    entry = struct.unpack_from("<H", data, vt + slot_of["data_offsets"])[0]
    struct.pack_into("<H", data, vt + slot_of["data_sizes"], entry)  # data_sizes now reads data_offsets' vector
    data = bytes(data)
    pre, header = header_of(data)
    model = pmx_header.read_header("x.pmx", header, pre, len(data))
    assert_same(model, reference(header))
    assert all(t.data_size == t.data_offset for t in model.tensors)
    assert any(t.data_offset > 0 for t in model.tensors)
    # the same in a table type a header holds many of (a reader per vtable, built with
    # one struct unless fields overlap): pass statistics, nodes_after read from
    # nodes_before's bytes
    data = bytearray(files["cnn"])
    pre, header = header_of(bytes(data))
    m = fb.Model.GetRootAs(header, 0)
    assert m.PassStatsLength() > 1
    vt = ff.PREAMBLE_SIZE + _table_vtable(header, m.PassStats(0)._tab.Pos)
    slot_of = {
        name: pmx_header._PASS_STAT.fields[getattr(pmx_header._PASS_STAT, name)].slot
        for name in ("nodes_before", "nodes_after")
    }
    entry = struct.unpack_from("<H", data, vt + slot_of["nodes_before"])[0]
    struct.pack_into("<H", data, vt + slot_of["nodes_after"], entry)
    data = bytes(data)
    pre, header = header_of(data)
    flatbuffer_reader.READERS.clear()
    model = pmx_header.read_header("x.pmx", header, pre, len(data))
    assert_same(model, reference(header))
    assert any(before == after for _, before, after in model.pass_stats)


# --- damaged headers: the reader's errors name the field ------------------------------


def _write(tmp_path, data):
    p = tmp_path / "bad.pmx"
    p.write_bytes(ff.pack_preamble(*_preamble_fields(data)) + data[ff.PREAMBLE_SIZE :])
    return p


def _preamble_fields(data):
    pre = ff.unpack_preamble(data[: ff.PREAMBLE_SIZE])
    h0, hs, d0 = pre["header_offset"], pre["header_size"], pre["data_offset"]
    return hs, d0, pre["data_size"], ff.crc32(data[h0 : h0 + hs]), ff.crc32(data[d0:])


def _tensors_table(data):
    _pre, header = header_of(data)
    return header, fb.Model.GetRootAs(header, 0).Tensors()._tab.Pos


def _field_target(header, pos, layout, name):
    """Header position of what the uoffset field `name` of the `layout` table at `pos`
    points at (a string's or vector's length)."""
    vt = _table_vtable(header, pos)
    slot = layout.fields[getattr(layout, name)].slot
    at = pos + struct.unpack_from("<H", header, vt + slot)[0]
    return at + struct.unpack_from("<I", header, at)[0]


def _patch(data, header_pos, fmt, value):
    out = bytearray(data)
    struct.pack_into(fmt, out, ff.PREAMBLE_SIZE + header_pos, value)
    return bytes(out)


def test_damaged_headers_name_what_is_wrong(files, tmp_path):
    data = files["cnn"]
    header, pos = _tensors_table(data)
    size = len(header)
    T, N = pmx_header._TENSORS, pmx_header._NODES
    name_at, dims_at = _field_target(header, pos, T, "names"), _field_target(header, pos, T, "dims")
    ends_at = _field_target(header, pos, T, "name_ends")
    alias_of_at = _field_target(header, pos, T, "alias_of")
    nodes = fb.Model.GetRootAs(header, 0).Nodes()._tab.Pos
    ops_at, input_ends_at = _field_target(header, nodes, N, "ops"), _field_target(header, nodes, N, "input_ends")
    sets_at = _field_target(header, nodes, N, "attr_sets")
    n_tensors = struct.unpack_from("<I", header, ends_at)[0]
    n_strings = fb.Model.GetRootAs(header, 0).StringsLength()
    cases = [
        # soffset aiming the vtable before the header
        (_patch(data, pos, "<i", pos + 100), "tensors vtable at byte -100 is outside the"),
        # the names longer than what is left of the header
        (_patch(data, name_at, "<I", size - name_at), f"tensor names at byte {name_at} runs past the {size}-byte"),
        # a dims vector of 2**31 elements: refused by the budget before it is read
        (_patch(data, dims_at, "<I", 2**31), r"tensor dims \(\d+ elements\): the header's vectors and strings add up"),
        # within the budget, but running past the header
        (_patch(data, dims_at, "<I", (size - dims_at) // 8 + 1), r"IndexError: tensor dims: unpack_from requires"),
        # a table past the end
        (_patch(data, 0, "<I", size + 8), r"IndexError: model tables: "),
        # columns that disagree: one entry short, ends that fall, an index past its table
        (
            _patch(data, ends_at, "<I", n_tensors - 1),
            f"tensors column name_ends has {n_tensors - 1} entries, expected {n_tensors}",
        ),
        (_patch(data, ends_at + 8, "<I", 2**31), r"tensor names: ends \[\d+, 2147483648"),
        (_patch(data, input_ends_at + 8, "<I", 10**6), r"node inputs: ends \[\d+, 1000000"),
        (_patch(data, ops_at + 4, "<I", n_strings), f"node 0 names entry {n_strings} of the {n_strings} model strings"),
        (_patch(data, sets_at + 4, "<I", 10**6), "node 0 names entry 1000000 of the"),
        (_patch(data, alias_of_at + 4, "<i", n_tensors + 5), f"alias_of {n_tensors + 5} is not a tensor index"),
    ]
    # a view's stride list claimed by a tensor index past the table
    strided = _strided_view_file(tmp_path)
    s_header, s_pos = _tensors_table(strided)
    s_count = struct.unpack_from("<I", s_header, _field_target(s_header, s_pos, T, "name_ends"))[0]
    cases.append(
        (
            _patch(strided, _field_target(s_header, s_pos, T, "strided") + 4, "<I", s_count),
            "tensor alias strides: tensor indices",
        )
    )
    # a least size above the planned one, the greatest unbounded (a dynamic batch)
    d_header, d_pos = _tensors_table(files["dynamic"])
    cases.append(
        (
            _patch(files["dynamic"], _field_target(d_header, d_pos, T, "dim_min") + 4, "<q", 10**6),
            r"tensor \d+ dim range 1000000..-1 does not contain its planned size 2",
        )
    )
    for bad, message in cases:
        with pytest.raises(PmxFormatError) as e:
            InferenceSession(str(_write(tmp_path, bad)))
        assert re.search(message, str(e.value)), (message, str(e.value))


def _strided_view_file(tmp_path):
    """A file whose second tensor is a view with explicit strides (the format allows
    them; no compiler pass writes them yet): y0 (2, 3) float32 viewing the input x with
    strides (12, 4)."""
    g = Graph("strided")
    x = Value("x", (2, 3))
    y0, y1 = Value("y0", (2, 3)), Value("y1", (2, 3))
    g.inputs = [x]
    g.add_node(Node("elementwise", "n0", [x], [y0], expr=E.call("neg", E.at(0))))
    g.add_node(Node("elementwise", "n1", [y0], [y1], expr=E.call("neg", E.at(0))))
    g.outputs = [y1]
    options = CompileOptions(disabled=["fuse_elementwise"])
    plan = compile_graph(g, options)
    plan = plan.replace(aliases={**plan.aliases, y0.uid: (x, 0, (12, 4))})
    path = tmp_path / "strided.pmx"
    write(g, plan, options, str(path))
    return path.read_bytes()


def test_strided_views_read_like_the_generated_code(tmp_path):
    data = _strided_view_file(tmp_path)
    _pre, header = header_of(data)
    p = tmp_path / "strided_ok.pmx"
    p.write_bytes(data)
    model = load.open_model(str(p))
    assert_same(model, verified(reference(header)))
    assert [t.alias_strides for t in model.tensors if t.alias_strides] == [(12, 4)]


def test_ranks_above_max_rank_are_refused(files, tmp_path):
    """A rank above MAX_RANK names the tensor and its rank, before the dims are cut."""
    data = files["cnn"]
    header, pos = _tensors_table(data)
    ranks_at = _field_target(header, pos, pmx_header._TENSORS, "ranks")
    too_long = pmx_header.MAX_RANK + 1
    bad = _patch(data, ranks_at + 4 + 3, "<B", too_long)
    with pytest.raises(PmxFormatError, match=f"tensor 3 has rank {too_long}, more than {pmx_header.MAX_RANK}"):
        InferenceSession(str(_write(tmp_path, bad)))


@pytest.mark.parametrize(
    "code,dtype",
    [
        ("f64", np.float64),
        ("f32", np.float32),
        ("f16", np.float16),
        ("i64", np.int64),
        ("i32", np.int32),
        ("i16", np.int16),
        ("i8", np.int8),
        ("u8", np.uint8),
        ("bool", np.bool_),
    ],
)
def test_tensors_of_every_dtype_load_and_run(tmp_path, code, dtype):
    """The dtype check names only unknown codes. It had refused every float64 tensor:
    np.dtype("float64") == None is True, so `None in dtypes` matched it."""
    from ziputil import build_zip

    param = tmp_path / "m.pnnx.param"
    ops = [
        f"pnnx.Input in 0 1 0 #0=(2,3){code}",
        f"torch.flatten flat 1 1 0 1 end_dim=-1 start_dim=0 $input=0 #0=(2,3){code} #1=(6){code}",
        "pnnx.Output out 1 0 1",
    ]
    param.write_text("\n".join(["7767517", f"{len(ops)} {len(ops) - 1}", *ops]) + "\n")
    (tmp_path / "m.pnnx.bin").write_bytes(build_zip([]).data)
    out = str(tmp_path / "m.pmx")
    compile_model(str(param), output=out)
    x = (np.arange(6).reshape(2, 3) % 3).astype(dtype)
    session = InferenceSession(out)
    (y,) = session.run(None, {session.get_inputs()[0].name: x})
    assert y.dtype == dtype
    np.testing.assert_array_equal(y, x.reshape(-1))


def test_older_format_versions_are_refused_with_a_way_out(files, tmp_path):
    data = bytearray(files["cnn"])
    struct.pack_into("<I", data, 8, 1)  # the version, after the 8-byte magic
    struct.pack_into("<I", data, 56, ff.crc32(bytes(data[:56])))
    p = tmp_path / "v1.pmx"
    p.write_bytes(bytes(data))
    with pytest.raises(PmxFormatError, match=r"format version 1 was written by an older pmx.*compile the model again"):
        load.open_model(str(p))


def test_newer_format_versions_are_refused_asking_to_upgrade(files, tmp_path):
    data = bytearray(files["cnn"])
    assert ff.unpack_preamble(bytes(data[: ff.PREAMBLE_SIZE]))["version"] == ff.OLDEST_READABLE_VERSION
    struct.pack_into("<I", data, 8, ff.FORMAT_VERSION + 1)
    struct.pack_into("<I", data, 56, ff.crc32(bytes(data[:56])))
    p = tmp_path / "v_next.pmx"
    p.write_bytes(bytes(data))
    with pytest.raises(
        PmxFormatError,
        match=f"format version {ff.FORMAT_VERSION + 1} is newer than this runtime "
        f"reads \\({ff.FORMAT_VERSION}\\): run it with the pnnx-pmx that compiled it",
    ):
        load.open_model(str(p))


# --- checks whose fast paths must not look away ------------------------------------------


@pytest.fixture()
def cnn_model(files, tmp_path):
    p = tmp_path / "cnn.pmx"
    p.write_bytes(files["cnn"])
    return load.open_model(str(p))


def _with_nodes(model, nodes):
    return model.replace(nodes=nodes)


def test_check_nodes_names_each_fault(cnn_model):
    m = cnn_model
    nodes = m.nodes
    const = next(i for i, t in enumerate(m.tensors) if t.kind == fb.TensorKind.Constant)
    first_out = nodes[0].outputs[0]
    last_out = nodes[-1].outputs[0]
    n = len(m.tensors)

    def replaced(j, **kw):
        return nodes[:j] + [nodes[j].replace(**kw)] + nodes[j + 1 :]

    cases = [
        (replaced(0, inputs=(n,) + nodes[0].inputs[1:]), f"input tensor index {n} out of range"),
        (replaced(0, inputs=(-2,) + nodes[0].inputs[1:]), "input tensor index -2 out of range"),
        (replaced(0, inputs=(last_out,) + nodes[0].inputs[1:]), f"reads tensor {last_out}"),
        (replaced(0, outputs=(n + 3,)), f"output tensor index {n + 3} out of range"),
        (replaced(0, outputs=(const,)), f"writes tensor {const}"),
        (replaced(0, outputs=(m.inputs[0],)), f"writes tensor {m.inputs[0]}"),
        (replaced(1, outputs=(first_out,)), f"writes tensor {first_out}"),  # produced twice
        (replaced(0, outputs=(first_out, first_out)), f"writes tensor {first_out}"),  # twice by one node
        (replaced(0, op="no_such_op"), "unknown op"),
    ]
    for bad, message in cases:
        with pytest.raises(PmxFormatError) as e:
            verify._check_nodes(_with_nodes(m, bad), load._expression)
        assert message in str(e.value), (message, str(e.value))
    # the valid model passes, and so does an absent optional input (-1)
    verify._check_nodes(m, load._expression)
    verify._check_nodes(_with_nodes(m, replaced(0, inputs=nodes[0].inputs + (-1,))), load._expression)


def test_shape_rule_cache_checks_nodes_that_differ_only_in_attributes(cnn_model):
    """Two convs reading the same tensor with the same weights: one matches the file, a
    copy with another stride must still be checked with its own attributes."""
    m = cnn_model
    j = next(j for j, node in enumerate(m.nodes) if node.op == "conv")
    conv = m.nodes[j]
    verify.check_shape_rules(_with_nodes(m, m.nodes + [conv]))  # the same node twice: fine
    stride = tuple(s + 1 for s in conv.attrs["stride"])
    other = conv.replace(attrs={**conv.attrs, "stride": stride}, name="other")
    with pytest.raises(PmxFormatError, match=r"'other'.*give output shapes"):
        verify.check_shape_rules(_with_nodes(m, m.nodes + [other]))
    # and the other order: the damaged node first, the good one reusing nothing of it
    with pytest.raises(PmxFormatError, match=r"'other'.*give output shapes"):
        verify.check_shape_rules(_with_nodes(m, m.nodes[:j] + [other] + m.nodes[j:]))


def test_loaded_constants_are_read_only_views_of_the_map(cnn_model):
    m = cnn_model
    whole = np.frombuffer(m._map, np.uint8)
    d0 = m.preamble["data_offset"]
    for i, arr in m.constants.items():
        t = m.tensors[i]
        assert arr.shape == t.shape and arr.dtype == t.dtype and not arr.flags.writeable
        assert arr.flags.c_contiguous and np.shares_memory(arr, whole)
        assert arr.tobytes() == bytes(m._map[d0 + t.data_offset : d0 + t.data_offset + t.data_size])


# --- the garbage collector is left as found ---------------------------------------------


@pytest.mark.parametrize("enabled", [True, False])
def test_collector_state_is_restored(files, tmp_path, enabled):
    good = tmp_path / "good.pmx"
    good.write_bytes(files["cnn"])
    bad = _write(tmp_path, _patch(files["cnn"], _tensors_table(files["cnn"])[1], "<i", 10**6))
    was = gc.isenabled()
    try:
        gc.enable() if enabled else gc.disable()
        session = InferenceSession(str(good))
        assert gc.isenabled() is enabled
        session.run(None, {a.name: np.zeros([d or 1 for d in a.shape], np.float32) for a in session.get_inputs()})
        assert gc.isenabled() is enabled  # the first run binds the kernels with it paused
        with pytest.raises(PmxError):
            InferenceSession(str(bad))
        assert gc.isenabled() is enabled
    finally:
        gc.enable() if was else gc.disable()


# --- the shape-rule check, at load ----------------------------------------------------------


def _with_conv_stride(data, stride):
    """`data` with the first element of the first conv's stride attribute replaced (the
    attribute is shared by every node with the same attributes: the first conv fails
    first)."""
    _pre, header = header_of(data)
    m = fb.Model.GetRootAs(header, 0)
    strings = [m.Strings(k) for k in range(m.StringsLength())]
    nodes = m.Nodes()
    names, ends = _text(nodes.Names()), _vector(nodes, "NameEnds")
    for j in range(nodes.OpsLength()):
        if strings[nodes.Ops(j)] != b"conv":
            continue
        attrs = m.AttrSets(nodes.AttrSets(j))
        for k in range(attrs.AttrsLength()):
            a = attrs.Attrs(k)
            if a.Name() == b"stride":
                pos = a._tab.Pos
                slot = pmx_header._ATTR.fields[pmx_header._ATTR.ints].slot
                at = pos + struct.unpack_from("<H", header, _table_vtable(header, pos) + slot)[0]
                first = at + struct.unpack_from("<I", header, at)[0] + 4
                return _patch(data, first, "<q", stride), names[(ends[j - 1] if j else 0) : ends[j]]
    raise AssertionError("no conv with a stride")


def test_shape_rules_refuse_a_damaged_file_at_load(files, tmp_path, monkeypatch):
    """A stride that no longer fits the stored shapes fails at load (open_model, pmx
    verify, InferenceSession) with PmxFormatError naming the node, before any arena is
    allocated or any kernel factory is called."""
    bad, conv = _with_conv_stride(files["cnn"], 3)
    path = str(_write(tmp_path, bad))
    message = rf"node \d+ \(conv '{re.escape(conv)}'\): its attributes and input shapes give output shapes"
    with pytest.raises(PmxFormatError, match=message):
        load.open_model(path)
    with pytest.raises(PmxFormatError, match=message):
        InferenceSession(path, verify=True)

    from pmx.runtime import session
    from pmx.runtime.kernels.registry import REGISTRY, all_kernels

    touched = []

    def recorded(op, make):
        return lambda *a: touched.append(op) or make(*a)

    for op, k in list(all_kernels().items()):
        monkeypatch.setitem(REGISTRY, op, k.replace(make=recorded(op, k.make)))
    real_empty = session._aligned_empty
    monkeypatch.setattr(session, "_aligned_empty", lambda n, *a: touched.append(n) or real_empty(n, *a))
    with pytest.raises(PmxFormatError, match=message):
        InferenceSession(path)
    assert touched == [], "a kernel or an arena was made before the check"

    good = tmp_path / "good.pmx"
    good.write_bytes(files["cnn"])
    sess = InferenceSession(str(good))
    x = np.zeros(sess.model.tensors[sess.model.inputs[0]].shape, np.float32)
    (y,) = sess.run(None, {sess.get_inputs()[0].name: x})
    assert touched and np.isfinite(y).all()
