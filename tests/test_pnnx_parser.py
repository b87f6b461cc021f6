"""The PNNX frontend on hand-written .param texts and .bin zips built here, and on a real
pnnx export: every parameter value kind, labels, shapes, every weight dtype, zip flavours."""

import math
import pathlib
import zipfile

import numpy as np
import pytest
import torch
from torch import nn
from ziputil import build_zip, write_bin

from pmx.compiler import pnnx
from pmx.runtime.errors import PmxFormatError

HEADER = "7767517"


def write_model(tmp_path, ops, weights=None, how="pnnx", operands=None, name="m"):
    """ops: operator lines without the header. Counts are computed unless given."""
    if operands is None:
        produced = set()
        for line in ops:
            t = line.split()
            nin, nout = int(t[2]), int(t[3])
            produced.update(t[4 + nin : 4 + nin + nout])
        operands = len(produced)
    param = tmp_path / f"{name}.pnnx.param"
    param.write_text("\n".join([HEADER, f"{len(ops)} {operands}", *ops]) + "\n")
    binp = tmp_path / f"{name}.pnnx.bin"
    if weights is None:
        binp.write_bytes(b"")
    else:
        write_bin(binp, weights, how)
    return str(param)


def one_op(tmp_path, params="", op="nn.Identity", weights=None, how="pnnx"):
    """in -> op -> out; returns the parsed op node."""
    ops = [
        "pnnx.Input in 0 1 x #x=(1,4)f32",
        f"{op} the.op 1 1 x y {params}",
        "pnnx.Output out 1 0 y",
    ]
    g = pnnx.load(write_model(tmp_path, ops, weights, how))
    (node,) = g.nodes
    return node


# --- parameter values ------------------------------------------------------------------

VALUES = [
    ("None", None),
    ("True", True),
    ("False", False),
    ("0", 0),
    ("7", 7),
    ("-3", -3),
    ("2147483647", 2147483647),
    ("-9223372036854775808", -(2**63)),
    ("1.5", 1.5),
    ("-0.25", -0.25),
    ("1e-05", 1e-05),
    ("1.000000e+00", 1.0),
    ("-2.5E+3", -2500.0),
    ("3.", 3.0),
    ("inf", math.inf),
    ("-inf", -math.inf),
    ("zeros", "zeros"),
    ("bilinear", "bilinear"),
    ("1x1", "1x1"),
    ("-x", "-x"),
    ("%batch", "%batch"),
    ("(%h,%w)", "(%h,%w)"),
    ("(1,2,3)", (1, 2, 3)),
    ("[1,-2]", (1, -2)),
    ("(1.5,2.000000e+00,-1e-05)", (1.5, 2.0, -1e-05)),
    ("(a,bb,ccc)", ("a", "bb", "ccc")),
    ("(1,x,2.5)", (1, "x", 2.5)),
    ("(7)", (7,)),
    ("()", ()),
    ("[]", ()),
    ("1.000000e+00+2.000000e+00j", 1 + 2j),
    ("1.000000e+00+-2.500000e-01j", 1 - 0.25j),
    ("(1.0+2.0j,-3.0+-4.0j)", (1 + 2j, -3 - 4j)),
]


@pytest.mark.parametrize("text,want", VALUES, ids=[v[0] for v in VALUES])
def test_parse_value_kinds(text, want):
    got = pnnx.parse_value(text)
    assert got == want and type(got) is type(want)
    if isinstance(want, tuple):
        assert [type(x) for x in got] == [type(x) for x in want]


def test_parse_value_nan():
    assert math.isnan(pnnx.parse_value("nan"))
    assert math.isnan(pnnx.parse_value("-nan"))
    (a, b) = pnnx.parse_value("(nan,1)")
    assert math.isnan(a) and b == 1


def test_parse_value_refuses_integers_beyond_int64():
    with pytest.raises(ValueError, match="int64"):
        pnnx.parse_value(str(2**63))
    with pytest.raises(ValueError, match="int64"):
        pnnx.parse_value(f"(1,{10**30})")


def test_every_value_kind_in_one_line(tmp_path):
    params = " ".join(f"p{i}={text}" for i, (text, _) in enumerate(VALUES))
    node = one_op(tmp_path, params + " q=nan")
    for i, (_, want) in enumerate(VALUES):
        assert node.attrs[f"p{i}"] == want, (i, VALUES[i])
    assert math.isnan(node.attrs["q"])


