"""End-to-end: small CNN blocks written here, exported with pnnx, compiled, run, compared
with torch (max|pmx - torch| / max|torch| <= 1e-4). Batch-norm statistics are random so
folding them is really exercised.

Each case also names pnnx op types its .param must contain, so the test proves the
spelling it means to cover is really what pnnx wrote (pnnx rewrites many spellings:
F.relu may become nn.ReLU, x.view may become Tensor.reshape, ...).
"""

import re

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F


def randomize_bn(module, seed=0):
    g = torch.Generator().manual_seed(seed)
    for m in module.modules():
        if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d)):
            m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.5)
            m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
            m.weight.data.copy_(torch.randn(m.num_features, generator=g))
            m.bias.data.copy_(torch.randn(m.num_features, generator=g))
    return module.eval()


def pnnx_ops(prefix):
    """Op types in a .pnnx.param file (first column of each operator line), plus
    "expr:<fn>" for each function a pnnx.Expression calls."""
    with open(prefix + ".pnnx.param") as f:
        lines = f.read().splitlines()[2:]
    ops = {line.split()[0] for line in lines if line.strip()}
    for line in lines:
        m = re.search(r" expr=(\S+)", line)
        if m:
            ops |= {f"expr:{fn}" for fn in re.findall(r"([a-z_]+)\(", m.group(1))}
    return ops


def conv_bn(cin, cout, k=3, stride=1, groups=1, act=nn.ReLU):
    return nn.Sequential(
        nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False),
        nn.BatchNorm2d(cout),
        act() if act else nn.Identity(),
    )


# --- the blocks ---------------------------------------------------------------------------


class TinyCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.c2 = nn.Conv2d(8, 8, 3, padding="same", groups=8)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        y = F.relu(self.bn(self.c(x)))
        y = y + self.c2(y) * 0.5 - torch.sqrt(torch.abs(y))
        y = F.max_pool2d(y, 2, ceil_mode=True)
        a, b = torch.chunk(y, 2, 1)
        y = torch.cat([b, a], 1)
        y = y.view(1, 8, -1).mean(-1)
        return F.softmax(self.fc(y), -1)


