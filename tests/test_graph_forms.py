"""End-to-end: graph forms pnnx writes besides one module per op with its weights as
@attributes. Weights, biases, batch-norm statistics and PReLU slopes that arrive as graph
operands (graph inputs or computed tensors) run as real inputs; a module whose parameter
pnnx writes both as @attribute and as an operand (a tied weight) uses the attribute.
Every model is exported with pnnx and compared with torch."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn


def g(seed):
    return torch.Generator().manual_seed(seed)


def param_lines(exporter, name, module, inputs):
    with open(exporter(name, module, inputs) + ".pnnx.param") as f:
        return f.read().splitlines()


class CalledTwice(nn.Module):
    """One conv / batch norm / PReLU / linear module applied twice."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.act = nn.PReLU(4)
        self.fc = nn.Linear(8, 8)
        with torch.no_grad():
            self.bn.running_mean.uniform_(-1, 1, generator=g(1))
            self.bn.running_var.uniform_(0.5, 2, generator=g(2))
            self.act.weight.uniform_(-0.5, 0.5, generator=g(3))

    def forward(self, x):
        y = self.act(self.bn(self.conv(x)))
        y = self.act(self.bn(self.conv(y)))
        return y, self.fc(self.fc(y))


def test_module_called_twice(check_model):
    check_model("gf_twice", CalledTwice(), (torch.randn(2, 4, 8, 8, generator=g(0)),))


class Tied(nn.Module):
    """Language-model head sharing the embedding matrix."""

    def __init__(self, bias):
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.head = nn.Linear(6, 11, bias=bias)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.emb(ids)))


@pytest.mark.parametrize("bias", [False, True])
def test_tied_embedding_and_linear(check_model, exporter, bias):
    torch.manual_seed(5)
    model, ids = Tied(bias), torch.randint(0, 11, (2, 7), generator=g(4))
    # the form under test: the linear carries its @weight and the shared tensor as an operand
    head = [line for line in param_lines(exporter, f"gf_tied_{bias}", model, (ids,)) if line.startswith("nn.Linear")]
    assert len(head) == 1 and head[0].split()[2:4] == ["2", "1"] and "@weight=" in head[0], head
    check_model(f"gf_tied_{bias}", model, (ids,))


class ComputedWeights(nn.Module):
    """Convolution and linear weights / biases that are graph inputs or computed from them."""

    def __init__(self, nd):
        super().__init__()
        self.nd = nd
        self.base = nn.Parameter(torch.randn((6, 2) + (3,) * nd, generator=g(6)))
        self.bias = nn.Parameter(torch.randn(6, generator=g(7)))
        self.conv = (F.conv1d, F.conv2d, F.conv3d)[nd - 1]

    def forward(self, x, scale, w_in, b_in):
        w = self.base * scale.view((-1,) + (1,) * (self.nd + 1))  # known at run time only
        a = self.conv(x, w, self.bias * scale, padding=1, groups=2)
        b = self.conv(x, w_in, b_in, stride=2, groups=2)
        c = F.linear(a.flatten(1)[:, :5], w_in.flatten(1)[:, :5], b_in)
        return a, b, c


@pytest.mark.parametrize("nd", [1, 2, 3])
def test_conv_and_linear_weights_as_operands(check_model, nd):
    size = (10, 8, 6)[nd - 1]
    x = torch.randn((2, 4) + (size,) * nd, generator=g(8))
    scale = torch.rand(6, generator=g(9)) + 0.5
    w_in = torch.randn((6, 2) + (3,) * nd, generator=g(10))
    b_in = torch.randn(6, generator=g(11))
    check_model(f"gf_conv_w_{nd}d", ComputedWeights(nd), (x, scale, w_in, b_in))


class BatchNormTensors(nn.Module):
    """F.batch_norm with statistics and affine parameters that are graph tensors."""

    def __init__(self, affine):
        super().__init__()
        self.affine = affine
        self.var = nn.Parameter(torch.rand(5, generator=g(12)) + 0.5)

    def forward(self, x, mean, var, w, b):
        y = F.batch_norm(x, mean, var, w if self.affine else None, b if self.affine else None, False, 0.1, 1e-3)
        z = F.batch_norm(x, mean * 2, self.var, None, b, False, 0.1, 1e-5)  # one computed, one constant
        return y, z


@pytest.mark.parametrize("affine", [False, True])
@pytest.mark.parametrize("shape", [(3, 5), (2, 5, 7), (2, 5, 4, 3)])
def test_batch_norm_statistics_as_operands(check_model, affine, shape):
    x = torch.randn(shape, generator=g(13))
    mean, w, b = (torch.randn(5, generator=g(s)) for s in (14, 15, 16))
    var = torch.rand(5, generator=g(17)) + 0.1
    check_model(f"gf_bn_{affine}_{len(shape)}", BatchNormTensors(affine), (x, mean, var, w, b))


