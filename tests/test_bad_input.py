"""Bad .param / .bin input: each case raises a PmxError subclass whose message says what
was wrong and where; the CLI turns each into one `pmx: error: ...` line and exit code 1."""

import pathlib
import re
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn
from ziputil import Entry, build_zip

from pmx.compiler.cli import main
from pmx.compiler.driver import compile_model
from pmx.runtime.errors import (
    PmxCompileError,
    PmxError,
    PmxFormatError,
    PmxResourceError,
    PmxUnsupportedOpError,
)

W = np.arange(12, dtype=np.float32).reshape(3, 4)

GOOD_OPS = [
    "pnnx.Input in 0 1 0 #0=(1,4)f32",
    "nn.Linear fc 1 1 0 1 bias=False in_features=4 out_features=3 @weight=(3,4)f32 $input=0 #0=(1,4)f32 #1=(1,3)f32",
    "pnnx.Output out 1 0 1",
]


def param_text(ops=GOOD_OPS, counts=None):
    counts = counts or f"{len(ops)} {len(ops) - 1}"
    return "\n".join(["7767517", counts, *ops]) + "\n"


def good_zip(**kw):
    return build_zip([("fc.weight", W.tobytes())], **kw)


def write(tmp_path, text=None, zip_bytes=None):
    p = tmp_path / "m.pnnx.param"
    p.write_text(param_text() if text is None else text) if not isinstance(text, bytes) else p.write_bytes(text)
    (tmp_path / "m.pnnx.bin").write_bytes(good_zip().data if zip_bytes is None else zip_bytes)
    return str(p)


def compile_err(param, bin_path=None, tmp_path=None):
    out = str(tmp_path / "out.pmx") if tmp_path else None
    with pytest.raises(PmxError) as info:
        compile_model(param, bin_path, out)
    return info.value


def test_good_model_compiles(tmp_path):
    r = compile_model(write(tmp_path), output=str(tmp_path / "m.pmx"))
    assert r.file_bytes > 0


# --- .param ------------------------------------------------------------------------------


def ops_with(i, line):
    ops = list(GOOD_OPS)
    ops[i] = line
    return ops


