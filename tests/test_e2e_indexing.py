"""End-to-end: modules mixing indexing, shape movement, reductions, activations, casts and
int64 / bool tensors, exported with pnnx, compiled, run and compared with torch (floats
at 1e-4 relative, integers and bools exactly). Several graph inputs and outputs each.

pnnx's Python exporter cannot take bool graph inputs (it declares them f32), so masks
enter as uint8 and become bool inside the graph; bool outputs are compared exactly."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F


def g(seed):
    return torch.Generator().manual_seed(seed)


class SwinShift(nn.Module):
    """Cyclic shift, window partition / merge and the reverse shift, as in Swin."""

    def forward(self, x):
        b, h, w, c = x.shape
        y = torch.roll(x, shifts=(-2, -2), dims=(1, 2))
        win = y.view(b, h // 4, 4, w // 4, 4, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, 16, c)
        win = F.softmax(win @ win.transpose(1, 2) * 0.25, -1) @ win
        y = win.view(b, h // 4, w // 4, 4, 4, c).permute(0, 1, 3, 2, 4, 5).reshape(b, h, w, c)
        return torch.roll(y, shifts=(2, 2), dims=(1, 2)), torch.roll(x, 3, 3), torch.roll(x, 5), torch.flip(x, [1, 3])


def test_swin_shift_roll(check_model):
    x = torch.randn(1, 8, 8, 6, generator=g(0))
    check_model("idx_swin_shift", SwinShift(), (x,))


class GatherIds(nn.Module):
    """int64 ids from the graph select rows (index_select) and gather positions; the
    table and constant ids are module state."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(10, 8, generator=g(1)))

    def forward(self, x, ids):
        rows = torch.index_select(self.table, 0, ids.flatten()).view(2, 3, 8)
        picked = torch.gather(x, 1, ids.unsqueeze(-1).expand(2, 3, 8))
        fixed = torch.index_select(x, 2, torch.tensor([7, 0, 3]))
        cols = x[:, [4, 0, -1]]
        return rows + picked, fixed, cols, ids > 2, ids * 2 + 1, ids.float() / 3


def test_gather_index_select_int64_ids(check_model):
    x = torch.randn(2, 5, 8, generator=g(2))
    ids = torch.randint(0, 5, (2, 3), generator=g(3))
    check_model("idx_gather_ids", GatherIds(), (x, ids))


class MaskedScores(nn.Module):
    """Attention-style masking with a padding mask that enters as uint8."""

    def forward(self, q, pad):
        mask = pad.bool()
        scores = q.masked_fill(mask[:, None, :], -1e9)
        probs = F.softmax(scores, -1)
        zeroed = torch.where(mask[:, None, :], 0.0, q)
        best = torch.argmax(scores, -1)
        values, where_max = torch.max(q, dim=1)
        lowest, where_min = q.min(2, keepdim=True)
        keep = (~mask).sum(-1)
        return probs, zeroed, best, values, where_max, lowest, where_min, keep, mask & (q[:, 0] > 0)


def test_masked_fill_where_max_argmax(check_model):
    q = torch.randn(2, 4, 6, generator=g(4))
    pad = (torch.rand(2, 6, generator=g(5)) > 0.6).to(torch.uint8)
    pad[:, 0] = 0  # every row keeps a position
    check_model("idx_masked_scores", MaskedScores(), (q, pad))


class Reductions(nn.Module):
    def forward(self, x):
        return (
            x.std(1),
            torch.var(x, 2, unbiased=False),
            torch.std(x, (1, 2), keepdim=True, correction=0),
            torch.norm(x, p=1, dim=-1),
            x.norm(2, 1, keepdim=True),
            torch.linalg.vector_norm(x, 3, dim=0),
            torch.logsumexp(x, (1, 2)),
            x.logsumexp(0, keepdim=True),
            x.amax(1),
            torch.amin(x, (0, 2)),
            x.prod(2),
            x.mean((0, 1), keepdim=True),
            torch.sum(x, -1),
            torch.argmin(x, 0),
            F.log_softmax(x, 0),
            x.softmax(1),
            torch.log_softmax(x, -1),
        )


def test_reductions(check_model):
    x = torch.randn(3, 4, 5, generator=g(6))
    check_model("idx_reductions", Reductions(), (x,))


class Activations(nn.Module):
    def __init__(self):
        super().__init__()
        self.prelu_c = nn.PReLU(4, init=0.1)
        with torch.no_grad():
            self.prelu_c.weight.copy_(torch.tensor([0.1, -0.2, 0.3, 0.05]))
        self.prelu_1 = nn.PReLU()
        self.mods = nn.ModuleList(
            [
                nn.GELU(),
                nn.GELU("tanh"),
                nn.Mish(),
                nn.Softplus(2.0, 5.0),
                nn.Softsign(),
                nn.SELU(),
                nn.CELU(0.5),
                nn.Hardtanh(-2.0, 2.0),
                nn.LogSigmoid(),
                nn.ELU(0.3),
            ]
        )

    def forward(self, x, lo, hi):
        outs = [m(x) for m in self.mods]
        outs += [
            F.gelu(x),
            F.gelu(x, approximate="tanh"),
            F.mish(x),
            F.softplus(x),
            F.softsign(x),
            F.selu(x),
            torch.selu(x),
            F.celu(x),
            F.hardtanh(x),
            F.logsigmoid(x),
            self.prelu_c(x),
            self.prelu_1(x),
            F.prelu(x, torch.tensor([0.25])),
            torch.clamp(x, lo, hi),
            x.clamp(min=lo),
            torch.clip(x, max=hi),
            torch.clamp(x, -0.5, 0.5),
            x.clamp(min=0),
            torch.erf(x),
            torch.sigmoid(x),
        ]
        return tuple(outs)


