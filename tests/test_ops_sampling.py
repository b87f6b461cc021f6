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
from paramgraph import compile_lines, generator, run_one_op, sizes

from pmx.runtime.errors import PmxCompileError

TOL = 1e-5


def check(got, want, tol=TOL):
    want = want.detach().numpy()
    assert got.shape == want.shape, f"shape {got.shape} != torch {want.shape}"
    err = rel_error(got, want)
    assert err <= tol, f"max-normalized error {err:.3g} > {tol}"


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
                (got,) = run_one_op(
                    "F.grid_sample", params, [x.numpy(), grid.numpy()], [want.numpy()], ["input", "grid"]
                )
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
        run_one_op(
            "F.grid_sample",
            "align_corners=False mode=bicubic padding_mode=zeros",
            [x, grid],
            [np.zeros((1, 1, 2, 2, 2), np.float32)],
            ["input", "grid"],
        )


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


@pytest.mark.slow  # exports through pnnx
def test_e2e_spatial_transformer(check_model):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8)
    g = torch.rand(2, 5, 4, 2) * 2.4 - 1.2
    check_model("sampling_stn", SpatialTransformer(), (x, g))


class Warp3d(nn.Module):
    def forward(self, x, theta):
        grid = F.affine_grid(theta, [1, 2, 3, 4, 5], align_corners=True)
        return F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=True)


@pytest.mark.slow  # exports through pnnx
def test_e2e_warp_3d(check_model):
    torch.manual_seed(1)
    theta = torch.eye(3, 4)[None] + 0.1 * torch.randn(1, 3, 4)
    check_model("sampling_warp3d", Warp3d(), (torch.randn(1, 2, 4, 5, 6), theta))


# --- torchvision ops, written as pnnx writes them (torchvision itself is not a test dependency) ---


def bilinear_at(plane, y, x, padding_mode):
    """Reference bilinear samples of plane (C, H, W) at pixel coordinates y, x (any one shape)
    through F.grid_sample with align_corners=True: -> (C, *shape)."""
    c, h, w = plane.shape
    shape = y.shape
    gx = x.reshape(1, 1, -1) * 2 / (w - 1) - 1
    gy = y.reshape(1, 1, -1) * 2 / (h - 1) - 1
    grid = torch.stack([gx, gy], -1).to(torch.float64)
    out = F.grid_sample(
        plane[None].to(torch.float64), grid, mode="bilinear", padding_mode=padding_mode, align_corners=True
    )
    return out.reshape(c, *shape)


def roi_align_reference(x, rois, output_size, scale, ratio, aligned):
    """torchvision.ops.roi_align's definition: each bin averages a grid of bilinear samples;
    samples within one pixel outside read the edge (border), farther ones read 0."""
    ph, pw = output_size
    _, c, h, w = x.shape
    outs = []
    for roi in rois.to(torch.float64):
        shift = 0.5 if aligned else 0.0
        x1, y1, x2, y2 = (roi[1:] * scale - shift).tolist()
        rw, rh = x2 - x1, y2 - y1
        if not aligned:
            rw, rh = max(rw, 1.0), max(rh, 1.0)
        gh = ratio if ratio > 0 else int(np.ceil(rh / ph))
        gw = ratio if ratio > 0 else int(np.ceil(rw / pw))
        if gh * gw == 0:
            outs.append(torch.zeros(c, ph, pw, dtype=torch.float64))
            continue
        ys = y1 + (torch.arange(ph * gh, dtype=torch.float64) + 0.5) * (rh / ph / gh)
        xs = x1 + (torch.arange(pw * gw, dtype=torch.float64) + 0.5) * (rw / pw / gw)
        yy, xx = torch.meshgrid(ys, xs, indexing="ij")
        vals = bilinear_at(x[int(roi[0])], yy, xx, "border")
        inside = (yy >= -1) & (yy <= h) & (xx >= -1) & (xx <= w)
        vals = vals * inside
        outs.append(vals.reshape(c, ph, gh, pw, gw).sum((2, 4)) / (gh * gw))
    return torch.stack(outs).to(torch.float32)


@given(st.data())
def test_roi_align(data):
    g = generator(data)
    n, c = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 3))
    h, w = sizes(data, 2, 9, 2)
    x = torch.randn(n, c, h, w, generator=g)
    scale = data.draw(st.sampled_from([1.0, 0.5, 0.25]))
    k = data.draw(st.integers(1, 4))
    corners = (torch.rand(k, 2, 2, generator=g) * torch.tensor([w, h]) * 1.4 - 1.0) / scale
    lo, hi = corners.min(1).values, corners.max(1).values
    batch = torch.randint(0, n, (k, 1), generator=g).float()
    rois = torch.cat([batch, lo, hi], 1)
    output_size = tuple(sizes(data, 1, 3, 2))
    ratio = data.draw(st.sampled_from([-1, 0, 1, 2, 3]))
    aligned = data.draw(st.booleans())
    want = roi_align_reference(x, rois, output_size, scale, ratio, aligned)
    params = (
        f"aligned={aligned} output_size=({output_size[0]},{output_size[1]}) sampling_ratio={ratio} "
        f"spatial_scale={scale:e}"
    )
    (got,) = run_one_op("torchvision.ops.RoIAlign", params, [x.numpy(), rois.numpy()], [want.numpy()])
    check(got, want)