PARAM_CASES = {
    "empty file": ("", PmxFormatError, [r"line 1", r"magic number 7767517", r"found ''"]),
    "wrong magic": (
        param_text().replace("7767517", "7767518", 1),
        PmxFormatError,
        [r"line 1", r"expected the pnnx magic number 7767517, found '7767518'"],
    ),
    "binary junk": (
        b"\x89PNG\r\n\x1a\n\xff\xfe",
        PmxFormatError,
        [r"not a text file", r"byte \d+"],
    ),
    "no counts line": ("7767517\n", PmxFormatError, [r"line 2", r"operator count"]),
    "non-integer counts": (
        param_text(counts="3 two"),
        PmxFormatError,
        [r"line 2", r"expected '<operator count> <operand count>'", r"'3 two'"],
    ),
    "negative count": (param_text(counts="-3 2"), PmxFormatError, [r"line 2", r"non-negative"]),
    "three counts": (param_text(counts="3 2 1"), PmxFormatError, [r"line 2", r"'3 2 1'"]),
    "unicode digit count": (param_text(counts="3 \u0662"), PmxFormatError, [r"line 2"]),
    "too many operators declared": (
        param_text(counts="4 2"),
        PmxFormatError,
        [r"declares 4 operators but the file has 3 operator lines"],
    ),
    "billion operators": (
        param_text(counts="1000000000 2"),
        PmxResourceError,
        [r"declares 1000000000 operators; the limit is"],
    ),
    "wrong operand count": (
        param_text(counts="3 5"),
        PmxFormatError,
        [r"declares 5 operands but the operators define 2"],
    ),
    "too few tokens": (
        param_text(ops_with(1, "nn.Linear fc 1")),
        PmxFormatError,
        [r"line 4", r"expected '<type> <name> <nin> <nout> \.\.\.'", r"'nn.Linear fc 1'"],
    ),
    "non-integer nin": (
        param_text(ops_with(1, "nn.ReLU r one 1 0 1")),
        PmxFormatError,
        [r"line 4", r"nn.ReLU r", r"counts 'one' '1' are not integers"],
    ),
    "nin beyond tokens": (
        param_text(ops_with(1, "nn.ReLU r 5 1 0 1")),
        PmxFormatError,
        [r"line 4", r"declares 5 inputs and 1 outputs but lists 2 names"],
    ),
    "huge nin": (
        param_text(ops_with(1, f"nn.ReLU r {2**63} 1 0 1")),
        PmxFormatError,
        [r"line 4", r"declares 9223372036854775808 inputs"],
    ),
    "operand used before defined": (
        param_text(ops_with(1, "nn.ReLU r 1 1 7 1")),
        PmxFormatError,
        [r"line 4", r"nn.ReLU r reads operand '7' before any operator produces it"],
    ),
    "operand produced twice": (
        param_text(ops_with(1, "nn.ReLU r 1 1 0 0")),
        PmxFormatError,
        [r"line 4", r"produces operand '0' a second time"],
    ),
    "bad shape spec": (
        param_text(ops_with(1, "nn.ReLU r 1 1 0 1 #1=1,3f32")),
        PmxFormatError,
        [r"line 4", r"operand 1", r"expected '\(dims\)type'", r"'1,3f32'"],
    ),
    "bad dimension": (
        param_text(ops_with(1, "nn.ReLU r 1 1 0 1 #1=(1,x)f32")),
        PmxFormatError,
        [r"line 4", r"dimension 'x' in '\(1,x\)f32' is not an integer"],
    ),
    "huge dimension": (
        param_text(ops_with(1, f"nn.ReLU r 1 1 0 1 #1=(1,{10**30})f32")),
        PmxResourceError,
        [r"line 4", r"exceeds 2147483647"],
    ),
    "negative dimension": (
        param_text(ops_with(1, "nn.ReLU r 1 1 0 1 #1=(1,-2)f32")),
        PmxFormatError,
        [r"line 4", r"dimension -2 in '\(1,-2\)f32' is negative"],
    ),
    "rank too high": (
        param_text(ops_with(1, "nn.ReLU r 1 1 0 1 #1=(" + ",".join(["1"] * 70) + ")f32")),
        PmxFormatError,
        [r"line 4", r"70 dimensions in .*the limit is 32"],
    ),
    "unknown dtype": (
        param_text(ops_with(1, "nn.ReLU r 1 1 0 1 #1=(1,4)f8")),
        PmxFormatError,
        [r"line 4", r"unknown dtype 'f8'", r"known: f32"],
    ),
    "shape for foreign operand": (
        param_text(ops_with(2, "pnnx.Output out 1 0 1 #0=(1,4)f32")),
        PmxFormatError,
        [r"line 5", r"shape given for operand '0', which is not an input or output"],
    ),
    "token without =": (
        param_text(ops_with(1, "nn.ReLU r 1 1 0 1 inplace")),
        PmxFormatError,
        [r"line 4", r"expected key=value, found 'inplace'"],
    ),
    "label names no input": (
        param_text(ops_with(1, "nn.ReLU r 1 1 0 1 $input=9")),
        PmxFormatError,
        [r"line 4", r"\$input=9 names no \(unlabelled\) input of nn.ReLU r"],
    ),
    "integer beyond int64": (
        param_text(ops_with(1, f"nn.ReLU r 1 1 0 1 dim={10**30}")),
        PmxFormatError,
        [r"line 4", r"parameter dim", r"outside the int64 range"],
    ),
    "dynamic weight shape": (
        param_text(ops_with(1, GOOD_OPS[1].replace("@weight=(3,4)", "@weight=(3,?)"))),
        PmxFormatError,
        [r"line 4", r"weight @weight has a dynamic or negative shape"],
    ),
    "missing weight": (
        param_text(ops_with(1, GOOD_OPS[1] + " @extra=(2)f32")),
        PmxFormatError,
        [r"line 4", r"weight 'fc.extra' \(\(2\)f32\) is missing from .*m.pnnx.bin"],
    ),
    "weight size mismatch": (
        param_text(ops_with(1, GOOD_OPS[1].replace("(3,4)f32", "(3,5)f32"))),
        PmxFormatError,
        [r"entry 'fc.weight' has 48 bytes but its declared shape needs 15 x 4 = 60 bytes"],
    ),
    "weight dtype mismatch": (
        param_text(ops_with(1, GOOD_OPS[1].replace("(3,4)f32", "(3,4)f64"))),
        PmxFormatError,
        [r"entry 'fc.weight' has 48 bytes but .* needs 12 x 8 = 96 bytes"],
    ),
    "output with outputs": (
        param_text(ops_with(2, "pnnx.Output out 1 1 1 2"), counts="3 3"),
        PmxFormatError,
        [r"line 5", r"pnnx.Output out declares 1 inputs and 1 outputs; pnnx.Output has no outputs"],
    ),
    "no output": (param_text(GOOD_OPS[:2], counts="2 2"), PmxFormatError, [r"no pnnx.Output"]),
    "unknown op": (
        param_text(ops_with(1, "nn.Frobnicate frob_1 1 1 0 1 #1=(1,4)f32")),
        PmxUnsupportedOpError,
        [r"line 4", r"unsupported op nn.Frobnicate", r"node 'frob_1'", r"--list-ops"],
    ),
}


