"""Each optimizing pass: outputs with and without it agree with torch on models where it
fires (and it does fire), and it does not fire where it must not."""

import weakref

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from pmx.compiler import pnnx
from pmx.compiler.driver import compile_graph
from pmx.compiler.ir import Graph, Node, Value
from pmx.compiler.options import CompileOptions
from pmx.compiler.plan import PassContext
from pmx.compiler.write import write
from pmx.runtime import InferenceSession
from pmx.runtime import expr as E


def text(node):
    """A node's expression as text, for readable assertions (nodes hold trees)."""
    return E.to_text(node.expr) if node.expr else ""


def tree(source):
    return E.parse(source)


def randomize_bn(module, seed=0):
    g = torch.Generator().manual_seed(seed)
    for m in module.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.5)
            m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
            m.weight.data.copy_(torch.randn(m.num_features, generator=g))
            m.bias.data.copy_(torch.randn(m.num_features, generator=g))
    return module.eval()


# graph -> (its Plan, the CompileOptions it was compiled with), for graphs compiled here
PLANS = weakref.WeakKeyDictionary()


def compile_here(graph, **kwargs):
    options = CompileOptions(verify=True, **kwargs)
    PLANS[graph] = (compile_graph(graph, options), options)
    return graph


def plan_of(graph):
    return PLANS[graph][0]


def write_compiled(graph, path):
    write(graph, *PLANS[graph], str(path))


def compiled(exporter, name, module, inputs, **kwargs):
    """The planned graph of a pnnx export (not written); plan_of(graph) is its Plan."""
    prefix = exporter(name, module, inputs)
    return compile_here(pnnx.load(prefix + ".pnnx.param", prefix + ".pnnx.bin"), **kwargs)


def ops(graph):
    return [n.op for n in graph.nodes]


def check_with_and_without(check_model, exporter, name, module, inputs, pass_name, also_disabled=()):
    """Both compiles match torch; returns (graph with the pass, graph without);
    `also_disabled` passes are off in both."""
    also = list(also_disabled)
    check_model(name, module, inputs, disabled=also)
    check_model(name, module, inputs, disabled=[pass_name] + also)
    return (
        compiled(exporter, name, module, inputs, disabled=also),
        compiled(exporter, name, module, inputs, disabled=[pass_name] + also),
    )


def make(cls):
    """A fresh instance with fixed initial weights: exports are cached by name, so every
    instance compared against one must be the same model."""
    torch.manual_seed(0)
    return cls().eval()


def _rand(*shape, seed=0):
    return (torch.rand(*shape, generator=torch.Generator().manual_seed(seed)) * 2 - 1,)


# --- fuse_conv_batchnorm -------------------------------------------------------------
# pnnx folds conv+bn itself when they are adjacent; a dropout between them (removed only
# by pmx's canonicalization) leaves the pair to pmx.


class ConvDropBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(4, 8, 3, padding=1)
        self.b1 = nn.BatchNorm2d(8)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1, groups=2, bias=False)
        self.b2 = nn.BatchNorm2d(8)
        self.c3 = nn.Conv1d(8, 6, 3)
        self.b3 = nn.BatchNorm1d(6)
        self.fc = nn.Linear(6, 5)
        self.b4 = nn.BatchNorm1d(5)
        self.d = nn.Dropout(0.3)

    def forward(self, x):
        y = F.relu(self.b1(self.d(self.c1(x))))
        y = self.b2(self.d(self.c2(y)))
        z = self.b3(self.d(self.c3(y.flatten(2))))
        return self.b4(self.d(self.fc(z.mean(-1))))


