"""End-to-end transformer pieces: small modules written here, exported with pnnx,
compiled, run, compared with torch (max|pmx - torch| / max|torch| <= 1e-4).

Models with bool inputs (masks) are exported here rather than through the shared
`check_model` fixture: pip pnnx's `export` maps torch.bool inputs to "f32", which the pnnx
binary then refuses, so they are traced here and converted with explicit input types.
nn.MultiheadAttention with a key_padding_mask also fails torch.jit's trace check (the
eval fast path traces differently twice), so the trace check is off for those.
"""

import contextlib
import io
import os
import pathlib

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import compare_with_torch

_TYPES = {torch.float32: "f32", torch.float64: "f64", torch.int64: "i64", torch.int32: "i32", torch.bool: "bool"}


@pytest.fixture(scope="module")
def check_typed(tmp_path_factory):
    """check_typed(name, module, inputs, tol): like check_model, for any input dtypes."""
    import pnnx

    root = tmp_path_factory.mktemp("pnnx_typed")

    def check(name, module, inputs, tol=1e-4):
        d = root / name
        d.mkdir()
        module = module.eval()
        cwd = os.getcwd()
        try:
            os.chdir(d)
            with torch.no_grad(), contextlib.redirect_stdout(io.StringIO()):
                torch.jit.trace(module, tuple(inputs), check_trace=False).save(str(d / "model.pt"))
                pnnx.convert(
                    str(d / "model.pt"),
                    input_shapes=[list(x.shape) for x in inputs],
                    input_types=[_TYPES[x.dtype] for x in inputs],
                )
        finally:
            os.chdir(cwd)
        prefix = str(d / "model")
        assert pathlib.Path(prefix + ".pnnx.param").exists(), "pnnx wrote no .pnnx.param"
        return compare_with_torch(prefix, module, inputs, d / "model.pmx", tol=tol)

    return check


def _seeded(module, seed=0):
    torch.manual_seed(seed)
    for p in module.parameters():  # non-trivial affine params / biases (defaults are 1 / 0)
        with torch.no_grad():
            p.add_(torch.randn_like(p) * 0.1)
    return module.eval()


class Fn(nn.Module):
    """Wraps a function of (self, *inputs) with submodules given as keywords."""

    def __init__(self, fn, **modules):
        super().__init__()
        self.fn = fn
        for k, v in modules.items():
            setattr(self, k, v)

    def forward(self, *xs):
        return self.fn(self, *xs)


# --- normalization ---------------------------------------------------------------------


def test_norms(check_model):
    torch.manual_seed(0)
    m = _seeded(
        Fn(
            lambda s, x, y: (
                s.ln(x),
                s.ln2(x),
                F.layer_norm(x, (8,), eps=1e-6),
                s.gn(y),
                s.in1(y),
                s.in2(y),
                F.group_norm(y, 2),
                F.normalize(x, dim=-1),
                F.normalize(y, p=1.0, dim=1),
                s.bn(x.mean(1)),
                s.bn3(x.transpose(1, 2)),
            ),
            ln=nn.LayerNorm(8),
            ln2=nn.LayerNorm([5, 8], elementwise_affine=False),
            gn=nn.GroupNorm(2, 4),
            in1=nn.InstanceNorm2d(4, affine=True),
            in2=nn.InstanceNorm2d(4, affine=True, track_running_stats=True),
            bn=nn.BatchNorm1d(8),
            bn3=nn.BatchNorm1d(8),
        )
    )
    for bn in (m.in2, m.bn, m.bn3):
        bn.running_mean.copy_(torch.randn(bn.num_features) * 0.3)
        bn.running_var.copy_(torch.rand(bn.num_features) + 0.5)
    check_model("norms", m, (torch.randn(2, 5, 8) * 3 + 1, torch.randn(2, 4, 5, 5)))


def test_instance_norm_1d(check_model):
    torch.manual_seed(1)
    m = _seeded(Fn(lambda s, x: s.a(x) + s.b(x), a=nn.InstanceNorm1d(4), b=nn.InstanceNorm1d(4, affine=True)))
    check_model("instance_norm_1d", m, (torch.randn(3, 4, 9),))


def test_functional_norms_on_computed_tensors(check_model):
    torch.manual_seed(14)
    m = _seeded(
        Fn(
            lambda s, x, w: (
                F.layer_norm(x, (4,), w, w * 0.5),
                F.rms_norm(x, (4,), w),
                s.rms(x),
                F.group_norm(x.unsqueeze(-1), 2, w, w),
            ),
            rms=nn.RMSNorm(4, eps=1e-5),
        )
    )
    check_model("functional_norms", m, (torch.randn(3, 4), torch.randn(4)))


# --- linear algebra --------------------------------------------------------------------