@pytest.mark.parametrize("bias", [2, 6])
def test_linear_bias_of_another_size_names_the_node(tmp_path, bias):
    """pnnx exported torchvision's SwinV2 with a 96-element bias on a 288-feature qkv
    layer (the slice its in-place zero_() touched): compiling says so, naming the node
    and line, instead of failing inside the first run. linear's shape rule says it, at
    compile time and for a loaded file alike."""
    from pmx.runtime.kernels.linalg import linear_infer

    line = GOOD_OPS[1].replace("bias=False", "bias=True") + f" @bias=({bias})f32"
    zip_bytes = build_zip([("fc.weight", W.tobytes()), ("fc.bias", np.zeros(bias, np.float32).tobytes())]).data
    err = compile_err(write(tmp_path, param_text(ops_with(1, line)), zip_bytes), tmp_path=tmp_path)
    assert isinstance(err, PmxCompileError), f"{type(err).__name__}: {err}"
    for p in (r"line 4", r"(?i)linear 'fc'", rf"bias \({bias},\) does not fit the weight's 3 output features"):
        assert re.search(p, str(err)), f"{p!r} not in {err}"
    with pytest.raises(ValueError, match=rf"bias \({bias},\) does not fit"):
        linear_infer(None, [(1, 4), (3, 4), (bias,)], [np.float32] * 3)
    for fits in [(3,), (1,), ()]:
        assert linear_infer(None, [(1, 4), (3, 4), fits], [np.float32] * 3) == [((1, 3), np.float32)]


@pytest.mark.parametrize("case", list(PARAM_CASES))
def test_bad_param(tmp_path, case):
    text, kind, patterns = PARAM_CASES[case]
    err = compile_err(write(tmp_path, text), tmp_path=tmp_path)
    assert isinstance(err, kind), f"{type(err).__name__}: {err}"
    msg = str(err)
    assert "m.pnnx.param" in msg or "m.pnnx.bin" in msg, msg
    for p in patterns:
        assert re.search(p, msg), f"{p!r} not in {msg!r}"


def test_tuple_bomb(tmp_path):
    """Each tuple packs the previous one twice: 2**60 items if flattened naively."""
    ops = ["pnnx.Input in 0 1 t0 #t0=(1)f32"]
    ops += [f"prim::TupleConstruct p{i} 2 1 t{i} t{i} t{i + 1}" for i in range(60)]
    ops += ["pnnx.Output out 1 0 t60"]
    err = compile_err(write(tmp_path, param_text(ops, counts=f"{len(ops)} 61")), tmp_path=tmp_path)
    assert isinstance(err, PmxResourceError), f"{type(err).__name__}: {err}"
    assert "line 64: tuple 't60' unpacks to more than" in str(err)


def test_missing_files(tmp_path):
    err = compile_err(str(tmp_path / "nope.pnnx.param"))
    assert isinstance(err, PmxFormatError) and "nope.pnnx.param: cannot read" in str(err)
    param = write(tmp_path)
    (tmp_path / "m.pnnx.bin").unlink()
    err = compile_err(param, tmp_path=tmp_path)
    assert "m.pnnx.bin: cannot open weights file" in str(err)


# --- .bin zips ----------------------------------------------------------------------------


def _damage(data, offset, fmt, value):
    b = bytearray(data)
    struct.pack_into(fmt, b, offset, value)
    return bytes(b)