class PReLUOperand(nn.Module):
    def forward(self, x, slopes, one):
        return F.prelu(x, slopes), F.prelu(x, one), F.prelu(x, slopes.abs() * 0.5)


@pytest.mark.parametrize("shape", [(3, 4), (2, 4, 5), (2, 4, 3, 3)])
def test_prelu_slopes_as_operand(check_model, shape):
    x = torch.randn(shape, generator=g(18))
    check_model(
        f"gf_prelu_{len(shape)}", PReLUOperand(), (x, torch.randn(4, generator=g(19)), torch.randn(1, generator=g(20)))
    )


# ---- shapes pnnx writes besides the batched [N, C, ...] forms


class UnbatchedConv(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv1d(4, 6, 3, padding=1, padding_mode="reflect")
        self.c2 = nn.Conv2d(4, 5, 3, stride=2, groups=1)
        self.c3 = nn.Conv3d(4, 2, 2)

    def forward(self, x, y, z, w):
        return self.c1(x), F.conv1d(x, w, stride=2), self.c2(y), self.c3(z)


def test_unbatched_conv(check_model):
    inputs = (
        torch.randn(4, 10, generator=g(21)),
        torch.randn(4, 7, 9, generator=g(22)),
        torch.randn(4, 3, 4, 5, generator=g(23)),
        torch.randn(3, 4, 2, generator=g(24)),
    )
    check_model("gf_unbatched_conv", UnbatchedConv(), inputs)


class UnbatchedMha(nn.Module):
    def __init__(self, batch_first, kdim, weights, average, mask):
        super().__init__()
        torch.manual_seed(25)
        self.mha = nn.MultiheadAttention(8, 2, batch_first=batch_first, kdim=kdim, vdim=kdim)
        self.weights, self.average, self.mask = weights, average, mask

    def forward(self, x, y, pad):
        causal = torch.triu(torch.ones(x.shape[0], y.shape[0]), 1).bool() if self.mask else None
        out = self.mha(
            x,
            y,
            y,
            key_padding_mask=pad.bool(),
            attn_mask=causal,
            need_weights=self.weights,
            average_attn_weights=self.average,
        )
        return out if self.weights else out[0]


@pytest.mark.parametrize(
    "batch_first,kdim,weights,average,mask",
    [
        (False, None, False, True, False),
        (True, 6, True, True, True),
        (False, 6, True, False, False),
        (True, None, True, False, True),
    ],
)
def test_unbatched_multihead_attention(tmp_path, batch_first, kdim, weights, average, mask):
    import contextlib
    import io
    import os

    import pnnx
    from helpers import compare_with_torch

    model = UnbatchedMha(batch_first, kdim, weights, average, mask).eval()
    pad = torch.zeros(7, dtype=torch.uint8)
    pad[[2, 5]] = 1  # pnnx's exporter cannot take bool graph inputs; the mask becomes bool inside
    inputs = (torch.randn(5, 8, generator=g(26)), torch.randn(7, kdim or 8, generator=g(27)), pad)
    cwd = os.getcwd()
    try:  # torch's own trace check rejects the unbatched module's trace, pnnx's export does not need it
        os.chdir(tmp_path)
        with torch.no_grad(), contextlib.redirect_stdout(io.StringIO()):
            pnnx.export(model, str(tmp_path / "model.pt"), inputs, check_trace=False)
    finally:
        os.chdir(cwd)
    assert "nn.MultiheadAttention" in (tmp_path / "model.pnnx.param").read_text()
    compare_with_torch(str(tmp_path / "model"), model, inputs, tmp_path / "model.pmx")


class ExpandLike(nn.Module):
    def forward(self, x, y):
        return x.expand_as(y) * 2, x.expand(y.size()) + 1, x.expand(y.size(0), -1, y.size(2)) - 1


def test_expand_to_another_tensors_size(check_model):
    check_model(
        "gf_expand_like", ExpandLike(), (torch.randn(1, 3, 1, generator=g(28)), torch.randn(2, 3, 4, generator=g(29)))
    )


class BoolLists(nn.Module):
    def forward(self, x, z):
        return x[[True, False, True]], z[[True, False], [False, False, True, False]], x[:, [False] * 6]


def test_constant_bool_index_lists(check_model):
    check_model(
        "gf_bool_lists", BoolLists(), (torch.randn(3, 6, generator=g(30)), torch.randn(2, 4, 5, generator=g(31)))
    )


class BoolMask(nn.Module):
    def forward(self, x, m):
        return x[m.bool()] * 2


def test_bool_mask_index_is_refused_naming_the_node(exporter, tmp_path):
    """x[mask] with a mask known at run time only has a data-dependent size: refused at
    compile time, naming the node and its .param line."""
    from pmx.compiler.driver import compile_model
    from pmx.runtime.errors import PmxCompileError

    prefix = exporter("gf_bool_mask", BoolMask(), (torch.randn(3, 4), (torch.rand(3, 4) > 0.5).to(torch.uint8)))
    with open(prefix + ".pnnx.param") as f:
        lines = f.read().splitlines()
    line = next(i for i, text in enumerate(lines, 1) if text.startswith("Tensor.index "))
    name = lines[line - 1].split()[1]
    with pytest.raises(PmxCompileError) as info:
        compile_model(prefix + ".pnnx.param", prefix + ".pnnx.bin", str(tmp_path / "m.pmx"))
    msg = str(info.value)
    assert f"'{name}'" in msg and f"line {line}" in msg and "data-dependent" in msg, msg


def test_expand_follows_another_tensor_in_a_dynamic_export(tmp_path):
    """Exported with dynamic dims, pnnx writes x.expand(y.size()) as Tensor.expand reading a
    size list `[size(@0,0),3,size(@0,2)]` of y, and expand_as with y as an operand: the
    expanded size follows y at run time."""
    import contextlib
    import io
    import os

    import numpy as np
    import pnnx

    from pmx.compiler.driver import compile_model
    from pmx.runtime import InferenceSession

    model = ExpandLike().eval()
    x = torch.randn(1, 3, 1, generator=g(32))
    cwd = os.getcwd()
    try:
        os.chdir(tmp_path)
        with torch.no_grad(), contextlib.redirect_stdout(io.StringIO()):
            pnnx.export(model, str(tmp_path / "m.pt"), (x, torch.randn(2, 3, 4)), (x, torch.randn(5, 3, 6)))
    finally:
        os.chdir(cwd)
    text = (tmp_path / "m.pnnx.param").read_text()
    assert "size(@0,0)" in text and "Tensor.expand_as" in text and "(?,3,?)" in text
    compile_model(
        str(tmp_path / "m.pnnx.param"),
        str(tmp_path / "m.pnnx.bin"),
        str(tmp_path / "m.pmx"),
        verify=True,
        plan_shapes={"in1": (2, 3, 4)},
        dynamic={"in1": {0: (1, 16), 2: (1, 16)}},
    )
    sess = InferenceSession(str(tmp_path / "m.pmx"))
    for shape in ((2, 3, 4), (5, 3, 7), (1, 3, 1)):
        y = torch.randn(shape, generator=g(33))
        got = sess.run(None, {"in0": x.numpy(), "in1": y.numpy()})
        with torch.no_grad():
            want = model(x, y)
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b.numpy(), rtol=1e-6, atol=1e-6)