class Residual(nn.Module):
    """ResNet basic block with a strided projection shortcut, then a stem-like max pool."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(4, 8, 3, stride=2, padding=(1, 1), bias=False)
        self.b1 = nn.BatchNorm2d(8)
        self.c2 = nn.Conv2d(8, 8, (3, 3), padding=1, bias=False)
        self.b2 = nn.BatchNorm2d(8)
        self.proj = nn.Sequential(nn.Conv2d(4, 8, 1, stride=2, bias=False), nn.BatchNorm2d(8))
        self.pool = nn.MaxPool2d(3, stride=2, padding=1)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2), nn.Linear(8, 5))

    def forward(self, x):
        y = F.relu(self.b1(self.c1(x)))
        y = self.b2(self.c2(y))
        y = F.relu(y + self.proj(x))
        return self.head(self.pool(y))


class DepthwiseSeparable(nn.Module):
    """MobileNetV1/V2 style: depthwise 3x3 (stride, ReLU6) + pointwise, inverted residual."""

    def __init__(self):
        super().__init__()
        self.expand = conv_bn(6, 24, 1, act=nn.ReLU6)
        self.dw = conv_bn(24, 24, 3, groups=24, act=nn.ReLU6)
        self.dw_s2 = nn.Conv2d(24, 24, 5, stride=2, padding=2, groups=24)
        self.pw = nn.Conv2d(24, 6, 1, bias=False)
        self.bn = nn.BatchNorm2d(6)

    def forward(self, x):
        y = self.dw(self.expand(x))
        r = x + self.bn(self.pw(y))
        z = F.hardtanh(self.dw_s2(y), -1.5, 2.0)
        return r, z


class SqueezeExcite(nn.Module):
    def __init__(self, c=16, r=4):
        super().__init__()
        self.conv = conv_bn(8, c, 3)
        self.fc1 = nn.Linear(c, c // r)
        self.fc2 = nn.Linear(c // r, c)

    def forward(self, x):
        y = self.conv(x)
        s = y.mean((2, 3))  # keepdim=False
        s = torch.sigmoid(self.fc2(F.relu(self.fc1(s))))
        return y * s.view(y.size(0), -1, 1, 1)


class ShuffleUnit(nn.Module):
    """ShuffleNetV2 unit: chunk, branch, cat, channel shuffle (both module and functional)."""

    def __init__(self, c=16):
        super().__init__()
        h = c // 2
        self.branch = nn.Sequential(conv_bn(h, h, 1), conv_bn(h, h, 3, groups=h, act=None), conv_bn(h, h, 1))
        self.shuffle = nn.ChannelShuffle(2)

    def forward(self, x):
        a, b = x.chunk(2, dim=1)
        y = self.shuffle(torch.cat((a, self.branch(b)), 1))
        # the same shuffle spelled by hand, as torchvision's ShuffleNetV2 writes it
        n, c, h, w = y.shape
        z = y.view(n, 4, c // 4, h, w).transpose(1, 2).contiguous().view(n, -1, h, w)
        return z


class DenseBlock(nn.Module):
    """DenseNet: every layer sees the concat of all previous ones; transition avg pool."""

    def __init__(self, c0=8, growth=4, layers=3):
        super().__init__()
        self.layers = nn.ModuleList()
        c = c0
        for _ in range(layers):
            self.layers.append(
                nn.Sequential(
                    nn.BatchNorm2d(c),
                    nn.ReLU(),
                    nn.Conv2d(c, 2 * growth, 1, bias=False),
                    nn.BatchNorm2d(2 * growth),
                    nn.ReLU(),
                    nn.Conv2d(2 * growth, growth, 3, padding=1, bias=False),
                )
            )
            c += growth
        self.trans = nn.Sequential(
            nn.BatchNorm2d(c), nn.ReLU(), nn.Conv2d(c, c // 2, 1, bias=False), nn.AvgPool2d(2, stride=2)
        )

    def forward(self, x):
        feats = [x]
        for layer in self.layers:
            feats.append(layer(torch.cat(feats, 1)))
        return self.trans(torch.cat(feats, 1))


class Inception(nn.Module):
    """GoogLeNet branches: 1x1, 1x1->3x3, 1x1->5x5 ('same'), pool->1x1; cat; ceil-mode pool."""

    def __init__(self):
        super().__init__()
        self.b1 = conv_bn(8, 4, 1)
        self.b2 = nn.Sequential(conv_bn(8, 4, 1), conv_bn(4, 6, 3))
        self.b3 = nn.Sequential(nn.Conv2d(8, 2, 1), nn.Conv2d(2, 4, 5, padding="same"), nn.ReLU())
        self.b4 = nn.Sequential(nn.MaxPool2d(3, stride=1, padding=1, ceil_mode=True), conv_bn(8, 4, 1))
        self.pool = nn.MaxPool2d(3, stride=2, ceil_mode=True)

    def forward(self, x):
        y = torch.cat([self.b1(x), self.b2(x), self.b3(x), self.b4(x)], 1)
        return self.pool(y)


class MobileNetV3Block(nn.Module):
    """Expand (hardswish), depthwise stride 2, SE with hardsigmoid, project; hardswish head."""

    def __init__(self):
        super().__init__()
        self.expand = conv_bn(8, 24, 1, act=nn.Hardswish)
        self.dw = conv_bn(24, 24, 5, stride=2, groups=24, act=nn.Hardswish)
        self.se_pool = nn.AdaptiveAvgPool2d(1)
        self.se1 = nn.Conv2d(24, 8, 1)
        self.se2 = nn.Conv2d(8, 24, 1)
        self.project = conv_bn(24, 12, 1, act=None)
        self.head = nn.Sequential(nn.Linear(12, 16), nn.Hardswish(), nn.Dropout(0.2), nn.Linear(16, 4))

    def forward(self, x):
        y = self.dw(self.expand(x))
        s = F.hardsigmoid(self.se2(F.relu(self.se1(self.se_pool(y)))))
        y = self.project(y * s)
        y = torch.flatten(F.adaptive_avg_pool2d(y, 1), 1)
        return self.head(y)


class MBConv(nn.Module):
    """EfficientNet MBConv: SiLU everywhere, SE with sigmoid, residual."""

    def __init__(self, c=8, e=4):
        super().__init__()
        h = c * e
        self.expand = conv_bn(c, h, 1, act=nn.SiLU)
        self.dw = conv_bn(h, h, 3, groups=h, act=nn.SiLU)
        self.se = nn.Sequential(
            nn.AdaptiveAvgPool2d(1), nn.Conv2d(h, 2, 1), nn.SiLU(), nn.Conv2d(2, h, 1), nn.Sigmoid()
        )
        self.project = conv_bn(h, c, 1, act=None)

    def forward(self, x):
        y = self.dw(self.expand(x))
        y = y * self.se(y)
        return x + self.project(y)


class RegNetBlock(nn.Module):
    """RegNet X block: 1x1, grouped 3x3 stride 2 (group width 4), 1x1, projection shortcut."""

    def __init__(self):
        super().__init__()
        self.a = conv_bn(8, 16, 1)
        self.b = conv_bn(16, 16, 3, stride=2, groups=4)
        self.c = conv_bn(16, 16, 1, act=None)
        self.proj = nn.Sequential(nn.Conv2d(8, 16, 1, stride=2, bias=False), nn.BatchNorm2d(16))

    def forward(self, x):
        return F.relu(self.proj(x) + self.c(self.b(self.a(x))))


class ConvVariety(nn.Module):
    """Conv2d parameter corners: tuple stride/padding, dilation, 'same' with dilation and
    even kernels, 'valid', groups with bias, no bias; plus Conv1d."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(4, 6, (3, 5), stride=(2, 1), padding=(0, 2))
        self.b = nn.Conv2d(6, 6, 3, dilation=2, padding=2, groups=3, bias=False)
        self.c = nn.Conv2d(6, 4, (4, 3), padding="same", dilation=(1, 2))
        self.d = nn.Conv2d(4, 4, 2, padding="valid", groups=2)
        self.e = nn.Conv2d(4, 4, 3, stride=(1, 2), padding=(2, 1), dilation=(2, 1), bias=False)
        self.c1 = nn.Conv1d(4, 5, 3, stride=2, padding=1)
        self.c1b = nn.Conv1d(5, 5, 4, padding="same", dilation=2, groups=5, bias=False)

    def forward(self, x, s):
        y = self.e(self.d(self.c(self.b(self.a(x)))))
        z = self.c1b(self.c1(s))
        return y, z