def test_expr_is_kept_raw(tmp_path):
    expr = "add(mul(@0,1.000000e+00),div(@1,sub(2,pow(@0,2))))"
    ops = [
        "pnnx.Input in 0 1 a #a=(2,3)f32",
        "pnnx.Input in2 0 1 b #b=(2,3)f32",
        f"pnnx.Expression e 2 1 a b c expr={expr} #c=(2,3)f32",
        "pnnx.Output out 1 0 c",
    ]
    g = pnnx.load(write_model(tmp_path, ops))
    assert g.nodes[0].attrs == {"expr": expr}
    ops[2] = "pnnx.Expression e 2 1 a b c expr=[int(size(@0,1)),-1] #c=(2,3)f32"
    g = pnnx.load(write_model(tmp_path, ops, name="n"))
    assert g.nodes[0].attrs["expr"] == "[int(size(@0,1)),-1]"


def test_value_may_contain_equals_and_dots_in_names(tmp_path):
    ops = [
        "pnnx.Input in.0 0 1 x.1 #x.1=(1,4)f32",
        (
            "nn.Linear blocks.0.fc 1 1 x.1 y.2 bias=False in_features=4 out_features=2 "
            "note=a=b @weight=(2,4)f32 $input=x.1 #y.2=(1,2)f32"
        ),
        "pnnx.Output out.0 1 0 y.2",
    ]
    w = np.arange(8, dtype=np.float32).reshape(2, 4)
    g = pnnx.load(write_model(tmp_path, ops, {"blocks.0.fc.weight": w}))
    (node,) = g.nodes
    assert node.name == "blocks.0.fc" and node.attrs["note"] == "a=b"
    assert node.input_names == ["input", "@weight"]
    np.testing.assert_array_equal(node.inputs[1].data, w)
    assert node.inputs[1].name == "blocks.0.fc.weight"


# --- labels and shapes -------------------------------------------------------------------


def test_operand_used_twice_gets_both_labels(tmp_path):
    ops = [
        "pnnx.Input in 0 1 0 #0=(2,3)f32",
        "torch.mul mul 2 1 0 0 1 $input=0 $other=0 #0=(2,3)f32 #1=(2,3)f32",
        "torch.add add 2 1 1 0 2 $other=0 #1=(2,3)f32 #2=(2,3)f32",
        "pnnx.Output out 1 0 2",
    ]
    g = pnnx.load(write_model(tmp_path, ops))
    mul, add = g.nodes
    assert mul.input_names == ["input", "other"] and mul.inputs[0] is mul.inputs[1]
    assert add.input_names == [None, "other"]
    assert mul.named_input("other") is g.inputs[0]


def test_shapes_with_dynamic_and_symbolic_dims(tmp_path):
    ops = [
        "pnnx.Input in 0 1 x #x=(?,3,%h,%w)f32",
        "nn.ReLU r 1 1 x y #x=(?,3,%h,%w)f32 #y=(?,3,%h,%w)f16",
        "torch.argmax a 1 1 y z dim=1 #y=(?,3,%h,%w)f16 #z=(-1,16)i64",
        "pnnx.Output out 1 0 z",
    ]
    g = pnnx.load(write_model(tmp_path, ops))
    assert g.inputs[0].shape == (None, 3, None, None) and g.inputs[0].dtype == "float32"
    assert g.nodes[0].outputs[0].shape == (None, 3, None, None)
    assert g.nodes[0].outputs[0].dtype == "float16"
    assert g.outputs[0].shape == (None, 16) and g.outputs[0].dtype == "int64"


@pytest.mark.parametrize("code,dtype", [(k, v[1]) for k, v in pnnx.DTYPES.items()])
def test_operand_dtype_codes(tmp_path, code, dtype):
    node = one_op(tmp_path, "#y=(2)" + code)
    assert node.outputs[0].dtype == dtype


def test_null_operand_type_and_old_negative_dims(tmp_path):
    node = one_op(tmp_path, "#y=(-1,-233,4)null")
    assert node.outputs[0].shape == (None, None, 4)
    with pytest.raises(PmxFormatError, match=r"weight @w: unknown dtype 'null'"):
        one_op(tmp_path, "@w=(2)null", weights={"the.op.w": b"\0" * 8})


def test_scalar_operand_shape(tmp_path):
    node = one_op(tmp_path, "#y=()f32")
    assert node.outputs[0].shape == ()


def test_graph_tensor_names(tmp_path):
    ops = [
        "pnnx.Input in0 0 1 a #a=(1)f32",
        "pnnx.Input in1 0 1 b #b=(1)f32",
        "torch.add add 2 1 a b out0 #out0=(1)f32",
        "nn.ReLU r 1 1 out0 c #c=(1)f32",
        "pnnx.Output o 2 0 c b",
    ]
    g = pnnx.load(write_model(tmp_path, ops))
    assert [v.name for v in g.inputs] == ["in0", "in1"]
    assert [v.name for v in g.outputs] == ["out0", "in1"]
    names = [v.name for v in g.values()]
    assert len(names) == len(set(names)), names  # the intermediate 'out0' was renamed