class ConvBNSecondReader(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(3, 6, 3)
        self.bn = nn.BatchNorm2d(6)
        self.fc = nn.Linear(4, 5)
        self.bn1 = nn.BatchNorm1d(3)
        self.d = nn.Dropout(0.1)

    def forward(self, x, s):
        y = self.c(x)
        # linear on rank 3: BatchNorm1d's channel axis (1) is not the feature axis
        return self.bn(self.d(y)) + y, self.bn1(self.d(self.fc(s)))


def test_fuse_conv_batchnorm_fires(check_model, exporter):
    m = randomize_bn(make(ConvDropBN))
    x = _rand(2, 4, 6, 6)
    # batch_norm_as_elementwise off: the batch_norm nodes fuse_conv_batchnorm leaves stay countable
    with_, without = check_with_and_without(
        check_model,
        exporter,
        "passes_conv_drop_bn",
        m,
        x,
        "fuse_conv_batchnorm",
        also_disabled=["batch_norm_as_elementwise"],
    )
    assert ops(without).count("batch_norm") == 4
    assert "batch_norm" not in ops(with_)


def test_fuse_conv_batchnorm_folds_in_float64():
    w = np.random.default_rng(0).standard_normal((4, 3, 1, 1)).astype(np.float32)
    scale = np.array([1e4, 1e-4, 3.0, -2.0], np.float32)
    shift = np.array([0.5, -1.0, 0.0, 2.0], np.float32)
    g = Graph("t")
    x = Value("x", (1, 3, 2, 2))
    y, z = Value("y", (1, 4, 2, 2)), Value("z", (1, 4, 2, 2))
    g.inputs = [x]
    g.add_node(
        Node(
            "conv",
            "c",
            [x, Value("w", w.shape, data=w)],
            [y],
            dict(stride=(1, 1), pads=(0, 0, 0, 0), dilation=(1, 1), groups=1),
        )
    )
    g.add_node(Node("batch_norm", "bn", [y, Value("s", (4,), data=scale), Value("t", (4,), data=shift)], [z]))
    g.outputs = [z]
    compile_here(g)
    (conv,) = g.nodes
    want_w = (w.astype(np.float64) * scale.astype(np.float64)[:, None, None, None]).astype(np.float32)
    np.testing.assert_array_equal(conv.inputs[1].data, want_w)
    np.testing.assert_array_equal(conv.inputs[2].data, shift)
    assert conv.inputs[1].dtype == "float32" and conv.outputs[0] is z


def test_fuse_conv_batchnorm_not_with_second_reader(check_model, exporter):
    m = randomize_bn(make(ConvBNSecondReader))
    inputs = (_rand(1, 3, 7, 7)[0], _rand(2, 3, 4, seed=1)[0])
    g, _ = check_with_and_without(
        check_model,
        exporter,
        "passes_conv_bn_second_reader",
        m,
        inputs,
        "fuse_conv_batchnorm",
        also_disabled=["batch_norm_as_elementwise"],
    )
    assert ops(g).count("batch_norm") == 2


# --- batch_norm_as_elementwise -----------------------------------------------------------


class PreActBN(nn.Module):
    """DenseNet's BN -> ReLU -> conv on a concat (no conv before the BN to fold into), and
    BatchNorm1d on rank 2 and rank 3 inputs."""

    def __init__(self):
        super().__init__()
        self.c0 = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(7)
        self.c1 = nn.Conv2d(7, 5, 1)
        self.bn2 = nn.BatchNorm1d(5)
        self.bn3 = nn.BatchNorm1d(3)

    def forward(self, x, s):
        y = self.c1(F.relu(self.bn(torch.cat([x, self.c0(x)], 1))))
        return self.bn2(y.mean((2, 3))), self.bn3(s)


def test_batch_norm_as_elementwise_fuses_with_relu(check_model, exporter):
    m = randomize_bn(make(PreActBN))
    inputs = (_rand(2, 3, 6, 6)[0], _rand(2, 3, 4, seed=1)[0])
    # fold_affine_relu (tested below) would turn the fused BN -> ReLU into max(x, t)
    with_, without = check_with_and_without(
        check_model,
        exporter,
        "passes_preact_bn",
        m,
        inputs,
        "batch_norm_as_elementwise",
        also_disabled=("fold_affine_relu",),
    )
    assert ops(without).count("batch_norm") == 3
    assert "batch_norm" not in ops(with_)
    exprs = [text(n) for n in with_.nodes if n.op == "elementwise"]
    # the 2-d BN and its ReLU are one node; the BN1d nodes are affine expressions
    assert any("maximum" in e and "mul" in e and "add" in e for e in exprs), exprs
    assert sum("mul" in e and "add" in e for e in exprs) == 3, exprs


# --- negate_silu_weights ---------------------------------------------------------------


class SiluGemms(nn.Module):
    """SiLU after an im2col conv, a depthwise conv, a Winograd-sized 3x3 conv and a linear
    layer (with and without bias), with sigmoid and hardswish epilogues that must stay."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 64, 3, stride=2, padding=1)
        self.dw = nn.Conv2d(64, 64, 5, padding=2, groups=64)
        self.wide = nn.Conv2d(64, 32, 3, padding=1, bias=False)  # Winograd: 64 channels, 6x6 tiles
        self.gate = nn.Conv2d(32, 32, 1)
        self.hs = nn.Conv2d(32, 8, 1)
        self.fc = nn.Linear(8, 12)
        self.fc2 = nn.Linear(12, 6, bias=False)

    def forward(self, x):
        y = F.silu(self.wide(F.silu(self.dw(F.silu(self.stem(x))))))
        y = F.hardswish(self.hs(y * torch.sigmoid(self.gate(y.mean((2, 3), keepdim=True)))))
        return F.silu(self.fc2(F.silu(self.fc(y.mean((2, 3))))))


def test_negate_silu_weights_is_bit_identical(check_model, exporter, tmp_path):
    """Every SiLU epilogue of a conv or linear runs over the negated product, in three
    numpy passes, and the outputs equal those of the unrewritten model bit for bit (and
    both match torch)."""
    m = make(SiluGemms)
    inputs = (_rand(2, 3, 24, 24)[0] * 4,)
    with_, without = check_with_and_without(check_model, exporter, "passes_silu", m, inputs, "negate_silu_weights")
    negated = [n for n in with_.nodes if text(n) == "div(@0,sub(-1,exp(@0)))"]
    assert len(negated) == 5, [(n.op, text(n)) for n in with_.nodes]
    assert not any(text(n) == "div(@0,sub(-1,exp(@0)))" for n in without.nodes)
    assert sorted(n.op + ":" + n.variant.split("_")[0] for n in negated) == [
        "conv:depthwise",
        "conv:gemm",
        "conv_winograd:winograd",
        "linear:",
        "linear:",
    ]
    assert {text(n) for n in with_.nodes if n.op.startswith("conv") and n not in negated} == {
        "sigmoid(@0)",
        "mul(@0,div(minimum(maximum(add(@0,3),0),6),6))",
    }
    originals = {n.name: n for n in without.nodes}
    for n in negated:
        for mine, theirs in zip(n.inputs[1:3], originals[n.name].inputs[1:3]):
            if theirs is not None:
                np.testing.assert_array_equal(np.asarray(mine.data), -np.asarray(theirs.data))
    feed = {"in0": inputs[0].numpy()}
    outs = []
    for g in (with_, without):
        path = tmp_path / f"{len(outs)}.pmx"
        write_compiled(g, path)
        outs.append(InferenceSession(str(path)).run(None, feed)[0])
    np.testing.assert_array_equal(outs[0].view(np.int32), outs[1].view(np.int32))


def test_negate_silu_weights_leaves_shared_weights():
    """A weight another node also reads is not negated (the file would hold it twice)."""
    from pmx.compiler.passes.negate_silu_weights import negate_silu_weights

    g = Graph("t")
    x, y, z = Value("x", (1, 4)), Value("y", (1, 4)), Value("z", (1, 4))
    w = Value("w", (4, 4), data=np.eye(4, dtype=np.float32))
    g.inputs = [x]
    g.add_node(Node("linear", "a", [x, w], [y], expr=tree("mul(@0,sigmoid(@0))")))
    g.add_node(Node("linear", "b", [y, w], [z]))
    g.outputs = [z]
    negate_silu_weights(g, PassContext())
    assert text(g.nodes[0]) == "mul(@0,sigmoid(@0))" and g.nodes[0].inputs[1] is w


# --- fold_affine_relu ------------------------------------------------------------------


class PreActReaders(nn.Module):
    """Pre-activation BN -> ReLU on a concat (nothing to fold the BN into) read by: a 1x1
    conv and a strided 1x1 conv without bias (all scales positive), an unpadded 3x3 conv
    (scales of both signs), and on pooled (N, C) tensors a linear layer (positive) and a
    matmul with a constant (both signs; pnnx makes it a linear): all fold. Not folded:
    one read by a padded conv, one that is also a graph output, one with a zero scale,
    one that a pool also reads, one read by a group norm (constant weights at input 1,
    but not a conv or linear)."""

    def __init__(self):
        super().__init__()
        self.c0 = nn.Conv2d(3, 5, 3, padding=1)
        self.bn_pos, self.pos_1x1, self.pos_strided = (
            nn.BatchNorm2d(8),
            nn.Conv2d(8, 6, 1),
            nn.Conv2d(8, 4, 1, 2, bias=False),
        )
        self.bn_mixed, self.mixed_3x3 = nn.BatchNorm2d(8), nn.Conv2d(8, 4, 3)
        self.bn_1d, self.fc = nn.BatchNorm1d(8), nn.Linear(8, 3)
        self.bn_padded, self.padded = nn.BatchNorm2d(8), nn.Conv2d(8, 4, 3, padding=1)
        self.bn_out, self.out_1x1 = nn.BatchNorm2d(8), nn.Conv2d(8, 4, 1)
        self.bn_zero, self.zero_1x1 = nn.BatchNorm2d(8), nn.Conv2d(8, 4, 1)
        self.bn_pooled, self.pooled_1x1 = nn.BatchNorm2d(8), nn.Conv2d(8, 4, 1)
        self.bn_matmul, self.matmul_weight = nn.BatchNorm1d(8), nn.Parameter(torch.randn(8, 3))
        self.bn_gn, self.gn = nn.BatchNorm2d(8), nn.GroupNorm(2, 8)

    def forward(self, x):
        z = torch.cat([x, self.c0(x)], 1)
        pos = F.relu(self.bn_pos(z))
        shown = F.relu(self.bn_out(z))
        pooled = F.relu(self.bn_pooled(z))
        return (
            self.pos_1x1(pos),
            self.pos_strided(pos),
            self.mixed_3x3(F.relu(self.bn_mixed(z))),
            self.fc(F.relu(self.bn_1d(z.mean((2, 3))))),
            self.padded(F.relu(self.bn_padded(z))),
            shown,
            self.out_1x1(shown),
            self.zero_1x1(F.relu(self.bn_zero(z))),
            self.pooled_1x1(pooled) + F.adaptive_avg_pool2d(pooled, 1)[:, :4],
            torch.matmul(F.relu(self.bn_matmul(z.amax((2, 3)))), self.matmul_weight),
            self.gn(F.relu(self.bn_gn(z))),
        )


def _preact_readers():
    m = randomize_bn(make(PreActReaders))
    with torch.no_grad():
        m.bn_pos.weight.abs_().add_(0.1)
        m.bn_1d.weight.abs_().add_(0.1)
        m.bn_mixed.weight.copy_(torch.tensor([1.0, -0.5, 2.0, -1.5, 0.7, -0.2, 0.3, -2.0]))
        m.bn_zero.weight[2] = 0.0
    return m


def _bn_scale_shift(bn):
    """The BN's per-channel scale and shift, in float64 from torch's parameters."""
    with torch.no_grad():
        s = bn.weight.double() / torch.sqrt(bn.running_var.double() + bn.eps)
        return s.numpy(), (bn.bias.double() - bn.running_mean.double() * s).numpy()


def test_fold_affine_relu_moves_scale_and_shift_into_the_readers(check_model, exporter):
    """Where a pre-activation BN -> ReLU is read only by unpadded convs (or a linear on
    (N, C)), the expression becomes max(x, t) (or max(x * sign, t * sign) with negative
    scales) and the readers' weights and biases are W |s| and b + W . shift, checked
    against torch's BN parameters; both compiles match torch."""
    from pmx.compiler.passes.batch_norm_as_elementwise import EXPR
    from pmx.compiler.passes.fold_affine_relu import FOLDED, FOLDED_SIGNED

    m = _preact_readers()
    inputs = (_rand(2, 3, 9, 9)[0] * 3,)
    with_, without = check_with_and_without(check_model, exporter, "passes_affine_relu", m, inputs, "fold_affine_relu")
    exprs = lambda g: sorted(text(n) for n in g.nodes if n.op == "elementwise" and "maximum" in text(n))
    affine_relu = E.to_text(E.call("maximum", EXPR, 0))
    folded, signed = E.to_text(FOLDED), E.to_text(FOLDED_SIGNED)
    assert exprs(without) == [affine_relu] * 9, exprs(without)
    assert exprs(with_) == sorted([folded] * 2 + [signed] * 2 + [affine_relu] * 5), exprs(with_)
    before = {n.name: n for n in without.nodes}
    readers = {"pos_1x1": m.bn_pos, "pos_strided": m.bn_pos, "mixed_3x3": m.bn_mixed, "fc": m.bn_1d}
    checked = 0
    for n in with_.nodes:
        name = next((k for k in readers if n.name.endswith(k)), None)
        if name is None or n.op not in ("conv", "linear"):
            continue
        s, shift = _bn_scale_shift(readers[name])
        w = np.asarray(before[n.name].inputs[1].data, np.float64)
        along = (1, -1) + (1,) * (w.ndim - 2)
        np.testing.assert_allclose(
            np.asarray(n.inputs[1].data, np.float64), w * np.abs(s).reshape(along), rtol=1e-6, atol=1e-7
        )
        old_bias = before[n.name].inputs[2] if len(before[n.name].inputs) > 2 else None
        bias = (0.0 if old_bias is None else np.asarray(old_bias.data, np.float64)) + (w * shift.reshape(along)).sum(
            axis=tuple(range(1, w.ndim))
        )
        np.testing.assert_allclose(np.asarray(n.inputs[2].data, np.float64), bias, rtol=1e-5, atol=1e-6)
        checked += 1
    assert checked == 4


def shared_weight_graph(first, shared):
    """x -> `first` (a node factory: first(x, y) -> Node writing y) -> linear a (weights
    w); linear c reads another input with w too when `shared`, else with its own."""
    g = Graph("t")
    x, y, z, u, v = (Value(n, (2, 4), "float32") for n in "xyzuv")
    w = Value("w", (4, 4), "float32", data=np.eye(4, dtype=np.float32))
    other = Value("o", (4, 4), "float32", data=np.eye(4, dtype=np.float32))
    g.inputs = [x, u]
    g.add_node(first(x, y))
    g.add_node(Node("linear", "a", [y, w], [z]))
    g.add_node(Node("linear", "c", [u, w if shared else other], [v]))
    g.outputs = [z, v]
    return g


def test_fold_affine_relu_leaves_shared_weights():
    """A reader whose weights another node also reads keeps them, and the expression
    stays; the unshared case folds."""
    from pmx.compiler.passes.batch_norm_as_elementwise import EXPR
    from pmx.compiler.passes.fold_affine_relu import FOLDED, fold_affine_relu

    def bn_relu(x, y):
        scale = Value("s", (4,), "float32", data=np.full(4, 2.0, np.float32))
        shift = Value("b", (4,), "float32", data=np.ones(4, np.float32))
        return Node("elementwise", "bnrelu", [x, scale, shift], [y], expr=E.call("maximum", EXPR, 0))

    g = shared_weight_graph(bn_relu, shared=True)
    fold_affine_relu(g, PassContext())
    assert g.nodes[0].expr == E.call("maximum", EXPR, 0) and g.nodes[1].inputs[1].name == "w"
    g = shared_weight_graph(bn_relu, shared=False)
    fold_affine_relu(g, PassContext())
    assert g.nodes[0].expr == FOLDED
    np.testing.assert_array_equal(np.asarray(g.nodes[0].inputs[1].data), np.full(4, -0.5, np.float32))
    np.testing.assert_array_equal(np.asarray(g.nodes[1].inputs[1].data), 2 * np.eye(4, dtype=np.float32))
    np.testing.assert_array_equal(np.asarray(g.nodes[1].inputs[2].data), np.ones(4, np.float32))


# --- pool_before_pointwise -------------------------------------------------------------


class PooledPointwise(nn.Module):
    """Average pools after 1x1 convs. Move before the conv: DenseNet's transition (BN ->
    ReLU -> 1x1 conv -> 2x2 pool stride 2), a grouped 1x1 conv without bias before a
    3x3 pool stride 2 in ceil mode (partial windows), and a 1-d 1x1 conv before a 1-d
    pool. Stay: a padded pool counting the padding, a pool with a divisor override, a
    1x1 conv with a ReLU, a 3x3 conv, a strided 1x1 conv, a padded 1x1 conv, and a 1x1
    conv whose output is also a graph output."""

    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm2d(8)
        self.transition = nn.Conv2d(8, 6, 1)
        self.grouped = nn.Conv2d(8, 4, 1, groups=2, bias=False)
        self.line = nn.Conv1d(8, 5, 1)
        self.padded = nn.Conv2d(8, 3, 1)
        self.divided = nn.Conv2d(8, 3, 1)
        self.activated = nn.Conv2d(8, 3, 1)
        self.wide = nn.Conv2d(8, 3, 3)
        self.strided = nn.Conv2d(8, 3, 1, stride=2)
        self.padded_conv = nn.Conv2d(8, 3, 1, padding=1)
        self.shown = nn.Conv2d(8, 3, 1)

    def forward(self, x):
        y = F.relu(self.bn(x))
        shown = self.shown(x)
        return (
            F.avg_pool2d(self.transition(y), 2),
            F.avg_pool2d(self.grouped(x), 3, 2, ceil_mode=True),
            F.avg_pool1d(self.line(x.mean(2)), 2),
            F.avg_pool2d(self.padded(x), 3, 2, padding=1),
            F.avg_pool2d(self.divided(x), 2, divisor_override=3),
            F.avg_pool2d(F.relu(self.activated(x)), 2),
            F.avg_pool2d(self.wide(x), 2),
            F.avg_pool2d(self.strided(x), 2),
            F.avg_pool2d(self.padded_conv(x), 2),
            shown,
            F.avg_pool2d(shown, 2),
        )


def test_pool_before_pointwise_pools_the_conv_input(check_model, exporter):
    """Where an unpadded average pool is a 1x1 conv's only reader, the pool reads the
    conv's input and the conv the pool's output (shapes and order follow); both
    compiles match torch."""
    m = randomize_bn(make(PooledPointwise))
    inputs = (_rand(2, 8, 11, 9)[0] * 2,)
    with_, without = check_with_and_without(
        check_model, exporter, "passes_pool_pointwise", m, inputs, "pool_before_pointwise"
    )

    def moved(graph):
        return [n for n in graph.nodes if n.op == "avg_pool" and any(c.op == "conv" for c in n.outputs[0].consumers)]

    assert moved(without) == []
    assert len(moved(with_)) == 3, [n.name for n in moved(with_)]
    for pool in moved(with_):
        (conv,) = pool.outputs[0].consumers
        assert with_.nodes.index(pool) < with_.nodes.index(conv)
        assert pool.outputs[0].shape[:2] == pool.inputs[0].shape[:2]
        assert conv.outputs[0].shape[2:] == pool.outputs[0].shape[2:]
    assert sum(n.op == "avg_pool" for n in with_.nodes) == sum(n.op == "avg_pool" for n in without.nodes) == 10


# --- fuse_activation -------------------------------------------------------------------


class GemmActs(nn.Module):
    def __init__(self):
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(4, 4, 3, padding=1, groups=g) for g in (1, 4, 1, 2, 1, 1, 4))
        self.fc1 = nn.Linear(16, 16)
        self.fc2 = nn.Linear(16, 16)
        self.fc3 = nn.Linear(16, 8)

    def forward(self, x, m):
        acts = [F.relu, F.relu6, lambda t: F.leaky_relu(t, 0.1), torch.sigmoid, F.silu, F.hardswish, F.hardsigmoid]
        for conv, act in zip(self.convs, acts):
            x = act(conv(x))
        x = torch.clamp(x, -0.5, 0.5)  # stays separate: the conv already took hardsigmoid, clamp chains on
        h = F.gelu(self.fc1(m))
        h = torch.tanh(self.fc2(h))
        h = F.gelu(self.fc3(h), approximate="tanh")
        return x, torch.tanh(torch.matmul(h, h.transpose(-1, -2)))