def test_matmul_family(check_model):
    torch.manual_seed(2)
    m = Fn(
        lambda s, a, b, c, d, e: (
            torch.matmul(a, b),
            a @ c,
            torch.matmul(c, b),
            torch.mm(a, b),
            torch.bmm(d, e),
            d @ e.transpose(1, 2) @ d,
            torch.addmm(a @ b, a, b, beta=0.5, alpha=2.0),
            torch.baddbmm(d, d, e.transpose(1, 2), beta=0.3, alpha=1.5),
            torch.addmm(a @ b, a, b),
            torch.matmul(d, c[:3]),
            torch.matmul(d.unsqueeze(0), e.unsqueeze(1).transpose(-1, -2)),
            a.mv(c),
            (a @ b).addmm(a, b, beta=2.0),
            F.linear(a, b.transpose(0, 1)),
            a.matmul(b),
            a.unsqueeze(0).bmm(b.unsqueeze(0)),
        )
    )
    check_model(
        "matmul_family",
        m,
        (torch.randn(3, 4), torch.randn(4, 5), torch.randn(4), torch.randn(2, 3, 3), torch.randn(2, 3, 3)),
    )


def test_einsum(check_model):
    torch.manual_seed(3)
    m = Fn(
        lambda s, q, k, a, b, x, w: (
            torch.einsum("bhid,bhjd->bhij", q, k),
            torch.einsum("bhij,bhjd->bhid", q @ k.transpose(-1, -2), k),
            torch.einsum("bij,bjk->bik", a, b),
            torch.einsum("bchw,bkc->bkhw", x, w),
            torch.einsum("bij->bji", a) + 1,
        )
    )
    check_model(
        "einsum",
        m,
        (
            torch.randn(2, 2, 3, 4),
            torch.randn(2, 2, 5, 4),
            torch.randn(2, 3, 4),
            torch.randn(2, 4, 6),
            torch.randn(2, 3, 4, 4),
            torch.randn(2, 5, 3),
        ),
    )


def test_embedding_and_linear_without_bias(check_typed):
    torch.manual_seed(4)
    m = _seeded(
        Fn(
            lambda s, ids, x: (s.e(ids), F.embedding(ids, s.e.weight, padding_idx=0), s.l(x), F.linear(x, s.l.weight)),
            e=nn.Embedding(10, 4, padding_idx=1),
            l=nn.Linear(4, 3, bias=False),
        )
    )
    check_typed("embedding", m, (torch.tensor([[1, 2, 9, 0, 1], [3, 3, 4, 5, 1]]), torch.randn(2, 4)))


def test_embedding_out_of_range_ids_raise(check_typed):
    from pmx.runtime.errors import PmxError

    m = Fn(lambda s, ids: s.e(ids), e=nn.Embedding(6, 3))
    sess, _, _ = check_typed("embedding_range", m, (torch.tensor([0, 5, 2]),))
    for bad in ([0, 6, 1], [-1, 0, 0]):
        with pytest.raises(PmxError, match="out of range"):
            sess.run(None, {sess.get_inputs()[0].name: np.array(bad, np.int64)})


# --- attention -------------------------------------------------------------------------


MHA_CASES = {
    # name: (module kwargs, call(mha, *inputs), input builders)
    "self_bf": (dict(batch_first=True), lambda a, x: a(x, x, x), [(2, 5, 8)]),
    "self_seq_first_no_weights": (dict(), lambda a, x: a(x, x, x, need_weights=False)[0], [(5, 2, 8)]),
    "cross_kv_bias_off": (dict(batch_first=True, bias=False), lambda a, x, m: a(x, m, m), [(2, 5, 8), (2, 7, 8)]),
    "qkv_distinct_kdim_vdim": (dict(kdim=6, vdim=4), lambda a, q, k, v: a(q, k, v), [(5, 2, 8), (7, 2, 6), (7, 2, 4)]),
    "bias_kv_zero_attn": (
        dict(add_bias_kv=True, add_zero_attn=True, batch_first=True),
        lambda a, q, k, v: a(q, k, v),
        [(2, 5, 8), (2, 7, 8), (2, 7, 8)],
    ),
    "float_mask_per_head_weights": (
        dict(batch_first=True),
        lambda a, x, m: a(x, x, x, attn_mask=m, average_attn_weights=False),
        [(2, 5, 8), (5, 5)],
    ),
    "float_3d_mask_and_kp": (
        dict(batch_first=True),
        lambda a, q, k, m, kp: a(q, k, k, attn_mask=m, key_padding_mask=kp),
        [(2, 5, 8), (2, 7, 8), (4, 5, 7), (2, 7)],
    ),
    "one_head_3d_mask": (
        dict(num_heads=1, batch_first=True),
        lambda a, q, k, v, m: a(q, k, v, attn_mask=m),
        [(2, 5, 8), (2, 6, 8), (2, 6, 8), (2, 5, 6)],
    ),
}