def test_tuple_output_is_flattened(tmp_path):
    ops = [
        "pnnx.Input in 0 1 a #a=(1)f32",
        "nn.ReLU r 1 1 a b #b=(1)f32",
        "nn.Sigmoid s 1 1 a c #c=(1)f32",
        "prim::TupleConstruct t0 1 1 c d",
        "prim::TupleConstruct t1 2 1 b d e",
        "pnnx.Output o 1 0 e",
    ]
    g = pnnx.load(write_model(tmp_path, ops))
    assert [n.op for n in g.nodes] == ["nn.ReLU", "nn.Sigmoid"]
    assert [v.producer.name for v in g.outputs] == ["r", "s"]


# --- weights -----------------------------------------------------------------------------

RNG = np.random.default_rng(0)
SAMPLES = {
    "f32": RNG.standard_normal((2, 3)).astype(np.float32),
    "f64": RNG.standard_normal((2, 3)),
    "f16": RNG.standard_normal((2, 3)).astype(np.float16),
    "i8": np.array([[-128, 0, 127], [1, 2, 3]], np.int8),
    "u8": np.array([[0, 255, 7], [1, 2, 3]], np.uint8),
    "i16": np.array([[-32768, 0, 32767], [1, 2, 3]], np.int16),
    "i32": np.array([[-(2**31), 0, 2**31 - 1], [1, 2, 3]], np.int32),
    "i64": np.array([[-(2**63), 0, 2**63 - 1], [1, 2, 3]], np.int64),
    "bool": np.array([[True, False, True], [False, False, True]]),
    "c64": (RNG.standard_normal((2, 3)) + 1j * RNG.standard_normal((2, 3))).astype(np.complex64),
    "c128": RNG.standard_normal((2, 3)) + 1j * RNG.standard_normal((2, 3)),
}


@pytest.mark.parametrize("code", sorted(SAMPLES))
def test_weight_dtypes(tmp_path, code):
    want = SAMPLES[code]
    node = one_op(tmp_path, f"@w=(2,3){code}", weights={"the.op.w": want})
    got = node.named_input("@w").data
    assert got.dtype == want.dtype and got.shape == (2, 3)
    np.testing.assert_array_equal(got, want)


def test_bf16_widens_bit_exactly(tmp_path):
    bits = np.array([0x3F80, 0xC049, 0x0001, 0x7F80, 0xFF80, 0x7FC1, 0x8000, 0x4049], np.uint16)
    node = one_op(tmp_path, "@w=(2,4)bf16", weights={"the.op.w": bits.reshape(2, 4)})
    got = node.named_input("@w").data
    assert got.dtype == np.float32 and got.shape == (2, 4)
    assert np.array_equal(got.reshape(-1).view(np.uint32), bits.astype(np.uint32) << 16)
    assert got.reshape(-1)[0] == 1.0 and got.reshape(-1)[1] == -3.140625


def test_c32_widens_to_complex64(tmp_path):
    halves = np.array([1.0, -2.0, 0.5, 3.0], np.float16)
    node = one_op(tmp_path, "@w=(2)c32", weights={"the.op.w": halves})
    np.testing.assert_array_equal(node.named_input("@w").data, np.array([1 - 2j, 0.5 + 3j], np.complex64))


def test_scalar_and_empty_weights(tmp_path):
    weights = {"the.op.s": np.array(2.5, np.float32), "the.op.e": b""}
    node = one_op(tmp_path, "@s=()f32 @e=(0,3)f32 @z=(4,0)i64", weights=weights)
    assert node.named_input("@s").data.shape == () and node.named_input("@s").data == 2.5
    assert node.named_input("@e").data.shape == (0, 3)
    assert node.named_input("@z").data.shape == (4, 0)  # absent from the zip: pnnx allows it


@pytest.mark.parametrize("how", ["pnnx", "plain", "zipfile", "zipfile64"])
def test_zip_flavours(tmp_path, how):
    w = RNG.standard_normal((3, 4)).astype(np.float32)
    b = RNG.standard_normal(3).astype(np.float32)
    node = one_op(
        tmp_path,
        "@weight=(3,4)f32 @bias=(3)f32",
        "nn.Linear",
        weights={"the.op.weight": w, "the.op.bias": b},
        how=how,
    )
    np.testing.assert_array_equal(node.named_input("@weight").data, w)
    np.testing.assert_array_equal(node.named_input("@bias").data, b)


