"""The Python route from a torch module to a checked .pmx (pmx.compiler.from_torch), the
check of a compiled .param against the model.pt pnnx traced (`pmx compile --check`), paths
as os.PathLike, and the advice InferenceSession gives for a file that is not a .pmx."""

import pathlib
import shutil

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from pmx.compiler import check_against_torch, compile_model, from_torch
from pmx.compiler.cli import main
from pmx.runtime import InferenceSession, PmxCompileError, PmxFormatError

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "tools" / "example"


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(F.relu(self.conv(x)).mean((2, 3)))


class TwoInputs(nn.Module):
    def forward(self, a, b):
        return torch.tanh(a) * b, a - b


@pytest.mark.parametrize(
    "module,inputs",
    [
        (Block(), (torch.rand(1, 3, 12, 12),)),
        (TwoInputs(), (torch.rand(2, 5), torch.rand(2, 5))),
        (nn.Sequential(nn.Linear(6, 6), nn.GELU()), torch.rand(3, 6)),  # one tensor, not a tuple
    ],
)
def test_from_torch_gives_a_pmx_that_matches_the_module(tmp_path, module, inputs):
    result = from_torch(module, inputs, tmp_path / "m.pmx", metadata={"from": "test"})
    assert pathlib.Path(result.output) == tmp_path / "m.pmx"
    sess = InferenceSession(tmp_path / "m.pmx")
    assert sess.get_modelmeta().custom_metadata_map == {"from": "test"}
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    with torch.no_grad():
        want = module.eval()(*inputs)
    want = want if isinstance(want, tuple) else (want,)
    got = sess.run(None, {a.name: x.numpy() for a, x in zip(sess.get_inputs(), inputs)})
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w.numpy(), rtol=1e-4, atol=1e-5)


class SelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(16, 2, batch_first=True)

    def forward(self, x):
        return self.mha(x, x, x, need_weights=False)[0]


@pytest.mark.parametrize(
    "module", [nn.TransformerEncoderLayer(16, 2, 32, batch_first=True, dropout=0.0), SelfAttention()]
)
def test_batch_first_attention_layers_export_without_torchs_fused_fast_path(tmp_path, module):
    """In eval mode under no_grad, torch runs a batch-first encoder layer as one fused op
    pnnx cannot convert (aten::_transformer_encoder_layer_fwd); from_torch traces with
    autograd on, so it and a batch-first attention layer trace as plain ops. torch's
    re-trace comparison, which fails on attention layers, is off by default."""
    torch.manual_seed(0)
    module = module.eval()
    x = torch.rand(2, 5, 16)
    from_torch(module, (x,), tmp_path / "m.pmx")
    sess = InferenceSession(tmp_path / "m.pmx")
    with torch.no_grad():
        want = module(x)
    want = want[0] if isinstance(want, tuple) else want
    (got,) = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-4, atol=1e-5)


def test_from_torch_is_quiet_and_its_result_reads_in_one_line(tmp_path, capfd):
    """pnnx's converter logs ~30 lines to the process's stderr; from_torch keeps them
    unless verbose=True, and the result prints as a one-line summary."""
    result = from_torch(Block(), torch.rand(1, 3, 12, 12), tmp_path / "m.pmx")
    out, err = capfd.readouterr()
    assert out == "" and err == ""
    text = repr(result)
    assert "\n" not in text and text.startswith("<CompileResult ") and "in0 takes [1.., 3, 12, 12]" in text
    from_torch(Block(), torch.rand(1, 3, 12, 12), tmp_path / "v.pmx", verbose=True)
    assert "pnnxparam" in "".join(capfd.readouterr())


def test_from_torch_passes_a_dynamic_shape_export_to_pnnx(tmp_path):
    """export_options' inputs2 is pnnx's second trace: the '?' dims it finds become dynamic."""
    result = from_torch(
        Block(), torch.rand(1, 3, 12, 12), tmp_path / "m.pmx", export_options=dict(inputs2=torch.rand(2, 3, 16, 16))
    )
    assert result.dynamic["in0"][2] == (1, -1)
    sess = InferenceSession(tmp_path / "m.pmx")
    x = torch.rand(3, 3, 20, 20)
    with torch.no_grad():
        want = Block().eval()(x)  # another module's weights: compare shapes only here
    assert sess.run(None, {"in0": x.numpy()})[0].shape == tuple(want.shape)


def test_an_unknown_export_option_is_named(tmp_path):
    from pmx.runtime import PmxInputError

    with pytest.raises(PmxInputError, match=r"export_options \['check_trase'\]"):
        from_torch(Block(), torch.rand(1, 3, 12, 12), tmp_path / "m.pmx", export_options=dict(check_trase=False))