@pytest.mark.parametrize("case", sorted(MHA_CASES))
def test_multihead_attention(check_model, case):
    kwargs, call, shapes = MHA_CASES[case]
    torch.manual_seed(5)
    kwargs = dict(kwargs)
    heads = kwargs.pop("num_heads", 2)
    m = _seeded(Fn(lambda s, *xs: call(s.a, *xs), a=nn.MultiheadAttention(8, heads, **kwargs)))
    inputs = tuple(torch.randn(*sh) for sh in shapes)
    check_model(f"mha_{case}", m, inputs)


def _bool_mask(shape, p, seed, keep_first=True):
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(*shape, generator=g) < p
    if keep_first:  # no fully masked rows (torch gives NaN there; pmx matches, but NaN != NaN)
        m[..., 0] = False
    return m


def test_multihead_attention_bool_masks(check_typed):
    torch.manual_seed(6)
    m = _seeded(
        Fn(
            lambda s, q, k, v, am, kp: s.a(q, k, v, attn_mask=am, key_padding_mask=kp),
            a=nn.MultiheadAttention(8, 2, batch_first=True),
        )
    )
    check_typed(
        "mha_bool_masks",
        m,
        (
            torch.randn(2, 5, 8),
            torch.randn(2, 7, 8),
            torch.randn(2, 7, 8),
            _bool_mask((5, 7), 0.3, 1),
            _bool_mask((2, 7), 0.3, 2),
        ),
    )


def test_multihead_attention_constant_causal_mask(check_model):
    torch.manual_seed(7)
    # built inside forward: pnnx keeps it as a folded constant operand. (A mask tensor
    # captured from outside the module is dropped by pnnx without a trace in the .param.)
    m = _seeded(
        Fn(
            lambda s, x: s.a(x, x, x, attn_mask=torch.triu(torch.ones(5, 5, dtype=torch.bool), 1))[0],
            a=nn.MultiheadAttention(8, 2, batch_first=True),
        )
    )
    check_model("mha_causal_const", m, (torch.randn(3, 5, 8),))


def test_multihead_attention_ambiguous_mask_fails(check_typed):
    from pmx.runtime.errors import PmxCompileError

    m = Fn(lambda s, x, kp: s.a(x, x, x, key_padding_mask=kp)[0], a=nn.MultiheadAttention(8, 2, batch_first=True))
    with pytest.raises(PmxCompileError, match="could be an attn_mask"):
        check_typed("mha_ambiguous", m, (torch.randn(5, 5, 8), _bool_mask((5, 5), 0.3, 3)))


def test_sdpa(check_typed):
    torch.manual_seed(8)
    m = Fn(
        lambda s, q, k, v, fm, bm: (
            F.scaled_dot_product_attention(q, k, v, is_causal=True),
            F.scaled_dot_product_attention(q, k, v, attn_mask=fm, scale=0.3),
            F.scaled_dot_product_attention(q, k, v, attn_mask=bm),
            F.scaled_dot_product_attention(q, k[:, :, :3], v[:, :, :3], is_causal=True),
        )
    )
    bm = _bool_mask((2, 1, 5, 5), 0.4, 4, keep_first=False)
    bm[0, 0, 1] = False  # a fully masked row: torch's SDPA gives 0 there
    q = torch.randn(2, 2, 5, 4)
    check_typed("sdpa", m, (q, torch.randn(2, 2, 5, 4), torch.randn(2, 2, 5, 6), torch.randn(5, 5), ~bm))


def test_sdpa_grouped_query(check_model):
    torch.manual_seed(15)
    m = Fn(
        lambda s, q, k, v: (
            F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
            F.scaled_dot_product_attention(q, k, v, enable_gqa=True, is_causal=True),
        )
    )
    check_model("sdpa_gqa", m, (torch.randn(2, 4, 5, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 3)))


# --- blocks ----------------------------------------------------------------------------


class Block(nn.Module):
    """Pre-LN transformer block: MHA + GELU MLP, both residual."""

    def __init__(self, d, heads, batch_first=True):
        super().__init__()
        self.n1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=batch_first)
        self.n2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x, kp=None):
        h = self.n1(x)
        x = x + self.attn(h, h, h, key_padding_mask=kp, need_weights=False)[0]
        return x + self.fc2(F.gelu(self.fc1(self.n2(x))))


class ViT(nn.Module):
    def __init__(self, d=16, heads=4, depth=2, patch=4, image=16, classes=5):
        super().__init__()
        self.patch = nn.Conv2d(3, d, patch, patch)
        self.cls = nn.Parameter(torch.randn(1, 1, d))
        self.pos = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, d) * 0.1)
        self.blocks = nn.ModuleList([Block(d, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, img):
        x = self.patch(img).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x)[:, 0])