class PaddingModes(nn.Module):
    """Conv padding_mode reflect/replicate/circular (also with 'same'), and the
    functional spellings with parameter tensors: F.conv2d, F.conv1d, F.linear, F.batch_norm."""

    def __init__(self):
        super().__init__()
        self.r = nn.Conv2d(3, 4, 3, padding=(1, 2), padding_mode="reflect")
        self.p = nn.Conv2d(4, 4, 3, padding=1, padding_mode="replicate", groups=4)
        self.c = nn.Conv2d(4, 5, (2, 3), padding="same", padding_mode="circular", bias=False)
        self.w = nn.Parameter(torch.randn(6, 5, 3, 3) * 0.3)
        self.b = nn.Parameter(torch.randn(6))
        self.w1 = nn.Parameter(torch.randn(4, 3, 3) * 0.3)
        self.c1 = nn.Conv1d(4, 4, 4, padding="same", padding_mode="reflect")
        self.fw = nn.Parameter(torch.randn(7, 6) * 0.3)
        self.register_buffer("mean", torch.randn(6) * 0.5)
        self.register_buffer("var", torch.rand(6) + 0.5)
        self.gamma = nn.Parameter(torch.randn(6))
        self.beta = nn.Parameter(torch.randn(6))

    def forward(self, x, s):
        y = self.c(self.p(self.r(x)))
        y = F.conv2d(y, self.w, self.b, stride=(2, 1), padding=1, dilation=(1, 2))
        y = F.batch_norm(y, self.mean, self.var, self.gamma, self.beta, False, 0.1, 1e-3)
        z = F.linear(y.permute(0, 2, 3, 1), self.fw)
        t = self.c1(F.conv1d(s, self.w1, None, 1, 2, 2))
        return z, t