class GemmActNotFused(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(3, 4, 1)
        self.c2 = nn.Conv2d(4, 4, 1)

    def forward(self, x):
        y = self.c(x)
        z = self.c2(y)
        return F.relu(y) + 1, y * z, torch.sigmoid(z)  # y read twice; z also a graph output? no: z read twice


def test_fuse_activation_fires(check_model, exporter):
    m = make(GemmActs)
    inputs = (_rand(1, 4, 6, 6)[0], _rand(2, 5, 16, seed=1)[0])
    g, without = check_with_and_without(check_model, exporter, "passes_gemm_acts", m, inputs, "fuse_activation")
    gemms = [n for n in g.nodes if n.op in ("conv", "linear", "matmul")]
    assert len(gemms) == 11 and all(n.expr for n in gemms), [(n.op, text(n)) for n in gemms]
    assert "clamp" not in "".join(text(n) for n in gemms)
    assert len(without.nodes) > len(g.nodes)


def test_fuse_activation_not_with_second_reader(check_model, exporter):
    m = make(GemmActNotFused)
    g, _ = check_with_and_without(check_model, exporter, "passes_gemm_act_not", m, _rand(1, 3, 5, 5), "fuse_activation")
    assert all(not n.expr for n in g.nodes if n.op == "conv")


# --- fuse_elementwise ------------------------------------------------------------------


class EwChains(nn.Module):
    def forward(self, x, y, g):
        a = torch.tanh(x * 2.5 + 1) - torch.sigmoid(y) * 0.5  # one region over x, y
        b = torch.clamp(a, -0.7, 0.7) * x  # continues the region
        s = torch.sigmoid(g) * 3  # (1, C, 1, 1) gate: stays its own node (small tensor)
        c = b * s
        d = torch.exp(c)  # read twice: region boundary
        return d + 1, d * 2, (x > 0).float() * y


def test_fuse_elementwise_fires(check_model, exporter):
    inputs = (_rand(1, 4, 5, 6)[0], _rand(1, 4, 5, 6, seed=1)[0], _rand(1, 4, 1, 1, seed=2)[0])
    g, without = check_with_and_without(
        check_model, exporter, "passes_ew_chains", make(EwChains), inputs, "fuse_elementwise"
    )
    ew = [n for n in g.nodes if n.op == "elementwise"]
    assert len(without.nodes) - len(g.nodes) >= 5
    # the gate region (small) and the d region (two readers) stay separate
    gate = [n for n in ew if n.outputs[0].shape == (1, 4, 1, 1)]
    assert len(gate) == 1
    assert all(v.dtype == "float32" for n in ew for v in n.outputs if "gt(" not in text(n))


def test_fused_expression_stays_float32(check_model, exporter):
    _, got, _ = check_model(
        "passes_ew_chains",
        make(EwChains),
        (_rand(1, 4, 5, 6)[0], _rand(1, 4, 5, 6, seed=1)[0], _rand(1, 4, 1, 1, seed=2)[0]),
    )
    assert all(a.dtype == np.float32 for a in got)


# --- alias_views, alias_concat, write_inplace -------------------------------------------


class Fire(nn.Module):
    """SqueezeNet fire module + Inception-style cat + reshape views."""

    def __init__(self):
        super().__init__()
        self.squeeze = nn.Conv2d(8, 4, 1)
        self.e1 = nn.Conv2d(4, 6, 1)
        self.e3 = nn.Conv2d(4, 6, 3, padding=1)
        self.b = nn.Conv2d(12, 4, 1)

    def forward(self, x):
        s = F.relu(self.squeeze(x))
        y = torch.cat([F.relu(self.e1(s)), F.relu(self.e3(s))], 1)
        z = torch.cat([y, self.b(y) * 2], 1)
        return z.flatten(1).view(z.shape[0], -1, 2) + 1


def aliases_by_op(graph):
    """{op of the aliased tensor's producer: count}"""
    out = {}
    aliases = plan_of(graph).aliases
    for v in graph.values():
        if v.uid in aliases and v.producer is not None:
            out[v.producer.op] = out.get(v.producer.op, 0) + 1
    return out


def test_alias_concat_fires(check_model, exporter):
    g, without = check_with_and_without(
        check_model, exporter, "passes_fire_b1", make(Fire), _rand(1, 8, 5, 5), "alias_concat"
    )
    concat_inputs = [v for n in g.nodes if n.op == "concat" for v in n.inputs]
    assert len(concat_inputs) == 4 and all(v.uid in plan_of(g).aliases for v in concat_inputs)
    assert plan_of(g).arena_size < plan_of(without).arena_size
    sess, _, _ = check_model("passes_fire_b1", make(Fire), _rand(1, 8, 5, 5))
    binding = sess._binding()
    concat_steps = [s for n, s in zip(sess.model.nodes, binding.steps) if n.op == "concat"]
    assert concat_steps == [None, None]  # no copy left at run time


class DenseBlock(nn.Module):
    """torchvision DenseNet's pattern: layer k reads cat([x0, .., xk-1])."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Conv2d(4 + 3 * i, 3, 3, padding=1) for i in range(4))

    def forward(self, x):
        feats = [F.relu(x)]
        for layer in self.layers:
            feats.append(torch.tanh(layer(torch.cat(feats, 1))))
        return torch.cat(feats, 1).mean((2, 3))


def test_alias_concat_dense_block_copies_nothing(check_model, exporter):
    g, without = check_with_and_without(
        check_model, exporter, "passes_dense_block", make(DenseBlock), _rand(1, 4, 6, 6), "alias_concat"
    )
    concats = [n for n in g.nodes if n.op == "concat"]
    assert len(concats) == 4  # pnnx drops the cat of one tensor
    assert all(n.outputs[0].uid in plan_of(g).aliases for n in concats[:-1])  # each a prefix of the next
    sess, _, _ = check_model("passes_dense_block", make(DenseBlock), _rand(1, 4, 6, 6))
    steps = sess._binding().steps
    assert all(s is None for n, s in zip(sess.model.nodes, steps) if n.op == "concat")
    assert plan_of(g).arena_size < plan_of(without).arena_size


def test_alias_concat_not_for_strided_slices(check_model, exporter):
    # batch 2: each input's slice of the cat output has gaps -> copied
    g, _ = check_with_and_without(
        check_model, exporter, "passes_fire_b2", make(Fire), _rand(2, 8, 5, 5), "alias_concat"
    )
    assert all(v.uid not in plan_of(g).aliases for n in g.nodes if n.op == "concat" for v in n.inputs)


class CatOfOutput(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(3, 4, 1)

    def forward(self, x):
        a = self.c(x)
        b = a * 2
        return torch.cat([a, b, b], 1), a, torch.cat([x, b], 1)


def test_alias_concat_not_for_outputs_inputs_or_repeats(check_model, exporter):
    g, _ = check_with_and_without(
        check_model, exporter, "passes_cat_of_output", make(CatOfOutput), _rand(1, 3, 4, 4), "alias_concat"
    )
    a = g.outputs[1]
    x = g.inputs[0]
    aliases = plan_of(g).aliases
    assert a.uid not in aliases and x.uid not in aliases
    for n in g.nodes:
        if n.op == "concat":
            repeated = [v for v in n.inputs if n.inputs.count(v) > 1]
            assert all(v.uid not in aliases or aliases[v.uid][0] is not n.outputs[0] for v in repeated)


def test_alias_views_fires_and_not_for_kept(check_model, exporter):
    g, without = check_with_and_without(
        check_model, exporter, "passes_fire_b1", make(Fire), _rand(1, 8, 5, 5), "alias_views"
    )
    assert aliases_by_op(g).get("reshape", 0) >= 1
    assert aliases_by_op(without).get("reshape", 0) == 0
    # keep the tensor a reshape reads: that reshape copies, and the kept tensor is exact
    cat_out = [n for n in g.nodes if n.op == "concat"][-1].outputs[0].name
    gk = compiled(exporter, "passes_fire_b1", make(Fire), _rand(1, 8, 5, 5), keep=[cat_out])
    kept = gk.kept[0]
    assert all(c.outputs[0].uid not in plan_of(gk).aliases for c in kept.consumers if c.op == "reshape")
    sess, _, _ = check_model("passes_fire_b1", make(Fire), _rand(1, 8, 5, 5), keep=[cat_out])
    m = make(Fire)
    x = _rand(1, 8, 5, 5)[0]
    with torch.no_grad():
        s = F.relu(m.squeeze(x))
        y = torch.cat([F.relu(m.e1(s)), F.relu(m.e3(s))], 1)
        want = torch.cat([y, m.b(y) * 2], 1).numpy()
    (got,) = sess.run([cat_out], {sess.get_inputs()[0].name: x.numpy()})
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


class InplaceChain(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        y = self.c(x)
        p = F.max_pool2d(y, 2)
        q = p + torch.sigmoid(p).mean((2, 3), keepdim=True)  # p dies here: written in place
        return torch.softmax(q * 3, 1), x * 2  # x is a graph input: never overwritten


def test_write_inplace_fires(check_model, exporter):
    g, without = check_with_and_without(
        check_model, exporter, "passes_inplace_chain", make(InplaceChain), _rand(1, 3, 8, 8), "write_inplace"
    )
    aliases, without_aliases = plan_of(g).aliases, plan_of(without).aliases
    inplace = [n for n in g.nodes if n.outputs[0].uid in aliases and n.op in ("elementwise", "softmax")]
    assert inplace and not any(n.outputs[0].uid in without_aliases for n in without.nodes if n.op == "elementwise")
    x = g.inputs[0]
    for n in g.nodes:
        if x in n.inputs:
            assert aliases.get(n.outputs[0].uid, (None,))[0] is not x
    assert plan_of(g).arena_size <= plan_of(without).arena_size


# --- fold_constants, eliminate_dead_code: hand-built graphs ------------------------------


def _run_graph(g, tmp_path, feed, **kwargs):
    compile_here(g, **kwargs)
    path = tmp_path / "g.pmx"
    write_compiled(g, path)
    sess = InferenceSession(str(path))
    return sess.run(None, feed), g


def _const_graph():
    g = Graph("t")
    x = Value("x", (2, 3))
    k = Value("k", (3,), data=np.array([1.0, 2.0, 3.0], np.float32))
    k2, y, dead, z = Value("k2", (3,)), Value("y", (2, 3)), Value("dead", (2, 3)), Value("z", (2, 3))
    g.inputs = [x]
    g.add_node(Node("elementwise", "fold_me", [k], [k2], expr=tree("exp(mul(@0,0.5))")))
    g.add_node(Node("elementwise", "use", [x, k2], [y], expr=tree("add(@0,@1)")))
    g.add_node(Node("elementwise", "unused", [x, k], [dead], expr=tree("mul(@0,@1)")))
    g.add_node(Node("elementwise", "out", [y], [z], expr=tree("tanh(@0)")))
    g.outputs = [z]
    return g


@pytest.mark.parametrize(
    "disabled", [[], ["fold_constants"], ["eliminate_dead_code"], ["fold_constants", "eliminate_dead_code"]]
)
def test_fold_constants_and_dce(tmp_path, disabled):
    x = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)
    (got,), g = _run_graph(_const_graph(), tmp_path, {"x": x}, disabled=disabled + ["fuse_elementwise"])
    want = np.tanh(x + np.exp(np.array([1, 2, 3], np.float32) * 0.5))
    np.testing.assert_allclose(got, want, rtol=1e-6)
    names = [n.name for n in g.nodes]
    assert ("fold_me" in names) == ("fold_constants" in disabled)
    assert ("unused" in names) == ("eliminate_dead_code" in disabled)
    if not disabled:
        consts = {v.name for n in g.nodes for v in n.inputs if v.is_constant}
        assert "k" not in consts  # only the dead node read it: not written


def test_no_opt_runs_only_required_passes(exporter):
    g = compiled(exporter, "passes_fire_b1", make(Fire), _rand(1, 8, 5, 5), no_opt=True)
    ran = [name for name, _, _ in plan_of(g).pass_stats]
    assert ran == ["canonicalize", "infer_shapes", "mark_dynamic_dims", "choose_kernels", "order", "plan_memory"]
    assert not plan_of(g).aliases


def test_order_is_deterministic(exporter):
    a = compiled(exporter, "passes_fire_b1", make(Fire), _rand(1, 8, 5, 5))
    b = compiled(exporter, "passes_fire_b1", make(Fire), _rand(1, 8, 5, 5))
    assert [n.name for n in a.nodes] == [n.name for n in b.nodes]
    pa, pb = plan_of(a), plan_of(b)
    assert pa.arena_size == pb.arena_size
    assert [pa.offsets[v.uid] for v in a.values() if v.uid in pa.offsets] == [
        pb.offsets[v.uid] for v in b.values() if v.uid in pb.offsets
    ]


# models tools/bench_memory.py adds to its table: (name, factory, inputs)
BENCH_MODELS = [
    ("conv_drop_bn", lambda: randomize_bn(make(ConvDropBN)), lambda: _rand(2, 4, 6, 6)),
    ("fire_b1", lambda: make(Fire), lambda: _rand(1, 8, 5, 5)),
    ("fire_b2", lambda: make(Fire), lambda: _rand(2, 8, 5, 5)),
    ("inplace_chain", lambda: make(InplaceChain), lambda: _rand(1, 3, 8, 8)),
    ("dense_block", lambda: make(DenseBlock), lambda: _rand(1, 4, 6, 6)),
]


# --- choose_kernels ----------------------------------------------------------------------


def _ew_node(expr, shape, n_inputs=1):
    ins = [Value(f"i{k}", shape) for k in range(n_inputs)]
    return Node("elementwise", "e", ins, [Value("o", shape)], expr=tree(expr))


@pytest.mark.parametrize(
    "expr,shape,want",
    [
        ("where(gt(@0,0),@0,mul(@0,0.1))", (1, 16, 64, 64), "numexpr"),  # where, cheap, large
        ("where(gt(@0,0),@0,mul(@0,0.1))", (1, 16, 16, 16), "numpy"),  # where, mid-size
        ("tanh(@0)", (1, 16, 64, 64), "numpy"),
        ("where(gt(@0,0),@0,expm1(@0))", (1, 16, 64, 64), "numpy"),  # transcendental
        ("mul(@0,div(minimum(maximum(add(@0,3),0),6),6))", (1, 8, 4, 4), "numexpr"),  # tiny, many ops
        ("maximum(add(@0,@1),0)", (1, 64, 56, 56), "numpy"),
        ("sign(@0)", (1, 8, 4, 4), "numpy"),  # numexpr lacks it
    ],
)
def test_choose_kernels_rule(expr, shape, want):
    from pmx.compiler.passes.choose_kernels import elementwise_variant

    assert elementwise_variant(_ew_node(expr, shape, 1 + ("@1" in expr))) == want


class BigLeaky(nn.Module):
    def forward(self, x, y):
        return F.leaky_relu(x * 2 - y, 0.2), F.hardswish(y[:, :1, :4, :4] * 3)


def test_numexpr_variant_runs_in_float32(check_model, exporter):
    inputs = (_rand(1, 16, 64, 64)[0], _rand(1, 16, 64, 64, seed=1)[0])
    sess, got, _ = check_model("passes_big_leaky", make(BigLeaky), inputs)
    variants = {n.variant for n in sess.model.nodes if n.op == "elementwise"}
    assert variants == {"numexpr"}
    assert all(g.dtype == np.float32 for g in got)


def test_graph_edits_go_through_graph_methods():
    """The node list and the producer and consumer links change only in compiler/ir.py
    (Graph's methods), so they cannot disagree with each other or with Graph.has_node,
    which the rewrite engine asks."""
    import pathlib
    import re

    compiler = pathlib.Path(__file__).resolve().parents[1] / "compiler"
    direct = re.compile(
        r"\.nodes = |\.nodes\.(append|insert|remove|pop|extend|clear)\(|\.producer = "
        r"|\.consumers\.(append|remove|insert)\(|\.consumers = "
    )
    found = [
        f"{path.relative_to(compiler)}:{n}"
        for path in compiler.rglob("*.py")
        if path.name != "ir.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if direct.search(line)
    ]
    assert found == []