def deform_conv_reference(x, offset, weight, bias, stride, padding, dilation, groups, mask):
    """torchvision.ops.deform_conv2d's definition: tap (i, j) of output pixel (oy, ox) samples
    input channel group g at (oy * s - p + i * d + dy, ox * s - p + j * d + dx), bilinear with
    zeros outside, times the mask; then a grouped convolution of those samples."""
    n, c, _h, _w = x.shape
    o, cg, kh, kw = weight.shape
    ho, wo = offset.shape[2:]
    k = kh * kw
    og = offset.shape[1] // (2 * k)
    off = offset.reshape(n, og, k, 2, ho, wo).to(torch.float64)
    oy = torch.arange(ho, dtype=torch.float64)[:, None] * stride[0] - padding[0]
    ox = torch.arange(wo, dtype=torch.float64)[None, :] * stride[1] - padding[1]
    cols = torch.zeros(n, c, k, ho, wo, dtype=torch.float64)
    cpg = c // og
    for b in range(n):
        for gi in range(og):
            for t in range(k):
                i, j = divmod(t, kw)
                yy = oy + i * dilation[0] + off[b, gi, t, 0]
                xx = ox + j * dilation[1] + off[b, gi, t, 1]
                v = bilinear_at(x[b, gi * cpg : (gi + 1) * cpg], yy, xx, "zeros")
                if mask is not None:
                    v = v * mask.reshape(n, og, k, ho, wo)[b, gi, t].to(torch.float64)
                cols[b, gi * cpg : (gi + 1) * cpg, t] = v
    cols = cols.reshape(n, groups, cg * k, ho * wo)
    wm = weight.reshape(groups, o // groups, cg * k).to(torch.float64)
    out = torch.einsum("gok,ngkp->ngop", wm, cols).reshape(n, o, ho, wo)
    if bias is not None:
        out = out + bias.reshape(1, o, 1, 1)
    return out.to(torch.float32)


@given(st.data())
def test_deform_conv2d(data):
    g = generator(data)
    groups = data.draw(st.sampled_from([1, 2]))
    og = data.draw(st.sampled_from([1, 2]))
    c = 2 * data.draw(st.integers(1, 2))
    o = groups * data.draw(st.integers(1, 3))
    kh, kw = sizes(data, 1, 3, 2)
    stride, padding, dilation = tuple(sizes(data, 1, 2, 2)), tuple(sizes(data, 0, 1, 2)), tuple(sizes(data, 1, 2, 2))
    n = data.draw(st.integers(1, 2))
    h, w = sizes(data, 4, 8, 2)
    ho = (h + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    wo = (w + 2 * padding[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    x = torch.randn(n, c, h, w, generator=g)
    offset = torch.randn(n, 2 * og * kh * kw, ho, wo, generator=g) * 2
    weight = torch.randn(o, c // groups, kh, kw, generator=g)
    bias = torch.randn(o, generator=g) if data.draw(st.booleans()) else None
    mask = torch.rand(n, og * kh * kw, ho, wo, generator=g) if data.draw(st.booleans()) else None
    want = deform_conv_reference(x, offset, weight, bias, stride, padding, dilation, groups, mask)
    params = (
        f"bias={bias is not None} dilation=({dilation[0]},{dilation[1]}) groups={groups} in_channels={c} "
        f"kernel_size=({kh},{kw}) out_channels={o} padding=({padding[0]},{padding[1]}) "
        f"stride=({stride[0]},{stride[1]})"
    )
    weights = {"weight": weight.numpy()}
    if bias is not None:
        weights["bias"] = bias.numpy()
    inputs = [x.numpy(), offset.numpy()] + ([mask.numpy()] if mask is not None else [])
    (got,) = run_one_op("torchvision.ops.DeformConv2d", params, inputs, [want.numpy()], weights=weights)
    check(got, want)


def compile_and_run(tmp_path, lines, weights, feeds):
    return compile_lines(tmp_path, lines, weights).run(None, feeds)


def shape_text(t):
    return "(" + ",".join(map(str, t.shape)) + ")f32"


def test_e2e_deform_conv_block(tmp_path):
    """The upstream DeformConv2d model's graph (offsets and a sigmoid mask from plain
    convolutions, two DeformConv2d layers) as pnnx writes it, against the reference."""
    torch.manual_seed(3)
    x = torch.rand(1, 4, 10, 10)
    convs = {"conv_0": nn.Conv2d(4, 2 * 9, 3), "conv_2": nn.Conv2d(4, 9, 3)}
    deform = {name: (torch.randn(6, 4, 3, 3) * 0.2, torch.randn(6)) for name in ("conv_1", "conv_3")}
    with torch.no_grad():
        offset = convs["conv_0"](x) * 3
        mask = torch.sigmoid(convs["conv_2"](x))
    want1 = deform_conv_reference(x, offset, *deform["conv_1"], (1, 1), (0, 0), (1, 1), 1, None)
    want2 = deform_conv_reference(x, offset, *deform["conv_3"], (1, 1), (0, 0), (1, 1), 1, mask)
    conv_params = (
        "bias=True dilation=(1,1) groups=1 in_channels=4 kernel_size=(3,3) padding=(0,0) "
        "padding_mode=zeros stride=(1,1)"
    )
    deform_params = (
        "bias=True dilation=(1,1) groups=1 in_channels=4 kernel_size=(3,3) out_channels=6 "
        "padding=(0,0) stride=(1,1) @weight=(6,4,3,3)f32 @bias=(6)f32"
    )
    lines = [
        f"pnnx.Input in0 0 1 x #x={shape_text(x)}",
        f"nn.Conv2d conv_0 1 1 x off0 {conv_params} out_channels=18 @weight=(18,4,3,3)f32 @bias=(18)f32 "
        f"#x={shape_text(x)} #off0={shape_text(offset)}",
        f"pnnx.Expression scale 1 1 off0 off expr=mul(@0,3) #off0={shape_text(offset)} #off={shape_text(offset)}",
        f"torchvision.ops.DeformConv2d conv_1 2 1 x off y1 {deform_params} #y1={shape_text(want1)}",
        f"nn.Conv2d conv_2 1 1 x m0 {conv_params} out_channels=9 @weight=(9,4,3,3)f32 @bias=(9)f32 "
        f"#m0={shape_text(mask)}",
        f"F.sigmoid sigmoid 1 1 m0 m #m={shape_text(mask)}",
        f"torchvision.ops.DeformConv2d conv_3 3 1 x off m y2 {deform_params} #y2={shape_text(want2)}",
        "pnnx.Output out 2 0 y1 y2",
    ]
    weights = {}
    for name, conv in convs.items():
        weights[f"{name}.weight"], weights[f"{name}.bias"] = conv.weight.detach().numpy(), conv.bias.detach().numpy()
    for name, (w, b) in deform.items():
        weights[f"{name}.weight"], weights[f"{name}.bias"] = w.numpy(), b.numpy()
    got1, got2 = compile_and_run(tmp_path, lines, weights, {"in0": x.numpy()})
    check(got1, want1, 1e-4)
    check(got2, want2, 1e-4)


def test_e2e_roi_align_with_constant_rois(tmp_path):
    """The upstream RoIAlign model: rois a parameter (a pnnx.Attribute), aligned=False."""
    torch.manual_seed(4)
    x = torch.rand(1, 3, 12, 16)
    rois = torch.tensor([[0, 0, 10, 12, 20], [0, 3.5, 2.25, 40, 30]], dtype=torch.float32)
    want = roi_align_reference(x, rois, (3, 3), 0.25, 3, False)
    want_adaptive = roi_align_reference(x, rois, (2, 4), 0.5, -1, True)
    lines = [
        f"pnnx.Input in0 0 1 x #x={shape_text(x)}",
        "pnnx.Attribute rois 0 1 r @data=(2,5)f32 #r=(2,5)f32",
        f"torchvision.ops.RoIAlign roi_align 2 1 x r y aligned=False output_size=(3,3) sampling_ratio=3 "
        f"spatial_scale=2.500000e-01 #y={shape_text(want)}",
        f"torchvision.ops.RoIAlign roi_align2 2 1 x r z aligned=True output_size=(2,4) sampling_ratio=-1 "
        f"spatial_scale=5.000000e-01 #z={shape_text(want_adaptive)}",
        "pnnx.Output out 2 0 y z",
    ]
    got, got_adaptive = compile_and_run(tmp_path, lines, {"rois.data": rois.numpy()}, {"in0": x.numpy()})
    check(got, want)
    check(got_adaptive, want_adaptive)


def test_roi_align_refuses_a_batch_index_beyond_the_input():
    from pmx.runtime.errors import PmxInputError

    x = np.zeros((1, 1, 4, 4), np.float32)
    rois = np.array([[3, 0, 0, 2, 2]], np.float32)
    with pytest.raises(PmxInputError, match="batch 3"):
        run_one_op(
            "torchvision.ops.RoIAlign",
            "aligned=False output_size=(2,2) sampling_ratio=2 spatial_scale=1.0",
            [x, rois],
            [np.zeros((1, 1, 2, 2), np.float32)],
        )