def test_a_pmx_that_differs_from_the_module_is_refused(tmp_path):
    """The check is what catches pnnx writing another graph than the module's: here the
    module is changed after export, as pnnx's rewrites change a graph."""
    module = Block().eval()
    x = torch.rand(1, 3, 12, 12)
    from_torch(module, (x,), tmp_path / "m.pmx")
    with torch.no_grad():
        module.fc.bias += 0.5
    with pytest.raises(PmxCompileError, match=r"differs from the torch module.*out0: max \|error\| 0\.5"):
        check_against_torch(module, (x,), tmp_path / "m.pmx")


class Flatten(nn.Module):
    """A conv, then its output flattened per image before a Linear (view(x.size(0), -1)),
    or, with mix, over the batch before a softmax (view(1, -1): at batch 2 torch mixes the
    two images in one softmax). pnnx writes both as (1, 64) at batch 1."""

    def __init__(self, mix=False):
        super().__init__()
        self.mix = mix
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(64, 3)

    def forward(self, x):
        y = self.conv(x)
        return y.reshape(1, -1).softmax(-1) if self.mix else self.fc(y.view(y.size(0), -1))


def test_a_batch_torch_runs_otherwise_fails_the_check_and_the_file_is_removed(tmp_path):
    """pnnx writes view(1, -1) and view(x.size(0), -1) alike at batch 1; pmx reads the
    second, so the check at batch 2 must catch the first, say so, and leave no file."""
    torch.manual_seed(0)
    with pytest.raises(PmxCompileError) as caught:
        from_torch(Flatten(mix=True), torch.rand(1, 3, 4, 4), tmp_path / "m.pmx")
    message = str(caught.value)
    assert "on inputs at batch 2: out0 has shape [2, 64], torch's [1, 128]" in message
    assert "--static" in message and "was removed" in message
    assert not (tmp_path / "m.pmx").exists()
    from_torch(Flatten(mix=True), torch.rand(1, 3, 4, 4), tmp_path / "m.pmx", auto_batch=False)  # as advised


def test_a_flatten_read_per_image_is_noted_and_matches_torch_at_other_batches(tmp_path):
    torch.manual_seed(0)
    module = Flatten().eval()
    result = from_torch(module, torch.rand(1, 3, 4, 4), tmp_path / "m.pmx")
    assert "flattens to (1, 64), read as (batch, 64)" in repr(result)
    x = torch.rand(3, 3, 4, 4)
    with torch.no_grad():
        want = module(x).numpy()
    (got,) = InferenceSession(tmp_path / "m.pmx").run(None, {"in0": x.numpy()})
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


class ScaledByScalar(nn.Module):
    def forward(self, x, k):
        return x * k + 1


def test_a_0d_input_takes_its_shape_and_dtype_from_the_example(tmp_path):
    """pnnx records no shape or dtype for a 0-d input (and its export cannot spell one):
    from_torch gives them from the example."""
    x, k = torch.rand(2, 4), torch.tensor(3)
    from_torch(ScaledByScalar(), (x, k), tmp_path / "m.pmx")
    sess = InferenceSession(tmp_path / "m.pmx")
    assert sess.get_inputs()[1].shape == [] and sess.get_inputs()[1].type == "tensor(int64)"
    (got,) = sess.run(None, {"in0": x.numpy(), "in1": np.array(5)})
    np.testing.assert_allclose(got, (x * 5 + 1).numpy(), rtol=1e-6)


def _exported_copy(exporter, tmp_path):
    prefix = pathlib.Path(exporter("from_torch_check", Block(), (torch.rand(1, 3, 12, 12),)))
    for suffix in (".pnnx.param", ".pnnx.bin", ".pt"):
        shutil.copy(str(prefix) + suffix, tmp_path / ("model" + suffix))
    return tmp_path / "model.pnnx.param"


def test_compile_check_passes_on_pnnxs_own_export(exporter, tmp_path, capsys):
    param = _exported_copy(exporter, tmp_path)
    assert main(["compile", str(param), "-o", str(tmp_path / "m.pmx"), "--check"]) == 0
    assert "matches" in capsys.readouterr().out