def test_vit(check_model):
    torch.manual_seed(9)
    check_model("vit", _seeded(ViT()), (torch.randn(2, 3, 16, 16),))


class Bert(nn.Module):
    def __init__(self, vocab=30, d=16, heads=2, depth=2, max_len=16):
        super().__init__()
        self.tok = nn.Embedding(vocab, d, padding_idx=0)
        self.pos = nn.Embedding(max_len, d)
        self.ln = nn.LayerNorm(d)
        self.blocks = nn.ModuleList([Block(d, heads) for _ in range(depth)])
        self.pool = nn.Linear(d, d)

    def forward(self, ids, pad):
        pos = torch.arange(ids.shape[1]).unsqueeze(0)
        x = self.ln(self.tok(ids) + self.pos(pos))
        for b in self.blocks:
            x = b(x, pad)
        return x, torch.tanh(self.pool(x[:, 0]))


def test_bert_with_padding_mask(check_typed):
    torch.manual_seed(10)
    ids = torch.randint(1, 30, (2, 7))
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[1, 4:] = True
    ids[1, 4:] = 0
    check_typed("bert", _seeded(Bert()), (ids, pad))


class ConvNeXtBlock(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.dw = nn.Conv2d(d, d, 7, padding=3, groups=d)
        self.norm = nn.LayerNorm(d, eps=1e-6)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.gamma = nn.Parameter(torch.rand(d) + 0.5)

    def forward(self, x):
        y = self.dw(x).permute(0, 2, 3, 1)
        y = self.fc2(F.gelu(self.fc1(self.norm(y)))) * self.gamma
        return x + y.permute(0, 3, 1, 2)


def test_convnext_block(check_model):
    torch.manual_seed(11)
    check_model("convnext", _seeded(ConvNeXtBlock()), (torch.randn(2, 16, 9, 9),))


class SDPABlock(nn.Module):
    def __init__(self, d=16, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x, mask):
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm(x)).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        causal = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        masked = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        y = (causal + masked).transpose(1, 2).reshape(b, n, d)
        return x + self.proj(y)


def test_sdpa_block(check_model):
    torch.manual_seed(12)
    check_model("sdpa_block", _seeded(SDPABlock()), (torch.randn(2, 6, 16), torch.randn(6, 6)))


def window_partition(x, w):
    b, h, wd, c = x.shape
    x = x.view(b, h // w, w, wd // w, w, c).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(-1, w * w, c)


def window_reverse(x, w, h, wd):
    b = x.shape[0] // ((h // w) * (wd // w))
    x = x.view(b, h // w, wd // w, w, w, -1).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(b, h, wd, -1)


class SwinBlock(nn.Module):
    """Shifted-window attention: roll, partition, windowed MHSA with the shift mask and a
    relative-position-style bias added to the scores, reverse, roll back, MLP."""

    def __init__(self, d=16, heads=2, window=4, shift=2, res=8):
        super().__init__()
        self.d, self.heads, self.w, self.shift, self.res = d, heads, window, shift, res
        self.norm1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.norm2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)
        self.bias = nn.Parameter(torch.randn(heads, window * window, window * window) * 0.1)
        img = torch.zeros(1, res, res, 1)
        cnt = 0
        for hs in (slice(0, -window), slice(-window, -shift), slice(-shift, None)):
            for ws in (slice(0, -window), slice(-window, -shift), slice(-shift, None)):
                img[:, hs, ws, :] = cnt
                cnt += 1
        mw = window_partition(img, window).squeeze(-1)
        mask = mw.unsqueeze(1) - mw.unsqueeze(2)
        self.register_buffer("mask", mask.masked_fill(mask != 0, -100.0).masked_fill(mask == 0, 0.0))

    def forward(self, x):
        _b, h, wd, c = x.shape
        shortcut = x
        x = torch.roll(self.norm1(x), shifts=(-self.shift, -self.shift), dims=(1, 2))
        win = window_partition(x, self.w)
        bw, n, _ = win.shape
        qkv = self.qkv(win).reshape(bw, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        attn = (q * (c // self.heads) ** -0.5) @ k.transpose(-2, -1) + self.bias.unsqueeze(0)
        nw = self.mask.shape[0]
        attn = attn.view(bw // nw, nw, self.heads, n, n) + self.mask.unsqueeze(1).unsqueeze(0)
        attn = attn.view(-1, self.heads, n, n).softmax(-1)
        y = self.proj((attn @ v).transpose(1, 2).reshape(bw, n, c))
        y = torch.roll(window_reverse(y, self.w, h, wd), shifts=(self.shift, self.shift), dims=(1, 2))
        x = shortcut + y
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


def test_swin_block(check_model):
    torch.manual_seed(13)
    check_model("swin", _seeded(SwinBlock()), (torch.randn(2, 8, 8, 16),))
