"""A .param whose recorded dtypes or shapes contradict what its ops compute (an edited or
damaged file): the compile refuses it, naming the node, its .param line and both dtypes
(or shapes), or compiles to what the op computes and then matches torch. Never a
failure at run time."""

import re

import numpy as np
import pytest
import torch
from helpers import rel_error, torch_outputs
from torch import nn

from pmx.compiler.driver import compile_model
from pmx.runtime import InferenceSession
from pmx.runtime.errors import PmxCompileError, PmxError, PmxFormatError, PmxInternalError

NUMPY_NAMES = {
    "f32": "float32",
    "f16": "float16",
    "i64": "int64",
    "i32": "int32",
    "u8": "uint8",
    "bool": "bool",
    "c64": "complex64",
}


class Mixed(nn.Module):
    """Float, integer and bool intermediates: linear, an expression, concat, argmax,
    gather, a comparison and a cast."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = torch.relu(self.fc(x))
        g = h * 2.0 + x
        c = torch.cat([h, g], 1)
        idx = torch.argmax(c, 1)
        picked = torch.gather(c, 1, idx.unsqueeze(1))
        m = c > 0.5
        return c @ c.t(), picked, m.float().sum(1), idx + 1


@pytest.fixture(scope="module")
def export(exporter):
    torch.manual_seed(0)
    module = Mixed().eval()
    prefix = exporter("recorded_dtypes_mixed", module, (torch.rand(2, 8),))
    with open(prefix + ".pnnx.param") as f:
        text = f.read()
    with open(prefix + ".pnnx.bin", "rb") as f:
        binary = f.read()
    return module, text, binary


def intermediates(text):
    """{operand: (its producer's name, .param line, recorded dtype code)} for the operands
    an op produces and another op (not the output packing) reads."""
    found = {}
    for lineno, line in enumerate(text.split("\n"), 1):
        tokens = line.split()
        if len(tokens) < 4 or tokens[0] in ("pnnx.Input", "pnnx.Output", "prim::TupleConstruct"):
            continue
        n_in, n_out = int(tokens[2]), int(tokens[3])
        for operand in tokens[4 + n_in : 4 + n_in + n_out]:
            code = re.search(rf"(?:^|\s)#{re.escape(operand)}=\([^)]*\)(\w+)", line).group(1)
            found[operand] = (tokens[1], lineno, code)
    readers = {}
    for line in text.split("\n"):
        tokens = line.split()
        if len(tokens) >= 4 and tokens[2].isdigit():
            for operand in tokens[4 : 4 + int(tokens[2])]:
                readers.setdefault(operand, set()).add(tokens[0])
    return {k: v for k, v in found.items() if readers.get(k, set()) - {"prim::TupleConstruct", "pnnx.Output"}}


def recorded_as(text, operand, code):
    """`text` with every record of `operand` given dtype `code` (its shape kept)."""
    return re.sub(rf"(#{re.escape(operand)}=\([^)]*\))\w+", rf"\g<1>{code}", text)


def compile_text(tmp_path, text, binary):
    (tmp_path / "m.pnnx.param").write_text(text)
    (tmp_path / "m.pnnx.bin").write_bytes(binary)
    out = tmp_path / "m.pmx"
    compile_model(str(tmp_path / "m.pnnx.param"), str(tmp_path / "m.pnnx.bin"), str(out), verify=True)
    return out


def matches_torch(path, module):
    x = torch.rand(2, 8, generator=torch.Generator().manual_seed(3))
    got = InferenceSession(str(path)).run(None, {"in0": x.numpy()})
    want = torch_outputs(module, (x,))
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, (g.dtype, w.dtype, g.shape, w.shape)
        assert rel_error(g, w) <= 1e-5


def test_the_export_has_float_integer_and_bool_intermediates(export):
    _, text, _ = export
    codes = {code for _, _, code in intermediates(text).values()}
    assert {"f32", "i64", "bool"} <= codes, codes


@pytest.mark.parametrize("code", ["u8", "c64", "i64", "bool"])
def test_a_float_intermediate_recorded_as_another_kind_is_refused_naming_it(export, tmp_path, code):
    _, text, binary = export
    floats = {k: v for k, v in intermediates(text).items() if v[2] == "f32"}
    assert len(floats) >= 4
    for operand, (node, line, _) in floats.items():
        with pytest.raises(PmxCompileError) as e:
            compile_text(tmp_path, recorded_as(text, operand, code), binary)
        msg = str(e.value)
        assert f"'{node}' (line {line})" in msg and operand in msg, msg
        assert NUMPY_NAMES[code] in msg and "float32" in msg, msg
        assert "m.pnnx.param" in msg or "casts to" in msg, msg


@pytest.mark.parametrize("code", ["f32", "f16", "bool", "c64"])
def test_an_integer_intermediate_recorded_as_another_kind_is_refused_naming_it(export, tmp_path, code):
    _, text, binary = export
    ints = {k: v for k, v in intermediates(text).items() if v[2] == "i64"}
    assert ints
    for operand, (_node, _line, _) in ints.items():
        with pytest.raises(PmxCompileError) as e:
            compile_text(tmp_path, recorded_as(text, operand, code), binary)
        msg = str(e.value)
        assert re.search(r"'[^']+' \(line \d+\)", msg), msg  # its producer, or a reader refusing it
        assert NUMPY_NAMES[code] in msg or (code == "bool" and "boolean index" in msg), msg


@pytest.mark.parametrize("spelling", ["none", "null"])
def test_an_operand_without_a_recorded_dtype_takes_the_ops(export, tmp_path, spelling):
    """pnnx writes no dtype for 0-d results and scalar expressions (an integer arange
    bound, a select of an int32 tensor: tests/test_ops_indexing_shape.py); the frontend
    assumes float32 there, and the op's dtype replaces it."""
    module, text, binary = export
    for operand, (_, _, _recorded) in intermediates(text).items():
        if spelling == "none":
            edited = re.sub(rf" #{re.escape(operand)}=\([^)]*\)\w+", "", text)
        else:
            edited = recorded_as(text, operand, "null")
        matches_torch(compile_text(tmp_path, edited, binary), module)


@pytest.mark.parametrize("code", ["u8", "c64", "i64", "bool", "f32", "f16", "i32"])
def test_any_recorded_dtype_fails_the_compile_naming_the_node_or_matches_torch(export, tmp_path, code):
    module, text, binary = export
    for operand, (_node, _line, recorded) in intermediates(text).items():
        if recorded == code:
            continue
        try:
            path = compile_text(tmp_path, recorded_as(text, operand, code), binary)
        except PmxInternalError:
            raise
        except PmxCompileError as e:
            assert "line" in str(e), str(e)
            continue
        matches_torch(path, module)


@pytest.mark.parametrize(
    "shape,error,expected",
    [
        ("(2,8,1)", PmxCompileError, "would have shape (2, 8) but pnnx recorded (2, 8, 1)"),
        ("(16)", PmxCompileError, "would have shape (2, 8) but pnnx recorded (16,)"),
        ("()", PmxCompileError, "would have shape (2, 8) but pnnx recorded ()"),
        ("(2,-8)", PmxFormatError, "dimension -8 in '(2,-8)f32' is negative"),
    ],
)
def test_a_recorded_shape_of_another_rank_or_a_negative_dim_is_refused(export, tmp_path, shape, error, expected):
    _, text, binary = export
    operand, (_node, line, _) = next((k, v) for k, v in intermediates(text).items() if v[0] == "fc")
    edited = re.sub(rf"#{operand}=\([^)]*\)", f"#{operand}={shape}", text)
    with pytest.raises(error) as e:
        compile_text(tmp_path, edited, binary)
    assert expected in str(e.value) and f"line {line}" in str(e.value), str(e.value)
    assert not isinstance(e.value, PmxInternalError)


def test_linear_conv_and_softmax_refuse_an_integer_input_at_compile_time(tmp_path):
    """What torch refuses too; the kernels compute in floats, which an integer output
    buffer cannot take, so the compile names the node instead of the run failing."""
    from paramgraph import run_one_op

    x = np.ones((1, 4), np.int64)
    with pytest.raises(PmxCompileError, match=r"linear 'the_op' \(line 4\).*int64: linear takes floating-point"):
        run_one_op(
            "nn.Linear",
            "bias=False in_features=4 out_features=3",
            [x],
            [np.zeros((1, 3), np.float32)],
            labels=["input"],
            weights={"weight": np.ones((3, 4), np.float32)},
        )
    with pytest.raises(PmxCompileError, match=r"int64: softmax takes floating-point"):
        run_one_op("F.softmax", "dim=-1", [x], [np.zeros((1, 4), np.float32)], labels=["input"])
    with pytest.raises(PmxCompileError, match=r"int32: conv takes floating-point"):
        run_one_op(
            "nn.Conv2d",
            "bias=False dilation=(1,1) groups=1 in_channels=2 kernel_size=(1,1) out_channels=2 "
            "padding=(0,0) padding_mode=zeros stride=(1,1)",
            [np.ones((1, 2, 3, 3), np.int32)],
            [np.zeros((1, 2, 3, 3), np.float32)],
            labels=["input"],
            weights={"weight": np.ones((2, 2, 1, 1), np.float32)},
        )


def test_a_where_with_an_integer_condition_is_refused(tmp_path):
    from paramgraph import run_one_op

    cond = np.ones((3,), np.int32)
    with pytest.raises(PmxError, match=r"condition is of dtype int32, not bool"):
        run_one_op(
            "pnnx.Expression",
            "expr=where(@0,@1,@2)",
            [cond, np.ones(3, np.float32), np.ones(3, np.float32)],
            [np.zeros((3,), np.float32)],
        )