class NoNodes(nn.Module):
    """pnnx writes no operator at all for identities and constant results."""

    def forward(self, x):
        return F.dropout(x, training=False), x.clone(), torch.ones(2, 5)


def test_model_without_nodes(check_model):
    check_model("gf_no_nodes", NoNodes(), (torch.randn(2, 3, generator=g(34)),))


def test_expand_output_shape_from_its_sizes_when_pnnx_left_it_out(tmp_path):
    """pnnx leaves some outputs without a shape (a transformers attention mask's expand);
    expand's shape follows from its sizes (-1 keeps the input's dim), as torch's does."""
    import zipfile

    import torch

    from pmx.compiler.driver import compile_model
    from pmx.runtime import InferenceSession

    param = tmp_path / "m.pnnx.param"
    param.write_text(
        "7767517\n3 2\n"
        "pnnx.Input in0 0 1 0 #0=(2,1,5,5)f32\n"
        "Tensor.expand e 1 1 0 1 sizes=(3,2,4,-1,5)\n"
        "pnnx.Output out0 1 0 1\n"
    )
    with zipfile.ZipFile(tmp_path / "m.pnnx.bin", "w"):
        pass
    compile_model(str(param), str(tmp_path / "m.pnnx.bin"), str(tmp_path / "m.pmx"), auto_batch=False)
    x = np.random.default_rng(0).standard_normal((2, 1, 5, 5)).astype(np.float32)
    (got,) = InferenceSession(str(tmp_path / "m.pmx")).run(None, {"in0": x})
    np.testing.assert_array_equal(got, torch.from_numpy(x).expand(3, 2, 4, -1, 5).numpy())