def test_zipfile64_really_is_zip64(tmp_path):
    path = tmp_path / "z.bin"
    write_bin(path, {"a.w": np.zeros(3, np.float32)}, "zipfile64")
    (info,) = zipfile.ZipFile(path).infolist()
    assert info.extract_version >= 45 and b"\xff\xff\xff\xff" in path.read_bytes()[:30]


def test_own_writer_is_read_by_python_zipfile(tmp_path):
    path = tmp_path / "z.bin"
    path.write_bytes(build_zip([("a.b", b"1234"), ("c", b"")]).data)
    with zipfile.ZipFile(path) as z:
        assert z.read("a.b") == b"1234" and z.read("c") == b""
        assert z.testzip() is None


def test_zip_comment_and_empty_zip(tmp_path):
    path = tmp_path / "z.bin"
    path.write_bytes(build_zip([("a.w", b"\0" * 8)], comment=b"PK\x05\x06 fake end record in comment").data)
    with pnnx.StoreZip(str(path)) as z:
        assert list(z.entries) == ["a.w"]
    path.write_bytes(build_zip([]).data)  # pnnx writes this for a weightless model
    with pnnx.StoreZip(str(path)) as z:
        assert z.entries == {}


def test_weightless_model_with_empty_bin(tmp_path):
    node = one_op(tmp_path, "")
    assert node.op == "nn.Identity" and len(node.inputs) == 1


def test_weight_size_is_checked(tmp_path):
    with pytest.raises(PmxFormatError, match=r"'the.op.w' has 20 bytes .* needs 6 x 4 = 24 bytes"):
        one_op(tmp_path, "@w=(2,3)f32", weights={"the.op.w": b"\0" * 20})


def test_crlf_and_trailing_blank_lines(tmp_path):
    param = tmp_path / "m.pnnx.param"
    param.write_bytes(
        b"7767517\r\n3 2\r\npnnx.Input in 0 1 x #x=(2)f32\r\n"
        b"nn.ReLU r 1 1 x y\t#y=(2)f32\r\npnnx.Output out 1 0 y\r\n\r\n\n"
    )
    (tmp_path / "m.pnnx.bin").write_bytes(b"")
    g = pnnx.load(str(param))
    assert [n.op for n in g.nodes] == ["nn.ReLU"] and g.outputs[0].shape == (2,)


# --- a real pnnx export --------------------------------------------------------------------


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=True)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 5)
        self.scale = nn.Parameter(torch.randn(1, 8, 1, 1))
        with torch.no_grad():
            self.bn.running_mean.uniform_(-1, 1)
            self.bn.running_var.uniform_(0.5, 2)

    def forward(self, x):
        y = torch.relu(self.bn(self.conv(x))) * self.scale
        z = self.fc(y.mean((2, 3)))
        return z, torch.sigmoid(y)


def test_real_export_round_trip(exporter):
    torch.manual_seed(0)
    net = Net().eval()
    prefix = exporter("parser_round_trip", net, (torch.randn(1, 3, 8, 8),))
    g = pnnx.load(prefix + ".pnnx.param", prefix + ".pnnx.bin")
    assert [v.name for v in g.inputs] == ["in0"] and g.inputs[0].shape == (1, 3, 8, 8)
    assert [v.name for v in g.outputs] == ["out0", "out1"]
    assert g.outputs[0].shape == (1, 5) and g.outputs[1].shape == (1, 8, 8, 8)
    consts = {v.name: v.data for n in g.nodes for v in n.inputs if v.is_constant}
    consts.update({v.name: v.data for v in g.values() if v.is_constant})
    fc = next(n for n in g.nodes if n.op == "nn.Linear")
    assert fc.attrs == {"bias": True, "in_features": 8, "out_features": 5}
    np.testing.assert_array_equal(fc.named_input("@weight").data, net.fc.weight.detach().numpy())
    np.testing.assert_array_equal(fc.named_input("@bias").data, net.fc.bias.detach().numpy())
    # conv+bn may be fused by pnnx; the scale parameter survives as a pnnx.Attribute constant
    scale = net.scale.detach().numpy()
    assert any(d.shape == scale.shape and np.array_equal(d, scale) for d in consts.values())
    # every line of the file became a node, an input, an output or a constant
    lines = pathlib.Path(prefix + ".pnnx.param").read_text().split("\n")[2:]
    kinds = [ln.split()[0] for ln in lines if ln.strip()]
    assert len(g.nodes) == sum(
        k not in ("pnnx.Input", "pnnx.Output", "pnnx.Attribute", "prim::TupleConstruct") for k in kinds
    )
    for node in g.nodes:
        for v in node.inputs + node.outputs:
            assert v.shape is not None, (node, v)