def test_compile_check_catches_a_param_edited_to_differ_from_its_model_pt(exporter, tmp_path, capsys):
    param = _exported_copy(exporter, tmp_path)
    text = param.read_text()
    assert "F.relu" in text
    param.write_text(text.replace("F.relu", "F.sigmoid", 1))  # an edited activation
    (tmp_path / "model_pnnx.py").write_text("# pnnx's generated Python\n")
    assert main(["compile", str(param), "-o", str(tmp_path / "m.pmx"), "--check"]) == 1
    err = capsys.readouterr().err
    assert "differs from the torch module on the example inputs: out0: max |error|" in err
    assert f"compare {tmp_path / 'model_pnnx.py'} with it" in err and "m.pmx was removed" in err
    assert not (tmp_path / "m.pmx").exists()


def test_compile_check_names_the_batch_that_differs(exporter, tmp_path, capsys):
    prefix = pathlib.Path(exporter("from_torch_flatten_softmax", Flatten(mix=True), (torch.rand(1, 3, 4, 4),)))
    for suffix in (".pnnx.param", ".pnnx.bin", ".pt"):
        shutil.copy(str(prefix) + suffix, tmp_path / ("model" + suffix))
    assert main(["compile", str(tmp_path / "model.pnnx.param"), "-o", str(tmp_path / "m.pmx"), "--check"]) == 1
    err = capsys.readouterr().err
    assert "at batch 2: out0 has shape [2, 64], torch's [1, 128]" in err and "--static" in err
    assert (
        main(["compile", str(tmp_path / "model.pnnx.param"), "-o", str(tmp_path / "m.pmx"), "--check", "--static"]) == 0
    )


@pytest.mark.parametrize("quiet", [[], ["-q"]])
def test_compile_check_fails_when_it_cannot_check(tmp_path, capsys, quiet):
    """A check asked for and not made must not pass: exit 1, saying why and how to skip it."""
    shutil.copy(EXAMPLE / "cnn.pnnx.param", tmp_path / "cnn.pnnx.param")
    shutil.copy(EXAMPLE / "cnn.pnnx.bin", tmp_path / "cnn.pnnx.bin")
    assert main(["compile", str(tmp_path / "cnn.pnnx.param"), "--check", *quiet]) == 1
    err = capsys.readouterr().err
    assert "--check: no traced model.pt beside" in err and "compile without --check to skip the check" in err


class TokenClassifier(torch.nn.Module):
    """Token ids in (int64, as pnnx writes them: #0=(1,8)i64), an embedding, a linear."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(16, 6)
        self.fc = torch.nn.Linear(6, 3)

    def forward(self, ids):
        return self.fc(self.embed(ids).mean(1))


def test_compile_check_feeds_integer_inputs_as_integers(exporter, tmp_path, capsys):
    prefix = pathlib.Path(exporter("from_torch_tokens", TokenClassifier(), (torch.randint(0, 16, (1, 8)),)))
    for suffix in (".pnnx.param", ".pnnx.bin", ".pt"):
        shutil.copy(str(prefix) + suffix, tmp_path / ("model" + suffix))
    assert "i64" in (tmp_path / "model.pnnx.param").read_text()
    assert main(["compile", str(tmp_path / "model.pnnx.param"), "-o", str(tmp_path / "m.pmx"), "--check"]) == 0
    assert "matches" in capsys.readouterr().out


def test_compile_model_takes_path_objects(tmp_path):
    result = compile_model(EXAMPLE / "cnn.pnnx.param", EXAMPLE / "cnn.pnnx.bin", tmp_path / "cnn.pmx")
    assert InferenceSession(pathlib.Path(result.output)).get_inputs()[0].name == "in0"


@pytest.mark.parametrize(
    "name,content,advice",
    [
        ("model.onnx", b"\x08\x07\x12\x04onnx", "is an ONNX model; export it with pnnx first"),
        ("model.pt", b"PK\x03\x04torch", "is a PyTorch model; export it with pnnx first"),
        ("model.pnnx.param", b"7767517\n3 2\npnnx.Input in0 0 1 x\n", "not compiled yet: pmx compile"),
    ],
)
def test_inference_session_on_another_format_says_what_to_run(tmp_path, name, content, advice):
    (tmp_path / name).write_bytes(content + bytes(64))
    with pytest.raises(PmxFormatError, match=advice):
        InferenceSession(str(tmp_path / name))


def test_a_pmx_is_told_by_its_content_not_its_name(tmp_path, capsys):
    compile_model(EXAMPLE / "cnn.pnnx.param", output=tmp_path / "m.pmx")
    shutil.copy(tmp_path / "m.pmx", tmp_path / "m.bin")  # a valid .pmx under an ncnn-like name
    assert main(["verify", str(tmp_path / "m.bin")]) == 0
    assert "ncnn" not in capsys.readouterr().err
