"""Sampling and distances: F.grid_sample -> grid_sample, F.affine_grid -> affine_grid,
F.pairwise_distance / nn.PairwiseDistance -> elementwise difference + reduce_norm
(torch's definition: the p-norm of x1 - x2 + eps over the last dim).
"""

from pmx.compiler.canon import data_input, elementwise, fail, in_shape, ints, make, param, rule, weight
from pmx.runtime import expr as E

GRID_MODES = ("bilinear", "nearest", "bicubic")
# pnnx's ONNX import writes GridSample's own mode names: ONNX's "linear" is torch's
# "bilinear" (trilinear on a 5-d input, as torch's "bilinear" is), "cubic" its "bicubic"
ONNX_GRID_MODES = {"linear": "bilinear", "cubic": "bicubic"}
PADDING_MODES = ("zeros", "border", "reflection")


@rule("F.grid_sample")
def grid_sample(node, ctx):
    x = data_input(node)
    grid = node.named_input("grid")
    if grid is None:
        grid = data_input(node, "grid", 1)
    xs, gs = in_shape(node, x), in_shape(node, grid)
    nd = len(xs) - 2
    mode = param(node, "mode", "bilinear")
    mode = ONNX_GRID_MODES.get(mode, mode)
    padding_mode = param(node, "padding_mode", "zeros")
    align = param(node, "align_corners", False)
    if mode not in GRID_MODES:
        fail(node, f"mode={mode!r}: expected one of {', '.join(GRID_MODES)}")
    if padding_mode not in PADDING_MODES:
        fail(node, f"padding_mode={padding_mode!r}: expected one of {', '.join(PADDING_MODES)}")
    if nd not in (2, 3) or len(gs) != nd + 2 or gs[-1] != nd or gs[0] != xs[0]:
        fail(
            node,
            f"input {xs} and grid {gs}: expected (N, C, H, W) with (N, H', W', 2) "
            f"or (N, C, D, H, W) with (N, D', H', W', 3)",
        )
    if mode == "bicubic" and nd != 2:
        fail(node, "mode='bicubic' needs a 4-d input")
    attrs = dict(mode=mode, padding_mode=padding_mode, align_corners=bool(align))
    return [make(node, "grid_sample", [x, grid], attrs)]


@rule("F.affine_grid")
def affine_grid(node, ctx):
    theta = node.named_input("theta")
    if theta is None:
        theta = data_input(node, "theta")
    ts = in_shape(node, theta)
    size = param(node, "size")
    if (
        not isinstance(size, tuple)
        or len(size) not in (4, 5)
        or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in size)
    ):
        fail(node, f"size={size!r}: expected 4 or 5 positive ints (N, C, *spatial)")
    nd = len(size) - 2
    if tuple(ts) != (size[0], nd, nd + 1):
        fail(node, f"theta {ts} must be ({size[0]}, {nd}, {nd + 1}) for size {size}")
    attrs = dict(size=size, align_corners=bool(param(node, "align_corners", False)))
    return [make(node, "affine_grid", [theta], attrs)]


def _number(node, key, default):
    v = param(node, key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        fail(node, f"{key}={v!r} must be a number")
    return float(v)


@rule("F.pairwise_distance", "nn.PairwiseDistance", "torch.pairwise_distance")
def pairwise_distance(node, ctx):
    x1 = node.named_input("x1")
    x2 = node.named_input("x2")
    if x1 is None or x2 is None:
        x1, x2 = data_input(node, "x1", 0), data_input(node, "x2", 1)
    s1, s2 = in_shape(node, x1), in_shape(node, x2)
    p = _number(node, "p", 2.0)
    eps = _number(node, "eps", 1e-6)
    keepdim = bool(param(node, "keepdim", False))
    rank = max(len(s1), len(s2))
    try:
        shape = _broadcast(s1, s2)
    except ValueError:
        fail(node, f"x1 {s1} and x2 {s2} do not broadcast")
    if rank == 0:
        fail(node, "pairwise_distance needs inputs of rank 1 or more")
    diff = ctx.temp(node, shape, x1.dtype, "diff")
    return [
        elementwise(
            node,
            E.call("add", E.call("sub", E.at(0), E.at(1)), eps),
            [x1, x2],
            outputs=[diff],
            name=node.name + ".diff",
        ),
        make(node, "reduce_norm", [diff], dict(axes=(rank - 1,), keepdim=keepdim, p=p)),
    ]


def _broadcast(a, b):
    n = max(len(a), len(b))
    a, b = (1,) * (n - len(a)) + tuple(a), (1,) * (n - len(b)) + tuple(b)
    out = []
    for x, y in zip(a, b):
        if x != y and 1 not in (x, y):
            raise ValueError
        out.append(max(x, y) if min(x, y) != 0 else 0)
    return tuple(out)


@rule("torchvision.ops.RoIAlign")
def roi_align(node, ctx):
    x, rois = data_input(node, "input", 0), data_input(node, "rois", 1)
    xs, rs = in_shape(node, x), in_shape(node, rois)
    if len(xs) != 4 or len(rs) != 2 or rs[1] != 5:
        fail(node, f"input {xs} and rois {rs}: expected (N, C, H, W) and (K, 5) rows (batch, x1, y1, x2, y2)")
    size = ints(node, "output_size", 2)
    ratio = param(node, "sampling_ratio", -1)
    if not isinstance(ratio, int) or isinstance(ratio, bool):
        fail(node, f"sampling_ratio={ratio!r} must be an int")
    attrs = dict(
        output_size=size,
        spatial_scale=_number(node, "spatial_scale", 1.0),
        sampling_ratio=ratio,
        aligned=bool(param(node, "aligned", False)),
    )
    return [make(node, "roi_align", [x, rois], attrs)]


@rule("torchvision.ops.DeformConv2d")
def deform_conv2d(node, ctx):
    x, offset = data_input(node, "input", 0), data_input(node, "offset", 1)
    unnamed = [v for v, n in zip(node.inputs, node.input_names) if n is None or not n.startswith("@")]
    mask = node.named_input("mask")
    if mask is None and len(unnamed) > 2:
        mask = unnamed[2]
    w = weight(node, "weight")
    b = weight(node, "bias", required=False)
    xs, os_, ws = in_shape(node, x), in_shape(node, offset), in_shape(node, w)
    groups = param(node, "groups", 1)
    if len(xs) != 4 or len(ws) != 4 or len(os_) != 4:
        fail(node, f"input {xs}, offset {os_}, weight {ws}: expected 4-d tensors")
    if not isinstance(groups, int) or groups < 1 or xs[1] != ws[1] * groups or ws[0] % groups:
        fail(node, f"weight {ws} with groups={groups!r} does not fit input channels {xs[1]}")
    k = ws[2] * ws[3]
    if os_[1] % (2 * k) or xs[1] % (os_[1] // (2 * k) or 1) or os_[1] == 0:
        fail(node, f"offset {os_}: expected 2 * offset_groups * {k} channels, offset_groups dividing {xs[1]}")
    if mask is not None and in_shape(node, mask)[1] != os_[1] // 2:
        fail(node, f"mask {mask.shape}: expected {os_[1] // 2} channels")
    attrs = dict(
        stride=ints(node, "stride", 2, 1),
        pads=ints(node, "padding", 2, 0),
        dilation=ints(node, "dilation", 2, 1),
        groups=groups,
        has_mask=mask is not None,
        has_bias=b is not None,
    )
    inputs = [x, offset, w] + ([mask] if mask is not None else []) + ([b] if b is not None else [])
    return [make(node, "deform_conv", inputs, attrs)]