def zip_cases():
    lay = good_zip()
    plain = good_zip(zip64=False)
    d = lay.data
    return {
        "truncated": (d[: len(d) - 30], [r"no end-of-central-directory record"]),
        "truncated into data": (d[:40], [r"no end-of-central-directory record"]),
        "tiny file": (b"PK\x03\x04", [r"4 bytes is too small for a zip archive"]),
        "not a zip": (b"\0" * 100, [r"no end-of-central-directory record"]),
        "deflated entry": (
            build_zip([Entry("fc.weight", W.tobytes(), method=8)]).data,
            [r"entry 'fc.weight' uses compression method 8; pnnx writes store-only"],
        ),
        "encrypted entry": (
            build_zip([Entry("fc.weight", W.tobytes(), flag=1)]).data,
            [r"entry 'fc.weight' is encrypted"],
        ),
        "bad central directory signature": (
            _damage(d, lay.cd_records[0], "<4s", b"PK\x09\x09"),
            [r"bad central directory record at offset \d+"],
        ),
        "central directory offset past end": (
            _damage(plain.data, plain.eocd_offset + 16, "<I", 10**6),
            [r"central directory \[1000000, \+\d+\) runs past the end record"],
        ),
        "directory count too large": (
            build_zip([("fc.weight", W.tobytes())], count=5).data,
            [r"cannot hold the 5 entries it declares"],
        ),
        "directory count too small": (
            build_zip([("fc.weight", W.tobytes()), ("x", b"")], count=1).data,
            [r"bytes after its 1 declared entries"],
        ),
        "huge directory": (
            build_zip([("fc.weight", W.tobytes())], count=2**40, cd_size=2**45).data,
            None,
        ),
        "entry past EOF": (
            build_zip([Entry("fc.weight", W.tobytes(), size=2**40)]).data,
            [r"entry 'fc.weight': data \[\d+, \+1099511627776\) runs past the end"],
        ),
        "entry size differs": (
            build_zip([Entry("fc.weight", W.tobytes(), size=40)]).data,
            [r"entry 'fc.weight' has 40 bytes but its declared shape needs 12 x 4 = 48"],
        ),
        "local header offset wrong": (
            build_zip([Entry("fc.weight", W.tobytes(), lfh_offset=7)]).data,
            [r"entry 'fc.weight': no local header at offset 7"],
        ),
        "local name differs": (
            build_zip([Entry("fc.weight", W.tobytes(), local_name="fc.weighx")]).data,
            [r"local header at 0 disagrees with the central directory"],
        ),
        "crc mismatch": (
            build_zip([Entry("fc.weight", W.tobytes(), crc=1234)]).data,
            [r"entry 'fc.weight': CRC-32 mismatch"],
        ),
        "flipped data byte": (
            _damage(d, lay.data_offsets[0] + 5, "<B", d[lay.data_offsets[0] + 5] ^ 0x40),
            [r"CRC-32 mismatch"],
        ),
        "zip64 locator missing": (
            d[: lay.locator_offset] + d[lay.eocd_offset :],
            [r"says zip64 but there is no zip64 end locator"],
        ),
        "zip64 record offset wrong": (
            _damage(d, lay.locator_offset + 8, "<Q", 3),
            [r"zip64 end record offset 3 does not point at a zip64 end record"],
        ),
        "zip64 extra truncated": (
            _damage(d, lay.cd_records[0] + 30, "<H", 4),
            [r"bad central directory record|malformed zip64 extra|runs past"],
        ),
        "duplicate entry": (
            build_zip([("fc.weight", W.tobytes()), ("fc.weight", W.tobytes())]).data,
            [r"entry name 'fc.weight' is empty or appears twice"],
        ),
    }


ZIP_CASES = list(zip_cases())


@pytest.mark.parametrize("case", ZIP_CASES)
def test_bad_zip(tmp_path, case):
    data, patterns = zip_cases()[case]
    err = compile_err(write(tmp_path, zip_bytes=data), tmp_path=tmp_path)
    msg = str(err)
    assert "m.pnnx.bin" in msg, msg
    if patterns is None:
        assert isinstance(err, PmxResourceError) and "limits are" in msg, msg
        return
    assert isinstance(err, PmxFormatError), f"{type(err).__name__}: {msg}"
    for p in patterns:
        assert re.search(p, msg), f"{p!r} not in {msg!r}"


# --- an ncnn model passed by mistake ---------------------------------------------------------


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        return torch.relu(self.conv(x))