class Conv1dBlock(nn.Module):
    """1-d CNN (audio/sequence style): conv + BN + ReLU, 1-d pools, a BatchNorm1d that pnnx
    cannot fold into a conv."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv1d(3, 8, 5, stride=2, padding=2, bias=False)
        self.b1 = nn.BatchNorm1d(8)
        self.c2 = nn.Conv1d(8, 8, 3, padding=1, groups=8)
        self.b2 = nn.BatchNorm1d(8)
        self.pool = nn.MaxPool1d(3, 2, 1)
        self.avg = nn.AvgPool1d(2, ceil_mode=True, count_include_pad=False)
        self.gap = nn.AdaptiveAvgPool1d(3)

    def forward(self, x):
        y = F.relu(self.b1(self.c1(x)))
        y = self.pool(self.c2(y))
        y = self.b2(torch.relu(y) + 1)
        return self.gap(self.avg(y))


class Activations(nn.Module):
    """Functional spellings inline, module spellings as submodules (pnnx writes an inline
    nn.X()(x) as F.x)."""

    def __init__(self):
        super().__init__()
        self.mods = nn.ModuleList(
            [
                nn.ReLU(),
                nn.ReLU6(),
                nn.Hardtanh(-2.0, 1.0),
                nn.LeakyReLU(),
                nn.LeakyReLU(0.2),
                nn.Sigmoid(),
                nn.SiLU(),
                nn.Hardswish(),
                nn.Hardsigmoid(),
                nn.Tanh(),
                nn.GELU(),
                nn.GELU("tanh"),
                nn.ELU(),
                nn.ELU(0.3),
            ]
        )

    def forward(self, x):
        fs = (
            F.relu(x),
            F.relu6(x * 4),
            F.hardtanh(x, -0.5, 0.7),
            F.leaky_relu(x, 0.1),
            torch.sigmoid(x),
            F.silu(x),
            F.hardswish(x * 4),
            F.hardsigmoid(x * 4),
            torch.tanh(x),
            F.gelu(x),
            F.gelu(x, approximate="tanh"),
            F.elu(x),
            F.elu(x, alpha=0.5),
        )
        return fs + tuple(m(x * 3) for m in self.mods)


class SharedPadding(nn.Module):
    """Convs, depthwise convs, Winograd convs and max pools with one geometry each, run one
    after another on different tensors. Convs of a binding with the same geometry share
    their padded input buffers (kernels.persistent_buffer), and depthwise convs and
    pools take theirs from the shared scratch (rewriting its border each run), so each
    must rewrite what it reads, and a reflect- or replicate-padded node must not leave
    its border in the buffer of a zero-padded one. The inputs sit far from zero, so a
    border that is not zero shows."""

    def __init__(self):
        super().__init__()
        self.z1, self.z2 = nn.Conv2d(6, 6, 3, padding=1), nn.Conv2d(6, 6, 3, padding=1)
        self.r = nn.Conv2d(6, 6, 3, padding=1, padding_mode="reflect")
        # stride 2: the phase layout, which a replicate-padded node fills border and all
        self.dz1, self.dz2 = (nn.Conv2d(6, 6, 3, stride=2, padding=1, groups=6) for _ in range(2))
        self.dr = nn.Conv2d(6, 6, 3, stride=2, padding=1, groups=6, padding_mode="replicate")
        self.expand = nn.Conv2d(6, 64, 1)
        self.w1, self.w2 = nn.Conv2d(64, 64, 3, padding=1), nn.Conv2d(64, 64, 3, padding=1)  # Winograd

    def forward(self, x):
        a = self.z2(self.r(self.z1(x)) + 3)
        r = self.dr(a)
        b = self.dz1(a) + self.dz2(a + r.mean(dim=(2, 3), keepdim=True))  # dz2 runs after dr
        w = self.expand(F.interpolate(b, scale_factor=2.0))
        w = self.w2(self.w1(w) + 3) + w
        p = F.max_pool2d(w, 3, 2, 1) + F.max_pool2d(-w, 3, 2, 1)
        return a, r, b, w, p


class Pools(nn.Module):
    def __init__(self):
        super().__init__()
        self.mods = nn.ModuleList(
            [
                nn.MaxPool2d(3, 2, ceil_mode=True),
                nn.MaxPool2d((2, 3), (1, 2), (1, 1), dilation=(2, 1)),
                nn.AvgPool2d((2, 3), (1, 2), (1, 1), ceil_mode=True, divisor_override=5),
                nn.AvgPool2d(3, ceil_mode=True, count_include_pad=False),
                nn.AvgPool2d(2),
            ]
        )

    def forward(self, x):
        return (
            F.max_pool2d(x, 3, 2, 1),
            F.max_pool2d(x, (3, 2), (2, 3), (1, 0), ceil_mode=True),
            F.max_pool2d(x, 2, 2, dilation=2),
            F.avg_pool2d(x, 3, 2, 1),
            F.avg_pool2d(x, 3, 2, 1, count_include_pad=False),
            F.avg_pool2d(x, 3, 2, 1, ceil_mode=True, count_include_pad=False),
            F.avg_pool2d(x, 3, 2, 1, ceil_mode=True),
            F.avg_pool2d(x, 2, divisor_override=3),
            # Inception's pool branch (stride 1, as large as the input)
            F.avg_pool2d(x, 3, 1, 1),
            F.max_pool2d(x, 3, 1, 1),
            F.avg_pool2d(x, 3, 1, 1, count_include_pad=False),
            # a max pool pads with -inf, an average pool of the same geometry with zeros
            # (phase buffers are shared by geometry and fill)
            F.max_pool2d(x, 2, 1, 1),
            F.avg_pool2d(x, 2, 1, 1),
        ) + tuple(m(x) for m in self.mods)


class AdaptivePools(nn.Module):
    def __init__(self):
        super().__init__()
        self.mods = nn.ModuleList(
            [
                nn.AdaptiveAvgPool2d((None, 2)),
                nn.AdaptiveMaxPool2d((4, None)),
                nn.AdaptiveAvgPool2d(7),
                nn.AdaptiveMaxPool2d((2, 3)),
                nn.AdaptiveAvgPool2d((6, 4)),
                nn.AdaptiveMaxPool2d(1),
            ]
        )

    def forward(self, x):
        return (
            F.adaptive_avg_pool2d(x, (3, 5)),
            F.adaptive_max_pool2d(x, (3, 5)),
            F.adaptive_avg_pool2d(x, 1),
            F.adaptive_max_pool2d(x, 1),
            F.adaptive_avg_pool2d(x, (None, 3)),
        ) + tuple(m(x) for m in self.mods)


class ShapeOps(nn.Module):
    def __init__(self):
        super().__init__()
        self.id = nn.Identity()
        self.drop = nn.Dropout2d(0.5)

    def forward(self, x):  # x: (N, 12, 6, 5)
        n = x.shape[0]
        a = x[:, 2:10:2]
        b = x[..., 1:-1]
        c = x[:, 0]
        d = x.permute(0, 2, 3, 1)
        e = torch.transpose(x, 1, 3)
        f = x.mean(1, keepdim=True) + x.mean((2, 3), keepdim=True)
        g = x.mean(-1)
        p, q, r = torch.split(x, [3, 4, 5], dim=1)
        s = torch.split(x, 2, dim=2)
        t = torch.cat([r, p, q], dim=1).reshape(n, 12, 30).view(n, 3, 4, 30)
        u = torch.flatten(self.drop(self.id(x)), 2)
        v = F.softmax(x, dim=1) + torch.softmax(x, -1)
        w = x[:, :, 1, 2:4]
        return a, b, c, d, e, f, g, s[2], t, u, v, w, F.dropout(x, 0.3, training=self.training) * 2


class Expressions(nn.Module):
    def forward(self, x, y, z):  # x: (N, 4, 5, 6) any sign, y: (N, 4, 1, 6) positive, z: (6,)
        a = (x + y - z) * 2.5 / (y + 1) - (-x)
        b = torch.pow(y, 2) + y**0.5 + torch.sqrt(y) + torch.rsqrt(y) + torch.exp(x * 0.1) + torch.log(y)
        c = torch.abs(x) + torch.sign(x) + torch.floor(x * 3) + torch.ceil(x * 3) + torch.round(x * 3)
        d = torch.max(x, y) + torch.min(x, z) + torch.maximum(x, y * 0.5) + torch.minimum(x, -z)
        e = x.clamp(-0.3, 0.4) + torch.neg(x) + 1 - x * x / 3.0 + 2**x
        return a, b, c, d, e


# --- the cases: (name, module factory, input factory, pnnx ops the .param must contain) --


def _rand(*shape, seed=0, low=-1.0, high=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(*shape, generator=g) * (high - low) + low


CASES = [
    ("tiny_cnn", TinyCNN, lambda: (_rand(1, 3, 17, 17),), {"nn.Conv2d", "nn.Linear", "F.softmax"}),
    (
        "residual",
        Residual,
        lambda: (_rand(1, 4, 16, 16),),
        {"nn.Conv2d", "F.relu", "nn.MaxPool2d", "nn.AdaptiveAvgPool2d", "torch.flatten", "nn.Linear"},
    ),
    ("residual_b2", Residual, lambda: (_rand(2, 4, 13, 11, seed=3),), {"nn.Conv2d"}),
    ("depthwise_separable", DepthwiseSeparable, lambda: (_rand(1, 6, 12, 12),), {"nn.ReLU6", "F.hardtanh"}),
    ("squeeze_excite", SqueezeExcite, lambda: (_rand(2, 8, 9, 9),), {"torch.mean", "F.sigmoid", "Tensor.reshape"}),
    ("shuffle_unit", ShuffleUnit, lambda: (_rand(1, 16, 8, 8),), {"torch.chunk", "torch.cat", "nn.ChannelShuffle"}),
    ("dense_block", DenseBlock, lambda: (_rand(1, 8, 10, 10),), {"torch.cat", "nn.BatchNorm2d", "nn.AvgPool2d"}),
    ("inception", Inception, lambda: (_rand(1, 8, 15, 15),), {"torch.cat", "nn.MaxPool2d"}),
    (
        "mobilenet_v3_block",
        MobileNetV3Block,
        lambda: (_rand(1, 8, 16, 16),),
        {"nn.Hardswish", "F.hardsigmoid", "F.adaptive_avg_pool2d", "torch.flatten"},
    ),
    ("mbconv", MBConv, lambda: (_rand(1, 8, 10, 10),), {"nn.SiLU", "nn.Sigmoid", "nn.AdaptiveAvgPool2d"}),
    ("regnet_block", RegNetBlock, lambda: (_rand(1, 8, 14, 14),), {"nn.Conv2d"}),
    ("conv_variety", ConvVariety, lambda: (_rand(1, 4, 15, 14), _rand(1, 4, 23, seed=1)), {"nn.Conv2d", "nn.Conv1d"}),
    ("padding_modes", PaddingModes, lambda: (_rand(1, 3, 9, 10), _rand(2, 3, 11, seed=1)), {"nn.Conv2d"}),
    (
        "conv1d_block",
        Conv1dBlock,
        lambda: (_rand(2, 3, 29),),
        {"nn.Conv1d", "nn.BatchNorm1d", "nn.MaxPool1d", "nn.AvgPool1d", "nn.AdaptiveAvgPool1d"},
    ),
    (
        "activations",
        Activations,
        lambda: (_rand(1, 3, 8, 9, low=-3, high=3),),
        {
            "F.relu",
            "F.relu6",
            "nn.ReLU6",
            "F.hardtanh",
            "F.leaky_relu",
            "nn.LeakyReLU",
            "F.sigmoid",
            "F.silu",
            "F.hardswish",
            "F.hardsigmoid",
            "F.tanh",
            "F.gelu",
            "F.elu",
            "nn.ReLU",
            "nn.GELU",
            "nn.ELU",
            "nn.Tanh",
            "nn.Sigmoid",
            "nn.SiLU",
            "nn.Hardswish",
            "nn.Hardsigmoid",
            "nn.Hardtanh",
        },
    ),
    ("shared_padding", SharedPadding, lambda: (_rand(1, 6, 12, 12, low=2.0, high=4.0),), {"nn.Conv2d", "F.max_pool2d"}),
    ("pools", Pools, lambda: (_rand(1, 3, 11, 13),), {"F.max_pool2d", "F.avg_pool2d", "nn.MaxPool2d", "nn.AvgPool2d"}),
    ("pools_b2", Pools, lambda: (_rand(2, 2, 8, 9, seed=5),), {"F.max_pool2d"}),
    (
        "adaptive_pools",
        AdaptivePools,
        lambda: (_rand(1, 3, 7, 7),),
        {"F.adaptive_avg_pool2d", "F.adaptive_max_pool2d", "nn.AdaptiveAvgPool2d", "nn.AdaptiveMaxPool2d"},
    ),
    ("adaptive_pools_odd", AdaptivePools, lambda: (_rand(2, 2, 13, 10, seed=2),), {"F.adaptive_avg_pool2d"}),
    (
        "shape_ops",
        ShapeOps,
        lambda: (_rand(1, 12, 6, 5),),
        {
            "Tensor.slice",
            "Tensor.select",
            "Tensor.permute",
            "torch.transpose",
            "torch.mean",
            "torch.split",
            "torch.cat",
            "Tensor.reshape",
            "torch.flatten",
            "F.softmax",
        },
    ),
    ("shape_ops_b2", ShapeOps, lambda: (_rand(2, 12, 6, 5, seed=4),), {"Tensor.slice"}),
    (
        "expressions",
        Expressions,
        lambda: (_rand(1, 4, 5, 6, low=-2, high=2), _rand(1, 4, 1, 6, seed=1, low=0.2, high=2), _rand(6, seed=2)),
        {"pnnx.Expression"}
        | {
            f"expr:{fn}"
            for fn in (
                "add",
                "sub",
                "mul",
                "div",
                "neg",
                "pow",
                "sqrt",
                "rsqrt",
                "exp",
                "log",
                "abs",
                "sign",
                "floor",
                "ceil",
                "round",
                "min",
                "max",
                "maximum",
                "minimum",
            )
        },
    ),
]


@pytest.mark.parametrize("name,factory,inputs,expect", CASES, ids=[c[0] for c in CASES])
def test_block(name, factory, inputs, expect, check_model, exporter):
    torch.manual_seed(0)
    module = randomize_bn(factory())
    args = inputs()
    check_model(name, module, args)
    missing = expect - pnnx_ops(exporter(name, module, args))
    assert not missing, f"pnnx did not write {sorted(missing)}; the case no longer covers those spellings"


class PoolIndices(nn.Module):
    def forward(self, x):
        return F.max_pool2d(x, 2, return_indices=True)


def test_used_pool_indices_match_torch(check_model):
    """A model that returns max_pool2d's indices gets them, int64 as torch returns them."""
    _, got, _ = check_model("pool_indices", PoolIndices(), (_rand(1, 2, 6, 6),))
    assert got[1].dtype == np.int64


def test_channel_shuffle_is_one_node_at_any_batch(exporter, tmp_path):
    """nn.ChannelShuffle, and the hand-written view/transpose/view pnnx also recognizes,
    compile to one channel_shuffle node each (no reshape + transpose + reshape: each node
    costs load time), and the file runs at other batch sizes than the exported one."""
    from pmx.compiler.driver import compile_model
    from pmx.runtime import InferenceSession

    torch.manual_seed(0)
    module = randomize_bn(ShuffleUnit()).eval()
    prefix = exporter("shuffle_unit", module, (_rand(1, 16, 8, 8),))
    out = tmp_path / "s.pmx"
    compile_model(prefix + ".pnnx.param", prefix + ".pnnx.bin", str(out), verify=True)
    sess = InferenceSession(str(out), verify=True)
    ops = [n.op for n in sess.model.nodes]
    assert ops.count("channel_shuffle") == 2 and "transpose" not in ops and "reshape" not in ops, ops
    for batch in (1, 3):
        x = _rand(batch, 16, 8, 8, seed=batch)
        with torch.no_grad():
            want = module(x).numpy()
        (got,) = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})
        assert got.shape == want.shape and np.abs(got - want).max() <= 1e-4 * max(1.0, np.abs(want).max())