def test_activations_every_spelling(check_model):
    x = torch.randn(2, 4, 5, 3, generator=g(7)) * 3
    lo = torch.randn(2, 4, 5, 3, generator=g(8)) - 1
    hi = lo + torch.rand(5, 3, generator=g(9)) * 2
    check_model("idx_activations", Activations(), (x, lo, hi))


class ShapeOps(nn.Module):
    def forward(self, x, y):
        a = x[:, :1].expand(2, 3, 4) + y[:1].expand_as(y)
        b = torch.stack([x, y, x * y], 1)
        c = torch.tile(x, (2, 1)) + x.repeat(1, 2, 1)
        d = torch.narrow(x, 2, 1, 2) * x[:, :, ::2] + x[:, 1:3, ::2].sum(1, keepdim=True)
        e = x[1, :, -1] + x.select(2, -1)[0] + x[-1, -1, :3].sum(0, keepdim=True)
        f = torch.squeeze(x.unsqueeze(1), 1) + x[:, None, 1].squeeze(1).unsqueeze(1)
        h = x[..., [3, 0]] - torch.flip(y, [0, 2])[..., :2]
        k = x[:, [0, 2], [1, 3]] + x[[0, 1], :, [3, -2]][:, :2]  # several list indices
        return a, b, c, d, e, f, h, x.repeat(2, 1, 1, 1), k


def test_shape_and_indexing_ops(check_model):
    x = torch.randn(2, 3, 4, generator=g(10))
    y = torch.randn(2, 3, 4, generator=g(11))
    check_model("idx_shape_ops", ShapeOps(), (x, y))


class CastsAndInts(nn.Module):
    def forward(self, x, i, j):
        j1 = j.clamp(min=1)
        return (
            x.long(),
            x.int() + 1,
            x.bool(),
            (x > 0).float() * x,
            (x > 0).long().sum(1),
            (x > 0).sum(-1),
            i.float() * 0.5,
            i.to(torch.float32) + x[:, :, 0],
            i + j,
            i // 2,
            i / j1,
            i * 3,
            i % 3,
            i > j,
            (i > 1) & (j < 3),
            ~(i > 1),
            torch.bitwise_not(i),
            i ^ j,
            torch.logical_or(i > 2, j > 2),
            torch.zeros_like(x),
            torch.ones_like(x) + x,
            torch.full_like(x, 3.0) * x,
            torch.arange(4) + x,
            torch.arange(3, dtype=torch.float32) + i,
            torch.maximum(i, j),
            torch.where(i > j, i, j),
        )


def test_casts_int64_bool_and_constants(check_model):
    x = torch.randn(2, 3, 4, generator=g(12)) * 3
    i = torch.randint(-5, 6, (2, 3), generator=g(13))
    j = torch.randint(-5, 6, (2, 3), generator=g(14))
    check_model("idx_casts_ints", CastsAndInts(), (x, i, j))


class EmbeddingLike(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(10, 8, generator=g(15)))

    def forward(self, x, ids):
        pooled = x[torch.arange(x.shape[0]), ids.argmax(-1)]  # CLIP's end-of-text pooling
        return self.table[ids] + x[:, ids[0]].sum(), x.sum(), x.argmax(), pooled, x[:, ids[:, :2], ids[:, 1:]]


def test_tensor_index_with_graph_ids_and_full_reductions(check_model):
    x = torch.randn(2, 5, 8, generator=g(16))
    ids = torch.randint(0, 5, (2, 3), generator=g(17))
    check_model("idx_embedding_like", EmbeddingLike(), (x, ids))


def test_data_dependent_indexing_fails_at_compile_time(exporter, tmp_path):
    """x[x > 0] has as many elements as the mask has True values: pmx refuses it at compile
    time, naming the node and its .param line."""
    from pmx.compiler.driver import compile_model
    from pmx.runtime.errors import PmxCompileError

    class BoolIndex(nn.Module):
        def forward(self, x):
            return x[x > 0] * 2

    prefix = exporter("idx_bool_index", BoolIndex(), (torch.randn(2, 3, 4, generator=g(18)),))
    with pytest.raises(PmxCompileError, match=r"Tensor\.index .*line \d+.*data-dependent"):
        compile_model(prefix + ".pnnx.param", prefix + ".pnnx.bin", str(tmp_path / "m.pmx"))