@pytest.fixture(scope="module")
def ncnn_prefix(exporter):
    return exporter("bad_input_small", Small(), (torch.randn(1, 3, 8, 8),))


def test_ncnn_param_is_recognised(ncnn_prefix, tmp_path):
    for bin_path in (ncnn_prefix + ".ncnn.bin", None, ncnn_prefix + ".pnnx.bin"):
        err = compile_err(ncnn_prefix + ".ncnn.param", bin_path, tmp_path)
        assert isinstance(err, PmxFormatError)
        msg = str(err)
        assert "model.ncnn.param: line 3" in msg and "looks like an ncnn .param file" in msg, msg
        assert "'Input'" in msg and "model.pnnx.param" in msg


def test_ncnn_layer_in_the_middle(tmp_path):
    text = param_text(ops_with(1, "Convolution conv0 1 1 0 1 0=3 1=4 #1=(1,3)f32"))
    err = compile_err(write(tmp_path, text), tmp_path=tmp_path)
    assert "line 4" in str(err) and "ncnn" in str(err)


def test_capitalised_unknown_op_is_not_called_ncnn(tmp_path):
    err = compile_err(write(tmp_path, param_text(ops_with(1, "MyOp frob 1 1 0 1 #1=(1,4)f32"))), tmp_path=tmp_path)
    assert isinstance(err, PmxUnsupportedOpError) and "unsupported op MyOp" in str(err)


# --- the CLI ---------------------------------------------------------------------------------


CLI_CASES = ["wrong magic", "unknown op", "missing weight", "operand used before defined"]


@pytest.mark.parametrize("case", CLI_CASES + ["zip:deflated entry", "zip:entry past EOF", "ncnn"])
def test_cli_one_line_error(tmp_path, capsys, case, request):
    if case == "ncnn":
        prefix = request.getfixturevalue("ncnn_prefix")
        param, want = prefix + ".ncnn.param", "looks like an ncnn .param file"
    elif case.startswith("zip:"):
        data, patterns = zip_cases()[case[4:]]
        param, want = write(tmp_path, zip_bytes=data), patterns[0]
    else:
        text, _, patterns = PARAM_CASES[case]
        param, want = write(tmp_path, text), patterns[-1]
    code = main(["compile", param, "-o", str(tmp_path / "o.pmx")])
    out, err = capsys.readouterr()
    assert code == 1
    lines = err.strip("\n").split("\n")
    assert len(lines) == 1 and lines[0].startswith("pmx: error: "), err
    assert re.search(want, lines[0]), (want, lines[0])
    assert "Traceback" not in err + out
    assert not (tmp_path / "o.pmx").exists()


def test_cli_subprocess(tmp_path):
    """The console script installed with the interpreter under test (or, where there is
    none, `python -m pmx.compiler`, which is `pmx compile`)."""
    script = pathlib.Path(sys.executable).with_name("pmx")
    cmd = [str(script), "compile"] if script.exists() else [sys.executable, "-m", "pmx.compiler"]
    param = write(tmp_path, param_text(ops_with(1, "nn.Frobnicate frob_1 1 1 0 1 #1=(1,4)f32")))
    r = subprocess.run(cmd + [param], capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 1, r
    lines = r.stderr.strip("\n").split("\n")
    assert len(lines) == 1 and lines[0].startswith("pmx: error: "), r.stderr
    assert "unsupported op nn.Frobnicate" in lines[0] and "line 4" in lines[0] and "frob_1" in lines[0]
    assert "Traceback" not in r.stderr + r.stdout


def test_wrongly_typed_parameter_names_the_node(tmp_path):
    """Parameters of a type pnnx never writes must not crash a canonicalization rule:
    either the rule refuses them or compile_model turns the crash into PmxCompileError."""
    for params in ("dim0=-2 dim1=(0,0)", "dim0=abc dim1=1", "dim0=inf dim1=0", "dim0=None dim1=0"):
        text = param_text(ops_with(1, f"torch.transpose tr_7 1 1 0 1 {params} $input=0 #1=(4,1)f32"))
        err = compile_err(write(tmp_path, text), tmp_path=tmp_path)
        assert isinstance(err, PmxCompileError), f"{type(err).__name__}: {err}"
        assert "'tr_7' (line 4)" in str(err), str(err)
