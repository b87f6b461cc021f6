"""grid_sample, affine_grid and pairwise_distance against torch: property tests over
one-op .pnnx.param models (canonical rule, shape rule and kernel together), and an
end-to-end pnnx export."""

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import rel_error
from hypothesis import given
from hypothesis import strategies as st
from paramgraph import run_one_op

from pmx.runtime.errors import PmxCompileError

TOL = 1e-5


def check(got, want, tol=TOL):
    want = want.detach().numpy()
    assert got.shape == want.shape, f"shape {got.shape} != torch {want.shape}"
    err = rel_error(got, want)
    assert err <= tol, f"max-normalized error {err:.3g} > {tol}"


def generator(data):
    return torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1), label="seed"))


def sizes(data, lo, hi, n):
    return data.draw(st.lists(st.integers(lo, hi), min_size=n, max_size=n))


@given(st.data())
def test_grid_sample(data):
    mode = data.draw(st.sampled_from(["bilinear", "nearest", "bicubic"]))
    nd = 2 if mode == "bicubic" else data.draw(st.sampled_from([2, 2, 3]))
    padding = data.draw(st.sampled_from(["zeros", "border", "reflection"]))
    align = data.draw(st.booleans())
    g = generator(data)
    n, c = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 3))
    x = torch.randn(n, c, *sizes(data, 1, 6, nd), generator=g)
    # coordinates well outside [-1, 1] exercise every padding rule, reflection's repeated folds too
    reach = data.draw(st.sampled_from([1.0, 1.5, 3.5]))
    grid = (torch.rand(n, *sizes(data, 1, 5, nd), nd, generator=g) * 2 - 1) * reach
    want = F.grid_sample(x, grid, mode=mode, padding_mode=padding, align_corners=align)
    params = f"align_corners={align} mode={mode} padding_mode={padding}"
    (got,) = run_one_op("F.grid_sample", params, [x.numpy(), grid.numpy()], [want.numpy()], ["input", "grid"])
    check(got, want)


def test_grid_sample_grid_points_on_pixel_centres():
    """Coordinates exactly on pixels and halfway between them (nearest's ties round half
    to even, as torch's nearbyint)."""
    x = torch.arange(2 * 5 * 4, dtype=torch.float32).reshape(1, 2, 5, 4)
    xs = torch.linspace(-1.25, 1.25, 11)
    grid = torch.stack(torch.meshgrid(xs, xs, indexing="xy"), -1)[None]
    for mode in ("bilinear", "nearest", "bicubic"):
        for padding in ("zeros", "border", "reflection"):
            for align in (False, True):
                want = F.grid_sample(x, grid, mode=mode, padding_mode=padding, align_corners=align)
                params = f"align_corners={align} mode={mode} padding_mode={padding}"
                (got,) = run_one_op("F.grid_sample", params, [x.numpy(), grid.numpy()], [want.numpy()],
                                    ["input", "grid"])
                check(got, want)


@given(st.data())
def test_affine_grid(data):
    nd = data.draw(st.sampled_from([2, 3]))
    align = data.draw(st.booleans())
    n = data.draw(st.integers(1, 3))
    size = (n, data.draw(st.integers(1, 3)), *sizes(data, 1, 6, nd))
    theta = torch.randn(n, nd, nd + 1, generator=generator(data))
    want = F.affine_grid(theta, size, align_corners=align)
    params = f"align_corners={align} size=({','.join(map(str, size))})"
    (got,) = run_one_op("F.affine_grid", params, [theta.numpy()], [want.numpy()], ["theta"])
    check(got, want)


@given(st.data())
def test_pairwise_distance(data):
    p = data.draw(st.sampled_from([1.0, 2.0, 3.0, 0.5, float("inf"), 0.0]))
    eps = data.draw(st.sampled_from([1e-6, 1e-3, 0.0]))
    keepdim = data.draw(st.booleans())
    shape = sizes(data, 1, 5, data.draw(st.integers(1, 3)))
    other = list(shape)
    if len(shape) > 1 and data.draw(st.booleans()):
        other[0] = 1  # x2 broadcast along the batch
    g = generator(data)
    a, b = torch.randn(*shape, generator=g), torch.randn(*other, generator=g)
    want = F.pairwise_distance(a, b, p=p, eps=eps, keepdim=keepdim)
    op = data.draw(st.sampled_from(["F.pairwise_distance", "nn.PairwiseDistance"]))
    params = f"eps={eps:e} keepdim={keepdim} p={p}"
    (got,) = run_one_op(op, params, [a.numpy(), b.numpy()], [want.numpy()], ["x1", "x2"])
    check(got, want)


def test_grid_sample_refuses_bicubic_5d():
    x = np.zeros((1, 1, 2, 2, 2), np.float32)
    grid = np.zeros((1, 2, 2, 2, 3), np.float32)
    with pytest.raises(PmxCompileError, match="bicubic"):
        run_one_op("F.grid_sample", "align_corners=False mode=bicubic padding_mode=zeros", [x, grid],
                   [np.zeros((1, 1, 2, 2, 2), np.float32)], ["input", "grid"])


class SpatialTransformer(nn.Module):
    """A spatial transformer head: theta from a linear layer, affine_grid, grid_sample,
    and a pairwise distance between the warped and the original features."""

    def __init__(self):
        super().__init__()
        self.loc = nn.Linear(3 * 8 * 8, 6)
        nn.init.normal_(self.loc.weight, std=0.01)
        with torch.no_grad():
            self.loc.bias.copy_(torch.tensor([0.9, 0.1, 0.05, -0.1, 1.1, -0.05]))
        self.dist = nn.PairwiseDistance(p=1.5, keepdim=True)

    def forward(self, x, g):
        theta = self.loc(x.flatten(1)).view(-1, 2, 3)
        grid = F.affine_grid(theta, [2, 3, 6, 7], align_corners=False)
        warped = F.grid_sample(x, grid, mode="bilinear", padding_mode="reflection", align_corners=False)
        near = F.grid_sample(x, g, mode="nearest", padding_mode="zeros", align_corners=True)
        cubic = F.grid_sample(x, g, mode="bicubic", padding_mode="border", align_corners=False)
        d = self.dist(warped.flatten(1), x[:, :, :6, :7].flatten(1))
        return warped, near, cubic, d


def test_e2e_spatial_transformer(check_model):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8)
    g = torch.rand(2, 5, 4, 2) * 2.4 - 1.2
    check_model("sampling_stn", SpatialTransformer(), (x, g))


class Warp3d(nn.Module):
    def forward(self, x, theta):
        grid = F.affine_grid(theta, [1, 2, 3, 4, 5], align_corners=True)
        return F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=True)


def test_e2e_warp_3d(check_model):
    torch.manual_seed(1)
    theta = torch.eye(3, 4)[None] + 0.1 * torch.randn(1, 3, 4)
    check_model("sampling_warp3d", Warp3d(), (torch.randn(1, 2, 4, 5, 6), theta))
